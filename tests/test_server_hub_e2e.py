"""The server extension end to end: a real JupyterHub, configurable-http-proxy, the broker as a
managed service on a one-GPU simulated pool, and real single-user servers (the extension loaded
from the file the package installs) with real kernels, reached through the proxy.

alice's kernel holds GPU memory and sits idle: it is warned, suspended (a stand-in
cuda-checkpoint written for the tests), and her lease goes back to the pool as *reclaimed*
while her server keeps running; bob, who waited for the GPU, gets it. When alice's kernel runs
a cell again, it waits in the queue (her feed says where) until bob stops, then gets the GPU
back and goes on. bob's token does not open alice's GPU API.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import sys
import time
import uuid
from pathlib import Path

import pytest
from tornado.httpclient import HTTPRequest
from tornado.websocket import websocket_connect

import standin_cuda_checkpoint as standin
from hubharness import HubHarness, free_port, wait_for
from serverutil import SimGPUs

pytestmark = pytest.mark.timeout(600)

POOL = [{"node": "n1", "model": "L4", "count": 1, "memory_mib": 23034}]


def make_hub(tmp: Path) -> tuple[HubHarness, str, str, SimGPUs, str]:
    """(hub, broker URL, spawner token, the simulated GPUs, the stand-in's folder)."""
    sim = SimGPUs(str(tmp / "sim-gpus.json"), POOL)
    standin_dir = tmp / "standin"
    standin_dir.mkdir()
    checkpoint = standin.install(str(standin_dir))
    # the servers' jupyter_server_config.py: a fast monitor and a short idle timeout
    conf_dir = tmp / "jupyter-config"
    conf_dir.mkdir()
    (conf_dir / "jupyter_server_config.py").write_text(
        "c = get_config()  # noqa\n"
        "c.GPULeaseExtension.sample_interval = 0.25\n"
        "c.GPUIdleRule.gpu_idle_timeout = 15\n"
        "c.ReclaimActions.warn_before = 5\n"
        "c.GPULeaseExtension.heartbeat_interval = 2\n"
        f"c.GPULeaseExtension.cuda_checkpoint = {checkpoint!r}\n"
    )
    bport = free_port()
    token = secrets.token_hex(16)
    broker_conf = tmp / "gpulease_config.py"
    broker_conf.write_text(
        "c = get_config()  # noqa\n"
        "c.GPULeaseBroker.device_backend = 'simulated'\n"
        f"c.GPULeaseBroker.devices = {{'gpus': {POOL!r}}}\n"
        "c.GPULeaseBroker.tick_interval = 0.5\n"
        "c.GPULeaseBroker.heartbeat_timeout = 60\n"
    )
    broker = {
        "name": "gpulease",
        "url": f"http://127.0.0.1:{bport}",
        "command": [sys.executable, "-m", "jupyter_gpulease.cli", "broker", f"--config={broker_conf}",
                    f"--db-url=sqlite:///{tmp / 'gpulease.sqlite'}"],
        "cwd": str(tmp),
    }
    broker_url = f"http://127.0.0.1:{bport}/services/gpulease/"
    server_env = {
        "JUPYTER_CONFIG_DIR": str(conf_dir),
        "GPULEASE_DEVICE_BACKEND": "simulated",
        "GPULEASE_DEVICE_CONFIG": json.dumps(sim.config),
        "STANDIN_CUDA_CHECKPOINT_DIR": str(standin_dir),
        "STANDIN_CUDA_CHECKPOINT_SIM_STATE": sim.state_file,
    }
    hub = HubHarness(
        tmp,
        users=["alice", "bob"],
        services=[broker, {"name": "gpulease-spawner", "api_token": token}],
        custom_scopes={"custom:gpulease:admin": {"description": "all GPU leases"}},
        roles=[
            {"name": "gpulease-spawner", "scopes": ["custom:gpulease:admin", "access:services!service=gpulease"], "services": ["gpulease-spawner"]},
            {"name": "gpulease-broker", "scopes": ["read:users", "read:servers", "read:groups", "list:groups", "admin:servers"], "services": ["gpulease"]},
        ],
        user_scopes=["access:services!service=gpulease"],
        spawner_class="gpulease-simple",
        config_lines=[
            f"c.GPULeaseSpawner.broker_url = {broker_url!r}",
            f"c.GPULeaseSpawner.broker_api_token = {token!r}",
            "c.GPULeaseSpawner.lease_wait_timeout = 300",
            # a lease the server gave back itself (reclaimed) must not stop it
            "c.GPULeaseSpawner.on_lease_end = 'keep'",
            "c.Spawner.server_token_scopes = ['users:activity!user', 'access:servers!server', 'access:services!service=gpulease']",
            f"c.Spawner.environment = {server_env!r}",
            "c.Spawner.default_url = '/tree'",
            "c.Spawner.poll_interval = 1",
            "c.Spawner.http_timeout = 60",
            "c.JupyterHub.log_level = 'INFO'",
        ],
    )
    hub.start()
    return hub, broker_url, token, sim, str(standin_dir)


def server_ready(hub, user):
    status, model = hub.api("GET", f"users/{user}")
    s = (model.get("servers") or {}).get("") if status == 200 else None
    return s if s and s.get("ready") else None


def gpu_api(hub, user, token, path="status", method="GET", body=None):
    return hub.request(method, f"{hub.url}/user/{user}/gpulease/api/{path}", body, token=token)


def broker_get(hub, url, token, path):
    return hub.request("GET", url + path, token=token)


async def run_cell(hub, user, token, kernel_id, code):
    """Send a cell to a kernel through the proxy's websocket (the way JupyterLab does); does not wait for it."""
    ws = await websocket_connect(HTTPRequest(f"ws://127.0.0.1:{hub.port}/user/{user}/api/kernels/{kernel_id}/channels",
                                             headers={"Authorization": f"token {token}"}))
    msg = {"header": {"msg_id": uuid.uuid4().hex, "username": user, "session": uuid.uuid4().hex, "msg_type": "execute_request",
                      "version": "5.3", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
           "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
           "content": {"code": code, "silent": False, "store_history": False, "user_expressions": {}, "allow_stdin": False,
                       "stop_on_error": True}}
    await ws.write_message(json.dumps(msg))
    await asyncio.sleep(1.0)  # delivered; the kernel runs the cell whether or not this client stays
    ws.close()


def test_an_idle_kernel_is_suspended_its_lease_goes_to_the_next_user_and_its_next_cell_resumes_it(tmp_path):
    hub, broker_url, spawner_token, sim, standin_dir = make_hub(tmp_path)
    try:
        alice, bob = hub.create_token("alice"), hub.create_token("bob")
        assert hub.api("POST", "users/alice/server", {"gpus": 1})[0] in (201, 202)
        wait_for(lambda: server_ready(hub, "alice"), 120, "alice's server did not start")

        # the extension runs in her server (enabled by the installed config file) and knows the lease
        def status_with_lease():
            code, st = gpu_api(hub, "alice", alice)
            return st if code == 200 and st["lease"] and st["lease"]["state"] == "active" else None

        st = wait_for(status_with_lease, 60, "alice's server reports its lease")
        lease = st["lease"]
        assert st["lease_origin"] == "spawner" and st["devices"][0]["uuid"] == sim.uuids[0]
        # bob's token does not open alice's GPU API (nor change her lease)
        assert gpu_api(hub, "alice", bob)[0] == 403
        assert gpu_api(hub, "alice", bob, "lease/release", "POST", {})[0] == 403

        # alice starts a kernel that takes GPU memory and then sits idle
        code, kernel = hub.request("POST", f"{hub.url}/user/alice/api/kernels", {"name": "python3"}, token=alice)
        assert code == 201, kernel

        def kernel_pid():
            _, s = gpu_api(hub, "alice", alice)
            k = next((k for k in s["kernels"] if k["id"] == kernel["id"]), None)
            return k and k["pid"]

        pid = wait_for(kernel_pid, 60, "the extension sees alice's kernel")
        sim.run(pid, 6000, sm=0.0)

        # bob asks for the only GPU and waits
        assert hub.api("POST", "users/bob/server", {"gpus": 1})[0] in (201, 202)
        wait_for(lambda: [x for x in broker_get(hub, broker_url, spawner_token, "api/leases?user=bob")[1]["leases"] if x["state"] == "queued"],
                 60, "bob's lease is queued")

        def lease_state(lease_id, token=spawner_token):
            return broker_get(hub, broker_url, token, f"api/leases/{lease_id}")[1]["state"]

        wait_for(lambda: lease_state(lease["id"]) == "reclaimed", 90, "alice's lease was not reclaimed")
        assert [c["action"] for c in standin.calls(standin_dir) if c["pid"] == pid] == ["lock", "checkpoint"]
        wait_for(lambda: server_ready(hub, "bob"), 120, "bob's server did not start on the freed GPU")
        # her server keeps running without a GPU, and says what happened
        assert server_ready(hub, "alice")
        _, st = gpu_api(hub, "alice", alice)
        assert st["lease"] is None and st["last_lease"]["state"] == "reclaimed"
        ks = next(k for k in st["kernels"] if k["id"] == kernel["id"])
        assert ks["state"] == "suspended" and ks["suspended"]["memory_mib"] == 6000

        # her next cell: the kernel waits for a GPU (bob has it) with its place in the queue ...
        asyncio.run(run_cell(hub, "alice", alice, kernel["id"], "import time; time.sleep(120)"))

        def waiting():
            _, s = gpu_api(hub, "alice", alice)
            return s if s["resume"] and s["resume"]["stage"] == "waiting" and s["resume"].get("position") else None

        st = wait_for(waiting, 60, "alice's resume waits in the queue")
        assert st["resume"]["position"] == 1 and st["lease"]["state"] == "queued"
        # ... and gets it when bob stops
        assert hub.api("DELETE", "users/bob/server")[0] in (202, 204)

        def resumed():
            _, s = gpu_api(hub, "alice", alice)
            k = next(k for k in s["kernels"] if k["id"] == kernel["id"])
            return s if k["state"] == "ok" and s["lease"] and s["lease"]["state"] == "active" else None

        st = wait_for(resumed, 90, "alice's kernel got its GPU back")
        assert st["lease"]["id"] != lease["id"] and st["lease_origin"] == "server"
        assert lease_state(st["lease"]["id"]) == "active"
        assert sim.processes()[pid] == (sim.uuids[0], 6000)  # the same process, its memory back on the GPU
        assert [c["action"] for c in standin.calls(standin_dir) if c["pid"] == pid] == ["lock", "checkpoint", "restore", "unlock"]
    finally:
        for user in ("alice", "bob"):
            if server_ready(hub, user):
                hub.api("DELETE", f"users/{user}/server")
        hub.stop()
