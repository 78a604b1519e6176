"""Chaos: 200 clients through a REAL hub while the serving broker is SIGKILLed again and again.

The hub runs the broker as its managed service: a supervisor with the active broker and a hot
standby on one database (a SQLite file; then PostgreSQL). 200 concurrent clients of 20 users
request, read, extend and release leases on a contended pool through the hub's proxy, retrying
through each hand-over as the spawner and the CLI do (``BrokerClient``). A killer SIGKILLs the
broker that holds the database's lock at random moments, at least 20 times, waiting for the
standby to take over between kills. Then, from the database itself:

* every answer any client got is on disk: the same state, or a later one reached by a legal
  transition (queued -> active -> ended; queued -> ended), and an answered grant keeps its
  placement and grant time (it was not granted again elsewhere);
* no GPU was ever over-committed (the shares held on each GPU, over all time, never add up to
  more than one), and no lease was granted twice;
* ``GET api/leases?state=all`` and ``GET api/leases/{id}`` agree on every lease.

Bounded for CI: ``GPULEASE_CHAOS_KILLS`` kills (default 20); about 2-4 minutes per database
on a 2-core machine.

A killed supervisor (the process the hub runs) costs no more than a killed broker: under 50
clients, the broker that serves goes on serving (the standby stops), the hub restarts its
service at its next poll, the broker serving hands over to the new supervisor's, and writes go
on; the same checks of the database follow.

Through the hub's proxy with the project's proxy class (``JSON_ERRORS_PROXY``), API clients see
JSON and nothing else while the broker is killed again and again (calls made during a hand-over
wait for the next broker on the supervisor's socket; a call cut by the kill gets the proxy's
JSON error, and a page path still the hub's own page), and a create sent again with its
Idempotency-Key after a kill is answered by the standby with the lease the first one made.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import threading
import time
import urllib.error
import urllib.request
import uuid

import pytest
from tornado.httpclient import AsyncHTTPClient

from brokerhub import JSON_ERRORS_PROXY, active_broker_pid, active_broker_pid_postgres, hub_for_broker, wait_for_broker
from hubharness import free_port, pid_alive, wait_for
from jupyter_gpulease.client import BrokerClient, BrokerError
from jupyter_gpulease.store import LeaseStore

pytestmark = pytest.mark.timeout(900)

KILLS = int(os.environ.get("GPULEASE_CHAOS_KILLS", "20"))
CLIENTS = 200
USERS = [f"user{i:02d}" for i in range(20)]
POOL = [
    {"node": "n1", "model": "A100-SXM4-80GB", "count": 2, "memory_mib": 81920},
    {"node": "n2", "model": "L4", "count": 6, "memory_mib": 23034},
]
SHAPES = [{"gpus": 1, "model": "L4"}, {"share": 0.25, "model": "L4"}, {"gpus": 1, "model": "A100*"}, {"share": 0.5, "model": "L4"}]
ORDER = {"queued": 0, "active": 1}  # every other state is an end (2)


def rank(state: str) -> int:
    return ORDER.get(state, 2)


def legal(answered: dict, disk: dict) -> str | None:
    """Why the state on disk cannot follow the answered one (None: it can)."""
    a, d = answered["state"], disk["state"]
    if rank(d) < rank(a):
        return f"answered {a}, on disk {d}"
    if rank(a) == 2 and d != a:
        return f"answered {a}, on disk {d}"
    if (a == "active" or (rank(a) == 2 and answered.get("granted_at") is not None)) and (
        disk.get("granted_at") != answered.get("granted_at") or disk.get("placement") != answered.get("placement")
    ):
        return f"answered a grant at {answered.get('granted_at')} on {answered.get('placement')}, on disk {disk.get('granted_at')} on {disk.get('placement')}"
    if a == "queued" and d == "withdrawn" and disk.get("granted_at") is not None:
        return "a granted lease ended as withdrawn"
    return None


def overcommitted(leases: list[dict]) -> list[str]:
    """GPUs whose held shares ever added up to more than one GPU."""
    points: dict[str, list[tuple[float, float]]] = {}
    for lease in leases:
        if lease.get("granted_at") is None or not lease.get("placement"):
            continue
        end = lease.get("ended_at") if lease.get("ended_at") is not None else float("inf")
        for s in lease["placement"]["slices"]:
            key = s.get("mig_uuid") or s["gpu_uuid"]
            points.setdefault(key, []).extend([(lease["granted_at"], s["share"]), (end, -s["share"])])
    bad = []
    for gpu, pts in points.items():
        held = 0.0
        for _, delta in sorted(pts, key=lambda p: (p[0], p[1])):  # ends before starts at the same instant
            held += delta
            if held > 1.0 + 1e-6:
                bad.append(f"{gpu}: {held:.3f} GPUs held at once")
                break
    return bad


class Load:
    """CLIENTS clients in one thread's event loop; each answer is kept for the checks."""

    def __init__(self, url: str, tokens: dict[str, str], clients: int = CLIENTS):
        self.url, self.tokens, self.clients = url, tokens, clients
        self.answers: list[dict] = []
        self.errors: list[str] = []
        self.calls = 0
        self.writes = 0  # answered requests, extensions and releases
        self.stop = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def start(self):
        self.thread.start()

    def finish(self, timeout: float = 180):
        self.stop.set()
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the clients did not finish"

    def _keep(self, lease: dict, write: bool = False) -> dict:
        self.calls += 1
        self.writes += write
        self.answers.append({k: lease.get(k) for k in ("id", "user", "state", "granted_at", "placement")})
        return lease

    async def _run(self):
        AsyncHTTPClient.configure(None, max_clients=self.clients + 10)
        await asyncio.gather(*(self._client(i) for i in range(self.clients)))

    async def _client(self, i: int):
        rnd = random.Random(i)
        user = USERS[i % len(USERS)]
        c = BrokerClient(self.url, self.tokens[user], timeout=30, retry_for=90)
        while not self.stop.is_set():
            try:
                lease = self._keep(await c.request_lease({**rnd.choice(SHAPES), "duration_s": 3600}), True)
                for _ in range(rnd.randint(0, 6)):
                    if self.stop.is_set() or rank(lease["state"]) == 2:
                        break
                    await asyncio.sleep(rnd.uniform(0.05, 0.4))
                    if lease["state"] == "active" and rnd.random() < 0.3:
                        lease = self._keep(await c.extend(lease["id"], by_s=60), True)
                    else:
                        lease = self._keep(await c.get_lease(lease["id"]))
                if rank(lease["state"]) < 2:
                    lease = self._keep(await c.release(lease["id"], reason="chaos client done"), True)
            except BrokerError as e:
                # refusals a client may meet: its lease ended meanwhile, or an extension refused
                # while others wait (409); past the tier's limits (400); a broker that stays away
                # longer than the retries: status 0
                if e.status not in (400, 409):
                    self.errors.append(f"{user}: {e.status} {e.message}")
                await asyncio.sleep(0.2)


