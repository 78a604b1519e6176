"""Idle reclaim in a real Jupyter server: real ipykernel kernels, simulated GPUs, a real broker.

Each test starts a server (pytest-jupyter) whose extension holds a lease from a broker running
in its own thread (fake hub auth: the token names the user), drives the simulated GPU figures of
the kernels' real process IDs through the backend's state file, and watches what a user would:
the status, the live feed, the kernels, and the lease at the broker. ``cuda-checkpoint`` is a
stand-in written for the tests (standin_cuda_checkpoint.py).

These are plain ``async def`` tests: pytest-jupyter runs them on the server's event loop.
"""

from __future__ import annotations

import json
import time

import pytest
from tornado.httpclient import HTTPClientError

import standin_cuda_checkpoint as standin
from brokerutil import broker_url
from serverutil import (
    IDLE_TIMEOUT,
    WARN_BEFORE,
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


# ---------------------------------------------------------------------- warned, then reclaimed, by each action
@pytest.mark.parametrize("ext_config", [{"reclaim_action": a} for a in ("suspend", "restart", "shutdown", "interrupt", "notify")],
                         indirect=True, ids=lambda c: c["reclaim_action"])
async def test_an_idle_kernel_holding_gpu_memory_is_warned_then_reclaimed(server, jp_fetch, sim, broker, lease, checkpoint_dir, ext_config):
    action = ext_config["reclaim_action"]
    await active_lease(jp_fetch)
    k = await start_kernel(server, jp_fetch)
    pid = k.pid
    sim.run(pid, 4096, sm=0.0)  # holds 4 GiB, computes nothing

    reclaimed = await wait_for(lambda: [e for e in feed_events(server, "reclaim") if e["kernel_id"] == k.id], sim=sim,
                               message=f"the kernel is reclaimed by {action}")
    warnings = [e for e in feed_events(server, "warning") if e.get("kernel_id") == k.id]
    assert warnings and warnings[0]["kind"] == "reclaim" and warnings[0]["id"] < reclaimed[0]["id"], "a warning comes first"
    assert warnings[0]["deadline"] - warnings[0]["time"] == pytest.approx(WARN_BEFORE, abs=0.6)
    assert reclaimed[-1]["action"] == action and reclaimed[-1]["outcome"] == "done", reclaimed

    if action == "notify":
        # only told: the kernel keeps its memory, so the lease stays
        st = await status(jp_fetch)
        assert kernel_status(st, k.id)["state"] == "reclaimed" and "holds GPU memory while idle" in reclaimed[-1]["message"]
        assert sim.processes()[pid][1] == 4096 and st["lease"]["state"] == "active"
        assert await lease_state(broker, lease["id"]) == "active"
        return
    if action == "interrupt":
        assert k.id in server.kernel_manager.list_kernel_ids() and k.pid == pid
        assert await lease_state(broker, lease["id"]) == "active"
        return
    if action == "suspend":
        calls = [(c["action"], c["pid"]) for c in standin.calls(checkpoint_dir)]
        assert calls[:2] == [("lock", pid), ("checkpoint", pid)]
        assert pid not in sim.processes()  # its GPU memory is in host memory now
        assert k.pid == pid  # the same process: nothing lost
        st = await status(jp_fetch)
        assert kernel_status(st, k.id)["state"] == "suspended"
        assert kernel_status(st, k.id)["suspended"]["memory_mib"] == 4096
    if action == "restart":
        await wait_for(lambda: k.pid != pid, message="the kernel has a new process")
    if action == "shutdown":
        await wait_for(lambda: k.id not in server.kernel_manager.list_kernel_ids(), message="the kernel is gone")
    # nothing holds GPU memory any more: the lease goes back to the pool as reclaimed
    assert await wait_for(lambda: _is(lease_state(broker, lease["id"]), "reclaimed"), sim=sim, message="the lease is reclaimed at the broker")

    async def server_knows():
        st = await status(jp_fetch)
        return st if st["lease"] is None else None

    st = await wait_for(server_knows, message="the server knows its lease went back")
    assert st["last_lease"]["state"] == "reclaimed" and st["last_lease"]["id"] == lease["id"]
    assert st["kernel_env"]["cuda_visible_devices"] == ""  # kernels started now get no GPU
    assert server.web_app.settings["gpulease_controller"] is not None  # the server keeps running


async def test_a_busy_kernel_is_not_reclaimed(server, jp_fetch, sim, broker, lease):
    await active_lease(jp_fetch)
    k = await start_kernel(server, jp_fetch)
    sim.run(k.pid, 4096, sm=85.0)
    sup = server.web_app.settings["gpulease_controller"]
    start = sup.monitor.samples
    await wait_for(lambda: sup.monitor.samples >= start + int(3 * (IDLE_TIMEOUT + WARN_BEFORE) / 0.25), timeout=60,
                   message="three idle timeouts' worth of samples")
    assert not feed_events(server, "warning") and not feed_events(server, "reclaim")
    assert await lease_state(broker, lease["id"]) == "active"
    st = await status(jp_fetch)
    ks = kernel_status(st, k.id)
    assert ks["state"] == "ok" and ks["idle"]["gpu_idle"] is False and ks["gpu"]["sm_util_pct"] == 85.0
    assert ks["gpu"]["memory_mib"] == 4096 and ks["gpu"]["pids"] == [k.pid]
    # its GPU work counts as server activity for the hub and its culler
    assert "gpulease_last_activity" in server.web_app.settings
    assert server.web_app.last_activity() >= server.web_app.settings["gpulease_last_activity"]


async def test_a_kernel_running_a_cell_is_not_reclaimed_even_at_zero_utilization(server, jp_fetch, sim, broker, lease):
    await active_lease(jp_fetch)
    k = await start_kernel(server, jp_fetch)
    await k.execute("import time; time.sleep(8)")  # busy without output, without using the GPU
    sup = server.web_app.settings["gpulease_controller"]
    await wait_for(lambda: sup.kernels.get(k.id) and sup.kernels[k.id].executing, message="the kernel is executing")
    sim.run(k.pid, 2048, sm=0.0)
    start = sup.monitor.samples
    await wait_for(lambda: sup.monitor.samples >= start + int((IDLE_TIMEOUT + 1) / 0.25), message="samples past the timeout")
    assert not [e for e in feed_events(server, "reclaim") if e["kernel_id"] == k.id]
    k.close()


@pytest.mark.parametrize("ext_config", [{"gpu_idle_timeout": 6.0, "warn_before": 2.0}], indirect=True)
async def test_a_kernel_idle_for_less_than_the_timeout_is_not_reclaimed(server, jp_fetch, sim, broker, lease, ext_config):
    await active_lease(jp_fetch)
    k = await start_kernel(server, jp_fetch)
    sup = server.web_app.settings["gpulease_controller"]
    sim.run(k.pid, 4096, sm=0.0)
    await wait_for(lambda: sup.tracker.kernels.get(k.id) and sup.tracker.kernels[k.id].holds_gpu and sup.tracker.kernels[k.id].idle_since,
                   message="the kernel is seen idle, holding GPU memory")
    idle_since = sup.tracker.kernels[k.id].idle_since
    await wait_for(lambda: sup.clock() - idle_since >= 2.5, message="2.5 s of idleness")
    sim.run(k.pid, 4096, sm=60.0)  # computes again before the 6 s timeout
    await wait_for(lambda: sup.tracker.kernels[k.id].idle_since is None, message="the kernel is seen busy")
    sim.run(k.pid, 4096, sm=0.0)
    await wait_for(lambda: sup.tracker.kernels[k.id].idle_since, message="idle again")
    await wait_for(lambda: sup.clock() - sup.tracker.kernels[k.id].idle_since >= 2.5, message="2.5 s idle again")
    assert not feed_events(server, "reclaim") and not feed_events(server, "warning")
    assert (sup.idle.gaps and sup.idle.gaps[-1] >= 2.5 - 0.5) or not sup.idle.gaps  # a short gap is learnt only past MIN_GAP_S
    assert await lease_state(broker, lease["id"]) == "active"


# ---------------------------------------------------------------------- keep
@pytest.mark.parametrize("ext_config", [{"gpu_idle_timeout": 3.0, "warn_before": 1.0, "max_keep": 4.0, "reclaim_action": "restart"}],
                         indirect=True)
async def test_keep_postpones_reclaim_but_not_beyond_max_keep(server, jp_fetch, sim, broker, lease, ext_config):
    await active_lease(jp_fetch)
    k = await start_kernel(server, jp_fetch)
    sup = server.web_app.settings["gpulease_controller"]
    with pytest.raises(HTTPClientError) as err:
        await jp_fetch("gpulease", "api", "keep", method="POST", body=json.dumps({"for_s": 3600}))
    assert err.value.code == 400
    assert json.loads(err.value.response.body)["message"] == "a keep of 1 h is longer than this server allows: it keeps an idle GPU for at most 4 s"
    for bad in ({}, {"for_s": "an hour"}, {"for_s": -5}, {"until": 5}):
        with pytest.raises(HTTPClientError) as err:
            await jp_fetch("gpulease", "api", "keep", method="POST", body=json.dumps(bad))
        assert err.value.code == 400, bad

    sim.run(k.pid, 4096, sm=0.0)
    await wait_for(lambda: sup.tracker.kernels.get(k.id) and sup.tracker.kernels[k.id].holds_gpu and sup.tracker.kernels[k.id].idle_since,
                   message="idle, holding GPU memory")
    idle_since = sup.tracker.kernels[k.id].idle_since
    r = await jp_fetch("gpulease", "api", "keep", method="POST", body=json.dumps({"for_s": 4.0}))
    keep_until = json.loads(r.body)["keep_until"]
    st = await status(jp_fetch)
    deadline = kernel_status(st, k.id)["idle"]["reclaim_at"]
    assert deadline == pytest.approx(min(keep_until, idle_since + 3.0 + 4.0), abs=0.01)
    assert deadline > idle_since + 3.0  # later than without keep
    # and it still comes, at the kept deadline, not at the first one
    pid = k.pid
    ev = await wait_for(lambda: [e for e in feed_events(server, "reclaim") if e["kernel_id"] == k.id], sim=sim, message="reclaimed")
    assert ev[0]["time"] >= deadline - 0.05
    await wait_for(lambda: k.pid != pid, message="restarted")


# ---------------------------------------------------------------------- the lease goes back; a queued user gets it
@pytest.mark.parametrize("ext_config", [{"reclaim_action": "shutdown"}], indirect=True)
async def test_the_reclaimed_lease_goes_back_to_the_broker_and_the_next_in_queue_is_granted(server, jp_fetch, sim, broker, lease, ext_config):
    url = broker_url(broker)
    _, other = await broker_call_async(url, "POST", "api/leases", {"gpus": 1}, token="carol")  # the pool's second GPU
    _, bob = await broker_call_async(url, "POST", "api/leases", {"gpus": 1}, token="bob")
    assert other["state"] == "active" and bob["state"] == "queued"
    await active_lease(jp_fetch)
    k = await start_kernel(server, jp_fetch)
    sim.run(k.pid, 8000, sm=0.0)
    await wait_for(lambda: _is(lease_state(broker, lease["id"]), "reclaimed"), sim=sim, timeout=60, message="alice's lease reclaimed")
    _, bob_now = await broker_call_async(url, "GET", f"api/leases/{bob['id']}", token="bob")
    assert bob_now["state"] == "active"
    assert [s["gpu_uuid"] for s in bob_now["placement"]["slices"]] == [s["gpu_uuid"] for s in lease["placement"]["slices"]]
    _, ended = await broker_call_async(url, "GET", f"api/leases/{lease['id']}")
    assert ended["end_reason"].startswith("idle")
    lease_events = await wait_for(lambda: [e for e in feed_events(server, "lease") if e["event"] == "reclaimed"],
                                  message="the feed says the lease went back")
    assert "keeps running without a GPU" in lease_events[0]["message"]
    # a kernel started now gets no GPU
    k2 = await start_kernel(server, jp_fetch)
    reply = await k2.run("import os; print(repr(os.environ.get('CUDA_VISIBLE_DEVICES')))")
    assert reply["status"] == "ok"
    st = await status(jp_fetch)
    assert kernel_status(st, k2.id)["cuda_visible_devices"] in ("", None)
    k2.close()


@pytest.mark.parametrize("ext_config", [{"reclaim_action": "shutdown", "on_reclaim": "stop"}], indirect=True)
async def test_with_on_reclaim_stop_the_lease_goes_back_without_keep_server_and_the_server_stops(server, jp_fetch, sim, broker, lease, ext_config):
    sup = server.web_app.settings["gpulease_controller"]
    stops: list[float] = []
    sup.actions.stop_server = lambda: stops.append(time.time())  # the test's own server must keep serving
    await active_lease(jp_fetch)
    k = await start_kernel(server, jp_fetch)
    sim.run(k.pid, 8000, sm=0.0)
    await wait_for(lambda: _is(lease_state(broker, lease["id"]), "reclaimed"), sim=sim, timeout=60, message="the lease reclaimed")
    _, ended = await broker_call_async(broker_url(broker), "GET", f"api/leases/{lease['id']}")
    assert ended["keep_server"] is False  # so the spawner stops the server too
    [event] = await wait_for(lambda: [e for e in feed_events(server, "lease") if e["event"] == "reclaimed"], message="the feed says so")
    assert "The server stops now." in event["message"]
    await wait_for(lambda: stops, message="the server was asked to stop")


@pytest.mark.parametrize("ext_config", [{"gpu_idle_timeout": 5.0, "warn_before": 3.0, "reclaim_action": "restart"}], indirect=True)
async def test_a_warned_kernel_that_computes_again_keeps_its_gpu_and_the_warning_goes_away(server, jp_fetch, sim, lease, ext_config):
    await active_lease(jp_fetch)
    k = await start_kernel(server, jp_fetch)
    sim.run(k.pid, 4096, sm=0.0)

    async def warned():
        st = await status(jp_fetch)
        return [w for w in st["warnings"] if w["kind"] == "reclaim" and w["kernel_id"] == k.id]

    [w] = await wait_for(warned, sim=sim, message="the status shows the reclaim warning")
    assert "restarted" in w["message"] and w["action"] == "restart"
    sim.run(k.pid, 4096, sm=70.0)  # the user's cell computes again
    await wait_for(lambda: _not(warned()), sim=sim, message="the warning is gone from the status")
    sup = server.web_app.settings["gpulease_controller"]
    start = sup.monitor.samples
    await wait_for(lambda: sup.monitor.samples >= start + 20, message="5 s of samples past the old deadline")
    assert not [e for e in feed_events(server, "reclaim") if e["kernel_id"] == k.id]


async def _not(coro):
    return not await coro
