"""A real broker, a real Jupyter server with the gpulease extension, and real kernels started by
that server, on 127.0.0.1: what `%gpu`, the widget and their tests talk to.

The broker runs in the test's process (tests/brokerutil.py: a clock the test moves, callers
named by their token: ``token alice`` is user alice); the server is a subprocess on the
``simulated`` device backend, whose GPUs are the broker's pool and whose figures the test drives
through the backend's state file. Kernels are started through the server's REST API, so they
start the way a user's do (the gpulease kernel provisioner, `%gpu` loaded).
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from jupyter_client import BlockingKernelClient

from brokerutil import SMALL_POOL
from hubharness import free_port, terminate, wait_for
from jupyter_gpulease.devices.simulated import SimulatedBackend


class JupyterServer:
    """``jupyter server`` with the gpulease extension, as user ``user`` of the broker."""

    def __init__(self, tmp_path: Path, broker_url: str, *, user: str = "alice", pool: list[dict] | None = None, extra_args: list[str] = (),
                 extra_env: dict[str, str] | None = None):
        self.dir = tmp_path / f"server-{user}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.runtime = self.dir / "runtime"
        self.port = free_port()
        self.token = f"server-token-{user}"
        self.url = f"http://127.0.0.1:{self.port}/"
        self.state_file = self.dir / "sim-gpus.json"
        self.devices = SimulatedBackend({"gpus": pool or SMALL_POOL, "state_file": str(self.state_file)})
        env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTERHUB_", "GPULEASE_", "JPY_"))}
        env.update(
            GPULEASE_BROKER_URL=broker_url,
            GPULEASE_TOKEN=user,
            GPULEASE_DEVICE_BACKEND="simulated",
            GPULEASE_DEVICE_CONFIG=json.dumps({"gpus": pool or SMALL_POOL, "state_file": str(self.state_file)}),
            JUPYTER_RUNTIME_DIR=str(self.runtime),
            IPYTHONDIR=str(self.dir / "ipython"),
            HOME=str(self.dir),
            **(extra_env or {}),
        )
        cmd = [sys.executable, "-m", "jupyter_server", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={self.port}",
               f"--IdentityProvider.token={self.token}", "--ServerApp.open_browser=False", f"--ServerApp.root_dir={self.dir}",
               "--ServerApp.jpserver_extensions=jupyter_gpulease.server=True", "--GPULeaseExtension.heartbeat_interval=1",
               "--GPULeaseExtension.sample_interval=0.5", *extra_args]
        if os.getuid() == 0:
            cmd.append("--allow-root")
        self.log_path = self.dir / "server.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, env=env, cwd=self.dir, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_for(self._ready, 60, f"the Jupyter server did not answer within 60 s; log: {self.log_path}")

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"the Jupyter server exited ({self.proc.returncode}):\n{self.log_tail()}")
        try:
            return self.api("GET", "gpulease/api/status")[0] == 200
        except OSError:
            return False

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def api(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else (b"{}" if method == "POST" else None)
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Authorization": f"token {self.token}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                raw = r.read()
                return r.status, json.loads(raw) if raw else None
        except urllib.error.HTTPError as e:
            raw = e.read()
            return e.code, json.loads(raw) if raw else None

    def status(self) -> dict:
        return self.api("GET", "gpulease/api/status?history=0")[1]

    def start_kernel(self) -> Kernel:
        status, body = self.api("POST", "api/kernels", {"name": "python3"})
        assert status == 201, body
        return Kernel(self, body["id"])

    def stop(self) -> None:
        terminate(self.proc, 20)
        self._log.close()


class Kernel:
    """A kernel of the server, driven over its ZMQ channels like a notebook does."""

    def __init__(self, server: JupyterServer, kernel_id: str):
        self.server = server
        self.id = kernel_id
        cf = server.runtime / f"kernel-{kernel_id}.json"
        wait_for(cf.exists, 30, f"no connection file {cf}")
        self.client = BlockingKernelClient(connection_file=str(cf))
        self.client.load_connection_file()
        # no heartbeat channel: the client would call a kernel that is still starting dead
        self.client.start_channels(hb=False)
        self.client.wait_for_ready(timeout=60)

    def execute(self, code: str, timeout: float = 120) -> dict[str, Any]:
        """Run ``code``; its stdout, stderr, every IOPub message of the run, and the reply."""
        msg_id = self.client.execute(code)
        return self.collect(msg_id, timeout)

    def collect(self, msg_id: str, timeout: float = 120) -> dict[str, Any]:
        out = {"stdout": "", "stderr": "", "messages": [], "reply": None}
        deadline = time.monotonic() + timeout
        idle = False
        while not idle:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"the kernel did not finish within {timeout} s; so far: {out['stdout']!r} {out['stderr']!r}")
            try:
                msg = self.client.get_iopub_msg(timeout=min(left, 5))
            except queue.Empty:
                continue
            out["messages"].append(msg)
            mine = msg.get("parent_header", {}).get("msg_id") == msg_id
            if msg["msg_type"] == "stream" and mine:
                out[msg["content"]["name"]] += msg["content"]["text"]
            elif msg["msg_type"] == "error" and mine:
                out["stderr"] += "\n".join(msg["content"]["traceback"])
            elif msg["msg_type"] == "status" and mine and msg["content"]["execution_state"] == "idle":
                idle = True
        out["reply"] = self.client.get_shell_msg(timeout=30)
        return out

    def interrupt(self) -> None:
        status, body = self.server.api("POST", f"api/kernels/{self.id}/interrupt")
        assert status == 204, body

    def stop(self) -> None:
        self.client.stop_channels()
        self.server.api("DELETE", f"api/kernels/{self.id}")
