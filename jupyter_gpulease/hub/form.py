"""The spawn form: a card per choice, built from the broker's live pool, the user's tiers and quota.

Like KubeSpawner's ``profile_list`` form, each choice is a card with what it gives (GPUs,
memory per GPU or share) and what it costs in waiting: how many of its kind are free, and the
broker's own estimate for exactly this request (start now, or the queue position and ETA it
would get), for each tier the user may pick. Choices the user's quota can never allow are not
offered. Above the cards: what is free and what waits in the whole pool.

Where the engine offers a choice of image (Docker's environments, :mod:`.environments`), an
"Environment" section comes first: a card per environment, one that cannot run here shown
disabled with the reason.

Pure functions over the broker's JSON plus one async gatherer (:func:`render_for`):
:func:`render_form` writes the HTML from a Jinja2 template (autoescaped), and
:func:`options_from_form` reads the posted form back into ``user_options`` of the same shape as
the REST API takes (see :mod:`.options`).
"""

from __future__ import annotations

import asyncio
import fnmatch
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jinja2 import Environment, FileSystemLoader, select_autoescape

from ..core.text import format_duration
from .options import Preset, default_preset, pool_models
from .placement import describe_request, display_model

if TYPE_CHECKING:
    from .environments import EnvironmentOffer

DURATION_CHOICES_H = (0.25, 0.5, 1, 2, 4, 8, 12, 24, 48)
SHARE_CHOICES = (0.5, 0.25)
WAIT_CHOICES_MIN = (5, 15, 30, 60, 120)
ESTIMATES_PER_CALL = 32  # the broker's limit per POST api/estimate

TEMPLATES = Path(__file__).resolve().parent / "templates"
_env = Environment(loader=FileSystemLoader(str(TEMPLATES / "gpulease")), autoescape=select_autoescape(default=True),
                   trim_blocks=True, lstrip_blocks=True)


# --------------------------------------------------------------------------- what is free
@dataclass(frozen=True)
class Availability:
    """What the pool says about a kind of slice right now (no promise about when: that is the estimate's job)."""

    free_now: bool
    waiting: int  # queued leases that want the same kind of GPU
    possible: bool = True  # False: the pool has nothing of this kind at all

    def text(self) -> str:
        if not self.possible:
            return "not in the pool"
        if self.free_now:
            return "free now" if not self.waiting else f"free now, {self.waiting} waiting"
        return f"all in use, {self.waiting} waiting" if self.waiting else "all in use"


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


def availability(request: dict, pool: dict, *, queue: list[dict] = ()) -> Availability:
    """Whether ``request`` (user_options request fields) fits the pool's free capacity now, and who waits for its kind."""
    capacity = pool.get("capacity") or {}
    patterns = _models(request)
    models = [m for m in capacity if _matches(m, patterns)]
    if not models:
        return Availability(False, 0, possible=False)
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
    return Availability(free, waiting)


def overview(pool: dict, queue: list[dict] = ()) -> list[dict]:
    """One row per model: whole GPUs idle of total, free share compute, MIG slices free, requests waiting for it."""
    rows = []
    for model, c in sorted((pool.get("capacity") or {}).items()):
        mig = [f"{p}: {d.get('free', 0)} of {d.get('total', 0)} free" for p, d in sorted((c.get("mig") or {}).items())]
        plain = sum(1 for d in pool.get("devices") or [] if d.get("model") == model and not d.get("mig"))
        waiting = sum(1 for q in queue if _matches(model, _models(q.get("request") or {})))
        rows.append({
            "model": display_model(model, c.get("memory_mib")),
            "whole": f"{int(c.get('idle_gpus', 0))} of {plain} idle" if plain else "",
            "shares": _share_room(c) if plain else "",
            "mig": ", ".join(mig),
            "waiting": waiting,
        })
    return rows


