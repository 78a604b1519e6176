"""Headless Chromium against the demo hub: a sick GPU and a maintenance window as the admin, a
user choosing a GPU and the holder of the sick GPU see them.

alice's server holds an L4 and her JupyterLab is open. The admin cordons the other L4 with a
reason and sets a maintenance window on the node (through the broker's REST API, as the CLI
does). The broker's admin page lists the cordoned GPU with its reason and the window; bob's
spawn form shows that L4 unavailable with the reason; then alice's L4 reports XID 79 (fallen
off the bus) through the demo's simulated GPUs, and within a sample of the broker her
JupyterLab warns her. Screenshots go to test-artifacts/browser/health-*.png.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from browserutil import ARTIFACTS, FAST_SERVERS, chromium_browser, demo_config, open_lab, slid_in, start_demo, toast

pytestmark = pytest.mark.timeout(420)

FAN = "fan failure: the card is replaced on Monday"
BIOS = "BIOS update of the node"


def health_config(tmp_path: Path) -> Path:
    """The example configs; the broker samples the GPUs every second, servers beat every 2 s."""
    return demo_config(tmp_path, server_args=FAST_SERVERS, broker="c.GPULeaseBroker.device_sample_interval = 1\n")


def test_a_cordoned_gpu_and_a_maintenance_window_on_the_admin_page_the_spawn_form_and_the_holders_jupyterlab(tmp_path, playwright_sync_api, chromium):
    demo, sim = start_demo(tmp_path, health_config(tmp_path))
    try:
        with chromium_browser(playwright_sync_api, chromium, failed=ARTIFACTS / "health-failed") as browser:
            alice = browser.login(demo, "alice")
            open_lab(alice, "alice", "gpu:1:L4")
            lease = next(x for x in demo.broker_api("api/leases?user=alice")["leases"] if x["state"] == "active")
            held = lease["placement"]["slices"][0]
            pool = demo.broker_api("api/pool")
            other = next(d for d in pool["devices"] if d["model"] == "L4" and d["uuid"] != held["gpu_uuid"])

            # the admin: the other L4 out with a reason; a window on the node from one hour to three
            demo.broker_api("api/health/cordon", {"kind": "device", "name": other["uuid"], "reason": FAN})
            start = time.time() + 3600
            demo.broker_api("api/maintenance", {"start": start, "end": start + 2 * 3600, "reason": BIOS, "nodes": [held["node"]]})

            admin = browser.login(demo, "admin", 1400, 1000)
            admin.goto(f"{demo.url}/services/gpulease/admin")
            row = admin.locator(f'#cordons tr[data-target="device:{other["uuid"]}"]')
            text = row.inner_text()
            assert FAN in text and "service:gpulease-spawner" in text and "cordoned" in text, text  # the spawner's token made the call
            window = admin.locator("#maintenance tr[data-window]")
            assert window.count() == 1
            wtext = window.inner_text()
            assert BIOS in wtext and held["node"] in wtext, wtext
            admin.locator("#health-section").scroll_into_view_if_needed()
            admin.screenshot(path=str(ARTIFACTS / "health-01-admin-page.png"), full_page=True)

            # bob picks a GPU: the cordoned L4 is unavailable, with the admin's reason
            bob = browser.login(demo, "bob", 1400, 1000)
            bob.goto(f"{demo.url}/hub/spawn/bob")
            notice = bob.locator("#spawn_form", has_text=FAN)
            notice.wait_for(timeout=30_000)
            assert f"GPU {other['index']} on {other['node']}" in bob.locator("#spawn_form").inner_text()
            bob.screenshot(path=str(ARTIFACTS / "health-02-spawn-form.png"), full_page=True)

            # alice's L4 falls off the bus: within a sample the broker cordons it and warns her
            sim.inject_xid(held["gpu_uuid"], 79)
            fallen = toast(alice, "fallen off the bus")
            fallen.wait_for(timeout=60_000)
            slid_in(alice, fallen)
            # and of the window ahead, which her lease would run into
            toast(alice, f"a maintenance window on your GPU begins in 1 h ({BIOS}").wait_for(timeout=30_000)
            alice.screenshot(path=str(ARTIFACTS / "health-03-holder-warned.png"))
            health = demo.broker_api("api/health")
            assert any(c["name"] == held["gpu_uuid"] and c["source"] == "health" for c in health["cordons"]), health
    finally:
        demo.stop()
