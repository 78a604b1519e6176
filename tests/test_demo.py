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
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from hubharness import find_chp, free_port, pid_alive, wait_for

pytestmark = pytest.mark.timeout(300)


class Demo:
    """The demo command as a child process; ``url`` once it printed its banner."""

    def __init__(self, state_dir: Path, *, password: str = "gpulease", config_dir: Path | None = None, port: int | None = None,
                 backend: str = "simulated", idle_timeout: int | None = 1800):
        self.state = Path(state_dir)
        self.password = password
        self.config_dir = config_dir  # --config-dir (default: the examples in config/)
        self.backend = backend
        # the demo's own idle reclaim is a minute (to show the cycle); tests of other things run with
        # the extension's usual 30 min, so that a lease they watch is not reclaimed meanwhile (None: the demo's)
        self.idle_timeout = idle_timeout
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.out_path = self.state.parent / f"{self.state.name}-demo-{self.port}.out"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 120) -> Demo:
        env = {**os.environ, "GPULEASE_CHP": find_chp()}
        env.pop("JUPYTERHUB_API_TOKEN", None)
        exe = Path(sys.executable).with_name("jupyter-gpulease")
        self._out = open(self.out_path, "wb")  # noqa: SIM115 (kept open while the demo runs)
        self.proc = subprocess.Popen(
            [str(exe), "demo", "--state-dir", str(self.state), "--port", str(self.port), "--password", self.password,
             "--device-backend", self.backend, *(["--config-dir", str(self.config_dir)] if self.config_dir else []),
             *(["--idle-timeout", str(self.idle_timeout)] if self.idle_timeout else [])],
            stdout=self._out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )

        def banner():
            if self.proc.poll() is not None:
                raise AssertionError(f"the demo exited with {self.proc.returncode}:\n{self.output()}\n{self.log_tail()}")
            return "Press Ctrl-C to stop." in self.output()
        try:
            wait_for(banner, timeout, "the demo did not print its banner")
        except AssertionError as e:
            raise AssertionError(f"{e}\n--- what it printed:\n{self.output()}\n--- the hub's log:\n{self.log_tail()}") from None
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

    def broker_api(self, path: str, body: dict | None = None):
        """The broker's REST API through the hub's proxy (POST when there is a ``body``), with the
        spawner's token (it holds the lease admin scope); the answer's JSON."""
        token = (self.state / "spawner-token").read_text().strip()
        req = urllib.request.Request(f"{self.url}/services/gpulease/{path}", data=None if body is None else json.dumps(body).encode(),
                                     headers={"Authorization": f"token {token}", "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())

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
        choices = re.findall(r'<input type="radio" name="choice" id="[^"]*" value="([^"]*)"', form)
        assert "gpu:1:L4" in choices
        assert any(v.startswith("mig:3g.40gb:") for v in choices)  # the MIG GPU of the simulated pool  # the MIG GPU of the simulated pool
        assert "spawn-pending/alice" in alice.submit({"choice": "gpu:1:L4", "tier": "experiment", "duration_h": "1"})

        def ready():
            status, model = demo.hub_api("GET", "users/alice")
            return status == 200 and (model["servers"].get("") or {}).get("ready")
        wait_for(ready, 90, "alice's server did not become ready")
        assert demo.leases() == [("alice", "active")]

        # bob starts without a GPU and asks for one from inside his server, as %gpu request does
        bob = Browserless(demo, "bob")
        bob.submit({"choice": "cpu"})

        def bob_ready():
            status, model = demo.hub_api("GET", "users/bob")
            return status == 200 and (model["servers"].get("") or {}).get("ready")
        wait_for(bob_ready, 90, "bob's server did not become ready")
        bob.opener.open(f"{demo.url}/user/bob/lab").read()  # the server's login (OAuth) and its page set its cookies (_xsrf)
        xsrf = [c.value for c in bob.jar if c.name == "_xsrf" and c.path.startswith("/user/bob")][-1]
        req = urllib.request.Request(f"{demo.url}/user/bob/gpulease/api/lease", data=json.dumps({"gpus": 1}).encode(), method="POST",
                                     headers={"Content-Type": "application/json", "X-XSRFToken": xsrf})
        bob.opener.open(req).read()
        wait_for(lambda: ("bob", "active") in demo.leases(), 30, "bob's own request was not granted")
        server_pids = processes_in(tmp_path / "state" / "home")
        assert server_pids
    finally:
        rc = demo.interrupt() if demo.proc.poll() is None else demo.proc.returncode
    assert rc == 0, demo.output()
    assert "Stopped; nothing is left running." in demo.output()
    # the spawner's lease and the one bob's server took itself: both given back at Ctrl-C
    assert sorted(demo.leases()) == [("alice", "released"), ("bob", "released")], demo.leases()
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
                       capture_output=True, text=True, env=env, timeout=60, cwd=tmp_path, check=False)
    if "configurable-http-proxy is missing" not in r.stderr:
        pytest.fail(f"expected the missing-proxy message, got rc={r.returncode}: {r.stderr}")
    assert r.returncode == 2
    assert "npm install --prefix" in r.stderr


def _fake_exe(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(0o755)
    return path


def test_the_demo_finds_the_proxy_in_gpulease_chp_path_or_a_project_node_modules(tmp_path, monkeypatch):
    from jupyter_gpulease.hub import demo

    state = tmp_path / "state"
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setattr(demo, "_checkout", lambda: None)  # not the checkout's own .ci/node_modules
    monkeypatch.delenv("GPULEASE_CHP", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    assert demo.find_chp(state) is None
    assert demo.chp_install_command(state) == f"npm install --prefix {state} configurable-http-proxy"
    # a project-local .ci/node_modules (npm install --prefix .ci), then one in the state folder
    local = _fake_exe(work / ".ci" / "node_modules" / ".bin" / "configurable-http-proxy")
    assert demo.find_chp(state) == str(local)
    local.unlink()
    in_state = _fake_exe(state / "node_modules" / ".bin" / "configurable-http-proxy")
    assert demo.find_chp(state) == str(in_state)
    # PATH wins over those
    on_path = _fake_exe(tmp_path / "bin" / "configurable-http-proxy")
    assert demo.find_chp(state) == str(on_path)
    # GPULEASE_CHP wins over everything, and is the only place looked at when set
    explicit = _fake_exe(tmp_path / "chp")
    monkeypatch.setenv("GPULEASE_CHP", str(explicit))
    assert demo.find_chp(state) == str(explicit)
    monkeypatch.setenv("GPULEASE_CHP", str(tmp_path / "nowhere"))
    assert demo.find_chp(state) is None


def test_the_checkout_suggests_installing_the_pinned_proxy_into_ci():
    from jupyter_gpulease.hub import demo

    root = Path(__file__).resolve().parent.parent
    assert demo._checkout() == root
    assert demo.chp_install_command(Path("x")) == f"npm install --prefix {root / '.ci'}"
    assert root / ".ci" / "node_modules" / ".bin" / "configurable-http-proxy" in demo.chp_candidates(Path("x"))
    assert "configurable-http-proxy" in json.loads((root / ".ci" / "package.json").read_text())["dependencies"]


def test_the_wheel_ships_the_example_configs_where_the_demo_finds_them(tmp_path):
    """Build the wheel, unpack it, and let the demo look for its configs from there."""
    import importlib.util
    import zipfile

    root = Path(__file__).resolve().parent.parent
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist"), str(root)]
    if importlib.util.find_spec("hatchling") is not None:
        cmd.insert(4, "--no-build-isolation")  # no network needed
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    (wheel,) = (tmp_path / "dist").glob("jupyter_gpulease-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for name in ("jupyterhub_config.py", "gpulease_config.py"):
        assert f"jupyter_gpulease/config_examples/{name}" in names, names
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    probe = ("import sys; sys.path.insert(0, sys.argv[1]); import jupyter_gpulease.hub.demo as d; "
             "print(d.__file__); print(d.find_config_dir())")
    r = subprocess.run([sys.executable, "-c", probe, str(site)], capture_output=True, text=True, timeout=60, cwd=tmp_path, check=False)
    assert r.returncode == 0, r.stderr
    module, found = r.stdout.split()
    assert module.startswith(str(site)), "the unpacked wheel's package was imported"
    assert found == str(site / "jupyter_gpulease" / "config_examples")


def test_the_demo_writes_its_tokens_readable_by_their_owner_only_from_the_start(tmp_path, monkeypatch):
    from pathlib import Path

    from jupyter_gpulease.hub import demo

    modes = []
    real_chmod = Path.chmod
    # the mode the file has before any chmod: nobody else may read it even for a moment
    monkeypatch.setattr(Path, "chmod", lambda self, mode: (modes.append(self.stat().st_mode & 0o777), real_chmod(self, mode)))
    old = os.umask(0)
    try:
        tok = demo._token(tmp_path / "demo-token")
    finally:
        os.umask(old)
    assert modes == [0o600]
    assert (tmp_path / "demo-token").read_text().strip() == tok
    assert demo._token(tmp_path / "demo-token") == tok  # kept across restarts


def test_ctrl_c_withdraws_waiting_spawns_before_stopping_servers_and_a_restart_right_after_says_so(tmp_path):
    """Alice holds both L4s, Bob waits for one. Ctrl-C: Bob's spawn is withdrawn (never started,
    never granted), Alice's server stops and its lease is given back. The demo starts again at
    once on the same port (its old connections still in TIME-WAIT) and says Bob must start again."""
    demo = Demo(tmp_path / "state").start()
    try:
        alice, bob = Browserless(demo, "alice"), Browserless(demo, "bob")
        choices = re.findall(r'<input type="radio" name="choice" id="[^"]*" value="([^"]*)"', alice.spawn_form())
        assert "gpu:2:L4" in choices, choices
        alice.submit({"choice": "gpu:2:L4", "tier": "experiment", "duration_h": "1"})

        def ready(user):
            status, model = demo.hub_api("GET", f"users/{user}")
            return status == 200 and (model["servers"].get("") or {}).get("ready")
        wait_for(lambda: ready("alice"), 120, "alice's server did not become ready")
        assert "spawn-pending/bob" in bob.submit({"choice": "gpu:1:L4", "tier": "experiment", "duration_h": "1"})
        wait_for(lambda: ("bob", "queued") in demo.leases(), 30, "bob's lease did not queue")
    finally:
        rc = demo.interrupt() if demo.proc.poll() is None else demo.proc.returncode
    out = demo.output()
    assert rc == 0, out
    assert "1 spawn(s) waiting" in out and "1 server(s) running" in out
    assert "1 waiting spawn(s) withdrawn" in out and "1 server(s) stopped" in out
    assert "every lease given back" in out
    assert sorted(demo.leases()) == [("alice", "released"), ("bob", "withdrawn")]
    log = (tmp_path / "state" / "jupyterhub.log").read_text()
    assert "Start your server again once the hub is back" in log  # what bob's spawn page said

    again = Demo(tmp_path / "state", port=demo.port).start()
    try:
        assert "At the last stop, 1 spawn(s) were waiting for GPUs and were withdrawn" in again.output()
        assert "is in use" not in again.output()
    finally:
        assert again.interrupt() == 0


def test_the_demo_says_the_gpus_are_simulated_and_why_and_its_start_logs_no_errors(tmp_path):
    from jupyter_gpulease.hub.demo import choose_backend

    backend, why = choose_backend("auto")
    demo = Demo(tmp_path / "state", backend="auto").start()
    try:
        out = demo.output()
        if backend == "simulated":  # a machine without NVIDIA GPUs, as CI
            assert f"The GPUs are simulated: {why}." in out
            assert "GPUs of the pool (simulated):" in out
            assert "2 × L4 (22 GB) on sim-node-1" in out
            assert "in MIG mode: 2 × 3g.40gb" in out
        else:
            assert "simulated" not in out
        log = (tmp_path / "state" / "jupyterhub.log").read_text(errors="replace")
        # waiting for the hub must not look like failures: no 404s through the proxy, no 401s at the broker
        assert " 404 GET /hub/api" not in log and "Failed to get custom error page" not in log
        assert " 401 " not in log
        # the demo's own config: no deprecated login option, every group its tiers and quotas name exists
        assert "is deprecated" not in log and "the hub has no group" not in log
    finally:
        assert demo.interrupt() == 0


def test_a_port_in_time_wait_counts_as_free_and_a_listener_as_busy():
    import socket

    from jupyter_gpulease.hub.demo import port_is_free

    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    assert not port_is_free(port)
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = server.accept()
    conn.close()  # the server side closes first: its end of the connection waits in TIME-WAIT
    client.close()
    server.close()
    assert port_is_free(port)


def test_the_banner_says_the_short_idle_reclaim_how_to_make_gpu_work_and_where_admins_see_every_lease(tmp_path):
    from jupyter_gpulease.hub import demo

    text = demo._banner("http://127.0.0.1:8000", "gpulease", tmp_path, tmp_path / "jupyterhub.log", ["2 × L4 (22 GB) on sim-node-1"], "simulated")
    assert f"warned after {demo.IDLE_WARN_S} s and suspended after {demo.IDLE_RECLAIM_S} s" in text
    assert "use_gpu(util=80, memory_gb=6, seconds=20)" in text
    assert "http://127.0.0.1:8000/services/gpulease/admin" in text
    assert "use_gpu" not in demo._banner("http://127.0.0.1:8000", "gpulease", tmp_path, tmp_path / "x.log", ["4 × H100"], "nvml")
    assert "warned after 900 s and suspended after 1800 s" in demo._banner("u", "p", tmp_path, tmp_path / "x.log", idle_timeout=1800)


def test_the_demo_puts_its_pythons_commands_first_on_the_path_of_the_hub_its_servers_and_kernels(tmp_path, monkeypatch):
    """`!jupyter gpulease leases` in a demo kernel finds the command though the venv is not activated."""
    import shutil

    from jupyter_gpulease.hub import demo

    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    args = demo.parse_args(["--state-dir", str(tmp_path)])
    env = demo._hub_env(args, tmp_path, 8000, "/x/configurable-http-proxy", "simulated")
    bin_dir = str(Path(sys.executable).parent)
    assert env["PATH"].split(os.pathsep) == [bin_dir, "/usr/bin", "/bin"]
    assert shutil.which("jupyter-gpulease", path=env["PATH"]) == str(Path(bin_dir) / "jupyter-gpulease")
    assert demo.path_with(Path(bin_dir), env["PATH"]) == env["PATH"]  # once, however often


def test_the_demo_config_logs_in_without_a_deprecated_option_and_makes_the_groups_its_tiers_and_quotas_name(tmp_path, monkeypatch):
    from traitlets.config.loader import PyFileConfigLoader

    root = Path(__file__).resolve().parent.parent
    monkeypatch.setenv("GPULEASE_DEMO_DIR", str(tmp_path))
    hub = PyFileConfigLoader("jupyterhub_config.py", path=str(root / "config")).load_config()
    broker = PyFileConfigLoader("gpulease_config.py", path=str(root / "config")).load_config()
    assert "password" not in hub.get("DummyAuthenticator", {})  # deprecated in JupyterHub 5.3
    assert hub.JupyterHub.authenticator_class == "jupyter_gpulease.hub.demo.DemoAuthenticator" and hub.DemoAuthenticator.password
    named = {g for t in broker.GPULeaseBroker.tiers.values() for g in t.get("groups", [])} | set(broker.GPULeaseBroker.group_quotas)
    assert named == {"staff", "students"} and named <= set(hub.JupyterHub.load_groups)


def test_the_demo_login_takes_the_one_password_for_every_user_admins_included():
    import asyncio

    from jupyter_gpulease.hub.demo import DemoAuthenticator

    auth = DemoAuthenticator(password="gpulease", admin_users={"admin"})
    login = lambda user, pw: asyncio.run(auth.authenticate(None, {"username": user, "password": pw}))  # noqa: E731
    assert login("alice", "gpulease") == "alice" and login("admin", "gpulease") == "admin"
    assert login("alice", "wrong") is None and login("alice", "") is None
    assert asyncio.run(DemoAuthenticator().authenticate(None, {"username": "alice", "password": ""})) is None


def test_the_demo_tutorial_says_the_silent_extension_build_on_the_line_before_its_command():
    """pip shows nothing of npm's build (about a minute): the words right before the command say it comes."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "tutorials" / "demo.md").read_text()
    before, command = text.split("```bash", 1)
    lead = before.strip().split("\n\n")[-1]  # the paragraph that introduces the command
    assert "pip install -e ." in command.split("```", 1)[0]
    assert "JupyterLab extension builds with npm, about a minute" in " ".join(lead.split()) and "shows nothing" in lead, lead
