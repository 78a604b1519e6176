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
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..core.events import ENDED, Event
from ..core.model import Conflict, LeaseError, LeaseState, NotFound
from ..core.request import Ask
from ..core.scheduler import REVOKE_META
from ..core.text import format_duration
from ..store import Batch, LeaseStore
from .feed import Feed

log = logging.getLogger(__name__)

LIVE = (LeaseState.QUEUED.value, LeaseState.ACTIVE.value)
TERMINAL = tuple(s.value for s in LeaseState if s.terminal)


class SystemClock:
    """The real clock. Tests inject an object with the same ``now()`` that they can move."""

    def now(self) -> float:
        return time.time()


STOPPING = "the broker is stopping; try again in a moment (its standby or the restarted broker answers)"


class Unavailable(LeaseError):
    """The broker cannot commit any more (its database failed); it is stopping."""

    status = 503


EventListener = Callable[[list[dict[str, Any]], list[Event]], None]


class LeaseManager:
    """Owns the :class:`Scheduler` and the :class:`LeaseStore`; the only writer of lease state."""

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

    def _stage(self, events: list[Event], leases: Iterable[Any] = (), *, tick: bool = True, key: str | None = None) -> asyncio.Future:
        """Queue decisions for the next group commit; the future resolves once they are on disk."""
        if self.failed is not None:
            raise Unavailable("the broker lost its database and is stopping; try again in a few seconds")
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

    _writing: asyncio.Future | None = None

    def _note_end(self, e: Event) -> None:
        extra = self._end_extra.setdefault(e.lease_id, {})
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
            batch = self._snapshot(staged, events, touched.values())
            try:
                written = await loop.run_in_executor(self._writer, self.store.write, batch) if batch else []
            except BaseException as e:  # any failure to commit is fatal, see the module doc
                self._fail(e, done)
                return
            self.commits += 1
            self._committed(batch, written, events)
            self._writing = None
            if not done.done():
                done.set_result(None)

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
            extra = self._end_extra.get(lid)
            if extra and d["state"] in TERMINAL:
                d.update({"end_info": {k: v for k, v in extra.items() if k != "keep_server"}, "keep_server": bool(extra.get("keep_server"))})
            batch.leases[lid] = d
        if self.count_totals is not None and events:
            batch.totals, batch.at = self.count_totals(events), self.now()
        if self.usage_recorder is not None:
            self.usage_recorder.observe(events, touched, self.now())
            batch.usage = self.usage_recorder.take()
            if batch.usage is not None and batch.usage.totals and self.count_totals is not None:
                for k, v in batch.usage.totals.items():
                    batch.totals[k] = batch.totals.get(k, 0.0) + v
                batch.at = batch.at or self.now()
        return batch

    def _committed(self, batch: Batch, written: list[dict[str, Any]], events: list[Event]) -> None:
        for key, n in batch.totals.items():
            total = self.totals.setdefault(key, [0.0, batch.at])
            total[0] += n
        for lid, d in batch.leases.items():
            if d["state"] in LIVE:
                self.committed[lid] = d
            else:
                self.committed.pop(lid, None)
                self._end_extra.pop(lid, None)
                self.recently_ended[lid] = d
                self.recently_ended.move_to_end(lid)
                if len(self.recently_ended) > self.recently_ended_max:
                    self.recently_ended.popitem(last=False)
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

    def _fail(self, exc: BaseException, done: asyncio.Future) -> None:
        self.failed = exc
        self.log.critical("Cannot write to the lease database %s: %s. Nothing more is answered; the broker stops so that it (or its standby) "
                          "starts again from the database.", self.store.describe(), exc)
        err = Unavailable("the broker lost its database and is stopping; try again in a few seconds")
        for fut in (done, self._pending_done):
            if fut is not None and not fut.done():
                fut.set_exception(err)
                fut.exception()  # retrieved: waiters that gave up must not log it again
        self._pending_done = None
        self.feed.close("the broker lost its database")
        if self.on_fatal is not None:
            self.on_fatal(exc)

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

    # ------------------------------------------------------------------ reading
    async def _lease_dict(self, lease_id: str) -> dict[str, Any] | None:
        d = self.committed.get(lease_id) or self.recently_ended.get(lease_id)
        if d is not None:
            return d
        if lease_id in self.scheduler.leases:  # its first commit is pending
            await self.flush()
            d = self.committed.get(lease_id) or self.recently_ended.get(lease_id)
            if d is not None:
                return d
        return await self._in_reader(self.store.get_lease_dict, lease_id)

    async def get(self, lease_id: str) -> dict[str, Any]:
        """The committed dict of any lease; NotFound when unknown."""
        d = await self._lease_dict(lease_id)
        if d is None:
            raise NotFound(f"no lease with id {lease_id!r}", field="id")
        return d

    def live(self, user: str | None = None) -> list[dict[str, Any]]:
        leases = self.committed.values() if user is None else (d for d in self.committed.values() if d["user"] == user)
        return sorted(leases, key=lambda d: (d["created_at"], d["seq"]))

    async def list(self, *, user: str | None = None, state: str = "live", limit: int | None = None) -> list[dict[str, Any]]:
        """Leases by ``state``: 'live' (queued+active), a state name, 'ended', or 'all'.

        Live ones as committed; ended ones from the store, newest first, at most ``limit``.
        Every lease appears once: one ended after its live copy was taken shows as ended.
        """
        if state in ("live", *LIVE):
            leases = self.live(user)
            return leases if state == "live" else [d for d in leases if d["state"] == state]
        if state == "all":
            live = self.live(user)  # first: a lease that ends meanwhile is then in the store
            ended = await self._in_reader(self.store.list_lease_dicts, user, TERMINAL, limit=limit)
            gone = {d["id"] for d in ended}
            return [d for d in live if d["id"] not in gone] + ended
        states = TERMINAL if state == "ended" else (state,)
        return await self._in_reader(self.store.list_lease_dicts, user, states, limit=limit)

    async def events_since(self, since: int, *, lease_id: str | None = None, user: str | None = None, limit: int = 500) -> list[dict]:
        """Committed events after ``since``: from memory when recent, else from the store."""
        events = self.feed.since(since, user=user, lease_id=lease_id, limit=limit)
        if events is None:
            events = await self._in_reader(self.store.events_since, since, lease_id, limit, user=user)
        return events

    def queue_info(self, d: dict[str, Any]) -> dict[str, Any] | None:
        """Position, length, ETA and what it waits for, of a lease queued as committed."""
        if d["state"] != LeaseState.QUEUED.value:
            return None
        try:
            q = self.scheduler.queue_info(d["id"])
        except NotFound:
            return None
        if q is not None:
            q["may_start_sooner_at"] = self.may_start_sooner_at(d["id"], q.get("eta"))
        return q

    def may_start_sooner_at(self, lease_id: str, eta: float | None) -> float | None:
        """When a queued lease may start before its ETA because what it waits for sits idle: the
        holders of the GPUs reserved for it all said in their heartbeats (``usage.lease_reclaim_at``)
        that idle reclaim gives their lease back by then if they stay idle. None when one of them
        computes, says nothing, or the deadline is not before the ETA. (The scheduler plans with
        lease ends only; this is the broker's reading of the heartbeats.)"""
        promised = {u for u, lid in self.scheduler._found.promised_to.items() if lid == lease_id}
        if not promised:
            return None
        now = self.now()
        latest = None
        for lease in self.scheduler.leases.values():
            if lease.state is not LeaseState.ACTIVE or lease.placement is None:
                continue
            if not any(sl.gpu_uuid in promised or (sl.mig_uuid and sl.mig_uuid in promised) for sl in lease.placement.slices):
                continue
            at = (lease.usage or {}).get("lease_reclaim_at")
            if isinstance(at, bool) or not isinstance(at, (int, float)) or at <= now:
                return None  # a holder that computes (or says nothing) keeps it until its lease ends
            latest = at if latest is None else max(latest, float(at))
        if latest is None or (eta is not None and latest >= eta):
            return None
        return round(latest, 1)

    def queue(self) -> list[dict[str, Any]]:
        """Committed queued leases in scheduling order, each with its queue info."""
        out = []
        for lease in self.scheduler.queue():
            d = self.committed.get(lease.id)
            if d is not None and d["state"] == LeaseState.QUEUED.value:
                out.append(d)
        return out

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

    def inventory(self):
        return list(self.scheduler.inventory.values())

    def tiers_for(self, user: str, groups: Iterable[str], *, every: bool = False):
        groups = tuple(groups)
        return [t for t in self.policy.tiers.values() if every or t.allows(user, groups)]

    def usage(self, user: str, groups: Iterable[str]) -> dict[str, Any]:
        return self.scheduler.user_usage(user, tuple(groups), self.now())

    def lease_counts(self) -> dict[tuple[str, str], int]:
        counts: dict[tuple[str, str], int] = {}
        for d in self.committed.values():
            k = (d["state"], d["tier"])
            counts[k] = counts.get(k, 0) + 1
        return counts

    def held_by_model(self) -> dict[str, float]:
        held: dict[str, float] = {}
        for d in self.committed.values():
            if d["state"] == LeaseState.ACTIVE.value and d.get("placement"):
                for s in d["placement"]["slices"]:
                    held[s["model"]] = held.get(s["model"], 0.0) + float(s.get("share", 1))
        return held

    # ------------------------------------------------------------------ the lease as JSON
    def lease_json(self, d: dict[str, Any], *, viewer: str | None = None, admin: bool = True) -> dict[str, Any]:
        """A committed lease as the API shows it to ``viewer``: queue info while queued, the end
        in words after it ended (names of other users only to admins)."""
        out = {k: v for k, v in d.items() if k != "end_info"}
        q = self.queue_info(d)
        if q is not None:
            out["queue"] = q
        if d["state"] in TERMINAL:
            out["ended_by"] = ended_by(d, viewer=viewer, admin=admin or self.show_preemptor_names)
            out["end_message"] = end_message(d, out["ended_by"])
            out.setdefault("keep_server", False)
        return out

    def warnings(self, d: dict[str, Any]) -> list[dict[str, Any]]:
        """What the holder should be told now: a coming preemption, a near expiry, the end."""
        now = self.now()
        out = []
        if d["state"] in TERMINAL:
            out.append({"kind": "ended", "at": d.get("ended_at"), "message": end_message(d, ended_by(d, viewer=d["user"], admin=self.show_preemptor_names))})
            return out
        if d["state"] != LeaseState.ACTIVE.value:
            return out
        revoke = (d.get("meta") or {}).get(REVOKE_META) if not d.get("preempted_for") else None
        if d.get("preempt_at") and isinstance(revoke, dict) and revoke.get("drain"):
            pass  # moved off a sick GPU: the health warning says so
        elif d.get("preempt_at") and isinstance(revoke, dict):
            out.append({"kind": "preemption", "at": d["preempt_at"],
                        "message": f"an admin ends this lease in {format_duration(d['preempt_at'] - now)}: {revoke.get('reason') or 'no reason given'}"})
        elif d.get("preempt_at"):
            out.append({"kind": "preemption", "at": d["preempt_at"], "message": f"this lease will be preempted in {format_duration(d['preempt_at'] - now)} for a waiting higher-tier request"})
        exp = d.get("expires_at")
        warn = self.policy.warn_before_s or 0
        if exp is not None and exp - now <= warn:
            out.append({"kind": "expiring", "at": exp, "message": f"this lease expires in {format_duration(exp - now)}"})
        if self.unleased_warnings is not None:
            out += self.unleased_warnings(d["user"])
        if self.health is not None:
            out += self.health.warnings(d)
        return out


