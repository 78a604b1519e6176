"""Broker benchmarks: a guard at the load a large hub makes, side by side with a baseline build;
on request, stress loads far above it; and memory holding many leases.

    python benchmarks/bench_broker.py [--servers 10000] [--interval 30] [--users 30] [--rounds 1] [--base f009040] [--stalls] [--py-spy FILE]
    python benchmarks/bench_broker.py --stress [--clients 200] [--seconds 20] [--base 8bdb240 ...] [--rates 500,800,1000] [--leases 100000]

0. The guard (the default): the heartbeats of ``--servers`` single-user servers, each one every
   ``--interval`` seconds at its own moment (10,000 servers every 30 s: ~333 calls/s, each a
   heartbeat body like the server extension's: the lease's device and two kernels), plus a
   spawn storm in the middle of the window: ``--users`` users ask for a GPU at the same moment
   while only 8 are free, each polls its lease until it is granted (as a spawn's progress page
   does), holds it ``--hold`` seconds and releases it. The broker runs as its own process
   (SQLite file, WAL, every commit fsynced) on 127.0.0.1; the servers' leases are made before
   the window (not measured). Latency counts from the moment a heartbeat was due (open loop:
   a broker that falls behind shows it); writes are heartbeats, requests and releases; reads
   are the storm's polls. The broker's CPU per call over the window: its event loop's thread
   and the other threads (the store's writer). Every ``--base`` build (a ``git worktree`` of that
   commit; the default is the last one before usage records and GPU health sensing, whose
   REST API ran on a lean handler of its own instead of tornado.web) and this tree run
   ``--rounds`` times, alternately, in the same script, so that all see the same machine.
   Target: writes p99 <= 60 ms, with usage records and health sensing on (the base made 57 ms
   on a quiet machine).

   Where the time goes: ``--stalls`` has every build's broker note, over the window, when its
   event loop was held up (a probe that sleeps 5 ms and sees how late it wakes; stalls over
   20 ms) and each pause of the garbage collector over 5 ms (every full collection); the
   summary gives their count and the longest (the probe costs each build the same).
   ``--py-spy FILE`` records this tree's broker during the window with py-spy (``pip install
   py-spy``; ``raw`` output, or ``speedscope`` for a ``.json`` FILE): where its loop's CPU goes.

Stress loads (``--stress``):

1. Load: the broker runs as its own process (SQLite file, WAL, synchronous=FULL: every commit
   fsyncs) on 127.0.0.1 with a pool of 256 GPUs. A second process runs ``--clients`` clients,
   each on its own keep-alive connection, in a loop of the mixed calls a hub makes: request a
   lease (granted at once), read it, extend it, release it. Latency by kind (writes: request,
   extend, release; reads: get).

   * Closed loop: each client sends its next call as soon as the last is answered, for
     ``--seconds``: the most calls per second the build answers. With 200 clients that each
     wait for their answer, latency is at least 200 / throughput (Little's law), whatever the
     server; the same load against Tornado alone (a handler that answers every call with a
     lease of the same size, no broker behind it) shows that floor on this machine. Two floors:
     ``tornado.web alone`` (a ``RequestHandler``, what any tornado.web service pays) and
     ``HTTP/1.1 alone`` (a bare delegate on Tornado's HTTP/1.1 server whose calls each await
     one loop turn before they answer: the least any HTTP/1.1 service on Tornado can cost).
   * Open loop, at each of ``--rates``: the clients' calls arrive as Poisson processes adding
     up to that many calls per second, answered or not; latency counts from when a call was
     due (no coordinated omission). This is latency at a given load.

   The load also reads the server process's CPU time per thread (``/proc``) at the start and
   the end of the measured window: the event loop's thread (all of the HTTP side, the
   handlers, the scheduler) and the others (the store's writer), in microseconds per call, and
   how busy the loop thread was. Both floors run every open-loop rate too: the loop's cost per
   call and its latency at that rate with no broker behind it.

   Every ``--base`` build (a ``git worktree`` of that commit in a temporary folder) and this
   tree run the same loads in the same script, one after the other, so all see the same
   machine. The hub's token check is left out (the caller is named by the token, as in the
   unit tests): it is a cached lookup per token.
2. Memory (with ``--stress``): this build's process RSS before and after holding ``--leases`` live leases (1 000
   active on 1 000 GPUs, the rest queued), and the time of a scheduling pass over them.

Figures are printed and saved as JSON (``--out``); nothing here asserts on them.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from procstat import thread_cpu

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
POOL = [{"node": f"n{i}", "model": "A100-SXM4-80GB", "count": 8, "memory_mib": 81920} for i in range(32)]

# Runs the broker of the source tree given as argv[1] (its own package first on sys.path), with
# the caller named by the token: the same for any build that has GPULeaseBroker and
# APIHandler.authenticate, which both builds compared here have.
SERVE = r'''
import asyncio, json, sys
src, db, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
sys.path.insert(0, src)
from traitlets.config import Config
from jupyter_gpulease.broker import handlers
from jupyter_gpulease.broker.app import GPULeaseBroker

async def authenticate(self):
    h = self.request.headers.get("Authorization", "")
    name = h.split(None, 1)[1].strip() if h.lower().startswith("token ") else ""
    return {"kind": "user", "name": name, "groups": [], "scopes": ["access:services!service=gpulease"], "admin": False} if name else None

handlers.APIHandler.authenticate = authenticate
c = Config()
c.GPULeaseBroker.db_url = f"sqlite:///{db}"
c.GPULeaseBroker.device_backend = "simulated"
c.GPULeaseBroker.devices = {"gpus": json.loads(open(sys.argv[4][1:]).read() if sys.argv[4].startswith("@") else sys.argv[4])}
c.GPULeaseBroker.bind_url = f"http://127.0.0.1:{port}"
c.GPULeaseBroker.base_url = "/services/gpulease/"
c.GPULeaseBroker.config_file = ""
c.GPULeaseBroker.reconcile_interval = 0
c.GPULeaseBroker.log_level = "WARN"
app = GPULeaseBroker(config=c)
app.initialize([])
import jupyter_gpulease
print("serving", jupyter_gpulease.__file__, flush=True)
if len(sys.argv) > 5 and sys.argv[5] == "--stalls":
    import gc, time
    started = {}

    def note(line: str) -> None:  # one write per line: a collection may run on another thread mid-print
        sys.stdout.write(line + "\n")
        sys.stdout.flush()

    def pause(phase, info):  # the collector's pauses, as they happen
        if phase == "start":
            started["t"] = time.perf_counter()
            return
        ms = (time.perf_counter() - started.get("t", time.perf_counter())) * 1000
        if ms > 5 or info["generation"] == 2:
            note(f"GC {time.time() - ms / 1000:.3f} {ms:.1f} {info['generation']}")

    gc.callbacks.append(pause)

    async def probe():  # how late a 5 ms sleep wakes: the loop was held up that long
        loop = asyncio.get_running_loop()
        while True:
            t = loop.time()
            await asyncio.sleep(0.005)
            late = loop.time() - t - 0.005
            if late > 0.02:
                note(f"STALL {time.time() - late:.3f} {late * 1000:.1f}")

    started_async = app.start_async

    async def start_async():
        ok = await started_async()
        asyncio.ensure_future(probe())
        return ok

    app.start_async = start_async
app.start()
'''


# The floor: Tornado alone, with no broker behind it, answering each call of the same load with a
# lease of the same size (what any Tornado service, JupyterHub's included, costs on this machine).
SERVE_FLOOR = r'''
import asyncio, json, sys
from tornado import web
port = int(sys.argv[3])
LEASE = json.dumps({"id": "0" * 32, "user": "user0", "server": "", "groups": [], "request": {"kind": "gpu", "gpus": 1}, "tier": "experiment",
    "duration_s": 3600.0, "max_wait_s": None, "prefer_gpus": [], "require_gpus": [], "resuming": False, "seq": 1, "state": "active",
    "created_at": 1796054473.5509908, "granted_at": 1796054473.551366, "expires_at": 1796061673.551366, "ended_at": None, "end_reason": "",
    "placement": {"node": "n0", "slices": [{"gpu_uuid": "GPU-sim-50e8d57c-ee3f-5bc7-82c8-0954ceefd30b", "node": "n0", "index": 0,
    "model": "A100-SXM4-80GB", "memory_mib": 81920, "share": 1.0}]}, "warned_at": None, "preempt_at": None, "preempted_for": "",
    "confirmed_at": None, "last_heartbeat": None, "usage": {}, "meta": {}})

class Lease(web.RequestHandler):
    def check_xsrf_cookie(self):
        pass
    def get(self, *args):
        self.set_header("Content-Type", "application/json; charset=utf-8")
        self.finish(LEASE)
    def post(self, *args):
        json.loads(self.request.body)
        self.set_status(201 if not args[0] else 200)
        self.get()

async def main():
    web.Application([(r"/services/gpulease/api/leases(/[0-9a-f]+(?:/[a-z]+)?)?/?", Lease)]).listen(port, "127.0.0.1")
    print("serving Tornado alone", flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
'''

# The broker API's own floor: Tornado's HTTP/1.1 server and a bare delegate (no tornado.web), each
# call a task that awaits one loop turn (a broker call awaits its commit) and then answers the
# same lease.
SERVE_DELEGATE = SERVE_FLOOR.split("class Lease(")[0] + r'''
from tornado import httputil
from tornado.httpserver import HTTPServer
BODY = LEASE.encode()

class Call(httputil.HTTPMessageDelegate):
    def __init__(self, conn):
        self.conn, self.chunks = conn, []
    def headers_received(self, start_line, headers):
        self.start_line = start_line
    def data_received(self, chunk):
        self.chunks.append(chunk)
    def finish(self):
        asyncio.ensure_future(self.answer())
    async def answer(self):
        await asyncio.sleep(0)
        code = 200
        if self.start_line.method == "POST":
            json.loads(b"".join(self.chunks))
            code = 201 if self.start_line.path.rstrip("/").endswith("leases") else 200
        h = httputil.HTTPHeaders()
        h["Content-Type"] = "application/json; charset=utf-8"
        h["Content-Length"] = str(len(BODY))
        self.conn.write_headers(httputil.ResponseStartLine("", code, "OK"), h, BODY)
        self.conn.finish()

class Server(httputil.HTTPServerConnectionDelegate):
    def start_request(self, server_conn, request_conn):
        return Call(request_conn)

async def main():
    HTTPServer(Server()).listen(port, "127.0.0.1")
    print("serving Tornado's HTTP/1.1 server alone", flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
'''
FLOORS = [("tornado.web alone", SERVE_FLOOR), ("HTTP/1.1 alone", SERVE_DELEGATE)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


# --------------------------------------------------------------------------- the load
class Conn:
    """One keep-alive HTTP/1.1 connection: as little client work per call as possible."""

    def __init__(self, port: int, user: str):
        self.port, self.user = port, user
        self.reader = self.writer = None

    async def call(self, method: str, path: str, body: dict | None = None, user: str | None = None) -> tuple[int, dict]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        data = json.dumps(body).encode() if body is not None else b""
        head = (f"{method} /services/gpulease/{path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: token {user or self.user}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n")
        self.writer.write(head.encode() + data)
        status_line = await self.reader.readline()
        length = 0
        while True:
            line = await self.reader.readline()
            if line in (b"\r\n", b""):
                break
            k, _, v = line.decode().partition(":")
            if k.lower() == "content-length":
                length = int(v)
        payload = await self.reader.readexactly(length) if length else b""
        return int(status_line.split()[1]), (json.loads(payload) if payload else {})


# one client's loop: what a hub's spawner and a server do with a lease
CYCLE = [
    ("request", "POST", None, {"gpus": 1, "duration_s": 3600}),
    ("get", "GET", None, None),
    ("extend", "POST", "extend", {"by_s": 60}),
    ("release", "POST", "release", {}),
]


def path_of(kind: str, lease_id: str | None, action: str | None) -> str:
    return "api/leases" if kind == "request" else f"api/leases/{lease_id}" + (f"/{action}" if action else "")


def checked(kind: str, status: int, answer: dict, errors: list[str]) -> bool:
    """Note what is wrong with an answer; False when the client's cycle cannot go on."""
    if status >= 400:
        errors.append(f"{kind} {status} {answer.get('message', '')[:80]}")
        return False
    if kind == "request" and answer["state"] != "active":
        errors.append(f"request answered {answer['state']}")
    return True


