"""Usage-record benchmarks: the report over a million records, and the recorder's cost on the
broker under 10,000 servers' heartbeats.

    python benchmarks/bench_usage.py report [--records 1000000] [--postgres] [--out benchmarks/results/usage_report.json]
    python benchmarks/bench_usage.py recorder [--servers 10000] [--interval 30] [--seconds 20] [--out benchmarks/results/usage_recorder.json]

1. ``report``: a store (a SQLite file; and a PostgreSQL server started here with ``--postgres``,
   as tests/pgserver.py starts one) is filled with ``--records`` hourly usage records (one per
   lease and hour: leases of 8 hours of 400 users in 20 groups on 4 models, over 90 days; and
   the leases' accounting rows), through the store's own writer. Then each report the CLI and
   the pages ask for is timed over the whole period: by user, group, model, tier, the series
   by group, and the right-sizing suggestions. Side by side, in the same run: the floor, one
   ``SELECT count(*), sum(held_gpu_s)`` over the same rows (what any aggregation over them
   costs on this database).
2. ``recorder``: the broker runs as its own process (SQLite file, WAL, synchronous=FULL, as
   benchmarks/bench_broker.py runs it, whose load generator and server script this reuses),
   with a pool of ``--servers`` GPUs, each held by one server's lease. The servers' heartbeats
   (usage of one device and two kernels with their notebooks, as the server extension sends
   them) arrive as a Poisson process of ``servers / interval`` heartbeats per second for
   ``--seconds``. Recording on and off run the same load one after the other: heartbeat
   latency (from when it was due), the event loop's and the other threads' CPU per heartbeat,
   and the rows written.

Figures are printed and saved as JSON; nothing here asserts on them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "tests"))

A100 = "A100-SXM4-80GB"
MODELS = [A100, "H100-SXM5-80GB", "L4", "A10"]
TIERS = ["production", "experiment", "learning"]


# --------------------------------------------------------------------------- 1. the report
def fill(store, records: int, now: float) -> dict:
    """``records`` hourly records (8 per lease) and their leases, written by the store's writer."""
    from jupyter_gpulease.store import UsageBatch

    rng = random.Random(7)
    hours_per_lease = 8
    leases = records // hours_per_lease
    span = 90 * 86400
    t_start = now - span
    t0 = time.perf_counter()
    batch = UsageBatch()
    for i in range(leases):
        user = f"user{rng.randrange(400):03d}"
        team = f"group{int(user[4:]) % 20:02d}"
        model = MODELS[i % len(MODELS)]
        tier = TIERS[i % len(TIERS)]
        granted = t_start + rng.random() * (span - hours_per_lease * 3600)
        granted -= granted % 3600
        held = hours_per_lease * 3600.0
        frac = (1.0, 0.25, 0.125)[i % 3]
        busy = held * frac * rng.random()
        lid = f"{i:032x}"
        batch.leases[lid] = {
            "lease_id": lid, "user": user, "team": team, "groups": [team], "tier": tier, "model": model, "slice_kind": ("gpu", "share", "mig")[i % 3],
            "slice": ("1", "0.25", "1g.10gb")[i % 3], "gpus": 1, "fraction": frac, "mem_mib": int(81920 * frac), "asked_s": 4 * held,
            "created_at": granted - rng.random() * 600, "granted_at": granted, "ended_at": granted + held, "end_state": "released",
            "queue_wait_s": rng.random() * 600, "held_s": held, "held_gpu_s": held * frac, "busy_gpu_s": busy, "mem_peak_mib": int(9000 * frac),
            "reclaims": 0, "suspends": 0, "preemptions": 0, "devices": {}, "state": {}}
        for h in range(hours_per_lease):
            hour = int(granted) + h * 3600
            batch.hours[(hour, lid, "")] = ["", user, team, model, tier, 3600.0 * frac, busy / hours_per_lease, int(9000 * frac)]
            d = batch.days.setdefault((hour - hour % 86400, user, team, model, tier), [0.0, 0.0])
            d[0] += 3600.0 * frac
            d[1] += busy / hours_per_lease
        if len(batch.hours) >= 50000:
            store.write_usage(batch)
            batch = UsageBatch()
    store.write_usage(batch)
    return {"records": leases * hours_per_lease, "leases": leases, "fill_s": round(time.perf_counter() - t0, 1)}


