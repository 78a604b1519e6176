"""Broker hand-over: how long clients get no answer when the serving broker is SIGKILLed.

    python benchmarks/bench_handover.py [--kills 5] [--postgres]
    python benchmarks/bench_handover.py --kill supervisor [--kills 3] [--postgres]
    python benchmarks/bench_handover.py --grown [--kills 5] [--postgres] [--clients 200]

A real JupyterHub runs the broker as its managed service (as README's config does), on a SQLite
file. A client asks the broker for the pool through the hub's proxy 20 times a second; the
broker that serves is SIGKILLed ``--kills`` times, and each time the benchmark takes the time
from the kill to the first answer after it (and, with a supervisor, to the moment a standby
holds the database's lock). Side by side, in the same script, one after the other:

1. the default: a supervisor with one hot standby (``GPULeaseBroker.standbys = 1``);
2. a supervisor without a standby: it starts a new broker when one dies (``standbys = 0``);
3. no supervisor (``supervise = False``): JupyterHub itself restarts its service when its poll
   finds it dead (what the broker did before the standby; fewer kills, each takes a while).

``--postgres`` adds (1) on a PostgreSQL server started for it (``initdb`` in a temporary
folder; the advisory lock instead of the file lock).

Beside the reads, a writer requests and releases a lease through the proxy, one call after the
other; ``write_gap_max_s`` is the longest time between two of its answers around each kill (from
before the kill until the next broker has served for 2 s).

``--kill supervisor`` SIGKILLs the supervisor instead, with the standby (SQLite, and
PostgreSQL with ``--postgres``), side by side with the same case killing the serving broker.
The broker that serves goes on serving without its supervisor until the hub restarts the
service (its next poll of the process, up to 30 s later), then hands over to a broker of the
new supervisor: the gaps are those of that hand-over.

``--grown`` puts the standby on a database grown to a site's history first, side by side with
a fresh one (SQLite, and PostgreSQL with ``--postgres``): ``--leases`` ended leases (default
60,000) over ``--days`` days (default 70; with the default policy the usage window is 35 days,
about 30,000 of them), three events each, their usage records and a week of hourly ones,
written straight through the store (:func:`grow_database`, a few seconds per 10,000 leases),
not through the API. ``--clients N`` adds N clients that request, read, extend and release
leases through the proxy all the while (``BrokerClient``, as the spawner and the CLI), so that
the hand-over happens under load. With a standby, each kill waits until the standby started
after the last one has read the past ahead (its log says so), as it would have between two
failures at a site.

The hub runs its proxy with the project's proxy class (``GPULeaseProxy``, as the docs' config
does). Every answer the writer and the reader get is checked to be JSON: ``non_json_answers``
counts those that were not (the hub's HTML error page).

Figures are printed and saved as JSON (``--out``); nothing here asserts on them.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from brokerhub import JSON_ERRORS_PROXY, active_broker_pid, active_broker_pid_postgres, hub_for_broker, wait_for_broker  # noqa: E402
from hubharness import pid_alive, wait_for  # noqa: E402


def _answer(req: urllib.request.Request, timeout: float) -> tuple[int, dict | None, bool]:
    """(status, JSON body or None, whether the body was JSON) of one call; status 0: no answer."""
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, body, ctype = r.status, r.read(), r.headers.get("Content-Type", "")
    except urllib.error.HTTPError as e:
        status, body, ctype = e.code, e.read(), e.headers.get("Content-Type", "")
    except (urllib.error.URLError, OSError):
        return 0, None, True
    try:
        return status, json.loads(body), "json" in ctype
    except ValueError:
        return status, None, False


class Writer(threading.Thread):
    """Requests a lease and releases it through the proxy, one call after the other; remembers
    when answers came (a 2xx). A call that got no answer is sent again with the same
    Idempotency-Key, so a lost answer makes no second lease."""

    def __init__(self, url: str, token: str):
        super().__init__(daemon=True)
        self.url, self.token = url, token
        self.ok: list[float] = []
        self.non_json: list[tuple[float, int]] = []  # (when, status) of answers that were not JSON
        self.stop = threading.Event()

    def _call(self, path: str, body: dict, key: str) -> dict | None:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Authorization": f"token {self.token}", "Content-Type": "application/json", "Idempotency-Key": key})
        status, got, was_json = _answer(req, 2)
        if not was_json:
            self.non_json.append((time.monotonic(), status))
        if 200 <= status < 300 and got is not None:
            self.ok.append(time.monotonic())
            return got
        return None

    def run(self) -> None:
        lease, key = None, uuid.uuid4().hex
        while not self.stop.is_set():
            if lease is None:
                lease = self._call("api/leases", {"share": 0.25, "model": "L4", "duration_s": 600}, key)
                done = lease is not None
            else:
                done = self._call(f"api/leases/{lease['id']}/release", {"reason": "bench"}, key) is not None
                lease = None if done else lease
            if done:
                key = uuid.uuid4().hex  # the next call's; a call sent again keeps its own
            if not done or self.ok[-1] < time.monotonic() - 0.05:
                self.stop.wait(0.05)  # failing: do not spin

    def longest_gap(self, start: float, end: float) -> float:
        """The longest time without an answer between ``start`` and ``end``."""
        times = [start] + [t for t in self.ok if start < t < end] + [end]
        return max(b - a for a, b in itertools.pairwise(times))


class Poller(threading.Thread):
    """``GET api/pool`` through the proxy every ``interval`` s; remembers when answers came."""

    def __init__(self, url: str, token: str, interval: float = 0.05):
        super().__init__(daemon=True)
        self.url, self.token, self.interval = url, token, interval
        self.ok: list[float] = []
        self.non_json: list[tuple[float, int]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            status, _, was_json = _answer(urllib.request.Request(self.url, headers={"Authorization": f"token {self.token}"}), 1)
            if status == 200:
                self.ok.append(time.monotonic())
            if not was_json:
                self.non_json.append((time.monotonic(), status))
            self.stop.wait(self.interval)

    def first_answer_after(self, t: float, timeout: float = 120) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            after = [x for x in self.ok[-50:] if x > t]
            if after:
                return after[0]
            time.sleep(0.01)
        raise RuntimeError(f"no answer within {timeout} s of the kill")

    def longest_gap(self, start: float, end: float) -> float:
        times = [start] + [t for t in self.ok if start < t < end] + [end]
        return max(b - a for a, b in itertools.pairwise(times))


SHAPES = [{"gpus": 1, "model": "L4"}, {"share": 0.25, "model": "L4"}, {"gpus": 1, "model": "A100*"}, {"share": 0.5, "model": "L4"}]


class Load:
    """``clients`` clients in one thread's event loop, each requesting, reading, extending and
    releasing leases through the proxy with the project's client (retries, idempotency keys),
    as tests/test_broker_chaos.py's do."""

    def __init__(self, url: str, tokens: list[str], clients: int):
        self.url, self.tokens, self.clients = url, tokens, clients
        self.calls = 0
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def start(self) -> None:
        if self.clients:
            self.thread.start()

    def finish(self) -> None:
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join(120)

    async def _run(self) -> None:
        from tornado.httpclient import AsyncHTTPClient

        AsyncHTTPClient.configure(None, max_clients=self.clients + 10)
        await asyncio.gather(*(self._client(i) for i in range(self.clients)))

    async def _client(self, i: int) -> None:
        from jupyter_gpulease.client import BrokerClient, BrokerError

        rnd = random.Random(i)
        c = BrokerClient(self.url, self.tokens[i % len(self.tokens)], timeout=30, retry_for=90)
        while not self.stop.is_set():
            try:
                lease = await c.request_lease({**rnd.choice(SHAPES), "duration_s": 3600})
                self.calls += 1
                for _ in range(rnd.randint(0, 4)):
                    if self.stop.is_set() or lease["state"] not in ("queued", "active"):
                        break
                    await asyncio.sleep(rnd.uniform(0.05, 0.4))
                    lease = await (c.extend(lease["id"], by_s=60) if lease["state"] == "active" and rnd.random() < 0.3 else c.get_lease(lease["id"]))
                    self.calls += 1
                if lease["state"] in ("queued", "active"):
                    await c.release(lease["id"], reason="bench client done")
                    self.calls += 1
            except BrokerError as e:
                if e.status not in (400, 409):
                    self.errors.append(f"{e.status} {e.message}")
                await asyncio.sleep(0.2)


