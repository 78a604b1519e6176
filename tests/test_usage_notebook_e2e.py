"""Usage down to the notebook, end to end: a real JupyterHub with configurable-http-proxy, the
broker as a managed service on a one-GPU simulated pool, and alice's real single-user server
with the server extension and real kernels, reached through the proxy.

alice's server holds one lease. Two notebooks run in it (sessions made through the server's REST
API, with their paths): busy.ipynb computes on the simulated GPU (``use_gpu`` at 90 %), idle.ipynb
holds GPU memory and computes nothing. The broker's usage report (``GET api/usage?by=notebook``)
then counts busy and idle GPU-seconds against each notebook: busy.ipynb busy, idle.ipynb idle.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from hubharness import wait_for
from leasehub import ONE_L4, LeaseHub
from serverutil import SimGPUs

pytestmark = pytest.mark.timeout(600)

BUSY_S = 24  # how long busy.ipynb computes


def make_hub(tmp: Path) -> tuple[LeaseHub, SimGPUs]:
    """(hub, the simulated GPUs): one L4; servers sample every 0.25 s, send heartbeats every
    second and never reclaim an idle GPU while the test looks."""
    sim = SimGPUs(str(tmp / "sim-gpus.json"), ONE_L4)
    hub = LeaseHub(
        tmp,
        users=["alice"],
        server_devices=sim.config,
        server_config=[
            "c.GPULeaseExtension.sample_interval = 0.25",
            "c.GPULeaseExtension.heartbeat_interval = 1",
            "c.GPUIdleRule.gpu_idle_timeout = 3600",
        ],
        broker_config=["c.GPULeaseBroker.heartbeat_timeout_s = 60"],
        hub_config=["c.GPULeaseSpawner.lease_wait_timeout = 120", "c.Spawner.default_url = '/tree'"],
    )
    return hub.start(), sim


def notebook_rows(report: dict) -> dict[str, dict]:
    """The report's rows by the notebook's file name."""
    return {Path(str(r["key"])).name: r for r in report["rows"] if r.get("key")}


def test_a_busy_and_an_idle_kernel_in_one_lease_count_as_busy_and_idle_gpu_seconds_of_their_notebooks(tmp_path):
    hub, sim = make_hub(tmp_path)
    try:
        alice = hub.create_token("alice")
        assert hub.spawn("alice", {"gpus": 1})[0] in (201, 202)
        wait_for(lambda: hub.ready_server("alice"), 120, "alice's server did not start")

        def lease():
            code, st = hub.gpu_api("alice", alice)
            return st["lease"] if code == 200 and st.get("lease") and st["lease"]["state"] == "active" else None

        lease_id = wait_for(lease, 60, "alice's server reports its lease")["id"]
        # two notebooks, each with its own kernel, made as JupyterLab makes them: a session with the notebook's path
        kernels = {Path(path).name: hub.start_session("alice", alice, path) for path in ("work/busy.ipynb", "work/idle.ipynb")}

        def on_gpu(n):
            sim.prune()
            return len(sim.processes()) >= n

        hub.run_cell("alice", alice, kernels["idle.ipynb"], "from jupyter_gpulease.sim.gpu import use_gpu; use_gpu(util=0, memory_gb=2, seconds=0)")
        hub.run_cell("alice", alice, kernels["busy.ipynb"],
                     f"from jupyter_gpulease.sim.gpu import use_gpu; use_gpu(util=90, memory_gb=4, seconds={BUSY_S})")
        wait_for(lambda: on_gpu(2), 60, "both kernels hold memory on the simulated GPU")

        def execution_state(name):
            code, k = hub.request("GET", hub.user_url("alice", f"api/kernels/{kernels[name]}"), token=alice)
            return k.get("execution_state") if code == 200 else None

        # the busy cell runs its course, then a few heartbeats carry the last of it
        wait_for(lambda: execution_state("busy.ipynb") == "busy", 30, "busy.ipynb's cell did not start")
        wait_for(lambda: execution_state("busy.ipynb") == "idle", BUSY_S + 60, "busy.ipynb's cell did not end", interval=0.5)
        time.sleep(4)

        # the lease ends with the server: its record is complete
        assert hub.api("DELETE", "users/alice/server")[0] in (202, 204)
        wait_for(lambda: hub.lease(lease_id)["state"] != "active", 60, "alice's lease did not end with her server")

        code, report = hub.broker_get("api/usage?since=1d&by=notebook&format=json", token=alice)
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
        code, lease_report = hub.broker_get("api/usage?since=1d&by=user", token=alice)
        assert code == 200 and [r["key"] for r in lease_report["rows"]] == ["alice"], lease_report
        whole = lease_report["rows"][0]
        assert whole["leases"] == 1 and BUSY_S * 0.8 <= whole["busy_gpu_h"] * 3600 <= BUSY_S + 3, whole
        assert whole["held_gpu_h"] * 3600 >= max(busy_held_s, idle_held_s), whole
        # alice sees only her own rows; another user's are refused
        assert all(r.get("key") for r in report["rows"])
        code, refused = hub.broker_get("api/usage?since=1d&by=notebook&user=bob", token=alice)
        assert code == 403, refused
    finally:
        hub.close()
