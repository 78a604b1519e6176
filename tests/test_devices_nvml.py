"""The NVML backend against a fake pynvml that raises the real nvidia-ml-py error classes."""

import logging
import subprocess
import sys

import pynvml
import pytest

from fake_pynvml import A100_UUID, L4_UUID, MIG_A, MIG_B, no_driver, two_gpu_machine
from jupyter_gpulease.devices import DeviceUnavailable, get_backend, processes_by_pid
from jupyter_gpulease.devices.nvml import NvmlBackend
from jupyter_gpulease.devices.simulated import SimulatedBackend


def backend(fake, **config):
    return NvmlBackend({"node": "gpu-box", **config}, nvml=fake, clock=lambda: 42.0)


def test_importing_the_devices_package_does_not_load_nvml():
    code = "import sys, jupyter_gpulease.devices, jupyter_gpulease.devices.nvml; print('pynvml' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "False"


def test_nvml_starts_on_first_use_only_and_once():
    fake = two_gpu_machine()
    b = backend(fake)
    assert fake.init_calls == 0
    b.inventory()
    b.sample()
    b.sample()
    assert fake.init_calls == 1
    b.close()
    assert fake.shutdown_calls == 1
    b.close()
    assert fake.shutdown_calls == 1


def test_inventory_lists_gpus_with_models_memory_and_mig_instances():
    gpus = backend(two_gpu_machine()).inventory()
    assert [(g.uuid, g.node, g.index, g.model, g.memory_mib) for g in gpus] == [
        (A100_UUID, "gpu-box", 0, "A100-SXM4-80GB", 81920),
        (L4_UUID, "gpu-box", 1, "L4", 23034),
    ]
    a100, l4 = gpus
    assert [(m.uuid, m.profile, m.memory_mib, m.index) for m in a100.mig] == [
        (MIG_A, "3g.40gb", 40192, 0),
        (MIG_B, "3g.40gb", 40192, 1),
    ]
    assert not l4.mig_enabled  # MigMode NotSupported: a GPU without MIG
    assert all(g.healthy for g in gpus)


def test_inventory_carries_the_drivers_version_and_the_cuda_version_it_supports():
    fake = two_gpu_machine(cuda_driver_version=12040)
    gpus = backend(fake).inventory()
    assert [(g.driver_version, g.cuda_version) for g in gpus] == [("550.54.15", "12.4")] * 2
    assert fake.calls.count("nvmlSystemGetCudaDriverVersion_v2") == 1  # once per inventory, not per GPU
    assert "nvmlSystemGetCudaDriverVersion" not in fake.calls
    d = gpus[1].to_dict()
    assert (d["driver_version"], d["cuda_version"]) == ("550.54.15", "12.4")
    assert type(gpus[1]).from_dict(d) == gpus[1]


def test_an_older_driver_without_the_v2_call_answers_through_the_plain_one():
    fake = two_gpu_machine(driver_version="535.104.05", cuda_driver_version=12020, cuda_driver_version_v2=False)
    gpus = backend(fake).inventory()
    assert {(g.driver_version, g.cuda_version) for g in gpus} == {("535.104.05", "12.2")}
    assert "nvmlSystemGetCudaDriverVersion" in fake.calls


def test_an_nvml_error_on_the_drivers_versions_leaves_them_empty_and_the_inventory_whole():
    fake = two_gpu_machine(driver_version=pynvml.NVMLError_Unknown, cuda_driver_version=pynvml.NVMLError_NotSupported)
    gpus = backend(fake).inventory()
    assert len(gpus) == 2
    assert {(g.driver_version, g.cuda_version) for g in gpus} == {("", "")}
    d = gpus[0].to_dict()
    assert "driver_version" not in d and "cuda_version" not in d  # in the pool's JSON only when known


def test_node_defaults_to_the_host_name():
    import socket

    b = NvmlBackend({}, nvml=two_gpu_machine())
    assert {g.node for g in b.inventory()} == {socket.gethostname()}


def test_mig_profile_comes_from_slices_and_memory_when_the_name_does_not_say():
    fake = two_gpu_machine()
    fake.gpus[0].name = "NVIDIA A100-SXM4-80GB"
    real_name = fake.nvmlDeviceGetName
    fake.nvmlDeviceGetName = lambda h: "NVIDIA A100-SXM4-80GB" if h in fake.gpus[0].mig else real_name(h)
    gpus = backend(fake).inventory()
    assert [m.profile for m in gpus[0].mig] == ["3g.40gb", "3g.40gb"]  # 3 slices, 40192 MiB rounds up to 40 GB


