"""The domain model: GPUs in the pool, lease requests, leases, placements and errors.

Pure data, no I/O. Times are POSIX seconds (float) passed in by the caller; compute
shares are integer milli-GPUs (1000 = one whole GPU) so that packing never suffers from
float rounding; memory is in MiB.
"""

from __future__ import annotations

import enum
import fnmatch
import functools
from dataclasses import dataclass, field
from typing import Any

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


# --------------------------------------------------------------------------- inventory
@dataclass(frozen=True)
class MigInstance:
    """One MIG GPU instance carved out of a physical GPU."""

    uuid: str
    profile: str  # e.g. "1g.10gb", "3g.40gb"
    memory_mib: int
    index: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"uuid": self.uuid, "profile": self.profile, "memory_mib": self.memory_mib, "index": self.index}


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

    @property
    def mig_enabled(self) -> bool:
        return bool(self.mig)

    def to_dict(self) -> dict[str, Any]:
        return {
            "uuid": self.uuid,
            "node": self.node,
            "index": self.index,
            "model": self.model,
            "memory_mib": self.memory_mib,
            "mig": [m.to_dict() for m in self.mig],
            "healthy": self.healthy,
        }

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
        )


def model_matches(model: str, patterns: tuple[str, ...]) -> bool:
    """True when ``model`` matches one of the glob ``patterns`` (case-insensitive); no patterns: any."""
    if not patterns:
        return True
    m = model.lower()
    return any(fnmatch.fnmatchcase(m, p.lower()) for p in patterns)


# --------------------------------------------------------------------------- requests
class SliceKind(str, enum.Enum):
    GPU = "gpu"  # whole GPUs, 1..n on one node
    SHARE = "share"  # a share of one GPU: compute milli and memory
    MIG = "mig"  # one MIG instance of a profile


@dataclass(frozen=True)
class Request:
    """What a lease asks for. Build with :func:`parse_request` from untrusted input."""

    kind: SliceKind = SliceKind.GPU
    gpus: int = 1  # whole GPUs (kind GPU)
    share_milli: int = 0  # compute share (kind SHARE), 1..999
    memory_mib: int = 0  # memory cap (kind SHARE); also derived from share_milli when 0
    mig_profile: str = ""  # kind MIG
    models: tuple[str, ...] = ()  # glob patterns; empty: any model
    min_memory_mib: int = 0  # minimum total memory of the GPU

    @property
    def gpu_milli(self) -> int:
        """GPUs this request counts as, in milli-GPUs (for quotas and fair share)."""
        if self.kind is SliceKind.GPU:
            return self.gpus * MILLI
        if self.kind is SliceKind.SHARE:
            return self.share_milli
        return 0  # MIG: set per placement from the instance's fraction of its GPU

    def shape(self) -> tuple:
        """A hashable key: two requests with the same shape fit in exactly the same places."""
        return (self.kind, self.gpus, self.share_milli, self.memory_mib, self.mig_profile, self.models, self.min_memory_mib)

    def describe(self) -> str:
        """Human words: '1 × A100*', 'a 0.25 share (20480 MiB) of one GPU', 'MIG 1g.10gb'."""
        where = f" ({'|'.join(self.models)})" if self.models else ""
        if self.kind is SliceKind.GPU:
            return f"{self.gpus} × GPU{where}"
        if self.kind is SliceKind.SHARE:
            mem = f", {self.memory_mib} MiB" if self.memory_mib else ""
            return f"a {self.share_milli / MILLI:g} share of one GPU{mem}{where}"
        return f"MIG {self.mig_profile}{where}"

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"kind": self.kind.value}
        if self.kind is SliceKind.GPU:
            d["gpus"] = self.gpus
        elif self.kind is SliceKind.SHARE:
            d["share"] = self.share_milli / MILLI
            d["memory_mib"] = self.memory_mib
        else:
            d["mig_profile"] = self.mig_profile
        if self.models:
            d["model"] = list(self.models)
        if self.min_memory_mib:
            d["min_memory_mib"] = self.min_memory_mib
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Request:
        """Inverse of :meth:`to_dict` (trusted input: what we wrote; untrusted input goes through parse_request)."""
        kind = SliceKind(d.get("kind", "gpu"))
        models = tuple(d.get("model") or ())
        min_mem = int(d.get("min_memory_mib") or 0)
        if kind is SliceKind.GPU:
            return cls(kind=kind, gpus=int(d.get("gpus", 1)), models=models, min_memory_mib=min_mem)
        if kind is SliceKind.SHARE:
            return cls(kind=kind, share_milli=round(float(d.get("share") or 0) * MILLI), memory_mib=int(d.get("memory_mib") or 0), models=models, min_memory_mib=min_mem)
        return cls(kind=kind, mig_profile=d.get("mig_profile", ""), models=models, min_memory_mib=min_mem)


