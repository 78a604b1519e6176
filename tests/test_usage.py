"""Usage records kept by the broker: from grants, heartbeats and ends to the report.

A broker in-process over real HTTP on 127.0.0.1 with a clock the tests move (the caller is
named by the token, see brokerutil.patch_auth); the records are written by the broker's own
recorder in the same commits as the events, and read back through ``GET api/usage``.
"""

from __future__ import annotations

import asyncio
import csv
import io
import json

import pytest
from tornado.httpclient import AsyncHTTPClient, HTTPClientError

from brokerutil import ManualClock, broker_url, make_broker, patch_auth
from jupyter_gpulease.client import BrokerClient, BrokerError
from jupyter_gpulease.store import LeaseStore

pytestmark = pytest.mark.timeout(90)

A100 = "A100-SXM4-80GB"
T0 = 1_800_000_000.0 - 1_800_000_000.0 % 3600  # on the hour: hours are easy to check
POOL = [
    {"node": "n1", "model": A100, "count": 2, "memory_mib": 81920},
    {"node": "n2", "model": A100, "memory_mib": 81920, "mig": {"1g.10gb": 7}},
    {"node": "n3", "model": "L4", "count": 2, "memory_mib": 23034},
]


@pytest.fixture(autouse=True)
def _auth(monkeypatch):
    patch_auth(monkeypatch)


def make(tmp_path, clock, usage: dict | None = None, **kw):
    """A broker on POOL; ``usage``: settings of GPULeaseUsage."""
    from traitlets.config import Config

    from jupyter_gpulease.broker.app import GPULeaseBroker

    kw.setdefault("confirm_timeout_s", 0)  # the tests' leases have no server to confirm them
    app = make_broker(tmp_path, clock, pool=POOL, **kw)
    if usage:
        c = Config(app.config)
        for k, v in usage.items():
            setattr(c.GPULeaseUsage, k, v)
        app = GPULeaseBroker(config=c, clock=clock)
        app.initialize([])
    return app


def run_with_broker(tmp_path, scenario, clock, **kw):
    async def main():
        app = make(tmp_path, clock, **kw)
        await app.start_async()
        try:
            return await scenario(app, lambda user: BrokerClient(broker_url(app), user))
        finally:
            await app.stop_async()

    return asyncio.run(main())


async def usage(app, caller: str, path: str = "api/usage", **query) -> dict | list:
    c = BrokerClient(broker_url(app), caller, retry_for=0)
    return await c._call("GET", path, query=query)


async def get_raw(app, user: str, path: str) -> tuple[int, str, dict]:
    try:
        r = await AsyncHTTPClient().fetch(broker_url(app) + path, headers={"Authorization": f"token {user}"})
    except HTTPClientError as e:
        return e.code, e.response.body.decode() if e.response else "", dict(e.response.headers) if e.response else {}
    return r.code, r.body.decode(), dict(r.headers)


def beat(busy: dict[str, float], idle: dict[str, float], kernels: dict | None = None, mem: int = 0) -> dict:
    return {"devices": {u: {"busy_s": busy[u], "idle_s": idle.get(u, 0.0), "mem_peak_mib": mem} for u in busy}, "kernels": kernels or {}}


def rows_by_key(rep: dict) -> dict:
    return {r["key"]: r for r in rep["rows"]}