# --------------------------------------------------------------------------- a grown database
DAY = 86400.0


def _lease_templates(now: float) -> list[tuple[dict, list[dict]]]:
    """One real lease per shape and its events (requested, granted, ended), decided by the
    scheduler on the pool of tests/brokerhub.py: what the grown leases are copied from."""
    from brokerhub import POOL
    from jupyter_gpulease.core.policy import Policy
    from jupyter_gpulease.core.request import parse_ask
    from jupyter_gpulease.core.scheduler import Scheduler
    from jupyter_gpulease.devices import get_backend

    inventory = get_backend("simulated", {"gpus": POOL}).inventory()
    out = []
    for i, shape in enumerate(SHAPES):
        sched = Scheduler(inventory, Policy())
        lease = sched.new_lease(parse_ask({**shape, "duration_s": 4 * 3600}, user="u", groups=("g",)), now, lease_id=f"t{i}")
        events = sched.submit(lease, now, actor="u") + sched.tick(now) + sched.release(lease.id, now + 60, reason="released by u", actor="u")
        out.append((lease.to_dict(), [e.to_dict() for e in events]))
    return out


def grow_database(db_url: str, *, leases: int = 60_000, days: float = 70.0, now: float | None = None, users: int = 400,
                  usage_days: float = 7.0, seed: int = 7) -> dict:
    """Write ``leases`` ended leases spread over the last ``days`` days into ``db_url`` (made or
    upgraded to the current schema) straight through :class:`~jupyter_gpulease.store.LeaseStore`:
    each with its events (requested, granted, ended; one in twenty withdrawn while queued) and
    its usage record, and hourly usage rows for the last ``usage_days``. Returns what it wrote."""
    from jupyter_gpulease.store import Batch, LeaseStore, UsageBatch

    rng = random.Random(seed)
    now = time.time() if now is None else now
    templates = _lease_templates(now)
    store = LeaseStore(db_url)
    t0 = time.perf_counter()
    span = days * DAY
    written_events = 0
    batch, usage = Batch(), UsageBatch()

    def flush():
        nonlocal batch, usage, written_events
        batch.usage = usage
        written_events += len(batch.events)
        store.write(batch)
        batch, usage = Batch(), UsageBatch()

    for i in range(leases):
        base, events = templates[i % len(templates)]
        user = f"user{rng.randrange(users):03d}"
        team = f"group{int(user[4:]) % 20:02d}"
        lid = f"{rng.getrandbits(128):032x}"
        created = now - span + span * i / leases + rng.random() * 60
        wait = rng.random() * 300
        d = {**base, "id": lid, "user": user, "groups": [team], "created_at": created, "seq": i + 1, "meta": {}, "usage": {}}
        if rng.random() < 0.05:  # withdrawn while queued
            d.update(state="withdrawn", granted_at=None, expires_at=None, placement=None, ended_at=min(created + wait, now - 1),
                     end_reason=f"withdrawn by {user}")
        else:
            granted = created + wait
            d.update(state=rng.choice(("released",) * 8 + ("expired", "reclaimed")), granted_at=granted, expires_at=granted + d["duration_s"],
                     ended_at=min(granted + rng.uniform(0.25, 4.0) * 3600, now - 1))
        batch.leases[lid] = d
        for template in events:
            if template["kind"] == "granted" and d["granted_at"] is None:
                continue
            e = {**template, "lease_id": lid}
            if e["kind"] == "requested":
                e["time"] = created
            elif e["kind"] == "granted":
                e["time"] = d["granted_at"]
            else:
                e.update(time=d["ended_at"], from_state="active" if d["granted_at"] else "queued", to_state=d["state"], reason=d["end_reason"])
            batch.events.append(e)
        if d["granted_at"] is not None:
            _usage_rows(usage, d, team, wait, rng, hourly=d["ended_at"] > now - usage_days * DAY)
        if len(batch.leases) >= 2000:
            flush()
    if batch.leases:
        flush()
    size = store.sqlite_path.stat().st_size if store.sqlite_path is not None else None
    store.close()
    return {"leases": leases, "events": written_events, "days": days, "grow_s": round(time.perf_counter() - t0, 1),
            **({"size_mib": round(size / 2**20, 1)} if size else {})}