def unavailable(pool: dict | None, now: float | None = None) -> list[dict]:
    """GPUs that take no lease now, or soon, and why: cordoned (by an admin or by their health) or
    in (or close to) a maintenance window, as the broker's pool lists them."""
    now = time.time() if now is None else now
    rows = []
    for d in (pool or {}).get("devices") or []:
        cordon, window = d.get("cordon"), d.get("maintenance")
        where = f"{display_model(d.get('model', ''), d.get('memory_mib'))}, GPU {d.get('index')} on {d.get('node')}"
        if cordon:
            state = {"drain": "unavailable (drained)", "drain_when_idle": "unavailable until it is serviced"}.get(cordon.get("mode"), "unavailable")
            rows.append({"where": where, "why": f"{state}: {cordon.get('reason', '')}"})
        elif d.get("healthy") is False:
            rows.append({"where": where, "why": "unavailable: its node is drained or cordoned"})
        if window and (window.get("under_way") or window.get("start", now) - now < 7 * 86400):
            when = "in maintenance" if window.get("under_way") else f"maintenance in {format_duration(max(0.0, window['start'] - now))}"
            rows.append({"where": where, "why": f"{when} for {format_duration(window['end'] - window['start'])}: {window.get('reason', '')} "
                                                 "(a lease that would run into it waits until after it)"})
    return rows


def _gpu_amount(x: float) -> str:
    """An amount of GPU compute in words: 'a whole GPU', 'half a GPU', '0.75 of a GPU', '3 GPUs'."""
    if abs(x - 1) < 1e-9:
        return "a whole GPU"
    if x < 1:
        return {0.5: "half a GPU", 0.25: "a quarter of a GPU"}.get(round(x, 3), f"{x:g} of a GPU")
    return f"{x:g} GPUs"


def _share_room(c: dict) -> str:
    total, largest = float(c.get("free_share", 0)), float(c.get("largest_free_share", 0))
    if total <= 0:
        return "none free"
    if abs(total - largest) < 1e-9:
        return f"{_gpu_amount(total)} free"
    return f"{_gpu_amount(total)} free in all; the largest share that fits is {_gpu_amount(largest)}"


def period_words(seconds: float) -> str:
    """604800 → 'week', 86400 → 'day', 30 days → '30 days', else a duration."""
    days = seconds / 86400
    if abs(days - 7) < 1e-6:
        return "week"
    if abs(days - 1) < 1e-6:
        return "day"
    if days >= 2 and abs(days - round(days)) < 1e-6:
        return f"{round(days)} days"
    return format_duration(seconds)


# --------------------------------------------------------------------------- quota
def gpu_cap(usage: dict | None) -> float | None:
    """The most GPUs the user may ever hold at once: the smallest of their own and their groups' ``max_gpus``."""
    usage = usage or {}
    caps = [usage.get("max_gpus")]
    caps += [(g or {}).get("max_gpus") for g in (usage.get("group_quotas") or {}).values()]
    nums = [float(c) for c in caps if isinstance(c, (int, float)) and not isinstance(c, bool)]
    return min(nums) if nums else None


def quota_text(usage: dict | None) -> str:
    """The caller's quota in words: 'You hold 0.5 of at most 2 GPUs (group students: 1 of 2 held); 3.0 of 100 GPU-hours used this week.'"""
    if not usage:
        return ""
    parts = []
    held = usage.get("gpus_held")
    cap = usage.get("max_gpus")
    if held is not None:
        s = f"You hold {float(held):g} GPU{'' if float(held) == 1 else 's'}"
        if cap is not None:
            s += f" of at most {float(cap):g}"
        groups = [f"group {name}: {float(g.get('gpus_held') or 0):g} of {float(g['max_gpus']):g} held by its members"
                  for name, g in sorted((usage.get("group_quotas") or {}).items()) if (g or {}).get("max_gpus") is not None]
        if groups:
            s += f" ({'; '.join(groups)})"
        parts.append(s)
    used, hours = usage.get("gpu_hours_used"), usage.get("gpu_hours")
    period = usage.get("period_s")
    per = f" per {period_words(float(period))}" if period else ""
    if hours is not None and used is not None:
        parts.append(f"{float(used):.1f} of {float(hours):g} GPU-hours used{per}")
    return "; ".join(parts) + "." if parts else ""


