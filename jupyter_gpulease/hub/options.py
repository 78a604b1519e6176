"""What a spawn asks for: user options (form or REST API) checked into a :class:`LeaseChoice`.

Pure functions, no I/O and no jupyterhub import, so they are tested on their own. The
spawner calls :func:`parse_user_options` with the admin's presets and (when the broker
answered) the live pool, and turns :class:`OptionsError` into a spawn failure whose message
the user reads on the spawn page or in the REST API's answer.

Accepted ``user_options`` (all optional; ``{}`` means "the default")::

    {"preset": "a100"}                              # a named preset of the admin
    {"gpus": 2, "model": "A100*", "tier": "experiment", "duration_h": 4}
    {"share": 0.5, "model": "L4"}                   # a 0.5 share of one L4: half its memory and compute, shared
    {"mig_profile": "3g.40gb"}
    {"kind": "cpu"}                                 # no GPU
    ... plus "duration_s" (or "duration_h"), "max_wait_s" (or "max_wait_min"), "min_memory_mib", "memory_mib"
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..core.model import BadRequest
from ..core.pool import pool_from_devices
from ..core.request import Ask, parse_ask, parse_request
from ..core.text import format_duration

REQUEST_KEYS = ("kind", "gpus", "share", "memory_mib", "mig_profile", "model", "min_memory_mib")
TIME_KEYS = ("tier", "duration_s", "duration_h", "max_wait_s", "max_wait_min")
KNOWN_KEYS = frozenset(("preset",) + REQUEST_KEYS + TIME_KEYS)
PRESET_KEYS = frozenset(("slug", "display_name", "description", "request", "cpu_only", "tier", "duration_s", "max_wait_s", "default"))


class OptionsError(ValueError):
    """The user's options can't be used; ``message`` says what to change, ``field`` which option."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.message = message
        self.field = field


@dataclass(frozen=True)
class LeaseChoice:
    """One spawn's GPU choice. ``request`` is None for a CPU-only server (no lease)."""

    request: dict[str, Any] | None
    tier: str | None = None
    duration_s: float | None = None
    max_wait_s: float | None = None
    preset: str = ""
    label: str = ""

    @property
    def cpu_only(self) -> bool:
        return self.request is None

    def broker_body(self, *, user: str, server: str = "", groups: list[str] | tuple[str, ...] = (), meta: dict | None = None,
                    max_wait_s: float | None = None) -> dict[str, Any]:
        """The body of ``POST api/leases`` for this choice, acting for ``user`` (admin path)."""
        if self.request is None:
            raise ValueError("a CPU-only choice needs no lease")
        body: dict[str, Any] = dict(self.request)
        body["user"] = user
        body["server"] = server
        if groups:
            body["groups"] = list(groups)
        if self.tier:
            body["tier"] = self.tier
        if self.duration_s is not None:
            body["duration_s"] = self.duration_s
        waits = [w for w in (self.max_wait_s, max_wait_s) if w is not None]
        if waits:
            body["max_wait_s"] = min(waits)
        if meta:
            body["meta"] = dict(meta)
        return body


# --------------------------------------------------------------------------- presets
@dataclass(frozen=True)
class Preset:
    """An admin-defined named option (like KubeSpawner's ``profile_list`` entries)."""

    slug: str
    display_name: str
    description: str = ""
    request: dict[str, Any] | None = None  # None: CPU only
    tier: str | None = None
    duration_s: float | None = None
    max_wait_s: float | None = None
    default: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def cpu_only(self) -> bool:
        return self.request is None


def parse_presets(raw: Any) -> list[Preset]:
    """Check the admin's ``lease_presets`` config; ``ValueError`` says which entry is wrong."""
    if not isinstance(raw, (list, tuple)):
        raise ValueError("lease_presets must be a list of dicts")
    out: list[Preset] = []
    seen: set[str] = set()
    for i, p in enumerate(raw):
        where = f"lease_presets[{i}]"
        if not isinstance(p, dict):
            raise ValueError(f"{where} must be a dict, got {type(p).__name__}")
        unknown = sorted(set(p) - PRESET_KEYS)
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {unknown}; known: {sorted(PRESET_KEYS)}")
        slug = p.get("slug")
        if not isinstance(slug, str) or not slug.strip() or any(c.isspace() for c in slug):
            raise ValueError(f"{where}: 'slug' must be a short name without spaces, like 'a100-whole'")
        if slug in seen:
            raise ValueError(f"{where}: slug {slug!r} is used twice")
        seen.add(slug)
        cpu_only = bool(p.get("cpu_only")) or p.get("request") is None
        request = None
        if not cpu_only:
            if not isinstance(p["request"], dict):
                raise ValueError(f"{where}: 'request' must be a dict such as {{'gpus': 1, 'model': 'A100*'}}")
            try:
                parse_request(p["request"])
            except BadRequest as e:
                raise ValueError(f"{where}: {e.message}") from None
            request = dict(p["request"])
        for k in ("duration_s", "max_wait_s"):
            v = p.get(k)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0):
                raise ValueError(f"{where}: {k!r} must be a positive number of seconds")
        out.append(Preset(
            slug=slug,
            display_name=str(p.get("display_name") or slug),
            description=str(p.get("description") or ""),
            request=request,
            tier=p.get("tier"),
            duration_s=p.get("duration_s"),
            max_wait_s=p.get("max_wait_s"),
            default=bool(p.get("default")),
        ))
    if sum(p.default for p in out) > 1:
        raise ValueError("lease_presets: more than one preset has 'default': True")
    return out