def timed(fn, repeat: int = 3) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def report_figures(url: str, records: int, label: str) -> dict:
    from jupyter_gpulease.broker.usage import Accounting, UsageAPI
    from jupyter_gpulease.store import LeaseStore

    now = time.time()
    store = LeaseStore(url)
    try:
        filled = fill(store, records, now)
        if store.dialect == "postgresql":
            with store.engine.begin() as conn:
                conn.exec_driver_sql("ANALYZE")
        api = UsageAPI(store, Accounting(prices={A100: 2.9, "H100*": 4.5, "*": 1.0}, currency="EUR"), clock=lambda: now, min_leases=3)
        span = {"start": now - 91 * 86400, "end": now}

        def floor():
            with store.engine.connect() as conn:
                return conn.exec_driver_sql("SELECT count(*), sum(held_gpu_s) FROM usage_hourly WHERE kernel = ''").one()

        def hourly_group_by():
            with store.engine.connect() as conn:
                return conn.exec_driver_sql('SELECT "user", model, sum(held_gpu_s), sum(busy_gpu_s) FROM usage_hourly WHERE kernel = \'\' '
                                            'GROUP BY "user", model').all()

        res = {"database": label, **filled}
        s, n = timed(floor)
        res["floor_count_sum_s"] = round(s, 3)
        s, _ = timed(hourly_group_by)
        res["baseline_hourly_group_by_user_s"] = round(s, 3)
        for by in ("user", "group", "model", "tier"):
            s, rep = timed(lambda by=by: api.report(by=by, **span))
            res[f"report_by_{by}_s"] = round(s, 3)
            res[f"report_by_{by}_rows"] = len(rep["rows"])
            assert abs(rep["totals"]["held_gpu_h"] * 3600 - n[1]) < 1e-3 * n[1], "the report's total is not the rows' sum"
        s, ser = timed(lambda: api.series(by="group", step="day", **span))
        res["series_by_group_day_s"] = round(s, 3)
        res["series_points"] = len(ser["points"])
        s, sugs = timed(lambda: api.suggestions(**span), repeat=1)
        res["suggestions_s"] = round(s, 3)
        res["suggestions"] = len(sugs)
    finally:
        store.close()
    return res


def report_main(args) -> dict:
    out = []
    with tempfile.TemporaryDirectory(prefix="bench-usage-") as tmp:
        out.append(report_figures(f"sqlite:///{tmp}/usage.sqlite", args.records, "SQLite (file, WAL)"))
        print(line_report(out[-1]), flush=True)
        if args.postgres:
            from pgserver import PostgresServer

            os.chmod(tmp, 0o755)  # the server runs as another user (PostgreSQL refuses root)
            pg = PostgresServer(Path(tmp) / "pg").start()
            try:
                out.append(report_figures(pg.create_database("usage"), args.records, "PostgreSQL (local server)"))
                print(line_report(out[-1]), flush=True)
            finally:
                pg.stop()
    return {"report": out}


def line_report(r: dict) -> str:
    return (f"{r['database']:<26} {r['records']:>9,} records ({r['leases']:,} leases; filled in {r['fill_s']} s): "
            f"floor count+sum {r['floor_count_sum_s']:.2f} s, baseline GROUP BY user over the hourly records {r['baseline_hourly_group_by_user_s']:.2f} s | report by user {r['report_by_user_s']:.2f} s, group {r['report_by_group_s']:.2f} s, "
            f"model {r['report_by_model_s']:.2f} s, tier {r['report_by_tier_s']:.2f} s | series by group/day {r['series_by_group_day_s']:.2f} s | "
            f"suggestions {r['suggestions_s']:.2f} s ({r['suggestions']})")


# --------------------------------------------------------------------------- 2. the recorder
def serve_script(record: bool) -> str:
    """bench_broker.py's server script, with the usage recorder on or off."""
    from bench_broker import SERVE

    marker = "app = GPULeaseBroker(config=c)"
    assert marker in SERVE, "bench_broker.SERVE changed: update bench_usage.serve_script"
    extra = (f"c.GPULeaseUsage.record = {record!r}\n"
             "c.GPULeaseBroker.confirm_timeout_s = 0\n"
             "c.GPULeaseBroker.tick_interval = 5\n")
    return SERVE.replace(marker, extra + marker)


