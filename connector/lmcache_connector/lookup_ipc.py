"""Scheduler-to-worker lookups over ZeroMQ IPC.

The cache lives in the worker process(es); vLLM's scheduler may run in another
process. The scheduler side sends a request's chunk hashes to every worker rank and
takes the smallest hit count. A reply that does not arrive within the timeout is a
miss (0): the scheduler never blocks on a stuck worker. Messages are raw bytes (no
pickle): ``[b"L1", seq, request_id, pin_flag, hashes...]`` and ``[b"L1", seq, count]``,
the count followed by ``,s`` when loading the hit needs a tier slower than memory
(the scheduler then loads it off the forward path: ``async_loads: auto``).

When the worker answering an address lives in the scheduler's own process (vLLM's
single-process executor: one worker, in the engine core process) and declared its
lookups memory-only (``inline=True``: a dict probe of the CPU tier, never a network or
disk call that the timeout exists for), the client calls it directly: no socket
round trip and no hand-off to the server thread, which on a busy CPU cost 0.3-1.5 ms
per lookup in ``bench/bench_burst.py``.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from typing import Callable, Sequence

import zmq

from lmcache_core.keys import HASH_BYTES

from .log import get_logger

log = get_logger(__name__)
PROTO = b"L1"


def socket_path(engine_id: str, rank: int) -> str:
    safe = "".join(c for c in engine_id if c.isalnum())[:16] or "default"
    return f"ipc://{tempfile.gettempdir()}/lmcc-{safe}-{rank}.ipc"


class Hit(int):
    """A lookup's answer: the chunks hit (it is that int), and ``slow``: loading them
    needs a tier slower than memory (see the worker's ``async_loads: auto``)."""

    slow: bool

    def __new__(cls, chunks: int, slow: bool = False) -> "Hit":
        hit = super().__new__(cls, chunks)
        hit.slow = bool(slow) and chunks > 0
        return hit

    def encode(self) -> bytes:
        return str(int(self)).encode() + (b",s" if self.slow else b"")

    @classmethod
    def decode(cls, raw: bytes) -> "Hit":
        count, _, flag = raw.partition(b",")
        return cls(max(0, int(count)), flag == b"s")


LookupFn = Callable[[Sequence[bytes], str | None], int]

# Servers in this process that may be called directly, by address.
_inline: dict[str, "LookupServer"] = {}
_inline_lock = threading.Lock()


class LookupServer:
    """Answers lookups in the worker with ``lookup(hashes, pin_id) -> chunks``."""

    def __init__(self, address: str, lookup: LookupFn, *, inline: bool = False) -> None:
        """``inline``: ``lookup`` only reads memory, so a client in this process may
        call it directly (see the module's docstring)."""
        self.address = address
        self._lookup = lookup
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if address.startswith("ipc://"):
            try:
                os.unlink(address[len("ipc://") :])
            except FileNotFoundError:
                pass
        self._sock.bind(address)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lmcache-lookup-server", daemon=True)
        self._thread.start()
        if inline:
            with _inline_lock:
                _inline[address] = self

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not dict(poller.poll(100)):
                continue
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                continue
            except zmq.ZMQError:
                return
            reply = self._answer(frames[1:])
            try:
                self._sock.send_multipart([frames[0], *reply])
            except zmq.ZMQError as err:
                log.warning("lookup reply failed: %s", err)

    def _answer(self, frames: list[bytes]) -> list[bytes]:
        if len(frames) != 5 or frames[0] != PROTO:
            return [PROTO, frames[1] if len(frames) > 1 else b"", b"0"]
        _, seq, req_id, pin, blob = frames
        if len(blob) % HASH_BYTES:
            return [PROTO, seq, b"0"]
        hashes = [blob[i : i + HASH_BYTES] for i in range(0, len(blob), HASH_BYTES)]
        hit = self.answer(hashes, req_id.decode() if pin == b"1" else None)
        return [PROTO, seq, hit.encode()]

    def answer(self, hashes: Sequence[bytes], pin_id: str | None) -> Hit:
        """Chunks hit (0 when the lookup fails: a failing cache is a miss, never a crash)."""
        try:
            got = self._lookup(hashes, pin_id)
            return Hit(max(0, int(got)), getattr(got, "slow", False))
        except Exception as err:
            log.warning("lookup failed, reporting a miss: %s", err)
            return Hit(0)

    def close(self) -> None:
        with _inline_lock:
            if _inline.get(self.address) is self:
                del _inline[self.address]
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close(0)
        self._ctx.term()


def _combine(answers: Sequence[Hit]) -> Hit:
    """Ranks answer for their own shards: the request hits what every rank holds."""
    if not answers:
        return Hit(0)
    return Hit(min(int(a) for a in answers), any(a.slow for a in answers))


class LookupClient:
    """Scheduler side: asks every worker rank; the answer is the minimum."""

    def __init__(self, addresses: Sequence[str], timeout_ms: int) -> None:
        self.addresses = list(addresses)
        self.timeout_ms = timeout_ms
        self._ctx = zmq.Context()
        self._socks: list[zmq.Socket] = []
        self._seq = 0
        self._lock = threading.Lock()
        self.timeouts = 0
        self.inline_lookups = 0
        for addr in self.addresses:
            self._socks.append(self._connect(addr))

    def _connect(self, addr: str) -> zmq.Socket:
        s = self._ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(addr)
        return s

    def lookup(self, hashes: Sequence[bytes], pin_id: str | None) -> Hit:
        """The smallest hit over the ranks; slow when any rank's hit needs a slow tier."""
        if not hashes:
            return Hit(0)
        with _inline_lock:
            local = [_inline.get(a) for a in self.addresses]
        if all(srv is not None for srv in local):
            self.inline_lookups += 1
            return _combine([srv.answer(hashes, pin_id) for srv in local if srv is not None])
        with self._lock:
            self._seq += 1
            seq = str(self._seq).encode()
            blob = b"".join(hashes)
            msg = [PROTO, seq, (pin_id or "").encode(), b"1" if pin_id else b"0", blob]
            for s in self._socks:
                s.send_multipart(msg)
            deadline = time.monotonic() + self.timeout_ms / 1000
            answers: list[Hit] = []
            for i, s in enumerate(self._socks):
                got = self._recv(s, seq, deadline)
                if got is None:
                    self.timeouts += 1
                    log.warning("lookup to %s timed out after %d ms: treated as a miss", self.addresses[i], self.timeout_ms)
                    # Drop late replies by starting over with a fresh socket.
                    s.close(0)
                    self._socks[i] = self._connect(self.addresses[i])
                    answers.append(Hit(0))
                else:
                    answers.append(got)
            return _combine(answers)

    @staticmethod
    def _recv(s: zmq.Socket, seq: bytes, deadline: float) -> Hit | None:
        while True:
            left = int((deadline - time.monotonic()) * 1000)
            if left <= 0 or not s.poll(left):
                return None
            frames = s.recv_multipart()
            if len(frames) == 3 and frames[0] == PROTO and frames[1] == seq:
                try:
                    return Hit.decode(frames[2])
                except ValueError:
                    return Hit(0)

    def close(self) -> None:
        for s in self._socks:
            s.close(0)
        self._ctx.term()
