"""Scheduler-to-worker lookups over ZeroMQ IPC.

The cache lives in the worker process(es); vLLM's scheduler may run in another
process. The scheduler side sends a request's chunk hashes to every worker rank and
takes the smallest hit count. A reply that does not arrive within the timeout is a
miss (0): the scheduler never blocks on a stuck worker. Messages are raw bytes (no
pickle): ``[b"L1", seq, request_id, pin, hashes...]`` and ``[b"L1", seq, count]``,
the count followed by ``,`` and flags: ``s`` when loading the hit needs a tier slower
than memory (the scheduler then loads it off the forward path: ``connector.async_loads: auto``),
``t`` when the stored chunk offered for the chunk after the hit is present and pinned,
``w`` when a background save of some of the request's chunks was still running when
the answer left (the scheduler then asks again a step later, see the scheduler's
``SAVE_WAIT_S``).
Those offers (sub-chunk hits, subchunks.py) travel in an optional sixth frame:
``(chunk index: 4 bytes little-endian, stored chunk's hash)`` pairs. ``pin`` is ``0``,
or ``1:<deadline>`` (wall-clock seconds) when the hit is to be pinned for the request:
the client counts a lookup unanswered by then as a miss, so the server skips one that
arrives late and releases the pins of one that ends late (the request, already
treated as a miss, may have finished and sent its one unpin meanwhile). A malformed
message gets a miss; the server thread never dies of one.

When the worker answering an address lives in the scheduler's own process (vLLM's
single-process executor: one worker, in the engine core process) and declared its
lookups memory-only (``inline=True``: a dict probe of the CPU tier, never a network or
disk call that the timeout exists for), the client calls it directly: no socket
round trip and no hand-off to the server thread, which on a busy CPU cost 0.3-1.5 ms
per lookup in ``bench/bench_burst.py``.
"""

from __future__ import annotations

import math
import os
import struct
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import zmq

from lmcache_core.keys import HASH_BYTES

from ..log import get_logger

log = get_logger(__name__)
PROTO = b"L1"


def socket_path(engine_id: str, rank: int) -> str:
    safe = "".join(c for c in engine_id if c.isalnum())[:16] or "default"
    return f"ipc://{tempfile.gettempdir()}/lmcc-{safe}-{rank}.ipc"


@dataclass(frozen=True)
class LookupAnswer:
    """A lookup's answer: ``chunks`` hit; ``slow``: loading them needs a tier slower
    than memory (see the worker's ``connector.async_loads: auto``); ``tail``: the stored
    chunk offered for the chunk right after the hit is present and pinned (a sub-chunk
    hit, subchunks.py); ``saving``: a background save of some of the looked-up chunks
    was still running (async_saves), so a lookup a moment later may hit more. Nothing
    to load is never slow."""

    chunks: int = 0
    slow: bool = False
    tail: bool = False
    saving: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "chunks", max(0, int(self.chunks)))
        object.__setattr__(self, "tail", bool(self.tail))
        object.__setattr__(self, "saving", bool(self.saving))
        object.__setattr__(self, "slow", bool(self.slow) and (self.chunks > 0 or self.tail))

    def encode(self) -> bytes:
        flags = (b"s" if self.slow else b"") + (b"t" if self.tail else b"") + (b"w" if self.saving else b"")
        return str(self.chunks).encode() + (b"," + flags if flags else b"")

    @classmethod
    def decode(cls, raw: bytes) -> "LookupAnswer":
        count, _, flags = raw.partition(b",")
        return cls(int(count), b"s" in flags, b"t" in flags, b"w" in flags)


MISS = LookupAnswer()


LookupFn = Callable[..., LookupAnswer]  # (hashes, pin_id[, alts]) -> the answer
Alts = dict[int, bytes]  # chunk index -> a stored chunk that starts with that chunk's first blocks
_ALT = struct.Struct("<I")


def encode_alts(alts: Alts) -> bytes:
    return b"".join(_ALT.pack(i) + h for i, h in sorted(alts.items()))


def decode_alts(blob: bytes) -> Alts | None:
    """The offers of a lookup message (None when malformed: the lookup ignores them)."""
    width = _ALT.size + HASH_BYTES
    if len(blob) % width:
        return None
    return {_ALT.unpack_from(blob, o)[0]: blob[o + _ALT.size : o + width] for o in range(0, len(blob), width)}


# Servers in this process that may be called directly, by address.
_inline: dict[str, "LookupServer"] = {}
_inline_lock = threading.Lock()