# --------------------------------------------------------------------------- the choices
@dataclass
class Choice:
    """One card of the form."""

    value: str  # the radio value: 'gpu:2:L4', 'share:0.5:L4', 'mig:3g.40gb:A100…', 'preset:a100', 'cpu'
    title: str  # '2 × L4'
    detail: str  # '22 GB of GPU memory each'
    request: dict | None  # None: CPU only
    group: str = ""  # the heading it goes under (the model)
    description: str = ""
    free: str = ""  # '3 of 4 free'
    free_now: bool = False
    tier: str | None = None  # a preset's fixed tier
    duration_s: float | None = None  # a preset's fixed duration
    estimates: dict[str, dict] = field(default_factory=dict)  # tier ('' for a preset) -> the estimate shown
    disabled: str = ""  # why it cannot be picked (from the broker's estimate)
    hints: list[str] = field(default_factory=list)  # right-sizing suggestions that point at this card

    @property
    def dom_id(self) -> str:
        return "gpulease-choice-" + "".join(c if c.isalnum() else "-" for c in self.value)

    @property
    def model(self) -> str:
        """The one model (or glob) this card asks for; '' for any or several (the environments' check on the page)."""
        models = _models(self.request or {})
        return models[0] if len(models) == 1 else ""


def _gb(mib: float) -> str:
    gb = mib / 1024
    return f"{gb:.0f} GB" if gb >= 10 else f"{gb:.1f} GB".replace(".0 GB", " GB")


def custom_choices(pool: dict, *, cap: float | None = None) -> list[Choice]:
    """The free-choice cards for whole GPUs, shares and MIG profiles, per model; none over ``cap`` GPUs."""
    out: list[Choice] = []
    capacity = pool.get("capacity") or {}
    for model, p in sorted(pool_models(pool).items()):
        name = display_model(model, p["memory_mib"])
        c = capacity.get(model) or {}
        most = max(p["per_node"].values(), default=0)
        if cap is not None:
            most = min(most, math.floor(cap + 1e-9))
        idle = int(c.get("idle_gpus", 0))
        for n in range(1, most + 1):
            out.append(Choice(
                value=f"gpu:{n}:{model}", title=f"{n} × {model}", group=name, request={"kind": "gpu", "gpus": n, "model": model},
                detail=f"{_gb(p['memory_mib'])} of GPU memory{' each' if n > 1 else ''}, the whole GPU{'s' if n > 1 else ''}",
                free=f"{idle} of {p['shareable']} idle", free_now=idle >= n))
        if p["shareable"]:
            largest = float(c.get("largest_free_share", 0))
            for s in SHARE_CHOICES:
                if cap is not None and s > cap + 1e-9:
                    continue
                out.append(Choice(
                    value=f"share:{s:g}:{model}", title=f"{_share_words(s)} of one {model}", group=name,
                    request={"kind": "share", "share": s, "model": model},
                    detail=f"{_gb(p['memory_mib'] * s)} of GPU memory and {s:.0%} of its compute, sharing the GPU with others",
                    free=f"room now for up to {_gpu_amount(largest)}" if largest else "no share free now", free_now=largest >= s))
        for prof in sorted(p["mig_profiles"]):
            m = (c.get("mig") or {}).get(prof) or {}
            free = int(m.get("free", 0))
            out.append(Choice(
                value=f"mig:{prof}:{model}", title=f"MIG {prof} of {model}", group=name,
                request={"kind": "mig", "mig_profile": prof, "model": model},
                detail=f"{_mig_memory(prof)} of GPU memory in a MIG slice (isolated by the GPU)",
                free=f"{free} of {int(m.get('total', 0))} free", free_now=free > 0))
    return out


