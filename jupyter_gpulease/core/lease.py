"""One lease, as every part that shows it sees it: :class:`LeaseView`, the kinds, the environment, the actions.

Pure (no I/O, no clock, nothing of the project outside ``core``). The broker's lease JSON
(``GET api/leases/<id>``, a heartbeat's answer, a feed event's ``lease``) becomes a frozen
:class:`LeaseView` with :meth:`LeaseView.from_json`; the hub's pages, the spawner, the ``%gpu``
magics, the widget and the server extension's status all read it, and its sentences come from
:mod:`.words` (one module of words).

Kinds, with the values the JSON carries (the labextension's ``src/kinds.ts`` is generated from
them by :mod:`.tsexport`, and a test checks the committed file is current):

* :class:`~.model.LeaseState`: the broker's lease states (re-exported here);
* :class:`KernelState`: a kernel's state in the server extension's status (``kernels[].state``);
* :class:`WarningKind`: a warning's ``kind`` (the status's ``warnings[]``, the feed's
  ``warning`` events, the broker's heartbeat answer);
* :class:`NoticeKind`: a notice's ``kind`` (the status's ``notices[]``, the feed's ``notice``).

The actions a user can take on a lease (:data:`ACTIONS`: extend, keep, resume, release) are one
table: label, the server extension's REST path and body, the kernel API's method, the words for
a failure; :func:`offered_actions` says which are offered for a status, and
:data:`WARNING_ACTIONS` which answer a warning.

What the server extension's status JSON carries for the labextension, so that the TypeScript
side formats only what changes every second (the countdown, an ETA as "~14 min"):

``lease`` / ``last_lease``   :meth:`LeaseView.status_json` of the lease: the lease's keys as the
                             status has always served them, plus
    ``summary``              :func:`.words.summary` (e.g. ``Lease 0123abcd · tier standard``,
                             ``Waiting: position 2 of 5``, an ended lease's end sentence)
    ``queue_words``          :func:`.words.queue_place` (``position 2 of 5``; ``""`` unless queued)
    ``holding``              :func:`.words.holding_short` (``L4 ×2``, ``A100 3g.40gb``; ``""`` without devices)
    ``devices``              the leased device ids (MIG instance or GPU UUIDs)
    ``time_left_s``          seconds left at the status's ``now`` (an active lease with an end)
``actions``                  :func:`offered_actions` for the status, as ``[{"name", "label", "path", "body"}]``
                             (:meth:`Action.to_json`)
``warnings``                 :func:`current_warnings` of the standing warnings
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from .model import TERMINAL_STATES, LeaseState

__all__ = [
    "ACTIONS", "TERMINAL_STATES", "WARNING_ACTIONS", "Action", "KernelState", "LeaseState", "LeaseView", "NoticeKind",
    "QueueView", "SliceView", "WarningKind", "cpu_only_environment", "current_warnings", "lease_devices", "lease_environment", "lease_idle_s",
    "memory_fraction", "mps_environment", "offered_actions",
]  # fmt: skip


class KernelState(StrEnum):
    """A kernel's state in the server extension's status (``kernels[].state``)."""

    OK = "ok"  # running as usual (on its GPU, or without one)
    ACTING = "acting"  # a reclaim action (suspend, restart, shutdown, ...) is under way
    SUSPENDED = "suspended"  # its GPU memory was put aside while idle: its next cell resumes it
    RESUMING = "resuming"  # getting a GPU back and its memory restored
    RECLAIMED = "reclaimed"  # its GPU was taken back (restarted or shut down without a GPU)

    @property
    def put_aside(self) -> bool:
        """Suspended or on its way back: the kernel holds no GPU memory now."""
        return self in (KernelState.SUSPENDED, KernelState.RESUMING)


class WarningKind(StrEnum):
    """A warning's ``kind``: the server's status and feed, and the broker's heartbeat answer."""

    RECLAIM = "reclaim"  # a kernel's GPU sat idle: it will be reclaimed at ``deadline``
    LEASE_RECLAIM = "lease_reclaim"  # no kernel used the GPU: the lease goes back at ``deadline``
    EXPIRING = "expiring"  # the lease reaches its end soon
    PREEMPTION = "preemption"  # the lease is taken for a higher tier (or ended by an admin) at ``deadline``
    SHARE_MEMORY = "share_memory"  # a kernel uses more GPU memory than the lease's share
    UNLEASED_USE = "unleased_use"  # a process of the user uses a GPU the user does not lease
    ENDED = "ended"  # the broker's heartbeat answer: the lease has ended (the server says it as a lease event)
    GPU_UNHEALTHY = "gpu_unhealthy"  # the lease's GPU is cordoned or drained (its health, or an admin): why, and what happens to the lease
    MAINTENANCE = "maintenance"  # a maintenance window on the lease's GPU begins before the lease ends


