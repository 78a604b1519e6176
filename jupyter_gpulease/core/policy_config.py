"""The scheduling policy as traitlets config options, derived from the declared settings.

:class:`PolicyConfig` is a ``Configurable`` mixin with one option per :data:`~.policy.SETTINGS`
entry (same name, help with its unit and example, the same default and range: each made by
:meth:`~.settings.Setting.trait`), plus the structured options (``tiers`` and the quotas). An
application that inherits it (the broker) gets ``c.<App>.aging_s = 900`` and friends, refuses an
invalid value at load with the option's name, lists a renamed option's old name (the application
moves it to the new name as it loads a config, :func:`.renames.migrated`), and builds its
:class:`~.policy.Policy` with :func:`policy_from_config`. It only declares options.
"""

from __future__ import annotations

from traitlets import Dict, validate
from traitlets.config import LoggingConfigurable

from .policy import DEFAULT_TIERS, SETTINGS, Policy, Quota, Tier

SETTING = {s.name: s for s in SETTINGS}


def _default_tiers() -> dict:
    return {name: t.to_dict() | {"users": list(t.users), "groups": list(t.groups)} for name, t in DEFAULT_TIERS.items()}


class PolicyConfig(LoggingConfigurable):
    """Scheduling policy options: tiers, quotas and the settings declared on Policy."""

    # ------------------------------------------------------------------ the declared settings (core.policy.SETTINGS)
    default_tier = SETTING["default_tier"].trait()
    min_duration_s = SETTING["min_duration_s"].trait()
    fair_share = SETTING["fair_share"].trait()
    fair_share_half_life_s = SETTING["fair_share_half_life_s"].trait()
    warn_before_s = SETTING["warn_before_s"].trait()
    backfill = SETTING["backfill"].trait()
    reservation_depth = SETTING["reservation_depth"].trait()
    preemption = SETTING["preemption"].trait()
    preemption_searches_per_pass = SETTING["preemption_searches_per_pass"].trait()
    placement_by_preemptibility = SETTING["placement_by_preemptibility"].trait()
    share_placement = SETTING["share_placement"].trait()
    aging_s = SETTING["aging_s"].trait()
    multi_gpu_aging = SETTING["multi_gpu_aging"].trait()
    short_grants = SETTING["short_grants"].trait()
    maintenance_shorten_min_s = SETTING["maintenance_shorten_min_s"].trait()
    extend_when_contended = SETTING["extend_when_contended"].trait()
    resume_priority = SETTING["resume_priority"].trait()
    confirm_timeout_s = SETTING["confirm_timeout_s"].trait()
    heartbeat_timeout_s = SETTING["heartbeat_timeout_s"].trait()
    max_queued_per_user = SETTING["max_queued_per_user"].trait()

    @validate(*SETTING)
    def _check_setting(self, proposal):
        return SETTING[proposal.trait.name].validated(self, proposal.value)

    # ------------------------------------------------------------------ old names (core.renames): listed, read as the new ones
    aging = SETTING["aging_s"].renamed_trait()
    warn_before = SETTING["warn_before_s"].renamed_trait()
    fair_share_half_life = SETTING["fair_share_half_life_s"].renamed_trait()
    confirm_timeout = SETTING["confirm_timeout_s"].renamed_trait()
    heartbeat_timeout = SETTING["heartbeat_timeout_s"].renamed_trait()

    # ------------------------------------------------------------------ tiers and quotas
    tiers = Dict(
        _default_tiers(),
        help="""Priority tiers, name -> settings (all optional): ``priority`` (higher is served
        first), ``max_duration_s`` / ``default_duration_s`` (seconds), ``max_lifetime_s`` (cap
        including extensions), ``users`` / ``groups`` (who may use it; both empty: everyone),
        ``preemptible``, ``preempted_by`` (tier names), ``grace_s`` (warning before a
        preemption ends the lease, seconds), ``description``. Example::

            c.GPULeaseBroker.tiers = {
                "production": {"priority": 30, "max_duration_s": 86400, "default_duration_s": 28800, "groups": ["staff"]},
                "experiment": {"priority": 20, "max_duration_s": 28800, "default_duration_s": 7200},
                "learning": {"priority": 10, "max_duration_s": 14400, "preemptible": True, "grace_s": 600},
            }

        The default (below) is the three tiers production, experiment and learning; setting
        this option replaces them all.
        """,
    ).tag(config=True)

    default_user_quota = Dict(
        help="""Quota of every user without an entry in ``user_quotas``: ``max_gpus`` (GPUs held
        at once; shares count by fraction), ``gpu_hours`` (per ``period_s`` seconds, rolling).
        Missing keys: no limit. Example: ``{"max_gpus": 2, "gpu_hours": 100, "period_s": 604800}``.
        """,
    ).tag(config=True)
    user_quotas = Dict(help="Per-user quotas, user name -> quota (as in ``default_user_quota``). Example: ``{'alice': {'max_gpus': 4}}``.").tag(config=True)
    group_quotas = Dict(
        help="""Per-group quotas, group name -> quota: ``max_gpus`` is what the group's members hold
        together; ``gpu_hours`` per ``period_s`` counts their use together. Example: ``{'students': {'max_gpus': 2}}``.""",
    ).tag(config=True)


def policy_from_config(options: PolicyConfig) -> Policy:
    """The Policy that ``options`` (an application inheriting :class:`PolicyConfig`: the broker)
    describe; ValueError naming the option that is wrong."""

    def quota(option: str, d) -> Quota:
        try:
            return d if isinstance(d, Quota) else Quota.from_dict(d)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{option}: {e}") from None

    tiers = {}
    for name, d in options.tiers.items():
        try:
            tiers[name] = d if isinstance(d, Tier) else Tier.from_dict(name, dict(d))
        except (TypeError, ValueError) as e:
            raise ValueError(f"tiers: {e}") from None
    return Policy(
        tiers=tiers,
        default_user_quota=quota("default_user_quota", options.default_user_quota),
        user_quotas={k: quota(f"user_quotas[{k!r}]", v) for k, v in options.user_quotas.items()},
        group_quotas={k: quota(f"group_quotas[{k!r}]", v) for k, v in options.group_quotas.items()},
        **{s.name: s.check(getattr(options, s.name)) for s in SETTINGS},
    )


__all__ = ["SETTING", "PolicyConfig", "policy_from_config"]
