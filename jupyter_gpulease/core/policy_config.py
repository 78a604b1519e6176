"""The scheduling policy as traitlets config options, derived from the declared settings.

:class:`PolicyConfig` is a ``Configurable`` mixin with one option per :data:`~.policy.SETTINGS`
entry (same name, help with its unit and example, the same default and range), plus the
structured options (``tiers`` and the quotas). An application that inherits it (the broker)
gets ``c.<App>.aging_s = 900`` and friends, refuses an invalid value at load with the option's
name, reads a renamed option's old name with a deprecation warning, and builds its
:class:`~.policy.Policy` with :meth:`PolicyConfig.build_policy`.
"""

from __future__ import annotations

import logging
from typing import Any

from traitlets import Bool, CaselessStrEnum, Dict, Float, Integer, TraitError, Unicode, observe, validate
from traitlets.config import Configurable

from .policy import DEFAULT_TIERS, SETTINGS, Policy, Quota, Tier
from .settings import Setting

log = logging.getLogger(__name__)

RENAMED = {old: s.name for s in SETTINGS for old in s.renamed_from}  # old option name -> new


def _trait(s: Setting):
    kw: dict[str, Any] = {"help": s.help}
    value = s.config_default()
    if s.kind is bool:
        t = Bool(value, **kw)
    elif s.choices:
        t = CaselessStrEnum(list(s.choices), value, **kw)
    elif s.kind is str:
        t = Unicode(value, **kw)
    elif s.kind is int:
        t = Integer(value, **kw)
    else:
        t = Float(value, **kw)
    return t.tag(config=True)


def _renamed_trait(old: str, new: Setting):
    t = Float if new.kind is float else Integer if new.kind is int else Bool if new.kind is bool else Unicode
    return t(None, allow_none=True, help=f"Renamed to {new.name} (same meaning and unit); the old name still works, with a warning.").tag(config=True)


def _default_tiers() -> dict:
    return {name: t.to_dict() | {"users": list(t.users), "groups": list(t.groups)} for name, t in DEFAULT_TIERS.items()}


class _PolicyOptions(Configurable):
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

    def build_policy(self) -> Policy:
        """The Policy these options describe; ValueError naming the option that is wrong."""

        def quota(option: str, d) -> Quota:
            try:
                return d if isinstance(d, Quota) else Quota.from_dict(d)
            except (TypeError, ValueError) as e:
                raise ValueError(f"{option}: {e}") from None

        tiers = {}
        for name, d in self.tiers.items():
            try:
                tiers[name] = d if isinstance(d, Tier) else Tier.from_dict(name, dict(d))
            except (TypeError, ValueError) as e:
                raise ValueError(f"tiers: {e}") from None
        return Policy(
            tiers=tiers,
            default_user_quota=quota("default_user_quota", self.default_user_quota),
            user_quotas={k: quota(f"user_quotas[{k!r}]", v) for k, v in self.user_quotas.items()},
            group_quotas={k: quota(f"group_quotas[{k!r}]", v) for k, v in self.group_quotas.items()},
            **{s.name: s.check(getattr(self, s.name)) for s in SETTINGS},
        )

    def _check_setting(self, proposal):
        s = _BY_NAME[proposal["trait"].name]
        try:
            s.check(proposal["value"])
        except ValueError as e:
            raise TraitError(f"{type(self).__name__}.{e}") from None
        return proposal["value"]

    def _renamed(self, change):
        new = RENAMED[change["name"]]
        if change["new"] is None:
            return
        logger = getattr(self, "log", log)
        logger.warning("%s.%s is renamed to %s (same meaning and unit); please use the new name", type(self).__name__, change["name"], new)
        setattr(self, new, change["new"])


_BY_NAME = {s.name: s for s in SETTINGS}

# one trait per setting, and one per old name; a validator for all, an observer for the old names
_namespace: dict[str, Any] = {s.name: _trait(s) for s in SETTINGS}
_namespace.update({old: _renamed_trait(old, _BY_NAME[new]) for old, new in RENAMED.items()})
_namespace["_validate_settings"] = validate(*_BY_NAME)(_PolicyOptions._check_setting)
_namespace["_observe_renamed"] = observe(*RENAMED)(_PolicyOptions._renamed)
_namespace["__doc__"] = "Scheduling policy options: tiers, quotas and the settings declared on Policy."
PolicyConfig = type("PolicyConfig", (_PolicyOptions,), _namespace)

__all__ = ["RENAMED", "PolicyConfig"]
