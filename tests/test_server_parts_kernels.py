"""The kernel table and the kernels' environment, with a fake kernel manager and a moved clock."""

from __future__ import annotations

import os

from jupyter_gpulease.kernel.resume import marker_path
from jupyter_gpulease.server.kernelenv import KernelEnvironment
from jupyter_gpulease.server.kernels import KernelRecord
from partsutil import child_process, lease_json, rig, run


@run
async def test_the_table_reads_kernels_through_the_public_kernel_model_and_the_sessions(tmp_path):
    r = rig(tmp_path)
    k = r.km.add("k-1111-aaaa", 4321, kernel_name="python3", execution_state="busy", connections=2,
                 connection_file=str(tmp_path / "kernel-k1.json"))
    r.sessions.paths["k-1111-aaaa"] = "work/train.ipynb"
    await r.ctrl.kernels.read_paths(r.clock())  # nothing known yet: read at the next sample
    r.ctrl.kernels.refresh()
    await r.ctrl.kernels.read_paths(r.clock())
    rec = r.ctrl.kernels["k-1111-aaaa"]
    assert (rec.pid, rec.name, rec.execution_state, rec.connections, rec.path) == (4321, "python3", "busy", 2, "work/train.ipynb")
    assert abs(rec.last_activity - k.last_activity.timestamp()) < 1e-3
    assert rec.busy_since == r.clock() and rec.executing
    assert rec.label == "k-1111-a (python3)"
    r.clock.move(5)
    k.execution_state = "idle"
    r.ctrl.kernels.refresh()
    assert rec.busy_since is None and not rec.executing
    # a restart is a new process: the GPU past of the old one is gone
    rec.memory_peak_mib, rec.had_gpu = 900, True
    k.pid = 4322
    r.ctrl.kernels.refresh()
    assert (rec.pid, rec.memory_peak_mib, rec.had_gpu) == (4322, 0, False)
    # a kernel that went away leaves the table, and its suspended marker with it
    rec.state = "suspended"
    r.ctrl.kernels.mark_suspended(rec, True)
    assert os.path.exists(marker_path(k.connection_file))
    del r.km.kernels["k-1111-aaaa"]
    r.ctrl.kernels.refresh()
    assert "k-1111-aaaa" not in r.ctrl.kernels and not os.path.exists(marker_path(k.connection_file))


@run
async def test_a_restarted_suspended_kernel_is_ok_again_and_its_marker_is_gone(tmp_path):
    r = rig(tmp_path)
    k = r.km.add("k2", 100, connection_file=str(tmp_path / "kernel-k2.json"))
    r.ctrl.kernels.refresh()
    rec = r.ctrl.kernels["k2"]
    rec.state, rec.suspended = "suspended", {"devices": []}
    r.ctrl.kernels.mark_suspended(rec, True)
    k.pid = 101
    r.ctrl.kernels.refresh()
    assert rec.state == "ok" and rec.suspended is None and not os.path.exists(marker_path(k.connection_file))


@run
async def test_new_kernels_get_the_new_lease_s_environment_and_running_ones_are_said_stale(tmp_path):
    proc = child_process()
    try:
        r = rig(tmp_path)
        before = dict(os.environ)
        r.km.add("k3", proc.pid)
        await r.tick()
        rec = r.ctrl.kernels["k3"]
        rec.env_devices = r.uuid  # what its process started with
        launch = {"PATH": "/bin", "GPULEASE_LEASE_ID": "L1", "CUDA_VISIBLE_DEVICES": r.uuid, "GPULEASE_SERVER_URL": "http://s/",
                  "GPULEASE_TIER": "standard"}
        assert r.ctrl.kernel_env.apply(dict(launch)) == launch  # no change yet: the server's own environment
        # the lease goes away: kernels started now get no GPU; the running one keeps its device and is told
        await r.keeper.end("expired")
        env = r.ctrl.kernel_env.apply(dict(launch))
        assert env["CUDA_VISIBLE_DEVICES"] == "" and env["GPULEASE_LEASE_ID"] == "" and env["GPULEASE_SERVER_URL"] == "http://s/"
        assert "GPULEASE_TIER" not in env and env["GPULEASE_BROKER_URL"] == "http://broker/"
        notice = r.ctrl.announce.notice_of("env_stale")
        assert notice and notice["kernel_ids"] == ["k3"] and "New kernels get no GPU" in notice["message"]
        st = r.ctrl.status(history=False)
        assert st["kernel_env"] == {"cuda_visible_devices": "", "lease_id": ""} and st["kernels"][0]["env_stale"] is True
        # a new lease: its environment, with the memory fraction of a share
        new = lease_json("L2", r.uuid, share=0.5, memory_mib=11517, now=r.clock())
        r.keeper.lease = new
        await r.keeper.on_change("granted", new)
        env = r.ctrl.kernel_env.apply(dict(launch))
        assert env["GPULEASE_LEASE_ID"] == "L2" and env["CUDA_VISIBLE_DEVICES"] == r.uuid and env["GPULEASE_SHARE"] == "0.5"
        assert "GPULEASE_MEMORY_FRACTION" in env
        assert r.ctrl.announce.notice_of("env_stale") is None  # the running kernel sees the lease's device again
        assert dict(os.environ) == before  # the server's own environment is never written
    finally:
        proc.kill()


def test_a_suspended_or_resuming_kernel_is_not_stale():
    env = KernelEnvironment(base=lambda: {"CUDA_VISIBLE_DEVICES": "GPU-b"})
    rec = KernelRecord("k", state="suspended")
    assert not env.stale(rec, "GPU-a")
    rec.state = "ok"
    assert env.stale(rec, "GPU-a") and not env.stale(rec, "GPU-b") and not env.stale(rec, None)
