"""Online cost models: how long a tier takes to read a chunk, how long the engine
takes to compute tokens. A load only pays off when it beats recomputing, and both
sides drift (a remote store gets slower, the GPU gets busier), so both are measured
from live traffic rather than configured.

:class:`LinearFit` is a least-squares fit of ``seconds = a + sum(b_i * x_i)`` over
the last ``window`` samples, refitted lazily when predicting. Coefficients are kept
non-negative (a negative cost per byte or per token is noise, not physics): a
feature whose coefficient comes out negative is dropped and the rest refitted.
With one repeated feature value (uniform chunk sizes) the fit degenerates to the
mean time per call, which is what a prediction at that value needs.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Sequence

import numpy as np


class LinearFit:
    """Thread-safe rolling fit of ``y = a + b . x`` with non-negative coefficients."""

    def __init__(self, n_features: int, *, window: int = 64, min_samples: int = 1) -> None:
        self.n_features = n_features
        self.min_samples = max(1, min_samples)
        self._samples: deque[tuple[tuple[float, ...], float]] = deque(maxlen=window)
        self._lock = threading.Lock()
        self._coef: np.ndarray | None = None
        self._dirty = False
        self.last_sample_at: float | None = None  # time.monotonic() of the latest sample
        self.count = 0

    def add(self, x: Sequence[float], y: float) -> None:
        if len(x) != self.n_features or not np.isfinite(y) or y < 0:
            return
        with self._lock:
            self._samples.append((tuple(float(v) for v in x), float(y)))
            self._dirty = True
            self.count += 1
            self.last_sample_at = time.monotonic()

    def coefficients(self) -> np.ndarray | None:
        """``[a, b_1, ..., b_n]`` or ``None`` before ``min_samples`` samples."""
        with self._lock:
            if len(self._samples) < self.min_samples:
                return None
            if self._dirty or self._coef is None:
                self._coef = self._fit(list(self._samples))
                self._dirty = False
            return self._coef

    def _fit(self, samples: list[tuple[tuple[float, ...], float]]) -> np.ndarray:
        X = np.array([[1.0, *x] for x, _ in samples])
        y = np.array([v for _, v in samples])
        active = list(range(self.n_features + 1))
        coef = np.zeros(self.n_features + 1)
        while active:
            sol, *_ = np.linalg.lstsq(X[:, active], y, rcond=None)
            neg = [a for a, c in zip(active, sol) if c < 0]
            if not neg:
                coef[active] = sol
                return coef
            active = [a for a in active if a not in neg]
        return coef

    def predict(self, x: Sequence[float]) -> float | None:
        coef = self.coefficients()
        if coef is None:
            return None
        value = float(coef[0] + np.dot(coef[1:], np.asarray(x, dtype=float)))
        return max(0.0, value) if np.isfinite(value) else None

    def age(self) -> float | None:
        """Seconds since the latest sample (``None`` if none)."""
        t = self.last_sample_at
        return None if t is None else time.monotonic() - t


class TierReadModel:
    """Per-tier read cost: ``seconds = latency + bytes / throughput``, fitted from
    every successful read the engine makes."""

    def __init__(self, window: int = 64) -> None:
        self.fit = LinearFit(1, window=window)

    def record(self, nbytes: int, seconds: float) -> None:
        self.fit.add((nbytes,), seconds)

    def predict(self, nbytes: int) -> float | None:
        return self.fit.predict((nbytes,))

    def describe(self) -> dict[str, float | int | None]:
        coef = self.fit.coefficients()
        if coef is None:
            return {"samples": 0, "latency_s": None, "throughput_bps": None}
        per_byte = float(coef[1])
        return {
            "samples": self.fit.count,
            "latency_s": float(coef[0]),
            "throughput_bps": (1.0 / per_byte) if per_byte > 0 else None,
        }
