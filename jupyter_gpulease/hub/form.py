"""The spawn form: built from the broker's live pool, the user's tiers and quota.

Each option says what it costs in waiting: free now, or how many wait for it and when a GPU
of that kind frees up, so a researcher can pick "a 1/2 share now" over "a whole A100 in about
40 minutes". Pure functions over the broker's JSON: :func:`render_form` writes the HTML,
:func:`options_from_form` reads the posted form back into ``user_options`` of the same shape
as the REST API takes (see :mod:`.options`).
"""

from __future__ import annotations

import fnmatch
import html
import time
from dataclasses import dataclass
from typing import Any

from ..core.text import format_duration
from .options import Preset, default_preset
from .placement import describe_request, display_model

DURATION_CHOICES_H = (0.5, 1, 2, 4, 8, 12, 24, 48)
SHARE_CHOICES = (0.5, 0.25)


@dataclass(frozen=True)
class Availability:
    free_now: bool
    waiting: int  # queued leases that want the same kind of GPU
    frees_at: float | None  # earliest end of an active lease on that kind of GPU
    possible: bool = True  # False: the pool has nothing of this kind at all

    def text(self, now: float) -> str:
        if not self.possible:
            return "not in the pool"
        if self.free_now:
            return "free now" if not self.waiting else f"free now, {self.waiting} waiting"
        parts = [f"{self.waiting} waiting" if self.waiting else "all in use"]
        if self.frees_at is not None:
            left = self.frees_at - now
            parts.append("one frees any moment" if left < 60 else f"one frees in about {format_duration(left)}")
        return "; ".join(parts)


def _models(request: dict) -> list[str]:
    m = request.get("model") or []
    return [m] if isinstance(m, str) else list(m)


def _matches(model: str, patterns: list[str]) -> bool:
    return not patterns or any(fnmatch.fnmatchcase(model.lower(), p.lower()) for p in patterns)


def _kind(request: dict) -> str:
    if request.get("kind"):
        return request["kind"]
    if request.get("mig_profile"):
        return "mig"
    if request.get("share") or (request.get("memory_mib") and "gpus" not in request):
        return "share"
    return "gpu"


def availability(request: dict, pool: dict, *, queue: list[dict] = (), active: list[dict] = ()) -> Availability:
    """How soon ``request`` (user_options request fields) could start, from the pool's capacity."""
    capacity = pool.get("capacity") or {}
    patterns = _models(request)
    models = [m for m in capacity if _matches(m, patterns)]
    if not models:
        return Availability(False, 0, None, possible=False)
    kind = _kind(request)
    free = False
    for m in models:
        c = capacity[m]
        if kind == "gpu":
            free |= int(c.get("idle_gpus", 0)) >= int(request.get("gpus", 1))
        elif kind == "share":
            free |= float(c.get("largest_free_share", 0)) >= float(request.get("share") or 0.01)
        else:
            free |= int(((c.get("mig") or {}).get(request.get("mig_profile")) or {}).get("free", 0)) > 0
    waiting = 0
    for q in queue:  # queued requests of the same kind on the same models wait for the same thing
        qr = q.get("request") or {}
        qm = _models(qr)
        if _kind(qr) == kind and (not qm or any(_matches(m, qm) for m in models)):
            waiting += 1
    ends = []
    for a in active:
        slices = (a.get("placement") or {}).get("slices") or []
        if a.get("expires_at") and any(s.get("model") in models for s in slices):
            ends.append(float(a["expires_at"]))
    return Availability(free, waiting, min(ends) if ends else None)


