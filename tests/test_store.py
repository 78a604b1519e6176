"""The durable store: leases and events survive a reopen, batches commit all or nothing,
schemas are upgraded, one broker leads. Every test that takes ``db_url`` runs against a SQLite
file and against a real PostgreSQL server (tests/pgserver.py)."""

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


def test_events_and_leases_survive_reopen(db_url):
    url = db_url
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


def test_history_lists_ended_leases_that_held_gpus(db_url):
    store = LeaseStore(db_url)
    a, b, c = make_lease(1), make_lease(2), make_lease(3)
    for lease, end in ((a, 3000.0), (b, 9000.0)):
        granted(lease)
        lease.state, lease.ended_at = LeaseState.RELEASED, end
        store.apply([ev(lease, "ended", end, "active", "released")])
    c.state, c.ended_at = LeaseState.WITHDRAWN, 1100.0  # never held anything
    store.apply([ev(c, "ended", 1100, "queued", "withdrawn")])
    assert [lease.id for lease in store.history(since=0)] == ["l1", "l2"]
    assert [lease.id for lease in store.history(since=5000)] == ["l2"]


def test_a_failing_batch_writes_nothing(db_url):
    store = LeaseStore(db_url)
    a = make_lease(1)
    store.apply([ev(a, "requested", 1001, "", "queued")])
    batch = store.snapshot([ev(make_lease(2), "requested", 1002, "", "queued")])
    batch.events.append({"lease_id": None, "kind": "broken", "time": 1.0})  # NOT NULL violation
    with pytest.raises(sqlalchemy.exc.IntegrityError):
        store.write(batch)
    assert store.get_lease("l2") is None
    assert store.last_event_id() == 1


def test_heartbeat_only_changes_are_persisted_without_events(db_url):
    store = LeaseStore(db_url)
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


def test_a_retried_calls_key_finds_the_lease_it_changed(db_url):
    store = LeaseStore(db_url)
    a = make_lease(1)
    batch = store.snapshot([ev(a, "requested", 1001, "", "queued")])
    batch.events[0]["request_key"] = "alice:k1"
    (written,) = store.write(batch)
    assert "request_key" not in written
    assert store.find_request_key("alice:k1") == "l1"
    assert store.find_request_key("alice:k2") is None
    store.close()


def test_old_events_of_ended_leases_are_pruned_and_lease_rows_kept(db_url):
    store = LeaseStore(db_url)
    done, live = make_lease(1), make_lease(2)
    store.apply([ev(done, "requested", 1000, "", "queued"), ev(live, "requested", 1000, "", "queued")])
    done.state, done.ended_at = LeaseState.WITHDRAWN, 1100.0
    store.apply([ev(done, "ended", 1100, "queued", "withdrawn")])
    store.apply([ev(make_lease(3), "requested", 1200, "", "queued")])
    assert store.prune_events(before=5000) == 2
    assert [e["lease_id"] for e in store.events_since(0)] == ["l2", "l3"]
    assert store.get_lease("l1").state is LeaseState.WITHDRAWN
    assert store.prune_events(before=5000) == 0
    store.close()


def test_pruning_keeps_the_newest_event_so_that_ids_never_go_back(db_url):
    """A hub idle for longer than the retention: every event is old and every lease ended. The
    newest event stays, so the next id (after a restart too) is above every id a feed client
    has seen; a client that follows the feed from its cursor misses nothing."""
    store = LeaseStore(db_url)
    a, b = make_lease(1), make_lease(2)
    store.apply([ev(a, "requested", 1000, "", "queued"), ev(b, "requested", 1001, "", "queued")])
    a.state, a.ended_at, b.state, b.ended_at = LeaseState.WITHDRAWN, 1100.0, LeaseState.WITHDRAWN, 1101.0
    seen = [e["id"] for e in store.apply([ev(a, "ended", 1100, "queued", "withdrawn"), ev(b, "ended", 1101, "queued", "withdrawn")])]
    cursor = max(seen)
    assert store.prune_events(before=10_000) == 3
    assert [e["id"] for e in store.events_since(0)] == [cursor]
    assert store.prune_events(before=10_000) == 0
    store.close()
    again = LeaseStore(db_url)  # the broker restarted after the prune
    assert again.last_event_id() == cursor
    c = make_lease(3)
    (new,) = again.apply([ev(c, "requested", 20_000, "", "queued")])
    assert new["id"] > cursor
    assert [e["lease_id"] for e in again.events_since(cursor)] == ["l3"]
    again.close()


