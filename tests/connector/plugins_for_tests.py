"""Backends registered through the real plugin path for the length of one test:
``slowget`` sleeps in every get (a tier slower than recomputing, for load_policy: the
reference tier with a read delay), and three faulty tiers built on the reference tier,
each keeping a fault it must not have: ``tamper`` serves altered KV (negative
control), ``flaky`` fails loads (fault injection: corrupt frames or exceptions),
``liar`` answers with another key's chunk in a frame re-made for the key asked for
(checksum and key valid: only the canary can catch it)."""

from __future__ import annotations

from typing import Any, Mapping

import torch

from lmcache_core import serde
from lmcache_core.backend import BackendContext, BackendError
from lmcache_core.config import StrictModel, validate_section
from lmcache_core.hookspecs import hookimpl
from lmcache_core.keys import ChunkKey
from lmcache_core.testing import MemoryTier, MemoryTierPlugin


class TamperBackend(MemoryTier):
    """Stores honestly; every hit is answered with the same random tensor."""

    name = "tamper"

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


class FlakyBackend(MemoryTier):
    """Keeps the frames of the engine's codec; ``mode: corrupt`` reads each with one
    bit flipped (counted in ``corrupt_reads``), ``mode: raise`` raises on every get."""

    name = "flaky"

    def __init__(self, ctx: BackendContext, mode: str) -> None:
        super().__init__(codec=ctx.codec, codecs=ctx.codecs)
        self.mode = mode
        self.count(corrupt_reads=0)

    def get(self, key: ChunkKey, out: torch.Tensor) -> bool:
        if self.mode == "raise":
            raise BackendError("injected failure")
        with self.lock:
            frame = self.data.get(key)
        if frame is None:
            return False
        bad = bytearray(frame)
        bad[len(bad) // 2] ^= 0x40  # one flipped bit in the payload
        got = serde.try_decode(bytes(bad), self.codecs or {}, expect_key=key, out=out).tensor
        if got is None:
            self.count(corrupt_reads=1)
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


def SlowGetPlugin() -> MemoryTierPlugin:
    """``slowget``: a far-away tier, storing instantly, every get taking the entry's
    ``get_delay_ms`` (300 unless given)."""
    return MemoryTierPlugin("slowget", get_delay_s=0.3)


class LiarBackend(MemoryTier):
    """Stores frames honestly; every ``get`` answers with the payload of another key
    of the same size, re-framed under the requested key, so the frame's key and
    checksum are right and the data is wrong (a namespace or index bug)."""

    name = "liar"

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(codec=ctx.codec, codecs=ctx.codecs)
        self.ctx = ctx
        self.count(lies=0)

    def get(self, key: ChunkKey, out: torch.Tensor) -> bool:
        with self.lock:
            own = self.data.get(key)
            others = [f for k, f in self.data.items() if k != key and len(f) == len(own or b"")]
        if own is None:
            return False
        if others:
            wrong = serde.decode(others[0], dict(self.ctx.codecs))
            own = serde.encode(key, wrong, self.ctx.codec)  # a valid frame for ``key``
            self.count(lies=1)
        got = serde.try_decode(own, dict(self.ctx.codecs), expect_key=key, out=out).tensor
        return got is not None


class LiarPlugin:
    @hookimpl
    def register_backends(self, register: Any) -> None:
        register("liar", lambda section, ctx: LiarBackend(ctx))
