"""The server extension stays in parts: small classes and functions, imports in one direction
(ARCHITECTURE.md, "server/: the extension in parts"), nothing of hub/ and no write of os.environ."""

from __future__ import annotations

import ast
import pathlib

import pytest

SERVER = pathlib.Path(__file__).resolve().parent.parent / "jupyter_gpulease" / "server"
MAX_CLASS_LINES, MAX_FUNCTION_LINES = 400, 80

# each module may import the modules of lower layers only (and none of its own layer)
LAYERS = [
    {"attribution", "checkpoint", "feed", "lease", "reclaim", "idletimeout"},  # leaves
    {"monitor"},
    {"kernels"},
    {"views", "announce", "kernelenv", "usage"},
    {"actions", "resumer"},
    {"preemption"},
    {"controller"},
    {"handlers"},  # reads the controller from the web app's settings: imports no part
    {"app"},
    {"__init__"},
]
LAYER = {m: i for i, layer in enumerate(LAYERS) for m in layer}


def modules():
    return sorted(SERVER.glob("*.py"))


@pytest.mark.parametrize("path", modules(), ids=lambda p: p.stem)
def test_no_class_or_function_is_too_long(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if not isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        lines = node.end_lineno - node.lineno + 1
        if isinstance(node, ast.ClassDef):
            assert lines <= MAX_CLASS_LINES, f"{path.name}: class {node.name} has {lines} lines"
        else:
            assert lines <= MAX_FUNCTION_LINES, f"{path.name}: {node.name}() has {lines} lines"


@pytest.mark.parametrize("path", modules(), ids=lambda p: p.stem)
def test_imports_point_one_way_and_the_process_environment_is_only_read(path):
    me = path.stem
    assert me in LAYER, f"{path.name} is in no layer of this test (and of ARCHITECTURE.md)"
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level >= 1:
            if node.level == 2:
                assert not (node.module or "").startswith("hub"), f"{path.name} imports hub/ (shared rules live in core/)"
                continue
            names = [node.module] if node.module else [a.name for a in node.names]
            for other in names:
                assert LAYER[other] < LAYER[me], f"{me} imports {other}, against the direction"
        if isinstance(node, (ast.Assign, ast.AugAssign)):
            for t in getattr(node, "targets", [getattr(node, "target", None)]):
                if isinstance(t, ast.Subscript) and "os.environ" in ast.unparse(t.value):
                    pytest.fail(f"{path.name}:{node.lineno} writes os.environ")
        if isinstance(node, ast.Call) and ast.unparse(node.func) in ("os.environ.pop", "os.environ.update", "os.environ.setdefault",
                                                                      "os.putenv", "os.unsetenv"):
            pytest.fail(f"{path.name}:{node.lineno} writes the process environment")