def test_a_lease_held_an_hour_and_busy_twenty_minutes_is_reported_so_against_its_user_group_and_notebooks(tmp_path, db_url):
    clock = ManualClock(T0)

    async def scenario(app, client):
        alice = client("alice")
        lease = await alice.request_lease({"gpus": 1, "model": A100, "duration_s": 4 * 3600})
        uuid = lease["placement"]["slices"][0]["gpu_uuid"]
        clock.advance(1800)  # half an hour, 15 min of it busy: train.ipynb computed, scratch.ipynb sat on memory
        k = {"k-train": {"busy_s": 900.0, "idle_s": 900.0, "mem_peak_mib": 9000, "state": "ok", "path": "work/train.ipynb"},
             "k-scrat": {"busy_s": 0.0, "idle_s": 1800.0, "mem_peak_mib": 2000, "state": "ok", "path": "work/scratch.ipynb"}}
        await alice.heartbeat(lease["id"], beat({uuid: 900.0}, {uuid: 900.0}, k, mem=11000))
        clock.advance(1800)  # another half hour, 5 more busy minutes
        k["k-train"].update(busy_s=1200.0, idle_s=2400.0)
        k["k-scrat"].update(idle_s=3600.0)
        await alice.heartbeat(lease["id"], beat({uuid: 1200.0}, {uuid: 2400.0}, k, mem=11000))
        await alice.release(lease["id"])

        rep = await usage(app, "alice", since="1d", by="user")
        assert [r["key"] for r in rep["rows"]] == ["alice"]
        r = rep["rows"][0]
        assert r["held_gpu_h"] == pytest.approx(1.0) and r["busy_gpu_h"] == pytest.approx(1200 / 3600)
        assert r["idle_gpu_h"] == pytest.approx(1 - 1200 / 3600) and r["busy_ratio"] == pytest.approx(1 / 3, abs=1e-3)
        assert r["leases"] == 1 and r["queue_wait_p50_s"] == 0 and (r["reclaims"], r["suspends"], r["preemptions"]) == (0, 0, 0)
        assert rep["totals"]["held_gpu_h"] == pytest.approx(1.0)
        # the group (the hub's) and the model
        assert rows_by_key(await usage(app, "admin-carol", since="1d", by="group"))["physics"]["held_gpu_h"] == pytest.approx(1.0)
        assert rows_by_key(await usage(app, "admin-carol", since="1d", by="model"))[A100]["busy_gpu_h"] == pytest.approx(1200 / 3600)
        # per notebook: the busy kernel's busy seconds, the idle one's idle seconds
        nb = rows_by_key(await usage(app, "alice", since="1d", by="notebook"))
        assert nb["work/train.ipynb"]["busy_gpu_h"] == pytest.approx(1200 / 3600)
        assert nb["work/scratch.ipynb"]["busy_gpu_h"] == 0 and nb["work/scratch.ipynb"]["idle_gpu_h"] == pytest.approx(1.0)
        # over time: two half-hours in one hour
        s = await usage(app, "admin-carol", "api/usage/series", since="1d", by="group")
        assert [(p["t"], p["key"]) for p in s["points"]] == [(int(T0), "physics")]
        assert s["points"][0]["held_gpu_h"] == pytest.approx(1.0)
        # the raw samples and the roll-ups are in the broker's store
        with app.store.engine.connect() as conn:
            assert conn.exec_driver_sql("SELECT count(*) FROM usage_samples WHERE kernel = ''").scalar() == 2  # one per beat (the end came at once)
            held = conn.exec_driver_sql("SELECT sum(held_gpu_s) FROM usage_hourly WHERE kernel = ''").scalar()
        assert held == pytest.approx(3600.0)

    run_with_broker(tmp_path, scenario, clock, db_url=db_url)


def test_a_user_reads_only_their_own_usage_and_bad_questions_get_a_400_naming_the_field(tmp_path):
    clock = ManualClock(T0)

    async def scenario(app, client):
        for who in ("alice", "bob"):
            lease = await client(who).request_lease({"gpus": 1, "model": "L4", "duration_s": 3600})
            clock.advance(600)
            await client(who).release(lease["id"])
        assert [r["key"] for r in (await usage(app, "alice", since="1d"))["rows"]] == ["alice"]
        assert {r["key"] for r in (await usage(app, "admin-carol", since="1d"))["rows"]} == {"alice", "bob"}
        assert [r["key"] for r in (await usage(app, "admin-carol", since="1d", user="bob"))["rows"]] == ["bob"]
        for query, status, field in [({"user": "bob"}, 403, "user"), ({"by": "planet"}, 400, "by"), ({"since": "soon"}, 400, "since"),
                                     ({"from": "yesterday"}, 400, "from"), ({"since": "1d", "from": "2026-01-01"}, 400, "since"),
                                     ({"format": "xml"}, 400, "format"), ({"from": "2026-02-01", "to": "2026-01-01"}, 400, "from")]:
            with pytest.raises(BrokerError) as info:
                await usage(app, "alice", **query)
            assert (info.value.status, info.value.field) == (status, field), (query, info.value.message)
            assert info.value.message
        with pytest.raises(BrokerError) as info:
            await usage(app, "alice", "api/usage/suggestions", user="bob")
        assert info.value.status == 403
        # CSV for a spreadsheet: a header, a row per key, the total
        code, text, headers = await get_raw(app, "admin-carol", "api/usage?since=1d&by=user&format=csv")
        assert code == 200 and headers["Content-Type"].startswith("text/csv")
        table = list(csv.reader(io.StringIO(text)))
        assert table[0][:4] == ["user", "held_gpu_h", "busy_gpu_h", "idle_gpu_h"]
        assert sorted(r[0] for r in table[1:-1]) == ["alice", "bob"] and table[-1][0] == "total"
        assert float(table[-1][1]) == pytest.approx(2 * 600 / 3600)

    run_with_broker(tmp_path, scenario, clock)


