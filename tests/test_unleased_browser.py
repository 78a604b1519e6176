"""Headless Chromium against the demo hub: unleased GPU use as the admin and the user see it.

alice's server holds an L4; bob's server runs without a GPU and his JupyterLab is open. A process
of bob's (a real ``sleep`` with his server's environment, under another uid) is put on alice's L4
through the demo's simulated GPUs. Within one check the broker's feed has an ``unleased-use``
event, the broker's admin page lists it (who, which GPU, whose it is, how much memory, since when,
what happens) and bob's JupyterLab shows the warning as a notification. The demo's broker runs
with ``unleased_use = "kill"``: after the grace bob's process is stopped by SIGTERM, the admin
page no longer lists it; alice's own process on her GPU and her lease are untouched.
Screenshots go to test-artifacts/browser/unleased-*.png.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess

import pytest

from browserutil import ARTIFACTS, FAST_SERVERS, chromium_browser, demo_config, open_lab, slid_in, start_demo, toast
from hubharness import wait_for
from test_demo import Browserless

pytestmark = pytest.mark.timeout(400)

GRACE_S = 30  # time enough to look at the admin page and bob's JupyterLab before the process is stopped


def unleased_config(tmp_path):
    """The example configs; the broker checks every second and stops unleased use after the grace."""
    return demo_config(tmp_path, server_args=FAST_SERVERS, broker=("c.GPULeaseBroker.unleased_check_interval = 1\n"
                                                           "c.GPULeaseBroker.unleased_use = 'kill'\n"
                                                           f"c.GPULeaseBroker.unleased_grace_s = {GRACE_S}\n"))


def sleeper(user: str, uid: int) -> subprocess.Popen:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "JUPYTERHUB_USER": user, "JUPYTERHUB_SERVER_NAME": ""}
    preexec = (lambda: os.setuid(uid)) if os.getuid() == 0 else None
    return subprocess.Popen(["sleep", "600"], env=env, preexec_fn=preexec)  # noqa: PLW1509 - a plain setuid before exec


def test_unleased_use_on_the_admin_page_and_in_the_users_jupyterlab_then_stopped_after_the_grace(tmp_path, playwright_sync_api, chromium):
    demo, sim = start_demo(tmp_path, unleased_config(tmp_path))
    procs: list[subprocess.Popen] = []
    try:
        # alice's server holds one L4 (no browser needed for her)
        assert "spawn-pending/alice" in Browserless(demo, "alice").submit({"choice": "gpu:1:L4", "tier": "experiment", "duration_h": "1"})
        wait_for(lambda: ("alice", "active") in demo.leases(), 90, "alice's lease was not granted")
        lease = next(x for x in demo.broker_api("api/leases?user=alice")["leases"] if x["state"] == "active")
        alice_gpu = lease["placement"]["slices"][0]["gpu_uuid"]
        with chromium_browser(playwright_sync_api, chromium, failed=ARTIFACTS / "unleased-failed") as browser:
            bob = browser.login(demo, "bob")
            open_lab(bob, "bob", "cpu")

            # a process of alice's on her GPU, and one of bob's on it too
            alice_proc, bob_proc = sleeper("alice", 61235), sleeper("bob", 61234)
            procs += [alice_proc, bob_proc]
            sim.add_process(alice_gpu, alice_proc.pid, 4096)
            sim.add_process(alice_gpu, bob_proc.pid, 6144)

            def found():
                events = demo.broker_api("api/events?since=0&timeout=0")["events"]
                return [e for e in events if e["kind"] == "unleased-use"]
            event = wait_for(found, 30, "no unleased-use event in the broker's feed", interval=0.5)[0]
            assert (event["data"]["user"], event["data"]["pid"], event["data"]["holders"]) == ("bob", bob_proc.pid, ["alice"])

            # the admin page: who, which GPU, whose it is, memory, since when, what happens
            admin = browser.login(demo, "admin", 1400, 1000)
            admin.goto(f"{demo.url}/services/gpulease/admin")
            row = admin.locator(f'#unleased tr[data-pid="{bob_proc.pid}"]')
            text = row.inner_text()
            assert text.startswith("bob\t(default)\tL4 #") and "\talice\t" in text and f"{bob_proc.pid} (sleep)" in text
            if os.getuid() == 0:
                assert f"{bob_proc.pid} (sleep), uid 61234" in text
            assert "6144 MiB" in text and "stopped in" in text
            assert admin.locator("#unleased tr", has_text=str(alice_proc.pid)).count() == 0
            admin.locator("#unleased").scroll_into_view_if_needed()
            admin.screenshot(path=str(ARTIFACTS / "unleased-01-admin-page.png"), full_page=True)

            # bob's JupyterLab: the warning as a notification
            warned = toast(bob, "GPU used without a lease")
            warned.wait_for(timeout=60_000)
            words = warned.inner_text()
            assert re.search(rf"process {bob_proc.pid} is stopped at \d\d:\d\d unless it lets go of the GPU\.", words), words
            slid_in(bob, warned)
            bob.screenshot(path=str(ARTIFACTS / "unleased-02-bobs-jupyterlab-warned.png"))
            warned.get_by_role("button", name="Details").click()  # the panel says it in full
            panel = bob.locator("#jp-gpulease-panel")
            panel.wait_for(state="visible")
            text = panel.inner_text()
            assert f"Process {bob_proc.pid} (sleep) uses L4 #" in text and "another user's GPU" in text and "it is stopped in" in text, text

            # after the grace: bob's process is stopped, alice's runs on, her lease too
            bob_proc.wait(timeout=GRACE_S + 60)
            assert bob_proc.returncode == -signal.SIGTERM
            sim.remove_process(bob_proc.pid)  # what the driver does when a process exits
            assert alice_proc.poll() is None
            assert ("alice", "active") in demo.leases()

            def stopped():
                events = demo.broker_api("api/events?since=0&timeout=0")["events"]
                return [e["data"]["pid"] for e in events if e["kind"] == "unleased-stop" and e["data"]["stop"]["outcome"] == "stopped"]
            assert wait_for(stopped, 30, "no unleased-stop event in the broker's feed", interval=0.5) == [bob_proc.pid]

            def unlisted():
                admin.reload()
                return admin.locator("#unleased tr", has_text=str(bob_proc.pid)).count() == 0
            wait_for(unlisted, 30, "the admin page still lists bob's stopped process", interval=1)
            admin.screenshot(path=str(ARTIFACTS / "unleased-03-admin-page-after-the-stop.png"), full_page=True)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        demo.stop()
