"""A TCP proxy on loopback that adds a fixed delay each way: a network of a given
round-trip time for the shared tiers (Redis, a peer node over TCP, S3), where the
machines have no ``netem``.

Every byte read on one side is written to the other side ``rtt / 2`` seconds later,
in order; bandwidth is not limited, so a pipelined or parallel protocol pays the
delay once per exchange and a one-request-at-a-time protocol once per request, as on
a real link.

    with LatencyProxy(("127.0.0.1", 6379), rtt_ms=20) as proxy:
        ...  # connect to proxy.address instead of 127.0.0.1:6379

``python bench/latency_proxy.py TARGET_HOST:PORT RTT_MS`` runs one in the foreground
and prints its address.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from typing import Any


class LatencyProxy:
    def __init__(self, target: tuple[str, int], rtt_ms: float) -> None:
        self.target = target
        self.one_way = max(0.0, rtt_ms) / 2000.0
        self.address: tuple[str, int] = ("127.0.0.1", 0)
        self.connections = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="latency-proxy", daemon=True)
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    # -- lifecycle ----------------------------------------------------------------------
    def start(self) -> "LatencyProxy":
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("latency proxy did not start")
        return self

    def stop(self) -> None:
        """Close the listener and every connection, then the loop."""
        if not self._thread.is_alive():
            return
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop.close()

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for w in list(self._writers):  # EOF on both sides: every pipe finishes on its own
            w.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        if tasks:
            await asyncio.wait(tasks, timeout=2)

    def __enter__(self) -> "LatencyProxy":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def url_host_port(self) -> str:
        return f"{self.address[0]}:{self.address[1]}"

    # -- the proxy ----------------------------------------------------------------------
    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._accept, "127.0.0.1", 0))
        self.address = self._server.sockets[0].getsockname()[:2]
        self._ready.set()
        self._loop.run_forever()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            up_r, up_w = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        self._writers |= {writer, up_w}
        try:
            await asyncio.gather(self._pipe(reader, up_w), self._pipe(up_r, writer), return_exceptions=True)
        finally:
            self._writers -= {writer, up_w}

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        """Copy ``src`` to ``dst``, each piece released ``one_way`` after it arrived."""
        q: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await q.get()
                if not data:
                    break
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                try:
                    dst.write(data)
                    await dst.drain()
                except (ConnectionError, OSError):
                    break
            dst.close()

        sender = asyncio.ensure_future(deliver())
        try:
            while True:
                data = await src.read(1 << 20)
                await q.put((time.monotonic() + self.one_way, data))
                if not data:
                    break
        except (ConnectionError, OSError):
            pass
        finally:
            q.put_nowait((0.0, b""))
            await asyncio.gather(sender, return_exceptions=True)


def main(argv: list[str]) -> int:
    host, _, port = argv[0].rpartition(":")
    with LatencyProxy((host or "127.0.0.1", int(port)), float(argv[1])) as proxy:
        print(f"proxy {proxy.url_host_port} -> {argv[0]} at {argv[1]} ms round trip", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
