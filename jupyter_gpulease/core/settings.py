"""Each scheduling setting declared once: name, unit, default, help, range.

A setting is declared on its dataclass field (:class:`~.policy.Policy`,
:class:`~.idle.IdleSettings`) with :func:`setting`; everything else is derived from that
declaration: the config options (:meth:`Setting.trait`, the one builder used by the broker's
:class:`~.policy_config.PolicyConfig` and the server's ``GPUIdleRule``), the keys of the
simulator's policy files, the checks a value goes through wherever it comes from, and the name
that an error message gives. A new setting is one edit.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from traitlets import Bool, CaselessStrEnum, Float, Integer, List, TraitError, TraitType, Unicode


@dataclass(frozen=True)
class Setting:
    """One setting. ``name`` is both the :class:`Policy` field and the config option."""

    name: str
    kind: type  # bool, int, float, str, or tuple (a list of numbers, each checked like a float)
    default: Any
    help: str  # what it does, with its unit and an example
    unit: str = ""  # 'seconds', or '' for a count or a ratio
    minimum: float | None = None
    maximum: float | None = None
    above: float | None = None  # exclusive lower bound
    choices: tuple[str, ...] = ()
    zero_is_off: bool = False  # in config, 0 turns it off (None in the Policy)
    renamed_from: tuple[str, ...] = ()  # older option names, still read with a deprecation warning

    def check(self, value: Any) -> Any:
        """The value as the Policy holds it, or ValueError naming the setting and what is allowed."""
        name = self.name
        if value is None and self.zero_is_off:
            return None
        if self.kind is bool:
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be True or False, got {value!r}")
            return value
        if self.kind is str:
            if not isinstance(value, str) or (self.choices and value.lower() not in self.choices):
                raise ValueError(f"{name} must be one of {', '.join(map(repr, self.choices))}, got {value!r}" if self.choices else f"{name} must be a string")
            return value.lower() if self.choices else value
        if self.kind is tuple:
            if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)) or not value:
                raise ValueError(f"{name} must be a non-empty list of numbers{self._unit_words()}, got {value!r}")
            return tuple(sorted(set(self._number(v) for v in value)))
        if self.zero_is_off and isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0:
            return None
        return self._number(value)

    def _number(self, value: Any) -> Any:
        name = self.name
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (isinstance(value, float) and not math.isfinite(value)):
            raise ValueError(f"{name} must be a number{self._unit_words()}, got {value!r}")
        if self.kind is int and not float(value).is_integer():
            raise ValueError(f"{name} must be a whole number, got {value!r}")
        unit = self._unit_words()
        if self.minimum is not None and value < self.minimum:
            raise ValueError(f"{name} must be at least {self.minimum:g}{unit}, got {value!r}")
        if self.maximum is not None and value > self.maximum:
            raise ValueError(f"{name} must be at most {self.maximum:g}{unit}, got {value!r}")
        if self.above is not None and value <= self.above:
            raise ValueError(f"{name} must be more than {self.above:g}{unit}, got {value!r}")
        return float(value) if self.kind is tuple else self.kind(value)

    def _unit_words(self) -> str:
        return f" ({self.unit})" if self.unit else ""

    def config_default(self) -> Any:
        """The default as a config file writes it (0 for 'off')."""
        return 0 if self.default is None and self.zero_is_off else self.default

    # ------------------------------------------------------------------ as a traitlets option
    def trait(self) -> TraitType:
        """The config option of this setting: its name is the attribute it is assigned to (which
        must be :attr:`name`), with the help and the default of the declaration. A class that has
        such options checks them with :meth:`validated` in one ``@validate`` method."""
        value, help = self.config_default(), self.help
        if self.kind is bool:
            t: TraitType = Bool(value, help=help)
        elif self.kind is tuple:
            t = List(Float(), list(value), help=help)
        elif self.choices:
            t = CaselessStrEnum(list(self.choices), value, help=help)
        elif self.kind is str:
            t = Unicode(value, help=help)
        elif self.kind is int:
            t = Integer(value, help=help)
        else:
            t = Float(value, help=help)
        return t.tag(config=True)

    def renamed_trait(self) -> TraitType:
        """The option of an older name of this setting (one of :attr:`renamed_from`): listed in the
        help and generated config files; a config that sets it is migrated to :attr:`name` before
        it is loaded (:func:`.renames.migrate_config`), so it never holds a value itself."""
        kind = {float: Float, int: Integer, bool: Bool}.get(self.kind, Unicode)
        help = f"Renamed to {self.name} (same meaning and unit); the old name still works, with a warning."
        return kind(None, allow_none=True, help=help).tag(config=True)

    def validated(self, owner: object, value: Any) -> Any:
        """``value`` unchanged when the declaration allows it for ``owner``'s option, else
        TraitError naming it as ``<owner's class>.<name> must be ...``."""
        try:
            self.check(value)
        except ValueError as e:
            raise TraitError(f"{type(owner).__name__}.{e}") from None
        return value


def setting(default: Any, help: str, **kw) -> Any:
    """Declare a :class:`Policy` field as a setting (see :class:`Setting` for the keywords)."""
    return dataclasses.field(default=default, metadata={"setting": kw | {"help": help, "default": default}})


def settings_of(cls) -> tuple[Setting, ...]:
    """The settings declared on a dataclass's fields, in declaration order."""
    out = []
    for f in dataclasses.fields(cls):
        if "setting" not in f.metadata:
            continue
        meta = dict(f.metadata["setting"])
        kind = meta.pop("kind", None)
        default = meta["default"]
        if kind is None:
            kind = type(default) if default is not None else float
            if kind is int and meta.get("unit") == "seconds":
                kind = float
        out.append(Setting(name=f.name, kind=kind, **meta))
    return tuple(out)
