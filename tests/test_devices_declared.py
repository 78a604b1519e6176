"""Simulated and static backends: pools from config, driven figures, clear config errors."""

import json
import subprocess
import sys

import pytest

from jupyter_gpulease.devices import DeviceSample, get_backend, parse_mig_profile, processes_by_pid
from jupyter_gpulease.devices.simulated import DEFAULT_POOL, SimulatedBackend


def test_default_simulated_pool_has_two_models_and_one_mig_gpu():
    gpus = get_backend("simulated", {}).inventory()
    assert [g.model for g in gpus] == ["A100-SXM4-80GB", "A100-SXM4-80GB", "L4", "L4"]
    assert [g.index for g in gpus] == [0, 1, 2, 3]
    assert {g.node for g in gpus} == {"sim-node-1"}
    mig = [g for g in gpus if g.mig_enabled]
    assert len(mig) == 1
    assert [m.profile for m in mig[0].mig] == ["3g.40gb", "3g.40gb"]
    assert all(m.memory_mib == 40960 for m in mig[0].mig)
    assert all(g.uuid.startswith("GPU-sim-") for g in gpus)
    assert all(m.uuid.startswith("MIG-sim-") for m in mig[0].mig)


def test_simulated_uuids_are_the_same_after_a_restart():
    first = [g.to_dict() for g in SimulatedBackend().inventory()]
    second = [g.to_dict() for g in SimulatedBackend({"gpus": DEFAULT_POOL}).inventory()]
    assert first == second
    assert len({g["uuid"] for g in first}) == 4


def test_inventory_from_config_numbers_gpus_per_node_and_expands_mig_counts():
    cfg = {"gpus": [
        {"node": "node-a", "model": "A100-80GB", "count": 2, "memory_mib": 81920, "mig": ["3g.40gb", "3g.40gb"]},
        {"node": "node-b", "model": "H100", "memory_mib": 81559, "mig": {"1g.10gb": 7}},
        {"node": "node-a", "model": "L4", "memory_mib": 23034},
    ]}
    gpus = get_backend("simulated", cfg).inventory()
    assert [(g.node, g.index, g.model) for g in gpus] == [("node-a", 0, "A100-80GB"), ("node-a", 1, "A100-80GB"),
                                                         ("node-b", 0, "H100"), ("node-a", 2, "L4")]
    assert len(gpus[0].mig) == 2 and len(gpus[1].mig) == 2
    assert gpus[0].mig[0].uuid != gpus[1].mig[0].uuid
    assert [m.profile for m in gpus[2].mig] == ["1g.10gb"] * 7
    assert [m.index for m in gpus[2].mig] == list(range(7))
    assert gpus[2].mig[0].memory_mib == 10240
    assert not gpus[3].mig_enabled


def test_mig_profile_names_give_slices_and_memory():
    assert parse_mig_profile("1g.10gb") == (1, 10240)
    assert parse_mig_profile("3g.40gb") == (3, 40960)
    assert parse_mig_profile("1g.10gb+me") == (1, 10240)
    with pytest.raises(ValueError, match="'half' is not a MIG profile"):
        parse_mig_profile("half")


