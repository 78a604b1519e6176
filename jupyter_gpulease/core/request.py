"""What a lease asks for: the slice (:class:`Request`) and the whole ask (:class:`Ask`).

Untrusted input (a REST body, spawn options, a CLI line) is checked here once, into frozen
objects that every layer passes on whole: the broker's handler parses an :class:`Ask` with
:func:`parse_ask`, the manager and the scheduler take it as it is, the simulator builds one
per job. What depends on the policy or the pool (tiers, time limits, quotas, whether any GPU
can hold the slice) is checked by :meth:`Scheduler.check_ask`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .model import BadRequest, SliceKind
from .slices import KINDS, slice_type
from .text import parse_duration

MAX_NAME_LEN = 255  # user and server names: JupyterHub's limit
MAX_DEVICES = 64  # GPU UUIDs in prefer_gpus / require_gpus

REQUEST_FIELDS = frozenset(("kind", "gpus", "share", "memory_mib", "mig_profile", "mig", "model", "models", "min_memory_mib"))
# meta["spawner"] of a lease bound to a hub server: the lease spawner's own and those its server takes
# itself; the hub ends them with the server, the broker's check with the hub ends them when it is gone
SPAWNER_META = "jupyter-gpulease"
ASK_FIELDS = REQUEST_FIELDS | {"tier", "duration_s", "duration_h", "max_wait_s", "max_wait_min", "server", "meta", "prefer_gpus", "require_gpus"}

_NUMBER = re.compile(r"-?[0-9]+(?:\.[0-9]+)?")  # ASCII digits only: no '²', no '--5', no '+1'


def _shown(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 40 else r[:40] + "…"


def parse_number(
    value: Any,
    name: str,
    *,
    integer: bool = False,
    minimum: float | None = None,
    maximum: float | None = None,
    above: float | None = None,
    unit: str = "",
) -> int | float:
    """A number from JSON or a form: an int or float (not a bool, NaN or infinite) or a string of
    ASCII digits with an optional minus and decimal point. ``integer``: a whole number (int).
    ``minimum``/``maximum`` bound it inclusively, ``above`` exclusively. Raises
    :class:`BadRequest` naming ``name``; ``unit`` ('seconds', 'hours') goes into the message.
    """
    what = ("a whole number" if integer else "a number") + (f" of {unit}" if unit else "")
    v: int | float
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise BadRequest(f"'{name}' must be {what}, got {_shown(value)}", field=name)
    if isinstance(value, str):
        text = value.strip()
        if not _NUMBER.fullmatch(text):
            raise BadRequest(f"'{name}' must be {what}, got {_shown(value)}", field=name)
        v = float(text) if "." in text else int(text)
    else:
        v = value
    try:
        finite = math.isfinite(v)
    except OverflowError:  # an integer too large for a float
        raise BadRequest(f"'{name}' is far out of range", field=name) from None
    if not finite:
        raise BadRequest(f"'{name}' must be {what}, got {_shown(value)}", field=name)
    if integer:
        if isinstance(v, float):
            if not v.is_integer():
                raise BadRequest(f"'{name}' must be {what}, got {_shown(value)}", field=name)
            v = int(v)
    else:
        v = float(v)
    low = f" {unit}" if unit else ""
    if minimum is not None and maximum is not None and not minimum <= v <= maximum:
        span = f"{minimum:g}" if minimum == maximum else f"from {minimum:g} to {maximum:g}"
        raise BadRequest(f"'{name}' must be {span}{low}, got {v:g}", field=name)
    if minimum is not None and v < minimum:
        raise BadRequest(f"'{name}' must be at least {minimum:g}{low}, got {v:g}", field=name)
    if maximum is not None and v > maximum:
        raise BadRequest(f"'{name}' must be at most {maximum:g}{low}, got {v:g}", field=name)
    if above is not None and v <= above:
        raise BadRequest(f"'{name}' must be more than {above:g}{low}, got {v:g}", field=name)
    return v


# --------------------------------------------------------------------------- the slice
@dataclass(frozen=True)
class Request:
    """The slice a lease asks for. Build with :func:`parse_request` from untrusted input."""

    kind: SliceKind = SliceKind.GPU
    gpus: int = 1  # whole GPUs (kind GPU)
    share_milli: int = 0  # compute share (kind SHARE), 1..999
    memory_mib: int = 0  # memory cap (kind SHARE); also derived from share_milli when 0
    mig_profile: str = ""  # kind MIG
    models: tuple[str, ...] = ()  # glob patterns; empty: any model
    min_memory_mib: int = 0  # minimum total memory of the GPU

    @property
    def gpu_milli(self) -> int:
        """GPUs this request counts as, in milli-GPUs (for quotas and fair share; MIG: per placement)."""
        return slice_type(self).asked_milli(self)

    @property
    def gpus_asked(self) -> int:
        """Whole GPUs that must be free together (1 unless it asks for several whole GPUs)."""
        return slice_type(self).gpus_asked(self)

    def shape(self) -> tuple:
        """A hashable key: two requests with the same shape fit in exactly the same places."""
        return (self.kind, self.gpus, self.share_milli, self.memory_mib, self.mig_profile, self.models, self.min_memory_mib)

    def describe(self) -> str:
        """Human words: '1 × GPU (A100*)', 'a 0.25 share of one GPU, 20480 MiB', 'MIG 1g.10gb'."""
        return slice_type(self).describe(self)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"kind": self.kind.value, **slice_type(self).to_dict(self)}
        if self.models:
            d["model"] = list(self.models)
        if self.min_memory_mib:
            d["min_memory_mib"] = self.min_memory_mib
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Request:
        """Inverse of :meth:`to_dict` (trusted input: what we wrote; untrusted input goes through parse_request)."""
        common = {"models": tuple(d.get("model") or ()), "min_memory_mib": int(d.get("min_memory_mib") or 0)}
        return KINDS[SliceKind(d.get("kind", "gpu"))].from_dict(d, common)


def _models(d: dict[str, Any]) -> tuple[str, ...]:
    raw = d.get("model", d.get("models"))
    if raw is None or raw == "" or raw == []:
        return ()
    if isinstance(raw, str):
        return tuple(p.strip() for p in raw.split("|") if p.strip())
    if isinstance(raw, list) and all(isinstance(p, str) and p.strip() for p in raw):
        return tuple(p.strip() for p in raw)
    raise BadRequest("'model' must be a model name, a glob like 'A100*', or a list of them", field="model")


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
    common = {"models": _models(d), "min_memory_mib": _optional(d, "min_memory_mib", integer=True, minimum=0) or 0}
    kind = d.get("kind")
    if kind is not None and kind not in ("gpu", "share", "mig"):
        raise BadRequest(f"'kind' must be 'gpu', 'share' or 'mig' ('cpu' where a server may run without a GPU), got {_shown(kind)}", field="kind")
    fields = {
        "gpus": d.get("gpus"),
        "mig_profile": d.get("mig_profile") or d.get("mig"),
        "share": _optional(d, "share"),
        "memory_mib": _optional(d, "memory_mib", integer=True, minimum=1),
    }
    if kind == "mig" or (kind is None and fields["mig_profile"]):
        return KINDS[SliceKind.MIG].parse(fields, common)
    if kind == "share" or (kind is None and (fields["share"] is not None or (fields["memory_mib"] is not None and "gpus" not in d))):
        return KINDS[SliceKind.SHARE].parse(fields, common)
    return KINDS[SliceKind.GPU].parse(fields, common)


def _optional(d: dict[str, Any], name: str, **kw) -> int | float | None:
    v = d.get(name)
    return None if v is None else parse_number(v, name, **kw)


# --------------------------------------------------------------------------- the ask
@dataclass(frozen=True)
class Ask:
    """One request for a lease, checked: who asks, for which slice, in which tier, for how
    long, how long they will wait, and for which server. Frozen: built once, passed whole.

    ``tier`` and ``duration_s`` None mean the policy's default tier and the tier's default
    length. ``prefer_gpus``: GPU or MIG UUIDs tried first (a kernel coming back to the GPU it
    had); ``require_gpus``: only those. ``duration_field`` is the option the duration came from
    (``duration_h`` in a form), so that errors name what the person typed.
    """

    user: str
    request: Request = field(default_factory=Request)
    tier: str | None = None
    duration_s: float | None = None
    groups: tuple[str, ...] = ()
    max_wait_s: float | None = None
    server: str = ""
    meta: Mapping[str, Any] = field(default_factory=dict, hash=False)
    prefer_gpus: tuple[str, ...] = ()
    require_gpus: tuple[str, ...] = ()
    duration_field: str = field(default="duration_s", compare=False)

    def __post_init__(self):
        if not isinstance(self.user, str) or not self.user.strip() or len(self.user) > MAX_NAME_LEN:
            raise BadRequest(f"'user' must be a user name (1 to {MAX_NAME_LEN} characters)", field="user")
        if not isinstance(self.request, Request):
            raise BadRequest("'request' must be a Request (build it with parse_request)", field="request")
        if self.tier is not None and (not isinstance(self.tier, str) or not self.tier):
            raise BadRequest(f"'tier' must be a tier name, got {_shown(self.tier)}", field="tier")
        if self.duration_s is not None:
            object.__setattr__(self, "duration_s", parse_number(self.duration_s, self.duration_field, above=0, unit="seconds"))
        if self.max_wait_s is not None:
            object.__setattr__(self, "max_wait_s", parse_number(self.max_wait_s, "max_wait_s", minimum=0, unit="seconds"))
        if not isinstance(self.server, str) or len(self.server) > MAX_NAME_LEN:
            raise BadRequest(f"'server' must be a server name of at most {MAX_NAME_LEN} characters (\"\" for the default server)", field="server")
        if not isinstance(self.meta, Mapping) or not all(isinstance(k, str) for k in self.meta):
            raise BadRequest("'meta' must be a JSON object", field="meta")
        object.__setattr__(self, "groups", _names(self.groups, "groups"))
        object.__setattr__(self, "prefer_gpus", _names(self.prefer_gpus, "prefer_gpus", MAX_DEVICES))
        object.__setattr__(self, "require_gpus", _names(self.require_gpus, "require_gpus", MAX_DEVICES))

    def to_body(self, *, with_user: bool = False) -> dict[str, Any]:
        """The JSON of ``POST api/leases`` that :func:`parse_ask` reads back into this ask."""
        body: dict[str, Any] = self.request.to_dict()
        if self.request.kind is SliceKind.SHARE and not self.request.memory_mib:
            body.pop("memory_mib")  # 0: sized by the share
        for k in ("tier", "duration_s", "max_wait_s"):
            if getattr(self, k) is not None:
                body[k] = getattr(self, k)
        if self.server:
            body["server"] = self.server
        if self.meta:
            body["meta"] = dict(self.meta)
        for k in ("prefer_gpus", "require_gpus"):
            if getattr(self, k):
                body[k] = list(getattr(self, k))
        if with_user:
            body["user"] = self.user
            body["groups"] = list(self.groups)
        return body


def _names(value: Iterable[str], name: str, limit: int | None = None) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise BadRequest(f"'{name}' must be a list of names", field=name)
    out = tuple(value)
    if not all(isinstance(x, str) and x.strip() for x in out):
        raise BadRequest(f"'{name}' must be a list of non-empty strings", field=name)
    if limit is not None and len(out) > limit:
        raise BadRequest(f"'{name}' may name at most {limit} devices, got {len(out)}", field=name)
    return out


def _duration(body: dict[str, Any], names: tuple[tuple[str, float, str], ...], *, minimum: float | None, above: float | None) -> tuple[float | None, str]:
    """A duration given once, in whichever of ``names`` (field, seconds per unit, unit name) is set."""
    got: list[tuple[str, float]] = []
    for name, unit, unit_name in names:
        v = body.get(name)
        if v is None or v == "":
            continue
        if isinstance(v, str) and not _NUMBER.fullmatch(v.strip()):
            try:
                seconds = parse_duration(v, unit=unit)
            except ValueError:
                raise BadRequest(f"'{name}' must be a number of {unit_name} or a duration like 90m, 2h, 1h30m, got {_shown(v)}", field=name) from None
        else:
            seconds = parse_number(v, name, unit=unit_name) * unit
        if (minimum is not None and seconds < minimum) or (above is not None and seconds <= above):
            limit = "more than 0" if above is not None else f"at least {minimum:g}"
            raise BadRequest(f"'{name}' must be {limit} {unit_name}, got {_shown(v)}", field=name)
        got.append((name, seconds))
    if len(got) > 1 and abs(got[0][1] - got[1][1]) > 1:
        raise BadRequest(f"give the duration once: '{got[0][0]}' or '{got[1][0]}', not both", field=got[1][0])
    return (got[0][1], got[0][0]) if got else (None, names[0][0])


def parse_ask(body: Any, *, user: str, groups: Iterable[str] = (), also: Iterable[str] = ()) -> Ask:
    """Check an untrusted JSON body (``POST api/leases``, a spawn's options) into an :class:`Ask` for ``user``.

    Fields: the slice (see :func:`parse_request`), ``tier``, ``duration_s`` (seconds, or a
    duration such as ``"2h"``) or ``duration_h`` (hours), ``max_wait_s`` or ``max_wait_min``,
    ``server``, ``meta`` (an object kept with the lease), ``prefer_gpus`` and ``require_gpus``
    (lists of GPU or MIG UUIDs). ``also``: more field names the caller handles itself (such as
    ``user``); any other field is refused, naming the ones allowed.
    """
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object", field="body")
    allowed = ASK_FIELDS | set(also)
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise BadRequest(f"unknown field(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(sorted(allowed))}", field=unknown[0])
    request = parse_request({k: v for k, v in body.items() if k in REQUEST_FIELDS})
    tier = body.get("tier")
    if tier is not None and (not isinstance(tier, str) or not tier.strip()):
        raise BadRequest(f"'tier' must be a tier name, got {_shown(tier)}", field="tier")
    duration, duration_field = _duration(body, (("duration_s", 1.0, "seconds"), ("duration_h", 3600.0, "hours")), minimum=None, above=0)
    max_wait, _ = _duration(body, (("max_wait_s", 1.0, "seconds"), ("max_wait_min", 60.0, "minutes")), minimum=0, above=None)
    server = "" if body.get("server") is None else body["server"]
    meta = {} if body.get("meta") is None else body["meta"]
    if not isinstance(meta, dict):
        raise BadRequest("'meta' must be a JSON object", field="meta")
    return Ask(
        user=user,
        request=request,
        tier=tier.strip() if tier else None,
        duration_s=duration,
        groups=tuple(groups),
        max_wait_s=max_wait,
        server=server,
        meta=meta,
        prefer_gpus=() if body.get("prefer_gpus") is None else body["prefer_gpus"],
        require_gpus=() if body.get("require_gpus") is None else body["require_gpus"],
        duration_field=duration_field,
    )


__all__ = ["ASK_FIELDS", "REQUEST_FIELDS", "Ask", "Request", "parse_ask", "parse_number", "parse_request"]