def _usage_rows(usage, d: dict, team: str, wait: float, rng: random.Random, *, hourly: bool) -> None:
    """A lease's accounting record (and its hourly rows) as the broker's usage recorder writes them."""
    granted, ended = d["granted_at"], d["ended_at"]
    slices = d["placement"]["slices"]
    frac = sum(s["share"] for s in slices)
    busy = (ended - granted) * frac * rng.random()
    usage.leases[d["id"]] = {
        "lease_id": d["id"], "user": d["user"], "team": team, "groups": [team], "tier": d["tier"], "model": slices[0]["model"],
        "slice_kind": "gpu" if frac >= 1 else "share", "slice": f"{frac:g}", "gpus": len(slices), "fraction": frac, "mem_mib": slices[0]["memory_mib"], "asked_s": d["duration_s"], "created_at": d["created_at"],
        "granted_at": granted, "ended_at": ended, "end_state": d["state"], "queue_wait_s": wait, "held_s": ended - granted,
        "held_gpu_s": (ended - granted) * frac, "busy_gpu_s": busy, "mem_peak_mib": 9000, "reclaims": 0, "suspends": 0, "preemptions": 0,
        "devices": {}, "state": {}}
    if hourly:
        hour = int(granted) - int(granted) % 3600
        while hour < ended:
            usage.hours[(hour, d["id"], "")] = ["", d["user"], team, slices[0]["model"], d["tier"], 3600.0 * frac, busy / max(1.0, (ended - granted) / 3600), 9000]
            hour += 3600


