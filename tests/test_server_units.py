"""The extension's plain logic: reclaim decisions with a moved clock, and process attribution
with real processes (a kernel's worker processes belong to it; PIDs from another namespace do not)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from jupyter_gpulease.devices import DeviceSample, ProcessSample
from jupyter_gpulease.server.attribution import HOST_PID_MESSAGE, KernelProcess, ProcessTree, attribute
from jupyter_gpulease.server.reclaim import KernelUse, ReclaimTracker


def tracker(**kw) -> ReclaimTracker:
    return ReclaimTracker(threshold_pct=5, warn_before_s=60, max_keep_s=kw.pop("max_keep_s", 0), **kw)


def idle(kid="k1", holds=True, sm=0.0, executing=False):
    return KernelUse(kid, executing, holds, sm)


def test_an_idle_kernel_is_warned_then_acted_on_then_the_lease_returns():
    t = tracker()
    t.lease_granted(0)
    t.observe(0, [idle(sm=80)])
    t.observe(100, [idle()])  # idle from t=100: deadline 700
    assert t.plan(600, 600, lease_active=True) == []
    [warn] = t.plan(640, 600, lease_active=True)
    assert (warn.kind, warn.kernel_id, warn.deadline) == ("warn", "k1", 700)
    assert t.plan(650, 600, lease_active=True) == []  # warned once
    [act] = t.plan(700, 600, lease_active=True)
    assert act.kind == "act" and act.idle_s == 600
    assert t.plan(701, 600, lease_active=True) == []  # acted once
    t.observe(705, [idle(holds=False)])  # its GPU memory is gone
    [ret] = t.plan(705, 600, lease_active=True)
    assert ret.kind == "return_lease" and ret.deadline == 600  # the GPU was last seen in use at 0


def test_a_short_timeout_warns_at_half_of_it_not_as_soon_as_the_kernel_falls_idle():
    t = ReclaimTracker(threshold_pct=5, warn_before_s=300)
    t.lease_granted(0)
    t.observe(0, [idle()])  # idle from 0: deadline 120, a 300 s warning would go out at once
    assert t.plan(1, 120, lease_active=True) == []
    assert t.plan(59, 120, lease_active=True) == []
    [warn] = t.plan(60, 120, lease_active=True)
    assert (warn.kind, warn.deadline) == ("warn", 120)


def test_computing_or_executing_resets_the_idle_clock_and_records_the_gap():
    t = tracker()
    t.observe(0, [idle()])
    assert t.observe(300, [idle(sm=50)]) == [300]  # a 5-minute gap, learnt
    assert t.kernels["k1"].idle_since is None
    t.observe(310, [idle()])
    assert t.observe(312, [idle(executing=True)]) == []  # 2 s: not a gap anyone takes
    t.observe(400, [idle()])
    assert t.kernel_deadline("k1", 600) == 1000


def test_allocating_gpu_memory_starts_the_idle_clock_again():
    t = tracker()
    t.observe(0, [idle(holds=False)])
    t.observe(500, [idle(holds=True)])  # loaded a model at 500 without computing yet
    assert t.kernel_deadline("k1", 600) == 1100


def test_keep_postpones_by_at_most_max_keep():
    t = tracker(max_keep_s=1800)
    t.lease_granted(0)
    t.observe(0, [idle()])
    t.keep(100, 7200)
    assert t.kernel_deadline("k1", 600) == 600 + 1800  # not 7300
    t.keep(100, 300)
    assert t.kernel_deadline("k1", 600) == 2400  # a shorter keep does not shorten the longer one


def test_a_lease_no_kernel_uses_goes_back_after_the_timeout_with_a_warning():
    t = tracker()
    t.lease_granted(1000)
    t.observe(1000, [])
    assert t.plan(1500, 600, lease_active=True) == []
    assert [d.kind for d in t.plan(1545, 600, lease_active=True)] == ["warn_lease"]
    assert [d.kind for d in t.plan(1600, 600, lease_active=True)] == ["return_lease"]
    assert t.plan(1600, None, lease_active=True) == []  # reclaim off
    assert t.plan(1600, 600, lease_active=False) == []


def test_executing_counts_as_use_unless_reclaim_busy():
    t = tracker()
    t.observe(0, [idle(executing=True)])
    assert t.kernels["k1"].idle_since is None
    t2 = tracker(reclaim_busy=True)
    t2.observe(0, [idle(executing=True)])
    assert t2.kernels["k1"].idle_since == 0


# ---------------------------------------------------------------------- attribution
def sample(uuid, *pids, mib=100, sm=10.0):
    return DeviceSample(uuid, 0.0, processes=tuple(ProcessSample(p, mib, uuid, sm_util_pct=sm) for p in pids))


def test_a_kernels_worker_processes_and_its_process_group_belong_to_it():
    # a stand-in kernel: a process in its own session that starts a worker (like a DataLoader)
    code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
    kernel = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        workers = []
        while not workers and time.monotonic() < deadline:
            workers = [int(p) for p in os.listdir("/proc") if p.isdigit() and _ppid(int(p)) == kernel.pid]
            time.sleep(0.05)
        assert workers, "the worker started"
        worker = workers[0]
        other = os.getpid()  # this test process: not the kernel's
        samples = {"GPU-a": sample("GPU-a", kernel.pid, worker), "GPU-b": sample("GPU-b", other, mib=7)}
        att = attribute(samples, [KernelProcess("k1", kernel.pid, os.getpgid(kernel.pid))], ProcessTree())
        k = att.kernels["k1"]
        assert sorted(k.pids) == sorted([kernel.pid, worker]) and k.memory_mib == 200 and k.sm_util_pct == 20.0
        assert k.devices == ["GPU-a"] and att.mode == "process"
        assert [p.pid for p in att.others] == [other] and att.owner == {kernel.pid: "k1", worker: "k1"}
    finally:
        os.killpg(kernel.pid, 9)
        kernel.wait()


def test_pids_nobody_here_has_switch_to_device_figures():
    att = attribute({"GPU-a": sample("GPU-a", 3_999_999, 3_999_998)}, [KernelProcess("k1", os.getpid())], ProcessTree())
    assert att.mode == "device" and att.message.endswith(HOST_PID_MESSAGE)
    # what it sees, where, and no guess at why
    assert "3999998, 3999999 on GPU-a" in att.message and "cannot see" in att.message and "container" not in att.message
    assert att.kernels["k1"].memory_mib is None and att.kernels["k1"].sm_util_pct is None
    # no processes at all, or no kernels: nothing to fall back from
    assert attribute({"GPU-a": sample("GPU-a")}, [KernelProcess("k1", os.getpid())], ProcessTree()).mode == "process"
    assert attribute({"GPU-a": sample("GPU-a", 3_999_999)}, [], ProcessTree()).mode == "process"


def test_a_process_counts_once_when_it_shows_on_a_gpu_and_its_mig_instance():
    p = ProcessSample(os.getpid(), 500, "MIG-1", sm_util_pct=None)
    samples = {"GPU-a": DeviceSample("GPU-a", 0, processes=(p,)), "MIG-1": DeviceSample("MIG-1", 0, processes=(p,), parent_uuid="GPU-a")}
    att = attribute(samples, [KernelProcess("k1", os.getpid())], ProcessTree())
    assert att.kernels["k1"].memory_mib == 500 and att.kernels["k1"].sm_util_pct is None


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        return int(data[data.rfind(b")") + 2:].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def test_where_the_engine_chose_the_devices_every_device_the_server_sees_is_watched():
    import asyncio

    from jupyter_gpulease.devices.simulated import SimulatedBackend
    from jupyter_gpulease.server.monitor import Monitor

    backend = SimulatedBackend()  # the default pool: an A100 in MIG mode (two instances), an A100, two L4
    gpus = backend.inventory()
    monitor = Monitor(backend, interval=1.0)
    monitor.watch(["GPU-k8s-0"])  # the broker's name for it: not a device NVML knows
    snap = asyncio.run(monitor.sample([]))
    assert snap.devices == {} and "not visible" in snap.error
    monitor.watch_all = True
    snap = asyncio.run(monitor.sample([]))
    expected = {m.uuid for m in gpus[0].mig} | {g.uuid for g in gpus[1:]}
    assert set(snap.devices) == expected and not snap.error
    asyncio.run(monitor.close())


def test_closing_the_monitor_closes_its_backend_off_the_event_loop():
    """A backend's close can wait for a sample that holds its lock (NVML): the loop runs on meanwhile."""
    import asyncio
    import threading

    from jupyter_gpulease.server.monitor import Monitor

    sample_done = threading.Event()

    class Backend:
        closed_in = None

        def close(self):
            self.closed_in = threading.current_thread()
            assert sample_done.wait(30), "the close blocked the event loop"  # set by a task on the loop

    backend = Backend()

    async def main():
        closing = asyncio.ensure_future(Monitor(backend).close())
        await asyncio.sleep(0)
        asyncio.get_running_loop().call_soon(sample_done.set)  # the loop still runs while the backend closes
        await closing
        return threading.current_thread()

    loop_thread = asyncio.run(main())
    assert backend.closed_in is not None and backend.closed_in is not loop_thread