class NoticeKind(StrEnum):
    """A notice's ``kind``: something the user should know that is not a deadline."""

    ATTRIBUTION = "attribution"  # how GPU processes are told apart on this server
    ENV_STALE = "env_stale"  # running kernels keep the devices they started with
    KEEP = "keep"  # idle reclaim postponed
    BROKER = "broker"  # the broker could not be reached for something
    UNLEASED_USE = "unleased_use"  # a process no longer uses a GPU the user does not lease


# --------------------------------------------------------------------------- the view
def _float(v: Any) -> float | None:
    return None if v is None or v == "" else float(v)


@dataclass(frozen=True)
class SliceView:
    """One leased slice: a whole GPU, a share of one, or a MIG instance."""

    gpu_uuid: str
    model: str = "GPU"
    index: int | None = None
    memory_mib: int = 0
    share: float = 1.0
    mig_uuid: str = ""
    mig_profile: str = ""
    node: str = ""
    gpu_memory_mib: int | None = None  # the whole GPU's memory, where the placement says it
    mps: bool = False  # served by CUDA MPS

    @classmethod
    def from_json(cls, s: Mapping[str, Any]) -> SliceView:
        return cls(gpu_uuid=str(s["gpu_uuid"]), model=str(s.get("model") or "GPU"),
                   index=None if s.get("index") is None else int(s["index"]), memory_mib=int(s.get("memory_mib") or 0),
                   share=float(s.get("share", 1.0) if s.get("share") is not None else 1.0), mig_uuid=str(s.get("mig_uuid") or ""),
                   mig_profile=str(s.get("mig_profile") or ""), node=str(s.get("node") or ""),
                   gpu_memory_mib=None if not s.get("gpu_memory_mib") else int(s["gpu_memory_mib"]), mps=bool(s.get("mps")))

    @property
    def device(self) -> str:
        """What CUDA_VISIBLE_DEVICES names: the MIG instance's UUID, else the GPU's."""
        return self.mig_uuid or self.gpu_uuid

    @property
    def is_mig(self) -> bool:
        return bool(self.mig_uuid)

    @property
    def is_share(self) -> bool:
        return not self.mig_uuid and self.share < 1


@dataclass(frozen=True)
class QueueView:
    """A queued lease's place: the broker's ``queue`` object."""

    position: int | None = None
    length: int | None = None
    eta: float | None = None
    may_start_sooner_at: float | None = None  # the holders it waits for are idle: their lease goes back by then
    waiting_for: str = ""
    gives_up_at: float | None = None
    eta_after_wait_limit: bool | None = None

    @classmethod
    def from_json(cls, q: Mapping[str, Any]) -> QueueView:
        return cls(position=None if q.get("position") is None else int(q["position"]),
                   length=None if q.get("length") is None else int(q["length"]), eta=_float(q.get("eta")),
                   may_start_sooner_at=_float(q.get("may_start_sooner_at")), waiting_for=str(q.get("waiting_for") or ""),
                   gives_up_at=_float(q.get("gives_up_at")),
                   eta_after_wait_limit=None if q.get("eta_after_wait_limit") is None else bool(q["eta_after_wait_limit"]))


