"""The hub's event feed: one stream of the broker's lease events for every server of the hub.

:class:`LeaseFeed` follows the broker's ``api/events`` from its latest event on (its cursor),
reconnects with back-off after a lost connection, asks its owner to resync (read again what it
follows) each time it (re)connects, and hands every event, in order, to its registered listeners
and to the ``on_event`` callable it was given. What an event means for a followed lease is the
owner's business (:class:`.link.BrokerLink`'s watches), not the feed's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from ..client import Backoff, BrokerError
from ..tasks import BackgroundTasks

log = logging.getLogger("jupyter_gpulease.hub")

# event kinds after which the lease JSON is read again (its placement, expiry, end reason)
REFRESH_KINDS = ("granted", "extended", "ended", "confirmed", "preempt-warned", "preempt-cancelled", "warned")

RESYNC = {"kind": "resync", "lease_id": ""}  # what listeners hear when events may have been missed


def _nothing(*args: Any) -> None:
    return None


async def _no_resync() -> None:
    return None


class LeaseFeed:
    """One subscription to the broker's lease events (see the module doc).

    ``client``: :class:`~jupyter_gpulease.client.BrokerClient`'s ``events`` method (or a fake).
    ``on_event(event)``: each event, in order, after the listeners heard it.
    ``resync()``: awaited at each (re)connection, before the first events after it; a
    :class:`~jupyter_gpulease.client.BrokerError` from it counts as a failed connection.
    ``needed()``: whether the owner needs the feed (besides the listeners, which always do); the
    feed runs while it or a listener needs it, and :meth:`start` runs it again.
    ``on_connected()``: the feed answers again (after a start or a lost connection).
    ``on_unreachable(message)``: a call failed because the broker cannot be reached.
    ``background(coro)``: starts the feed's task (default: a :class:`BackgroundTasks` of its own).
    ``feed_timeout``: seconds of each long-poll.
    """

    def __init__(
        self,
        client: Any,
        *,
        on_event: Callable[[dict], Any] = _nothing,
        resync: Callable[[], Awaitable[None]] = _no_resync,
        needed: Callable[[], bool] = lambda: False,
        on_connected: Callable[[], Any] = _nothing,
        on_unreachable: Callable[[str], Any] = _nothing,
        background: Callable[[Coroutine], asyncio.Task] | None = None,
        logger: logging.Logger | logging.LoggerAdapter | None = None,
        feed_timeout: float = 30,
    ):
        self.client = client
        self.on_event = on_event
        self.resync = resync
        self.needed = needed
        self.on_connected = on_connected
        self.on_unreachable = on_unreachable
        self.log = logger or log
        self.feed_timeout = feed_timeout
        self.listeners: list[Callable[[dict], Any]] = []
        self.cursor: int | None = None  # the last event id seen (None: not started)
        self.connected = False  # caught up: every event reaches its listeners at once
        self.closed = False
        self._background = background or BackgroundTasks(self.log).start
        self._task: asyncio.Task | None = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def wanted(self) -> bool:
        """Whether anyone needs the feed: a listener, or the owner (``needed()``)."""
        return bool(self.listeners) or bool(self.needed())

    def start(self) -> None:
        """Run the feed (unless it runs, is closed, or nobody needs it)."""
        if self.closed or self.running or not self.wanted:
            return
        self._task = self._background(self._run())

    def add_listener(self, listener: Callable[[dict], Any]) -> Callable[[], None]:
        """Call ``listener(event)`` with every event, and with :data:`RESYNC` at each
        (re)connection; starts the feed. Returns a function that removes the listener."""
        self.listeners.append(listener)
        self.start()

        def remove() -> None:
            if listener in self.listeners:
                self.listeners.remove(listener)

        return remove

    def close(self) -> None:
        """Stop the feed for good."""
        self.closed = True
        self.connected = False
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()

    # ------------------------------------------------------------------ the stream
    async def _latest_event_id(self) -> int:
        """Where the feed starts: the newest event id, without replaying history."""
        try:
            feed = await self.client.events(since="latest", timeout=0)
            return int(feed.get("last_id") or 0)
        except BrokerError as e:
            if e.status != 400:
                raise
        # a broker without since=latest: page through (each page answers at once)
        since = 0
        while True:
            feed = await self.client.events(since=since, timeout=0)
            last = int(feed.get("last_id") or since)
            if not feed.get("events") or last == since:
                return since
            since = last

    async def _run(self) -> None:
        backoff = Backoff(first=0.5, cap=15.0)
        delays = backoff.delays()
        lost = False  # the feed was up and went away: say so once, and once when it is back
        while not self.closed and self.wanted:
            try:
                if self.cursor is None:
                    self.cursor = await self._latest_event_id()
                if not self.connected:
                    await self.resync()
                    self._tell_listeners(dict(RESYNC))  # events may have been missed
                # a short first wait after a reconnect: 'connected' means the feed answers
                feed = await self.client.events(since=self.cursor, timeout=self.feed_timeout if self.connected else 0)
                delays = backoff.delays()
            except asyncio.CancelledError:
                raise
            except BrokerError as e:
                lost = self._failed(e) or lost
                await asyncio.sleep(next(delays))
                continue
            except Exception:  # a bug must not end the feed for every spawner
                self.log.exception("The lease event feed failed; reconnecting")
                self.connected = False
                await asyncio.sleep(next(delays))
                continue
            if not self.connected:
                self.connected = True
                self.on_connected()
                if lost:
                    self.log.info("The lease broker's event feed is back")
                    lost = False
            self.cursor = int(feed.get("last_id") or self.cursor)
            self._dispatch(feed.get("events") or [])
        self.connected = False

    def _failed(self, e: BrokerError) -> bool:
        """Note a failed feed call; True when this lost a working feed."""
        was = self.connected
        self.connected = False
        if e.status == 0 or e.status >= 500:
            if was and not self.closed:
                self.log.warning("Lost the lease broker's event feed (%s); reconnecting with back-off", e.message)
            self.on_unreachable(e.message)
        else:
            self.log.error("The lease broker refused the hub's event feed: %s", e)
        return was

    def _tell_listeners(self, ev: dict) -> None:
        for listener in list(self.listeners):
            try:
                listener(ev)
            except Exception:
                self.log.exception("A lease event listener failed on %s", ev.get("kind"))

    def _dispatch(self, events: list[dict]) -> None:
        for ev in events:
            self._tell_listeners(ev)
            self.on_event(ev)
