"""Policy: tiers, quotas and scheduling knobs, as plain data built from config."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

HOUR = 3600.0
DAY = 24 * HOUR


@dataclass(frozen=True)
class Tier:
    """A priority class of leases (e.g. production > experiment > learning)."""

    name: str
    priority: int = 0  # higher is served first
    max_duration_s: float = 8 * HOUR  # longest grant, and longest step of an extension (from now)
    default_duration_s: float = 2 * HOUR
    max_lifetime_s: float | None = None  # cap on expires_at - granted_at, extensions included
    users: tuple[str, ...] = ()  # who may use it; users and groups both empty: everyone
    groups: tuple[str, ...] = ()
    preemptible: bool = False  # may its leases be preempted at all?
    preempted_by: tuple[str, ...] = ()  # tiers that may preempt it; empty: any tier of higher priority
    grace_s: float = 10 * 60  # warning time between the preemption decision and the end
    description: str = ""

    def allows(self, user: str, groups: tuple[str, ...] | list[str] = ()) -> bool:
        if not self.users and not self.groups:
            return True
        return user in self.users or any(g in self.groups for g in groups)

    def can_be_preempted_by(self, other: Tier) -> bool:
        if not self.preemptible or other.name == self.name:
            return False
        if self.preempted_by:
            return other.name in self.preempted_by
        return other.priority > self.priority

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "priority": self.priority,
            "max_duration_s": self.max_duration_s,
            "default_duration_s": self.default_duration_s,
            "max_lifetime_s": self.max_lifetime_s,
            "preemptible": self.preemptible,
            "preempted_by": list(self.preempted_by),
            "grace_s": self.grace_s,
            "description": self.description,
        }

    @classmethod
    def from_dict(cls, name: str, d: dict[str, Any]) -> Tier:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"tier {name!r}: unknown setting(s) {sorted(unknown)}; known: {sorted(known - {'name'})}")
        kw = dict(d)
        for k in ("users", "groups", "preempted_by"):
            if k in kw:
                kw[k] = tuple(kw[k])
        t = cls(name=name, **{k: v for k, v in kw.items() if k != "name"})
        if t.default_duration_s > t.max_duration_s:
            raise ValueError(f"tier {name!r}: default_duration_s ({t.default_duration_s:g}) exceeds max_duration_s ({t.max_duration_s:g})")
        return t


@dataclass(frozen=True)
class Quota:
    """Limits for one user or one group. ``None`` means no limit."""

    max_gpus: float | None = None  # concurrent GPUs held (shares count by fraction)
    gpu_hours: float | None = None  # GPU-hours per rolling period
    period_s: float = 7 * DAY

    def to_dict(self) -> dict[str, Any]:
        return {"max_gpus": self.max_gpus, "gpu_hours": self.gpu_hours, "period_s": self.period_s}

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> Quota:
        if not d:
            return cls()
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"quota: unknown setting(s) {sorted(unknown)}; known: {sorted(known)}")
        return cls(**d)


DEFAULT_TIERS = {
    "production": Tier("production", priority=30, max_duration_s=24 * HOUR, default_duration_s=8 * HOUR, description="deadline work; preempts learning"),
    "experiment": Tier("experiment", priority=20, max_duration_s=8 * HOUR, default_duration_s=2 * HOUR, description="day-to-day research"),
    "learning": Tier(
        "learning", priority=10, max_duration_s=4 * HOUR, default_duration_s=1 * HOUR, preemptible=True, grace_s=10 * 60, description="courses and tinkering; may be preempted"
    ),
}


@dataclass(frozen=True)
class Policy:
    """Everything the scheduler needs to know besides the pool and the leases."""

    tiers: dict[str, Tier] = field(default_factory=lambda: dict(DEFAULT_TIERS))
    default_tier: str = "experiment"
    default_user_quota: Quota = field(default_factory=Quota)
    user_quotas: dict[str, Quota] = field(default_factory=dict)
    group_quotas: dict[str, Quota] = field(default_factory=dict)
    fair_share: bool = True
    fair_share_half_life_s: float = 7 * DAY
    warn_before_s: float = 10 * 60  # expiry warning ahead of expires_at
    backfill: bool = True
    reservation_depth: int = 100  # queued leases that get a reservation (and an ETA) each pass
    preemption: bool = True
    preemption_searches_per_pass: int = 4  # waiting leases per pass that look for victims (bounds a pass's cost)
    # preemption-aware placement: non-preemptible leases are packed onto nodes that already
    # hold non-preemptible work, preemptible ones onto other nodes, so that preemption can free
    # whole nodes for multi-GPU requests (False: plain best fit, blind to tiers)
    placement_by_preemptibility: bool = True
    # where a share goes among the GPUs that fit (within the preemption-aware node rank):
    # "best_fit": the fullest partly used GPU, so that idle GPUs stay whole;
    # "fragmentation": the GPU whose fragmentation grows least, fragmentation of a GPU being
    # the free compute that a request drawn from the sizes submitted so far could not use
    # there (FGD, USENIX ATC'23); best fit breaks ties
    share_placement: str = "best_fit"
    # aging: a queued lease that has waited this long (seconds) is considered before every
    # tier's newer leases, oldest first, so its reservation holds against higher tiers too and
    # a large request cannot be passed forever by a stream of small higher-tier ones
    # (None: off, strict tier order)
    aging_s: float | None = 30 * 60
    # a request for more than one whole GPU ages after aging_s x this: k GPUs of one node are free
    # together only when the scheduler keeps them free, so large requests need that guard sooner
    # (1: they age like any other lease; the batch-pod replay uses 0.5, the notebook replay is a
    # little worse with it: more sessions cut at their step's end)
    multi_gpu_aging: float = 1.0
    # a lease of a preemptible tier that finds no room may start on slices promised to a waiting
    # lease, with its time limit cut to when that promise begins (at least 10 min)
    short_grants: bool = True
    extend_when_contended: bool = False  # allow extension even when someone waits for these GPUs
    confirm_timeout_s: float | None = 15 * 60  # an active lease never confirmed is revoked after this
    heartbeat_timeout_s: float | None = None  # an active lease whose heartbeats stop is revoked after this

    def __post_init__(self):
        if not 0 < self.multi_gpu_aging <= 1:
            raise ValueError(f"multi_gpu_aging must be in (0, 1], got {self.multi_gpu_aging!r}")
        if self.share_placement not in ("best_fit", "fragmentation"):
            raise ValueError(f"share_placement must be 'best_fit' or 'fragmentation', got {self.share_placement!r}")
        if self.default_tier not in self.tiers:
            raise ValueError(f"default_tier {self.default_tier!r} is not one of the tiers {sorted(self.tiers)}")

    def tier(self, name: str | None) -> Tier:
        return self.tiers[name or self.default_tier]

    def quota_for_user(self, user: str) -> Quota:
        return self.user_quotas.get(user, self.default_user_quota)
