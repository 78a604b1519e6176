"""`%gpu` answers as text: the same words in a notebook, in IPython and in a terminal.

Pure functions of the server's JSON (docs/server-api.md) and ``now``. A lease is said with the
one lease view's words (:mod:`jupyter_gpulease.core.words`); what is here lays out the tables
and the status.
"""

from __future__ import annotations

from typing import Any

from ..core.lease import KernelState, LeaseView
from ..core.lease import current_warnings as _current_warnings
from ..core.text import format_duration, format_gpus, format_table, usage_words
from ..core.words import SUSPENDED_WORDS, hhmm, lease_line, queue_words, sooner_words
from ..core.words import request_words as describe_request


def _mib(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v / 1024:.1f} GiB" if v >= 1024 else f"{v:.0f} MiB"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}%"


def table(headers: list[str], rows: list[list[Any]]) -> str:
    return format_table(rows, headers)


def short_id(lease_id: Any) -> str:
    """A lease id as people see it: its first 8 characters (enough to tell leases apart)."""
    return str(lease_id or "")[:8]


__all__ = ["current_warnings", "describe_request", "device_label", "lease_line", "pool_text", "queue_text", "queue_words",
           "short_id", "status_text", "suspended_kernels"]


def device_label(d: dict[str, Any], lease: dict[str, Any] | None) -> str:
    """'A100-SXM4-80GB #0', 'MIG 3g.40gb of A100-SXM4-80GB #0': names from the lease's placement."""
    if d.get("model"):
        return f"{d['model']} #{d.get('index', '?')}" + (f" {d['mig_profile']}" if d.get("mig_profile") else "")
    slices = ((lease or {}).get("placement") or {}).get("slices") or []
    uuid = d.get("uuid")
    for s in slices:
        if s.get("mig_uuid") and s["mig_uuid"] == uuid:
            return f"MIG {s['mig_profile']} of {s['model']} #{s['index']}"
    for s in slices:
        if s.get("gpu_uuid") == uuid:
            return f"{s['model']} #{s['index']}"
    uuid = str(d.get("uuid") or "GPU")
    return uuid if len(uuid) <= 16 else uuid[:14] + "…"


def current_warnings(status: dict[str, Any], now: float) -> list[dict[str, Any]]:
    """The status's warnings that still stand (:func:`jupyter_gpulease.core.lease.current_warnings`)."""
    return _current_warnings(status.get("warnings") or [], now)


def suspended_kernels(status: dict[str, Any]) -> list[dict[str, Any]]:
    """The kernels whose GPU memory is put aside now: suspended, or resuming."""
    known = {k.value for k in KernelState}
    return [k for k in status.get("kernels") or [] if k.get("state") in known and KernelState(k["state"]).put_aside]


def kernel_row(k: dict[str, Any], kernel_id: str | None) -> list[str]:
    kid = str(k.get("id") or "")
    me = " (this kernel)" if kernel_id and kid == kernel_id else ""
    gpu = k.get("gpu") or {}
    idle = k.get("idle") or {}
    state = k.get("state") or KernelState.OK.value
    if state == KernelState.OK:
        state = k.get("execution_state") or "-"
        if idle.get("idle_s") is not None:
            state = f"GPU idle {format_duration(float(idle['idle_s']))}"
        if idle.get("kept_until"):
            state += f" (kept until {hhmm(float(idle['kept_until']))})"
        elif idle.get("reclaim_at"):
            state += f" (reclaim at {hhmm(float(idle['reclaim_at']))})"
    if k.get("env_stale"):
        # the server's words for what this kernel sees (servers before them: the one case they knew)
        state += "; " + (k.get("sight") or "restart to see the new GPU")
    return [f"{kid[:8]} {k.get('name') or ''}".rstrip() + me, _mib(gpu.get("memory_mib")), _pct(gpu.get("sm_util_pct")), state]


