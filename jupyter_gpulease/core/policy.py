"""Policy: tiers, quotas and scheduling knobs, as plain data built from config."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from .settings import setting, settings_of

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
    """Everything the scheduler needs to know besides the pool and the leases.

    The tiers and quotas are structured settings (see :class:`Tier` and :class:`Quota`); every
    other field is one :class:`~.settings.Setting`, declared here once: its help, unit, default
    and range are what the broker's config options and the simulator's policy files are made of.
    """

    tiers: dict[str, Tier] = field(default_factory=lambda: dict(DEFAULT_TIERS))
    default_user_quota: Quota = field(default_factory=Quota)
    user_quotas: dict[str, Quota] = field(default_factory=dict)
    group_quotas: dict[str, Quota] = field(default_factory=dict)

    default_tier: str = setting("experiment", "Tier of requests that name none. Example: 'experiment'.")
    min_duration_s: float = setting(
        600.0, "Shortest lease anyone may ask for, in seconds; shorter requests are refused with a message naming it. Example: 600.",
        unit="seconds", minimum=0,
    )  # fmt: skip
    fair_share: bool = setting(True, "Order the queue within a tier by recent usage (less used first).")
    fair_share_half_life_s: float = setting(
        7 * DAY, "Half-life of past usage in fair share, in seconds. Example: 604800 (one week).", unit="seconds", above=0, renamed_from=("fair_share_half_life",)
    )
    warn_before_s: float = setting(
        600.0, "Warn a lease's holder this many seconds before it expires; 0: no warning. Example: 600.", unit="seconds", minimum=0, renamed_from=("warn_before",)
    )
    backfill: bool = setting(True, "Let small requests start ahead of a blocked big one when they cannot delay it.")
    reservation_depth: int = setting(
        100, "How many queued leases get a reservation (and an ETA) each scheduling pass; the rest wait without one. Example: 100.", minimum=0
    )
    preemption: bool = setting(True, "Let higher tiers preempt preemptible tiers (after the preempted tier's grace_s).")
    preemption_searches_per_pass: int = setting(
        4, "Waiting leases per scheduling pass that may look for leases to preempt (bounds a pass's cost). Example: 4.", minimum=0
    )
    placement_by_preemptibility: bool = setting(
        True,
        "Keep non-preemptible leases on the nodes that already hold such work, and preemptible ones together elsewhere, "
        "so that preempting a tier can free whole nodes for multi-GPU requests.",
    )
    share_placement: str = setting(
        "best_fit",
        "Where a share of one GPU goes. 'best_fit': the fullest GPU it fits on, so that idle GPUs stay whole. 'fragmentation': "
        "the GPU where it strands the least capacity for the share sizes requested so far (after FGD, USENIX ATC'23). Example: 'fragmentation'.",
        choices=("best_fit", "fragmentation"),
    )
    aging_s: float | None = setting(
        1800.0,
        "Seconds after which a waiting lease is considered before newer leases of every tier (oldest first), so that a stream of "
        "small higher-tier requests cannot starve a large request; 0: never (strict tier order). Example: 1800.",
        unit="seconds", minimum=0, zero_is_off=True, renamed_from=("aging",),
    )  # fmt: skip
    multi_gpu_aging: float = setting(
        1.0,
        "A request for more than one whole GPU ages after aging_s times this (every lease queued before it ages with it, so nothing "
        "passes an older lease of its tier): one GPU frees up often, several on one node only when the scheduler keeps them free. "
        "1: they age like any other lease. Example: 0.5.",
        above=0, maximum=1,
    )  # fmt: skip
    short_grants: bool = setting(
        True,
        "Let a lease of a preemptible tier that finds no room start on GPUs promised to a waiting lease, with its time limit cut to "
        "when that promise begins (at least 10 minutes). False: it waits like any other lease.",
    )
    maintenance_shorten_min_s: float | None = setting(
        None,
        "A lease that would run into a maintenance window of its GPUs may start shortened to end when the window begins, if that "
        "leaves it at least this many seconds; 0: never (it waits for a slot after the window). Example: 1800.",
        unit="seconds", minimum=0, zero_is_off=True, kind=float,
    )  # fmt: skip
    extend_when_contended: bool = setting(
        False,
        "Allow extensions even while other leases wait for the same GPUs. False: an extension is refused while a lease of the same "
        "or a higher tier waits for one of its GPUs, or one of a lower tier that has aged (see aging_s).",
    )
    resume_priority: bool = setting(
        False,
        "A request from a server whose lease was reclaimed as idle (its kernel is coming back to run a cell) goes ahead of the "
        "new requests of its tier.",
    )
    confirm_timeout_s: float | None = setting(
        900.0, "Revoke an active lease whose holder never confirms it (its server never came up) after this many seconds; 0: never. Example: 900.",
        unit="seconds", minimum=0, zero_is_off=True, renamed_from=("confirm_timeout",),
    )  # fmt: skip
    heartbeat_timeout_s: float | None = setting(
        None, "Revoke an active lease whose heartbeats stop for this many seconds; 0: never (for holders that send none). Example: 600.",
        unit="seconds", minimum=0, zero_is_off=True, renamed_from=("heartbeat_timeout",), kind=float,
    )  # fmt: skip

    max_queued_per_user: int | None = setting(
        100,
        "Most requests one user may have waiting in the queue at once; one more is refused (HTTP 429) until one of them starts or "
        "is withdrawn, so that no user can fill the queue (and every scheduling pass) with thousands of requests. 0: no limit. Example: 20.",
        minimum=0, zero_is_off=True, kind=int,
    )  # fmt: skip

    def __post_init__(self):
        for s in SETTINGS:
            object.__setattr__(self, s.name, s.check(getattr(self, s.name)))
        if self.default_tier not in self.tiers:
            raise ValueError(f"default_tier {self.default_tier!r} is not one of the tiers {sorted(self.tiers)}")
        for t in self.tiers.values():
            if min(t.max_duration_s, t.default_duration_s) < self.min_duration_s:
                raise ValueError(
                    f"tier {t.name!r} grants leases of {t.default_duration_s:g} s by default and {t.max_duration_s:g} s at most, "
                    f"under min_duration_s ({self.min_duration_s:g} s): lower min_duration_s or lengthen the tier"
                )

    def settings(self) -> dict[str, Any]:
        """Every declared setting's value, by name."""
        return {s.name: getattr(self, s.name) for s in SETTINGS}

    def tier(self, name: str | None) -> Tier:
        return self.tiers[name or self.default_tier]

    def quota_for_user(self, user: str) -> Quota:
        return self.user_quotas.get(user, self.default_user_quota)


SETTINGS = settings_of(Policy)
