"""The lease manager: the scheduler, the store, the clock and the feed, wired together; it
holds the group commit (:mod:`.commit`) and the view of committed state (:mod:`.reads`).

The contract, which handlers and metrics rely on (they use nothing else of the broker):

* **Acknowledge only what is durable.** Every change goes the same way: a scheduler call on
  the event loop (pure and fast), then the commit of what it decided; only after that commit
  does the caller get its answer, does the feed carry the events, do listeners (metrics,
  stopping servers) hear of them. A failed check is answered only after what was pending
  before it is committed too (the check read that state).
* **Group commit.** Decisions pile up while the writer is busy; the writer takes all that is
  pending, runs one scheduling pass over it, and commits it in ONE transaction (one fsync).
  Throughput grows with concurrency, and commits stay in decision order (one writer thread).
* **Reads see committed state.** The manager keeps the committed version of every live lease
  (``reads.committed``); a read of a lease whose first commit is still pending waits for it. Ended
  leases are read from the store, after their end was committed, so a list and a get agree.
* **A failed commit stops the broker** (``on_fatal``): the decisions in memory are no longer
  what the database holds, and the next broker (a restart, or the standby) starts from the
  database. Nothing acknowledged is lost, because nothing unwritten was acknowledged.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..core.events import Event
from ..core.model import Conflict, LeaseError, LeaseState, NotFound
from ..core.request import Ask
from ..store import Batch, LeaseStore
from .commit import LIVE, STOPPING, TERMINAL, CountTotals, GroupCommit, Unavailable
from .ends import end_message, ended_by
from .feed import Feed
from .keys import RequestKeys
from .past import PastLeases
from .reads import LeaseReads, WarningSource

__all__ = ["LIVE", "STOPPING", "TERMINAL", "EventListener", "LeaseManager", "SystemClock", "Unavailable", "end_message", "ended_by"]

log = logging.getLogger(__name__)


class SystemClock:
    """The real clock. Tests inject an object with the same ``now()`` that they can move."""

    def now(self) -> float:
        return time.time()


EventListener = Callable[[list[dict[str, Any]], list[Event]], None]


class LeaseManager:
    """Owns the :class:`Scheduler` and the :class:`LeaseStore`; the only writer of lease state.

    Its operations and its life (restore, close, pruning) are here. It holds the group commit
    every decision goes through (:attr:`commit`, a :class:`.commit.GroupCommit`) and the view of
    committed state every read comes from (:attr:`reads`, a :class:`.reads.LeaseReads`); the
    reads the API uses are methods here too (``get``, ``list``, ``lease_json``, ``warnings``…).

    ``count_totals``: the increments of the durable counters a batch of events makes (the
    metrics' :func:`.metrics.count_events`), committed with them; ``usage_recorder``: usage
    records fed from each batch and committed with it; ``on_fatal(exc)``: called once a commit
    failed (the broker process ends: see the module doc); ``past``: the leases that ended in
    the usage window, read ahead while the broker stood by (:class:`.past.PastLeases`; by
    default read at start). The parts built after the manager, which hold it, are handed to it
    by :meth:`wire`."""

    def __init__(
        self,
        scheduler,
        store: LeaseStore,
        *,
        clock=None,
        usage_lookback_s: float | None = None,
        logger: logging.Logger | None = None,
        feed: Feed | None = None,
        request_key_window_s: float = 900.0,
        show_preemptor_names: bool = False,
        count_totals: CountTotals | None = None,
        usage_recorder=None,
        on_fatal: Callable[[BaseException], None] | None = None,
        past: PastLeases | None = None,
    ):
        self.scheduler = scheduler
        self.store = store
        self.clock = clock or SystemClock()
        self.log = logger or log
        self.usage_lookback_s = usage_lookback_s if usage_lookback_s is not None else usage_lookback(scheduler.policy)
        self.feed = feed if feed is not None else Feed()
        self.usage_recorder = usage_recorder
        self.on_fatal = on_fatal
        self.listeners: list[EventListener] = []
        self.health = None  # GPU health, cordons and maintenance windows (broker/health.py), where on: see wire()
        # one writer thread keeps commits in order; reads use their own threads (an in-memory
        # SQLite database is one connection: everything goes through the writer then)
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="gpulease-store-write")
        self._readers = self._writer if store.in_memory else ThreadPoolExecutor(2, thread_name_prefix="gpulease-store-read")
        self.commit = GroupCommit(scheduler, store, writer=self._writer, now=self.clock.now, on_committed=self._committed, on_fail=self._lost_database,
                                  count_totals=count_totals, usage_recorder=usage_recorder, logger=self.log)
        self.reads = LeaseReads(scheduler, store, readers=self._readers, feed=self.feed, flush=self.commit.flush, now=self.clock.now,
                                show_preemptor_names=show_preemptor_names)
        # idempotency keys: this process's, and the database's in its first minutes (see keys.py)
        self.keys = RequestKeys(lambda key: self.reads.in_reader(store.find_request_key, key), now=self.clock.now, window_s=request_key_window_s)
        self.past = past if past is not None else PastLeases(store, keep_s=self.usage_lookback_s, now=self.clock.now)
        self.started_at = 0.0
        self.draining = False
        self._ids = random.Random(os.urandom(32))

    def wire(self, *, listeners: Iterable[EventListener] = (), health=None, warnings: Iterable[WarningSource] = ()) -> None:
        """Hand the manager the parts built after it (they hold the manager): ``listeners`` of
        committed events (``listener(written, events)``, in this order), the GPU ``health``
        keeper (cordoned GPUs take no grants; the pool's notes) and the ``warnings`` sources of
        the heartbeat answers (each: a lease's dict -> its holder's warnings). Before start()."""
        self.listeners.extend(listeners)
        self.health = health
        self.reads.warn_from(*warnings)

    # ------------------------------------------------------------------ plumbing
    def now(self) -> float:
        return self.clock.now()

    def _new_id(self) -> str:
        """A lease id: 128 random bits. Ids are names, not secrets (every call checks who may
        act on a lease), so a generator seeded once from the OS serves; asking the OS per id
        costs a system call per request."""
        return f"{self._ids.getrandbits(128):032x}"

    @property
    def policy(self):
        return self.scheduler.policy

    @property
    def last_event_id(self) -> int:
        """Id of the newest committed event (the feed's cursor)."""
        return self.feed.last_id

    @property
    def commits(self) -> int:
        """Transactions this manager committed."""
        return self.commit.commits

    @property
    def failed(self) -> BaseException | None:
        """Why the database failed under this manager (None: it did not)."""
        return self.commit.failed

    @property
    def closed(self) -> bool:
        return self.commit.closed

    async def in_writer(self, fn, *args):
        """``fn(*args)`` in the writer thread (in order with the commits)."""
        return await asyncio.get_running_loop().run_in_executor(self._writer, fn, *args)

    def in_reader(self, fn, *args, **kwargs) -> Awaitable[Any]:
        """``fn(*args, **kwargs)`` in a reader thread (a store read off the loop)."""
        return self.reads.in_reader(fn, *args, **kwargs)

    def flush(self) -> Awaitable[None]:
        """Wait until everything decided so far is committed."""
        return self.commit.flush()

    def _committed(self, batch: Batch, written: list[dict[str, Any]], events: list[Event]) -> None:
        """A batch is on disk (the group commit's ``on_committed``): the reads see it, then the
        feed carries its events and the listeners hear of them."""
        self.reads.apply(batch)
        users = {}
        for e in events:
            lease = getattr(e, "lease", None)
            if lease is not None:
                users[e.lease_id] = lease.user
        self.feed.publish((w, users.get(w["lease_id"]) or (batch.leases.get(w["lease_id"]) or {}).get("user", "")) for w in written)
        for listener in self.listeners:
            try:
                listener(written, events)
            except Exception:
                self.log.exception("event listener %r failed", listener)

    def _lost_database(self, exc: BaseException) -> None:
        self.feed.close("the broker lost its database")
        if self.on_fatal is not None:
            self.on_fatal(exc)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> list[Event]:
        """Bring the schema up to date, load live leases and past usage, start the writer, tick
        once. The caller holds the store's leadership."""
        before, head = await self.in_writer(self.store.upgrade)
        if before != head:
            self.log.info("Lease database %s at schema %s (was %s)", self.store.describe(), head, before or "empty")
        now = self.now()
        self.started_at = now
        self.keys.start(now)
        live = await self.in_writer(self.store.load_live)
        self.scheduler.restore(live)
        self.reads.restore((lease.to_dict() for lease in live), await self.in_writer(self.store.load_totals))
        await self.in_writer(self.past.catch_up)  # a standby read all but the last moment's ends ahead
        self.record_past()
        self.feed.last_id = await self.in_writer(self.store.last_event_id)
        if self.usage_recorder is not None:
            stale = self.usage_recorder.restore(await self.in_writer(self.store.load_live_usage), live=self.reads.committed)
            for lid in stale:  # ended while nothing was recorded (recording off): closed at its end
                self.usage_recorder.close_stale(lid, await self.in_writer(self.store.get_lease, lid))
        self.log.info("Restored %d live lease(s) and %d past lease(s) of usage history", len(live), self.past.count_since(now - self.usage_lookback_s))
        self.commit.start()
        await self.commit.stage([], tick=True)
        return []

    def record_past(self) -> None:
        """Count the use of the leases that ended within the usage window and were read since the
        last call (``past``): a standby as it reads them, on the thread that waits for the lock
        (nothing else touches the scheduler before start), the broker that takes over for the
        last ones. A lease counted ahead that leaves the window before the take-over stays
        counted, as it would in a broker that had served all along."""
        for p in self.past.take_new(self.now() - self.usage_lookback_s):
            self.scheduler.record_usage(p.user, p.groups, p.granted_at, p.ended_at, p.gpu_milli)

    async def tick(self) -> None:
        """A scheduling pass (expiries, warnings, grants), committed."""
        if self.commit.failed is None and not self.commit.closed:
            await self.commit.stage([], tick=True)

    async def close(self) -> None:
        """Finish pending writes, close the store."""
        if self.commit.closed:
            return
        await self.commit.close()
        self.feed.close()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._writer.shutdown, True)
        if self._readers is not self._writer:
            await loop.run_in_executor(None, self._readers.shutdown, True)
        self.store.close()

    async def check_lock(self) -> None:
        """Whether this broker still holds the database's lock (the connection that holds it is
        alive); losing it is fatal, like a failed commit."""
        try:
            await self.in_writer(self.store.check_leadership)
        except Exception as e:  # the connection holding the lock is gone
            self.commit.fail(e)

    async def prune_events(self, retention_s: float) -> int:
        """Delete events older than ``retention_s`` of ended leases (in chunks, in the writer)."""
        before = self.now() - retention_s
        total = 0
        while not self.closed and self.failed is None:
            n = await self.in_writer(self.store.prune_events, before)
            total += n
            if n == 0:
                break
        if total:
            self.feed.ring.clear()  # catch-ups read the store until the ring fills again
        return total

    async def prune_usage_samples(self, retention_s: float) -> int:
        """Delete raw usage samples older than ``retention_s`` (in chunks, in the writer); the hourly roll-ups stay."""
        before = self.now() - retention_s
        total = 0
        while not self.closed and self.failed is None:
            n = await self.in_writer(self.store.prune_usage_samples, before)
            total += n
            if n == 0:
                break
        return total

    # ------------------------------------------------------------------ idempotency
    async def _replayed(self, key: str | None, user: str | None = None) -> str | None:
        """The lease an earlier call with ``key`` changed (a client retrying after a lost answer)."""
        lid = await self.keys.find(key)
        if lid is None:
            return None
        if user is not None:
            d = await self.reads.lease_dict(lid)
            if d is None or d["user"] != user:
                raise Conflict("this Idempotency-Key was already used for another user's lease; send a new key", field="Idempotency-Key")
        return lid

    async def _run(self, op, *, leases=(), tick: bool = True, key: str | None = None) -> list[Event]:
        """Run a scheduler call; on its refusal, answer only once what it read is committed."""
        try:
            events = op()
        except LeaseError:
            await self.commit.flush()
            raise
        await self.commit.stage(events, leases, tick=tick, key=key)
        return events

    # ------------------------------------------------------------------ operations
    async def request(self, ask: Ask, *, actor: str = "", key: str | None = None) -> dict[str, Any]:
        """Queue the lease ``ask`` asks for (granted in the same commit when it fits); its
        committed dict. ``key``: the caller's idempotency key (a retry gets the first lease)."""
        replay = await self._replayed(key, ask.user)
        if replay is not None:
            return await self.reads.get(replay)
        now = self.now()
        try:
            lease = self.scheduler.new_lease(ask, now, lease_id=self._new_id())
        except LeaseError:
            await self.commit.flush()
            raise
        self.keys.remember(key, lease.id)
        await self._run(lambda: self.scheduler.submit(lease, now, actor=actor or ask.user), leases=[lease], key=key)
        return self.reads.committed.get(lease.id) or await self.reads.get(lease.id)

    async def _change(self, lease_id: str, op, *, tick: bool = True, key: str | None = None) -> dict[str, Any]:
        if await self._replayed(key) == lease_id:
            return await self.reads.get(lease_id)
        lease = await self._live(lease_id)
        self.keys.remember(key, lease_id)
        await self._run(lambda: op(self.now()), leases=[lease], tick=tick, key=key)
        return await self.reads.get(lease_id)

    async def _live(self, lease_id: str):
        try:
            return self.scheduler.get(lease_id)
        except NotFound:
            await self.commit.flush()  # its end may still be on its way to the disk
            d = await self.reads.lease_dict(lease_id)
            if d is None:
                raise NotFound(f"no lease with id {lease_id!r}", field="id") from None
            raise Conflict(f"lease {lease_id} has already ended ({d['state']})", field="state") from None

    async def release(self, lease_id: str, *, state: LeaseState = LeaseState.RELEASED, reason: str = "", actor: str = "", keep_server: bool = False, key: str | None = None) -> dict[str, Any]:
        if keep_server:
            self.commit.keep_server(lease_id)
        return await self._change(lease_id, lambda now: self.scheduler.release(lease_id, now, state=state, reason=reason, actor=actor), key=key)

    async def revoke(self, lease_id: str, *, grace_s: float, reason: str, actor: str, key: str | None = None) -> dict[str, Any]:
        """An admin ends a lease after ``grace_s`` s (0: now), its holder warned meanwhile."""
        return await self._change(lease_id, lambda now: self.scheduler.revoke(lease_id, now, grace_s=grace_s, reason=reason, actor=actor), key=key)

    async def extend(self, lease_id: str, *, by_s: float | None = None, until: float | None = None, actor: str = "", key: str | None = None) -> dict[str, Any]:
        return await self._change(lease_id, lambda now: self.scheduler.extend(lease_id, now, by_s=by_s, until=until, actor=actor), key=key)

    async def drain(self, lease_id: str, *, grace_s: float, reason: str, device: str, actor: str = "broker:health") -> dict[str, Any]:
        """Move a lease off a sick GPU (see Scheduler.drain)."""
        return await self._change(lease_id, lambda now: self.scheduler.drain(lease_id, now, grace_s=grace_s, reason=reason, device=device, actor=actor))

    async def cancel_drain(self, lease_id: str, *, why: str, actor: str = "broker:health") -> dict[str, Any]:
        """Keep a lease whose move off its GPU is pending (see Scheduler.cancel_drain)."""
        return await self._change(lease_id, lambda now: self.scheduler.cancel_drain(lease_id, now, why=why, actor=actor))

    async def confirm(self, lease_id: str, *, actor: str = "", key: str | None = None) -> dict[str, Any]:
        return await self._change(lease_id, lambda now: self.scheduler.confirm(lease_id, now, actor=actor), key=key)

    async def heartbeat(self, lease_id: str, usage: dict | None = None) -> dict[str, Any]:
        """Record the holder's usage; an ended lease answers with its end (the holder learns of it)."""
        try:
            lease = self.scheduler.get(lease_id)
        except NotFound:
            return await self.reads.get(lease_id)
        await self._run(lambda: self.scheduler.heartbeat(lease_id, self.now(), usage), leases=[lease], tick=False)
        return await self.reads.get(lease_id)

    async def record(self, events: list[Event]) -> None:
        """Commit events that belong to no lease (the unleased-use detector's): the audit log,
        the counters and the feed carry them like the others; in the feed only admins' streams
        see them (they name other users: whose GPU was used)."""
        await self.commit.stage(events, tick=False)

    async def set_inventory(self, gpus) -> list[Event]:
        if self.health is not None:
            gpus = self.health.apply(gpus)  # cordoned GPUs take no new grants
        events = self.scheduler.set_inventory(gpus, self.now())
        await self.commit.stage(events)
        return events

    async def set_draining(self, draining: bool, *, actor: str = "") -> None:
        """Stop (or resume) granting: queued leases stay queued; expiries and ends go on."""
        self.draining = bool(draining)
        self.scheduler.set_draining(self.draining)
        self.log.warning("%s granting leases%s", "Stopped" if draining else "Resumed", f" ({actor})" if actor else "")
        if not draining:
            await self.tick()

    def estimate(self, ask: Ask) -> dict[str, Any]:
        """What ``ask`` would get if it were made now, without making it (the scheduler's
        pass, run dry): ``start`` now / queued (position, ETA) / never (``refused``)."""
        return self.scheduler.estimate(ask, self.now()).to_dict()

    # ------------------------------------------------------------------ reads (committed state: self.reads)
    @property
    def committed(self) -> dict[str, dict[str, Any]]:
        """Live leases as last committed (id -> dict)."""
        return self.reads.committed

    @property
    def totals(self) -> dict[tuple[str, tuple[str, ...]], list[float]]:
        """The durable counters as committed: (name, label values) -> [total, created]."""
        return self.reads.totals

    def get(self, lease_id: str) -> Awaitable[dict[str, Any]]:
        """The committed dict of any lease (awaitable); NotFound when unknown."""
        return self.reads.get(lease_id)

    def live(self, user: str | None = None) -> list[dict[str, Any]]:
        """Live leases (of ``user``) as committed, oldest first."""
        return self.reads.live(user)

    def list(self, *, user: str | None = None, state: str = "live", limit: int | None = None) -> Awaitable[list[dict[str, Any]]]:
        """Leases by ``state`` (awaitable): see :meth:`.reads.LeaseReads.list`."""
        return self.reads.list(user=user, state=state, limit=limit)

    def page(self, *, user: str | None = None, state: str = "live", limit: int, after=None) -> Awaitable[tuple[list[dict[str, Any]], Any]]:
        """One page of a list and the next page's cursor (awaitable): see :meth:`.reads.LeaseReads.page`."""
        return self.reads.page(user=user, state=state, limit=limit, after=after)

    def events_since(self, since: int, *, lease_id: str | None = None, user: str | None = None, limit: int = 500) -> Awaitable[list[dict]]:
        """Committed events after ``since`` (awaitable)."""
        return self.reads.events_since(since, lease_id=lease_id, user=user, limit=limit)

    def queue(self) -> list[dict[str, Any]]:
        """Committed queued leases in scheduling order."""
        return self.reads.queue()

    def queue_info(self, d: dict[str, Any]) -> dict[str, Any] | None:
        """Position, length, ETA and what it waits for, of a lease queued as committed."""
        return self.reads.queue_info(d)

    def lease_json(self, d: dict[str, Any], *, viewer: str | None = None, admin: bool = True) -> dict[str, Any]:
        """A committed lease as the API shows it to ``viewer``."""
        return self.reads.lease_json(d, viewer=viewer, admin=admin)

    def warnings(self, d: dict[str, Any]) -> list[dict[str, Any]]:
        """What the holder of committed lease ``d`` should be told now."""
        return self.reads.warnings(d)

    # ------------------------------------------------------------------ the pool and the policy (the scheduler's, now)
    def inventory(self):
        return list(self.scheduler.inventory.values())

    def pool(self) -> dict[str, Any]:
        sched = self.scheduler
        health = self.health
        return {
            "devices": [g.to_dict() | ((health.device_note(g) or {}) if health else {}) for g in sched.inventory.values()],
            **({"health": health.state_json()} if health else {}),
            "capacity": sched.capacity(),
            "queue_length": sched.queue_length(),
            "default_tier": sched.policy.default_tier,
            "draining": self.draining,
        }

    def tiers_for(self, user: str, groups: Iterable[str], *, every: bool = False):
        groups = tuple(groups)
        return [t for t in self.policy.tiers.values() if every or t.allows(user, groups)]

    def usage(self, user: str, groups: Iterable[str]) -> dict[str, Any]:
        return self.scheduler.user_usage(user, tuple(groups), self.now())


def usage_lookback(policy) -> float:
    """How far back past usage still matters: the longest quota period, or 5 fair-share half-lives."""
    periods = [q.period_s for q in (policy.default_user_quota, *policy.user_quotas.values(), *policy.group_quotas.values()) if q.gpu_hours is not None]
    if policy.fair_share:
        periods.append(5 * policy.fair_share_half_life_s)
    return max(periods, default=0.0)
