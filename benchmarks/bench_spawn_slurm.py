"""Spawn-to-ready on Slurm: GPULeaseSlurmSpawner against plain batchspawner SlurmSpawner, same hub, same cluster.

A real single-node Slurm cluster (munged, slurmctld, slurmd with four ``l4`` GPU GRES; see
tests/slurmharness.py), one real JupyterHub + configurable-http-proxy + broker whose pool is
read from Slurm. User "plain" spawns through batchspawner's SlurmSpawner methods alone, asking
Slurm for the same thing (``--gres=gpu:l4:1 --nodelist=localhost``, a one-hour limit); user
"leased" through the lease spawner (lease request, grant, job spec from the placement, confirm,
the job's GPUs read back). Spawns alternate so both see the same machine load; both servers are
real jupyterhub-singleuser processes in Slurm jobs. Reports the medians and their ratio
(target: within 5%), and where the time goes: each spawn's phases after the POST (the
spawner's start() called, sbatch run, the job RUNNING in squeue, start() returning once the
server reported its port), so the lease layer's own cost (start() to sbatch) is seen apart from
the job's and the server's start-up, which dominate and vary with the machine's load. Saved to
benchmarks/results/bench_spawn_slurm.json.

As in bench_spawn.py the hub polls a new server every 20-50 ms instead of its exponential
back-off (0.2 s up to 5 s), and batchspawner polls squeue every 0.2 s, for both users alike, so
the figures show the spawners' own cost rather than polling granularity.

    .venv/bin/python benchmarks/bench_spawn_slurm.py [--rounds 8]

Needs root, Slurm (apt-get install slurm-wlm munge) and configurable-http-proxy (GPULEASE_CHP).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from hubharness import wait_for  # noqa: E402
from slurmharness import SlurmCluster  # noqa: E402
from test_slurm_spawner import make_slurm_hub  # noqa: E402

BENCH_SPAWNER = '''
import json
import os
import time

import jupyterhub.utils as _hub_utils
from batchspawner import SlurmSpawner

from slurm_test_spawner import TestSlurmSpawner

_backoff = _hub_utils.exponential_backoff


async def _fine_backoff(pass_func, fail_message, start_wait=0.2, scale_factor=2, max_wait=5, timeout=10, timeout_tolerance=0.1, *args, **kwargs):
    return await _backoff(pass_func, fail_message, 0.02, 1.0, 0.05, timeout, timeout_tolerance, *args, **kwargs)


_hub_utils.exponential_backoff = _fine_backoff


def _mark(user, what):
    """Append one timestamp of a spawn's phases (the benchmark splits spawn-to-ready with them)."""
    with open(os.environ["GPULEASE_BENCH_MARKS"], "a") as f:
        f.write(json.dumps({"user": user, "what": what, "t": time.time()}) + "\\n")


class BenchSlurmSpawner(TestSlurmSpawner):
    """User 'plain' bypasses the lease layer: batchspawner's SlurmSpawner with the same request."""

    def _plain(self):
        return self.user.name == "plain"

    async def start(self):
        _mark(self.user.name, "start")
        if self._plain():
            self.req_gres, self.req_options, self.req_runtime = "gpu:l4:1", "--nodelist=localhost", "0-01:02:00"
            url = await SlurmSpawner.start(self)
        else:
            url = await super().start()
        _mark(self.user.name, "started")
        return url

    async def submit_batch_script(self):
        _mark(self.user.name, "sbatch")
        job = await super().submit_batch_script()
        _mark(self.user.name, "submitted")
        return job

    async def query_job_status(self):
        status = await super().query_job_status()
        if status.name == "RUNNING":
            _mark(self.user.name, "running")
        return status

    async def stop(self, now=False):
        if self._plain():
            return await SlurmSpawner.stop(self, now=now)
        return await super().stop(now=now)

    async def poll(self):
        if self._plain():
            return await SlurmSpawner.poll(self)
        return await super().poll()