def test_a_share_and_a_mig_slice_are_charged_their_fraction_and_idle_time_as_the_admin_says(tmp_path):
    clock = ManualClock(T0)
    price = 4.0

    async def scenario(app, client):
        alice, bob, dave = client("alice"), client("bob"), client("dave")
        whole = await alice.request_lease({"gpus": 1, "model": A100, "duration_s": 7200})
        share = await bob.request_lease({"share": 0.25, "model": A100, "duration_s": 7200})
        mig = await dave.request_lease({"mig_profile": "1g.10gb", "duration_s": 7200})
        assert {x["state"] for x in (whole, share, mig)} == {"active"}
        assert mig["placement"]["slices"][0]["share"] == pytest.approx(0.125)
        clock.advance(3600)
        # bob's share computed for half the hour
        bob_uuid = share["placement"]["slices"][0]["gpu_uuid"]
        await bob.heartbeat(share["id"], beat({bob_uuid: 1800.0}, {bob_uuid: 1800.0}))
        for c, lease in ((alice, whole), (bob, share), (dave, mig)):
            await c.release(lease["id"])
        rep = rows_by_key(await usage(app, "admin-carol", since="1d", by="user"))
        assert rep["alice"]["held_gpu_h"] == pytest.approx(1.0) and rep["alice"]["cost"] == pytest.approx(price)
        assert rep["bob"]["held_gpu_h"] == pytest.approx(0.25) and rep["bob"]["cost"] == pytest.approx(price * 0.25)
        assert rep["bob"]["busy_gpu_h"] == pytest.approx(0.125)
        assert rep["dave"]["held_gpu_h"] == pytest.approx(0.125) and rep["dave"]["cost"] == pytest.approx(price * 0.125)
        total = await usage(app, "admin-carol", since="1d", by="user")
        assert total["totals"]["cost"] == pytest.approx(price * 1.375) and total["currency"] == "EUR"
        # without charging idle time only busy GPU-hours cost
        app.usage.accounting = type(app.usage.accounting)(prices={"A100*": price}, currency="EUR", charge_idle=False)
        rep = rows_by_key(await usage(app, "admin-carol", since="1d", by="user"))
        assert rep["bob"]["cost"] == pytest.approx(price * 0.125) and rep["alice"]["cost"] == 0

    run_with_broker(tmp_path, scenario, clock, usage={"prices": {"A100*": price}, "currency": "EUR"})


def test_records_continue_across_a_broker_restart_and_counters_reach_prometheus(tmp_path, db_url):
    clock = ManualClock(T0)
    lease_id = {}

    async def first(app, client):
        alice = client("alice")
        lease = await alice.request_lease({"gpus": 1, "model": "L4", "duration_s": 7200})
        lease_id["id"], lease_id["uuid"] = lease["id"], lease["placement"]["slices"][0]["gpu_uuid"]
        clock.advance(600)
        await alice.heartbeat(lease["id"], beat({lease_id["uuid"]: 300.0}, {lease_id["uuid"]: 300.0}))

    async def second(app, client):
        alice = client("alice")
        clock.advance(600)
        # the server's counters go on from where they were: only the new 200 s count
        await alice.heartbeat(lease_id["id"], beat({lease_id["uuid"]: 500.0}, {lease_id["uuid"]: 700.0}))
        await alice.release(lease_id["id"])
        r = rows_by_key(await usage(app, "alice", since="1d"))["alice"]
        assert r["held_gpu_h"] == pytest.approx(1200 / 3600) and r["busy_gpu_h"] == pytest.approx(500 / 3600) and r["leases"] == 1
        code, text, _ = await get_raw(app, "admin-carol", "metrics")
        assert code == 200
        held = [ln for ln in text.splitlines() if ln.startswith("gpulease_usage_held_gpu_seconds_total{")]
        busy = [ln for ln in text.splitlines() if ln.startswith("gpulease_usage_busy_gpu_seconds_total{")]
        assert held == ['gpulease_usage_held_gpu_seconds_total{group="physics",model="L4"} 1200.0'], held
        assert busy == ['gpulease_usage_busy_gpu_seconds_total{group="physics",model="L4"} 500.0'], busy
        assert "user=" not in "".join(held + busy)  # no user label unless the admin allows it

    run_with_broker(tmp_path, first, clock, db_url=db_url)
    run_with_broker(tmp_path, second, clock, db_url=db_url)