def custom_choices(pool: dict) -> list[tuple[str, str, dict]]:
    """The free-choice options: (value, label, request) for whole GPUs, shares and MIG profiles."""
    out: list[tuple[str, str, dict]] = []
    per: dict[str, dict] = {}
    for d in pool.get("devices") or []:
        p = per.setdefault(d["model"], {"memory_mib": 0, "nodes": {}, "mig": set(), "plain": 0})
        p["memory_mib"] = max(p["memory_mib"], int(d.get("memory_mib") or 0))
        if d.get("mig"):
            p["mig"].update(i["profile"] for i in d["mig"])
        elif d.get("healthy", True):
            p["plain"] += 1
            p["nodes"][d["node"]] = p["nodes"].get(d["node"], 0) + 1
    for model in sorted(per):
        p = per[model]
        name = display_model(model, p["memory_mib"])
        most = max(p["nodes"].values(), default=0)
        for n in range(1, most + 1):
            out.append((f"gpu:{n}:{model}", f"{n} × {name}", {"kind": "gpu", "gpus": n, "model": model}))
        if p["plain"]:
            for s in SHARE_CHOICES:
                out.append((f"share:{s:g}:{model}", f"a {s:g} share of one {name}", {"kind": "share", "share": s, "model": model}))
        for prof in sorted(p["mig"]):
            out.append((f"mig:{prof}:{model}", f"MIG {prof} of {name}", {"kind": "mig", "mig_profile": prof, "model": model}))
    return out


def choice_to_request(value: str) -> dict:
    """Inverse of the ``choice`` values of :func:`custom_choices`: 'gpu:2:L4' → {'gpus': 2, 'model': 'L4'}."""
    if value == "cpu":
        return {"kind": "cpu"}
    kind, _, rest = value.partition(":")
    arg, _, model = rest.partition(":")
    if kind == "gpu":
        return {"gpus": arg, "model": model} if model else {"gpus": arg}
    if kind == "share":
        return {"share": arg, "model": model} if model else {"share": arg}
    if kind == "mig":
        return {"mig_profile": arg, "model": model} if model else {"mig_profile": arg}
    # unknown shape: pass it on and let validation name it
    return {"kind": kind}


def options_from_form(form: dict[str, list[str]]) -> dict[str, Any]:
    """The posted form (a dict of lists of strings) → ``user_options`` in the REST API's shape."""
    first = {k: (v[0] if isinstance(v, list) and v else v) for k, v in form.items()}
    first = {k: v.strip() if isinstance(v, str) else v for k, v in first.items()}
    out: dict[str, Any] = {}
    choice = first.get("choice") or ""
    if choice.startswith("preset:"):
        out["preset"] = choice.split(":", 1)[1]
    elif choice:
        out.update(choice_to_request(choice))
    if out.get("kind") != "cpu":
        if first.get("tier") and "preset" not in out:
            out["tier"] = first["tier"]
        if first.get("duration_h"):
            out["duration_h"] = first["duration_h"]
        if first.get("max_wait_min"):
            out["max_wait_min"] = first["max_wait_min"]
    for k, v in list(out.items()):  # numbers from the form's strings
        if k in ("gpus",) and isinstance(v, str) and v.isdigit():
            out[k] = int(v)
        elif k in ("share", "duration_h", "max_wait_min") and isinstance(v, str):
            try:
                out[k] = float(v)
            except ValueError:
                pass  # validation names it
    return out


# --------------------------------------------------------------------------- HTML
_STYLE = """
<style>
.gpulease-form .gpulease-option { display:block; padding:.45em .6em; margin:.25em 0; border:1px solid #ddd; border-radius:4px; cursor:pointer; }
.gpulease-form .gpulease-option:hover { background:#f6f8fa; }
.gpulease-form .gpulease-free { color:#1a7f37; font-weight:600; }
.gpulease-form .gpulease-wait { color:#9a6700; font-weight:600; }
.gpulease-form .gpulease-none { color:#888; }
.gpulease-form .gpulease-desc { color:#555; font-size:90%; display:block; margin-left:1.6em; }
.gpulease-form .gpulease-quota, .gpulease-form .gpulease-error { margin:.5em 0 1em; }
.gpulease-form .gpulease-error { color:#b35900; }
.gpulease-form select { max-width:100%; }
</style>
"""


def _esc(s: Any) -> str:
    return html.escape(str(s), quote=True)


