"""Headless Chromium against the demo: log in, pick a GPU on the spawn form, reach the server;
a second user sees the queue message on the spawn page. Screenshots go to test-artifacts/browser/.

Needs Chromium (/usr/bin/chromium, or GPULEASE_CHROMIUM) and the Python package playwright
(its own browser download is never used).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from test_demo import Demo

pytestmark = pytest.mark.timeout(300)

ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts" / "browser"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-dev-shm-usage"]


def chromium_path() -> str:
    path = os.environ.get("GPULEASE_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not path:
        raise AssertionError("Chromium not found: apt-get install -y chromium (or set GPULEASE_CHROMIUM to its path)")
    return path


def login(page, url: str, user: str, password: str) -> None:
    page.goto(f"{url}/hub/login")
    page.fill("#username_input", user)
    page.fill("#password_input", password)
    page.click("#login_submit")
    page.wait_for_url("**/hub/spawn**")


def start_from_form(page, choice: str) -> None:
    page.wait_for_selector("#gpulease-choice")
    page.select_option("#gpulease-choice", choice)
    page.click("#spawn_form [type=submit]")


def test_log_in_pick_a_gpu_reach_the_server_and_a_second_user_sees_the_queue(tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (into the venv)")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    demo = Demo(tmp_path / "state").start()
    try:
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS, headless=True)
            try:
                alice = browser.new_context(viewport={"width": 1280, "height": 900}).new_page()
                login(alice, demo.url, "alice", demo.password)
                alice.wait_for_selector("#gpulease-choice")
                form_text = alice.inner_text("#spawn_form")
                assert "2 × L4 (22 GB) — free now" in form_text
                alice.screenshot(path=str(ARTIFACTS / "01-spawn-form.png"), full_page=True)

                start_from_form(alice, "gpu:2:L4")  # both L4s
                alice.wait_for_url("**/user/alice/**", timeout=120_000)
                alice.wait_for_load_state("load")
                alice.wait_for_timeout(2000)  # let JupyterLab draw
                alice.screenshot(path=str(ARTIFACTS / "02-alice-server-running.png"))
                assert demo.leases() == [("alice", "active")]

                bob = browser.new_context(viewport={"width": 1280, "height": 900}).new_page()
                login(bob, demo.url, "bob", demo.password)
                assert "1 × L4 (22 GB) — all in use" in bob.inner_text("#spawn_form")
                start_from_form(bob, "gpu:1:L4")
                bob.wait_for_url("**/hub/spawn-pending/bob**")
                message = bob.wait_for_selector("text=Waiting for 1 × L4 (22 GB): position 1 of 1", timeout=60_000)
                assert "about" in message.inner_text()
                bob.screenshot(path=str(ARTIFACTS / "03-bob-waits-in-the-queue.png"), full_page=True)
                assert ("bob", "queued") in demo.leases()
            finally:
                browser.close()
    finally:
        demo.stop()
    # Ctrl-C ended both leases (bob's may have been granted in the moment between the two stops)
    states = dict(demo.leases())
    assert states["alice"] == "released" and states["bob"] in ("withdrawn", "released")