def test_samples_give_utilization_memory_and_processes_per_device():
    s = backend(two_gpu_machine()).sample()
    assert set(s) == {A100_UUID, L4_UUID, MIG_A, MIG_B}
    l4 = s[L4_UUID]
    assert (l4.timestamp, l4.utilization_pct, l4.memory_used_mib, l4.memory_total_mib) == (42.0, 37.0, 6144, 23034)
    assert [(p.pid, p.used_memory_mib, p.device_uuid, p.kind) for p in l4.processes] == [
        (700, None, L4_UUID, "graphics"),  # the driver does not say how much: None, not 0
        (6001, 4096, L4_UUID, "compute"),
        (6002, 2048, L4_UUID, "compute"),
    ]
    # MIG: the GPU sees the process and names the instance it runs in
    a100 = s[A100_UUID]
    assert a100.utilization_pct is None  # NotSupported on a GPU in MIG mode
    assert [(p.pid, p.device_uuid) for p in a100.processes] == [(5001, MIG_A)]
    assert s[MIG_A].parent_uuid == A100_UUID
    assert (s[MIG_A].memory_used_mib, s[MIG_A].memory_total_mib, s[MIG_A].utilization_pct) == (12000, 40192, None)
    assert [(p.pid, p.used_memory_mib, p.device_uuid) for p in s[MIG_A].processes] == [(5001, 12000, MIG_A)]
    assert s[MIG_B].processes == () and s[MIG_B].memory_used_mib == 0
    assert sorted(processes_by_pid(s)) == [700, 5001, 6001, 6002]


def test_mig_processes_are_attributed_by_gpu_instance_when_instances_cannot_list_them():
    s = backend(two_gpu_machine(mig_process_lists=False)).sample()
    assert [(p.pid, p.device_uuid) for p in s[MIG_A].processes] == [(5001, MIG_A)]
    assert s[MIG_B].processes == ()


def test_unsupported_utilization_is_none_not_an_error(caplog):
    with caplog.at_level(logging.WARNING):
        s = backend(two_gpu_machine(l4_utilization=None)).sample()
    assert s[L4_UUID].utilization_pct is None
    assert s[L4_UUID].memory_used_mib == 6144  # the other figures are still there
    assert "NotSupported" not in caplog.text and "Not Supported" not in caplog.text  # expected: not worth a warning


def test_a_lost_gpu_reports_no_figures_and_warns_once(caplog):
    fake = two_gpu_machine()
    b = backend(fake)
    b.inventory()
    fake.gpus[1].lost = True
    with caplog.at_level(logging.WARNING):
        s1 = b.sample()
        s2 = b.sample()
    for s in (s1, s2):
        assert (s[L4_UUID].utilization_pct, s[L4_UUID].memory_used_mib, s[L4_UUID].processes) == (None, None, ())
        assert s[A100_UUID].processes  # the other GPU is unaffected
    assert caplog.text.count("nvmlDeviceGetUtilizationRates failed: GPU is lost") == 1


def test_a_gpu_lost_at_discovery_is_listed_as_unhealthy():
    fake = two_gpu_machine()
    fake.gpus[1].lost = True
    gpus = backend(fake).inventory()
    assert [g.healthy for g in gpus] == [True, False]


def test_old_driver_without_v3_process_functions_falls_back_to_v2():
    fake = two_gpu_machine(driver_has_v3=False)
    s = backend(fake).sample()
    assert [p.pid for p in s[L4_UUID].processes] == [700, 6001, 6002]
    assert "nvmlDeviceGetComputeRunningProcesses_v2" in fake.calls
    assert "nvmlDeviceGetComputeRunningProcesses" not in fake.calls


def test_old_binding_without_v3_or_v2_falls_back_to_the_plain_call():
    fake = two_gpu_machine(binding_has_v3=False, binding_has_v2=False)
    s = backend(fake).sample()
    assert [p.pid for p in s[L4_UUID].processes] == [700, 6001, 6002]
    assert "nvmlDeviceGetComputeRunningProcesses" in fake.calls
    assert not any(c.endswith("_v3") for c in fake.calls)


def test_memory_info_without_v2_uses_v1():
    fake = two_gpu_machine(binding_has_memory_v2=False)
    s = backend(fake).sample()
    assert s[L4_UUID].memory_used_mib == 6144
    assert "nvmlDeviceGetMemoryInfo_v2" not in fake.calls


def test_graphics_processes_can_be_left_out():
    s = backend(two_gpu_machine(), include_graphics=False).sample()
    assert [p.pid for p in s[L4_UUID].processes] == [6001, 6002]


