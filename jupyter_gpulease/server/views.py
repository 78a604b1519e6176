"""The JSON the extension shows: pure builders of the status, the samples and the lease (no I/O).

Every function takes what it shows and ``now``; see docs/server-api.md for the fields.
"""

from __future__ import annotations

import datetime
from typing import Any

from ..core.text import format_duration
from .kernels import KernelRecord
from .lease import lease_devices
from .monitor import Snapshot

STATUS_VERSION = 1
LEASE_KEYS = ("id", "state", "tier", "request", "placement", "granted_at", "expires_at", "ended_at", "end_reason", "ended_by",
              "end_message", "preempt_at", "duration_s", "created_at", "queue")


def lease_json(lease: dict[str, Any] | None, now: float) -> dict[str, Any] | None:
    if not lease:
        return None
    out = {k: lease.get(k) for k in LEASE_KEYS if k in lease}
    if lease.get("expires_at") and lease.get("state") == "active":
        out["time_left_s"] = max(0.0, float(lease["expires_at"]) - now)
    out["devices"] = lease_devices(lease)
    return out


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


def kernel_json(rec: KernelRecord, *, now: float, idle: Any, reclaim_at: float | None, env: str | None, stale: bool,
                resume: dict[str, Any] | None, history: dict[str, list[Any]] | None) -> dict[str, Any]:
    """One kernel in the status; ``idle`` is its reclaim tracker entry (None: not seen idle)."""
    item = {
        "id": rec.id, "name": rec.name, "path": rec.path, "execution_state": rec.execution_state, "connections": rec.connections,
        "last_activity": rec.last_activity, "pid": rec.pid, "state": rec.state, "message": rec.message,
        "gpu": rec.gpu.to_dict() if rec.gpu else None,
        "idle": {"gpu_idle": bool(idle and idle.idle_since is not None), "idle_since": idle.idle_since if idle else None,
                 "idle_s": idle_seconds(idle.idle_since if idle else None, now), "reclaim_at": reclaim_at,
                 "warned": bool(idle and idle.warned_for)},
        "cuda_visible_devices": env,
        "env_stale": stale,
        "resume": {k: v for k, v in resume.items() if k != "kernel_id"} if resume and resume.get("kernel_id") == rec.id else None,
        "suspended": {k: rec.suspended[k] for k in ("devices", "memory_mib", "at", "suspend_s")} if rec.suspended else None,
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
                      lease_active: bool) -> list[dict[str, Any]]:
    """The warnings of the feed that still hold: their deadline is ahead and nothing since made them moot."""
    out = []
    for w in feed_warnings:
        deadline = w.get("deadline")
        if deadline is None or deadline <= now:
            continue
        kid = w.get("kernel_id")
        if w["kind"] == "reclaim" and (tracker.kernels.get(kid) is None or tracker.kernels[kid].warned_for != deadline):
            continue  # the kernel computed again (or was kept): no reclaim at that time
        if w["kind"] == "lease_reclaim" and tracker.lease_warned_for != deadline:
            continue
        if w["kind"] == "share_memory" and (kid not in kernels or kernels[kid].share_warned_at is None):
            continue
        if w["kind"] in ("preemption", "expiring", "lease_reclaim", "reclaim", "share_memory") and not lease_active:
            continue
        out.append(w)
    return out


def placement_words(lease: dict[str, Any]) -> str:
    slices = (lease.get("placement") or {}).get("slices") or []
    parts = []
    for s in slices:
        what = f"MIG {s['mig_profile']} of " if s.get("mig_uuid") else (f"a {float(s.get('share', 1)):g} share of " if float(s.get("share", 1)) < 1 else "")
        parts.append(f"{what}{s.get('model', 'GPU')} {s.get('mig_uuid') or s['gpu_uuid']}")
    return ", ".join(parts) or "no devices"


def queue_words(lease: dict[str, Any], now: float) -> str:
    q = lease.get("queue") or {}
    if q.get("position") is None:
        return "queued for a GPU"
    eta = q.get("eta")
    when = f", expected in about {format_duration(max(0.0, eta - now))}" if eta else ""
    return f"queued for a GPU: number {q['position']} of {q.get('length', '?')}{when}"


def clock_words(t: float) -> str:
    return datetime.datetime.fromtimestamp(t).strftime("%H:%M")