async def client(port: int, i: int, stop_at: float, lat: dict[str, list[float]], errors: list[str]) -> None:
    conn = Conn(port, f"user{i}")
    while time.perf_counter() < stop_at:
        lease_id = None
        for kind, method, action, body in CYCLE:
            t0 = time.perf_counter()
            status, answer = await conn.call(method, path_of(kind, lease_id, action), body)
            lat[kind].append((time.perf_counter() - t0) * 1000)
            if not checked(kind, status, answer, errors):
                break
            if kind == "request":
                lease_id = answer["id"]


async def paced_client(port: int, i: int, rate: float, start: float, stop_at: float, lat: dict[str, list[float]], errors: list[str], rng) -> None:
    """Open loop: this client's calls arrive as a Poisson process of ``rate`` calls/s, whether or
    not the broker keeps up; a call's latency counts from the moment it was due (a late answer
    delays the next call's send, not its due time: no coordinated omission)."""
    conn = Conn(port, f"user{i}")
    due = start + rng.expovariate(rate)
    while due < stop_at:
        lease_id = None
        for kind, method, action, body in CYCLE:
            if due >= stop_at or time.perf_counter() >= stop_at + 5:  # (a build that falls far behind)
                return
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            status, answer = await conn.call(method, path_of(kind, lease_id, action), body)
            lat[kind].append((time.perf_counter() - due) * 1000)
            due += rng.expovariate(rate)
            if not checked(kind, status, answer, errors):
                break
            if kind == "request":
                lease_id = answer["id"]


