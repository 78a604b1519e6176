"""Broker hand-over: how long clients get no answer when the serving broker is SIGKILLed.

    python benchmarks/bench_handover.py [--kills 5] [--postgres]

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

Figures are printed and saved as JSON (``--out``); nothing here asserts on them.
"""

from __future__ import annotations

import argparse
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


def serving_pid(hub, supervised: bool, pg_port: int | None = None) -> int | None:
    """The broker that serves: the holder of the database's lock (with a supervisor), else the
    hub's one broker process."""
    if pg_port is not None:
        return active_broker_pid_postgres(pg_port, "handover")
    if supervised:
        return active_broker_pid(hub)
    brokers = [pid for pid, cmd in hub.descendants() if "jupyter_gpulease.broker" in cmd]
    return brokers[0] if len(brokers) == 1 else None


def run_case(name: str, tmp: Path, kills: int, config: str, db_url: str | None = None, pg_port: int | None = None) -> dict:
    supervised = "supervise = False" not in config
    folder = tmp / name.replace(" ", "-")
    folder.mkdir()
    hub = hub_for_broker(folder, db_url=db_url, extra_config="c.GPULeaseBroker.reconcile_interval = 0\n" + config, log_level="INFO")
    hub.start()
    poller = None
    try:
        token = hub.create_token("alice")
        wait_for_broker(hub, token)
        poller = Poller(hub.service_url("gpulease") + "api/pool", token)
        poller.start()
        wait_for(lambda: len(poller.ok) >= 5, 60, "the poller never got an answer")
        downtimes, lock_times = [], []
        for i in range(kills):
            pid = wait_for(lambda: serving_pid(hub, supervised, pg_port), 120, "no serving broker")
            wait_for(lambda: poller.ok and poller.ok[-1] > time.monotonic() - 0.5, 60, "the broker does not answer")
            time.sleep(1.0 + 0.37 * i)  # somewhere between two polls
            t_kill = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            if supervised:
                wait_for(lambda pid=pid: (p := serving_pid(hub, True, pg_port)) and p != pid, 120, "no broker took the lock", interval=0.01)
                lock_times.append(time.monotonic() - t_kill)
            downtimes.append(poller.first_answer_after(t_kill) - t_kill)
            wait_for(lambda pid=pid: not pid_alive(pid), 10, "the killed broker lives on")
        res = {"case": name, "kills": kills, "no_answer_s": [round(x, 2) for x in downtimes],
               "no_answer_p50_s": round(statistics.median(downtimes), 2), "no_answer_max_s": round(max(downtimes), 2)}
        if lock_times:
            res["lock_taken_p50_s"] = round(statistics.median(lock_times), 2)
        return res
    finally:
        if poller is not None:
            poller.stop.set()
        hub.stop()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=5, help="kills per case with a supervisor (without one: 3 at most)")
    p.add_argument("--postgres", action="store_true", help="also the standby on a PostgreSQL server started for it")
    p.add_argument("--out", default=str(HERE / "results" / "handover.json"))
    args = p.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="bench-handover-"))
    tmp.chmod(0o755)  # PostgreSQL runs as its own user
    result = {"command": "python benchmarks/bench_handover.py " + " ".join(argv if argv is not None else sys.argv[1:]), "python": sys.version.split()[0], "cpus": os.cpu_count()}
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
            cases.append(run_case("standby, PostgreSQL", tmp, args.kills, "c.GPULeaseBroker.standbys = 1\n", db_url=pg.create_database("handover"), pg_port=pg.port))
        finally:
            pg.stop()
    result["cases"] = cases
    for c in cases:
        lock = f", the next broker held the lock after {c['lock_taken_p50_s']} s (p50)" if "lock_taken_p50_s" in c else ""
        print(f"{c['case']:>20}: no answer for {c['no_answer_p50_s']} s p50, {c['no_answer_max_s']} s max over {c['kills']} kills{lock}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
