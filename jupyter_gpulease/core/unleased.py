"""Unleased GPU use: processes on GPUs (or MIG instances) that their owners do not lease.

Pure: the broker samples the processes, finds their owners and calls :func:`find_unleased`
with the live leases; :class:`UnleasedTracker` remembers since when each finding stands and
says when the admin's grace is over. Nothing here does I/O or reads a clock.

The rule, per process on a device ``D`` of GPU ``G`` (``D == G`` unless ``D`` is a MIG instance):

* its owner is the hub user it works for (the ``JUPYTERHUB_USER`` of its single-user server,
  else its Unix user when the hub knows that name); a process of no hub user (a system job,
  someone on ssh) is always unleased use: nobody can lease a GPU for it;
* it is leased when one of its owner's active leases holds ``D``, or holds ``G`` whole (or a
  share of it), or — for a process the driver places on ``G`` without naming the instance —
  holds a MIG instance of ``G``;
* otherwise it is *unleased use*, whoever else leases the device (the holders are named, so that
  the admin sees whose GPU is used).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .events import Event
from .text import format_duration

# the admin's choices (GPULeaseBroker.unleased_use)
REPORT, WARN, KILL = "report", "warn", "kill"
ACTIONS = (REPORT, WARN, KILL)

# kinds of events (lease_id "": they belong to no lease)
UNLEASED_USE = "unleased-use"  # a process began to use a GPU its owner does not lease
UNLEASED_STOP = "unleased-stop"  # the broker stopped it (or tried to, and says why it could not)
UNLEASED_ENDED = "unleased-ended"  # it no longer uses the GPU unleased (gone, or its owner leases the GPU now)
EVENT_KINDS = (UNLEASED_USE, UNLEASED_STOP, UNLEASED_ENDED)

WARNING_KIND = "unleased_use"  # the warning a user's server shows


@dataclass(frozen=True)
class Owner:
    """Who a process works for. ``name``: its Unix user (or ``uid N`` without a name)."""

    uid: int | None = None
    name: str = ""
    hub_user: str = ""  # "" : not a hub user
    server: str = ""  # the single-user server's name ("" : the default server)
    cgroup: str = ""
    claimed: str = ""  # a JUPYTERHUB_USER the process carries but is not believed (it runs under another uid)

    def words(self) -> str:
        forged = f", claiming to be {self.claimed}'s" if self.claimed and self.claimed != self.hub_user else ""
        if self.hub_user:
            return self.hub_user + forged
        if self.name:
            return f"{self.name} (not a hub user{forged})"
        return "unknown owner (the broker cannot see the process)"


@dataclass(frozen=True)
class GPUProcess:
    """One compute process on one device of the pool, with its owner."""

    pid: int
    device_uuid: str  # the GPU's UUID, or the MIG instance's
    gpu_uuid: str  # the physical GPU
    node: str
    model: str
    index: int
    used_memory_mib: int | None
    owner: Owner
    mig_profile: str = ""
    command: str = ""
    start: str = ""  # the process's start time as the kernel counts it: a reused PID is another process

    @property
    def key(self) -> tuple[str, int, str, str]:
        return (self.node, self.pid, self.start, self.device_uuid)

    def device_words(self) -> str:
        gpu = f"{self.model} #{self.index} on {self.node}"
        return f"MIG {self.mig_profile} of {gpu}" if self.mig_profile else gpu


@dataclass(frozen=True)
class Finding:
    """A process using a device its owner does not lease; ``holders``: who leases that device."""

    process: GPUProcess
    holders: tuple[str, ...] = ()

    @property
    def key(self) -> tuple[str, int, str, str]:
        return self.process.key


def _lease_devices(leases: Iterable[dict[str, Any]]) -> dict[str, tuple[set[str], set[str]]]:
    """user -> (devices held: MIG UUIDs and whole/shared GPU UUIDs; GPUs of which a MIG instance is held)."""
    out: dict[str, tuple[set[str], set[str]]] = {}
    for d in leases:
        if d.get("state") != "active" or not d.get("placement"):
            continue
        held, via_mig = out.setdefault(d["user"], (set(), set()))
        for s in d["placement"].get("slices") or ():
            if s.get("mig_uuid"):
                held.add(s["mig_uuid"])
                via_mig.add(s["gpu_uuid"])
            else:
                held.add(s["gpu_uuid"])
    return out


def is_leased(p: GPUProcess, held: set[str], via_mig: set[str]) -> bool:
    """Whether a lease with these devices covers process ``p`` (see the module doc)."""
    if p.device_uuid in held or p.gpu_uuid in held:
        return True
    return p.device_uuid == p.gpu_uuid and p.gpu_uuid in via_mig


def find_unleased(processes: Iterable[GPUProcess], leases: Iterable[dict[str, Any]]) -> list[Finding]:
    """The processes that use a device their owner does not lease (the rule of the module doc),
    each with the users who lease that device. ``leases``: lease dicts (only active ones count)."""
    by_user = _lease_devices(leases)
    out = []
    for p in processes:
        user = p.owner.hub_user
        if user:
            held, via_mig = by_user.get(user, (set(), set()))
            if is_leased(p, held, via_mig):
                continue
        holders = tuple(sorted(u for u, (h, m) in by_user.items() if u != user and is_leased(p, h, m)))
        out.append(Finding(p, holders))
    return sorted(out, key=lambda f: (f.process.node, f.process.gpu_uuid, f.process.pid))


# --------------------------------------------------------------------------- findings over time
@dataclass
class Standing:
    """A finding that holds, since ``since``; ``stop_at``: when the broker stops it (policy kill)."""

    finding: Finding
    since: float
    stop_at: float | None = None
    stop: dict[str, Any] = field(default_factory=dict)  # how stopping it went: {"outcome", "message", "at"}

    def to_dict(self, now: float) -> dict[str, Any]:
        p = self.finding.process
        d = {
            "pid": p.pid,
            "command": p.command,
            "user": p.owner.hub_user,
            "owner": p.owner.words(),
            "uid": p.owner.uid,
            "unix_user": p.owner.name,
            "server": p.owner.server,
            "cgroup": p.owner.cgroup,
            "claimed_user": p.owner.claimed,
            "hub_user": bool(p.owner.hub_user),
            "device_uuid": p.device_uuid,
            "gpu_uuid": p.gpu_uuid,
            "node": p.node,
            "model": p.model,
            "index": p.index,
            "mig_profile": p.mig_profile,
            "device": p.device_words(),
            "used_memory_mib": p.used_memory_mib,
            "holders": list(self.finding.holders),
            "since": self.since,
            "for_s": max(0.0, now - self.since),
            "stop_at": self.stop_at,
        }
        if self.stop:
            d["stop"] = dict(self.stop)
        return d


@dataclass
class Changes:
    """What one sample changed: findings that began, ended, and those due to be stopped now."""

    new: list[Standing] = field(default_factory=list)
    ended: list[tuple[Standing, str]] = field(default_factory=list)  # (finding, why: "gone" | "leased")
    due: list[Standing] = field(default_factory=list)


class UnleasedTracker:
    """The findings that stand, from sample to sample (pure: every call takes ``now``)."""

    def __init__(self, *, action: str = WARN, grace_s: float = 300.0):
        if action not in ACTIONS:
            raise ValueError(f"unleased-use action must be one of {', '.join(ACTIONS)}, got {action!r}")
        self.action = action
        self.grace_s = max(0.0, float(grace_s))
        self.standing: dict[tuple, Standing] = {}

    def observe(self, now: float, findings: Iterable[Finding], seen: Iterable[tuple] = ()) -> Changes:
        """Take one sample's findings. ``seen``: keys of every process sampled (leased or not): a
        finding that is gone from ``findings`` but whose process still runs on the device ended
        because its owner leases the device now; otherwise the process is gone."""
        seen = set(seen)
        changes = Changes()
        current = {f.key: f for f in findings}
        for key, st in list(self.standing.items()):
            if key not in current:
                if st.stop.get("outcome") == "stopping":
                    continue  # its stop is under way (the process may be ending on SIGTERM): the stop says how it ended
                del self.standing[key]
                changes.ended.append((st, "leased" if key in seen else "gone"))
        for key, f in current.items():
            st = self.standing.get(key)
            if st is None:
                st = Standing(f, now, now + self.grace_s if self.action == KILL and self.may_stop(f) else None)
                self.standing[key] = st
                changes.new.append(st)
            else:
                st.finding = f  # memory and holders move
            if st.stop_at is not None and now >= st.stop_at and not st.stop:
                changes.due.append(st)
        return changes

    @staticmethod
    def may_stop(f: Finding) -> bool:
        """Root's processes (the driver's helpers, system services) are reported, never stopped."""
        return f.process.owner.uid != 0

    def for_user(self, user: str) -> list[Standing]:
        return [st for st in self.standing.values() if st.finding.process.owner.hub_user == user]


# --------------------------------------------------------------------------- words and events
def warning(st: Standing, now: float, action: str, *, names: bool = False) -> dict[str, Any]:
    """The warning the owner's server shows (``kind`` ``unleased_use``); ``names``: say who leases
    the GPU (else "another user", as a preempted holder is told only the tier). What matters comes
    first: a notification shows about 140 characters."""
    p = st.finding.process
    holders = st.finding.holders
    if not holders:
        whose = "a GPU you do not lease"
    elif names:
        whose = f"{', '.join(holders)}'s GPU" if len(holders) == 1 else f"a GPU leased to {', '.join(holders)}"
    else:
        whose = "another user's GPU" if len(holders) == 1 else "a GPU leased to other users"
    what = f"Process {p.pid}" + (f" ({p.command})" if p.command else "")
    mem = f" It holds {p.used_memory_mib} MiB." if p.used_memory_mib is not None else ""
    msg = f"{what} uses {p.device_words()}, {whose}"
    if st.stop and st.stop.get("outcome") == "stopped":
        msg += ": the broker stopped it."
    elif st.stop_at is not None:
        msg += f": it is stopped in {format_duration(max(0.0, st.stop_at - now))} unless it lets go of it.{mem} Ask for a lease of that GPU instead."
    else:
        msg += f".{mem} Stop it, or ask for a lease of that GPU (the admin sees this use)."
    out: dict[str, Any] = {"kind": WARNING_KIND, "at": st.stop_at if st.stop_at is not None else st.since, "message": msg,
                           "pid": p.pid, "device_uuid": p.device_uuid, "since": st.since}
    if st.stop_at is not None:
        out["deadline"] = st.stop_at
    return out


def found_event(st: Standing, now: float, action: str) -> Event:
    d = st.to_dict(now)
    d["action"] = action
    why = f"leased to {', '.join(st.finding.holders)}" if st.finding.holders else "not leased to its owner"
    reason = f"{st.finding.process.owner.words()}: process {st.finding.process.pid} on {st.finding.process.device_words()}, {why}"
    return Event("", UNLEASED_USE, now, reason=reason, actor="broker", data=d)


def stop_event(st: Standing, now: float) -> Event:
    d = st.to_dict(now)
    return Event("", UNLEASED_STOP, now, reason=st.stop.get("message", ""), actor="broker", data=d)


def ended_event(st: Standing, now: float, why: str) -> Event:
    d = st.to_dict(now)
    d["why"] = why
    p = st.finding.process
    words = {"gone": "no longer uses the GPU", "leased": "its owner leases the GPU now", "stopped": "stopped by the broker"}
    return Event("", UNLEASED_ENDED, now, reason=f"process {p.pid} on {p.device_words()}: {words.get(why, why)}", actor="broker", data=d)
