"""Leases that ended lately, read ahead by a broker that stands by and kept up to date.

A broker that takes over needs the leases that ended within the usage window (fair share and
GPU-hour quotas count their use) and, for the health keeper, those of the last hour (a server
moved off a sick GPU keeps its place ahead). Read after taking the database's lock, on a
database of tens of thousands of leases, that cost seconds in which nobody was answered, and
grew with the history. A standby reads them while it waits (:meth:`PastLeases.catch_up`, the
first time the whole window), then, every second or so, only the leases that ended since: every
end is an ``ended`` event, and event ids grow in commit order (one broker writes at a time), so
the ends after the last event id read are exactly those not read yet. The broker that takes the
lock reads the last second's ends and is ready.

Only what those readers use is kept of each lease (:class:`PastLease`), and only for the
window (``keep_s``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ..core.health import HEALTH_META
from ..core.model import LeaseState, Placement
from ..core.request import Request
from ..core.text import format_duration

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PastLease:
    """What a broker keeps of an ended lease that held GPUs: whose, when, how much, how it
    ended, and the health keeper's note (``meta`` holds that note alone, when there is one)."""

    id: str
    user: str
    server: str
    groups: tuple[str, ...]
    created_at: float
    granted_at: float
    ended_at: float
    gpu_milli: int
    state: LeaseState
    meta: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, row: dict[str, Any]) -> PastLease:
        """From a row of the store's :meth:`~jupyter_gpulease.store.LeaseStore.past_rows`."""
        note = row.get("health")
        return cls(row["id"], row["user"], row["server"] or "", tuple(row.get("groups") or ()), row["created_at"], row["granted_at"],
                   row["ended_at"], held_milli(row), LeaseState(row["state"]), {HEALTH_META: note} if note is not None else {})


def held_milli(row: dict[str, Any]) -> int:
    """Milli-GPUs a lease held, as :attr:`Lease.gpu_milli` counts them (its placement's, else
    its request's), from the row's JSON columns."""
    placement = Placement.from_dict(row.get("placement"))
    return placement.gpu_milli if placement is not None else Request.from_dict(row["request"]).gpu_milli


class PastLeases:
    """The ended leases of the last ``keep_s`` seconds (see the module doc), read from ``store``.

    :meth:`catch_up` reads (blocking: call it off the event loop); :meth:`since` answers from
    memory. ``now``: the broker's clock."""

    def __init__(self, store, *, keep_s: float, now: Callable[[], float] = time.time):
        self.store = store
        self.keep_s = max(0.0, float(keep_s))
        self.now = now
        self.cursor: int | None = None  # the newest event id read (None: nothing read yet)
        self.reads = 0  # reads of the store (the first one is the whole window)
        self._leases: dict[str, PastLease] = {}
        self._new: list[PastLease] = []  # read since the last take_new()
        self._lock = threading.Lock()  # the standby's thread catches up; the loop's writer thread may too

    @property
    def loaded(self) -> bool:
        """Whether the window was read once."""
        return self.cursor is not None

    def __len__(self) -> int:
        return len(self._leases)

    def catch_up(self) -> int:
        """Read what ended since the last read (the first time: the whole window); forget what
        left the window. Returns how many ended leases were read."""
        with self._lock:
            since = self.now() - self.keep_s
            if self.cursor is None:
                top = self.store.last_event_id()  # first: whatever ends after it is read by the next catch-up
                got = self.store.past_rows(since)
            else:
                top, got = self.store.ended_after(self.cursor)
            self._add(got)
            self.cursor = max(self.cursor or 0, top)
            self.reads += 1
            if self.reads % 64 == 0:
                self._forget(since)
            return len(got)

    def _add(self, rows: Iterable[dict[str, Any]]) -> None:
        for row in rows:
            if row["id"] not in self._leases:
                self._leases[row["id"]] = p = PastLease.of(row)
                self._new.append(p)

    def _forget(self, before: float) -> None:
        for lid in [lid for lid, p in self._leases.items() if p.ended_at < before]:
            del self._leases[lid]

    def since(self, t: float) -> list[PastLease]:
        """The leases kept that ended at or after ``t``, in the order they were granted."""
        with self._lock:
            return sorted((p for p in self._leases.values() if p.ended_at >= t), key=lambda p: p.granted_at)

    def count_since(self, t: float) -> int:
        """How many of the leases kept ended at or after ``t``."""
        with self._lock:
            return sum(1 for p in self._leases.values() if p.ended_at >= t)

    def take_new(self, since: float) -> list[PastLease]:
        """The leases read since the last call that ended at or after ``since``, in the order
        they were granted (their use not counted yet); the others read since are dropped."""
        with self._lock:
            new, self._new = self._new, []
        return sorted((p for p in new if p.ended_at >= since), key=lambda p: p.granted_at)

    def clear(self) -> None:
        """Forget everything (the broker that serves needs none of it once started)."""
        with self._lock:
            self._leases.clear()
            self._new.clear()


class ReadAhead:
    """What a broker that stands by does between its tries for the database's lock
    (``LeaseStore.acquire_leadership``'s ``idle``): at most every ``every_s`` seconds, read what
    ended since into ``past`` (the first time also the schema's revision, so that the check of
    the schema at take-over finds its code loaded), then ``then()`` (the manager counts their
    use: ``LeaseManager.record_past``). Blocking: it runs on the waiting thread. A failed read
    is logged once and tried again at the next turn: standing by goes on."""

    def __init__(self, store, past: PastLeases, *, then: Callable[[], None] | None = None, every_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic, logger: logging.Logger | None = None):
        self.store = store
        self.past = past
        self.then = then
        self.every_s = every_s
        self.clock = clock
        self.log = logger or log
        self._next = 0.0
        self._failing = False

    def __call__(self) -> None:
        t = self.clock()
        if t < self._next:
            return
        self._next = t + self.every_s
        try:
            if self.past.loaded:
                self.past.catch_up()
            else:
                self.store.schema_revision()
                self.store.head_revision()
                self.past.catch_up()
                self.log.info("Standing by (pid %d): read ahead the %d lease(s) that ended in the last %s (%.1f s); following what ends from here",
                              os.getpid(), len(self.past), format_duration(self.past.keep_s), self.clock() - t)
        except Exception as e:  # the database away for a moment: the standby waits on
            if not self._failing:
                self.log.warning("Standing by: cannot read the lease history ahead (%s); trying again", e)
            self._failing = True
            return
        self._failing = False
        if self.then is not None:
            self.then()
