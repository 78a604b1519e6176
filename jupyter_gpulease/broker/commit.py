"""The lease manager's group commit: one scheduling pass and one transaction per batch.

Decisions are staged on the event loop (:meth:`GroupCommit.stage`); the writer takes all that
is pending, runs a scheduling pass over it, snapshots the leases it touched, and commits it all
in one transaction on the writer thread. Only then does ``on_committed`` run (the manager's
committed state, its feed and its listeners), and only then do the callers get their answers.
A failed commit stops the broker (:meth:`GroupCommit.fail`). Held by
:class:`.manager.LeaseManager`; see that module for the contract.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from concurrent.futures import Executor
from typing import Any

from .. import booking_store
from ..core.events import ENDED, Event
from ..core.model import LeaseError, LeaseState
from ..store import Batch, LeaseStore

LIVE = (LeaseState.QUEUED.value, LeaseState.ACTIVE.value)
TERMINAL = tuple(s.value for s in LeaseState if s.terminal)

STOPPING = "the broker is stopping; try again in a moment (its standby or the restarted broker answers)"
LOST_DATABASE = "the broker lost its database and is stopping; try again in a few seconds"

log = logging.getLogger(__name__)

CountTotals = Callable[[list[Event]], dict[tuple[str, tuple[str, ...]], float]]
Committed = Callable[[Batch, list[dict[str, Any]], list[Event]], None]


BOOKING = "booking"  # the kind of an event about a booking (no lease: ``lease_id`` is "", its id in ``data.booking``)


def booking_event(change) -> Event:
    """A booking's change (:class:`~..core.bookings.BookingChange`) as an event of the audit log and the feed."""
    b = change.booking
    return Event("", BOOKING, change.at, to_state=b.state, reason=change.words, actor="broker",
                 data={"booking": b.id, "what": change.what, "users": sorted(b.users), "groups": sorted(b.groups), "start": b.start,
                       "end": b.end, "devices": sorted(b.devices), "title": b.title})


class Unavailable(LeaseError):
    """The broker cannot commit any more (its database failed); it is stopping."""

    status = 503