# --------------------------------------------------------------------------- ends in words
def ended_by(d: dict[str, Any], *, viewer: str | None, admin: bool) -> dict[str, Any]:
    """Who or what ended a lease, as ``viewer`` may see it."""
    info = d.get("end_info") or {}
    actor = info.get("actor", "")
    state = d["state"]
    if state == LeaseState.PREEMPTED.value:
        out: dict[str, Any] = {"kind": "preemption"}
        pf = info.get("preempted_for") or {}
        if pf.get("tier"):
            out["tier"] = pf["tier"]
        if pf.get("user") and (admin or pf["user"] == viewer):
            out["user"] = pf["user"]
        if admin and pf.get("lease"):
            out["lease"] = pf["lease"]
        return out
    if actor == "broker" or actor.startswith("broker:"):
        return {"kind": "idle" if state == LeaseState.RECLAIMED.value else "broker"}
    if actor.startswith("admin:"):
        return {"kind": "admin", "user": actor.split(":", 1)[1]}
    if actor.startswith("service:"):
        return {"kind": "service", "name": actor.split(":", 1)[1]}
    if actor == d["user"] or not actor:
        return {"kind": "idle" if state == LeaseState.RECLAIMED.value else "holder"}
    return {"kind": "user", "user": actor}


_STATE_WORDS = {
    "released": "Released",
    "expired": "Expired",
    "reclaimed": "Reclaimed because its GPUs sat idle",
    "preempted": "Preempted",
    "revoked": "Revoked",
    "withdrawn": "Withdrawn",
    "failed": "Failed",
}


