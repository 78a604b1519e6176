"""A real JupyterHub + configurable-http-proxy on 127.0.0.1, for integration tests.

Usage::

    hub = HubHarness(tmp_path, users=["alice", "bob"], admin_users=["root"],
                     services=[{"name": "gpulease", "url": f"http://127.0.0.1:{port}", "command": [...]}],
                     user_scopes=["access:services!service=gpulease"],
                     config_lines=["c.Spawner.poll_interval = 1"])
    hub.start()
    token = hub.create_token("alice")
    status, body = hub.api("GET", "users/alice")       # the admin token by default
    hub.restart()                                       # waits for the old hub's PID to exit
    hub.keep_servers = True                             # with cleanup_servers = False: servers outlive stop()
    hub.stop()

Users' servers, through the Hub API and /proc::

    hub.spawn("alice", {"gpus": 1})                     # (status, body) of POST users/alice/server
    hub.wait_ready("alice")                             # her server's model, once ready
    hub.server_env("alice")["CUDA_VISIBLE_DEVICES"]     # the environment of her server's process
    hub.stop_server("alice")                            # DELETE, then wait until the hub lists none

Everything binds to 127.0.0.1 on free ports; the hub's database, cookie secret, proxy pid
file and log live in ``tmp_path``. configurable-http-proxy is found by :func:`tooling.find_chp`
(``GPULEASE_CHP``, ``PATH``, the project's ``.ci/node_modules``, where it is installed when
missing); when that fails, :meth:`start` fails with a message saying so (tests must not skip
silently).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import tooling
from jupyter_gpulease.hub.demo import pid_alive, terminate  # pid_alive re-exported: tests import it from here

ADMIN_SERVICE = "test-admin"
ADMIN_SCOPES = ["admin:users", "admin:servers", "admin:groups", "tokens", "access:servers", "access:services", "read:hub", "list:users", "read:users"]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_chp() -> str:
    """Path of configurable-http-proxy (see :mod:`tooling`: GPULEASE_CHP, PATH, the project's
    .ci/node_modules, installed there by npm when missing), or AssertionError saying what to do."""
    return tooling.find_chp()


def wait_for(predicate, timeout: float, message: str, interval: float = 0.1):
    """Call ``predicate`` until it returns something truthy; AssertionError(message) after ``timeout`` s.

    Other exceptions are retried; an AssertionError raised by ``predicate`` fails at once (use it
    for "this will never happen now", e.g. the process under test exited).
    """
    deadline = time.monotonic() + timeout
    last_exc: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except AssertionError:
            raise
        except Exception as e:
            last_exc = e
            value = None
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"{message} (waited {timeout:g} s; last error: {last_exc!r})")


def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid:
            out.append(int(d))
    return out


def process_env(pid: int) -> dict[str, str]:
    """The environment process ``pid`` started with (from /proc; OSError when it is gone)."""
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


class HubHarness:
    """One JupyterHub (with its proxy and managed services) for a test; see the module doc."""

    def __init__(
        self,
        tmp_path: Path | str,
        *,
        users: list[str] = (),
        admin_users: list[str] = (),
        groups: dict[str, list[str]] | None = None,
        services: list[dict[str, Any]] = (),
        roles: list[dict[str, Any]] = (),
        custom_scopes: dict[str, dict[str, Any]] | None = None,
        user_scopes: list[str] = (),
        spawner_class: str = "simple",
        authenticator_class: str = "dummy",
        password: str = "test-password",
        config_lines: list[str] | str = (),
        env: dict[str, str] | None = None,
        start_timeout: float = 60,
        log_level: str = "DEBUG",
    ):
        self.dir = Path(tmp_path)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.users = list(users)
        self.admin_users = list(admin_users)
        self.groups = dict(groups or {})
        self.services = [dict(s) for s in services]
        self.roles = [dict(r) for r in roles]
        self.custom_scopes = dict(custom_scopes or {})
        self.user_scopes = list(user_scopes)
        self.spawner_class = spawner_class
        self.authenticator_class = authenticator_class
        self.password = password
        self.config_lines = [config_lines] if isinstance(config_lines, str) else list(config_lines)
        self.env = dict(env or {})
        self.start_timeout = start_timeout
        self.log_level = log_level
        self.python = sys.executable  # the Python whose JupyterHub runs (a test may point it at another venv)

        self.port = free_port()
        self.hub_port = free_port()
        self.proxy_api_port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.hub_api_url = f"{self.url}/hub/api"
        self.admin_token = secrets.token_hex(16)
        self.proxy_token = secrets.token_hex(16)
        self.config_file = self.dir / "jupyterhub_config.py"
        self.log_file = self.dir / "jupyterhub.log"
        self.proc: subprocess.Popen | None = None
        self.keep_servers = False  # stop() leaves single-user servers running (a hub restart that keeps them)
        self.pid: int | None = None
        self._log_handle = None

    # ------------------------------------------------------------------ config
    def site_lines(self) -> list[str]:
        """The settings every hub has of its own: its ports on 127.0.0.1, its database, cookie
        secret and proxy, all in this harness's folder."""
        return [
            f"c.JupyterHub.bind_url = {self.url!r}",
            f"c.JupyterHub.hub_bind_url = 'http://127.0.0.1:{self.hub_port}'",
            f"c.JupyterHub.db_url = {('sqlite:///' + str(self.dir / 'jupyterhub.sqlite'))!r}",
            f"c.JupyterHub.cookie_secret_file = {str(self.dir / 'jupyterhub_cookie_secret')!r}",
            f"c.ConfigurableHTTPProxy.command = [{find_chp()!r}]",
            f"c.ConfigurableHTTPProxy.api_url = 'http://127.0.0.1:{self.proxy_api_port}'",
            f"c.ConfigurableHTTPProxy.auth_token = {self.proxy_token!r}",
            f"c.ConfigurableHTTPProxy.pid_file = {str(self.dir / 'proxy.pid')!r}",
        ]

    def config_text(self) -> str:
        """The jupyterhub_config.py this harness writes (handy when a test fails)."""
        home = self.dir / "home"
        home.mkdir(exist_ok=True)
        singleuser = Path(sys.executable).with_name("jupyterhub-singleuser")
        services = [{"name": ADMIN_SERVICE, "api_token": self.admin_token}, *self.services]
        roles = [{"name": "test-admin-role", "scopes": ADMIN_SCOPES, "services": [ADMIN_SERVICE]}, *self.roles]
        if self.user_scopes:
            roles.append({"name": "user", "scopes": ["self", *self.user_scopes]})
        allowed = sorted(set(self.users) | set(self.admin_users) | {u for members in self.groups.values() for u in members})
        lines = [
            "c = get_config()  # noqa",
            *self.site_lines(),
            "c.JupyterHub.cleanup_servers = True",
            "c.ConfigurableHTTPProxy.should_start = True",
            f"c.JupyterHub.authenticator_class = {self.authenticator_class!r}",
            f"c.DummyAuthenticator.password = {self.password!r}",
            f"c.Authenticator.allowed_users = {set(allowed)!r}",
            f"c.Authenticator.admin_users = {set(self.admin_users)!r}",
            f"c.JupyterHub.spawner_class = {self.spawner_class!r}",
            f"c.Spawner.cmd = [{str(singleuser)!r}]",
            "c.Spawner.args = ['--allow-root']",
            "c.Spawner.default_url = '/lab'",
            f"c.SimpleLocalProcessSpawner.home_dir_template = {str(home / '{username}')!r}",
            f"c.JupyterHub.services = {services!r}",
            f"c.JupyterHub.load_roles = {roles!r}",
            f"c.JupyterHub.log_level = {self.log_level!r}",
        ]
        if self.groups:
            lines.append(f"c.JupyterHub.load_groups = {({g: {'users': list(m)} for g, m in self.groups.items()})!r}")
        if self.custom_scopes:
            lines.append(f"c.JupyterHub.custom_scopes = {self.custom_scopes!r}")
        lines += self.config_lines
        return "\n".join(lines) + "\n"

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout: float | None = None) -> HubHarness:
        """Start the hub and wait until its API answers through the proxy."""
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError("hub already running")
        self.config_file.write_text(self.config_text())
        env = {**os.environ, **self.env}
        env.pop("JUPYTERHUB_API_TOKEN", None)
        self._log_handle = open(self.log_file, "ab")  # noqa: SIM115 (kept open for the hub's lifetime)
        self._log_handle.write(b"\n===== starting hub =====\n")
        self._log_handle.flush()
        self.proc = subprocess.Popen(
            [self.python, "-m", "jupyterhub", "-f", str(self.config_file)],
            cwd=self.dir,
            env=env,
            stdout=self._log_handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stop() can clean up the whole tree
        )
        self.pid = self.proc.pid

        def ready():
            if self.proc.poll() is not None:
                raise AssertionError(f"the hub exited with status {self.proc.returncode}:\n{self.log_tail()}")
            status, _ = self.api("GET", "", token=None)
            return status == 200

        try:
            wait_for(ready, timeout or self.start_timeout, f"JupyterHub did not answer on {self.hub_api_url}")
        except AssertionError as e:
            self.stop()
            raise AssertionError(f"{e}\n--- hub log ---\n{self.log_tail()}") from None
        return self

    def stop(self, timeout: float = 30) -> None:
        """Stop the hub (SIGTERM, SIGKILL after ``timeout``) and wait until its PID is gone."""
        proc = self.proc
        if proc is None:
            return
        # managed services and the proxy run in their own sessions: remember them, to clean up after;
        # with keep_servers (and c.JupyterHub.cleanup_servers = False) single-user servers live on
        leftovers = [pid for pid, cmd in self.descendants() if not (self.keep_servers and "singleuser" in cmd)]
        terminate(proc, timeout)
        # anything left in its process group (services, the proxy): gone too
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        pid_file = self.dir / "proxy.pid"
        if pid_file.exists():
            try:
                chp_pid = int(pid_file.read_text().strip())
                if pid_alive(chp_pid):
                    os.kill(chp_pid, signal.SIGTERM)
                    wait_for(lambda: not pid_alive(chp_pid), 10, f"proxy PID {chp_pid} did not exit")
            except (ValueError, ProcessLookupError):
                pass
        wait_for(lambda: not pid_alive(proc.pid), timeout, f"hub PID {proc.pid} did not exit")
        for pid in leftovers:
            if pid_alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
                wait_for(lambda pid=pid: not pid_alive(pid), 10, f"PID {pid} (started by the hub) did not exit")
        self.proc = None
        if self._log_handle:
            self._log_handle.close()
            self._log_handle = None

    def restart(self, timeout: float | None = None) -> HubHarness:
        """Stop, wait for the old hub's PID to exit, start again (same ports, same database)."""
        old = self.pid
        self.stop()
        if old is not None:
            wait_for(lambda: not pid_alive(old), 30, f"old hub PID {old} still running")
        return self.start(timeout)

    def __enter__(self) -> HubHarness:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ looking around
    def log_tail(self, n: int = 80) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no hub log)"

    def descendants(self) -> list[tuple[int, str]]:
        """(pid, command line) of every process below the hub."""
        if self.pid is None:
            return []
        out, todo = [], [self.pid]
        while todo:
            for child in _children(todo.pop()):
                out.append((child, _cmdline(child)))
                todo.append(child)
        return out

    def find_process(self, needle: str) -> int | None:
        """PID of a process below the hub whose command line contains ``needle``."""
        for pid, cmd in self.descendants():
            if needle in cmd and pid_alive(pid):
                return pid
        return None

    # ------------------------------------------------------------------ the Hub API
    def request(self, method: str, url: str, body: Any = None, *, token: str | None = None, headers: dict | None = None, timeout: float = 30) -> tuple[int, Any]:
        """Any HTTP request; returns (status, parsed JSON or text). Never raises on HTTP errors."""
        data = None
        hdrs = dict(headers or {})
        if body is not None:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            hdrs.setdefault("Content-Type", "application/json")
        elif method in ("POST", "PUT", "PATCH"):
            data = b""
        if token:
            hdrs["Authorization"] = f"token {token}"
        req = urllib.request.Request(url, data=data, method=method, headers=hdrs)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read()
        text = raw.decode(errors="replace")
        try:
            return status, json.loads(text) if text else None
        except ValueError:
            return status, text

    def api(self, method: str, path: str, body: Any = None, *, token: str | None = "admin") -> tuple[int, Any]:
        """Call the Hub API (``path`` relative to /hub/api/), with the admin token by default."""
        if token == "admin":
            token = self.admin_token
        return self.request(method, f"{self.hub_api_url}/{path.lstrip('/')}", body, token=token)

    def create_token(self, user: str, *, scopes: list[str] | None = None, roles: list[str] | None = None, note: str = "test") -> str:
        """A new API token of ``user`` (its own permissions unless ``scopes``/``roles`` narrow them)."""
        body: dict[str, Any] = {"note": note}
        if scopes is not None:
            body["scopes"] = scopes
        if roles is not None:
            body["roles"] = roles
        status, reply = self.api("POST", f"users/{user}/tokens", body)
        assert status == 201, f"creating a token for {user} failed: {status} {reply}"
        return reply["token"]

    def login(self, user: str, password: str | None = None):
        """A urllib opener that logged ``user`` in through the hub's login form, with its cookies.

        ``opener.open(url)`` then behaves like that user's browser (it follows OAuth redirects).
        """
        import http.cookiejar
        import re
        import urllib.parse

        jar = http.cookiejar.CookieJar()
        opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
        page = opener.open(f"{self.url}/hub/login", timeout=30).read().decode()
        m = re.search(r'name="_xsrf" value="([^"]+)"', page)
        form = {"username": user, "password": self.password if password is None else password}
        if m:
            form["_xsrf"] = m.group(1)
        resp = opener.open(f"{self.url}/hub/login", data=urllib.parse.urlencode(form).encode(), timeout=60)
        assert "/hub/login" not in resp.url, f"logging in {user} failed: ended at {resp.url}"
        opener.cookiejar = jar
        return opener

    def service_url(self, name: str) -> str:
        """The service's public URL through the proxy, with a trailing slash."""
        return f"{self.url}/services/{name}/"

    # ------------------------------------------------------------------ users' servers
    def user_url(self, user: str, path: str = "") -> str:
        """A URL of ``user``'s default server through the proxy (``path`` relative to it)."""
        return f"{self.url}/user/{user}/{path.lstrip('/')}"

    def spawn(self, user: str, options: dict | None = None) -> tuple[int, Any]:
        """POST users/<user>/server with ``options`` as the user_options; (status, body)."""
        return self.api("POST", f"users/{user}/server", options)

    def server_model(self, user: str) -> dict | None:
        """The hub's model of ``user``'s default server (pending or ready), or None when it has none."""
        status, model = self.api("GET", f"users/{user}")
        assert status == 200, model
        return (model.get("servers") or {}).get("")

    def ready_server(self, user: str) -> dict | None:
        """``user``'s server model when the hub calls it ready, else None (never fails)."""
        status, model = self.api("GET", f"users/{user}")
        s = (model.get("servers") or {}).get("") if status == 200 else None
        return s if s and s.get("ready") else None

    def wait_ready(self, user: str, timeout: float = 90) -> dict:
        """Wait until ``user``'s server is ready; fails at once when the hub drops it (the spawn failed)."""
        def ready():
            s = self.server_model(user)
            if s is None:
                raise AssertionError(f"{user} has no server: the spawn failed\n{self.log_tail(40)}")
            return s if s.get("ready") else None
        return wait_for(ready, timeout, f"{user}'s server did not become ready")

    def wait_gone(self, user: str, timeout: float = 60) -> None:
        wait_for(lambda: self.server_model(user) is None, timeout, f"{user}'s server did not stop")

    def stop_server(self, user: str, timeout: float = 60) -> None:
        """DELETE ``user``'s server and wait until the hub lists it no more."""
        status, body = self.api("DELETE", f"users/{user}/server")
        assert status in (202, 204), body
        self.wait_gone(user, timeout)

    def stop_servers(self) -> None:
        """Ask the hub to stop every server it lists, pending or running (clean-up: no waiting)."""
        status, users = self.api("GET", "users?state=active")
        for user in users if status == 200 else ():
            if (user.get("servers") or {}).get(""):
                self.api("DELETE", f"users/{user['name']}/server")

    def server_processes(self) -> dict[str, tuple[int, dict[str, str]]]:
        """user -> (pid, environment) of every running single-user server process below the hub."""
        out = {}
        for pid, cmd in self.descendants():
            if "jupyterhub-singleuser" not in cmd or _zombie(pid):
                continue
            try:
                env = process_env(pid)
            except OSError:
                continue
            if env.get("JUPYTERHUB_USER"):
                out[env["JUPYTERHUB_USER"]] = (pid, env)
        return out

    def server_process(self, user: str) -> tuple[int, dict[str, str]]:
        """(pid, environment) of ``user``'s single-user server process."""
        found = self.server_processes().get(user)
        if found is None:
            raise AssertionError(f"no single-user server process of {user} found below the hub")
        return found

    def server_env(self, user: str) -> dict[str, str]:
        return self.server_process(user)[1]

    def server_pid(self, user: str) -> int:
        return self.server_process(user)[0]

    def server_token(self, user: str) -> str:
        """The token the hub gave ``user``'s running server (its JUPYTERHUB_API_TOKEN)."""
        return self.server_env(user)["JUPYTERHUB_API_TOKEN"]

    def progress(self, user: str, *, timeout: float = 600, deadline: float | None = None) -> Iterator[dict]:
        """The events of ``user``'s spawn progress stream (server-sent events) as they come, until
        one says ready or failed; ``timeout``: the longest silence; ``deadline`` (monotonic): stop
        at the first keep-alive after it."""
        req = urllib.request.Request(f"{self.hub_api_url}/users/{user}/server/progress",
                                     headers={"Authorization": f"token {self.admin_token}"})
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    if deadline is not None and time.monotonic() > deadline:
                        return
                    continue
                ev = json.loads(line[5:])
                yield ev
                if ev.get("failed") or ev.get("ready"):
                    return

    def progress_events(self, user: str, until, timeout: float = 60) -> list[dict]:
        """``user``'s spawn progress events until ``until(event)`` is true (or ready, failed, ``timeout``)."""
        events = []
        for ev in self.progress(user, timeout=timeout, deadline=time.monotonic() + timeout):
            events.append(ev)
            if until(ev):
                break
        return events
