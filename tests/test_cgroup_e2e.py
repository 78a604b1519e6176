"""Device access follows the lease, end to end, on cgroup v1's devices controller.

A real JupyterHub with the lease spawner for local processes, the broker as its managed service
on a three-GPU pool whose GPUs are real character devices with NVIDIA's major number (made with
``mknod`` in the test's folder and named in the pool's declaration), real single-user servers
with the extension, a real kernel in alice's server that tries to open the nodes, and a process
of her server that outlives it. Without a driver an allowed open reaches the (absent) driver and
fails with ENXIO; a denied one fails with EPERM. Needs root and a writable v1 devices
controller; skipped elsewhere.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import stat
import sys
import time
import uuid
from pathlib import Path

import pytest
from tornado.httpclient import HTTPRequest
from tornado.websocket import websocket_connect

from hubharness import HubHarness, free_port, wait_for
from jupyter_gpulease.hub import cgroups
from serverutil import SimGPUs

pytestmark = pytest.mark.timeout(600)

MINOR0 = 240  # high minors: no real GPU of a host is denied by accident


def _v1_root() -> str | None:
    if os.geteuid() != 0:
        return None
    mount = cgroups.v1_devices_mount()
    return mount if mount and os.access(mount, os.W_OK) else None


requires_v1 = pytest.mark.skipif(_v1_root() is None, reason="needs root and cgroup v1's devices controller")


def make_nodes(folder: Path, n: int) -> list[str]:
    folder.mkdir()
    paths = []
    for i in range(n):
        p = folder / f"nvidia{i}"
        os.mknod(p, stat.S_IFCHR | 0o666, os.makedev(195, MINOR0 + i))
        paths.append(str(p))
    return paths


def make_hub(tmp: Path, pool: list[dict], parent: str, mode: str = "required", *, users=("alice", "bob"),
             config_lines: list[str] = ()) -> tuple[HubHarness, str, SimGPUs]:
    sim = SimGPUs(str(tmp / "sim-gpus.json"), pool)
    conf_dir = tmp / "jupyter-config"
    conf_dir.mkdir(exist_ok=True)
    (conf_dir / "jupyter_server_config.py").write_text("c = get_config()  # noqa\nc.GPULeaseExtension.heartbeat_interval = 5\n")
    bport = free_port()
    token = secrets.token_hex(16)
    broker_conf = tmp / "gpulease_config.py"
    broker_conf.write_text(
        "c = get_config()  # noqa\n"
        "c.GPULeaseBroker.device_backend = 'simulated'\n"
        f"c.GPULeaseBroker.devices = {{'gpus': {pool!r}}}\n"
        "c.GPULeaseBroker.tick_interval = 0.5\n"
        "c.GPULeaseBroker.heartbeat_timeout = 120\n"
    )
    broker = {"name": "gpulease", "url": f"http://127.0.0.1:{bport}", "cwd": str(tmp),
              "command": [sys.executable, "-m", "jupyter_gpulease.cli", "broker", f"--config={broker_conf}",
                          f"--db-url=sqlite:///{tmp / 'gpulease.sqlite'}"]}
    broker_url = f"http://127.0.0.1:{bport}/services/gpulease/"
    server_env = {"JUPYTER_CONFIG_DIR": str(conf_dir), "GPULEASE_DEVICE_BACKEND": "simulated",
                  "GPULEASE_DEVICE_CONFIG": json.dumps(sim.config)}
    hub = HubHarness(
        tmp,
        users=list(users),
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
            f"c.GPULeaseSpawner.enforce_devices = {mode!r}",
            f"c.GPULeaseSpawner.device_cgroup_parent = {parent!r}",
            "c.Spawner.server_token_scopes = ['users:activity!user', 'access:servers!server', 'access:services!service=gpulease']",
            f"c.Spawner.environment = {server_env!r}",
            "c.Spawner.default_url = '/tree'",
            "c.Spawner.poll_interval = 2",
            "c.Spawner.http_timeout = 90",
            "c.JupyterHub.log_level = 'INFO'",
            *config_lines,
        ],
        log_level="INFO",
        start_timeout=120,
    )
    hub.start()
    return hub, broker_url, sim


def server_ready(hub, user):
    status, model = hub.api("GET", f"users/{user}")
    s = (model.get("servers") or {}).get("") if status == 200 else None
    return s if s and s.get("ready") else None


PROBE = """
import errno as _e, json as _j, os as _o
def _probe(p):
    try:
        _o.close(_o.open(p, _o.O_RDONLY))
    except OSError as x:
        return _e.errorcode.get(x.errno, str(x.errno))
    return "opened"