@pytest.mark.parametrize("kind, words", [
    ("library", "No NVIDIA driver found on this machine (the NVML library libnvidia-ml.so.1 could not be loaded"),
    ("driver", "No NVIDIA driver found on this machine (the NVIDIA kernel driver is not loaded"),
    ("permission", "NVML refused access to the GPUs"),
])
def test_no_driver_gives_a_clear_message_without_a_traceback_chain(kind, words):
    b = backend(no_driver(kind))
    with pytest.raises(DeviceUnavailable) as err:
        b.inventory()
    assert words in str(err.value)
    assert "'simulated' or 'static' device backend" in str(err.value)
    assert err.value.__cause__ is None and err.value.__suppress_context__
    with pytest.raises(DeviceUnavailable):
        b.sample()


def test_the_real_binding_on_this_machine_says_no_driver_or_finds_gpus():
    b = get_backend("nvml", {})
    try:
        gpus = b.inventory()
    except DeviceUnavailable as e:
        assert "NVIDIA" in str(e) or "NVML" in str(e)
    else:
        assert all(g.uuid for g in gpus)
    finally:
        b.close()


def test_auto_uses_nvml_when_it_finds_gpus(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", two_gpu_machine())
    b = get_backend("auto", {})
    assert isinstance(b, NvmlBackend)
    assert len(b.inventory()) == 2


def test_auto_falls_back_to_the_simulated_pool_and_says_why(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "pynvml", no_driver("library"))
    with caplog.at_level(logging.INFO, logger="jupyter_gpulease.devices"):
        b = get_backend("auto", {"gpus": [{"node": "n", "model": "L4", "memory_mib": 23034}]})
    assert isinstance(b, SimulatedBackend)
    assert [g.model for g in b.inventory()] == ["L4"]
    assert "NVML is not usable (No NVIDIA driver found on this machine" in caplog.text


def test_auto_falls_back_when_nvml_finds_no_gpus(monkeypatch, caplog):
    from fake_pynvml import FakeNVML

    monkeypatch.setitem(sys.modules, "pynvml", FakeNVML([]))
    with caplog.at_level(logging.INFO, logger="jupyter_gpulease.devices"):
        b = get_backend("auto", {})
    assert isinstance(b, SimulatedBackend)
    assert "found no GPUs" in caplog.text


def test_fake_uses_the_real_error_classes():
    fake = two_gpu_machine()
    assert fake.NVMLError_NotSupported is pynvml.NVMLError_NotSupported
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        fake.nvmlDeviceGetCount()


def test_gpu_check_script_passes_on_a_gpu_machine_or_explains_the_missing_driver(tmp_path):
    import os

    script = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "gpu_check.py")
    r = subprocess.run([sys.executable, script, "--no-torch", "--out", str(tmp_path / "gpu.json")],
                       capture_output=True, text=True, timeout=120, check=False)
    if r.returncode == 2:
        assert "No NVIDIA driver found on this machine" in r.stderr
        assert "Traceback" not in r.stderr
    else:
        assert r.returncode == 0, r.stderr
        assert (tmp_path / "gpu.json").exists()


# ---------------------------------------------------------------------- temperature, power, health, per-process utilization
def test_samples_give_temperature_and_power_in_plain_units():
    s = backend(two_gpu_machine()).sample()
    l4 = s[L4_UUID]
    assert (l4.temperature_c, l4.power_w, l4.power_limit_w) == (61.0, 41.5, 72.0)  # milliwatts from NVML, watts here
    assert s[MIG_A].temperature_c == s[A100_UUID].temperature_c  # an instance shares its GPU's die
    assert s[MIG_A].power_w is None  # no power figure of its own


def test_figures_the_driver_does_not_report_are_none_without_warnings(caplog):
    fake = two_gpu_machine()
    l4 = fake.gpus[1]
    l4.temperature = l4.power_mw = l4.power_limit_mw = l4.ecc_uncorrected = None
    with caplog.at_level(logging.WARNING):
        s = backend(fake).sample()[L4_UUID]
    assert (s.temperature_c, s.power_w, s.power_limit_w, s.health.ecc_uncorrected) == (None, None, None, None)
    assert s.health.ok
    assert caplog.text == ""


def test_per_process_sm_utilization_comes_from_process_utilization_samples():
    fake = two_gpu_machine()
    b = backend(fake)
    procs = {p.pid: p for p in b.sample()[L4_UUID].processes}
    assert procs[6001].sm_util_pct == 30.0
    assert procs[6002].sm_util_pct == 0.0  # no sample in the period: it ran no kernel
    fake.gpus[1].processes[0].sm_util = None
    fake.gpus[1].processes[1].sm_util = 85
    procs = {p.pid: p for p in b.sample()[L4_UUID].processes}
    assert (procs[6001].sm_util_pct, procs[6002].sm_util_pct) == (0.0, 85.0)
    # the second call asks only for samples after the newest one the first call returned
    first, second = [ts for uuid, ts in fake.process_utilization_timestamps if uuid == L4_UUID]
    assert second == first + 1000


