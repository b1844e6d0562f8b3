"""Backends registered through the real plugin path for the length of one test:
``tamper`` serves altered KV (negative control), ``flaky`` fails loads (fault
injection: corrupt frames or exceptions), ``slowget`` sleeps in every get (a tier
slower than recomputing, for load_policy), ``liar`` answers with another key's chunk in
a frame re-made for the key asked for (checksum and key valid: only the canary can
catch it)."""

from __future__ import annotations

import threading
from typing import Any, Mapping, Sequence

import torch

from lmcache_core import serde
from lmcache_core.backend import BackendContext, BackendError, BackendStats, StorageBackend, prefix_count
from lmcache_core.config import StrictModel, validate_section
from lmcache_core.hookspecs import hookimpl
from lmcache_core.keys import ChunkKey


class _DictBackend(StorageBackend):
    def __init__(self) -> None:
        self.data: dict[ChunkKey, Any] = {}
        self.lock = threading.Lock()
        self.s = BackendStats(self.name)

    def contains(self, keys: Sequence[ChunkKey]) -> int:
        with self.lock:
            return prefix_count(keys, self.data)

    def remove(self, key: ChunkKey) -> bool:
        with self.lock:
            return self.data.pop(key, None) is not None

    def stats(self) -> BackendStats:
        self.s.chunks = len(self.data)
        return self.s


class TamperBackend(_DictBackend):
    name = "tamper"

    def put(self, key: ChunkKey, data: torch.Tensor) -> bool:
        with self.lock:
            self.data[key] = data.clone()
            self.s.puts += 1
        return True

    def get(self, key: ChunkKey, out: torch.Tensor) -> bool:
        with self.lock:
            data = self.data.get(key)
        if data is None or data.shape != out.shape:
            return False
        g = torch.Generator().manual_seed(0)
        out.copy_(torch.randn(out.shape, generator=g).to(out.dtype) * 2)
        return True


class _FlakyConfig(StrictModel):
    mode: str = "corrupt"


class _FrameBackend(_DictBackend):
    """Keeps each chunk as the frame the engine's codec makes of it."""

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__()
        self.ctx = ctx

    def put(self, key: ChunkKey, data: torch.Tensor) -> bool:
        frame = serde.encode(key, data, self.ctx.codec)
        with self.lock:
            self.data[key] = frame
            self.s.puts += 1
        return True


class FlakyBackend(_FrameBackend):
    name = "flaky"

    def __init__(self, ctx: BackendContext, mode: str) -> None:
        super().__init__(ctx)
        self.mode = mode
        self.s.extra["corrupt_reads"] = 0

    def get(self, key: ChunkKey, out: torch.Tensor) -> bool:
        if self.mode == "raise":
            raise BackendError("injected failure")
        with self.lock:
            frame = self.data.get(key)
        if frame is None:
            return False
        bad = bytearray(frame)
        bad[len(bad) // 2] ^= 0x40  # one flipped bit in the payload
        got, reason = serde.try_decode(bytes(bad), dict(self.ctx.codecs), expect_key=key, out=out)
        if got is None:
            self.s.extra["corrupt_reads"] += 1
            return False
        return True


class TamperPlugin:
    @hookimpl
    def register_backends(self, register: Any) -> None:
        register("tamper", lambda section, ctx: TamperBackend())


class FlakyPlugin:
    @hookimpl
    def register_backends(self, register: Any) -> None:
        def create(section: Mapping[str, Any], ctx: BackendContext) -> FlakyBackend:
            cfg = validate_section(_FlakyConfig, section, ctx.key_path, ctx.source)
            return FlakyBackend(ctx, cfg.mode)

        register("flaky", create)


class _SlowGetConfig(StrictModel):
    get_delay_ms: float = 300.0


class SlowGetBackend(_DictBackend):
    """A far-away tier: stores instantly, every ``get`` takes ``get_delay_ms``."""

    name = "slowget"

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s

    def put(self, key: ChunkKey, data: torch.Tensor) -> bool:
        with self.lock:
            self.data[key] = data.clone()
            self.s.puts += 1
        return True

    def get(self, key: ChunkKey, out: torch.Tensor) -> bool:
        import time

        time.sleep(self.delay_s)
        with self.lock:
            data = self.data.get(key)
            self.s.hits += data is not None
        if data is None or data.shape != out.shape or data.dtype != out.dtype:
            return False
        out.copy_(data)
        return True


class SlowGetPlugin:
    @hookimpl
    def register_backends(self, register: Any) -> None:
        def create(section: Mapping[str, Any], ctx: BackendContext) -> SlowGetBackend:
            cfg = validate_section(_SlowGetConfig, section, ctx.key_path, ctx.source)
            return SlowGetBackend(cfg.get_delay_ms / 1000)

        register("slowget", create)


class LiarBackend(_FrameBackend):
    """Stores frames honestly; every ``get`` answers with the payload of another key
    of the same size, re-framed under the requested key, so the frame's key and
    checksum are right and the data is wrong (a namespace or index bug)."""

    name = "liar"

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        self.s.extra["lies"] = 0

    def get(self, key: ChunkKey, out: torch.Tensor) -> bool:
        with self.lock:
            own = self.data.get(key)
            others = [f for k, f in self.data.items() if k != key and len(f) == len(own or b"")]
        if own is None:
            return False
        if others:
            wrong = serde.decode(others[0], dict(self.ctx.codecs))
            own = serde.encode(key, wrong, self.ctx.codec)  # a valid frame for ``key``
            self.s.extra["lies"] += 1
        got, _ = serde.try_decode(own, dict(self.ctx.codecs), expect_key=key, out=out)
        return got is not None


class LiarPlugin:
    @hookimpl
    def register_backends(self, register: Any) -> None:
        register("liar", lambda section, ctx: LiarBackend(ctx))
