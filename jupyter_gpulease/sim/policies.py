"""The policies a replay compares, each expressed as a core :class:`Policy` plus the few
things a policy decides outside the scheduler (how a request is rounded, which tier a QoS
class maps to, when an idle session loses its GPU).

Built in:

1. ``static`` -- whole GPUs (a share takes a whole GPU), strict FCFS, held until the work or
   session ends, no time limit, no preemption.
2. ``static+backfill`` -- the same, but any waiting request that fits starts now (what the
   Kubernetes default scheduler does): no reservations, so large requests can starve.
3. ``static+culler`` -- static + backfill, and a notebook server is culled after a fixed idle
   time, whatever its GPU does (jupyterhub-idle-culler).
4. ``gpulease`` -- shares packed onto GPUs, tiers from QoS, time limits with extension,
   preemption of the learning tier, backfill with reservations (cannot starve large requests),
   and idle reclaim exactly as the server extension does it by default: the idle rule of
   :class:`~jupyter_gpulease.core.idle.IdleSettings` with its defaults, the reclaim action of
   the extension's default (suspend), each session standing for a user with no earlier gaps.

More come from a config file (TOML or JSON), see :func:`load_policy_file`, and from an admin's
``jupyter_server_config.py``, see :func:`from_server_config`.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field, replace
from typing import Any

from traitlets import TraitError
from traitlets.config import Config
from traitlets.config.loader import DeferredConfig

from ..core.idle import IDLE_NAMES, IdleRule, IdleSettings
from ..core.policy import DEFAULT_TIERS, HOUR, SETTINGS, Policy, Tier
from ..core.renames import EXTENSION_SECTION, POLICY_SECTION, migrate_config

log = logging.getLogger(__name__)

NEVER = 100 * 365 * 24 * HOUR  # "no time limit"

# QoS class of the Alibaba trace -> tier of the gpulease policy. LS (latency-sensitive) and
# Guaranteed are the cluster's priority work; Burstable is ordinary; BE (best effort) may be
# preempted. Notebook sessions are day-to-day research.
GPULEASE_QOS_TIERS = {"LS": "production", "Guaranteed": "production", "Burstable": "experiment", "BE": "learning", "notebook": "experiment"}

# Preemption grace (seconds) of the learning tier when its leases are batch pods, as in the
# Alibaba replay. ASSUMPTION: a preempted pod is stopped the way Kubernetes stops any pod,
# with terminationGracePeriodSeconds, whose default is 30 s (the pod resumes its remaining
# work when it is recreated, see the replay). The core default of 10 min is for people at a
# notebook, who need time to save their work; a pod has no one to warn.
BATCH_GRACE_S = 30.0

# Step of the non-preemptible tiers' leases for batch pods: a lease runs at most this long before
# it must be extended, and an extension is refused while a lease entitled to its GPUs waits.
# CHOICE, derived from the target that multi-GPU pods start within an hour: without preempting
# non-preemptible work, a node drains only as fast as its leases' steps end. The core default
# (24 h for production) suits people, who should not be asked to renew every hour.
BATCH_STEP_S = HOUR
# Batch pods asking for several whole GPUs age after this fraction of the aging time (the core
# default, 1, suits the notebook replay better). CHOICE among 1, 0.5 and 0.25 on the contended
# Alibaba replay (benchmarks/sim/step_sweep.txt): 0.5 kept the 10-minute share and multi-GPU waits best.
BATCH_MULTI_GPU_AGING = 0.5


def describe_idle(rule: IdleRule, action: str = "reclaim", *, prior: bool = True) -> str:
    """The idle rule in the words of a replay, where each session stands for a user."""
    if rule.learn and rule.method == "cost":
        cands = [c for c in rule.candidates_s if rule.min_s <= c <= rule.max_s]
        among = f" among {cands[0] / 60:g}-{cands[-1] / 60:g} min" if cands else ""
        return (
            f"learnt per session: T{among} minimising idle holding + {rule.regret_cost_s / 60:g} GPU-min per regretted reclaim, "
            + (f"over its own earlier gaps and a prior of {rule.prior_weight:g} pseudo-gaps from sessions seen so far"
               if prior and rule.prior_weight else f"over its own earlier gaps; {rule.default_s / 60:g} min until its first gap")
        )
    if rule.learn:
        return (
            f"learnt per session: p{rule.quantile:g} of its earlier gaps x {rule.factor:g}, "
            f"within {rule.min_s / 60:g}-{rule.max_s / 60:g} min; {rule.default_s / 60:g} min until {rule.min_gaps} gaps seen"
        )
    if rule.timeout_s is None:
        return "never"
    return f"fixed {rule.timeout_s / 60:g} min ({action})"


@dataclass(frozen=True)
class SimPolicy:
    """One policy of a comparison."""

    name: str
    policy: Policy
    description: str = ""
    whole_gpus: bool = False  # round a share up to one whole GPU
    qos_tiers: dict[str, str] = field(default_factory=dict)  # QoS class -> tier (missing: default tier)
    idle: IdleRule = field(default_factory=IdleRule)  # a raw core idle rule (used when idle_settings is None)
    # the idle rule as the server extension is configured (core.idle.IdleSettings): the rule of
    # each reclaim then follows what the reclaim really does to that session's kernel
    idle_settings: IdleSettings | None = None
    # learnt timeouts: also weigh a prior of every session's gaps so far (the server extension
    # knows only its own user's gaps: False replays it)
    idle_prior: bool = False
    idle_action: str = "reclaim"  # "reclaim" (GPU taken back, server kept) or "cull" (server stopped)
    # what an idle reclaim does to the session's kernel: "release" (the GPU is taken back; the
    # kernel's state is not modelled), "suspend" (cuda-checkpoint: the state waits in host
    # memory, the returning cell pays the wait for a GPU plus restore_s; single-GPU sessions
    # only) or "restart" (the state is lost: the returning cell pays the wait plus reload_s)
    reclaim_action: str = "release"
    restore_s: float = 0.0
    reload_s: float = 0.0
    suspend_multi_gpu: bool = False  # may a kernel on several GPUs be suspended (see gpulease_suspend)?
    strict_fcfs: bool = False  # documented expectation: only the head of the queue may start
    # does a replay of it take bookings (--bookings, --book-fraction)? The gpulease policies do, as
    # the broker does; the static ones stand for a cluster without bookings
    takes_bookings: bool = False

    def tier_for(self, qos: str) -> str:
        return self.qos_tiers.get(qos, self.policy.default_tier)

    def real_action(self, n_gpus: int) -> str:
        """What an idle reclaim really does to a kernel on ``n_gpus`` GPUs, in the server's words."""
        if self.reclaim_action == "suspend" and (n_gpus <= 1 or self.suspend_multi_gpu):
            return "suspend"
        return "restart"  # restart, a suspend that cannot work, or a release that does not model the kernel

    def idle_rule(self, n_gpus: int = 1) -> IdleRule:
        """The idle rule of a session whose kernel is on ``n_gpus`` GPUs."""
        if self.idle_settings is None:
            return self.idle
        return self.idle_settings.rule(self.real_action(n_gpus))

    @property
    def idle_active(self) -> bool:
        return self.idle_rule().active

    @property
    def idle_learns(self) -> bool:
        return self.idle_rule().learn

    def describe_idle(self) -> str:
        words = describe_idle(self.idle_rule(), self.idle_action, prior=self.idle_prior or self.idle_settings is None)
        if self.idle_settings is not None and self.idle_learns and self.reclaim_action == "suspend" and not self.suspend_multi_gpu:
            words += f" (kernels on several GPUs, restarted: {self.idle_settings.regret_cost_s('restart') / 60:g} GPU-min per regretted reclaim)"
        return words

    def to_dict(self) -> dict[str, Any]:
        p = self.policy
        return {
            "name": self.name,
            "description": self.description,
            "whole_gpus": self.whole_gpus,
            "strict_fcfs": self.strict_fcfs,
            "qos_tiers": dict(self.qos_tiers),
            "idle": self.describe_idle(),
            "idle_settings": self.idle_settings.to_dict() if self.idle_settings is not None else None,
            "idle_prior": self.idle_prior,
            "reclaim_action": self.reclaim_action,
            "restore_s": self.restore_s,
            "reload_s": self.reload_s,
            "suspend_multi_gpu": self.suspend_multi_gpu,
            "takes_bookings": self.takes_bookings,
            "tiers": {n: t.to_dict() for n, t in p.tiers.items()},
            **p.settings(),
        }


