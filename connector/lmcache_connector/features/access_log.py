"""``connector.access_log``: a trace of this server's traffic that an operator can replay
(``lmcache-core replay``) to size and tune the cache on their own workload.

Opt-in. The scheduler side appends one JSON line per finished request (internal
settle requests excluded), in the Mooncake trace format: ``timestamp`` (ms since the
log was opened), ``input_length``, ``output_length`` (tokens) and
``hash_ids``, one id per whole chunk of the prompt (``chunk_size`` tokens: replay
with ``--block-tokens`` set to it). Two requests share their first k
ids exactly when they share the KV of their first k chunks, as in the trace format.
The ids are the chunk hashes passed through a keyed BLAKE2b with a secret drawn per
process (48-bit ids): the log holds no token, no key and nothing from which a prompt
could be checked; ids compare within one recording (one server run). Lines are
written as requests finish: the replayer takes them in that order, which differs from
arrival order only among requests in flight together.

Bounded: the file stops growing at ``access_log_max_bytes`` (one warning; the lines
not written are counted). The file is opened without following a link, made 0600
when created, and must be a regular file of this user's.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import threading
import time
from typing import Sequence

from ..log import get_logger

log = get_logger(__name__)

ID_BYTES = 6


class AccessLogError(OSError):
    pass


class AccessLog:
    def __init__(self, path: str, max_bytes: int, chunk_tokens: int) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.chunk_tokens = chunk_tokens
        self._salt = os.urandom(32)
        try:
            flags = (
                os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
            )  # a FIFO never blocks us
            fd = os.open(path, flags, 0o600)
        except OSError as err:
            raise AccessLogError(f"connector.access_log: cannot open {path}: {err.strerror}") from None
        st = os.fstat(fd)
        why = None
        if not stat.S_ISREG(st.st_mode):
            why = "is not a regular file"
        elif st.st_uid != os.geteuid():
            why = f"belongs to uid {st.st_uid}, not this user"
        elif st.st_mode & 0o022:
            why = f"is writable by other users (mode {st.st_mode & 0o777:o})"
        if why is not None:
            os.close(fd)
            raise AccessLogError(f"connector.access_log: {path} {why}")
        self._fd = fd
        self._size = st.st_size
        self._t0 = time.time()  # vLLM's arrival times are wall-clock seconds
        self._lock = threading.Lock()
        self.written = 0
        self.dropped = 0
        self._full_warned = False

    def _id(self, chunk_hash: bytes) -> int:
        return int.from_bytes(hashlib.blake2b(chunk_hash, key=self._salt, digest_size=ID_BYTES).digest(), "big")

    def record(self, arrival_s: float, input_length: int, output_length: int, chunk_hashes: Sequence[bytes]) -> bool:
        """Append one request; False when the log is full or closed (counted)."""
        with self._lock:
            if self._fd < 0:
                return False
            line = (
                json.dumps(
                    {
                        "timestamp": max(0, round((arrival_s - self._t0) * 1000)),
                        "input_length": int(input_length),
                        "output_length": int(output_length),
                        "hash_ids": [self._id(h) for h in chunk_hashes],
                    },
                    separators=(",", ":"),
                ).encode()
                + b"\n"
            )
            if self._size + len(line) > self.max_bytes:
                self.dropped += 1
                if not self._full_warned:
                    self._full_warned = True
                    log.warning(
                        "connector.access_log: %s reached access_log_max_bytes (%d bytes); later requests are not recorded",
                        self.path,
                        self.max_bytes,
                    )
                return False
            os.write(self._fd, line)
            self._size += len(line)
            self.written += 1
            return True

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
