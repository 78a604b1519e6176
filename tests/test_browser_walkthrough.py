"""README's walkthrough, "The cycle in five minutes", run in headless Chromium against the demo as a
user gets it (its own idle timeouts: warned after 1 min of GPU idleness, suspended after 2 min; the
simulated cuda-checkpoint): it asserts each step on what the users see and saves the screenshots
README shows (docs/images/walkthrough-*.png). At each step one notification says what changed.

alice takes both L4s and runs a cell that uses the GPU (``use_gpu``) and sets a variable; bob
asks for an L4 and waits in the queue; alice's GPU sits idle: she is warned, then her kernel is
suspended (``GPU suspended · resumes on next cell``) and bob is granted at once; alice runs a
cell: it waits in the queue with its position shown, bob stops his server, alice's kernel gets
its GPUs back and the cell prints her variable.
"""

from __future__ import annotations

import re

import pytest

from browserutil import (
    ROOT,
    TOAST,
    chromium_browser,
    demo_config,
    open_lab,
    open_notebook_and_run,
    server_status,
    slid_in,
    start_from_form,
    toast,
)
from hubharness import wait_for
from jupyter_gpulease.hub.demo import IDLE_RECLAIM_S, IDLE_WARN_S
from test_demo import Demo

pytestmark = pytest.mark.timeout(600)

IMAGES = ROOT / "docs" / "images"
FAILED = ROOT / "test-artifacts" / "walkthrough"
VIEWPORT = {"width": 1280, "height": 760}


def shot(page, name: str, *toasts) -> None:
    """A screenshot for README, once the notifications ``toasts`` have slid fully into view (and no other is on screen)."""
    slid_in(page, *toasts)
    wait_for(lambda: page.locator(TOAST).count() == len(toasts), 15, f"{name}: other notifications on screen: "
             f"{page.locator(TOAST).all_inner_texts()}", interval=0.2)
    page.screenshot(path=str(IMAGES / f"walkthrough-{name}.png"))


def cell_output(page, index: int) -> str:
    out = page.locator(".jp-NotebookPanel .jp-Cell").nth(index).locator(".jp-OutputArea-output")
    return "\n".join(out.all_inner_texts()).strip()


def run_next_cell(page, code: str) -> None:
    """A new cell below the last one, ``code`` typed into it and run."""
    cells = page.locator(".jp-NotebookPanel .jp-Cell")
    n = cells.count()
    cells.last.locator(".cm-content").click()
    page.keyboard.press("Escape")  # command mode: B inserts a cell below
    page.keyboard.press("b")
    wait_for(lambda: cells.count() == n + 1, 10, "no new cell", interval=0.1)
    cells.last.locator(".cm-content").click()
    page.keyboard.type(code)
    cells.last.locator(".cm-content").press("Shift+Enter")