def serving_pid(hub, supervised: bool, pg: tuple[int, str] | None = None) -> int | None:
    """The broker that serves: the holder of the database's lock (with a supervisor), else the
    hub's one broker process."""
    if pg is not None:
        return active_broker_pid_postgres(*pg)
    if supervised:
        return active_broker_pid(hub)
    brokers = [pid for pid, cmd in hub.descendants() if "jupyter_gpulease.broker" in cmd]
    return brokers[0] if len(brokers) == 1 else None


def supervisor_pid(hub) -> int | None:
    sups = [pid for pid, cmd in hub.descendants() if "jupyter_gpulease.broker" in cmd and "worker=True" not in cmd]
    return sups[0] if len(sups) == 1 else None


def hub_worker_serves(hub, pg: tuple[int, str] | None, not_pid: int) -> int | None:
    """A broker of the hub's (new) supervisor holds the lock: a hub descendant, not ``not_pid``."""
    pid = serving_pid(hub, True, pg)
    if pid is None or pid == not_pid or pid not in {p for p, _ in hub.descendants()}:
        return None
    return pid


def run_case(name: str, tmp: Path, kills: int, config: str, db_url: str | None = None, pg_port: int | None = None, kill: str = "worker",
             clients: int = 0, grown: dict | None = None, baseline: bool = False) -> dict:
    supervised = "supervise = False" not in config
    pg = (pg_port, db_url.rsplit("/", 1)[1]) if pg_port is not None and db_url else None  # the PostgreSQL server and database
    folder = tmp / name.replace(" ", "-").replace(",", "")
    folder.mkdir()
    users = ("alice", "bob", "carol", *(f"user{i:02d}" for i in range(20 if clients else 0)))
    hub = hub_for_broker(folder, db_url=db_url, users=users, extra_config="c.GPULeaseBroker.reconcile_interval = 0\n" + config, log_level="INFO",
                         config_lines=[] if baseline else [JSON_ERRORS_PROXY])
    hub.start()
    poller = writer = load = None
    try:
        token = hub.create_token("alice")
        wait_for_broker(hub, token, timeout=180)
        load = Load(hub.service_url("gpulease"), [hub.create_token(u) for u in users[3:]], clients)
        load.start()
        poller = Poller(hub.service_url("gpulease") + "api/pool", token)
        poller.start()
        writer = Writer(hub.service_url("gpulease"), token)
        writer.start()
        wait_for(lambda: len(poller.ok) >= 5 and len(writer.ok) >= 5, 60, "the poller or the writer never got an answer")
        downtimes, lock_times, write_gaps, read_gaps, restarts = [], [], [], [], []
        standby = supervised and "standbys = 0" not in config
        for i in range(kills):
            pid = wait_for(lambda: serving_pid(hub, supervised, pg), 120, "no serving broker")
            if standby and kill == "worker" and baseline:
                time.sleep(8)  # a broker that does not read ahead: its new standby has started by then
            elif standby and kill == "worker":
                # a standby is ready as it would be between two failures at a site: it has read ahead
                wait_for(lambda i=i: hub.log_file.read_text(errors="replace").count("read ahead the") >= i + 1, 180, "the standby did not read ahead")
            wait_for(lambda: poller.ok and poller.ok[-1] > time.monotonic() - 0.5, 60, "the broker does not answer")
            time.sleep(1.0 + 0.37 * i)  # somewhere between two polls
            t_kill = time.monotonic()
            if kill == "supervisor":
                sup = wait_for(lambda: supervisor_pid(hub), 30, "no supervisor")
                os.kill(sup, signal.SIGKILL)
                # the orphan serves on until the hub restarts the service and hands over then
                wait_for(lambda pid=pid: hub_worker_serves(hub, pg, pid), 120, "no broker of a new supervisor took the lock", interval=0.01)
                t_new = time.monotonic()
                restarts.append(t_new - t_kill)
                wait_for(lambda pid=pid: not pid_alive(pid), 30, "the old broker did not stop after the hand-over")
                time.sleep(2)
                write_gaps.append(writer.longest_gap(t_kill - 0.5, time.monotonic()))
                read_gaps.append(poller.longest_gap(t_kill - 0.5, time.monotonic()))
                continue
            os.kill(pid, signal.SIGKILL)
            if supervised:
                wait_for(lambda pid=pid: (p := serving_pid(hub, True, pg)) and p != pid, 120, "no broker took the lock", interval=0.01)
                lock_times.append(time.monotonic() - t_kill)
            downtimes.append(poller.first_answer_after(t_kill) - t_kill)
            wait_for(lambda pid=pid: not pid_alive(pid), 10, "the killed broker lives on")
            wait_for(lambda: serving_pid(hub, supervised, pg) and writer.ok[-1] > time.monotonic() - 0.5, 120, "writes did not resume")
            time.sleep(2)
            write_gaps.append(writer.longest_gap(t_kill - 0.5, time.monotonic()))
            read_gaps.append(poller.longest_gap(t_kill - 0.5, time.monotonic()))
        res = {"case": name, "killed": kill, "kills": kills, "clients": clients, **({"database": grown} if grown else {}),
               "non_json_answers": len(writer.non_json) + len(poller.non_json)}
        if downtimes:
            res.update({"no_answer_s": [round(x, 2) for x in downtimes],
                        "no_answer_p50_s": round(statistics.median(downtimes), 2), "no_answer_max_s": round(max(downtimes), 2)})
        if restarts:
            res["hub_restart_s"] = [round(x, 2) for x in restarts]
        res.update({"read_gap_s": [round(x, 2) for x in read_gaps], "read_gap_max_s": round(max(read_gaps), 2),
                    "write_gap_s": [round(x, 2) for x in write_gaps], "write_gap_p50_s": round(statistics.median(write_gaps), 2),
                    "write_gap_max_s": round(max(write_gaps), 2)})
        if lock_times:
            res["lock_taken_p50_s"] = round(statistics.median(lock_times), 2)
        return res
    finally:
        for t in (poller, writer):
            if t is not None:
                t.stop.set()
        if load is not None:
            load.finish()
        hub.stop()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=5, help="kills per case with a supervisor (without one: 3 at most)")
    p.add_argument("--postgres", action="store_true", help="also the standby on a PostgreSQL server started for it")
    p.add_argument("--kill", choices=("worker", "supervisor"), default="worker",
                   help="supervisor: SIGKILL the supervisor, side by side with killing the serving broker (both with the standby)")
    p.add_argument("--grown", action="store_true", help="the standby on a grown database, side by side with a fresh one (see the module doc)")
    p.add_argument("--leases", type=int, default=60_000, help="--grown: ended leases in the grown database")
    p.add_argument("--days", type=float, default=70.0, help="--grown: over how many days they ended")
    p.add_argument("--clients", type=int, default=0, help="clients requesting, reading, extending and releasing leases all the while")
    p.add_argument("--baseline", action="store_true",
                   help="--grown, the brokers of an earlier build (PYTHONPATH): the hub's own proxy, and 8 s between a take-over and the next kill "
                        "instead of waiting for the standby's read-ahead")
    p.add_argument("--out", default=None, help="default: benchmarks/results/handover.json (handover_supervisor.json with --kill supervisor, "
                                              "handover_grown.json with --grown)")
    args = p.parse_args(argv)
    name = "handover_supervisor" if args.kill == "supervisor" else "handover_grown" if args.grown else "handover"
    args.out = args.out or str(HERE / "results" / f"{name}.json")
    tmp = Path(tempfile.mkdtemp(prefix="bench-handover-"))
    tmp.chmod(0o755)  # PostgreSQL runs as its own user
    result = {"command": "python benchmarks/bench_handover.py " + " ".join(argv if argv is not None else sys.argv[1:]), "python": sys.version.split()[0], "cpus": os.cpu_count()}
    if args.grown:
        result["cases"] = cases = grown_cases(tmp, args)
        print_cases(cases)
        save(result, args.out)
        return 0
    if args.kill == "supervisor":
        cases = [
            run_case("standby, broker killed", tmp, args.kills, "c.GPULeaseBroker.standbys = 1\n"),
            run_case("standby, supervisor killed", tmp, args.kills, "c.GPULeaseBroker.standbys = 1\n", kill="supervisor"),
        ]
    else:
        cases = [
            run_case("standby", tmp, args.kills, "c.GPULeaseBroker.standbys = 1\n"),
            run_case("no standby", tmp, args.kills, "c.GPULeaseBroker.standbys = 0\n"),
            run_case("no supervisor", tmp, min(3, args.kills), "c.GPULeaseBroker.supervise = False\n"),
        ]
    if args.postgres:
        from pgserver import PostgresServer

        pg = PostgresServer(tmp / "pg")
        pg.start()
        try:
            if args.kill == "supervisor":
                cases.append(run_case("standby, PostgreSQL, supervisor killed", tmp, args.kills, "c.GPULeaseBroker.standbys = 1\n",
                                      db_url=pg.create_database("handover"), pg_port=pg.port, kill="supervisor"))
            else:
                cases.append(run_case("standby, PostgreSQL", tmp, args.kills, "c.GPULeaseBroker.standbys = 1\n", db_url=pg.create_database("handover"), pg_port=pg.port))
        finally:
            pg.stop()
    result["cases"] = cases
    print_cases(cases)
    save(result, args.out)
    return 0


