"""README's walkthrough, "The cycle in five minutes" (docs/tutorials/demo.md), at a reader's pace:
a minute between steps, as someone who reads each step before doing it takes. The demo
as it ships (its own timeouts: a kernel warned after 1 min of an idle GPU and suspended after 2,
an unused lease back after 5 min), in headless Chromium.

Every step it promises is seen, with no traceback in a cell: alice's first cell, typed minutes
after JupyterLab opened, finds her GPUs; `jupyter` works in a cell; bob waits in the queue; alice
is warned, then suspended, and bob is granted; alice's next cell waits in the queue (saying when
it may come sooner while bob's L4 sits unused); bob's Stop My Server changes his home page's
lease card without a reload; alice's cell prints her variable. All along, alice sees at most one
notification at a time, none cut before its Details button; after the cycle her notification
centre holds one, and it says what is true: her kernel has its GPU back.

It also saves the screenshots the tutorial shows (docs/images/walkthrough-*.png), each taken
once the step's one notification has slid into view. One test, several minutes long: the pauses
are the point.
"""

from __future__ import annotations

import re
import time

import pytest

from browserutil import ROOT, TOAST, chromium_browser, demo_config, open_lab, server_status, slid_in, start_from_form, toast
from hubharness import wait_for
from jupyter_gpulease.hub.demo import IDLE_RECLAIM_S, IDLE_WARN_S, UNUSED_LEASE_S
from test_demo import Demo

pytestmark = pytest.mark.timeout(1500)

FAILED = ROOT / "test-artifacts" / "pace"
IMAGES = ROOT / "docs" / "images"
VIEWPORT = {"width": 1280, "height": 760}
CELL = ("from jupyter_gpulease.sim.gpu import use_gpu\n"
        "use_gpu(util=80, memory_gb=6, seconds=20)   # 80% busy for 20 s, then idle with 6 GB held\n"
        "work = \"the weights of 42 epochs\"")
PRINT = "print(work)"


def reader(seconds: float) -> None:
    """A reader reads the next step before doing it (the browser and the servers go on meanwhile)."""
    time.sleep(seconds)


