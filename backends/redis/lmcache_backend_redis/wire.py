"""Pipelined ``SET``s whose values go out as (header, payload) buffers, never joined.

A frame is a small header plus the chunk's bytes. Joining them into one value would
copy every chunk into freshly allocated memory before it is sent, which costs about as
much as sending it (measured: a 64 x 4 MiB batch took twice as long). Here each
``SET`` is written as RESP with the header and the payload (for the raw codec, a view
of the tensor's own memory) as separate buffers of one bulk string, all commands in
one write, then every reply is read: one round trip, as a redis-py pipeline. Used for
single servers; a cluster goes through redis-py's cluster pipeline, which routes by
slot and follows ``MOVED`` / ``ASK``.
"""

from __future__ import annotations

from typing import Any, Sequence, Union

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

Buffer = Union[bytes, memoryview]


def set_command(name: bytes, header: bytes, payload: memoryview, px: int | None) -> list[Buffer]:
    """``SET name (header + payload) [PX px]`` as RESP, the value in two buffers."""
    n_args = 3 if px is None else 5
    value_len = len(header) + payload.nbytes
    out: list[Buffer] = [
        b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (n_args, len(name), name, value_len),
        header,
        payload,
        b"\r\n",
    ]
    if px is not None:
        ms = b"%d" % px
        out.append(b"$2\r\nPX\r\n$%d\r\n%s\r\n" % (len(ms), ms))
    return out


def pipelined(pool: Any, commands: Sequence[list[Buffer]]) -> list[Any]:
    """Send ``commands`` on one pooled connection in one write, then read one reply
    each. An error reply (``OOM``, ``NOPERM``) is returned in its slot as the
    exception. A connection that turns out dead (the server restarted since it was
    pooled) is dropped and the batch sent once more on a fresh one (``SET`` is
    idempotent); any other failure raises, and the connection is dropped so a
    half-read reply never reaches the next user."""
    for attempt in range(2):
        conn = pool.get_connection()
        try:
            conn.send_packed_command([buf for cmd in commands for buf in cmd])
            replies: list[Any] = []
            for _ in commands:
                try:
                    replies.append(conn.read_response())
                except ResponseError as err:
                    replies.append(err)
            return replies
        except RedisConnectionError:
            conn.disconnect()
            if attempt:
                raise
        except BaseException:
            conn.disconnect()
            raise
        finally:
            pool.release(conn)
    raise AssertionError("unreachable")
