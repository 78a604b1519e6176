"""Sphinx glue for the generated reference sections.

A page asks for a generated section with a MyST comment line of its own::

    % gpulease-generate: config

When Sphinx reads the page, the line is replaced by what the generator of that name in
:mod:`gpulease_reference` returns, so the reference follows the package at every build. Such a
page is read again at every build (its source file does not change when the code does).
"""

from __future__ import annotations

import re
from pathlib import Path

import gpulease_reference

MARKER = re.compile(r"^% gpulease-generate: ([\w-]+)[ \t]*$", re.M)


def expand(text: str) -> str:
    """``text`` with every generate marker replaced by its generated section."""

    def one(m: re.Match) -> str:
        name = m.group(1)
        if name not in gpulease_reference.GENERATORS:
            raise ValueError(f"unknown generated section {name!r} (known: {', '.join(gpulease_reference.GENERATORS)})")
        return gpulease_reference.GENERATORS[name]()

    return MARKER.sub(one, text)


def _source_read(app, docname: str, source: list[str]) -> None:
    if MARKER.search(source[0]):
        source[0] = expand(source[0])


def _always_outdated(app, env, added, changed, removed):
    """Pages with a generated section: read again, since the code they show may have changed."""
    found = []
    for docname in env.found_docs:
        path = Path(env.doc2path(docname))
        if path.suffix == ".md" and MARKER.search(path.read_text(encoding="utf-8")):
            found.append(docname)
    return [d for d in found if d not in added and d not in changed]


def setup(app):
    app.connect("source-read", _source_read)
    app.connect("env-get-outdated", _always_outdated)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