def test_a_restore_refused_once_is_tried_again_and_one_refused_every_time_fails(tmp_path, monkeypatch):
    """Where the hub locks GPUs to leases, the GPU of a lease granted a moment ago opens only once
    the hub heard of the grant: a restore that came first is refused, and is tried again."""
    import asyncio

    import pytest

    import standin_cuda_checkpoint as standin
    from jupyter_gpulease.server.checkpoint import CheckpointError, CudaCheckpoint

    exe = standin.install(str(tmp_path))
    monkeypatch.setenv("STANDIN_CUDA_CHECKPOINT_DIR", str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        cc = CudaCheckpoint(exe)
        asyncio.run(cc.suspend([proc.pid]))
        monkeypatch.setenv("STANDIN_CUDA_CHECKPOINT_FAIL_ONCE", "restore")
        asyncio.run(cc.restore([proc.pid]))
        assert [c["action"] for c in standin.calls(str(tmp_path))] == ["lock", "checkpoint", "restore", "restore", "unlock"]
        asyncio.run(cc.suspend([proc.pid]))
        monkeypatch.setenv("STANDIN_CUDA_CHECKPOINT_FAIL", "restore")
        with pytest.raises(CheckpointError):
            asyncio.run(cc.restore([proc.pid], tries=2))
        assert [c["action"] for c in standin.calls(str(tmp_path))][-2:] == ["restore", "restore"]
    finally:
        proc.kill()
        proc.wait()
