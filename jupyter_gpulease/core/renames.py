"""Old option names, in one table, and the one function that reads them as the new ones.

Two kinds of rename, one table (:data:`RENAMES`):

* a scheduling setting renamed in place (``c.GPULeaseBroker.aging`` is now ``aging_s``): the
  :class:`~.settings.Setting` says so in ``renamed_from``; the option class keeps the old name
  as an option of its own (:meth:`~.settings.Setting.renamed_trait`) so that ``--help-all`` and
  a generated config file still list it;
* a setting of the server extension that moved to the part that uses it
  (``c.GPULeaseExtension.warn_before`` is now ``c.ReclaimActions.warn_before``).

:func:`migrate_config` moves each old name of a loaded ``Config`` to its new name, with one
warning naming both; where the new name is set as well, the new name wins. It runs once per
loaded config, before any option is set from it: the broker and the server extension apply it
(:func:`migrated`) in traitlets' two public hooks for a config, the ``config`` trait's validation
and ``update_config``, and the simulator applies it to an admin's ``jupyter_server_config.py``
and to its policy files. No old name is ever set as an option, so nothing forwards it later.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from copy import deepcopy
from dataclasses import dataclass

from traitlets.config import Config

from .idle import IDLE_NAMES
from .policy import SETTINGS

log = logging.getLogger(__name__)

POLICY_SECTION = "PolicyConfig"  # the scheduling settings' class (the broker inherits it)
EXTENSION_SECTION = "GPULeaseExtension"  # the server extension, where every server setting was once set


@dataclass(frozen=True)
class Rename:
    """``c.<section>.<old>`` is now ``c.<new_section>.<new>`` (``new_section`` empty: the same class)."""

    section: str
    old: str
    new: str
    new_section: str = ""

    def target(self, found_in: str) -> str:
        """The section the new name goes to, for the old name found in section ``found_in``."""
        return self.new_section or found_in

    def message(self, found_in: str, *, both: bool) -> str:
        new = f"{self.new_section}.{self.new}" if self.new_section else self.new
        words = f"{found_in}.{self.old} is renamed to {new} (same meaning and unit); please use the new name"
        return words + (f" ({self.target(found_in)}.{self.new} is set too, and wins)" if both else "")


# the server extension's settings that moved to its parts, by the part that declares each now
EXTENSION_MOVED: dict[str, tuple[str, ...]] = {
    "GPUIdleRule": (*IDLE_NAMES, "gaps_file"),
    "ReclaimActions": ("reclaim_action", "fallback_action", "warn_before", "on_reclaim", "max_keep", "share_grace", "reclaim_busy"),
    "Resumer": ("resume_max_wait", "resume_on_execute"),
    "GPUUsage": ("report_activity",),
}

RENAMES: tuple[Rename, ...] = (
    *(Rename(POLICY_SECTION, old, s.name) for s in SETTINGS for old in s.renamed_from),
    *(Rename(EXTENSION_SECTION, name, name, part) for part, names in EXTENSION_MOVED.items() for name in names),
)


def old_names(section: str) -> set[str]:
    """The old option names of class ``section`` (still accepted there, with a warning)."""
    return {r.old for r in RENAMES if r.section == section}


def migrate_config(config: Config, sections: Iterable[str], *, warn: Callable[[str], object] = log.warning) -> Config:
    """A copy of ``config`` with the old names that a class reading ``sections`` had (its
    ``section_names()``) moved to their new names: one ``warn`` per old name found, naming both;
    where the new name is set as well, it wins and the old one is dropped.

    A setting renamed in place is looked for in every section the class reads (traitlets loads
    them all into it); a moved one under its old class's section only."""
    sections = list(sections)
    out = deepcopy(config)
    for r in RENAMES:
        if r.section not in sections:
            continue
        for found_in in (sections if not r.new_section else [r.section]):
            section = out.get(found_in)
            if not isinstance(section, Config) or r.old not in section:
                continue
            value = section.pop(r.old)
            target = out[r.target(found_in)]
            both = r.new in target
            if not both:
                target[r.new] = value
            warn(r.message(found_in, both=both))
    return out


def migrated(configurable, config: Config, said: set[str]) -> Config:
    """``config`` as ``configurable`` (an application: the broker, the server extension) loads it,
    its old names moved (:func:`migrate_config`), each warning in its log once: an application
    sees its command line more than once (traitlets merges it into each config file's load, so
    that it wins), and ``said`` remembers what was said."""

    def warn(words: str) -> None:
        if words not in said:
            said.add(words)
            configurable.log.warning(words)

    return migrate_config(config, configurable.section_names(), warn=warn)


__all__ = ["EXTENSION_MOVED", "EXTENSION_SECTION", "POLICY_SECTION", "RENAMES", "Rename", "migrate_config", "migrated", "old_names"]