def _static_policy(backfill: bool) -> Policy:
    t = Tier("static", priority=0, max_duration_s=NEVER, default_duration_s=NEVER, description="no time limit")
    return Policy(
        tiers={"static": t},
        default_tier="static",
        fair_share=False,
        backfill=backfill,
        # backfill off is strict FCFS in the core (nothing passes a lease that cannot start);
        # backfill on without reservations is the Kubernetes default: anything that fits starts
        reservation_depth=0,
        preemption=False,
        warn_before_s=0.0,
        confirm_timeout_s=None,
        heartbeat_timeout_s=None,
    )


def static() -> SimPolicy:
    return SimPolicy(
        "static",
        _static_policy(backfill=False),
        "whole GPUs, strict FCFS, held until done, no time limit",
        whole_gpus=True,
        strict_fcfs=True,
    )


def static_backfill() -> SimPolicy:
    return SimPolicy(
        "static+backfill",
        _static_policy(backfill=True),
        "whole GPUs, any waiting request that fits starts (Kubernetes default scheduler), no time limit",
        whole_gpus=True,
    )


def static_culler(timeout_s: float = 1800.0) -> SimPolicy:
    return SimPolicy(
        "static+culler",
        _static_policy(backfill=True),
        f"static+backfill, servers culled after {timeout_s / 60:g} min idle (blind to GPU activity)",
        whole_gpus=True,
        idle=IdleRule(timeout_s=timeout_s),
        idle_action="cull",
    )


