"""A hard per-tenant byte quota on a shared Redis (``tenant_quota``), kept by the server.

Every engine of a tenant (the core config's ``tenant`` label) writes through one ledger
in Redis, under the tier's prefix: ``{prefix}lmcache-quota-<tenant>:order`` (a sorted
set of the tenant's chunk names, scored by the server's time of the write),
``:sizes`` (a hash, chunk name -> bytes of its value) and ``:bytes`` (their sum). A put
is one transaction (``MULTI`` ... ``EXEC``): a Lua script (:data:`RESERVE_SCRIPT`)
that drops the chunk's own entry (an overwrite never counts twice) and, with
``ttl_s``, entries whose chunk has expired; while the sum plus the new value would
pass the quota, deletes the tenant's oldest chunk and its entry; and enters the new
chunk; then the chunk's ``SET``. The server runs a transaction as a whole, so the
tenant's bytes stay within its quota at every instant, across any number of
processes, and no other tenant's key is ever touched (the script deletes only names
its own ledger lists). A chunk larger than the quota is refused before anything is
sent. The value goes to ``SET`` as it does without a quota (never through Lua, which
would copy it twice more: measured, that halved the put throughput).

What the ledger cannot see makes it overstate, never understate: a chunk the server
evicted (``maxmemory``) or expired is still counted until its entry is popped (the
oldest go first) or pruned. The ledger's own keys can be evicted too (a server whose
``maxmemory`` is reached under an ``allkeys-*`` policy): a part evicted while another
remains is rebuilt from it at the next put (:data:`RESERVE_SCRIPT`); only with both the
order and the sizes gone are the tenant's earlier chunks no longer counted. ``remove`` and ``erase`` drop the entries of what they
delete (:data:`FORGET_SCRIPT`). With ``ttl_s`` the ledger's keys expire a TTL after
the tenant's last write, when every chunk they list has expired too.

Single servers only: a script may touch keys of one hash slot on a Redis Cluster, and
a tenant's chunks spread over every slot (the config refuses the combination).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from .wire import Buffer, Split, commands

LEDGER_NAME = "lmcache-quota-"
"""Ledger keys are ``{prefix}lmcache-quota-<tenant>:<part>``: never a chunk key (those
start with ``v1-``), so no SCAN for chunks or namespace records ever matches them."""

PUT_REPLIES = 4
"""Replies to one chunk's :meth:`TenantLedger.put_commands`."""

PRUNE_PER_PUT = 64
"""Expired entries (``ttl_s``) a put drops at most, so a script's time stays bounded."""

RESERVE_SCRIPT = """
local size = tonumber(ARGV[1])
local quota = tonumber(ARGV[2])
local ttl = tonumber(ARGV[3])
local used = redis.call('GET', KEYS[4])
-- A part of the ledger the server evicted on its own (maxmemory under allkeys-*) while
-- the others stayed is rebuilt from them: the order from the sizes (oldest unknown:
-- all first), the sizes from the order (each chunk's STRLEN; one gone is dropped),
-- the sum from the sizes.
local nsizes = redis.call('HLEN', KEYS[3])
local norder = redis.call('ZCARD', KEYS[2])
if norder == 0 and nsizes > 0 then
  for _, name in ipairs(redis.call('HKEYS', KEYS[3])) do redis.call('ZADD', KEYS[2], 0, name) end
  used = false
elseif nsizes == 0 and norder > 0 then
  for _, name in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
    local n = redis.call('STRLEN', name)
    if n > 0 then redis.call('HSET', KEYS[3], name, n) else redis.call('ZREM', KEYS[2], name) end
  end
  used = false
end
if not used then
  used = 0
  for _, v in ipairs(redis.call('HVALS', KEYS[3])) do used = used + tonumber(v) end
else
  used = tonumber(used)
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function drop(name)
  local s = redis.call('HGET', KEYS[3], name)
  if s then
    redis.call('HDEL', KEYS[3], name)
    used = used - tonumber(s)
  end
  redis.call('ZREM', KEYS[2], name)
end
drop(KEYS[1])
if ttl > 0 then
  local stale = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now - ttl - 1, 'LIMIT', 0, tonumber(ARGV[4]))
  for _, name in ipairs(stale) do drop(name) end
end
local out = {0}
while used + size > quota do
  local head = redis.call('ZRANGE', KEYS[2], 0, 0)
  if #head == 0 then
    redis.call('DEL', KEYS[3])
    used = 0
    break
  end
  drop(head[1])
  redis.call('DEL', head[1])
  out[#out + 1] = head[1]
end
if used < 0 then used = 0 end
local top = redis.call('ZRANGE', KEYS[2], -1, -1, 'WITHSCORES')
if #top == 2 and tonumber(top[2]) > now then now = tonumber(top[2]) end
redis.call('ZADD', KEYS[2], now, KEYS[1])
redis.call('HSET', KEYS[3], KEYS[1], size)
used = used + size
redis.call('SET', KEYS[4], used)
if ttl > 0 then
  for i = 2, 4 do redis.call('PEXPIRE', KEYS[i], ttl) end
end
out[1] = used
return out
"""
"""KEYS: the chunk, the ledger's order, sizes and bytes; ARGV: the value's size, the
quota (never below the size: the tier refuses such a chunk before sending it), the
TTL in ms (0: none), :data:`PRUNE_PER_PUT`. Makes room for the chunk and enters it;
the ``SET`` that follows in the same transaction stores it. Returns ``{used,
evicted...}``: the tenant's bytes after the put and the chunk names deleted."""

