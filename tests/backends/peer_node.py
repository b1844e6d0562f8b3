"""A real standalone peer cache node (``lmcache-core serve``) in a child process, for
the node's admission, tenant and socket tests and the soak: start it with extra options,
read its address, measure its RSS, kill it and start it again on the same port."""

from __future__ import annotations

import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

STARTUP_TIMEOUT = 60.0


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` from /proc (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def first_line(proc: subprocess.Popen[str], prefix: str, timeout: float = STARTUP_TIMEOUT) -> str | None:
    """The next line ``proc`` prints on stdout that starts with ``prefix``, or None when
    it closes stdout (exits) or ``timeout`` passes first. One reader thread per process
    feeds a queue kept on ``proc``, so a child that prints nothing never blocks the
    caller past ``timeout``, and lines already read ahead are there for the next call."""
    lines: queue.Queue[str | None] | None = getattr(proc, "_lines", None)
    if lines is None:
        lines = proc._lines = queue.Queue()  # type: ignore[attr-defined]

        def pump(lines: queue.Queue[str | None] = lines) -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            return None
        if line is None:
            return None
        if line.startswith(prefix):
            return line
    return None


class PeerNode:
    """``lmcache-core serve --listen 127.0.0.1:PORT`` with ``options``; the secret comes
    from ``secret_file`` (or a tenants file among ``options``)."""

    def __init__(self, options: list[str], secret_file: Path | None = None, port: int = 0) -> None:
        exe = shutil.which("lmcache-core", path=os.path.dirname(sys.executable))
        assert exe, "install the core (pip install -e .) for its console script"
        self.argv = [exe, "serve", *options] + (["--secret-file", str(secret_file)] if secret_file else [])
        self.port = port
        self.proc: subprocess.Popen[str] | None = None
        self.start()

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None
        self.proc = subprocess.Popen(
            [*self.argv, "--listen", f"127.0.0.1:{self.port}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        proc = self.proc
        line = first_line(proc, "listening on ")
        if line is not None:
            self.port = int(line.rsplit(":", 1)[1])
            return
        self.kill()
        err = proc.stderr.read()[-2000:] if proc.stderr else ""
        raise AssertionError(f"peer node did not start: rc={proc.poll()} stderr={err}")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def rss(self) -> int:
        return rss_bytes(self.pid)

    def kill(self) -> None:
        """SIGKILL (a crash, not a shutdown) and reap."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
