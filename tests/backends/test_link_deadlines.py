"""A call to a network tier ends within the tier's deadline whatever the link does, so a
slow or stalled link costs a miss, never a hung request. Redis has its own file
(test_redis_deadline.py), S3 too (test_s3_deadline.py); here the peer tier against a
real node and the Mooncake tier against a real master, each reached through a TCP proxy
on 127.0.0.1 that passes the server's bytes 16 at a time every 0.5 s (``trickle``) or
passes the first bytes of a reply and then nothing (``stall``). Negative control for
each: the same proxy passing bytes through serves a hit."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Iterator

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "soak"))
from faults import ChildFaultProxy, TcpFaultProxy, timed_call  # noqa: E402
from peer_node import PeerNode  # noqa: E402

from lmcache_backend_peer import create_peer_backend  # noqa: E402
from lmcache_core.testing import make_context, random_chunk, random_key  # noqa: E402

MARGIN_S = 1.5  # thread hand-offs and scheduling on 2 shared CPUs
SECRET = "link-deadline-secret-0123456789"
CHUNK = (128, 1024)  # 256 KiB of float16


# -- peer: a node behind the proxy ----------------------------------------------------------
@pytest.fixture
def peer_link(tmp_path: Path) -> Iterator[tuple[PeerNode, TcpFaultProxy]]:
    secret = tmp_path / "secret"
    secret.write_text(SECRET)
    secret.chmod(0o600)
    node = PeerNode(["--listen", "127.0.0.1:0", "--max-size", "64MiB"], secret)
    host, port = node.address.rsplit(":", 1)
    proxy = TcpFaultProxy((host, int(port)), trickle=(16, 0.5), stall_after=2000)
    yield node, proxy
    proxy.close()
    node.stop()


@pytest.mark.parametrize("mode", ["trickle", "stall"])
def test_peer_get_ends_at_its_deadline(peer_link: tuple[PeerNode, TcpFaultProxy], mode: str) -> None:
    _, proxy = peer_link
    host, port = proxy.address
    section = {"peers": [f"{host}:{port}"], "secret": SECRET, "max_size": 0, "push": True, "timeout_s": 1.5}
    tier = create_peer_backend(section, make_context())
    try:
        key, data = random_key(), random_chunk(shape=CHUNK, seed=5)
        assert tier.put(key, data)
        out = torch.empty_like(data)
        assert tier.get(key, out) and torch.equal(out, data)  # negative control: the link passes bytes
        proxy.set_mode(mode)
        hit, took = timed_call(lambda: tier.get(key, torch.empty_like(data)))
        assert hit is False
        assert took < 1.5 + MARGIN_S, f"a {mode} get took {took:.1f} s"
    finally:
        tier.close()


# -- mooncake: the master's RPC behind the proxy ---------------------------------------------
def test_mooncake_calls_end_at_their_deadline_when_the_master_trickles(tmp_path: Path) -> None:
    from mooncake_server import MooncakeMaster, SegmentOwner

    from lmcache_backend_mooncake import create_mooncake_backend

    master = MooncakeMaster(tmp_path)
    owner = SegmentOwner(master, size_mib=64)
    host, port = master.master.rsplit(":", 1)
    proxy = ChildFaultProxy((host, int(port)), trickle=(16, 0.5), stall_after=0)
    opts = master.options(
        master=f"{proxy.address[0]}:{proxy.address[1]}",
        timeout_s=1.0,
        down_cooldown_s=0.2,
        setup_timeout_s=5.0,
        staging_size="16MiB",
    )
    tier = create_mooncake_backend(opts, make_context())
    try:
        key, data = random_key(), random_chunk(seed=6)
        assert tier.put(key, data)
        out = torch.empty_like(data)
        assert tier.get(key, out) and torch.equal(out, data)  # negative control
        for mode in ("trickle", "stall"):
            proxy.set_mode(mode)
            time.sleep(0.3)  # past the health gate's cooldown from the switch's dropped connections
            for call in (lambda: tier.get(key, torch.empty_like(data)), lambda: tier.contains([key])):
                result, took = timed_call(call)
                assert result in (False, 0)
                assert took < 1.0 + MARGIN_S, f"a {mode} call took {took:.1f} s"
    finally:
        tier.close()
        proxy.close()
        owner.kill()
        master.kill()
