"""``lmcache-core erase`` against real tiers: a disk tier in tmp_path, S3 on moto's
server on loopback, a redis-server on loopback. Chunks of two namespaces are stored,
one namespace is erased, and a fresh tier of each kind then misses every erased
chunk and still serves every chunk of the other (the negative control); a stopped
server makes the erase partial: exit status 1 and the tier named."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from redis_server import RedisServer, redis_server  # noqa: E402,F401 - fixtures
from s3_server import MotoS3, s3_server  # noqa: E402,F401 - fixtures

from lmcache_core import cli  # noqa: E402
from lmcache_core.keys import ChunkKey, KeyNamespace  # noqa: E402
from lmcache_core.plugins import PluginManager  # noqa: E402
from lmcache_core.backend import BackendContext, StorageBackend  # noqa: E402
from lmcache_core.config import BackendSection  # noqa: E402
from lmcache_core.testing import make_context, random_chunk  # noqa: E402

N = 5  # chunks per namespace
SHAPE = (2, 16)


@pytest.fixture(scope="module")
def pm() -> PluginManager:
    return PluginManager()


@pytest.fixture
def bucket(s3_server: MotoS3) -> str:
    return s3_server.make_bucket()


def sections(tmp_path: Path, s3: MotoS3, bucket: str, redis_url: str, prefix: str) -> list[dict[str, Any]]:
    return [
        {"name": "local_cpu", "max_size": "16MiB"},
        {"name": "disk", "path": str(tmp_path / "disk"), "max_size": "64MiB"},
        s3.section(bucket),
        {"name": "redis", "url": redis_url, "prefix": prefix},
    ]


def write_config(tmp_path: Path, backends: list[dict[str, Any]]) -> Path:
    """The config erase reads; its control directory is this test's own (no engine of
    another test is asked about its CPU tier)."""
    path = tmp_path / "lmcache.yaml"
    cfg = {"chunk_size": 16, "serde": "raw", "backends": backends, "quarantine_dir": str(tmp_path / "control")}
    path.write_text(yaml.safe_dump(cfg))
    return path


def open_tier(pm: PluginManager, section: dict[str, Any], i: int) -> StorageBackend:
    ctx: BackendContext = make_context(key_path=f"backends[{i}]")
    return pm.create_backend(BackendSection(**section), ctx)


def fill(pm: PluginManager, backends: list[dict[str, Any]], keys: list[ChunkKey]) -> dict[ChunkKey, torch.Tensor]:
    data = {k: random_chunk(SHAPE, seed=i) for i, k in enumerate(keys)}
    for i, section in enumerate(backends[1:], 1):
        tier = open_tier(pm, section, i)
        try:
            for k, t in data.items():
                assert tier.put(k, t), (section["name"], k)
            assert tier.contains(keys) == len(keys)
        finally:
            tier.close()
    return data


def held(pm: PluginManager, section: dict[str, Any], i: int, data: dict[ChunkKey, torch.Tensor]) -> int:
    """How many of ``data``'s chunks a fresh tier of ``section`` serves, byte for byte."""
    tier = open_tier(pm, section, i)
    try:
        n = 0
        for k, t in data.items():
            out = torch.empty_like(t)
            if tier.contains([k]) == 1 and tier.get(k, out) and torch.equal(out, t):
                n += 1
        return n
    finally:
        tier.close()


def two_namespaces() -> tuple[KeyNamespace, KeyNamespace, list[ChunkKey], list[ChunkKey]]:
    a = KeyNamespace(model="model-a", layout="test", dtype="float16")
    b = KeyNamespace(model="model-b", layout="test", dtype="float16")
    hashes = [bytes([i]) * 16 for i in range(N)]  # the same hashes: only the namespace differs
    return a, b, a.keys(hashes), b.keys(hashes)


def counts(out: str) -> dict[str, str]:
    """backends[i] (name) -> 'RESULT CHUNKS' from the report."""
    rows = {}
    for line in out.splitlines():
        if line.startswith("backends["):
            where, rest = line.split(")", 1)
            rows[where + ")"] = " ".join(rest.split()[:2])
    return rows


@pytest.fixture
def tiers(
    tmp_path: Path, s3_server: MotoS3, bucket: str, redis_server: RedisServer, request: pytest.FixtureRequest
) -> Iterator[list[dict[str, Any]]]:
    yield sections(tmp_path, s3_server, bucket, redis_server.url, f"erase:{request.node.name}:")


