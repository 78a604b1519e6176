"""The lease spawner without a hub: options, form, state, progress, and every path that ends a lease.

A fake broker (in-memory, same methods as BrokerClient) and a fake engine stand in for the
real ones; the end-to-end tests against a real hub, proxy and broker are in test_spawner_e2e.py.
"""

from __future__ import annotations

import asyncio
import json
import time
import types
from typing import ClassVar

import pytest
from jupyterhub.objects import Hub
from jupyterhub.spawner import Spawner

from jupyter_gpulease.client import BrokerError
from jupyter_gpulease.hub.link import BrokerLink
from jupyter_gpulease.hub.options import OptionsError, parse_presets, parse_user_options
from jupyter_gpulease.hub.placement import describe_request, granted_message, lease_environment, queue_message
from jupyter_gpulease.hub.spawner import GPULeaseSpawner

A100 = "A100-SXM4-80GB"
POOL = {
    "devices": [
        {"uuid": "GPU-a0", "node": "n1", "index": 0, "model": A100, "memory_mib": 81920,
         "mig": [{"uuid": "MIG-a0-0", "profile": "3g.40gb", "memory_mib": 40960, "index": 0},
                 {"uuid": "MIG-a0-1", "profile": "3g.40gb", "memory_mib": 40960, "index": 1}], "healthy": True},
        {"uuid": "GPU-a1", "node": "n1", "index": 1, "model": A100, "memory_mib": 81920, "mig": [], "healthy": True},
        {"uuid": "GPU-l0", "node": "n1", "index": 2, "model": "L4", "memory_mib": 23034, "mig": [], "healthy": True},
        {"uuid": "GPU-l1", "node": "n1", "index": 3, "model": "L4", "memory_mib": 23034, "mig": [], "healthy": True},
    ],
    "capacity": {
        A100: {"gpus": 2, "memory_mib": 81920, "idle_gpus": 0, "free_share": 0.0, "largest_free_share": 0.0,
               "mig": {"3g.40gb": {"total": 2, "free": 1}}},
        "L4": {"gpus": 2, "memory_mib": 23034, "idle_gpus": 2, "free_share": 2.0, "largest_free_share": 1.0, "mig": {}},
    },
    "tiers": [
        {"name": "experiment", "priority": 20, "max_duration_s": 8 * 3600, "default_duration_s": 7200, "preemptible": False},
        {"name": "learning", "priority": 10, "max_duration_s": 4 * 3600, "default_duration_s": 3600, "preemptible": True},
    ],
    "usage": {"gpus_held": 0.5, "max_gpus": 2},
    "queue_length": 1,
}

PRESETS = [
    {"slug": "cpu", "display_name": "CPU only", "cpu_only": True},
    {"slug": "l4-half", "display_name": "Half an L4", "request": {"share": 0.5, "model": "L4"}, "tier": "learning", "default": True},
    {"slug": "a100", "display_name": "One A100", "request": {"gpus": 1, "model": "A100*"}, "tier": "experiment", "duration_s": 7200},
]


# --------------------------------------------------------------------------- options
def test_empty_options_pick_the_default_preset_or_cpu_only():
    assert parse_user_options({}, presets=parse_presets(PRESETS)).preset == "l4-half"
    assert parse_user_options({}).cpu_only
    assert parse_user_options({}, allow_cpu_only=False).request == {"kind": "gpu", "gpus": 1}
    assert parse_user_options({}, default_options={"gpus": 2}).request["gpus"] == 2


def test_good_options_become_a_broker_body():
    c = parse_user_options({"gpus": 1, "model": "L4", "tier": "experiment", "duration_h": 2, "max_wait_min": 30}, pool=POOL)
    body = c.broker_body(user="alice", server="", groups=["lab"], meta={"spawner": "x"}, max_wait_s=3600)
    assert body == {"kind": "gpu", "gpus": 1, "model": ["L4"], "user": "alice", "server": "", "groups": ["lab"],
                    "tier": "experiment", "duration_s": 7200.0, "max_wait_s": 1800.0, "meta": {"spawner": "x"}}
    assert parse_user_options({"share": "0.5", "model": "L4"}, pool=POOL).request["share"] == 0.5
    assert parse_user_options({"mig_profile": "3g.40gb"}, pool=POOL).request["mig_profile"] == "3g.40gb"


