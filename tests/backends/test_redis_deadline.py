"""Every Redis call ends within ``call_timeout_s``: a slow link costs a miss, not a hang.

redis-py's ``socket_timeout`` bounds each socket read: through a link that trickles 16
bytes every 0.5 s a 256 KiB get was still blocked at 30 s, and a reply cut off
mid-way was retried and took 14 s. A TCP proxy on 127.0.0.1 in front of a real
``redis-server`` does both (``trickle``: the server's bytes 16 at a time every 0.5 s;
``stall``: the first bytes of a reply, then nothing). Each call must be a miss (or a
skipped put) within its deadline plus scheduling margin. Negative control: the same
proxy passing bytes through serves a hit, so the misses come from the deadline."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "soak"))
from faults import TcpFaultProxy, timed_call  # noqa: E402
from redis_server import RedisServer, redis_server  # noqa: E402,F401 - fixture

from lmcache_backend_redis import create_redis_backend  # noqa: E402
from lmcache_core.testing import make_context, random_chunk, random_key  # noqa: E402

MARGIN_S = 1.0  # scheduling slack on 2 shared CPUs
CHUNK = (128, 1024)  # 256 KiB of float16


@pytest.fixture
def proxy(redis_server: RedisServer) -> Iterator[TcpFaultProxy]:
    p = TcpFaultProxy(("127.0.0.1", redis_server.port), trickle=(16, 0.5), stall_after=1000)
    yield p
    p.close()


def _tier(port: int, prefix: str, **opts: Any) -> Any:
    section = {"url": f"redis://127.0.0.1:{port}/0", "prefix": prefix, "verify_on_start": False, "down_cooldown_s": 0, **opts}
    return create_redis_backend(section, make_context())


def _stored(redis_server: RedisServer, prefix: str) -> tuple[Any, torch.Tensor]:
    key, data = random_key(), random_chunk(shape=CHUNK, seed=9)
    direct = _tier(redis_server.port, prefix)
    try:
        assert direct.put(key, data)
    finally:
        direct.close()
    return key, data


def test_a_trickled_reply_ends_at_the_default_deadline(redis_server: RedisServer, proxy: TcpFaultProxy) -> None:
    key, data = _stored(redis_server, "dl-trickle:")
    tier = _tier(proxy.address[1], "dl-trickle:")
    try:
        out = torch.empty_like(data)
        assert tier.get(key, out) and torch.equal(out, data)  # negative control: the link passes bytes
        proxy.set_mode("trickle")
        hit, took = timed_call(lambda: tier.get(key, torch.empty_like(data)))
        assert hit is False
        assert took < tier.cfg.call_timeout_s + MARGIN_S, f"a trickled get took {took:.1f} s"
        assert tier.stats().errors >= 1
    finally:
        tier.close()


@pytest.mark.parametrize("op", ["get", "contains", "put"])
def test_a_reply_cut_off_midway_is_not_retried_past_the_deadline(
    redis_server: RedisServer, proxy: TcpFaultProxy, op: str
) -> None:
    """Per-read timeout 5 s and two retries: without a deadline over the whole call a
    stalled reply costs 3 x 5 s; with ``call_timeout_s: 1.5`` the call ends by then."""
    key, data = _stored(redis_server, f"dl-stall-{op}:")
    tier = _tier(proxy.address[1], f"dl-stall-{op}:", socket_timeout_s=5.0, call_timeout_s=1.5, retries=2)
    calls: dict[str, Callable[[], Any]] = {
        "get": lambda: tier.get(key, torch.empty_like(data)),
        "contains": lambda: tier.contains([key]),
        "put": lambda: tier.put(random_key(), data),
    }
    try:
        result, _ = timed_call(calls[op])
        assert result in (True, 1), f"negative control: {op} through a passing link"
        proxy.stall_after = 0 if op != "get" else 1000  # small replies: nothing at all
        proxy.set_mode("stall")
        result, took = timed_call(calls[op])
        assert result in (False, 0)
        assert took < 1.5 + MARGIN_S, f"a stalled {op} took {took:.1f} s"
    finally:
        tier.close()


def test_waiting_for_a_pooled_connection_counts_against_the_deadline(redis_server: RedisServer, proxy: TcpFaultProxy) -> None:
    """One connection, held by a stalled call: a second call waits for it no longer
    than its own deadline."""
    key, data = _stored(redis_server, "dl-pool:")
    tier = _tier(proxy.address[1], "dl-pool:", socket_timeout_s=20.0, call_timeout_s=1.5, max_connections=1)
    try:
        proxy.stall_after = 0
        proxy.set_mode("stall")
        first = threading.Thread(target=lambda: tier.get(key, torch.empty_like(data)), daemon=True)
        first.start()
        time.sleep(0.3)  # the first call holds the only connection
        result, took = timed_call(lambda: tier.contains([key]))
        assert result == 0 and took < 1.5 + MARGIN_S, f"waited {took:.1f} s for a pooled connection"
        first.join(10)
        assert not first.is_alive()
    finally:
        tier.close()
