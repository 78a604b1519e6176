"""Acknowledge only what is durable: answers, reads and feeds follow the commit.

In-process brokers (the caller named by the token, see brokerutil) whose store can be held
back: a gate in front of ``LeaseStore.write`` lets a test look at what callers see while a
decision is made but not yet on disk.
"""

import asyncio
import json
import threading

import pytest
import sqlalchemy

from brokerutil import ManualClock, broker_url, make_broker, patch_auth
from jupyter_gpulease.client import BrokerClient, BrokerError
from jupyter_gpulease.store import LeaseStore

pytestmark = pytest.mark.timeout(120)

A100_ONLY = [{"node": "n1", "model": "A100-SXM4-80GB", "count": 2, "memory_mib": 81920}]


@pytest.fixture(autouse=True)
def _auth(monkeypatch):
    patch_auth(monkeypatch)


class Gate:
    """Holds every commit of ``store`` until opened."""

    def __init__(self, store):
        self.open_ = threading.Event()
        self.entered = threading.Event()
        self.real = store.write
        store.write = self.write

    def write(self, batch):
        self.entered.set()
        assert self.open_.wait(30), "the test never opened the gate"
        return self.real(batch)

    def open(self):
        self.open_.set()


def on_disk(app, lease_id):
    """The lease as a second connection to the database sees it (what a restart would load)."""
    other = LeaseStore(app.db_url, migrate=False)
    try:
        lease = other.get_lease(lease_id)
        return None if lease is None else lease.state.value
    finally:
        other.close()


def run(tmp_path, scenario, **kw):
    async def main():
        app = make_broker(tmp_path, ManualClock(), **kw)
        await app.start_async()
        try:
            return await scenario(app, lambda user, **c: BrokerClient(broker_url(app), user, **c))
        finally:
            await app.stop_async()

    return asyncio.run(main())


