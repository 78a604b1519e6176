"""The broker's parts, each built alone with fakes (no broker application, and no lease manager
where the part does not take one): the group commit over a real in-memory store and a real
scheduler, the view of committed state, the periodic jobs, the hub side, the orphan hand-over's
decision, the device samples and the sample they share with the unleased-use check, and the
metrics and alerts given a fake device telemetry, health keeper and unleased detector."""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import pytest
import sqlalchemy

from jupyter_gpulease.broker.alerts import BrokerAlerts, Thresholds, evaluate
from jupyter_gpulease.broker.commit import GroupCommit, Unavailable
from jupyter_gpulease.broker.feed import Feed
from jupyter_gpulease.broker.hubapi import RECONCILE_REASON
from jupyter_gpulease.broker.hubside import HubSide
from jupyter_gpulease.broker.jobs import PeriodicJobs
from jupyter_gpulease.broker.manager import LeaseManager
from jupyter_gpulease.broker.metrics import BrokerMetrics, count_events
from jupyter_gpulease.broker.orphan import ORPHAN_STANDBY_GRACE_S, OrphanHandover
from jupyter_gpulease.broker.reads import LeaseReads
from jupyter_gpulease.broker.telemetry import DeviceTelemetry, SharedSample
from jupyter_gpulease.client import BrokerError
from jupyter_gpulease.core.events import ENDED, GRANTED
from jupyter_gpulease.core.model import LeaseState
from jupyter_gpulease.core.policy import Policy
from jupyter_gpulease.core.request import SPAWNER_META, Ask, parse_request
from jupyter_gpulease.core.scheduler import Scheduler
from jupyter_gpulease.devices.base import DeviceHealth, DeviceSample
from jupyter_gpulease.devices.declared import parse_inventory
from jupyter_gpulease.store import Batch, LeaseStore
from jupyter_gpulease.tasks import BackgroundTasks

T0 = 1_700_000_000.0


def run(coro_fn):
    """A test body written as a coroutine, run on its own event loop."""

    @functools.wraps(coro_fn)
    def wrapper(*args, **kwargs):
        return asyncio.run(coro_fn(*args, **kwargs))

    return wrapper


def pool(count: int = 2):
    return parse_inventory([{"node": "n1", "model": "L4", "count": count, "memory_mib": 23034}])


