"""The extension's REST API and live feed, lease changes, heartbeats and attribution, in a real
Jupyter server with real kernels, simulated GPUs and a real broker (see serverutil)."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging

import pytest
from tornado.httpclient import HTTPClientError

from brokerutil import broker_in_thread, broker_url
from jupyter_gpulease.broker.manager import SystemClock
from serverutil import (
    POOL,
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


async def sse(port: int, path: str, token: str, count: int, *, headers: dict | None = None, timeout: float = 30) -> list[dict]:
    """Read ``count`` events from a server-sent-events stream, as {"id", "event", "data"}."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: token {token}\r\nAccept: text/event-stream\r\n{extra}\r\n".encode())
    await writer.drain()
    events, current = [], {}
    try:
        head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)).decode()
        assert head.startswith("HTTP/1.1 200"), head
        assert "text/event-stream" in head
        while len(events) < count:
            line = (await asyncio.wait_for(reader.readline(), timeout)).decode().rstrip("\r\n")
            if line.endswith(("0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "a", "b", "c", "d", "e", "f")) and ":" not in line and " " not in line:
                continue  # a chunk-size line of the chunked encoding
            if not line:
                if current:
                    events.append(current)
                    current = {}
                continue
            key, _, value = line.partition(": ")
            if key == "data":
                current["data"] = json.loads(value)
            elif key in ("id", "event"):
                current[key] = value
    finally:
        writer.close()
    return events


# ---------------------------------------------------------------------- status and feed
async def test_status_shows_devices_with_figures_health_and_history_and_kernels_with_their_gpu_use(server, jp_fetch, sim, lease):
    await active_lease(jp_fetch)
    k = await start_kernel(server, jp_fetch)
    gpu = lease["placement"]["slices"][0]["gpu_uuid"]
    sim.run(k.pid, 3000, sm=40.0, uuid=gpu)
    sim.run(424242, 500, sm=0.0, uuid=gpu)  # someone else's process on a shared GPU
    sim.backend.set_device(gpu, temperature_c=71, power_w=55.5, health={"xid": 79, "xid_count": 1})

    async def seen():
        st = await status(jp_fetch, history="1")
        ks = kernel_status(st, k.id)
        return st if ks and ks["gpu"] and ks["gpu"]["memory_mib"] == 3000 and len(st["devices"][0]["history"]["t"]) >= 3 else None

    st = await wait_for(seen, message="the status shows the kernel's GPU use")
    assert st["message"] == "" and st["telemetry"]["available"] and st["telemetry"]["attribution"] == "process"
    [d] = st["devices"]  # only the leased GPU, not the pool's other one
    assert d["uuid"] == gpu and (d["temperature_c"], d["power_w"], d["power_limit_w"]) == (71.0, 55.5, 72.0)
    assert d["health"]["ok"] is False and "XID 79" in d["health"]["message"]
    assert {p["pid"]: p["kernel_id"] for p in d["processes"]} == {k.pid: k.id, 424242: None}
    assert d["history"]["memory_used_mib"][-1] == 3500
    ks = kernel_status(st, k.id)
    assert ks["gpu"] == {"pids": [k.pid], "devices": [gpu], "memory_mib": 3000, "sm_util_pct": 40.0}
    assert ks["history"]["memory_mib"][-1] == 3000 and ks["cuda_visible_devices"] == gpu and not ks["env_stale"]
    assert st["lease"]["devices"] == [gpu] and 0 < st["lease"]["time_left_s"] <= 3600
    assert st["reclaim"]["timeout_s"] == 2.0 and st["reclaim"]["suspend_available"]
    # a shorter window of history on request, none by default
    short = json.loads((await jp_fetch("gpulease", "api", "status", params={"seconds": "0.5"})).body)
    assert len(short["devices"][0]["history"]["t"]) <= 4
    assert "history" not in (await status(jp_fetch))["devices"][0]


async def test_the_live_feed_streams_status_then_events_and_replays_what_a_reconnecting_client_missed(
        server, jp_fetch, jp_http_port, jp_base_url, sim, lease):
    await active_lease(jp_fetch)
    token = server.identity_provider.token
    path = f"{jp_base_url}gpulease/api/feed"
    events = await sse(jp_http_port, path, token, 4)
    assert events[0]["event"] == "status" and events[0]["data"]["lease"]["id"] == lease["id"]
    assert {e["event"] for e in events[1:]} == {"sample"}
    assert all(int(b["id"]) > int(a["id"]) for a, b in itertools.pairwise(events[1:]))
    # a notice goes out while nobody listens; a client reconnecting with its last id gets it
    last = int(events[-1]["id"])
    r = await jp_fetch("gpulease", "api", "keep", method="POST", body=json.dumps({"for_s": 60}))
    assert json.loads(r.body)["keep_until"] > 0
    again = await sse(jp_http_port, path, token, 2, headers={"Last-Event-ID": str(last)})
    assert again[0]["event"] == "status"
    assert again[1]["event"] == "notice" and again[1]["data"]["kind"] == "keep" and "postponed" in again[1]["data"]["message"]


async def test_another_users_token_and_no_token_are_refused(server, jp_fetch):
    for headers in ({"Authorization": "token not-this-servers-token"}, {"Authorization": ""}):
        for path, method, body in ((("gpulease", "api", "status"), "GET", None), (("gpulease", "api", "lease"), "POST", "{}"),
                                   (("gpulease", "api", "feed"), "GET", None)):
            with pytest.raises(HTTPClientError) as err:
                await jp_fetch(*path, method=method, body=body, headers=dict(headers))
            assert err.value.code == 403, (path, headers)


@pytest.mark.parametrize("path, body, field, code", [
    (("lease",), "not json", "body", 400),
    (("lease",), "[1]", "body", 400),
    (("lease",), '{"gpus": 1, "user": "bob"}', "user", 400),
    (("lease",), '{"gpus": 1}', "lease", 409),  # already holds one
    (("lease", "extend"), "{}", "by_s", 400),
    (("lease", "extend"), '{"by_s": 60, "until": 5}', "by_s", 400),
    (("lease", "extend"), '{"by_s": NaN}', "body", 400),
    (("lease", "release"), '{"force": "yes"}', "force", 400),
    (("resume",), '{"kernel_id": "nope"}', "kernel_id", 404),
    (("keep",), '{"for_s": -60}', "for_s", 400),
    (("kernels", "nope", "devices"), '{"cuda_visible_devices": ""}', "kernel_id", 404),
])
async def test_bad_requests_get_a_clear_error_and_change_nothing(server, jp_fetch, broker, lease, path, body, field, code):
    await active_lease(jp_fetch)
    with pytest.raises(HTTPClientError) as err:
        await jp_fetch("gpulease", "api", *path, method="POST", body=body)
    assert err.value.code == code
    reply = json.loads(err.value.response.body)
    assert reply["field"] == field and reply["message"]
    assert await lease_state(broker, lease["id"]) == "active"


async def test_the_brokers_refusal_keeps_its_status_and_words(server, jp_fetch, lease):
    await active_lease(jp_fetch)
    with pytest.raises(HTTPClientError) as err:
        await jp_fetch("gpulease", "api", "lease", "extend", method="POST", body=json.dumps({"by_s": 10 * 24 * 3600}))
    reply = json.loads(err.value.response.body)
    assert err.value.code in (400, 409) and reply["message"] and "broker" not in reply["error"].lower()


# ---------------------------------------------------------------------- lease changes from the server
@pytest.mark.parametrize("ext_config", [{"gpu_idle_timeout": 0}], indirect=True)  # no idle reclaim in the way
async def test_release_and_request_from_the_server_change_what_new_kernels_get_and_running_ones_are_told(
        server, jp_fetch, sim, broker, lease, ext_config):
    await active_lease(jp_fetch)
    old = await start_kernel(server, jp_fetch)
    sim.run(old.pid, 1000, sm=50.0)
    await wait_for(lambda: kernel_status_sync(server, old.id, "holds"), message="the kernel holds GPU memory")
    # a kernel holds GPU memory: releasing needs force
    with pytest.raises(HTTPClientError) as err:
        await jp_fetch("gpulease", "api", "lease", "release", method="POST", body="{}")
    assert err.value.code == 409 and "still hold GPU memory" in json.loads(err.value.response.body)["message"]
    sim.stop(old.pid)
    await wait_for(lambda: not kernel_status_sync(server, old.id, "holds"), message="the memory is freed")
    r = await jp_fetch("gpulease", "api", "lease", "release", method="POST", body=json.dumps({"reason": "done for now"}))
    assert json.loads(r.body)["state"] == "released"
    assert await lease_state(broker, lease["id"]) == "released"
    st = await status(jp_fetch)
    assert st["lease"] is None and st["kernel_env"]["cuda_visible_devices"] == ""
    assert kernel_status(st, old.id)["env_stale"] is True  # it still names the GPU it started with
    notice = [e for e in feed_events(server, "notice") if e["kind"] == "env_stale"]
    assert notice and old.id in notice[-1]["kernel_ids"] and "keep the devices they started with" in notice[-1]["message"]
    standing = [n for n in st["notices"] if n["kind"] == "env_stale"]
    assert standing[0]["message"].startswith("New kernels get no GPU;") and standing[0]["kernel_ids"] == [old.id]
    cpu = await start_kernel(server, jp_fetch)
    assert (await cpu.run("import os; assert os.environ['CUDA_VISIBLE_DEVICES'] == ''"))["status"] == "ok"
    # the stale kernel goes: so does the notice (it said something no longer true)
    await jp_fetch("api", "kernels", old.id, method="DELETE")

    async def no_notice():
        return not [n for n in (await status(jp_fetch))["notices"] if n["kind"] == "env_stale"]

    await wait_for(no_notice, message="the env_stale notice is gone with the stale kernel")

    # ask for a GPU again: granted at once (201); kernels started now see it
    r = await jp_fetch("gpulease", "api", "lease", method="POST", body=json.dumps({"gpus": 1, "model": "L4", "duration_s": 600}))
    assert r.code == 201
    new = json.loads(r.body)
    assert new["state"] == "active" and new["id"] != lease["id"]
    assert (await lease_state(broker, new["id"])) == "active"
    fresh = await start_kernel(server, jp_fetch)
    reply = await fresh.run(f"import os; assert os.environ['CUDA_VISIBLE_DEVICES'] == {new['devices'][0]!r}; "
                            f"assert os.environ['GPULEASE_LEASE_ID'] == {new['id']!r}")
    assert reply["status"] == "ok", reply
    st = await status(jp_fetch)
    assert st["lease_origin"] == "server" and kernel_status(st, cpu.id)["env_stale"] is True
    standing = [n for n in st["notices"] if n["kind"] == "env_stale"]
    assert standing[0]["message"].startswith(f"New kernels get the GPU {new['devices'][0]};") and standing[0]["kernel_ids"] == [cpu.id]
    # extend it through the server
    r = await jp_fetch("gpulease", "api", "lease", "extend", method="POST", body=json.dumps({"by_s": 600}))
    assert json.loads(r.body)["expires_at"] > new["expires_at"]
    for k in (cpu, fresh):
        k.close()
    # the server stops: the lease it asked for itself goes back
    await server.extension_manager.stop_all_extensions()
    assert await lease_state(broker, new["id"]) == "released"


@pytest.mark.parametrize("ext_config", [{"gpu_idle_timeout": 0}], indirect=True)
async def test_a_kernel_says_which_devices_it_uses_now_and_a_keep_ends_with_zero(server, jp_fetch, sim, broker, lease, ext_config):
    await active_lease(jp_fetch)
    k = await start_kernel(server, jp_fetch)
    gpu = lease["placement"]["slices"][0]["gpu_uuid"]
    await wait_for(lambda: (kernel_status_sync_env(server, k.id) or "") == gpu, message="the kernel's devices are read")
    await jp_fetch("gpulease", "api", "lease", "release", method="POST", body=json.dumps({"force": True}))
    st = await status(jp_fetch)
    ks = kernel_status(st, k.id)
    assert ks["env_stale"] and ks["sight"] == "still sees a GPU this server no longer leases: restart it to drop it"
    # the kernel dropped the GPU itself (as %gpu release does where CUDA never started): the server follows it
    r = await jp_fetch("gpulease", "api", "kernels", k.id, "devices", method="POST", body=json.dumps({"cuda_visible_devices": ""}))
    assert json.loads(r.body) == {"kernel_id": k.id, "cuda_visible_devices": ""}
    ks = kernel_status(await status(jp_fetch), k.id)
    assert ks["cuda_visible_devices"] == "" and not ks["env_stale"] and ks["sight"] == ""
    with pytest.raises(HTTPClientError) as err:
        await jp_fetch("gpulease", "api", "kernels", k.id, "devices", method="POST", body=json.dumps({"cuda_visible_devices": 3}))
    assert err.value.code == 400 and json.loads(err.value.response.body)["field"] == "cuda_visible_devices"
    r = await jp_fetch("gpulease", "api", "keep", method="POST", body=json.dumps({"for_s": 0}))
    assert json.loads(r.body)["keep_until"] is None
    k.close()


def kernel_status_sync_env(server, kid):
    controller = server.web_app.settings["gpulease_controller"]
    rec = controller.kernels.get(kid)
    return controller.kernels.env_of(rec) if rec is not None else None


def kernel_status_sync(server, kid, what):
    rec = server.web_app.settings["gpulease_controller"].kernels.get(kid)
    return rec is not None and rec.gpu is not None and rec.gpu.holds_memory


@pytest.mark.parametrize("ext_config", [{"gpu_idle_timeout": 0}], indirect=True)
async def test_a_queued_request_reports_its_position_and_is_followed_until_granted(server, jp_fetch, broker, lease, ext_config):
    url = broker_url(broker)
    await active_lease(jp_fetch)
    await jp_fetch("gpulease", "api", "lease", "release", method="POST", body="{}")
    _, bob = await broker_call_async(url, "POST", "api/leases", {"gpus": 2}, token="bob")
    assert bob["state"] == "active"
    r = await jp_fetch("gpulease", "api", "lease", method="POST", body=json.dumps({"gpus": 1}))
    assert r.code == 202
    queued = json.loads(r.body)
    assert queued["state"] == "queued" and queued["queue"]["position"] == 1
    st = await status(jp_fetch)
    assert st["queue"]["position"] == 1 and "queued" in [e["event"] for e in feed_events(server, "lease")]
    await broker_call_async(url, "POST", f"api/leases/{bob['id']}/release", {}, token="bob")

    async def granted():
        st = await status(jp_fetch)
        return st["lease"] and st["lease"]["state"] == "active"

    await wait_for(granted, message="the queued lease is granted and the server knows")

    async def confirmed():  # the server confirms the grant (it is up) right after it hears of it
        _, got = await broker_call_async(url, "GET", f"api/leases/{queued['id']}")
        return got["state"] == "active" and got["confirmed_at"]

    await wait_for(confirmed, message="the server confirmed the granted lease")


# ---------------------------------------------------------------------- heartbeats
@pytest.mark.parametrize("ext_config", [{"gpu_idle_timeout": 0}], indirect=True)
async def test_heartbeats_carry_usage_and_survive_a_broker_restart(server, jp_fetch, sim, broker, lease, tmp_path, ext_config):
    await active_lease(jp_fetch)
    k = await start_kernel(server, jp_fetch)
    sim.run(k.pid, 2500, sm=70.0)
    url = broker_url(broker)

    async def usage_reached():
        _, got = await broker_call_async(url, "GET", f"api/leases/{lease['id']}")
        kernels = (got.get("usage") or {}).get("kernels") or {}
        return got if kernels.get(k.id, {}).get("mem_peak_mib") == 2500 else None

    got = await wait_for(usage_reached, sim=sim, message="a heartbeat carried the kernel's usage")
    usage = got["usage"]
    ku = usage["kernels"][k.id]  # keyed by the full kernel id, with its name and notebook path (none: no session)
    assert usage["gpu_busy"] is True and ku["busy_s"] > 0 and ku["name"] == "python3" and ku["path"] == ""
    assert usage["lease_reclaim_at"] is None  # it computes: no idle reclaim ahead
    gpu = lease["placement"]["slices"][0]["gpu_uuid"]
    assert usage["devices"][gpu]["mem_peak_mib"] >= 2500
    assert len(json.dumps(usage)) < 4096  # the broker's cap

    sup = server.web_app.settings["gpulease_controller"]
    port = broker.bind_url.rsplit(":", 1)[1]
    # the broker goes away: heartbeats fail and are retried; the server keeps its lease and runs on
    await asyncio.get_running_loop().run_in_executor(None, broker.test_stop)
    await wait_for(lambda: sup.keeper.heartbeat["failures"] >= 2, timeout=60, message="heartbeats fail while the broker is away")
    assert (await status(jp_fetch))["lease"]["state"] == "active"
    # it comes back (same database, same address): heartbeats go through again
    with broker_in_thread(tmp_path, pool=POOL, clock=SystemClock(), bind_url=f"http://127.0.0.1:{port}"):
        sent = sup.keeper.heartbeat["sent"]
        await wait_for(lambda: sup.keeper.heartbeat["failures"] == 0 and sup.keeper.heartbeat["sent"] > sent, timeout=60,
                       message="heartbeats reach the restarted broker")
        assert await lease_state_at(url, lease["id"]) == "active"
        st = await status(jp_fetch)
        assert st["heartbeat"]["last_error"] == "" and st["lease"]["id"] == lease["id"]
        await server.extension_manager.stop_all_extensions()


async def lease_state_at(url, lease_id):
    _, body = await broker_call_async(url, "GET", f"api/leases/{lease_id}")
    return body["state"]


# ---------------------------------------------------------------------- attribution
async def test_host_pids_that_the_server_cannot_see_fall_back_to_device_figures_and_say_so(server, jp_fetch, sim, lease, caplog):
    await active_lease(jp_fetch)
    k = await start_kernel(server, jp_fetch)
    gpu = lease["placement"]["slices"][0]["gpu_uuid"]
    sim.backend.add_process(gpu, 3_999_999, 5000, sm_util_pct=0.0)  # a PID of the host's namespace: nothing here has it

    async def device_mode():
        st = await status(jp_fetch)
        return st if st["telemetry"]["attribution"] == "device" else None

    log = server.web_app.settings["gpulease_controller"].log  # the server's log (it may not propagate to the root)
    log.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING):
            st = await wait_for(device_mode, message="the monitor falls back to device figures")
            await asyncio.sleep(1.0)
    finally:
        log.removeHandler(caplog.handler)
    assert "cannot see" in st["telemetry"]["attribution_message"]
    ks = kernel_status(st, k.id)
    assert ks["gpu"]["memory_mib"] is None and ks["gpu"]["sm_util_pct"] is None  # unknown, not 0
    assert [n for n in st["notices"] if n["kind"] == "attribution"]
    assert caplog.text.count("GPU figures are per device") == 1  # said once, not at every sample
    # the idle decision works from the device: idle device, idle kernel -> it is reclaimed
    await wait_for(lambda: [e for e in feed_events(server, "reclaim") if e["kernel_id"] == k.id], timeout=60,
                   message="the kernel is reclaimed on device figures")


@pytest.mark.parametrize("ext_config", [{"reclaim_action": "restart", "share_grace": 1.0, "gpu_idle_timeout": 0}], indirect=True)
@pytest.mark.parametrize("lease_request", [{"share": 0.25}], indirect=True)
async def test_a_process_over_its_shares_memory_is_warned_then_acted_on(server, jp_fetch, sim, lease, ext_config, lease_request):
    await active_lease(jp_fetch)
    cap = lease["placement"]["slices"][0]["memory_mib"]
    k = await start_kernel(server, jp_fetch)
    pid = k.pid
    sim.run(pid, cap + 1000, sm=90.0)  # busy, but over its memory
    warned = await wait_for(lambda: [e for e in feed_events(server, "warning") if e["kind"] == "share_memory"], sim=sim,
                            message="warned about the share's memory")
    assert f"over this server's share of {cap} MiB" in warned[0]["message"] and str(pid) in warned[0]["message"]
    done = await wait_for(lambda: [e for e in feed_events(server, "reclaim") if e["kernel_id"] == k.id], sim=sim, message="acted on")
    assert done[-1]["action"] == "restart" and "over the share" in done[-1]["message"]
    assert done[-1]["time"] - warned[0]["time"] >= 1.0 - 0.05
    await wait_for(lambda: k.pid != pid, message="restarted")


async def test_a_kernel_without_a_local_process_is_asked_for_its_pid(server, jp_fetch, lease):
    # what a remote provisioner gives the extension: no pid; ipykernel answers a usage_request with its own
    await active_lease(jp_fetch)
    k = await start_kernel(server, jp_fetch)
    sup = server.web_app.settings["gpulease_controller"]
    kernel = server.kernel_manager.get_kernel(k.id)
    rec = await wait_for(lambda: sup.kernels.get(k.id), message="the kernel is in the extension's table")
    assert await sup.kernels.ask_kernel_pid(rec, kernel) == k.pid
    assert rec.reported_pid == k.pid
