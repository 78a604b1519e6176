"""Quotas and the use they are measured on (the framework's *pre-filter* of the pass).

What each user and group holds now, GPU-hours used in each rolling period, and the decayed
usage that fair share orders by. Two gates: at submit, a request over a hard limit (more GPUs
than a user or group may ever hold at once, more GPU-hours than the period leaves) is refused;
in a pass, a lease whose concurrent-GPU quota is in use waits, with an ETA from when its own
user's (or group's) leases end.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

from .model import MILLI, Lease, LeaseState, Refused
from .policy import Policy
from .text import format_duration
from .usage import FairShare, UsageWindow


class Quotas:
    def __init__(self, policy: Policy):
        self.policy = policy
        self._fair = FairShare(policy.fair_share_half_life_s)
        self._window = UsageWindow()
        self.held_by_user: dict[str, int] = defaultdict(int)  # milli-GPUs held now
        self._held_user_t: dict[str, float] = defaultdict(float)  # Σ milli · granted_at of active leases
        self.held_by_group: dict[str, int] = defaultdict(int)
        self.active_by_user: dict[str, set[str]] = defaultdict(set)
        self.active_by_tier: dict[str, dict[str, None]] = defaultdict(dict)  # in grant order: newest last

    # ----------------------------------------------------------------- holding
    def hold(self, lease: Lease) -> None:
        """Book-keeping when a lease starts holding its placement (grant or restore)."""
        m = lease.placement.gpu_milli
        self.held_by_user[lease.user] += m
        self._held_user_t[lease.user] += m * lease.granted_at
        for g in lease.groups:
            self.held_by_group[g] += m
        self.active_by_user[lease.user].add(lease.id)
        self.active_by_tier[lease.tier][lease.id] = None

    def unhold(self, lease: Lease) -> None:
        m = lease.placement.gpu_milli
        self.held_by_user[lease.user] -= m
        self._held_user_t[lease.user] -= m * lease.granted_at
        for g in lease.groups:
            self.held_by_group[g] -= m
        self.active_by_user[lease.user].discard(lease.id)
        self.active_by_tier[lease.tier].pop(lease.id, None)

    def record_usage(self, user: str, groups: Iterable[str], start: float, end: float, gpu_milli: int) -> None:
        """Count GPU use that ended (here, or in history loaded at start) for fair share and quotas."""
        if end <= start or gpu_milli <= 0:
            return
        self._fair.add(user, (end - start) * gpu_milli / MILLI, end)
        self._window.add("u:" + user, start, end, gpu_milli)
        for g in groups:
            self._window.add("g:" + g, start, end, gpu_milli)

    def usage(self, user: str, now: float) -> float:
        """Decayed past GPU-seconds plus what the user's active leases have used so far (fair share)."""
        # Σ (now - granted_i) · milli_i = now · Σ milli_i - Σ granted_i · milli_i
        return self._fair.value(user, now) + (now * self.held_by_user.get(user, 0) - self._held_user_t.get(user, 0.0)) / MILLI

    def _active_gpu_hours(self, key: str, is_group: bool, now: float, period_s: float, leases: Mapping[str, Lease]) -> float:
        total = 0.0
        for lease in leases.values():
            if lease.state is LeaseState.ACTIVE and ((key in lease.groups) if is_group else (lease.user == key)):
                total += (now - max(lease.granted_at or now, now - period_s)) * lease.gpu_milli / MILLI
        return total / 3600

    # ----------------------------------------------------------------- gates
    def check_hard(self, user: str, groups: tuple[str, ...], milli: int, duration_s: float, now: float, leases: Mapping[str, Lease], field: str = "duration_s") -> None:
        """Refuse a request that no wait would let through: over a concurrent limit or the GPU-hours left."""
        pol = self.policy
        scopes = [("you", user, pol.quota_for_user(user))] + [(f"group {g}", g, pol.group_quotas[g]) for g in groups if g in pol.group_quotas]
        for who, key, q in scopes:
            if q.max_gpus is not None and milli > q.max_gpus * MILLI:
                raise Refused(f"asks for {milli / MILLI:g} GPUs, over the limit of {q.max_gpus:g} concurrent GPUs for {who}", field="gpus")
            if q.gpu_hours is not None:
                wkey = ("g:" if who != "you" else "u:") + key
                used_h = self._window.used_s(wkey, now, q.period_s) / 3600 + self._active_gpu_hours(key, who != "you", now, q.period_s, leases)
                want_h = milli / MILLI * duration_s / 3600
                if used_h + want_h > q.gpu_hours + 1e-9:
                    left = max(0.0, q.gpu_hours - used_h)
                    raise Refused(
                        f"over the GPU-hour quota for {who}: {used_h:.1f} of {q.gpu_hours:g} GPU-hours used in the last {format_duration(q.period_s)}, "
                        f"this asks for {want_h:.1f}; {left:.1f} left — ask for a shorter duration or fewer GPUs",
                        field=field,
                    )

    def holds_back(self, lease: Lease, milli: int) -> str:
        """Why a concurrent-GPU quota holds this lease back now ('' if it doesn't)."""
        pol = self.policy
        q = pol.quota_for_user(lease.user)
        held = self.held_by_user
        if q.max_gpus is not None and held[lease.user] + milli > q.max_gpus * MILLI:
            return f"your quota of {q.max_gpus:g} concurrent GPUs is in use ({held[lease.user] / MILLI:g} held); it starts when you release some"
        for g in lease.groups:
            gq = pol.group_quotas.get(g)
            if gq is not None and gq.max_gpus is not None and self.held_by_group[g] + milli > gq.max_gpus * MILLI:
                return f"the quota of group '{g}' ({gq.max_gpus:g} concurrent GPUs) is in use; it starts when the group's leases end"
        return ""

    def frees_at(self, lease: Lease, milli: int, leases: Mapping[str, Lease], end_of) -> float | None:
        """When enough of the user's (and groups') active leases will have ended for ``lease`` to fit its quotas."""
        pol = self.policy
        when = None
        scopes = [(pol.quota_for_user(lease.user), self.held_by_user[lease.user], lambda x: x.user == lease.user)]
        for g in lease.groups:
            gq = pol.group_quotas.get(g)
            if gq is not None:
                scopes.append((gq, self.held_by_group[g], lambda x, g=g: g in x.groups))
        for q, held_now, mine in scopes:
            if q.max_gpus is None or held_now + milli <= q.max_gpus * MILLI:
                continue
            held = held_now
            ends = sorted((end_of(x.id), x.placement.gpu_milli) for x in leases.values() if x.state is LeaseState.ACTIVE and mine(x))
            for t, m in ends:
                held -= m
                if held + milli <= q.max_gpus * MILLI:
                    when = t if when is None else max(when, t)
                    break
            else:
                return None
        return when

    def check_extension(self, lease: Lease, new_expiry: float, now: float, field: str) -> None:
        """Refuse an extension that would go over the user's GPU-hour quota."""
        q = self.policy.quota_for_user(lease.user)
        if q.gpu_hours is None:
            return
        # past use in the window, this lease's current grant in full, and the extension
        gpus = lease.gpu_milli / MILLI
        used_h = self._window.used_s("u:" + lease.user, now, q.period_s) / 3600 + (lease.expires_at - lease.granted_at) * gpus / 3600
        if used_h + (new_expiry - lease.expires_at) * gpus / 3600 > q.gpu_hours + 1e-9:
            left = max(0.0, q.gpu_hours - used_h)
            raise Refused(
                f"extending would go over your GPU-hour quota ({q.gpu_hours:g} GPU-hours per {format_duration(q.period_s)}); "
                f"{left:.1f} GPU-hours left, enough for {format_duration(left * 3600 / gpus)} more",
                field=field,
            )

    # ----------------------------------------------------------------- views
    def user_usage(self, user: str, groups: Iterable[str], now: float, leases: Mapping[str, Lease]) -> dict[str, Any]:
        """GPUs held, GPU-hours used in the quota period, and what the quota leaves."""
        q = self.policy.quota_for_user(user)
        used_h = self._window.used_s("u:" + user, now, q.period_s) / 3600 + self._active_gpu_hours(user, False, now, q.period_s, leases)
        held = self.held_by_user.get(user, 0) / MILLI
        return {
            "gpus_held": held,
            "gpu_hours_used": round(used_h, 3),
            "period_s": q.period_s,
            "max_gpus": q.max_gpus,
            "gpu_hours": q.gpu_hours,
            "gpus_left": None if q.max_gpus is None else max(0.0, q.max_gpus - held),
            "gpu_hours_left": None if q.gpu_hours is None else round(max(0.0, q.gpu_hours - used_h), 3),
            "fair_share_usage_gpu_hours": round(self.usage(user, now) / 3600, 3),
            "groups": list(groups),
        }