@dataclass(frozen=True)
class LeaseView:
    """A lease as the broker's JSON describes it, read once (see the module)."""

    id: str
    state: LeaseState
    tier: str = ""
    slices: tuple[SliceView, ...] = ()
    queue: QueueView | None = None
    expires_at: float | None = None
    granted_at: float | None = None
    created_at: float | None = None
    ended_at: float | None = None
    preempt_at: float | None = None
    duration_s: float | None = None
    end_reason: str = ""
    end_message: str = ""  # the broker's sentence for the end, naming the state itself ('Released from the notebook.')
    ended_by: Mapping[str, Any] | str | None = field(default=None, compare=False, hash=False)
    request: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)
    placement: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)  # as the broker sent it (GPULEASE_PLACEMENT)
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> LeaseView:
        """The view of a broker lease JSON; ``ValueError`` for one with an unknown state.

        A JSON without ``state`` (a lease as the spawner builds it before the broker answers) is
        active when it has a placement, else queued."""
        if not isinstance(d, Mapping):
            raise ValueError(f"not a lease: {d!r:.200}")
        placement = d.get("placement") or {}
        try:
            state = LeaseState(d.get("state") or (LeaseState.ACTIVE if placement.get("slices") else LeaseState.QUEUED))
        except ValueError:
            raise ValueError(f"lease {d.get('id')}: unknown state {d.get('state')!r}") from None
        q = d.get("queue")
        return cls(
            id=str(d.get("id") or ""), state=state, tier=str(d.get("tier") or ""),
            slices=tuple(SliceView.from_json(s) for s in placement.get("slices") or []),
            queue=QueueView.from_json(q) if isinstance(q, Mapping) and q else None,
            expires_at=_float(d.get("expires_at")), granted_at=_float(d.get("granted_at")), created_at=_float(d.get("created_at")),
            ended_at=_float(d.get("ended_at")), preempt_at=_float(d.get("preempt_at")), duration_s=_float(d.get("duration_s")),
            end_reason=str(d.get("end_reason") or ""), end_message=str(d.get("end_message") or ""), ended_by=d.get("ended_by"),
            request=dict(d.get("request") or {}), placement=dict(placement), raw=dict(d),
        )

    @classmethod
    def maybe(cls, d: Mapping[str, Any] | None) -> LeaseView | None:
        """:meth:`from_json`, or None for no lease (None or ``{}``)."""
        return cls.from_json(d) if d else None

    # ------------------------------------------------------------------ facts
    @property
    def short_id(self) -> str:
        """The id as people see it: its first 8 characters (enough to tell leases apart)."""
        return self.id[:8]

    @property
    def active(self) -> bool:
        return self.state is LeaseState.ACTIVE

    @property
    def queued(self) -> bool:
        return self.state is LeaseState.QUEUED

    @property
    def ended(self) -> bool:
        return self.state.terminal

    @property
    def devices(self) -> list[str]:
        """The leased devices as CUDA_VISIBLE_DEVICES names them (MIG instances by their MIG UUID)."""
        return [s.device for s in self.slices]

    def time_left(self, now: float) -> float | None:
        """Seconds until the lease's end (never negative); None without an end."""
        return None if self.expires_at is None else max(0.0, self.expires_at - now)

    # ------------------------------------------------------------------ what others read
    def environment(self, *, broker_url: str = "", gpu_memory_mib: Mapping[str, int] | None = None,
                    cuda_mps: bool = False) -> dict[str, str]:
        """:func:`lease_environment` of this lease."""
        return lease_environment(self, broker_url=broker_url, gpu_memory_mib=gpu_memory_mib, cuda_mps=cuda_mps)

    def status_json(self, now: float) -> dict[str, Any]:
        """The lease as the server extension's status serves it (see the module)."""
        from . import words

        keys = ("id", "state", "tier", "request", "placement", "granted_at", "expires_at", "ended_at", "end_reason", "ended_by",
                "end_message", "preempt_at", "duration_s", "created_at", "queue")
        out = {k: self.raw.get(k) for k in keys if k in self.raw}
        if self.active and self.expires_at:
            out["time_left_s"] = self.time_left(now)
        out["devices"] = self.devices
        out["summary"] = words.summary(self)
        out["queue_words"] = words.queue_place(self) if self.queued else ""
        out["holding"] = words.holding_short(self)
        return out


def lease_devices(lease: Mapping[str, Any] | LeaseView | None) -> list[str]:
    """The device ids a lease JSON (or view) holds; [] for none."""
    if not lease:
        return []
    if isinstance(lease, LeaseView):
        return lease.devices
    return [s.get("mig_uuid") or s["gpu_uuid"] for s in (lease.get("placement") or {}).get("slices") or []]


