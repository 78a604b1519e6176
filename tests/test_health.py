"""GPU health in the broker, with the simulated backend: XID 79 drains now and moves the holder
ahead onto a healthy GPU, XID 13 changes nothing, XID 63 lets the lease run and keeps the GPU out,
a reset brings it back after the settling time; admin cordons, drains and maintenance windows."""

import asyncio

import pytest

from brokerutil import ManualClock, broker_url, make_broker, patch_auth
from jupyter_gpulease.broker.pages import render_admin_page
from jupyter_gpulease.client import BrokerClient, BrokerError
from jupyter_gpulease.hub.form import estimate_words, render_form

pytestmark = pytest.mark.timeout(60)

POOL = [
    {"node": "n1", "model": "A100-SXM4-80GB", "count": 2, "memory_mib": 81920},
    {"node": "n2", "model": "L4", "count": 2, "memory_mib": 23034},
]
A100 = {"gpus": 1, "model": "A100*", "duration_s": 7200}


@pytest.fixture(autouse=True)
def _auth(monkeypatch):
    patch_auth(monkeypatch)


def run(tmp_path, scenario, **traits):
    clock = ManualClock()

    async def main():
        app = make_broker(tmp_path, clock, pool=POOL, device_sample_interval=3600, health_settle_s=300, health_drain_grace_s=60, **traits)
        await app.start_async()
        try:
            return await scenario(app, clock, lambda user: BrokerClient(broker_url(app), user))
        finally:
            await app.stop_async()

    return asyncio.run(main())


async def sample(app):
    """One sample of the pool by the broker's monitor, and what the broker does about it."""
    await app.telemetry.sample()
    while app.health._tasks:
        await asyncio.gather(*list(app.health._tasks))
    await app.manager.flush()


async def tick(app, clock, seconds):
    clock.advance(seconds)
    await app.manager.tick()
    await app.manager.flush()


def gpu_of(lease):
    return lease["placement"]["slices"][0]["gpu_uuid"]


def device(pool, uuid):
    return next(d for d in pool["devices"] if d["uuid"] == uuid)


def test_xid_79_cordons_warns_moves_the_holder_ahead_onto_a_healthy_gpu_and_a_reset_brings_it_back(tmp_path):
    async def scenario(app, clock, client):
        alice, bob, carol, admin = client("alice"), client("bob"), client("carol"), client("admin-dan")
        a = await alice.request_lease({**A100, "server": "nb"})
        b = await bob.request_lease(A100)
        c = await carol.request_lease(A100)  # waits, first in the queue
        assert c["state"] == "queued"
        await sample(app)  # the baseline
        sick = gpu_of(a)
        app.backend.inject_xid(sick, 79)
        await sample(app)  # within one sample:
        health = await admin.health()
        [cordon] = health["cordons"]
        assert cordon["name"] == sick and cordon["mode"] == "drain" and cordon["source"] == "health"
        assert "XID 79" in cordon["reason"] and "fallen off the bus" in cordon["reason"]
        d = device(await carol.pool(), sick)
        assert d["healthy"] is False and "XID 79" in d["cordon"]["reason"]
        beat = await alice.heartbeat(a["id"])
        warn = [w for w in beat["warnings"] if w["kind"] == "gpu_unhealthy"]
        assert warn and "moves to a healthy GPU in 1 min" in warn[0]["message"] and "suspended first" in warn[0]["message"]
        lease = await alice.get_lease(a["id"])
        assert lease["preempt_at"] == pytest.approx(clock.now() + 60)
        assert lease["meta"]["health"]["device"] == sick and "XID 79" in lease["meta"]["health"]["reason"]
        await tick(app, clock, 61)  # the grace is over: the server suspended its kernels meanwhile
        ended = await alice.get_lease(a["id"])
        assert ended["state"] == "revoked" and "moved off its GPU" in ended["end_reason"] and "XID 79" in ended["end_reason"]
        assert ended["end_message"] == "Revoked by the broker: moved off its GPU: GPU 0 on n1: XID 79: GPU has fallen off the bus."
        # the next cell resumes: its request goes ahead of carol's, which waited before it
        again = await alice.request_lease({**A100, "server": "nb"})
        assert again["state"] == "queued" and again["queue"]["position"] == 1
        assert again["meta"]["moved"]["device"] == sick
        await bob.release(b["id"])
        await app.manager.flush()
        granted = await alice.get_lease(again["id"])
        assert granted["state"] == "active" and gpu_of(granted) != sick  # the healthy GPU
        assert (await carol.get_lease(c["id"]))["state"] == "queued"
        # a reset: back after the settling time, not before
        app.backend.reset_device(sick)
        await sample(app)
        assert (await admin.health())["cordons"][0]["healthy_since"] == clock.now()
        await tick(app, clock, 200)
        await sample(app)
        assert device(await carol.pool(), sick)["healthy"] is False
        await tick(app, clock, 101)
        await sample(app)
        assert (await admin.health())["cordons"] == []
        assert device(await carol.pool(), sick)["healthy"] is True
        await app.manager.tick()
        await app.manager.flush()
        assert (await carol.get_lease(c["id"]))["state"] == "active"

    run(tmp_path, scenario)


