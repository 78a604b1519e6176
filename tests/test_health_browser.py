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

import json
import time
import urllib.request
from pathlib import Path

import pytest

from hubharness import wait_for
from jupyter_gpulease.devices.simulated import SimulatedBackend
from test_browser import ARTIFACTS, CHROMIUM_ARGS, login, start_from_form
from test_demo import Demo
from test_unleased_browser import broker_get, demo_config

pytestmark = pytest.mark.timeout(420)

ROOT = Path(__file__).resolve().parents[1]
FAN = "fan failure: the card is replaced on Monday"
BIOS = "BIOS update of the node"


def health_config(tmp_path: Path) -> Path:
    """The example configs; the broker samples the GPUs every second, servers beat every 2 s."""
    return demo_config(tmp_path, "c.GPULeaseBroker.device_sample_interval = 1\n")


def broker_post(demo: Demo, path: str, body: dict):
    token = (demo.state / "spawner-token").read_text().strip()
    req = urllib.request.Request(f"{demo.url}/services/gpulease/{path}", data=json.dumps(body).encode(), method="POST",
                                 headers={"Authorization": f"token {token}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def test_a_cordoned_gpu_and_a_maintenance_window_on_the_admin_page_the_spawn_form_and_the_holders_jupyterlab(tmp_path, playwright_sync_api, chromium):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    state = tmp_path / "state"
    state.mkdir()
    demo = Demo(state, config_dir=health_config(tmp_path)).start()
    sim = SimulatedBackend({"state_file": str(state / "sim-gpus.json")})  # the demo's broker reads the same file
    try:
        with playwright_sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS, headless=True)
            try:
                alice = browser.new_context(viewport={"width": 1400, "height": 900}).new_page()
                login(alice, demo.url, "alice", demo.password)
                start_from_form(alice, "gpu:1:L4")
                alice.wait_for_url("**/user/alice/**", timeout=120_000)
                alice.locator(".jp-gpulease-status").wait_for(timeout=120_000)
                lease = next(x for x in broker_get(demo, "api/leases?user=alice")["leases"] if x["state"] == "active")
                held = lease["placement"]["slices"][0]
                pool = broker_get(demo, "api/pool")
                other = next(d for d in pool["devices"] if d["model"] == "L4" and d["uuid"] != held["gpu_uuid"])

                # the admin: the other L4 out with a reason; a window on the node from one hour to three
                broker_post(demo, "api/health/cordon", {"kind": "device", "name": other["uuid"], "reason": FAN})
                start = time.time() + 3600
                broker_post(demo, "api/maintenance", {"start": start, "end": start + 2 * 3600, "reason": BIOS, "nodes": [held["node"]]})

                admin = browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
                login(admin, demo.url, "admin", demo.password)
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
                bob = browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
                login(bob, demo.url, "bob", demo.password)
                bob.goto(f"{demo.url}/hub/spawn/bob")
                notice = bob.locator("#spawn_form", has_text=FAN)
                notice.wait_for(timeout=30_000)
                assert f"GPU {other['index']} on {other['node']}" in bob.locator("#spawn_form").inner_text()
                bob.screenshot(path=str(ARTIFACTS / "health-02-spawn-form.png"), full_page=True)

                # alice's L4 falls off the bus: within a sample the broker cordons it and warns her
                sim.inject_xid(held["gpu_uuid"], 79)
                toast = alice.locator(".Toastify__toast:not([class*='exit'])", has_text="fallen off the bus").first
                toast.wait_for(timeout=60_000)

                def in_view():  # the notification has slid in
                    box = toast.bounding_box()
                    return box is not None and box["x"] + box["width"] <= 1400
                wait_for(in_view, 10, "the notification did not slide into view", interval=0.2)
                # and of the window ahead, which her lease would run into
                alice.locator(".Toastify__toast:not([class*='exit'])", has_text=f"a maintenance window on your GPU begins in 1 h ({BIOS}").first.wait_for(timeout=30_000)
                alice.screenshot(path=str(ARTIFACTS / "health-03-holder-warned.png"))
                health = broker_get(demo, "api/health")
                assert any(c["name"] == held["gpu_uuid"] and c["source"] == "health" for c in health["cordons"]), health
            except BaseException:
                for i, ctx in enumerate(browser.contexts):
                    for j, pg in enumerate(ctx.pages):
                        pg.screenshot(path=str(ARTIFACTS / f"health-failed-{i}-{j}.png"))
                raise
            finally:
                browser.close()
    finally:
        demo.stop()