# --------------------------------------------------------------------------- the environment
def lease_environment(lease: LeaseView | Mapping[str, Any], *, broker_url: str = "", gpu_memory_mib: Mapping[str, int] | None = None,
                      cuda_mps: bool = False) -> dict[str, str]:
    """The environment of a process (a single-user server, a kernel) that uses the active ``lease``.

    ``CUDA_VISIBLE_DEVICES``   the leased devices by UUID (MIG instances by their MIG UUID)
    ``CUDA_DEVICE_ORDER``      ``PCI_BUS_ID``: indices match nvidia-smi's
    ``GPULEASE_LEASE_ID``      the lease's id
    ``GPULEASE_BROKER_URL``    the broker's base URL
    ``GPULEASE_EXPIRES_AT``    POSIX seconds when the lease was due to end at the time (not updated)
    ``GPULEASE_SHARE``         compute share of each slice (1 = whole GPU, 0.5 = half)
    ``GPULEASE_MEMORY_MIB``    memory cap of each slice in MiB (comma-separated, one per device)
    ``GPULEASE_MEMORY_FRACTION`` the same cap as a fraction of each device's memory (``0.5``)
    ``GPULEASE_GPU_UUIDS``     physical GPU UUIDs (for a MIG slice: its parent GPU)
    ``GPULEASE_TIER``          the lease's tier
    ``GPULEASE_PLACEMENT``     the whole placement as JSON

    ``gpu_memory_mib``: each GPU's whole memory by UUID (the pool's devices), for
    ``GPULEASE_MEMORY_FRACTION`` (else the slice's ``gpu_memory_mib``, else its share).
    ``cuda_mps``: the GPUs are served by CUDA MPS, so a share gets its MPS client limits (a slice
    marked ``"mps": true`` in the placement gets them too). ``ValueError`` for a lease without
    devices (queued, ended).
    """
    view = lease if isinstance(lease, LeaseView) else LeaseView.from_json(lease)
    slices = view.slices
    if not slices:
        raise ValueError(f"lease {view.id} has no placement (state {view.state.value!r})")
    gpu_memory_mib = gpu_memory_mib or {}
    env = {
        "CUDA_VISIBLE_DEVICES": ",".join(view.devices),
        # CUDA numbers devices by PCI bus so that indices match nvidia-smi's.
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "GPULEASE_LEASE_ID": view.id,
        "GPULEASE_BROKER_URL": broker_url,
        "GPULEASE_EXPIRES_AT": "" if view.expires_at is None else f"{view.expires_at:.0f}",
        "GPULEASE_SHARE": ",".join(f"{s.share:g}" for s in slices),
        "GPULEASE_MEMORY_MIB": ",".join(str(s.memory_mib) for s in slices),
        "GPULEASE_MEMORY_FRACTION": ",".join(f"{memory_fraction(s, gpu_memory_mib):.4g}" for s in slices),
        "GPULEASE_GPU_UUIDS": ",".join(s.gpu_uuid for s in slices),
        "GPULEASE_TIER": view.tier,
        "GPULEASE_PLACEMENT": json.dumps(view.placement, separators=(",", ":"), sort_keys=True),
    }
    shares = [s for s in slices if s.is_share]
    if shares and (cuda_mps or all(s.mps for s in shares)):
        env.update(mps_environment(slices))
    return env


def memory_fraction(s: SliceView, gpu_memory_mib: Mapping[str, int] | None = None) -> float:
    """The slice's memory cap as a fraction of its device's memory (1 for a whole GPU or a MIG slice)."""
    if not s.is_share:
        return 1.0
    total = (gpu_memory_mib or {}).get(s.gpu_uuid) or s.gpu_memory_mib
    if total:
        return max(0.0, min(1.0, s.memory_mib / int(total)))
    return s.share


def mps_environment(slices: Iterable[SliceView | Mapping[str, Any]]) -> dict[str, str]:
    """CUDA MPS client limits for the server's processes: the compute share as a percentage of
    the SMs (the smallest share when there are several slices: the limit is per process) and
    a pinned memory limit per device, numbered as the server sees them (0, 1, ...)."""
    views = [s if isinstance(s, SliceView) else SliceView.from_json(s) for s in slices]
    pct = min(max(1, round(100 * s.share)) for s in views)
    mem = ",".join(f"{i}={s.memory_mib}M" for i, s in enumerate(views))
    return {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(pct), "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": mem}


def cpu_only_environment(*, broker_url: str = "") -> dict[str, str]:
    """A server without a lease: no GPU visible, and the broker URL so the user can ask for one."""
    return {"CUDA_VISIBLE_DEVICES": "", "GPULEASE_LEASE_ID": "", "GPULEASE_BROKER_URL": broker_url}


# --------------------------------------------------------------------------- warnings
def current_warnings(warnings: Iterable[Mapping[str, Any]], now: float) -> list[dict[str, Any]]:
    """The warnings that still stand, the latest of each kind (per kernel): a warning whose
    deadline passed has come true or gone, and a repeated one replaces the earlier."""
    latest: dict[tuple[str, str], dict[str, Any]] = {}
    for w in warnings:
        if w.get("deadline") is not None and float(w["deadline"]) < now:
            continue
        key = (str(w.get("kind", "")), str(w.get("kernel_id") or ""))
        latest.pop(key, None)
        latest[key] = dict(w)
    return list(latest.values())


