"""The ``backends: [{name: disk, ...}]`` section."""

from __future__ import annotations

from pydantic import Field

from lmcache_core.config import ByteSize, Flag, StrictModel


class DiskConfig(StrictModel):
    """Options of the disk tier; see docs/backends/disk.md for the guide."""

    path: str = Field(..., min_length=1, description="directory of the tier; created if missing")
    max_size: ByteSize = Field(
        10 * 2**30, description="byte budget of the directory (all processes sharing it); eviction above it"
    )
    eviction: str = Field(
        "lru",
        description="eviction policy of this process's index: lru (the order survives restarts), or any policy the CPU "
        "tier takes (s3fifo, tinylfu, a plugin's)",
    )
    fsync: Flag = Field(True, description="fsync each chunk file and its directory before it becomes visible")
    o_direct: Flag = Field(False, description="bypass the page cache with O_DIRECT where the filesystem allows it")
    io_threads: int = Field(
        4, ge=1, le=64, description="threads that move payloads, and that scan the directory in the background at start-up"
    )
    verify_on_start: Flag = Field(
        True, description="the background start-up scan reads each file's header; truncated or foreign files are removed"
    )
    scan_rate: int = Field(0, ge=0, description="files per second the background start-up scan handles at most (0: no limit)")
