"""The ``fp8`` codec: lossy, opt-in, about half the bytes of bfloat16 KV.

Each run of :data:`GROUP` (64) consecutive values of the chunk (a (token, head) row
for a head size of 64; half a head for 128) is stored as float8 e4m3 (``e4m3fn``:
3 mantissa bits, largest value 448) after division by one scale, the run's largest
magnitude over 448 rounded up to a bfloat16. The payload is the scales
(little-endian bfloat16, one per group, the last group padded with zeros), then the
float8 bytes (one per value): ``2 * ceil(n / 64) + n`` bytes for ``n`` values,
1.03125 bytes per value (0.516x of bfloat16, 0.258x of float32). The frame header
keeps the original dtype and shape (``float16``, ``bfloat16`` or ``float32``), so
any process with this codec decodes it to the engine's dtype.

Why one bfloat16 scale per 64 values: a float32 scale per 64 values is 0.531x of
bfloat16, over the 0.52x the codec is meant for; one per 128 values is worse where
magnitudes differ between heads (1.52% vs 1.07% relative error, measured with
per-channel outliers); a power-of-two scale (1 byte) costs 2.7% everywhere instead
of 2.5% (normal data). The scale's own rounding costs nothing: values are divided by
the stored scale, the one decode multiplies by. Figures: ``docs/benchmarks.md``.

Encode and decode run in the fused kernel of :mod:`lmcache_core.fp8_native` where
the package was built with a C compiler (about 5x faster, the same bytes and values), else in the
torch ops below.

Decoding trusts nothing in the payload: its length must be exactly the one the
header's shape implies, every scale must be finite, non-negative and at most
:func:`scale_limit` of the dtype (so no product can overflow it), and the float8
NaN codes (``0x7f``, ``0xff``), which the encoder never writes, are refused. The
float8 bytes are widened with integer operations (their bits moved into a
bfloat16), which cannot produce NaN or infinity: a decode gives finite values of
the header's dtype and shape, or a :class:`~lmcache_core.serde.FrameError` (a miss).
"""

from __future__ import annotations

import functools
import threading
from math import prod

import numpy as np
import torch

from . import fp8_native
from .serde import copy_into

#: values per scale
GROUP = 64
#: the largest finite float8 e4m3fn value
FP8_MAX = 448.0
#: the smallest scale written: a group whose values are all below ``448 * 2**-126``
#: (zero, in practice) decodes to values this small or zero, and ``1 / scale`` stays finite
MIN_SCALE = 2.0**-126
#: the scale is rounded up by this factor before its conversion to bfloat16 (to
#: nearest, at most 2**-9 off), so the group's largest value stays within 448
_ROUND_UP = 1.0 + 2.0**-7
SUPPORTED = (torch.float16, torch.bfloat16, torch.float32)
#: documented round-trip error bound (relative Frobenius norm of the error) the tests hold
#: the codec to on K/V-like data; the measured values are lower (see docs/benchmarks.md)
REL_ERROR_BOUND = 0.03
#: the worst case of the round trip's relative error, for the canary: every value in
#: float8's normal range is off by at most 2**-4 of itself, the (subnormal) rest by at
#: most 2**-10 of the scale, under 2e-5 of the group's norm; plus margin for the
#: recomputation's own rounding. Another key's chunk is off by about 100%.
CANARY_BOUND = 0.08
_UNBIAS = 2.0**120  # float8 bits moved into a bfloat16 read 2**-120 of their value
#: the fused kernel's dtype codes (lmcache_core/csrc/fp8_kernel.c)
_KERNEL_DTYPES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}
# what both paths (kernel and torch ops) say when they refuse input
_NOT_FINITE = "the fp8 codec cannot store NaN or infinite KV"
_BAD_SCALE = "a scale is negative, not finite or too large for the dtype"
_NAN_CODE = "a float8 NaN code: not written by this codec"


@functools.cache  # a pure function of the dtype, asked by every encode and decode
def scale_limit(dtype: torch.dtype) -> float:
    """The largest scale a frame of ``dtype`` may hold: ``max / 480`` rounded down to
    a bfloat16, so that even ``480 * scale`` (beyond any float8 value) stays below
    the dtype's largest finite value. Larger magnitudes (above ``448 * limit``,
    about 93% of the dtype's largest value) are clipped."""
    bits = torch.tensor([float(torch.finfo(dtype).max) / 480.0], dtype=torch.float32).view(torch.int32)
    return float((bits & ~0xFFFF).view(torch.float32))  # truncation: rounds down, a bfloat16 value