def grown_cases(tmp: Path, args) -> list[dict]:
    """The standby on a fresh database and on a grown one, SQLite (and PostgreSQL)."""
    from jupyter_gpulease.broker.manager import usage_lookback
    from jupyter_gpulease.core.policy import Policy

    config = "c.GPULeaseBroker.standbys = 1\n"
    now = time.time()
    window = usage_lookback(Policy())
    in_window = round(args.leases * 0.95 * min(1.0, window / (args.days * DAY)))  # the granted ones that ended within the window

    def grown(db_url: str) -> dict:
        info = grow_database(db_url, leases=args.leases, days=args.days, now=now)
        print(f"grew {db_url.split('@')[-1]}: {info}", flush=True)
        return {**info, "usage_window_days": window / DAY, "past_leases_in_usage_window_about": in_window}

    template = tmp / "grown.sqlite"
    info = grown(f"sqlite:///{template}")
    copy = tmp / "grown-copy.sqlite"
    shutil.copy2(template, copy)
    cases = [
        run_case("standby, fresh SQLite", tmp, args.kills, config, clients=args.clients, baseline=args.baseline),
        run_case("standby, grown SQLite", tmp, args.kills, config, db_url=f"sqlite:///{copy}", clients=args.clients, grown=info, baseline=args.baseline),
    ]
    if args.postgres:
        from pgserver import PostgresServer

        pg = PostgresServer(tmp / "pg")
        pg.start()
        try:
            cases.append(run_case("standby, fresh PostgreSQL", tmp, args.kills, config, db_url=pg.create_database("fresh"), pg_port=pg.port,
                                  clients=args.clients, baseline=args.baseline))
            url = pg.create_database("grown")
            info = grown(url)
            cases.append(run_case("standby, grown PostgreSQL", tmp, args.kills, config, db_url=url, pg_port=pg.port, clients=args.clients, baseline=args.baseline,
                                  grown=info))
        finally:
            pg.stop()
    return cases


def print_cases(cases: list[dict]) -> None:
    for c in cases:
        lock = f", the next broker held the lock after {c['lock_taken_p50_s']} s (p50)" if "lock_taken_p50_s" in c else ""
        first = f"no answer for {c['no_answer_p50_s']} s p50, {c['no_answer_max_s']} s max; " if "no_answer_p50_s" in c else ""
        hub = f"; the hub restarted the service {min(c['hub_restart_s'])}-{max(c['hub_restart_s'])} s after the kill" if "hub_restart_s" in c else ""
        print(f"{c['case']:>38}: {first}longest gap between writes {c['write_gap_p50_s']} s p50, {c['write_gap_max_s']} s max "
              f"({', '.join(map(str, c['write_gap_s']))}), between reads {c['read_gap_max_s']} s max, over {c['kills']} kills{lock}{hub}; "
              f"{c['non_json_answers']} answers not JSON")


def save(result: dict, path: str) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {out}")


if __name__ == "__main__":
    sys.exit(main())
