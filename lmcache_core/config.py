"""Typed configuration: YAML file, then ``LMCACHE_CORE_<KEY>`` environment overrides,
then programmatic overrides. With no file at all the embedded default applies (the CPU
tier only).

Every error names the key path and where the value came from (file, env var,
override), because a config that silently falls back to a default serves the wrong
cache or none at all.
"""

from __future__ import annotations

import logging
import math
import os
import re
import stat
import warnings
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Annotated, Any, Callable, ClassVar, Literal, Mapping, TypeVar

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    create_model,
    model_validator,
)

log = logging.getLogger(__name__)

ENV_PREFIX = "LMCACHE_CORE_"
ENV_CONFIG_PATH = "LMCACHE_CORE_CONFIG"
ENV_BLOCK_PLUGINS = "LMCACHE_CORE_BLOCK_PLUGINS"
_RESERVED_ENV = {ENV_CONFIG_PATH, ENV_BLOCK_PLUGINS}
_RAW_ENV_KEYS = {"frame_secret"}  # taken verbatim from the environment, never parsed as YAML
MIN_FRAME_SECRET_BYTES = 16
MAX_SECRET_FILE_BYTES = 4096
#: ``frame_secret: none``: this deployment runs its shared tiers unsealed on purpose
#: (written in the config, so the start-up warning about them goes). Four bytes:
#: shorter than :data:`MIN_FRAME_SECRET_BYTES`, so it can never be a real secret.
NO_FRAME_SECRET = "none"

DEFAULT_YAML = """\
# Embedded default: used when no config file is given.
chunk_size: 256
serde: raw
backends:
  - name: local_cpu
    max_size: 1GiB
"""


class ConfigError(ValueError):
    """A configuration value is wrong. The message names the key path and its source."""

    def one_line(self) -> str:
        """The whole message on one line (a command's ``error: ...``): its first line,
        then each further line (one per wrong key) after it, joined by ``; ``."""
        lines = [line.strip() for line in str(self).splitlines() if line.strip()]
        if not lines:
            return type(self).__name__
        head, rest = lines[0], "; ".join(lines[1:])
        return f"{head} {rest}" if head.endswith(":") and rest else "; ".join(lines)


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]{1,30}(?:\.[0-9]{1,30})?)\s*([a-zA-Z]*)\s*$")
MAX_SIZE_BYTES = 2**60  # 1 EiB: above any real budget, far below what breaks arithmetic
MAX_CONFIG_BYTES = 1 << 20  # a config file is a few KiB; more is not a config file
MAX_YAML_NODES = 100_000  # values after expanding YAML aliases


def parse_size(value: Any) -> int:
    """Parse ``1024``, ``"512MiB"``, ``"2GiB"``, ``"1.5GB"`` into bytes.

    Exact arithmetic (no float rounding): a size must come to a whole number of
    bytes (``"0.5"`` and ``"1.3B"`` are errors, ``"0.5KiB"`` is 512) and at most
    :data:`MAX_SIZE_BYTES`, so a typo never becomes 0 bytes or an overflow."""
    if isinstance(value, bool):
        raise ValueError(f"expected a size like 512MiB or 2GiB, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must not be negative, got {value}")
        if value > MAX_SIZE_BYTES:
            raise ValueError(f"size is larger than {MAX_SIZE_BYTES} bytes (1 EiB), got a {len(str(value))}-digit number")
        return value
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m and m.group(2).lower() in _UNITS:
            exact = Fraction(m.group(1)) * _UNITS[m.group(2).lower()]
            if exact.denominator != 1:
                raise ValueError(f"size {value!r} is not a whole number of bytes; write it in bytes or a smaller unit")
            if exact > MAX_SIZE_BYTES:
                raise ValueError(f"size {value!r} is larger than {MAX_SIZE_BYTES} bytes (1 EiB)")
            return int(exact)
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:60] + "..."
    raise ValueError(f"expected a size like 512MiB or 2GiB (units: B, KiB, MiB, GiB, TiB, KB, MB, GB), got {shown}")


ByteSize = Annotated[int, BeforeValidator(parse_size)]


def _shown(value: Any) -> str:
    shown = repr(value)
    return shown if len(shown) <= 60 else shown[:60] + "..."


def _flag(value: Any) -> bool:
    if value is True or value is False:
        return value
    raise ValueError(f"must be true or false, got {_shown(value)}")


#: a boolean key: exactly ``true`` or ``false`` (YAML, JSON or Python booleans), from
#: every source alike; ``yes``, ``on``, ``1`` or the string ``"true"`` are errors
Flag = Annotated[bool, BeforeValidator(_flag)]

#: the shortest duration any key takes: 1 ms (a shorter timeout cannot be met, and a
#: float such as 1e-300 is not a timeout but a typo)
MIN_SECONDS = 0.001
MINUTE, HOUR, DAY = 60.0, 3600.0, 86400.0


