"""XID 79 end to end: a real Jupyter server with a real kernel computing on a simulated GPU, the
real broker (its own monitor samples the pool), the stand-in cuda-checkpoint.

Within one sample of the broker the GPU is cordoned and alice's lease is being moved; her
notebook is warned (kind ``gpu_unhealthy``), her kernel is suspended before the lease ends, and
its next cell resumes it first in the queue (ahead of bob, who waited before) on the healthy GPU.
"""

from __future__ import annotations

import pytest

import standin_cuda_checkpoint as standin
from brokerutil import broker_url
from serverutil import _is, active_lease, broker_call_async, feed_events, lease_state, start_kernel, status, wait_for
from test_server_resume import kernel_status_holds, resume_events

pytest_plugins = ["serverutil"]

TRAITS = {"tick_interval": 0.5, "device_sample_interval": 0.5, "health_drain_grace_s": 15, "health_settle_s": 5}


@pytest.mark.parametrize("broker_traits", [TRAITS], indirect=True)
@pytest.mark.parametrize("ext_config", [{"gpu_idle_timeout": 0}], indirect=True)
async def test_xid_79_moves_the_holder_suspended_and_first_in_the_queue_onto_the_healthy_gpu(
        server, jp_fetch, sim, broker, lease, checkpoint_dir, broker_traits, ext_config):
    url = broker_url(broker)
    await active_lease(jp_fetch)
    k = await start_kernel(server, jp_fetch)
    pid = k.pid
    sim.run(pid, 5000, sm=60.0)  # computing
    await wait_for(lambda: kernel_status_holds(server, k.id), sim=sim, message="the kernel holds GPU memory")
    sick = lease["placement"]["slices"][0]["gpu_uuid"]
    _, carol = await broker_call_async(url, "POST", "api/leases", {"gpus": 1}, token="carol")  # the other GPU
    assert carol["state"] == "active" and carol["placement"]["slices"][0]["gpu_uuid"] != sick
    broker.backend.inject_xid(sick, 79)  # the driver's report, seen by the broker's own monitor
    _, bob = await broker_call_async(url, "POST", "api/leases", {"gpus": 1}, token="bob")
    assert bob["state"] == "queued"  # the sick GPU is not granted

    async def cordoned():
        _, health = await broker_call_async(url, "GET", "api/health", token="alice")
        return [c for c in health["cordons"] if c["name"] == sick]

    [cordon] = await wait_for(cordoned, timeout=10, message="the GPU is cordoned")
    assert cordon["mode"] == "drain" and "XID 79" in cordon["reason"]
    warned = await wait_for(lambda: [e for e in feed_events(server, "warning") if e["kind"] == "gpu_unhealthy"], timeout=20,
                            message="the notebook is warned")
    assert "XID 79" in warned[0]["message"] and "moves to a healthy GPU" in warned[0]["message"]
    done = await wait_for(lambda: [e for e in feed_events(server, "reclaim") if e["kernel_id"] == k.id and e["action"] == "suspend"],
                          timeout=60, message="suspended before the lease moves")
    assert done[0]["outcome"] == "done"
    await wait_for(lambda: _is(lease_state(broker, lease["id"]), "revoked"), timeout=60, message="the lease moved off the GPU")
    _, ended = await broker_call_async(url, "GET", f"api/leases/{lease['id']}")
    assert ended["end_message"].startswith("Revoked by the broker: moved off its GPU") and "XID 79" in ended["end_message"]
    assert k.pid == pid  # the kernel and its variables are still there

    async def server_knows():
        st = await status(jp_fetch)
        return st if st["lease"] is None else None

    await wait_for(server_knows, message="the server knows its lease ended")
    # its next cell resumes it: first in the queue, ahead of bob
    await k.execute("import time; time.sleep(30)")
    waiting = await wait_for(lambda: [e for e in resume_events(server, k.id) if e["stage"] == "waiting" and e.get("position")],
                             timeout=60, message="the resume waits in the queue")
    assert waiting[-1]["position"] == 1
    _, again = await broker_call_async(url, "GET", f"api/leases/{waiting[-1]['lease_id']}")
    assert again["meta"]["moved"]["device"] == sick and again["queue"]["position"] == 1
    await broker_call_async(url, "POST", f"api/leases/{carol['id']}/release", {}, token="carol")
    done = await wait_for(lambda: [e for e in resume_events(server, k.id) if e["stage"] in ("done", "failed")], sim=sim, timeout=60,
                          message="the resume finished")
    assert done[-1]["stage"] == "done", done
    healthy = carol["placement"]["slices"][0]["gpu_uuid"]
    assert sim.processes()[k.pid][0] == healthy
    restore = [c for c in standin.calls(checkpoint_dir) if c["action"] == "restore"][-1]
    assert restore["argv"][-2:] == ["--device-map", f"{sick}={healthy}"]
    _, bob_now = await broker_call_async(url, "GET", f"api/leases/{bob['id']}", token="bob")
    assert bob_now["state"] == "queued"  # he waited before, but alice's kernel went first
    k.close()
