"""GPU health: what a driver report means for the pool. Pure, no I/O.

The one table of XID error codes (:data:`XID_TABLE`) and the rule that turns what the device
monitor sensed (XIDs, uncorrectable ECC errors, retired pages and row remapping, a lost GPU,
temperature against the card's own slowdown threshold, throttling) into an :class:`Action`:

* ``application`` — the holder's own error (a bad kernel, an illegal address); the GPU is fine
  and nothing is done;
* ``drain_now`` — the GPU is broken until it is reset: it is cordoned at once and its holders
  are moved to a healthy GPU;
* ``drain_when_idle`` — the GPU works, but a repair takes effect only at its next reset (a row
  remap pending): the leases on it run to their end, nothing new is granted there;
* ``watch`` — worth an alert (hot, throttled, an XID this table does not know); the GPU stays
  in the pool.

Sources: NVIDIA's XID catalogue (docs.nvidia.com/deploy/xid-errors) and its GPU memory error
management guide (row remapping, page retirement).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

HEALTH_META = "health"  # lease.meta: what happened to the lease's GPU and why (device, reason, at, action)
MOVED_META = "moved"  # lease.meta of a request from a server whose lease was drained off a sick GPU: it goes first in its tier


class Action(str, enum.Enum):
    """What the broker does about a finding (strongest last)."""

    NONE = "none"
    APPLICATION = "application"  # the holder's error: nothing
    WATCH = "watch"  # an alert, the GPU stays in the pool
    DRAIN_WHEN_IDLE = "drain_when_idle"  # no new grants; the leases on it run to their end
    DRAIN_NOW = "drain_now"  # cordoned now, holders moved to a healthy GPU

    @property
    def rank(self) -> int:
        return _RANK[self]

    @property
    def cordons(self) -> bool:
        """Whether the GPU takes no new grants."""
        return self in (Action.DRAIN_NOW, Action.DRAIN_WHEN_IDLE)


_RANK = {Action.NONE: 0, Action.APPLICATION: 1, Action.WATCH: 2, Action.DRAIN_WHEN_IDLE: 3, Action.DRAIN_NOW: 4}


@dataclass(frozen=True)
class Xid:
    code: int
    action: Action
    meaning: str


#: The XID error codes the broker acts on, the one place they are classed (README shows it).
XID_TABLE: dict[int, Xid] = {
    x.code: x
    for x in (
        Xid(13, Action.APPLICATION, "graphics engine exception (an application's illegal instruction or address)"),
        Xid(31, Action.APPLICATION, "GPU memory page fault (an application's illegal memory access)"),
        Xid(43, Action.APPLICATION, "GPU stopped processing (an application's channel was reset)"),
        Xid(45, Action.APPLICATION, "preemptive cleanup after an earlier error (an application was stopped)"),
        Xid(68, Action.APPLICATION, "video processor exception (an application's decoder work)"),
        Xid(48, Action.DRAIN_NOW, "double-bit ECC error (uncorrectable memory error)"),
        Xid(62, Action.DRAIN_NOW, "internal micro-controller halt"),
        Xid(63, Action.DRAIN_WHEN_IDLE, "ECC page retirement or row remapping recorded (takes effect at the next reset)"),
        Xid(64, Action.DRAIN_NOW, "ECC page retirement or row remapping failed"),
        Xid(74, Action.DRAIN_NOW, "NVLink error"),
        Xid(79, Action.DRAIN_NOW, "GPU has fallen off the bus"),
        Xid(92, Action.DRAIN_WHEN_IDLE, "high single-bit ECC error rate"),
        Xid(94, Action.DRAIN_WHEN_IDLE, "contained ECC error (the application that hit it was stopped; the row is remapped at the next reset)"),
        Xid(95, Action.DRAIN_NOW, "uncontained ECC error (every application on the GPU is affected; needs a reset)"),
        Xid(119, Action.DRAIN_NOW, "GSP RPC timeout (the GPU's system processor stopped answering)"),
        Xid(120, Action.DRAIN_NOW, "GSP error"),
        Xid(140, Action.DRAIN_NOW, "unrecovered ECC error"),
    )
}


def xid_action(code: int) -> Action:
    """The class of an XID code; one this table does not know is watched (an alert, no action)."""
    x = XID_TABLE.get(int(code))
    return x.action if x is not None else Action.WATCH


def xid_words(code: int) -> str:
    x = XID_TABLE.get(int(code))
    return f"XID {code}: {x.meaning}" if x is not None else f"XID {code} (not in the table: watched, no action)"


@dataclass(frozen=True)
class Finding:
    """One thing the monitor sensed on a device, and what it calls for."""

    action: Action
    reason: str  # plain words for the holder and the admin
    code: str = ""  # machine name: "xid:79", "ecc_dbe", "lost", "row_remap_pending", "hot", "throttle:hw_thermal"…

    def to_dict(self) -> dict[str, Any]:
        return {"action": self.action.value, "reason": self.reason, "code": self.code}


def new_xids(before: Mapping[int, int] | None, now: Mapping[int, int]) -> dict[int, int]:
    """XID codes seen since ``before`` (both are counts per code since the monitor started)."""
    before = before or {}
    return {c: n - before.get(c, 0) for c, n in now.items() if n > before.get(c, 0)}


def is_hot(temperature_c: float | None, slowdown_c: float | None) -> bool:
    """Whether a card is at or above its own slowdown threshold (what :func:`assess` watches)."""
    return temperature_c is not None and slowdown_c is not None and temperature_c >= slowdown_c


def assess(health: Mapping[str, Any], *, temperature_c: float | None = None, slowdown_c: float | None = None,
           xids: Mapping[int, int] | None = None, ecc_new: int = 0) -> list[Finding]:
    """What a device's health report calls for, strongest first.

    ``health`` is the monitor's report (``DeviceHealth.to_dict()``: ``lost``,
    ``retired_pages_pending``, ``row_remap_pending``, ``row_remap_failed``, ``throttle``);
    ``xids`` the XID codes new since the last look (code -> count); ``ecc_new`` the
    uncorrectable ECC errors new since the last look; the temperature is compared with the
    card's own slowdown threshold (no fixed figure: cards differ).
    """
    out: list[Finding] = []
    for code, n in sorted((xids or {}).items()):  # first: the driver's own words for what happened
        times = f" ({n} times)" if n > 1 else ""
        out.append(Finding(xid_action(code), xid_words(code) + times, f"xid:{code}"))
    if health.get("lost"):
        out.append(Finding(Action.DRAIN_NOW, "the driver reports the GPU as lost (it needs a reset)", "lost"))
    if ecc_new > 0:
        out.append(Finding(Action.DRAIN_NOW, f"{ecc_new} uncorrectable (double-bit) ECC memory error(s)", "ecc_dbe"))
    if health.get("row_remap_failed"):
        out.append(Finding(Action.DRAIN_NOW, "a memory row remap failed (the GPU needs service)", "row_remap_failed"))
    if health.get("row_remap_pending"):
        out.append(Finding(Action.DRAIN_WHEN_IDLE, "a memory row remap is pending (it takes effect at the next reset)", "row_remap_pending"))
    if health.get("retired_pages_pending"):
        out.append(Finding(Action.DRAIN_WHEN_IDLE, "retired memory pages are pending (they take effect at the next reset)", "retired_pages_pending"))
    if is_hot(temperature_c, slowdown_c):
        out.append(Finding(Action.WATCH, f"{temperature_c:.0f} °C, at or above the card's slowdown threshold of {slowdown_c:.0f} °C", "hot"))
    for reason in health.get("throttle") or ():
        out.append(Finding(Action.WATCH, f"clocks throttled: {THROTTLE_WORDS.get(reason, reason)}", f"throttle:{reason}"))
    out.sort(key=lambda f: -f.action.rank)
    return out


def strongest(findings: Iterable[Finding]) -> Action:
    return max((f.action for f in findings), key=lambda a: a.rank, default=Action.NONE)


#: Throttle reasons that say something is wrong (NVML's clocks event reasons, by name).
THROTTLE_WORDS = {
    "hw_slowdown": "hardware slowdown (power brake or over-temperature)",
    "hw_thermal": "hardware thermal slowdown",
    "hw_power_brake": "hardware power brake",
    "sw_thermal": "software thermal slowdown",
    "sw_power_cap": "software power cap",
}


def xid_table_markdown() -> str:
    """The XID table as README shows it."""
    words = {Action.APPLICATION: "the holder's: nothing", Action.DRAIN_NOW: "drain now", Action.DRAIN_WHEN_IDLE: "drain when idle"}
    rows = ["| XID | meaning | the broker |", "|---|---|---|"]
    for x in sorted(XID_TABLE.values(), key=lambda x: (-x.action.rank if x.action is not Action.APPLICATION else -9, x.code)):
        rows.append(f"| {x.code} | {x.meaning} | {words.get(x.action, x.action.value)} |")
    return "\n".join(rows)


__all__ = ["HEALTH_META", "MOVED_META", "XID_TABLE", "Action", "Finding", "Xid", "assess", "is_hot", "new_xids", "strongest", "xid_action", "xid_table_markdown", "xid_words"]