def test_no_process_sample_at_all_means_every_process_was_idle():
    fake = two_gpu_machine()
    fake.gpus[1].processes[0].sm_util = None  # the driver answers NotFound
    procs = backend(fake).sample()[L4_UUID].processes
    assert {p.pid: p.sm_util_pct for p in procs if p.kind == "compute"} == {6001: 0.0, 6002: 0.0}


def test_unsupported_process_utilization_leaves_it_unknown():
    fake = two_gpu_machine()
    fake.gpus[1].process_utilization = False
    procs = backend(fake).sample()[L4_UUID].processes
    assert all(p.sm_util_pct is None for p in procs)


def test_critical_xid_errors_and_ecc_errors_mark_the_gpu_unhealthy():
    fake = two_gpu_machine()
    b = backend(fake)
    assert b.sample()[L4_UUID].health.ok
    fake.raise_xid(fake.gpus[1], 79)
    fake.raise_xid(fake.gpus[1], 48)
    fake.gpus[1].ecc_uncorrected = 2
    s = b.sample()
    h = s[L4_UUID].health
    assert (h.ok, h.xid, h.xid_count, h.ecc_uncorrected) == (False, 48, 2, 2)
    assert "2 critical XID error(s), the last XID 48" in h.message() and "2 uncorrectable ECC" in h.message()
    assert s[A100_UUID].health.ok  # the other GPU is untouched
    assert b.sample()[L4_UUID].health.xid_count == 2  # errors stay counted: the GPU stays suspect until a reset
    fake.gpus[1].ecc_uncorrected = 0  # the GPU was reset: the volatile count is back to 0
    h = b.sample()[L4_UUID].health
    assert (h.ok, h.resets, h.xid_counts(), h.xids_since_reset(), h.message()) == (True, 1, {48: 1, 79: 1}, {}, "")
    fake.raise_xid(fake.gpus[1], 79)  # failing again after the reset
    h = b.sample()[L4_UUID].health
    assert not h.ok and h.xids_since_reset() == {79: 1} and "1 critical XID error(s) since the last reset, the last XID 79" in h.message()


def test_a_lost_gpu_is_reported_lost_in_its_health():
    fake = two_gpu_machine()
    b = backend(fake)
    b.inventory()
    fake.gpus[1].lost = True
    h = b.sample()[L4_UUID].health
    assert h.lost and not h.ok and "lost" in h.message()


def test_gpus_without_event_support_still_sample():
    fake = two_gpu_machine()
    for g in fake.gpus:
        g.events = False
    b = backend(fake)
    assert b.sample()[L4_UUID].health.ok
    assert "nvmlEventSetFree" in fake.calls  # the unused event set is given back
    b.sample()
    assert fake.calls.count("nvmlEventSetCreate") == 1  # not retried every sample


def test_closing_frees_the_event_set_before_shutting_nvml_down():
    fake = two_gpu_machine()
    b = backend(fake)
    b.sample()
    b.close()
    assert fake.calls[-2:] == ["nvmlEventSetFree", "nvmlShutdown"]


def test_a_mig_instance_names_its_two_capability_nodes_from_the_drivers_list(tmp_path):
    """CUDA opens a MIG slice through its GPU instance's and its compute instance's access nodes;
    the driver lists their minors in /proc/driver/nvidia-caps/mig-minors."""
    minors = tmp_path / "mig-minors"
    minors.write_text("config 1\nmonitor 2\ngpu0/gi1/access 21\ngpu0/gi1/ci0/access 22\ngpu0/gi2/access 30\ngpu0/gi2/ci0/access 31\n")
    b = backend(two_gpu_machine())
    b.mig_minors_path = str(minors)
    a100 = next(g for g in b.inventory() if g.uuid == A100_UUID)
    assert a100.device == "/dev/nvidia0"
    assert [(m.uuid, m.device, m.compute_device) for m in a100.mig] == [
        (MIG_A, "/dev/nvidia-caps/nvidia-cap21", "/dev/nvidia-caps/nvidia-cap22"),
        (MIG_B, "/dev/nvidia-caps/nvidia-cap30", "/dev/nvidia-caps/nvidia-cap31")]
    b.mig_minors_path = str(tmp_path / "none")  # no list (no MIG capabilities): no nodes, nothing else changes
    a100 = next(g for g in b.inventory() if g.uuid == A100_UUID)
    assert [(m.device, m.compute_device) for m in a100.mig] == [("", ""), ("", "")]