def test_raw_samples_are_pruned_after_the_retention_and_the_hourly_rollups_stay(tmp_path):
    clock = ManualClock(T0)

    async def scenario(app, client):
        alice = client("alice")
        lease = await alice.request_lease({"gpus": 1, "model": "L4", "duration_s": 3600})
        clock.advance(1200)
        await alice.release(lease["id"])
        clock.advance(3 * 86400)
        assert await app.manager.prune_usage_samples(2 * 86400) == 1
        with app.store.engine.connect() as conn:
            assert conn.exec_driver_sql("SELECT count(*) FROM usage_samples").scalar() == 0
        r = rows_by_key(await usage(app, "alice", since="7d"))["alice"]
        assert r["held_gpu_h"] == pytest.approx(1200 / 3600)

    run_with_broker(tmp_path, scenario, clock)


def test_recording_off_writes_no_records(tmp_path):
    clock = ManualClock(T0)

    async def scenario(app, client):
        lease = await client("alice").request_lease({"gpus": 1, "model": "L4", "duration_s": 3600})
        clock.advance(600)
        await client("alice").release(lease["id"])
        assert (await usage(app, "alice", since="1d"))["rows"] == []

    run_with_broker(tmp_path, scenario, clock, usage={"record": False})


def test_the_store_upgrade_adds_the_usage_tables_to_an_older_database(tmp_path):
    url = f"sqlite:///{tmp_path / 'old.sqlite'}"
    from alembic import command

    store = LeaseStore(url, migrate=False)
    with store.engine.begin() as conn:
        cfg = store._alembic_config(conn)
        command.upgrade(cfg, "0003")
    assert store.schema_revision() == "0003"
    store.upgrade()
    with store.engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT count(*) FROM usage_hourly").scalar() == 0
    store.close()


def test_an_over_asking_user_gets_right_sizing_suggestions_they_alone_may_read(tmp_path):
    clock = ManualClock(T0)

    async def scenario(app, client):
        alice, bob = client("alice"), client("bob")
        for _ in range(5):  # alice: a whole 80 GB A100 for 8 h, 9 GB (9216 MiB) and 2 h used
            lease = await alice.request_lease({"gpus": 1, "model": A100, "duration_s": 8 * 3600})
            uuid = lease["placement"]["slices"][0]["gpu_uuid"]
            clock.advance(2 * 3600)
            await alice.heartbeat(lease["id"], beat({uuid: 3600.0}, {uuid: 3600.0}, mem=9216))
            await alice.release(lease["id"])
        for _ in range(3):  # bob: two GPUs, the second never computes
            lease = await bob.request_lease({"gpus": 2, "model": A100, "duration_s": 3600})
            u1, u2 = (s["gpu_uuid"] for s in lease["placement"]["slices"])
            clock.advance(3000)
            await bob.heartbeat(lease["id"], beat({u1: 2000.0, u2: 0.0}, {u1: 1000.0, u2: 3000.0}, mem=30000))
            await bob.release(lease["id"])
        mine = await usage(app, "alice", "api/usage/suggestions")
        assert {s["user"] for s in mine} == {"alice"}
        kinds = {s["kind"]: s for s in mine}
        mem = kinds["memory"]
        assert mem["text"] == f"asks 1 × {A100} (80 GB), peak memory 9 GB in 95% of leases: a 1g.10gb slice or a 0.25 share would do"
        assert mem["suggested"] == {"kind": "mig", "model": A100, "memory_mib": 10240, "mig_profile": "1g.10gb"}
        assert mem["alternatives"] == [{"kind": "share", "model": A100, "memory_mib": 20480, "share": 0.25}]
        assert mem["evidence"]["leases"] == 5 and mem["evidence"]["mem_peak_p95_mib"] == 9216
        assert kinds["duration"]["text"] == "asks 8 h, uses 2 h at the median: 2 h would do for 90% of leases"
        assert kinds["duration"]["suggested"]["duration_s"] == 7200
        everyone = await usage(app, "admin-carol", "api/usage/suggestions")
        gpus = [s for s in everyone if s.get("user") == "bob" and s["kind"] == "gpus"]
        assert [s["text"] for s in gpus] == [f"holds 2 GPUs, one is never busy in most leases: 1 × {A100} would do"]
        assert gpus[0]["suggested"]["gpus"] == 1
        # the groups' view (admins only): physics is alice
        assert any(s.get("group") == "physics" and s["kind"] == "memory" for s in everyone)
        assert not any("group" in s for s in await usage(app, "bob", "api/usage/suggestions"))

    run_with_broker(tmp_path, scenario, clock)


