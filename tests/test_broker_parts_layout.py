"""The broker application and the lease manager stay in parts (ARCHITECTURE.md, "Around the
core"): small classes and functions, the parts never importing what they are parts of, and the
broker reached by hub/, server/ and kernel/ over HTTP only."""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "jupyter_gpulease"
MAX_CLASS_LINES, MAX_FUNCTION_LINES = 400, 80

# the whole: its parts (mixins and helpers), which must not import it back
PARTS = {
    "app": {"settings", "jobs", "hubside", "orphan"},
    "manager": {"commit", "reads", "ends"},
}
SIZED = [PACKAGE / "broker" / f"{m}.py" for whole, parts in PARTS.items() for m in (whole, *sorted(parts))] + [PACKAGE / "hub" / "form.py"]


def relative_imports(path: pathlib.Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level >= 1:
            yield node


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
def test_parts_do_not_import_what_they_are_parts_of(whole):
    for part in PARTS[whole]:
        path = PACKAGE / "broker" / f"{part}.py"
        for node in relative_imports(path):
            names = [node.module] if node.level == 1 and node.module else [a.name for a in node.names] if node.level == 1 else []
            assert whole not in names, f"broker/{part}.py imports broker/{whole}.py, the class it is a part of"


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
