"""The conformance suite can fail: run in its own pytest process against backends
that break one clause each, it fails exactly the clauses they break, and passes the
honest backend they derive from (the negative control)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SUITE_SRC = '''
import pytest
import torch

from lmcache_backend_example import DictBackend
from lmcache_core.local_cpu import LocalCpuBackend
from lmcache_core.serde import try_decode
from lmcache_core.testing import BackendConformance, flip_byte


class DictFixtures(BackendConformance):
    backend_class = DictBackend

    def make_backend(self, ctx, tmp_path):
        return self.backend_class(ctx.codec, ctx.codecs, max_entries=1000)

    def make_bounded_backend(self, ctx, tmp_path, max_bytes):
        return self.backend_class(ctx.codec, ctx.codecs, max_entries=max_bytes // 16384)

    @pytest.fixture
    def corrupt(self, backend):
        def corrupt(key):
            backend._frames[key] = flip_byte(backend._frames[key])
        return corrupt

    @pytest.fixture
    def replace_with(self, backend):
        def replace_with(key, other):
            backend._frames[key] = backend._frames[other]
        return replace_with

    @pytest.fixture
    def plant(self, backend):
        def plant(key, frame):
            backend._frames[key] = frame
        return plant


class IgnoresExpectKey(DictBackend):
    """Checks the frame's checksum but not whose frame it is."""

    def get(self, key, out):
        with self._lock:
            frame = self._frames.get(key)
        tensor = try_decode(frame, self._codecs, out=out).tensor
        with self._lock:
            if tensor is None:
                self._stats.misses += 1
                return False
            self._stats.hits += 1
            self._stats.get_bytes += out.nbytes
        return True


class IgnoresTheSecret(DictBackend):
    """Unwraps the context's codecs: writes and reads plain frames, so its own
    chunks round-trip and a planted frame with a valid checksum is served."""

    def __init__(self, codec, codecs, max_entries):
        plain = {n: getattr(c, "inner", c) for n, c in codecs.items()}
        super().__init__(getattr(codec, "inner", codec), plain, max_entries)


class CountsNothing(DictBackend):
    def get(self, key, out):
        ok = super().get(key, out)
        with self._lock:
            self._stats.misses = self._stats.hits = 0
        return ok


class BatchStopsAtFirstMiss(DictBackend):
    """A batch read that gives up after the first miss (a prefix, not per key)."""

    def get_many(self, keys, outs):
        if len(keys) != len(outs):
            raise ValueError("lengths differ")
        out = []
        for k, o in zip(keys, outs):
            out.append(bool(out[-1] if out else True) and self.get(k, o))
        return out


class PinIsANoOp(LocalCpuBackend):
    def pin(self, keys):
        pass


class TestHonest(DictFixtures):
    pass


class TestIgnoresExpectKey(DictFixtures):
    backend_class = IgnoresExpectKey


class TestIgnoresTheSecret(DictFixtures):
    backend_class = IgnoresTheSecret


class TestCountsNothing(DictFixtures):
    backend_class = CountsNothing


class TestBatchStopsAtFirstMiss(DictFixtures):
    backend_class = BatchStopsAtFirstMiss


class TestNoStorageFixtures(BackendConformance):
    def make_backend(self, ctx, tmp_path):
        return DictBackend(ctx.codec, ctx.codecs, max_entries=1000)


class TestPinIsANoOp(BackendConformance):
    stores_frames = False

    def make_backend(self, ctx, tmp_path):
        return PinIsANoOp(ctx.pool, 16 << 20)

    def make_bounded_backend(self, ctx, tmp_path, max_bytes):
        return PinIsANoOp(ctx.pool, max_bytes)
'''


def test_the_suite_fails_exactly_the_broken_clauses(tmp_path: Path) -> None:
    (tmp_path / "test_broken_backends.py").write_text(SUITE_SRC)
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    failed: dict[str, set[str]] = {}
    for cls, test in re.findall(r"^FAILED \S*::(\w+)::(\w+)", res.stdout, re.M):
        failed.setdefault(cls, set()).add(test)
    assert failed == {
        "TestIgnoresExpectKey": {"test_foreign_frame_is_a_miss"},
        "TestCountsNothing": {
            "test_stats_count_what_happened",
            "test_corrupt_frame_is_a_miss",
            "test_foreign_frame_is_a_miss",
            "test_planted_frames_are_misses",
        },
        "TestBatchStopsAtFirstMiss": {
            "test_get_many_judges_each_key_alone",
            "test_planted_frame_in_a_batch_is_a_miss_for_its_key",
        },
        "TestIgnoresTheSecret": {
            "test_planted_frames_are_misses",
            "test_planted_frame_in_a_batch_is_a_miss_for_its_key",
        },
        "TestNoStorageFixtures": {
            "test_corrupt_frame_is_a_miss",
            "test_foreign_frame_is_a_miss",
            "test_get_many_judges_each_key_alone",
            "test_planted_frames_are_misses",
            "test_planted_frame_in_a_batch_is_a_miss_for_its_key",
        },
        "TestPinIsANoOp": {"test_pinned_chunks_survive_eviction_pressure"},
    }, res.stdout[-4000:]
    assert re.search(r"\d+ passed", res.stdout), res.stdout[-2000:]  # TestHonest and the rest ran
    assert "served another key's frame" in res.stdout
    assert "supply the `corrupt` fixture" in res.stdout
    assert "supply the `plant` fixture" in res.stdout
    assert "was served as a hit" in res.stdout
