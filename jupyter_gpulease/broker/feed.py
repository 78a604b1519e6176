"""The live event feed, fanned out from memory.

The manager publishes each committed batch of events once; every open stream or long poll
is a :class:`Subscription` with its own bounded buffer. Subscriptions are indexed by user,
so an event costs work only for the streams that may see it, and an idle stream costs
nothing between events. A stream whose client reads too slowly for its buffer is dropped
with a reason (the client reconnects with ``Last-Event-ID`` and catches up from the store).
Recent events stay in a ring so that most catch-ups never touch the database.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterable
from typing import Any


class TooManyStreams(Exception):
    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class Subscription:
    """What one stream sees: events of ``user`` (None: everyone's), or of one lease."""

    def __init__(self, feed: Feed, user: str | None, lease_id: str | None, buffer: int):
        self.feed = feed
        self.user = user
        self.lease_id = lease_id
        self.buffer = buffer
        self.events: deque[dict[str, Any]] = deque()
        self.dropped = ""  # why the feed stopped feeding this subscription
        self._ready = asyncio.Event()

    def matches(self, event: dict[str, Any], user: str) -> bool:
        return (self.lease_id is None or event["lease_id"] == self.lease_id) and (self.user is None or user == self.user)

    def push(self, event: dict[str, Any]) -> None:
        if self.dropped:
            return
        if len(self.events) >= self.buffer:
            self.events.clear()
            self.drop(f"the client read too slowly: more than {self.buffer} events were waiting for it; reconnect with Last-Event-ID to catch up")
            return
        self.events.append(event)
        self._ready.set()

    def drop(self, reason: str) -> None:
        self.dropped = reason
        self._ready.set()
        self.feed.unsubscribe(self)

    async def wait(self, timeout: float) -> bool:
        """Wait until events are buffered or the subscription was dropped; False on timeout."""
        if self.events or self.dropped:
            return True
        self._ready.clear()
        try:
            await asyncio.wait_for(self._ready.wait(), max(0.0, timeout))
        except TimeoutError:
            return False
        return True

    def take(self, after: int = 0) -> list[dict[str, Any]]:
        out = [e for e in self.events if e["id"] > after]
        self.events.clear()
        return out

    def close(self) -> None:
        self.feed.unsubscribe(self)

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Feed:
    """Committed events, fanned out to subscriptions; see the module doc."""

    def __init__(self, *, ring: int = 10_000, buffer: int = 1000, max_per_user: int = 20, max_total: int = 5000):
        self.ring: deque[tuple[dict[str, Any], str]] = deque(maxlen=ring)
        self.buffer = buffer
        self.max_per_user = max_per_user
        self.max_total = max_total
        self._by_user: dict[str | None, set[Subscription]] = {}
        self._count = 0
        self.last_id = 0

    def __len__(self) -> int:
        return self._count

    def open_streams(self, user: str | None) -> int:
        return len(self._by_user.get(user, ()))

    def subscribe(self, user: str | None, lease_id: str | None = None, *, capped: bool = True) -> Subscription:
        """A new subscription; :class:`TooManyStreams` over the per-user cap (when ``capped``)
        or the broker-wide cap."""
        if self._count >= self.max_total:
            raise TooManyStreams(f"the broker has {self._count} open event streams, its limit; try again later")
        if capped and user is not None and self.open_streams(user) >= self.max_per_user:
            raise TooManyStreams(f"{user} has {self.max_per_user} event streams open, the limit per user; close one first")
        sub = Subscription(self, user, lease_id, self.buffer)
        self._by_user.setdefault(user, set()).add(sub)
        self._count += 1
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        subs = self._by_user.get(sub.user)
        if subs is not None and sub in subs:
            subs.discard(sub)
            self._count -= 1
            if not subs:
                del self._by_user[sub.user]

    def publish(self, events: Iterable[tuple[dict[str, Any], str]]) -> None:
        """``(event dict with its id, user of its lease)`` pairs, in commit order."""
        everyone = self._by_user.get(None, ())
        for e, user in events:
            self.ring.append((e, user))
            self.last_id = max(self.last_id, e["id"])
            for sub in [*self._by_user.get(user, ()), *everyone]:
                if sub.matches(e, user):
                    sub.push(e)

    def since(self, since: int, *, user: str | None, lease_id: str | None, limit: int) -> list[dict[str, Any]] | None:
        """Events after ``since`` from the ring; None when the ring no longer reaches back that far."""
        if since >= self.last_id:
            return []
        if not self.ring or self.ring[0][0]["id"] > since + 1:
            return None
        out = []
        for e, u in self.ring:
            if e["id"] > since and (user is None or u == user) and (lease_id is None or e["lease_id"] == lease_id):
                out.append(e)
                if len(out) >= limit:
                    break
        return out

    def close(self, reason: str = "the broker is stopping") -> None:
        for subs in list(self._by_user.values()):
            for sub in list(subs):
                sub.drop(reason)
