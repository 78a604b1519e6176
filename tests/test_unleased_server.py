"""Unleased GPU use end to end at unit cost: a real broker (its own thread, fake hub auth) on
simulated GPUs whose state file the test drives, bob's real Jupyter server with the extension and
no lease, and real processes: a ``sleep`` of bob's (another uid, bob's server's environment) put on
the GPU leased to alice, and one of alice's on her own GPU. Then the broker alone, its checks
called by hand: the heartbeat answer of a lease holder, the ``report`` policy and a stranger's
process, a process the broker may not signal.

Within one check bob's process is in the broker's feed, its API, its metrics and its admin page,
and bob's server shows the warning; after the grace (policy ``kill``) it is stopped with SIGTERM,
the events say so, the warning goes; alice's process and lease are untouched.
"""

from __future__ import annotations

import asyncio
import os
import pwd
import signal
import subprocess

import pytest

from brokerutil import broker_url, make_broker, patch_auth
from jupyter_gpulease.broker.manager import SystemClock
from jupyter_gpulease.broker.pages import render_admin_page
from jupyter_gpulease.client import BrokerClient
from serverutil import SimGPUs, broker_call, broker_call_async, status, wait_for

pytestmark = pytest.mark.timeout(120)
pytest_plugins = ["serverutil"]  # its fixtures: sim, broker, lease (alice's), checkpoint_dir

GRACE_S = 4.0


@pytest.fixture
def broker_traits(sim):
    return {"devices": sim.config, "unleased_check_interval": 0.25, "unleased_use": "kill", "unleased_grace_s": GRACE_S}


@pytest.fixture
def jp_server_config(broker, lease, sim, checkpoint_dir):
    """bob's server: the extension with the broker, holding no lease."""
    cfg = {"device_backend": "simulated", "device_config": sim.config, "broker_url": broker_url(broker), "broker_token": "bob",
           "sample_interval": 0.25, "heartbeat_interval": 0.5, "cuda_checkpoint": os.path.join(checkpoint_dir, "cuda-checkpoint"),
           "gaps_file": ""}
    return {"ServerApp": {"jpserver_extensions": {"jupyter_gpulease.server": True}}, "GPULeaseExtension": cfg}


@pytest.fixture
def bob_server(jp_serverapp, jp_asyncio_loop):
    jp_asyncio_loop.run_until_complete(jp_serverapp.extension_manager.start_all_extensions())
    return jp_serverapp