def shot(page, name: str, *shown) -> None:
    """A screenshot for the tutorial, once the notifications ``shown`` have slid fully into view (and no other is on screen)."""
    slid_in(page, *shown)
    wait_for(lambda: page.locator(TOAST).count() == len(shown), 15, f"{name}: other notifications on screen: "
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


def toasts(page) -> list[str]:
    """The notifications on screen, each as its text (its buttons' labels included)."""
    return [t.strip() for t in page.locator(TOAST).all_inner_texts()]


def one_at_most(page, step: str) -> list[str]:
    """At most one notification on screen, and none cut by JupyterLab's length limit."""
    shown = toasts(page)
    assert len(shown) <= 1, f"{step}: {len(shown)} notifications on screen: {shown}"
    assert not any("…" in t for t in shown), f"{step}: a notification was cut: {shown}"
    return shown


def output_of(page, code: str) -> str:
    """The output of the (last) cell that runs ``code``."""
    cell = page.locator(".jp-NotebookPanel .jp-Cell", has=page.locator(".cm-content", has_text=code)).last
    return "\n".join(cell.locator(".jp-OutputArea-output").all_inner_texts()).strip()


def no_traceback(page) -> None:
    outputs = "\n".join(page.locator(".jp-NotebookPanel .jp-OutputArea-output").all_inner_texts())
    assert "Traceback" not in outputs and "SimulatedGPUError" not in outputs, outputs


def test_the_cycle_at_a_readers_pace_sees_every_step_and_leaves_one_true_notification(tmp_path, playwright_sync_api, chromium):
    IMAGES.mkdir(parents=True, exist_ok=True)
    demo = Demo(tmp_path / "state", config_dir=demo_config(tmp_path), idle_timeout=None).start()
    out = demo.output()
    assert f"warned after {IDLE_WARN_S} s and suspended after {IDLE_RECLAIM_S} s" in out
    assert f"goes back after {UNUSED_LEASE_S // 60} min" in out
    assert "/services/gpulease/admin" in out
    try:
        with chromium_browser(playwright_sync_api, chromium, failed=FAILED / "failed") as browser:
            # 1. alice takes both L4s; JupyterLab opens; she reads on, opens a notebook, writes the cell slowly
            alice = browser.login(demo, "alice", **VIEWPORT)
            item = open_lab(alice, "alice", "gpu:2:L4")
            reader(60)
            alice.locator('.jp-LauncherCard[data-category="Notebook"]').first.click()
            alice.locator(".jp-StatusBar-Widget", has_text="| Idle").first.wait_for(timeout=120_000)
            reader(60)
            cell = alice.locator(".jp-Notebook .jp-Cell").first
            cell.locator(".cm-content").click()
            alice.keyboard.type(CELL)
            cell.locator(".cm-content").press("Control+Enter")
            wait_for(lambda: "Using the simulated GPU" in cell_output(alice, 0), 60,
                     f"alice's first cell did not find her GPUs: {cell_output(alice, 0)!r}", interval=0.5)
            wait_for(lambda: re.fullmatch(r"GPU L4 ×2 · [1-9]\d*% · 1 h \d+ min left", item.inner_text().strip()), 60,
                     f"the status bar did not show alice's GPUs at work: {item.inner_text()!r}", interval=0.3)
            shot(alice, "01-alice-computes")
            wait_for(lambda: "Done: the GPU is idle now" in cell_output(alice, 0), 60, "use_gpu did not finish", interval=0.5)
            st = server_status(alice, "alice")
            assert st["reclaim"]["suspend_available"] and st["reclaim"]["suspend_note"].startswith("simulated")
            assert st["reclaim"]["timeout_s"] == IDLE_RECLAIM_S
            run_next_cell(alice, "!jupyter gpulease leases")  # README: a server needs no token for the CLI
            cli = "!jupyter gpulease leases"
            wait_for(lambda: "active" in output_of(alice, cli), 60, f"the CLI in a cell: {output_of(alice, cli)!r}", interval=0.5)
            assert "command not found" not in output_of(alice, cli)
            no_traceback(alice)
            one_at_most(alice, "alice computes")

            # 2. bob (another browser) reads step 2, logs in and asks for an L4: both are alice's, he waits
            reader(60)
            bob = browser.login(demo, "bob", **VIEWPORT)
            start_from_form(bob, "gpu:1:L4")
            bob.wait_for_url("**/hub/spawn-pending/bob**")
            position = bob.locator("#gpulease-queue .gpulease-queue-position")
            position.wait_for(timeout=60_000)
            assert position.inner_text() == "Position 1 of 1 in the queue"
            shot(bob, "02-bob-waits-in-the-queue")

            # 3. alice's GPUs sit idle: warned (one notification), then suspended (the same one, in place); bob is granted
            warning = toast(alice, "Idle GPU: kernel")
            warning.wait_for(timeout=(IDLE_WARN_S + 90) * 1000)
            assert re.search(r"is suspended at \d\d:\d\d unless it computes again\.", warning.inner_text()), warning.inner_text()
            one_at_most(alice, "alice is warned")
            shot(alice, "03-alice-is-warned", warning)
            wait_for(lambda: item.inner_text().strip() == "GPU suspended · resumes on next cell", IDLE_RECLAIM_S + 60,
                     f"alice's status bar never said the kernel was suspended: {item.inner_text()!r}", interval=0.5)
            suspended = toast(alice, "is suspended: its next cell gets a GPU back")
            suspended.wait_for(timeout=30_000)
            assert one_at_most(alice, "alice is suspended")[0].startswith("Kernel ")
            st = server_status(alice, "alice")
            assert any("nothing is lost (simulated" in (k.get("message") or "") for k in st["kernels"]), st["kernels"]
            shot(alice, "04-alice-is-suspended", suspended)
            bob.wait_for_url("**/user/bob/**", timeout=90_000)
            bob_item = bob.locator(".jp-gpulease-status")
            bob_item.wait_for(timeout=120_000)
            bob.locator(".jp-LauncherCard").first.wait_for(timeout=120_000)
            wait_for(lambda: bob_item.inner_text().strip().startswith("GPU L4 ×1"), 120, "bob's status bar did not show his L4",
                     interval=0.5)
            shot(bob, "05-bob-is-granted")

            # 4. alice reads on, then runs print(work): it waits in the queue, in the cell, the status bar and her notification
            reader(60)
            run_next_cell(alice, PRINT)
            wait_for(lambda: "number 1 in the queue" in output_of(alice, PRINT), 60,
                     f"alice's waiting cell did not show her place in the queue: {output_of(alice, PRINT)!r}", interval=0.5)
            wait_for(lambda: "queue #1" in item.inner_text(), 30, f"alice's status bar did not show her place: {item.inner_text()!r}",
                     interval=0.5)
            printing = alice.locator(".jp-NotebookPanel .jp-Cell", has=alice.locator(".cm-content", has_text=PRINT)).last
            assert printing.locator(".jp-InputPrompt").inner_text().strip() == "[*]:"  # it waits, it has not run
            waiting = toast(alice, "waits for a GPU: number 1 in the queue")
            waiting.wait_for(timeout=30_000)
            one_at_most(alice, "alice waits")
            shot(alice, "06-alice-waits-in-the-queue", waiting)
            # bob's server has no kernel on his L4: it may come sooner, and both say by when
            wait_for(lambda: re.search(r"\(or by \d\d:\d\d if idle GPUs go back\)", item.inner_text()), 90,
                     f"alice's status bar did not say her GPU may come sooner: {item.inner_text()!r}", interval=1)
            wait_for(lambda: re.search(r"or sooner: by \d\d:\d\d", output_of(alice, PRINT)), 30,
                     f"alice's cell did not say her GPU may come sooner: {output_of(alice, PRINT)!r}", interval=0.5)
            assert "the weights" not in output_of(alice, PRINT), "the cell ran before the kernel had its GPU back"
            assert ("bob", "active") in demo.leases()  # his unused L4 is still his, minutes after the grant

            # 5. bob reads on, then stops his server on the hub's home page: its lease card follows without a reload
            reader(60)
            bob.goto(f"{demo.url}/hub/home")
            card = bob.locator("#gpulease-lease")
            assert card.get_attribute("data-kind") == "active" and "Your server holds 1 × L4" in card.inner_text()
            bob.locator("#stop").click()
            wait_for(lambda: bob.locator("#gpulease-lease").get_attribute("data-kind") == "none", 60,
                     "bob's lease card did not follow Stop My Server", interval=0.5)
            assert "Your server has no GPU lease" in bob.locator("#gpulease-lease").inner_text()

            # alice's kernel gets its GPUs back and the cell prints her variable
            wait_for(lambda: output_of(alice, PRINT).endswith("the weights of 42 epochs"), 120,
                     f"alice's cell did not print her variable after the resume: {output_of(alice, PRINT)!r}", interval=0.5)
            resumed = toast(alice, "has its GPU back")
            resumed.wait_for(timeout=30_000)
            one_at_most(alice, "alice resumes")
            wait_for(lambda: item.inner_text().strip().startswith("GPU L4 ×2"), 60, "alice's status bar did not show her GPUs again",
                     interval=0.5)
            shot(alice, "07-alice-resumes-with-her-variables", resumed)
            no_traceback(alice)

            # what the cycle leaves: one notification in alice's centre, and it is true (her GPU is back)
            st = server_status(alice, "alice")
            assert st["lease"]["state"] == "active" and [k["state"] for k in st["kernels"]] == ["ok"]
            alice.locator(".jp-Notification-Status").click()
            items = alice.locator(".jp-Notification-List-Item")
            wait_for(lambda: items.count() >= 1, 10, "alice's notification centre did not open", interval=0.2)
            entries = [t.strip() for t in items.all_inner_texts()]
            assert len(entries) == 1 and "has its GPU back" in entries[0], entries
            assert "…" not in entries[0]
    finally:
        demo.stop()