def run_chaos(hub, db_url: str, find_active, kills: int = KILLS) -> None:
    tokens = {u: hub.create_token(u) for u in USERS}
    tokens["carol"] = hub.create_token("carol")
    wait_for_broker(hub, tokens["carol"])
    load = Load(hub.service_url("gpulease"), tokens)
    load.start()
    wait_for(lambda: load.calls >= 200, 120, "the clients never got going")
    rnd = random.Random(7)
    killed = []
    try:
        for _ in range(kills):
            pid = wait_for(find_active, 60, "no broker holds the database's lock (the standby did not take over)")
            time.sleep(rnd.uniform(0.2, 2.0))
            calls_before = load.calls
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
            wait_for(lambda pid=pid: not pid_alive(pid), 10, f"broker {pid} survived SIGKILL")
            new = wait_for(lambda pid=pid: (p := find_active()) and p != pid and p, 30, "the standby did not take over within 30 s")
            assert new not in killed
            # clients get answers again (through the proxy, from the new broker)
            wait_for(lambda n=calls_before: load.calls > n + 20, 60, "no answers after the hand-over")
    finally:
        load.finish()
    assert len(killed) == kills
    check_answers_on_disk(hub, db_url, load, tokens, find_active, min_answers=1000)


def check_answers_on_disk(hub, db_url: str, load: Load, tokens: dict[str, str], find_active, min_answers: int) -> None:
    assert not load.errors, f"{len(load.errors)} client errors, e.g. {load.errors[:5]}"
    assert len(load.answers) > min_answers, f"only {len(load.answers)} answers"

    # the database is the truth: read it directly
    store = LeaseStore(db_url, migrate=False)
    try:
        on_disk = {d["id"]: d for d in store.list_lease_dicts(limit=None)}
        events = store.events_since(0, limit=10_000_000)
    finally:
        store.close()
    problems = []
    for answer in load.answers:
        disk = on_disk.get(answer["id"])
        if disk is None:
            problems.append(f"{answer['id']}: answered {answer['state']}, not on disk")
        elif (why := legal(answer, disk)) is not None:
            problems.append(f"{answer['id']}: {why}")
    assert not problems, f"{len(problems)} answers not on disk as answered: {problems[:10]}"
    grants: dict[str, int] = {}
    for e in events:
        if e["kind"] == "granted":
            grants[e["lease_id"]] = grants.get(e["lease_id"], 0) + 1
    assert all(n == 1 for n in grants.values()), {k: n for k, n in grants.items() if n > 1}
    assert not overcommitted(list(on_disk.values()))

    async def agree():
        admin = BrokerClient(hub.service_url("gpulease"), tokens["carol"], retry_for=60)
        listed = {x["id"]: x for x in await admin.list_leases(state="all", limit=100_000)}
        assert set(listed) == set(on_disk), "the list and the database disagree on which leases exist"
        sample = random.Random(3).sample(sorted(listed), min(300, len(listed)))
        for lid in sample:
            got = await admin.get_lease(lid)
            assert (got["state"], got.get("placement")) == (listed[lid]["state"], listed[lid].get("placement")), lid
        for x in listed.values():  # every lease ends
            if x["state"] in ("queued", "active"):
                await admin.release(x["id"], state="revoked", reason="end of the chaos test")

    asyncio.run(agree())
    # a kill may land while the broker that took the lock is still restoring (before it listens
    # and says "active"): a legal moment to die, counted above by the lock, not by the log. The
    # broker serving at the end came up whole and said so
    log = hub.log_file.read_text(errors="replace")
    assert f"active (pid {find_active()})" in log, "the serving broker never logged that it became active"
    assert log.count("active (pid") >= 2, "no take-over in the log"


