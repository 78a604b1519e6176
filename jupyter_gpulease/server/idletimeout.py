"""The idle rule of a Jupyter server: its options, and the user's learnt idle gaps.

:class:`GPUIdleRule` has one config option per setting declared on
:class:`~jupyter_gpulease.core.idle.IdleSettings` (same name, help, default and range; the
simulator's policy files use the same names), plus ``gaps_file``. It gives the effective
timeout for the reclaim action that will really happen (:meth:`GPUIdleRule.timeout`: a
regretted suspend weighs less than a regretted restart) and learns from each idle gap
(:meth:`GPUIdleRule.learn`), keeping the gaps in the user's Jupyter data directory.

Set it as ``c.GPUIdleRule.gpu_idle_timeout = 600``; the names under ``GPULeaseExtension``
(``c.GPULeaseExtension.gpu_idle_timeout = 600``) still work: the rule reads them from the
config it is given when the same name is not set under ``GPUIdleRule``.
"""

from __future__ import annotations

import json
import os
from typing import Any

from jupyter_core.paths import jupyter_data_dir
from traitlets import Bool, Float, List, TraitError, Unicode, default, validate
from traitlets.config import LoggingConfigurable

from ..core.idle import IDLE_NAMES, IDLE_SETTINGS, IdleRule, IdleSettings
from ..core.settings import Setting

MAX_GAPS = 200  # the most recent gaps kept (and learnt from)
OLD_SECTION = "GPULeaseExtension"  # where these options lived before; still read


def _trait(s: Setting):
    value = s.config_default()
    help = s.help
    if s.kind is bool:
        t = Bool(value, help=help)
    elif s.kind is tuple:
        t = List(Float(), list(value), help=help)
    else:
        t = Float(value, help=help)
    return t.tag(config=True)


def _check(self, proposal):
    s = _BY_NAME[proposal["trait"].name]
    try:
        s.check(proposal["value"])
    except ValueError as e:
        raise TraitError(f"{type(self).__name__}.{e}") from None
    return proposal["value"]


_BY_NAME = {s.name: s for s in IDLE_SETTINGS}


class _GPUIdleRule(LoggingConfigurable):
    gaps_file = Unicode(help="""Where the learnt timeout keeps the user's idle gaps. Default: ``<jupyter data dir>/gpulease/idle-gaps.json``.""").tag(config=True)
    user = Unicode("", help="""The user whose gaps these are (written into the gaps file). Default: ``JUPYTERHUB_USER``.""")

    @default("gaps_file")
    def _gaps_file_default(self):
        return os.path.join(jupyter_data_dir(), "gpulease", "idle-gaps.json")

    @default("user")
    def _user_default(self):
        return os.environ.get("JUPYTERHUB_USER", "")

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        old = self.config.get(OLD_SECTION, {}) if OLD_SECTION in self.config else {}
        mine = self.config.get(type(self).__name__, {}) if type(self).__name__ in self.config else {}
        for name in (*IDLE_NAMES, "gaps_file"):
            if name in old and name not in mine:
                setattr(self, name, old[name])
        self.settings  # noqa: B018 -- refuse an inconsistent configuration (min above max) now, with the names
        self.gaps: list[float] = self._load_gaps()
        self._action = "suspend"

    # ------------------------------------------------------------------ the rule
    @property
    def settings(self) -> IdleSettings:
        """The configured settings (ValueError naming the option when they do not fit together)."""
        return IdleSettings(**{name: getattr(self, name) for name in IDLE_NAMES})

    @property
    def threshold_pct(self) -> float:
        return self.gpu_idle_threshold

    def rule_for(self, action: str) -> IdleRule:
        """The core idle rule when a reclaim really does ``action`` (after any fallback)."""
        return self.settings.rule(action)

    @property
    def rule(self) -> IdleRule:
        """The core idle rule for the action last asked about in :meth:`timeout` (first: suspend)."""
        return self.rule_for(self._action)

    def timeout(self, action: str = "suspend") -> float | None:
        """Seconds an idle kernel keeps its GPU when a reclaim really does ``action`` (None: never)."""
        self._action = action
        return self.rule_for(action).timeout(self.gaps)

    def describe(self, action: str | None = None) -> str:
        return self.settings.describe(action or self._action)

    # ------------------------------------------------------------------ learnt gaps
    def learn(self, gap_s: float) -> None:
        """One idle gap ended (seconds from the GPU falling idle to its next use)."""
        if not gap_s > 0:
            return
        self.gaps = (self.gaps + [round(float(gap_s), 1)])[-MAX_GAPS:]
        path = self.gaps_file
        if not path or not self.gpu_idle_timeout_learn:
            return
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = path + ".tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump({"user": self.user, "gaps": self.gaps}, f)
            os.replace(tmp, path)
        except OSError as e:
            self.log.debug("Could not save idle gaps to %s: %s", path, e)

    def _load_gaps(self) -> list[float]:
        path = self.gaps_file
        if not path or not os.path.exists(path):
            return []
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
            gaps = data.get("gaps", [])
            return [float(g) for g in gaps if isinstance(g, (int, float)) and not isinstance(g, bool) and g > 0][-MAX_GAPS:]
        except (OSError, ValueError, AttributeError, TypeError) as e:
            self.log.warning("GPU idle rule: ignoring %s (%s)", path, e)
            return []


# one option per declared idle setting, each checked like the declaration says
_namespace: dict[str, Any] = {s.name: _trait(s) for s in IDLE_SETTINGS}
_namespace["_validate_settings"] = validate(*IDLE_NAMES)(_check)
_namespace["__doc__"] = """The idle rule of this server: when a kernel's GPU is idle, how long it may stay idle (fixed or
learnt per user), and what a regretted reclaim weighs for the action that really happens. One option per
:class:`~jupyter_gpulease.core.idle.IdleSettings` field; the simulator replays the same settings."""
_namespace["__module__"] = __name__
GPUIdleRule = type("GPUIdleRule", (_GPUIdleRule,), _namespace)

__all__ = ["GPUIdleRule"]