def summary(lat: dict[str, list[float]], errors: list[str], elapsed: float) -> dict:
    n = sum(len(v) for v in lat.values())
    writes = lat["request"] + lat["extend"] + lat["release"]
    res = {"seconds": round(elapsed, 1), "calls": n, "calls_per_s": round(n / elapsed, 1), "errors": len(errors), "first_errors": errors[:3],
           "write_ms_p50": round(statistics.median(writes), 1), "write_ms_p99": round(pct(writes, 99), 1),
           "read_ms_p50": round(statistics.median(lat["get"]), 1), "read_ms_p99": round(pct(lat["get"], 99), 1)}
    for k, v in lat.items():
        res[f"{k}_ms_p50"], res[f"{k}_ms_p99"] = round(statistics.median(v), 1), round(pct(v, 99), 1)
    return res


def cpu_figures(pid: int, before: dict[int, float], after: dict[int, float], calls: int, elapsed: float) -> dict:
    """The server's CPU over the measured window: its main thread (the event loop) and the rest."""
    if not before or not after or not calls:
        return {}
    loop = after.get(pid, 0.0) - before.get(pid, 0.0)
    other = sum(t - before.get(tid, 0.0) for tid, t in after.items() if tid != pid)
    return {"loop_cpu_us_per_call": round(loop / calls * 1e6), "other_cpu_us_per_call": round(other / calls * 1e6), "loop_busy": round(loop / elapsed, 2)}