class LookupServer:
    """Answers lookups in the worker with ``lookup(hashes, pin_id) -> chunks``."""

    def __init__(
        self, address: str, lookup: LookupFn, *, inline: bool = False, release: Callable[[str], object] | None = None
    ) -> None:
        """``inline``: ``lookup`` only reads memory, so a client in this process may
        call it directly (see the module's docstring). ``release(pin_id)``: drops what
        a lookup pinned for a client that gave up waiting (see the module's docstring)."""
        self.address = address
        self._lookup = lookup
        self._release = release
        self.late = 0  # lookups skipped or released because their client had given up
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
            try:
                reply = self._answer(frames[1:])
            except Exception as err:  # a malformed message is a miss, never the end of this thread
                log.warning("malformed lookup message, answered as a miss: %s", err)
                reply = [PROTO, b"", b"0"]
            try:
                self._sock.send_multipart([frames[0], *reply])
            except zmq.ZMQError as err:
                log.warning("lookup reply failed: %s", err)

    def _answer(self, frames: list[bytes]) -> list[bytes]:
        if len(frames) not in (5, 6) or frames[0] != PROTO:
            return [PROTO, frames[1] if len(frames) > 1 else b"", b"0"]
        seq, req_id, pin, blob = frames[1:5]
        if len(blob) % HASH_BYTES:
            return [PROTO, seq, b"0"]
        pin_id, deadline = None, math.inf
        if pin[:1] == b"1":
            try:
                pin_id = req_id.decode()
                deadline = float(pin[2:]) if pin[1:2] == b":" else math.inf
            except (UnicodeDecodeError, ValueError):
                return [PROTO, seq, b"0"]
            if time.time() > deadline:  # (NaN is never late: then pinned, and released by its unpin)
                self.late += 1
                return [PROTO, seq, b"0"]
        hashes = [blob[i : i + HASH_BYTES] for i in range(0, len(blob), HASH_BYTES)]
        alts = decode_alts(frames[5]) if len(frames) == 6 else None
        hit = self.answer(hashes, pin_id, alts)
        if pin_id is not None and time.time() > deadline and self._release is not None:
            self.late += 1
            self._release(pin_id)  # the client has counted it a miss: nothing will load these
            return [PROTO, seq, b"0"]
        return [PROTO, seq, hit.encode()]

    def answer(self, hashes: Sequence[bytes], pin_id: str | None, alts: Alts | None = None) -> LookupAnswer:
        """The answer (a miss when the lookup fails: a failing cache is a miss, never a crash)."""
        try:
            got = self._lookup(hashes, pin_id, alts) if alts else self._lookup(hashes, pin_id)
            if not isinstance(got, LookupAnswer):
                raise TypeError(f"the lookup returned {type(got).__name__}, not a LookupAnswer")
            return got
        except Exception as err:
            log.warning("lookup failed, reporting a miss: %s", err)
            return MISS

    def close(self) -> None:
        with _inline_lock:
            if _inline.get(self.address) is self:
                del _inline[self.address]
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close(0)
        self._ctx.term()


def _combine(answers: Sequence[LookupAnswer]) -> LookupAnswer:
    """Ranks answer for their own shards: the request hits what every rank holds
    (the offered chunk after it only when every rank holds that too); still saving
    when any rank is."""
    if not answers:
        return MISS
    n = min(a.chunks for a in answers)
    tail = all(a.tail and a.chunks == n for a in answers)
    return LookupAnswer(n, any(a.slow for a in answers), tail, any(a.saving for a in answers))


class LookupClient:
    """Scheduler side: asks every worker rank; the answer is the minimum."""

    def __init__(self, addresses: Sequence[str], timeout_s: float) -> None:
        self.addresses = list(addresses)
        self.timeout_s = timeout_s
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

    def lookup(self, hashes: Sequence[bytes], pin_id: str | None, alts: Alts | None = None) -> LookupAnswer:
        """The smallest hit over the ranks; slow when any rank's hit needs a slow tier.
        ``alts``: stored chunks offered for sub-chunk hits (see the module's docstring)."""
        if not hashes and not alts:
            return MISS
        with _inline_lock:
            local = [_inline.get(a) for a in self.addresses]
        if all(srv is not None for srv in local):
            self.inline_lookups += 1
            return _combine([srv.answer(hashes, pin_id, alts) for srv in local if srv is not None])
        with self._lock:
            self._seq += 1
            seq = str(self._seq).encode()
            blob = b"".join(hashes)
            deadline = time.monotonic() + self.timeout_s
            pin = b"1:%.6f" % (time.time() + self.timeout_s) if pin_id else b"0"
            msg = [PROTO, seq, (pin_id or "").encode(), pin, blob]
            if alts:
                msg.append(encode_alts(alts))
            for s in self._socks:
                s.send_multipart(msg)
            answers: list[LookupAnswer] = []
            for i, s in enumerate(self._socks):
                got = self._recv(s, seq, deadline)
                if got is None:
                    self.timeouts += 1
                    log.warning("lookup to %s timed out after %g s: treated as a miss", self.addresses[i], self.timeout_s)
                    # Drop late replies by starting over with a fresh socket.
                    s.close(0)
                    self._socks[i] = self._connect(self.addresses[i])
                    answers.append(MISS)
                else:
                    answers.append(got)
            return _combine(answers)

    @staticmethod
    def _recv(s: zmq.Socket, seq: bytes, deadline: float) -> LookupAnswer | None:
        while True:
            left = int((deadline - time.monotonic()) * 1000)
            if left <= 0 or not s.poll(left):
                return None
            frames = s.recv_multipart()
            if len(frames) == 3 and frames[0] == PROTO and frames[1] == seq:
                try:
                    return LookupAnswer.decode(frames[2])
                except ValueError:
                    return MISS

    def close(self) -> None:
        for s in self._socks:
            s.close(0)
        self._ctx.term()
