"""A hub that stops while its broker is down: every server stops, every lease ends once a broker answers.

A real JupyterHub with configurable-http-proxy, the broker as its managed service, real
single-user servers with the server extension and a real kernel. The broker is killed and kept
down (its restart by the hub waits on a file), then the hub gets SIGTERM, as at a restart or
maintenance. Before, the hub waited on the broker inside each server's stop, gave up after
40 s, and exited leaving the servers and their kernels running under PID 1 with their leases
active; here the servers stop without the broker, the lease ends wait in the hub's outbox
file, and the next hub sends them as soon as its broker answers.
"""

from __future__ import annotations

import json
import os
import signal
import urllib.request
from pathlib import Path

import pytest

from hubharness import pid_alive, wait_for
from test_spawner_e2e import BROKER_HOLD, make_hub

pytestmark = pytest.mark.timeout(600)


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            kids = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        out += [int(k) for k in kids]
        todo += [int(k) for k in kids]
    return out


def _processes_naming(text: str) -> list[int]:
    """Processes whose command line contains ``text``."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != os.getpid():
            try:
                if text in Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    out.append(int(d))
            except OSError:
                continue
    return out


def _user_call(hub, user: str, token: str, method: str, path: str, body: dict | None = None) -> dict:
    req = urllib.request.Request(f"{hub.url}/user/{user}/{path}", method=method,
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"Authorization": f"token {token}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read() or b"{}")


def _kill_brokers(hub) -> None:
    pids = [pid for pid, cmd in hub.descendants() if "jupyter_gpulease" in cmd and "broker" in cmd]
    assert pids, "no broker process below the hub"
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    wait_for(lambda: not any(pid_alive(p) for p in pids), 30, "the broker did not die")


def test_a_hub_stopped_while_its_broker_is_down_stops_every_server_and_every_lease_ends_when_a_broker_answers(tmp_path):
    hub = make_hub(
        tmp_path, users=("alice", "bob"),
        # the broker's own check with the hub would end the leases too, but only after its grace:
        # long here, so that what ends them is the hub's outbox
        broker_lines=("c.GPULeaseBroker.reconcile_grace = 3600",),
    )
    procs: list[int] = []
    try:
        # bob holds the spawner's lease; alice runs CPU-only and asks for a GPU from inside her
        # server, as %gpu request does (the server extension's API, her own token)
        for user, options in (("bob", {"share": 0.5}), ("alice", {"kind": "cpu"})):
            status, body = hub.spawn(user, options)
            assert status in (201, 202), body
            hub.wait_ready(user)
        alice_token = hub.create_token("alice")
        _user_call(hub, "alice", alice_token, "POST", "gpulease/api/lease", {"share": 0.5})
        (own,) = hub.leases("alice", "active")
        assert own["server"] == "" and own["meta"]["taken_by"] == "server", own
        _user_call(hub, "alice", alice_token, "POST", "api/kernels", {"name": "python3"})
        (bobs,) = hub.leases("bob", "active")
        servers = [hub.server_pid("alice"), hub.server_pid("bob")]
        procs = servers + [p for s in servers for p in _descendants(s)]
        assert len(procs) >= 3, "alice's kernel is not running below her server"

        (tmp_path / BROKER_HOLD).touch()
        _kill_brokers(hub)
        proc = hub.proc
        hub.keep_servers = True  # the harness must not clean up after the hub: the hub must have
        hub.stop(timeout=120)
        hub.keep_servers = False
        assert proc.returncode != -signal.SIGKILL, "the hub did not exit by itself"
        left = [p for p in procs if pid_alive(p)]
        assert not left, f"processes left running after the hub exited: {left}\n{hub.log_tail(40)}"
        log = hub.log_file.read_text()
        assert "2 server(s) stopped" in log and "kept in" in log, hub.log_tail(40)
        assert (tmp_path / "jupyterhub-gpulease-pending.json").exists()

        # the next hub (the broker no longer held): both leases end, by the hub's word, at once
        (tmp_path / BROKER_HOLD).unlink()
        hub.start()

        def ended(lease_id):
            try:
                lease = hub.broker_call("get_lease", lease_id)
            except Exception:
                return None
            return lease if lease["state"] != "active" else None
        for lease in (bobs, own):
            done = wait_for(lambda lid=lease["id"]: ended(lid), 90, f"lease {lease['id']} still active after the restart")
            assert done["state"] == "released", done
            assert done["end_reason"] in ("server stopped", "its server stopped"), done
        wait_for(lambda: not (tmp_path / "jupyterhub-gpulease-pending.json").exists(), 30, "the outbox was not emptied")
        assert hub.server_model("alice") is None and hub.server_model("bob") is None
        assert "Every GPU lease end the hub kept has reached the broker" in hub.log_file.read_text()
    finally:
        try:
            (tmp_path / BROKER_HOLD).unlink(missing_ok=True)
            hub.stop()
        finally:
            for p in procs:
                if pid_alive(p):
                    os.kill(p, signal.SIGKILL)


def test_a_hub_killed_while_its_broker_is_down_follows_its_servers_again_and_no_lease_outlives_its_server(tmp_path):
    """SIGKILL: the hub has no clean-up at all. Its servers run on; alice's dies while the hub
    is away. The next hub follows bob's server again and finds alice's gone before its broker
    answers (JupyterHub checks its servers before it starts its services): the end of her lease
    waits in the outbox and reaches the broker as soon as it answers (not after the broker's own
    check, whose grace is an hour here). Then that hub stops normally (cleanup_servers): bob's
    server stops and both his leases end."""
    hub = make_hub(tmp_path, users=("alice", "bob"), broker_lines=("c.GPULeaseBroker.reconcile_grace = 3600",))
    procs: list[int] = []
    try:
        for user, options in (("alice", {"share": 0.5}), ("bob", {"kind": "cpu"})):
            status, body = hub.spawn(user, options)
            assert status in (201, 202), body
            hub.wait_ready(user)
        _user_call(hub, "bob", hub.create_token("bob"), "POST", "gpulease/api/lease", {"share": 0.5})
        (alices,) = hub.leases("alice", "active")
        (bobs,) = hub.leases("bob", "active")
        alice_pid, bob_pid = hub.server_pid("alice"), hub.server_pid("bob")
        procs = [alice_pid, bob_pid, *_descendants(alice_pid), *_descendants(bob_pid)]

        (tmp_path / BROKER_HOLD).touch()
        _kill_brokers(hub)
        os.kill(hub.pid, signal.SIGKILL)
        wait_for(lambda: not pid_alive(hub.pid), 30, "the hub did not die")
        hub.proc = None
        # what a service manager does with a dead hub's services: the broker's restart (held by the
        # file, or already started) goes too; the single-user servers are the hub's to find again
        for pid in _processes_naming(str(tmp_path / "gpulease_config.py")) + _processes_naming(str(tmp_path / BROKER_HOLD)):
            os.kill(pid, signal.SIGKILL)
        os.kill(alice_pid, signal.SIGKILL)  # her server dies while no hub watches
        assert pid_alive(bob_pid)

        # a hub waits for its managed services at start: it starts with the broker, as a service
        # manager would restart both; it checks its servers before the broker answers
        (tmp_path / BROKER_HOLD).unlink()
        hub.start()
        wait_for(lambda: hub.server_model("alice") is None, 60, "the new hub did not notice alice's server is gone")
        hub.wait_ready("bob")

        def state(lease_id):
            try:
                return hub.broker_call("get_lease", lease_id)["state"]
            except Exception:
                return None
        wait_for(lambda: state(alices["id"]) == "released", 90, "alice's lease did not end once the broker answered")
        assert state(bobs["id"]) == "active" and pid_alive(bob_pid)  # his server runs: its lease stays

        proc = hub.proc
        hub.keep_servers = True
        hub.stop(timeout=120)
        hub.keep_servers = False
        assert proc.returncode != -signal.SIGKILL
        assert not [p for p in procs if pid_alive(p)], hub.log_tail(40)
        hub.start()  # only to ask the broker: both of bob's leases ended with his server
        wait_for(lambda: state(bobs["id"]) == "released", 60, "bob's own lease is still active")
    finally:
        try:
            (tmp_path / BROKER_HOLD).unlink(missing_ok=True)
            hub.stop()
        finally:
            for p in procs:
                if pid_alive(p):
                    os.kill(p, signal.SIGKILL)


def test_an_admins_revoke_with_a_grace_warns_the_holder_then_says_why_on_the_home_page_and_in_the_notebook(tmp_path):
    """On a hub whose servers keep running when their lease ends (on_lease_end = "keep"), an
    admin revokes bob's lease with a grace: the admin's answer says his server keeps running;
    bob's home page and his server's status (what the notebook shows) carry the admin's words
    as a warning while the grace runs, and the end with its reason after it; the server runs on."""
    from jupyter_gpulease.hub.pages import TEMPLATE_PATH

    hub = make_hub(tmp_path, users=("bob",), config_lines=[
        "c.GPULeaseSpawner.on_lease_end = 'keep'", f"c.JupyterHub.template_paths = [{TEMPLATE_PATH!r}]",
        # the server hears the broker's warnings in its heartbeats' answers: every 2 s here
        "c.Spawner.args = ['--allow-root', '--GPULeaseExtension.heartbeat_interval=2']"])
    pid = None
    try:
        status, body = hub.spawn("bob", {"share": 0.5})
        assert status in (201, 202), body
        hub.wait_ready("bob")
        pid = hub.server_pid("bob")
        (lease,) = hub.leases("bob", "active")
        assert lease["meta"]["on_end"] == "keep"
        bob_token = hub.create_token("bob")
        browser = hub.login("bob")

        def home() -> str:
            return browser.open(f"{hub.url}/hub/home", timeout=30).read().decode()

        status, answer = hub.request("POST", f"{hub.broker.url}api/leases/{lease['id']}/release",
                                     {"state": "revoked", "reason": "node maintenance at noon", "grace_s": 20}, token=hub.spawner_token)
        assert status == 200 and answer["state"] == "active" and answer["preempt_at"], answer
        words = "an admin ends this lease in"
        wait_for(lambda: words in home() and "node maintenance at noon" in home(), 15, "bob's home page shows no warning")
        wait_for(lambda: any(words in w.get("message", "").lower() and "node maintenance at noon" in w["message"] for w in
                             _user_call(hub, "bob", bob_token, "GET", "gpulease/api/status?history=0")["warnings"]),
                 45, "bob's server does not show the warning: "
                 + json.dumps(_user_call(hub, "bob", bob_token, "GET", "gpulease/api/status?history=0").get("warnings")))

        wait_for(lambda: hub.broker_call("get_lease", lease["id"])["state"] == "revoked", 60, "the grace did not end the lease")

        def ended_on_home():
            page = home()
            return 'data-kind="ended"' in page and "node maintenance at noon" in page and "Your server keeps running without a GPU." in page
        wait_for(ended_on_home, 30, "bob's home page does not say why his lease ended")
        wait_for(lambda: (_user_call(hub, "bob", bob_token, "GET", "gpulease/api/status?history=0").get("last_lease") or {}).get("state") == "revoked",
                 60, "bob's server does not know its lease was revoked")
        last = _user_call(hub, "bob", bob_token, "GET", "gpulease/api/status?history=0")["last_lease"]
        assert "node maintenance at noon" in last["end_reason"], last
        assert pid_alive(pid) and hub.server_model("bob")["ready"]
    finally:
        hub.stop()
