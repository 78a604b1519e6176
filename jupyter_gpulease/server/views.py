"""The JSON the extension shows: pure builders of the status, the samples and the lease (no I/O).

Every function takes what it shows and ``now``; see docs/server-api.md for the fields.
"""

from __future__ import annotations

import datetime
from typing import Any

from ..core import words
from ..core.lease import LeaseView, WarningKind, offered_actions
from .kernels import KernelRecord
from .monitor import Snapshot

STATUS_VERSION = 1
# warnings about the active lease: moot once it is gone
LEASE_WARNINGS = frozenset({WarningKind.PREEMPTION, WarningKind.EXPIRING, WarningKind.LEASE_RECLAIM, WarningKind.RECLAIM,
                            WarningKind.SHARE_MEMORY})


def lease_json(lease: dict[str, Any] | None, now: float) -> dict[str, Any] | None:
    """The lease as the status and the feed show it: its keys, devices, time left, and its
    sentences (``summary``, ``queue_words``, ``holding``: see :meth:`LeaseView.status_json`)."""
    view = _view(lease)
    return None if view is None else view.status_json(now)


def _view(lease: dict[str, Any] | None) -> LeaseView | None:
    try:
        return LeaseView.maybe(lease)
    except ValueError:  # a state this server does not know: shown as no lease rather than failing the status
        return None


def actions_json(lease: dict[str, Any] | None, kernels: list[KernelRecord], last_lease: dict[str, Any] | None) -> list[dict[str, Any]]:
    """What the user can do now (extend, keep, resume, release), for the frontends' buttons."""
    view = _view(lease)
    return [a.to_json(view) for a in offered_actions(view, [k.state for k in kernels], _view(last_lease))]


def device_figures(s: Any) -> dict[str, Any]:
    return {
        "uuid": s.uuid,
        "parent_uuid": s.parent_uuid or None,
        "utilization_pct": s.utilization_pct,
        "memory_used_mib": s.memory_used_mib,
        "memory_total_mib": s.memory_total_mib,
        "temperature_c": s.temperature_c,
        "power_w": s.power_w,
        "power_limit_w": s.power_limit_w,
        "health": s.health.to_dict(),
    }


def device_json(uuid: str, s: Any, snap: Snapshot, history: dict[str, list[Any]] | None) -> dict[str, Any]:
    d = device_figures(s)
    owner = snap.attribution.owner if snap.attribution else {}
    d["processes"] = [{"pid": p.pid, "kernel_id": owner.get(p.pid), "used_memory_mib": p.used_memory_mib,
                       "sm_util_pct": p.sm_util_pct, "kind": p.kind} for p in s.processes]
    if history is not None:
        d["history"] = history
    return d


def idle_seconds(idle_since: float | None, now: float) -> float | None:
    return None if idle_since is None else round(now - idle_since, 1)


def sample_json(snap: Snapshot, kernels: list[KernelRecord], idle_since: dict[str, float | None], now: float) -> dict[str, Any]:
    att = snap.attribution
    return {
        "t": snap.time,
        "devices": [device_figures(s) for s in snap.devices.values()],
        "kernels": [{"id": k.id, "state": k.state, "execution_state": k.execution_state,
                     "memory_mib": k.gpu.memory_mib if k.gpu else None, "sm_util_pct": k.gpu.sm_util_pct if k.gpu else None,
                     "idle_s": idle_seconds(idle_since.get(k.id), now)} for k in kernels],
        "attribution": att.mode if att else "process",
        "error": snap.error,
    }