def load_main(port: int, clients: int, seconds: float, out: str, rate: float = 0.0, server_pid: int = 0) -> None:
    """Closed loop (``rate`` 0: each client sends its next call when the last is answered, the
    most the broker can answer) or open loop (``rate`` calls/s offered by all clients together)."""
    import random

    async def go():
        lat: dict[str, list[float]] = {k: [] for k in ("request", "get", "extend", "release")}
        errors: list[str] = []
        warm = time.perf_counter() + 2
        warm_lat: dict[str, list[float]] = {k: [] for k in lat}
        await asyncio.gather(*(client(port, i, warm, warm_lat, []) for i in range(clients)))  # connect and warm up
        cpu_before = thread_cpu(server_pid) if server_pid else {}
        t0 = time.perf_counter()
        if rate:
            rng = random.Random(1)
            await asyncio.gather(*(paced_client(port, i, rate / clients, t0, t0 + seconds, lat, errors, rng) for i in range(clients)))
        else:
            await asyncio.gather(*(client(port, i, t0 + seconds, lat, errors) for i in range(clients)))
        elapsed = time.perf_counter() - t0
        cpu_after = thread_cpu(server_pid) if server_pid else {}
        res = {"clients": clients, "offered_calls_per_s": rate or None, "warm_up_calls": sum(len(v) for v in warm_lat.values()), **summary(lat, errors, elapsed)}
        res.update(cpu_figures(server_pid, cpu_before, cpu_after, res["calls"], elapsed))
        Path(out).write_text(json.dumps(res))

    asyncio.run(go())


def wait_listening(broker: subprocess.Popen, port: int, log: Path, name: str) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if broker.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the {name} broker did not start: {log.read_text()[-2000:]}") from None
            time.sleep(0.2)


def run_load(src: Path, tmp: Path, name: str, clients: int, seconds: float, rate: float = 0.0, serve: str = SERVE) -> dict:
    port = free_port()
    slug = "".join(c if c.isalnum() or c in "._" else "-" for c in name)  # a file name
    db = tmp / f"{slug}-{rate:.0f}.sqlite"
    log = open(tmp / f"{slug}-broker.log", "wb")  # noqa: SIM115 - kept open for the broker's life
    broker = subprocess.Popen([sys.executable, "-c", serve, str(src), str(db), str(port), json.dumps(POOL)], stdout=log, stderr=subprocess.STDOUT, cwd=tmp)
    try:
        wait_listening(broker, port, tmp / f"{slug}-broker.log", name)
        out = tmp / f"{slug}-load.json"
        subprocess.run([sys.executable, __file__, "--_load", str(port), str(clients), str(seconds), str(out), str(rate), str(broker.pid)], check=True, timeout=seconds + 300)
        res = json.loads(out.read_text())
    finally:
        broker.terminate()
        try:
            broker.wait(30)
        except subprocess.TimeoutExpired:
            broker.kill()
        log.close()
    served = next((line for line in (tmp / f"{slug}-broker.log").read_text().splitlines() if line.startswith("serving ")), "")
    res["build"] = name
    res["served_from"] = served.split(" ", 1)[-1]
    return res


def base_tree(rev: str, tmp: Path, name: str = "base") -> Path:
    """A git worktree of ``rev`` (a baseline build) in ``tmp``."""
    dest = tmp / f"base-{name}"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(dest), rev], check=True, capture_output=True)
    return dest


# --------------------------------------------------------------------------- the guard
GUARD_FREE_GPUS = 8  # what the spawn storm's users share: the servers' leases hold the rest


