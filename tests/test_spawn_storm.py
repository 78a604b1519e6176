"""Thirty users at nine o'clock: a spawn storm on a real hub, broker and servers.

Thirty users start servers at the same moment on the demo's small simulated pool with a mix
of whole GPUs, shares and MIG slices; most of them queue. While servers stop one by one, a
queued spawn is cancelled, a server is killed with SIGKILL and the hub restarts, a checker
(tests/storm.py) looks at the broker, the hub and the server processes several times a second
and records any GPU given twice or any mismatch between the broker's leases and the servers.

Every lease must end through the hub's own path, within one poll: the broker's own check with
the hub is switched off here (``reconcile_interval = 0``), so a lease that the hub failed to
end would stay active and fail the test.
"""

from __future__ import annotations

import time

import pytest

from hubharness import wait_for
from storm import Checker, Storm, granted_seen, queue_seen, storm_options

pytestmark = pytest.mark.timeout(900)

USERS = 30
STOPS = 8


def lease_of(storm: Storm, user: str, leases: list[dict] | None = None) -> dict:
    mine = [lease for lease in (leases or storm.leases()) if lease["user"] == user]
    assert mine, f"{user} has no lease"
    return max(mine, key=lambda lease: lease["created_at"])


def ended(storm: Storm, user: str, timeout: float = 60) -> dict:
    def done():
        lease = lease_of(storm, user)
        return lease if lease["state"] not in ("queued", "active") else None
    return wait_for(done, timeout, f"{user}'s lease did not end")


def test_thirty_users_at_once_every_lease_ends_through_the_hub_and_no_gpu_is_given_twice(tmp_path):
    storm = Storm(tmp_path, poll_interval=2, reconcile_interval=0).start()
    checker = Checker(storm).start()
    try:
        spawns = storm.storm(storm_options(USERS))
        assert {s["status"] for s in spawns.values()} <= {201, 202}, {u: (s["status"], s["body"]) for u, s in spawns.items()}
        assert len(storm.leases("live")) == USERS

        # ---- every early progress stream shows the queue: its position, and its ETA whenever
        # the broker has one (the stream was opened 0.3 s after the POST, as the spawn page is)
        def streams_told():
            leases = {lease["user"]: lease for lease in storm.leases("live")}
            waiting = {u: lease for u, lease in leases.items() if lease["state"] == "queued"}
            for u, lease in waiting.items():
                if not queue_seen(spawns[u]["events"]):
                    return None
                if (lease.get("queue") or {}).get("eta") is not None and not queue_seen(spawns[u]["events"], with_eta=True):
                    return None
            return waiting
        waiting = wait_for(streams_told, 120, "a waiting spawn's progress stream never showed its queue position and ETA")
        assert len(waiting) >= USERS - 10, list(waiting)
        with_eta = [u for u in waiting if queue_seen(spawns[u]["events"], with_eta=True)]
        assert len(with_eta) >= len(waiting) // 2, (len(with_eta), len(waiting))  # most waits have an estimate
        for u in waiting:
            ev = queue_seen(spawns[u]["events"])
            assert f"position {ev['gpulease']['position']} of {ev['gpulease']['length']}" in ev["message"], ev

        # ---- servers stop one by one; each stop ends its lease through the hub at once
        stopped: set[str] = set()
        for _ in range(STOPS):
            def a_ready_server():
                leases = storm.leases("live")
                up = [lease for lease in leases if lease["state"] == "active" and lease.get("confirmed_at") and lease["user"] not in stopped]
                return min(up, key=lambda lease: lease["confirmed_at"])["user"] if up else None
            user = wait_for(a_ready_server, 180, "no server became ready")
            status, _ = storm.stop_server(user)
            assert status in (202, 204), status
            stopped.add(user)
            lease = ended(storm, user)
            assert (lease["state"], lease["end_reason"]) == ("released", "server stopped"), lease

        # ---- a queued spawn is cancelled: it ends as cancelled everywhere
        leases = storm.leases("live")
        queued = [lease["user"] for lease in leases if lease["state"] == "queued"]
        assert queued, "the queue emptied too early for the test"
        victim = queued[-1]
        status, body = storm.hub.api("DELETE", f"users/{victim}/server")
        assert status in (202, 204), (status, body)
        lease = ended(storm, victim)
        assert lease["state"] == "withdrawn", lease
        spawns[victim]["stream"].join(60)
        events = spawns[victim]["events"]
        assert events[-1].get("failed") and "cancelled" in events[-1]["message"].lower(), events[-3:]
        assert not any(ev.get("ready") or "Server ready" in ev.get("message", "") for ev in events), events
        wait_for(lambda: victim not in storm.server_models(), 30, "the cancelled spawn is still listed")

        # ---- a server killed with SIGKILL: the hub's poll ends its lease
        def running_user():
            procs = storm.processes()
            up = [lease["user"] for lease in storm.leases("live")
                  if lease["state"] == "active" and lease.get("confirmed_at") and lease["user"] in procs]
            return up[0] if up else None
        killed = wait_for(running_user, 180, "no running server to kill")
        storm.kill_server(killed)
        lease = ended(storm, killed)
        assert (lease["state"], lease["end_reason"]) == ("released", "server is gone"), lease
        wait_for(lambda: killed not in storm.server_models(), 60, "the hub still lists the killed server")

        # ---- the hub restarts: it stops granting, withdraws the waiting spawns, stops the
        # servers and releases their leases before the broker goes
        checker.pause()
        still_queued = [lease["user"] for lease in storm.leases("live") if lease["state"] == "queued"]
        storm.hub.stop()
        states = storm.lease_states_in_db()
        assert not states.get("active") and not states.get("queued"), states
        for u in still_queued:
            spawns[u]["stream"].join(30)
            last = spawns[u]["events"][-1] if spawns[u]["events"] else {}
            assert "hub is shutting down" in last.get("message", ""), (u, spawns[u]["events"][-2:])
        storm.hub.start()  # and the broker is back
        assert storm.leases("live") == []
        assert storm.server_models() == {}
        checker.resume()

        # ---- after the restart the hub spawns as before
        again = {"u01": {"gpus": 1, "model": "A100*"}, "u02": {"share": 0.5, "model": "L4"}}
        for user, opts in again.items():
            status, body = storm.spawn(user, opts)
            assert status in (201, 202), body
        for user in again:
            wait_for(lambda u=user: (storm.server_models().get(u) or {}).get("ready"), 180, f"{user} did not start after the restart")
        for user in again:
            assert storm.stop_server(user)[0] in (202, 204)
            assert ended(storm, user)["state"] == "released"
        time.sleep(checker.interval * 3)
    finally:
        checker.stop()
        storm.stop()

    assert not checker.violations, "\n".join(checker.violations[:20])
    assert checker.rounds >= 20 and checker.checks >= 200, (checker.rounds, checker.checks)
    assert not [lease for lease in storm_final_leases(storm) if lease[1] in ("active", "queued")]
    assert any(granted_seen(s["events"]) for s in spawns.values())


def storm_final_leases(storm: Storm) -> list[tuple[str, str]]:
    import sqlite3

    with sqlite3.connect(storm.broker_db) as db:
        return list(db.execute("select user, state from leases"))