def default_preset(presets: list[Preset]) -> Preset | None:
    for p in presets:
        if p.default:
            return p
    return presets[0] if presets else None


# --------------------------------------------------------------------------- numbers
def _times(opts: dict) -> Ask:
    """The duration and the wait limit of ``opts``, read by core's one parser (numbers, or "2h"-style
    durations; the option given is kept in ``duration_field``)."""
    body = {k: opts[k] for k in ("duration_s", "duration_h", "max_wait_s", "max_wait_min") if k in opts}
    try:
        return parse_ask(body, user="-")
    except BadRequest as e:
        raise OptionsError(e.message, e.field) from None


# --------------------------------------------------------------------------- the pool
def pool_models(pool: dict) -> dict[str, dict]:
    """Per model in the pool: memory, whole GPUs per node (non-MIG), MIG profiles."""
    out: dict[str, dict] = {}
    for d in pool.get("devices", []) or []:
        m = out.setdefault(d["model"], {"memory_mib": 0, "per_node": {}, "mig_profiles": set(), "gpus": 0, "shareable": 0})
        m["memory_mib"] = max(m["memory_mib"], int(d.get("memory_mib", 0)))
        m["gpus"] += 1
        if d.get("mig"):
            m["mig_profiles"].update(i["profile"] for i in d["mig"])
        else:  # unhealthy GPUs too: a drained node comes back, and the request waits for it
            m["per_node"][d["node"]] = m["per_node"].get(d["node"], 0) + 1
            m["shareable"] += 1
    return out


def check_against_pool(request: dict, tier: str | None, duration_s: float | None, pool: dict, *,
                       duration_field: str = "duration_s") -> None:
    """Catch what can never work with this pool and these tiers, with the broker's own words.

    Whether the request fits the pool's devices is core's :meth:`Pool.why_never` on the devices
    of the broker's ``GET api/pool``; tiers and durations are checked against the tiers the
    broker lists for this user. The broker decides in the end (quotas, the queue).
    """
    if not pool.get("devices"):
        raise OptionsError("the GPU pool is empty right now; choose a CPU-only server or try again later", "model")
    why = pool_from_devices(pool["devices"]).why_never(parse_request(request))
    if why is not None:
        raise OptionsError(why[1], why[0])
    check_tier(tier, duration_s, pool, duration_field=duration_field)


def in_units(seconds: float, field: str) -> str:
    """A duration in the unit of the option the user gave it in: 'duration_h' → '100 h', 'duration_s' → '360000 s (4 d 4 h)'."""
    if field.endswith("_h"):
        hours = seconds / 3600
        return f"{hours:g} h" if (seconds % 900) == 0 else f"{hours:.3g} h ({format_duration(seconds)})"
    if field.endswith("_min"):
        return f"{seconds / 60:g} min"
    words = format_duration(seconds)
    return f"{seconds:g} s" + ("" if words == f"{seconds:g} s" else f" ({words})")


def check_tier(tier: str | None, duration_s: float | None, pool: dict, *, duration_field: str = "duration_s") -> None:
    """The tier is one the user may pick, and the duration within its limit and the hub's minimum.

    ``tier`` None means the broker's default tier; ``duration_field`` is the option the user
    gave the duration in, so the message names it ('duration_h') and speaks in hours or minutes.
    """
    tiers = {t["name"]: t for t in pool.get("tiers", []) or []}
    if not tiers:
        return  # the broker will say
    if tier is not None and tier not in tiers:
        raise OptionsError(f"tier {tier!r} is not one you may use; choose one of: {', '.join(tiers)}", "tier")
    name = tier if tier is not None else pool.get("default_tier")
    if duration_s is None:
        return
    def u(seconds):
        return in_units(float(seconds), duration_field)

    least = pool.get("min_duration_s")
    if least and duration_s < float(least):
        raise OptionsError(f"a duration of {u(duration_s)} is shorter than this hub's shortest lease, "
                           f"{u(least)}; ask for at least {u(least)}", duration_field)
    if name in tiers:
        limit = tiers[name].get("max_duration_s")
        if limit and duration_s > limit:
            which = f"the {name!r} tier's limit of" if tier is not None else f"the limit of the default tier, {name!r}:"
            raise OptionsError(
                f"a duration of {u(duration_s)} is over {which} {u(limit)}; ask for at most {u(limit)}, or pick another tier",
                duration_field)


