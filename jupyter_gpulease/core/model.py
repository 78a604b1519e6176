"""The domain model: GPUs in the pool, lease requests, leases, placements and errors.

Pure data, no I/O. Times are POSIX seconds (float) passed in by the caller; compute
shares are integer milli-GPUs (1000 = one whole GPU) so that packing never suffers from
float rounding; memory is in MiB.
"""

from __future__ import annotations

import enum
import fnmatch
import functools
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .request import Request

MILLI = 1000  # compute share of one whole GPU


# --------------------------------------------------------------------------- errors
class LeaseError(Exception):
    """Base of the expected failures. ``status`` is the HTTP status the broker answers."""

    status = 400

    def __init__(self, message: str, *, field: str | None = None):
        super().__init__(message)
        self.message = message
        self.field = field

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"error": type(self).__name__, "message": self.message}
        if self.field:
            d["field"] = self.field
        return d


class BadRequest(LeaseError):
    """Malformed request: a field is missing, of the wrong type or out of range."""

    status = 400


class Refused(LeaseError):
    """A well-formed request that can never be granted (no such model, over a hard quota…)."""

    status = 400


class Forbidden(LeaseError):
    """The caller may not act on this lease or use this tier."""

    status = 403


class NotFound(LeaseError):
    """No lease with this id."""

    status = 404


class Conflict(LeaseError):
    """The lease's state forbids the transition (extend an expired lease, …)."""

    status = 409


class TooManyQueued(LeaseError):
    """The user already has as many requests waiting as the policy allows (``max_queued_per_user``)."""

    status = 429


# --------------------------------------------------------------------------- inventory
@dataclass(frozen=True)
class MigInstance:
    """One MIG GPU instance carved out of a physical GPU."""

    uuid: str
    profile: str  # e.g. "1g.10gb", "3g.40gb"
    memory_mib: int
    index: int = 0
    device: str = ""  # its GPU instance's access node (nvidia-capN), where known (device enforcement)
    compute_device: str = ""  # its compute instance's access node (nvidia-capN): CUDA opens both

    def to_dict(self) -> dict[str, Any]:
        d = {"uuid": self.uuid, "profile": self.profile, "memory_mib": self.memory_mib, "index": self.index}
        if self.device:
            d["device"] = self.device
        if self.compute_device:
            d["compute_device"] = self.compute_device
        return d


@dataclass(frozen=True)
class GPU:
    """One physical GPU of the pool.

    A GPU with ``mig`` instances is in MIG mode: only MIG requests can use it, one lease per
    instance. Otherwise it can be leased whole or in shares (compute milli + memory).
    """

    uuid: str
    node: str
    index: int
    model: str
    memory_mib: int
    mig: tuple[MigInstance, ...] = ()
    healthy: bool = True
    device: str = ""  # path of its character device (/dev/nvidiaN), where the backend knows it
    driver_version: str = ""  # its node's NVIDIA driver ("550.54.15"), where the backend knows it
    cuda_version: str = ""  # the highest CUDA version that driver supports ("12.4", nvidia-smi's "CUDA Version")

    @property
    def mig_enabled(self) -> bool:
        return bool(self.mig)

    def to_dict(self) -> dict[str, Any]:
        d = {
            "uuid": self.uuid,
            "node": self.node,
            "index": self.index,
            "model": self.model,
            "memory_mib": self.memory_mib,
            "mig": [m.to_dict() for m in self.mig],
            "healthy": self.healthy,
        }
        if self.device:
            d["device"] = self.device
        if self.driver_version:
            d["driver_version"] = self.driver_version
        if self.cuda_version:
            d["cuda_version"] = self.cuda_version
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GPU:
        return cls(
            uuid=d["uuid"],
            node=d["node"],
            index=int(d["index"]),
            model=d["model"],
            memory_mib=int(d["memory_mib"]),
            mig=tuple(MigInstance(**m) for m in d.get("mig", ())),
            healthy=bool(d.get("healthy", True)),
            device=str(d.get("device") or ""),
            driver_version=str(d.get("driver_version") or ""),
            cuda_version=str(d.get("cuda_version") or ""),
        )


