"""Reads of committed lease state, and a lease as the API shows it.

A live lease is read as last committed (from memory); a lease whose first commit is pending
waits for it; an ended one comes from the recently ended or the store. Nothing here decides;
the committed state changes only when a batch is on disk (:meth:`LeaseReads.apply`). Held by
:class:`.manager.LeaseManager`.
"""

from __future__ import annotations

import asyncio
import heapq
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import Executor
from typing import Any

from ..core.model import LeaseState, NotFound
from ..core.scheduler import REVOKE_META
from ..core.text import format_duration
from ..store import Batch, LeaseStore
from .commit import LIVE, TERMINAL
from .ends import end_message, ended_by
from .feed import Feed
from .listing import Cursor, key_of

WarningSource = Callable[[dict[str, Any]], list[dict[str, Any]]]


class LeaseReads:
    """Leases, events and the queue as committed; a lease's JSON and its warnings.

    ``scheduler``: for what is pending and the queue's order; ``store`` and ``readers``: ended
    leases and old events, read in those threads; ``feed``: recent events; ``flush``: waits
    until everything decided so far is committed (the group commit's); ``now``: the clock;
    ``show_preemptor_names``: holders read who preempted them. Besides what a lease says of
    itself, its holder is warned by each of ``warning_sources`` (:meth:`warn_from`)."""

    def __init__(self, scheduler, store: LeaseStore, *, readers: Executor, feed: Feed, flush: Callable[[], Awaitable[None]],
                 now: Callable[[], float], show_preemptor_names: bool = False, recently_ended_max: int = 8192):
        self.scheduler = scheduler
        self.store = store
        self.readers = readers
        self.feed = feed
        self.flush = flush
        self.now = now
        self.show_preemptor_names = show_preemptor_names
        self.committed: dict[str, dict[str, Any]] = {}  # live leases as last committed
        # leases that ended lately, as committed: the answer to a release and the reads that
        # follow an end come from here, not from the database (bounded, oldest end out first)
        self.recently_ended: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self.recently_ended_max = recently_ended_max
        # the durable counters (the metrics'): (name, label values) -> [total, created] as committed
        self.totals: dict[tuple[str, tuple[str, ...]], list[float]] = {}
        self.warning_sources: tuple[WarningSource, ...] = ()

    def warn_from(self, *sources: WarningSource) -> None:
        """Add what other parts tell a lease's holder (each: a lease's dict -> its warnings)."""
        self.warning_sources += sources

    async def in_reader(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` in a reader thread (a store read off the loop)."""
        return await asyncio.get_running_loop().run_in_executor(self.readers, lambda: fn(*args, **kwargs))

    # ------------------------------------------------------------------ the committed state
    def restore(self, live: Iterable[dict[str, Any]], totals: dict[tuple[str, tuple[str, ...]], list[float]]) -> None:
        """The state a broker starts from: the live leases and the counter totals in the store."""
        self.committed = {d["id"]: d for d in live}
        self.totals = totals

    def apply(self, batch: Batch) -> None:
        """A batch is on disk: its leases and counter increments are committed state now."""
        for key, n in batch.totals.items():
            total = self.totals.setdefault(key, [0.0, batch.at])
            total[0] += n
        committed, ended = self.committed, self.recently_ended
        for lid, d in batch.leases.items():
            if d["state"] in LIVE:
                committed[lid] = d
            else:
                committed.pop(lid, None)
                ended[lid] = d
                ended.move_to_end(lid)
                if len(ended) > self.recently_ended_max:
                    ended.popitem(last=False)

    # ------------------------------------------------------------------ leases and events
    async def lease_dict(self, lease_id: str) -> dict[str, Any] | None:
        """The committed dict of any lease; None when unknown."""
        d = self.committed.get(lease_id) or self.recently_ended.get(lease_id)
        if d is not None:
            return d
        if lease_id in self.scheduler.leases:  # its first commit is pending
            await self.flush()
            d = self.committed.get(lease_id) or self.recently_ended.get(lease_id)
            if d is not None:
                return d
        return await self.in_reader(self.store.get_lease_dict, lease_id)

    async def get(self, lease_id: str) -> dict[str, Any]:
        """The committed dict of any lease; NotFound when unknown."""
        d = await self.lease_dict(lease_id)
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
            ended = await self.in_reader(self.store.list_lease_dicts, user, TERMINAL, limit=limit)
            gone = {d["id"] for d in ended}
            return [d for d in live if d["id"] not in gone] + ended
        states = TERMINAL if state == "ended" else (state,)
        return await self.in_reader(self.store.list_lease_dicts, user, states, limit=limit)

    async def page(self, *, user: str | None = None, state: str = "live", limit: int, after: Cursor | None = None) -> tuple[list[dict[str, Any]], Cursor | None]:
        """One page of the leases :meth:`list` lists (see :mod:`.listing`): at most ``limit``
        after the cursor ``after``, and the cursor of the next page (None: this was the last).

        Live ones as committed (the ``limit`` first after the cursor, without sorting them all);
        ended ones from the store. On a page of ``all``, a lease that ended after its live copy
        was taken shows as ended only."""
        page: list[dict[str, Any]] = []
        if state in ("live", *LIVE) or (state == "all" and (after is None or after.phase == "live")):
            since = after.key if after is not None and after.key is not None else None
            only = None if state in ("live", "all") else state
            picked = (d for d in self.committed.values()
                      if (user is None or d["user"] == user) and (only is None or d["state"] == only) and (since is None or key_of(d) > since))
            page = heapq.nsmallest(limit + 1, picked, key=key_of)
            if len(page) > limit:
                page = page[:limit]
                return page, Cursor("live", key_of(page[-1]))
            if state != "all":
                return page, None
            before = None
        else:
            before = after.key if after is not None else None
        room = limit - len(page)
        ended = await self.in_reader(self.store.list_lease_dicts, user, TERMINAL if state in ("ended", "all") else (state,),
                                     limit=room + 1, before=before)
        if page:
            gone = {d["id"] for d in ended}
            page = [d for d in page if d["id"] not in gone]
        if len(ended) <= room:
            return page + ended, None
        ended = ended[:room]
        return page + ended, Cursor("ended", key_of(ended[-1]) if ended else before)

    async def events_since(self, since: int, *, lease_id: str | None = None, user: str | None = None, limit: int = 500) -> list[dict]:
        """Committed events after ``since``: from memory when recent, else from the store."""
        events = self.feed.since(since, user=user, lease_id=lease_id, limit=limit)
        if events is None:
            events = await self.in_reader(self.store.events_since, since, lease_id, limit, user=user)
        return events

    # ------------------------------------------------------------------ the queue
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
        holders = self.scheduler.promised_holders(lease_id)
        if not holders:
            return None
        now = self.now()
        latest = None
        for lease in holders:
            at = (lease.usage or {}).get("lease_reclaim_at")
            if isinstance(at, bool) or not isinstance(at, (int, float)) or at <= now:
                return None  # a holder that computes (or says nothing) keeps it until its lease ends
            latest = at if latest is None else max(latest, float(at))
        if latest is None or (eta is not None and latest >= eta):
            return None
        return round(latest, 1)

    def queue(self) -> list[dict[str, Any]]:
        """Committed queued leases in scheduling order."""
        out = []
        for lease in self.scheduler.queue():
            d = self.committed.get(lease.id)
            if d is not None and d["state"] == LeaseState.QUEUED.value:
                out.append(d)
        return out

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
        """What the holder should be told now: a coming preemption, a near expiry, the end; then
        what the warning sources say (unleased GPU use, the GPU's health)."""
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
        warn = self.scheduler.policy.warn_before_s or 0
        if exp is not None and exp - now <= warn:
            out.append({"kind": "expiring", "at": exp, "message": f"this lease expires in {format_duration(exp - now)}"})
        for source in self.warning_sources:
            out += source(d)
        return out