# the server extension's default reclaim action (ReclaimActions.reclaim_action; a test checks it)
SERVER_RECLAIM_ACTION = "suspend"

# ASSUMPTION: bringing a suspended kernel back (cuda-checkpoint --action restore, then unlock)
# copies its GPU memory back from host memory over PCIe and re-attaches its CUDA contexts: 10 s
# stands for ~40 GB at ~5 GB/s including the driver's own work (NVIDIA reports checkpoints and
# restores of multi-GB processes in seconds; benchmarks/gpu_check.py times it where installed).
RESTORE_S = 10.0
# ASSUMPTION: after a restart the kernel's state is gone; its user reruns the cells that load
# data and models before the interrupted cell can run: 5 minutes.
RELOAD_S = 300.0

IdleArg = IdleRule | IdleSettings | None


def _idle_fields(idle: IdleArg) -> dict[str, Any]:
    """SimPolicy fields for an idle argument: settings as the server has them (None: its
    defaults), or a raw core rule (replayed as given, whatever the action)."""
    if isinstance(idle, IdleRule):
        return {"idle": idle, "idle_settings": None}
    return {"idle_settings": idle if idle is not None else IdleSettings()}


def gpulease(idle: IdleArg = None, *, reclaim_action: str = SERVER_RECLAIM_ACTION, extend_when_contended: bool = False,
             preempt_grace_s: float | None = None) -> SimPolicy:
    """The gpulease policy with the server extension's idle reclaim: by default exactly its
    default configuration (the :class:`IdleSettings` defaults, reclaim action suspend, kernels on
    several GPUs suspended too). ``reclaim_action``: ``suspend``, ``restart`` (the state is lost)
    or ``release`` (the kernel's state is not modelled). ``preempt_grace_s`` (None: the core
    default of 10 min) replaces the preemption grace of the preemptible (learning) tier."""
    tiers = dict(DEFAULT_TIERS)
    desc = "shares packed, tiers from QoS, time limits with extension, idle reclaim, preemption, backfill with reservations"
    if preempt_grace_s is not None:
        tiers = {n: replace(t, grace_s=float(preempt_grace_s)) if t.preemptible else t for n, t in tiers.items()}
        desc += f"; preemption grace of the learning tier {preempt_grace_s:g} s"
    pol = Policy(
        tiers=tiers,
        fair_share=True,
        backfill=True,
        preemption=True,
        extend_when_contended=extend_when_contended,
        confirm_timeout_s=None,
        heartbeat_timeout_s=None,
    )
    if reclaim_action == "suspend":
        desc += (f"; an idle reclaim suspends the kernel (ASSUMPTION: cuda-checkpoint works, kernels on several GPUs too; "
                 f"restore {RESTORE_S:g} s per kernel, each GPU's memory copied back over its own link); a resume prefers its former GPU")
    elif reclaim_action == "restart":
        desc += f"; an idle reclaim restarts the kernel (state lost; ASSUMPTION: reload {RELOAD_S / 60:g} min before the cell runs)"
    elif reclaim_action == "release":
        desc += "; an idle reclaim takes the GPU back (the kernel's state is not modelled)"
    else:
        raise ValueError(f"reclaim_action must be 'suspend', 'restart' or 'release', got {reclaim_action!r}")
    return SimPolicy("gpulease", pol, desc, qos_tiers=dict(GPULEASE_QOS_TIERS), reclaim_action=reclaim_action,
                     restore_s=RESTORE_S if reclaim_action == "suspend" else 0.0, reload_s=RELOAD_S if reclaim_action != "release" else 0.0,
                     suspend_multi_gpu=True, takes_bookings=True, **_idle_fields(idle))