def kernel_json(rec: KernelRecord, *, now: float, idle: Any, reclaim_at: float | None, env: str | None, sight: str,
                resume: dict[str, Any] | None, history: dict[str, list[Any]] | None, kept_until: float | None = None) -> dict[str, Any]:
    """One kernel in the status; ``idle`` is its reclaim tracker entry (None: not seen idle);
    ``sight``: what it sees against what new kernels get, in words ("" when the same);
    ``kept_until``: the keep in force that postpones its reclaim."""
    item = {
        "id": rec.id, "name": rec.name, "path": rec.path, "execution_state": rec.execution_state, "connections": rec.connections,
        "last_activity": rec.last_activity, "pid": rec.pid, "state": rec.state, "message": rec.message,
        "gpu": rec.gpu.to_dict() if rec.gpu else None,
        "idle": {"gpu_idle": bool(idle and idle.idle_since is not None), "idle_since": idle.idle_since if idle else None,
                 "idle_s": idle_seconds(idle.idle_since if idle else None, now), "reclaim_at": reclaim_at,
                 "warned": bool(idle and idle.warned_for), "kept_until": kept_until if reclaim_at is not None else None},
        "cuda_visible_devices": env,
        "env_stale": bool(sight),
        "sight": sight,
        "resume": {k: v for k, v in resume.items() if k != "kernel_id"} if resume and resume.get("kernel_id") == rec.id else None,
        "suspended": ({k: rec.suspended[k] for k in ("devices", "memory_mib", "at", "suspend_s")} | {"parked": bool(rec.suspended.get("parked"))}
                      if rec.suspended else None),
        "busy_s": round(rec.busy_s, 1), "idle_total_s": round(rec.idle_s, 1), "memory_peak_mib": rec.memory_peak_mib,
    }
    if history is not None:
        item["history"] = history
    return item


def status_message(*, has_broker: bool, lease: dict[str, Any] | None, telemetry_ok: bool, unavailable: str,
                   sample_error: str) -> str:
    """The one line the status bar shows when something keeps the extension from working fully."""
    if not has_broker:
        return "No lease broker is configured for this server (GPULEASE_BROKER_URL): GPU leases cannot be requested here."
    if lease is None:
        return "This server holds no GPU lease: kernels run without a GPU."
    if not telemetry_ok:
        return f"No GPU telemetry on this server: {unavailable}"
    return sample_error or ""


def telemetry_json(monitor: Any, snap: Snapshot | None, *, sample_interval: float, history_s: float) -> dict[str, Any]:
    att = snap.attribution if snap else None
    return {
        "backend": getattr(monitor.backend, "name", None),
        "available": monitor.available,
        "message": monitor.unavailable,
        "sample_interval_s": sample_interval,
        "history_s": history_s,
        "attribution": att.mode if att else "process",
        "attribution_message": att.message if att else "",
        "samples": monitor.samples,
    }


def standing_warnings(feed_warnings: list[dict[str, Any]], *, now: float, tracker: Any, kernels: dict[str, KernelRecord],
                      lease_active: bool, ends_early_at: float | None = None) -> list[dict[str, Any]]:
    """The warnings of the feed that still hold: their deadline is ahead and nothing since made them
    moot (``ends_early_at``: the lease's ``preempt_at`` now; a preemption warning of another time
    was called off)."""
    out = []
    for w in feed_warnings:
        deadline = w.get("deadline")
        if deadline is None or deadline <= now:
            continue
        kid = w.get("kernel_id")
        if w["kind"] == WarningKind.RECLAIM and (tracker.kernels.get(kid) is None or tracker.kernels[kid].warned_for != deadline):
            continue  # the kernel computed again (or was kept): no reclaim at that time
        if w["kind"] == WarningKind.LEASE_RECLAIM and tracker.lease_warned_for != deadline:
            continue
        if w["kind"] == WarningKind.SHARE_MEMORY and (kid not in kernels or kernels[kid].share_warned_at is None):
            continue
        if w["kind"] in LEASE_WARNINGS and not lease_active:
            continue
        if w["kind"] == WarningKind.PREEMPTION and deadline != ends_early_at:
            continue
        out.append(w)
    return out


def placement_words(lease: dict[str, Any]) -> str:
    """'L4 (GPU-…)', 'a 0.5 share of L4 (GPU-…)', 'MIG 3g.40gb of A100 (MIG-…)'."""
    return words.placement_words(lease, name="uuid", none="no devices")


def queue_words(lease: dict[str, Any], now: float) -> str:
    """'queued for a GPU: position 2 of 5, about 14 min'."""
    return f"queued for a GPU: {words.queue_words(lease, now)}" if (lease.get("queue") or {}).get("position") is not None else "queued for a GPU"


def clock_words(t: float) -> str:
    return datetime.datetime.fromtimestamp(t).strftime("%H:%M")