def _share_words(s: float) -> str:
    return {0.5: "Half", 0.25: "A quarter"}.get(s, f"A {s:g} share")


def _mig_memory(profile: str) -> str:
    tail = profile.split(".")[-1].lower()
    return tail[:-2] + " GB" if tail.endswith("gb") else "its profile's share"


def preset_choices(presets: list[Preset], pool: dict | None, queue: list[dict]) -> list[Choice]:
    out = []
    for p in presets:
        if p.cpu_only:
            out.append(Choice(value=f"preset:{p.slug}", title=p.display_name, detail="no GPU", request=None,
                              description=p.description, free="starts now", free_now=True))
            continue
        a = availability(p.request, pool, queue=queue) if pool is not None else None
        detail = [describe_request(p.request, pool)]
        if p.tier:
            detail.append(f"tier {p.tier}")
        if p.duration_s:
            detail.append(f"for {format_duration(p.duration_s)}")
        out.append(Choice(value=f"preset:{p.slug}", title=p.display_name, detail=" · ".join(detail), request=dict(p.request),
                          description=p.description, free=a.text() if a else "availability unknown", free_now=bool(a and a.free_now),
                          tier=p.tier, duration_s=p.duration_s))
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
    """The posted form (a dict of lists of strings) → ``user_options`` in the REST API's shape
    (with ``environment``, the engine's option, where the form has an environment section)."""
    first = {k: (v[0] if isinstance(v, list) and v else v) for k, v in form.items()}
    first = {k: v.strip() if isinstance(v, str) else v for k, v in first.items()}
    out: dict[str, Any] = {}
    choice = first.get("choice") or ""
    if choice.startswith("preset:"):
        out["preset"] = choice.split(":", 1)[1]
    elif choice:
        out.update(choice_to_request(choice))
    if first.get("environment"):
        out["environment"] = first["environment"]
    if out.get("kind") != "cpu":
        if first.get("tier") and "preset" not in out:
            out["tier"] = first["tier"]
        if first.get("duration_h") and "preset" not in out:
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


# --------------------------------------------------------------------------- estimates
def estimate_words(est: dict | None, now: float) -> tuple[str, str]:
    """The broker's estimate for one ask → (css kind 'now'|'wait'|'never'|'unknown', words)."""
    if not est:
        return "unknown", ""
    start = est.get("start")
    if start == "now":
        if est.get("short_grant") and est.get("duration_s"):
            why = f": {est['short_why']}" if est.get("short_why") else ""
            return "now", f"starts now, for {format_duration(float(est['duration_s']))} only{why}"
        return "now", "starts now"
    if start == "never":
        refused = est.get("refused") or {}
        return "never", refused.get("message") or "this request cannot be granted"
    pos, length = est.get("position"), est.get("length")
    where = f"you would be {_ordinal(pos)} in the queue" if pos else "you would wait in the queue"
    if length:
        where += f" ({length} waiting now)" if not pos else ""
    eta = est.get("eta")
    if eta is None:
        when = "no estimate of the start yet"
    elif float(eta) - now < 60:
        when = "starts within a minute"
    else:
        when = f"starts in about {format_duration(float(eta) - now)}"
    return "wait", f"{where}; {when}"


def _ordinal(n: int) -> str:
    n = int(n)
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def estimate_asks(choices: list[Choice], tiers: list[dict], *, user: str, groups: list[str]) -> list[tuple[str, str, dict]]:
    """(choice value, tier or '', body of POST api/estimate's ask) for every card and every tier it can be asked in."""
    out = []
    for c in choices:
        if c.request is None:
            continue
        base = {**c.request, "user": user}
        if groups:
            base["groups"] = list(groups)
        if c.value.startswith("preset:"):
            body = dict(base)
            if c.tier:
                body["tier"] = c.tier
            if c.duration_s:
                body["duration_s"] = c.duration_s
            out.append((c.value, "", body))
            continue
        for t in tiers or [{"name": ""}]:
            body = dict(base)
            if t["name"]:
                body["tier"] = t["name"]
            out.append((c.value, t["name"], body))
    return out


