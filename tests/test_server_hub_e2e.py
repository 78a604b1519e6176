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

from pathlib import Path

import pytest

import standin_cuda_checkpoint as standin
from hubharness import wait_for
from leasehub import ONE_L4, LeaseHub
from serverutil import SimGPUs

pytestmark = pytest.mark.timeout(600)


def make_hub(tmp: Path) -> tuple[LeaseHub, SimGPUs, str]:
    """(hub, the simulated GPUs, the stand-in's folder): one L4; servers sample fast, and reclaim a
    GPU idle for 15 s (warned 5 s before) by suspending its kernels with the stand-in cuda-checkpoint."""
    sim = SimGPUs(str(tmp / "sim-gpus.json"), ONE_L4)
    standin_dir = tmp / "standin"
    standin_dir.mkdir()
    checkpoint = standin.install(str(standin_dir))
    hub = LeaseHub(
        tmp,
        server_devices=sim.config,
        server_config=[
            "c.GPULeaseExtension.sample_interval = 0.25",
            "c.GPUIdleRule.gpu_idle_timeout = 15",
            "c.ReclaimActions.warn_before = 5",
            "c.GPULeaseExtension.heartbeat_interval = 2",
            f"c.GPULeaseExtension.cuda_checkpoint = {checkpoint!r}",
        ],
        server_env={"STANDIN_CUDA_CHECKPOINT_DIR": str(standin_dir), "STANDIN_CUDA_CHECKPOINT_SIM_STATE": sim.state_file},
        broker_config=["c.GPULeaseBroker.heartbeat_timeout_s = 60"],
        hub_config=[
            "c.GPULeaseSpawner.lease_wait_timeout = 300",
            # a lease the server gave back itself (reclaimed) must not stop it
            "c.GPULeaseSpawner.on_lease_end = 'keep'",
            "c.Spawner.default_url = '/tree'",
        ],
    )
    return hub.start(), sim, str(standin_dir)


def test_an_idle_kernel_is_suspended_its_lease_goes_to_the_next_user_and_its_next_cell_resumes_it(tmp_path):
    hub, sim, standin_dir = make_hub(tmp_path)
    try:
        alice, bob = hub.create_token("alice"), hub.create_token("bob")
        assert hub.spawn("alice", {"gpus": 1})[0] in (201, 202)
        wait_for(lambda: hub.ready_server("alice"), 120, "alice's server did not start")

        # the extension runs in her server (enabled by the installed config file) and knows the lease
        def status_with_lease():
            code, st = hub.gpu_api("alice", alice)
            return st if code == 200 and st["lease"] and st["lease"]["state"] == "active" else None

        st = wait_for(status_with_lease, 60, "alice's server reports its lease")
        lease = st["lease"]
        assert st["lease_origin"] == "spawner" and st["devices"][0]["uuid"] == sim.uuids[0]
        # bob's token does not open alice's GPU API (nor change her lease)
        assert hub.gpu_api("alice", bob)[0] == 403
        assert hub.gpu_api("alice", bob, "lease/release", "POST", {})[0] == 403

        # alice starts a kernel that takes GPU memory and then sits idle
        kernel = hub.start_kernel("alice", alice)

        def kernel_pid():
            _, s = hub.gpu_api("alice", alice)
            k = next((k for k in s["kernels"] if k["id"] == kernel), None)
            return k and k["pid"]

        pid = wait_for(kernel_pid, 60, "the extension sees alice's kernel")
        sim.run(pid, 6000, sm=0.0)

        # bob asks for the only GPU and waits
        assert hub.spawn("bob", {"gpus": 1})[0] in (201, 202)
        wait_for(lambda: [x for x in hub.broker_get("api/leases?user=bob")[1]["leases"] if x["state"] == "queued"],
                 60, "bob's lease is queued")

        def lease_state(lease_id):
            return hub.broker_get(f"api/leases/{lease_id}")[1]["state"]

        wait_for(lambda: lease_state(lease["id"]) == "reclaimed", 90, "alice's lease was not reclaimed")
        assert [c["action"] for c in standin.calls(standin_dir) if c["pid"] == pid] == ["lock", "checkpoint"]
        wait_for(lambda: hub.ready_server("bob"), 120, "bob's server did not start on the freed GPU")
        # her server keeps running without a GPU, and says what happened
        assert hub.ready_server("alice")
        _, st = hub.gpu_api("alice", alice)
        assert st["lease"] is None and st["last_lease"]["state"] == "reclaimed"
        ks = next(k for k in st["kernels"] if k["id"] == kernel)
        assert ks["state"] == "suspended" and ks["suspended"]["memory_mib"] == 6000

        # her next cell: the kernel waits for a GPU (bob has it) with its place in the queue ...
        hub.run_cell("alice", alice, kernel, "import time; time.sleep(120)")

        def waiting():
            _, s = hub.gpu_api("alice", alice)
            return s if s["resume"] and s["resume"]["stage"] == "waiting" and s["resume"].get("position") else None

        st = wait_for(waiting, 60, "alice's resume waits in the queue")
        assert st["resume"]["position"] == 1 and st["lease"]["state"] == "queued"
        # ... and gets it when bob stops
        assert hub.api("DELETE", "users/bob/server")[0] in (202, 204)

        def resumed():
            _, s = hub.gpu_api("alice", alice)
            k = next(k for k in s["kernels"] if k["id"] == kernel)
            return s if k["state"] == "ok" and s["lease"] and s["lease"]["state"] == "active" else None

        st = wait_for(resumed, 90, "alice's kernel got its GPU back")
        assert st["lease"]["id"] != lease["id"] and st["lease_origin"] == "server"
        assert lease_state(st["lease"]["id"]) == "active"
        assert sim.processes()[pid] == (sim.uuids[0], 6000)  # the same process, its memory back on the GPU
        assert [c["action"] for c in standin.calls(standin_dir) if c["pid"] == pid] == ["lock", "checkpoint", "restore", "unlock"]
    finally:
        hub.close()
