"""Usage down to the notebook, end to end: a real JupyterHub with configurable-http-proxy, the
broker as a managed service on a one-GPU simulated pool, and alice's real single-user server
with the server extension and real kernels, reached through the proxy.

alice's server holds one lease. Two notebooks run in it (sessions made through the server's REST
API, with their paths): busy.ipynb computes on the simulated GPU (``use_gpu`` at 90 %), idle.ipynb
holds GPU memory and computes nothing. The broker's usage report (``GET api/usage?by=notebook``)
then counts busy and idle GPU-seconds against each notebook: busy.ipynb busy, idle.ipynb idle.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import sys
import time
from pathlib import Path

import pytest

from hubharness import HubHarness, free_port, wait_for
from serverutil import SimGPUs
from test_server_hub_e2e import run_cell, server_ready

pytestmark = pytest.mark.timeout(600)

POOL = [{"node": "n1", "model": "L4", "count": 1, "memory_mib": 23034}]
BUSY_S = 24  # how long busy.ipynb computes


def make_hub(tmp: Path) -> tuple[HubHarness, str, str, SimGPUs]:
    """(hub, broker URL, spawner token, the simulated GPUs): servers sample every 0.25 s, send
    heartbeats every second and never reclaim an idle GPU while the test looks."""
    sim = SimGPUs(str(tmp / "sim-gpus.json"), POOL)
    conf_dir = tmp / "jupyter-config"
    conf_dir.mkdir()
    (conf_dir / "jupyter_server_config.py").write_text(
        "c = get_config()  # noqa\n"
        "c.GPULeaseExtension.sample_interval = 0.25\n"
        "c.GPULeaseExtension.heartbeat_interval = 1\n"
        "c.GPULeaseExtension.gpu_idle_timeout = 3600\n"
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
    }
    hub = HubHarness(
        tmp,
        users=["alice"],
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
            "c.GPULeaseSpawner.lease_wait_timeout = 120",
            "c.Spawner.server_token_scopes = ['users:activity!user', 'access:servers!server', 'access:services!service=gpulease']",
            f"c.Spawner.environment = {server_env!r}",
            "c.Spawner.default_url = '/tree'",
            "c.Spawner.poll_interval = 1",
            "c.Spawner.http_timeout = 60",
        ],
    )
    hub.start()
    return hub, broker_url, token, sim


def notebook_rows(report: dict) -> dict[str, dict]:
    """The report's rows by the notebook's file name."""
    return {Path(str(r["key"])).name: r for r in report["rows"] if r.get("key")}


def test_a_busy_and_an_idle_kernel_in_one_lease_count_as_busy_and_idle_gpu_seconds_of_their_notebooks(tmp_path):
    hub, broker_url, spawner_token, sim = make_hub(tmp_path)
    try:
        alice = hub.create_token("alice")
        assert hub.api("POST", "users/alice/server", {"gpus": 1})[0] in (201, 202)
        wait_for(lambda: server_ready(hub, "alice"), 120, "alice's server did not start")

        def lease():
            code, st = hub.request("GET", f"{hub.url}/user/alice/gpulease/api/status", token=alice)
            return st["lease"] if code == 200 and st.get("lease") and st["lease"]["state"] == "active" else None

        lease_id = wait_for(lease, 60, "alice's server reports its lease")["id"]
        # two notebooks, each with its own kernel, made as JupyterLab makes them: a session with the notebook's path
        kernels = {}
        for path in ("work/busy.ipynb", "work/idle.ipynb"):
            code, session = hub.request("POST", f"{hub.url}/user/alice/api/sessions",
                                        {"path": path, "name": Path(path).name, "type": "notebook", "kernel": {"name": "python3"}}, token=alice)
            assert code == 201, session
            kernels[Path(path).name] = session["kernel"]["id"]

        def on_gpu(n):
            sim.prune()
            return len(sim.processes()) >= n

        asyncio.run(run_cell(hub, "alice", alice, kernels["idle.ipynb"],
                             "from jupyter_gpulease.sim.gpu import use_gpu; use_gpu(util=0, memory_gb=2, seconds=0)"))
        asyncio.run(run_cell(hub, "alice", alice, kernels["busy.ipynb"],
                             f"from jupyter_gpulease.sim.gpu import use_gpu; use_gpu(util=90, memory_gb=4, seconds={BUSY_S})"))
        wait_for(lambda: on_gpu(2), 60, "both kernels hold memory on the simulated GPU")

        def execution_state(name):
            code, k = hub.request("GET", f"{hub.url}/user/alice/api/kernels/{kernels[name]}", token=alice)
            return k.get("execution_state") if code == 200 else None

        # the busy cell runs its course, then a few heartbeats carry the last of it
        wait_for(lambda: execution_state("busy.ipynb") == "busy", 30, "busy.ipynb's cell did not start")
        wait_for(lambda: execution_state("busy.ipynb") == "idle", BUSY_S + 60, "busy.ipynb's cell did not end", interval=0.5)
        time.sleep(4)

        # the lease ends with the server: its record is complete
        assert hub.api("DELETE", "users/alice/server")[0] in (202, 204)
        wait_for(lambda: hub.request("GET", broker_url + f"api/leases/{lease_id}", token=spawner_token)[1]["state"] != "active",
                 60, "alice's lease did not end with her server")

        code, report = hub.request("GET", broker_url + "api/usage?since=1d&by=notebook&format=json", token=alice)
        assert code == 200, report
        rows = notebook_rows(report)
        assert {"busy.ipynb", "idle.ipynb"} <= set(rows), report
        busy, idle = rows["busy.ipynb"], rows["idle.ipynb"]
        busy_s, busy_held_s = busy["busy_gpu_h"] * 3600, busy["held_gpu_h"] * 3600
        idle_busy_s, idle_held_s = idle["busy_gpu_h"] * 3600, idle["held_gpu_h"] * 3600
        # busy.ipynb computed for BUSY_S seconds at 90 % (busy as the idle rule counts it: the
        # samples over the threshold), idle.ipynb held its memory and never computed
        assert BUSY_S * 0.8 <= busy_s <= min(busy_held_s, BUSY_S + 3), busy
        assert idle_busy_s == 0, idle
        assert idle_held_s >= BUSY_S * 0.8 and idle["idle_gpu_h"] == idle["held_gpu_h"], idle
        # the lease as a whole: held for as long as the server ran, busy only while busy.ipynb computed
        code, lease_report = hub.request("GET", broker_url + "api/usage?since=1d&by=user", token=alice)
        assert code == 200 and [r["key"] for r in lease_report["rows"]] == ["alice"], lease_report
        whole = lease_report["rows"][0]
        assert whole["leases"] == 1 and BUSY_S * 0.8 <= whole["busy_gpu_h"] * 3600 <= BUSY_S + 3, whole
        assert whole["held_gpu_h"] * 3600 >= max(busy_held_s, idle_held_s), whole
        # alice sees only her own rows; another user's are refused
        assert all(r.get("key") for r in report["rows"])
        code, refused = hub.request("GET", broker_url + "api/usage?since=1d&by=notebook&user=bob", token=alice)
        assert code == 403, refused
    finally:
        if server_ready(hub, "alice"):
            hub.api("DELETE", "users/alice/server")
        hub.stop()
