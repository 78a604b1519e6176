"""The ``slurm`` device backend: the pool from ``scontrol show node`` GRES, node states, and a real slurmctld.

fixtures/slurm/scontrol-captured.txt was captured from the test cluster (tests/slurmharness.py);
constructed-cluster.txt is built from Slurm's documentation (several GPU types, MIG types as
NVML autodetection names them, shards, down and drained nodes), not captured.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hubharness import wait_for
from jupyter_gpulease.devices import DeviceUnavailable, get_backend
from jupyter_gpulease.devices.slurm import inventory_from_scontrol, node_health, parse_gres, parse_scontrol_nodes
from slurmharness import SlurmCluster, require_slurm

FIXTURES = Path(__file__).parent / "fixtures" / "slurm"


def snapshots() -> dict[str, str]:
    out, name = {}, None
    for line in (FIXTURES / "scontrol-captured.txt").read_text().splitlines():
        if line.startswith("# state: "):
            name = line.removeprefix("# state: ")
        elif name and line.startswith("NodeName="):
            out[name] = line
    return out


def summary(gpus):
    return [(g.node, g.index, g.model, g.memory_mib, g.healthy, tuple(m.profile for m in g.mig)) for g in gpus]


def test_captured_scontrol_lines_parse_with_values_that_hold_spaces():
    snaps = snapshots()
    assert set(snaps) == {"idle", "mixed", "drain", "down", "resumed"}
    (drained,) = parse_scontrol_nodes(snaps["drain"])
    assert drained["NodeName"] == "localhost" and drained["Gres"] == "gpu:l4:4"
    assert drained["State"] == "MIXED+DRAIN"
    assert drained["Reason"].startswith("GPU 2 XID 79, RMA ticket 4711")
    assert drained["OS"].startswith("Linux ") and "#1 SMP" in drained["OS"]
    assert drained["GresUsed"] == "gpu:l4:3(IDX:0-2)"


def test_captured_states_give_healthy_unhealthy_and_lost_gpus():
    snaps = snapshots()
    mem = {"l4": 23034}
    assert summary(inventory_from_scontrol(snaps["idle"], memory_mib=mem)) == [("localhost", i, "l4", 23034, True, ()) for i in range(4)]
    assert all(g.healthy for g in inventory_from_scontrol(snaps["mixed"], memory_mib=mem))  # busy is not unhealthy
    assert not any(g.healthy for g in inventory_from_scontrol(snaps["drain"], memory_mib=mem))
    problems: list[str] = []
    assert inventory_from_scontrol(snaps["down"], memory_mib=mem, problems=problems) == []
    assert "left the pool" in problems[0]
    assert not any(g.healthy for g in inventory_from_scontrol(snaps["resumed"], memory_mib=mem))  # IDLE+NOT_RESPONDING


def test_a_constructed_cluster_with_types_mig_shards_and_partitions():
    text = (FIXTURES / "constructed-cluster.txt").read_text()
    problems: list[str] = []
    gpus = inventory_from_scontrol(text, memory_mib={"a100": 81920, "l4": 23034, "l40s": 46068, "t4": 15360},
                                   partitions=("gpu",), problems=problems)
    nodes = {g.node for g in gpus}
    assert nodes == {"gpu-01", "gpu-02", "gpu-04"}  # gpu-03 is down, cpu-01 has no GPU, viz-01 is in another partition
    g1 = [g for g in gpus if g.node == "gpu-01"]
    assert summary(g1) == [("gpu-01", i, "a100", 81920, True, ()) for i in range(4)] + [("gpu-01", i, "l4", 23034, True, ()) for i in (4, 5)]
    g2 = [g for g in gpus if g.node == "gpu-02"]
    assert {g.model for g in g2} == {"a100"} and all(g.mig for g in g2)
    assert sorted(m.profile for g in g2 for m in g.mig) == sorted(["3g.40gb"] * 2 + ["2g.20gb"] + ["1g.10gb"] * 9)
    for g in g2:
        assert sum(int(m.profile[0]) for m in g.mig) <= 7
    assert not any(g.healthy for g in gpus if g.node == "gpu-04")  # IDLE+DRAIN
    assert len([g for g in gpus if g.node == "gpu-04"]) == 8  # shards are not GPUs
    assert any("gpu-03" in p and "left the pool" in p for p in problems)
    assert len({g.uuid for g in gpus}) == len(gpus) and all(g.uuid.startswith("GPU-slurm-") for g in gpus)


def test_gpu_types_without_known_memory_are_left_out_with_a_message():
    problems: list[str] = []
    gpus = inventory_from_scontrol("NodeName=n1 Gres=gpu:h200:8,gpu:a100_80gb:2 State=IDLE", problems=problems)
    assert summary(gpus) == [("n1", 8, "a100_80gb", 81920, True, ()), ("n1", 9, "a100_80gb", 81920, True, ())]
    assert "h200" in problems[0] and "memory_mib" in problems[0]


def test_gres_strings_and_states():
    assert parse_gres("gpu:a100:4(S:0,2),gpu:2,shard:l4:8") == [
        parse_gres("gpu:a100:4(S:0,2)")[0], parse_gres("gpu:2")[0], parse_gres("shard:l4:8")[0]]
    assert [(e.name, e.type, e.count) for e in parse_gres("gpu:a100:4(S:0,2),gpu:2,shard:l4:8")] == [
        ("gpu", "a100", 4), ("gpu", "", 2), ("shard", "l4", 8)]
    assert parse_gres("(null)") == []
    assert node_health("IDLE") == node_health("MIXED") == node_health("ALLOCATED") == node_health("COMPLETING") == "ok"
    assert node_health("MIXED+DRAIN") == node_health("IDLE+NOT_RESPONDING") == node_health("IDLE+POWERED_DOWN") == "unhealthy"
    assert node_health("DOWN+DRAIN") == node_health("DOWN*") == "lost"


def test_backend_config_errors_are_clear():
    with pytest.raises(ValueError, match="unknown config key"):
        get_backend("slurm", {"memory": {}})
    with pytest.raises(ValueError, match="memory_mib"):
        get_backend("slurm", {"memory_mib": {"a100": "80GB"}})
    with pytest.raises(DeviceUnavailable, match="not found"):
        get_backend("slurm", {"scontrol": "/nonexistent/scontrol"}).inventory()


def test_backend_reads_a_real_slurmctld_and_follows_drain_and_down(tmp_path):
    require_slurm()
    with SlurmCluster(tmp_path, gpus=3, gpu_type="l4") as slurm:
        backend = get_backend("slurm", {"slurm_conf": str(slurm.conf), "memory_mib": {"l4": 23034}})
        assert backend.inventory_refresh_s == 15
        assert summary(backend.inventory()) == [("localhost", i, "l4", 23034, True, ()) for i in range(3)]
        slurm.run("scontrol", "update", "NodeName=localhost", "State=DRAIN", "Reason=maintenance window")
        assert not any(g.healthy for g in backend.inventory())
        slurm.run("scontrol", "update", "NodeName=localhost", "State=DOWN", "Reason=lost power")
        assert backend.inventory() == []
        slurm.run("scontrol", "update", "NodeName=localhost", "State=RESUME")
        wait_for(lambda: all(g.healthy for g in backend.inventory()) and backend.inventory(), 60, "the node did not come back")
        samples = backend.sample()
        assert len(samples) == 3 and all(s.memory_total_mib == 23034 and s.utilization_pct is None for s in samples.values())
    with pytest.raises(DeviceUnavailable, match="failed"):
        backend.inventory()  # the controller is gone: a clear error, not an empty pool
