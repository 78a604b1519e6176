"""The Docker engine's parts, without a Docker daemon: the container's device lock and its nodes.

:class:`ContainerDevices` is the device guard's backend for containers: it finds a container's
device cgroup from its first process's ``/proc/<pid>/cgroup`` and writes the rules there. Here
the cgroup is a folder of the test (the kernel's files are plain files) and ``/proc`` a folder
with the one file read; the real cgroup, in real containers, is tests/test_docker_e2e.py's.
"""

from __future__ import annotations

import os

import pytest
from traitlets import TraitError

from jupyter_gpulease.hub.devaccess import DeviceNode
from jupyter_gpulease.hub.docker import (
    ContainerDevices,
    GPULeaseDockerSpawner,
    container_cgroup,
    container_device_args,
    detect_containers,
)

G0, G1 = DeviceNode("/dev/nvidia0", 195, 0), DeviceNode("/dev/nvidia1", 195, 1)
CTL = DeviceNode("/dev/nvidiactl", 195, 255)


def fake_proc(tmp_path, pid: int, line: str) -> str:
    proc = tmp_path / "proc"
    (proc / str(pid)).mkdir(parents=True)
    (proc / str(pid) / "cgroup").write_text(f"12:pids:/docker/abc\n{line}\n1:name=systemd:/docker/abc\n")
    return str(proc)


def cgroup_folder(tmp_path, rel: str):
    folder = tmp_path / "devices" / rel
    folder.mkdir(parents=True)
    for name in ("devices.allow", "devices.deny"):
        (folder / name).write_text("")
    return folder


class Recorder:
    """Each write to devices.allow/deny, in order (open(..., "w") truncates: keep them all)."""

    def __init__(self, monkeypatch):
        self.writes: list[tuple[str, str]] = []
        import builtins

        real_open = builtins.open

        def recording_open(path, mode="r", *a, **kw):
            f = real_open(path, mode, *a, **kw)
            if "w" in mode and os.path.basename(str(path)) in ("devices.allow", "devices.deny"):
                rec = self
                write = f.write

                def w(text):
                    rec.writes.append((os.path.basename(str(path)), text))
                    return write(text)

                f.write = w
            return f

        monkeypatch.setattr(builtins, "open", recording_open)


def test_container_cgroup_is_found_from_the_first_process(tmp_path):
    proc = fake_proc(tmp_path, 4242, "5:devices:/docker/0123abcd")
    assert container_cgroup(4242, "/sys/fs/cgroup/devices", proc=proc) == "/sys/fs/cgroup/devices/docker/0123abcd"
    proc2 = fake_proc(tmp_path / "b", 7, "3:cpu,devices:/system.slice/docker-1.scope")
    assert container_cgroup(7, "/m", proc=proc2) == "/m/system.slice/docker-1.scope"
    proc3 = fake_proc(tmp_path / "c", 9, "3:cpu:/x")
    with pytest.raises(OSError, match="no v1 devices cgroup"):
        container_cgroup(9, "/m", proc=proc3)


def test_every_node_goes_in_with_mknod_only_and_missing_ones_are_left_out(tmp_path):
    present = {"/dev/nvidia0", "/dev/nvidia1", "/dev/nvidiactl"}
    unresolved = DeviceNode("/dev/nvidia9", -1, -1)
    args = container_device_args([G0, G1, CTL, G0, unresolved, DeviceNode("/dev/nvidia-uvm", 511, 0)],
                                 exists=present.__contains__)
    assert args == ["/dev/nvidia0:/dev/nvidia0:m", "/dev/nvidia1:/dev/nvidia1:m", "/dev/nvidiactl:/dev/nvidiactl:m"]