def _span(seconds: float) -> str:
    for unit, name in ((DAY, "day"), (HOUR, "hour"), (MINUTE, "minute")):
        if seconds >= unit and seconds % unit == 0:
            n = int(seconds // unit)
            return f"{n} {name}{'s' if n != 1 else ''}"
    return f"{seconds:g} s"


def check_seconds(value: Any, *, max_s: float, min_s: float = MIN_SECONDS, off: bool = False) -> float:
    """The one rule for every duration key (``*_s``), core, connector or backend,
    whatever the source: a number (not a boolean, not a string) of seconds from
    ``min_s`` to ``max_s``, or exactly 0 where ``off`` (the key's "never"/"none").
    Raises ValueError saying the bounds; NaN and infinities are out of them."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"expected a number of seconds, got {_shown(value)}")
    try:
        seconds = float(value)
    except OverflowError:
        seconds = math.inf
    if off and seconds == 0:
        return 0.0
    if not min_s <= seconds <= max_s:  # NaN fails too
        zero = "0 (off) or " if off else ""
        raise ValueError(
            f"must be {zero}a number of seconds from {min_s:.10g} to {max_s:.10g} ({_span(max_s)}), got {_shown(value)}"
        )
    return seconds


def seconds(max_s: float, *, min_s: float = MIN_SECONDS, off: bool = False) -> Any:
    """The validator of a duration key, for ``Annotated[float, seconds(...)]``
    (:func:`check_seconds`'s rule with these bounds)."""

    def check(value: Any) -> float:
        return check_seconds(value, max_s=max_s, min_s=min_s, off=off)

    check.duration_bounds = (min_s, max_s, off)  # type: ignore[attr-defined]  # read by tests and docs checks
    return BeforeValidator(check)


def deprecated(msg: str, say: Callable[[str], None] | None = None) -> None:
    """Say that a deprecated spelling was used: a ``DeprecationWarning``, and a log
    warning (or ``say(msg)``, a command line's own way to tell its user)."""
    warnings.warn(msg, DeprecationWarning, stacklevel=3)
    if say is None:
        log.warning("%s", msg)
    else:
        say(msg)


def ms_to_seconds(
    value: Any,
    old: str,
    new: str,
    src: str = "",
    *,
    path: str | None = None,
    both: bool = False,
    sep: str = ": ",
    say: Callable[[str], None] | None = None,
) -> float:
    """The one rule for an old millisecond spelling (``old``, a config key path or a
    command-line flag) of a setting that now takes seconds (``new``): both spellings
    at once, or an old value that is not a number, is a :class:`ConfigError` naming
    ``path`` (the old key's full path, default ``old``) and ``src`` (`` (from ...)``); else the value divided by 1000, with a
    deprecation warning (:func:`deprecated`, ``say``) that names both spellings and
    the converted value (``new``, ``sep``, seconds). Used by :func:`renamed_keys` and
    the peer node's ``--*-ms`` flags."""
    path = old if path is None else path
    if both:
        raise ConfigError(f"{path}: both {old} (deprecated, milliseconds) and {new} (seconds) are set; give only {new}{src}")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(
            f"{path}: expected a number of milliseconds, got {_shown(value)}{src}; it is deprecated: give {new} in seconds"
        )
    try:
        seconds = value / 1000
    except OverflowError:
        raise ConfigError(f"{path}: a {len(str(value))}-digit number of milliseconds is too large{src}") from None
    deprecated(f"{path}{src} is deprecated: use {new}{sep}{seconds!r} (seconds)", say)
    return seconds


def renamed_keys(
    data: Any,
    renames: Mapping[str, str],
    where: str = "",
    source_of: Callable[[str], str] | None = None,
) -> Any:
    """Accept, for one release, the old millisecond spelling of keys that now take seconds.

    ``renames`` maps each old key (``timeout_ms``, a number of milliseconds) to its new
    key (``timeout_s``, seconds). For each old key in ``data`` the value divided by 1000
    goes under the new key, with a ``DeprecationWarning`` and a log warning that name
    both keys and the converted value. Giving both spellings, or an old value that is
    not a number, is a :class:`ConfigError` naming the key path (``where`` is the
    section's path, ``backends[1]``; ``source_of(path)`` says where the value came
    from). ``data`` that is not a mapping is returned unchanged for the model to reject.

    Config models use it through :attr:`StrictModel.renamed_ms_keys`; with
    :func:`moved_keys` it is the one place old spellings are converted (the rule
    itself: :func:`ms_to_seconds`)."""
    found = _old_keys(data, renames, where, source_of)
    if found is None:
        return data
    out, olds = found
    for old, path, src in olds:
        out[renames[old]] = ms_to_seconds(out.pop(old), old, renames[old], src, path=path, both=renames[old] in out)
    return out


def _old_keys(
    data: Any, old_keys: Mapping[str, str], where: str, source_of: Callable[[str], str] | None
) -> tuple[dict[str, Any], list[tuple[str, str, str]]] | None:
    """``None`` when ``data`` is not a mapping or holds none of ``old_keys``; else a copy
    of it to rewrite and, for each old key in it, the key, its path under ``where`` and
    `` (from <source>)``."""
    if not isinstance(data, Mapping) or not any(old in data for old in old_keys):
        return None
    found = []
    for old in old_keys:
        if old in data:
            path = f"{where}.{old}" if where else old
            found.append((old, path, f" (from {source_of(path)})" if source_of is not None else ""))
    return dict(data), found


def moved_keys(data: Any, moves: Mapping[str, str], where: str = "", source_of: Callable[[str], str] | None = None) -> Any:
    """Accept, for one release, keys that moved into a section.

    ``moves`` maps each old key (``save_unfull_chunk``) to its new path in a section of
    ``data`` (``connector.save_unfull_chunk``). For each old key in ``data`` its value
    goes under the new path, unchanged, with a ``DeprecationWarning`` and a log warning
    that name both (:func:`deprecated`). Giving both spellings is a
    :class:`ConfigError` naming both and the source (``source_of(path)``), as is an
    old key next to a section that is not a mapping. ``data`` that is not a mapping
    is returned unchanged for the model to reject.

    Every path uses it: :func:`load_config` on each source (file, env vars,
    overrides) before the sources merge, and :attr:`StrictModel.moved_keys` on a model
    built directly. It runs before :func:`renamed_keys` (an old ``lookup_timeout_ms``
    moves, then converts to seconds)."""
    found = _old_keys(data, moves, where, source_of)
    if found is None:
        return data
    out, olds = found
    for old, path, src in olds:
        new = moves[old]
        section, key = new.split(".", 1)
        new_path = f"{where}.{new}" if where else new
        current = out.get(section)
        if current is None:
            current = {}
        if not isinstance(current, Mapping):
            raise ConfigError(f"{path}: moved to {new_path}, but {section} is {_shown(current)}, not a mapping of keys{src}")
        if key in current:
            raise ConfigError(f"{path}: both {path} (deprecated) and {new_path} are set; give only {new_path}{src}")
        out[section] = {**current, key: out.pop(old)}
        deprecated(f"{path}{src} is deprecated: use {new_path}")
    return out


class StrictModel(BaseModel):
    """Base for every config section: unknown keys are errors, not ignored."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    #: old key (milliseconds) -> its new name (seconds), still accepted for one release
    #: with a deprecation warning (see :func:`renamed_keys`). A section declares its own.
    renamed_ms_keys: ClassVar[Mapping[str, str]] = {}
    #: old key -> its new path in a section of this model (``connector.layout``), still
    #: accepted for one release with a deprecation warning (see :func:`moved_keys`).
    moved_keys: ClassVar[Mapping[str, str]] = {}
    #: a section's keys that were top-level keys before the section existed, still
    #: accepted there for one release (see :func:`config_model`)
    moved_from_top: ClassVar[tuple[str, ...]] = ()

    @model_validator(mode="before")
    @classmethod
    def _renamed_keys(cls, data: Any, info: ValidationInfo) -> Any:
        sections = {name: model for name, model in _sections(cls).items() if model.renamed_ms_keys}
        if not cls.renamed_ms_keys and not cls.moved_keys and not sections:
            return data
        ctx = info.context if isinstance(info.context, dict) else {}
        where, source_of = ctx.get("key_path", ""), ctx.get("source_of")
        data = moved_keys(data, cls.moved_keys, where, source_of)
        data = renamed_keys(data, cls.renamed_ms_keys, where, source_of)
        for name, model in sections.items():  # here, where the section's key path is known
            if isinstance(data, Mapping) and name in data:
                inner = renamed_keys(data[name], model.renamed_ms_keys, f"{where}.{name}" if where else name, source_of)
                data = {**data, name: inner}
        return data


def _sections(model: type[BaseModel]) -> dict[str, type["StrictModel"]]:
    """The fields of ``model`` that are config sections themselves (``connector``)."""
    return {
        name: f.annotation
        for name, f in model.model_fields.items()
        if isinstance(f.annotation, type) and issubclass(f.annotation, StrictModel)
    }


class BackendSection(BaseModel):
    """One entry of ``backends:``. Only ``name`` is checked here; the backend's own
    factory validates the rest (see :func:`validate_section`)."""

    model_config = ConfigDict(extra="allow", frozen=True)
    name: str
    #: this tier's codec (``raw``, ``lz4``, ``fp8``, a plugin codec); unset: the
    #: top-level ``serde``. Not passed to the tier's factory (see :meth:`options`).
    serde: str | None = None

    def options(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


def true_false_or(word: str) -> Callable[[Any], Any]:
    """A validator taking exactly ``true``, ``false`` or ``word`` (no ``1``, ``yes``...),
    for ``Annotated[bool | Literal[word], BeforeValidator(true_false_or(word))]``."""

    def check(value: Any) -> Any:
        if value is not True and value is not False and value != word:
            raise ValueError(f"must be true, false or {word}, got {_shown(value)}")
        return value

    return check


#: sections a first-party plugin adds, and what to install for them: a config naming
#: one whose plugin is not installed gets the command to run (see :func:`load_config`)
KNOWN_SECTIONS = {"connector": "lmcache-core[vllm]"}


class CoreConfig(StrictModel):
    chunk_size: int = Field(256, gt=0, description="tokens per chunk; a multiple of the engine's block size")
    serde: str = Field(
        "raw",
        description="codec for serialized tiers: raw, lz4, fp8 (lossy, opt-in) or a plugin codec; "
        "a tier's own serde: key overrides it",
    )
    backends: list[BackendSection] = Field(
        default_factory=lambda: [BackendSection(name="local_cpu", max_size="1GiB")],
        min_length=1,
        description="ordered tiers, fastest first",
    )
    tenant_salt: str | None = Field(None, description="mixed into every key: tenants never share KV")
    tenant: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9._-]{1,64}$",
        description="a label for the tenant this engine serves, recorded with its key namespace in the tiers it "
        "writes (never part of a key), so `lmcache-core erase --tenant LABEL` finds its chunks",
    )
    write_queue_size: int = Field(256, gt=0, description="chunks queued per slower tier before new writes to it are dropped")
    staging_size: ByteSize = Field(
        256 * 2**20,
        description="pool memory beyond the CPU tier for chunks in flight (saves, write-behind to slower tiers, loads)",
    )
    preload: ByteSize = Field(
        0,
        description="at start, read up to this many bytes of this engine's chunks from the slower tiers that can list "
        "them (disk), newest first, into the CPU tier, in the background: the first request about a warmed document "
        "then loads from memory. Never evicts (stops when the CPU tier is full); 0: off",
    )
    populate_pool: Flag = Field(
        False,
        description="fault in the memory pool's pages on a background thread at start (Linux), so the first saves "
        "copy at memory speed instead of taking page faults; off by default: while it runs, the engine's own "
        "memory mappings (shared-memory loads from a node) wait on it",
    )
    background_nice: int = Field(
        0,
        ge=0,
        le=19,
        description="nice value added to lmcache-core's background threads (loads and prefetches off the forward "
        "path, read-ahead, write-behind, asynchronous saves; Linux, per thread): the model's threads get the cores "
        "first, a background transfer the rest",
    )
    background_cores: Literal["auto", "none"] | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)] = Field(
        "none",
        description="cores lmcache-core's background threads run on (Linux, per thread). none: where they start (a "
        "thread started by the model's thread shares its binding). auto: where an inference engine binds the model's "
        "threads to some of the cores (vLLM-CPU), the other cores, so a background transfer does not take turns with "
        "the forward pass on the model's core; elsewhere they stay where they start. A list of core ids: those cores",
    )
    verify_fraction: float = Field(
        0.01,
        ge=0.0,
        le=1.0,
        description="fraction of requests with a cache hit that recompute it instead and compare the stored chunks "
        "with the fresh ones (correctness canary)",
    )
    verify_mismatch_limit: int = Field(
        3, ge=1, description="mismatches of one tier within verify_window_s that quarantine it (no reads, no writes)"
    )
    verify_window_s: Annotated[float, seconds(30 * DAY)] = Field(
        3600.0, description="window in seconds for verify_mismatch_limit"
    )
    quarantine_dir: str | None = Field(
        None,
        description="where quarantined tiers are announced as control files (delete one to release the tier); "
        "default $XDG_RUNTIME_DIR/lmcache-core-quarantine, else <tmpdir>/lmcache-core-quarantine-<euid>; a private 0700 "
        "directory owned by the engine's user (anything else is refused)",
    )
    frame_secret: SecretStr | None = Field(
        None,
        description="deployment secret (at least 16 bytes) that seals every frame written to a tier: a keyed "
        "BLAKE3 MAC, so nobody without it can plant KV in a shared store; every engine sharing a store needs the "
        "same one. Prefer frame_secret_file or the env var LMCACHE_CORE_FRAME_SECRET; never logged. The word none: "
        "no secret, on purpose (shared tiers then start without the warning about planted KV)",
    )
    frame_secret_file: str | None = Field(
        None,
        description="file holding frame_secret (its first line, at most 4 KiB); the alternative to frame_secret. "
        "Readable by its owner only (this user or root; chmod 600), else refused",
    )

    @model_validator(mode="after")
    def _one_secret(self) -> "CoreConfig":
        if self.frame_secret is not None and self.frame_secret_file is not None:
            raise ValueError("set frame_secret or frame_secret_file, not both")
        if self.frame_secret_declined:
            return self
        if self.frame_secret is not None and len(self.frame_secret.get_secret_value().encode()) < MIN_FRAME_SECRET_BYTES:
            raise ValueError(
                f"frame_secret needs at least {MIN_FRAME_SECRET_BYTES} bytes (or exactly {NO_FRAME_SECRET}: "
                "no secret, on purpose)"
            )
        return self

    @property
    def frame_secret_declined(self) -> bool:
        """``frame_secret: none``: the operator chose to run shared tiers unsealed."""
        return self.frame_secret is not None and self.frame_secret.get_secret_value() == NO_FRAME_SECRET


_MODELS: dict[tuple[tuple[str, type[StrictModel], str], ...], type[CoreConfig]] = {}


def config_model(sections: Mapping[str, tuple[type[StrictModel], str]]) -> type[CoreConfig]:
    """:class:`CoreConfig` with the sections plugins add: ``{name: (model, description)}``
    (``{"connector": (ConnectorSection, "...")}``), each a field defaulting to its
    model's defaults, its keys merged one by one across sources (:func:`load_config`),
    its old top-level spellings (``model.moved_from_top``) moved into it. One class per
    set of sections; no sections: :class:`CoreConfig` itself."""
    if not sections:
        return CoreConfig
    key = tuple(sorted((name, model, description) for name, (model, description) in sections.items()))
    cls = _MODELS.get(key)
    if cls is None:
        fields: dict[str, Any] = {
            name: (model, Field(default_factory=model, description=description)) for name, model, description in key
        }
        cls = create_model("CoreConfig", __base__=CoreConfig, __module__=__name__, **fields)
        cls.moved_keys = section_moves({name: model for name, model, _ in key})
        _MODELS[key] = cls
    return cls


def section_moves(sections: Mapping[str, type[StrictModel]]) -> dict[str, str]:
    """``{old top-level key: its path in a section}`` for the sections' ``moved_from_top``."""
    return {key: f"{name}.{key}" for name, model in sections.items() for key in model.moved_from_top}


def read_frame_secret(cfg: CoreConfig) -> str | None:
    """The frame secret ``cfg`` names (``frame_secret``, or the first line of
    ``frame_secret_file``), or ``None`` (none set, or ``frame_secret: none``). The file
    must be a regular file of at most 4 KiB (read without blocking: a FIFO is refused,
    not waited on), owned by this user or root, with no permission for its group or
    others (mode 600 or 400): anyone else who can read it can seal forged KV. Errors
    never quote the secret."""
    if cfg.frame_secret_declined:
        return None
    if cfg.frame_secret is not None:
        return cfg.frame_secret.get_secret_value()
    if cfg.frame_secret_file is None:
        return None
    path = cfg.frame_secret_file
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        raise ConfigError(f"frame_secret_file: cannot open {path}: {err.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"frame_secret_file: {path} is not a regular file")
        if st.st_size > MAX_SECRET_FILE_BYTES:
            raise ConfigError(f"frame_secret_file: {path} is larger than {MAX_SECRET_FILE_BYTES} bytes")
        _check_private(path, st)
        data = os.read(fd, MAX_SECRET_FILE_BYTES + 1)
    finally:
        os.close(fd)
    try:
        lines = data.decode("utf-8").splitlines()
    except UnicodeDecodeError:
        raise ConfigError(f"frame_secret_file: {path} is not UTF-8 text") from None
    secret = lines[0].strip() if lines else ""
    if len(secret.encode()) < MIN_FRAME_SECRET_BYTES:
        raise ConfigError(f"frame_secret_file: the secret in {path} is shorter than {MIN_FRAME_SECRET_BYTES} bytes")
    return secret


def _check_private(path: str, st: os.stat_result) -> None:
    """Refuse a secret file someone other than its reader can read or replace: a
    group or other permission bit, or an owner other than this user or root."""
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        if mode & 0o004:
            what = "readable by every user"
        elif mode & 0o040:
            what = "readable by its group"
        elif mode & 0o022:
            what = "writable by other users"
        else:
            what = "open to users other than its owner"
        raise ConfigError(
            f"frame_secret_file: {path} is {what} (mode {mode:04o}): anyone who can read it can seal "
            f"forged KV that this engine serves; make it private to its owner: chmod 600 {path}"
        )
    euid = os.geteuid()
    if st.st_uid not in (euid, 0):
        raise ConfigError(
            f"frame_secret_file: {path} belongs to uid {st.st_uid}, not to this user (uid {euid}) or root: its owner "
            f"can read it and seal forged KV; give it to this user: chown {euid} {path} && chmod 600 {path}"
        )


@dataclass
class LoadedConfig:
    """The validated config plus where each key came from: each top-level key, and
    each key of a merged section (``connector.async_loads``) on its own."""

    config: CoreConfig
    sources: dict[str, str] = field(default_factory=dict)

    def source_of(self, key: str) -> str:
        """Where the value at ``key`` (``chunk_size``, ``backends[1].path``,
        ``connector.async_loads``) came from; ``default`` when no source set it. For a
        whole merged section (``connector``): its keys' sources, comma-separated."""
        return _source_in(self.sources, key, "default", _sections(type(self.config)))


def _source_in(sources: Mapping[str, str], path: str, default: str, sections: Mapping[str, object]) -> str:
    parts = path.split("[")[0].split(".")
    if parts[0] in sections and parts[0] not in sources:
        if len(parts) > 1:
            return sources.get(f"{parts[0]}.{parts[1]}", default)
        inner = sorted({src for key, src in sources.items() if key.startswith(parts[0] + ".")})
        return ", ".join(inner) or default
    return sources.get(parts[0], default)


def _loc_to_path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def format_validation_error(err: ValidationError, prefix: str, source_of: Any) -> str:
    lines = []
    for e in err.errors():
        path = _loc_to_path(tuple(e["loc"]))
        full = f"{prefix}.{path}" if prefix and path else (prefix or path)
        src = source_of(full) if callable(source_of) else source_of
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        raised = (e.get("ctx") or {}).get("error")
        if isinstance(raised, ConfigError):  # raised by a validator (renamed_keys): names its key and source
            lines.append(str(raised))
            continue
        lines.append(f"{full or '<root>'}: {msg} (from {src})")
    return "invalid configuration:\n  " + "\n  ".join(lines)


M = TypeVar("M", bound=BaseModel)


def validate_section(model: type[M], data: Mapping[str, Any], key_path: str, source: str) -> M:
    """Validate one config section against ``model``; errors name ``key_path`` and
    ``source``. Backends call this on their ``backends:`` entry."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{key_path or '<root>'}: expected a mapping of keys, got {type(data).__name__} (from {source})")
    try:
        return model.model_validate(dict(data), context={"key_path": key_path, "source_of": lambda _path: source})
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, key_path, source)) from None


def _expanded_nodes(root: yaml.Node, where: str) -> int:
    """How many values ``root`` stands for once every alias is expanded, counted on
    the composed graph (aliases share nodes, so this costs one visit per node). A
    few hundred bytes of nested aliases can expand to billions of values, which
    validation or ``config --show`` would then materialize."""
    memo: dict[int, int] = {}
    active: set[int] = set()

    def count(node: yaml.Node) -> int:
        key = id(node)
        if key in memo:
            return memo[key]
        if key in active:
            raise ConfigError(f"{where}: a YAML alias refers to a value that contains it (a cycle)")
        active.add(key)
        total = 1
        if isinstance(node, yaml.SequenceNode):
            total += sum(count(child) for child in node.value)
        elif isinstance(node, yaml.MappingNode):
            total += sum(count(k) + count(v) for k, v in node.value)
        active.discard(key)
        memo[key] = total = min(total, MAX_YAML_NODES + 1)
        return total

    return count(root)


_YAML11_SCALARS = {f"tag:yaml.org,2002:{t}" for t in ("bool", "int", "float", "timestamp")}


class ConfigLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` reading plain scalars by YAML 1.2's core schema, the way
    JSON (vLLM's ``kv_connector_extra_config``) reads them, so a word means the same
    from a file, an env var or vLLM: only ``true``/``false`` (also ``True``,
    ``TRUE``...) are booleans (YAML 1.1 also took ``yes``, ``no``, ``on``, ``off``);
    integers are decimal (``010`` is ten, not eight), ``0o17`` or ``0x1f`` (no
    ``1_000``, no base 60: ``1:30`` is text); ``1e3`` is a float (YAML 1.1 left it
    text); dates are text. Everything else a plain scalar says is a string."""


ConfigLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in _YAML11_SCALARS]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
ConfigLoader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:int", re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"), list("-+0123456789")
)
ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+.0123456789"),
)