def test_erase_one_namespace_from_every_tier(
    tmp_path: Path, tiers: list[dict[str, Any]], pm: PluginManager, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b, keys_a, keys_b = two_namespaces()
    data = fill(pm, tiers, keys_a + keys_b)
    data_a = {k: data[k] for k in keys_a}
    data_b = {k: data[k] for k in keys_b}
    cfg = write_config(tmp_path, tiers)

    rc = cli.main(["erase", "--config", str(cfg), "--namespace", a.id.hex(), "--dry-run"], plugin_manager=pm)
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = counts(out)
    for i in (1, 2, 3):
        assert rows[f"backends[{i}] ({tiers[i]['name']})"] == f"would-erase {N}", out
    for i in (1, 2, 3):  # a dry run deletes nothing
        assert held(pm, tiers[i], i, data) == 2 * N

    rc = cli.main(["erase", "--config", str(cfg), "--namespace", a.id.hex()], plugin_manager=pm)
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = counts(out)
    assert rows["backends[0] (local_cpu)"] == "erased 0", out  # no engine runs: tests/core/test_control.py
    for i in (1, 2, 3):
        assert rows[f"backends[{i}] ({tiers[i]['name']})"] == f"erased {N}", out
        assert held(pm, tiers[i], i, data_a) == 0, tiers[i]["name"]  # every erased chunk misses
        assert held(pm, tiers[i], i, data_b) == N, tiers[i]["name"]  # the other model's all hit
    assert "PARTIAL" not in out

    # again: nothing of a is left to erase, and b is still whole
    rc = cli.main(["erase", "--config", str(cfg), "--namespace", a.id.hex()], plugin_manager=pm)
    out = capsys.readouterr().out
    assert rc == 0
    assert all(rows == "erased 0" for where, rows in counts(out).items() if "local_cpu" not in where), out

    rc = cli.main(["erase", "--config", str(cfg), "--all"], plugin_manager=pm)
    out = capsys.readouterr().out
    assert rc == 0, out
    for i in (1, 2, 3):
        assert counts(out)[f"backends[{i}] ({tiers[i]['name']})"] == f"erased {N}", out
        assert held(pm, tiers[i], i, data_b) == 0


def test_erase_keeps_foreign_names(
    tmp_path: Path, tiers: list[dict[str, Any]], pm: PluginManager, redis_server: RedisServer
) -> None:
    """--all takes chunk keys only: other names under the redis prefix stay."""
    prefix = tiers[3]["prefix"]
    c = redis_server.client()
    c.set(prefix + "not-a-chunk", b"x")
    c.set(prefix + "v1-zz", b"x")
    cfg = write_config(tmp_path, tiers)
    assert cli.main(["erase", "--config", str(cfg), "--all"], plugin_manager=pm) == 0
    assert c.get(prefix + "not-a-chunk") == b"x" and c.get(prefix + "v1-zz") == b"x"


def test_erase_with_servers_down_is_partial(
    tmp_path: Path, s3_server: MotoS3, bucket: str, pm: PluginManager, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b, keys_a, keys_b = two_namespaces()
    down_redis = RedisServer()
    down_s3 = MotoS3()
    try:
        down_bucket = down_s3.make_bucket()
        backends = sections(tmp_path, down_s3, down_bucket, down_redis.url, "erase:down:")
        data = fill(pm, backends, keys_a + keys_b)
        down_redis.stop()
        down_s3.stop()
        cfg = write_config(tmp_path, backends)
        rc = cli.main(["erase", "--config", str(cfg), "--namespace", a.id.hex()], plugin_manager=pm)
        out = capsys.readouterr().out
        assert rc == 1, out
        rows = counts(out)
        assert rows["backends[1] (disk)"] == f"erased {N}", out  # the tier that answers is erased
        assert rows["backends[2] (s3)"].startswith("FAILED"), out
        assert rows["backends[3] (redis)"].startswith("FAILED"), out
        partial = [line for line in out.splitlines() if line.startswith("PARTIAL")]
        assert partial and "backends[2] (s3)" in partial[0] and "backends[3] (redis)" in partial[0], out
        assert held(pm, backends[1], 1, {k: data[k] for k in keys_a}) == 0
        assert held(pm, backends[1], 1, {k: data[k] for k in keys_b}) == N
    finally:
        down_redis.stop()
        down_s3.stop()


def test_erase_peer_tier_without_admin_urls_fails(tmp_path: Path, pm: PluginManager, capsys: pytest.CaptureFixture[str]) -> None:
    """A peer tier without admin_urls cannot reach the nodes' memory: the erase fails
    honestly, saying what to give, instead of counting 0."""
    backends = [
        {"name": "disk", "path": str(tmp_path / "disk")},
        {"name": "peer", "peers": ["127.0.0.1:9"], "secret": "s" * 32, "max_size": 0},
    ]
    cfg = write_config(tmp_path, backends)
    rc = cli.main(["erase", "--config", str(cfg), "--all"], plugin_manager=pm)
    out = capsys.readouterr().out
    assert rc == 1, out
    assert counts(out)["backends[1] (peer)"].startswith("FAILED"), out
    assert "admin_urls and admin_token_file" in out, out
    assert "PARTIAL: not erased from backends[1] (peer)" in out


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Any]:
    from test_peer_admin import SECRET, Admin

    (tmp_path / "node").mkdir()
    a = Admin(tmp_path / "node", ["--max-size", "64MiB"])
    a.secret = SECRET
    yield a
    a.stop()


def peer_section(node: Any, token: Path) -> dict[str, Any]:
    return {
        "name": "peer",
        "peers": [f"127.0.0.1:{node.node.port}"],
        "secret": node.secret,
        "push": True,
        "max_size": 0,
        "admin_urls": [node.url],
        "admin_token_file": str(token),
    }


def test_erase_reaches_a_cache_node_through_its_admin_api(
    tmp_path: Path, node: Any, pm: PluginManager, capsys: pytest.CaptureFixture[str]
) -> None:
    """A peer tier with admin_urls: --namespace erases the node's chunks of that
    namespace (a fresh tier then misses every one) and keeps the other's; --tenant
    erases the ids the disk tier records, the peer noted as keeping none; a wrong
    token and a node that is down are FAILED, named, exit 1."""
    from test_peer_admin import TOKEN, private_file

    token = private_file(tmp_path / "admin.token", TOKEN + "\n")
    backends = [{"name": "disk", "path": str(tmp_path / "disk")}, peer_section(node, token)]
    a, b, keys_a, keys_b = two_namespaces()
    data = fill(pm, [{"name": "local_cpu"}, *backends], keys_a + keys_b)
    data_a, data_b = {k: data[k] for k in keys_a}, {k: data[k] for k in keys_b}
    assert held(pm, backends[1], 1, data) == 2 * N
    cfg = write_config(tmp_path, backends)

    rc = cli.main(["erase", "--config", str(cfg), "--namespace", a.id.hex(), "--dry-run"], plugin_manager=pm)
    out = capsys.readouterr().out
    assert rc == 0 and counts(out)["backends[1] (peer)"] == f"would-erase {N}", out
    rc = cli.main(["erase", "--config", str(cfg), "--namespace", a.id.hex()], plugin_manager=pm)
    out = capsys.readouterr().out
    assert rc == 0 and counts(out)["backends[1] (peer)"] == f"erased {N}", out
    assert held(pm, backends[1], 1, data_a) == 0
    assert held(pm, backends[1], 1, data_b) == N  # the control: the other namespace stays

    ns = open_engine(pm, backends, KeyNamespace(model="model-t", layout="t", dtype="f"), tenant="acme")
    data_t = fill(pm, [{"name": "local_cpu"}, *backends], ns.keys(HASHES))
    rc = cli.main(["erase", "--config", str(cfg), "--tenant", "acme"], plugin_manager=pm)
    out = capsys.readouterr().out
    assert rc == 0, out
    assert counts(out)["backends[1] (peer)"] == f"erased {N}", out
    assert "keeps no namespace records: erased the ids the other tiers record" in out, out
    assert held(pm, backends[1], 1, data_t) == 0 and held(pm, backends[1], 1, data_b) == N

    wrong = private_file(tmp_path / "wrong.token", "w" * 32 + "\n")
    cfg = write_config(tmp_path, [backends[0], {**backends[1], "admin_token_file": str(wrong)}])
    rc = cli.main(["erase", "--config", str(cfg), "--all"], plugin_manager=pm)
    out = capsys.readouterr().out
    assert rc == 1 and counts(out)["backends[1] (peer)"].startswith("FAILED"), out
    assert "answered 401" in out and held(pm, backends[1], 1, data_b) == N
    node.stop()
    cfg = write_config(tmp_path, backends)
    rc = cli.main(["erase", "--config", str(cfg), "--all"], plugin_manager=pm)
    out = capsys.readouterr().out
    assert rc == 1 and "PARTIAL: not erased from backends[1] (peer)" in out, out


def test_erase_opens_a_listening_peer_tier_without_serving(
    tmp_path: Path, node: Any, pm: PluginManager, capsys: pytest.CaptureFixture[str]
) -> None:
    """The config a running engine uses, whose peer tier listens on a port the engine
    holds: erase opens the tier without listening (it would fail: address in use) and
    erases through the node's admin API. The control: an engine opened from the same
    section while the port is held fails to start."""
    import socket

    from lmcache_core.config import ConfigError
    from test_peer_admin import TOKEN, private_file

    token = private_file(tmp_path / "admin.token", TOKEN + "\n")
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        section = {**peer_section(node, token), "listen": f"127.0.0.1:{taken.getsockname()[1]}"}
        a, _, keys_a, _ = two_namespaces()
        data = fill(pm, [{"name": "local_cpu"}, {**section, "listen": None}], keys_a)
        cfg = write_config(tmp_path, [section])
        rc = cli.main(["erase", "--config", str(cfg), "--namespace", a.id.hex()], plugin_manager=pm)
        out = capsys.readouterr().out
        assert rc == 0 and counts(out)["backends[0] (peer)"] == f"erased {N}", out
        assert held(pm, {**section, "listen": None}, 0, data) == 0
        with pytest.raises(ConfigError, match="cannot listen"):
            open_tier(pm, section, 0)
    finally:
        taken.close()


def test_erase_from_mooncake_store(tmp_path: Path, pm: PluginManager, capsys: pytest.CaptureFixture[str]) -> None:
    """Mooncake Store through its master's remove_by_regex: --namespace takes that
    namespace's objects under the tier's key_prefix and no other (another prefix's
    objects of the same namespace stay: the control); --tenant erases the ids the disk
    tier records (Mooncake keeps no records, noted); a dry run cannot count (FAILED,
    exit 1, nothing deleted); a master that is down is FAILED."""
    from mooncake_server import MooncakeMaster, SegmentOwner

    (tmp_path / "mc").mkdir()
    master = MooncakeMaster(tmp_path / "mc")
    owner = SegmentOwner(master, size_mib=64)
    try:
        mc = master.section(key_prefix="erase.t/", staging_size="8MiB")
        other = master.section(key_prefix="erase-other/", staging_size="8MiB")
        backends = [{"name": "disk", "path": str(tmp_path / "disk")}, mc]
        a, b, keys_a, keys_b = two_namespaces()
        data = fill(pm, [{"name": "local_cpu"}, *backends, other], keys_a + keys_b)
        data_a, data_b = {k: data[k] for k in keys_a}, {k: data[k] for k in keys_b}
        cfg = write_config(tmp_path, backends)

        rc = cli.main(["erase", "--config", str(cfg), "--namespace", a.id.hex(), "--dry-run"], plugin_manager=pm)
        out = capsys.readouterr().out
        assert rc == 1 and counts(out)["backends[1] (mooncake)"].startswith("FAILED"), out
        assert "cannot count without deleting" in out and held(pm, mc, 1, data) == 2 * N
        rc = cli.main(["erase", "--config", str(cfg), "--namespace", a.id.hex()], plugin_manager=pm)
        out = capsys.readouterr().out
        assert rc == 0 and counts(out)["backends[1] (mooncake)"] == f"erased {N}", out
        assert held(pm, mc, 1, data_a) == 0 and held(pm, mc, 1, data_b) == N
        assert held(pm, other, 2, data) == 2 * N  # another key_prefix is not this tier's

        ns = open_engine(pm, backends, KeyNamespace(model="model-t", layout="t", dtype="f"), tenant="acme")
        data_t = fill(pm, [{"name": "local_cpu"}, *backends], ns.keys(HASHES))
        rc = cli.main(["erase", "--config", str(cfg), "--tenant", "acme"], plugin_manager=pm)
        out = capsys.readouterr().out
        assert rc == 0 and counts(out)["backends[1] (mooncake)"] == f"erased {N}", out
        assert "keeps no namespace records" in out
        assert held(pm, mc, 1, data_t) == 0 and held(pm, mc, 1, data_b) == N

        owner.kill()
        master.kill()
        down = {**mc, "verify_on_start": False}
        cfg = write_config(tmp_path, [backends[0], down])
        rc = cli.main(["erase", "--config", str(cfg), "--all"], plugin_manager=pm)
        out = capsys.readouterr().out
        assert rc == 1 and "PARTIAL: not erased from backends[1] (mooncake)" in out, out
    finally:
        owner.kill()
        master.kill()


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["--namespace", "abc"],
        ["--namespace", "AB" * 16],
        ["--namespace", "00" * 16, "--all"],
        ["--model", ""],
        ["--tenant", ""],
        ["--model", "m", "--all"],
        ["--tenant", "t", "--namespace", "00" * 16],
    ],
)
def test_erase_bad_arguments(tmp_path: Path, args: list[str], pm: PluginManager, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write_config(tmp_path, [{"name": "disk", "path": str(tmp_path / "disk")}])
    try:
        rc = cli.main(["erase", "--config", str(cfg), *args], plugin_manager=pm)
    except SystemExit as e:  # argparse: usage, then one error line
        rc = int(e.code or 0)
    err = capsys.readouterr().err
    assert rc == 2
    assert len([line for line in err.splitlines() if "error:" in line]) == 1, err
    assert not (tmp_path / "disk").exists() or not any((tmp_path / "disk").glob("??/*"))


def test_engine_logs_its_namespace_id(tmp_path: Path, pm: PluginManager, caplog: pytest.LogCaptureFixture) -> None:
    """What an operator gives --namespace: the id each engine logs at start."""
    from lmcache_core.config import CoreConfig
    from lmcache_core.engine import CacheEngine

    ns = KeyNamespace(model="model-a", layout="test", dtype="float16")
    cfg = CoreConfig(chunk_size=16, backends=[BackendSection(name="local_cpu", max_size="4MiB")], staging_size="4MiB")
    with caplog.at_level("INFO", logger="lmcache_core.engine"):
        engine = CacheEngine(cfg, namespace=ns, plugins=pm)
        engine.close()
    assert f"key namespace {ns.id.hex()} (model model-a, rank 0 of 1, tenant salt none)" in caplog.text


def test_erase_bad_config(tmp_path: Path, pm: PluginManager, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("backends: [{name: nosuchtier}]\n")
    rc = cli.main(["erase", "--config", str(cfg), "--all"], plugin_manager=pm)
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("error:") and len(err.strip().splitlines()) == 1, err
    assert "nosuchtier" in err, err  # the line names what is wrong, not only that something is
    cfg.write_text("chunk_sise: 5\nbackends: [{name: local_cpu, bogus: 1}]\n")
    rc = cli.main(["erase", "--config", str(cfg), "--all"], plugin_manager=pm)
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "chunk_sise" in err and str(cfg) in err, err


# --- by name: the namespace records engines leave in the tiers they write -------------


def open_engine(pm: PluginManager, backends: list[dict[str, Any]], ns: KeyNamespace, **cfg: Any) -> KeyNamespace:
    """Start (and close) an engine over ``backends``, as a vLLM worker would: it records
    its namespace in every tier it writes. Its namespace (salt applied) is returned."""
    from lmcache_core.config import CoreConfig
    from lmcache_core.engine import CacheEngine

    config = CoreConfig(chunk_size=16, backends=[BackendSection(**b) for b in backends], staging_size="4MiB", **cfg)
    engine = CacheEngine(config, namespace=ns, plugins=pm)
    try:
        return engine.namespace
    finally:
        engine.close()


def listed(pm: PluginManager, section: dict[str, Any], i: int, ns: KeyNamespace) -> int:
    """How many chunk keys of ``ns`` a listing of the tier finds (a direct scan)."""
    from lmcache_core.backend import EraseMatch

    tier = open_tier(pm, section, i)
    try:
        return tier.erase(EraseMatch(frozenset([ns.id])), dry_run=True)
    finally:
        tier.close()


HASHES = [bytes([i]) * 16 for i in range(N)]


def test_erase_one_tenant_of_three_from_every_shared_tier(
    tmp_path: Path, tiers: list[dict[str, Any]], pm: PluginManager, capsys: pytest.CaptureFixture[str]
) -> None:
    """Three tenants (a label and a salt each) on disk, S3 and redis: --tenant beta
    leaves 0 of beta's chunks in a listing of every tier and 100% of the others'."""
    base = KeyNamespace(model="model-a", layout="test", dtype="float16")
    spaces = {t: open_engine(pm, tiers, base, tenant=t, tenant_salt=f"salt-{t}") for t in ("acme", "beta", "gamma")}
    assert len({ns.id for ns in spaces.values()}) == 3
    data = {t: fill(pm, tiers, ns.keys(HASHES)) for t, ns in spaces.items()}
    cfg = write_config(tmp_path, tiers)

    rc = cli.main(["erase", "--config", str(cfg), "--tenant", "beta"], plugin_manager=pm)
    out = capsys.readouterr().out
    assert rc == 0, out
    assert f"erase tenant 'beta': namespace(s) {spaces['beta'].id.hex()}:" in out, out
    rows = counts(out)
    for i in (1, 2, 3):
        assert rows[f"backends[{i}] ({tiers[i]['name']})"] == f"erased {N}", out
        assert listed(pm, tiers[i], i, spaces["beta"]) == 0, tiers[i]["name"]
        assert held(pm, tiers[i], i, data["beta"]) == 0, tiers[i]["name"]
        for other in ("acme", "gamma"):  # the control: the other tenants keep every chunk
            assert listed(pm, tiers[i], i, spaces[other]) == N, (tiers[i]["name"], other)
            assert held(pm, tiers[i], i, data[other]) == N, (tiers[i]["name"], other)


def test_erase_a_model_takes_every_rank_and_no_other_model(
    tmp_path: Path, pm: PluginManager, capsys: pytest.CaptureFixture[str]
) -> None:
    backends = [{"name": "local_cpu", "max_size": "4MiB"}, {"name": "disk", "path": str(tmp_path / "disk")}]
    a = [open_engine(pm, backends, KeyNamespace(model="model-a", layout="t", dtype="f", world_size=2, rank=r)) for r in (0, 1)]
    b = open_engine(pm, backends, KeyNamespace(model="model-b", layout="t", dtype="f"))
    data_a = fill(pm, backends, [k for ns in a for k in ns.keys(HASHES)])
    data_b = fill(pm, backends, b.keys(HASHES))
    cfg = write_config(tmp_path, backends)

    rc = cli.main(["erase", "--config", str(cfg), "--model", "model-a", "--dry-run"], plugin_manager=pm)
    out = capsys.readouterr().out
    assert rc == 0 and counts(out)["backends[1] (disk)"] == f"would-erase {2 * N}", out
    assert held(pm, backends[1], 1, data_a) == 2 * N  # a dry run deletes nothing

    rc = cli.main(["erase", "--config", str(cfg), "--model", "model-a"], plugin_manager=pm)
    out = capsys.readouterr().out
    assert rc == 0 and counts(out)["backends[1] (disk)"] == f"erased {2 * N}", out
    assert held(pm, backends[1], 1, data_a) == 0
    assert held(pm, backends[1], 1, data_b) == N

    # a name no tier records: nothing erased, the recorded names shown, not an error
    rc = cli.main(["erase", "--config", str(cfg), "--model", "model-c"], plugin_manager=pm)
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "no tier records a namespace of model 'model-c' (recorded: 'model-a', 'model-b')" in out, out
    assert held(pm, backends[1], 1, data_b) == N


def test_erase_by_name_with_a_tier_down_is_partial(tmp_path: Path, pm: PluginManager, capsys: pytest.CaptureFixture[str]) -> None:
    """redis stopped: its records cannot be read, so namespaces recorded only there
    would be missed: exit 1 naming it; the disk tier is still erased."""
    down = RedisServer()
    try:
        backends = [
            {"name": "disk", "path": str(tmp_path / "disk")},
            {"name": "redis", "url": down.url, "prefix": "erase:byname:"},
        ]
        ns = open_engine(pm, backends, KeyNamespace(model="model-a", layout="t", dtype="f"), tenant="acme")
        data = fill(pm, [{"name": "local_cpu"}, *backends], ns.keys(HASHES))
        down.stop()
        cfg = write_config(tmp_path, backends)
        rc = cli.main(["erase", "--config", str(cfg), "--tenant", "acme"], plugin_manager=pm)
        out = capsys.readouterr().out
        assert rc == 1, out
        rows = counts(out)
        assert rows["backends[0] (disk)"] == f"erased {N}", out
        assert rows["backends[1] (redis)"].startswith("FAILED"), out
        assert "PARTIAL: not erased from backends[1] (redis)" in out
        assert held(pm, backends[0], 0, data) == 0
    finally:
        down.stop()


def test_disk_records_are_read_without_following_links_or_blocking(tmp_path: Path, pm: PluginManager) -> None:
    """Names in the directory's root that only look like records: a link to a real
    record, a FIFO, a directory, an oversized file, a bad id; all skipped, in bounded
    time. The control: the one written by an engine is read."""
    import os

    from lmcache_core.namespaces import MAX_RECORD_BYTES, NamespaceRecord, parse_records

    backends = [{"name": "local_cpu", "max_size": "4MiB"}, {"name": "disk", "path": str(tmp_path / "disk")}]
    ns = open_engine(pm, backends, KeyNamespace(model="model-a", layout="t", dtype="f"), tenant="acme")
    root = tmp_path / "disk"
    real = root / f"LMCACHE_DISK_TIER.ns-{ns.id.hex()}"
    assert real.is_file()
    fake = [bytes([0xA0 + i]) * 16 for i in range(1, 6)]  # hex with letters: upper case differs
    os.symlink(real, root / f"LMCACHE_DISK_TIER.ns-{fake[0].hex()}")
    os.mkfifo(root / f"LMCACHE_DISK_TIER.ns-{fake[1].hex()}")
    (root / f"LMCACHE_DISK_TIER.ns-{fake[2].hex()}").mkdir()
    (root / f"LMCACHE_DISK_TIER.ns-{fake[3].hex()}").write_bytes(b" " * (MAX_RECORD_BYTES + 1))
    (root / f"LMCACHE_DISK_TIER.ns-{fake[4].hex().upper()}").write_bytes(real.read_bytes())
    tier = open_tier(pm, backends[1], 1)
    try:
        found = tier.namespace_records()
    finally:
        tier.close()
    assert set(found) == {ns.id}, sorted(k.hex() for k in found)
    records, skipped = parse_records(found)
    assert skipped == 0 and records == [NamespaceRecord.of(ns, "acme")]


def test_running_engines_erase_their_memory_after_the_slower_tiers(
    tmp_path: Path, pm: PluginManager, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Erased the other way round, a live engine's lookup between the two erases could
    read a chunk back from disk into its memory and go on serving it. The command's
    disk tier records, when it is erased, what the running engine's CPU tier holds:
    still every chunk (its memory is erased after); then both hold none."""
    from lmcache_core.config import CoreConfig
    from lmcache_core.engine import CacheEngine

    backends = [{"name": "local_cpu", "max_size": "16MiB"}, {"name": "disk", "path": str(tmp_path / "disk"), "max_size": "64MiB"}]
    config = CoreConfig(
        chunk_size=16,
        backends=[BackendSection(**b) for b in backends],
        staging_size="4MiB",
        quarantine_dir=str(tmp_path / "control"),
    )
    engine = CacheEngine(config, namespace=KeyNamespace(model="model-a", layout="test", dtype="float16"), plugins=pm)
    try:
        assert engine.store_hashes(HASHES, [random_chunk(SHAPE, seed=i) for i in range(N)]) == N
        assert engine.flush(30)
        cpu, disk = engine.tiers
        seen: list[int] = []
        erase_disk = type(disk).erase

        def recording(self: Any, match: Any, progress: Any = None, *, dry_run: bool = False) -> int:
            seen.append(cpu.stats().chunks)
            return erase_disk(self, match, progress, dry_run=dry_run)

        monkeypatch.setattr(type(disk), "erase", recording)
        cfg = write_config(tmp_path, backends)
        rc = cli.main(["erase", "--config", str(cfg), "--namespace", engine.namespace.id.hex()], plugin_manager=pm)
        out = capsys.readouterr().out
        assert rc == 0, out
        assert seen == [N], out
        rows = counts(out)
        assert rows["backends[0] (local_cpu)"] == f"erased {N}" and rows["backends[1] (disk)"] == f"erased {N}", out
        assert cpu.stats().chunks == 0 and engine.lookup_hashes(HASHES) == 0
    finally:
        engine.close()
