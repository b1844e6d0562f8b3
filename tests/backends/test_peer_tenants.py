"""Tenants on a shared peer node (checked on a real ``lmcache-core serve`` in a child
process, loopback only, and on the node's parts in this process):

* each principal (each tenant of ``--tenants-file``, and the holder of the node's
  shared secret) has its own namespace, keyed per node process: a chunk written
  without a tenant's key is never its hit, and no other principal can find, read or
  remove a tenant's chunk, not even under the key a namespace keyed by a constant
  would give it.
* a tenant name is accepted only with that tenant's secret; instances of one tenant
  serve each other and nobody else; a node with only a tenants file has no shared
  secret.
* a bad tenants file is refused with an error naming the file and the line.
* drops from a shared store are attributed to the principal whose chunk went.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from peer_clients import MALLORY, MALLORY_SECRET, SECRET, VICTIM, VICTIM_SECRET, frame_of, port_of, start_node  # noqa: E402
from peer_node import PeerNode  # noqa: E402

from lmcache_backend_peer import PeerClient, create_peer_backend  # noqa: E402
from lmcache_backend_peer import protocol as p  # noqa: E402
from lmcache_backend_peer.backend import PeerBackend  # noqa: E402
from lmcache_core.keys import HASH_BYTES, ChunkKey  # noqa: E402
from lmcache_core.testing import make_context, random_chunk, random_key  # noqa: E402

N_FORGED = 16
GUESSABLE_NS_KEY = b"lmcache-peer/tenant-namespace/v1"


def guessable_tenant_key(tenant: str, key: ChunkKey) -> ChunkKey:
    """Where a node keyed by a constant in the source would store ``tenant``'s ``key``:
    anyone could compute it."""
    ns = hashlib.blake2b(tenant.encode() + b"\0" + key.namespace, digest_size=HASH_BYTES, key=GUESSABLE_NS_KEY).digest()
    return ChunkKey(ns, key.chunk_hash)


@pytest.fixture(scope="module")
def tenant_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PeerNode]:
    """A node with a shared secret and two tenants, keeping frames in a FrameStore
    (no shared memory)."""
    d = tmp_path_factory.mktemp("tenant-node")
    (d / "tenants").write_text(f"# name secret\n{VICTIM} {VICTIM_SECRET}\n{MALLORY} {MALLORY_SECRET}\n")
    node = start_node(d, ["--max-size", "64MiB", "--tenants-file", str(d / "tenants")])
    yield node
    node.stop()


def tier(node: PeerNode, secret: str, tenant: str | None = None) -> PeerBackend:
    section = {
        "peers": [node.address],
        "secret": secret,
        "push": True,
        "max_size": 0,
        "timeout_s": 2.0,
        "retry_after_s": 0.0,
        **({"tenant": tenant} if tenant else {}),
    }
    b = create_peer_backend(section, make_context())
    assert isinstance(b, PeerBackend)
    return b


def test_a_chunk_written_without_the_tenants_key_is_never_its_hit(tenant_node: PeerNode) -> None:
    import torch

    victim, mallory, shared = (
        tier(tenant_node, VICTIM_SECRET, VICTIM),
        tier(tenant_node, MALLORY_SECRET, MALLORY),
        tier(tenant_node, SECRET),
    )
    try:
        own = random_key()
        genuine = random_chunk(shape=(8, 64), seed=1)
        assert victim.put(own, genuine)
        forged_keys = [random_key() for _ in range(N_FORGED)]
        forged = random_chunk(shape=(8, 64), seed=666)
        # Another tenant and a holder of the node's shared secret both write valid frames
        # under the victim's keys, and try to overwrite the victim's existing chunk.
        for i, k in enumerate(forged_keys):
            assert (mallory if i % 2 else shared).put(k, forged)
        assert mallory.put(own, forged) and shared.put(own, forged)
        out = torch.zeros_like(forged)
        hits = sum(victim.get(k, out) for k in forged_keys)
        print(f"tenant isolation: forged chunks served to the victim as hits: {hits}/{N_FORGED}")
        assert hits == 0 and victim.contains(forged_keys) == 0
        assert victim.get(own, out) and torch.equal(out, genuine)  # its own chunk, untouched
        # Control: the forgers do read back what they wrote (the frames are valid hits
        # in their own namespaces), and a shared-secret reader is one trust domain.
        assert mallory.get(forged_keys[1], out) and torch.equal(out, forged)
        assert shared.get(forged_keys[0], out) and torch.equal(out, forged)
        assert mallory.get(own, out) and torch.equal(out, forged)
    finally:
        for b in (victim, mallory, shared):
            b.close()


def test_a_tenant_name_with_another_tenants_secret_is_refused(tenant_node: PeerNode) -> None:
    from lmcache_backend_peer.auth import AuthError

    for name, secret in ((VICTIM, MALLORY_SECRET), (VICTIM, SECRET), ("t-nobody", MALLORY_SECRET)):
        client = PeerClient(port_of(tenant_node), secret.encode(), timeout=2.0, tenant=name)
        try:
            with pytest.raises(AuthError):
                client.lookup([random_key()])
        finally:
            client.close()


def test_tenants_file_errors_name_the_line(tmp_path: Path) -> None:
    from lmcache_backend_peer.tenants import load_tenants

    tf = tmp_path / "tenants"
    for text, match in (
        (f"{VICTIM} short\n", r":1: tenant 't-victim'.*at least 16"),
        (f"{VICTIM} {VICTIM_SECRET}\n{VICTIM} {MALLORY_SECRET}\n", ":2: tenant 't-victim' is listed twice"),
        ("bad/name x\n", ":1: tenant name"),
        ("# nothing\n", "no tenants"),
    ):
        tf.write_text(text)
        with pytest.raises(ValueError, match=match):
            load_tenants(tf)


def test_instances_of_one_tenant_serve_each_other_and_nobody_else() -> None:
    import torch

    a = create_peer_backend(
        {"listen": "127.0.0.1:0", "secret": VICTIM_SECRET, "tenant": VICTIM, "max_size": "8MiB"}, make_context()
    )
    assert isinstance(a, PeerBackend) and a.server is not None
    host, port = a.server.address
    k, data = random_key(), random_chunk(shape=(8, 64), seed=5)
    assert a.put(k, data)
    b = create_peer_backend(
        {"peers": [f"{host}:{port}"], "secret": VICTIM_SECRET, "tenant": VICTIM, "max_size": 0}, make_context()
    )
    c = create_peer_backend({"peers": [f"{host}:{port}"], "secret": VICTIM_SECRET, "max_size": 0}, make_context())
    try:
        out = torch.zeros_like(data)
        assert b.get(k, out) and torch.equal(out, data)
        assert c.contains([k]) == 0 and not c.get(k, out)  # right secret, but not as the tenant
    finally:
        for x in (a, b, c):
            x.close()


def test_node_with_only_a_tenants_file_has_no_shared_secret_and_rejects_a_bad_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from lmcache_backend_peer import cli
    from lmcache_backend_peer.auth import AuthError

    tf = tmp_path / "tenants"
    tf.write_text(f"{VICTIM} {VICTIM_SECRET}\n")
    node = PeerNode(["--max-size", "8MiB", "--tenants-file", str(tf)])
    try:
        victim = PeerClient(port_of(node), VICTIM_SECRET.encode(), timeout=2.0, tenant=VICTIM)
        assert victim.lookup([random_key()]) == 0
        victim.close()
        # Nobody holds a shared secret: even the tenant's secret without the name is refused.
        untenanted = PeerClient(port_of(node), VICTIM_SECRET.encode(), timeout=2.0)
        with pytest.raises(AuthError):
            untenanted.lookup([random_key()])
        untenanted.close()
    finally:
        node.stop()
    tf.write_text(f"{VICTIM} short\n")
    monkeypatch.delenv("LMCACHE_PEER_SECRET", raising=False)
    with pytest.raises(SystemExit) as exc:
        cli.main(["--listen", "127.0.0.1:0", "--tenants-file", str(tf)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"--tenants-file: {tf}:1: tenant 't-victim'" in err and "at least 16" in err, err


def test_a_shared_secret_client_cannot_address_a_tenants_chunk(tenant_node: PeerNode) -> None:
    address = port_of(tenant_node)
    victim = PeerClient(address, VICTIM_SECRET.encode(), timeout=2.0, tenant=VICTIM)
    shared = PeerClient(address, SECRET.encode(), timeout=2.0)
    try:
        keys = [random_key() for _ in range(8)]
        frames = [frame_of(k, i) for i, k in enumerate(keys)]
        for k, f in zip(keys, frames):
            assert victim.put(k, f)
        # The attack: every key the shared secret's holder can compute for the victim's
        # chunks (under a namespace keyed by a constant, and the client keys themselves).
        targets = [guessable_tenant_key(VICTIM, k) for k in keys] + keys
        found = sum(shared.lookup([t]) for t in targets)
        served = sum(f is not None for f in shared.get(targets))
        removed = shared.remove(targets)
        print(f"shared-secret client on the victim's keys: {found} found, {served} served, {removed} removed of {len(targets)}")
        assert (found, served, removed) == (0, 0, 0)
        # The victim's chunks survived, byte for byte (negative control: they are there).
        assert victim.lookup(keys) == len(keys)
        assert [bytes(f) if f is not None else None for f in victim.get(keys)] == frames
        # Positive control: the shared client's requests do reach the store (its own
        # chunk under the same kind of key is found, served and removed).
        own = random_key()
        assert shared.put(own, frame_of(own, 99))
        assert shared.lookup([own]) == 1 and shared.get([own])[0] is not None and shared.remove([own]) == 1
        assert victim.lookup([own]) == 0  # and the tenant never sees the shared part
    finally:
        victim.close()
        shared.close()


def test_the_namespace_key_is_per_process_and_each_principal_has_its_own(tmp_path: Path) -> None:
    from lmcache_backend_peer.tenants import tenant_key

    k = ChunkKey(bytes(range(16)), bytes(range(16, 32)))
    here = {t: tenant_key(t, k) for t in (None, VICTIM, "t-other")}
    assert len(set(here.values()) | {k, guessable_tenant_key(VICTIM, k)}) == 5
    assert all(m.chunk_hash == k.chunk_hash for m in here.values())
    # Another process (another node) derives other namespaces for the same principals.
    code = (
        "from lmcache_backend_peer.tenants import tenant_key; from lmcache_core.keys import ChunkKey; "
        "k = ChunkKey(bytes(range(16)), bytes(range(16, 32))); "
        f"print(tenant_key(None, k).namespace.hex(), tenant_key({VICTIM!r}, k).namespace.hex())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout.split()
    assert out == [out[0], out[1]] and out[0] != here[None].namespace.hex() and out[1] != here[VICTIM].namespace.hex()


def test_drops_of_the_shared_principals_mapped_part_are_attributed_to_it() -> None:
    from lmcache_backend_peer.evictions import EvictionLog
    from lmcache_backend_peer.store import FrameStore
    from lmcache_backend_peer.tenants import TenantSource

    keys = [random_key() for _ in range(3)]
    frames = [frame_of(k, i) for i, k in enumerate(keys)]
    store = FrameStore(2 * len(frames[0]))
    log = EvictionLog(8)
    log.watch(store, [VICTIM])
    TenantSource(store, None).put_frame(keys[0], frames[0])
    TenantSource(store, VICTIM).put_frame(keys[1], frames[1])
    TenantSource(store, VICTIM).put_frame(keys[2], frames[2])  # evicts the shared part's key
    assert TenantSource(store, None).contains([keys[0]]) == 0 and TenantSource(store, VICTIM).contains(keys[1:]) == 2
    assert log.since(None, 0)[2] == [p.key_bytes(keys[0])] and log.since(VICTIM, 0)[2] == []
    assert TenantSource(store, VICTIM).remove(keys[1]) and not store.remove(keys[2])  # raw keys reach nothing
    assert log.since(VICTIM, 0)[2] == [p.key_bytes(keys[1])] and log.unattributed == 0
