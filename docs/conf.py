"""Sphinx configuration of the jupyter-gpulease documentation.

Build: ``pip install -e '.[docs]'`` then ``sphinx-build -W -b html docs docs/_build/html``.
The build needs no network: no intersphinx, and the theme's assets ship with the theme.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "_ext"))
sys.path.insert(0, str(HERE.parent))  # the package of this checkout, for the generated reference

project = "jupyter-gpulease"
author = "the jupyter-gpulease contributors"
copyright = "the jupyter-gpulease contributors"

extensions = ["myst_parser", "gpulease_docs"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "README.md", "images/README.md"]

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 4  # Markdown links to a heading's anchor (`page.md#a-heading`) are checked
toc_object_entries = False  # the page tables of contents list the classes, not each of their options
nitpicky = True  # a cross-reference to an option or page that does not exist fails the build
# option help may name Python objects (:class:`…`); the site documents options, not the Python API
nitpick_ignore_regex = [(r"py:.*", r".*")]

html_theme = "pydata_sphinx_theme"
html_title = "jupyter-gpulease"
html_static_path = ["_static"]
html_css_files = ["gpulease.css"]
html_show_sourcelink = False
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
    "secondary_sidebar_items": ["page-toc"],
    "footer_start": ["copyright"],
    "footer_end": [],
}
html_context = {"default_mode": "light"}