def format_usage(usage: dict | None) -> str:
    """The caller's quota in words, from whatever the broker reports (keys it knows are named)."""
    if not usage:
        return ""
    parts = []
    held = usage.get("gpus_held", usage.get("gpus"))
    mx = usage.get("max_gpus")
    if held is not None:
        parts.append(f"{float(held):g} GPU{'s' if float(held) != 1 else ''} held" + (f" of at most {float(mx):g}" if mx is not None else ""))
    used = usage.get("gpu_hours_used", usage.get("gpu_hours_in_period"))
    cap = usage.get("gpu_hours", usage.get("gpu_hours_quota"))
    if isinstance(cap, (int, float)) and used is not None:
        parts.append(f"{float(used):.1f} of {float(cap):g} GPU-hours used this period")
    elif used is not None:
        parts.append(f"{float(used):.1f} GPU-hours used this period")
    left = usage.get("quota_left") or usage.get("left")
    if isinstance(left, dict):
        bits = []
        if left.get("gpus") is not None:
            bits.append(f"{float(left['gpus']):g} GPUs")
        if left.get("gpu_hours") is not None:
            bits.append(f"{float(left['gpu_hours']):.1f} GPU-hours")
        if bits:
            parts.append("left: " + ", ".join(bits))
    return "; ".join(parts)


def _avail_span(a: Availability, now: float) -> str:
    cls = "gpulease-free" if a.free_now else ("gpulease-none" if not a.possible else "gpulease-wait")
    return f'<span class="{cls}">{_esc(a.text(now))}</span>'