class GroupCommit:
    """Staging decisions and writing them, one batch per transaction, in decision order.

    ``scheduler`` and ``store``: what is decided and where it is written; ``writer``: the one
    thread that writes (commits stay in decision order); ``now``: the broker's clock;
    ``on_committed(batch, written, events)``: what happens once a batch is on disk, before the
    callers are answered; ``on_fail(exc)``: what happens once a commit failed (after the
    waiting callers were answered 503). ``count_totals``: the increments of the durable
    counters a batch's events make (written with them), ``usage_recorder``: the usage records
    fed from each batch and written with it; None: none."""

    def __init__(self, scheduler, store: LeaseStore, *, writer: Executor, now: Callable[[], float], on_committed: Committed,
                 on_fail: Callable[[BaseException], None] | None = None, count_totals: CountTotals | None = None,
                 usage_recorder=None, logger: logging.Logger | None = None):
        self.scheduler = scheduler
        self.store = store
        self.writer = writer
        self.now = now
        self.on_committed = on_committed
        self.on_fail = on_fail
        self.count_totals = count_totals
        self.usage_recorder = usage_recorder
        self.log = logger or log
        self.failed: BaseException | None = None
        self.closed = False
        self.commits = 0  # transactions written (for the benchmark and metrics)
        self.end_extra: dict[str, dict[str, Any]] = {}  # facts about an end the scheduler does not keep
        self.booking_extra: dict[str, dict[str, Any]] = {}  # booking id -> who booked it and when (its row keeps them)
        self._pending: list[tuple[list[Event], str | None]] = []
        self._pending_leases: dict[str, Any] = {}
        self._pending_tick = False
        self._pending_done: asyncio.Future | None = None
        self._writing: asyncio.Future | None = None
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    @property
    def running(self) -> bool:
        """Whether the writer was started (:meth:`start`)."""
        return self._task is not None

    def start(self) -> None:
        """Start the writer (on the running loop)."""
        self._wake = asyncio.Event()
        self._task = asyncio.ensure_future(self._write_loop())

    def stage(self, events: list[Event], leases: Iterable[Any] = (), *, tick: bool = True, key: str | None = None) -> asyncio.Future:
        """Queue decisions for the next group commit; the future resolves once they are on disk.
        ``leases``: the leases they changed; ``tick``: run a scheduling pass with them; ``key``:
        the caller's idempotency key, written with the first of ``events``."""
        if self.failed is not None:
            raise Unavailable(LOST_DATABASE)
        if self.closed:
            raise Unavailable(STOPPING)
        self._pending.append((events, key))
        for lease in leases:
            self._pending_leases[lease.id] = lease
        for e in events:
            if e.kind == ENDED:
                self._note_end(e)
        self._pending_tick = self._pending_tick or tick
        if self._pending_done is None:
            self._pending_done = asyncio.get_running_loop().create_future()
        self._wake.set()
        return self._pending_done

    async def flush(self) -> None:
        """Wait until everything decided so far is committed."""
        if self._pending_done is not None:
            await asyncio.shield(self._pending_done)
        elif self._writing is not None:
            await asyncio.shield(self._writing)

    def keep_server(self, lease_id: str) -> None:
        """The end of ``lease_id`` about to be decided leaves its server running (its record says so)."""
        self.end_extra.setdefault(lease_id, {})["keep_server"] = True

    async def close(self, timeout: float = 30.0) -> None:
        """Stop taking decisions (they are answered 503), write what was staged, end the writer."""
        # closed first: a call that comes during the flush is answered 503 (the next broker
        # answers it), and the writer ends once what was staged is written (were ``closed`` set
        # after the flush, a batch staged meanwhile could leave the writer waiting for a wake-up
        # that never comes, holding the database's lock until the timeout below)
        self.closed = True
        try:
            if self.failed is None and self._task is not None:
                await self.flush()
        except LeaseError:
            pass
        if self._wake is not None:
            self._wake.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, timeout)
            except Exception:  # a writer stuck on a dead database: close anyway
                pass

    def _note_end(self, e: Event) -> None:
        extra = self.end_extra.setdefault(e.lease_id, {})
        extra["actor"] = e.actor
        lease = getattr(e, "lease", None)
        if lease is not None and e.to_state == LeaseState.PREEMPTED.value and lease.preempted_for:
            w = self.scheduler.leases.get(lease.preempted_for)
            if w is not None:
                extra["preempted_for"] = {"lease": w.id, "user": w.user, "tier": w.tier}

    async def _write_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if self.closed and self._pending_done is None and not self._pending_tick:
                return  # closing, everything staged is written
            await self._wake.wait()
            self._wake.clear()
            if self._pending_done is None and not self._pending_tick:
                if self.closed:
                    return
                continue
            done = self._pending_done or loop.create_future()
            self._pending_done = None
            self._writing = done
            staged, self._pending = self._pending, []
            touched, self._pending_leases = self._pending_leases, {}
            events = [e for evs, _ in staged for e in evs]
            if self._pending_tick:
                self._pending_tick = False
                try:
                    more = self.scheduler.tick(self.now())
                except Exception:  # a bug in a pass must not lose the decisions before it
                    self.log.exception("scheduling pass failed")
                    more = []
                for e in more:
                    if e.kind == ENDED:
                        self._note_end(e)
                events += more
            booked = self._booking_changes()
            events += [booking_event(c) for c in booked]
            batch = self._snapshot(staged, events, touched.values())
            batch.bookings = list({c.booking.id: booking_store.row_of(c.booking, self.booking_extra.get(c.booking.id)) for c in booked}.values())
            try:
                written = await loop.run_in_executor(self.writer, self.store.write, batch) if batch else []
            except BaseException as e:  # any failure to commit is fatal, see the manager's module doc
                self.fail(e, done)
                return
            self.commits += 1
            if self.end_extra:  # forget what was kept for ends now on disk
                for lid, d in batch.leases.items():
                    if d["state"] not in LIVE:
                        self.end_extra.pop(lid, None)
            self.on_committed(batch, written, events)
            self._writing = None
            if not done.done():
                done.set_result(None)

    def _booking_changes(self) -> list:
        """What the scheduler changed about bookings since the last batch (placed, used, moved, ended…)."""
        pop = getattr(self.scheduler, "pop_booking_changes", None)
        return pop() if pop is not None else []

    def _snapshot(self, staged, events: list[Event], touched) -> Batch:
        batch = Batch()
        touched = list(touched)
        first_of_call: dict[int, str] = {}
        for evs, key in staged:
            if key and evs:
                first_of_call[id(evs[0])] = key
        for e in events:
            d = e.to_dict()
            key = first_of_call.get(id(e))
            if key:
                d["request_key"] = key
            batch.events.append(d)
            lease = getattr(e, "lease", None)
            if lease is not None:
                batch.leases[lease.id] = lease
        for lease in touched:
            batch.leases[lease.id] = lease
        for lid, lease in list(batch.leases.items()):
            d = lease.to_dict()
            extra = self.end_extra.get(lid)
            if extra and d["state"] in TERMINAL:
                d.update({"end_info": {k: v for k, v in extra.items() if k != "keep_server"}, "keep_server": bool(extra.get("keep_server"))})
            batch.leases[lid] = d
        if self.count_totals is not None and events:
            batch.totals, batch.at = self.count_totals(events), self.now()
        if self.usage_recorder is not None:
            self.usage_recorder.observe(events, touched, self.now())
            batch.usage = self.usage_recorder.take(self.now())  # heartbeats' records every write_interval_s
            if batch.usage is not None and batch.usage.totals and self.count_totals is not None:
                for k, v in batch.usage.totals.items():
                    batch.totals[k] = batch.totals.get(k, 0.0) + v
                batch.at = batch.at or self.now()
        return batch

    def fail(self, exc: BaseException, done: asyncio.Future | None = None) -> None:
        """The database failed (a commit, or the lock's check): answer every waiting caller 503,
        take no more decisions, and tell ``on_fail``."""
        self.failed = exc
        self.log.critical("Cannot write to the lease database %s: %s. Nothing more is answered; the broker stops so that it (or its standby) "
                          "starts again from the database.", self.store.describe(), exc)
        err = Unavailable(LOST_DATABASE)
        for fut in (done, self._pending_done):
            if fut is not None and not fut.done():
                fut.set_exception(err)
                fut.exception()  # retrieved: waiters that gave up must not log it again
        self._pending_done = None
        if self.on_fail is not None:
            self.on_fail(exc)
