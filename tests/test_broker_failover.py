"""The parts of a quick fail-over, each built alone: the past leases a standby reads ahead and
follows (on SQLite and on PostgreSQL), its reading between tries for the lock, the idempotency
keys a retried call is answered by, and the listening socket the supervisor holds while no
broker accepts."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import threading
import time

import pytest
from tornado.httpserver import HTTPServer
from tornado.web import Application, RequestHandler

from hubharness import free_port, wait_for
from jupyter_gpulease.broker.keys import STORED_CHARS, RequestKeys, scoped_key
from jupyter_gpulease.broker.manager import LeaseManager
from jupyter_gpulease.broker.past import PastLeases, ReadAhead
from jupyter_gpulease.broker.supervisor import LISTEN_FDS, inherited_sockets, listening_sockets
from jupyter_gpulease.core.health import HEALTH_META
from jupyter_gpulease.core.model import LeaseState
from jupyter_gpulease.core.policy import Policy
from jupyter_gpulease.core.request import Ask, parse_request
from jupyter_gpulease.core.scheduler import Scheduler
from jupyter_gpulease.devices.declared import parse_inventory
from jupyter_gpulease.store import LeaseStore

T0 = 1_700_000_000.0
DAY = 86400.0


class Clock:
    def __init__(self, t: float = T0):
        self.t = t

    def now(self) -> float:
        return self.t


class History:
    """A store and a scheduler that decides leases into it: granted, then ended, committed as a
    broker commits them (events and leases in one batch)."""

    def __init__(self, db_url: str, clock: Clock):
        self.store = LeaseStore(db_url)
        self.clock = clock
        self.sched = Scheduler(parse_inventory([{"node": "n1", "model": "L4", "count": 4, "memory_mib": 23034}]), Policy(confirm_timeout_s=None))
        self.n = 0

    def lease(self, user: str, *, held_s: float = 3600.0, ask: str = "gpus", groups=("physics",), meta=None, end: LeaseState = LeaseState.RELEASED) -> str:
        """A lease of ``user`` granted now, ended ``held_s`` later (the clock moves on)."""
        self.n += 1
        lid = f"L{self.n}"
        body = {"gpus": 1} if ask == "gpus" else {"share": 0.25}
        lease = self.sched.new_lease(Ask(user=user, groups=tuple(groups), request=parse_request(body), meta=dict(meta or {})), self.clock.t, lease_id=lid)
        self.store.apply(self.sched.submit(lease, self.clock.t, actor=user) + self.sched.tick(self.clock.t))
        self.clock.t += held_s
        self.store.apply(self.sched.release(lid, self.clock.t, state=end, reason="done", actor=user))
        return lid


def view(p) -> tuple:
    return p.id, p.user, tuple(p.groups), p.granted_at, p.ended_at, p.gpu_milli, LeaseState(p.state), p.meta.get(HEALTH_META)


def test_the_past_is_read_once_then_only_what_ended_since_and_matches_the_history(db_url):
    clock = Clock()
    h = History(db_url, clock)
    try:
        h.lease("alice")
        h.lease("bob", ask="share", groups=())
        drained = h.lease("carol", meta={HEALTH_META: {"action": "drain_now", "device": "GPU-1"}}, end=LeaseState.REVOKED)
        past = PastLeases(h.store, keep_s=7 * DAY, now=clock.now)
        assert not past.loaded
        assert past.catch_up() == 3 and past.loaded
        assert past.catch_up() == 0, "nothing ended since: nothing read"
        h.lease("alice", held_s=60)
        h.lease("dave", held_s=60)
        assert past.catch_up() == 2, "only the two leases that ended since the last read"
        want = sorted(h.store.history(clock.t - 7 * DAY), key=lambda x: x.granted_at)
        assert [view(p) for p in past.since(clock.t - 7 * DAY)] == [
            (x.id, x.user, tuple(x.groups), x.granted_at, x.ended_at, x.gpu_milli, x.state, x.meta.get(HEALTH_META)) for x in want]
        assert {p.id: p.meta for p in past.since(0)}[drained] == {HEALTH_META: {"action": "drain_now", "device": "GPU-1"}}
        assert [p.user for p in past.since(clock.t - 100)] == ["alice", "dave"]
    finally:
        h.store.close()


def test_a_lease_withdrawn_while_queued_is_no_usage_and_is_not_kept(tmp_path):
    clock = Clock()
    h = History(f"sqlite:///{tmp_path / 'db.sqlite'}", clock)
    past = PastLeases(h.store, keep_s=DAY, now=clock.now)
    past.catch_up()
    holder = h.sched.new_lease(Ask(user="frank", request=parse_request({"gpus": 1})), clock.t, lease_id="held")
    h.store.apply(h.sched.submit(holder, clock.t, actor="frank") + h.sched.tick(clock.t))
    lease = h.sched.new_lease(Ask(user="erin", request=parse_request({"gpus": 4})), clock.t, lease_id="big")  # waits for frank's GPU
    h.store.apply(h.sched.submit(lease, clock.t, actor="erin") + h.sched.tick(clock.t))
    assert h.sched.get("big").state is LeaseState.QUEUED
    h.store.apply(h.sched.release("big", clock.t + 5, state=LeaseState.WITHDRAWN, actor="erin"))
    assert past.catch_up() == 0 and len(past) == 0
    h.store.close()


def usage_after_start(store: LeaseStore, clock: Clock, *, standby=None) -> dict:
    """Each user's usage as a manager started on ``store`` counts it; ``standby(manager)``: what
    happened while it stood by (before its start)."""
    async def main():
        sched = Scheduler(parse_inventory([{"node": "n1", "model": "L4", "count": 4, "memory_mib": 23034}]), Policy(confirm_timeout_s=None))
        m = LeaseManager(sched, store, clock=clock)
        if standby is not None:
            standby(m)
        await m.start()
        out = {u: m.usage(u, ("physics",)) for u in ("alice", "bob")}
        await m.close()
        return out
    return asyncio.run(main())


def test_a_manager_that_counted_the_past_while_it_stood_by_counts_the_same_usage_as_one_that_reads_it_at_start(tmp_path):
    db = f"sqlite:///{tmp_path / 'db.sqlite'}"
    clock = Clock()
    h = History(db, clock)
    for i in range(6):
        h.lease("alice" if i % 2 else "bob", held_s=3600 * (i + 1))

    def standby(m):
        ReadAhead(m.store, m.past, then=m.record_past, clock=lambda: 0.0)()  # the standby's first read, its use counted
        assert m.past.loaded and m.usage("alice", ("physics",))["gpu_hours_used"] > 0
        h.lease("alice", held_s=1800)  # an end after it, read and counted at take-over
        clock.t += 60

    read_ahead = usage_after_start(h.store, clock, standby=standby)
    at_start = usage_after_start(LeaseStore(db, migrate=False), clock)
    assert read_ahead == at_start and read_ahead["alice"] != read_ahead["bob"]


class FlakyStore:
    """What ReadAhead asks of a store, failing while ``down``."""

    def __init__(self):
        self.down = False
        self.schema_reads = 0

    def schema_revision(self):
        self.schema_reads += 1
        return "0006"

    def head_revision(self):
        return "0006"


class CountingPast:
    def __init__(self, store: FlakyStore):
        self.store = store
        self.loaded = False
        self.reads = 0
        self.keep_s = DAY

    def catch_up(self):
        if self.store.down:
            raise OSError("database away")
        self.loaded = True
        self.reads += 1
        return 0

    def __len__(self):
        return 0


def test_the_standby_reads_ahead_at_most_every_second_and_goes_on_when_the_database_is_away(caplog):
    store, t = FlakyStore(), [0.0]
    past = CountingPast(store)
    read = ReadAhead(store, past, every_s=1.0, clock=lambda: t[0], logger=logging.getLogger("test.readahead"))
    for step in (0.0, 0.05, 0.5, 0.99):  # tries for the lock every 50 ms: one read in the first second
        t[0] = step
        read()
    assert past.reads == 1 and store.schema_reads == 1
    store.down = True
    with caplog.at_level(logging.WARNING, "test.readahead"):
        for step in (1.0, 2.0, 3.0):
            t[0] = step
            read()
    assert past.reads == 1 and len([r for r in caplog.records if "cannot read" in r.getMessage()]) == 1, "said once, not at every try"
    store.down = False
    t[0] = 4.0
    read()
    assert past.reads == 2


# ---------------------------------------------------------------------- idempotency keys
def test_a_scoped_key_fits_the_column_and_keeps_two_callers_apart():
    assert scoped_key("alice", "k1") == "alice:k1"
    long_name = "a.person.with.a.long.name@physics.example.university.edu"
    k = scoped_key(long_name, "x" * 64)
    assert len(k) <= STORED_CHARS and k == scoped_key(long_name, "x" * 64)
    assert k != scoped_key(long_name + "2", "x" * 64) and k != scoped_key(long_name, "y" * 64)


def test_a_key_is_found_in_memory_and_in_the_database_only_in_the_first_minutes():
    db = {"old": "L0"}
    asked = []
    clock = Clock()

    async def find(key):
        asked.append(key)
        return db.get(key)

    async def main():
        keys = RequestKeys(find, now=clock.now, window_s=900)
        keys.start(clock.t)
        assert await keys.find("old") == "L0"  # answered before this broker started
        keys.remember("new", "L1")
        assert await keys.find("new") == "L1" and asked == ["old"]
        clock.t += 901
        assert await keys.find("old") is None and asked == ["old"]  # older than the window: not looked for
        assert await keys.find(None) is None
    asyncio.run(main())


def test_two_calls_with_one_key_while_the_database_is_read_get_one_lease():
    release = asyncio.Event

    async def main():
        gate = release()

        async def find(key):
            await gate.wait()  # the database is slow: both calls wait here
            return None

        keys = RequestKeys(find, now=time.time, window_s=900)
        keys.start(time.time())
        made = []

        async def create():
            lid = await keys.find("k")
            if lid is None:
                lid = f"L{len(made) + 1}"
                made.append(lid)
                keys.remember("k", lid)
            return lid

        first, second = asyncio.ensure_future(create()), asyncio.ensure_future(create())
        await asyncio.sleep(0)
        gate.set()
        return await asyncio.gather(first, second), made

    (a, b), made = asyncio.run(main())
    assert a == b and made == [a]


# ---------------------------------------------------------------------- the supervisor's socket
class Hello(RequestHandler):
    def get(self):
        self.finish(json.dumps({"pid": os.getpid()}))


def test_connections_wait_for_the_next_broker_on_the_supervisors_socket_instead_of_being_refused(monkeypatch):
    port = free_port()
    held = listening_sockets("127.0.0.1", port)
    assert held
    try:
        # nobody accepts (the broker that served is gone, the next one restores): the call is not refused
        client = socket.create_connection(("127.0.0.1", port), timeout=5)
        client.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        # the next broker: a worker handed the socket (its own descriptor of it)
        monkeypatch.setenv(LISTEN_FDS, ",".join(str(os.dup(s.fileno())) for s in held))
        inherited = inherited_sockets()
        assert inherited and LISTEN_FDS not in os.environ
        loop = asyncio.new_event_loop()
        served = threading.Event()

        def serve():
            asyncio.set_event_loop(loop)
            server = HTTPServer(Application([(r"/", Hello)]))
            server.add_sockets(inherited)
            served.set()
            loop.run_forever()
            server.stop()

        t = threading.Thread(target=serve, daemon=True)
        t.start()
        assert served.wait(5)
        answer = b""
        while chunk := client.recv(4096):
            answer += chunk
        client.close()
        assert answer.startswith(b"HTTP/1.1 200") and b'"pid"' in answer
        loop.call_soon_threadsafe(loop.stop)
        t.join(5)
    finally:
        for s in held:
            s.close()


def test_a_taken_address_leaves_each_broker_to_bind_its_own():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert listening_sockets("127.0.0.1", taken.getsockname()[1]) == []


@pytest.fixture(autouse=True)
def _no_leftover_env(monkeypatch):
    monkeypatch.delenv(LISTEN_FDS, raising=False)


# ---------------------------------------------------------------------- token checks
def test_calls_that_bring_one_token_at_once_share_one_check_with_the_hub():
    from jupyter_gpulease.broker.tokens import TokenChecks

    asked = []

    async def main():
        checks = TokenChecks()
        gate = asyncio.Event()

        def check(name):
            async def ask():
                asked.append(name)
                await gate.wait()
                if name == "bad":
                    raise RuntimeError("the hub did not answer")
                return {"name": name}
            return ask

        calls = [asyncio.ensure_future(checks.check(f"token {n}", check(n))) for n in ("alice", "alice", "bob", "alice", "bad", "bad")]
        await asyncio.sleep(0)
        gate.set()
        got = await asyncio.gather(*calls, return_exceptions=True)
        again = await checks.check("token alice", check("alice"))  # answered checks are not kept
        return got, again, len(checks)

    got, again, pending = asyncio.run(main())
    assert [g["name"] for g in got[:4]] == ["alice", "alice", "bob", "alice"] and all(isinstance(g, RuntimeError) for g in got[4:])
    assert asked == ["alice", "bob", "bad", "alice"] and again == {"name": "alice"} and pending == 0


def test_a_broker_that_died_is_replaced_after_a_pause_while_another_serves_and_at_once_when_none_does(tmp_path):
    """The supervisor's own loop, with workers that only note when they started."""
    import signal
    import subprocess
    import sys

    starts = tmp_path / "starts"
    worker = tmp_path / "worker.sh"
    worker.write_text(f"#!/bin/sh\necho \"$$ $(date +%s.%N)\" >> {starts}\nexec sleep 60\n")
    worker.chmod(0o755)
    code = ("import logging, sys; from jupyter_gpulease.broker.supervisor import Supervisor; "
            f"sys.exit(Supervisor([], standbys=1, python={str(worker)!r}, replace_delay_s=2.0, log=logging.getLogger()).run())")
    sup = subprocess.Popen([sys.executable, "-c", code])

    def started():
        return [(int(p), float(t)) for p, t in (line.split() for line in starts.read_text().splitlines())] if starts.exists() else []

    try:
        first = wait_for(lambda: len(started()) == 2 and started(), 20, "the supervisor did not start two brokers")
        t_kill = time.time()
        os.kill(first[0][0], signal.SIGKILL)  # one dies, the other lives: its replacement waits
        third = wait_for(lambda: len(started()) == 3 and started()[2], 20, "the broker that died was not replaced")
        assert third[1] - t_kill >= 1.9
        os.kill(first[1][0], signal.SIGKILL)
        os.kill(third[0], signal.SIGKILL)  # none lives: replaced at once
        t_kill = time.time()
        fourth = wait_for(lambda: len(started()) >= 4 and started()[3], 20, "no broker was started again")
        assert fourth[1] - t_kill < 1.5
    finally:
        sup.send_signal(signal.SIGTERM)
        sup.wait(30)
