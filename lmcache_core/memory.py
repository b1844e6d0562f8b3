"""One preallocated pool of host memory handing out reference-counted buffers.

No per-chunk allocation on the hot path: every chunk buffer is a view into one
tensor allocated at start-up (pinned when CUDA is present, so GPU copies can be
asynchronous). A buffer goes back to the pool when its last reference is released,
so a tier can drop a chunk while a background writer still reads it.
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import logging
import math
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from .threads import idle_priority

ALIGN = 256

log = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault pages in as if written, contents untouched
POPULATE_STEP = 2 << 20
"""Bytes per madvise call: a pool being closed stops within one step, and the
process's memory map lock is held for one step at a time."""
_PAGE = 4096


_CGROUP_LIMITS = (
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),  # cgroup v2
    ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),  # v1
)


def _read_int(path: str) -> int | None:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def available_memory() -> int | None:
    """Bytes of memory this process can still obtain: the kernel's ``MemAvailable``,
    lowered to the headroom under a container (cgroup) memory limit if there is one.
    ``None`` where neither is known. Used to refuse a pool that cannot exist with a
    config error instead of an allocator error or the OOM killer."""
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
                break
    except (OSError, ValueError, IndexError):
        avail = None
    for limit_path, usage_path in _CGROUP_LIMITS:
        limit, usage = _read_int(limit_path), _read_int(usage_path)
        if limit is not None and usage is not None and limit < 1 << 60:
            headroom = max(0, limit - usage)
            avail = headroom if avail is None else min(avail, headroom)
            break
    return avail


def _madvise() -> Any:
    """libc's ``madvise`` on Linux, else ``None``. Called through ctypes, so the GIL is
    released while the kernel faults the pages in."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def populate(
    data: torch.Tensor, stop: threading.Event | None = None, progress: Callable[[int], None] | None = None
) -> tuple[int, str | None]:
    """Fault in the pages of ``data`` (a contiguous CPU tensor) without changing its
    bytes (``MADV_POPULATE_WRITE``), ``POPULATE_STEP`` at a time, so later writes into
    it run at memory speed instead of taking a page fault every 4 KiB. Safe while
    other threads read and write it. ``progress(bytes so far)`` after each step.
    (bytes populated, why it stopped early or ``None``)."""
    fn = _madvise()
    if fn is None:
        return 0, "madvise is not available on this platform"
    start = (data.data_ptr() + _PAGE - 1) // _PAGE * _PAGE
    end = (data.data_ptr() + data.numel() * data.element_size()) // _PAGE * _PAGE
    done = 0
    for a in range(start, end, POPULATE_STEP):
        if stop is not None and stop.is_set():
            return done, "stopped"
        n = min(POPULATE_STEP, end - a)
        if fn(a, n, MADV_POPULATE_WRITE) != 0:
            err = ctypes.get_errno()
            return done, f"madvise(MADV_POPULATE_WRITE) failed: errno {err}"
        done += n
        if progress is not None:
            progress(done)
    return done, None


def _round_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def pool_size(nbytes: int) -> int:
    """The pool bytes a buffer of ``nbytes`` takes (what a tier holding it charges)."""
    return _round_up(max(nbytes, 1))


_ELEMENT_SIZES: dict[torch.dtype, int] = {}


def element_size(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype`` (cached: asking torch costs a tensor)."""
    es = _ELEMENT_SIZES.get(dtype)
    if es is None:
        es = _ELEMENT_SIZES[dtype] = torch.empty((), dtype=dtype).element_size()
    return es


class _Layout:
    """What buffers of one shape and dtype share: the shape, the dtype, the bytes
    they hold (``nbytes``) and the pool bytes they take (``size``, aligned). One per
    distinct (shape, dtype) in a pool, so a buffer holds none of these itself."""

    __slots__ = ("shape", "dtype", "nbytes", "size")

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.shape = shape
        self.dtype = dtype
        self.nbytes = math.prod(shape) * element_size(dtype)
        self.size = pool_size(self.nbytes)