'''


def read_marks(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def phases(marks: list[dict], user: str, t_post: float) -> dict[str, float]:
    """Seconds from the POST to the spawner's start, to sbatch, to the job running, to start() returning."""
    mine = [m for m in marks if m["user"] == user and m["t"] >= t_post - 1]
    first = {}
    for m in mine:
        first.setdefault(m["what"], m["t"])
    out = {}
    for what in ("start", "sbatch", "running", "started"):
        if what in first:
            out[what] = first[what] - t_post
    return out


def spawn_to_ready(hub, user: str, options: dict, timeout: float = 180) -> float:
    t0 = time.perf_counter()
    status, body = hub.api("POST", f"users/{user}/server", options)
    if status not in (201, 202):
        raise RuntimeError(f"spawn of {user} failed: {status} {body}")
    while True:
        s = hub.server_model(user)
        if s and s.get("ready"):
            return time.perf_counter() - t0
        if s is None:
            raise RuntimeError(f"{user}'s spawn failed:\n{hub.log_tail(30)}")
        if time.perf_counter() - t0 > timeout:
            raise RuntimeError(f"{user} not ready after {timeout} s")
        time.sleep(0.02)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8, help="spawns per spawner (default 8)")
    ap.add_argument("--out", default=str(HERE / "results" / "bench_spawn_slurm.json"))
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="bench-slurm-") as tmp_dir:
        tmp = Path(tmp_dir)
        slurm = SlurmCluster(tmp / "slurm", gpus=4, gpu_type="l4").start()
        hub = None
        times: dict[str, list[float]] = {"plain": [], "leased": []}
        split: dict[str, list[dict]] = {"plain": [], "leased": []}
        try:
            (tmp / "hub").mkdir()
            (tmp / "hub" / "bench_slurm_spawner.py").write_text(BENCH_SPAWNER)
            marks_file = tmp / "marks.jsonl"
            hub = make_slurm_hub(tmp / "hub", slurm, users=("plain", "leased"),
                                 config_lines=["c.BatchSpawnerBase.startup_poll_interval = 0.2"],
                                 spawner="bench_slurm_spawner.BenchSlurmSpawner",
                                 env={"GPULEASE_BENCH_MARKS": str(marks_file)})
            order = (("plain", {"kind": "cpu"}), ("leased", {"gpus": 1, "model": "l4"}))
            for user, opts in order:  # warm-up, not counted
                spawn_to_ready(hub, user, opts)
                hub.api("DELETE", f"users/{user}/server")
                hub.wait_gone(user)
            for i in range(args.rounds):
                for user, opts in (order if i % 2 == 0 else order[::-1]):
                    t_post = time.time()
                    times[user].append(spawn_to_ready(hub, user, opts))
                    split[user].append(phases(read_marks(marks_file), user, t_post))
                    hub.api("DELETE", f"users/{user}/server")
                    hub.wait_gone(user)
                    wait_for(lambda: not slurm.jobs(), 60, "a job outlived its server")
                    assert not hub.leases(state="live"), "a lease outlived its server"
                print(f"round {i + 1}: plain {times['plain'][-1]:.3f} s {fmt(split['plain'][-1])}; "
                      f"leased {times['leased'][-1]:.3f} s {fmt(split['leased'][-1])}", flush=True)
        finally:
            if hub is not None:
                hub.stop()
            slurm.stop()

    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["leased"] / med["plain"]
    # where the time goes, per phase (medians): POST -> the spawner's start() -> sbatch -> job
    # RUNNING in squeue -> start() returns (the server reported its port) -> ready (the hub's check)
    phase_med = {u: {p: statistics.median(x[p] for x in split[u] if p in x) for p in ("start", "sbatch", "running", "started")
                     if any(p in x for x in split[u])} for u in split}
    lease_layer = {u: statistics.median(x["sbatch"] - x["start"] for x in split[u] if "sbatch" in x and "start" in x) for u in split}
    result = {
        "what": "spawn-to-ready on Slurm (POST /users/{name}/server until ready: sbatch, job start, "
                "batchspawner-singleuser, hub check), same hub and cluster, GPU free; hub polls every 20-50 ms, squeue every 0.2 s",
        "command": "python benchmarks/bench_spawn_slurm.py" + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:])),
        "rounds": args.rounds,
        "seconds": times,
        "median_s": med,
        "ratio_leased_to_plain": ratio,
        "phases_median_s_after_post": phase_med,
        "start_to_sbatch_median_s": lease_layer,
        "phases": split,
        "target_ratio": 1.05,
        "within_target": ratio <= 1.05,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nmedian spawn-to-ready on Slurm: plain SlurmSpawner {med['plain']:.3f} s, lease spawner {med['leased']:.3f} s, "
          f"ratio {ratio:.3f} (target <= 1.05: {'met' if ratio <= 1.05 else 'NOT met'})")
    print(f"start() to sbatch (the lease request, grant and job spec; plain: none): plain {lease_layer['plain'] * 1000:.0f} ms, "
          f"leased {lease_layer['leased'] * 1000:.0f} ms")
    for u in ("plain", "leased"):
        print(f"  {u:6s} after POST: " + ", ".join(f"{p} {v:.2f} s" for p, v in phase_med[u].items()))
    print(f"saved {args.out}")
    return 0


def fmt(ph: dict) -> str:
    return "(" + " ".join(f"{k} {v:.2f}" for k, v in ph.items()) + ")"


if __name__ == "__main__":
    sys.exit(main())