@pytest.mark.parametrize("entry, words", [
    ({"node": "n", "model": "L4"}, "entry 1 (L4 on n): 'memory_mib' must be"),
    ({"node": "n", "model": "L4", "memory_mib": "24GB"}, "'memory_mib' must be"),
    ({"node": "n", "memory_mib": 1000}, "'model' must name the GPU model"),
    ({"node": "n", "model": "L4", "memory_mib": 23034, "count": 0}, "'count' must be a whole number of at least 1"),
    ({"node": "", "model": "L4", "memory_mib": 23034}, "'node' must be a non-empty string"),
    ({"node": "n", "model": "L4", "memory": 23034}, "unknown key(s) 'memory'"),
    ({"node": "n", "model": "A100", "memory_mib": 81920, "mig": ["4g.40gb", "4g.40gb"]}, "need 8 compute slices"),
    ({"node": "n", "model": "A100", "memory_mib": 40960, "mig": ["3g.40gb", "3g.40gb"]}, "need 81920 MiB but the GPU has 40960 MiB"),
    ({"node": "n", "model": "A100", "memory_mib": 81920, "mig": ["big"]}, "'big' is not a MIG profile"),
    ({"node": "n", "model": "A100", "memory_mib": 81920, "mig": "3g.40gb"}, "'mig' must be a list of profiles"),
    ({"node": "n", "model": "L4", "memory_mib": 23034, "count": 2, "uuids": ["GPU-1"]}, "'uuids' must list one UUID string per GPU (2)"),
    ("L4", "entry 1 must be an object"),
    ({"node": "n", "model": "L4", "memory_mib": 23034, "cuda_version": 12.4}, "'cuda_version' must be the highest CUDA version"),
    ({"node": "n", "model": "L4", "memory_mib": 23034, "cuda_version": "12"}, "such as '12.4'; got '12'"),
    ({"node": "n", "model": "L4", "memory_mib": 23034, "cuda_version": "CUDA 12.4"}, "'cuda_version' must be"),
    ({"node": "n", "model": "L4", "memory_mib": 23034, "driver_version": "550"}, "'driver_version' must be an NVIDIA driver version"),
    ({"node": "n", "model": "L4", "memory_mib": 23034, "driver_version": 550.54}, "'driver_version' must be"),
])
def test_bad_gpu_entry_is_refused_with_a_message_naming_it(entry, words):
    with pytest.raises(ValueError) as err:
        get_backend("simulated", {"gpus": [entry]})
    assert words in str(err.value)
    assert "entry 1" in str(err.value)


def test_a_declared_node_may_carry_its_drivers_version_and_cuda_version():
    gpus = get_backend("simulated", {"gpus": [
        {"node": "new", "model": "H100", "memory_mib": 81559, "driver_version": "570.124.06", "cuda_version": "12.8"},
        {"node": "old", "model": "L4", "count": 2, "memory_mib": 23034, "driver_version": "535.104.05", "cuda_version": "12.2"},
        {"node": "any", "model": "L4", "memory_mib": 23034},
    ]}).inventory()
    assert [(g.node, g.driver_version, g.cuda_version) for g in gpus] == [
        ("new", "570.124.06", "12.8"), ("old", "535.104.05", "12.2"), ("old", "535.104.05", "12.2"), ("any", "", "")]
    assert gpus[1].to_dict()["cuda_version"] == "12.2" and "cuda_version" not in gpus[3].to_dict()
    static = get_backend("static", {"gpus": [{"node": "n", "model": "L4", "memory_mib": 23034, "cuda_version": "12.4"}]}).inventory()
    assert static[0].cuda_version == "12.4" and static[0].driver_version == ""


def test_bad_entry_is_named_by_position():
    good = {"node": "n", "model": "L4", "memory_mib": 23034}
    with pytest.raises(ValueError, match=r"gpus entry 3 \(L4 on n\)"):
        get_backend("static", {"gpus": [good, good, {**good, "count": -1}]})


def test_duplicate_uuids_are_refused():
    e = {"node": "n", "model": "L4", "memory_mib": 23034, "uuids": ["GPU-x"]}
    with pytest.raises(ValueError, match="'GPU-x' is declared twice"):
        get_backend("static", {"gpus": [e, e]})


def test_unknown_backend_and_unknown_config_keys_are_refused():
    with pytest.raises(ValueError, match="unknown device backend 'cuda': choose one of simulated, static, nvml, auto"):
        get_backend("cuda", {})
    with pytest.raises(ValueError, match="unknown config key"):
        get_backend("simulated", {"gpu": []})
    with pytest.raises(ValueError, match="'gpus' must be a list"):
        get_backend("simulated", {"gpus": {"model": "L4"}})


