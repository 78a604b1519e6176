"""Spawn-to-ready: the lease spawner against plain SimpleLocalProcessSpawner, on the same hub.

One real JupyterHub + configurable-http-proxy + broker (one simulated GPU, always free when a
spawn starts). User "plain" spawns through SimpleLocalProcessSpawner's own start/stop/poll;
user "leased" through GPULeaseSpawner (lease request, grant, placement, confirm). Spawns
alternate, so both see the same machine load. Reports the medians and their ratio
(target: within 5%) and saves them to benchmarks/results/bench_spawn.json.

The hub's readiness check normally polls a new server with exponential backoff (0.2 s up to
5 s, with jitter), which adds up to seconds of noise per spawn; this benchmark makes the hub
poll every 20-50 ms for both spawners, so the figures show the spawners' own cost.

    .venv/bin/python benchmarks/bench_spawn.py [--rounds 8]

Needs configurable-http-proxy (PATH or GPULEASE_CHP).
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

from test_spawner_e2e import GPU_MODEL, make_hub  # noqa: E402

BENCH_SPAWNER = '''
import jupyterhub.utils as _hub_utils
from jupyterhub.spawner import SimpleLocalProcessSpawner
from jupyter_gpulease.hub.spawner import GPULeaseSimpleLocalProcessSpawner

# The hub notices a server is up by polling it with exponential backoff (0.2 s, 0.4 s, … 5 s,
# with jitter), which rounds each spawn up to its next poll: seconds of noise that hide what
# the spawners themselves cost. Poll every 20-50 ms instead, for both spawners alike.
_backoff = _hub_utils.exponential_backoff


async def _fine_backoff(pass_func, fail_message, start_wait=0.2, scale_factor=2, max_wait=5, timeout=10, timeout_tolerance=0.1, *args, **kwargs):
    return await _backoff(pass_func, fail_message, 0.02, 1.0, 0.05, timeout, timeout_tolerance, *args, **kwargs)


_hub_utils.exponential_backoff = _fine_backoff


class BenchSpawner(GPULeaseSimpleLocalProcessSpawner):
    """User 'plain' bypasses the lease layer entirely: SimpleLocalProcessSpawner's own methods."""

    def _plain(self):
        return self.user.name == "plain"

    async def start(self):
        if self._plain():
            return await SimpleLocalProcessSpawner.start(self)
        return await super().start()

    async def stop(self, now=False):
        if self._plain():
            return await SimpleLocalProcessSpawner.stop(self, now=now)
        return await super().stop(now=now)

    async def poll(self):
        if self._plain():
            return await SimpleLocalProcessSpawner.poll(self)
        return await super().poll()
'''


def spawn_to_ready(hub, user: str, options: dict, timeout: float = 120) -> float:
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
    ap.add_argument("--out", default=str(HERE / "results" / "bench_spawn.json"))
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="bench-spawn-") as tmp_name:
        tmp = Path(tmp_name)
        (tmp / "bench_spawner.py").write_text(BENCH_SPAWNER)  # the hub runs with cwd=tmp: importable
        hub = make_hub(tmp, users=("plain", "leased"), config_lines=["c.JupyterHub.spawner_class = 'bench_spawner.BenchSpawner'"])
        times: dict[str, list[float]] = {"plain": [], "leased": []}
        try:
            # one warm-up each (imports, first JupyterLab build of settings), not counted
            for user, opts in (("plain", {"kind": "cpu"}), ("leased", {"gpus": 1, "model": GPU_MODEL})):
                spawn_to_ready(hub, user, opts)
                hub.api("DELETE", f"users/{user}/server")
                hub.wait_gone(user)
            for i in range(args.rounds):
                order = (("plain", {"kind": "cpu"}), ("leased", {"gpus": 1, "model": GPU_MODEL}))
                for user, opts in (order if i % 2 == 0 else order[::-1]):
                    times[user].append(spawn_to_ready(hub, user, opts))
                    hub.api("DELETE", f"users/{user}/server")
                    hub.wait_gone(user)
                    assert not hub.leases(state="live"), "a lease outlived its server"
                print(f"round {i + 1}: plain {times['plain'][-1]:.3f} s, leased {times['leased'][-1]:.3f} s", flush=True)
        finally:
            hub.stop()

    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["leased"] / med["plain"]
    result = {
        "what": "spawn-to-ready (POST /users/{name}/server until ready), same hub, GPU free, hub readiness polled every 20-50 ms",
        "command": "python benchmarks/bench_spawn.py" + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:])),
        "rounds": args.rounds,
        "seconds": times,
        "median_s": med,
        "ratio_leased_to_plain": ratio,
        "target_ratio": 1.05,
        "within_target": ratio <= 1.05,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nmedian spawn-to-ready: plain {med['plain']:.3f} s, leased {med['leased']:.3f} s, "
          f"ratio {ratio:.3f} (target <= 1.05: {'met' if ratio <= 1.05 else 'NOT met'})")
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
