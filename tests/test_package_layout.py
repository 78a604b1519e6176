"""How the package is built (ARCHITECTURE.md, "How the parts are built"): each job is an object
with its own state, held by whoever uses it; no class is assembled from mixins spread over files
(bases that only declare traitlets options are ordinary traitlets, and allowed); nothing installs
itself on the lease manager or is fetched from it by name; the device lock has one door."""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib
import pkgutil

import pytest
from traitlets import TraitType
from traitlets.traitlets import EventHandler

import jupyter_gpulease

PACKAGE = pathlib.Path(jupyter_gpulease.__file__).resolve().parent


def package_modules():
    for info in pkgutil.walk_packages(jupyter_gpulease.__path__, "jupyter_gpulease."):
        if ".migrations" in info.name or info.name.endswith("__main__"):
            continue
        yield importlib.import_module(info.name)


def package_classes():
    seen = set()
    for module in package_modules():
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__.startswith("jupyter_gpulease.") and cls not in seen:
                seen.add(cls)
                yield cls


def only_declares_traits(cls: type) -> bool:
    """A settings class: its body holds trait declarations, their @default/@validate/@observe
    handlers, constants and a docstring, and no method of its own."""
    for name, value in vars(cls).items():
        if name.startswith("__") and name.endswith("__"):
            continue
        if isinstance(value, (TraitType, EventHandler)):
            continue
        if inspect.isfunction(value) or isinstance(value, (property, classmethod, staticmethod)):
            return False
    return True


def own_files(cls: type) -> set[str]:
    """The package files that define the methods a class is made of (settings-only bases left out)."""
    files = set()
    for base in cls.__mro__:
        if base.__module__.startswith("jupyter_gpulease.") and not only_declares_traits(base):
            files.add(inspect.getsourcefile(base))
    return files


def test_no_class_is_assembled_from_bases_spread_over_three_or_more_files():
    spread = {f"{c.__module__}.{c.__qualname__}": sorted(pathlib.Path(f).relative_to(PACKAGE).as_posix() for f in own_files(c))
              for c in package_classes() if len(own_files(c)) >= 3}
    assert not spread, f"classes assembled from parts in three or more files: {spread}"


@pytest.mark.parametrize("dotted", [
    "jupyter_gpulease.hub.spawner.GPULeaseSpawner",
    "jupyter_gpulease.hub.link.BrokerLink",
    "jupyter_gpulease.broker.manager.LeaseManager",
    "jupyter_gpulease.broker.app.GPULeaseBroker",
])
def test_the_large_objects_keep_their_own_methods_in_one_file(dotted):
    module, _, name = dotted.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    assert own_files(cls) == {inspect.getsourcefile(cls)}, f"{name} takes methods from {sorted(own_files(cls))}"


def sources(folder: str = ""):
    for path in sorted((PACKAGE / folder).rglob("*.py")):
        yield path, path.read_text()


def test_nothing_installs_itself_on_the_lease_manager_or_is_fetched_from_it_by_name():
    for path, text in sources("broker"):
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "manager"
                            and isinstance(node.value, ast.Name) and node.value.id == "self"):
                        pytest.fail(f"broker/{path.name}:{node.lineno}: manager.{target.attr} = self")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") and node.args:
                obj = ast.unparse(node.args[0])
                assert not obj.endswith("manager"), f"broker/{path.name}:{node.lineno}: {ast.unparse(node)}"


def test_the_device_guards_registry_is_its_own():
    for path, text in sources():
        if path.name != "cgroups.py":
            assert "_guards" not in text, f"{path.relative_to(PACKAGE)} reaches into DeviceGuard's registry"


def test_configuration_machinery_is_plain_traitlets():
    for path, text in sources():
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.name != "_load_config", f"{path.relative_to(PACKAGE)}:{node.lineno} overrides traitlets' private _load_config"
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "type" and len(node.args) == 3:
                pytest.fail(f"{path.relative_to(PACKAGE)}:{node.lineno}: a class made with type(); write it as a class")


def test_no_private_name_is_imported_across_modules():
    for path, text in sources():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("jupyter_gpulease")):
                private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                assert not private, f"{path.relative_to(PACKAGE)}:{node.lineno} imports private {', '.join(private)} from {node.module}"


def test_the_idle_culler_hook_is_not_part_of_the_server_extension():
    assert not (PACKAGE / "server" / "culler.py").exists()