def usage_of(i: int, t: float, t0: float, uuid: str) -> dict:
    """A server's heartbeat usage as the extension sends it: cumulative since the grant."""
    up = max(0.0, t - t0)
    busy = up * (0.3 + 0.4 * (i % 2))
    return {"t": round(t, 1), "gpu_busy": bool(i % 2), "devices": {uuid: {"busy_s": round(busy, 1), "idle_s": round(up - busy, 1), "mem_peak_mib": 9000}},
            "kernels": {f"k{i:06d}a": {"busy_s": round(busy, 1), "idle_s": round(up - busy, 1), "mem_peak_mib": 8000, "state": "ok", "path": f"work/train{i}.ipynb"},
                        f"k{i:06d}b": {"busy_s": 0.0, "idle_s": round(up, 1), "mem_peak_mib": 1000, "state": "ok", "path": f"work/scratch{i}.ipynb"}}}


def beats_main(port: int, servers: int, interval: float, seconds: float, out: str, server_pid: int) -> None:
    """The load process: grant ``servers`` leases (one user each), then send their heartbeats
    as a Poisson process of ``servers / interval`` per second for ``seconds``."""
    from bench_broker import Conn, cpu_figures, pct
    from procstat import thread_cpu

    n_conns = 200

    async def go():
        conns = [Conn(port, "") for _ in range(n_conns)]
        leases: list[tuple[str, str, str, float]] = []  # (user, lease id, device, granted)

        async def grant(c: int):
            conn = conns[c]
            for i in range(c, servers, n_conns):
                conn.user = f"user{i}"
                status, lease = await conn.call("POST", "api/leases", {"gpus": 1, "duration_s": 8 * 3600})
                if status >= 400 or lease.get("state") != "active":
                    raise RuntimeError(f"lease {i}: {status} {lease}")
                leases.append((conn.user, lease["id"], lease["placement"]["slices"][0]["gpu_uuid"], time.time()))

        t0 = time.perf_counter()
        await asyncio.gather(*(grant(c) for c in range(n_conns)))
        grant_s = time.perf_counter() - t0
        rate = servers / interval
        lat: list[float] = []
        errors: list[str] = []
        rng = random.Random(1)
        cpu_before = thread_cpu(server_pid)
        start = time.perf_counter()
        stop_at = start + seconds

        async def beat(c: int):
            conn = conns[c]
            mine = leases[c::n_conns]
            due = start + rng.expovariate(rate / n_conns)
            k = 0
            while due < stop_at:
                delay = due - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                user, lid, uuid, granted = mine[k % len(mine)]
                k += 1
                conn.user = user
                status, ans = await conn.call("POST", f"api/leases/{lid}/heartbeat", {"usage": usage_of(k, time.time(), granted, uuid)})
                lat.append((time.perf_counter() - due) * 1000)
                if status >= 400:
                    errors.append(f"{status} {ans.get('message', '')[:80]}")
                due += rng.expovariate(rate / n_conns)

        await asyncio.gather(*(beat(c) for c in range(n_conns)))
        elapsed = time.perf_counter() - start
        cpu_after = thread_cpu(server_pid)
        res = {"servers": servers, "grant_s": round(grant_s, 1), "offered_heartbeats_per_s": round(rate, 1), "heartbeats": len(lat),
               "heartbeats_per_s": round(len(lat) / elapsed, 1), "errors": len(errors), "first_errors": errors[:3],
               "ms_p50": round(statistics.median(lat), 1) if lat else None, "ms_p99": round(pct(lat, 99), 1) if lat else None,
               "ms_max": round(max(lat), 1) if lat else None}
        res.update(cpu_figures(server_pid, cpu_before, cpu_after, len(lat), elapsed))
        Path(out).write_text(json.dumps(res))

    asyncio.run(go())