def test_only_one_store_leads_a_database_until_it_lets_go(db_url):
    first, second = LeaseStore(db_url), LeaseStore(db_url, migrate=False)
    try:
        assert first.try_acquire_leadership()
        assert not second.try_acquire_leadership()
        first.release_leadership()
        assert second.try_acquire_leadership()
        assert not first.try_acquire_leadership()
    finally:
        first.close()
        second.close()


def test_a_database_of_the_first_releases_is_upgraded_in_place(tmp_path):
    """The first releases made their tables without a version table: they are stamped and
    upgraded, and every lease and event is kept (a copy of the file is kept beside it)."""
    import sqlite3

    path = tmp_path / "old.sqlite"
    con = sqlite3.connect(path)
    con.executescript(
        """
        CREATE TABLE leases (id VARCHAR(64) PRIMARY KEY, user VARCHAR(255) NOT NULL, server VARCHAR(255) NOT NULL,
            tier VARCHAR(64) NOT NULL, state VARCHAR(16) NOT NULL, seq INTEGER NOT NULL, created_at FLOAT NOT NULL,
            granted_at FLOAT, expires_at FLOAT, ended_at FLOAT, end_reason TEXT NOT NULL, request JSON NOT NULL,
            placement JSON, data JSON NOT NULL);
        CREATE INDEX ix_leases_user ON leases (user);
        CREATE INDEX ix_leases_state ON leases (state);
        CREATE INDEX ix_leases_ended_at ON leases (ended_at);
        CREATE TABLE lease_events (id INTEGER PRIMARY KEY AUTOINCREMENT, lease_id VARCHAR(64) NOT NULL, time FLOAT NOT NULL,
            kind VARCHAR(32) NOT NULL, from_state VARCHAR(16) NOT NULL, to_state VARCHAR(16) NOT NULL, actor VARCHAR(255) NOT NULL,
            reason TEXT NOT NULL, data JSON NOT NULL);
        CREATE INDEX ix_lease_events_lease_id ON lease_events (lease_id);
        """
    )
    lease = make_lease(7)
    d = lease.to_dict()
    import json

    con.execute("INSERT INTO leases VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (d["id"], d["user"], "", d["tier"], "queued", 7, d["created_at"], None, None, None, "", json.dumps(d["request"]), None, json.dumps(d)))
    con.execute("INSERT INTO lease_events (lease_id, time, kind, from_state, to_state, actor, reason, data) VALUES ('l7', 1007, 'requested', '', 'queued', 'alice', '', '{}')")
    con.commit()
    con.close()

    store = LeaseStore(f"sqlite:///{path}", migrate=False)
    assert store.schema_revision() == "0001"
    assert store.upgrade() == ("0001", store.head_revision())
    assert store.schema_revision() == store.head_revision()
    assert store.load_live() == [lease]
    assert [e["kind"] for e in store.events_since(0)] == ["requested"]
    store.apply([ev(lease, "granted", 2000, "queued", "active")])  # the new columns work
    assert (tmp_path / "old.sqlite.0001.bak").exists()
    assert store.upgrade() == (store.head_revision(), store.head_revision())  # nothing left to do
    store.close()


def test_an_empty_postgresql_database_gets_the_newest_schema(postgres):
    url = postgres.create_database("fresh_schema")
    store = LeaseStore(url)
    try:
        assert store.schema_revision() == store.head_revision()
        assert store.count_leases() == 0
        assert store.describe().startswith("postgresql")
    finally:
        store.close()


def test_a_batch_larger_than_one_statement_is_written_whole_and_in_order(db_url, monkeypatch):
    """SQLite writes a batch in multi-row statements (a few per commit, not one per row); a batch
    of more rows than one statement takes spans several, in one transaction, events in order."""
    import jupyter_gpulease.store as store_mod

    monkeypatch.setattr(store_mod, "_SQLITE_ROWS_LEASES", 3)
    monkeypatch.setattr(store_mod, "_SQLITE_ROWS_EVENTS", 4)
    store = LeaseStore(db_url)
    leases = [make_lease(i, user=f"u{i}", meta={"n": i}) for i in range(1, 11)]
    for lease in leases[::2]:
        granted(lease)
    written = store.apply([ev(lease, "requested", 1000 + lease.seq, "", lease.state.value) for lease in leases])
    assert [e["id"] for e in written] == list(range(1, 11))
    assert [e["lease_id"] for e in written] == [f"l{i}" for i in range(1, 11)]
    for lease in leases:
        assert store.get_lease(lease.id) == lease
    with store.engine.connect() as conn:  # the columns as SQLAlchemy's JSON type reads them
        rows = {r.id: r for r in conn.execute(sqlalchemy.select(store_mod.LEASES))}
    assert rows["l2"].placement is None and rows["l2"].state == "queued"
    assert rows["l1"].placement["slices"][0]["gpu_uuid"] == "GPU-a" and rows["l1"].request == {"kind": "gpu", "gpus": 1}
    assert [e["kind"] for e in store.events_since(0, user="u3")] == ["requested"]
    # an update of rows that exist (the upsert), several statements again
    for lease in leases:
        lease.state, lease.ended_at = LeaseState.RELEASED, 3000.0
    store.apply([ev(lease, "ended", 3000, "active", "released") for lease in leases])
    assert store.last_event_id() == 20
    assert {lease.state for lease in store.list_leases()} == {LeaseState.RELEASED}
    assert store.count_leases() == 10
    store.close()


def test_event_ids_go_on_from_the_database_after_a_failure_a_reopen_and_another_leader(tmp_path):
    """The leader numbers events itself (SQLite): after a failed batch, a reopen, or another
    broker that led meanwhile, the next id is the highest on disk + 1, never one already used."""
    url = f"sqlite:///{tmp_path / 'ids.sqlite'}"
    a = LeaseStore(url)
    assert a.try_acquire_leadership()
    assert [e["id"] for e in a.apply([ev(make_lease(1), "requested", 1001, "", "queued")])] == [1]
    bad = a.snapshot([ev(make_lease(2), "requested", 1002, "", "queued")])
    bad.events.append({"lease_id": None, "kind": "broken", "time": 1.0})
    with pytest.raises(sqlalchemy.exc.IntegrityError):
        a.write(bad)
    assert [e["id"] for e in a.apply([ev(make_lease(3), "requested", 1003, "", "queued")])] == [2]
    a.release_leadership()
    b = LeaseStore(url)  # a standby that took over, wrote, and stopped
    assert b.try_acquire_leadership()
    assert [e["id"] for e in b.apply([ev(make_lease(4), "requested", 1004, "", "queued")])] == [3]
    b.release_leadership()
    b.close()
    assert a.try_acquire_leadership()
    assert [e["id"] for e in a.apply([ev(make_lease(5), "requested", 1005, "", "queued")])] == [4]
    a.close()
    c = LeaseStore(url)
    assert [e["id"] for e in c.apply([ev(make_lease(6), "requested", 1006, "", "queued")])] == [5]
    assert [e["lease_id"] for e in c.events_since(0)] == ["l1", "l3", "l4", "l5", "l6"]
    c.close()