def payload_len(numel: int) -> int:
    """Bytes of the payload for ``numel`` values."""
    return 2 * -(-numel // GROUP) + numel


class Fp8Codec:
    """float8 e4m3 with one bfloat16 scale per 64 values (see the module docstring).

    A :class:`~lmcache_core.serde.TensorCodec`: serde hands it the tensor and the
    header's dtype and shape. ``lossy``: its frames satisfy only tiers configured
    with ``serde: fp8``."""

    name = "fp8"
    lossy = True
    #: the correctness canary accepts a stored chunk within this relative error of
    #: its recomputation (see :data:`CANARY_BOUND`)
    error_bound = CANARY_BOUND
    #: a float32 chunk of n values takes 4n bytes raw, more than n payload bytes
    max_ratio = 4

    def prepare(self) -> None:
        """Build or load the fused kernel now (at engine start, for a tier configured
        with this codec) rather than in the first request; falls back as
        :func:`~lmcache_core.fp8_native.kernel` does."""
        fp8_native.kernel()

    def accepts(self, dtype: torch.dtype) -> bool:
        """Float KV only: byte pages (grouped layouts) and integers are framed raw."""
        return dtype in SUPPORTED

    def encode(self, raw: memoryview) -> bytes:
        """Bytes without a dtype cannot be quantized: a tier that calls this (instead
        of :func:`~lmcache_core.serde.encode_payload`) cannot store fp8 frames."""
        raise TypeError("the fp8 codec encodes tensors: this tier must build frames with serde.encode_payload/encode_parts")

    def decode(self, payload: memoryview, raw_len: int) -> bytes:
        raise TypeError("the fp8 codec decodes to tensors: use serde.decode/codec_output")

    def encode_tensor(self, tensor: torch.Tensor) -> memoryview:
        if tensor.dtype not in SUPPORTED:
            raise TypeError(f"the fp8 codec stores float16, bfloat16 or float32 KV, not {tensor.dtype}")
        n = tensor.numel()
        groups = -(-n // GROUP)
        kern = fp8_native.kernel() if tensor.device.type == "cpu" else None
        if kern is not None:
            src = tensor.detach().contiguous()
            out = torch.empty(2 * groups + n, dtype=torch.uint8)
            limit = scale_limit(tensor.dtype)
            code = _KERNEL_DTYPES[tensor.dtype]
            if kern.encode(src.data_ptr(), code, n, _ROUND_UP / FP8_MAX, MIN_SCALE, limit, out.data_ptr()) != 0:
                raise ValueError(_NOT_FINITE)
            return out.numpy().data.cast("B")
        flat = tensor.detach().reshape(-1)
        if groups * GROUP != n:
            flat = torch.cat([flat, flat.new_zeros(groups * GROUP - n)])
        amax = _group_absmax(flat.view(groups, GROUP))
        if not bool(torch.isfinite(amax).all()):
            raise ValueError(_NOT_FINITE)
        limit = scale_limit(tensor.dtype)
        scale = (amax.float() * (_ROUND_UP / FP8_MAX)).clamp_(min=MIN_SCALE, max=limit).to(torch.bfloat16)
        # a float32 working copy (the quotient must round once, to float8)
        work = _scratch("work", groups * GROUP, torch.float32)
        work.copy_(flat)
        work.view(groups, GROUP).mul_(scale.float().reciprocal_()).clamp_(-FP8_MAX, FP8_MAX)
        out = torch.empty(2 * groups + n, dtype=torch.uint8)
        out[: 2 * groups] = scale.reshape(-1).view(torch.uint8)
        out[2 * groups :].view(torch.float8_e4m3fn).copy_(work[:n])
        return out.numpy().data.cast("B")

    def decode_tensor(
        self, payload: memoryview, dtype: torch.dtype, shape: tuple[int, ...], out: torch.Tensor | None
    ) -> torch.Tensor:
        if dtype not in SUPPORTED:
            raise ValueError(f"fp8 frames hold float16, bfloat16 or float32, not {dtype}")
        n = prod(shape)
        groups = -(-n // GROUP)
        if payload.nbytes != 2 * groups + n:
            raise ValueError(f"payload is {payload.nbytes} bytes, {2 * groups + n} expected for {n} values")
        kern = fp8_native.kernel()
        if kern is not None:
            direct = (
                out is not None and out.dtype == dtype and out.numel() == n and out.is_contiguous() and out.device.type == "cpu"
            )
            dst = out if direct and out is not None else torch.empty(shape, dtype=dtype)
            src = np.frombuffer(payload, dtype=np.uint8)
            rc = kern.decode(src.ctypes.data, n, _KERNEL_DTYPES[dtype], scale_limit(dtype), dst.data_ptr()) if n else 0
            if rc == -1:
                raise ValueError(_BAD_SCALE)
            if rc == -2:
                raise ValueError(_NAN_CODE)
            # written in place, or a fresh tensor (no out), or out of another layout
            return dst if out is None or direct else copy_into(out, dst)
        bits = np.frombuffer(payload, dtype="<i2", count=groups).astype(np.int16)
        scale = torch.from_numpy(bits).view(torch.bfloat16).float().view(groups, 1)
        if not bool((torch.isfinite(scale) & (scale >= 0) & (scale <= scale_limit(dtype))).all()):
            raise ValueError(_BAD_SCALE)
        code = _scratch("code", n, torch.int16)
        np.copyto(code.numpy(), np.frombuffer(payload, dtype=np.uint8, count=n, offset=2 * groups), casting="safe")
        mag = torch.bitwise_and(code, 0x7F, out=_scratch("mag", n, torch.int16))
        if n and int(mag.max()) == 0x7F:  # the largest 7-bit magnitude is the NaN code
            raise ValueError(_NAN_CODE)
        # e4m3 bits s.eeee.mmm become bfloat16 bits s.0000eeee.mmm0000: the same
        # number times 2**-120 (subnormals included); exact, never NaN or infinite
        mag.bitwise_left_shift_(4).bitwise_or_(code.bitwise_and_(0x80).bitwise_left_shift_(8))
        work = _scratch("work", groups * GROUP, torch.float32)
        work[:n].copy_(mag.view(torch.bfloat16))
        work[n:].zero_()
        work2d = work.view(groups, GROUP)
        if groups and float(scale.max()) > 2.0**7:
            work2d.mul_(_UNBIAS)  # exact: a power of two, results at most 480
        else:
            scale.mul_(_UNBIAS)  # at most 2**127: finite
        work2d.mul_(scale)  # at most 480 * scale_limit(dtype): finite in dtype
        if out is None:
            return work[:n].view(shape).to(dtype, copy=True)  # never the scratch itself: it is reused
        return copy_into(out, work[:n].view(shape))


#: per-thread working buffers up to this size are kept for the next call (fresh
#: memory costs a page fault per 4 KiB, which halved the codec's speed); larger
#: ones are allocated per call
MAX_SCRATCH_BYTES = 64 << 20
_local = threading.local()


def _scratch(name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D tensor of ``numel`` elements (contents undefined) from this thread's
    buffer ``name``, grown as needed; never returned to a caller of the codec."""
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes > MAX_SCRATCH_BYTES:
        return torch.empty(numel, dtype=dtype)
    bufs: dict[str, torch.Tensor] = _local.__dict__.setdefault("bufs", {})
    buf = bufs.get(name)
    if buf is None or buf.numel() < nbytes:
        # a normal tensor even when made under inference mode: the thread may call
        # the codec outside it next time, and only then write an inference tensor fails
        with torch.inference_mode(False):
            buf = bufs[name] = torch.empty(nbytes, dtype=torch.uint8)
    return buf[:nbytes].view(dtype)


def _group_absmax(x: torch.Tensor) -> torch.Tensor:
    """The largest magnitude of each row of ``x`` (``[groups, GROUP]``), as
    ``[groups, 1]`` of ``x``'s dtype (a maximum is exact in any dtype): pairwise
    maxima of halves, which torch vectorises, where ``abs().amax(dim=1)`` reduces 64
    values at a time several times slower. NaN propagates (``torch.maximum``), so the
    caller's finiteness check sees it."""
    groups = x.shape[0]
    a = torch.abs(x, out=_scratch("abs", groups * GROUP, x.dtype).view(groups, GROUP))
    width = GROUP
    while width > 1:
        width //= 2
        a = torch.maximum(
            a[:, :width], a[:, width : 2 * width], out=_scratch(f"max{width}", groups * width, x.dtype).view(groups, width)
        )
    return a