def guard_pool(servers: int) -> list[dict]:
    nodes = -(-(servers + GUARD_FREE_GPUS) // 8)
    return [{"node": f"n{i}", "model": "A100-SXM4-80GB", "count": 8, "memory_mib": 81920} for i in range(nodes)]


def heartbeat_body(lease: dict, t: float, i: int) -> dict:
    """What a server extension sends: its usage per device and per kernel (server/usage.py)."""
    uuid = (lease.get("placement") or {}).get("slices", [{}])[0].get("gpu_uuid", "GPU-0")
    busy = i % 3 != 0
    return {"usage": {
        "t": round(t, 1), "gpu_busy": busy, "last_gpu_activity": round(t - (1 if busy else 600), 1), "attribution": "pid", "lease_reclaim_at": None,
        "devices": {uuid: {"busy_s": 1234.5 + i % 100, "idle_s": 456.7, "mem_peak_mib": 20480}},
        "kernels": {f"{i:08x}-0000-4000-8000-{j:012x}": {"busy_s": 600.0 + j, "idle_s": 30.0, "mem_peak_mib": 10240, "state": "idle" if j else "busy",
                                                          "name": "python3", "path": f"projects/run{j}/train.ipynb"} for j in range(2)},
    }}


class Pool:
    """Keep-alive connections shared by calls (as a proxy or a hub's client pool holds them)."""

    def __init__(self, port: int, size: int):
        self.free: asyncio.Queue[Conn] = asyncio.Queue()
        for _ in range(size):
            self.free.put_nowait(Conn(port, ""))

    async def call(self, method: str, path: str, body: dict | None, user: str) -> tuple[int, dict]:
        conn = await self.free.get()
        try:
            return await conn.call(method, path, body, user)
        finally:
            self.free.put_nowait(conn)


def guard_main(port: int, servers: int, interval: float, users: int, hold: float, out: str, server_pid: int, py_spy: str = "") -> None:
    """The load process of the guard (see the module doc); ``py_spy``: where to record the broker
    with py-spy over the window ("": not)."""
    import random

    async def go():
        pool = Pool(port, 256)
        errors: list[str] = []
        # the servers' leases, made before the window
        leases: list[dict] = [{}] * servers

        async def make(i: int) -> None:
            status, answer = await pool.call("POST", "api/leases", {"gpus": 1, "duration_s": 8 * 3600}, f"server{i}")
            if status != 201 or answer.get("state") != "active":
                raise RuntimeError(f"server{i}'s lease was answered {status} {answer}")
            leases[i] = answer

        t_seed = time.perf_counter()
        for start in range(0, servers, 1000):
            await asyncio.gather(*(make(i) for i in range(start, min(servers, start + 1000))))
        seed_s = time.perf_counter() - t_seed
        lat: dict[str, list[float]] = {k: [] for k in ("heartbeat", "request", "release", "get")}
        grants: list[float] = []
        rng = random.Random(1)
        phases = sorted((rng.uniform(0, interval), i) for i in range(servers))
        storm_at = interval / 3
        load_before = os.getloadavg()[0]
        spy = None
        if py_spy:
            fmt = "speedscope" if py_spy.endswith(".json") else "raw"
            beside = Path(sys.executable).with_name("py-spy")  # installed in this Python's environment, or on the PATH
            spy = subprocess.Popen([str(beside) if beside.exists() else shutil.which("py-spy") or "py-spy", "record", "-p", str(server_pid), "-o", py_spy, "-f", fmt, "-r", "200",
                                    "-d", str(math.ceil(interval)), "--nonblocking"], stdout=subprocess.DEVNULL)
        cpu_before = thread_cpu(server_pid)
        t0 = time.perf_counter()
        wall0 = time.time()

        async def heartbeat(due: float, i: int) -> None:
            lease = leases[i]
            status, answer = await pool.call("POST", f"api/leases/{lease['id']}/heartbeat", heartbeat_body(lease, wall0 + due - t0, i), f"server{i}")
            lat["heartbeat"].append((time.perf_counter() - due) * 1000)
            if status != 200 or "warnings" not in answer:
                errors.append(f"heartbeat {status} {answer.get('message', '')[:80]}")

        async def heartbeats() -> None:
            tasks = []
            for phase, i in phases:
                due = t0 + phase
                delay = due - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.ensure_future(heartbeat(due, i)))
            await asyncio.gather(*tasks)

        async def spawn(j: int) -> None:
            await asyncio.sleep(storm_at)
            conn, user = Conn(port, f"storm{j}"), f"storm{j}"  # each spawn on its own connection
            asked = time.perf_counter()
            status, lease = await conn.call("POST", "api/leases", {"gpus": 1, "duration_s": 3600})
            lat["request"].append((time.perf_counter() - asked) * 1000)
            if status != 201:
                errors.append(f"request {status} {lease.get('message', '')[:80]}")
                return
            while lease.get("state") == "queued":
                await asyncio.sleep(0.2)
                t = time.perf_counter()
                status, lease = await conn.call("GET", f"api/leases/{lease['id']}", None, user)
                lat["get"].append((time.perf_counter() - t) * 1000)
                if status != 200:
                    errors.append(f"get {status} {lease.get('message', '')[:80]}")
                    return
            if lease.get("state") != "active":
                errors.append(f"storm lease ended {lease.get('state')} unused")
                return
            grants.append(time.perf_counter() - asked)
            await asyncio.sleep(hold)
            t = time.perf_counter()
            status, answer = await conn.call("POST", f"api/leases/{lease['id']}/release", {"reason": "benchmark"}, user)
            lat["release"].append((time.perf_counter() - t) * 1000)
            if status != 200:
                errors.append(f"release {status} {answer.get('message', '')[:80]}")

        await asyncio.gather(heartbeats(), *(spawn(j) for j in range(users)))
        elapsed = time.perf_counter() - t0
        cpu_after = thread_cpu(server_pid)
        if spy is not None:
            spy.wait()
        calls = sum(len(v) for v in lat.values())
        writes = lat["heartbeat"] + lat["request"] + lat["release"]
        res = {"servers": servers, "interval_s": interval, "storm_users": users, "hold_s": hold, "seed_s": round(seed_s, 1),
               "seconds": round(elapsed, 1), "calls": calls, "calls_per_s": round(calls / elapsed, 1), "errors": len(errors), "first_errors": errors[:3],
               "storm_grant_s_p50": round(statistics.median(grants), 2) if grants else None, "storm_grant_s_max": round(max(grants), 2) if grants else None,
               "load_average": [round(load_before, 1), round(os.getloadavg()[0], 1)], "window": [wall0, wall0 + elapsed]}
        for name, xs in (("writes", writes), ("reads", lat["get"]), *lat.items()):
            for p in (50, 95, 99):
                res[f"{name}_ms_p{p}"] = round(pct(xs, p), 1)
            res[f"{name}_n"] = len(xs)
        res.update(cpu_figures(server_pid, cpu_before, cpu_after, calls, elapsed))
        Path(out).write_text(json.dumps(res))

    asyncio.run(go())


