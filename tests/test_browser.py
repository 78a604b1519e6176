"""Headless Chromium against the demo: log in, pick a GPU on the spawn form, reach JupyterLab and
run a cell in a real kernel on the leased GPUs; a second user sees the queue on the spawn page;
the admin revokes the first lease on the broker's admin page and its user's home page says why.
Screenshots go to test-artifacts/browser/.

Chromium and playwright: see tests/browserutil.py.
"""

from __future__ import annotations

import pytest

from browserutil import ARTIFACTS, card, chromium_browser, start_from_form
from hubharness import wait_for
from test_demo import Demo

pytestmark = pytest.mark.timeout(400)


def run_a_cell_in_jupyterlab(page, code: str, timeout_ms: int = 120_000) -> str:
    """In an open JupyterLab: a new Python notebook from the launcher, run ``code``, return its output.

    Fails unless JupyterLab really loaded (its shell and launcher drew) and a kernel ran the cell.
    """
    page.wait_for_selector("#jp-main-dock-panel", timeout=timeout_ms)
    # locators, not element handles: JupyterLab redraws the launcher and the cells while it loads
    page.locator('.jp-LauncherCard[data-category="Notebook"]').first.click(timeout=timeout_ms)
    # the kernel is up when the notebook's status says idle; a cell run before the kernel's
    # connection is up is dropped without a word, so also wait for "Idle" in the status bar
    page.locator('.jp-NotebookPanel .jp-Notebook-ExecutionIndicator[data-status="idle"]').first.wait_for(timeout=timeout_ms)
    page.locator(".jp-StatusBar-Widget", has_text="| Idle").first.wait_for(timeout=timeout_ms)
    first_cell = page.locator(".jp-NotebookPanel .jp-Cell").first
    first_cell.locator(".cm-content").click(timeout=timeout_ms)
    page.keyboard.type(code)
    page.keyboard.press("Shift+Enter")
    out = page.locator(".jp-NotebookPanel .jp-OutputArea-output").first
    try:
        try:
            out.wait_for(timeout=20_000)
        except Exception:
            # still "[ ]:" (never sent to the kernel, not "[*]:" running): run that cell again
            if first_cell.locator(".jp-InputPrompt").inner_text().strip() != "[ ]:":
                raise
            first_cell.locator(".cm-content").click(timeout=timeout_ms)
            page.keyboard.press("Control+Enter")
            out.wait_for(timeout=timeout_ms)
    except Exception:
        page.screenshot(path=str(ARTIFACTS / "failed-no-cell-output.png"))
        raise
    dismiss_news_question(page)
    return out.inner_text().strip()


def dismiss_news_question(page) -> None:
    """JupyterLab asks once whether to fetch Jupyter news; answer No so screenshots show the work."""
    no = page.locator(".jp-Notification-Toast button", has_text="No")
    if no.count():
        no.first.click()


def test_log_in_pick_a_gpu_run_a_cell_see_the_lease_on_the_home_page_while_a_second_user_queues(tmp_path, playwright_sync_api, chromium):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    demo = Demo(tmp_path / "state").start()
    try:
        with chromium_browser(playwright_sync_api, chromium) as browser:
            alice = browser.login(demo, "alice", 1280, 900)
            two_l4 = card(alice, "gpu:2:L4").inner_text()
            assert "22 GB of GPU memory each" in two_l4 and "2 of 2 idle" in two_l4
            assert "starts now" in two_l4 or "free now" in two_l4
            alice.screenshot(path=str(ARTIFACTS / "01-spawn-form.png"), full_page=True)

            start_from_form(alice, "gpu:2:L4")  # both L4s
            alice.wait_for_url("**/user/alice/lab**", timeout=120_000)
            # the kernel sees the two leased GPUs (by UUID) and computes
            output = run_a_cell_in_jupyterlab(
                alice, "import os; print(len(os.environ['CUDA_VISIBLE_DEVICES'].split(',')), 6 * 7)")
            alice.screenshot(path=str(ARTIFACTS / "02-alice-runs-a-cell-in-jupyterlab.png"))
            assert output == "2 42"
            assert demo.leases() == [("alice", "active")]

            # the hub's home page shows what the server holds and for how long
            alice.goto(f"{demo.url}/hub/home")
            panel = alice.locator("#gpulease-lease")
            assert panel.get_attribute("data-kind") == "active"
            text = panel.inner_text()
            assert "Your server holds 2 × L4 on sim-node-1" in text and "Time left: 1 h " in text and "(until " in text
            alice.screenshot(path=str(ARTIFACTS / "03-home-page-shows-the-lease.png"), full_page=True)

            bob = browser.login(demo, "bob", 1280, 900)
            one_l4 = card(bob, "gpu:1:L4").inner_text()
            assert "0 of 2 idle" in one_l4 and ("in the queue" in one_l4 or "all in use" in one_l4)
            start_from_form(bob, "gpu:1:L4")
            bob.wait_for_url("**/hub/spawn-pending/bob**")
            # while queued the page shows the place in the queue, not a progress bar
            position = bob.locator("#gpulease-queue .gpulease-queue-position")
            position.wait_for(timeout=60_000)
            assert position.inner_text() == "Position 1 of 1 in the queue"
            assert bob.locator(".progress").is_hidden()
            assert bob.locator("#stop-server-btn").inner_text() == "Leave the queue"
            assert bob.locator("#gpulease-queue .gpulease-queue-what").inner_text() == "Waiting for 1 × L4 (22 GB)"
            bob.screenshot(path=str(ARTIFACTS / "04-bob-waits-in-the-queue.png"), full_page=True)
            assert ("bob", "queued") in demo.leases()

            # the hub's admin revokes alice's lease on the broker's admin page, saying why
            admin = browser.login(demo, "admin", 1280, 900)
            admin.goto(f"{demo.url}/services/gpulease/admin")
            row = admin.locator("#active tr", has_text="alice")
            row.locator("input[name=reason]").fill("GPU maintenance on sim-node-1 at noon")
            admin.screenshot(path=str(ARTIFACTS / "05-admin-revokes-a-lease.png"), full_page=True)
            row.locator("button", has_text="Revoke").click()
            assert "revoked; its server is stopped, and its user is told why" in admin.locator("p.msg").inner_text()

            # alice's home page then says why her lease ended and what to do
            def ended_panel():  # the end is known at once; the server's stop follows
                alice.goto(f"{demo.url}/hub/home")
                panel = alice.locator("#gpulease-lease")
                return panel.get_attribute("data-kind") == "ended" and "Your server was stopped." in panel.inner_text()
            wait_for(ended_panel, 60, "alice's home page never showed the end of her lease", interval=2)
            text = alice.locator("#gpulease-lease").inner_text()
            assert "Your GPU lease (2 × L4 on sim-node-1) ended" in text
            assert "evoked by admin (admin)" in text and "GPU maintenance on sim-node-1 at noon" in text
            assert "ask your administrator" in text
            alice.screenshot(path=str(ARTIFACTS / "06-home-page-says-why-the-lease-ended.png"), full_page=True)
            # and bob, first in the queue, gets the L4 she held
            wait_for(lambda: ("bob", "active") in demo.leases(), 60, "bob was not granted the freed L4")
    finally:
        demo.stop()
    # the admin ended alice's lease; Ctrl-C ended bob's
    states = dict(demo.leases())
    assert states["alice"] == "revoked" and states["bob"] == "released"
