"""Reads of committed lease state, and a lease as the API shows it.

A live lease is read as last committed (from memory); a lease whose first commit is pending
waits for it; an ended one comes from the recently ended or the store. Nothing here changes
state. A part of :class:`.manager.LeaseManager`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..core.model import LeaseState, NotFound
from ..core.scheduler import REVOKE_META
from ..core.text import format_duration
from .commit import LIVE, TERMINAL
from .ends import end_message, ended_by


class LeaseReads:
    """Leases, events, the queue and the pool as committed; a lease's JSON and its warnings."""

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
