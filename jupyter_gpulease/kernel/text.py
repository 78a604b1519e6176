"""`%gpu` answers as text: the same words in a notebook, in IPython and in a terminal.

Pure functions of the server's JSON (docs/server-api.md) and ``now``.
"""

from __future__ import annotations

import time
from typing import Any

from ..core.text import format_duration, format_gpus, format_table, format_time_left, usage_words


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


def describe_request(r: dict[str, Any]) -> str:
    models = r.get("model") or []
    if isinstance(models, str):
        models = [models]
    of = f" of {'|'.join(models)}" if models else ""
    if r.get("kind") == "share":
        return f"a {float(r.get('share') or 0):g} share{of}"
    if r.get("kind") == "mig":
        return f"MIG {r.get('mig_profile')}{of}"
    n = int(r.get("gpus") or 1)
    return f"{n} GPU{'s' if n != 1 else ''}{of}"


def describe_slices(lease: dict[str, Any]) -> str:
    parts = []
    for s in (lease.get("placement") or {}).get("slices") or []:
        if s.get("mig_profile"):
            parts.append(f"MIG {s['mig_profile']} of {s['model']} #{s['index']}")
        elif float(s.get("share", 1)) < 1:
            parts.append(f"a {float(s['share']):g} share of {s['model']} #{s['index']}")
        else:
            parts.append(f"{s['model']} #{s['index']}")
    return ", ".join(parts) or "-"


def queue_words(lease: dict[str, Any], now: float) -> str:
    """'position 2 of 5, about 14 min' (or 'no estimate yet')."""
    q = lease.get("queue") or {}
    pos = f"position {q.get('position', '?')} of {q.get('length', '?')}"
    eta = q.get("eta")
    if eta is None:
        return f"{pos}, no estimate yet"
    left = float(eta) - now
    return f"{pos}, {'any moment now' if left < 60 else 'about ' + format_duration(left)}{_sooner(q, now, long=True)}"


def _sooner(q: dict[str, Any], now: float, *, long: bool = False) -> str:
    """The broker's may_start_sooner_at: what the queued lease waits for sits idle and goes back by then."""
    at = q.get("may_start_sooner_at")
    if at is None or float(at) <= now:
        return ""
    hhmm = time.strftime("%H:%M", time.localtime(float(at)))
    if long:
        return f", or sooner: the GPU it waits for is idle and goes back by {hhmm} if it stays idle"
    return f", or sooner: by {hhmm}"


def lease_line(lease: dict[str, Any] | None, now: float) -> str:
    """One line about the lease: what, state, time left or queue position, or how it ended."""
    if not lease:
        return "no GPU lease (ask for one with %gpu request)"
    lid = short_id(lease.get("id"))
    state = lease.get("state")
    if state == "queued":
        return f"lease {lid} waits for {describe_request(lease.get('request') or {})}: {queue_words(lease, now)}"
    if state == "active":
        left = ""
        if lease.get("expires_at") is not None:
            left = f", {format_time_left(float(lease['expires_at']) - now)} left"
        tier = f" (tier {lease['tier']})" if lease.get("tier") else ""
        return f"lease {lid}: {describe_slices(lease)}{tier}{left}"
    if lease.get("end_message"):  # a sentence that names the state itself ('Released from the notebook.')
        return f"lease {lid}: {lease['end_message']}"
    why = lease.get("end_reason") or ""
    return f"lease {lid} {state}" + (f": {why}" if why else "")


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
    """The status's warnings that still stand, the latest of each kind (per kernel): a warning
    whose deadline passed has come true or gone, and a repeated one replaces the earlier."""
    latest: dict[tuple[str, str], dict[str, Any]] = {}
    for w in status.get("warnings") or []:
        if w.get("deadline") is not None and float(w["deadline"]) < now:
            continue
        latest.pop((w.get("kind", ""), w.get("kernel_id") or ""), None)
        latest[(w.get("kind", ""), w.get("kernel_id") or "")] = w
    return list(latest.values())


def suspended_kernels(status: dict[str, Any]) -> list[dict[str, Any]]:
    return [k for k in status.get("kernels") or [] if k.get("state") in ("suspended", "resuming")]


def kernel_row(k: dict[str, Any], kernel_id: str | None) -> list[str]:
    kid = str(k.get("id") or "")
    me = " (this kernel)" if kernel_id and kid == kernel_id else ""
    gpu = k.get("gpu") or {}
    idle = k.get("idle") or {}
    state = k.get("state") or "ok"
    if state == "ok":
        state = k.get("execution_state") or "-"
        if idle.get("idle_s") is not None:
            state = f"GPU idle {format_duration(float(idle['idle_s']))}"
        if idle.get("reclaim_at"):
            state += " (reclaim coming)"
    if k.get("env_stale"):
        state += "; restart to see the new GPU"
    return [f"{kid[:8]} {k.get('name') or ''}".rstrip() + me, _mib(gpu.get("memory_mib")), _pct(gpu.get("sm_util_pct")), state]


def status_text(status: dict[str, Any], now: float | None = None, *, kernel_id: str | None = None) -> str:
    """`%gpu status`: lease, devices, kernels (this one marked), warnings."""
    now = float(status.get("now") or 0) if now is None else now
    lease = status.get("lease")
    lines = [lease_line(lease, now)]
    if not lease and status.get("last_lease"):
        lines.append("last: " + lease_line(status["last_lease"], now))
    if status.get("message"):
        lines.append(status["message"])
    kernels = status.get("kernels") or []
    if any(k.get("state") == "suspended" for k in kernels):
        lines.append("suspended: the GPU state of an idle kernel was put aside; its next cell resumes it (or %gpu resume)")
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
        when += _sooner(q, now)
        rows.append([q.get("position", i), x.get("user", "-"), x.get("tier", "-"), describe_request(x.get("request") or {}), when,
                     q.get("waiting_for") or ""])
    out = table(["#", "USER", "TIER", "ASKS FOR", "ETA", "WAITING FOR"], rows)
    if any(_sooner(x.get("queue") or {}, now) for x in queue):
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