# --------------------------------------------------------------------------- right-sizing hints
def suggested_request(suggested: dict | None) -> dict | None:
    """A suggestion's ``suggested`` card (kind mig/share/whole, with profile/fraction/gpus and model)
    as the request fields of a card: {'kind': 'mig', 'mig_profile': '1g.10gb', 'model': 'A100…'}."""
    if not isinstance(suggested, dict):
        return None
    kind, model = suggested.get("kind"), suggested.get("model")
    out: dict[str, Any]
    if kind == "mig":
        profile = suggested.get("mig_profile") or suggested.get("profile")
        if not profile:
            return None
        out = {"kind": "mig", "mig_profile": str(profile)}
    elif kind == "share":
        share = suggested.get("share", suggested.get("fraction"))
        if not isinstance(share, (int, float)) or isinstance(share, bool):
            return None
        out = {"kind": "share", "share": float(share)}
    elif kind in ("whole", "gpu"):
        gpus = suggested.get("gpus", 1)
        if not isinstance(gpus, int) or isinstance(gpus, bool):
            return None
        out = {"kind": "gpu", "gpus": gpus}
    else:
        return None
    if model:
        out["model"] = model[0] if isinstance(model, list) and len(model) == 1 else model
    return out


def _card_matches(request: dict | None, want: dict) -> bool:
    if not request or _kind(request) != want["kind"]:
        return False
    for k in ("mig_profile", "share", "gpus"):
        if k in want:
            have = request.get(k, 1 if k == "gpus" else None)
            if have is None or (float(have) != float(want[k]) if k == "share" else str(have) != str(want[k])):
                return False
    if want.get("model"):
        models = _models(request)
        wanted = want["model"] if isinstance(want["model"], list) else [want["model"]]
        return bool(models) and all(any(_matches(m, [w]) for w in wanted) for m in models)
    return True


def duration_hint(suggestion: dict) -> float | None:
    """The duration (seconds) a suggestion suggests, when that is what it is about."""
    d = (suggestion.get("suggested") or {}).get("duration_s") if isinstance(suggestion.get("suggested"), dict) else None
    return float(d) if isinstance(d, (int, float)) and not isinstance(d, bool) and d > 0 else None


def attach_hints(suggestions: list[dict], cards: list[Choice], *, durations: bool = False) -> tuple[list[str], list[dict]]:
    """Put each right-sizing suggestion on the card it suggests (the first that matches, presets
    first), or, one about the duration when the form has a duration field (``durations``), by that
    field. Returns (texts that match no card, shown above the cards; duration hints as
    {"text", "hours"}). The choice the form starts with is not touched: a hint only says."""
    loose, by_duration = [], []
    for s in suggestions or []:
        text = (s or {}).get("text") or ""
        if not text:
            continue
        seconds = duration_hint(s)
        if seconds is not None and durations:
            by_duration.append({"text": text, "hours": f"{seconds / 3600:g}"})
            continue
        want = suggested_request(s.get("suggested"))
        card = next((c for c in cards if want and not c.disabled and _card_matches(c.request, want)), None)
        if card is None:
            loose.append(text)
        elif text not in card.hints:
            card.hints.append(text)
    return loose, by_duration