def run_guard(src: Path, tmp: Path, name: str, args, rnd: int) -> dict:
    port = free_port()
    slug = "".join(c if c.isalnum() or c in "._" else "-" for c in name) + f"-{rnd}"
    pool_file = tmp / "guard-pool.json"
    pool_file.write_text(json.dumps(guard_pool(args.servers)))
    db = tmp / f"{slug}.sqlite"
    log = open(tmp / f"{slug}-broker.log", "wb")  # noqa: SIM115 - kept open for the broker's life
    probe = ["--stalls"] if args.stalls else []
    broker = subprocess.Popen([sys.executable, "-c", SERVE, str(src), str(db), str(port), f"@{pool_file}", *probe], stdout=log, stderr=subprocess.STDOUT, cwd=tmp)
    try:
        wait_listening(broker, port, tmp / f"{slug}-broker.log", name)
        out = tmp / f"{slug}-guard.json"
        spy = [str(Path(args.py_spy).resolve())] if args.py_spy and src == ROOT else []  # this tree's broker only
        subprocess.run([sys.executable, __file__, "--_guard", str(port), str(args.servers), str(args.interval), str(args.users), str(args.hold), str(out), str(broker.pid),
                        *spy], check=True, timeout=args.interval + 600)
        res = json.loads(out.read_text())
    finally:
        broker.terminate()
        try:
            broker.wait(30)
        except subprocess.TimeoutExpired:
            broker.kill()
        log.close()
    lines = (tmp / f"{slug}-broker.log").read_text().splitlines()
    served = next((line for line in lines if line.startswith("serving ")), "")
    # that build's package answered, not another one on the path
    res.update(build=name, round=rnd + 1, served_by_that_build=Path(served.split(" ", 1)[-1]).resolve().is_relative_to(Path(src).resolve()))
    if args.stalls:
        res.update(stall_figures(lines, *res["window"]))
    return res


def stall_figures(lines: list[str], start: float, end: float) -> dict:
    """The probe's notes (see the module doc) that fall in the window: loop stalls over 20 ms and
    the garbage collector's pauses over 5 ms, each as (seconds into the window, ms)."""
    stalls, pauses, full = [], [], 0
    for line in lines:
        kind, _, rest = line.partition(" ")
        if kind not in ("STALL", "GC"):
            continue
        try:
            at, ms, *gen = rest.split()
            float(at), float(ms)
        except ValueError:  # a line the broker's own output ran into
            continue
        if not start <= float(at) <= end:
            continue
        (stalls if kind == "STALL" else pauses).append((round(float(at) - start, 2), float(ms)))
        full += kind == "GC" and gen == ["2"]
    return {"stalls": stalls, "gc_pauses": pauses, "full_collections": full}


def guard_line(r: dict) -> str:
    def kind(k: str) -> str:
        return f"{k} p50/p95/p99 {r[f'{k}_ms_p50']}/{r[f'{k}_ms_p95']}/{r[f'{k}_ms_p99']} ms ({r[f'{k}_n']})"
    cpu = f"; loop thread {r['loop_cpu_us_per_call']} µs/call ({r['loop_busy']:.0%} busy), other threads {r['other_cpu_us_per_call']} µs/call" if "loop_busy" in r else ""
    if "stalls" in r:
        cpu += (f"; loop stalls over 20 ms: {len(r['stalls'])} (longest {max((ms for _, ms in r['stalls']), default=0):.0f} ms), "
                f"collector pauses over 5 ms: {len(r['gc_pauses'])} (longest {max((ms for _, ms in r['gc_pauses']), default=0):.0f} ms, "
                f"{r['full_collections']} full)")
    return (f"{r['build']:>16} round {r['round']}: {r['calls_per_s']:.0f} calls/s; {kind('writes')}, {kind('reads')}; "
            f"heartbeats p99 {r['heartbeat_ms_p99']} ms; storm: grant p50 {r['storm_grant_s_p50']} s max {r['storm_grant_s_max']} s, "
            f"requests p99 {r['request_ms_p99']} ms, releases p99 {r['release_ms_p99']} ms; {r['errors']} errors{cpu}; "
            f"machine load average {r['load_average'][0]} -> {r['load_average'][1]}")


