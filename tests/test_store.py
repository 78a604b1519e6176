"""The durable store: leases and events survive a reopen, batches commit all or nothing."""

import pytest
import sqlalchemy

from jupyter_gpulease.core.events import Event
from jupyter_gpulease.core.model import Lease, LeaseState, Placement, Slice, SliceKind
from jupyter_gpulease.core.request import Request, parse_request
from jupyter_gpulease.store import LeaseStore


def make_lease(i=1, user="alice", state=LeaseState.QUEUED, request=None, **kw):
    return Lease(
        id=f"l{i}",
        user=user,
        request=request or Request(kind=SliceKind.GPU, gpus=1),
        tier="experiment",
        duration_s=3600,
        created_at=1000.0 + i,
        seq=i,
        state=state,
        **kw,
    )


def granted(lease, t=2000.0):
    lease.state = LeaseState.ACTIVE
    lease.granted_at = t
    lease.expires_at = t + lease.duration_s
    lease.placement = Placement((Slice("GPU-a", "node1", 0, "A100-80GB", 81920),))
    return Event(lease.id, "granted", t, "queued", "active", reason="free GPU", actor="broker")


def ev(lease, kind, t, frm="", to=""):
    e = Event(lease.id, kind, t, frm, to)
    e.lease = lease
    return e


@pytest.mark.parametrize(
    "body",
    [
        {"gpus": 2, "model": ["A100*", "H100"]},
        {"share": 0.25},
        {"share": 0.5, "memory_mib": 20000, "min_memory_mib": 40000},
        {"memory_mib": 10240},
        {"mig_profile": "1g.10gb", "model": "A100*"},
    ],
)
def test_request_round_trips_through_its_dict(body):
    r = parse_request(body)
    assert Request.from_dict(r.to_dict()) == r


def test_lease_round_trips_with_placement_usage_and_meta():
    lease = make_lease(7, groups=("physics",), max_wait_s=600, meta={"spawner": "x"}, usage={"util": 0.5})
    e = granted(lease)
    lease.confirmed_at = 2001.0
    lease.warned_at = 5000.0
    back = Lease.from_dict(lease.to_dict())
    assert back == lease
    assert e.kind == "granted"


def test_events_and_leases_survive_reopen(tmp_path):
    url = f"sqlite:///{tmp_path / 'leases.sqlite'}"
    store = LeaseStore(url)
    a, b = make_lease(1), make_lease(2, user="bob")
    ids = store.apply([ev(a, "requested", 1001, "", "queued"), ev(b, "requested", 1002, "", "queued")])
    assert [e["id"] for e in ids] == [1, 2]
    g = granted(a)
    g.lease = a
    store.apply([g])
    b.state, b.ended_at, b.end_reason = LeaseState.WITHDRAWN, 1500.0, "changed my mind"
    store.apply([ev(b, "ended", 1500, "queued", "withdrawn")])
    store.close()

    store = LeaseStore(url)
    live = store.load_live()
    assert [lease.id for lease in live] == ["l1"]
    assert live[0] == a
    assert live[0].placement.slices[0].gpu_uuid == "GPU-a"
    assert store.get_lease("l2").state is LeaseState.WITHDRAWN
    assert store.get_lease("nope") is None
    assert [lease.id for lease in store.list_leases(user="bob")] == ["l2"]
    assert [lease.id for lease in store.list_leases(states=["active"])] == ["l1"]
    feed = store.events_since(0)
    assert [e["kind"] for e in feed] == ["requested", "requested", "granted", "ended"]
    assert [e["kind"] for e in store.events_since(2)] == ["granted", "ended"]
    assert [e["kind"] for e in store.events_since(0, lease_id="l2")] == ["requested", "ended"]
    assert [e["lease_id"] for e in store.events_since(0, user="bob")] == ["l2", "l2"]
    assert store.last_event_id() == 4
    store.close()


def test_history_lists_ended_leases_that_held_gpus(tmp_path):
    store = LeaseStore(f"sqlite:///{tmp_path / 'h.sqlite'}")
    a, b, c = make_lease(1), make_lease(2), make_lease(3)
    for lease, end in ((a, 3000.0), (b, 9000.0)):
        granted(lease)
        lease.state, lease.ended_at = LeaseState.RELEASED, end
        store.apply([ev(lease, "ended", end, "active", "released")])
    c.state, c.ended_at = LeaseState.WITHDRAWN, 1100.0  # never held anything
    store.apply([ev(c, "ended", 1100, "queued", "withdrawn")])
    assert [lease.id for lease in store.history(since=0)] == ["l1", "l2"]
    assert [lease.id for lease in store.history(since=5000)] == ["l2"]


def test_a_failing_batch_writes_nothing(tmp_path):
    store = LeaseStore(f"sqlite:///{tmp_path / 't.sqlite'}")
    a = make_lease(1)
    store.apply([ev(a, "requested", 1001, "", "queued")])
    batch = store.snapshot([ev(make_lease(2), "requested", 1002, "", "queued")])
    batch.events.append({"lease_id": None, "kind": "broken", "time": 1.0})  # NOT NULL violation
    with pytest.raises(sqlalchemy.exc.IntegrityError):
        store.write(batch)
    assert store.get_lease("l2") is None
    assert store.last_event_id() == 1


def test_heartbeat_only_changes_are_persisted_without_events(tmp_path):
    store = LeaseStore(f"sqlite:///{tmp_path / 'hb.sqlite'}")
    a = make_lease(1)
    granted(a)
    store.apply([ev(a, "granted", 2000, "queued", "active")])
    a.last_heartbeat, a.usage = 2100.0, {"gpu_util": 37}
    assert store.apply([], leases=[a]) == []
    assert store.get_lease("l1").usage == {"gpu_util": 37}
    assert store.last_event_id() == 1


def test_sqlite_file_uses_wal_and_full_sync(tmp_path):
    store = LeaseStore(f"sqlite:///{tmp_path / 'w.sqlite'}")
    with store.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == 2  # FULL


def test_in_memory_database_works():
    store = LeaseStore("sqlite://")
    a = make_lease(1)
    store.apply([ev(a, "requested", 1001, "", "queued")])
    assert store.load_live() == [a]


def test_in_memory_database_is_shared_across_threads():
    from concurrent.futures import ThreadPoolExecutor

    store = LeaseStore("sqlite://")
    a = make_lease(1)
    with ThreadPoolExecutor(1) as pool:
        pool.submit(store.apply, [ev(a, "requested", 1001, "", "queued")]).result()
    assert store.load_live() == [a]
