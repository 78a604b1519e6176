"""The lease manager: the scheduler, the store and the clock, wired together.

Every change goes the same way: call ``scheduler.<op>(…, now)``, then ``scheduler.tick(now)``
(so a release grants the next lease at once), serialise every lease the events touched,
commit it all in ONE store transaction, and only then answer the caller and wake the event
feed. The scheduler runs on the event loop (it is pure and fast); the store runs in a
single-thread executor, so commits keep the scheduler's order and never block the loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tornado.locks import Condition

from ..core.events import ENDED, GRANTED, Event
from ..core.model import Lease, LeaseState, NotFound
from ..core.request import Ask
from ..store import LeaseStore

log = logging.getLogger(__name__)


class SystemClock:
    """The real clock. Tests inject an object with the same ``now()`` that they can move."""

    def now(self) -> float:
        return time.time()


class ManualClock:
    """A clock a test moves by hand."""

    def __init__(self, t: float = 1_700_000_000.0):
        self.t = float(t)

    def now(self) -> float:
        return self.t

    def advance(self, seconds: float) -> float:
        self.t += seconds
        return self.t


EventListener = Callable[[list[dict[str, Any]], list[Event]], None]


class LeaseManager:
    """Owns the :class:`Scheduler` and the :class:`LeaseStore`; the only writer of lease state."""

    def __init__(self, scheduler, store: LeaseStore, *, clock=None, usage_lookback_s: float | None = None, logger: logging.Logger | None = None):
        self.scheduler = scheduler
        self.store = store
        self.clock = clock or SystemClock()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="gpulease-store")
        self._new_events = Condition()
        self.last_event_id = 0
        self.listeners: list[EventListener] = []
        self.usage_lookback_s = usage_lookback_s
        self.closed = False
        self.log = logger or log

    # ------------------------------------------------------------------ plumbing
    def now(self) -> float:
        return self.clock.now()

    async def run_store(self, fn, *args, **kwargs):
        """Run a store call in the store's thread (in order with the writes)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: fn(*args, **kwargs))

    async def _persist(self, events: list[Event], touched: Iterable[Lease] = ()) -> list[dict[str, Any]]:
        # serialise NOW, on the loop thread: the lease objects keep changing after this
        batch = self.store.snapshot(events, touched)
        if not batch.events and not batch.leases:
            return []
        written = await self.run_store(self.store.write, batch)
        if written:
            self.last_event_id = max(self.last_event_id, written[-1]["id"])
            self._new_events.notify_all()
        for listener in self.listeners:
            try:
                listener(written, events)
            except Exception:
                self.log.exception("event listener %r failed", listener)
        return written

    async def wait_for_events(self, timeout: float) -> None:
        """Return when new events were committed, or after ``timeout`` seconds."""
        await self._new_events.wait(timeout=asyncio.get_running_loop().time() + max(0.0, timeout))

    def wake_waiters(self) -> None:
        self._new_events.notify_all()

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> list[Event]:
        """Load live leases and past usage from the store, then tick once."""
        now = self.now()
        live = await self.run_store(self.store.load_live)
        self.scheduler.restore(live)
        lookback = self.usage_lookback_s if self.usage_lookback_s is not None else _usage_lookback(self.scheduler.policy)
        past = await self.run_store(self.store.history, now - lookback)
        for lease in past:
            self.scheduler.record_usage(lease.user, lease.groups, lease.granted_at, lease.ended_at, lease.gpu_milli)
        self.last_event_id = await self.run_store(self.store.last_event_id)
        self.log.info("Restored %d live lease(s) and %d past lease(s) of usage history", len(live), len(past))
        events = self.scheduler.tick(now)
        await self._persist(events)
        return events

    async def tick(self) -> list[Event]:
        events = self.scheduler.tick(self.now())
        if events:
            await self._persist(events)
        return events

    async def close(self) -> None:
        """Finish pending writes, close the store."""
        if self.closed:
            return
        self.closed = True
        self.wake_waiters()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._executor.shutdown, True)
        self.store.close()

    # ------------------------------------------------------------------ operations
    async def request(self, ask: Ask, *, actor: str = "") -> Lease:
        """Queue the lease ``ask`` asks for (checked by the scheduler), schedule, persist; the lease."""
        now = self.now()
        lease = self.scheduler.new_lease(ask, now, lease_id=uuid.uuid4().hex)
        events = self.scheduler.submit(lease, now, actor=actor or ask.user)
        events += self.scheduler.tick(now)
        await self._persist(events, [lease])
        return lease

    async def _change(self, lease_id: str, apply, *, tick: bool = True) -> Lease:
        """Apply ``apply(now)`` (a scheduler call on one lease), schedule, persist; the lease after."""
        now = self.now()
        lease = self.scheduler.get(lease_id)
        events = apply(now)
        if tick:
            events += self.scheduler.tick(now)
        await self._persist(events, [lease])
        return lease

    async def release(self, lease_id: str, *, state: LeaseState = LeaseState.RELEASED, reason: str = "", actor: str = "") -> Lease:
        return await self._change(lease_id, lambda now: self.scheduler.release(lease_id, now, state=state, reason=reason, actor=actor))

    async def extend(self, lease_id: str, *, by_s: float | None = None, until: float | None = None, actor: str = "") -> Lease:
        return await self._change(lease_id, lambda now: self.scheduler.extend(lease_id, now, by_s=by_s, until=until, actor=actor))

    async def confirm(self, lease_id: str, *, actor: str = "") -> Lease:
        return await self._change(lease_id, lambda now: self.scheduler.confirm(lease_id, now, actor=actor))

    async def heartbeat(self, lease_id: str, usage: dict | None = None) -> Lease:
        return await self._change(lease_id, lambda now: self.scheduler.heartbeat(lease_id, now, usage), tick=False)

    async def set_inventory(self, gpus) -> list[Event]:
        now = self.now()
        events = self.scheduler.set_inventory(gpus, now)
        events += self.scheduler.tick(now)
        await self._persist(events)
        return events

    # ------------------------------------------------------------------ reading
    async def get(self, lease_id: str) -> Lease:
        """Any lease: live from the scheduler, ended from the store. NotFound otherwise."""
        try:
            return self.scheduler.get(lease_id)
        except NotFound:
            pass
        lease = await self.run_store(self.store.get_lease, lease_id)
        if lease is None:
            raise NotFound(f"no lease with id {lease_id!r}")
        return lease

    def live(self, user: str | None = None) -> list[Lease]:
        leases = self.scheduler.leases.values()
        if user is not None:
            leases = [lease for lease in leases if lease.user == user]
        return sorted(leases, key=lambda lease: (lease.created_at, lease.seq))

    async def list(self, *, user: str | None = None, state: str = "live", limit: int | None = None) -> list[Lease]:
        """Leases by ``state``: 'live' (queued+active), a state name, 'ended', or 'all'.

        Ended leases come from the store, newest first, at most ``limit`` of them.
        """
        if state in ("live", LeaseState.QUEUED.value, LeaseState.ACTIVE.value):
            leases = self.live(user)
            if state != "live":
                leases = [lease for lease in leases if lease.state.value == state]
            return leases
        if state == "all":
            ended = await self.run_store(self.store.list_leases, user, [s.value for s in LeaseState if s.terminal], limit=limit)
            return self.live(user) + ended
        states = [s.value for s in LeaseState if s.terminal] if state == "ended" else [state]
        return await self.run_store(self.store.list_leases, user, states, limit=limit)

    async def events_since(self, since: int, *, lease_id: str | None = None, user: str | None = None, limit: int = 500) -> list[dict]:
        return await self.run_store(self.store.events_since, since, lease_id, limit, user=user)

    def queue_info(self, lease: Lease) -> dict[str, Any] | None:
        if lease.state is not LeaseState.QUEUED or lease.id not in self.scheduler.leases:
            return None
        return self.scheduler.queue_info(lease.id)

    def lease_json(self, lease: Lease) -> dict[str, Any]:
        d = lease.to_dict()
        q = self.queue_info(lease)
        if q is not None:
            d["queue"] = q
        return d


def _usage_lookback(policy) -> float:
    """How far back past usage still matters: the longest quota period, or 5 fair-share half-lives."""
    periods = [q.period_s for q in (policy.default_user_quota, *policy.user_quotas.values(), *policy.group_quotas.values()) if q.gpu_hours is not None]
    if policy.fair_share:
        periods.append(5 * policy.fair_share_half_life_s)
    return max(periods, default=0.0)


def ended_events(events: Iterable[Event]) -> list[Event]:
    return [e for e in events if e.kind == ENDED]


def granted_events(events: Iterable[Event]) -> list[Event]:
    return [e for e in events if e.kind == GRANTED]
