"""The idle rule of a Jupyter server: its options, and the user's learnt idle gaps.

:class:`GPUIdleRule` has one config option per setting declared on
:class:`~jupyter_gpulease.core.idle.IdleSettings` (same name, help, default and range, each made
by :meth:`~jupyter_gpulease.core.settings.Setting.trait`; the simulator's policy files use the
same names), plus ``gaps_file``. It gives the effective timeout for the reclaim action that will
really happen (:meth:`GPUIdleRule.timeout`: a regretted suspend weighs less than a regretted
restart) and learns from each idle gap (:meth:`GPUIdleRule.learn`), keeping the gaps in the
user's Jupyter data directory.

Set it as ``c.GPUIdleRule.gpu_idle_timeout = 600``; the older names under ``GPULeaseExtension``
(``c.GPULeaseExtension.gpu_idle_timeout = 600``) are moved here by the extension when it loads
its config (:mod:`jupyter_gpulease.core.renames`).
"""

from __future__ import annotations

import json
import os
from typing import Any

from jupyter_core.paths import jupyter_data_dir
from traitlets import Unicode, default, validate
from traitlets.config import LoggingConfigurable

from ..core.idle import IDLE_NAMES, IDLE_SETTING, IdleRule, IdleSettings
from ..files import write_atomically

MAX_GAPS = 200  # the most recent gaps kept (and learnt from)


class GPUIdleRule(LoggingConfigurable):
    """The idle rule of this server: when a kernel's GPU is idle, how long it may stay idle (fixed or
    learnt per user), and what a regretted reclaim weighs for the action that really happens. One option per
    :class:`~jupyter_gpulease.core.idle.IdleSettings` field; the simulator replays the same settings."""

    # ------------------------------------------------------------------ the declared settings (core.idle.IdleSettings)
    gpu_idle_threshold = IDLE_SETTING["gpu_idle_threshold"].trait()
    gpu_idle_timeout = IDLE_SETTING["gpu_idle_timeout"].trait()
    gpu_idle_timeout_learn = IDLE_SETTING["gpu_idle_timeout_learn"].trait()
    gpu_idle_regret_suspend = IDLE_SETTING["gpu_idle_regret_suspend"].trait()
    gpu_idle_regret_restart = IDLE_SETTING["gpu_idle_regret_restart"].trait()
    gpu_idle_timeout_candidates = IDLE_SETTING["gpu_idle_timeout_candidates"].trait()
    gpu_idle_timeout_min = IDLE_SETTING["gpu_idle_timeout_min"].trait()
    gpu_idle_timeout_max = IDLE_SETTING["gpu_idle_timeout_max"].trait()

    @validate(*IDLE_NAMES)
    def _check_setting(self, proposal):
        return IDLE_SETTING[proposal.trait.name].validated(self, proposal.value)

    # ------------------------------------------------------------------ the learnt gaps' file
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
        self.settings  # noqa: B018 -- refuse an inconsistent configuration (min above max) now, with the names
        self.gaps: list[float] = self._load_gaps()

    # ------------------------------------------------------------------ the rule
    @property
    def settings(self) -> IdleSettings:
        """The configured settings (ValueError naming the option when they do not fit together)."""
        return IdleSettings(**{name: getattr(self, name) for name in IDLE_NAMES})

    @property
    def threshold_pct(self) -> float:
        return self.gpu_idle_threshold

    def rule(self, action: str) -> IdleRule:
        """The core idle rule when a reclaim really does ``action`` (after any fallback)."""
        return self.settings.rule(action)

    def timeout(self, action: str) -> float | None:
        """Seconds an idle kernel keeps its GPU when a reclaim really does ``action`` (None: never)."""
        return self.rule(action).timeout(self.gaps)

    def describe(self, action: str) -> str:
        """The rule in words, for a reclaim that really does ``action``."""
        return self.settings.describe(action)

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
            write_atomically(path, json.dumps({"user": self.user, "gaps": self.gaps}))
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


__all__ = ["GPUIdleRule"]
