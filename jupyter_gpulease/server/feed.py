"""The live feed: numbered events that the REST feed streams to the frontends.

Every event has a kind (``sample``, ``lease``, ``warning``, ``reclaim``, ``resume``,
``notice``, ``status``), a sequence number and a JSON body. Events other than ``sample`` are
kept (the last :attr:`Feed.keep` of them) so that a client that reconnects with the last id it
saw gets what it missed; samples are only ever the latest (the status call has the history).

Subscribers get their own bounded queue: a client that does not read is dropped rather than
letting the server's memory grow.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

KINDS = ("status", "sample", "lease", "warning", "reclaim", "resume", "notice")


@dataclass(frozen=True)
class FeedEvent:
    id: int
    kind: str
    data: dict[str, Any]
    time: float

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "kind": self.kind, "time": self.time, **self.data}


@dataclass(eq=False)  # kept in a set: hashed by identity
class Subscription:
    queue: asyncio.Queue = field(default_factory=lambda: asyncio.Queue(maxsize=512))
    dropped: bool = False


class Feed:
    """In-memory, single event loop. ``publish`` never blocks and never raises for slow readers."""

    def __init__(self, *, keep: int = 256, clock: Callable[[], float] = time.time):
        self.keep = keep
        self._clock = clock
        self._ids = itertools.count(1)
        self._recent: deque[FeedEvent] = deque(maxlen=keep)
        self._subs: set[Subscription] = set()
        self.last_id = 0

    def publish(self, kind: str, data: dict[str, Any]) -> FeedEvent:
        if kind not in KINDS:
            raise ValueError(f"unknown feed event kind {kind!r}")
        ev = FeedEvent(next(self._ids), kind, data, self._clock())
        self.last_id = ev.id
        if kind != "sample":
            self._recent.append(ev)
        for sub in list(self._subs):
            try:
                sub.queue.put_nowait(ev)
            except asyncio.QueueFull:
                sub.dropped = True  # the reader fell too far behind: it reconnects and catches up
                self._subs.discard(sub)
        return ev

    def since(self, last_id: int) -> list[FeedEvent]:
        """Kept events after ``last_id`` (samples are not kept)."""
        return [e for e in self._recent if e.id > last_id]

    def recent(self, kinds: tuple[str, ...] = (), limit: int = 50) -> list[FeedEvent]:
        out = [e for e in self._recent if not kinds or e.kind in kinds]
        return out[-limit:]

    def subscribe(self) -> Subscription:
        sub = Subscription()
        self._subs.add(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        self._subs.discard(sub)

    @property
    def subscribers(self) -> int:
        return len(self._subs)