def _yaml_int(loader: yaml.SafeLoader, node: yaml.Node) -> int:
    text = str(loader.construct_scalar(node))  # type: ignore[arg-type]
    if text.startswith(("0o", "0x")):
        return int(text[2:], 8 if text[1] == "o" else 16)
    return int(text, 10)


def _yaml_float(loader: yaml.SafeLoader, node: yaml.Node) -> float:
    text = str(loader.construct_scalar(node))  # type: ignore[arg-type]
    if text.lower().endswith(".inf"):
        return -math.inf if text.startswith("-") else math.inf
    if text.lower() == ".nan":
        return math.nan
    return float(text)


ConfigLoader.add_constructor("tag:yaml.org,2002:int", _yaml_int)
ConfigLoader.add_constructor("tag:yaml.org,2002:float", _yaml_float)


def safe_yaml(text: str, where: str) -> Any:
    """``yaml.safe_load`` with YAML 1.2's plain scalars (:class:`ConfigLoader`) and
    bounds: at most :data:`MAX_YAML_NODES` values after alias expansion, no alias
    cycles, no nesting deep enough to exhaust the stack. Every failure is a
    :class:`ConfigError` naming ``where``."""
    loader = ConfigLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        if _expanded_nodes(node, where) > MAX_YAML_NODES:
            raise ConfigError(
                f"{where}: the YAML expands to more than {MAX_YAML_NODES} values (nested aliases?); "
                "a configuration needs a few dozen"
            )
        return loader.construct_document(node)
    except yaml.YAMLError as err:
        raise ConfigError(f"{where}: not valid YAML: {err}") from None
    except ConfigError:
        raise
    except ValueError as err:  # a number past what Python converts (thousands of digits)
        raise ConfigError(f"{where}: not a usable number: {err}") from None
    except RecursionError:
        raise ConfigError(f"{where}: the YAML is nested too deeply to be a configuration") from None
    finally:
        loader.dispose()