def sleeper(user: str, uid: int) -> subprocess.Popen:
    """A real process of ``user``'s server: its environment names the user; another uid where we may."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "JUPYTERHUB_USER": user, "JUPYTERHUB_SERVER_NAME": ""}
    preexec = (lambda: os.setuid(uid)) if os.getuid() == 0 else None
    return subprocess.Popen(["sleep", "300"], env=env, preexec_fn=preexec)  # noqa: PLW1509 - a plain setuid before exec


def events_of(url: str, kind: str) -> list[dict]:
    _, body = broker_call(url, "GET", "api/events?since=0&timeout=0", token="admin-carol")
    return [e for e in body["events"] if e["kind"] == kind]


async def test_bobs_process_on_alices_gpu_is_reported_warned_and_stopped_after_the_grace_alices_is_untouched(
        bob_server, broker, lease, sim, jp_fetch):
    url = broker_url(broker)
    alice_gpu = lease["placement"]["slices"][0]["gpu_uuid"]
    bob = sleeper("bob", 61234)
    alice = sleeper("alice", 61235)
    try:
        sim.backend.add_process(alice_gpu, alice.pid, 4096)
        sim.backend.add_process(alice_gpu, bob.pid, 2048)

        # the broker's feed: one unleased-use event, bob's, naming alice as the holder
        found = await wait_for(lambda: events_of(url, "unleased-use"), timeout=30, message="an unleased-use event in the broker's feed")
        assert len(found) == 1
        d = found[0]["data"]
        assert (d["user"], d["pid"], d["gpu_uuid"], d["used_memory_mib"], d["holders"]) == ("bob", bob.pid, alice_gpu, 2048, ["alice"])
        assert d["uid"] == (61234 if os.getuid() == 0 else os.getuid()) and d["command"] == "sleep" and d["stop_at"] == d["since"] + GRACE_S
        assert found[0]["lease_id"] == "" and "bob: process" in found[0]["reason"]

        # the API: an admin sees it, bob sees his own with his warning, alice sees nothing of bob's
        _, everyone = await broker_call_async(url, "GET", "api/unleased", token="admin-carol")
        assert [f["pid"] for f in everyone["findings"]] == [bob.pid] and everyone["action"] == "kill"
        _, mine = await broker_call_async(url, "GET", "api/unleased", token="bob")
        assert [w["kind"] for w in mine["warnings"]] == ["unleased_use"]
        assert [f["holders"] for f in mine["findings"]] == [["…"]] and [f["holders"] for f in everyone["findings"]] == [["alice"]]
        _, hers = await broker_call_async(url, "GET", "api/unleased", token="alice")
        assert hers["findings"] == [] and hers["warnings"] == []
        code, _ = await broker_call_async(url, "GET", "api/unleased?user=bob", token="alice")
        assert code == 403

        # the metrics and the admin page
        metrics = (await broker.metrics.render()).decode()
        assert sample(metrics, 'gpulease_unleased_processes{model="L4"}') == 1
        assert sample(metrics, 'gpulease_unleased_memory_bytes{model="L4"}') == 2048 * 1024 * 1024
        assert sample(metrics, 'gpulease_unleased_findings_total{model="L4",owner="hub_user"}') == 1
        page = render_admin_page(broker.manager, unleased=broker.unleased)
        row = page.split(f'<tr data-pid="{bob.pid}">', 1)[1].split("</tr>", 1)[0]
        assert "<td>bob</td>" in row and "L4 #" in row and "<td>alice</td>" in row and "2048 MiB" in row and "stopped in" in row

        # bob's notebook: his server (no lease, so no heartbeats) shows the broker's warning
        st = await wait_for(lambda: _unleased_warning(jp_fetch), timeout=30, message="the unleased-use warning in bob's server status")
        assert f"Process {bob.pid} (sleep) uses L4 #" in st["message"] and "another user's GPU" in st["message"]
        assert st["deadline"] == d["stop_at"]

        # after the grace: bob's process is stopped (SIGTERM), the feed says so; alice's runs on
        assert bob.wait(timeout=GRACE_S + 30) == -signal.SIGTERM
        stops = await wait_for(lambda: events_of(url, "unleased-stop"), timeout=30, message="an unleased-stop event")
        assert stops[0]["data"]["stop"]["outcome"] == "stopped" and stops[0]["data"]["pid"] == bob.pid
        assert [e["data"]["why"] for e in events_of(url, "unleased-ended")] == ["stopped"]
        assert alice.poll() is None
        _, live = await broker_call_async(url, "GET", f"api/leases/{lease['id']}")
        assert live["state"] == "active"
        await wait_for(lambda: _no_unleased_warning(jp_fetch), timeout=30, message="the warning gone from bob's server")
        metrics = (await broker.metrics.render()).decode()
        assert sample(metrics, 'gpulease_unleased_processes{model="L4"}') == 0
        assert sample(metrics, 'gpulease_unleased_stops_total{model="L4",outcome="stopped"}') == 1
        # alice's process on her own GPU was never a finding
        assert all(e["data"]["pid"] != alice.pid for e in events_of(url, "unleased-use"))
    finally:
        for p in (bob, alice):
            if p.poll() is None:
                p.kill()
            p.wait()


def sample(metrics: str, series: str) -> float | None:
    """The value of one series in Prometheus' text format."""
    for line in metrics.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return None


async def _unleased_warning(fetch):
    st = await status(fetch)
    return next((w for w in st["warnings"] if w["kind"] == "unleased_use"), None)


async def _no_unleased_warning(fetch):
    return await _unleased_warning(fetch) is None



# --------------------------------------------------------------------------- the broker alone (checks called by hand)
def run_broker_alone(tmp_path, scenario, **traits):
    """An in-process broker on the simulated pool of ``tmp_path/sim.json``; ``scenario(app, sim, client_for)``."""
    sim = SimGPUs(str(tmp_path / "sim.json"))

    async def main():
        app = make_broker(tmp_path, SystemClock(), devices=sim.config, unleased_check_interval=3600, **traits)
        await app.start_async()
        try:
            return await scenario(app, sim, lambda user: BrokerClient(broker_url(app), user))
        finally:
            await app.stop_async()

    return asyncio.run(main())


