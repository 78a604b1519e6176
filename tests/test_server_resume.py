"""Suspend and resume in a real Jupyter server, against a stand-in ``cuda-checkpoint``.

The stand-in (standin_cuda_checkpoint.py, written for these tests) takes the real tool's
command line, records each call, moves the process's simulated GPU memory out of the device on
checkpoint and back (onto the mapped device) on restore, and fails on request
(``STANDIN_CUDA_CHECKPOINT_FAIL``). The broker is real; the kernels are real ipykernel kernels.
"""

from __future__ import annotations

import json
import os
import re
import time

import pytest

import standin_cuda_checkpoint as standin
from brokerutil import broker_url
from jupyter_gpulease.kernel.resume import status_lines as resume_status_lines
from serverutil import (
    _is,
    active_lease,
    broker_call_async,
    feed_events,
    kernel_status,
    lease_state,
    start_kernel,
    status,
    wait_for,
)

pytest_plugins = ["serverutil"]  # its fixtures: server, sim, broker, lease, checkpoint_dir, ext_config


async def suspended(server, fetch, sim, broker, lease, checkpoint_dir, mib=6000):
    """A kernel holding ``mib`` MiB, suspended after its idle timeout, its lease returned."""
    await active_lease(fetch)
    k = await start_kernel(server, fetch)
    sim.run(k.pid, mib, sm=0.0)

    async def is_suspended():
        st = await status(fetch)
        ks = kernel_status(st, k.id)
        return ks and ks["state"] == "suspended"

    await wait_for(is_suspended, sim=sim, message="the kernel is suspended")
    await wait_for(lambda: _is(lease_state(broker, lease["id"]), "reclaimed"), sim=sim, message="the lease went back")
    return k


def resume_events(server, kid):
    return [e for e in feed_events(server, "resume") if e["kernel_id"] == kid]


async def test_a_suspended_kernel_that_starts_a_cell_gets_a_new_lease_and_is_restored(server, jp_fetch, sim, broker, lease, checkpoint_dir):
    k = await suspended(server, jp_fetch, sim, broker, lease, checkpoint_dir)
    pid = k.pid
    assert pid not in sim.processes()
    # the next cell: its CUDA calls would block until the GPU state is back
    await k.execute("import time; time.sleep(6)")
    done = await wait_for(lambda: [e for e in resume_events(server, k.id) if e["stage"] in ("done", "failed")], sim=sim, timeout=60,
                          message="the resume finished")
    assert done[-1]["stage"] == "done", done
    stages = [e["stage"] for e in resume_events(server, k.id)]
    assert stages[0] == "waiting" and "restoring" in stages
    st = await status(jp_fetch)
    new = st["lease"]
    assert new["state"] == "active" and new["id"] != lease["id"] and st["lease_origin"] == "server"
    assert new["request"] == lease["request"] and new["tier"] == lease["tier"]  # the same shape
    assert await lease_state(broker, new["id"]) == "active"
    # restored onto the GPU it had (free again): the same process holds its memory there again
    assert sim.processes()[pid] == (lease["placement"]["slices"][0]["gpu_uuid"], 6000)
    assert k.pid == pid and kernel_status(st, k.id)["state"] == "ok"
    actions = [c["action"] for c in standin.calls(checkpoint_dir) if c["pid"] == pid]
    assert actions == ["lock", "checkpoint", "restore", "unlock"]
    assert st["kernel_env"]["lease_id"] == new["id"]  # kernels started now get the new lease's GPU
    reply = await k.run("print('still here')")
    assert reply["status"] == "ok"
    k.close()


