"""Read the serving command and the YAML example out of README.md and docs/connector.md.

Why: the README's serving command once failed on vLLM's CPU build while
every test passed, because the tests started vLLM with their own flags. These helpers
let a test run the documented text itself, so an edit that breaks it fails the suite.

A block is found by an HTML comment marker (invisible when rendered) on the line
before its fence, e.g. ``<!-- serve-cpu -->`` then a ```` ```bash ```` fence. Only
placeholders are substituted (``MODEL``, the port ``8000``, absolute tier ``path:``
values in the YAML); anything else that changed shape raises :class:`DocBlockError`
naming the file and what the test expects, so the failure says where to look.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
CONNECTOR_DOC = ROOT / "docs" / "connector.md"

CPU_MARKER = "serve-cpu"
CUDA_MARKER = "serve-cuda"
YAML_MARKER = "lmcache-yaml"

# How each block must start; the flags after the launcher must be the same in both.
CPU_LAUNCHER = ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "MODEL"]
CUDA_LAUNCHER = ["vllm", "serve", "MODEL"]
PORT_PLACEHOLDER = "8000"
HELPER = "tests/connector/doc_blocks.py"


class DocBlockError(AssertionError):
    """A documented block is missing or no longer has the shape the test runs."""


def _fail(doc: Path, marker: str, what: str) -> DocBlockError:
    return DocBlockError(
        f"{doc.name} (block <!-- {marker} -->): {what}. The documented command is run verbatim by "
        f"tests/connector/test_readme_serving.py; fix {doc.name}, or update {HELPER} if the change is intended."
    )


def fenced_block(text: str, doc: Path, marker: str, lang: str) -> str:
    """The body of the ```` ```lang ```` fence right after ``<!-- marker ... -->``."""
    pattern = re.compile(rf"^<!--\s*{re.escape(marker)}\b[^\n]*-->[ \t]*$", re.MULTILINE)
    hits = list(pattern.finditer(text))
    if not hits:
        raise _fail(doc, marker, f"marker line '<!-- {marker} -->' not found")
    if len(hits) > 1:
        raise _fail(doc, marker, f"marker appears {len(hits)} times, expected once")
    rest = text[hits[0].end() :].lstrip("\n")
    opening = f"```{lang}\n"
    if not rest.startswith(opening):
        first = rest.splitlines()[0] if rest else "<end of file>"
        raise _fail(doc, marker, f"expected a '```{lang}' fence on the line after the marker, found {first!r}")
    body = rest[len(opening) :]
    end = re.search(r"^```[ \t]*$", body, re.MULTILINE)
    if end is None:
        raise _fail(doc, marker, "the fenced block is not closed")
    return body[: end.start()]


def _argv(script: str, doc: Path, marker: str) -> list[str]:
    """Words of a one-command shell block, as bash would split them.

    The test runs the block with ``bash -c``; a second command or a pipeline would not
    be a serving command the test can check, so they (and comments) are refused."""
    joined = "\n".join(ln for ln in script.replace("\\\n", " ").splitlines() if ln.strip())
    quote = ""
    for ch in joined:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "\n;&|<>`#":
            raise _fail(doc, marker, f"the block must hold one command; found {ch!r} outside quotes")
    try:
        return shlex.split(joined)
    except ValueError as err:
        raise _fail(doc, marker, f"the command does not parse as shell words ({err})") from err


@dataclass(frozen=True)
class ServeCommand:
    """One documented serving command: its text and its words."""

    doc: Path
    marker: str
    script: str
    argv: list[str]
    launcher: list[str]

    @property
    def flags(self) -> list[str]:
        """The words after the launcher (``python -m ... --model MODEL`` or ``vllm serve MODEL``)."""
        return self.argv[len(self.launcher) :]

    def kv_transfer_config(self) -> dict[str, Any]:
        return _ktc(self.flags, self.doc, self.marker)

    def config_file(self) -> str:
        """The YAML file name the command points the connector at (relative to the cwd)."""
        extra = self.kv_transfer_config().get("kv_connector_extra_config")
        name = extra.get("config_file") if isinstance(extra, dict) else None
        if not isinstance(name, str) or not name or Path(name).is_absolute():
            raise _fail(
                self.doc,
                self.marker,
                "kv_connector_extra_config.config_file must name a relative YAML file (the test writes the "
                f"documented YAML there, in the server's working directory); got {name!r}",
            )
        return name

    def substituted(self, model: str, port: int) -> str:
        """The command text with ``MODEL`` and port 8000 replaced, nothing else."""
        text, n = re.subn(r"\bMODEL\b", lambda _: shlex.quote(model), self.script)
        if n != 1:
            raise _fail(self.doc, self.marker, f"placeholder MODEL appears {n} times, expected once")
        text, n = re.subn(rf"(--port[ =]){PORT_PLACEHOLDER}\b", lambda m: f"{m.group(1)}{port}", text)
        if n != 1:
            raise _fail(self.doc, self.marker, f"'--port {PORT_PLACEHOLDER}' appears {n} times, expected once")
        return text


