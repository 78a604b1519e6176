"""Where the kernel's `%gpu` talks to: its gpulease server, or (without one) the broker.

The kernel runs inside the user's Jupyter server; the server's gpulease extension serves
``/gpulease/api/…``. A kernel finds its server, in this order:

1. ``GPULEASE_SERVER_URL`` (+ ``GPULEASE_SERVER_TOKEN``): set by the gpulease kernel
   provisioner for every kernel it starts (see :mod:`.launch`);
2. ``JUPYTERHUB_SERVICE_URL`` + ``JUPYTERHUB_API_TOKEN``: any JupyterHub single-user server
   passes these on to its kernels;
3. the runtime folder's ``jpserver-<pid>.json`` of the process that started this kernel (how
   other kernel-side tools find their server).

Calls are plain blocking HTTP (the magics run in the kernel's main thread, where no event loop
of ours may run; the widget's feed runs in a thread of its own).
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

API = "gpulease/api/"


class NoServer(Exception):
    """No gpulease server (and no broker) to talk to; the message says what to do."""


class ServerError(Exception):
    """The gpulease server said no, or could not be reached (``status`` 0)."""

    def __init__(self, status: int, message: str, field: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.field = field


@dataclass(frozen=True)
class Server:
    """A Jupyter server: its base URL (ending in /) and a token it accepts."""

    url: str
    token: str
    found_by: str

    def api_url(self, path: str) -> str:
        return self.url + API + path.lstrip("/")


def _slash(url: str) -> str:
    return url if url.endswith("/") else url + "/"


def _runtime_server(ppid: int, runtime_dir: str | None) -> Server | None:
    if runtime_dir is None:
        try:
            from jupyter_core.paths import jupyter_runtime_dir

            runtime_dir = jupyter_runtime_dir()
        except ImportError:
            return None
    path = Path(runtime_dir) / f"jpserver-{ppid}.json"
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    url = info.get("url") or ""
    if not url:
        return None
    base = info.get("base_url") or "/"
    if not url.rstrip("/").endswith(base.rstrip("/")):
        url = _slash(url) + base.lstrip("/")
    return Server(_slash(url), info.get("token") or "", str(path))


def find_server(env: dict[str, str] | None = None, *, ppid: int | None = None, runtime_dir: str | None = None) -> Server | None:
    """This kernel's Jupyter server, or None when it has none (plain IPython, a terminal)."""
    env = os.environ if env is None else env
    token = env.get("GPULEASE_SERVER_TOKEN") or env.get("JUPYTERHUB_API_TOKEN") or env.get("JPY_API_TOKEN") or ""
    if env.get("GPULEASE_SERVER_URL"):
        return Server(_slash(env["GPULEASE_SERVER_URL"]), token, "GPULEASE_SERVER_URL")
    if env.get("JUPYTERHUB_SERVICE_URL") and env.get("JUPYTERHUB_API_TOKEN"):
        return Server(_slash(env["JUPYTERHUB_SERVICE_URL"]), env["JUPYTERHUB_API_TOKEN"], "JUPYTERHUB_SERVICE_URL")
    return _runtime_server(os.getppid() if ppid is None else ppid, runtime_dir)


def http_json(method: str, url: str, token: str, body: Any = None, *, timeout: float = 15) -> Any:
    """One JSON call; ServerError with the server's own message when it answers 4xx/5xx."""
    headers = {"Accept": "application/json"}
    if token:
        headers["Authorization"] = f"token {token}"
    data = None
    if body is not None or method == "POST":
        headers["Content-Type"] = "application/json"
        data = json.dumps(body if body is not None else {}).encode()
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as e:
        raw = e.read() or b""
        try:
            d = json.loads(raw)
        except ValueError:
            d = {}
        if not isinstance(d, dict):
            d = {}
        message = d.get("message") or d.get("reason") or e.reason or str(e)
        if e.code in (301, 302, 303, 307) or (e.code == 403 and not d.get("message")):
            message = f"the server refused the token ({e.code} {e.reason})"
        raise ServerError(e.code, str(message), d.get("field")) from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise ServerError(0, f"cannot reach {url.split(API)[0]}: {reason}") from None
    if not raw:
        return None
    return json.loads(raw)


class ServerAPI:
    """The gpulease server extension's REST API (see docs/server-api.md)."""

    def __init__(self, server: Server, *, timeout: float = 15):
        self.server = server
        self.timeout = timeout

    def __repr__(self) -> str:
        return f"ServerAPI({self.server.url!r})"

    def get(self, path: str, *, timeout: float | None = None) -> Any:
        return http_json("GET", self.server.api_url(path), self.server.token, timeout=timeout or self.timeout)

    def post(self, path: str, body: dict | None = None, *, timeout: float | None = None) -> Any:
        return http_json("POST", self.server.api_url(path), self.server.token, body or {}, timeout=timeout or self.timeout)