@pytest.mark.parametrize(
    "opts, field, words",
    [
        ({"gpus": 1, "model": "H100"}, "model", "the pool has: A100-SXM4-80GB, L4"),
        ({"gpus": 0}, "gpus", "at least 1"),
        ({"gpus": 1000}, "gpus", "the most any node has is 3"),
        ({"gpus": 1, "tier": "production"}, "tier", "choose one of: experiment, learning"),
        ({"gpus": 1, "tier": "learning", "duration_h": 48}, "duration_h", "over the 'learning' tier's limit of 4 h"),
        ({"mig_profile": "1g.10gb"}, "mig_profile", "profiles in the pool: 3g.40gb"),
        ({"gpus": 1, "colour": "red"}, "colour", "unknown option"),
        ({"preset": "h100"}, "preset", "choose one of: cpu, l4-half, a100"),
        ({"preset": "a100", "gpus": 2}, "gpus", "a preset fixes what you get"),
        ({"kind": "cpu", "gpus": 1}, "gpus", "drop 'gpus'"),
        ({"share": 1.5}, "share", "between 0 and 1"),
        ({"gpus": "two"}, "gpus", "whole number"),
        ({"preset": ["a100"]}, "preset", "choose one of: cpu, l4-half, a100"),
        ({"gpus": 1, "duration_h": 10**400}, "duration_h", "far out of range"),
        ({"gpus": 1, "max_wait_min": 10**400}, "max_wait_min", "far out of range"),
    ],
)
def test_bad_options_say_what_to_change(opts, field, words):
    with pytest.raises(OptionsError) as e:
        parse_user_options(opts, presets=parse_presets(PRESETS), pool=POOL)
    assert e.value.field == field
    assert words in e.value.message


def test_presets_only_hub_refuses_free_choice():
    with pytest.raises(OptionsError, match="choose one of the presets"):
        parse_user_options({"gpus": 1}, presets=parse_presets(PRESETS), allow_custom=False)


@pytest.mark.parametrize("bad, words", [
    ([{"slug": "x y"}], "without spaces"),
    ([{"slug": "a", "request": {"gpus": 0}}], "at least 1"),
    ([{"slug": "a", "cpu_only": True}, {"slug": "a", "cpu_only": True}], "used twice"),
    ([{"slug": "a", "cpu_only": True, "image": "x"}], "unknown key"),
])
def test_bad_presets_are_refused_at_config_time(bad, words):
    with pytest.raises(ValueError, match=words):
        parse_presets(bad)
    with pytest.raises(Exception, match=words):
        GPULeaseSpawner(lease_presets=bad)


# the spawn form's own tests: test_form.py


# --------------------------------------------------------------------------- words and env
def test_queue_message_names_what_is_awaited_position_and_eta():
    lease = {"id": "L1", "request": {"kind": "gpu", "gpus": 1, "model": ["L4"]},
             "queue": {"position": 2, "length": 5, "eta": 1000 + 14 * 60, "waiting_for": "x"}}
    assert queue_message(lease, POOL, now=1000) == "Waiting for 1 × L4 (22 GB): position 2 of 5, about 14 min"
    assert describe_request({"kind": "share", "share": 0.5, "model": ["L4"]}, POOL) == "a 0.5 share of one L4 (22 GB)"


def test_placement_environment_names_devices_by_uuid():
    lease = {"id": "L1", "tier": "experiment", "expires_at": 1234.0, "placement": {"node": "n1", "slices": [
        {"gpu_uuid": "GPU-a0", "node": "n1", "index": 0, "model": A100, "memory_mib": 40960, "share": 0.5,
         "mig_uuid": "MIG-a0-1", "mig_profile": "3g.40gb"},
        {"gpu_uuid": "GPU-l0", "node": "n1", "index": 2, "model": "L4", "memory_mib": 11517, "share": 0.5}]}}
    env = lease_environment(lease, broker_url="http://b/")
    assert env["CUDA_VISIBLE_DEVICES"] == "MIG-a0-1,GPU-l0"
    assert env["GPULEASE_LEASE_ID"] == "L1" and env["GPULEASE_EXPIRES_AT"] == "1234"
    assert env["GPULEASE_SHARE"] == "0.5,0.5" and env["GPULEASE_MEMORY_MIB"] == "40960,11517"
    assert json.loads(env["GPULEASE_PLACEMENT"])["slices"][1]["gpu_uuid"] == "GPU-l0"


