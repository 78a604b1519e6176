"""The lease manager: the scheduler, the store, the clock and the feed, wired together.

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
  (``committed``); a read of a lease whose first commit is still pending waits for it. Ended
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
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..core.events import Event
from ..core.model import Conflict, LeaseError, LeaseState, NotFound
from ..core.request import Ask
from ..store import LeaseStore
from .commit import LIVE, STOPPING, TERMINAL, GroupCommit, Unavailable
from .ends import end_message, ended_by
from .feed import Feed
from .reads import LeaseReads

__all__ = ["LIVE", "STOPPING", "TERMINAL", "EventListener", "LeaseManager", "SystemClock", "Unavailable", "end_message", "ended_by"]

log = logging.getLogger(__name__)



class SystemClock:
    """The real clock. Tests inject an object with the same ``now()`` that they can move."""

    def now(self) -> float:
        return time.time()


EventListener = Callable[[list[dict[str, Any]], list[Event]], None]


class LeaseManager(LeaseReads, GroupCommit):
    """Owns the :class:`Scheduler` and the :class:`LeaseStore`; the only writer of lease state.

    Its operations and its life (restore, close, pruning) are here; the group commit they go
    through is :class:`.commit.GroupCommit`, the reads of committed state
    :class:`.reads.LeaseReads`."""

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
    ):
        self.scheduler = scheduler
        self.store = store
        self.clock = clock or SystemClock()
        self.log = logger or log
        self.usage_lookback_s = usage_lookback_s
        self.feed = feed if feed is not None else Feed()
        self.listeners: list[EventListener] = []
        self.on_fatal: Callable[[BaseException], None] | None = None
        self.show_preemptor_names = show_preemptor_names
        # one writer thread keeps commits in order; reads use their own threads (an in-memory
        # SQLite database is one connection: everything goes through the writer then)
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="gpulease-store-write")
        self._readers = self._writer if store.in_memory else ThreadPoolExecutor(2, thread_name_prefix="gpulease-store-read")
        self.committed: dict[str, dict[str, Any]] = {}  # live leases as last committed
        # leases that ended lately, as committed: the answer to a release and the reads that
        # follow an end come from here, not from the database (bounded, oldest end out first)
        self.recently_ended: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self.recently_ended_max = 8192
        self._pending: list[tuple[list[Event], str | None]] = []
        self._pending_leases: dict[str, Any] = {}
        self._pending_tick = False
        self._pending_done: asyncio.Future | None = None
        self._wake: asyncio.Event | None = None
        self._writer_task: asyncio.Task | None = None
        self._end_extra: dict[str, dict[str, Any]] = {}  # facts about an end the scheduler does not keep
        self._keys: OrderedDict[str, str] = OrderedDict()  # idempotency key -> lease id (this process)
        self._keys_max = 200_000
        self.request_key_window_s = request_key_window_s
        self.started_at = 0.0
        self.draining = False
        self.failed: BaseException | None = None
        self.closed = False
        self.commits = 0  # transactions written (for the benchmark and metrics)
        # durable counters (the metrics'): events -> increments, committed with the events;
        # ``totals`` holds (name, label values) -> [total, created] as committed
        self.count_totals: Callable[[list[Event]], dict[tuple[str, tuple[str, ...]], float]] | None = None
        self.totals: dict[tuple[str, tuple[str, ...]], list[float]] = {}
        self._ids = random.Random(os.urandom(32))
        # unleased GPU use (broker/unleased.py): the standing findings as JSON, and the warnings
        # of one user's findings for the heartbeat answers of that user's leases
        self.unleased: list[dict[str, Any]] = []
        self.unleased_action: str | None = None  # None: nothing checks
        self.unleased_warnings: Callable[[str], list[dict[str, Any]]] | None = None
        self.health = None  # GPU health, cordons and maintenance windows (broker/health.py), where on
        # usage records (broker/usage.py): fed from each batch before its commit, written with it
        self.usage_recorder = None

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

    async def _in_writer(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._writer, fn, *args)

    async def _in_reader(self, fn, *args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(self._readers, lambda: fn(*args, **kwargs))

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> list[Event]:
        """Bring the schema up to date, load live leases and past usage, start the writer, tick
        once. The caller holds the store's leadership."""
        self._wake = asyncio.Event()
        before, head = await self._in_writer(self.store.upgrade)
        if before != head:
            self.log.info("Lease database %s at schema %s (was %s)", self.store.describe(), head, before or "empty")
        now = self.now()
        self.started_at = now
        live = await self._in_writer(self.store.load_live)
        self.scheduler.restore(live)
        self.committed = {lease.id: lease.to_dict() for lease in live}
        lookback = self.usage_lookback_s if self.usage_lookback_s is not None else _usage_lookback(self.scheduler.policy)
        past = await self._in_writer(self.store.history, now - lookback)
        for lease in past:
            self.scheduler.record_usage(lease.user, lease.groups, lease.granted_at, lease.ended_at, lease.gpu_milli)
        self.feed.last_id = await self._in_writer(self.store.last_event_id)
        self.totals = await self._in_writer(self.store.load_totals)
        if self.usage_recorder is not None:
            stale = self.usage_recorder.restore(await self._in_writer(self.store.load_live_usage), live=self.committed)
            for lid in stale:  # ended while nothing was recorded (recording off): closed at its end
                self.usage_recorder.close_stale(lid, await self._in_writer(self.store.get_lease, lid))
        self.log.info("Restored %d live lease(s) and %d past lease(s) of usage history", len(live), len(past))
        self._writer_task = asyncio.ensure_future(self._write_loop())
        done = self._stage([], tick=True)
        await done
        return []

    async def tick(self) -> None:
        """A scheduling pass (expiries, warnings, grants), committed."""
        if self.failed is None and not self.closed:
            await self._stage([], tick=True)

    async def close(self) -> None:
        """Finish pending writes, close the store."""
        if self.closed:
            return
        # closed first: a call that comes during the flush is answered 503 (the next broker
        # answers it), and the writer ends once what was staged is written (were ``closed`` set
        # after the flush, a batch staged meanwhile could leave the writer waiting for a wake-up
        # that never comes, holding the database's lock until the timeout below)
        self.closed = True
        try:
            if self.failed is None and self._writer_task is not None:
                await self.flush()
        except LeaseError:
            pass
        self.feed.close()
        if self._wake is not None:
            self._wake.set()
        if self._writer_task is not None:
            try:
                await asyncio.wait_for(self._writer_task, 30)
            except Exception:  # a writer stuck on a dead database: close anyway
                pass
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._writer.shutdown, True)
        if self._readers is not self._writer:
            await loop.run_in_executor(None, self._readers.shutdown, True)
        self.store.close()

    async def prune_events(self, retention_s: float) -> int:
        """Delete events older than ``retention_s`` of ended leases (in chunks, in the writer)."""
        before = self.now() - retention_s
        total = 0
        while not self.closed and self.failed is None:
            n = await self._in_writer(self.store.prune_events, before)
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
            n = await self._in_writer(self.store.prune_usage_samples, before)
            total += n
            if n == 0:
                break
        return total

    # ------------------------------------------------------------------ idempotency
    def _remember_key(self, key: str | None, lease_id: str) -> None:
        if not key:
            return
        self._keys[key] = lease_id
        if len(self._keys) > self._keys_max:
            self._keys.popitem(last=False)

    async def _replayed(self, key: str | None, user: str | None = None) -> str | None:
        """The lease an earlier call with ``key`` changed (a client retrying after a lost answer)."""
        if not key:
            return None
        lid = self._keys.get(key)
        if lid is None and self.now() - self.started_at < self.request_key_window_s:
            lid = await self._in_reader(self.store.find_request_key, key)  # answered before a restart?
        if lid is None:
            return None
        if user is not None:
            d = await self._lease_dict(lid)
            if d is None or d["user"] != user:
                raise Conflict("this Idempotency-Key was already used for another user's lease; send a new key", field="Idempotency-Key")
        return lid

    async def _run(self, op, *, leases=(), tick: bool = True, key: str | None = None) -> list[Event]:
        """Run a scheduler call; on its refusal, answer only once what it read is committed."""
        try:
            events = op()
        except LeaseError:
            await self.flush()
            raise
        await self._stage(events, leases, tick=tick, key=key)
        return events

    # ------------------------------------------------------------------ operations
    async def request(self, ask: Ask, *, actor: str = "", key: str | None = None) -> dict[str, Any]:
        """Queue the lease ``ask`` asks for (granted in the same commit when it fits); its
        committed dict. ``key``: the caller's idempotency key (a retry gets the first lease)."""
        replay = await self._replayed(key, ask.user)
        if replay is not None:
            return await self.get(replay)
        now = self.now()
        try:
            lease = self.scheduler.new_lease(ask, now, lease_id=self._new_id())
        except LeaseError:
            await self.flush()
            raise
        self._remember_key(key, lease.id)
        await self._run(lambda: self.scheduler.submit(lease, now, actor=actor or ask.user), leases=[lease], key=key)
        return self.committed.get(lease.id) or await self.get(lease.id)

    async def _change(self, lease_id: str, op, *, tick: bool = True, key: str | None = None) -> dict[str, Any]:
        if await self._replayed(key) == lease_id:
            return await self.get(lease_id)
        lease = await self._live(lease_id)
        self._remember_key(key, lease_id)
        await self._run(lambda: op(self.now()), leases=[lease], tick=tick, key=key)
        return await self.get(lease_id)

    async def _live(self, lease_id: str):
        try:
            return self.scheduler.get(lease_id)
        except NotFound:
            await self.flush()  # its end may still be on its way to the disk
            d = await self._lease_dict(lease_id)
            if d is None:
                raise NotFound(f"no lease with id {lease_id!r}", field="id") from None
            raise Conflict(f"lease {lease_id} has already ended ({d['state']})", field="state") from None

    async def release(self, lease_id: str, *, state: LeaseState = LeaseState.RELEASED, reason: str = "", actor: str = "", keep_server: bool = False, key: str | None = None) -> dict[str, Any]:
        if keep_server:
            self._end_extra.setdefault(lease_id, {})["keep_server"] = True
        return await self._change(lease_id, lambda now: self.scheduler.release(lease_id, now, state=state, reason=reason, actor=actor), key=key)

    async def revoke(self, lease_id: str, *, grace_s: float, reason: str, actor: str, key: str | None = None) -> dict[str, Any]:
        """An admin ends a lease after ``grace_s`` s (0: now), its holder warned meanwhile."""
        return await self._change(lease_id, lambda now: self.scheduler.revoke(lease_id, now, grace_s=grace_s, reason=reason, actor=actor), key=key)

    async def extend(self, lease_id: str, *, by_s: float | None = None, until: float | None = None, actor: str = "", key: str | None = None) -> dict[str, Any]:
        return await self._change(lease_id, lambda now: self.scheduler.extend(lease_id, now, by_s=by_s, until=until, actor=actor), key=key)

    async def drain(self, lease_id: str, *, grace_s: float, reason: str, device: str, actor: str = "broker:health") -> dict[str, Any]:
        """Move a lease off a sick GPU (see Scheduler.drain)."""
        return await self._change(lease_id, lambda now: self.scheduler.drain(lease_id, now, grace_s=grace_s, reason=reason, device=device, actor=actor))

    async def confirm(self, lease_id: str, *, actor: str = "", key: str | None = None) -> dict[str, Any]:
        return await self._change(lease_id, lambda now: self.scheduler.confirm(lease_id, now, actor=actor), key=key)

    async def heartbeat(self, lease_id: str, usage: dict | None = None) -> dict[str, Any]:
        """Record the holder's usage; an ended lease answers with its end (the holder learns of it)."""
        try:
            lease = self.scheduler.get(lease_id)
        except NotFound:
            return await self.get(lease_id)
        await self._run(lambda: self.scheduler.heartbeat(lease_id, self.now(), usage), leases=[lease], tick=False)
        return await self.get(lease_id)

    async def record(self, events: list[Event]) -> None:
        """Commit events that belong to no lease (the unleased-use detector's): the audit log,
        the counters and the feed carry them like the others; in the feed only admins' streams
        see them (they name other users: whose GPU was used)."""
        await self._stage(events, tick=False)

    async def set_inventory(self, gpus) -> list[Event]:
        if self.health is not None:
            gpus = self.health.apply(gpus)  # cordoned GPUs take no new grants
        events = self.scheduler.set_inventory(gpus, self.now())
        await self._stage(events)
        return events

    async def set_draining(self, draining: bool, *, actor: str = "") -> None:
        """Stop (or resume) granting: queued leases stay queued; expiries and ends go on."""
        self.draining = bool(draining)
        setter = getattr(self.scheduler, "set_draining", None)
        if setter is not None:
            setter(self.draining)
        else:
            self.scheduler.draining = self.draining
        self.log.warning("%s granting leases%s", "Stopped" if draining else "Resumed", f" ({actor})" if actor else "")
        if not draining:
            await self.tick()

    def estimate(self, ask: Ask) -> dict[str, Any]:
        """What ``ask`` would get if it were made now, without making it (the scheduler's
        pass, run dry): ``start`` now / queued (position, ETA) / never (``refused``)."""
        return self.scheduler.estimate(ask, self.now()).to_dict()





def _usage_lookback(policy) -> float:
    """How far back past usage still matters: the longest quota period, or 5 fair-share half-lives."""
    periods = [q.period_s for q in (policy.default_user_quota, *policy.user_quotas.values(), *policy.group_quotas.values()) if q.gpu_hours is not None]
    if policy.fair_share:
        periods.append(5 * policy.fair_share_half_life_s)
    return max(periods, default=0.0)
