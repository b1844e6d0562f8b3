"""Hardening round 3, item 7: what a flood of forged keyspace notifications costs a
Redis tier that reports evictions (KV events on).

    python bench/security/redis_event_flood.py [--messages 200000] [--max-per-s N]

Starts a ``redis-server`` on loopback (the tests' helper), a Redis tier subscribed to
its evictions (as the engine does once KV events are on), and a child process that
publishes ``--messages`` forged ``evicted`` notifications, as fast as one client can,
naming chunk keys under the tier's prefix that were never stored: they pass the
tier's ``EXISTS`` check, so each one the tier handles becomes an ``evicted()`` call.
Prints the calls, this process's CPU time (the publisher runs in its own process) and
the subscriber thread's CPU where the tier reports it, once the tier has been idle
for 3 s (at most 120 s after the flood).
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "backends"))

from redis_server import RedisServer  # noqa: E402

from lmcache_backend_redis import create_redis_backend  # noqa: E402
from lmcache_core.testing import make_context, random_key  # noqa: E402

PREFIX = "lmc-flood:"
PUBLISHER = """
import sys, redis
raw = redis.Redis(host="127.0.0.1", port=int(sys.argv[1]))
names = open(sys.argv[2], "rb").read().split(b"\\n")
for i in range(0, len(names), 1000):
    pipe = raw.pipeline(transaction=False)
    for name in names[i : i + 1000]:
        pipe.publish("__keyevent@0__:evicted", name)
    pipe.execute()
"""


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=200_000)
    ap.add_argument("--max-per-s", type=int, default=None, help="the tier's max_key_events_per_s (default: its default)")
    args = ap.parse_args()
    server = RedisServer()
    calls = [0]
    extra = {} if args.max_per_s is None else {"max_key_events_per_s": args.max_per_s}
    tier = create_redis_backend({"url": server.url, "prefix": PREFIX, **extra}, make_context())
    try:
        tier.subscribe_evictions(lambda key: calls.__setitem__(0, calls[0] + 1))
        assert tier.watcher is not None and tier.watcher.subscribed.wait(10), "no subscription"
        names = server.dir / "names"
        names.write_bytes(b"\n".join((PREFIX + random_key("gone").to_str()).encode() for _ in range(args.messages)))
        cpu0, t0 = cpu(), time.monotonic()
        subprocess.run([sys.executable, "-c", PUBLISHER, str(server.port), str(names)], check=True, timeout=600)
        published = time.monotonic() - t0
        last, idle_since, deadline = -1, time.monotonic(), time.monotonic() + 120
        while time.monotonic() < deadline and time.monotonic() - idle_since < 3:  # bounded: 120 s
            if calls[0] != last:
                last, idle_since = calls[0], time.monotonic()
            time.sleep(0.1)
        took = idle_since - t0
        x = tier.stats().extra
        print(
            f"{args.messages} forged messages published in {published:.2f} s: {calls[0]} evicted() calls within "
            f"{took:.1f} s; this process's CPU {cpu() - cpu0:.2f} s; subscriber thread CPU "
            f"{x.get('key_event_cpu_s', 'n/a')}; pauses {x.get('key_event_pauses', 'n/a')}; "
            f"dropped by the old token bucket {x.get('key_events_dropped', 0)}"
        )
    finally:
        tier.close()
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