def gpulease_release(idle: IdleArg = None) -> SimPolicy:
    """gpulease whose idle reclaim only takes the GPU back: the kernel's state is not modelled
    (the replay before reclaim actions were modelled; its learnt timeout weighs a regretted
    reclaim as a restart)."""
    return replace(gpulease(idle, reclaim_action="release"), name="gpulease+release")


def gpulease_suspend(idle: IdleArg = None, *, multi_gpu: bool = True) -> SimPolicy:
    """gpulease (idle reclaim suspends the kernel) with the broker's ``resume_priority`` on: a
    resume goes ahead of new requests of its tier.

    ``multi_gpu``: ASSUMPTION that a kernel on several GPUs drives them from its own process
    without NCCL communicators (DataParallel-style), which cuda-checkpoint can suspend; False:
    such kernels use NCCL and are restarted instead (their state is lost, and their learnt
    timeout weighs a regretted reclaim as a restart)."""
    sp = gpulease(idle)
    multi = (
        "kernels on several GPUs too (ASSUMPTION: one process, no NCCL)"
        if multi_gpu
        else f"kernels on one GPU only (ASSUMPTION: kernels on several GPUs use NCCL, which cuda-checkpoint cannot suspend: they restart, reload {RELOAD_S / 60:g} min)"
    )
    return replace(
        sp,
        name="gpulease+suspend" if multi_gpu else "gpulease+suspend-1gpu",
        policy=replace(sp.policy, resume_priority=True),
        suspend_multi_gpu=multi_gpu,
        description=sp.description + f"; suspended: {multi}; a resume goes ahead of new requests of its tier (resume_priority)",
    )


def gpulease_restart(idle: IdleArg = None) -> SimPolicy:
    """gpulease whose idle reclaim restarts the kernel: its state is lost and reloaded."""
    return replace(gpulease(idle, reclaim_action="restart"), name="gpulease+restart")


