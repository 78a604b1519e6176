"""The broker application and the lease manager are each one class in one file, holding parts
that are objects of their own (ARCHITECTURE.md, "Around the core"): no part installs itself on
the manager and nothing looks the manager's collaborators up by name; small classes and
functions; the parts never import what holds them; and the broker is reached by hub/, server/
and kernel/ over HTTP only."""

from __future__ import annotations

import ast
import inspect
import pathlib

import pytest
from traitlets import TraitType
from traitlets.traitlets import EventHandler

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "jupyter_gpulease"
BROKER = PACKAGE / "broker"
MAX_CLASS_LINES, MAX_FUNCTION_LINES = 400, 80

# what holds the parts, and its parts (objects it builds or holds), which must not import it back
PARTS = {
    "app": {"settings", "jobs", "hubside", "orphan"},
    "manager": {"commit", "reads", "ends"},
}
SIZED = [BROKER / f"{m}.py" for whole, parts in PARTS.items() for m in (whole, *sorted(parts))] + [PACKAGE / "hub" / "form.py"]


def relative_imports(path: pathlib.Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level >= 1:
            yield node


def broker_modules():
    return sorted(BROKER.glob("*.py"))


def names_the_manager(node: ast.AST) -> bool:
    """Whether an expression is the lease manager as the broker's code names it (``manager``,
    ``self.manager``, ``handler.manager``, ``app.manager``, ``m`` in the pages…) or something
    reached through it."""
    parts = ast.unparse(node).split("(", 1)[0].split(".")
    return parts[0] in ("m", "mgr") or any(part in ("manager", "_manager") for part in parts)


@pytest.mark.parametrize("path", SIZED, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_no_class_or_function_is_too_long(path):
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        lines = node.end_lineno - node.lineno + 1
        if isinstance(node, ast.ClassDef):
            assert lines <= MAX_CLASS_LINES, f"{path.name}: class {node.name} has {lines} lines"
        else:
            assert lines <= MAX_FUNCTION_LINES, f"{path.name}: {node.name}() has {lines} lines"


@pytest.mark.parametrize("whole", sorted(PARTS))
def test_parts_do_not_import_what_holds_them(whole):
    for part in PARTS[whole]:
        path = BROKER / f"{part}.py"
        for node in relative_imports(path):
            names = [node.module] if node.level == 1 and node.module else [a.name for a in node.names] if node.level == 1 else []
            assert whole not in names, f"broker/{part}.py imports broker/{whole}.py, which holds it"


def test_the_broker_apps_methods_are_all_in_app_py():
    """GPULeaseBroker's bases of this package only declare settings (traits, their defaults and
    checks): every method it has of its own is in app.py, none comes from a mixin elsewhere."""
    from jupyter_gpulease.broker.app import GPULeaseBroker
    from jupyter_gpulease.broker.settings import BrokerSettings

    ours = [c for c in GPULeaseBroker.__mro__ if c.__module__.startswith("jupyter_gpulease.")]
    broker_bases = {c for c in ours if c.__module__.startswith("jupyter_gpulease.broker.")} - {GPULeaseBroker}
    assert broker_bases == {BrokerSettings}, f"GPULeaseBroker is assembled from {sorted(c.__name__ for c in broker_bases)}"
    assert all(c.__module__.startswith("jupyter_gpulease.core.") for c in set(ours) - {GPULeaseBroker, BrokerSettings}), \
        "besides BrokerSettings, the broker app's bases of this package are core's config (PolicyConfig)"
    for name, value in vars(BrokerSettings).items():
        if inspect.isfunction(value) or isinstance(value, (property, staticmethod, classmethod)):
            pytest.fail(f"BrokerSettings.{name} is not a setting (a trait, its default or its check): the broker app's methods belong in app.py")
    assert any(isinstance(v, TraitType) for v in vars(BrokerSettings).values()) and any(isinstance(v, EventHandler) for v in vars(BrokerSettings).values())
    for name, fn in inspect.getmembers(GPULeaseBroker, inspect.isfunction):
        if fn.__module__.startswith("jupyter_gpulease.broker."):
            assert fn.__module__ == "jupyter_gpulease.broker.app", f"GPULeaseBroker.{name} comes from {fn.__module__}"


@pytest.mark.parametrize("name", ["manager.LeaseManager", "commit.GroupCommit", "reads.LeaseReads", "jobs.PeriodicJobs",
                                  "hubside.HubSide", "orphan.OrphanHandover"])
def test_the_manager_and_the_parts_are_classes_of_their_own(name):
    """Each is one class with its own __init__ and no base: its methods are in its own file."""
    import importlib

    module, cls = name.split(".")
    klass = getattr(importlib.import_module(f"jupyter_gpulease.broker.{module}"), cls)
    assert klass.__mro__ == (klass, object), f"{cls} has the bases {[c.__name__ for c in klass.__mro__[1:-1]]}"
    assert "__init__" in vars(klass), f"{cls} has no __init__ of its own"


@pytest.mark.parametrize("path", broker_modules(), ids=lambda p: p.stem)
def test_no_part_installs_itself_on_the_manager_or_elsewhere(path):
    """What the manager works with it is given (constructor arguments, LeaseManager.wire), never
    set on it from outside; and no object of broker/ puts itself on another (``x.attr = self``)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                    if not isinstance(el, ast.Attribute):
                        continue
                    where = f"broker/{path.name}:{node.lineno} {ast.unparse(el)}"
                    if path.stem != "manager":
                        assert not names_the_manager(el.value), f"{where}: sets an attribute of the manager"
                    value = node.value
                    if isinstance(value, ast.Name) and value.id == "self" and ast.unparse(el.value) != "self":
                        pytest.fail(f"{where} = self: a part installs itself on another object")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("append", "extend", "insert", "add"):
            owner = node.func.value
            if path.stem != "manager" and isinstance(owner, ast.Attribute) and names_the_manager(owner.value):
                pytest.fail(f"broker/{path.name}:{node.lineno}: {ast.unparse(node.func)}(): a part adds itself to the manager")


@pytest.mark.parametrize("path", broker_modules(), ids=lambda p: p.stem)
def test_nothing_looks_up_the_managers_collaborators_by_name(path):
    """No ``getattr(manager, ...)`` / ``hasattr(self.manager, ...)``: readers are given what they read."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") and node.args:
            assert not names_the_manager(node.args[0]), f"broker/{path.name}:{node.lineno}: {ast.unparse(node)}"


@pytest.mark.parametrize("part", ["broker", "hub", "server", "kernel"])
def test_the_broker_and_its_callers_meet_over_http_only(part):
    others = {"hub", "server", "kernel"} if part == "broker" else {"broker"}
    for path in sorted((PACKAGE / part).glob("*.py")):
        for node in relative_imports(path):
            if node.level != 2:
                continue
            tops = {node.module.split(".")[0]} if node.module else {a.name for a in node.names}
            assert not tops & others, f"{part}/{path.name}:{node.lineno} imports {', '.join(sorted(tops & others))}/ (against ARCHITECTURE.md's direction)"
        assert "jupyter_gpulease.broker" not in path.read_text() or part == "broker", f"{part}/{path.name} names the broker's modules"