def lease_idle_s(d: Mapping[str, Any], now: float) -> float | None:
    """Seconds the GPUs of active lease ``d`` (the broker's lease JSON) have sat idle at ``now``
    (the broker's clock, or one in step with it), from its server's last heartbeat; None before
    any. The server's times are taken relative to its own clock (``usage.t``), so a server whose
    clock is skewed does not shift the answer. The broker's metrics and the idle culler's hook
    both measure idle leases with it."""
    if d.get("state") != LeaseState.ACTIVE.value:
        return None
    usage = d.get("usage")
    beat = _finite(d.get("last_heartbeat"))
    if not isinstance(usage, Mapping) or not usage or beat is None:
        return None
    if usage.get("gpu_busy") is True:
        return 0.0
    t, last = _finite(usage.get("t")), _finite(usage.get("last_gpu_activity"))
    if t is not None and last is not None:
        since = beat - max(0.0, t - last)
    else:
        since = _finite(d.get("granted_at")) or beat
    return max(0.0, now - since)


def _finite(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


# --------------------------------------------------------------------------- actions
EXTEND_S = 1800
KEEP_S = 3600


@dataclass(frozen=True)
class Action:
    """One thing a user can do about the lease, wherever it is offered (panel, notification, widget)."""

    name: str
    label: str  # the button
    path: str  # the server extension's REST API: POST gpulease/api/<path>
    body: Mapping[str, Any] = field(default_factory=dict, hash=False)
    doing: str = ""  # a failure says '<doing> failed: …'
    done: str = ""  # what a success says
    tooltip: str = ""
    label_queued: str = ""  # the label while the lease waits (release: 'Withdraw')

    def label_for(self, lease: LeaseView | None) -> str:
        return self.label_queued if self.label_queued and lease is not None and lease.queued else self.label

    def to_json(self, lease: LeaseView | None = None) -> dict[str, Any]:
        return {"name": self.name, "label": self.label_for(lease), "path": self.path, "body": dict(self.body)}


ACTIONS: dict[str, Action] = {a.name: a for a in (
    Action("extend", "Extend 30 min", "lease/extend", {"by_s": EXTEND_S}, doing="Extending the GPU lease",
           done="GPU lease extended", tooltip="ask the broker for more time"),
    Action("keep", "Keep 1 h", "keep", {"for_s": KEEP_S}, doing="Keeping the idle GPU", done="Idle reclaim postponed",
           tooltip="no idle reclaim for a while"),
    Action("resume", "Resume", "resume", {}, doing="Resuming the kernels", done="Resuming: the kernels get a GPU back",
           tooltip="bring the kernel back onto a GPU"),
    Action("release", "Release", "lease/release", {"reason": "released from JupyterLab", "force": True},
           doing="Releasing the GPU lease", done="GPU lease released", tooltip="give the GPU back now", label_queued="Withdraw"),
)}  # fmt: skip

# which actions answer a warning (a notification's buttons)
WARNING_ACTIONS: dict[WarningKind, tuple[str, ...]] = {
    WarningKind.EXPIRING: ("extend", "release"),
    WarningKind.RECLAIM: ("keep", "release"),
    WarningKind.LEASE_RECLAIM: ("keep", "release"),
    WarningKind.PREEMPTION: ("release",),
}


def offered_actions(lease: LeaseView | None, kernel_states: Iterable[str] = (), last_lease: LeaseView | None = None) -> list[Action]:
    """The actions offered for a server's status: extend and keep while the lease is active; resume
    while a kernel is suspended (or resuming), or when the last lease was reclaimed and none is
    held (resume asks for a GPU again); release (withdraw) while the lease is active or queued."""
    known = {k.value for k in KernelState}
    put_aside = any(KernelState(s).put_aside for s in kernel_states if s in known)
    offered = {
        "extend": lease is not None and lease.active,
        "keep": lease is not None and lease.active,
        "resume": put_aside or (lease is None and last_lease is not None and last_lease.state is LeaseState.RECLAIMED),
        "release": lease is not None and (lease.active or lease.queued),
    }
    return [a for name, a in ACTIONS.items() if offered[name]]
