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
(forged, counted); and at most ``max_key_events_per_s`` names a second are checked
at all (a token bucket), the rest dropped and counted, so a flood costs bounded work.

The server's setting is read first and the missing flags added (``CONFIG SET``, the
other flags kept). A server that refuses (managed services rename or forbid
``CONFIG``) is logged once and subscribed anyway: if its operator turned the flags on,
events still come. Pub/sub is fire-and-forget: what the server publishes while the
connection is down is lost (counted as a reconnect, logged); the watcher reconnects
after ``retry_s``.
"""

from __future__ import annotations

import logging
import threading
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


def url_db(url: str | None) -> int:
    if url is None or url.startswith("unix://"):
        return 0
    path = urlsplit(url).path.strip("/")
    return int(path) if path else 0


def merged_flags(current: str) -> str | None:
    """``current`` with the flags the watcher needs, or None when it has them all
    (``A`` stands for every key-type class, ``x`` and ``e`` included)."""
    have = set(current)
    missing = [f for f in NEEDED_FLAGS if f not in have and not (f in "xe" and "A" in have)]
    return None if not missing else current + "".join(missing)


class KeyEventWatcher:
    """Calls ``on_names([(name, event), ...])`` with the keys the server(s) say they
    evicted or expired, a batch per wake-up (at most :data:`MAX_MESSAGES_PER_WAKE`)."""

    def __init__(
        self,
        cfg: RedisConfig,
        password: str | None,
        on_names: Callable[[list[tuple[bytes, str]]], None],
        *,
        retry_s: float = 5.0,
    ) -> None:
        self.cfg = cfg
        self._password = password
        self.on_names = on_names
        self.retry_s = retry_s
        self.db = url_db(cfg.url)
        self.channels = [f"__keyevent@{self.db}__:{e}" for e in EVENTS]
        self.state = "starting"
        self.subscribed = threading.Event()
        self.reconnects = 0
        self.messages = 0
        self._config_refused_logged = False
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
        while not self._stop.is_set():
            try:
                self._session()
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
            self._stop.wait(self.retry_s)

    def _nodes(self) -> list[Any]:
        """One redis.Redis per server to subscribe on (a cluster: each primary)."""
        self._client = make_client(self.cfg, self._password)
        if self.cfg.cluster is None:
            return [self._client]
        return [n.redis_connection for n in self._client.get_primaries() if n.redis_connection is not None]

    def _session(self) -> None:
        nodes = self._nodes()
        pubsubs = []
        try:
            for node in nodes:
                self._configure(node)
                ps = node.pubsub()
                pubsubs.append(ps)
                ps.subscribe(*self.channels)
            # The subscription is in place once each server confirmed it.
            for ps in pubsubs:
                for _ in range(len(self.channels)):
                    msg = ps.get_message(timeout=self.cfg.socket_timeout_s)
                    if msg is None or msg.get("type") != "subscribe":
                        raise ConnectionError(f"no subscribe confirmation (got {msg and msg.get('type')})")
            self.state = "subscribed"
            self.subscribed.set()
            wait = 0.5 / len(pubsubs)
            while not self._stop.is_set():
                for ps in pubsubs:
                    batch: list[tuple[bytes, str]] = []
                    for _ in range(MAX_MESSAGES_PER_WAKE):
                        msg = ps.get_message(timeout=wait if not batch else 0)
                        if msg is None:
                            break
                        if msg.get("type") != "message":
                            continue
                        channel = msg.get("channel", b"")
                        event = channel.rsplit(b":", 1)[-1].decode("ascii", "replace") if isinstance(channel, bytes) else ""
                        data = msg.get("data")
                        if isinstance(data, bytes) and event in EVENTS:
                            batch.append((data, event))
                    if batch:
                        self.messages += len(batch)
                        self.on_names(batch)
        finally:
            for ps in pubsubs:
                try:
                    ps.close()
                except Exception as err:
                    log.debug("redis tier: pubsub close: %s", describe(err))

    def _configure(self, node: Any) -> None:
        """Turn on the flags the watcher needs, keeping the server's others; a refusal
        is logged once (the subscription goes ahead)."""
        try:
            current = str(node.config_get("notify-keyspace-events").get("notify-keyspace-events", ""))
            flags = merged_flags(current)
            if flags is not None:
                node.config_set("notify-keyspace-events", flags)
                log.info("redis tier: notify-keyspace-events on %s was %r, now %r", self.cfg.target(), current, flags)
        except Exception as err:
            if classify(err) is Failure.UNAVAILABLE:
                raise
            if not self._config_refused_logged:
                self._config_refused_logged = True
                log.warning(
                    "redis tier: cannot turn on keyspace notifications on %s (%s): evictions and expiries are reported "
                    "only if the server's notify-keyspace-events already includes %s (set it in the service's parameters)",
                    self.cfg.target(),
                    describe(err),
                    NEEDED_FLAGS,
                )