# --------------------------------------------------------------------------- environments
def environment_cards(environments: list[EnvironmentOffer], previous: dict) -> tuple[list[dict], str]:
    """The environment section's cards (dicts for the template) and the name checked: the previous
    choice, else the default, else the first offered; one not offered is a disabled card with its reason."""
    cards = []
    for o in environments:
        e = o.env
        cards.append({
            "value": e.name,
            "dom_id": "gpulease-env-" + "".join(c if c.isalnum() else "-" for c in e.name),
            "title": e.display_name,
            "detail": " · ".join([o.cuda_words] + ([o.models_words] if e.models else []) + ([] if e.cpu_only_ok else ["needs a GPU"])),
            "image": e.image,
            "description": e.description,
            "status": o.ready_words if o.offered else f"not offered here: {o.reason}",
            "kind": ("now" if o.present else "wait") if o.offered else "never",
            "disabled": not o.offered,
            "models": " ".join(e.models),
            "cpu_ok": e.cpu_only_ok,
        })
    offered = [c["value"] for c in cards if not c["disabled"]]
    default = next((o.env.name for o in environments if o.env.default), "")
    prev = previous.get("environment")
    checked = next((v for v in (prev, default) if v and v in offered), offered[0] if offered else "")
    return cards, checked


# --------------------------------------------------------------------------- the page
def tier_rows(pool: dict | None) -> list[dict]:
    """The tiers the user may pick, highest priority first, with their limits in words."""
    rows = []
    for t in sorted((pool or {}).get("tiers") or [], key=lambda t: -int(t.get("priority", 0))):
        limits = [f"up to {format_duration(float(t.get('max_duration_s') or 0))}"]
        if t.get("default_duration_s"):
            limits.append(f"{format_duration(float(t['default_duration_s']))} unless you choose")
        if t.get("preemptible"):
            by = ", ".join(t.get("preempted_by") or []) or "higher tiers"
            grace = f" after a {format_duration(float(t['grace_s']))} warning" if t.get("grace_s") else ""
            limits.append(f"{by} may preempt it{grace}")
        rows.append({"name": t["name"], "limits": "; ".join(limits), "description": t.get("description") or "",
                     "max_duration_s": float(t.get("max_duration_s") or 0), "default_duration_s": float(t.get("default_duration_s") or 0)})
    return rows


def _form_choices(pool: dict | None, presets: list[Preset], queue: list[dict], tiers: list[dict], *, allow_custom: bool,
                  allow_cpu_only: bool, cap: float | None, estimates: dict[tuple[str, str], dict] | None,
                  now: float) -> tuple[list[Choice], list[Choice]]:
    """The preset cards and the custom cards, each with the broker's estimate per tier in words."""
    cards: list[Choice] = preset_choices(presets, pool, queue)
    custom: list[Choice] = []
    if allow_custom and pool is not None:
        custom = custom_choices(pool, cap=cap)
        if allow_cpu_only and not any(p.cpu_only for p in presets):
            custom.append(Choice(value="cpu", title="No GPU", detail="a CPU-only server", request=None,
                                    free="starts now", free_now=True, group="Without a GPU"))
    elif not presets and allow_cpu_only:
        custom = [Choice(value="cpu", title="No GPU", detail="a CPU-only server", request=None, free="starts now", free_now=True,
                         group="Without a GPU")]
    for c in cards + custom:
        for key_tier in ([""] if c.value.startswith("preset:") else [t["name"] for t in tiers] or [""]):
            est = (estimates or {}).get((c.value, key_tier))
            kind, words = estimate_words(est, now)
            c.estimates[key_tier] = {"kind": kind, "words": words}
        if c.value.startswith("preset:") and c.estimates.get("", {}).get("kind") == "never":
            c.disabled = c.estimates[""]["words"]
    return cards, custom


def _checked_value(cards: list[Choice], custom: list[Choice], presets: list[Preset], previous: dict) -> str:
    """Which card starts checked: the previous choice, else the default preset, else the first free GPU."""
    values = [c.value for c in cards + custom if not c.disabled]
    prev_value = ""
    if previous.get("preset"):
        prev_value = f"preset:{previous['preset']}"
    elif previous.get("kind") == "cpu":
        prev_value = "cpu"
    elif any(k in previous for k in ("gpus", "share", "mig_profile")):
        want = {k: str(previous[k]) for k in ("gpus", "share", "mig_profile") if k in previous}
        for c in custom:
            if c.request and all(str(c.request.get(k)) == v for k, v in want.items()) and (
                    not previous.get("model") or str(c.request.get("model")) == str(previous.get("model"))):
                prev_value = c.value
                break
    checked = prev_value if prev_value in values else ""
    if not checked and presets:
        d = default_preset(presets)
        checked = f"preset:{d.slug}" if f"preset:{d.slug}" in values else ""
    if not checked:
        checked = next((c.value for c in custom if c.request is not None and c.free_now), values[0] if values else "")
    return checked