def test_a_lease_holders_heartbeat_answer_carries_the_warning_of_his_process_on_a_gpu_he_does_not_lease(tmp_path, monkeypatch):
    patch_auth(monkeypatch)
    bob = sleeper("bob", 61234)

    async def scenario(app, sim, client):
        theirs = await client("alice").request_lease({"gpus": 1, "duration_s": 3600})
        mine = await client("bob").request_lease({"gpus": 1, "duration_s": 3600})
        sim.backend.add_process(mine["placement"]["slices"][0]["gpu_uuid"], bob.pid, 100)  # his own GPU: fine
        await app.unleased.check()
        assert app.unleased.findings == []
        sim.backend.add_process(theirs["placement"]["slices"][0]["gpu_uuid"], bob.pid, 512)  # and alice's
        await app.unleased.check()
        reply = await client("bob").heartbeat(mine["id"], {})
        assert [(w["kind"], w["pid"]) for w in reply["warnings"]] == [("unleased_use", bob.pid)]
        assert "another user's GPU" in reply["warnings"][0]["message"] and "deadline" not in reply["warnings"][0]  # policy warn
        assert (await client("alice").heartbeat(theirs["id"], {}))["warnings"] == []
        # alice gives hers back and bob leases both GPUs: the same process is no longer unleased use
        await client("alice").release(theirs["id"])
        await client("bob").release(mine["id"])
        second = await client("bob").request_lease({"gpus": 2, "duration_s": 3600})
        assert second["state"] == "active"
        await app.unleased.check()
        assert app.unleased.findings == []
        _, events = await _events(client)
        assert [(e["kind"], e["data"].get("why")) for e in events] == [("unleased-use", None), ("unleased-ended", "leased")]

    try:
        run_broker_alone(tmp_path, scenario)
    finally:
        bob.kill()
        bob.wait()


async def _events(client):
    got = await client("admin-carol").events(since=0, timeout=0)
    return got, [e for e in got["events"] if e["kind"].startswith("unleased")]


def test_under_report_nobody_is_warned_and_a_stranger_is_reported_as_not_a_hub_user(tmp_path, monkeypatch):
    patch_auth(monkeypatch)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    stranger = subprocess.Popen(["sleep", "300"], env=env, preexec_fn=(lambda: os.setuid(61236)) if os.getuid() == 0 else None)  # noqa: PLW1509

    async def scenario(app, sim, client):
        app.unleased.hub_user_exists = _nobody
        lease = await client("alice").request_lease({"gpus": 1, "duration_s": 3600})
        sim.backend.add_process(lease["placement"]["slices"][0]["gpu_uuid"], stranger.pid, 300)
        await app.unleased.check()
        [finding] = app.unleased.findings
        name = "uid 61236" if os.getuid() == 0 else pwd.getpwuid(os.getuid()).pw_name
        assert finding["owner"] == f"{name} (not a hub user)" and finding["user"] == "" and finding["holders"] == ["alice"]
        assert (await client("alice").heartbeat(lease["id"], {}))["warnings"] == []
        _, events = await _events(client)
        assert events[0]["data"]["action"] == "report" and events[0]["data"]["stop_at"] is None

    try:
        run_broker_alone(tmp_path, scenario, unleased_use="report")
    finally:
        stranger.kill()
        stranger.wait()


async def _nobody(name: str) -> bool:
    return False


def test_a_process_the_broker_may_not_signal_is_reported_as_not_stopped_with_the_reason(tmp_path, monkeypatch):
    patch_auth(monkeypatch)
    bob = sleeper("bob", 61234)

    def refuse(pid, sig):
        raise PermissionError(1, "Operation not permitted")

    async def scenario(app, sim, client):
        app.unleased.kill = refuse
        lease = await client("alice").request_lease({"gpus": 1, "duration_s": 3600})
        sim.backend.add_process(lease["placement"]["slices"][0]["gpu_uuid"], bob.pid, 300)
        await app.unleased.check()
        await wait_for(lambda: any(e["kind"] == "unleased-stop" for e in app.manager.feed.since(0, user=None, lease_id=None, limit=100) or []),
                       timeout=10, message="an unleased-stop event")
        _, events = await _events(client)
        stop = next(e for e in events if e["kind"] == "unleased-stop")["data"]["stop"]
        assert stop["outcome"] == "not_stopped" and "must run as root" in stop["message"]
        assert app.unleased.findings[0]["stop"]["outcome"] == "not_stopped"
        assert bob.poll() is None

    try:
        run_broker_alone(tmp_path, scenario, unleased_use="kill", unleased_grace_s=0)
    finally:
        bob.kill()
        bob.wait()
