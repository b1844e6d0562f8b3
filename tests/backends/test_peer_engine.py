"""Two real processes on loopback, through the engine and the plugin's entry point.

Engine A (a child process running this file) stores chunks with tiers
[local_cpu, peer(listen)] and serves them; engine B (this process) with tiers
[local_cpu, peer(peers=[A])] and an empty CPU tier retrieves identical bytes. The
standalone node (``lmcache-peer-serve``, another child) takes pushes from one engine
and serves them to another. Wrong secrets get and store nothing; a dead peer is a miss.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from lmcache_backend_peer import PeerClient
from lmcache_core import CacheEngine, ConfigError, KeyNamespace, load_config
from lmcache_core.plugins import get_plugin_manager
from lmcache_core.testing.tokens import lookup_tokens, retrieve_tokens, store_tokens, token_hashes

sys.path.insert(0, str(Path(__file__).parent))
from peer_node import first_line  # noqa: E402

CHUNK = 16
N_CHUNKS = 6
SHAPE = (2, CHUNK, 8)
SECRET = "engine-test-secret-0xC0FFEE"
STARTUP_TIMEOUT = 60.0


def tokens_for(seed: int) -> list[int]:
    return [(seed * 1000 + i) % 50_000 for i in range(N_CHUNKS * CHUNK)]


def chunks_for(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(SHAPE, generator=g).to(torch.float16) for _ in range(N_CHUNKS)]


def digest(chunks: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for c in chunks:
        h.update(c.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def engine(backends: list[dict[str, Any]]) -> CacheEngine:
    cfg = load_config(overrides={"chunk_size": CHUNK, "backends": [{"name": "local_cpu", "max_size": "16MiB"}, *backends]})
    return CacheEngine(cfg, namespace=KeyNamespace(model="m"))


def read_line(proc: subprocess.Popen, prefix: str, timeout: float = STARTUP_TIMEOUT) -> str:
    """The rest of the next stdout line starting with ``prefix``, or fail (never hang)."""
    line = first_line(proc, prefix, timeout)
    if line is not None:
        return line[len(prefix) :].strip()
    proc.kill()
    raise AssertionError(f"child did not print {prefix!r}: rc={proc.wait(5)} stderr={proc.stderr.read()[-2000:]}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.fixture
def secret_file(tmp_path: Path) -> Path:
    f = tmp_path / "peer.secret"
    f.write_text(SECRET + "\n")
    f.chmod(0o600)
    return f


@pytest.fixture
def engine_a(secret_file: Path) -> Iterator[tuple[str, str]]:
    """A child process running engine A; yields (its peer address, digest of its data)."""
    proc = subprocess.Popen(
        [sys.executable, __file__, "engine-a", str(secret_file), "7"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        address = read_line(proc, "listening ")
        yield address, read_line(proc, "digest ")
    finally:
        stop(proc)


@pytest.fixture(params=[["lmcache-peer-serve"], ["lmcache-core", "serve"]], ids=["lmcache-peer-serve", "lmcache-core-serve"])
def node(secret_file: Path, request: pytest.FixtureRequest) -> Iterator[tuple[str, subprocess.Popen]]:
    exe = shutil.which(request.param[0], path=os.path.dirname(sys.executable))
    assert exe, "install backends/peer (pip install -e backends/peer) for its console script"
    proc = subprocess.Popen(
        [exe, *request.param[1:], "--listen", "127.0.0.1:0", "--secret-file", str(secret_file), "--max-size", "64MiB"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        yield read_line(proc, "listening on "), proc
    finally:
        stop(proc)


def test_the_plugin_is_found_through_its_entry_point() -> None:
    info = get_plugin_manager().backends()["peer"]
    assert info.origin.distribution == "lmcache-backend-peer"


def test_engine_b_retrieves_what_engine_a_stored(engine_a: tuple[str, str], secret_file: Path) -> None:
    address, a_digest = engine_a
    expected = chunks_for(7)
    assert digest(expected) == a_digest  # both processes derive the same data
    b = engine([{"name": "peer", "peers": [address], "secret_file": str(secret_file), "max_size": 0}])
    try:
        assert b.tiers[0].stats().chunks == 0
        tokens = tokens_for(7)
        assert lookup_tokens(b, tokens) == len(tokens)
        outs = [torch.zeros(SHAPE, dtype=torch.float16) for _ in range(N_CHUNKS)]
        assert retrieve_tokens(b, tokens, outs) == N_CHUNKS
        assert digest(outs) == a_digest
        assert b.tiers[0].stats().chunks == N_CHUNKS  # promoted into B's CPU tier
        assert lookup_tokens(b, tokens_for(8)) == 0  # not stored anywhere
    finally:
        b.close()


def test_engine_with_the_wrong_secret_gets_nothing(engine_a: tuple[str, str], tmp_path: Path) -> None:
    address, _ = engine_a
    c = engine([{"name": "peer", "peers": [address], "secret": "wrong-secret-0123456789", "max_size": 0, "timeout_s": 1.0}])
    try:
        tokens = tokens_for(7)
        assert lookup_tokens(c, tokens) == 0
        outs = [torch.zeros(SHAPE, dtype=torch.float16) for _ in range(N_CHUNKS)]
        assert retrieve_tokens(c, tokens, outs) == 0
        assert all(torch.count_nonzero(o) == 0 for o in outs)
    finally:
        c.close()


def test_standalone_node_shares_pushed_chunks(node: tuple[str, subprocess.Popen], secret_file: Path) -> None:
    address, proc = node
    peer = {"name": "peer", "peers": [address], "secret_file": str(secret_file), "max_size": 0, "timeout_s": 1.0}
    writer = engine([{**peer, "push": True}])
    bad = engine([{**peer, "push": True, "secret_file": None, "secret": "wrong-secret-0123456789"}])
    reader = engine([peer])
    try:
        tokens, data = tokens_for(3), chunks_for(3)
        assert store_tokens(writer, tokens, data) == N_CHUNKS
        assert writer.flush(30)
        bad_tokens = tokens_for(4)
        store_tokens(bad, bad_tokens, chunks_for(4))
        assert bad.flush(30)

        assert lookup_tokens(reader, tokens) == len(tokens)
        outs = [torch.zeros(SHAPE, dtype=torch.float16) for _ in range(N_CHUNKS)]
        assert retrieve_tokens(reader, tokens, outs) == N_CHUNKS
        assert digest(outs) == digest(data)
        assert lookup_tokens(reader, bad_tokens) == 0  # the wrong-secret PUTs stored nothing
        host, port = address.rsplit(":", 1)
        check = PeerClient((host, int(port)), SECRET.encode(), timeout=2.0)
        assert check.lookup(bad.keys(token_hashes(bad, bad_tokens))) == 0
        check.close()

        proc.kill()  # the node dies: a miss within the timeout, no hang, no crash
        proc.wait(10)
        fresh = tokens_for(5)
        t0 = time.monotonic()
        assert lookup_tokens(reader, fresh) == 0
        assert retrieve_tokens(reader, fresh, outs) == 0
        assert time.monotonic() - t0 < 15
    finally:
        writer.close()
        bad.close()
        reader.close()


def test_cli_refuses_to_start_without_a_secret(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "LMCACHE_PEER_SECRET"}
    r = subprocess.run(
        [sys.executable, "-m", "lmcache_backend_peer.cli", "--listen", "127.0.0.1:0"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert r.returncode == 2 and "--secret-file" in r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "lmcache_backend_peer.cli", "--listen", "nowhere", "--secret-file", "x"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert r.returncode == 2 and "host:port" in r.stderr


def test_engine_config_errors_name_the_key_and_source(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        engine([{"name": "peer", "peers": ["10.0.0.1"], "secret": "s" * 16}])
    assert "backends[1].peers[0]" in str(info.value) and "programmatic override" in str(info.value)
    with pytest.raises(ConfigError, match=r"backends\[1\].secret_file: cannot read"):
        engine([{"name": "peer", "peers": ["10.0.0.1:1"], "secret_file": str(tmp_path / "none")}])


# -- child process: engine A --------------------------------------------------------------
def _engine_a_main(secret_file: str, seed: int) -> None:
    a = engine([{"name": "peer", "listen": "127.0.0.1:0", "secret_file": secret_file}])
    try:
        data = chunks_for(seed)
        assert store_tokens(a, tokens_for(seed), data) == N_CHUNKS
        if not a.flush(30):
            raise SystemExit("flush timed out")
        host, port = a.tiers[1].server.address
        print(f"listening {host}:{port}", flush=True)
        print(f"digest {digest(data)}", flush=True)
        sys.stdin.read()  # serve until the parent closes our stdin or terminates us
    finally:
        a.close()


if __name__ == "__main__":
    if sys.argv[1] == "engine-a":
        _engine_a_main(sys.argv[2], int(sys.argv[3]))