def gpulease_batch() -> SimPolicy:
    """gpulease for a trace of batch pods (Alibaba): preempted pods get a Kubernetes-like
    grace of :data:`BATCH_GRACE_S` instead of the 10 minutes meant for notebook users, and the
    non-preemptible tiers run in steps of :data:`BATCH_STEP_S` (renewed while nobody entitled
    to their GPUs waits) instead of up to 24 h."""
    sp = gpulease(preempt_grace_s=BATCH_GRACE_S, reclaim_action="release")  # pods are never idle: no kernel to model
    tiers = {
        n: t if t.preemptible else replace(t, max_duration_s=BATCH_STEP_S, default_duration_s=min(BATCH_STEP_S, t.default_duration_s))
        for n, t in sp.policy.tiers.items()
    }
    return replace(
        sp,
        policy=replace(sp.policy, tiers=tiers, multi_gpu_aging=BATCH_MULTI_GPU_AGING),
        description=sp.description + " (ASSUMPTION: batch pods are stopped like Kubernetes pods, terminationGracePeriodSeconds defaults to 30 s; "
        "the 10-min core default is time for a person to save a notebook's work); "
        f"production and experiment leases run in {BATCH_STEP_S / HOUR:g}-hour steps, renewed while nobody entitled to their GPUs waits "
        "(CHOICE: for a multi-GPU pod to start within an hour without preempting non-preemptible work, a node must drain within an hour; "
        "a pod cut at a step's end resumes its work when resubmitted, see the resubmission assumption); "
        f"a pod asking for several GPUs ages after {BATCH_MULTI_GPU_AGING:g} x the aging time (CHOICE, see benchmarks/sim/step_sweep.txt)",
    )


def for_trace(name: str, batch: bool) -> SimPolicy:
    """Built-in policy ``name``, in its variant for a batch-pod trace when ``batch``."""
    if batch and name == "gpulease":
        return gpulease_batch()
    return BUILTIN[name]()


BUILTIN = {
    "static": static,
    "static+backfill": static_backfill,
    "static+culler": static_culler,
    "gpulease": gpulease,
    "gpulease+suspend": gpulease_suspend,
    "gpulease+restart": gpulease_restart,
    "gpulease+release": gpulease_release,
}
DEFAULT_POLICIES = ("static", "static+backfill", "static+culler", "gpulease")


# --------------------------------------------------------------------------- config files
_POLICY_KEYS = {s.name for s in SETTINGS}  # every declared scheduling setting, by its one name