def _card_groups(custom: list[Choice]) -> list[tuple[str, list[Choice]]]:
    """The custom cards in runs of one group, in their order."""
    groups: list[tuple[str, list[Choice]]] = []
    for c in custom:
        if not groups or groups[-1][0] != c.group:
            groups.append((c.group, []))
        groups[-1][1].append(c)
    return groups


def _duration_rows(pool: dict | None, tiers: list[dict], chosen_tier: str | None) -> tuple[list[dict], float, str]:
    """The durations offered (within the pool's minimum and the longest tier), the minimum, the chosen tier's default in words."""
    min_s = float((pool or {}).get("min_duration_s") or 0)
    longest = max((t["max_duration_s"] for t in tiers), default=max(DURATION_CHOICES_H) * 3600)
    durations = [{"hours": f"{h:g}", "words": format_duration(h * 3600), "seconds": h * 3600}
                 for h in DURATION_CHOICES_H if min_s <= h * 3600 <= longest]
    default_words = ""
    for t in tiers:
        if t["name"] == chosen_tier and t["default_duration_s"]:
            default_words = format_duration(t["default_duration_s"])
    return durations, min_s, default_words


def render_form(
    pool: dict | None,
    *,
    presets: list[Preset] = (),
    allow_custom: bool = True,
    allow_cpu_only: bool = True,
    queue: list[dict] = (),
    estimates: dict[tuple[str, str], dict] | None = None,
    previous: dict | None = None,
    error: str = "",
    now: float | None = None,
    suggestions: list[dict] | None = None,
    environments: list[EnvironmentOffer] | None = None,
) -> str:
    """The HTML of the spawn form (JupyterHub wraps it in a <form> with the Start button).

    ``environments``: the engine's images as offered here (:func:`.environments.offers`), shown
    first as the "Environment" section; None: no such section.

    ``estimates``: the broker's estimate per (choice value, tier name or '' for a preset); None
    when the broker gave none (the cards then say only what is free now). ``suggestions``: the
    user's right-sizing suggestions (``GET api/usage/suggestions``), each shown on the card it
    suggests, or above the cards when none matches.
    """
    now = time.time() if now is None else now
    previous = previous or {}
    presets = list(presets)
    usage = (pool or {}).get("usage") or {}
    cap = gpu_cap(usage)
    tiers = tier_rows(pool)
    default_tier = (pool or {}).get("default_tier")
    if tiers and default_tier not in [t["name"] for t in tiers]:
        default_tier = tiers[0]["name"]
    chosen_tier = previous.get("tier") if previous.get("tier") in [t["name"] for t in tiers] else default_tier

    cards, custom = _form_choices(pool, presets, list(queue), tiers, allow_custom=allow_custom, allow_cpu_only=allow_cpu_only,
                                  cap=cap, estimates=estimates, now=now)
    checked = _checked_value(cards, custom, presets, previous)
    has_duration_field = bool(custom and any(c.request is not None for c in custom))
    loose_hints, duration_hints = attach_hints(list(suggestions or []), cards + custom, durations=has_duration_field)
    durations, min_s, default_words = _duration_rows(pool, tiers, chosen_tier)

    over_cap = cap is not None and cap < 1 and not any(c.request and c.request.get("kind") == "gpu" for c in custom)
    env_cards, env_checked = environment_cards(list(environments), previous) if environments is not None else ([], "")
    return _env.get_template("spawn_form.html").render(
        error=error,
        environments=env_cards,
        environment_checked=env_checked,
        pool=pool,
        quota=quota_text(usage),
        cap=cap,
        over_cap=over_cap,
        queue_length=(pool or {}).get("queue_length"),
        overview=overview(pool, list(queue)) if pool is not None else [],
        unavailable=unavailable(pool, now),
        presets=cards,
        groups=_card_groups(custom),
        allow_custom=allow_custom,
        checked=checked,
        tiers=tiers,
        chosen_tier=chosen_tier,
        durations=durations,
        prev_duration=str(previous.get("duration_h") or ""),
        default_words=default_words,
        min_duration=format_duration(min_s) if min_s else "",
        waits=[{"minutes": m, "words": format_duration(m * 60)} for m in WAIT_CHOICES_MIN],
        prev_wait=str(previous.get("max_wait_min") or ""),
        has_estimates=bool(estimates),
        hints=loose_hints,
        duration_hints=duration_hints,
        suggested_hours={h["hours"] for h in duration_hints},
        custom_hinted=any(c.hints for c in custom),
    )