async def test_a_resuming_kernel_waits_in_the_queue_with_its_position_then_is_restored_on_another_gpu(
        server, jp_fetch, sim, broker, lease, checkpoint_dir):
    url = broker_url(broker)
    k = await suspended(server, jp_fetch, sim, broker, lease, checkpoint_dir)
    # both GPUs are taken now (alice's former one by bob)
    _, bob = await broker_call_async(url, "POST", "api/leases", {"gpus": 1}, token="bob")
    _, carol = await broker_call_async(url, "POST", "api/leases", {"gpus": 1}, token="carol")
    assert bob["state"] == carol["state"] == "active"
    await k.execute("import time; time.sleep(30)")
    waiting = await wait_for(lambda: [e for e in resume_events(server, k.id) if e["stage"] == "waiting" and e.get("position")],
                             timeout=60, message="the feed says where the kernel waits")
    assert waiting[-1]["position"] == 1 and "waits for a GPU" in waiting[-1]["message"]
    st = await status(jp_fetch)
    assert st["lease"]["state"] == "queued" and st["resume"]["stage"] == "waiting" and st["resume"]["position"] == 1
    ks = kernel_status(st, k.id)
    assert ks["state"] == "resuming" and ks["resume"]["position"] == 1 and not ks["env_stale"]
    assert f"resuming: kernel {k.id[:8]}: waiting for a GPU, number 1 in the queue" in "\n".join(resume_status_lines(st, st["now"]))
    # carol gives her GPU back: alice's kernel gets it and is restored there (the driver can remap)
    await broker_call_async(url, "POST", f"api/leases/{carol['id']}/release", {}, token="carol")
    done = await wait_for(lambda: [e for e in resume_events(server, k.id) if e["stage"] in ("done", "failed")], sim=sim, timeout=60,
                          message="the resume finished")
    assert done[-1]["stage"] == "done", done
    carol_gpu = carol["placement"]["slices"][0]["gpu_uuid"]
    assert sim.processes()[k.pid][0] == carol_gpu
    restore = [c for c in standin.calls(checkpoint_dir) if c["action"] == "restore"][-1]
    old_gpu = lease["placement"]["slices"][0]["gpu_uuid"]
    assert restore["argv"][-2:] == ["--device-map", f"{old_gpu}={carol_gpu}"]
    k.close()


async def test_a_failed_restore_restarts_the_kernel_and_tells_the_user(server, jp_fetch, sim, broker, lease, checkpoint_dir, monkeypatch):
    k = await suspended(server, jp_fetch, sim, broker, lease, checkpoint_dir)
    pid = k.pid
    monkeypatch.setenv("STANDIN_CUDA_CHECKPOINT_FAIL", "restore")
    await k.execute("import time; time.sleep(5)")
    failed = await wait_for(lambda: [e for e in resume_events(server, k.id) if e["stage"] == "failed"], sim=sim, timeout=60,
                            message="the resume failed")
    assert "could not get its GPU state back" in failed[0]["message"] and "restarted" in failed[0]["message"]
    assert "the stand-in was asked to fail" in failed[0]["message"]
    await wait_for(lambda: k.pid != pid, message="the kernel was restarted")
    st = await status(jp_fetch)
    assert kernel_status(st, k.id)["state"] == "ok" and "restarted" in kernel_status(st, k.id)["message"]


@pytest.mark.parametrize("ext_config", [{"fallback_action": "restart"}], indirect=True)
async def test_a_failed_checkpoint_leaves_the_kernel_running_and_falls_back_saying_why(
        server, jp_fetch, sim, broker, lease, checkpoint_dir, monkeypatch, ext_config):
    monkeypatch.setenv("STANDIN_CUDA_CHECKPOINT_FAIL", "checkpoint")
    await active_lease(jp_fetch)
    k = await start_kernel(server, jp_fetch)
    pid = k.pid
    sim.run(pid, 4096, sm=0.0)
    events = await wait_for(lambda: [e for e in feed_events(server, "reclaim") if e["kernel_id"] == k.id and e["outcome"] == "done"],
                            sim=sim, message="the fallback ran")
    reclaims = [e for e in feed_events(server, "reclaim") if e["kernel_id"] == k.id]
    assert reclaims[0]["action"] == "suspend" and reclaims[0]["outcome"] == "failed"
    assert "Suspending kernel" in reclaims[0]["message"] and "doing 'restart' instead" in reclaims[0]["message"]
    assert events[-1]["action"] == "restart"
    # what was locked was unlocked again before the fallback: nothing left half-suspended
    assert [c["action"] for c in standin.calls(checkpoint_dir) if c["pid"] == pid] == ["lock", "checkpoint", "unlock"]
    await wait_for(lambda: _is(lease_state(broker, lease["id"]), "reclaimed"), sim=sim, message="the lease went back")