def guard_summary(runs: list[dict]) -> list[str]:
    """Per build, over its rounds: the median of each round's figures."""
    out = []
    for name in dict.fromkeys(r["build"] for r in runs):
        mine = [r for r in runs if r["build"] == name]

        def med(k: str, mine: list[dict] = mine) -> float:
            return round(statistics.median(r[k] for r in mine), 1)

        ok = "met" if med("writes_ms_p99") <= GUARD_TARGET_MS else "NOT met"
        cpu = f", loop thread {med('loop_cpu_us_per_call'):.0f} µs/call, other threads {med('other_cpu_us_per_call'):.0f} µs/call" if all("loop_busy" in r for r in mine) else ""
        out.append(f"{name:>16} ({len(mine)} round(s), medians): writes p50 {med('writes_ms_p50')} / p95 {med('writes_ms_p95')} / p99 {med('writes_ms_p99')} ms "
                   f"(target p99 <= {GUARD_TARGET_MS} ms: {ok}), reads p50 {med('reads_ms_p50')} / p99 {med('reads_ms_p99')} ms{cpu}, {sum(r['errors'] for r in mine)} errors")
        if all("stalls" in r for r in mine):
            out[-1] += (f"; loop stalls over 20 ms {statistics.median(len(r['stalls']) for r in mine):g}, longest "
                        f"{statistics.median(max((ms for _, ms in r['stalls']), default=0) for r in mine):.0f} ms; full collections "
                        f"{statistics.median(r['full_collections'] for r in mine):g}, longest collector pause "
                        f"{statistics.median(max((ms for _, ms in r['gc_pauses']), default=0) for r in mine):.0f} ms")
    return out


# --------------------------------------------------------------------------- memory
def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