def _ktc(flags: list[str], doc: Path, marker: str) -> dict[str, Any]:
    values = [flags[i + 1] for i, w in enumerate(flags[:-1]) if w == "--kv-transfer-config"]
    if len(values) != 1:
        raise _fail(doc, marker, f"expected one --kv-transfer-config '<json>' argument, found {len(values)}")
    try:
        ktc = json.loads(values[0])
    except json.JSONDecodeError as err:
        raise _fail(doc, marker, f"--kv-transfer-config is not valid JSON ({err})") from err
    if not isinstance(ktc, dict) or ktc.get("kv_connector") != "LMCacheCoreConnector":
        raise _fail(doc, marker, f"--kv-transfer-config must select kv_connector LMCacheCoreConnector, got {ktc!r}")
    return ktc


def serve_command(doc: Path, marker: str, launcher: list[str], text: str | None = None) -> ServeCommand:
    """Extract and shape-check the serving command under ``marker`` in ``doc``."""
    text = doc.read_text() if text is None else text
    script = fenced_block(text, doc, marker, "bash")
    argv = _argv(script, doc, marker)
    if argv[: len(launcher)] != launcher:
        raise _fail(doc, marker, f"the command must start with {shlex.join(launcher)!r}, got {shlex.join(argv[:6])!r}")
    cmd = ServeCommand(doc, marker, script, argv, launcher)
    if cmd.flags.count("--port") != 1 or cmd.flags[cmd.flags.index("--port") + 1] != PORT_PLACEHOLDER:
        raise _fail(doc, marker, f"expected '--port {PORT_PLACEHOLDER}' once (the test substitutes a free port)")
    cmd.config_file()  # shape of the JSON and of config_file
    return cmd


def documented_commands(readme_text: str | None = None, connector_text: str | None = None) -> ServeCommand:
    """The CPU serving command, after checking every documented copy agrees.

    README.md and docs/connector.md each carry the CPU command and the CUDA
    (``vllm serve``) command; all four must have the same flags, so running the CPU
    one covers the others' flags too (``vllm serve`` itself cannot run on the CPU build).
    """
    cpu = serve_command(README, CPU_MARKER, CPU_LAUNCHER, readme_text)
    others = [
        serve_command(README, CUDA_MARKER, CUDA_LAUNCHER, readme_text),
        serve_command(CONNECTOR_DOC, CPU_MARKER, CPU_LAUNCHER, connector_text),
        serve_command(CONNECTOR_DOC, CUDA_MARKER, CUDA_LAUNCHER, connector_text),
    ]
    for other in others:
        if other.flags != cpu.flags:
            raise _fail(
                other.doc,
                other.marker,
                f"its flags differ from README.md's <!-- {CPU_MARKER} --> block:\n  {shlex.join(other.flags)}\n"
                f"vs\n  {shlex.join(cpu.flags)}",
            )
    return cpu


@dataclass(frozen=True)
class DocYaml:
    """The README's lmcache.yaml, with absolute tier paths moved into a test directory."""

    text: str
    rewrites: dict[str, str]


def documented_yaml(tmp: Path, readme_text: str | None = None) -> DocYaml:
    """README.md's YAML block; each absolute ``backends[i].path`` is rewritten into ``tmp``.

    Only those paths change (e.g. ``/var/cache/lmcache``): a test must not write
    outside its temporary directory. Comments and every other key stay as written.
    """
    text = README.read_text() if readme_text is None else readme_text
    body = fenced_block(text, README, YAML_MARKER, "yaml")
    try:
        data = yaml.safe_load(body)
    except yaml.YAMLError as err:
        raise _fail(README, YAML_MARKER, f"not valid YAML ({err})") from err
    if not isinstance(data, dict) or not isinstance(data.get("backends"), list):
        raise _fail(README, YAML_MARKER, "expected a mapping with a 'backends:' list")
    rewrites: dict[str, str] = {}
    for i, entry in enumerate(data["backends"]):
        path = entry.get("path") if isinstance(entry, dict) else None
        if isinstance(path, str) and Path(path).is_absolute():
            new = str(tmp / f"tier{i}-{Path(path).name}")
            if body.count(path) != 1:
                raise _fail(README, YAML_MARKER, f"path {path!r} appears {body.count(path)} times, expected once")
            body = body.replace(path, new)
            rewrites[path] = new
    return DocYaml(body, rewrites)