def read_config_text(path: Path) -> str:
    """The text of a config file, read in bounded time and memory: it must be a
    regular file (a device or FIFO may never end), at most :data:`MAX_CONFIG_BYTES`,
    and UTF-8."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        raise ConfigError(f"cannot read config file {path}: {err.strerror or err}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ConfigError(
                f"config file {path} is not a regular file (a directory, device or pipe); give the path of a YAML file"
            )
        data = b""
        while len(data) <= MAX_CONFIG_BYTES:
            piece = os.read(fd, MAX_CONFIG_BYTES + 1 - len(data))
            if not piece:
                break
            data += piece
    except OSError as err:
        raise ConfigError(f"cannot read config file {path}: {err.strerror or err}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"config file {path} is larger than {MAX_CONFIG_BYTES // 1024} KiB; is it a config file?")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"config file {path} is not UTF-8 text (byte {err.start} is {data[err.start]:#04x}); is it a YAML config file?"
        ) from None


def _read_yaml(text: str, where: str) -> dict[str, Any]:
    data = safe_yaml(text, where)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: the top level must be a mapping of keys, got {type(data).__name__}")
    return data


def _env_overrides(env: Mapping[str, str], model: type[CoreConfig]) -> tuple[dict[str, Any], dict[str, str]]:
    """The ``LMCACHE_CORE_<KEY>`` variables as one source: its data (a merged section's
    keys gathered under it: ``LMCACHE_CORE_CONNECTOR_ASYNC_LOADS`` is
    ``connector.async_loads``, ``LMCACHE_CORE_CONNECTOR`` a YAML mapping of them) and
    the variable each key path came from."""
    fields, sections = model.model_fields, _sections(model)
    data: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for name, raw in sorted(env.items()):
        if not name.startswith(ENV_PREFIX) or name in _RESERVED_ENV:
            continue
        key = name[len(ENV_PREFIX) :].lower()
        section, _, sub = key.partition("_")
        if key not in fields and key not in model.moved_keys and not _section_key(sections.get(section), sub):
            raise ConfigError(f"{name}: unknown setting {key!r}{_not_installed(section, sections)}{_env_hint(key, model)}")
        if key in _RAW_ENV_KEYS:
            value: Any = raw if raw.strip() else None
        else:
            value = safe_yaml(raw, f"env var {name}") if raw.strip() else None
        src = f"env var {name}"
        if key in sections:
            if not isinstance(value, Mapping):
                raise ConfigError(f"{name}: expected a YAML mapping of {key} keys ({{async_loads: true}}), got {_shown(value)}")
            pairs = [(str(k), v) for k, v in value.items()]
        elif key not in fields and key not in model.moved_keys:
            pairs, key = [(sub, value)], section
        else:
            data[key], sources[key] = value, src
            continue
        inner = data.setdefault(key, {})
        for sub, v in pairs:
            path = f"{key}.{sub}"
            if path in sources:
                raise ConfigError(f"{path}: set by both {sources[path]} and {src}; give it once")
            inner[sub], sources[path] = v, src
    return data, sources


def _section_key(section: type[StrictModel] | None, key: str) -> bool:
    return section is not None and (key in section.model_fields or key in section.renamed_ms_keys)


def _not_installed(key: str, sections: Mapping[str, object]) -> str:
    """The hint for a key of a known plugin's section (:data:`KNOWN_SECTIONS`) when
    that plugin is not installed."""
    if key in KNOWN_SECTIONS and key not in sections:
        return f": the {key}: section belongs to a plugin that is not installed (pip install '{KNOWN_SECTIONS[key]}')"
    return ""


def _env_hint(key: str, model: type[CoreConfig]) -> str:
    import difflib

    sections = _sections(model)
    names = [k for k in model.model_fields if k not in sections]
    names += [f"{s}_{k}" for s, section in sections.items() for k in section.model_fields]
    close = difflib.get_close_matches(key, names, n=1)
    hint = f"; did you mean {ENV_PREFIX}{close[0].upper()}?" if close else ""
    merged = "".join(f", {ENV_PREFIX}{s.upper()}_<KEY> for {s}.<key>" for s in sections)
    return f"{hint}{' (' + merged[2:] + ')' if merged else ''}; known: " + ", ".join(
        ENV_PREFIX + k.upper() for k in sorted(names)
    )


def _layer(
    data: Mapping[str, Any], source_of: Callable[[str], str], model: type[CoreConfig]
) -> dict[tuple[str, ...], tuple[Any, str]]:
    """One source's keys, old spellings moved (:func:`moved_keys`), as ``{path: (value,
    source)}`` with a merged section's keys one by one (``("connector", "layout")``).
    A section of a known plugin that is not installed is a :class:`ConfigError`."""
    sections = _sections(model)
    for key in data:
        if key in KNOWN_SECTIONS and key not in sections:
            blocked = os.environ.get(ENV_BLOCK_PLUGINS, "").strip()
            why = f" or blocked ({ENV_BLOCK_PLUGINS}={blocked})" if blocked else ""
            raise ConfigError(
                f"{key}: this section configures a plugin that is not installed here{why} (from {source_of(key)}); "
                f"install it (pip install '{KNOWN_SECTIONS[key]}') or remove the section"
            )
    moved = {new: old for old, new in model.moved_keys.items() if old in data}
    data = moved_keys(data, model.moved_keys, "", source_of)
    out: dict[tuple[str, ...], tuple[Any, str]] = {}
    for key, value in data.items():
        if key in sections and isinstance(value, Mapping):
            for sub, v in value.items():
                path = f"{key}.{sub}"
                out[(key, sub)] = (v, source_of(moved.get(path, path)))
        else:
            out[(key,)] = (value, source_of(key))
    return out


def _renamed_paths(model: type[CoreConfig]) -> dict[tuple[str, ...], tuple[str, ...]]:
    """Both directions of every millisecond rename, as paths (``connector.lookup_timeout_ms``
    and ``connector.lookup_timeout_s``)."""
    out: dict[tuple[str, ...], tuple[str, ...]] = {}
    models: list[tuple[tuple[str, ...], type[StrictModel]]] = [((), model)]
    models += [((name,), section) for name, section in _sections(model).items()]
    for prefix, m in models:
        for old, new in m.renamed_ms_keys.items():
            out[prefix + (old,)], out[prefix + (new,)] = prefix + (new,), prefix + (old,)
    return out


def load_config(
    path: str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    overrides_source: str = "programmatic override",
    model: type[CoreConfig] = CoreConfig,
) -> LoadedConfig:
    """Load the config: file (``path`` or ``$LMCACHE_CORE_CONFIG``, else the embedded
    default), then ``LMCACHE_CORE_<KEY>`` env vars, then ``overrides``. A later source
    replaces a key of an earlier one; a merged section (``connector``) merges key by
    key, so an override of ``connector.async_loads`` keeps the file's other connector
    keys. Old spellings are moved within each source (:func:`moved_keys`).

    ``model`` is the config's model: :class:`CoreConfig`, or one with the sections
    installed plugins add (:func:`config_model`, ``PluginManager.config_model()``); a
    section of a first-party plugin that ``model`` lacks (:data:`KNOWN_SECTIONS`,
    ``connector:``) is a :class:`ConfigError` saying what to install."""
    env = os.environ if env is None else env
    data, file_src = _file_layer(path, env)
    if overrides is not None and not isinstance(overrides, Mapping):
        raise ConfigError(f"{overrides_source}: expected a mapping of config keys, got {type(overrides).__name__}")
    env_data, env_sources = _env_overrides(env, model)
    merged = _layer(data, lambda _p: file_src, model)
    _apply_layer(merged, _layer(env_data, lambda p: env_sources.get(p, "env"), model), model)
    _apply_layer(merged, _layer(overrides or {}, lambda _p: overrides_source, model), model)

    data = _nested(merged)
    sources = {".".join(map(str, key_path)): src for key_path, (_value, src) in merged.items()}
    renamed = _renamed_paths(model)
    sections = _sections(model)

    def source_of(path: str) -> str:
        key = path.split("[")[0].split(".")
        if ".".join(key[:2]) not in sources and ".".join(key[:1]) not in sources:
            # a value given under its old name is checked under the new one
            other = renamed.get(tuple(key[:2])) or renamed.get(tuple(key[:1]))
            if other is not None:
                return sources.get(".".join(other), file_src)
        return _source_in(sources, path, file_src, sections)

    try:
        cfg = model.model_validate(data, context={"key_path": "", "source_of": source_of})
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, "", source_of)) from None
    for old_path, new_path in renamed.items():  # the value now lives under its new name
        old, new = ".".join(old_path), ".".join(new_path)
        if old in sources and new not in sources and new_path[-1] in _fields_at(new_path, model):
            sources[new] = sources.pop(old)
    return LoadedConfig(cfg, sources)


def _file_layer(path: str | os.PathLike[str] | None, env: Mapping[str, str]) -> tuple[dict[str, Any], str]:
    """The file's keys (``path``, else ``$LMCACHE_CORE_CONFIG``, else the embedded
    default) and how to name it as a source."""
    if path is None and env.get(ENV_CONFIG_PATH):
        path = env[ENV_CONFIG_PATH]
        file_src = f"{Path(path)} (from env var {ENV_CONFIG_PATH})"
    else:
        file_src = str(path) if path is not None else "embedded default"
    if path is None:
        return _read_yaml(DEFAULT_YAML, "embedded default"), file_src
    return _read_yaml(read_config_text(Path(path)), str(Path(path))), file_src


def _nested(merged: Mapping[tuple[str, ...], tuple[Any, str]]) -> dict[str, Any]:
    """The merged keys as the model's input: a section's keys gathered under it."""
    data: dict[str, Any] = {}
    for key_path, (value, _src) in merged.items():
        if len(key_path) == 1:
            data[key_path[0]] = value
        elif not isinstance(data.get(key_path[0], {}), Mapping):
            continue  # the section itself was given as something else: validation refuses it
        else:
            data.setdefault(key_path[0], {})[key_path[1]] = value
    return data


def _fields_at(path: tuple[str, ...], model: type[CoreConfig]) -> Mapping[str, Any]:
    return (_sections(model)[path[0]] if len(path) > 1 else model).model_fields


def _apply_layer(
    merged: dict[tuple[str, ...], tuple[Any, str]], layer: Mapping[tuple[str, ...], tuple[Any, str]], model: type[CoreConfig]
) -> None:
    """Put one source's keys over the earlier ones. A merged section's keys replace
    one by one; a section given as something other than a mapping replaces the whole
    section (for validation to refuse). A key replaces an earlier source's value under
    either spelling of a renamed key (an override of ``connector.lookup_timeout_s``
    replaces a file's ``connector.lookup_timeout_ms``); both spellings from one source
    are left for validation to refuse."""
    renamed, sections = _renamed_paths(model), _sections(model)
    for path in layer:
        other = renamed.get(path)
        if other is not None and other not in layer:
            merged.pop(other, None)
        if len(path) == 1 and path[0] in sections:  # the whole section, not a mapping
            for earlier in [p for p in merged if p[0] == path[0]]:
                del merged[earlier]
        elif len(path) == 2:
            merged.pop(path[:1], None)
    merged.update(layer)
