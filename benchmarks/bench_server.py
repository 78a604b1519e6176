"""What the server extension costs, and how fast an idle GPU reaches the next user.

1. Monitor cost. Two Jupyter servers run side by side in one run, each with 20 idle-looking
   kernels: one with the GPU lease extension sampling 8 simulated GPUs and 50 GPU processes
   (the 20 kernels' and 30 others') at 1 Hz, holding a real lease from the broker (heartbeats
   included); one without the extension. Reported: each server process's CPU time over the
   window (as % of one core) and its event-loop lag (p50/p99/max, from a probe that sleeps
   10 ms on the loop, loaded into both). Targets: the difference < 1% of a core, lag p99 < 5 ms.
2. Reclaim to grant. A server holds the only GPU while another user waits for it. From the
   reclaim deadline (the moment the idle rule says "reclaim now") to the waiting user's grant at
   the broker, for (a) a lease no kernel uses and (b) a kernel suspended through a stand-in
   cuda-checkpoint (a test double: the real tool's own time is not in this figure). Target:
   at most one sample interval + 1 s.

The broker is the real broker application serving HTTP from a thread of this process with an
SQLite file; only its JupyterHub authentication is replaced (the token names the user), as in
the tests. Needs no GPU.

    .venv/bin/python benchmarks/bench_server.py [--seconds 60] [--rounds 5]

Saves the figures to benchmarks/results/server.json.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

import standin_cuda_checkpoint as standin  # noqa: E402
from brokerutil import broker_url, make_broker  # noqa: E402
from jupyter_gpulease.broker import handlers  # noqa: E402
from jupyter_gpulease.broker.manager import SystemClock  # noqa: E402
from serverutil import SimGPUs, broker_call  # noqa: E402


def fake_hub_auth() -> None:
    from brokerutil import _fake_authenticate

    handlers.APIHandler.authenticate = _fake_authenticate


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class BrokerThread:
    def __init__(self, folder: Path, pool: list[dict]):
        import asyncio
        import threading

        folder.mkdir(parents=True, exist_ok=True)
        self.app = make_broker(folder, pool=pool, clock=SystemClock(), tick_interval=0.5)
        self.loop = asyncio.new_event_loop()
        started = threading.Event()

        def run():
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self.app.start_async())
            started.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        started.wait(30)
        self.url = broker_url(self.app)

    def stop(self):
        import asyncio

        asyncio.run_coroutine_threadsafe(self.app.stop_async(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


class Server:
    """A `jupyter server` subprocess with the loop-lag probe; with or without the GPU lease extension."""

    def __init__(self, folder: Path, *, extension: bool, env: dict[str, str], settings: str = ""):
        folder.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.token = secrets.token_hex(8)
        self.url = f"http://127.0.0.1:{self.port}/"
        conf = folder / "jupyter_server_config.py"
        conf.write_text(
            "c = get_config()  # noqa\n"
            f"c.ServerApp.jpserver_extensions = {{'looplag': True, 'jupyter_gpulease.server': {extension!r}}}\n"
            "c.ServerApp.log_level = 'WARN'\n" + settings
        )
        full_env = {**os.environ, **env, "PYTHONPATH": str(HERE), "JUPYTER_CONFIG_DIR": str(folder / "cfg"),
                    "JUPYTER_DATA_DIR": str(folder / "data"), "JUPYTER_RUNTIME_DIR": str(folder / "run")}
        self.log = open(folder / "server.log", "wb")  # noqa: SIM115 - the server writes to it until stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jupyter_server", "--no-browser", "--allow-root", "--ip=127.0.0.1", f"--port={self.port}",
             f"--ServerApp.token={self.token}", f"--ServerApp.root_dir={folder}", f"--config={conf}"],
            env=full_env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.wait(lambda: self.call("GET", "api/status")[0] == 200, 60, "server start")

    def call(self, method: str, path: str, body=None):
        data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Authorization": f"token {self.token}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                raw = r.read()
                return r.status, json.loads(raw) if raw else None
        except urllib.error.HTTPError as e:
            return e.code, None
        except OSError:
            return 0, None

    @staticmethod
    def wait(pred, timeout, what):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            v = pred()
            if v:
                return v
            time.sleep(0.1)
        raise SystemExit(f"timed out waiting for {what}")

    def kernels(self, n: int) -> list[int]:
        pids = []
        for _ in range(n):
            code, k = self.call("POST", "api/kernels", {"name": "python3"})
            assert code == 201, code
            pids.append(k["id"])
        return pids

    def stop(self):
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()


def kernel_pids(server_pid: int) -> list[int]:
    return [c.pid for c in psutil.Process(server_pid).children() if "ipykernel" in " ".join(c.cmdline())]


def monitor_cost(tmp: Path, seconds: float) -> dict:
    pool = [{"node": "n1", "model": "A100-SXM4-80GB", "count": 8, "memory_mib": 81920}]
    broker = BrokerThread(tmp / "broker1", pool)
    sim = SimGPUs(str(tmp / "sim-gpus.json"), pool)
    others = [subprocess.Popen(["sleep", "3600"]) for _ in range(30)]
    servers = []
    try:
        _, lease = broker_call(broker.url, "POST", "api/leases", {"gpus": 8}, token="alice")
        assert lease["state"] == "active", lease
        env = {"GPULEASE_LEASE_ID": lease["id"], "GPULEASE_BROKER_URL": broker.url, "GPULEASE_TOKEN": "alice",
               "GPULEASE_DEVICE_BACKEND": "simulated", "GPULEASE_DEVICE_CONFIG": json.dumps(sim.config)}
        with_ext = Server(tmp / "with", extension=True, env=env, settings=(
            "c.GPULeaseExtension.sample_interval = 1.0\n"
            "c.GPUIdleRule.gpu_idle_timeout = 3600\n"
            "c.GPUIdleRule.gpu_idle_timeout_learn = False\n"
            "c.GPULeaseExtension.heartbeat_interval = 30\n"))
        servers.append(with_ext)
        without = Server(tmp / "without", extension=False, env={})
        servers.append(without)
        for s in servers:
            s.kernels(20)
        Server.wait(lambda: len(kernel_pids(with_ext.proc.pid)) == 20 and len(kernel_pids(without.proc.pid)) == 20, 120, "40 kernels")
        pids = kernel_pids(with_ext.proc.pid) + [p.pid for p in others]
        for i, pid in enumerate(pids):  # 50 GPU processes over 8 GPUs; kernels compute a little
            sim.run(pid, 1000 + 10 * i, sm=20.0 if i < 20 else 0.0, uuid=sim.uuids[i % 8])
        Server.wait(lambda: len([k for k in with_ext.call("GET", "gpulease/api/status?history=0")[1]["kernels"] if k["gpu"]["memory_mib"]]) == 20,
                    60, "the extension attributes all 20 kernels")
        time.sleep(5)  # settle
        procs = [psutil.Process(s.proc.pid) for s in servers]
        for s in servers:
            s.call("DELETE", "looplag")
        cpu0 = [sum(p.cpu_times()[:2]) for p in procs]
        t0 = time.monotonic()
        time.sleep(seconds)
        wall = time.monotonic() - t0
        cpu1 = [sum(p.cpu_times()[:2]) for p in procs]
        lags = [s.call("GET", "looplag")[1] for s in servers]
        st = with_ext.call("GET", "gpulease/api/status?history=0")[1]
        out = {}
        for name, c0, c1, lag in zip(("with_extension", "without_extension"), cpu0, cpu1, lags):
            out[name] = {"cpu_pct_of_core": round(100 * (c1 - c0) / wall, 3), "loop_lag_p50_ms": round(lag["p50_ms"], 3),
                         "loop_lag_p99_ms": round(lag["p99_ms"], 3), "loop_lag_max_ms": round(lag["max_ms"], 3), "lag_samples": lag["n"]}
        out["extension_cpu_pct_of_core"] = round(out["with_extension"]["cpu_pct_of_core"] - out["without_extension"]["cpu_pct_of_core"], 3)
        out["samples_taken"] = st["telemetry"]["samples"]
        out["devices"] = len(st["devices"])
        out["gpu_processes"] = sum(len(d["processes"]) for d in st["devices"])
        out["kernels"] = len(st["kernels"])
        out["window_s"] = round(wall, 1)
        return out
    finally:
        for s in servers:
            s.stop()
        for p in others:
            p.kill()
            p.wait()
        broker.stop()


def _deadline(server: Server, case: str) -> float | None:
    """When the idle rule says "reclaim now": the kernel's deadline, or the lease's when no kernel uses it."""
    st = server.call("GET", "gpulease/api/status?history=0")[1]
    if case == "suspended_kernel":
        return next((k["idle"]["reclaim_at"] for k in st["kernels"] if k["idle"]["reclaim_at"]), None)
    return st["reclaim"]["lease_reclaim_at"]


def _granted(url: str, lease_id: str) -> dict | None:
    _, b = broker_call(url, "GET", f"api/leases/{lease_id}", token="bob")
    return b if b["state"] == "active" else None


def reclaim_to_grant(tmp: Path, rounds: int, sample_interval: float = 1.0) -> dict:
    pool = [{"node": "n1", "model": "L4", "count": 1, "memory_mib": 23034}]
    results: dict[str, list[float]] = {"lease_no_kernel_uses": [], "suspended_kernel": []}
    for case in results:
        for r in range(rounds):
            folder = tmp / f"r-{case}-{r}"
            broker = BrokerThread(folder / "broker", pool)
            sim = SimGPUs(str(folder / "sim-gpus.json"), pool)
            sdir = folder / "standin"
            sdir.mkdir(parents=True)
            checkpoint = standin.install(str(sdir))
            server = None
            try:
                _, lease = broker_call(broker.url, "POST", "api/leases", {"gpus": 1}, token="alice")
                broker_call(broker.url, "POST", f"api/leases/{lease['id']}/confirm", token="alice")
                _, bob = broker_call(broker.url, "POST", "api/leases", {"gpus": 1}, token="bob")
                assert bob["state"] == "queued"
                env = {"GPULEASE_LEASE_ID": lease["id"], "GPULEASE_BROKER_URL": broker.url, "GPULEASE_TOKEN": "alice",
                       "GPULEASE_DEVICE_BACKEND": "simulated", "GPULEASE_DEVICE_CONFIG": json.dumps(sim.config),
                       "STANDIN_CUDA_CHECKPOINT_DIR": str(sdir), "STANDIN_CUDA_CHECKPOINT_SIM_STATE": sim.state_file}
                timeout = 8.0 if case == "suspended_kernel" else 4.0
                server = Server(folder / "server", extension=True, env=env, settings=(
                    f"c.GPULeaseExtension.sample_interval = {sample_interval}\n"
                    f"c.GPUIdleRule.gpu_idle_timeout = {timeout}\n"
                    "c.GPUIdleRule.gpu_idle_timeout_learn = False\n"  # the fixed timeout, every round
                    "c.ReclaimActions.warn_before = 1\n"
                    f"c.GPULeaseExtension.cuda_checkpoint = {checkpoint!r}\n"))
                if case == "suspended_kernel":
                    server.kernels(1)
                    pid = Server.wait(lambda s=server: kernel_pids(s.proc.pid), 60, "the kernel")[0]
                    sim.run(pid, 4000, sm=0.0)
                due = Server.wait(lambda s=server, c=case: _deadline(s, c), 60, "a reclaim deadline")
                b = Server.wait(lambda u=broker.url, i=bob["id"]: _granted(u, i), 60, "bob's grant")
                results[case].append(b["granted_at"] - due)
            finally:
                if server is not None:
                    server.stop()
                broker.stop()
    out = {"sample_interval_s": sample_interval, "target_s": sample_interval + 1.0}
    for case, xs in results.items():
        out[case] = {"median_s": round(statistics.median(xs), 3), "max_s": round(max(xs), 3), "all_s": [round(x, 3) for x in xs]}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="measuring window of the monitor-cost run (seconds)")
    ap.add_argument("--rounds", type=int, default=5, help="reclaim-to-grant repetitions per case")
    ap.add_argument("--out", default=str(HERE / "results" / "server.json"))
    args = ap.parse_args(argv)
    fake_hub_auth()
    command = "python benchmarks/bench_server.py " + " ".join(argv if argv is not None else sys.argv[1:])
    with tempfile.TemporaryDirectory(prefix="bench-server-") as tmp:
        cost = monitor_cost(Path(tmp) / "cost", args.seconds)
        print("monitor cost, 8 GPUs / 50 GPU processes / 20 kernels at 1 Hz, side by side:")
        for name in ("with_extension", "without_extension"):
            c = cost[name]
            print(f"  {name:18} CPU {c['cpu_pct_of_core']:6.2f}% of a core   loop lag p50 {c['loop_lag_p50_ms']:.2f} ms  "
                  f"p99 {c['loop_lag_p99_ms']:.2f} ms  max {c['loop_lag_max_ms']:.1f} ms")
        print(f"  the extension: {cost['extension_cpu_pct_of_core']:+.2f}% of a core over {cost['window_s']} s "
              f"({cost['samples_taken']} samples of {cost['devices']} devices, {cost['gpu_processes']} processes, {cost['kernels']} kernels)")
        grant = reclaim_to_grant(Path(tmp) / "grant", args.rounds)
        print(f"reclaim deadline -> next user's grant at the broker (target <= {grant['target_s']:g} s):")
        for case in ("lease_no_kernel_uses", "suspended_kernel"):
            g = grant[case]
            print(f"  {case:22} median {g['median_s']:.2f} s  max {g['max_s']:.2f} s  ({g['all_s']})")
    result = {"command": command, "machine": f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}",
              "monitor_cost": cost, "reclaim_to_grant": grant}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"saved to {args.out}\ncommand: {command}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
