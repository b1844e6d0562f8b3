"""Opening what an engine serves from its config: the memory pool sized by what the
tiers declare, the codecs (sealed with the deployment's frame key when there is one)
and the tiers themselves, each created by its plugin with its own codec.

:class:`~lmcache_core.engine.CacheEngine` calls these once, at start; nothing here
keeps state.
"""

from __future__ import annotations

import logging
import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Mapping

from .backend import SHARED, ZERO_COPY, BackendContext, StorageBackend
from .config import ConfigError, CoreConfig, LoadedConfig, load_config
from .keys import KeyNamespace
from .memory import MemoryPool, available_memory
from .plugins import PluginManager
from .serde import Codec, FrameSeal, SealedCodec, SealedCodecs, is_lossy, tier_codecs

log = logging.getLogger("lmcache_core.engine")


def engine_config(config: CoreConfig | LoadedConfig | None, plugins: PluginManager) -> LoadedConfig:
    """The engine's config: as given, or (``None``) loaded from the usual sources with
    every section the installed plugins register."""
    if isinstance(config, LoadedConfig):
        return config
    return LoadedConfig(config) if config is not None else load_config(model=plugins.config_model())


def pool_claims(loaded: LoadedConfig, plugins: PluginManager) -> list[tuple[int, int]]:
    """``(index in backends, bytes)`` for every configured tier that declares pool
    memory (``pool_bytes`` at registration: tiers that keep their chunks in the pool,
    like ``local_cpu`` or a third-party zero-copy tier); a size that does not parse is
    a :class:`ConfigError` naming its key and file."""
    source = loaded.source_of("backends")
    claims = [(i, plugins.pool_bytes(b, key_path=f"backends[{i}]", source=source)) for i, b in enumerate(loaded.config.backends)]
    return [(i, n) for i, n in claims if n > 0]


def check_config(loaded: LoadedConfig, plugins: PluginManager) -> list[str]:
    """What an engine would refuse in ``loaded`` at start that loading it does not
    check, because the installed plugins decide it (``lmcache-core config`` runs this
    before saying a config is good): the codecs (``serde``, each tier's), each tier's
    backend installed and the pool memory it declares, a ``local_cpu`` tier's whole
    section (its keys, ``retention_share``, ``eviction``), and the pool against the
    machine's memory, each through the engine's own check. A plugin tier's own keys
    are checked when it opens. Each problem as the engine words it; none: an empty
    list."""
    from .local_cpu import checked_section

    problems: list[str] = []

    def check(fn: Callable[[], object]) -> None:
        try:
            fn()
        except ConfigError as err:
            problems.append(err.one_line())

    check(lambda: Codecs(loaded, plugins, None))
    source = loaded.source_of("backends")
    for i, sec in enumerate(loaded.config.backends):
        where = f"backends[{i}]"
        try:
            plugins.backend_info(sec.name, key_path=where, source=source)
        except ConfigError as err:
            problems.append(err.one_line())
            continue
        serde = sec.serde
        if serde is not None:  # (what Codecs.for_tier asks the plugins)
            check(lambda: plugins.get_codec(serde, key_path=f"{where}.serde", source=source))  # noqa: B023
        if sec.name == "local_cpu":  # (capacity 1: the policy's name is what is checked)
            check(lambda: checked_section(sec.options(), where, source, plugins, 1))  # noqa: B023
    if not problems:
        check(lambda: _pool_size(loaded, plugins))
    return problems


def _pool_size(loaded: LoadedConfig, plugins: PluginManager) -> tuple[int, list[tuple[int, int]]]:
    """The pool's bytes (what the tiers declare plus ``staging_size``) and the claims
    that make them; a :class:`ConfigError` naming those sections when the machine
    cannot hold it."""
    claims = pool_claims(loaded, plugins)
    size = max(sum(n for _, n in claims) + loaded.config.staging_size, 1 << 20)
    avail = available_memory()
    if avail is not None and size > avail:
        raise _pool_error(loaded, claims, size, f"only {avail / 2**30:.1f} GiB of memory is available on this machine")
    return size, claims


def _pool_error(loaded: LoadedConfig, claims: list[tuple[int, int]], size: int, reason: str) -> ConfigError:
    cfg = loaded.config
    keys = [f"backends[{i}] ({cfg.backends[i].name}: {n / 2**30:.1f} GiB)" for i, n in claims]
    return ConfigError(
        f"{' + '.join(keys + ['staging_size'])}: the CPU memory pool would be {size / 2**30:.1f} GiB but {reason}; "
        f"lower them (backends from {loaded.source_of('backends')}, staging_size from {loaded.source_of('staging_size')})"
    )


def make_pool(loaded: LoadedConfig, plugins: PluginManager) -> MemoryPool:
    """The pool holds what the tiers declare plus ``staging_size`` of headroom for
    chunks in flight (gathered for a save, queued for a slower tier, read from one
    for a load), so a full CPU tier never starves the transfers to and from slower
    tiers. When the machine cannot hold it: a :class:`ConfigError` naming the
    sections that size it (rather than an allocator error naming no key, or the OOM
    killer later)."""
    size, claims = _pool_size(loaded, plugins)
    try:
        return MemoryPool(size, populate=loaded.config.populate_pool)
    except (RuntimeError, MemoryError) as err:
        raise _pool_error(loaded, claims, size, f"allocating it failed: {err}") from None