FORGET_SCRIPT = """
local n = 0
for _, name in ipairs(KEYS) do
  n = n + redis.call('DEL', name)
  for _, base in ipairs(ARGV) do
    local s = redis.call('HGET', base .. 'sizes', name)
    if s then
      redis.call('HDEL', base .. 'sizes', name)
      redis.call('ZREM', base .. 'order', name)
      local left = redis.call('DECRBY', base .. 'bytes', tonumber(s))
      if left < 0 then redis.call('SET', base .. 'bytes', 0) end
    end
  end
end
return n
"""
"""KEYS: chunk names to delete; ARGV: ledger bases (``{prefix}lmcache-quota-<tenant>:``)
whose entries for them go too. Returns how many of the names existed."""


def ledger_base(prefix: str, tenant: str) -> str:
    """``{prefix}lmcache-quota-<tenant>:``: the ledger's keys are this plus
    ``order``, ``sizes`` and ``bytes`` (``:`` never occurs in a tenant label)."""
    return f"{prefix}{LEDGER_NAME}{tenant}:"


def ledger_pattern(prefix: str) -> str:
    """The SCAN pattern (a glob) of every tenant's ``sizes`` key under ``prefix``,
    ``prefix`` already escaped for a glob by the caller."""
    return f"{prefix}{LEDGER_NAME}*:sizes"


@dataclass(frozen=True)
class PutOutcome:
    """One put's reply: the tenant's bytes after it and the chunk names deleted to
    make room."""

    used: int
    evicted: tuple[bytes, ...]


@dataclass(frozen=True)
class TenantLedger:
    """One tenant's ledger on one server: the commands that write through it."""

    prefix: str
    tenant: str
    quota: int
    ttl_ms: int | None

    @property
    def base(self) -> str:
        return ledger_base(self.prefix, self.tenant)

    def put_commands(self, name: bytes, header: bytes, payload: memoryview) -> list[Buffer]:
        """One chunk's put, :data:`PUT_REPLIES` commands packed for
        :func:`~.wire.pipelined`: ``MULTI``, ``EVAL`` of :data:`RESERVE_SCRIPT`, ``SET``
        (the value as the frame's header and payload buffers, no copy of the chunk;
        ``PX`` with a TTL), ``EXEC``. A transaction runs as a whole, so no other
        client sees the room made but the chunk not stored. ``EVAL`` with the
        script's text rather than ``EVALSHA``: inside a transaction a ``NOSCRIPT``
        (a flushed script cache) would fail only the script and still run the ``SET``."""
        base = self.base.encode()
        size = len(header) + payload.nbytes
        ttl = self.ttl_ms or 0
        keys = [name, base + b"order", base + b"sizes", base + b"bytes"]
        args = [b"%d" % size, b"%d" % self.quota, b"%d" % ttl, b"%d" % PRUNE_PER_PUT]
        expiry = [b"PX", b"%d" % ttl] if ttl else []
        return commands(
            [
                [b"MULTI"],
                [b"EVAL", RESERVE_SCRIPT.encode(), b"4", *keys, *args],
                [b"SET", name, Split(header, payload), *expiry],
                [b"EXEC"],
            ]
        )


def read_put_reply(replies: Sequence[Any]) -> PutOutcome | BaseException:
    """The outcome of one chunk's :meth:`TenantLedger.put_commands` from its four
    replies: the error that failed it (a queued command refused, ``OOM`` included,
    aborts the whole transaction), else what the script said. A reply of another
    shape is a ``ValueError`` (not what this module sent)."""
    for reply in replies:  # a command refused when queued (OOM) comes before EXEC's EXECABORT
        if isinstance(reply, BaseException):
            return reply
    done = replies[-1]
    if not isinstance(done, list) or len(done) != 2:
        raise ValueError(f"unexpected reply to a quota transaction: {done!r:.200}")
    script, stored = done
    for reply in (script, stored):
        if isinstance(reply, BaseException):
            return reply
    if not isinstance(script, list) or not script or not isinstance(script[0], int):
        raise ValueError(f"unexpected reply to the quota script: {script!r:.200}")
    return PutOutcome(int(script[0]), tuple(bytes(r) for r in script[1:] if isinstance(r, (bytes, bytearray))))