def test_200_clients_see_nothing_lost_while_the_broker_is_killed_again_and_again(tmp_path):
    db_url = f"sqlite:///{tmp_path / 'gpulease.sqlite'}"
    hub = hub_for_broker(tmp_path, db_url=db_url, pool=POOL, users=(*USERS, "carol"),
                         extra_config="c.GPULeaseBroker.reconcile_interval = 0\n", log_level="INFO")
    hub.start()
    try:
        run_chaos(hub, db_url, lambda: active_broker_pid(hub))
    finally:
        hub.stop()


def supervisor_and_workers(hub) -> tuple[int | None, list[int]]:
    procs = [(pid, cmd) for pid, cmd in hub.descendants() if "jupyter_gpulease.broker" in cmd]
    sups = [pid for pid, cmd in procs if "worker=True" not in cmd]
    return (sups[0] if len(sups) == 1 else None), [pid for pid, cmd in procs if "worker=True" in cmd]


def test_a_killed_supervisor_stops_no_writes_and_its_broker_hands_over_to_the_restarted_service(tmp_path):
    db_url = f"sqlite:///{tmp_path / 'gpulease.sqlite'}"
    hub = hub_for_broker(tmp_path, db_url=db_url, pool=POOL, users=(*USERS, "carol"),
                         extra_config="c.GPULeaseBroker.reconcile_interval = 0\nc.GPULeaseBroker.orphan_hub_grace_s = 3\n",
                         log_level="INFO")
    hub.start()
    try:
        tokens = {u: hub.create_token(u) for u in USERS}
        tokens["carol"] = hub.create_token("carol")
        wait_for_broker(hub, tokens["carol"])
        load = Load(hub.service_url("gpulease"), tokens, clients=50)
        load.start()
        try:
            wait_for(lambda: load.writes >= 100, 120, "the clients never got going")
            serving = wait_for(lambda: active_broker_pid(hub), 30, "no broker holds the lock")
            sup, workers = wait_for(lambda: (got := supervisor_and_workers(hub))[0] and len(got[1]) == 2 and got, 30, "no supervisor with two brokers")
            standby = next(p for p in workers if p != serving)
            os.kill(sup, signal.SIGKILL)
            wait_for(lambda: not pid_alive(sup), 10, "the supervisor survived SIGKILL")
            # the standby stops; the broker that serves goes on, writes included, without a supervisor
            wait_for(lambda: not pid_alive(standby), 10, "the standby outlived its supervisor")
            writes = load.writes
            wait_for(lambda: load.writes > writes + 100, 15, "writes stopped with the supervisor")
            assert pid_alive(serving)
            # the hub restarts its service (its next poll); a broker of the new supervisor waits,
            # the old one hands over to it and exits
            new = wait_for(lambda: (p := active_broker_pid(hub)) and p != serving and p, 90, "no broker of the restarted service took the lock")
            wait_for(lambda: not pid_alive(serving), 15, "the old broker did not stop after handing over")
            writes = load.writes
            wait_for(lambda: load.writes > writes + 20, 15, "writes did not resume within 15 s of the hand-over")
            # the new supervisor keeps a standby again: a broker killed now is taken over as before
            wait_for(lambda: len(supervisor_and_workers(hub)[1]) == 2, 30, "the new supervisor has no standby")
            os.kill(new, signal.SIGKILL)
            wait_for(lambda: (p := active_broker_pid(hub)) and p != new, 30, "the new standby did not take over")
            writes = load.writes
            wait_for(lambda: load.writes > writes + 20, 15, "writes did not resume after the broker was killed")
        finally:
            load.finish()
        log = hub.log_file.read_text(errors="replace")
        assert f"this standby (pid {standby}) stops" in log and f"this broker (pid {serving}) serves on" in log
        assert f"Let go of the lock of {db_url} (pid {serving})" in log
        check_answers_on_disk(hub, db_url, load, tokens, lambda: active_broker_pid(hub), min_answers=300)

        # the supervisor killed again, and then the hub stopped for good: nobody restarts the
        # service, so the broker that serves on stops once the hub has not answered for its grace
        serving = wait_for(lambda: active_broker_pid(hub), 30, "no broker holds the lock")
        sup, _ = supervisor_and_workers(hub)
        os.kill(sup, signal.SIGKILL)
        wait_for(lambda: not pid_alive(sup), 10, "the supervisor survived SIGKILL")
        hub.stop()
        wait_for(lambda: not pid_alive(serving), 60, "the broker outlived its supervisor and its hub")
        assert f"nobody took over: this broker (pid {serving}) stops" in hub.log_file.read_text(errors="replace")
    finally:
        hub.stop()


