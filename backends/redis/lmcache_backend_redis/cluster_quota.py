"""A hard per-tenant byte quota on a Redis Cluster (``tenant_quota`` with ``cluster``).

On a single server one Lua script deletes the tenant's oldest chunks and enters the new
one, and the ``SET`` follows in the same transaction (:mod:`.quota`). A cluster runs a
script on the keys of one hash slot only, and a tenant's chunks are spread over every
slot, so here the ledger lives in one slot and the chunks' ``DEL`` and ``SET`` go to
their own nodes in separate round trips. The ledger's keys share the hash tag
``{<tenant>}``: ``{prefix}lmcache-quota-{<tenant>}:<part>`` (the same name as a single
server's ledger, with the tenant in braces), parts:

- ``sizes``: hash, name -> bytes of every chunk entered and not deleted (*live* and *pending*);
- ``order``: sorted set of the live chunks (stored, confirmed) by time: the oldest go first;
- ``pending``: sorted set of the chunks reserved and not yet confirmed, by the time their
  reservation lapses (a writer that died: the entry then joins ``order``);
- ``gone`` / ``gonesize``: chunks taken out of ``order`` to be deleted (sorted set by
  the time the deletion lapses; hash, name -> bytes): still counted until the writer
  that took them has deleted them and says so;
- ``bytes``: the sum of ``sizes`` and ``gonesize``, the tenant's counted bytes ``U``.

One script, :data:`STEP_SCRIPT`, is every ledger change of a put (and the writer's
later steps), atomic in its slot. A writer, for a batch of chunks:

1. *reserve*: a chunk is granted (entered as pending) only while ``U + size <= quota``;
   otherwise the script takes the tenant's oldest live chunks into ``gone`` (still
   counted) until the room they will free covers it, and answers "wait" with their
   names; when nothing can be taken (every chunk pending or being deleted) the chunk is
   refused (a skipped put, counted);
2. ``DEL`` of the chunks taken and ``SET`` of the granted ones, in one pipeline;
3. the next step forgets the deleted chunks (``U`` drops), confirms the stored ones
   (pending -> live, a failed ``SET`` drops its entry) and reserves the waiting ones,
   at most :data:`ROUNDS` times; a last step confirms.

The invariant, at every instant: the tenant's bytes on the cluster <= ``U`` <= quota.
``U`` grows only by a grant, which requires room with every pending and every
not-yet-deleted chunk still counted; a chunk is counted from before its ``SET`` until
after its ``DEL`` (a writer deletes what it took before it says so, and writes a chunk
only after its grant). A pending entry is never taken for deletion, so no writer
deletes a chunk whose ``SET`` is in flight and then forgets it while the ``SET`` lands.
What the ledger cannot see makes it overstate, never understate, as on a single
server: chunks the cluster evicted or expired stay counted until taken or pruned.

Lapses (:data:`LEASE_MS` or four times ``call_timeout_s``, the longer): a writer sends
every ``SET`` within one ``call_timeout_s`` of its grant; a writer that died leaves
pending entries that lapse into ``order`` and deletions that lapse back to the next
writer, which deletes them again and forgets them (every time is the ledger
server's ``TIME``, so hosts' clocks do not matter).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from .quota import LEDGER_NAME, PRUNE_PER_PUT

LEASE_MS = 60_000
"""The shortest lapse of a pending entry or a deletion (milliseconds)."""

ROUNDS = 4
"""Reserve steps per batch at most; a chunk still waiting after them is skipped (counted)."""

PARTS = ("sizes", "order", "pending", "gone", "gonesize", "bytes")
"""The ledger's keys, in :data:`STEP_SCRIPT`'s ``KEYS`` order."""

GRANTED, WAIT, REFUSED, IN_FLIGHT = 1, 0, -1, 2
"""A reservation's answers: granted (``SET`` it), wait (chunks are being deleted to make
room: ask again after deleting them), refused (nothing of the tenant's can be taken:
every chunk pending or being deleted), in flight (another writer is storing this very
chunk now: this one skips it)."""

STEP_SCRIPT = """
local quota = tonumber(ARGV[1])
local ttl = tonumber(ARGV[2])
local prune = tonumber(ARGV[3])
local lease = tonumber(ARGV[4])
local nf, nc, nx, nw = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local used = tonumber(redis.call('GET', KEYS[6]) or '0')
local i = 9
local function unsize(name)
  local s = redis.call('HGET', KEYS[1], name)
  if s then
    redis.call('HDEL', KEYS[1], name)
    used = used - tonumber(s)
  end
  return s
