"""Broker benchmarks: throughput and latency under 200 concurrent clients, side by side with
baseline builds and with the web framework alone; and memory holding many leases.

    python benchmarks/bench_broker.py [--clients 200] [--seconds 20] [--base 8bdb240 ...] [--rates 500,800,1000] [--leases 100000]

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
     one loop turn before they answer: the request path the broker's API runs on, see
     ``jupyter_gpulease/broker/jsonapi.py``).
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
2. Memory: this build's process RSS before and after holding ``--leases`` live leases (1 000
   active on 1 000 GPUs, the rest queued), and the time of a scheduling pass over them.

Figures are printed and saved as JSON (``--out``); nothing here asserts on them.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
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
c.GPULeaseBroker.devices = {"gpus": json.loads(sys.argv[4])}
c.GPULeaseBroker.bind_url = f"http://127.0.0.1:{port}"
c.GPULeaseBroker.base_url = "/services/gpulease/"
c.GPULeaseBroker.config_file = ""
c.GPULeaseBroker.reconcile_interval = 0
c.GPULeaseBroker.log_level = "WARN"
app = GPULeaseBroker(config=c)
app.initialize([])
import jupyter_gpulease
print("serving", jupyter_gpulease.__file__, flush=True)
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

    async def call(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        data = json.dumps(body).encode() if body is not None else b""
        head = (f"{method} /services/gpulease/{path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: token {self.user}\r\n"
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


def run_load(src: Path, tmp: Path, name: str, clients: int, seconds: float, rate: float = 0.0, serve: str = SERVE) -> dict:
    port = free_port()
    slug = "".join(c if c.isalnum() or c in "._" else "-" for c in name)  # a file name
    db = tmp / f"{slug}-{rate:.0f}.sqlite"
    log = open(tmp / f"{slug}-broker.log", "wb")  # noqa: SIM115 - kept open for the broker's life
    broker = subprocess.Popen([sys.executable, "-c", serve, str(src), str(db), str(port), json.dumps(POOL)], stdout=log, stderr=subprocess.STDOUT, cwd=tmp)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if broker.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the {name} broker did not start: {(tmp / f'{slug}-broker.log').read_text()[-2000:]}") from None
                time.sleep(0.2)
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


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--_load":
        load_main(int(argv[1]), int(argv[2]), float(argv[3]), argv[4], float(argv[5]) if len(argv) > 5 else 0.0, int(argv[6]) if len(argv) > 6 else 0)
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=200)
    p.add_argument("--seconds", type=float, default=20)
    p.add_argument("--base", action="append", help="git revision of a baseline build, repeatable (default: 8bdb240, the broker before group commit)")
    p.add_argument("--base-src", default=None, help="a folder holding the baseline's jupyter_gpulease package, instead of a git worktree of --base")
    p.add_argument("--rates", default="500,800,1000", help="offered loads (calls/s, comma-separated) of the open-loop runs; '' for none")
    p.add_argument("--leases", type=int, default=100_000, help="live leases for the memory figure (0: skip it)")
    p.add_argument("--out", default=str(HERE / "results" / "broker.json"))
    args = p.parse_args(argv)
    revs = args.base or ["8bdb240"]
    rates = [float(x) for x in args.rates.split(",") if x.strip()]
    tmp = Path(tempfile.mkdtemp(prefix="bench-broker-"))
    result = {"command": "python benchmarks/bench_broker.py " + " ".join(argv), "python": sys.version.split()[0], "cpus": os.cpu_count()}
    builds = [(f"base {rev}", Path(args.base_src).resolve() if args.base_src else base_tree(rev, tmp, rev)) for rev in revs] + [("this tree", ROOT)]
    try:
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
            if name != "this tree" and not args.base_src:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(src)], check=False, capture_output=True)
    for r in result["load"] + result["open_loop"]:
        print(line(r))
    if args.leases:
        result["memory"] = asyncio.run(memory(tmp, args.leases))
        print(json.dumps(result["memory"], indent=2))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {out}")
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
