"""Headless Chromium against the demo hub: the GPU lease inside JupyterLab.

alice logs in and spawns with a GPU: the status bar shows her lease; in a notebook `%gpu watch`
draws the widget, which changes as the (simulated) GPU's utilization changes; the broker's
expiry warning appears as a JupyterLab notification (one line: when it ends) whose Extend button
extends the lease. bob,
whose server runs without a GPU, asks for one with `%gpu request` and sees his place in the
queue in the status bar. Screenshots go to test-artifacts/browser-lease/ (the README's
walkthrough shows them).

A second test follows bob's JupyterLab through the live feed, with the hub and servers checking
XSRF as a default deployment does: a grant, an idle reclaim (suspend), a resume from the
notification and an admin's revoke, each an event that the event stream delivered (read from
Chromium's DevTools protocol), each change the one notification of the lease or of the kernel
(one line; its Details button opens the panel with the events' messages in full), the stream is answered
200 and the server's log has no 403 for the gpulease API; when the stream cannot be opened the
status bar polls, and goes back to the stream when it can. Its screenshots go to
test-artifacts/browser/feed-*.png.

The demo runs from a copy of the example configs that warns of expiry 12 h ahead (so a fresh
lease is warned at once) and has servers send heartbeats every 2 s; the test drives the
simulated GPUs through the demo's own state file (``<state>/sim-gpus.json``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import standin_cuda_checkpoint as standin
from browserutil import (
    FAST_SERVERS,
    ROOT,
    TOAST,
    chromium_browser,
    demo_config,
    login,
    open_lab,
    open_notebook_and_run,
    server_status,
    slid_in,
    start_demo,
    toast,
)
from hubharness import wait_for

pytestmark = pytest.mark.timeout(600)

ARTIFACTS = ROOT / "test-artifacts" / "browser-lease"
# every lease is within its warning time: the notification shows at once
WARN_AT_ONCE = "c.GPULeaseBroker.warn_before_s = 12 * 3600\n"  # (the example config sets warn_before_s: the old name would lose)


def lease_config(tmp_path: Path) -> Path:
    """The example configs, with expiry warnings 12 h ahead, fast heartbeats, and not the demo's
    one-minute idle reclaim: the lease stays while the test looks at it."""
    return demo_config(tmp_path, server_args=[*FAST_SERVERS, "--GPUIdleRule.gpu_idle_timeout=3600"], broker=WARN_AT_ONCE)


def test_the_lease_in_jupyterlab_status_bar_widget_notification_and_queue(tmp_path, playwright_sync_api, chromium):
    demo, sim = start_demo(tmp_path, lease_config(tmp_path))
    try:
        with chromium_browser(playwright_sync_api, chromium, failed=ARTIFACTS / "failed") as browser:
            alice = browser.login(demo, "alice")
            item = open_lab(alice, "alice", "gpu:2:L4")  # both L4s
            wait_for(lambda: re.fullmatch(r"GPU L4 ×2 · \d+% · \d+ h( \d+ min)? left", item.inner_text().strip()) is not None, 90,
                     "the status bar did not show alice's lease", interval=0.5)
            alice.locator(".jp-LauncherCard").first.wait_for(timeout=60_000)
            expiring = toast(alice, "GPU lease ends at")  # (warned at once in this config)
            expiring.wait_for(timeout=90_000)
            slid_in(alice, expiring)
            alice.screenshot(path=str(ARTIFACTS / "01-status-bar-shows-the-lease.png"))

            # the status bar item opens the panel: per-device figures and the actions
            item.click()
            panel = alice.locator("#jp-gpulease-panel")
            panel.wait_for(state="visible")
            assert panel.locator(".jp-gpulease-device").count() == 2
            assert panel.locator("button[data-action='lease/extend']").is_visible()
            alice.screenshot(path=str(ARTIFACTS / "02-panel-with-devices-and-actions.png"))
            # while the feed's samples and the countdown move on, the buttons stay the same nodes (a
            # button made anew detaches under the pointer and swallows the click)
            marked = alice.evaluate("""() => { const bs = document.querySelectorAll('#jp-gpulease-panel button');
                                               bs.forEach(b => { b.dataset.seen = '1'; }); return bs.length; }""")
            for sl in server_status(alice, "alice")["lease"]["placement"]["slices"]:
                sim.set_utilization(sl["gpu_uuid"], 41)
            util = panel.locator(".jp-gpulease-device .jp-gpulease-bar-value")
            wait_for(lambda: util.all_inner_texts().count("41%") == 2, 60, "the panel did not follow the utilization to 41%", interval=0.25)
            alice.wait_for_timeout(2000)  # two more seconds of samples and countdown
            assert marked >= 3 and panel.locator("button[data-seen='1']").count() == marked == panel.locator("button").count()
            # a click elsewhere closes it; the item opens and closes it again
            alice.locator(".jp-Launcher-sectionTitle").first.click()
            panel.wait_for(state="detached", timeout=10_000)
            item.click()
            panel.wait_for(state="visible")
            item.click()
            panel.wait_for(state="detached", timeout=10_000)

            # the expiry warning (12 h ahead in this config) is a notification; its Extend button extends the lease
            # (a replaced notification lingers in the page while it slides out: take a standing one)
            expiring.wait_for(timeout=90_000)
            slid_in(alice, expiring)
            assert re.match(r"GPU lease ends at \d\d:\d\d\.", expiring.inner_text()), expiring.inner_text()
            alice.screenshot(path=str(ARTIFACTS / "03-expiry-warning-notification.png"))
            before = server_status(alice, "alice")["lease"]["expires_at"]
            expiring.get_by_role("button", name="Extend 30 min").click()
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
            bob = browser.login(demo, "bob")
            bob_item = open_lab(bob, "bob", "cpu")
            open_notebook_and_run(bob, "%gpu request --gpus 2 --model L4")
            wait_for(lambda: re.match(r"GPU queue #1( · .+)?$", bob_item.inner_text().strip()) is not None, 90,
                     "bob's status bar did not show his place in the queue", interval=0.5)
            bob.screenshot(path=str(ARTIFACTS / "06-second-user-waits-in-the-queue.png"))
            assert server_status(bob, "bob")["lease"]["state"] == "queued"
    finally:
        demo.stop()


# ---------------------------------------------------------------------- the live feed, with XSRF checks on
def feed_config(tmp_path: Path, standin_dir: Path, sim_state: Path) -> Path:
    """The demo's configs with fast heartbeats (the broker warns of expiry as it usually does, not
    at once), a fast idle reclaim by suspend (idle kernels are warned after 3 s and suspended after
    6 s; cuda-checkpoint is the tests' stand-in) and servers that keep running when their lease ends. Nothing about XSRF: the hub and the single-user servers check it
    as a default deployment does."""
    return demo_config(
        tmp_path,
        server_args=[*FAST_SERVERS, "--GPUIdleRule.gpu_idle_timeout=6", "--ReclaimActions.warn_before=3", "--ReclaimActions.reclaim_action=suspend",
                     f"--GPULeaseExtension.cuda_checkpoint={standin_dir / 'cuda-checkpoint'}"],
        hub=f"""c.Spawner.environment.update({{"STANDIN_CUDA_CHECKPOINT_DIR": {str(standin_dir)!r}, "STANDIN_CUDA_CHECKPOINT_SIM_STATE": {str(sim_state)!r},
                              "STANDIN_CUDA_CHECKPOINT_REMAP": "1"}})
c.GPULeaseSpawner.on_lease_end = "keep"
""",
    )


class FeedWatch:
    """What the page's event streams carried (Chromium's DevTools protocol reports each
    server-sent event), every answer to the feed's URL, and the answers to the actions (POSTs)."""

    def __init__(self, page):
        self.page = page
        self.events: list[dict] = []
        self.answers: list[tuple[str, int]] = []
        self.actions: list[tuple[str, int]] = []
        cdp = page.context.new_cdp_session(page)
        cdp.on("Network.eventSourceMessageReceived", self._message)
        cdp.send("Network.enable")
        page.on("response", self._response)

    def _response(self, r) -> None:
        if "/gpulease/api/feed" in r.url:
            self.answers.append((r.url, r.status))
        elif "/gpulease/api/" in r.url and r.request.method == "POST":
            self.actions.append((r.url.split("/gpulease/api/")[1].split("?")[0], r.status))

    def _message(self, params: dict) -> None:
        try:
            data = json.loads(params.get("data") or "null")
        except ValueError:
            data = None
        self.events.append({"event": params.get("eventName"), "id": params.get("eventId"), "data": data})

    def find(self, name: str, **match) -> list[dict]:
        """The data of the streamed events called ``name`` whose fields equal ``match``."""
        self.page.wait_for_timeout(20)  # playwright delivers what came meanwhile only while it runs
        out = []
        for e in self.events:
            d = e["data"]
            if e["event"] == name and isinstance(d, dict) and all(d.get(k) == v for k, v in match.items()):
                out.append(d)
        return out