def engine_namespace(namespace: KeyNamespace, cfg: CoreConfig) -> KeyNamespace:
    """``namespace`` with the config's ``tenant_salt``, logged with its id (the id to
    give ``lmcache-core erase --namespace``: keys carry only this hash)."""
    if cfg.tenant_salt is not None:
        namespace = dataclasses.replace(namespace, salt=cfg.tenant_salt)
    log.info(
        "key namespace %s (model %s, rank %d of %d, tenant salt %s)",
        namespace.id.hex(),
        namespace.model,
        namespace.rank,
        namespace.world_size,
        "set" if namespace.salt is not None else "none",
    )
    return namespace


@dataclass
class Codecs:
    """The top-level codec (``serde``), every codec by name and each tier's codec,
    all sealed with ``seal`` when there is one."""

    loaded: LoadedConfig
    plugins: PluginManager
    seal: FrameSeal | None
    codec: Codec = field(init=False)
    by_name: Mapping[str, Codec] = field(init=False)

    def __post_init__(self) -> None:
        by_name: Mapping[str, Codec] = self.plugins.codec_map()
        codec: Codec = self.plugins.get_codec(self.loaded.config.serde, source=self.loaded.source_of("serde"))
        if self.seal is not None:
            codec, by_name = SealedCodec(codec, self.seal), SealedCodecs(by_name, self.seal)
        self.codec, self.by_name = codec, by_name

    def for_tier(self, name: str | None, key_path: str) -> Codec:
        """The codec of a tier whose section says ``serde: name`` (the top-level
        codec when it says nothing), sealed like it."""
        if name is None:
            return self.codec
        codec = self.plugins.get_codec(name, key_path=key_path, source=self.loaded.source_of("backends"))
        return SealedCodec(codec, self.seal) if self.seal is not None else codec


def tier_context(codecs: Codecs, pool: MemoryPool, i: int, *, serving: bool = True) -> BackendContext:
    """What the plugin of ``backends[i]`` is given to create its tier: the section's
    place and source, the config, ``pool``, its codec and every codec, sealed alike
    (``serving=False``: for a command, see :attr:`BackendContext.serving`)."""
    tier_codec = codecs.for_tier(codecs.loaded.config.backends[i].serde, f"backends[{i}].serde")
    return BackendContext(
        key_path=f"backends[{i}]",
        source=codecs.loaded.source_of("backends"),
        config=codecs.loaded.config,
        pool=pool,
        codec=tier_codec,
        codecs=tier_codecs(codecs.by_name, tier_codec),
        plugins=codecs.plugins,
        serving=serving,
    )


def open_tiers(codecs: Codecs, pool: MemoryPool) -> tuple[list[StorageBackend], list[Codec]]:
    """Every configured tier, created by its plugin, and its codec; if one fails,
    those already open are closed and the error raised."""
    cfg, plugins = codecs.loaded.config, codecs.plugins
    tiers: list[StorageBackend] = []
    per_tier: list[Codec] = []
    try:
        for i, section in enumerate(cfg.backends):
            ctx = tier_context(codecs, pool, i)
            tier_codec = ctx.codec
            tier = plugins.create_backend(section, ctx)
            tiers.append(tier)
            per_tier.append(tier_codec)
            prepare = getattr(tier_codec, "prepare", None)
            if callable(prepare):
                prepare()  # e.g. fp8's kernel, built here rather than by the first request
            _warn_about(ctx, section.name, tier, tier_codec, plugins.pool_bytes(section), cfg.staging_size)
    except BaseException:
        for t in tiers:
            t.close()
        raise
    return tiers, per_tier


def _warn_about(ctx: BackendContext, name: str, tier: StorageBackend, codec: Codec, pool_bytes: int, staging: int) -> None:
    if is_lossy(codec):
        log.warning(
            "%s (%s) stores KV with the LOSSY codec %r: its frames are approximations, served "
            "only by tiers configured with that codec",
            ctx.key_path,
            name,
            codec.name,
        )
    if ZERO_COPY in tier.capabilities and pool_bytes == 0:
        log.warning(
            "%s (%s) keeps chunks in the memory pool but declares no pool_bytes when it "
            "registers: it shares the %d-byte staging headroom",
            ctx.key_path,
            name,
            staging,
        )


def say_how_frames_are_sealed(loaded: LoadedConfig, tiers: list[StorageBackend], seal: FrameSeal | None) -> None:
    """At start: a warning when a ``SHARED`` tier's frames are not sealed and the
    config does not say so on purpose (``frame_secret: none``), since anyone who
    can write to such a tier can plant KV this engine serves as a hit."""
    shared = [t.name for t in tiers if SHARED in t.capabilities]
    if seal is not None:
        log.info("frames are sealed (frame key id %s)", seal.key_id)
    elif shared and loaded.config.frame_secret_declined:
        log.info(
            "tiers %s are shared and their frames are not sealed: frame_secret: none (from %s)",
            ", ".join(shared),
            loaded.source_of("frame_secret"),
        )
    elif shared:
        log.warning(
            "tiers %s are shared and frame_secret is not set: anyone who can write to them can plant KV "
            "that this engine serves as a hit. Set frame_secret_file (see docs/security.md), or write "
            "frame_secret: none in the config to run them unsealed on purpose",
            ", ".join(shared),
        )
