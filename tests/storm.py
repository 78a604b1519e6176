"""A spawn storm on a real hub: many users start servers at once on a small simulated pool.

Shared by the storm test (tests/test_spawn_storm.py) and its benchmark
(benchmarks/bench_spawn_storm.py). :class:`Storm` runs the whole stack of :class:`leasehub.LeaseHub`
(JupyterHub, configurable-http-proxy, the broker and the lease spawner on 127.0.0.1) on the
demo's simulated pool (two L4, one A100, one A100 in MIG mode with two 3g.40gb instances); :class:`Checker` looks at the broker,
the hub and the servers' processes over and over and records every broken rule:

* no GPU or MIG instance is held by two active leases, no GPU's shares add up to more than 1;
* every running server process holds an active lease of its user, with the devices the
  lease names (``CUDA_VISIBLE_DEVICES``, ``GPULEASE_LEASE_ID``);
* every active lease belongs to a server the hub has (starting or running), and every server
  the hub calls ready has a process.

States that pass through a mismatch on their way (a server between its lease's end and its
stop, a granted lease before its server's process exists) count as broken only when they last
longer than ``grace`` seconds.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from leasehub import LeaseHub

# the mix of a class starting its day: whole L4 and A100 GPUs, half and quarter L4 shares, MIG slices
REQUESTS = [
    {"share": 0.5, "model": "L4"},
    {"gpus": 1, "model": "A100*"},
    {"share": 0.25, "model": "L4"},
    {"mig_profile": "3g.40gb"},
    {"gpus": 1, "model": "L4"},
    {"share": 0.25, "model": "L4", "tier": "learning", "duration_s": 1800},
]


def storm_options(n: int) -> dict[str, dict]:
    """``n`` users (u01, u02, ...) and what each asks for."""
    return {f"u{i + 1:02d}": dict(REQUESTS[i % len(REQUESTS)]) for i in range(n)}


TIERS = [
    "c.GPULeaseBroker.tiers = {",
    "    'experiment': {'priority': 20, 'max_duration_s': 8 * 3600, 'default_duration_s': 3600},",
    "    'learning': {'priority': 10, 'max_duration_s': 4 * 3600, 'default_duration_s': 1800, 'preemptible': True},",
    "}",
    "c.GPULeaseBroker.default_tier = 'experiment'",
]


class Storm:
    """The hub of a storm, and the calls a test or a benchmark makes on it."""

    def __init__(self, tmp_path: Path, *, poll_interval: float = 2, tick: float = 0.5, reconcile_interval: float = 0,
                 lease_wait_timeout: float = 3600, config_lines=()):
        self.dir = Path(tmp_path)
        self.poll_interval = poll_interval
        self.hub = LeaseHub(
            self.dir,
            users=(),  # any user may log in; the storm creates its users through the Hub API
            broker_devices={},  # the demo's pool
            broker_tick=tick,
            broker_config=[f"c.GPULeaseBroker.reconcile_interval = {reconcile_interval}", *TIERS],
            hub_config=[
                "c.Authenticator.allow_all = True",
                f"c.GPULeaseSpawner.lease_wait_timeout = {lease_wait_timeout}",
                f"c.Spawner.poll_interval = {poll_interval}",
                "c.Spawner.http_timeout = 120",
                "c.JupyterHub.concurrent_spawn_limit = 0",
                "c.JupyterHub.active_server_limit = 0",
                *config_lines,
            ],
        )
        self.broker_db = Path(self.hub.broker.db_url.removeprefix("sqlite:///"))

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> Storm:
        self.hub.start()
        return self

    def stop(self) -> None:
        """Stop every server, then the hub."""
        self.hub.close()

    # ------------------------------------------------------------------ the broker
    def broker(self, method: str, *args, **kw):
        return self.hub.broker_call(method, *args, **kw)

    def leases(self, state: str = "all") -> list[dict]:
        return self.broker("list_leases", state=state, limit=10000)

    def lease_states_in_db(self) -> dict[str, int]:
        """Lease states counted in the broker's database (readable while the broker is down)."""
        import sqlite3

        with sqlite3.connect(self.broker_db) as db:
            return dict(db.execute("select state, count(*) from leases group by state"))

    # ------------------------------------------------------------------ the hub
    def spawn(self, user: str, options: dict) -> tuple[int, object]:
        return self.hub.spawn(user, options)

    def create_users(self, names) -> None:
        status, body = self.hub.api("POST", "users", {"usernames": sorted(names)})
        assert status in (201, 409), body

    def server_models(self) -> dict[str, dict]:
        """user -> server model, for every user the hub has an active server (or spawn) for."""
        status, users = self.hub.api("GET", "users?state=active")
        assert status == 200, users
        return {u["name"]: (u.get("servers") or {}).get("") for u in users if (u.get("servers") or {}).get("") is not None}

    def stop_server(self, user: str) -> tuple[int, float]:
        """DELETE the user's server; (status, seconds the hub took to answer)."""
        t0 = time.monotonic()
        status, _ = self.hub.api("DELETE", f"users/{user}/server")
        return status, time.monotonic() - t0

    def processes(self) -> dict[str, dict]:
        """user -> {pid, env} of every running single-user server process below the hub."""
        return {user: {"pid": pid, "env": env} for user, (pid, env) in self.hub.server_processes().items()}

    def kill_server(self, user: str) -> int:
        pid = self.processes()[user]["pid"]
        os.kill(pid, signal.SIGKILL)
        return pid

    # ------------------------------------------------------------------ progress streams
    def open_progress(self, user: str, into: list, timeout: float = 600) -> threading.Thread:
        """Read ``user``'s spawn progress stream in a thread, appending each event to ``into``."""
        def read():
            try:
                for ev in self.hub.progress(user, timeout=timeout):
                    into.append(ev)  # as it comes: the test reads the list while the stream goes on
            except Exception as e:
                into.append({"stream_error": repr(e)})
        t = threading.Thread(target=read, daemon=True)
        t.start()
        return t

    def storm(self, options: dict[str, dict], *, streams_after: float = 0.3) -> dict[str, dict]:
        """Every user POSTs its spawn at the same moment; each opens its progress stream
        ``streams_after`` seconds after its POST answered. Returns user -> {status, body,
        posted (time.time()), events (list, filled as the stream goes on)}."""
        users = sorted(options)
        self.create_users(users)
        barrier = threading.Barrier(len(users))
        out: dict[str, dict] = {u: {"events": []} for u in users}

        def one(user):
            barrier.wait()
            out[user]["posted"] = time.time()
            status, body = self.hub.api("POST", f"users/{user}/server", options[user])
            out[user].update(status=status, body=body)
            time.sleep(streams_after)
            out[user]["stream"] = self.open_progress(user, out[user]["events"])

        with ThreadPoolExecutor(len(users)) as pool:
            list(pool.map(one, users))
        return out