end
for _ = 1, nf do
  local name, size = ARGV[i], tonumber(ARGV[i + 1])
  i = i + 2
  local left = tonumber(redis.call('HINCRBY', KEYS[5], name, -size))
  if left <= 0 then
    redis.call('HDEL', KEYS[5], name)
    redis.call('ZREM', KEYS[4], name)
    size = size + left
  end
  used = used - size
end
for _ = 1, nc do
  local name = ARGV[i]
  i = i + 1
  if redis.call('ZREM', KEYS[3], name) == 1 then redis.call('ZADD', KEYS[2], now, name) end
end
for _ = 1, nx do
  local name = ARGV[i]
  i = i + 1
  if redis.call('ZREM', KEYS[3], name) == 1 then unsize(name) end
end
local lapsed = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now, 'LIMIT', 0, prune)
for _, name in ipairs(lapsed) do
  redis.call('ZREM', KEYS[3], name)
  redis.call('ZADD', KEYS[2], now - lease, name)
end
if ttl > 0 then
  local stale = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now - ttl - 1, 'LIMIT', 0, prune)
  for _, name in ipairs(stale) do
    redis.call('ZREM', KEYS[2], name)
    unsize(name)
  end
end
local victims = {}
local function take(name)
  redis.call('ZREM', KEYS[2], name)
  local s = tonumber(redis.call('HGET', KEYS[1], name) or '0')
  redis.call('HDEL', KEYS[1], name)
  redis.call('HINCRBY', KEYS[5], name, s)
  redis.call('ZADD', KEYS[4], now + lease, name)
  victims[#victims + 1] = name
  victims[#victims + 1] = s
  return s
end
local freeing, claim = 0, 0
if nw > 0 then
  local redo = redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', now, 'LIMIT', 0, prune)
  for _, name in ipairs(redo) do
    local s = tonumber(redis.call('HGET', KEYS[5], name) or '0')
    redis.call('ZADD', KEYS[4], now + lease, name)
    victims[#victims + 1] = name
    victims[#victims + 1] = s
    freeing = freeing + s
  end
end
local answers = {}
for _ = 1, nw do
  local name, size = ARGV[i], tonumber(ARGV[i + 1])
  i = i + 2
  if redis.call('ZSCORE', KEYS[3], name) then
    answers[#answers + 1] = 2
  else
    if redis.call('ZSCORE', KEYS[2], name) then freeing = freeing + take(name) end
    if freeing == 0 and claim == 0 and used + size <= quota then
      redis.call('HSET', KEYS[1], name, size)
      redis.call('ZADD', KEYS[3], now + lease, name)
      used = used + size
      answers[#answers + 1] = 1
    else
      while used - freeing + claim + size > quota do
        local head = redis.call('ZRANGE', KEYS[2], 0, 0)
        if #head == 0 then break end
        freeing = freeing + take(head[1])
      end
      if used - freeing + claim + size > quota then
        answers[#answers + 1] = -1
      else
        answers[#answers + 1] = 0
        claim = claim + size
      end
    end
  end
end
if used < 0 then used = 0 end
redis.call('SET', KEYS[6], used)
if ttl > 0 then
  for k = 1, 6 do redis.call('PEXPIRE', KEYS[k], ttl + 2 * lease) end
end
return {used, answers, victims}
"""
"""``KEYS``: the ledger's :data:`PARTS`. ``ARGV``: quota, TTL in ms (0: none), entries
pruned at most, the lapse in ms, then the counts of four lists and the lists: deleted
chunks to forget (name, bytes), stored chunks to confirm (name), failed chunks to drop
(name), chunks wanted (name, bytes). Returns ``{U, answers, victims}``: the counted
bytes after the step, one answer per chunk wanted (:data:`GRANTED` ...), and the
chunks to delete (name, bytes: this step's, and with chunks wanted the lapsed
deletions of writers that died, taken over: they free room for this writer).

Within a step, the chunks wanted share the room being made: once one had to wait, the
following ones wait too (``claim``: the bytes of those waiting, ``freeing``: of the
chunks taken), so none is granted ahead of them. A wanted chunk that is live already (an overwrite, or the cluster
dropped it and the ledger still counts it) is taken for deletion first: it is stored
again only once its old value is deleted and forgotten."""

FORGET_NAMES_SCRIPT = """
local n = 0
for _, name in ipairs(ARGV) do
  if redis.call('ZREM', KEYS[2], name) == 1 then
    local s = redis.call('HGET', KEYS[1], name)
    redis.call('HDEL', KEYS[1], name)
    if s then
      local left = redis.call('DECRBY', KEYS[6], tonumber(s))
      if left < 0 then redis.call('SET', KEYS[6], 0) end
    end
    n = n + 1
  end
end
return n
"""
"""``KEYS``: the ledger's :data:`PARTS`; ``ARGV``: names of live chunks that ``remove``
or ``erase`` deleted. Drops their entries (a pending one stays: its writer confirms
it). Returns how many it dropped."""


def cluster_ledger_base(prefix: str, tenant: str) -> str:
    """``{prefix}lmcache-quota-{<tenant>}:``: every part of the ledger hashes to the slot
    of ``<tenant>`` (``{`` and ``}`` never occur in a tenant label)."""
    return f"{prefix}{LEDGER_NAME}{{{tenant}}}:"


@dataclass
class Batch:
    """One ``put_many``'s chunks through the ledger: what the next step tells it."""

    forget: list[tuple[bytes, int]] = field(default_factory=list)
    confirm: list[bytes] = field(default_factory=list)
    failed: list[bytes] = field(default_factory=list)


@dataclass(frozen=True)
class StepOutcome:
    """One step's answer: the counted bytes, the answer per chunk wanted, the chunks to
    delete (name, bytes)."""

    used: int
    answers: tuple[int, ...]
    victims: tuple[tuple[bytes, int], ...]


@dataclass(frozen=True)
class ClusterLedger:
    """One tenant's ledger on a cluster: the scripts' calls."""

    prefix: str
    tenant: str
    quota: int
    ttl_ms: int | None
    lease_ms: int

    @property
    def base(self) -> str:
        return cluster_ledger_base(self.prefix, self.tenant)

    def keys(self) -> list[str]:
        return [self.base + part for part in PARTS]

    def step(self, client: Any, batch: Batch, wanted: Sequence[tuple[bytes, int]]) -> StepOutcome:
        """Run :data:`STEP_SCRIPT` with what ``batch`` has to report (then cleared) and
        the chunks ``wanted``."""
        args: list[bytes | int] = [self.quota, self.ttl_ms or 0, PRUNE_PER_PUT, self.lease_ms]
        args += [len(batch.forget), len(batch.confirm), len(batch.failed), len(wanted)]
        for name, size in batch.forget:
            args += [name, size]
        args += batch.confirm
        args += batch.failed
        for name, size in wanted:
            args += [name, size]
        batch.forget, batch.confirm, batch.failed = [], [], []
        reply = client.register_script(STEP_SCRIPT)(keys=self.keys(), args=args)
        return read_step(reply, len(wanted))

    def forget_names(self, client: Any, names: Sequence[bytes]) -> int:
        """Drop live entries of chunks deleted by ``remove`` or ``erase``."""
        return forget_in(client, self.base, names)


def forget_in(client: Any, base: str, names: Sequence[bytes]) -> int:
    """:data:`FORGET_NAMES_SCRIPT` on the ledger whose keys start with ``base``."""
    if not names:
        return 0
    return int(client.register_script(FORGET_NAMES_SCRIPT)(keys=[base + part for part in PARTS], args=list(names)))


def read_step(reply: Any, wanted: int) -> StepOutcome:
    """:data:`STEP_SCRIPT`'s reply, checked: a reply of another shape is a ``ValueError``
    (not what this module sent)."""
    if not isinstance(reply, list) or len(reply) != 3 or not isinstance(reply[0], int):
        raise ValueError(f"unexpected reply to the cluster quota script: {reply!r:.200}")
    used, answers, victims = reply
    if not isinstance(answers, list) or len(answers) != wanted or not all(isinstance(a, int) for a in answers):
        raise ValueError(f"unexpected answers from the cluster quota script: {answers!r:.200}")
    if not isinstance(victims, list) or len(victims) % 2:
        raise ValueError(f"unexpected victims from the cluster quota script: {victims!r:.200}")
    pairs = tuple((bytes(victims[j]), int(victims[j + 1])) for j in range(0, len(victims), 2))
    return StepOutcome(int(used), tuple(answers), pairs)