def _unrepeated(state: str, reason: str) -> tuple[str, bool]:
    """The reason less a first word that repeats what the head already says, and whether what is
    left continues the head's sentence: 'released from the notebook' under 'Released' gives
    ('from the notebook', True); 'idle: …' under 'Reclaimed because its GPUs sat idle' gives
    ('…', False)."""
    low = reason.lower()
    for word in (state, "idle") if state == LeaseState.RECLAIMED.value else (state,):
        rest = reason[len(word) + 1:].strip()
        if low == word:
            return "", False
        if low.startswith(word + ":"):
            return rest, False
        if low.startswith(word + " ") and rest:
            return rest, word == state
    return reason, False


def end_message(d: dict[str, Any], by: dict[str, Any]) -> str:
    """One sentence a user understands: what happened, by whom, why."""
    state = d["state"]
    head = _STATE_WORDS.get(state, state.capitalize())
    reason, continues = _unrepeated(state, (d.get("end_reason") or "").strip().rstrip("."))
    kind = by.get("kind")
    if state == LeaseState.PREEMPTED.value:
        whom = f" of {by['user']}" if by.get("user") else ""
        tier = f"a waiting {by['tier']!r} request{whom}" if by.get("tier") else "a waiting higher-tier request"
        return f"Preempted: its GPUs were needed for {tier}."
    if kind == "admin":
        head += f" by {by['user']} (admin)"
    elif kind == "service" and by.get("name"):
        head += f" by the service {by['name']}"
    elif kind == "user":
        head += f" by {by['user']}"
    elif kind == "broker" and state not in ("expired", "withdrawn"):
        head += " by the broker"
    if reason and continues:
        return f"{head} {reason}."
    return f"{head}: {reason}." if reason else f"{head}."


def _usage_lookback(policy) -> float:
    """How far back past usage still matters: the longest quota period, or 5 fair-share half-lives."""
    periods = [q.period_s for q in (policy.default_user_quota, *policy.user_quotas.values(), *policy.group_quotas.values()) if q.gpu_hours is not None]
    if policy.fair_share:
        periods.append(5 * policy.fair_share_half_life_s)
    return max(periods, default=0.0)
