"""The disk tier's start-up layer: the background scan that builds the index.

The constructor returns at once; :class:`StartupScan` indexes the directory shard
by shard on a pool of its own (paced by ``scan_rate``), serving meanwhile, then
merges what it found into the index (mtime order), and recounts and trims the
directory under the budget lock, all in one thread (:meth:`wait_for_scan`).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from .keeper import BudgetKeeper
from .scan import Pacer, ScanResult, scan_shards

log = logging.getLogger("lmcache_backend_disk.backend")

PROGRESS_LOG_S = 10.0  # the background scan logs its progress this often


class StartupScan(BudgetKeeper):
    """The background start-up scan and its state."""

    def _start_scan(self) -> None:
        """Start the background scan (a tier without its directory open has none).
        Until its index is complete, chunks it has listed wait in _found (key ->
        size) and in _found_heap (mtime order: the eviction victims meanwhile); keys
        dropped meanwhile are remembered so a listing that raced with the drop is
        ignored."""
        self._indexing = self._root_fd is not None
        self._found = {}
        self._found_bytes = 0
        self._found_heap = []
        self._dropped = set()
        self._scan_stop = threading.Event()
        self._scan_done = threading.Event()
        self._extra.update(
            startup_stale_temps=0,
            startup_bad_removed=0,
            startup_foreign_kept=0,
            startup_shards_refused=0,
            startup_not_regular=0,
            scan_state="indexing" if self._indexing else "skipped",
            scan_shards_done=0,
            scan_files=0,
            scan_index_s=None,
            scan_s=None,
        )
        self._scan_thread = None
        self._scan_running = self._indexing  # under self._lock: the thread has not finished
        self._close_deferred = False  # under self._lock: close() left the directory to the thread
        if self._indexing:
            self._scan_thread = threading.Thread(target=self._background_scan, name="lmcache-disk-scan", daemon=True)
            self._scan_thread.start()
        else:
            self._scan_done.set()

    def wait_for_scan(self, timeout: float | None = None) -> bool:
        """Wait until the background start-up scan (index, recount, trim) is over;
        False on timeout."""
        return self._scan_done.wait(timeout)

    @property
    def index_complete(self) -> bool:
        return not self._indexing

    def _background_scan(self) -> None:
        """Index the directory shard by shard (on a pool of its own, paced by
        ``scan_rate``), serving meanwhile; then order the index by mtime, and recount
        and trim the directory under the budget lock. Killing the process at any
        point loses nothing: only the index is built, in memory."""
        assert self._root_fd is not None
        t0 = time.perf_counter()
        verify = self.cfg.verify_on_start
        log.info("disk tier %s: indexing the directory in the background (verify_on_start=%s)", self.root, verify)
        state = "failed"
        try:
            total = self._scan_index()
            if self._scan_stop.is_set():
                state = "stopped"
                return
            self._merge_found()
            with self._lock:
                self._extra.update(
                    scan_state="trimming",
                    scan_index_s=round(time.perf_counter() - t0, 4),
                    startup_stale_temps=total.stale_temps,
                    startup_bad_removed=total.bad_removed,
                    startup_foreign_kept=total.foreign_kept,
                    startup_shards_refused=total.shards_refused,
                    startup_not_regular=total.not_regular,
                )
            if self._budget is not None:
                self._recount_and_trim()
            state = "stopped" if self._scan_stop.is_set() else "complete"
            log.info(
                "disk tier %s: index complete: %d chunk files in %.2f s (%d invalid removed, %d stale temps removed, "
                "%d foreign files kept, %d non-regular entries removed), %d evictions",
                self.root,
                self._extra["scan_files"],
                time.perf_counter() - t0,
                total.bad_removed,
                total.stale_temps,
                total.foreign_kept,
                total.not_regular,
                self._stats.evictions,
            )
        except Exception:
            log.exception("disk tier %s: background start-up scan failed; serving goes on from the files", self.root)
        finally:
            self._end_scan(state, t0)

    def _scan_index(self) -> ScanResult:
        """The listing part of the scan: every shard's chunks into the found ones,
        progress logged every :data:`PROGRESS_LOG_S`; returns the totals."""
        assert self._root_fd is not None
        total = ScanResult()
        seq = 0
        next_log = time.monotonic() + PROGRESS_LOG_S
        with ThreadPoolExecutor(max_workers=self.cfg.io_threads, thread_name_prefix="lmcache-disk-scan") as pool:
            pace = Pacer(self.cfg.scan_rate, self._scan_stop).wait if self.cfg.scan_rate else None
            parts = scan_shards(
                self._root_fd,
                str(self.root),
                verify=self.cfg.verify_on_start,
                pool=pool,
                judge=self._judge,
                stop=self._scan_stop,
                pace=pace,
                drop_odd=self._drop_odd,
            )
            for part in parts:
                with self._lock:
                    seq = self._take_found(part.entries, seq)
                    self._extra["scan_shards_done"] += 1
                    self._extra["scan_files"] += len(part.entries)
                part.entries = []
                total.merge(part)
                if time.monotonic() >= next_log:
                    next_log = time.monotonic() + PROGRESS_LOG_S
                    log.info(
                        "disk tier %s: background scan %d/256 shards, %d chunk files indexed",
                        self.root,
                        self._extra["scan_shards_done"],
                        self._extra["scan_files"],
                    )
        return total

    def _end_scan(self, state: str, t0: float) -> None:
        """The scan thread's last act, whatever happened: no more found chunks, the
        final state, and the directory closed if close() left it to this thread."""
        with self._lock:
            self._indexing = False
            self._found, self._found_heap, self._found_bytes = {}, [], 0
            self._dropped.clear()
            self._extra["scan_state"] = state
            self._extra["scan_s"] = round(time.perf_counter() - t0, 4)
            self._scan_running = False
            release = self._close_deferred
        self._scan_done.set()
        if release:  # close() gave up waiting for us: the directory is ours to close
            self._release_dir()