def test_the_standby_on_postgresql_takes_over_from_a_killed_active_broker_with_nothing_lost(tmp_path, postgres):
    db_url = postgres.create_database("chaos")

    hub = hub_for_broker(tmp_path, db_url=db_url, pool=POOL, users=(*USERS, "carol"),
                         extra_config="c.GPULeaseBroker.reconcile_interval = 0\n", log_level="INFO")
    hub.start()
    try:
        run_chaos(hub, db_url, lambda: active_broker_pid_postgres(postgres.port, "chaos"), kills=max(5, KILLS // 2))
    finally:
        hub.stop()


def test_the_leader_sees_a_broker_that_waits_for_its_lock_on_either_database(db_url):
    """What a broker whose supervisor died asks before it hands over (SQLite, then PostgreSQL)."""
    leader = LeaseStore(db_url)
    waiter = second = None
    try:
        assert leader.try_acquire_leadership() and not leader.successor_waiting()
        waiter = LeaseStore(db_url, migrate=False)
        assert not waiter.try_acquire_leadership()
        assert leader.successor_waiting() and leader.successor_waiting()  # asking takes nothing from the waiter
        assert not waiter.try_acquire_leadership()
        leader.close()
        assert waiter.try_acquire_leadership()
        assert not waiter.successor_waiting()  # the new leader no longer says it waits
        second = LeaseStore(db_url, migrate=False)
        assert not second.try_acquire_leadership() and waiter.successor_waiting()
        second.close()  # a waiter that stops stops saying so
        assert not waiter.successor_waiting()
    finally:
        for s in (leader, waiter, second):
            if s is not None:
                s.close()


# ---------------------------------------------------------------------- JSON only, one lease per key
def raw_call(url: str, token: str, body: dict | None = None, key: str | None = None) -> tuple[int, str, bytes]:
    """(status, content type, body) of one call, as any HTTP client sees it; status 0: no answer."""
    headers = {"Authorization": f"token {token}"}
    if body is not None:
        headers["Content-Type"] = "application/json"
    if key:
        headers["Idempotency-Key"] = key
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(), method="GET" if body is None else "POST", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read()
    except (urllib.error.URLError, OSError):
        return 0, "", b""


class RawClients:
    """``n`` threads calling the API through the proxy without pause (reads, creates and
    releases, each write with its key, sent again with it until answered); every answer kept."""

    def __init__(self, url: str, token: str, n: int = 12):
        self.url, self.token = url, token
        self.answers: list[tuple[float, int, str, bytes]] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(n)]

    def _keep(self, got):
        self.answers.append((time.monotonic(), *got))
        return got

    def _run(self, i: int) -> None:
        lease, key = None, uuid.uuid4().hex
        while not self.stop.is_set():
            if i % 3 == 0:
                self._keep(raw_call(self.url + "api/pool", self.token))
                continue
            if lease is None:
                status, _, body = self._keep(raw_call(self.url + "api/leases", self.token, {"share": 0.25, "model": "L4"}, key))
                if status == 201:
                    lease, key = json.loads(body), uuid.uuid4().hex
            else:
                status, _, _ = self._keep(raw_call(self.url + f"api/leases/{lease['id']}/release", self.token, {"reason": "done"}, key))
                if status in (200, 409):
                    lease, key = None, uuid.uuid4().hex
            if status == 0:
                time.sleep(0.05)

    def answered_after(self, t: float) -> int:
        return sum(1 for a in self.answers if a[0] > t and a[1])


def test_api_clients_see_only_json_while_the_broker_is_killed_and_a_create_sent_again_makes_one_lease(tmp_path):
    db_url = f"sqlite:///{tmp_path / 'gpulease.sqlite'}"
    gone = free_port()  # a service that never answers: the proxy's own error, on an API path and on a page
    hub = hub_for_broker(tmp_path, db_url=db_url, extra_config="c.GPULeaseBroker.reconcile_interval = 0\n", log_level="INFO",
                         config_lines=[JSON_ERRORS_PROXY, f"c.JupyterHub.services.append({{'name': 'gone', 'url': 'http://127.0.0.1:{gone}'}})"])
    hub.start()
    try:
        token = hub.create_token("alice")
        wait_for_broker(hub, token)
        status, ctype, body = raw_call(hub.service_url("gone") + "api/leases", token)
        assert (status, json.loads(body)["error"]) == (503, "Unavailable") and "application/json" in ctype
        status, ctype, body = raw_call(hub.service_url("gone") + "admin", token)
        assert status == 503 and "text/html" in ctype and b"<html" in body.lower(), "a page path keeps the hub's page"

        clients = RawClients(hub.service_url("gpulease"), token)
        for t in clients.threads:
            t.start()
        try:
            wait_for(lambda: clients.answered_after(0) > 50, 60, "the clients never got going")
            for _ in range(4):
                pid = wait_for(lambda: active_broker_pid(hub), 60, "no broker holds the lock")
                time.sleep(random.uniform(0.3, 1.0))
                t_kill = time.monotonic()
                os.kill(pid, signal.SIGKILL)
                wait_for(lambda pid=pid: (p := active_broker_pid(hub)) and p != pid, 30, "the standby did not take over")
                wait_for(lambda t=t_kill: clients.answered_after(t) > 30, 60, "no answers after the hand-over")
        finally:
            clients.stop.set()
            for t in clients.threads:
                t.join(15)
        not_json = [(status, ctype, body[:80]) for _, status, ctype, body in clients.answers if status and "application/json" not in ctype]
        assert not not_json, f"{len(not_json)} of {len(clients.answers)} answers were not JSON, e.g. {not_json[:3]}"

        # a create whose answer is lost is sent again with its key, after a kill: the standby has it
        key = uuid.uuid4().hex
        body = {"share": 0.25, "model": "L4", "meta": {"test": key}}
        status, _, first = raw_call(hub.service_url("gpulease") + "api/leases", token, body, key)
        assert status == 201
        pid = active_broker_pid(hub)
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: (p := active_broker_pid(hub)) and p != pid, 30, "the standby did not take over")
        again = wait_for(lambda: (got := raw_call(hub.service_url("gpulease") + "api/leases", token, body, key))[0] == 201 and got, 30,
                         "the create sent again was not answered")
        assert json.loads(again[2])["id"] == json.loads(first)["id"]
        status, _, listed = raw_call(hub.service_url("gpulease") + "api/leases?state=all", token)
        assert [x["id"] for x in json.loads(listed)["leases"] if x.get("meta", {}).get("test") == key] == [json.loads(first)["id"]]
    finally:
        hub.stop()