def _int_field(d: dict, name: str, default: int | None = None, *, minimum: int | None = None, maximum: int | None = None) -> int | None:
    if name not in d or d[name] is None:
        return default
    v = d[name]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not v.is_integer()):
        if isinstance(v, str) and v.strip().lstrip("-").isdigit():
            v = int(v)
        else:
            raise BadRequest(f"'{name}' must be a whole number, got {v!r}", field=name)
    v = int(v)
    if minimum is not None and v < minimum:
        raise BadRequest(f"'{name}' must be at least {minimum}, got {v}", field=name)
    if maximum is not None and v > maximum:
        raise BadRequest(f"'{name}' must be at most {maximum}, got {v}", field=name)
    return v


def _num_field(d: dict, name: str) -> float | None:
    if name not in d or d[name] is None:
        return None
    v = d[name]
    if isinstance(v, str):
        try:
            v = float(v)
        except ValueError:
            raise BadRequest(f"'{name}' must be a number, got {v!r}", field=name) from None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
        raise BadRequest(f"'{name}' must be a number, got {v!r}", field=name)
    try:
        return float(v)
    except OverflowError:
        raise BadRequest(f"'{name}' is far out of range", field=name) from None


def parse_request(d: Any) -> Request:
    """Validate an untrusted JSON request body into a :class:`Request`.

    Accepted shapes::

        {"gpus": 2, "model": "A100*"}
        {"share": 0.25}                 # a quarter of one GPU's compute and memory
        {"share": 0.5, "memory_mib": 20000}
        {"memory_mib": 10240}           # a share sized by memory
        {"mig_profile": "1g.10gb"}

    Raises :class:`BadRequest` naming the field at fault.
    """
    if not isinstance(d, dict):
        raise BadRequest("the request must be a JSON object")
    models_raw = d.get("model", d.get("models"))
    if models_raw is None or models_raw == "" or models_raw == []:
        models: tuple[str, ...] = ()
    elif isinstance(models_raw, str):
        models = tuple(p.strip() for p in models_raw.split("|") if p.strip())
    elif isinstance(models_raw, list) and all(isinstance(p, str) and p.strip() for p in models_raw):
        models = tuple(p.strip() for p in models_raw)
    else:
        raise BadRequest("'model' must be a model name, a glob like 'A100*', or a list of them", field="model")
    min_mem = _int_field(d, "min_memory_mib", 0, minimum=0) or 0

    kind = d.get("kind")
    if kind is not None and kind not in ("gpu", "share", "mig"):
        raise BadRequest(f"'kind' must be 'gpu', 'share' or 'mig', got {kind!r}", field="kind")
    mig = d.get("mig_profile") or d.get("mig")
    share = _num_field(d, "share")
    mem = _int_field(d, "memory_mib", None, minimum=1)
    if kind == "mig" or (kind is None and mig):
        if not isinstance(mig, str) or not mig.strip():
            raise BadRequest("'mig_profile' must name a MIG profile such as '1g.10gb'", field="mig_profile")
        return Request(kind=SliceKind.MIG, mig_profile=mig.strip(), models=models, min_memory_mib=min_mem)
    if kind == "share" or (kind is None and (share is not None or (mem is not None and "gpus" not in d))):
        if share is None and mem is None:
            raise BadRequest("a share needs 'share' (0 < share < 1) or 'memory_mib'", field="share")
        share_milli = 0
        if share is not None:
            if not 0 < share < 1:
                raise BadRequest(f"'share' must be between 0 and 1 (exclusive), got {share:g}; ask for 'gpus' for whole GPUs", field="share")
            share_milli = max(1, round(share * MILLI))
        return Request(kind=SliceKind.SHARE, share_milli=share_milli, memory_mib=mem or 0, models=models, min_memory_mib=min_mem)
    gpus = _int_field(d, "gpus", 1, minimum=1)
    return Request(kind=SliceKind.GPU, gpus=gpus, models=models, min_memory_mib=min_mem)


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
