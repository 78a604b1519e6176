"""The lease manager's group commit: one scheduling pass and one transaction per batch.

Decisions are staged on the event loop (``_stage``); the writer takes all that is pending, runs
a scheduling pass over it, snapshots the leases it touched, and commits it all in one
transaction on the writer thread. Only then do the callers get their answers, does the feed
carry the events, and do the listeners hear of them (``_committed``). A failed commit stops the
broker (``_fail``). A part of :class:`.manager.LeaseManager`; see that module for the contract.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from ..core.events import ENDED, Event
from ..core.model import LeaseError, LeaseState
from ..store import Batch

LIVE = (LeaseState.QUEUED.value, LeaseState.ACTIVE.value)
TERMINAL = tuple(s.value for s in LeaseState if s.terminal)

STOPPING = "the broker is stopping; try again in a moment (its standby or the restarted broker answers)"


class Unavailable(LeaseError):
    """The broker cannot commit any more (its database failed); it is stopping."""

    status = 503


class GroupCommit:
    """Staging decisions and writing them, one batch per transaction, in decision order."""

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
            batch.usage = self.usage_recorder.take(self.now())  # heartbeats' records every write_interval_s
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