def test_rules_wait_for_the_container_then_follow_every_change(tmp_path, monkeypatch):
    proc = fake_proc(tmp_path, 4242, "5:devices:/docker/c1")
    folder = cgroup_folder(tmp_path, "docker/c1")
    backend = ContainerDevices(str(tmp_path / "devices"), proc=proc)
    rec = Recorder(monkeypatch)

    start = backend.start("alice", [G0, CTL], [G1])
    # the container is made with every node, m only: nothing opens before its rules are written
    assert all(d.endswith(":m") for d in start.devices)
    assert rec.writes == []
    backend.apply("bob", [G1], [G0])  # not running yet: kept for later
    assert rec.writes == [] and not backend.holds("alice", 4242)

    backend.attach("alice", 4242)
    assert backend.holds("alice", 4242) and not backend.holds("alice", 1)
    assert rec.writes == [("devices.deny", "c 195:1 rwm"), ("devices.allow", "c 195:0 rwm"), ("devices.allow", "c 195:255 rwm")]
    rec.writes.clear()

    # the lease ended: every GPU denied, the container untouched otherwise
    backend.apply("alice", [], [G0, G1, CTL])
    assert rec.writes == [("devices.deny", "c 195:0 rwm"), ("devices.deny", "c 195:1 rwm"), ("devices.deny", "c 195:255 rwm")]
    rec.writes.clear()
    # resumed onto the other GPU
    backend.apply("alice", [G1, CTL], [G0])
    assert rec.writes == [("devices.deny", "c 195:0 rwm"), ("devices.allow", "c 195:1 rwm"), ("devices.allow", "c 195:255 rwm")]
    rec.writes.clear()

    backend.retire("alice", [G0, G1, CTL])
    assert [w for f, w in rec.writes if f == "devices.allow"] == []
    assert backend.remove("alice") and not backend.holds("alice", 4242)
    assert folder.is_dir()  # Docker removes the container's cgroup, not the guard


def test_a_restarted_hub_writes_the_rules_once_it_knows_the_container(tmp_path, monkeypatch):
    proc = fake_proc(tmp_path, 99, "5:devices:/docker/c2")
    cgroup_folder(tmp_path, "docker/c2")
    backend = ContainerDevices(str(tmp_path / "devices"), proc=proc)
    rec = Recorder(monkeypatch)
    backend.adopt("alice", [G1, CTL], [G0])
    assert rec.writes == [] and not backend.holds("alice", 99)  # so the guard attaches it
    backend.attach("alice", 99)
    assert ("devices.allow", "c 195:1 rwm") in rec.writes and ("devices.deny", "c 195:0 rwm") in rec.writes


def test_the_mechanism_needs_root_and_cgroup_v1(tmp_path):
    v1 = tmp_path / "mountinfo-v1"
    v1.write_text("30 25 0:26 / /sys/fs/cgroup/devices rw,nosuid shared:12 - cgroup cgroup rw,devices\n")
    v2 = tmp_path / "mountinfo-v2"
    v2.write_text("30 25 0:26 / /sys/fs/cgroup rw,nosuid shared:12 - cgroup2 cgroup2 rw\n")
    m = detect_containers(mountinfo=str(v1), euid=0)
    assert m.kind == "docker" and isinstance(m.backend, ContainerDevices) and m.backend.mount == "/sys/fs/cgroup/devices"
    m = detect_containers(mountinfo=str(v1), euid=1000)
    assert m.kind == "none" and "needs root" in m.why
    m = detect_containers(mountinfo=str(v2), euid=0)
    assert m.kind == "none" and "cgroup v2" in m.why


def test_settings_are_checked_when_set():
    s = GPULeaseDockerSpawner(_mock=True) if "_mock" in GPULeaseDockerSpawner.class_trait_names() else GPULeaseDockerSpawner()
    assert s.remove is True  # a container per start: its devices come from that start's lease
    assert s.enforces_devices and s.server_changes_gpus
    with pytest.raises(TraitError, match="environments"):
        s.environments = [{"name": "a"}]  # no image
    s.environments = [{"name": "torch", "display_name": "PyTorch", "image": "lab/torch:2.5", "cuda": "12.4"}]
    assert [e.name for e in s.environment_list] == ["torch"]
    with pytest.raises(TraitError):
        s.gpu_device_requests = "sometimes"


def test_gpu_spawns_are_refused_where_containers_cannot_be_locked_and_cpu_only_ones_go_on(monkeypatch):
    """best-effort on a host without the lock (cgroup v2): a container would keep its GPUs after
    its lease, so GPU spawns fail at once with the reason; CPU-only servers start."""
    import asyncio
    import types

    from jupyter_gpulease.hub import docker as docker_engine
    from jupyter_gpulease.hub.cgroups import Mechanism

    monkeypatch.setattr(docker_engine, "detect_containers", lambda: Mechanism("none", "no cgroup v1 devices controller is mounted"))
    s = GPULeaseDockerSpawner(user=types.SimpleNamespace(name="alice", groups=[]), broker_url="http://127.0.0.1:9/services/gpulease/",
                              enforce_devices="best-effort", pull_policy="skip")
    s.user_options = {"gpus": 1}
    with pytest.raises(Exception) as e:
        asyncio.run(s.before_lease_request())
    assert "cannot keep a container to its lease's GPUs here (no cgroup v1 devices controller is mounted)" in e.value.jupyterhub_message
    s.user_options = {"kind": "cpu"}
    asyncio.run(s.before_lease_request())  # no environments, no pull: nothing to refuse
