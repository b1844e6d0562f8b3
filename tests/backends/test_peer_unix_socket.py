"""A peer node owns its ``--unix-socket`` path, and nothing else there (checked on a
real ``lmcache-core serve`` in a child process, local paths only):

* only a stale socket of the node's own user is replaced (in a private directory, or
  one writable by all with the sticky bit); the new socket is 0600 and serves.
* anything else at the path (a regular file, a FIFO, a directory, a symbolic link, a
  live socket, another user's socket) or a directory writable by all without the
  sticky bit stops the node with a one-line error naming the path and what is there,
  and is left untouched (links are never followed).
* shutdown removes the node's own socket only (same inode), never what someone put
  at its path since.

Cases that chown a squatting socket to another user need root (skipped otherwise).
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from peer_clients import SECRET, write_secret  # noqa: E402
from peer_node import PeerNode, first_line  # noqa: E402

from lmcache_backend_peer import PeerClient  # noqa: E402
from lmcache_backend_peer import protocol as p  # noqa: E402
from lmcache_core.testing import random_key  # noqa: E402

OTHER_UID = 65534  # nobody
IS_ROOT = os.geteuid() == 0


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A private (0700) directory with a short path: Unix socket paths are limited to
    107 bytes, which pytest's own tmp_path can exceed."""
    d = Path(tempfile.mkdtemp(prefix="peer-sock-", dir="/tmp"))
    yield d
    os.chmod(d, 0o700)
    shutil.rmtree(d, ignore_errors=True)


@dataclass
class Launch:
    """What ``lmcache-core serve`` did with a socket path: started (then it is
    stopped with SIGTERM), or exited with ``rc`` and ``stderr``."""

    started: bool
    rc: int | None
    stderr: str