# --------------------------------------------------------------------------- the spawner, with fakes
class FakeBroker:
    """In-memory broker with BrokerClient's methods: one GPU (GPU-l0), leases granted by the test.

    Every change is an event in a feed (ids from 1), like the real broker's ``api/events``.
    ``down = True``: every call fails as when the broker cannot be reached."""

    def __init__(self, *, grant_at_once=False):
        self.leases: dict[str, dict] = {}
        self.calls: list[tuple] = []
        self.keys: list[str | None] = []  # the Idempotency-Key of each create
        self.grant_at_once = grant_at_once
        self.events_log: list[dict] = []
        self.down = False
        self._changed = asyncio.Event()
        self._n = 0

    def _check(self):
        if self.down:
            raise BrokerError(0, "cannot reach the lease broker")

    def _event(self, lid, kind, **kw):
        self.events_log.append({"id": len(self.events_log) + 1, "lease_id": lid, "kind": kind, "time": 0.0, **kw})
        self._changed.set()
        self._changed = asyncio.Event()

    async def pool(self, user=None, groups=None):
        self._check()
        self.calls.append(("pool", user, tuple(groups or ())))
        return POOL

    async def queue(self):
        self._check()
        self.calls.append(("queue",))
        return [dict(lease) for lease in self.leases.values() if lease["state"] == "queued"]

    async def list_leases(self, state=None, user=None):
        self._check()
        live = state in (None, "live")
        return [dict(lease) for lease in self.leases.values()
                if user in (None, lease["user"]) and (not live or lease["state"] in ("queued", "active"))]

    async def request_lease(self, body, *, key=None):
        self._check()
        self.calls.append(("request", body))
        self.keys.append(key)
        if body.get("tier") == "production":
            raise BrokerError(403, "you may not use tier 'production'", "tier", "Forbidden")
        self._n += 1
        lid = f"L{self._n}"
        lease = {"id": lid, "user": body["user"], "server": body.get("server", ""), "state": "queued", "tier": body.get("tier"),
                 "request": {k: body[k] for k in ("kind", "gpus", "share", "model") if k in body}, "meta": body.get("meta", {}),
                 "queue": {"position": 1, "length": 1, "eta": None, "waiting_for": "GPU-l0"}, "expires_at": None, "placement": None,
                 "confirmed_at": None}
        self.leases[lid] = lease
        self._event(lid, "requested", to_state="queued")
        if self.grant_at_once:
            self.grant(lid)
        return dict(lease)

    def grant(self, lid, share=1.0):
        lease = self.leases[lid]
        lease.update(state="active", queue=None, expires_at=2e9, placement={"node": "n1", "slices": [
            {"gpu_uuid": "GPU-l0", "node": "n1", "index": 2, "model": "L4", "memory_mib": int(23034 * share), "share": share}]})
        self._event(lid, "granted", from_state="queued", to_state="active")

    def end(self, lid, state="expired", actor="broker"):
        self.leases[lid].update(state=state, end_reason=state)
        self._event(lid, "ended", from_state="active", to_state=state, reason=state, actor=actor)

    def set_queue(self, lid, **q):
        self.leases[lid]["queue"] = {**self.leases[lid]["queue"], **q}

    async def get_lease(self, lid):
        self._check()
        if lid not in self.leases:
            raise BrokerError(404, "no such lease")
        return dict(self.leases[lid])

    async def events(self, since=0, lease_id=None, timeout=30):
        self._check()
        if since == "latest":
            return {"events": [], "last_id": len(self.events_log)}
        new = [e for e in self.events_log[int(since):] if lease_id in (None, e["lease_id"])]
        if not new and timeout:
            changed = self._changed
            try:
                async with asyncio.timeout(timeout):
                    await changed.wait()
            except TimeoutError:
                pass
            self._check()
            new = [e for e in self.events_log[int(since):] if lease_id in (None, e["lease_id"])]
        return {"events": new, "last_id": new[-1]["id"] if new else int(since)}

    async def confirm(self, lid):
        self._check()
        self.calls.append(("confirm", lid))
        self.leases[lid]["confirmed_at"] = 1.0
        return dict(self.leases[lid])

    async def release(self, lid, reason="", state="released"):
        self.calls.append(("release", lid, reason))
        self._check()
        lease = self.leases.get(lid)
        if lease is None:
            raise BrokerError(404, "no such lease")
        if lease["state"] not in ("queued", "active"):
            raise BrokerError(409, "already ended")
        old = lease["state"]
        lease["state"] = "withdrawn" if old == "queued" else "released"
        self._event(lid, "ended", from_state=old, to_state=lease["state"], reason=reason, actor="service:gpulease-spawner")
        return dict(lease)

    async def drain(self, on=True, reason=""):
        self._check()
        self.calls.append(("drain", on))
        return {"draining": on}


