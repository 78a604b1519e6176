"""XID 79 through a whole JupyterHub: the server outlives the sick GPU's lease, its kernel moves.

A real JupyterHub with configurable-http-proxy, the broker as its managed service sampling a
simulated pool of two L4s, the lease spawner with its default ``on_lease_end = "stop"`` (set here
to say so), and alice's real single-user server with the extension and a real kernel, reached
through the proxy.

Her kernel sets ``x = 41`` and computes on her GPU (``use_gpu``); the driver then reports XID 79
on that GPU. The broker cordons it and moves her lease off it: the lease ends as revoked, "moved
off its GPU", after the extension suspended her kernel. The hub keeps her server running, the
same process with the same kernel, although a lease end stops a server under ``"stop"``. Her
kernel's next cell resumes it on the healthy GPU and sees ``x``; her server's status names the
new GPU.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from hubharness import wait_for
from leasehub import LeaseHub
from serverutil import SimGPUs

pytestmark = pytest.mark.timeout(300)

TWO_L4 = [{"node": "n1", "model": "L4", "count": 2, "memory_mib": 23034}]


class ServerWatch:
    """Reads the hub's model of a user's server every half second in a thread of its own, and keeps
    each time it was not the ready server it first saw (gone, not ready, or started again)."""

    def __init__(self, hub: LeaseHub, user: str):
        self.hub = hub
        self.user = user
        self.first = hub.ready_server(user)
        assert self.first, f"{user}'s server is not ready"
        self.lapses: list[dict | None] = []
        self.reads = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> ServerWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            try:
                model = self.hub.server_model(self.user)
            except Exception:  # the hub API did not answer this once: no reading, not a lapse
                continue
            self.reads += 1
            if not model or not model.get("ready") or model.get("started") != self.first["started"]:
                self.lapses.append(model)


def make_hub(tmp: Path) -> tuple[LeaseHub, SimGPUs]:
    """(hub, the simulated GPUs): two L4s the broker samples every 0.5 s (a sick GPU's holders
    moved within 15 s); servers sample every 0.5 s, send a heartbeat every second and never
    reclaim an idle GPU while the test looks."""
    sim = SimGPUs(str(tmp / "sim-gpus.json"), TWO_L4)
    hub = LeaseHub(
        tmp,
        users=["alice"],
        pool=TWO_L4,
        broker_devices=sim.config,
        server_devices=sim.config,
        broker_config=[
            "c.GPULeaseBroker.device_sample_interval = 0.5",
            "c.GPULeaseBroker.health_drain_grace_s = 15",
            "c.GPULeaseBroker.health_settle_s = 5",
            "c.GPULeaseBroker.heartbeat_timeout_s = 60",
        ],
        server_config=[
            "c.GPULeaseExtension.sample_interval = 0.5",
            "c.GPULeaseExtension.heartbeat_interval = 1",
            "c.GPUIdleRule.gpu_idle_timeout = 0",
        ],
        hub_config=[
            "c.GPULeaseSpawner.on_lease_end = 'stop'",  # the default, said aloud
            "c.GPULeaseSpawner.lease_wait_timeout = 120",
            "c.Spawner.default_url = '/tree'",
        ],
        start_timeout=120,
    )
    return hub.start(), sim


def test_xid_79_keeps_the_server_and_its_kernel_and_resumes_it_on_the_healthy_gpu_with_on_lease_end_stop(tmp_path):
    hub, sim = make_hub(tmp_path)
    try:
        alice = hub.create_token("alice")
        assert hub.spawn("alice", {"gpus": 1})[0] in (201, 202)
        hub.wait_ready("alice", timeout=120)
        server_pid = hub.server_pid("alice")

        def status() -> dict:
            code, st = hub.gpu_api("alice", alice, "status")
            if code != 200:  # her server is gone: say so, and what the hub says of it
                raise AssertionError(f"her server's status answered {code}; the hub's model of it: {hub.server_model('alice')}")
            return st

        def kernel(kid: str) -> dict:
            return next(k for k in status()["kernels"] if k["id"] == kid)

        lease = wait_for(lambda: (le := status().get("lease")) and le["state"] == "active" and le, 60, "alice's server reports its lease")
        [sick] = lease["devices"]
        [healthy] = [u for u in sim.uuids if u != sick]

        # her kernel keeps a variable and computes on her GPU
        kid = hub.start_kernel("alice", alice)
        hub.run_cell("alice", alice, kid, "x = 41\nfrom jupyter_gpulease.sim.gpu import use_gpu\n"
                                          "use_gpu(util=80, memory_gb=2, seconds=1, quiet=True)")
        working = wait_for(lambda: (k := kernel(kid))["execution_state"] == "idle" and (k.get("gpu") or {}).get("memory_mib") and k, 60,
                           "her kernel computed on her GPU and holds its memory")
        kernel_pid = working["pid"]
        assert sim.processes()[kernel_pid][0] == sick

        with ServerWatch(hub, "alice") as watch:
            sim.backend.inject_xid(sick, 79)  # the driver's report, seen by the broker's own device sampler

            def cordon():
                code, health = hub.broker_get("api/health", token=alice)
                return code == 200 and [c for c in health["cordons"] if c["name"] == sick]

            [cordoned] = wait_for(cordon, 20, "the sick GPU is cordoned")
            assert cordoned["mode"] == "drain" and "XID 79" in cordoned["reason"]

            # her kernel is suspended before the lease moves, then the lease ends as moved off its GPU
            wait_for(lambda: kernel(kid)["state"] == "suspended", 60, "her kernel is suspended")
            ended = wait_for(lambda: (le := hub.lease(lease["id"]))["state"] == "revoked" and le, 60, "her lease moved off its GPU")
            assert ended["end_message"].startswith("Revoked by the broker: moved off its GPU") and "XID 79" in ended["end_message"]
            wait_for(lambda: status()["lease"] is None, 30, "her server knows its lease ended")

            # the hub's spawner took the end (its state says how the lease ended), and kept her server running
            def hub_took_the_end():
                last = ((hub.server_model("alice") or {}).get("state") or {}).get("gpulease", {}).get("last_end") or {}
                return last.get("lease_id") == lease["id"] and last

            took = wait_for(hub_took_the_end, 30, "the hub took the end of her lease")
            assert took["state"] == "revoked" and took["end_reason"].startswith("moved off its GPU"), took
            suspended = kernel(kid)
            assert suspended["state"] == "suspended" and suspended["pid"] == kernel_pid
            assert suspended["suspended"]["devices"] == [sick] and suspended["suspended"]["at"] <= ended["ended_at"]  # before the move
            assert sick not in [uuid for uuid, _ in sim.processes().values()]  # off the sick GPU, the process alive

            # her kernel's next cell resumes it on the healthy GPU, with its variables
            out = tmp_path / "cells"
            out.mkdir()
            hub.run_cell("alice", alice, kid, f"open({str(out / 'x.txt')!r}, 'w').write(str(x + 1))")
            wait_for(lambda: (out / "x.txt").exists() and (out / "x.txt").read_text() == "42", 90,
                     "the next cell resumed her kernel and saw x")
            resumed = kernel(kid)
            assert resumed["state"] == "ok" and resumed["pid"] == kernel_pid, resumed
            assert (resumed.get("resume") or {}).get("stage") in (None, "done"), resumed
            assert sim.processes()[kernel_pid][0] == healthy

            # what she sees: her server holds a new lease on the healthy GPU
            now = wait_for(lambda: (le := status().get("lease")) and le["state"] == "active" and le, 30,
                           "her server reports the new lease")
            assert now["id"] != lease["id"] and now["devices"] == [healthy], now
            assert hub.lease(now["id"])["placement"]["slices"][0]["gpu_uuid"] == healthy
            time.sleep(2)  # a couple more of the hub's polls with the new lease

        assert watch.reads >= 10 and watch.lapses == [], watch.lapses
        assert hub.server_pid("alice") == server_pid  # the same server process throughout
        assert hub.server_model("alice")["state"]["pid"] == server_pid
        code, kernels = hub.request("GET", hub.user_url("alice", "api/kernels"), token=alice)
        assert code == 200 and [k["id"] for k in kernels] == [kid]
    finally:
        hub.close()