async def until(predicate, timeout=10.0):
    for _ in range(int(timeout / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not met in time")


def test_a_grant_is_answered_only_after_it_is_on_disk(tmp_path):
    async def scenario(app, client):
        gate = Gate(app.store)
        answer = asyncio.ensure_future(client("alice").request_lease({"gpus": 1}))
        await until(gate.entered.is_set)
        await asyncio.sleep(0.3)
        assert not answer.done(), "the broker answered before the grant was committed"
        assert app.manager.scheduler.leases, "the decision is made in memory"
        lease_id = next(iter(app.manager.scheduler.leases))
        assert on_disk(app, lease_id) is None
        gate.open()
        lease = await answer
        assert lease["state"] == "active" and on_disk(app, lease["id"]) == "active"

    run(tmp_path, scenario, pool=A100_ONLY)


def test_reads_see_the_committed_state_while_a_grant_waits_for_the_disk(tmp_path):
    """alice's release grants bob's queued lease in memory; until that is committed every read
    says queued (get and list agree), after it every read says active."""

    async def scenario(app, client):
        alice, bob = client("alice"), client("bob")
        held = await alice.request_lease({"gpus": 2})
        waiting = await bob.request_lease({"gpus": 1})
        assert waiting["state"] == "queued"
        gate = Gate(app.store)
        release = asyncio.ensure_future(alice.release(held["id"]))
        await until(gate.entered.is_set)
        assert app.manager.scheduler.leases[waiting["id"]].state.value == "active"  # decided…
        assert (await bob.get_lease(waiting["id"]))["state"] == "queued"  # …not yet answered
        assert [x["state"] for x in await bob.list_leases(state="all")] == ["queued"]
        assert [x["id"] for x in await bob.list_leases(state="active")] == []
        events = await bob.events(0, timeout=0)
        assert [e["kind"] for e in events["events"]] == ["requested"], "the feed carried an uncommitted grant"
        gate.open()
        assert (await release)["state"] == "released"
        got = await bob.get_lease(waiting["id"])
        assert got["state"] == "active" and on_disk(app, waiting["id"]) == "active"
        assert [x["state"] for x in await bob.list_leases(state="all")] == ["active"]

    run(tmp_path, scenario, pool=A100_ONLY)


def test_a_refusal_that_read_a_pending_end_waits_for_that_end_to_commit(tmp_path):
    async def scenario(app, client):
        alice = client("alice")
        lease = await alice.request_lease({"gpus": 1})
        gate = Gate(app.store)
        first = asyncio.ensure_future(alice.release(lease["id"]))
        await until(gate.entered.is_set)
        second = asyncio.ensure_future(BrokerClient(broker_url(app), "alice", retry_for=0).extend(lease["id"], by_s=60))
        await asyncio.sleep(0.3)
        assert not second.done(), "'already ended' was answered before the end was on disk"
        gate.open()
        await first
        with pytest.raises(BrokerError) as info:
            await second
        assert info.value.status == 409 and on_disk(app, lease["id"]) == "released"

    run(tmp_path, scenario, pool=A100_ONLY)


def test_decisions_that_arrive_while_the_disk_is_busy_commit_together(tmp_path):
    from tornado.httpclient import AsyncHTTPClient

    AsyncHTTPClient.configure(None, max_clients=100)  # tornado's default: 10 requests at a time

    async def scenario(app, client):
        gate = Gate(app.store)
        before = app.manager.commits
        first = asyncio.ensure_future(client("user0").request_lease({"share": 0.01}))
        await until(gate.entered.is_set)
        rest = [asyncio.ensure_future(client(f"user{i}").request_lease({"share": 0.01})) for i in range(1, 40)]
        await until(lambda: len(app.manager.scheduler.leases) == 40)
        gate.open()
        leases = await asyncio.gather(first, *rest)
        assert all(x["state"] == "active" for x in leases)
        assert app.manager.commits - before <= 3, f"{app.manager.commits - before} commits for 40 requests"
        assert app.store.count_leases() == 40

    run(tmp_path, scenario, pool=[{"node": "n1", "model": "L4", "count": 1, "memory_mib": 23034}])


def test_a_failed_commit_answers_503_and_stops_the_broker_instead_of_going_on(tmp_path):
    async def scenario(app, client):
        def broken(batch):
            raise sqlalchemy.exc.OperationalError("INSERT", {}, Exception("disk I/O error"))

        app.store.write = broken
        alice = client("alice", retry_for=0)
        with pytest.raises(BrokerError) as info:
            await alice.request_lease({"gpus": 1})
        assert info.value.status == 503 and "stopping" in info.value.message
        assert "disk I/O error" in str(app.lost_database)  # the manager told the app, which ends a broker process
        with pytest.raises(BrokerError) as info:
            await alice.request_lease({"gpus": 1})
        assert info.value.status == 503
        assert app.store.count_leases() == 0

    run(tmp_path, scenario, pool=A100_ONLY)


def test_a_retried_request_with_its_idempotency_key_makes_one_lease_also_across_a_restart(tmp_path):
    from tornado.httpclient import AsyncHTTPClient

    async def post(app, key, body=b'{"gpus": 1}', user="alice"):
        r = await AsyncHTTPClient().fetch(broker_url(app) + "api/leases", method="POST", body=body, raise_error=False,
                                          headers={"Authorization": f"token {user}", "Idempotency-Key": key})
        return r.code, r.body

    async def first(app, client):
        a = await post(app, "k-1")
        b = await post(app, "k-1")
        assert a[0] == 201 and a[1] == b[1]
        assert app.store.count_leases() == 1
        code, _ = await post(app, "k-1", user="bob")
        assert code == 201  # keys are per caller: bob's "k-1" is his own
        assert app.store.count_leases() == 2
        return a[1]

    body = run(tmp_path, first, pool=A100_ONLY)

    async def again(app, client):
        code, same = await post(app, "k-1")
        assert code in (200, 201) and json.loads(same)["id"] == json.loads(body)["id"]
        assert app.store.count_leases() == 2

    run(tmp_path, again, pool=A100_ONLY)


def test_a_standby_takes_over_when_the_active_broker_stops(tmp_path):
    """Two brokers on one SQLite file: the second waits on the lock, then serves every lease."""

    async def main():
        a = make_broker(tmp_path, ManualClock(), pool=A100_ONLY)
        b = make_broker(tmp_path, ManualClock(), pool=A100_ONLY)
        assert await a.start_async()
        lease = await BrokerClient(broker_url(a), "alice").request_lease({"gpus": 1})
        standby = asyncio.ensure_future(b.start_async())
        await asyncio.sleep(0.5)
        assert not standby.done(), "the standby started while the active broker held the lock"
        await a.stop_async()
        assert await asyncio.wait_for(standby, 20)
        try:
            got = await BrokerClient(broker_url(b), "alice").get_lease(lease["id"])
            assert got["state"] == "active" and got["placement"] == lease["placement"]
        finally:
            await b.stop_async()

    asyncio.run(main())


def test_old_events_of_ended_leases_are_pruned_and_live_ones_kept(tmp_path):
    async def scenario(app, client):
        alice = client("alice")
        old = await alice.request_lease({"gpus": 1})
        await alice.release(old["id"])
        live = await alice.request_lease({"gpus": 1})
        app.clock.advance(40 * 86400)
        n = await app.manager.prune_events(30 * 86400)
        assert n == 3  # requested, granted and ended of the released lease
        kinds = [(e["lease_id"], e["kind"]) for e in (await client("admin").events(0, timeout=0))["events"]]
        assert all(lid == live["id"] for lid, _ in kinds) and kinds
        assert (await alice.get_lease(old["id"]))["state"] == "released"  # the lease row stays

    run(tmp_path, scenario, pool=A100_ONLY)


def test_a_release_and_the_reads_after_it_come_from_memory_and_older_ends_from_disk(tmp_path):
    """The answer to a release, and reads of a lease that ended lately, are the committed end
    kept in memory (no database read per release); past the bound, the database answers."""
    from tornado.httpclient import AsyncHTTPClient

    async def scenario(app, client):
        alice = client("alice")
        app.manager.reads.recently_ended_max = 2
        reads = []
        real = app.store.get_lease_dict
        app.store.get_lease_dict = lambda lid: reads.append(lid) or real(lid)
        leases = [await alice.request_lease({"share": 0.25}) for _ in range(3)]
        ended = [await alice.release(x["id"]) for x in leases]
        assert [x["state"] for x in ended] == ["released"] * 3 and reads == []
        assert all(on_disk(app, x["id"]) == "released" for x in leases)
        assert (await alice.get_lease(leases[2]["id"]))["end_message"] == ended[2]["end_message"]
        assert (await alice.get_lease(leases[1]["id"]))["state"] == "released" and reads == []
        oldest = await alice.get_lease(leases[0]["id"])  # no longer among the 2 kept
        assert reads == [leases[0]["id"]] and oldest["state"] == "released"
        assert oldest["end_message"] == ended[0]["end_message"]
        # API answers are not cached (no-store), so no ETag is computed for them
        r = await AsyncHTTPClient().fetch(f"{broker_url(app)}api/leases/{leases[1]['id']}", headers={"Authorization": "token alice"})
        assert r.headers.get("Cache-Control") == "no-store" and "Etag" not in r.headers

    run(tmp_path, scenario, pool=[{"node": "n1", "model": "L4", "count": 1, "memory_mib": 23034}])


def test_the_broker_process_tunes_the_garbage_collector_once_it_serves():
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", "import gc; from jupyter_gpulease.broker.app import tune_gc, GC_THRESHOLDS as T; tune_gc(); "
         "print(gc.get_threshold() == T, gc.get_freeze_count() > 1000)"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert out.stdout.split() == ["True", "True"]


def test_the_broker_process_hands_the_gil_back_to_its_loop_within_a_millisecond_once_it_serves():
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", "import sys; from jupyter_gpulease.broker.app import tune_switching, SWITCH_INTERVAL_S as S; "
         "before = sys.getswitchinterval(); tune_switching(); print(before, sys.getswitchinterval() == S == 0.001)"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert out.stdout.split() == ["0.005", "True"]
