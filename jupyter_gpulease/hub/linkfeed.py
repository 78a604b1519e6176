"""The hub link's event feed: one stream of the broker's lease events for every server of the hub.

Followed leases are updated as their events arrive (a lease read again after the events that
change it), listeners hear every event, and after a gap the feed resyncs from the broker's
latest event. A part of :class:`.link.BrokerLink`.
"""

from __future__ import annotations

import asyncio

from ..client import Backoff, BrokerError

# event kinds after which the lease JSON is read again (its placement, expiry, end reason)
REFRESH_KINDS = ("granted", "extended", "ended", "confirmed", "preempt-warned", "preempt-cancelled", "warned")


class LinkFeed:
    """The event feed of :class:`.link.BrokerLink` (its attributes are the link's)."""

    def _ensure_feed(self) -> None:
        if self._closed:
            return
        if self._feed_task is None or self._feed_task.done():
            self._feed_task = self.background(self._run_feed())

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

    async def _resync(self) -> None:
        """Read every followed lease again: what changed while the feed was away counts now."""
        ids = list(self.watches)
        if not ids:
            return
        live = {lease["id"]: lease for lease in await self.client.list_leases(state="live")}
        for lid in ids:
            if lid in live:
                self._update(live[lid])
            else:
                self.refresh(lid)  # ended meanwhile: read its end

    async def _run_feed(self) -> None:
        backoff = Backoff(first=0.5, cap=15.0)
        delays = backoff.delays()
        lost = False  # the feed was up and went away: say so once, and once when it is back
        while not self._closed and (self.watches or self.spawners):
            try:
                if self._cursor is None:
                    self._cursor = await self._latest_event_id()
                if not self.connected:
                    await self._resync()
                    self._tell_listeners({"kind": "resync", "lease_id": ""})  # events may have been missed
                # a short first wait after a reconnect: 'connected' means the feed answers
                feed = await self.client.events(since=self._cursor, timeout=self.feed_timeout if self.connected else 0)
                delays = backoff.delays()
            except asyncio.CancelledError:
                raise
            except BrokerError as e:
                lost = self._feed_failed(e) or lost
                await asyncio.sleep(next(delays))
                continue
            except Exception:  # a bug must not end the feed for every spawner
                self.log.exception("The lease event feed failed; reconnecting")
                self.connected = False
                await asyncio.sleep(next(delays))
                continue
            if not self.connected:
                self.connected = True
                self._clear_problem("unreachable")
                if lost:
                    self.log.info("The lease broker's event feed is back")
                    lost = False
            self._cursor = int(feed.get("last_id") or self._cursor)
            self._dispatch(feed.get("events") or [])
        self.connected = False

    def _feed_failed(self, e: BrokerError) -> bool:
        """Note a failed feed call; True when this lost a working feed."""
        was = self.connected
        self.connected = False
        if e.status == 0 or e.status >= 500:
            if was and not self._closed:
                self.log.warning("Lost the lease broker's event feed (%s); reconnecting with back-off", e.message)
            self._note_problem("unreachable", f"the lease broker at {self.url} is not answering: {e.message}")
        else:
            self.log.error("The lease broker refused the hub's event feed: %s", e)
        return was

    def _dispatch(self, events: list[dict]) -> None:
        queue_changed = False
        for ev in events:
            kind = ev.get("kind")
            if kind in ("requested", "granted", "ended"):
                queue_changed = True
            self._tell_listeners(ev)
            lid = ev.get("lease_id")
            if lid not in self.watches:
                continue
            for w in self._watches_of(lid):
                w.deliver(ev)
            if kind in ("warned", "preempt-warned"):
                for w in self._watches_of(lid):
                    w.warn(ev)
            if kind == "ended":
                # known at once from the event; the lease JSON (end reason, who) follows
                for w in self._watches_of(lid):
                    w.update(state=ev.get("to_state") or "ended", end_reason=ev.get("reason", ""),
                             ended_actor=ev.get("actor", ""), ended_at=ev.get("time"))
            if kind in REFRESH_KINDS:
                self.refresh(lid)
        if queue_changed and self._queue_task is not None and not self._queue_task.done():
            self._queue_kick.set()
