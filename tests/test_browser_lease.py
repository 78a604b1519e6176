"""Headless Chromium against the demo hub: the GPU lease inside JupyterLab.

alice logs in and spawns with a GPU: the status bar shows her lease; in a notebook `%gpu watch`
draws the widget, which changes as the (simulated) GPU's utilization changes; the broker's
expiry warning appears as a JupyterLab notification whose Extend button extends the lease. bob,
whose server runs without a GPU, asks for one with `%gpu request` and sees his place in the
queue in the status bar. Screenshots go to test-artifacts/browser-lease/ (the README's
walkthrough shows them).

The demo runs from a copy of the example configs that warns of expiry 12 h ahead (so a fresh
lease is warned at once) and has servers send heartbeats every 2 s; the test drives the
simulated GPUs through the demo's own state file (``<state>/sim-gpus.json``).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from hubharness import wait_for
from jupyter_gpulease.devices.simulated import SimulatedBackend
from test_browser import CHROMIUM_ARGS, login, start_from_form
from test_demo import Demo

pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts" / "browser-lease"


def demo_config(tmp_path: Path) -> Path:
    """The example configs, with expiry warnings 12 h ahead, fast heartbeats and no JupyterLab news."""
    conf = tmp_path / "config"
    conf.mkdir()
    shutil.copy(ROOT / "config" / "jupyterhub_config.py", conf / "jupyterhub_config.py")
    labconf = tmp_path / "labconf" / "labconfig"
    labconf.mkdir(parents=True)
    (labconf / "page_config.json").write_text(json.dumps({"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}}))
    with open(conf / "jupyterhub_config.py", "a") as f:
        f.write(f"""
# --- test: fast heartbeats, no news pop-up (the simulated GPUs' state file is the demo's own)
c.Spawner.args.extend(["--GPULeaseExtension.heartbeat_interval=2", "--GPULeaseExtension.sample_interval=1"])
c.Spawner.environment.update({{"JUPYTER_CONFIG_PATH": {str(tmp_path / "labconf")!r}}})
""")
    (conf / "gpulease_config.py").write_text(
        "c = get_config()  # noqa: F821\n"
        f"load_subconfig({str(ROOT / 'config' / 'gpulease_config.py')!r})  # noqa: F821\n"
        "c.GPULeaseBroker.warn_before = 12 * 3600  # every lease is within its warning time: the notification shows at once\n"
    )
    return conf


def server_status(page, user: str) -> dict:
    return page.evaluate(
        """async (user) => {
            const xsrf = (document.cookie.match(/_xsrf=([^;]+)/) || [])[1] || '';
            const r = await fetch(`/user/${user}/gpulease/api/status?history=0`, {headers: {'X-XSRFToken': xsrf}});
            return await r.json();
        }""", user)


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


def test_the_lease_in_jupyterlab_status_bar_widget_notification_and_queue(tmp_path, playwright_sync_api, chromium):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    state = tmp_path / "state"
    state.mkdir()
    demo = Demo(state, config_dir=demo_config(tmp_path)).start()
    sim = SimulatedBackend({"state_file": str(state / "sim-gpus.json")})  # the demo's servers read the same file
    try:
        with playwright_sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS, headless=True)
            try:
                alice = browser.new_context(viewport={"width": 1400, "height": 900}).new_page()
                login(alice, demo.url, "alice", demo.password)
                start_from_form(alice, "gpu:2:L4")  # both L4s
                alice.wait_for_url("**/user/alice/**", timeout=120_000)
                item = alice.locator(".jp-gpulease-status")
                item.wait_for(timeout=120_000)
                wait_for(lambda: re.fullmatch(r"GPU L4 ×2 · \d+% · \d+:\d\d left", item.inner_text().strip()) is not None, 90,
                         "the status bar did not show alice's lease", interval=0.5)
                alice.screenshot(path=str(ARTIFACTS / "01-status-bar-shows-the-lease.png"))

                # the status bar item opens the panel: per-device figures and the actions
                item.click()
                panel = alice.locator("#jp-gpulease-panel")
                panel.wait_for(state="visible")
                assert panel.locator(".jp-gpulease-device").count() == 2
                assert panel.locator("button[data-action='lease/extend']").is_visible()
                alice.screenshot(path=str(ARTIFACTS / "02-panel-with-devices-and-actions.png"))
                item.click()

                # the expiry warning (12 h ahead in this config) is a notification; its Extend button extends the lease
                # (a replaced notification lingers in the page while it slides out: take a standing one)
                toast = alice.locator(".Toastify__toast:not([class*='exit'])", has_text="GPU lease ends soon").first
                toast.wait_for(timeout=90_000)
                alice.screenshot(path=str(ARTIFACTS / "03-expiry-warning-notification.png"))
                before = server_status(alice, "alice")["lease"]["expires_at"]
                toast.get_by_role("button", name="Extend 30 min").click()
                wait_for(lambda: server_status(alice, "alice")["lease"]["expires_at"] >= before + 1800 - 1, 60,
                         "Extend in the notification did not extend the lease", interval=0.5)

                # a notebook: %gpu watch draws the widget, which follows the GPUs' utilization
                open_notebook_and_run(alice, "%gpu watch")
                widget = alice.locator(".gpulease-widget")
                widget.wait_for(timeout=90_000)
                slices = server_status(alice, "alice")["lease"]["placement"]["slices"]
                for s in slices:
                    sim.set_utilization(s["gpu_uuid"], 12)
                wait_for(lambda: widget.inner_text().count("12%") == 2, 60, "the widget did not show 12%", interval=0.5)
                alice.screenshot(path=str(ARTIFACTS / "04-widget-at-12-percent.png"))
                for s in slices:
                    sim.set_utilization(s["gpu_uuid"], 87)
                wait_for(lambda: widget.inner_text().count("87%") == 2, 60, "the widget did not follow the utilization to 87%", interval=0.5)
                assert re.search(r"L4 #\d", widget.inner_text()) and "Time left" in widget.inner_text()
                wait_for(lambda: "87%" in item.inner_text(), 60, "the status bar did not follow the utilization", interval=0.5)
                alice.screenshot(path=str(ARTIFACTS / "05-widget-follows-utilization.png"))

                # bob's server runs without a GPU; he asks for both L4s and waits in the queue
                bob = browser.new_context(viewport={"width": 1400, "height": 900}).new_page()
                login(bob, demo.url, "bob", demo.password)
                start_from_form(bob, "cpu")
                bob.wait_for_url("**/user/bob/**", timeout=120_000)
                open_notebook_and_run(bob, "%gpu request --gpus 2 --model L4")
                bob_item = bob.locator(".jp-gpulease-status")
                wait_for(lambda: re.match(r"GPU queue #1( · .+)?$", bob_item.inner_text().strip()) is not None, 90,
                         "bob's status bar did not show his place in the queue", interval=0.5)
                bob.screenshot(path=str(ARTIFACTS / "06-second-user-waits-in-the-queue.png"))
                assert server_status(bob, "bob")["lease"]["state"] == "queued"
            except BaseException:
                for ctx in browser.contexts:  # what each user saw when it failed
                    for i, pg in enumerate(ctx.pages):
                        pg.screenshot(path=str(ARTIFACTS / f"failed-{browser.contexts.index(ctx)}-{i}.png"))
                raise
            finally:
                browser.close()
    finally:
        demo.stop()