_j.dump({p: _probe(p) for p in PATHS}, open(OUT + ".tmp", "w")); _o.replace(OUT + ".tmp", OUT)
"""


LEFTOVER = """
import errno, json, os, sys, time
out, stop, paths = sys.argv[1], sys.argv[2], sys.argv[3:]
def probe(p):
    try:
        os.close(os.open(p, os.O_RDONLY))
    except OSError as x:
        return errno.errorcode.get(x.errno, str(x.errno))
    return "opened"
while not os.path.exists(stop):
    json.dump({p: probe(p) for p in paths}, open(out + ".tmp", "w")); os.replace(out + ".tmp", out)
    time.sleep(0.2)
"""


def start_leftover(hub, user, token, kernel_id, paths, out: Path, stop: Path) -> None:
    """A process of the user's server that outlives it: started from a kernel in a session of its
    own (so neither the kernel's nor the server's end takes it along); it opens ``paths`` over and
    over, writing what it sees to ``out``, until ``stop`` exists."""
    code = ("import subprocess, sys\n"
            f"subprocess.Popen([sys.executable, '-c', {LEFTOVER!r}, {str(out)!r}, {str(stop)!r}, *{list(paths)!r}], "
            "start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n")
    asyncio.run(_run_cell(hub, user, token, kernel_id, code))


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


async def _run_cell(hub, user, token, kernel_id, code):
    ws = await websocket_connect(HTTPRequest(f"ws://127.0.0.1:{hub.port}/user/{user}/api/kernels/{kernel_id}/channels",
                                             headers={"Authorization": f"token {token}"}))
    msg = {"header": {"msg_id": uuid.uuid4().hex, "username": user, "session": uuid.uuid4().hex, "msg_type": "execute_request",
                      "version": "5.3", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
           "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
           "content": {"code": code, "silent": False, "store_history": False, "user_expressions": {}, "allow_stdin": False,
                       "stop_on_error": True}}
    await ws.write_message(json.dumps(msg))
    await asyncio.sleep(0.5)
    ws.close()


class Prober:
    """Runs ``open()`` of each node in a kernel of the user's server; returns errno names."""

    def __init__(self, hub, user, token, kernel_id, paths, folder: Path):
        self.hub, self.user, self.token, self.kernel_id, self.paths, self.folder = hub, user, token, kernel_id, paths, folder
        self.n = 0

    def __call__(self) -> dict[str, str]:
        self.n += 1
        out = self.folder / f"probe-{self.n}.json"
        code = f"PATHS = {self.paths!r}; OUT = {str(out)!r}\n" + PROBE
        asyncio.run(_run_cell(self.hub, self.user, self.token, self.kernel_id, code))
        wait_for(out.exists, 60, "the kernel did not run the probe")
        return json.loads(out.read_text())