class Clock:
    def __init__(self, t: float = T0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def granted(sched: Scheduler, user: str = "alice", lease_id: str = "L1", now: float = T0, **ask: Any):
    """A lease ``user`` asked for and got (decided by the scheduler alone, nothing committed)."""
    lease = sched.new_lease(Ask(user=user, request=parse_request({"gpus": 1}), **ask), now, lease_id=lease_id)
    events = sched.submit(lease, now, actor=user) + sched.tick(now)
    return lease, events


# ---------------------------------------------------------------------- the group commit
class CommitRig:
    """A GroupCommit over an in-memory LeaseStore and a Scheduler, recording what it hands on."""

    def __init__(self, **kw):
        self.sched = Scheduler(pool(), Policy(confirm_timeout_s=None))
        self.store = LeaseStore("sqlite://")
        self.writer = ThreadPoolExecutor(1)
        self.clock = Clock()
        self.committed: list[tuple[Batch, list, list]] = []
        self.failed: list[BaseException] = []
        self.answered_before_committed = False
        self.waiting: list[asyncio.Future] = []
        self.commit = GroupCommit(self.sched, self.store, writer=self.writer, now=self.clock, on_committed=self.on_committed,
                                  on_fail=self.failed.append, **kw)

    def on_committed(self, batch, written, events) -> None:
        self.answered_before_committed |= any(f.done() for f in self.waiting)
        self.committed.append((batch, written, events))

    async def start(self) -> None:
        await self.in_writer(self.store.upgrade)
        self.commit.start()

    async def in_writer(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.writer, fn, *args)

    async def close(self) -> None:
        await self.commit.close()
        self.writer.shutdown(wait=True)


@run
async def test_the_group_commit_writes_staged_decisions_in_one_transaction_then_hands_them_on():
    rig = CommitRig(count_totals=count_events)
    await rig.start()
    answers = []
    for i in range(3):
        lease = rig.sched.new_lease(Ask(user=f"u{i}", request=parse_request({"share": 0.25})), T0, lease_id=f"L{i}")
        answers.append(rig.commit.stage(rig.sched.submit(lease, T0, actor=f"u{i}"), [lease], key=f"key-{i}"))
    rig.waiting = answers
    await asyncio.gather(*answers)
    assert rig.commit.commits == 1 and len(rig.committed) == 1  # three decisions, one transaction
    batch, written, events = rig.committed[0]
    assert not rig.answered_before_committed  # the answers go out after on_committed
    assert {lid: d["state"] for lid, d in batch.leases.items()} == {"L0": "active", "L1": "active", "L2": "active"}  # granted by the pass
    assert [e.kind for e in events].count(GRANTED) == 3 and len(written) == len(events)
    assert batch.totals[("grants", ("experiment",))] == 3  # the durable counters, written with the events
    assert (await rig.in_writer(rig.store.get_lease_dict, "L1"))["state"] == "active"
    assert await rig.in_writer(rig.store.find_request_key, "key-2") == "L2"
    await rig.close()


@run
async def test_the_group_commit_keeps_what_an_end_does_not_say_with_the_ended_lease():
    rig = CommitRig()
    await rig.start()
    lease, events = granted(rig.sched)
    await rig.commit.stage(events, [lease])
    rig.commit.keep_server("L1")
    await rig.commit.stage(rig.sched.release("L1", T0 + 60, reason="done", actor="admin:carol"), [lease])
    ended = rig.committed[-1][0].leases["L1"]
    assert ended["state"] == "released" and ended["keep_server"] is True and ended["end_info"] == {"actor": "admin:carol"}
    assert rig.commit.end_extra == {}  # forgotten once the end is on disk
    await rig.close()


@run
async def test_a_failed_commit_answers_503_tells_on_fail_and_takes_no_more_decisions():
    rig = CommitRig()
    await rig.start()

    def broken(batch):
        raise sqlalchemy.exc.OperationalError("INSERT", {}, Exception("disk I/O error"))

    rig.store.write = broken
    lease, events = granted(rig.sched)
    with pytest.raises(Unavailable):
        await rig.commit.stage(events, [lease])
    assert "disk I/O error" in str(rig.failed[0]) and rig.commit.failed is rig.failed[0] and rig.committed == []
    with pytest.raises(Unavailable):
        rig.commit.stage([], tick=True)
    await rig.close()


@run
async def test_a_closed_group_commit_writes_what_was_staged_and_refuses_the_rest():
    rig = CommitRig()
    await rig.start()
    lease, events = granted(rig.sched)
    staged = rig.commit.stage(events, [lease])
    await rig.commit.close()
    assert staged.done() and (await rig.in_writer(rig.store.get_lease_dict, "L1"))["state"] == "active"
    with pytest.raises(Unavailable, match="stopping"):
        rig.commit.stage([], tick=True)
    rig.writer.shutdown(wait=True)


# ---------------------------------------------------------------------- the reads
class FakeStore:
    """The store's reads as LeaseReads makes them, recorded."""

    def __init__(self, leases: dict[str, dict] | None = None):
        self.leases = leases or {}
        self.reads: list[str] = []

    def get_lease_dict(self, lease_id):
        self.reads.append(lease_id)
        return self.leases.get(lease_id)


def reads_rig(**kw):
    sched = Scheduler(pool(), Policy(confirm_timeout_s=None, warn_before_s=600))
    store = FakeStore()
    flushed: list[bool] = []
    reads: LeaseReads | None = None
    pending: list[Batch] = []

    async def flush():  # the group commit's flush: what is pending is on disk now
        flushed.append(True)
        for b in pending:
            reads.apply(b)
        pending.clear()

    reads = LeaseReads(sched, store, readers=ThreadPoolExecutor(1), feed=Feed(), flush=flush, now=Clock(T0 + 3300), **kw)
    return SimpleNamespace(sched=sched, store=store, reads=reads, flushed=flushed, pending=pending)


@run
async def test_reads_see_committed_state_and_wait_for_a_pending_first_commit():
    r = reads_rig(recently_ended_max=1)
    lease, _ = granted(r.sched, lease_id="L1", duration_s=3600)
    r.pending.append(Batch(leases={"L1": lease.to_dict()}, totals={("grants", ("experiment",)): 1.0}, at=T0))
    assert (await r.reads.get("L1"))["state"] == "active" and r.flushed == [True]  # waited for its commit, then read memory
    assert r.reads.totals == {("grants", ("experiment",)): [1.0, T0]}
    assert [d["id"] for d in r.reads.live("alice")] == ["L1"] and r.store.reads == []
    ended = [dict(lease.to_dict(), id=lid, state="released", ended_at=T0 + 10) for lid in ("E1", "E2")]
    for d in ended:
        r.reads.apply(Batch(leases={d["id"]: d}))
    assert list(r.reads.recently_ended) == ["E2"]  # bounded: the oldest end is out
    assert (await r.reads.get("E2"))["state"] == "released" and r.store.reads == []
    r.store.leases["E1"] = ended[0]
    assert (await r.reads.get("E1"))["state"] == "released" and r.store.reads == ["E1"]  # past the bound, the store answers


@run
async def test_a_holder_is_warned_by_the_lease_itself_then_by_each_warning_source_in_order():
    r = reads_rig()
    lease, _ = granted(r.sched, duration_s=3600)
    d = lease.to_dict()
    r.reads.warn_from(lambda d: [{"kind": "unleased_use", "user": d["user"]}], lambda d: [{"kind": "maintenance"}])
    assert [w["kind"] for w in r.reads.warnings(d)] == ["expiring", "unleased_use", "maintenance"]  # 300 s left, warned 600 s ahead
    ended = dict(d, state="preempted", ended_at=T0 + 100, end_info={"actor": "broker", "preempted_for": {"tier": "interactive", "user": "bob"}})
    assert [w["kind"] for w in r.reads.warnings(ended)] == ["ended"]  # the sources are not asked about an end
    shown = r.reads.lease_json(ended, viewer="alice", admin=False)
    assert "end_info" not in shown and shown["ended_by"] == {"kind": "preemption", "tier": "interactive"}  # no other user's name
    assert "interactive" in shown["end_message"] and shown["keep_server"] is False


# ---------------------------------------------------------------------- the periodic jobs
class FakeManager:
    """What the periodic jobs ask of the lease manager, recorded."""

    def __init__(self, pruned: list[int] | None = None):
        self.calls: list[tuple] = []
        self.pruned = list(pruned or [])

    async def tick(self):
        self.calls.append(("tick",))

    async def prune_events(self, retention_s):
        self.calls.append(("prune_events", retention_s))
        if not self.pruned:
            raise RuntimeError("database gone")
        return self.pruned.pop(0)

    async def prune_usage_samples(self, retention_s):
        self.calls.append(("prune_usage_samples", retention_s))
        return 0

    async def check_lock(self):
        self.calls.append(("check_lock",))

    async def set_inventory(self, gpus):
        self.calls.append(("set_inventory", [g.uuid for g in gpus]))
        return [SimpleNamespace(kind=ENDED)]


class FakeBackend:
    def __init__(self, gpus):
        self.gpus = gpus
        self.fail = False

    def inventory(self):
        if self.fail:
            raise OSError("the API server did not answer")
        return list(self.gpus)


@run
async def test_the_periodic_jobs_apply_a_changed_pool_only_and_keep_it_when_the_backend_fails(caplog):
    gpus = pool(2)
    manager, backend = FakeManager(), FakeBackend(gpus)
    jobs = PeriodicJobs(manager, backend=backend, tasks=BackgroundTasks(), inventory=gpus, inventory_s=15, backend_name="kubernetes")
    await jobs.refresh_inventory()
    assert manager.calls == []  # the same pool: nothing to apply
    backend.gpus = gpus[:1]
    await jobs.refresh_inventory()
    assert manager.calls == [("set_inventory", [gpus[0].uuid])] and jobs.inventory == gpus[:1]
    backend.fail = True
    with caplog.at_level(logging.WARNING):
        await jobs.refresh_inventory()
    assert jobs.inventory == gpus[:1] and "Pool not re-read from the 'kubernetes' device backend" in caplog.text


@run
async def test_the_periodic_jobs_start_what_the_config_asks_and_run_some_once_at_start(caplog):
    manager = FakeManager(pruned=[3])
    tasks = BackgroundTasks()
    hub_checks: list[bool] = []

    async def hub_check():
        hub_checks.append(True)

    jobs = PeriodicJobs(manager, backend=FakeBackend(pool()), tasks=tasks, tick_s=3600, hub_check=hub_check, reconcile_s=300,
                        event_retention_days=30, lock_check=True)
    with caplog.at_level(logging.INFO):
        jobs.start()
        await asyncio.gather(*tasks)
    try:
        assert len(jobs.periodic) == 4 and all(p.is_running() for p in jobs.periodic)  # ticks, hub check, pruning, lock check
        assert hub_checks == [True] and ("prune_events", 30 * 86400) in manager.calls
        assert "Deleted 3 event(s) of ended leases older than 30 days" in caplog.text
        await jobs.prune_events()  # a failure is logged, not raised: the job runs again at its turn
        assert "pruning old events failed" in caplog.text
    finally:
        jobs.stop()
    assert not any(p.is_running() for p in jobs.periodic)


# ---------------------------------------------------------------------- the hub side
class FakeHub:
    """The Hub API client as the hub side calls it."""

    def __init__(self, users: dict[str, Any] | None = None, groups: list[str] | None = None):
        self.users = users or {}
        self.group_names = groups or []
        self.stopped: list[tuple[str, str]] = []
        self.down = False

    async def user(self, name):
        if self.down:
            raise BrokerError(0, "the hub did not answer")
        return self.users.get(name)

    async def groups(self):
        return list(self.group_names)

    async def stop_server(self, user, server=""):
        self.stopped.append((user, server))


class LeasesOnly:
    """The manager as the hub side's check uses it: live leases, the clock, release."""

    def __init__(self, leases, clock):
        self.leases = {d["id"]: d for d in leases}
        self.clock = clock
        self.released: list[tuple[str, LeaseState, str]] = []

    def live(self):
        return list(self.leases.values())

    def now(self):
        return self.clock()

    async def release(self, lease_id, *, state, reason, actor):
        self.released.append((lease_id, state, reason))
        return self.leases.pop(lease_id)


def hub_side(hub, manager=None, **kw):
    policy = SimpleNamespace(tiers={"gpu": SimpleNamespace(name="gpu", groups=("physics", "typo-grp"))}, group_quotas={})  # as the check reads it
    return HubSide(manager, policy, hub=lambda: hub, tasks=BackgroundTasks(), **kw)


@run
async def test_the_hub_side_reads_groups_and_users_from_the_hub():
    hub = FakeHub({"alice": {"name": "alice", "groups": ["physics"]}})
    side = hub_side(hub)
    assert await side.user_groups("alice") == ("physics",) and await side.user_groups("nobody") == ()
    assert await side.user_exists("alice") is True and await side.user_exists("nobody") is False
    hub.down = True
    assert await side.user_exists("alice") is None  # the hub did not say


@run
async def test_the_hub_side_stops_the_server_of_a_lease_the_broker_ended_only_when_asked():
    hub = FakeHub()
    lease = SimpleNamespace(user="alice", server="gpu", meta={})
    expired = SimpleNamespace(kind=ENDED, from_state="active", to_state="expired", lease=lease)
    released = SimpleNamespace(kind=ENDED, from_state="active", to_state="released", lease=lease)
    # bob's lease moved off a sick GPU: his server's kernels take a healthy one, his spawner decides
    moved = SimpleNamespace(kind=ENDED, from_state="active", to_state="revoked",
                            lease=SimpleNamespace(user="bob", server="", meta={"health": {"device": "GPU-1", "action": "drain_now"}}))
    hub_side(hub).on_events([], [expired])  # stop_servers_on_end is off by default
    side = hub_side(hub, stop_servers_on_end=True)
    side.on_events([], [expired, released, moved])
    await asyncio.gather(*side.tasks)
    assert hub.stopped == [("alice", "gpu")]  # the holder's own release stops nothing, nor a move


@run
async def test_the_hub_side_ends_a_spawners_lease_whose_server_is_gone_after_the_grace(caplog):
    clock = Clock()
    lease = {"id": "L1", "user": "alice", "server": "", "meta": {"spawner": SPAWNER_META}, "granted_at": T0, "created_at": T0}
    other = {"id": "L2", "user": "bob", "server": "", "meta": {}, "granted_at": T0, "created_at": T0}  # not a spawner's: never checked
    manager = LeasesOnly([lease, other], clock)
    hub = FakeHub({"alice": {"name": "alice", "servers": {}}}, groups=["physics"])
    side = hub_side(hub, manager, reconcile_grace=120)
    assert await side.reconcile() == []
    clock.t += 121
    assert await side.reconcile() == ["L1"] and manager.released == [("L1", LeaseState.REVOKED, RECONCILE_REASON)]
    with caplog.at_level(logging.INFO):
        await side.check_hub_groups()
        await side.check_hub_groups()
        hub.group_names.append("typo-grp")
        await side.check_hub_groups()
    assert caplog.text.count("the hub has no group 'typo-grp'") == 1 and "the hub has the group 'typo-grp' now" in caplog.text


# ---------------------------------------------------------------------- the orphan hand-over
class HandoverStore:
    def __init__(self, leader: bool = True):
        self.leader = leader
        self.waiting = False

    def successor_waiting(self):
        return self.waiting

    def describe(self):
        return "sqlite:///test"


def orphan(store, clock, **kw):
    stops: list[bool] = []

    async def in_writer(fn, *args):
        return fn(*args)

    o = OrphanHandover(store, in_writer=in_writer, stop=lambda: stops.append(True), worker=True, clock=clock, **kw)
    return o, stops


@run
async def test_a_standby_whose_supervisor_died_stops_at_once():
    o, stops = orphan(HandoverStore(leader=False), Clock(), hub_api_url="")
    o.supervisor_gone()
    assert stops == [True] and o.successor_check is None


@run
async def test_an_orphan_hands_over_to_a_waiting_broker_once_its_old_standby_is_surely_gone():
    store, clock = HandoverStore(), Clock(1000.0)
    o, stops = orphan(store, clock, hub_api_url="")
    o.supervisor_gone()
    o.successor_check.stop()  # the test drives the checks itself
    store.waiting = True
    await o.check_successor()
    assert stops == []  # a waiter this early may be the old supervisor's standby, stopping
    clock.t += ORPHAN_STANDBY_GRACE_S + 0.1
    await o.check_successor()
    assert stops == [True]


@run
async def test_an_orphan_that_saw_nobody_waiting_hands_over_to_the_next_waiter_at_once():
    store, clock = HandoverStore(), Clock(1000.0)
    o, stops = orphan(store, clock, hub_api_url="")
    o.supervisor_gone()
    o.successor_check.stop()
    await o.check_successor()
    assert o.waiter_gone and stops == []
    store.waiting = True
    await o.check_successor()
    assert stops == [True]


@run
async def test_an_orphan_whose_hub_stopped_answering_stops_after_the_grace():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    clock = Clock(1000.0)
    o, stops = orphan(HandoverStore(), clock, hub_api_url=f"http://127.0.0.1:{port}/hub/api", hub_grace_s=10)
    o.supervisor_gone()
    o.successor_check.stop()
    clock.t += 5
    await o.check_successor()
    assert stops == []  # not answering for 5 s only
    clock.t += 6
    await o.check_successor()
    assert stops == [True]


# ---------------------------------------------------------------------- device samples
class FakeDevices:
    """A device backend whose figures the test sets; each sample is made of new objects, as a real one's."""

    name = "fake"

    def __init__(self, figures: dict[str, dict[str, Any]]):
        self.figures = figures
        self.calls = 0

    def sample(self):
        self.calls += 1
        self.t = getattr(self, "t", T0) + 15
        return {uuid: DeviceSample(uuid, self.t, **f) for uuid, f in self.figures.items()}


@run
async def test_the_device_samples_keep_what_did_not_change_and_count_each_new_xid_once():
    gpus = pool(2)
    a, b = (g.uuid for g in gpus)
    backend = FakeDevices({a: {"temperature_c": 40.0}, b: {"temperature_c": 41.0}, "GPU-not-in-the-pool": {}})
    heard = []
    telemetry = DeviceTelemetry(SimpleNamespace(inventory=lambda: gpus), backend, listeners=[heard.append])
    await telemetry.sample()
    first = telemetry.samples
    assert set(first) == {a, b} and first[a].temperature_c == 40.0 and heard == [telemetry]

    await telemetry.sample()  # the same figures, taken later: the same objects, the same dict
    assert telemetry.samples is first and telemetry.samples[a] is first[a] and len(heard) == 2

    backend.figures[b] = {"temperature_c": 41.0, "health": DeviceHealth(xid=79, xid_count=1, xids=((79, 1),))}
    await telemetry.sample()
    assert telemetry.samples[a] is first[a] and telemetry.samples[b] is not first[b]
    assert telemetry.samples[b].health.xid == 79 and telemetry.xids == {(b, 79): 1.0}
    await telemetry.sample()  # the same count again: nothing new
    assert telemetry.xids == {(b, 79): 1.0}
    backend.figures[b] = {"temperature_c": 41.0, "health": DeviceHealth(xid=79, xid_count=2, xids=((79, 2),))}
    await telemetry.sample()
    assert telemetry.xids == {(b, 79): 2.0} and len(heard) == 5 and backend.calls == 5

    telemetry.observe({a: DeviceSample(a, T0, temperature_c=70.0)})  # a sample given on the loop: b is gone from it
    assert set(telemetry.samples) == {a} and telemetry.samples[a].temperature_c == 70.0


def test_callers_that_ask_while_a_sample_of_the_pool_is_under_way_share_it():
    entered, release = threading.Event(), threading.Event()

    class Slow(FakeDevices):
        def sample(self):
            entered.set()
            release.wait(10)
            if self.figures is None:
                self.calls += 1
                raise RuntimeError("the driver did not answer")
            return super().sample()

    backend = Slow({"GPU-1": {"temperature_c": 40.0}})
    shared = SharedSample(backend)
    assert shared.name == "fake"
    with ThreadPoolExecutor(2) as pool_:
        first = pool_.submit(shared.sample)
        assert entered.wait(10)
        second = pool_.submit(shared.sample)  # asks while the first is under way
        threading.Timer(0.3, release.set).start()
        assert first.result(10) is second.result(10) and backend.calls == 1
        assert shared.sample() is not first.result() and backend.calls == 2  # nothing under way: a sample of its own

        entered.clear()
        release.clear()
        backend.figures = None
        first = pool_.submit(shared.sample)
        assert entered.wait(10)
        second = pool_.submit(shared.sample)
        threading.Timer(0.3, release.set).start()
        for f in (first, second):
            with pytest.raises(RuntimeError, match="did not answer"):
                f.result(10)
        assert backend.calls == 3


# ---------------------------------------------------------------------- metrics and alerts
class FakeTelemetry:
    def __init__(self, samples, xids=None):
        self.samples = samples
        self.xids = xids or {}
        self.sampled_at = 1.0
        self.started_at = T0

    def current(self):
        return self.samples


class FakeHealth:
    def __init__(self, raw, cordoned: dict[str, str]):
        self.raw = raw
        self.cordoned = cordoned

    def cordon_of(self, gpu):
        reason = self.cordoned.get(gpu.uuid)
        return {"reason": reason, "mode": "cordon"} if reason else None


def sample_value(text: str, series: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


@run
async def test_metrics_and_alerts_read_the_telemetry_health_keeper_and_detector_they_are_given():
    gpus = pool(2)
    manager = LeaseManager(Scheduler(gpus), LeaseStore("sqlite://"), clock=SimpleNamespace(now=lambda: T0))  # not started: no leases
    hot, cool = gpus
    telemetry = FakeTelemetry({hot.uuid: DeviceSample(hot.uuid, T0, temperature_c=88.0, temperature_slowdown_c=90.0, health=DeviceHealth()),
                               cool.uuid: DeviceSample(cool.uuid, T0, temperature_c=40.0, temperature_slowdown_c=90.0)},
                              xids={(hot.uuid, 79): 1.0})
    health = FakeHealth(gpus, {cool.uuid: "fan failure"})
    unleased = SimpleNamespace(findings=[{"model": "L4", "gpu_uuid": hot.uuid, "owner": "mallory", "used_memory_mib": 512}])
    text = (await BrokerMetrics(manager, telemetry=telemetry, health=health, unleased=unleased).render()).decode()
    where = f'model="L4",node="n1",uuid="{hot.uuid}"'
    assert sample_value(text, f"gpulease_device_temperature_celsius{{{where}}}") == 88.0
    assert sample_value(text, f'gpulease_device_xid_errors_total{{kind="device",{where},xid="79"}}') == 1.0
    assert sample_value(text, f'gpulease_device_cordoned{{model="L4",node="n1",uuid="{cool.uuid}"}}') == 1.0
    assert sample_value(text, 'gpulease_unleased_processes{model="L4"}') == 1.0
    bare = (await BrokerMetrics(manager).render()).decode()  # none of them runs
    assert "gpulease_device_temperature_celsius{" not in bare and sample_value(bare, 'gpulease_unleased_processes{model="L4"}') == 0.0
    assert sample_value(bare, f'gpulease_device_cordoned{{model="L4",node="n1",uuid="{cool.uuid}"}}') == 0.0

    fired = {(a.name, a.key) for a in evaluate(manager, Thresholds(), T0, telemetry=telemetry, health=health, unleased=unleased)}
    assert fired == {("GPULeaseGPUHot", hot.uuid), ("GPULeaseDeviceCordoned", cool.uuid), ("GPULeaseUnleasedUse", hot.uuid)}
    assert evaluate(manager, Thresholds(), T0) == []
    alerts = BrokerAlerts(manager, [], telemetry=telemetry, health=health, unleased=unleased)
    assert {a.name for a in await alerts.check()} == {"GPULeaseGPUHot", "GPULeaseDeviceCordoned", "GPULeaseUnleasedUse", "GPULeaseCriticalXID"}
    await manager.close()