def test_the_cycle_in_five_minutes_warning_suspend_handover_and_resume_with_the_variables(tmp_path, playwright_sync_api, chromium):
    IMAGES.mkdir(parents=True, exist_ok=True)
    state = tmp_path / "state"
    # the example configs as they are (the demo's own idle reclaim), only without JupyterLab's news question
    demo = Demo(state, config_dir=demo_config(tmp_path), idle_timeout=None).start()
    assert f"warned after {IDLE_WARN_S} s and suspended after {IDLE_RECLAIM_S} s" in demo.output()
    assert "/services/gpulease/admin" in demo.output()
    try:
        with chromium_browser(playwright_sync_api, chromium, failed=FAILED / "failed") as browser:
            # 1. alice takes both L4s and computes: the kernel uses the (simulated) GPU and keeps a variable
            alice = browser.login(demo, "alice", **VIEWPORT)
            item = open_lab(alice, "alice", "gpu:2:L4")
            open_notebook_and_run(alice, "from jupyter_gpulease.sim.gpu import use_gpu\n"
                                         "use_gpu(util=80, memory_gb=6, seconds=4)\n"
                                         "work = 'the weights of 42 epochs'")
            wait_for(lambda: re.fullmatch(r"GPU L4 ×2 · [1-9]\d*% · \d+ h( \d+ min)? left", item.inner_text().strip()), 60,
                     "the status bar did not show alice's GPUs at work", interval=0.3)
            shot(alice, "01-alice-computes")
            wait_for(lambda: "Done: the GPU is idle now" in cell_output(alice, 0), 60, "use_gpu did not finish", interval=0.5)
            st = server_status(alice, "alice")
            assert st["reclaim"]["suspend_available"] and st["reclaim"]["suspend_note"].startswith("simulated")
            assert st["reclaim"]["timeout_s"] == IDLE_RECLAIM_S

            # 2. bob asks for an L4: all are alice's, so he waits in the queue
            bob = browser.login(demo, "bob", **VIEWPORT)
            start_from_form(bob, "gpu:1:L4")
            bob.wait_for_url("**/hub/spawn-pending/bob**")
            position = bob.locator("#gpulease-queue .gpulease-queue-position")
            position.wait_for(timeout=60_000)
            assert position.inner_text() == "Position 1 of 1 in the queue"
            shot(bob, "02-bob-waits-in-the-queue")

            # 3. alice's GPUs sit idle: she is warned (the status bar still shows the lease)
            warning = toast(alice, "Idle GPU: kernel")
            warning.wait_for(timeout=(IDLE_WARN_S + 60) * 1000)
            assert re.search(r"is suspended at \d\d:\d\d unless it computes again\.", warning.inner_text()), warning.inner_text()
            shot(alice, "03-alice-is-warned", warning)

            # 4. then her kernel is suspended (simulated), the lease goes back, and bob is granted at once
            wait_for(lambda: item.inner_text().strip() == "GPU suspended · resumes on next cell", IDLE_RECLAIM_S + 60,
                     "alice's status bar never said the kernel was suspended", interval=0.5)
            suspended = toast(alice, "is suspended: its next cell gets a GPU back")
            suspended.wait_for(timeout=30_000)
            st = server_status(alice, "alice")
            assert any("nothing is lost (simulated" in (k.get("message") or "") for k in st["kernels"]), st["kernels"]
            shot(alice, "04-alice-is-suspended", suspended)
            bob.wait_for_url("**/user/bob/**", timeout=60_000)
            bob.locator(".jp-gpulease-status").wait_for(timeout=120_000)
            bob.locator(".jp-LauncherCard").first.wait_for(timeout=120_000)
            wait_for(lambda: bob.locator(".jp-gpulease-status").inner_text().strip().startswith("GPU L4 ×1"), 60,
                     "bob's status bar did not show his L4", interval=0.5)
            shot(bob, "05-bob-is-granted")
            assert ("bob", "active") in demo.leases()

            # 5. alice runs a cell: it waits for a GPU, showing her place in the queue, while bob holds an L4
            run_next_cell(alice, "print(work)")
            wait_for(lambda: "number 1 in the queue" in cell_output(alice, 1), 60,
                     f"alice's waiting cell did not show her place in the queue: {cell_output(alice, 1)!r}", interval=0.5)
            wait_for(lambda: "queue #1" in item.inner_text(), 30, f"alice's status bar did not show her place: {item.inner_text()!r}",
                     interval=0.5)
            assert "the weights" not in cell_output(alice, 1), "the cell ran before the kernel had its GPU back"
            assert alice.locator(".jp-NotebookPanel .jp-Cell").nth(1).locator(".jp-InputPrompt").inner_text().strip() == "[*]:"
            waiting = toast(alice, "waits for a GPU: number 1 in the queue")
            waiting.wait_for(timeout=30_000)
            shot(alice, "06-alice-waits-in-the-queue", waiting)

            # 6. bob stops his server; alice's kernel gets the GPUs back and the cell prints her variable
            bob.goto(f"{demo.url}/hub/home")
            bob.locator("#stop").click()
            wait_for(lambda: cell_output(alice, 1).endswith("the weights of 42 epochs"), 120,
                     "alice's cell did not print her variable after the resume", interval=0.5)
            resumed = toast(alice, "has its GPU back")
            resumed.wait_for(timeout=30_000)
            wait_for(lambda: item.inner_text().strip().startswith("GPU L4 ×2"), 60, "alice's status bar did not show her GPUs again",
                     interval=0.5)
            shot(alice, "07-alice-resumes-with-her-variables", resumed)
    finally:
        demo.stop()
