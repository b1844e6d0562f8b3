"""What the server drops on its own: keyspace notifications for evicted and expired keys.

Redis evicts under ``maxmemory`` (``allkeys-lru`` and the like) and expires keys with a
TTL (``ttl_s``) without telling the client that stored them. With keyspace
notifications on (``notify-keyspace-events`` with ``E``, ``x`` and ``e``), it publishes
each such key's name on ``__keyevent@<db>__:evicted`` / ``:expired``. A
:class:`KeyEventWatcher` subscribes to those channels on its own connection (one per
primary of a cluster: notifications are per node), on a background thread, and hands
the names it read in one wake-up to a callback as a batch; the tier maps names under
its prefix back to chunk keys and reports only those the server no longer holds.

Anyone who may ``PUBLISH`` on the server can send these messages too: the channel is
not the server's alone. So a name is a hint, not a fact: the tier checks each one
with ``EXISTS`` (one pipeline per batch) and drops names the server still holds
(forged, counted). And the watcher reads at most ``max_per_s`` messages in any one
second (all its connections together): the first message past that ends the session,
and closing its connections makes the server discard whatever it still holds for
them, so the rest of the flood costs neither work nor memory here; the watcher
subscribes again when that second is over (a pause, counted). What the server
publishes meanwhile is lost: a real eviction in a flood may go unreported, which
costs a router a stale entry (a later miss), never wrong KV.

The server's setting is read first (``CONFIG GET``) and only the missing flags are
added (``CONFIG SET`` with the server's own flags kept; never when
``configure_keyspace_events`` is false). Where the setting can be read and lacks a
flag that cannot be added (``CONFIG SET`` refused, or not ours to set), the server
publishes no real events, so nothing is subscribed there (whatever arrives would be
forged): that is logged once and checked again every :data:`RECHECK_S`. Where it
cannot be read at all (managed services rename or forbid ``CONFIG`` and take the
setting in their own parameters), the watcher says so once and subscribes anyway: if
the operator turned the flags on, events come. Pub/sub is fire-and-forget: what the
server publishes while the connection is down is lost (counted as a reconnect,
logged); the watcher reconnects after ``retry_s``.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable
from urllib.parse import urlsplit

from .client import Client, Failure, classify, describe, make_client
from .config import RedisConfig

log = logging.getLogger(__name__)

EVENTS = ("evicted", "expired")
NEEDED_FLAGS = "Exe"
"""``E``: keyevent channels; ``x``: expired; ``e``: evicted."""
MAX_MESSAGES_PER_WAKE = 4096
"""Messages read from one connection before the others get their turn (one batch)."""
FLOOD_WINDOW_S = 1.0
"""The window ``max_per_s`` counts messages in."""
RECHECK_S = 60.0
"""How often a server whose notifications are off (and not ours to turn on) is asked again."""


def url_db(url: str | None) -> int:
    if url is None or url.startswith("unix://"):
        return 0
    path = urlsplit(url).path.strip("/")
    return int(path) if path else 0


class _Paused(Exception):
    """More messages than ``max_per_s`` in one window: the session ends here."""


class _Off(Exception):
    """Notifications are off on every node and the watcher may not turn them on."""


def merged_flags(current: str) -> str | None:
    """``current`` with the flags the watcher needs, or None when it has them all
    (``A`` stands for every key-type class, ``x`` and ``e`` included)."""
    have = set(current)
    missing = [f for f in NEEDED_FLAGS if f not in have and not (f in "xe" and "A" in have)]
    return None if not missing else current + "".join(missing)


class KeyEventWatcher:
    """Calls ``on_names([(name, event), ...])`` with the keys the server(s) say they
    evicted or expired, a batch per wake-up (at most :data:`MAX_MESSAGES_PER_WAKE`),
    at most ``max_per_s`` names in any second; ``on_flood()`` when a second had more
    (the subscription then pauses until that second is over)."""

    def __init__(
        self,
        cfg: RedisConfig,
        password: str | None,
        on_names: Callable[[list[tuple[bytes, str]]], None],
        *,
        retry_s: float = 5.0,
        max_per_s: int | None = None,
        on_flood: Callable[[], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self._password = password
        self.on_names = on_names
        self.on_flood = on_flood
        self.retry_s = retry_s
        self.max_per_s = max_per_s if max_per_s is not None else cfg.max_key_events_per_s
        self.db = url_db(cfg.url)
        self.channels = [f"__keyevent@{self.db}__:{e}" for e in EVENTS]
        self.state = "starting"
        self.subscribed = threading.Event()
        self.settled = threading.Event()
        """Set once the first session subscribed, found notifications off, or failed."""
        self.reconnects = 0
        self.pauses = 0
        self.messages = 0
        self.cpu_s = 0.0
        """CPU time of the watcher's thread, the callbacks it ran included."""
        self._window_end = 0.0
        self._left = 0
        self._cpu0 = 0.0
        self._logged: set[str] = set()  # warnings given once per watcher
        self._stop = threading.Event()
        self._client: Client | None = None
        self._thread = threading.Thread(target=self._run, name="lmcache-redis-keyevents", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._drop_client()

    def _drop_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception as err:
                log.debug("redis tier: key-event client close: %s", describe(err))

    # -- one session: connect, configure, subscribe, read until an error --------------
    def _run(self) -> None:
        said = ""  # the failure last logged as a warning (the same one again: debug)
        self._cpu0 = time.thread_time()
        while not self._stop.is_set():
            wait = self.retry_s
            try:
                self._session()
            except _Paused:
                self.subscribed.clear()
                self.pauses += 1
                self.state = f"paused: more than {self.max_per_s} key events in one second"
                wait = max(0.0, self._window_end - time.monotonic())
            except _Off as off:
                self.subscribed.clear()
                self.state = f"off: {off}"
                wait = RECHECK_S
            except Exception as err:
                self.subscribed.clear()
                why = describe(err)
                self.state = f"down: {why}"
                if not self._stop.is_set():
                    self.reconnects += 1
                    if why != said:
                        said = why
                        log.warning(
                            "redis tier: no key-event subscription on %s (%s); what the server drops meanwhile is not "
                            "reported; retrying every %.1fs",
                            self.cfg.target(),
                            why,
                            self.retry_s,
                        )
                    else:
                        log.debug("redis tier: key-event subscription on %s: %s", self.cfg.target(), why)
            finally:
                self._drop_client()
                self.settled.set()
                self.cpu_s = time.thread_time() - self._cpu0
            self._stop.wait(wait)

    def _nodes(self) -> list[Any]:
        """One redis.Redis per server to subscribe on (a cluster: each primary)."""
        self._client = make_client(self.cfg, self._password)
        if self.cfg.cluster is None:
            return [self._client]
        return [n.redis_connection for n in self._client.get_primaries() if n.redis_connection is not None]

    def _take(self) -> bool:
        """Count one message against this window's ``max_per_s``; False past it."""
        now = time.monotonic()
        if now >= self._window_end:
            self._window_end = now + FLOOD_WINDOW_S
            self._left = self.max_per_s
        if self._left <= 0:
            return False
        self._left -= 1
        return True

    def _session(self) -> None:
        nodes = self._nodes()
        pubsubs = []
        try:
            unread: list[str] = []  # why a node's setting is unknown
            off: list[str] = []  # why a node publishes nothing real
            live = []
            for node in nodes:
                verdict, why = self._configure(node)
                if verdict == "off":
                    off.append(why)
                    continue
                if verdict == "unknown":
                    unread.append(why)
                live.append(node)
            if not live:
                raise _Off(off[0])
            for node in live:
                ps = node.pubsub()
                pubsubs.append(ps)
                ps.subscribe(*self.channels)
            # The subscription is in place once each server confirmed it.
            for ps in pubsubs:
                for _ in range(len(self.channels)):
                    msg = ps.get_message(timeout=self.cfg.socket_timeout_s)
                    if msg is None or msg.get("type") != "subscribe":
                        raise ConnectionError(f"no subscribe confirmation (got {msg and msg.get('type')})")
            state = "subscribed"
            if unread:
                state += f" (notify-keyspace-events not readable: {unread[0]})"
            if off:
                state += f" ({len(off)} of {len(nodes)} nodes publish nothing: {off[0]})"
            self.state = state
            self.subscribed.set()
            self.settled.set()
            wait = 0.5 / len(pubsubs)
            while not self._stop.is_set():
                for ps in pubsubs:
                    batch: list[tuple[bytes, str]] = []
                    flooded = False
                    for _ in range(MAX_MESSAGES_PER_WAKE):
                        msg = ps.get_message(timeout=wait if not batch else 0)
                        if msg is None:
                            break
                        if msg.get("type") != "message":
                            continue
                        if not self._take():
                            flooded = True
                            break
                        channel = msg.get("channel", b"")
                        event = channel.rsplit(b":", 1)[-1].decode("ascii", "replace") if isinstance(channel, bytes) else ""
                        data = msg.get("data")
                        if isinstance(data, bytes) and event in EVENTS:
                            batch.append((data, event))
                    if batch:
                        self.messages += len(batch)
                        self.on_names(batch)
                    self.cpu_s = time.thread_time() - self._cpu0
                    if flooded:
                        if self.on_flood is not None:
                            self.on_flood()
                        raise _Paused
        finally:
            for ps in pubsubs:
                try:
                    ps.close()
                except Exception as err:
                    log.debug("redis tier: pubsub close: %s", describe(err))

    def _warn_once(self, kind: str, msg: str, *args: Any) -> None:
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning(msg, *args)

    def _configure(self, node: Any) -> tuple[str, str]:
        """Read the node's ``notify-keyspace-events`` and add the flags the watcher
        needs, keeping the server's others. ``("on", "")`` when the node publishes
        evictions and expiries; ``("unknown", why)`` when the setting cannot be read
        (the subscription goes ahead); ``("off", why)`` when it lacks a flag the watcher
        may not add. Each kind of refusal is logged once."""
        target = self.cfg.target()
        try:
            reply = node.config_get("notify-keyspace-events")
        except Exception as err:
            if classify(err) is Failure.UNAVAILABLE:
                raise
            why = f"CONFIG GET refused: {describe(err)}"
            self._warn_once(
                "unread",
                "redis tier: cannot turn on keyspace notifications on %s (%s): subscribing anyway, but evictions and "
                "expiries are reported only if the server's notify-keyspace-events includes %s (on a managed service: "
                "set it in the service's parameters)",
                target,
                why,
                NEEDED_FLAGS,
            )
            return "unknown", why
        if "notify-keyspace-events" not in reply:
            why = "CONFIG GET does not show notify-keyspace-events"
            self._warn_once(
                "unread",
                "redis tier: cannot turn on keyspace notifications on %s (%s): subscribing anyway, but evictions and "
                "expiries are reported only if the server publishes them (flags %s)",
                target,
                why,
                NEEDED_FLAGS,
            )
            return "unknown", why
        current = str(reply["notify-keyspace-events"])
        flags = merged_flags(current)
        if flags is None:
            return "on", ""
        missing = flags[len(current) :]
        if not self.cfg.configure_keyspace_events:
            why = f"notify-keyspace-events is {current!r}, without {missing!r}, and configure_keyspace_events is false"
        else:
            try:
                node.config_set("notify-keyspace-events", flags)
            except Exception as err:
                if classify(err) is Failure.UNAVAILABLE:
                    raise
                why = f"notify-keyspace-events is {current!r}, without {missing!r}, and CONFIG SET was refused ({describe(err)})"
            else:
                log.warning(
                    "redis tier: turned on keyspace notifications on %s: notify-keyspace-events was %r, now %r (a "
                    "server-wide setting, the server's own flags kept; configure_keyspace_events: false leaves it alone)",
                    target,
                    current,
                    flags,
                )
                return "on", ""
        self._warn_once(
            "off",
            "redis tier: no key events from %s: %s; the server publishes no evictions or expiries, so nothing is "
            "subscribed (evictions are not reported: routers keep stale entries, later misses); set the flags %s on "
            "the server (checked again every %.0f s)",
            target,
            why,
            NEEDED_FLAGS,
            RECHECK_S,
        )
        return "off", why