async def render_for(broker, *, user: str, groups: list[str], presets: list[Preset], allow_custom: bool, allow_cpu_only: bool,
                     previous: dict | None = None, log: logging.Logger | None = None, now: float | None = None,
                     environments: list[EnvironmentOffer] | None = None) -> str:
    """Fetch the pool, the queue and the broker's estimates for every card, and render the form
    (with the engine's ``environments`` section first, where it offers any).

    ``broker`` is a :class:`~jupyter_gpulease.client.BrokerClient` acting for ``user`` (admin token), or None
    when the hub has no broker configured.
    Without the broker the form still renders (CPU only, or the presets without availability).
    """
    from ..client import BrokerError

    log = log or logging.getLogger(__name__)
    pool, queue, estimates, error, suggestions = None, [], None, "", []
    if broker is None:
        error = "GPU leases are not configured on this hub (the administrator sets c.GPULeaseSpawner.broker_url)."
    else:
        hints = asyncio.ensure_future(_suggestions(broker, user, log))
        try:
            pool, queue = await asyncio.gather(broker.pool(user=user, groups=groups), broker.queue())
        except BrokerError as e:
            log.warning("Spawn form for %s without the pool: %s", user, e)
            error = "The GPU lease broker is not answering right now, so availability is unknown."
        suggestions = await hints
    if pool is not None:
        cards = preset_choices(list(presets), pool, queue)
        if allow_custom:
            cards += custom_choices(pool, cap=gpu_cap(pool.get("usage")))
        asks = estimate_asks(cards, pool.get("tiers") or [], user=user, groups=groups)
        if asks:
            bodies = [a[2] for a in asks]
            try:
                parts = await asyncio.gather(*(broker.estimate(bodies[i:i + ESTIMATES_PER_CALL])
                                               for i in range(0, len(bodies), ESTIMATES_PER_CALL)))
                answers = [est for part in parts for est in part]
                estimates = {(value, tier): est for (value, tier, _), est in zip(asks, answers, strict=False)}
            except BrokerError as e:
                log.warning("Spawn form for %s without estimates: %s", user, e)
    return render_form(pool, presets=presets, allow_custom=allow_custom, allow_cpu_only=allow_cpu_only, queue=queue,
                       estimates=estimates, previous=previous, error=error, now=now, suggestions=suggestions,
                       environments=environments)


async def _suggestions(broker, user: str, log: logging.Logger) -> list[dict]:
    """``user``'s right-sizing suggestions, or none when the broker has none to give (an older
    broker, usage records off, not answering): the form never waits long or fails for a hint."""
    from ..client import BrokerError

    ask = getattr(broker, "usage_suggestions", None)
    if ask is None:
        return []
    try:
        async with asyncio.timeout(5):
            return [s for s in await ask(user) if (s or {}).get("user") == user]
    except (BrokerError, TimeoutError) as e:
        log.info("Spawn form for %s without right-sizing hints: %s", user, e)
        return []