CUDA_VERSION_RE = re.compile(r"^(\d+)\.(\d+)$")  # a CUDA version as nvidia-smi shows it: "12.4"
DRIVER_VERSION_RE = re.compile(r"^\d+\.\d+(\.\d+)?$")  # an NVIDIA driver version: "550.54.15"


def cuda_version_text(v: int) -> str:
    """NVML's CUDA version integer (``nvmlSystemGetCudaDriverVersion``: 1000 × major + 10 × minor)
    as nvidia-smi shows it: 12040 → "12.4", 11020 → "11.2"."""
    v = int(v)
    return f"{v // 1000}.{(v % 1000) // 10}"


def model_matches(model: str, patterns: tuple[str, ...]) -> bool:
    """True when ``model`` matches one of the glob ``patterns`` (case-insensitive); no patterns: any."""
    if not patterns:
        return True
    m = model.lower()
    return any(fnmatch.fnmatchcase(m, p.lower()) for p in patterns)


# --------------------------------------------------------------------------- slice kinds
class SliceKind(str, enum.Enum):
    """What a request asks for; each kind's rules live in :mod:`.slices`."""

    GPU = "gpu"  # whole GPUs, 1..n on one node
    SHARE = "share"  # a share of one GPU: compute milli and memory
    MIG = "mig"  # one MIG instance of a profile


# --------------------------------------------------------------------------- placement
@dataclass(frozen=True)
class Slice:
    """One granted piece of a GPU."""

    gpu_uuid: str
    node: str
    index: int
    model: str
    memory_mib: int  # memory this slice may use
    share_milli: int = MILLI  # compute share
    mig_uuid: str = ""
    mig_profile: str = ""

    @property
    def device_id(self) -> str:
        """What CUDA_VISIBLE_DEVICES should name: the MIG instance's UUID or the GPU's."""
        return self.mig_uuid or self.gpu_uuid

    def to_dict(self) -> dict[str, Any]:
        d = {
            "gpu_uuid": self.gpu_uuid,
            "node": self.node,
            "index": self.index,
            "model": self.model,
            "memory_mib": self.memory_mib,
            "share": self.share_milli / MILLI,
        }
        if self.mig_uuid:
            d["mig_uuid"] = self.mig_uuid
            d["mig_profile"] = self.mig_profile
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Slice:
        return cls(
            gpu_uuid=d["gpu_uuid"],
            node=d["node"],
            index=int(d["index"]),
            model=d["model"],
            memory_mib=int(d["memory_mib"]),
            share_milli=round(float(d.get("share", 1.0)) * MILLI),
            mig_uuid=d.get("mig_uuid", ""),
            mig_profile=d.get("mig_profile", ""),
        )


@dataclass(frozen=True)
class Placement:
    slices: tuple[Slice, ...]

    @property
    def node(self) -> str:
        return self.slices[0].node if self.slices else ""

    @functools.cached_property
    def gpu_milli(self) -> int:
        return sum(s.share_milli for s in self.slices)

    def device_ids(self) -> list[str]:
        return [s.device_id for s in self.slices]

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "slices": [s.to_dict() for s in self.slices]}

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> Placement | None:
        if not d:
            return None
        return cls(tuple(Slice.from_dict(s) for s in d["slices"]))


# --------------------------------------------------------------------------- leases
class LeaseState(str, enum.Enum):
    QUEUED = "queued"
    ACTIVE = "active"
    RELEASED = "released"  # the holder gave it back
    EXPIRED = "expired"  # its time ran out
    RECLAIMED = "reclaimed"  # taken back because it sat idle
    PREEMPTED = "preempted"  # taken back for a higher tier
    REVOKED = "revoked"  # ended by an admin, or by the broker (never confirmed, heartbeats stopped)
    WITHDRAWN = "withdrawn"  # cancelled while queued (by the requester, or its wait limit ran out)
    FAILED = "failed"  # could not be honoured (e.g. its GPUs left the pool)

    @property
    def terminal(self) -> bool:
        return self not in (LeaseState.QUEUED, LeaseState.ACTIVE)