class FakeEngine(Spawner):
    """A spawner whose 'server' is a flag; records the environment it was started with.

    ``up``: the hub saw the server answer (what makes the real spawner 'ready')."""

    running = False
    up = False
    started_env: ClassVar[dict] = {}

    async def start(self):
        self.started_env = self.get_env()
        self.running = True
        return "http://127.0.0.1:9999"

    async def stop(self, now=False):
        self.running = False
        self.up = False

    async def poll(self):
        return None if self.running else 0

    @property
    def ready(self):
        return self.running and self.up and not self.pending


class LeaseFakeSpawner(GPULeaseSpawner, FakeEngine):
    pass


def make_spawner(broker, **kw):
    user = types.SimpleNamespace(name="alice", groups=[], url="/user/alice/", progress_url=lambda name: "")
    kw.setdefault("queue_refresh_interval", 0.05)
    s = LeaseFakeSpawner(user=user, hub=Hub(), broker_url="http://broker/", broker_api_token="t", **kw)
    if broker is not None:
        s._link = BrokerLink("http://broker/", "t", client=broker, queue_refresh_interval=kw["queue_refresh_interval"], feed_timeout=1)
    return s


async def until(predicate, timeout=5.0, what="condition"):
    """Wait (on the running loop) until ``predicate()`` is true."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def test_queued_spawn_streams_position_then_starts_with_the_leased_gpu():
    async def main():
        broker = FakeBroker()
        s = make_spawner(broker)
        s.user_options = {"gpus": 1, "model": "L4"}
        s._spawn_pending = True
        events = []

        async def watch():
            async for ev in s.progress():
                events.append(ev)
        # the hub opens the progress stream as soon as the spawn is requested, before start() runs
        watcher = asyncio.ensure_future(watch())
        await asyncio.sleep(0.05)
        task = asyncio.ensure_future(s.start())
        await until(lambda: any("position 1 of 1" in e["message"] for e in events), what="the queue position")
        assert await s.poll() is None  # waiting counts as starting
        broker.set_queue("L1", position=1, length=3, eta=time.time() + 600)
        broker._event("L9", "requested")  # the queue changed: one refresh for all waiting spawns
        await until(lambda: any("position 1 of 3, about 10 min" in e["message"] for e in events), what="the refreshed ETA")
        broker.grant("L1")
        url = await asyncio.wait_for(task, 5)
        await asyncio.wait_for(watcher, 5)
        assert ("confirm", "L1") not in broker.calls  # not before the server is up
        s._spawn_pending = False  # the hub saw the server answer and added it to the proxy
        s.up = True
        await asyncio.wait_for(s._confirm_task, 5)
        s._unfollow()
        return s, broker, url, events

    s, broker, url, events = asyncio.run(main())
    assert url == "http://127.0.0.1:9999"
    assert s.started_env["CUDA_VISIBLE_DEVICES"] == "GPU-l0"
    assert s.started_env["GPULEASE_LEASE_ID"] == "L1"
    assert s.started_env["GPULEASE_BROKER_URL"] == "http://broker/"
    queued = [e for e in events if e.get("gpulease", {}).get("state") == "queued"]
    assert queued[0]["message"].startswith("Waiting for 1 × L4 (22 GB): position 1 of 1")
    assert queued[0]["gpulease"]["position"] == 1
    assert any("granted" in e["message"] for e in events)
    for e in events:  # the hub sends them as JSON
        json.dumps(e)
    assert ("confirm", "L1") in broker.calls
    assert s.get_state()["gpulease"] == {"version": 1, "lease_id": "L1"}


def test_many_waiting_spawns_share_one_feed_and_one_queue_refresh():
    async def main():
        broker = FakeBroker()
        first = make_spawner(broker)
        spawners = [first] + [make_spawner(None) for _ in range(9)]
        for i, s in enumerate(spawners):
            s._link = first._link
            s.user = types.SimpleNamespace(name=f"u{i}", groups=[], url=f"/user/u{i}/")
            s.user_options = {"gpus": 1}
        tasks = [asyncio.ensure_future(s.start()) for s in spawners]
        await until(lambda: len(broker.leases) == 10, what="ten requests")
        broker.calls.clear()
        await asyncio.sleep(0.5)  # ten refresh intervals
        refreshes = broker.calls.count(("queue",))
        for lid in broker.leases:
            broker.grant(lid)
        await asyncio.wait_for(asyncio.gather(*tasks), 5)
        for s in spawners:
            s._unfollow()
        return refreshes, first._link

    refreshes, link = asyncio.run(main())
    assert 1 <= refreshes <= 12, refreshes  # about one per interval for all ten, not ten per interval
    assert not link.watches


def test_state_round_trip_and_stop_after_restart_releases():
    async def main():
        broker = FakeBroker(grant_at_once=True)
        s = make_spawner(broker)
        s.user_options = {"gpus": 1}
        await s.start()
        state = json.loads(json.dumps(s.get_state()))
        s._unfollow()
        # a restarted hub: a new spawner object, same state
        s2 = make_spawner(broker)
        s2.load_state(state)
        s2.running = True
        assert s2.lease_id == "L1"
        assert await s2.poll() is None  # lease still active: server still running
        assert s2._watch is not None and s2._watch.lease_id == "L1"
        await s2.stop()
        return broker, s2
    broker, s2 = asyncio.run(main())
    assert broker.leases["L1"]["state"] == "released"
    assert s2.lease_id == "" and "lease_id" not in s2.get_state()["gpulease"]
    assert s2.get_state()["gpulease"]["last_end"]["end_reason"] == "server stopped"


def test_each_spawn_asks_for_its_lease_with_an_idempotency_key_of_its_own():
    async def main():
        broker = FakeBroker(grant_at_once=True)
        s = make_spawner(broker)
        s.user_options = {"gpus": 1}
        await s.start()
        await s.stop()
        await s.start()
        s._unfollow()
        return broker
    broker = asyncio.run(main())
    assert len(broker.keys) == 2 and all(k and k.startswith("spawn-") for k in broker.keys)
    assert broker.keys[0] != broker.keys[1], "a new spawn is a new create; only the same create sent again shares its key"


def test_cancel_while_queued_withdraws_the_lease_at_once_and_never_looks_ready():
    async def main():
        broker = FakeBroker()
        s = make_spawner(broker)
        s.user_options = {"gpus": 1}
        events = []
        task = asyncio.ensure_future(s.start())

        async def watch():
            async for ev in s.progress():
                events.append(ev)
        watcher = asyncio.ensure_future(watch())
        await until(lambda: broker.leases, what="the request")
        await asyncio.sleep(0.1)
        slow = broker.release

        async def slow_release(*a, **kw):  # a broker under load: the cancel must not wait for it
            await asyncio.sleep(3)
            return await slow(*a, **kw)
        broker.release = slow_release
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # the spawn ended before the broker answered the withdrawal (the hub waits one second
        # for a cancelled spawn, then stops it; a spawn still pending then answers 500)
        state_when_cancelled = broker.leases["L1"]["state"]
        ready_after_cancel = s.ready
        await asyncio.wait_for(watcher, 5)
        # the hub then stops the spawner: nothing was started, nothing is signalled
        await s.stop()
        await until(lambda: broker.leases["L1"]["state"] == "withdrawn", what="the withdrawal")
        return s, state_when_cancelled, ready_after_cancel, events
    s, state_when_cancelled, ready_after_cancel, events = asyncio.run(main())
    assert state_when_cancelled == "queued"
    assert not ready_after_cancel and not s.running
    assert events[-1]["message"].startswith("Spawn cancelled")
    assert not any("granted" in e["message"] or "ready" in e["message"].lower() for e in events)


def test_refused_request_fails_the_spawn_with_the_brokers_words():
    async def main():
        s = make_spawner(FakeBroker())
        s.user_options = {"gpus": 1, "model": "H100"}
        with pytest.raises(Exception) as e1:
            await s.start()
        s.link.client.pool = lambda **kw: _pool_with_production()
        s.user_options = {"gpus": 1, "tier": "production"}
        with pytest.raises(Exception) as e2:
            await s.start()
        return e1.value, e2.value
    e1, e2 = asyncio.run(main())
    assert "no GPU model in the pool matches 'H100'" in e1.message and e1.status_code == 400
    assert "you may not use tier 'production'" in e2.message and e2.status_code == 403


async def _pool_with_production():
    return {**POOL, "tiers": POOL["tiers"] + [{"name": "production", "max_duration_s": 86400}]}


def test_a_lease_ended_by_the_broker_stops_the_server_through_the_feed():
    async def main():
        broker = FakeBroker(grant_at_once=True)
        s = make_spawner(broker)
        s.user_options = {"gpus": 1}
        await s.start()
        assert s.running
        broker.end("L1", "expired")
        await until(lambda: not s.running, what="the server to stop")
        return s
    s = asyncio.run(main())
    assert s.lease_id == "" and s.last_lease_end["state"] == "expired"


def test_poll_reads_the_lease_itself_when_the_feed_is_away():
    async def main():
        broker = FakeBroker(grant_at_once=True)
        s = make_spawner(broker)
        s.user_options = {"gpus": 1}
        await s.start()
        await s.link.close()  # no feed: only poll() can notice
        assert not s.link.connected
        broker.end("L1", "revoked", actor="admin")
        status = await s.poll()
        return s, status
    s, status = asyncio.run(main())
    assert status == 0 and not s.running and s.lease_id == ""
    assert s.last_lease_end["state"] == "revoked"


def test_keep_running_when_configured():
    async def main():
        broker = FakeBroker(grant_at_once=True)
        s = make_spawner(broker, on_lease_end="keep")
        s.user_options = {"gpus": 1}
        await s.start()
        broker.end("L1", "preempted")
        await until(lambda: s.lease_id == "", what="the end to be noticed")
        status = await s.poll()
        return s, status
    s, status = asyncio.run(main())
    assert status is None and s.running and s.lease_id == ""


def test_a_lease_moved_off_a_sick_gpu_keeps_the_server_whatever_on_lease_end_says():
    async def main():
        broker = FakeBroker(grant_at_once=True)
        s = make_spawner(broker)  # on_lease_end = "stop", the default
        s.user_options = {"gpus": 1}
        await s.start()
        broker.leases["L1"]["meta"] = {**broker.leases["L1"]["meta"], "health": {"device": "GPU-l0", "reason": "XID 79", "action": "drain_now"}}
        broker.end("L1", "revoked")
        await until(lambda: s.lease_id == "", what="the end to be noticed")
        await asyncio.sleep(0.1)
        return s
    s = asyncio.run(main())
    assert s.running and s.last_lease_end["state"] == "revoked" and "CUDA_VISIBLE_DEVICES" not in s._lease_env
    s.running = False


@pytest.mark.parametrize("state", ["released", "reclaimed"])
def test_a_lease_the_user_gives_back_from_inside_the_server_keeps_the_server(state):
    async def main(on_release_by_user):
        broker = FakeBroker(grant_at_once=True)
        s = make_spawner(broker, on_release_by_user=on_release_by_user)
        s.user_options = {"gpus": 1}
        await s.start()
        broker.end("L1", state, actor="alice")  # the server's own token: the user
        await until(lambda: s.lease_id == "", what="the end to be noticed")
        await asyncio.sleep(0.1)
        running = s.running
        s.running = False
        return running, s
    kept, s = asyncio.run(main("keep"))
    assert kept and s.last_lease_end["state"] == state and "CUDA_VISIBLE_DEVICES" not in s._lease_env
    stopped, _ = asyncio.run(main("stop"))
    assert not stopped


def test_cpu_only_needs_no_broker_and_hides_gpus():
    async def main():
        s = make_spawner(None)
        s.user_options = {"kind": "cpu"}
        await s.start()
        return s
    s = asyncio.run(main())
    assert s.started_env["CUDA_VISIBLE_DEVICES"] == ""
    assert "gpulease" not in s.get_state()


def test_hub_start_timeout_is_stretched_by_the_wait_limit_and_restored():
    s = make_spawner(FakeBroker(grant_at_once=True), start_timeout=60, lease_wait_timeout=1800, broker_timeout=10)
    s.run_pre_spawn_hook()
    assert s.start_timeout == 60 + 1800 + 20
    s.user_options = {"gpus": 1}
    asyncio.run(s.start())
    assert s.start_timeout == 60


def test_the_pool_is_fetched_for_the_spawning_user_and_leases_end_through_client_release():
    async def main():
        broker = FakeBroker(grant_at_once=True)
        s = make_spawner(broker)
        s.user_options = {"gpus": 1}
        pool = await s.fetch_pool()
        assert pool is POOL
        assert await s._end_lease("nope", "server stopped") is None  # 404: fine, nothing raised
        return broker.calls, s
    calls, s = asyncio.run(main())
    assert ("pool", s.user.name, ()) in calls, "the form and the options check see the user's own tiers and quota"
    assert ("release", "nope", "server stopped") in calls


def test_a_server_that_died_ends_its_lease_and_poll_retries_a_lost_confirm():
    async def main():
        broker = FakeBroker(grant_at_once=True)
        s = make_spawner(broker)
        s.user_options = {"gpus": 1}

        async def confirm_fails(lid):
            broker.calls.append(("confirm-failed", lid))
            raise BrokerError(403, "not now")
        real_confirm, broker.confirm = broker.confirm, confirm_fails
        await s.start()
        s.up = True
        await s._confirm_task
        # the confirm did not reach the broker: the next poll, with the server up, confirms
        broker.confirm = real_confirm
        assert await s.poll() is None
        await s._confirm_task
        assert ("confirm", "L1") in broker.calls
        watch = s._watch
        assert watch is not None and not watch.closed
        # the server dies: poll ends the lease and stops following it
        s.running = False
        assert await s.poll() == 0
        await until(lambda: broker.leases["L1"]["state"] == "released", what="the release")
        return s, watch
    s, watch = asyncio.run(main())
    assert s.lease_id == "" and s._watch is None and watch.closed


def test_a_release_while_the_broker_is_away_is_retried_until_the_broker_has_it():
    async def main():
        broker = FakeBroker(grant_at_once=True)
        s = make_spawner(broker)
        s.user_options = {"gpus": 1}
        await s.start()
        broker.down = True
        await s.stop()  # returns: the release goes on in the background
        assert broker.leases["L1"]["state"] == "active"
        tries = sum(1 for c in broker.calls if c[0] == "release")
        broker.down = False
        await until(lambda: broker.leases["L1"]["state"] == "released", timeout=10, what="the retried release")
        return tries
    assert asyncio.run(main()) >= 1


def test_a_cpu_only_spawn_ends_a_gpu_lease_left_by_an_earlier_hub():
    async def main():
        broker = FakeBroker(grant_at_once=True)
        left = await broker.request_lease({"user": "alice", "server": "", "gpus": 1, "meta": {"spawner": "jupyter-gpulease"}})
        s = make_spawner(broker)
        s.user_options = {"kind": "cpu"}
        await s.start()
        await s._orphan_task
        await until(lambda: broker.leases[left["id"]]["state"] == "released", what="the orphan's release")
        return s
    s = asyncio.run(main())
    assert s.started_env["CUDA_VISIBLE_DEVICES"] == ""


def test_a_restarted_hub_notices_an_end_as_soon_as_the_broker_answers():
    """The hub checks its servers before it starts the broker: the first poll cannot reach it.
    The shared link keeps trying, and the end that happened meanwhile stops the server at once."""
    async def main():
        broker = FakeBroker(grant_at_once=True)
        s = make_spawner(broker)
        s.user_options = {"gpus": 1}
        await s.start()
        state = s.get_state()
        s._unfollow()
        await s.link.close()
        broker.end("L1", "revoked", actor="admin")  # while the hub was down
        broker.down = True
        s2 = make_spawner(broker)
        s2.load_state(state)
        s2.running = True
        assert await s2.poll() is None  # broker unreachable: assume running
        broker.down = False
        await until(lambda: not s2.running, timeout=10, what="the server to stop once the broker answers")
        return s2
    s2 = asyncio.run(main())
    assert s2.last_lease_end["state"] == "revoked"


def test_withdrawn_at_hub_shutdown_tells_the_user_and_remembers_it():
    async def main():
        broker = FakeBroker()
        s = make_spawner(broker)
        s.user_options = {"gpus": 1}
        task = asyncio.ensure_future(s.start())
        await until(lambda: s._watch is not None and s._watch.state == "queued", what="the queue")
        assert s.withdraw_for_shutdown("The hub is shutting down; start again later.")
        with pytest.raises(Exception) as e:
            await asyncio.wait_for(task, 5)
        await until(lambda: broker.leases["L1"]["state"] == "withdrawn", what="the withdrawal")
        return s, e.value
    s, err = asyncio.run(main())
    assert "The hub is shutting down" in err.message
    assert s.last_lease_end["state"] == "withdrawn" and "shutting down" in s.last_lease_end["end_reason"]


def test_an_eta_beyond_the_wait_limit_says_the_spawn_gives_up_first():
    lease = {"request": {"kind": "gpu", "gpus": 1, "model": ["L4"]}, "queue": {"position": 3, "length": 5, "eta": 1000.0 + 13 * 3600}}
    msg = queue_message(lease, POOL, now=1000.0, gives_up_at=1000.0 + 3600)
    assert "position 3 of 5, about 13 h" in msg
    assert "after this spawn stops waiting (in 1 h)" in msg and "it will give up" in msg
    assert "give up" not in queue_message(lease, POOL, now=1000.0, gives_up_at=1000.0 + 14 * 3600)
    # the broker's own flag and wait limit, as its queue info carries them
    flagged = {**lease, "queue": {**lease["queue"], "eta_after_wait_limit": True, "gives_up_at": 1000.0 + 3600}}
    assert "after this spawn stops waiting (in 1 h)" in queue_message(flagged, POOL, now=1000.0)


def test_a_share_gets_mps_limits_where_mps_serves_the_gpu_and_a_memory_fraction_everywhere():
    lease = {"id": "L1", "expires_at": 1234, "tier": "learning", "placement": {"node": "n1", "slices": [
        {"gpu_uuid": "GPU-l0", "node": "n1", "index": 2, "model": "L4", "memory_mib": 11517, "share": 0.5}]}}
    plain = lease_environment(lease, gpu_memory_mib={"GPU-l0": 23034})
    assert plain["GPULEASE_MEMORY_FRACTION"] == "0.5"
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in plain
    mps = lease_environment(lease, gpu_memory_mib={"GPU-l0": 23034}, cuda_mps=True)
    assert mps["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    assert mps["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=11517M"
    whole = {**lease, "placement": {"node": "n1", "slices": [{**lease["placement"]["slices"][0], "share": 1.0, "memory_mib": 23034}]}}
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in lease_environment(whole, cuda_mps=True)
    assert lease_environment(whole)["GPULEASE_MEMORY_FRACTION"] == "1"


def test_granted_message_says_when_a_grant_is_shorter_than_asked():
    slices = [{"model": "A100", "gpu_uuid": "GPU-1", "share": 1}]
    full = {"id": "L1", "placement": {"slices": slices}, "granted_at": 1000.0, "expires_at": 1000.0 + 7200, "duration_s": 7200}
    assert granted_message(full, now=1000.0) == "GPU lease L1 granted: A100 (GPU-1), for 2 h"
    short = dict(full, expires_at=1000.0 + 2400)
    msg = granted_message(short, now=1000.0)
    assert msg.startswith("GPU lease L1 granted: A100 (GPU-1), for 40 min") and "you asked for 2 h" in msg and "promised to a waiting request" in msg