async def memory(tmp: Path, n: int) -> dict:
    sys.path.insert(0, str(ROOT / "tests"))
    from brokerutil import make_broker
    from jupyter_gpulease.broker.manager import SystemClock
    from jupyter_gpulease.core.request import Ask, parse_request

    gpus = 1000
    app = make_broker(tmp, SystemClock(), pool=[{"node": f"n{i}", "model": "A100-SXM4-80GB", "count": 8, "memory_mib": 81920} for i in range(gpus // 8)], db_name="memory.sqlite")
    m = app.manager
    await m.start()
    before = rss_mib()
    one = parse_request({"gpus": 1})
    t0 = time.perf_counter()
    for start in range(0, n, 5000):  # each chunk: one group commit
        await asyncio.gather(*(m.request(Ask(user=f"user{i % 500}", request=one)) for i in range(start, min(n, start + 5000))))
    t_requests = time.perf_counter() - t0
    gc.collect()
    t0 = time.perf_counter()
    m.scheduler.tick(m.now() + 1)
    t_pass = time.perf_counter() - t0
    after = rss_mib()
    active = sum(1 for d in m.committed.values() if d["state"] == "active")
    await m.close()
    return {
        "leases": n,
        "active": active,
        "queued": n - active,
        "rss_before_mib": round(before, 1),
        "rss_after_mib": round(after, 1),
        "rss_per_1000_leases_mib": round((after - before) / n * 1000, 2),
        "requests_s": round(t_requests, 2),
        "commits": m.commits,
        "next_pass_s": round(t_pass, 3),
    }


def line(r: dict) -> str:
    if r.get("skipped"):
        return f"{r['build']:>22} ({r['offered_calls_per_s']:.0f} calls/s offered): not run, {r['skipped']}"
    load = f"{r['offered_calls_per_s']:.0f} calls/s offered" if r.get("offered_calls_per_s") else "closed loop"
    cpu = f"; loop thread {r['loop_cpu_us_per_call']} µs/call ({r['loop_busy']:.0%} busy), other threads {r['other_cpu_us_per_call']} µs/call" if "loop_busy" in r else ""
    return (f"{r['build']:>22} ({load}): {r['calls_per_s']:7.1f} calls/s, writes p50 {r['write_ms_p50']} ms p99 {r['write_ms_p99']} ms, "
            f"reads p50 {r['read_ms_p50']} ms p99 {r['read_ms_p99']} ms, {r['errors']} errors ({r['clients']} clients, {r['seconds']} s){cpu}")


GUARD_BASE = "e340744"  # the last commit before usage records and GPU health sensing (a lean REST handler of its own, broker/jsonapi.py)
GUARD_TARGET_MS = 60  # writes p99 of the guard


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--_load":
        load_main(int(argv[1]), int(argv[2]), float(argv[3]), argv[4], float(argv[5]) if len(argv) > 5 else 0.0, int(argv[6]) if len(argv) > 6 else 0)
        return 0
    if argv and argv[0] == "--_guard":
        guard_main(int(argv[1]), int(argv[2]), float(argv[3]), int(argv[4]), float(argv[5]), argv[6], int(argv[7]), argv[8] if len(argv) > 8 else "")
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stress", action="store_true", help="the stress loads and the memory figure instead of the guard")
    p.add_argument("--servers", type=int, default=10_000, help="guard: servers sending heartbeats")
    p.add_argument("--interval", type=float, default=30.0, help="guard: seconds between two heartbeats of a server (the window)")
    p.add_argument("--users", type=int, default=30, help="guard: users of the spawn storm")
    p.add_argument("--hold", type=float, default=2.0, help="guard: seconds a storm user holds its GPU before releasing it")
    p.add_argument("--rounds", type=int, default=1, help="guard: runs of each build, alternating")
    p.add_argument("--stalls", action="store_true", help="guard: note each build's event-loop stalls and garbage-collector pauses over the window")
    p.add_argument("--py-spy", default=None, metavar="FILE", help="guard: record this tree's broker with py-spy over the window into FILE")
    p.add_argument("--this-rev", default=None, help="a git revision to measure instead of the working tree")
    p.add_argument("--clients", type=int, default=200)
    p.add_argument("--seconds", type=float, default=20)
    p.add_argument("--base", action="append", help=f"git revision of a baseline build, repeatable (default: {GUARD_BASE} for the guard, 8bdb240, the broker before group commit, for --stress)")
    p.add_argument("--base-src", default=None, help="a folder holding the baseline's jupyter_gpulease package, instead of a git worktree of --base")
    p.add_argument("--rates", default="500,800,1000", help="offered loads (calls/s, comma-separated) of the open-loop runs; '' for none")
    p.add_argument("--leases", type=int, default=100_000, help="live leases for the memory figure (0: skip it)")
    p.add_argument("--out", default=None, help="where the JSON goes (default: benchmarks/results/broker_guard.json, or broker.json with --stress)")
    args = p.parse_args(argv)
    revs = args.base or ([GUARD_BASE] if not args.stress else ["8bdb240"])
    rates = [float(x) for x in args.rates.split(",") if x.strip()]
    tmp = Path(tempfile.mkdtemp(prefix="bench-broker-"))
    result = {"command": "python benchmarks/bench_broker.py " + " ".join(argv), "python": sys.version.split()[0], "cpus": os.cpu_count()}
    this = ("this tree", ROOT) if not args.this_rev else (f"this {args.this_rev}", base_tree(args.this_rev, tmp, "this"))
    builds = [(f"base {rev}", Path(args.base_src).resolve() if args.base_src else base_tree(rev, tmp, rev)) for rev in revs] + [this]
    try:
        if not args.stress:
            order = [b for rnd in range(args.rounds) for b in (builds if rnd % 2 == 0 else builds[::-1])]  # alternately
            result["guard"] = []
            for i, (name, src) in enumerate(order):
                result["guard"].append(run_guard(src, tmp, name, args, i // len(builds)))
                print(guard_line(result["guard"][-1]), flush=True)
        else:
            # the most each build answers (closed loop), and the web framework alone under the same load
            result["load"] = [run_load(src, tmp, name, args.clients, args.seconds) for name, src in builds]
            result["load"] += [run_load(ROOT, tmp, name, args.clients, args.seconds, serve=serve) for name, serve in FLOORS]
            # latency at a given load (open loop)
            # (a build offered more than it answered in the closed loop would only queue up)
            most = {r["build"]: r["calls_per_s"] for r in result["load"]}
            runs = [(name, src, SERVE) for name, src in builds] + [(name, ROOT, serve) for name, serve in FLOORS]
            result["open_loop"] = [
                run_load(src, tmp, name, args.clients, args.seconds, rate, serve=serve) if rate < most[name] else {"build": name, "offered_calls_per_s": rate, "skipped": f"more than the {most[name]} calls/s it answers at most"}
                for rate in rates for name, src, serve in runs
            ]  # fmt: skip
    finally:
        for name, src in builds:
            if src != ROOT and not (args.base_src and name.startswith("base ")):
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(src)], check=False, capture_output=True)
    if not args.stress:
        result["summary"] = guard_summary(result["guard"])
        print("\n".join(result["summary"]))
    else:
        for r in result["load"] + result["open_loop"]:
            print(line(r))
        if args.leases:
            result["memory"] = asyncio.run(memory(tmp, args.leases))
            print(json.dumps(result["memory"], indent=2))
    print(result["command"])
    out = Path(args.out or HERE / "results" / ("broker.json" if args.stress else "broker_guard.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {out}")
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