class MemoryBuffer:
    """A region of the pool holding a ``dtype`` array of ``shape``, seen as a tensor
    through :attr:`tensor`. Starts with one reference.

    It keeps its offset and a layout shared with every buffer of the same shape and
    dtype, not a tensor: a torch view costs about a kilobyte, too much per resident
    chunk when a CPU tier holds millions of small ones. Each access to :attr:`tensor`
    makes a fresh view (about a microsecond); keep it in a local for repeated use."""

    __slots__ = ("pool", "offset", "_layout", "_refs")

    def __init__(self, pool: "MemoryPool", offset: int, layout: _Layout) -> None:
        self.pool = pool
        self.offset = offset
        self._layout = layout
        self._refs = 1

    @property
    def size(self) -> int:
        """Pool bytes this buffer takes (its bytes rounded up to the alignment)."""
        return self._layout.size

    @property
    def shape(self) -> tuple[int, ...]:
        return self._layout.shape

    @property
    def dtype(self) -> torch.dtype:
        return self._layout.dtype

    @property
    def tensor(self) -> torch.Tensor:
        lay = self._layout
        return self.pool.view(self.offset, lay.shape, lay.dtype)

    @property
    def refcount(self) -> int:
        return self._refs

    @property
    def nbytes(self) -> int:
        return self._layout.nbytes

    def retain(self) -> "MemoryBuffer":
        with self.pool._lock:
            if self._refs <= 0:
                raise RuntimeError("retain() on a released buffer")
            self._refs += 1
        return self

    def release(self) -> None:
        with self.pool._lock:
            if self._refs <= 0:
                raise RuntimeError("release() on a released buffer")
            self._refs -= 1
            if self._refs == 0:
                self.pool._free_locked(self.offset, self._layout.size)