def launch(sock: Path, secret: Path) -> Launch:
    """Run a node on ``sock`` until it prints ``listening on`` or exits (bounded)."""
    exe = shutil.which("lmcache-core", path=os.path.dirname(sys.executable))
    assert exe
    argv = [exe, "serve", "--listen", "127.0.0.1:0", "--secret-file", str(secret), "--max-size", "16MiB"]
    proc = subprocess.Popen(
        [*argv, "--unix-socket", str(sock), "--no-shm"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    started = first_line(proc, "listening on ") is not None
    if started or proc.poll() is None:
        proc.terminate()
    try:
        _, err = proc.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate(timeout=15)
    return Launch(started, None if started else proc.returncode, err)


def stale_socket(path: Path) -> None:
    """A socket file nobody listens on (what a killed node leaves)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.close()


def listening_socket(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.listen(4)
    return s


def identity(path: Path) -> tuple[int, int, int, int]:
    """(kind and mode, uid, device, inode) of ``path`` itself (links not followed)."""
    st = os.lstat(path)
    return st.st_mode, st.st_uid, st.st_dev, st.st_ino


@dataclass
class Squat:
    """What is at the path before the node starts; ``check`` says it is untouched."""

    phrase: str
    """What the node's error must say about it."""
    check: Callable[[], bool]
    """Whether what was there is still there, untouched."""
    cleanup: Callable[[], None] = lambda: None


def squat(case: str, d: Path, sock: Path) -> Squat:
    """Put ``case`` at ``sock`` (in directory ``d``)."""
    elsewhere = d / "elsewhere"
    elsewhere.mkdir()
    if case == "regular file":
        sock.write_text("someone's data\n")
        before = identity(sock)
        return Squat("regular file", lambda: identity(sock) == before and sock.read_text() == "someone's data\n")
    if case == "FIFO":
        os.mkfifo(sock, 0o600)
        before = identity(sock)
        return Squat("FIFO", lambda: identity(sock) == before)
    if case == "directory":
        sock.mkdir()
        (sock / "inside").write_text("x")
        before = identity(sock)
        return Squat("directory", lambda: identity(sock) == before and (sock / "inside").exists())
    if case == "symlink to a stale socket of ours":
        target = elsewhere / "target.sock"
        stale_socket(target)
        sock.symlink_to(target)
        before, tbefore = identity(sock), identity(target)
        return Squat("symbolic link", lambda: (identity(sock), identity(target)) == (before, tbefore))
    if case == "dangling symlink":
        target = elsewhere / "would-be.sock"
        sock.symlink_to(target)
        before = identity(sock)
        return Squat("symbolic link", lambda: identity(sock) == before and not os.path.lexists(target))
    if case == "live socket of ours":
        listener = listening_socket(sock)
        before = identity(sock)

        def still_live() -> bool:
            if not os.path.lexists(sock) or identity(sock) != before:
                return False
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.settimeout(2)
                probe.connect(str(sock))  # still ours to accept on
                return True
            except OSError:
                return False
            finally:
                probe.close()

        return Squat("another node is listening", still_live, listener.close)
    if case in ("stale socket of another user", "live socket of another user"):
        if not IS_ROOT:
            pytest.skip("making a file of another user needs root")
        other = listening_socket(sock) if case.startswith("live") else None
        if other is None:
            stale_socket(sock)
        os.chown(sock, OTHER_UID, OTHER_UID)
        before = identity(sock)
        return Squat(
            f"uid {OTHER_UID}",
            lambda: os.path.lexists(sock) and identity(sock) == before,
            other.close if other else lambda: None,
        )
    if case == "directory writable by all, no sticky bit":
        os.chmod(d, 0o777)
        return Squat("sticky bit", lambda: not os.path.lexists(sock))
    raise AssertionError(case)


REFUSED = [
    "regular file",
    "FIFO",
    "directory",
    "symlink to a stale socket of ours",
    "dangling symlink",
    "live socket of ours",
    "stale socket of another user",
    "live socket of another user",
    "directory writable by all, no sticky bit",
]


@pytest.mark.parametrize("case", REFUSED)
def test_a_squatted_socket_path_is_refused_and_left_alone(short_dir: Path, case: str) -> None:
    secret = write_secret(short_dir)
    sock = short_dir / "node.sock"
    what = squat(case, short_dir, sock)
    try:
        got = launch(sock, secret)
        print(f"{case}: started={got.started} rc={got.rc} stderr={got.stderr.strip()!r}")
        assert not got.started, f"the node started on {case}"
        assert got.rc == 2, got
        lines = got.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in got.stderr, got.stderr  # one clear line, never a traceback
        assert str(sock) in lines[0] and what.phrase in lines[0], lines[0]
        assert what.check(), f"{case} at {sock} was changed or removed"  # never unlinked, replaced or followed
    finally:
        what.cleanup()


def test_a_stale_socket_of_ours_is_replaced_and_a_sticky_world_writable_directory_is_fine(short_dir: Path) -> None:
    """Negative controls: what a killed node leaves is replaced (in a directory like
    /tmp: writable by all, with the sticky bit), and the new socket is 0600 and serves."""
    os.chmod(short_dir, 0o1777)
    secret = write_secret(short_dir)
    sock = short_dir / "node.sock"
    stale_socket(sock)
    old = os.lstat(sock)
    node = PeerNode(["--max-size", "16MiB", "--unix-socket", str(sock), "--no-shm"], secret)
    try:
        new = os.lstat(sock)  # (the inode number may be reused: compare creation times)
        assert stat.S_ISSOCK(new.st_mode) and stat.S_IMODE(new.st_mode) == 0o600 and new.st_uid == os.geteuid()
        assert new.st_ctime_ns > old.st_ctime_ns  # a new file
        assert served_over(sock)
        node.kill()  # a crash leaves its socket: the next start replaces it again
        assert os.lstat(sock).st_ctime_ns == new.st_ctime_ns and not served_over(sock)
        node.start()
        assert os.lstat(sock).st_ctime_ns > new.st_ctime_ns and served_over(sock)
    finally:
        node.stop()
    assert not os.path.lexists(sock)  # positive control: shutdown removes its own socket


def served_over(sock: Path) -> bool:
    """A lookup over ``sock`` is answered (the node listens there)."""
    client = PeerClient(str(sock), SECRET.encode(), timeout=5.0, pool_size=0)
    try:
        return client.lookup([random_key()]) == 0
    except p.PeerError:
        return False
    finally:
        client.close()


@pytest.mark.parametrize("replacement", ["regular file", "another socket"])
def test_shutdown_removes_only_the_nodes_own_socket(short_dir: Path, replacement: str) -> None:
    secret = write_secret(short_dir)
    sock = short_dir / "node.sock"
    node = PeerNode(["--max-size", "16MiB", "--unix-socket", str(sock), "--no-shm"], secret)
    try:
        os.rename(sock, short_dir / "moved.sock")  # someone moved the node's socket away...
        if replacement == "regular file":  # ...and put something else at its path
            sock.write_text("not the node's\n")
        else:
            stale_socket(sock)
        before = identity(sock)
    finally:
        node.stop()
    assert node.proc is not None and node.proc.returncode == 0
    left = os.path.lexists(sock) and identity(sock) == before
    print(f"after shutdown the {replacement} at the node's path is {'left' if left else 'GONE'}")
    assert left
