"""The demo's simulated GPUs hold a kernel's place: the simulated cuda-checkpoint (its command line, what it
does to the state file, its refusals), use_gpu from a notebook's process, the state file readable by other
users' servers, an unreadable state file tried again, and the extension's choice of checkpoint tool."""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jupyter_gpulease.devices import simulated
from jupyter_gpulease.devices.simulated import SimulatedBackend
from jupyter_gpulease.server.checkpoint import CudaCheckpoint, simulated_checkpoint


@pytest.fixture
def sim(tmp_path):
    return SimulatedBackend({"state_file": str(tmp_path / "sim-gpus.json")})


def sim_env(sim, devices: str = "") -> dict[str, str]:
    return dict(os.environ, GPULEASE_DEVICE_BACKEND="simulated", GPULEASE_DEVICE_CONFIG=json.dumps({"state_file": sim.state_file}),
                CUDA_VISIBLE_DEVICES=devices)


def held(sim, pid: int) -> dict[str, tuple]:
    return {uuid: (p.used_memory_mib, p.sm_util_pct) for uuid, s in sim.sample().items() for p in s.processes
            if p.pid == pid and (p.device_uuid or uuid) == uuid}


def test_use_gpu_works_then_leaves_the_memory_held_and_the_gpu_idle_and_the_checkpoint_holds_the_place(sim):
    l4a, l4b = [g.uuid for g in sim.inventory() if g.model == "L4"]
    code = ("from jupyter_gpulease.sim.gpu import use_gpu; use_gpu(util=80, memory_gb=6, seconds=1.5)\n"
            "import sys; print('done', flush=True); sys.stdin.read()")
    kernel = subprocess.Popen([sys.executable, "-c", code], env=sim_env(sim, l4a), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not held(sim, kernel.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert held(sim, kernel.pid) == {l4a: (6144, 80.0)}  # working
        assert kernel.stdout.readline().strip().startswith("Using the simulated GPU")
        assert kernel.stdout.readline().strip().startswith("Done: the GPU is idle now")
        assert held(sim, kernel.pid) == {l4a: (6144, 0.0)}  # idle, the memory held

        # the suspend and the resume onto another GPU, as the extension runs them
        ck = simulated_checkpoint({"state_file": sim.state_file}, timeout_s=60)
        assert ck.simulated and ck.note.startswith("simulated")
        import asyncio

        asyncio.run(ck.suspend([kernel.pid]))
        assert held(sim, kernel.pid) == {}  # off the device; the process runs on
        assert asyncio.run(ck.state(kernel.pid)) == "checkpointed" and kernel.poll() is None
        assert asyncio.run(ck.supports_device_map())
        asyncio.run(ck.restore([kernel.pid], {l4a: l4b}))
        assert held(sim, kernel.pid) == {l4b: (6144, 0.0)}
        assert sim.started_at(kernel.pid) is not None  # restored as it was: it leaves the GPU when it exits
        assert asyncio.run(ck.state(kernel.pid)) == "running"
    finally:
        kernel.kill()
        kernel.wait()


def test_a_stopped_kernel_leaves_the_simulated_gpu_and_a_new_demo_run_forgets_the_last_ones_processes(sim, tmp_path):
    from jupyter_gpulease.hub.demo import forget_last_run

    l4a, l4b = [g.uuid for g in sim.inventory() if g.model == "L4"]
    code = ("from jupyter_gpulease.sim.gpu import use_gpu; use_gpu(util=50, memory_gb=6, seconds=0, quiet=True)\n"
            "import sys; print('done', flush=True); sys.stdin.read()")
    kernel = subprocess.Popen([sys.executable, "-c", code], env=sim_env(sim, l4a), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert kernel.stdout.readline().strip() == "done"
        assert held(sim, kernel.pid) == {l4a: (6144, 0.0)}
    finally:
        kernel.kill()
        kernel.wait()
    # the kernel stopped: its memory is no longer on the GPU, for any reader, and the next write drops it
    assert held(sim, kernel.pid) == {} and held(SimulatedBackend({"state_file": sim.state_file}), kernel.pid) == {}
    assert sim.sample()[l4a].memory_used_mib == 0
    sim.add_process(l4b, os.getpid(), 512)  # a process given without its start time stays while it is there
    saved = json.loads(Path(sim.state_file).read_text())
    assert kernel.pid not in [p["pid"] for procs in saved["processes"].values() for p in procs]
    assert str(kernel.pid) not in saved.get("started", {})
    # a new demo run: nothing of the last one runs, so pids that do not exist now go too, timed or not
    sim.add_process(l4a, 3_999_999, 6144)
    assert (tmp_path / "sim-gpus.json").exists() and forget_last_run(tmp_path) == [3_999_999]
    assert {p.pid for s in SimulatedBackend({"state_file": sim.state_file}).sample().values() for p in s.processes} == {os.getpid()}


def test_the_simulated_tools_refuse_real_gpus_and_kernels_without_a_lease(sim):
    real = dict(os.environ, GPULEASE_DEVICE_BACKEND="nvml", CUDA_VISIBLE_DEVICES="GPU-1234")
    r = subprocess.run([sys.executable, "-m", "jupyter_gpulease.devices.simcheckpoint", "--action", "lock", "--pid", str(os.getpid())],
                       env=real, capture_output=True, text=True, check=False)
    assert r.returncode == 1 and "works on simulated GPUs only" in r.stderr
    r = subprocess.run([sys.executable, "-c", "from jupyter_gpulease.sim.gpu import use_gpu; use_gpu()"], env=real, capture_output=True, text=True, check=False)
    assert r.returncode == 1 and "drives the demo's simulated GPUs only" in r.stderr and "real (nvml)" in r.stderr
    r = subprocess.run([sys.executable, "-c", "from jupyter_gpulease.sim.gpu import use_gpu; use_gpu()"], env=sim_env(sim, ""),
                       capture_output=True, text=True, check=False)
    assert r.returncode == 1 and "this kernel has no leased GPU" in r.stderr
    r = subprocess.run([sys.executable, "-c", "from jupyter_gpulease.sim.gpu import use_gpu; use_gpu(util=120)"],
                       env=sim_env(sim, "GPU-x"), capture_output=True, text=True, check=False)
    assert r.returncode == 1 and "util must be a number from 0 to 100, got 120" in r.stderr
    # a lock of a running process twice: the second says why not
    env = sim_env(sim)
    run = [sys.executable, "-m", "jupyter_gpulease.devices.simcheckpoint", "--action", "unlock", "--pid", str(os.getpid())]
    r = subprocess.run(run, env=env, capture_output=True, text=True, check=False)
    assert r.returncode == 1 and f"process {os.getpid()} is running, cannot unlock" in r.stderr


def test_the_state_file_is_readable_by_others_and_an_unreadable_one_is_tried_again(sim, caplog, monkeypatch):
    gpu = sim.inventory()[1].uuid
    sim.add_process(gpu, 4242, 1024)
    assert stat.S_IMODE(os.stat(sim.state_file).st_mode) == 0o644
    reader = SimulatedBackend({"state_file": sim.state_file})
    sim.add_process(gpu, 4343, 2048)
    real_open = os.open

    def refused(path, *a, **kw):  # as a server of another user met a 0600 file
        if str(path) == sim.state_file:
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *a, **kw)

    monkeypatch.setattr(simulated.os, "open", refused)
    with caplog.at_level(logging.WARNING):
        reader.sample()
        reader.sample()
    assert caplog.text.count("cannot read the state file") == 1 and "Permission denied" in caplog.text
    monkeypatch.undo()  # readable now, the file itself unchanged: read at the next sample, not cached as failed
    assert {p.pid for p in reader.sample()[gpu].processes} == {4242, 4343}


def test_the_extension_suspends_simulated_gpus_with_the_simulated_tool_unless_told_otherwise(sim):
    from traitlets.config import Config

    from jupyter_gpulease.server.app import GPULeaseExtension

    def choose(config: dict, backend_name: str):
        ext = GPULeaseExtension(config=Config({"GPULeaseExtension": config}))
        ext.device_config = {"state_file": sim.state_file}
        return ext._checkpoint(type("B", (), {"name": backend_name})())

    ck, why = choose({}, "simulated")
    assert isinstance(ck, CudaCheckpoint) and ck.simulated and why == ""
    ck, why = choose({}, "nvml")  # real GPUs: NVIDIA's tool or nothing
    assert ck is None or not ck.simulated
    ck, why = choose({"cuda_checkpoint": "simulated"}, "nvml")
    assert ck is None and "simulated GPUs only" in why
    ck, why = choose({"cuda_checkpoint": "no-such-cuda-checkpoint"}, "simulated")  # set on purpose: that one
    assert ck is None and "was not found" in why


def test_the_hub_start_check_sees_a_single_user_command_other_users_cannot_run():
    import shutil
    import tempfile
    from pathlib import Path

    from jupyter_gpulease.hub.startcheck import unreachable_by_others

    top = tempfile.mkdtemp(prefix="startcheck-", dir="/tmp")  # pytest's own tmp_path is in a 0700 folder
    try:
        os.chmod(top, 0o755)
        _start_check(Path(top), unreachable_by_others)
    finally:
        shutil.rmtree(top)


def _start_check(tmp_path, unreachable_by_others):
    home = tmp_path / "root-home"
    (home / "pyenv" / "bin").mkdir(parents=True)
    python = home / "pyenv" / "bin" / "python3"
    python.write_text("")
    python.chmod(0o755)
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").symlink_to(python)
    script = venv / "jupyterhub-singleuser"
    script.write_text(f"#!{venv / 'python'}\nprint('hi')\n")
    script.chmod(0o755)
    home.chmod(0o700)  # as pyenv's Python in /root
    try:
        warning = unreachable_by_others(str(script))
    finally:
        home.chmod(0o755)
    assert "cannot be run by other users" in warning and f"{home} (mode 700) cannot be entered" in warning, warning
    assert unreachable_by_others(str(script)) == ""
    assert unreachable_by_others(str(tmp_path / "missing")) == ""