def queue_seen(events: list[dict], *, with_eta: bool = False) -> dict | None:
    """The first progress event that showed a queue position (and an ETA), or None."""
    for ev in list(events):
        g = ev.get("gpulease") or {}
        if g.get("state") == "queued" and g.get("position") and (not with_eta or g.get("eta") is not None):
            return ev
    return None


def granted_seen(events: list[dict]) -> bool:
    return any((ev.get("gpulease") or {}).get("state") == "active" for ev in events)


class Checker:
    """Checks the rules of the module doc every ``interval`` seconds in a thread."""

    def __init__(self, storm: Storm, *, interval: float = 0.3, grace: float | None = None):
        self.storm = storm
        self.interval = interval
        # a server may take the engine's stop timeouts (SIGINT, then SIGTERM after 10 s) to exit
        # after its lease was given back as the stop began
        self.grace = grace if grace is not None else storm.poll_interval + 20
        self.checks = 0
        self.rounds = 0
        self.violations: list[str] = []
        self._since: dict[str, float] = {}
        self._stop = threading.Event()
        self._paused = threading.Event()
        self._thread: threading.Thread | None = None
        self.errors = 0

    def start(self) -> Checker:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def pause(self) -> None:
        self._paused.set()
        time.sleep(self.interval * 3)  # let a round under way finish
        self._since.clear()

    def resume(self) -> None:
        self._paused.clear()

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(30)

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._paused.is_set():
                try:
                    self.check_once()
                except Exception:
                    self.errors += 1
            self._stop.wait(self.interval)

    def _lasting(self, key: str, now: float, broken: bool, text: str) -> None:
        self.checks += 1
        if not broken:
            self._since.pop(key, None)
            return
        first = self._since.setdefault(key, now)
        if now - first > self.grace:
            self.violations.append(f"{text} (for {now - first:.1f} s)")
            self._since[key] = now  # report again only after another grace

    def check_once(self) -> None:
        live = self.storm.leases("live")
        models = self.storm.server_models()
        procs = self.storm.processes()
        now = time.monotonic()
        self.rounds += 1
        active = [lease for lease in live if lease["state"] == "active"]
        # 1. no device given twice
        whole: dict[str, list[str]] = defaultdict(list)
        mig: dict[str, list[str]] = defaultdict(list)
        shares: dict[str, float] = defaultdict(float)
        mig_parent: dict[str, list[str]] = defaultdict(list)
        for lease in active:
            for s in (lease.get("placement") or {}).get("slices") or []:
                if s.get("mig_uuid"):
                    mig[s["mig_uuid"]].append(lease["id"])
                    mig_parent[s["gpu_uuid"]].append(lease["id"])
                elif float(s.get("share", 1)) < 1:
                    shares[s["gpu_uuid"]] += float(s["share"])
                else:
                    whole[s["gpu_uuid"]].append(lease["id"])
        for uuid, ids in mig.items():
            self.checks += 1
            if len(ids) > 1:
                self.violations.append(f"MIG instance {uuid} held by {ids}")
        for uuid, ids in whole.items():
            self.checks += 1
            if len(ids) > 1 or shares.get(uuid) or mig_parent.get(uuid):
                self.violations.append(f"GPU {uuid} held whole by {ids} and shared ({shares.get(uuid, 0)}) or sliced")
        for uuid, total in shares.items():
            self.checks += 1
            if total > 1.0 + 1e-9:
                self.violations.append(f"GPU {uuid} shares add up to {total}")
        # 2. every server process holds an active lease of its user, with its devices
        by_id = {lease["id"]: lease for lease in active}
        for user, p in procs.items():
            env = p["env"]
            lid = env.get("GPULEASE_LEASE_ID", "")
            if not lid:
                continue  # a CPU-only server
            lease = by_id.get(lid)
            broken = lease is None or lease["user"] != user
            self._lasting(f"proc:{user}:{lid}", now, broken, f"{user}'s server process runs with lease {lid}, which is not active")
            if lease is not None:
                devices = ",".join(s.get("mig_uuid") or s["gpu_uuid"] for s in lease["placement"]["slices"])
                self.checks += 1
                if env.get("CUDA_VISIBLE_DEVICES") != devices:
                    self.violations.append(f"{user}'s server sees {env.get('CUDA_VISIBLE_DEVICES')!r}, its lease {lid} names {devices!r}")
        # 3. every active lease has a server the hub knows; every ready server has a process
        for lease in active:
            self._lasting(f"lease:{lease['id']}", now, lease["user"] not in models and lease["user"] not in procs,
                          f"lease {lease['id']} of {lease['user']} is active, but the hub has no server for it")
        for user, model in models.items():
            self._lasting(f"ready:{user}", now, bool(model.get("ready")) and user not in procs,
                          f"the hub says {user}'s server is ready, but no process runs")