def test_simulated_samples_follow_the_driven_utilization_and_processes():
    clock = iter([100.0, 200.0]).__next__
    b = SimulatedBackend(clock=clock)
    gpus = b.inventory()
    a100_mig, a100, l4 = gpus[0], gpus[1], gpus[2]
    mig0 = a100_mig.mig[0].uuid
    b.set_utilization(a100.uuid, 85)
    b.add_process(a100.uuid, 4242, 30000)
    b.add_process(mig0, 5151, 12000)
    s = b.sample()
    assert set(s) == {g.uuid for g in gpus} | {m.uuid for m in a100_mig.mig}
    assert isinstance(s[a100.uuid], DeviceSample)
    assert s[a100.uuid].timestamp == 100.0
    assert s[a100.uuid].utilization_pct == 85.0
    assert s[a100.uuid].memory_used_mib == 30000
    assert s[a100.uuid].memory_total_mib == 81920
    assert [(p.pid, p.used_memory_mib, p.device_uuid) for p in s[a100.uuid].processes] == [(4242, 30000, a100.uuid)]
    assert s[l4.uuid].utilization_pct == 0.0 and s[l4.uuid].memory_used_mib == 0 and s[l4.uuid].processes == ()
    # a MIG instance's process shows on the instance and on its GPU, named by the instance
    assert s[mig0].parent_uuid == a100_mig.uuid and s[mig0].memory_total_mib == 40960
    assert [(p.pid, p.device_uuid) for p in s[mig0].processes] == [(5151, mig0)]
    assert [(p.pid, p.device_uuid) for p in s[a100_mig.uuid].processes] == [(5151, mig0)]
    assert s[a100_mig.uuid].memory_used_mib == 12000
    by_pid = processes_by_pid(s)
    assert len(by_pid[5151]) == 1 and len(by_pid[4242]) == 1

    assert b.remove_process(4242)
    assert not b.remove_process(4242)
    s2 = b.sample()
    assert s2[a100.uuid].processes == () and s2[a100.uuid].memory_used_mib == 0
    assert s2[a100.uuid].timestamp == 200.0
    assert json.loads(json.dumps(s2[mig0].to_dict()))["processes"][0]["pid"] == 5151


def test_driving_an_unknown_device_or_bad_figures_is_refused():
    b = SimulatedBackend()
    uuid = b.inventory()[1].uuid
    with pytest.raises(ValueError, match="no simulated GPU or MIG instance with UUID 'GPU-nope'"):
        b.set_utilization("GPU-nope", 10)
    with pytest.raises(ValueError, match="from 0 to 100"):
        b.set_utilization(uuid, 120)
    with pytest.raises(ValueError, match="pid must be a positive"):
        b.add_process(uuid, 0, 10)


def test_state_file_lets_another_process_drive_the_simulated_gpus(tmp_path):
    state = tmp_path / "sim" / "gpus.json"
    watcher = SimulatedBackend({"state_file": str(state)})
    uuid = watcher.inventory()[2].uuid
    assert watcher.sample()[uuid].utilization_pct == 0.0  # no file yet: idle
    driver = f"""
from jupyter_gpulease.devices.simulated import SimulatedBackend
b = SimulatedBackend({{"state_file": {str(state)!r}}})
b.set_utilization({uuid!r}, 64)
b.add_process({uuid!r}, 777, 2048)
"""
    subprocess.run([sys.executable, "-c", driver], check=True)
    s = watcher.sample()[uuid]
    assert s.utilization_pct == 64.0
    assert [(p.pid, p.used_memory_mib) for p in s.processes] == [(777, 2048)]
    # and back: the watcher's own change reaches a fresh reader
    watcher.remove_process(777)
    fresh = SimulatedBackend({"state_file": str(state)})
    assert fresh.sample()[uuid].processes == ()
    assert fresh.sample()[uuid].utilization_pct == 64.0


def test_a_broken_state_file_is_ignored_with_the_last_good_figures_kept(tmp_path, caplog):
    state = tmp_path / "gpus.json"
    b = SimulatedBackend({"state_file": str(state)})
    uuid = b.inventory()[3].uuid
    b.set_utilization(uuid, 50)
    state.write_text("{not json")
    with caplog.at_level("WARNING"):
        assert b.sample()[uuid].utilization_pct == 50.0
    assert "ignoring state file" in caplog.text


def test_static_backend_reports_the_declared_pool_without_figures():
    b = get_backend("static", {"gpus": [
        {"node": "gpu-01", "model": "A100-SXM4-80GB", "count": 2, "memory_mib": 81920, "uuids": ["GPU-real-1", "GPU-real-2"]},
        {"node": "gpu-02", "model": "A100-SXM4-80GB", "memory_mib": 81920, "mig": {"1g.10gb": 7}},
    ]}, clock=lambda: 5.0)
    gpus = b.inventory()
    assert [g.uuid for g in gpus[:2]] == ["GPU-real-1", "GPU-real-2"]
    assert gpus[2].uuid.startswith("GPU-static-") and len(gpus[2].mig) == 7
    s = b.sample()
    assert len(s) == 3 + 7
    one = s["GPU-real-1"]
    assert (one.utilization_pct, one.memory_used_mib, one.memory_total_mib, one.processes, one.timestamp) == (None, None, 81920, (), 5.0)