TERMINAL_STATES = frozenset(s for s in LeaseState if s.terminal)


@dataclass
class Lease:
    """A lease and everything the scheduler needs to decide about it.

    Mutable: the scheduler (through the broker or the simulator) moves it between states.
    """

    id: str
    user: str
    request: Request
    tier: str
    duration_s: float  # asked-for length of the grant
    created_at: float
    server: str = ""  # JupyterHub server name ("" = the default server)
    groups: tuple[str, ...] = ()
    max_wait_s: float | None = None  # withdraw if still queued after this long
    prefer_gpus: tuple[str, ...] = ()  # GPU/MIG UUIDs tried first (a resume goes back to its GPU)
    require_gpus: tuple[str, ...] = ()  # only these GPU/MIG UUIDs
    resuming: bool = False  # brings back the GPU its server lost to an idle reclaim (see Policy.resume_priority)
    seq: int = 0  # arrival order, ties broken by it
    state: LeaseState = LeaseState.QUEUED
    granted_at: float | None = None
    expires_at: float | None = None
    ended_at: float | None = None
    end_reason: str = ""
    placement: Placement | None = None
    warned_at: float | None = None  # expiry warning sent
    preempt_at: float | None = None  # preemption decided: ends at this time (grace)
    preempted_for: str = ""  # id of the lease the preemption makes room for
    confirmed_at: float | None = None
    last_heartbeat: float | None = None
    usage: dict[str, Any] = field(default_factory=dict)  # last usage sample from the holder
    meta: dict[str, Any] = field(default_factory=dict)  # free-form (spawner info, labels)

    @property
    def gpu_milli(self) -> int:
        """Milli-GPUs this lease holds (placement) or asks for (request)."""
        if self.placement is not None:
            return self.placement.gpu_milli
        return self.request.gpu_milli

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "user": self.user,
            "server": self.server,
            "groups": list(self.groups),
            "request": self.request.to_dict(),
            "tier": self.tier,
            "duration_s": self.duration_s,
            "max_wait_s": self.max_wait_s,
            "prefer_gpus": list(self.prefer_gpus),
            "require_gpus": list(self.require_gpus),
            "resuming": self.resuming,
            "seq": self.seq,
            "state": self.state.value,
            "created_at": self.created_at,
            "granted_at": self.granted_at,
            "expires_at": self.expires_at,
            "ended_at": self.ended_at,
            "end_reason": self.end_reason,
            "placement": self.placement.to_dict() if self.placement else None,
            "warned_at": self.warned_at,
            "preempt_at": self.preempt_at,
            "preempted_for": self.preempted_for,
            "confirmed_at": self.confirmed_at,
            "last_heartbeat": self.last_heartbeat,
            "usage": self.usage,
            "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Lease:
        """Inverse of :meth:`to_dict`: what the store wrote back into a live lease."""
        from .request import Request  # request.py builds on this module

        return cls(
            id=d["id"],
            user=d["user"],
            request=Request.from_dict(d["request"]),
            tier=d["tier"],
            duration_s=float(d["duration_s"]),
            created_at=float(d["created_at"]),
            server=d.get("server", ""),
            groups=tuple(d.get("groups") or ()),
            max_wait_s=d.get("max_wait_s"),
            prefer_gpus=tuple(d.get("prefer_gpus") or ()),
            require_gpus=tuple(d.get("require_gpus") or ()),
            resuming=bool(d.get("resuming", False)),
            seq=int(d.get("seq") or 0),
            state=LeaseState(d["state"]),
            granted_at=d.get("granted_at"),
            expires_at=d.get("expires_at"),
            ended_at=d.get("ended_at"),
            end_reason=d.get("end_reason") or "",
            placement=Placement.from_dict(d.get("placement")),
            warned_at=d.get("warned_at"),
            preempt_at=d.get("preempt_at"),
            preempted_for=d.get("preempted_for") or "",
            confirmed_at=d.get("confirmed_at"),
            last_heartbeat=d.get("last_heartbeat"),
            usage=dict(d.get("usage") or {}),
            meta=dict(d.get("meta") or {}),
        )