@pytest.mark.parametrize("ext_config", [{"cuda_checkpoint": "no-such-cuda-checkpoint", "fallback_action": "shutdown"}], indirect=True)
async def test_without_cuda_checkpoint_the_fallback_runs_and_the_user_is_told_why(server, jp_fetch, sim, broker, lease, ext_config):
    await active_lease(jp_fetch)
    st = await status(jp_fetch)
    assert st["reclaim"]["suspend_available"] is False
    assert "cuda-checkpoint was not found" in st["reclaim"]["suspend_unavailable_reason"]
    k = await start_kernel(server, jp_fetch)
    sim.run(k.pid, 4096, sm=0.0)
    warned = await wait_for(lambda: [e for e in feed_events(server, "warning") if e.get("kernel_id") == k.id], sim=sim, message="warned")
    assert "shut down" in warned[0]["message"]  # the warning names what will really happen
    reclaims = await wait_for(lambda: [e for e in feed_events(server, "reclaim") if e["kernel_id"] == k.id and e["outcome"] == "done"],
                              sim=sim, message="reclaimed")
    first = next(e for e in feed_events(server, "reclaim") if e["kernel_id"] == k.id)
    assert first["outcome"] == "fallback" and "cannot be suspended (NVIDIA's cuda-checkpoint was not found" in first["message"]
    assert reclaims[-1]["action"] == "shutdown"
    await wait_for(lambda: k.id not in server.kernel_manager.list_kernel_ids(), message="the kernel was shut down")


TIERS = {
    "production": {"priority": 30, "max_duration_s": 3600, "default_duration_s": 3600},
    "experiment": {"priority": 20, "max_duration_s": 3600, "default_duration_s": 3600},
    "learning": {"priority": 10, "max_duration_s": 3600, "default_duration_s": 3600, "preemptible": True, "grace_s": 20},
}


@pytest.mark.parametrize("broker_traits", [{"tiers": TIERS, "default_tier": "experiment", "tick_interval": 0.5}], indirect=True)
@pytest.mark.parametrize("lease_request", [{"gpus": 1, "tier": "learning"}], indirect=True)
@pytest.mark.parametrize("ext_config", [{"gpu_idle_timeout": 0}], indirect=True)
async def test_before_a_preemption_ends_the_lease_the_kernels_holding_the_gpu_are_suspended(
        server, jp_fetch, sim, broker, lease, checkpoint_dir, broker_traits, lease_request, ext_config):
    url = broker_url(broker)
    await active_lease(jp_fetch)
    k = await start_kernel(server, jp_fetch)
    pid = k.pid
    sim.run(pid, 5000, sm=60.0)  # computing: no idle reclaim; a preemption is another matter
    await wait_for(lambda: kernel_status_holds(server, k.id), sim=sim, message="the kernel holds GPU memory")
    _, carol = await broker_call_async(url, "POST", "api/leases", {"gpus": 1}, token="carol")
    _, bob = await broker_call_async(url, "POST", "api/leases", {"gpus": 1, "tier": "production"}, token="bob")
    assert carol["state"] == "active" and bob["state"] == "queued"
    _, mine = await broker_call_async(url, "GET", f"api/leases/{lease['id']}")
    preempt_at = mine["preempt_at"]
    assert preempt_at, mine
    warned = await wait_for(lambda: [e for e in feed_events(server, "warning") if e["kind"] == "preemption"], message="warned")
    assert warned[0]["deadline"] == pytest.approx(preempt_at) and "nothing is lost" in warned[0]["message"]
    done = await wait_for(lambda: [e for e in feed_events(server, "reclaim") if e["kernel_id"] == k.id and e["action"] == "suspend"],
                          timeout=60, message="suspended before the end")
    assert done[0]["outcome"] == "done" and done[0]["time"] < preempt_at
    assert "preempted" in done[0]["message"]
    await wait_for(lambda: _is(lease_state(broker, lease["id"]), "preempted"), timeout=60, message="the lease is preempted")
    _, bob_now = await broker_call_async(url, "GET", f"api/leases/{bob['id']}", token="bob")
    assert bob_now["state"] == "active"

    async def ended():
        st = await status(jp_fetch)
        return st if st["lease"] is None else None

    st = await wait_for(ended, message="the server knows its lease ended")
    assert st["last_lease"]["state"] == "preempted" and kernel_status(st, k.id)["state"] == "suspended"
    assert k.pid == pid  # the kernel and its variables are still there, waiting for a GPU


def kernel_status_holds(server, kid):
    rec = server.web_app.settings["gpulease_controller"].kernels.get(kid)
    return rec is not None and rec.gpu is not None and rec.gpu.holds_memory


async def cell_output(k, code: str, timeout: float = 90) -> tuple[dict, str]:
    """Run a cell to its end: (execute_reply content, its stdout)."""
    msg_id = await k.execute(code)
    out = ""
    while True:
        msg = await k.client.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream":
            out += msg["content"]["text"]
        elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
    while True:
        reply = await k.client.get_shell_msg(timeout=timeout)
        if reply["parent_header"].get("msg_id") == msg_id:
            return reply["content"], out


