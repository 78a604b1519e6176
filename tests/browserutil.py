"""What the browser tests share: the demo's configs with a test's additions, headless Chromium,
and the steps a user takes in it (log in, the spawn form, a notebook in JupyterLab, its
notifications).

Chromium is found by tests/tooling.py (the ``chromium`` fixture; skipped without it, failed in
CI) and driven by the Python package playwright (its own browser download is never used).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from hubharness import wait_for
from jupyter_gpulease.devices.simulated import SimulatedBackend
from test_demo import Demo

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts" / "browser"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-dev-shm-usage"]
# servers' settings for tests that watch them: a heartbeat every 2 s, a sample every second
FAST_SERVERS = ["--GPULeaseExtension.heartbeat_interval=2", "--GPULeaseExtension.sample_interval=1"]
# a notification on screen (a replaced one lingers in the page while it slides out)
TOAST = ".Toastify__toast:not([class*='exit'])"


# ---------------------------------------------------------------------- the demo's configs
def demo_config(tmp_path: Path, *, server_args: Sequence[str] = (), hub: str = "", broker: str = "", news: bool = False) -> Path:
    """A folder for the demo's ``--config-dir``: the example configs (config/), with a test's additions.

    ``server_args``: settings on the single-user servers' command line (``--Class.name=value``),
    each in place of the demo's own of that name; ``hub``: more of jupyterhub_config.py;
    ``broker``: more of gpulease_config.py (which loads the example's first); ``news``: whether
    JupyterLab asks about Jupyter news (it would cover screenshots)."""
    conf = tmp_path / "config"
    conf.mkdir()
    shutil.copy(ROOT / "config" / "jupyterhub_config.py", conf / "jupyterhub_config.py")
    added = ["", "# --- test"]
    if server_args:
        names = sorted({a.split("=", 1)[0] for a in server_args})
        added += ["_args = c.Spawner.args if isinstance(c.Spawner.args, list) else c.Spawner.args.get_value([])  # not root: not set",
                  f"c.Spawner.args = [a for a in _args if a.split('=', 1)[0] not in {names!r}] + {list(server_args)!r}"]
    if not news:
        labconf = tmp_path / "labconf" / "labconfig"
        labconf.mkdir(parents=True)
        (labconf / "page_config.json").write_text(json.dumps({"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}}))
        added.append(f"c.Spawner.environment.update({{'JUPYTER_CONFIG_PATH': {str(tmp_path / 'labconf')!r}}})  # no news question")
    if os.environ.get("JUPYTER_PATH"):
        # a test run whose JupyterLab loads an extension build of its own: the servers look there too
        added.append(f"c.Spawner.environment.update({{'JUPYTER_PATH': {os.environ['JUPYTER_PATH']!r}}})")
    with open(conf / "jupyterhub_config.py", "a") as f:
        f.write("\n".join([*added, hub]) + "\n")
    (conf / "gpulease_config.py").write_text(
        "c = get_config()  # noqa: F821\n"
        f"load_subconfig({str(ROOT / 'config' / 'gpulease_config.py')!r})  # noqa: F821\n" + broker
    )
    return conf


def start_demo(tmp_path: Path, config_dir: Path) -> tuple[Demo, SimulatedBackend]:
    """The demo on ``config_dir``'s configs, its state in ``tmp_path``/state, and the simulated GPUs
    its broker and servers read (its state file), for the test to drive."""
    state = tmp_path / "state"
    state.mkdir(exist_ok=True)
    demo = Demo(state, config_dir=config_dir).start()
    return demo, SimulatedBackend({"state_file": str(state / "sim-gpus.json")})


# ---------------------------------------------------------------------- Chromium
class Chromium:
    """Headless Chromium: a page per user, each in a context of its own (its own cookies)."""

    def __init__(self, browser):
        self.browser = browser

    def page(self, width: int = 1400, height: int = 900):
        return self.browser.new_context(viewport={"width": width, "height": height}).new_page()

    def login(self, demo: Demo, user: str, width: int = 1400, height: int = 900):
        """A page of its own on which ``user`` logged in to the demo (it shows the spawn form)."""
        page = self.page(width, height)
        login(page, demo, user)
        return page

    def screenshots(self, prefix: Path) -> None:
        """Every open page, as ``<prefix>-<context>-<page>.png``."""
        for i, ctx in enumerate(self.browser.contexts):
            for j, pg in enumerate(ctx.pages):
                pg.screenshot(path=f"{prefix}-{i}-{j}.png")


@contextmanager
def chromium_browser(playwright_sync_api, chromium: str, *, failed: Path | None = None) -> Iterator[Chromium]:
    """Headless Chromium for the block; when the block fails, every open page is saved with
    :meth:`Chromium.screenshots` under the prefix ``failed`` (what each user saw), whose folder
    is made at the start (the test's screenshots go there too)."""
    if failed is not None:
        failed.parent.mkdir(parents=True, exist_ok=True)
    with playwright_sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS, headless=True)
        try:
            yield Chromium(browser)
        except BaseException:
            if failed is not None:
                Chromium(browser).screenshots(failed)
            raise
        finally:
            browser.close()


# ---------------------------------------------------------------------- the hub's pages
def login(page, demo: Demo, user: str) -> None:
    """``user`` logs in on the demo's login page (it lands on the spawn form)."""
    page.goto(f"{demo.url}/hub/login")
    page.fill("#username_input", user)
    page.fill("#password_input", demo.password)
    page.click("#login_submit")
    page.wait_for_url("**/hub/spawn**")


def card(page, choice: str):
    """The spawn form's card for ``choice`` (e.g. 'gpu:2:L4')."""
    return page.locator(f'label.gpulease-card:has(input[name=choice][value="{choice}"])')


def start_from_form(page, choice: str) -> None:
    page.check(f'input[name=choice][value="{choice}"]')
    page.click("#spawn_form [type=submit]")


def open_lab(page, user: str, choice: str):
    """On the spawn form, ``user`` (logged in) starts a server with ``choice`` and reaches
    JupyterLab; the GPU lease's item in its status bar, once drawn."""
    start_from_form(page, choice)
    page.wait_for_url(f"**/user/{user}/**", timeout=120_000)
    item = page.locator(".jp-gpulease-status")
    item.wait_for(timeout=120_000)
    return item


# ---------------------------------------------------------------------- JupyterLab
def open_notebook_and_run(page, code: str) -> None:
    """A new notebook from the launcher; ``code`` typed into its first cell and run once the kernel is idle."""
    page.wait_for_selector(".jp-LauncherCard", timeout=120_000)
    page.locator('.jp-LauncherCard[data-category="Notebook"]').first.click()
    cell = page.locator(".jp-Notebook .jp-Cell").first
    cell.locator(".cm-content").wait_for(timeout=60_000)
    # a cell run before the kernel is connected is silently dropped: wait for "Idle" in the status bar
    page.locator(".jp-StatusBar-Widget", has_text="| Idle").first.wait_for(timeout=120_000)
    cell.locator(".cm-content").click()
    page.keyboard.type(code)
    cell.locator(".cm-content").press("Control+Enter")
    prompt = cell.locator(".jp-InputPrompt")
    wait_for(lambda: re.search(r"\[(\*|\d+)\]", prompt.inner_text()) is not None, 60, f"the cell {code!r} did not run", interval=0.5)


def server_status(page, user: str) -> dict:
    """The server extension's status, fetched by the page as JupyterLab fetches it (with its XSRF token)."""
    return page.evaluate(
        """async (user) => {
            const xsrf = (document.cookie.match(/_xsrf=([^;]+)/) || [])[1] || '';
            const r = await fetch(`/user/${user}/gpulease/api/status?history=0`, {headers: {'X-XSRFToken': xsrf}});
            return await r.json();
        }""", user)


def toast(page, text: str):
    """The notification on screen that says ``text``."""
    return page.locator(TOAST, has_text=text).first


def slid_in(page, *toasts, timeout: float = 10) -> None:
    """Wait until each notification has slid fully into the page's view (for a screenshot)."""
    width = page.viewport_size["width"]
    for t in toasts:
        wait_for(lambda t=t: (box := t.bounding_box()) is not None and box["x"] + box["width"] <= width, timeout,
                 "a notification did not slide into view", interval=0.1)
