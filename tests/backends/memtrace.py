"""Python memory a call allocates, for tests that bound a read's memory."""

from __future__ import annotations

import tracemalloc
from typing import Callable, TypeVar

T = TypeVar("T")


def peak_python_bytes(fn: Callable[[], T]) -> tuple[T, int]:
    """``(fn(), the most bytes of Python memory traced at once while it ran)``."""
    tracemalloc.start()
    try:
        result = fn()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return result, peak
