"""Events: what the scheduler decided, one per lease transition or notice."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# kinds of events
REQUESTED = "requested"  # queued
GRANTED = "granted"  # queued -> active
WARNED = "warned"  # expiry is near (no state change)
PREEMPT_WARNED = "preempt-warned"  # preemption decided; ends after the grace period (no state change)
EXTENDED = "extended"  # expires_at moved (no state change)
CONFIRMED = "confirmed"  # the holder said the server is up (no state change)
PREEMPT_CANCELLED = "preempt-cancelled"  # a decided preemption was called off (no state change)
ENDED = "ended"  # any transition to a terminal state; to_state says which


@dataclass
class Event:
    """One thing that happened to one lease, at ``time``. The audit log is a list of these."""

    lease_id: str
    kind: str
    time: float
    from_state: str = ""
    to_state: str = ""
    reason: str = ""
    actor: str = ""  # who caused it: a user name, "broker", "admin:<name>", …
    data: dict[str, Any] = field(default_factory=dict)
    lease: Any = field(default=None, repr=False, compare=False)  # the Lease after the change (not serialised)

    def to_dict(self) -> dict[str, Any]:
        return {
            "lease_id": self.lease_id,
            "kind": self.kind,
            "time": self.time,
            "from_state": self.from_state,
            "to_state": self.to_state,
            "reason": self.reason,
            "actor": self.actor,
            "data": self.data,
        }


# --------------------------------------------------------------------------- named constructors
# One per kind of event, so that the scheduler says what happened in words, not in eight
# positional arguments. ``lease`` is the lease after the change; its state is the to-state.
def requested(lease, now: float, actor: str) -> Event:
    return Event(lease.id, REQUESTED, now, "", lease.state.value, actor=actor, data={"request": lease.request.to_dict(), "tier": lease.tier}, lease=lease)


def granted(lease, now: float, reason: str, *, short_grant: bool) -> Event:
    data = {"placement": lease.placement.to_dict(), "expires_at": lease.expires_at, "waited_s": now - lease.created_at}
    if short_grant:
        data["short_grant"] = True
    return Event(lease.id, GRANTED, now, "queued", "active", reason, "broker", data, lease=lease)


def warned(lease, now: float, reason: str) -> Event:
    return Event(lease.id, WARNED, now, "active", "active", reason, "broker", {"expires_at": lease.expires_at}, lease=lease)


def preempt_warned(lease, now: float, reason: str, *, for_tier: str) -> Event:
    return Event(lease.id, PREEMPT_WARNED, now, "active", "active", reason, "broker", {"preempt_at": lease.preempt_at, "for_tier": for_tier}, lease=lease)


def revoke_warned(lease, now: float, reason: str, actor: str) -> Event:
    """An admin's revoke with a grace: the same warning as a preemption's (the holder saves its
    work, the server suspends its kernels first), with the admin's words and the end's time."""
    return Event(lease.id, PREEMPT_WARNED, now, "active", "active", reason, actor, {"preempt_at": lease.preempt_at, "revoke": True}, lease=lease)


def preempt_cancelled(lease, now: float, reason: str, actor: str = "broker") -> Event:
    return Event(lease.id, PREEMPT_CANCELLED, now, "active", "active", reason, actor, lease=lease)


def extended(lease, now: float, old: float, actor: str) -> Event:
    return Event(lease.id, EXTENDED, now, lease.state.value, lease.state.value, actor=actor, data={"from": old, "to": lease.expires_at}, lease=lease)


def confirmed(lease, now: float, actor: str) -> Event:
    return Event(lease.id, CONFIRMED, now, lease.state.value, lease.state.value, actor=actor, lease=lease)


def ended(lease, now: float, from_state: str, actor: str) -> Event:
    return Event(lease.id, ENDED, now, from_state, lease.state.value, lease.end_reason, actor, lease=lease)
