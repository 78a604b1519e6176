"""`jupyter gpulease demo`: one command starts the hub, proxy, broker and spawner; Ctrl-C leaves nothing.

Runs the real command (the README's first one) in a temporary state folder on a free port.
"""

from __future__ import annotations

import http.cookiejar
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from hubharness import find_chp, free_port, pid_alive, wait_for

pytestmark = pytest.mark.timeout(300)


class Demo:
    """The demo command as a child process; ``url`` once it printed its banner."""

    def __init__(self, state_dir: Path, *, password: str = "gpulease"):
        self.state = Path(state_dir)
        self.password = password
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.out_path = self.state.parent / f"{self.state.name}-demo.out"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 120) -> Demo:
        env = {**os.environ, "GPULEASE_CHP": find_chp()}
        env.pop("JUPYTERHUB_API_TOKEN", None)
        exe = Path(sys.executable).with_name("jupyter-gpulease")
        self._out = open(self.out_path, "wb")
        self.proc = subprocess.Popen(
            [str(exe), "demo", "--state-dir", str(self.state), "--port", str(self.port), "--password", self.password,
             "--device-backend", "simulated"],
            stdout=self._out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )

        def banner():
            if self.proc.poll() is not None:
                raise AssertionError(f"the demo exited with {self.proc.returncode}:\n{self.output()}\n{self.log_tail()}")
            return "Press Ctrl-C to stop." in self.output()
        wait_for(banner, timeout, "the demo did not print its banner")
        return self

    def output(self) -> str:
        return self.out_path.read_text(errors="replace") if self.out_path.exists() else ""

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join((self.state / "jupyterhub.log").read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def interrupt(self, timeout: float = 90) -> int:
        """Ctrl-C, as a person would press it; returns the exit status."""
        self.proc.send_signal(signal.SIGINT)
        rc = self.proc.wait(timeout)
        self._out.close()
        return rc

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.interrupt()
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)

    def admin_token(self) -> str:
        return (self.state / "demo-token").read_text().strip()

    def hub_api(self, method: str, path: str):
        req = urllib.request.Request(f"{self.url}/hub/api/{path}", method=method,
                                     headers={"Authorization": f"token {self.admin_token()}"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                body = r.read()
                return r.status, json.loads(body) if body else None
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")

    def leases(self) -> list[tuple]:
        with sqlite3.connect(self.state / "gpulease.sqlite") as db:
            return list(db.execute("select user, state from leases order by created_at"))


class Browserless:
    """A logged-in browser session without a browser: cookies, the login form, the spawn form."""

    def __init__(self, demo: Demo, user: str):
        self.demo = demo
        self.jar = http.cookiejar.CookieJar()
        self.opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(self.jar))
        self.opener.open(f"{demo.url}/hub/login").read()
        data = urllib.parse.urlencode({"username": user, "password": demo.password, "_xsrf": self.xsrf()}).encode()
        self.opener.open(f"{demo.url}/hub/login", data).read()

    def xsrf(self) -> str:
        return [c.value for c in self.jar if c.name == "_xsrf"][-1]

    def spawn_form(self) -> str:
        return self.opener.open(f"{self.demo.url}/hub/spawn").read().decode()

    def submit(self, fields: dict) -> str:
        data = urllib.parse.urlencode({**fields, "_xsrf": self.xsrf()}).encode()
        with self.opener.open(f"{self.demo.url}/hub/spawn", data) as r:
            return r.url


def processes_in(folder: Path) -> list[int]:
    root = str(folder.resolve())
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            cwd = os.readlink(f"/proc/{d}/cwd")
        except OSError:
            continue
        if (cwd == root or cwd.startswith(root + os.sep)) and pid_alive(int(d)):
            out.append(int(d))
    return out


def test_demo_starts_serves_a_leased_server_and_ctrl_c_leaves_nothing(tmp_path):
    demo = Demo(tmp_path / "state").start()
    try:
        out = demo.output()
        assert f"running at {demo.url}/" in out
        assert "password 'gpulease'" in out
        assert str(tmp_path / "state") in out

        alice = Browserless(demo, "alice")
        form = alice.spawn_form()
        choices = dict(re.findall(r'<option value="([^"]*)"[^>]*>([^<]*)</option>', form))
        assert choices["gpu:1:L4"].startswith("1 × L4 (22 GB) — free now")
        assert any(v.startswith("mig:3g.40gb:") for v in choices)  # the MIG GPU of the simulated pool
        assert "spawn-pending/alice" in alice.submit({"choice": "gpu:1:L4", "tier": "experiment", "duration_h": "1"})

        def ready():
            status, model = demo.hub_api("GET", "users/alice")
            return status == 200 and (model["servers"].get("") or {}).get("ready")
        wait_for(ready, 90, "alice's server did not become ready")
        assert demo.leases() == [("alice", "active")]
        server_pids = processes_in(tmp_path / "state" / "home")
        assert server_pids
    finally:
        rc = demo.interrupt() if demo.proc.poll() is None else demo.proc.returncode
    assert rc == 0, demo.output()
    assert "Stopped; nothing is left running." in demo.output()
    assert demo.leases() == [("alice", "released")]
    wait_for(lambda: not processes_in(tmp_path / "state"), 10, "processes of the demo are still running")
    assert not pid_alive(demo.proc.pid)


def test_demo_without_the_proxy_says_what_to_install(tmp_path):
    env = {**os.environ, "GPULEASE_CHP": str(tmp_path / "nowhere"), "PATH": "/usr/bin:/bin"}
    exe = Path(sys.executable).with_name("jupyter-gpulease")
    # hide a configurable-http-proxy of the checkout by running from a copy of the config folder
    cfg = tmp_path / "config"
    cfg.mkdir()
    (cfg / "jupyterhub_config.py").write_text("c = get_config()  # noqa\n")
    r = subprocess.run([str(exe), "demo", "--state-dir", str(tmp_path / "s"), "--config-dir", str(cfg)],
                       capture_output=True, text=True, env=env, timeout=60, cwd=tmp_path)
    if "configurable-http-proxy is missing" not in r.stderr:
        pytest.fail(f"expected the missing-proxy message, got rc={r.returncode}: {r.stderr}")
    assert r.returncode == 2
    assert "npm install --prefix" in r.stderr
