"""Namespace records in the tier's directory (:mod:`lmcache_core.namespaces`): one
small file per namespace id in the directory's root, next to the marker, outside
the byte budget, the shards and eviction::

    <path>/LMCACHE_DISK_TIER.ns-<namespace id, 32 hex digits>

Written to a temp name in the root and renamed over the record (atomic for readers);
read without following links, only regular files, at most
:data:`~lmcache_core.namespaces.MAX_RECORD_BYTES` each."""

from __future__ import annotations

import os
import secrets

from lmcache_core.namespaces import MAX_RECORD_BYTES, MAX_RECORDS, namespace_of

from .directory import MARKER
from .fileio import NotRegularFile, open_regular

RECORD_PREFIX = f"{MARKER}.ns-"
_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL


def record_name(namespace: bytes) -> str:
    return RECORD_PREFIX + namespace.hex()


def write_record(root_fd: int, namespace: bytes, record: bytes) -> None:
    """Replace the record of ``namespace`` with ``record`` (OSError on failure)."""
    name = record_name(namespace)
    temp = f"{name}.tmp-{os.getpid()}-{secrets.token_hex(8)}"
    fd, _ = open_regular(temp, dir_fd=root_fd, flags=_FLAGS)
    try:
        try:
            view = memoryview(record)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        os.rename(temp, name, src_dir_fd=root_fd, dst_dir_fd=root_fd)
    except BaseException:
        try:
            os.unlink(temp, dir_fd=root_fd)
        except OSError:
            pass
        raise


def read_records(root_fd: int) -> dict[bytes, bytes]:
    """Every record file in the root, by namespace id (others and odd files skipped)."""
    out: dict[bytes, bytes] = {}
    for name in os.listdir(root_fd):
        if len(out) >= MAX_RECORDS:
            break
        if not name.startswith(RECORD_PREFIX):
            continue
        namespace = namespace_of(name[len(RECORD_PREFIX) :])
        if namespace is None:
            continue
        try:
            fd, st = open_regular(name, dir_fd=root_fd)
        except (NotRegularFile, FileNotFoundError, OSError):
            continue
        try:
            if st.st_size <= MAX_RECORD_BYTES:
                out[namespace] = os.read(fd, MAX_RECORD_BYTES + 1)
        finally:
            os.close(fd)
    return out