def test_static_backend_needs_a_declared_pool():
    with pytest.raises(ValueError, match="static device backend: config needs 'gpus'"):
        get_backend("static", {})


@pytest.mark.parametrize("content", [
    '{"utilization": [50], "processes": {}}',
    '{"utilization": {}, "processes": "none"}',
])
def test_a_state_file_of_the_wrong_shape_is_ignored_not_raised(tmp_path, caplog, content):
    state = tmp_path / "gpus.json"
    b = SimulatedBackend({"state_file": str(state)})
    uuid = b.inventory()[3].uuid
    b.set_utilization(uuid, 50)
    state.write_text(content)
    with caplog.at_level("WARNING"):
        assert b.sample()[uuid].utilization_pct == 50.0
    assert "ignoring state file" in caplog.text


def test_non_finite_figures_in_a_state_file_are_dropped(tmp_path):
    state = tmp_path / "gpus.json"
    b = SimulatedBackend({"state_file": str(state)})
    uuid = b.inventory()[3].uuid
    state.write_text(f'{{"utilization": {{"{uuid}": NaN}}, "processes": {{"{uuid}": [{{"pid": 7, "used_memory_mib": Infinity}}]}}}}')
    s = b.sample()[uuid]
    assert s.utilization_pct == 0.0
    assert [(p.pid, p.used_memory_mib) for p in s.processes] == [(7, None)]


def test_simulated_process_utilization_temperature_power_and_health_can_be_driven(tmp_path):
    state = tmp_path / "gpus.json"
    b = SimulatedBackend({"state_file": str(state)})
    l4 = b.inventory()[2].uuid
    idle = b.sample()[l4]
    assert idle.utilization_pct == 0.0 and idle.power_limit_w == 72.0
    assert idle.temperature_c < 40 and idle.power_w < 20 and idle.health.ok  # idle: cool, little power
    b.add_process(l4, 4242, 8000, sm_util_pct=70)
    b.add_process(l4, 4343, 1000, sm_util_pct=50)
    busy = b.sample()[l4]
    assert {p.pid: p.sm_util_pct for p in busy.processes} == {4242: 70.0, 4343: 50.0}
    assert busy.utilization_pct == 100.0  # not driven: the processes' sum, at most 100
    assert busy.temperature_c > idle.temperature_c and busy.power_w > idle.power_w
    b.set_device(l4, temperature_c=88, power_w=70.5, health={"xid": 79, "xid_count": 1})
    # another process sees the same figures through the state file
    other = SimulatedBackend({"state_file": str(state)}).sample()[l4]
    assert (other.temperature_c, other.power_w, other.power_limit_w) == (88.0, 70.5, 72.0)
    assert not other.health.ok and other.health.xid == 79
    assert {p.pid: p.sm_util_pct for p in other.processes} == {4242: 70.0, 4343: 50.0}
    with pytest.raises(ValueError, match="sm_util_pct must be a number from 0 to 100"):
        b.add_process(l4, 5, 10, sm_util_pct=150)
    with pytest.raises(ValueError, match="temperature_c must be a number"):
        b.set_device(l4, temperature_c=-3)
    b.reset()
    assert b.sample()[l4].health.ok


def test_the_brokers_pool_lists_a_declared_nodes_driver(tmp_path):
    """GET api/pool's devices carry driver_version and cuda_version where the backend knows them."""
    import asyncio

    from brokerutil import make_broker

    app = make_broker(tmp_path, pool=[
        {"node": "old", "model": "L4", "memory_mib": 23034, "driver_version": "535.104.05", "cuda_version": "12.2"},
        {"node": "new", "model": "L4", "memory_mib": 23034},
    ])

    async def pool():
        await app.start_async()
        try:
            return app.manager.pool()
        finally:
            await app.stop_async()

    devices = {d["node"]: d for d in asyncio.run(pool())["devices"]}
    assert (devices["old"]["driver_version"], devices["old"]["cuda_version"]) == ("535.104.05", "12.2")
    assert "cuda_version" not in devices["new"] and "driver_version" not in devices["new"]