def test_a_lease_that_ended_while_recording_was_off_is_closed_at_its_end(tmp_path):
    clock = ManualClock(T0)
    ids = {}

    async def on(app, client):
        lease = await client("alice").request_lease({"gpus": 1, "model": "L4", "duration_s": 7200})
        ids["id"] = lease["id"]
        clock.advance(600)
        await client("alice").heartbeat(lease["id"], {"devices": {}})

    async def off(app, client):
        clock.advance(600)
        await client("alice").release(ids["id"])
        clock.advance(3600)

    async def on_again(app, client):
        assert ids["id"] not in app.manager.usage_recorder.live
        await app.manager.flush()
        r = rows_by_key(await usage(app, "alice", since="1d"))["alice"]
        assert r["held_gpu_h"] == pytest.approx(1200 / 3600) and r["leases"] == 1

    run_with_broker(tmp_path, on, clock)
    run_with_broker(tmp_path, off, clock, usage={"record": False})
    run_with_broker(tmp_path, on_again, clock)


def test_the_report_command_reads_the_broker_or_a_store_directly(tmp_path, capsys, monkeypatch):
    from brokerutil import broker_in_thread
    from jupyter_gpulease.broker import usage_cli

    clock = ManualClock(T0)
    monkeypatch.delenv("GPULEASE_TOKEN", raising=False)
    with broker_in_thread(tmp_path, clock=clock, pool=POOL, confirm_timeout_s=0) as app:
        async def work():
            alice = BrokerClient(broker_url(app), "alice")
            lease = await alice.request_lease({"share": 0.5, "model": A100, "duration_s": 7200})
            clock.advance(3600)
            await alice.release(lease["id"])

        asyncio.run(work())
        span = ["--from", str(T0 - 3600), "--to", str(T0 + 86400)]
        assert usage_cli.main(["--url", broker_url(app), "--token", "admin-carol", *span, "--by", "group"]) == 0
        out = capsys.readouterr().out
        lines = out.splitlines()
        assert lines[1].split()[:4] == ["GROUP", "HELD", "GPU-h", "BUSY"]
        assert lines[2].split()[:2] == ["physics", "0.5"] and lines[-1].split()[:2] == ["total", "0.5"]
        assert usage_cli.main(["--url", broker_url(app), "--token", "alice", "--user", "bob"]) == 1
        assert "only an admin" in capsys.readouterr().err
        db = app.db_url
    # the same store read directly, with prices given on the command line
    assert usage_cli.main(["--db", db, *span, "--price", "A100*=4", "--currency", "EUR", "--format", "json", "--suggestions"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["rows"][0]["key"] == "alice" and rep["rows"][0]["cost"] == 2.0 and rep["currency"] == "EUR" and rep["suggestions"] == []
    assert usage_cli.main(["--db", db, "--from", "2020-01-01", "--to", "2019-01-01"]) == 2
    assert "must come before" in capsys.readouterr().err
    assert usage_cli.main(["--db", f"sqlite:///{tmp_path / 'nothing.sqlite'}"]) == 1
    assert "no usage records" in capsys.readouterr().err