def test_xid_13_changes_nothing_and_xid_63_lets_the_lease_run_then_keeps_the_gpu_out(tmp_path):
    async def scenario(app, clock, client):
        alice, bob, admin = client("alice"), client("bob"), client("admin-dan")
        a = await alice.request_lease(A100)
        await sample(app)
        app.backend.inject_xid(gpu_of(a), 13, count=3)  # the application's own error
        await sample(app)
        assert (await admin.health())["cordons"] == []
        lease = await alice.get_lease(a["id"])
        assert lease["preempt_at"] is None and "health" not in lease["meta"]
        assert not [w for w in (await alice.heartbeat(a["id"]))["warnings"] if w["kind"] == "gpu_unhealthy"]
        assert device(await alice.pool(), gpu_of(a))["healthy"] is True
        # XID 63: a row remap pending, applied at the next reset
        app.backend.inject_xid(gpu_of(a), 63)
        await sample(app)
        [cordon] = (await admin.health())["cordons"]
        assert cordon["mode"] == "drain_when_idle" and "XID 63" in cordon["reason"]
        lease = await alice.get_lease(a["id"])
        assert lease["state"] == "active" and lease["preempt_at"] is None
        warn = [w for w in (await alice.heartbeat(a["id"]))["warnings"] if w["kind"] == "gpu_unhealthy"]
        assert warn and "runs to its end" in warn[0]["message"]
        b1 = await bob.request_lease(A100)
        assert b1["state"] == "active" and gpu_of(b1) != gpu_of(a)
        await bob.confirm(b1["id"])
        await tick(app, clock, 3600)
        await sample(app)
        assert (await alice.get_lease(a["id"]))["state"] == "active"
        await alice.release(a["id"])
        await app.manager.flush()
        b2 = await bob.request_lease(A100)
        assert b2["state"] == "queued"  # the remapped GPU stays out until it is reset
        assert "XID 63" in device(await bob.pool(), gpu_of(a))["cordon"]["reason"]

    run(tmp_path, scenario)


def test_admin_cordon_drain_uncordon_hold_and_bad_input(tmp_path):
    async def scenario(app, clock, client):
        alice, admin = client("alice"), client("admin-dan")
        a = await alice.request_lease({"gpus": 1, "model": "L4", "duration_s": 3600})
        with pytest.raises(BrokerError) as e:
            await alice.cordon("node", "n1", "nope")
        assert e.value.status == 403
        for bad, status in ((("gpu", "n1", "x"), 400), (("node", "n9", "x"), 404), (("node", "n1", " "), 400)):
            with pytest.raises(BrokerError) as e:
                await admin.cordon(*bad)
            assert e.value.status == status
        assert (await admin.health())["cordons"] == []
        got = await admin.cordon("node", "n1", "firmware update at noon")
        assert got["hold"] is True and got["mode"] == "cordon"
        form = render_form(await alice.pool(), now=clock.now())
        assert form.count("unavailable: firmware update at noon") == 2  # both GPUs of n1, on the spawn form
        page = render_admin_page(app.manager, "admin-dan", health=app.health)
        assert "firmware update at noon" in page and "held out until an admin uncordons it" in page
        pool = await alice.pool()
        assert all(not d["healthy"] and d["cordon"]["reason"] == "firmware update at noon" for d in pool["devices"] if d["node"] == "n1")
        assert (await alice.request_lease(A100))["state"] == "queued"
        with pytest.raises(BrokerError) as e:
            await admin.uncordon("device", gpu_of(a))
        assert e.value.status == 404
        # drain the L4 node: the holder is moved, with the admin's words
        await admin.cordon("node", "n2", "PSU swap", drain=True)
        lease = await alice.get_lease(a["id"])
        assert lease["preempt_at"] is not None and "PSU swap" in lease["meta"]["health"]["reason"]
        await tick(app, clock, 61)
        ended = await alice.get_lease(a["id"])
        assert ended["end_message"].startswith("Revoked by admin-dan (admin): moved off its GPU") and "PSU swap" in ended["end_message"]
        await admin.uncordon("node", "n1")
        assert [c["name"] for c in (await admin.health())["cordons"]] == ["n2"]
        # a health cordon held out by an admin stays after a reset and the settling time
        await sample(app)
        sick = next(d["uuid"] for d in (await alice.pool())["devices"] if d["node"] == "n1")
        app.backend.inject_xid(sick, 48)
        await sample(app)
        await admin.cordon("device", sick, "keep it out until the vendor looked at it")
        app.backend.reset_device(sick)
        for _ in range(3):
            await sample(app)
            await tick(app, clock, 400)
        assert sick in [c["name"] for c in (await admin.health())["cordons"]]

    run(tmp_path, scenario)