class MemoryPool:
    """First-fit allocator over one preallocated byte tensor, with coalescing.

    ``populate``: fault the pool's pages in on a background thread (unpinned pools;
    pinned memory is resident already), so the chunks saved into it later are copied
    at memory speed rather than at page-fault speed (96 MiB: 5 ms instead of 17-20 ms
    measured here). The thread runs at idle priority (``SCHED_IDLE``): it uses cores
    the engine leaves idle (about 0.3 s of one per GiB) and none while the engine's
    threads keep every core busy; resident memory grows to the pool's size as it goes.
    Each step holds the process's memory-map lock, and at idle priority a step can wait
    for a core while holding it: the process's own mappings (shared-memory loads) stall
    meanwhile, which is why the engine leaves it off unless ``populate_pool`` is set.
    Without it pages are faulted in as chunks first use them."""

    def __init__(self, capacity: int, *, pin: bool | None = None, populate: bool = False) -> None:
        if capacity <= 0:
            raise ValueError("pool capacity must be positive")
        self.capacity = _round_up(capacity)
        if pin is None:
            pin = torch.cuda.is_available()
        self.pinned = bool(pin)
        self._data = torch.empty(self.capacity, dtype=torch.uint8, pin_memory=self.pinned)
        self.populated = threading.Event()  # set when the background populate ended (done or not)
        self.populated_bytes = 0
        self._stop_populate = threading.Event()
        if populate and not self.pinned:
            threading.Thread(target=self._populate, name="lmcache-pool-populate", daemon=True).start()
        else:
            self.populated.set()
        self._lock = threading.Lock()
        self._free_offsets: list[int] = [0]
        self._free_sizes: dict[int, int] = {0: self.capacity}
        self.used = 0
        self._typed: dict[torch.dtype, torch.Tensor] = {}  # the pool viewed as each dtype
        self._layouts: dict[tuple[tuple[int, ...], torch.dtype], _Layout] = {}  # one per distinct shape and dtype
        self._strides: dict[tuple[int, ...], tuple[int, ...]] = {}  # contiguous strides per shape

    def _populate(self) -> None:
        t0 = time.perf_counter()
        idle_priority()
        try:
            # The thread holds ``self`` (and so the tensor) until it ends: the memory
            # it advises is never freed under it.
            self.populated_bytes, why = populate(self._data, self._stop_populate, self._populate_progress)
        except Exception as err:  # never fatal: pages then fault in on first use
            why = f"{type(err).__name__}: {err}"
        finally:
            self.populated.set()
        if why is None:
            log.debug("memory pool: %.1f GiB faulted in in %.2f s", self.populated_bytes / 2**30, time.perf_counter() - t0)
        elif why != "stopped":
            log.info("memory pool: pages not faulted in ahead (%s); they fault in on first use", why)

    def _populate_progress(self, done: int) -> None:
        self.populated_bytes = done

    def stop_populate(self) -> None:
        """Stop a background populate within one step (close)."""
        self._stop_populate.set()

    def view(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The pool's bytes at ``offset`` (a multiple of :data:`ALIGN`) as a
        contiguous ``dtype`` tensor of ``shape``."""
        typed = self._typed.get(dtype)
        if typed is None:
            es = element_size(dtype)
            # Cached for every later call, so made outside inference mode: a view made
            # under it would turn every later buffer of this dtype into one that
            # cannot be written outside inference mode (a store after a load).
            with torch.inference_mode(False):
                typed = self._typed[dtype] = self._data[: self.capacity // es * es].view(dtype)
        strides = self._strides.get(shape)
        if strides is None:
            acc, out = 1, []
            for d in reversed(shape):
                out.append(acc)
                acc *= max(d, 1)
            strides = tuple(reversed(out))
            if len(self._strides) < 4096:
                self._strides[shape] = strides
        return typed.as_strided(shape, strides, offset // element_size(dtype))

    def allocate(self, shape: Sequence[int], dtype: torch.dtype) -> MemoryBuffer | None:
        """A buffer of ``shape``/``dtype``, or ``None`` when no free region fits."""
        shp = shape if type(shape) is tuple else tuple(shape)
        lay = self._layouts.get((shp, dtype))
        if lay is None:
            shp = tuple(int(d) for d in shape)
            if any(d < 0 for d in shp):
                raise ValueError(f"negative dimension in shape {shp}")
            lay = _Layout(shp, dtype)
            if len(self._layouts) < 4096:  # layouts repeat (one per chunk layout); bounded all the same
                self._layouts[(shp, dtype)] = lay
        size = lay.size
        with self._lock:
            for i, off in enumerate(self._free_offsets):
                free = self._free_sizes[off]
                if free >= size:
                    del self._free_offsets[i]
                    del self._free_sizes[off]
                    if free > size:
                        bisect.insort(self._free_offsets, off + size)
                        self._free_sizes[off + size] = free - size
                    self.used += size
                    break
            else:
                return None
        return MemoryBuffer(self, off, lay)

    def _free_locked(self, off: int, size: int) -> None:
        self.used -= size
        i = bisect.bisect_left(self._free_offsets, off)
        if i < len(self._free_offsets) and self._free_offsets[i] == off + size:
            nxt = self._free_offsets.pop(i)
            size += self._free_sizes.pop(nxt)
        if i > 0:
            prev = self._free_offsets[i - 1]
            if prev + self._free_sizes[prev] == off:
                self._free_sizes[prev] += size
                return
        self._free_offsets.insert(i, off)
        self._free_sizes[off] = size

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s memory lies inside this pool (a view, not a copy)."""
        if tensor.untyped_storage().data_ptr() != self._data.untyped_storage().data_ptr():
            return False
        start = tensor.storage_offset() * tensor.element_size()
        return 0 <= start and start + tensor.numel() * tensor.element_size() <= self.capacity

    @property
    def free_regions(self) -> int:
        """How many separate free regions there are (1 when nothing is fragmented)."""
        with self._lock:
            return len(self._free_offsets)

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used

    def largest_free(self) -> int:
        with self._lock:
            return max(self._free_sizes.values(), default=0)
