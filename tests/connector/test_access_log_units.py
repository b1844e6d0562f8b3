"""``connector.access_log`` (features/access_log.py): the trace format, ids that are
stable within a recording and meaningless outside it, a bounded file, and a path
nobody else controls."""

from __future__ import annotations

import json
import os

import pytest

from lmcache_connector.features.access_log import AccessLog, AccessLogError


def test_lines_are_mooncake_trace_records_with_prefix_shared_ids(tmp_path):
    path = tmp_path / "trace.jsonl"
    log = AccessLog(str(path), 1 << 20, chunk_tokens=256)
    t = log._t0
    assert log.record(t + 0.25, 800, 17, [b"a" * 16, b"b" * 16, b"c" * 16])
    assert log.record(t + 1.5, 600, 3, [b"a" * 16, b"b" * 16])
    log.close()
    assert not log.record(t + 2, 1, 1, [])  # closed
    one, two = (json.loads(x) for x in path.read_text().splitlines())
    assert one == {"timestamp": 250, "input_length": 800, "output_length": 17, "hash_ids": one["hash_ids"]}
    assert two["timestamp"] == 1500 and two["hash_ids"] == one["hash_ids"][:2]
    assert len(set(one["hash_ids"])) == 3 and all(0 <= i < 1 << 48 for i in one["hash_ids"])
    assert path.stat().st_mode & 0o777 == 0o600
    # another recording (another process) maps the same chunk to another id: an id
    # says nothing outside its recording
    other = AccessLog(str(tmp_path / "other.jsonl"), 1 << 20, chunk_tokens=256)
    other.record(other._t0, 800, 1, [b"a" * 16])
    other.close()
    assert json.loads((tmp_path / "other.jsonl").read_text())["hash_ids"][0] != one["hash_ids"][0]


def test_the_log_stops_at_its_size_bound(tmp_path, caplog):
    path = tmp_path / "trace.jsonl"
    log = AccessLog(str(path), 400, chunk_tokens=256)
    results = [log.record(log._t0, 300, 5, [bytes([i]) * 16] * 3) for i in range(20)]
    log.close()
    assert path.stat().st_size <= 400 and log.written == sum(results) > 0  # control: some were written
    assert log.dropped == 20 - log.written and "reached access_log_max_bytes" in caplog.text
    assert all(json.loads(x) for x in path.read_text().splitlines())  # no torn line


def test_a_path_someone_else_controls_is_refused(tmp_path):
    target = tmp_path / "elsewhere.jsonl"
    target.write_text("")
    link = tmp_path / "link.jsonl"
    link.symlink_to(target)
    with pytest.raises(AccessLogError, match="cannot open"):
        AccessLog(str(link), 1 << 20, 256)
    shared = tmp_path / "shared.jsonl"
    shared.write_text("")
    shared.chmod(0o666)
    with pytest.raises(AccessLogError, match="writable by other users"):
        AccessLog(str(shared), 1 << 20, 256)
    with pytest.raises(AccessLogError, match="Is a directory"):
        AccessLog(str(tmp_path), 1 << 20, 256)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # a reader, so opening it for writing does not block
    with pytest.raises(AccessLogError, match="not a regular file"):
        AccessLog(str(fifo), 1 << 20, 256)
    if os.geteuid() == 0:
        theirs = tmp_path / "theirs.jsonl"
        theirs.write_text("")
        os.chown(theirs, 1, 1)
        with pytest.raises(AccessLogError, match="belongs to uid 1"):
            AccessLog(str(theirs), 1 << 20, 256)
    AccessLog(str(tmp_path / "fine.jsonl"), 1 << 20, 256).close()  # control