def status_text(status: dict[str, Any], now: float | None = None, *, kernel_id: str | None = None) -> str:
    """`%gpu status`: lease, devices, kernels (this one marked), warnings."""
    now = float(status.get("now") or 0) if now is None else now
    lease = status.get("lease")
    lines = [lease_line(LeaseView.maybe(lease), now)]
    if not lease and status.get("last_lease"):
        lines.append("last: " + lease_line(LeaseView.from_json(status["last_lease"]), now))
    if status.get("message"):
        lines.append(status["message"])
    kernels = status.get("kernels") or []
    if any(k.get("state") == KernelState.SUSPENDED for k in kernels):
        lines.append(f"{SUSPENDED_WORDS} (or %gpu resume)")
    devices = status.get("devices") or []
    if devices:
        rows = []
        for d in devices:
            mem = f"{_mib(d.get('memory_used_mib'))} / {_mib(d.get('memory_total_mib'))}"
            temp = "-" if d.get("temperature_c") is None else f"{d['temperature_c']:.0f} °C"
            power = "-" if d.get("power_w") is None else f"{d['power_w']:.0f} W"
            rows.append([device_label(d, lease), _pct(d.get("utilization_pct")), mem, temp, power])
        lines += ["", table(["DEVICE", "UTIL", "MEMORY", "TEMP", "POWER"], rows)]
    kernels = status.get("kernels") or []
    if kernels:
        lines += ["", table(["KERNEL", "GPU MEMORY", "UTIL", "STATE"], [kernel_row(k, kernel_id) for k in kernels])]
    warnings = current_warnings(status, now)
    notices = status.get("notices") or []
    if warnings or notices:
        lines.append("")
        for w in [*warnings, *notices]:
            lines.append(f"! {w.get('message') or w.get('kind')}")
    return "\n".join(lines)


def queue_text(queue: list[dict[str, Any]], now: float) -> str:
    if not queue:
        return "the queue is empty"
    rows = []
    for i, x in enumerate(queue, 1):
        q = x.get("queue") or {}
        eta = q.get("eta")
        when = "-" if eta is None else ("any moment" if float(eta) - now < 60 else f"~{format_duration(float(eta) - now)}")
        when += sooner_words(q, now, long=False)
        rows.append([q.get("position", i), x.get("user", "-"), x.get("tier", "-"), describe_request(x.get("request") or {}), when,
                     q.get("waiting_for") or ""])
    out = table(["#", "USER", "TIER", "ASKS FOR", "ETA", "WAITING FOR"], rows)
    if any(sooner_words(x.get("queue") or {}, now) for x in queue):
        out += "\n(or sooner: the GPU it waits for is idle, and idle reclaim gives it back by then if it stays idle)"
    return out


def mig_words(mig: dict[str, Any]) -> str:
    """'3g.40gb: 2 of 2 free, 1g.10gb: none of 7 free' from the pool's per-profile figures."""
    parts = []
    for profile, n in sorted(mig.items()):
        if isinstance(n, dict):
            free, total = int(n.get("free") or 0), n.get("total")
            parts.append(f"{profile}: {free or 'none'} of {total} free" if total is not None else f"{profile}: {free} free")
        else:
            parts.append(f"{profile}: {n} free")
    return ", ".join(parts) or "-"


def pool_text(pool: dict[str, Any]) -> str:
    cap = pool.get("capacity") or {}
    rows = [[m, c.get("gpus", ""), c.get("idle_gpus", ""), format_gpus(float(c.get("free_share") or 0)), mig_words(c.get("mig") or {})]
            for m, c in sorted(cap.items())]
    out = [table(["MODEL", "GPUS", "IDLE", "FREE SHARE", "MIG FREE"], rows)] if rows else ["no GPUs in the pool"]
    u = pool.get("usage") or {}
    out += ["", f"queue: {pool.get('queue_length', 0)} waiting; {usage_words(u)}"]
    tiers = pool.get("tiers") or []
    if tiers:
        out.append("tiers: " + ", ".join(f"{t['name']} (up to {format_duration(float(t['max_duration_s']))})" for t in tiers if t.get("max_duration_s")))
    return "\n".join(out)
