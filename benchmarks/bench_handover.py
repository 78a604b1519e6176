"""Broker hand-over: how long clients get no answer when the serving broker is SIGKILLed.

    python benchmarks/bench_handover.py [--kills 5] [--postgres]
    python benchmarks/bench_handover.py --kill supervisor [--kills 3] [--postgres]

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

Figures are printed and saved as JSON (``--out``); nothing here asserts on them.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))

from brokerhub import active_broker_pid, active_broker_pid_postgres, hub_for_broker, wait_for_broker  # noqa: E402
from hubharness import pid_alive, wait_for  # noqa: E402


class Writer(threading.Thread):
    """Requests a lease and releases it through the proxy, one call after the other; remembers
    when answers came (a 2xx)."""

    def __init__(self, url: str, token: str):
        super().__init__(daemon=True)
        self.url, self.token = url, token
        self.ok: list[float] = []
        self.stop = threading.Event()

    def _call(self, path: str, body: dict) -> dict | None:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Authorization": f"token {self.token}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=2) as r:
                got = json.loads(r.read())
            self.ok.append(time.monotonic())
            return got
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def run(self) -> None:
        lease = None
        while not self.stop.is_set():
            if lease is None:
                lease = self._call("api/leases", {"share": 0.25, "model": "L4", "duration_s": 600})
            elif self._call(f"api/leases/{lease['id']}/release", {"reason": "bench"}) is not None:
                lease = None
            if lease is None or not self.ok or self.ok[-1] < time.monotonic() - 0.05:
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
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            req = urllib.request.Request(self.url, headers={"Authorization": f"token {self.token}"})
            try:
                with urllib.request.urlopen(req, timeout=1) as r:
                    if r.status == 200:
                        self.ok.append(time.monotonic())
            except (urllib.error.URLError, OSError):
                pass
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


def serving_pid(hub, supervised: bool, pg_port: int | None = None) -> int | None:
    """The broker that serves: the holder of the database's lock (with a supervisor), else the
    hub's one broker process."""
    if pg_port is not None:
        return active_broker_pid_postgres(pg_port, "handover")
    if supervised:
        return active_broker_pid(hub)
    brokers = [pid for pid, cmd in hub.descendants() if "jupyter_gpulease.broker" in cmd]
    return brokers[0] if len(brokers) == 1 else None


def supervisor_pid(hub) -> int | None:
    sups = [pid for pid, cmd in hub.descendants() if "jupyter_gpulease.broker" in cmd and "worker=True" not in cmd]
    return sups[0] if len(sups) == 1 else None


def hub_worker_serves(hub, pg_port: int | None, not_pid: int) -> int | None:
    """A broker of the hub's (new) supervisor holds the lock: a hub descendant, not ``not_pid``."""
    pid = serving_pid(hub, True, pg_port)
    if pid is None or pid == not_pid or pid not in {p for p, _ in hub.descendants()}:
        return None
    return pid


def run_case(name: str, tmp: Path, kills: int, config: str, db_url: str | None = None, pg_port: int | None = None, kill: str = "worker") -> dict:
    supervised = "supervise = False" not in config
    folder = tmp / name.replace(" ", "-")
    folder.mkdir()
    hub = hub_for_broker(folder, db_url=db_url, extra_config="c.GPULeaseBroker.reconcile_interval = 0\n" + config, log_level="INFO")
    hub.start()
    poller = writer = None
    try:
        token = hub.create_token("alice")
        wait_for_broker(hub, token)
        poller = Poller(hub.service_url("gpulease") + "api/pool", token)
        poller.start()
        writer = Writer(hub.service_url("gpulease"), token)
        writer.start()
        wait_for(lambda: len(poller.ok) >= 5 and len(writer.ok) >= 5, 60, "the poller or the writer never got an answer")
        downtimes, lock_times, write_gaps, read_gaps, restarts = [], [], [], [], []
        for i in range(kills):
            pid = wait_for(lambda: serving_pid(hub, supervised, pg_port), 120, "no serving broker")
            wait_for(lambda: poller.ok and poller.ok[-1] > time.monotonic() - 0.5, 60, "the broker does not answer")
            time.sleep(1.0 + 0.37 * i)  # somewhere between two polls
            t_kill = time.monotonic()
            if kill == "supervisor":
                sup = wait_for(lambda: supervisor_pid(hub), 30, "no supervisor")
                os.kill(sup, signal.SIGKILL)
                # the orphan serves on until the hub restarts the service and hands over then
                wait_for(lambda pid=pid: hub_worker_serves(hub, pg_port, pid), 120, "no broker of a new supervisor took the lock", interval=0.01)
                t_new = time.monotonic()
                restarts.append(t_new - t_kill)
                wait_for(lambda pid=pid: not pid_alive(pid), 30, "the old broker did not stop after the hand-over")
                time.sleep(2)
                write_gaps.append(writer.longest_gap(t_kill - 0.5, time.monotonic()))
                read_gaps.append(poller.longest_gap(t_kill - 0.5, time.monotonic()))
                continue
            os.kill(pid, signal.SIGKILL)
            if supervised:
                wait_for(lambda pid=pid: (p := serving_pid(hub, True, pg_port)) and p != pid, 120, "no broker took the lock", interval=0.01)
                lock_times.append(time.monotonic() - t_kill)
            downtimes.append(poller.first_answer_after(t_kill) - t_kill)
            wait_for(lambda pid=pid: not pid_alive(pid), 10, "the killed broker lives on")
            wait_for(lambda: serving_pid(hub, supervised, pg_port) and writer.ok[-1] > time.monotonic() - 0.5, 120, "writes did not resume")
            time.sleep(2)
            write_gaps.append(writer.longest_gap(t_kill - 0.5, time.monotonic()))
            read_gaps.append(poller.longest_gap(t_kill - 0.5, time.monotonic()))
        res = {"case": name, "killed": kill, "kills": kills}
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
        hub.stop()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=5, help="kills per case with a supervisor (without one: 3 at most)")
    p.add_argument("--postgres", action="store_true", help="also the standby on a PostgreSQL server started for it")
    p.add_argument("--kill", choices=("worker", "supervisor"), default="worker",
                   help="supervisor: SIGKILL the supervisor, side by side with killing the serving broker (both with the standby)")
    p.add_argument("--out", default=None, help="default: benchmarks/results/handover.json (handover_supervisor.json with --kill supervisor)")
    args = p.parse_args(argv)
    args.out = args.out or str(HERE / "results" / ("handover_supervisor.json" if args.kill == "supervisor" else "handover.json"))
    tmp = Path(tempfile.mkdtemp(prefix="bench-handover-"))
    tmp.chmod(0o755)  # PostgreSQL runs as its own user
    result = {"command": "python benchmarks/bench_handover.py " + " ".join(argv if argv is not None else sys.argv[1:]), "python": sys.version.split()[0], "cpus": os.cpu_count()}
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
    for c in cases:
        lock = f", the next broker held the lock after {c['lock_taken_p50_s']} s (p50)" if "lock_taken_p50_s" in c else ""
        first = f"no answer for {c['no_answer_p50_s']} s p50, {c['no_answer_max_s']} s max; " if "no_answer_p50_s" in c else ""
        hub = f"; the hub restarted the service {min(c['hub_restart_s'])}-{max(c['hub_restart_s'])} s after the kill" if "hub_restart_s" in c else ""
        print(f"{c['case']:>38}: {first}longest gap between writes {c['write_gap_p50_s']} s p50, {c['write_gap_max_s']} s max, "
              f"between reads {c['read_gap_max_s']} s max, over {c['kills']} kills{lock}{hub}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