async def test_a_short_cell_in_a_suspended_kernel_waits_for_the_resume_and_runs_with_its_variables(
        server, jp_fetch, sim, broker, lease, checkpoint_dir):
    await active_lease(jp_fetch)
    k = await start_kernel(server, jp_fetch)
    reply, _ = await cell_output(k, "x = 41")
    assert reply["status"] == "ok"
    sim.run(k.pid, 6000, sm=0.0)

    async def is_suspended():
        return (kernel_status(await status(jp_fetch), k.id) or {}).get("state") == "suspended"

    await wait_for(is_suspended, sim=sim, message="the kernel is suspended")
    marker = server.kernel_manager.get_kernel(k.id).connection_file[:-len(".json")] + ".gpulease-suspended"
    assert os.path.exists(marker)  # what tells the kernel's hook to wait
    # a cell far shorter than the server's settle time: it waits for the GPU, then runs
    reply, out = await cell_output(k, "print(x + 1)")
    assert reply["status"] == "ok", reply
    assert "GPU back after" in out and "restored with its variables" in out, out
    assert out.rstrip().endswith("42"), out
    assert [e["stage"] for e in resume_events(server, k.id)][-1] == "done"
    st = await status(jp_fetch)
    ks = kernel_status(st, k.id)
    assert ks["state"] == "ok" and ks["env_stale"] is False  # restored in place: nothing to restart
    assert not [n for n in st["notices"] if n["kind"] == "env_stale"]
    assert not os.path.exists(marker)
    # kept from now on (else it is idle again and suspended 2 s later): %gpu status says so, and when reclaim comes
    r = await jp_fetch("gpulease", "api", "keep", method="POST", body=json.dumps({"for_s": 600}))
    until = json.loads(r.body)["keep_until"]
    n = len(resume_events(server, k.id))
    reply, out = await cell_output(k, "%gpu status")
    assert f"kept: idle reclaim leaves this server's GPU alone until {time.strftime('%H:%M', time.localtime(until))}" in out, out
    # this kernel runs the cell: no deadline for it now, or (when the server has not yet seen the
    # kernel busy, on a loaded machine) the deadline after the keep
    assert ("idle reclaim: after 2 s without GPU use" in out
            or re.search(rf"idle reclaim: kernel {k.id[:8]} \(this kernel\) is suspended \(nothing is lost\) at \d\d:\d\d", out)), out

    async def deadline_said():
        st = await status(jp_fetch)
        return "\n".join(resume_status_lines(st, st["now"], k.id))

    said = await wait_for(lambda: _has(deadline_said(), "idle reclaim: kernel"), message="the idle kernel's deadline is said")
    assert re.search(rf"idle reclaim: kernel {k.id[:8]} \(this kernel\) is suspended \(nothing is lost\) at \d\d:\d\d", said), said
    # the heartbeats tell the broker when the lease goes back if it stays idle (its queue says "or sooner")
    sup = server.web_app.settings["gpulease_controller"]
    at = sup.usage.usage()["lease_reclaim_at"]
    assert at is not None and at >= until - 0.1  # (rounded to 0.1 s)
    assert "restart to see the new GPU" not in out and "resuming" not in out, out
    # not suspended now: the next cell runs at once and asks for nothing
    reply, out = await cell_output(k, "print('again')")
    assert out == "again\n" and len(resume_events(server, k.id)) == n
    k.close()


async def test_after_an_unused_lease_was_reclaimed_resume_asks_for_a_lease_of_the_same_shape(server, jp_fetch, sim, broker, lease):
    await active_lease(jp_fetch)
    await wait_for(lambda: _is(lease_state(broker, lease["id"]), "reclaimed"), sim=sim, message="the unused lease went back")
    r = await jp_fetch("gpulease", "api", "resume", method="POST", body="{}")
    body = json.loads(r.body)
    assert r.code == 201 and body["resuming"] == [] and body["lease"]["state"] == "active", body
    assert body["lease"]["request"] == lease["request"] and body["lease"]["id"] != lease["id"]
    # held now: a second resume has nothing to do
    r = await jp_fetch("gpulease", "api", "resume", method="POST", body="{}")
    assert r.code == 200 and json.loads(r.body) == {"resuming": [], "lease": None}


async def _has(coro, words):
    text = await coro
    return text if words in text else None