def shown(message: str, toast_text: str) -> bool:
    """Whether a notification shows ``message`` (JupyterLab cuts long ones short with "…")."""
    return message[:60] in toast_text


def test_grant_reclaim_resume_and_revoke_reach_jupyterlab_through_the_feed(tmp_path, playwright_sync_api, chromium):
    """The hub and servers as a default deployment runs them (XSRF checks on): bob's JupyterLab
    opens the event stream (200, never 403) and shows the grant, the idle reclaim (whose Resume
    button resumes the kernel), the resume and an admin's revoke as notifications, each the
    message of an event that the stream carried. Only the stream brings lease, reclaim and
    resume events (polling brings standing warnings only)."""
    shots = ARTIFACTS.parent / "browser"
    standin_dir = tmp_path / "standin"
    standin_dir.mkdir()
    standin.install(str(standin_dir))
    demo, sim = start_demo(tmp_path, feed_config(tmp_path, standin_dir, tmp_path / "state" / "sim-gpus.json"))
    try:
        with chromium_browser(playwright_sync_api, chromium, failed=shots / "feed-failed") as browser:
            bob = browser.page()
            feed = FeedWatch(bob)  # from the first page on
            login(bob, demo, "bob")
            item = open_lab(bob, "bob", "cpu")
            # the stream is open: the status bar is fed by it, not by asking
            wait_for(lambda: item.get_attribute("data-feed") == "live", 60, "bob's JupyterLab never opened the live feed", interval=0.5)

            # grant: bob asks for both L4s in a notebook; the kernel says its process id, so that the
            # simulated GPUs can show it holding memory on them from the grant on, as a CUDA program would
            open_notebook_and_run(bob, "import os; print(os.getpid())\n%gpu request --gpus 2 --model L4")
            grants = wait_for(lambda: feed.find("lease", event="granted"), 60, "no grant came on the stream", interval=0.2)
            output = bob.locator(".jp-NotebookPanel .jp-OutputArea-output").first
            wait_for(lambda: output.count() and output.inner_text().strip().split("\n")[0].isdigit(), 60,
                     "the cell did not print the kernel's process id", interval=0.2)
            pid = int(output.inner_text().strip().split("\n")[0])
            sim.add_process(grants[0]["lease"]["placement"]["slices"][0]["gpu_uuid"], pid, 4096, sm_util_pct=0.0)  # idle
            granted = toast(bob, "GPU lease granted:")
            granted.wait_for(timeout=60_000)
            bob.screenshot(path=str(shots / "feed-01-grant-notification.png"))
            assert granted.inner_text().startswith(f"GPU lease granted: {grants[0]['lease']['holding']}."), granted.inner_text()
            lease_id = grants[0]["lease"]["id"]

            # idle reclaim: warned, then suspended; the kernel's notification says so (the lease's end with it) and offers Resume
            suspended = bob.locator(TOAST, has=bob.get_by_role("button", name="Resume")).first
            suspended.wait_for(timeout=60_000)
            wait_for(lambda: feed.find("lease", event="reclaimed"), 30, "the lease did not go back as reclaimed", interval=0.5)
            suspends = feed.find("reclaim", action="suspend", outcome="done")
            assert suspends and suspended.inner_text().startswith(f"Kernel {suspends[0]['kernel_id'][:8]} is suspended:"), suspended.inner_text()
            assert feed.find("warning", kind="reclaim"), "no reclaim warning came first"
            assert feed.find("lease", event="reclaimed")[0]["lease"]["id"] == lease_id
            wait_for(lambda: bob.locator(TOAST).count() == 1, 15, f"more than the kernel's notification: {bob.locator(TOAST).all_inner_texts()}",
                     interval=0.2)
            bob.screenshot(path=str(shots / "feed-02-idle-reclaim-notifications.png"))
            # Details: the panel says it in full
            suspended.get_by_role("button", name="Details").click()
            panel = bob.locator("#jp-gpulease-panel")
            panel.wait_for(state="visible")
            assert shown(suspends[0]["message"], panel.inner_text()), (panel.inner_text(), suspends)
            item.click()
            panel.wait_for(state="detached", timeout=10_000)

            # resume: the notification's button (a POST with the XSRF header) gets the kernel a GPU back
            suspended.get_by_role("button", name="Resume").click()
            resumed = toast(bob, "has its GPU back")
            resumed.wait_for(timeout=90_000)
            bob.screenshot(path=str(shots / "feed-03-resume-notification.png"))
            done = feed.find("resume", stage="done")
            assert done and resumed.inner_text().startswith(f"Kernel {done[0]['kernel_id'][:8]} has its GPU back."), (resumed.inner_text(), done)
            assert next(d["stage"] for d in feed.find("resume")) == "waiting"
            regrants = [g for g in feed.find("lease", event="granted") if g["lease"]["id"] != lease_id]
            assert regrants, "the resume's lease was not announced"
            new_lease = regrants[-1]["lease"]
            # the kernel computes again (the idle rule leaves it alone now)
            sim.remove_process(pid)
            sim.add_process(new_lease["placement"]["slices"][0]["gpu_uuid"], pid, 4096, sm_util_pct=80.0)

            # the panel's Keep (a POST with the XSRF header, as ServerConnection sends it)
            item.click()
            bob.locator("#jp-gpulease-panel button[data-action='keep']").click()
            toast(bob, "Idle reclaim postponed").wait_for(timeout=30_000)
            item.click()
            assert [a for a in feed.actions if a[0] in ("resume", "keep")] == [("resume", 202), ("keep", 200)], feed.actions

            # revoke: the hub's admin ends bob's lease on the broker's admin page
            admin = browser.login(demo, "admin", 1280, 900)
            admin.goto(f"{demo.url}/services/gpulease/admin")
            row = admin.locator("#active tr", has_text="bob")
            row.locator("input[name=reason]").fill("GPU maintenance on sim-node-1 at noon")
            row.locator("button", has_text="Revoke").click()
            assert "revoked" in admin.locator("p.msg").inner_text()
            ended = toast(bob, "GPU lease revoked")
            ended.wait_for(timeout=60_000)
            bob.screenshot(path=str(shots / "feed-04-revoke-notification.png"))
            ends = feed.find("lease", event="ended")
            assert ends and ends[-1]["lease"]["id"] == new_lease["id"], ends
            ended.get_by_role("button", name="Details").click()  # the reason, in full, in the panel
            panel.wait_for(state="visible")
            assert "GPU maintenance on sim-node-1 at noon" in panel.inner_text(), panel.inner_text()
            item.click()
            panel.wait_for(state="detached", timeout=10_000)
            wait_for(lambda: not item.inner_text().startswith("GPU L4"), 30, "the status bar still shows the revoked lease", interval=0.5)

            # the events came in order on the stream, each once
            ids = [int(e["id"]) for e in feed.events if e["event"] != "sample" and e["id"]]
            assert ids == sorted(ids)
            kinds = [e["event"] for e in feed.events]
            assert {"status", "lease", "warning", "reclaim", "resume"} <= set(kinds)

            # the feed was answered 200 every time it was opened, and the server never refused it; a
            # request without the XSRF token is refused (so the log would show a client that forgot it)
            refused = bob.evaluate("async () => (await fetch('/user/bob/gpulease/api/feed?probe=no-xsrf')).status")
            assert refused == 403
            streams = [status for url, status in feed.answers if "probe=no-xsrf" not in url]
            assert streams and set(streams) == {200}, feed.answers
            log = (demo.state / "jupyterhub.log").read_text(errors="replace")
            assert re.search(r"403 GET /user/bob/gpulease/api/feed\?probe=no-xsrf", log), "the server's log does not show refusals"
            refusals = [line for line in log.splitlines() if re.search(r"\b403 \w+ /user/\w+/gpulease/api/", line) and "probe=no-xsrf" not in line]
            assert not refusals, refusals

            # when the stream cannot be opened (here a proxy answers 503 for it), the status bar asks for
            # the status instead, and opens the stream again once it can
            bob.context.route("**/gpulease/api/feed*", lambda route: route.fulfill(status=503, body="no streams today"))
            other = bob.context.new_page()
            other.goto(f"{demo.url}/user/bob/lab/workspaces/feed-down?reset")
            other_item = other.locator(".jp-gpulease-status")
            other_item.wait_for(timeout=120_000)
            wait_for(lambda: other_item.get_attribute("data-feed") == "polling" and other_item.inner_text().strip() == "GPU none", 60,
                     "without the stream, the status bar did not show the status by asking", interval=0.5)
            other.screenshot(path=str(shots / "feed-05-stream-down-status-by-polling.png"))
            bob.context.unroute("**/gpulease/api/feed*")
            wait_for(lambda: other_item.get_attribute("data-feed") == "live", 90, "the stream was not opened again", interval=0.5)
    finally:
        demo.stop()