def test_an_uncordon_during_a_drains_grace_keeps_the_lease_and_says_so(tmp_path):
    async def scenario(app, clock, client):
        alice, admin = client("alice"), client("admin-dan")
        a = await alice.request_lease({"gpus": 1, "model": "L4", "duration_s": 3600})
        gpu = gpu_of(a)
        await admin.cordon("device", gpu, "fan noise, looking", drain=True)
        assert (await alice.get_lease(a["id"]))["preempt_at"] is not None
        await tick(app, clock, 30)  # half the grace
        with pytest.raises(BrokerError) as e:
            await alice.uncordon("device", gpu)
        assert e.value.status == 403
        assert (await alice.get_lease(a["id"]))["preempt_at"] is not None  # a refused uncordon changes nothing
        await admin.uncordon("device", gpu)
        kept = await alice.get_lease(a["id"])
        assert kept["state"] == "active" and kept["preempt_at"] is None and "health" not in kept["meta"] and "revoke" not in kept["meta"]
        feed = await alice.events(lease_id=a["id"], timeout=0)
        (called_off,) = [x for x in feed["events"] if x["kind"] == "preempt-cancelled"]
        assert called_off["actor"] == "admin:admin-dan" and "the move off its GPU is called off: an admin put device" in called_off["reason"]
        await tick(app, clock, 60)  # past the drain's grace: the lease runs on, on its GPU
        after = await alice.get_lease(a["id"])
        assert after["state"] == "active" and gpu_of(after) == gpu
        # and its server's next request does not jump the queue as a moved one would
        assert not app.manager.scheduler.moved
        # the same once the broker reads it back from its database
        await app.manager.flush()
        (stored,) = [x for x in app.manager.store.load_live() if x.id == a["id"]]
        assert stored.preempt_at is None and "health" not in stored.meta
        # a drain called off leaves the GPU free to drain again: a second drain moves the lease
        await admin.cordon("device", gpu, "fan noise again", drain=True)
        await tick(app, clock, 61)
        assert (await alice.get_lease(a["id"]))["state"] == "revoked"

    run(tmp_path, scenario)


def test_maintenance_windows_over_rest_keep_grants_out_and_warn_holders_ahead(tmp_path):
    async def scenario(app, clock, client):
        alice, bob, admin = client("alice"), client("bob"), client("admin-dan")
        a = await alice.request_lease(A100)
        gpu = gpu_of(a)
        now = clock.now()
        with pytest.raises(BrokerError) as e:
            await alice.add_maintenance(start=now + 3600, end=now + 7200, reason="x", nodes=["n1"])
        assert e.value.status == 403
        for bad in ({"start": now + 10, "end": now, "nodes": ["n1"]}, {"start": now + 10, "end": now + 20, "nodes": []},
                    {"start": "tomorrow", "end": now + 20, "nodes": ["n1"]}, {"start": now + 10, "end": now + 20, "nodes": ["n9"]}):
            with pytest.raises(BrokerError) as e:
                await admin.add_maintenance(reason="x", **bad)
            assert e.value.status in (400, 404)
        assert (await admin.health())["maintenance"] == []
        w = await admin.add_maintenance(start=now + 3600, end=now + 3 * 3600, reason="BIOS update", nodes=["n1"])
        # alice's lease started before the window was set and runs into it: warned ahead
        warn = [x for x in (await alice.heartbeat(a["id"]))["warnings"] if x["kind"] == "maintenance"]
        assert warn and "begins in 1 h" in warn[0]["message"] and "BIOS update" in warn[0]["message"]
        with pytest.raises(BrokerError) as e:
            await alice.extend(a["id"], by_s=600)
        assert e.value.status == 409 and "maintenance window" in e.value.message
        # a new two-hour lease would run into the window: it waits, with an ETA after it and the reason
        b = await bob.request_lease(A100)
        assert b["state"] == "queued"
        assert b["queue"]["eta"] == pytest.approx(now + 3 * 3600)
        assert "maintenance window" in b["queue"]["waiting_for"] and "BIOS update" in b["queue"]["waiting_for"]
        assert device(await bob.pool(), gpu)["maintenance"]["reason"] == "BIOS update"
        assert "maintenance in 1 h for 2 h: BIOS update" in render_form(await bob.pool(), now=clock.now())
        page = render_admin_page(app.manager, "admin-dan", health=app.health)
        assert 'data-window="' + w["id"] + '"' in page and "BIOS update" in page
        # a short one fits before it
        short = await bob.request_lease({**A100, "duration_s": 1800})
        assert short["state"] == "active"
        await bob.release(short["id"])
        await app.manager.flush()
        assert (await bob.get_lease(b["id"]))["state"] == "queued"  # the free GPU would run into the window
        await admin.delete_maintenance(w["id"])
        await app.manager.flush()
        assert (await bob.get_lease(b["id"]))["state"] == "active"

    run(tmp_path, scenario)


