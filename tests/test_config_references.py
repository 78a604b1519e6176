"""Every setting a message, a docstring or a template of the package names exists: each
``c.<Class>.<name>`` or ``<Class>.<name>`` of one of the package's config classes is a config
option of that class, one of its documented old names (core/renames.py), or (without ``c.``)
another attribute of it, such as a method a docstring points to."""

from __future__ import annotations

import ast
import importlib
import pathlib
import pkgutil
import re

from traitlets.config import Configurable

import jupyter_gpulease
from jupyter_gpulease.core.renames import old_names

PACKAGE = pathlib.Path(jupyter_gpulease.__file__).resolve().parent


def config_classes() -> dict[str, type[Configurable]]:
    """The package's Configurable classes, by name (every module imported, entry points excepted)."""
    for info in pkgutil.walk_packages([str(PACKAGE)], prefix="jupyter_gpulease."):
        if not info.name.endswith("__main__"):
            importlib.import_module(info.name)
    out: dict[str, type[Configurable]] = {}
    todo = [Configurable]
    while todo:
        for sub in todo.pop().__subclasses__():
            todo.append(sub)
            if sub.__module__.startswith("jupyter_gpulease.") and not sub.__name__.startswith("_"):
                out[sub.__name__] = sub
    return out


def texts():
    """(where, text) of every string constant in the package's modules, and of its templates."""
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                yield f"{path.relative_to(PACKAGE)}:{node.lineno}", node.value
    for path in sorted(PACKAGE.rglob("templates/**/*.html")):
        yield str(path.relative_to(PACKAGE)), path.read_text()


def test_every_setting_the_package_names_is_an_option_of_its_class():
    classes = config_classes()
    assert {"GPULeaseBroker", "GPULeaseExtension", "GPUIdleRule", "ReclaimActions", "GPULeaseUsage", "GPULeaseSpawner"} <= set(classes)
    ref = re.compile(r"(?<![\w.])(c\.)?(" + "|".join(sorted(classes, key=len, reverse=True)) + r")\.([A-Za-z_]\w*)")
    wrong, seen = [], 0
    for where, text in texts():
        for m in ref.finditer(text):
            config, name, attr = m.group(1), m.group(2), m.group(3)
            cls = classes[name]
            seen += 1
            if attr in cls.class_trait_names(config=True) or any(attr in old_names(s) for s in cls.section_names()):
                continue
            if not config and hasattr(cls, attr):
                continue  # a method or attribute the text points to, not a setting
            wrong.append(f"{where}: {m.group(0)}")
    assert seen > 50  # the scan does find the references
    assert not wrong, "settings that do not exist:\n" + "\n".join(wrong)