def render_form(
    pool: dict | None,
    *,
    presets: list[Preset] = (),
    allow_custom: bool = True,
    allow_cpu_only: bool = True,
    queue: list[dict] = (),
    active: list[dict] = (),
    previous: dict | None = None,
    error: str = "",
    now: float | None = None,
) -> str:
    """The HTML of the spawn form (JupyterHub wraps it in a <form> with the Start button)."""
    now = time.time() if now is None else now
    previous = previous or {}
    out = [_STYLE, '<div class="gpulease-form">']
    if error:
        out.append(f'<div class="gpulease-error alert alert-warning">{_esc(error)}</div>')
    if pool is not None:
        usage_text = format_usage(pool.get("usage"))
        qlen = pool.get("queue_length")
        line = []
        if usage_text:
            line.append(f"Your quota: {usage_text}.")
        if qlen is not None:
            line.append(f"{qlen} request{'s' if qlen != 1 else ''} in the queue.")
        if line:
            out.append(f'<div class="gpulease-quota">{_esc(" ".join(line))}</div>')

    prev_choice = ""
    if previous.get("preset"):
        prev_choice = f"preset:{previous['preset']}"
    elif previous.get("kind") == "cpu":
        prev_choice = "cpu"

    presets = list(presets)
    if presets:
        default = default_preset(presets)
        checked = prev_choice if prev_choice.startswith("preset:") and any(prev_choice == f"preset:{p.slug}" for p in presets) else f"preset:{default.slug}"
        out.append("<fieldset><legend>Choose a GPU option</legend>")
        for p in presets:
            value = f"preset:{p.slug}"
            if p.cpu_only:
                status = '<span class="gpulease-free">no GPU, starts now</span>'
            elif pool is not None:
                status = _avail_span(availability(p.request, pool, queue=queue, active=active), now)
            else:
                status = '<span class="gpulease-none">availability unknown</span>'
            detail = []
            if not p.cpu_only:
                detail.append(describe_request(p.request, pool))
                if p.tier:
                    detail.append(f"tier {p.tier}")
                if p.duration_s:
                    detail.append(format_duration(p.duration_s))
            desc = " · ".join(detail)
            if p.description:
                desc = f"{p.description} ({desc})" if desc else p.description
            out.append(
                f'<label class="gpulease-option"><input type="radio" name="choice" value="{_esc(value)}"'
                f'{" checked" if value == checked else ""}> <strong>{_esc(p.display_name)}</strong> — {status}'
                f'<span class="gpulease-desc">{_esc(desc)}</span></label>'
            )
        out.append("</fieldset>")

    if allow_custom and (not presets or pool is not None):
        choices = custom_choices(pool) if pool is not None else []
        prev_req = {k: previous[k] for k in ("gpus", "share", "mig_profile", "model") if k in previous}
        sel_value = ""
        for value, _label, req in choices:
            if prev_req and all(str(req.get(k)) == str(v) for k, v in prev_req.items() if k != "kind"):
                sel_value = value
        if presets:
            out.append('<details><summary>Or choose freely</summary>')
        out.append('<div class="form-group mb-2"><label for="gpulease-choice">GPU</label>')
        out.append('<select class="form-select form-control" id="gpulease-choice" name="choice">' if not presets else
                   '<select class="form-select form-control" id="gpulease-choice" name="choice" disabled>')
        if allow_cpu_only and not any(p.cpu_only for p in presets):
            out.append(f'<option value="cpu"{" selected" if prev_choice == "cpu" else ""}>No GPU (CPU only) — starts now</option>')
        first_free = None
        for value, _label, req in choices:
            a = availability(req, pool, queue=queue, active=active)
            if first_free is None and a.free_now:
                first_free = value
        pick = sel_value or (first_free if prev_choice != "cpu" else "") or (choices[0][0] if choices and prev_choice != "cpu" else "")
        for value, label, req in choices:
            a = availability(req, pool, queue=queue, active=active)
            out.append(f'<option value="{_esc(value)}"{" selected" if value == pick else ""}>{_esc(label)} — {_esc(a.text(now))}</option>')
        out.append("</select></div>")
        tiers = (pool or {}).get("tiers") or []
        if tiers:
            out.append('<div class="form-group mb-2"><label for="gpulease-tier">Tier</label>')
            out.append('<select class="form-select form-control" id="gpulease-tier" name="tier"' + (" disabled" if presets else "") + ">")
            prev_tier = previous.get("tier") or (pool or {}).get("default_tier")
            for t in sorted(tiers, key=lambda t: -int(t.get("priority", 0))):
                label = f"{t['name']} — up to {format_duration(t.get('max_duration_s') or 0)}"
                if t.get("preemptible"):
                    label += ", may be preempted"
                if t.get("description"):
                    label += f" ({t['description']})"
                out.append(f'<option value="{_esc(t["name"])}"{" selected" if t["name"] == prev_tier else ""}>{_esc(label)}</option>')
            out.append("</select></div>")
        longest = max((float(t.get("max_duration_s") or 0) for t in tiers), default=max(DURATION_CHOICES_H) * 3600)
        out.append('<div class="form-group mb-2"><label for="gpulease-duration">Duration</label>')
        out.append('<select class="form-select form-control" id="gpulease-duration" name="duration_h"' + (" disabled" if presets else "") + ">")
        out.append('<option value="">the tier\'s default</option>')
        for h in DURATION_CHOICES_H:
            if h * 3600 <= longest:
                sel = " selected" if str(previous.get("duration_h")) in (str(h), f"{h:g}") else ""
                out.append(f'<option value="{h:g}"{sel}>{_esc(format_duration(h * 3600))}</option>')
        out.append("</select></div>")
        if presets:
            out.append("</details>")
            # the free-choice fields are only sent when the user opens them
            out.append(
                "<script>(function(){var d=document.querySelector('.gpulease-form details');if(!d)return;"
                "d.addEventListener('toggle',function(){var on=d.open;d.querySelectorAll('select').forEach(function(s){s.disabled=!on;});"
                "document.querySelectorAll('.gpulease-form input[name=choice]').forEach(function(r){r.disabled=on;});});})();</script>"
            )
    elif not presets:
        out.append('<input type="hidden" name="choice" value="cpu">' if allow_cpu_only else "")
        if allow_cpu_only:
            out.append("<p>Without the lease broker only a CPU-only server can start.</p>")
    out.append('<div class="form-group mb-2"><label for="gpulease-wait">Wait at most</label>')
    out.append('<select class="form-select form-control" id="gpulease-wait" name="max_wait_min">')
    out.append('<option value="">as long as it takes (up to the hub\'s limit)</option>')
    for m in (5, 15, 30, 60, 120):
        out.append(f'<option value="{m}">{_esc(format_duration(m * 60))}</option>')
    out.append("</select></div>")
    out.append("</div>")
    return "\n".join(out)