def test_the_form_says_why_a_lease_is_cut_short_and_why_a_request_waits_on_gpus_out_of_service(tmp_path):
    async def scenario(app, clock, client):
        alice, admin = client("alice"), client("admin-dan")
        now = clock.now()
        await admin.add_maintenance(start=now + 21 * 60, end=now + 3600, reason="BIOS update", nodes=["n1"])
        (est,) = await alice.estimate([A100])
        assert est["start"] == "now" and est["short_grant"] and est["duration_s"] == pytest.approx(21 * 60)
        assert estimate_words(est, now) == ("now", "starts now, for 21 min only: a maintenance window of its GPU begins then (BIOS update)")
        (whole,) = await alice.estimate([{"gpus": 1, "model": "L4", "duration_s": 7200}])
        assert estimate_words(whole, now) == ("now", "starts now")
        # both L4s cordoned: a request only they could hold waits for them, and says so
        await admin.cordon("node", "n2", "PSU swap")
        (est,) = await alice.estimate([{"gpus": 1, "model": "L4", "duration_s": 3600}])
        assert est["start"] == "queued"
        assert "the 2 GPUs that could hold it are out of service (cordoned, draining or unhealthy); it starts when one is back" in est["waiting_for"]
        queued = await alice.request_lease({"gpus": 1, "model": "L4", "duration_s": 3600})
        assert "out of service" in queued["queue"]["waiting_for"] and "no slice is expected" not in queued["queue"]["waiting_for"]

    run(tmp_path, scenario, maintenance_shorten_min_s=600)


def test_cordons_and_windows_hold_across_a_restart(tmp_path):
    holder = {}

    async def first(app, clock, client):
        admin = client("admin-dan")
        await admin.cordon("node", "n2", "rack move")
        holder["w"] = await admin.add_maintenance(start=clock.now() + 600, end=clock.now() + 1200, reason="BIOS update", nodes=["n1"])

    async def second(app, clock, client):
        alice = client("alice")
        health = await alice.health()
        assert [(c["name"], c["reason"]) for c in health["cordons"]] == [("n2", "rack move")]
        assert [w["id"] for w in health["maintenance"]] == [holder["w"]["id"]]
        assert all(not d["healthy"] for d in (await alice.pool())["devices"] if d["node"] == "n2")
        lease = await alice.request_lease(A100)  # two hours would run into the window on n1
        assert lease["state"] == "queued" and "maintenance window" in lease["queue"]["waiting_for"]

    run(tmp_path, first)
    run(tmp_path, second)


def test_a_server_moved_off_a_sick_gpu_keeps_its_place_ahead_across_a_restart(tmp_path):
    async def first(app, clock, client):
        alice, bob = client("alice"), client("bob")
        a = await alice.request_lease({**A100, "server": "nb"})
        await bob.request_lease(A100)
        await sample(app)
        app.backend.inject_xid(gpu_of(a), 79)
        await sample(app)
        await tick(app, clock, 61)
        assert (await alice.get_lease(a["id"]))["state"] == "revoked"

    async def second(app, clock, client):
        carol, alice = client("carol"), client("alice")
        c = await carol.request_lease(A100)  # waits first
        again = await alice.request_lease({**A100, "server": "nb"})
        assert c["state"] == again["state"] == "queued"
        assert again["queue"]["position"] == 1 and "XID 79" in again["meta"]["moved"]["reason"]

    run(tmp_path, first)
    run(tmp_path, second)