@requires_v1
def test_a_server_opens_only_the_gpus_it_leases_and_follows_its_leases(tmp_path):
    nodes = make_nodes(tmp_path / "dev", 3)
    pool = [{"node": "n1", "model": "L4", "count": 3, "memory_mib": 23034, "devices": nodes}]
    parent = f"jupyter-gpulease-test-{secrets.token_hex(4)}"
    root = os.path.join(_v1_root(), parent)
    hub, broker_url, sim = make_hub(tmp_path, pool, parent)
    node_of = dict(zip(sim.uuids, nodes, strict=True))
    left_out, left_stop = tmp_path / "leftover.json", tmp_path / "leftover.stop"
    try:
        assert "GPU device access follows the lease (required): cgroup v1 devices controller" in hub.log_tail(400)
        alice, bob = hub.create_token("alice"), hub.create_token("bob")
        assert hub.api("POST", "users/alice/server", {"gpus": 1})[0] in (201, 202)
        assert hub.api("POST", "users/bob/server", {"gpus": 1})[0] in (201, 202)
        wait_for(lambda: server_ready(hub, "alice") and server_ready(hub, "bob"), 180, "the servers did not start")

        def live(user, token):
            code, body = hub.request("GET", broker_url + f"api/leases?user={user}", token=token)
            assert code == 200, body
            return [x for x in body["leases"] if x["state"] == "active"]

        (a_lease,), (b_lease,) = live("alice", alice), live("bob", bob)
        mine, bobs = a_lease["placement"]["slices"][0]["gpu_uuid"], b_lease["placement"]["slices"][0]["gpu_uuid"]
        free = next(u for u in sim.uuids if u not in (mine, bobs))
        # each server's process sits in a cgroup of its own under the hub's parent
        for user in ("alice", "bob"):
            with open(os.path.join(root, user, "cgroup.procs")) as f:
                assert f.read().split(), f"no process in {user}'s cgroup"

        code, kernel = hub.request("POST", f"{hub.url}/user/alice/api/kernels", {"name": "python3"}, token=alice)
        assert code == 201, kernel
        probe = Prober(hub, "alice", alice, kernel["id"], nodes, tmp_path)
        seen = probe()
        # her GPU's open reaches the driver (none here: ENXIO); bob's and the free one are denied
        assert seen == {node_of[mine]: "ENXIO", node_of[bobs]: "EPERM", node_of[free]: "EPERM"}, seen

        # her lease ends (she releases it): a new open of her former GPU is denied, her server runs on
        code, body = hub.request("POST", broker_url + f"api/leases/{a_lease['id']}/release", {"reason": "done with it"}, token=alice)
        assert code == 200, body
        seen = wait_for(lambda: (s := probe())[node_of[mine]] == "EPERM" and s, 60, "her former GPU was not denied")
        assert seen == dict.fromkeys(nodes, "EPERM"), seen
        assert server_ready(hub, "alice")

        # she takes a lease from inside her server, onto the free GPU: that one opens
        wait_for(lambda: hub.request("GET", f"{hub.url}/user/alice/gpulease/api/status", token=alice)[1]["lease"] is None,
                 60, "her server did not see its lease end")
        code, body = hub.request("POST", f"{hub.url}/user/alice/gpulease/api/lease", {"gpus": 1, "require_gpus": [free]}, token=alice)
        assert code == 201, body
        seen = wait_for(lambda: (s := probe())[node_of[free]] == "ENXIO" and s, 60, "the GPU she took was not allowed")
        assert seen == {node_of[mine]: "EPERM", node_of[bobs]: "EPERM", node_of[free]: "ENXIO"}, seen

        # a process of her server that outlives it keeps her cgroup: from the stop on it opens no GPU,
        # not even the one her server took itself
        start_leftover(hub, "alice", alice, kernel["id"], nodes, left_out, left_stop)
        wait_for(lambda: read_json(left_out).get(node_of[free]) == "ENXIO", 60, "the leftover process did not start")

        # stopped servers: every GPU denied in their cgroups, which go once nothing of them is left
        for user in ("alice", "bob"):
            assert hub.api("DELETE", f"users/{user}/server")[0] in (202, 204)
        wait_for(lambda: not server_ready(hub, "alice") and not server_ready(hub, "bob"), 60, "the servers did not stop")
        seen = wait_for(lambda: (s := read_json(left_out)).get(node_of[free]) == "EPERM" and s, 30,
                        "the stopped server's cgroup still allows the GPU it took")
        assert seen == dict.fromkeys(nodes, "EPERM"), seen
        assert os.path.isdir(os.path.join(root, "alice")), "the cgroup went while a process of the server lived on"
        left_stop.touch()  # the leftover ends: the cgroup can go
        wait_for(lambda: not os.path.exists(os.path.join(root, "alice")) and not os.path.exists(os.path.join(root, "bob")),
                 30, "the servers' cgroups were not removed")
    finally:
        left_stop.touch()
        for user in ("alice", "bob"):
            if server_ready(hub, user):
                hub.api("DELETE", f"users/{user}/server")
        hub.stop()
        for name in ("alice", "bob", ""):
            path = os.path.join(root, name)
            if os.path.isdir(path):
                try:
                    os.rmdir(path)
                except OSError:
                    pass