def run_recorder(tmp: Path, record: bool, servers: int, interval: float, seconds: float) -> dict:
    import socket

    from bench_broker import free_port

    name = "recording on" if record else "recording off"
    port = free_port()
    db = tmp / f"broker-{int(record)}.sqlite"
    pool = [{"node": f"n{i}", "model": A100, "count": 8, "memory_mib": 81920} for i in range(-(-servers // 8))]
    log_path = tmp / f"broker-{int(record)}.log"
    with open(log_path, "wb") as log:
        broker = subprocess.Popen([sys.executable, "-c", serve_script(record), str(ROOT), str(db), str(port), json.dumps(pool)], stdout=log,
                                  stderr=subprocess.STDOUT, cwd=tmp)
        try:
            deadline = time.monotonic() + 120
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    if broker.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"the broker did not start: {log_path.read_text()[-2000:]}") from None
                    time.sleep(0.2)
            out = tmp / f"beats-{int(record)}.json"
            subprocess.run([sys.executable, __file__, "_beats", str(port), str(servers), str(interval), str(seconds), str(out), str(broker.pid)],
                           check=True, timeout=seconds + 900)
            res = {"build": name, **json.loads(out.read_text())}
        finally:
            broker.terminate()
            try:
                broker.wait(30)
            except subprocess.TimeoutExpired:
                broker.kill()
    import sqlite3

    with sqlite3.connect(db) as conn:
        for t in ("usage_leases", "usage_samples", "usage_hourly", "usage_daily", "lease_events"):
            res[f"rows_{t}"] = conn.execute(f"SELECT count(*) FROM {t}").fetchone()[0]
    res["db_mib"] = round(sum(f.stat().st_size for f in tmp.glob(f"broker-{int(record)}.sqlite*")) / 2**20, 1)
    return res


def recorder_main(args) -> dict:
    """Recording off and on, alternately for ``--rounds`` rounds (the machine's other load falls on both)."""
    out = []
    for rnd in range(args.rounds):
        for record in (False, True):
            with tempfile.TemporaryDirectory(prefix="bench-usage-") as tmp:
                out.append({"round": rnd + 1, **run_recorder(Path(tmp), record, args.servers, args.interval, args.seconds)})
            print(line_recorder(out[-1]), flush=True)
    summary = {}
    for build in ("recording off", "recording on"):
        runs = [r for r in out if r["build"] == build]
        summary[build] = {k: statistics.median(r[k] for r in runs) for k in ("loop_cpu_us_per_call", "other_cpu_us_per_call", "ms_p50", "ms_p99",
                                                                               "heartbeats_per_s") if all(r.get(k) is not None for r in runs)}
    on, off = summary["recording on"], summary["recording off"]
    if "loop_cpu_us_per_call" in on and "loop_cpu_us_per_call" in off:
        summary["recorder_cost_us_per_heartbeat"] = {"loop": on["loop_cpu_us_per_call"] - off["loop_cpu_us_per_call"],
                                                     "other_threads": on["other_cpu_us_per_call"] - off["other_cpu_us_per_call"]}
    print("medians:", json.dumps(summary), flush=True)
    return {"recorder": out, "medians": summary}


def line_recorder(r: dict) -> str:
    return (f"round {r['round']}: {r['build']:<14} {r['servers']:,} servers, {r['offered_heartbeats_per_s']} heartbeats/s offered: answered {r['heartbeats_per_s']}/s, "
            f"{r['errors']} errors | latency p50 {r['ms_p50']} ms, p99 {r['ms_p99']} ms | loop CPU {r.get('loop_cpu_us_per_call')} us/heartbeat "
            f"(busy {r.get('loop_busy')}), other threads {r.get('other_cpu_us_per_call')} us/heartbeat | rows: {r['rows_usage_samples']} samples, "
            f"{r['rows_usage_hourly']} hourly, {r['rows_usage_daily']} daily | db {r['db_mib']} MiB")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    r = sub.add_parser("report")
    r.add_argument("--records", type=int, default=1_000_000)
    r.add_argument("--postgres", action="store_true")
    r.add_argument("--out", default=str(HERE / "results" / "usage_report.json"))
    r = sub.add_parser("recorder")
    r.add_argument("--servers", type=int, default=10_000)
    r.add_argument("--interval", type=float, default=30.0, help="seconds between one server's heartbeats (the extension's default: 30)")
    r.add_argument("--seconds", type=float, default=20.0)
    r.add_argument("--rounds", type=int, default=2, help="rounds of recording off then on (default 2)")
    r.add_argument("--out", default=str(HERE / "results" / "usage_recorder.json"))
    b = sub.add_parser("_beats")
    for a in ("port", "servers", "interval", "seconds", "out", "pid"):
        b.add_argument(a)
    args = p.parse_args(argv)
    if args.what == "_beats":
        beats_main(int(args.port), int(args.servers), float(args.interval), float(args.seconds), args.out, int(args.pid))
        return 0
    cmd = "python benchmarks/bench_usage.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.what == "report":
        res = report_main(args)
    else:
        res = recorder_main(args)
    res = {"command": cmd, "python": sys.version.split()[0], "cpus": os.cpu_count(), **res}
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    print(f"saved: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
