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
