"""The documentation site is tested like code.

The site is built once per run with Sphinx (warnings are errors) into a temporary folder; then
every internal link and anchor of the built HTML must resolve, the configuration reference must
list every option of every configurable class of the package (found here by walking the
package's modules, apart from how the docs find them), README's links must land, and README's
two commands must be the ones the docs' tutorial gives and CI runs. Last, headless Chromium
takes the screenshots of the built site that docs/images keeps (the start page, a how-to
guide and the configuration reference).

Needs the docs packages (the ``test`` extra has them); without them the tests skip with a
one-line reason, except in CI, where that is a failure.
"""

from __future__ import annotations

import importlib
import inspect
import os
import pkgutil
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

import tooling

pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
IMAGES = DOCS / "images"
CI_RUN = ROOT / ".ci" / "run"


def _missing(reason: str):
    if tooling.in_ci():
        pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The built site (HTML), from a clean build with warnings as errors."""
    for module in ("sphinx", "myst_parser", "pydata_sphinx_theme", "bs4"):
        try:
            importlib.import_module(module)
        except ImportError:
            _missing(f"the docs package {module!r} is not installed (pip install -e '.[docs]' or '.[test]')")
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    build = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", str(DOCS), str(out)],
                           capture_output=True, text=True, timeout=540, env=env, check=False)
    assert build.returncode == 0, f"sphinx-build -W failed:\n{build.stdout[-4000:]}\n{build.stderr[-8000:]}"
    assert "WARNING" not in build.stderr, build.stderr[-8000:]
    return out


def soup(path: Path):
    from bs4 import BeautifulSoup

    return BeautifulSoup(path.read_text(encoding="utf-8"), "html.parser")


# --------------------------------------------------------------------------- links and anchors
def _ids(page) -> set[str]:
    return {t["id"] for t in page.find_all(id=True)} | {t["name"] for t in page.find_all("a", attrs={"name": True})}


def _is_external(url: str) -> bool:
    return bool(urlsplit(url).scheme) or url.startswith("//")


def test_every_internal_link_and_anchor_of_the_site_resolves(site):
    # the site's pages; _static/ holds the theme's own templates, not pages
    pages = sorted(p for p in site.rglob("*.html") if p.relative_to(site).parts[0] != "_static")
    assert len(pages) > 20, [p.name for p in pages]
    ids = {p: _ids(soup(p)) for p in pages}
    broken = []
    for page in pages:
        for tag in soup(page).find_all(["a", "img", "link", "script"]):
            url = tag.get("href") or tag.get("src")
            if not url or _is_external(url):
                continue
            parts = urlsplit(url)
            target = (page.parent / unquote(parts.path)).resolve() if parts.path else page
            if not target.exists():
                broken.append(f"{page.relative_to(site)}: {url} (no such file)")
            elif parts.fragment and target.suffix == ".html" and unquote(parts.fragment) not in ids.get(target, set()):
                broken.append(f"{page.relative_to(site)}: {url} (no such anchor)")
    assert not broken, "\n".join(broken)


def test_readmes_links_land(site):
    """Every relative link of README leads to a file of the repository; a link to a page's heading
    leads to that heading in the built site."""
    text = README.read_text(encoding="utf-8")
    broken = []
    for url in re.findall(r"\]\(([^)\s]+)\)", text):
        if _is_external(url):
            continue
        parts = urlsplit(url)
        path = (ROOT / unquote(parts.path)).resolve()
        if not path.exists():
            broken.append(f"{url} (no such file)")
        elif parts.fragment:
            rel = path.relative_to(DOCS) if path.is_relative_to(DOCS) else None
            built = site / rel.with_suffix(".html") if rel else None
            if built is None or parts.fragment not in _ids(soup(built)):
                broken.append(f"{url} (no such anchor in the built page)")
    assert not broken, "\n".join(broken)


def test_readme_is_short_and_links_every_page_of_the_docs():
    """README is the first hour: short, and one click from every page that holds what it left out."""
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 300
    linked = {(ROOT / unquote(urlsplit(u).path)).resolve() for u in re.findall(r"\]\(([^)\s#]+)(?:#[^)\s]*)?\)", text)}
    pages = [p for p in DOCS.rglob("*.md") if "_" not in p.relative_to(DOCS).parts[0][:1] and p.name != "index.md"]
    # the architecture page shows ARCHITECTURE.md, which README links itself
    missing = [str(p.relative_to(ROOT)) for p in pages if p.resolve() not in linked
               and not (p.name == "architecture.md" and (ROOT / "ARCHITECTURE.md").resolve() in linked)]
    assert not missing, f"README links none of: {missing}"


def test_every_code_block_of_every_page_is_closed():
    """A fence left open swallows the rest of its page into one code block (a table, the prose)
    and the build still passes: every opening fence of every page has its closing one."""
    unclosed = []
    for page in [README, ROOT / "ARCHITECTURE.md", *DOCS.rglob("*.md")]:
        fence = None
        for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            m = re.match(r"^\s*(`{3,}|~{3,})", line)
            if m is None:
                continue
            if fence is None:
                fence = (m.group(1), n)
            elif m.group(1).startswith(fence[0]) and not line.strip()[len(m.group(1)):].strip():
                fence = None
        if fence is not None:
            unclosed.append(f"{page.relative_to(ROOT)}:{fence[1]}")
    assert not unclosed, f"code blocks opened and never closed: {unclosed}"


# --------------------------------------------------------------------------- the two commands
def _bash_blocks(text: str) -> list[str]:
    return [m.group(1).strip() for m in re.finditer(r"^```bash\n(.*?)^```", text, re.S | re.M)]


def test_readmes_two_commands_come_first_and_are_the_tutorials_and_cis():
    readme = README.read_text(encoding="utf-8")
    demo, tests = _bash_blocks(readme)[:2]
    assert demo.endswith("jupyter-gpulease demo") and demo.startswith("npm install --prefix .ci"), demo
    ci = CI_RUN.read_text(encoding="utf-8")
    (test_cmd,) = re.findall(r"^TEST_CMD='([^']+)'", ci, re.M)
    assert tests.endswith(test_cmd) and "pip install -e '.[test]'" in tests, tests
    # both within README's first 30 lines
    head = "\n".join(readme.splitlines()[:30])
    assert demo in head and tests in head
    # the tutorial gives the same two commands, word for word
    tutorial = _bash_blocks((DOCS / "tutorials" / "demo.md").read_text(encoding="utf-8"))
    assert demo in tutorial and tests in tutorial, tutorial
    # and CI runs the test command and installs the proxy the demo command installs
    assert "npm install --prefix .ci" in ci and "pip install -q -e '.[test]'" in ci


# --------------------------------------------------------------------------- the configuration reference
def _configurable_classes() -> dict[type, set[str]]:
    """Every Configurable the package defines that has config options of its own making, with
    the names of all its config options (class_traits(config=True))."""
    from traitlets.config import Configurable

    import jupyter_gpulease

    found: set[type] = set()
    for info in pkgutil.walk_packages(jupyter_gpulease.__path__, "jupyter_gpulease."):
        if info.name.endswith("__main__") or ".migrations" in info.name:
            continue
        module = importlib.import_module(info.name)
        for obj in vars(module).values():
            if inspect.isclass(obj) and issubclass(obj, Configurable) and obj.__module__ != "traitlets.config.configurable":
                found.add(obj)
    ours = {c for c in found if c.__module__.startswith("jupyter_gpulease")}
    ours |= {c for c in found if any(b in ours for b in c.__mro__[1:])}  # made with type() in a package module
    return {c: set(c.class_traits(config=True)) for c in ours
            if any(getattr(t, "this_class", None) in ours for t in c.class_traits(config=True).values())}


def _documented(page) -> dict[str, set[str]]:
    """Class name -> every option name its section of the built page lists."""
    out: dict[str, set[str]] = {}
    for section in page.find_all("section", id=re.compile(r"^config-")):
        heading = section.find(re.compile(r"^h\d$"))
        name = heading.get_text().rstrip("#¶ ").strip()
        names = set()
        for dt in section.select("dl.confval > dt"):
            full = dt.select_one(".sig-name").get_text()
            assert full.startswith(f"c.{name}."), (name, full)
            names.add(full.removeprefix(f"c.{name}."))
        for div in section.select("div.gpulease-inherited"):
            codes = div.select("code.std-confval") if "gpulease-external" not in div["class"] else div.select("code")
            names |= {c.get_text() for c in codes}
        out[name] = names
    return out


def test_the_configuration_reference_lists_every_option_of_every_configurable_class(site):
    documented = _documented(soup(site / "reference" / "config.html"))
    classes = _configurable_classes()
    assert classes and documented
    by_name = {c.__name__: c for c in classes}
    assert set(documented) <= set(by_name), set(documented) - set(by_name)
    for cls, options in classes.items():
        if cls.__name__ in documented:
            assert documented[cls.__name__] == options, (cls.__name__, options ^ documented[cls.__name__])
        else:
            # a class that only declares options for its subclasses: they list every one of them
            subclasses = [by_name[n] for n in documented if issubclass(by_name[n], cls)]
            assert subclasses, f"{cls.__module__}.{cls.__name__} has config options and no section, nor a subclass with one"
            for sub in subclasses:
                assert options <= documented[sub.__name__], (cls.__name__, sub.__name__, options - documented[sub.__name__])


def test_the_generated_pages_show_the_code(site):
    """The REST API page has every path of the OpenAPI document; the CLI page every command."""
    import json

    from jupyter_gpulease import cli

    api = json.loads((ROOT / "jupyter_gpulease" / "broker" / "openapi.json").read_text())
    text = soup(site / "reference" / "rest-api.html").get_text()
    for path, item in api["paths"].items():
        for method in ("get", "post", "delete", "put", "patch"):
            if method in item:
                assert f"{method.upper()} {path}" in text, (method, path)
    text = soup(site / "reference" / "cli.html").get_text()
    for name in cli.SUBCOMMANDS:
        assert f"usage: jupyter gpulease {name}" in text or name == "broker", name
    assert "jupyter gpulease maintenance add" in text


# --------------------------------------------------------------------------- screenshots
SHOTS = {
    "site-01-start-page.png": "index.html",
    "site-02-how-to-prices-and-groups.png": "how-to/prices-and-groups.html",
    "site-03-configuration-reference.png": "reference/config.html",
}


def test_screenshots_of_the_built_site(site, playwright_sync_api, chromium):
    from browserutil import chromium_browser

    with chromium_browser(playwright_sync_api, chromium) as browser:
        page = browser.page(1280, 900)
        for name, url in SHOTS.items():
            path, _, fragment = url.partition("#")
            page.goto((site / path).as_uri() + (f"#{fragment}" if fragment else ""))
            page.wait_for_load_state("load")
            assert page.locator("h1").first.is_visible()
            page.screenshot(path=str(IMAGES / name))
    for name in SHOTS:
        assert (IMAGES / name).stat().st_size > 10_000, name