def policy_from_dict(d: dict[str, Any], *, source: str = "config") -> SimPolicy:
    """A policy from a config mapping::

        name = "gpulease-30min"
        base = "gpulease"            # a built-in to start from (default: gpulease)
        whole_gpus = false
        backfill = true              # any declared setting of the core Policy (core.policy.SETTINGS)
        gpu_idle_timeout = 600       # the server extension's idle settings, same names (core.idle.IdleSettings)
        gpu_idle_timeout_learn = false
        reclaim_action = "suspend"   # suspend, restart or release
        [qos_tiers]
        BE = "learning"
        [tiers.learning]             # tiers replace the base's tiers when given
        priority = 10
        max_duration_s = 14400
        preemptible = true
    """
    if not isinstance(d, dict):
        raise ValueError(f"{source}: a policy must be a table/object")
    d = dict(d)
    name = d.pop("name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"{source}: each policy needs a 'name'")
    # a scheduling setting's old name is read as the new one, as the broker reads it (core.renames)
    d = dict(migrate_config(Config({POLICY_SECTION: d}), [POLICY_SECTION],
                            warn=lambda words: log.warning("%s: policy %r: %s", source, name, words))[POLICY_SECTION])
    base_name = d.pop("base", "gpulease")
    if base_name not in BUILTIN:
        raise ValueError(f"{source}: policy {name!r}: unknown base {base_name!r}; built-ins: {', '.join(BUILTIN)}")
    base: SimPolicy = BUILTIN[base_name]()
    pol = base.policy
    kw: dict[str, Any] = {}
    tiers = d.pop("tiers", None)
    if tiers is not None:
        if not isinstance(tiers, dict) or not tiers:
            raise ValueError(f"{source}: policy {name!r}: 'tiers' must map tier names to settings")
        kw["tiers"] = {tn: Tier.from_dict(tn, td) for tn, td in tiers.items()}
        if "default_tier" not in d and pol.default_tier not in kw["tiers"]:
            kw["default_tier"] = next(iter(kw["tiers"]))
    for k in list(d):
        if k in _POLICY_KEYS:
            kw[k] = d.pop(k)
    try:
        pol = replace(pol, **kw)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{source}: policy {name!r}: {e}") from None
    idle_fields = _idle_from_dict(d, base, f"{source}: policy {name!r}")
    sp = replace(
        base,
        name=name,
        policy=pol,
        description=d.pop("description", f"from {os.path.basename(source)} (base {base_name})"),
        whole_gpus=bool(d.pop("whole_gpus", base.whole_gpus)),
        qos_tiers={**base.qos_tiers, **d.pop("qos_tiers", {})},
        **idle_fields,
        strict_fcfs=bool(d.pop("strict_fcfs", base.strict_fcfs)),
        reclaim_action=d.pop("reclaim_action", base.reclaim_action),
        restore_s=float(d.pop("restore_s", base.restore_s)),
        reload_s=float(d.pop("reload_s", base.reload_s)),
        suspend_multi_gpu=bool(d.pop("suspend_multi_gpu", base.suspend_multi_gpu)),
    )
    if sp.reclaim_action == "suspend" and not sp.restore_s and base.reclaim_action != "suspend":
        sp = replace(sp, restore_s=RESTORE_S, reload_s=sp.reload_s or RELOAD_S)
    elif sp.reclaim_action == "restart" and not sp.reload_s:
        sp = replace(sp, reload_s=RELOAD_S)
    if sp.reclaim_action not in ("release", "suspend", "restart"):
        raise ValueError(f"{source}: policy {name!r}: reclaim_action must be 'release', 'suspend' or 'restart', got {sp.reclaim_action!r}")
    if d:
        raise ValueError(
            f"{source}: policy {name!r}: unknown setting(s) {sorted(d)}; known: base, description, whole_gpus, strict_fcfs, qos_tiers, tiers, "
            f"reclaim_action, restore_s, reload_s, suspend_multi_gpu, idle_prior, {', '.join(IDLE_NAMES)}, "
            f"{', '.join(f'idle_{k}' for k in _RAW_IDLE_KEYS)}, {', '.join(sorted(_POLICY_KEYS))}"
        )
    for tier in sp.qos_tiers.values():
        if tier not in pol.tiers:
            raise ValueError(f"{source}: policy {name!r}: qos_tiers names tier {tier!r}, not one of {sorted(pol.tiers)}")
    return sp


_RAW_IDLE_KEYS = ("timeout_s", "learn", "quantile", "factor", "min_s", "max_s", "min_gaps", "default_s", "method", "regret_cost_s", "prior_weight")


def _idle_from_dict(d: dict[str, Any], base: SimPolicy, where: str) -> dict[str, Any]:
    """The idle fields of a policy from its keys (popped): the server's settings by their names,
    or (for experiments) a raw core rule with ``idle_<field>`` keys; not both."""
    named = {k: d.pop(k) for k in list(d) if k in IDLE_NAMES}
    raw = {k: d.pop(f"idle_{k}") for k in _RAW_IDLE_KEYS if f"idle_{k}" in d}
    out: dict[str, Any] = {"idle_prior": bool(d.pop("idle_prior", base.idle_prior))}
    if named and raw:
        raise ValueError(f"{where}: give the idle rule either as the server's settings ({', '.join(named)}) or as idle_* keys, not both")
    if named:
        try:
            out["idle_settings"] = replace(base.idle_settings or IdleSettings(), **named)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: {e}") from None
    elif raw:
        if "timeout_s" in raw:
            v = raw["timeout_s"]
            raw["timeout_s"] = None if v in (None, 0, False) else float(v)
            raw.setdefault("learn", False)
        try:
            out.update(idle=replace(base.idle_rule(), **raw), idle_settings=None)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: {e}") from None
    return out


def load_policy_file(path: str) -> list[SimPolicy]:
    """Policies from a TOML (``[[policy]]`` tables) or JSON (``{"policy": [...]}`` or a list) file."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ValueError(f"{path}: cannot read: {e.strerror or e}") from None
    if path.endswith(".toml"):
        import tomllib

        try:
            data: Any = tomllib.loads(raw.decode("utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{os.path.basename(path)}: not valid TOML: {e}") from None
    else:
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{os.path.basename(path)}: not valid JSON: {e}") from None
    items = data.get("policy", data.get("policies")) if isinstance(data, dict) else data
    if isinstance(items, dict):
        items = [items]
    if not isinstance(items, list) or not items:
        raise ValueError(f"{os.path.basename(path)}: expected a list of policies ([[policy]] tables in TOML)")
    return [policy_from_dict(it, source=os.path.basename(path)) for it in items]


# --------------------------------------------------------------------------- an admin's server config
# the server extension's reclaim actions, as the replay models them: suspend keeps the kernel's
# state; restart and shutdown lose it; interrupt and notify leave the GPU held (no reclaim)
_SERVER_ACTIONS = {"suspend": "suspend", "restart": "restart", "shutdown": "restart"}


def from_server_config(path: str, *, name: str = "server-config") -> SimPolicy:
    """The gpulease policy with the idle reclaim of a ``jupyter_server_config.py``: the file is
    loaded with traitlets' config loader, its old names migrated as the server extension migrates
    them (:mod:`~jupyter_gpulease.core.renames`), and its values read through the server's own
    option classes (:class:`~jupyter_gpulease.server.idletimeout.GPUIdleRule`, built from it;
    ``ReclaimActions``' options, checked by their traits), so they are checked as the server
    checks them."""
    from traitlets.config.loader import ConfigFileNotFound, PyFileConfigLoader

    from ..server.idletimeout import GPUIdleRule

    try:
        cfg = PyFileConfigLoader(os.path.basename(path), path=os.path.dirname(os.path.abspath(path))).load_config()
    except ConfigFileNotFound:
        raise ValueError(f"--server-config: {path}: no such file") from None
    except Exception as e:  # the file is Python: any error in it is the admin's to see
        raise ValueError(f"--server-config: {path}: could not be loaded: {type(e).__name__}: {e}") from None
    cfg = migrate_config(cfg, [EXTENSION_SECTION], warn=lambda words: log.warning("--server-config: %s: %s", path, words))
    try:
        settings = GPUIdleRule(config=cfg, gaps_file="").settings
        action, fallback = (_reclaim_option(cfg, n) for n in ("reclaim_action", "fallback_action"))
    except Exception as e:  # TraitError, ValueError: a value the server would refuse
        raise ValueError(f"--server-config: {path}: {e}") from None
    sim_action = _SERVER_ACTIONS.get(action)
    base = gpulease(settings, reclaim_action=sim_action or "release")
    if sim_action is None:  # interrupt or notify: the GPU stays with the kernel, nothing is reclaimed
        base = replace(base, idle_settings=settings.changed(gpu_idle_timeout=0))
    note = (f"; from {os.path.basename(path)}: reclaim_action {action!r}"
            + (f" (ASSUMPTION: cuda-checkpoint works for every kernel; where it does not, fallback_action {fallback!r} applies)" if action == "suspend" else "")
            + (" (the GPU stays with the kernel: replayed as no idle reclaim)" if sim_action is None else ""))
    return replace(base, name=name, description=base.description + note)


def _reclaim_option(cfg: Config, name: str) -> Any:
    """The value ``cfg`` gives the server's ``c.ReclaimActions.<name>`` (its default when unset),
    checked by the option's own trait; the part itself needs a running server, so it is not built."""
    from ..server.actions import ReclaimActions

    trait = ReclaimActions.class_traits(config=True)[name]
    section = cfg.get("ReclaimActions")
    if not isinstance(section, Config) or name not in section:
        return trait.default_value
    value = section[name]
    try:
        return trait.validate(None, value.get_value(trait) if isinstance(value, DeferredConfig) else value)
    except TraitError as e:
        raise ValueError(f"ReclaimActions.{name}: {e}") from None