# --------------------------------------------------------------------------- parse
def parse_user_options(
    opts: Any,
    *,
    presets: list[Preset] = (),
    allow_custom: bool = True,
    allow_cpu_only: bool = True,
    default_options: dict | None = None,
    pool: dict | None = None,
) -> LeaseChoice:
    """Check one spawn's ``user_options`` and return what to ask the broker for.

    ``presets``: the admin's named options; with ``allow_custom`` False only those can be used.
    ``pool``: the broker's ``GET api/pool`` answer, for early checks of models, counts, tiers
    and durations (None: leave every check to the broker). Raises :class:`OptionsError`.
    """
    if opts is None:
        opts = {}
    if not isinstance(opts, dict):
        raise OptionsError("user_options must be a JSON object such as {\"gpus\": 1, \"model\": \"A100*\"}")
    opts = {k: v for k, v in opts.items() if v is not None and v != ""}
    unknown = sorted(set(opts) - KNOWN_KEYS)
    if unknown:
        raise OptionsError(f"unknown option(s) {', '.join(map(repr, unknown))}; known options: {', '.join(sorted(KNOWN_KEYS))}", unknown[0])
    presets = list(presets)
    if not opts:
        p = default_preset(presets)
        if p is not None:
            opts = {"preset": p.slug}
        elif default_options:
            opts = dict(default_options)
        elif allow_cpu_only:
            opts = {"kind": "cpu"}
        else:
            opts = {"gpus": 1}

    times = _times(opts)
    duration_s, duration_field, max_wait_s = times.duration_s, times.duration_field, times.max_wait_s

    if "preset" in opts:
        return _preset_choice(opts, presets, times, pool)

    if opts.get("kind") == "cpu":
        if not allow_cpu_only:
            raise OptionsError("CPU-only servers are not offered here; ask for a GPU, a share or a MIG profile", "kind")
        extra = sorted(set(opts) - {"kind"})
        if extra:
            raise OptionsError(f"a CPU-only server has no lease: drop {', '.join(map(repr, extra))}", extra[0])
        return LeaseChoice(request=None, label="CPU only")

    if not allow_custom:
        choices = ", ".join(p.slug for p in presets)
        raise OptionsError(f"choose one of the presets with 'preset': {choices}", "preset")

    return _custom_choice(opts, duration_s, duration_field, max_wait_s, pool)


def _preset_choice(opts: dict, presets: list[Preset], times: Ask, pool: dict | None) -> LeaseChoice:
    """``{"preset": slug}`` (with at most a duration and a wait): the admin's named option."""
    duration_s, duration_field, max_wait_s = times.duration_s, times.duration_field, times.max_wait_s
    slug = opts["preset"]
    by_slug = {p.slug: p for p in presets}
    if not isinstance(slug, str) or slug not in by_slug:
        if not by_slug:
            raise OptionsError(f"unknown preset {slug!r}: this hub has no presets; ask with 'gpus', 'share' or "
                               "'mig_profile' instead", "preset")
        raise OptionsError(f"unknown preset {slug!r}; choose one of: {', '.join(by_slug)}", "preset")
    extra = sorted(set(opts) & set(REQUEST_KEYS + ("tier",)))
    if extra:
        raise OptionsError(f"a preset fixes what you get; drop {', '.join(map(repr, extra))} or drop 'preset'", extra[0])
    p = by_slug[slug]
    if p.cpu_only:
        if duration_s is not None:
            raise OptionsError("a CPU-only server has no lease: drop the duration", "duration_s")
        return LeaseChoice(request=None, preset=p.slug, label=p.display_name)
    duration_s = duration_s if duration_s is not None else p.duration_s
    if pool is not None:
        check_tier(p.tier, duration_s, pool, duration_field=duration_field)
    waits = [w for w in (max_wait_s, p.max_wait_s) if w is not None]
    return LeaseChoice(request=dict(p.request), tier=p.tier, duration_s=duration_s, max_wait_s=min(waits) if waits else None,
                       preset=p.slug, label=p.display_name)


def _custom_choice(opts: dict, duration_s: float | None, duration_field: str, max_wait_s: float | None,
                   pool: dict | None) -> LeaseChoice:
    """GPUs, a share or a MIG profile asked for by the user (where the hub allows custom options)."""
    request = {k: opts[k] for k in REQUEST_KEYS if k in opts}
    if request.get("kind") == "gpu" and "gpus" not in request:
        request["gpus"] = 1
    try:
        req = parse_request(request)
    except BadRequest as e:
        raise OptionsError(_explain(e), e.field) from None
    tier = opts.get("tier")
    if tier is not None and not isinstance(tier, str):
        raise OptionsError(f"'tier' must be a tier name, got {tier!r}", "tier")
    if pool is not None:
        check_against_pool(request, tier, duration_s, pool, duration_field=duration_field)
    normal = req.to_dict()
    if not normal.get("memory_mib"):
        normal.pop("memory_mib", None)  # 0: sized by the share (the broker wants a positive value or none)
    return LeaseChoice(request=normal, tier=tier, duration_s=duration_s, max_wait_s=max_wait_s, label=req.describe())


def _explain(e: BadRequest) -> str:
    if e.field == "gpus" and "at least" in e.message:
        return f"{e.message}: ask for 1 or more whole GPUs, or a 'share' of one GPU"
    return e.message
