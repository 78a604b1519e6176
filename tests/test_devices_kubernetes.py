"""The ``kubernetes`` device backend: the pool from GPU nodes' labels, capacity, HAMi annotations and
DRA ResourceSlices, and how node changes reach the broker.

The node documents (tests/fixtures/kubernetes/*.json) are constructed from NVIDIA GPU operator,
GPU feature discovery, HAMi and DRA driver documentation (see make_fixtures.py), not captured
from a live cluster; the first test checks that every one is a valid Node / ResourceSlice of
Kubernetes 1.34.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
from datetime import datetime
from decimal import Decimal
from pathlib import Path

import kubernetes_validate
import pytest

from brokerutil import ManualClock, broker_url, make_broker, patch_auth
from jupyter_gpulease.client import BrokerClient
from jupyter_gpulease.devices import DeviceUnavailable, get_backend
from jupyter_gpulease.devices.kubenodes import (
    apply_node_event,
    gpus_from_hami,
    gpus_from_labels,
    gpus_from_resource_slices,
    inventory_from_nodes,
    items_of,
    model_name,
    node_state,
    parse_quantity,
    product_label_values,
    quantity_mib,
)

FIXTURES = Path(__file__).parent / "fixtures" / "kubernetes"
NODES_FILE = FIXTURES / "gpu-nodes.json"
SLICES_FILE = FIXTURES / "resource-slices.json"
NOW = datetime.fromisoformat("2025-10-06T10:00:00+00:00").timestamp()  # 5 min after gpu-l4-notready went silent


def load_nodes() -> list[dict]:
    return items_of(json.loads(NODES_FILE.read_text()), "Node")


def load_slices() -> list[dict]:
    return items_of(json.loads(SLICES_FILE.read_text()), "ResourceSlice")


def node(name: str) -> dict:
    return copy.deepcopy(next(n for n in load_nodes() if n["metadata"]["name"] == name))


def summary(gpus):
    return [(g.node, g.index, g.model, g.memory_mib, g.healthy, tuple(m.profile for m in g.mig)) for g in gpus]


# --------------------------------------------------------------------------- the fixtures are real objects
@pytest.mark.parametrize("version", ["1.34", "1.35"])
def test_recorded_node_and_slice_documents_are_valid_kubernetes_objects(version):
    for n in load_nodes():
        kubernetes_validate.validate(n, version, strict=True)
    for s in load_slices():
        kubernetes_validate.validate(s, version, strict=True)


# --------------------------------------------------------------------------- one node at a time
def test_whole_gpus_come_from_gfd_labels_with_the_model_and_memory_they_name():
    found = gpus_from_labels(node("gpu-a100-0"))
    assert found.source == "gfd" and not found.problems
    assert summary(found.gpus) == [("gpu-a100-0", i, "A100-SXM4-80GB", 81920, True, ()) for i in range(8)]
    # stable, distinct names where the cluster gives no UUIDs
    again = gpus_from_labels(node("gpu-a100-0"))
    assert [g.uuid for g in found.gpus] == [g.uuid for g in again.gpus]
    assert len({g.uuid for g in found.gpus}) == 8 and all(g.uuid.startswith("GPU-k8s-") for g in found.gpus)


def test_time_sliced_replicas_count_as_physical_gpus_of_the_unshared_model():
    found = gpus_from_labels(node("gpu-t4-ts-0"))  # nvidia.com/gpu 16 = 4 GPUs x 4 replicas, product Tesla-T4-SHARED
    assert summary(found.gpus) == [("gpu-t4-ts-0", i, "T4", 15360, True, ()) for i in range(4)]


def test_mps_with_renamed_shared_resource_counts_the_physical_gpus():
    found = gpus_from_labels(node("gpu-l4-mps-0"))  # nvidia.com/gpu 0, nvidia.com/gpu.shared 8
    assert summary(found.gpus) == [("gpu-l4-mps-0", i, "L4", 23034, True, ()) for i in range(2)]


def test_mixed_mig_labels_become_mig_instances_that_fit_each_gpu():
    found = gpus_from_labels(node("gpu-a100-mig-0"))
    assert len(found.gpus) == 4 and not found.problems
    profiles = sorted(m.profile for g in found.gpus for m in g.mig)
    assert profiles == sorted(["1g.10gb"] * 8 + ["2g.20gb"] * 4 + ["3g.40gb"] * 4)
    for g in found.gpus:
        assert g.mig_enabled and g.memory_mib == 81920
        assert sum(int(m.profile.split("g.")[0]) for m in g.mig) <= 7  # compute slices of one A100
        assert {m.memory_mib for m in g.mig if m.profile == "1g.10gb"} <= {9856}  # from nvidia.com/mig-1g.10gb.memory
        assert len({m.uuid for m in g.mig}) == len(g.mig)


def test_single_strategy_mig_product_names_the_profile_and_gpus_hold_seven_each():
    found = gpus_from_labels(node("gpu-h100-mig-single-0"))  # 14 x 1g.10gb on nvidia.com/gpu
    assert [(g.model, len(g.mig)) for g in found.gpus] == [("H100-80GB-HBM3", 7), ("H100-80GB-HBM3", 7)]
    assert {m.profile for g in found.gpus for m in g.mig} == {"1g.10gb"}
    assert {m.memory_mib for g in found.gpus for m in g.mig} == {9984}  # nvidia.com/gpu.memory is the instance's


def test_gpus_the_device_plugin_reports_unhealthy_are_marked_so():
    found = gpus_from_labels(node("gpu-v100-0"))  # capacity 4, allocatable 3
    assert [g.healthy for g in found.gpus] == [True, True, True, False]
    assert {g.model for g in found.gpus} == {"V100-SXM2-32GB"}


def test_hami_register_annotation_gives_real_uuids_memory_and_health():
    found = gpus_from_hami(node("gpu-a10-hami-0"))
    assert found.source == "hami"
    assert [(g.uuid, g.model, g.memory_mib, g.index) for g in found.gpus] == [
        ("GPU-3f1c2a10-7d5e-4b8a-9c11-0a1b2c3d4e01", "A10", 23028, 0),
        ("GPU-3f1c2a10-7d5e-4b8a-9c11-0a1b2c3d4e02", "A10", 23028, 1),
    ]
    broken = node("gpu-a10-hami-0")
    broken["metadata"]["annotations"]["hami.io/node-nvidia-register"] = "GPU-1,10,23028,100,NVIDIA-A10,0,true:"
    bad = gpus_from_hami(broken)
    assert bad.gpus == [] and "not JSON" in bad.problems[0]


def test_dra_resource_slices_give_the_exact_devices_with_mig_under_their_parent():
    found = gpus_from_resource_slices("gpu-dra-0", load_slices())
    assert found.source == "dra"
    whole = [g for g in found.gpus if not g.mig]
    assert [(g.uuid, g.index, g.model, g.memory_mib) for g in whole] == [
        ("GPU-9a8b7c6d-0000-4000-8000-00000000c000", 0, "H100-80GB-HBM3", 81559),
        ("GPU-9a8b7c6d-0000-4000-8000-00000000c001", 1, "H100-80GB-HBM3", 81559),
    ]
    (parent,) = [g for g in found.gpus if g.mig]
    assert parent.uuid == "GPU-9a8b7c6d-0000-4000-8000-00000000c002"
    assert [(m.uuid, m.profile, m.memory_mib) for m in parent.mig] == [
        ("MIG-5e4d3c2b-0000-4000-8000-00000000d000", "3g.40gb", 40448),
        ("MIG-5e4d3c2b-0000-4000-8000-00000000d001", "3g.40gb", 40448),
    ]
    assert gpus_from_resource_slices("gpu-a100-0", load_slices()) is None


def test_only_the_newest_generation_of_a_dra_pool_counts_and_v1beta1_devices_are_read():
    old, = load_slices()
    new = copy.deepcopy(old)
    new["spec"]["pool"]["generation"] = 2
    new["spec"]["devices"] = [{"name": "gpu-0", "basic": new["spec"]["devices"][0]}]  # v1beta1 shape
    found = gpus_from_resource_slices("gpu-dra-0", [old, new])
    assert [g.uuid for g in found.gpus] == ["GPU-9a8b7c6d-0000-4000-8000-00000000c000"]


def test_a_node_without_a_memory_label_is_left_out_unless_the_config_names_the_memory():
    n = node("gpu-a100-0")
    del n["metadata"]["labels"]["nvidia.com/gpu.memory"]
    n["metadata"]["labels"]["nvidia.com/gpu.product"] = "NVIDIA-A100-SXM4"  # no size in the name either
    found = gpus_from_labels(n)
    assert found.gpus == [] and "memory_mib" in found.problems[0]
    assert len(gpus_from_labels(n, {"A100-SXM4": 40960}).gpus) == 8


def test_gpu_labels_without_device_plugin_capacity_give_no_gpus_and_say_why():
    found = gpus_from_labels(node("gpu-dra-0"))
    assert found.gpus == [] and "'dra': true" in found.problems[0]


def test_cpu_nodes_are_not_gpu_nodes():
    assert gpus_from_labels(node("cpu-0")) is None


# --------------------------------------------------------------------------- names and quantities
def test_every_gfd_product_label_maps_to_a_model_whose_label_values_include_it():
    for n in load_nodes():
        raw = n["metadata"]["labels"].get("nvidia.com/gpu.product")
        if not raw:
            continue
        model, profile = model_name(raw)
        assert raw in product_label_values(model, mig_profile=profile, shared=raw.endswith("-SHARED")), raw
    assert model_name("NVIDIA-NVIDIA A10") == ("A10", "")  # HAMi's "NVIDIA-" + the driver's name
    assert model_name("NVIDIA A100-SXM4-80GB") == ("A100-SXM4-80GB", "")  # DRA productName, as nvml names it


def test_quantities_in_every_unit_kubernetes_writes():
    assert quantity_mib("80Gi") == 81920
    assert quantity_mib("81559Mi") == 81559
    assert quantity_mib(str(80 * 2**30)) == 81920
    assert quantity_mib("85G") == 85 * 10**9 // 2**20
    assert quantity_mib("lots") is None and quantity_mib(None) is None
    # the rest of the API's grammar: P/E and Pi/Ei, milli, decimal exponents, a fraction with a suffix
    assert quantity_mib("1Pi") == 2**30 and quantity_mib("1Ei") == 2**40
    assert quantity_mib("1.5Gi") == 1536 and quantity_mib("2e9") == 2 * 10**9 // 2**20
    assert parse_quantity("500m") == Decimal("0.5") and parse_quantity("1E3") == 1000 and parse_quantity(".5k") == 500
    for bad in ("1.5.5Gi", "Gi", "1 Gi", "1Xi", "1e", True):
        with pytest.raises(ValueError, match="not a Kubernetes quantity"):
            parse_quantity(bad)


# --------------------------------------------------------------------------- node states
def test_cordoned_and_not_ready_nodes_keep_unhealthy_gpus_until_lost():
    assert node_state(node("gpu-a100-cordoned"), NOW, 300).state == "cordoned"
    assert node_state(node("gpu-l4-notready"), NOW - 60, 300).state == "not-ready"
    assert node_state(node("gpu-l4-notready"), NOW, 300).state == "lost"
    assert node_state(node("gpu-a100-0"), NOW, 300).state == "ready"


def test_the_whole_pool_from_recorded_nodes_and_slices():
    problems: list[str] = []
    gpus = inventory_from_nodes(load_nodes(), now=NOW - 60, slices=load_slices(), problems=problems)
    by_node: dict[str, list] = {}
    for g in gpus:
        by_node.setdefault(g.node, []).append(g)
    assert {n: len(v) for n, v in by_node.items()} == {
        "gpu-a10-hami-0": 2, "gpu-a100-0": 8, "gpu-a100-cordoned": 2, "gpu-a100-mig-0": 4, "gpu-dra-0": 3,
        "gpu-h100-mig-single-0": 2, "gpu-l4-mps-0": 2, "gpu-l4-notready": 1, "gpu-t4-ts-0": 4, "gpu-v100-0": 4,
    }
    assert not any(g.healthy for g in by_node["gpu-a100-cordoned"] + by_node["gpu-l4-notready"])
    assert problems == []
    later = inventory_from_nodes(load_nodes(), now=NOW + 1, slices=load_slices(), problems=problems)
    assert "gpu-l4-notready" not in {g.node for g in later}
    assert any("gpu-l4-notready" in p and "left the pool" in p for p in problems)
    assert len({g.uuid for g in gpus}) == len(gpus)


def test_watch_events_add_change_and_remove_nodes():
    cache: dict[str, dict] = {}
    apply_node_event(cache, "ADDED", node("gpu-a100-0"))
    changed = node("gpu-a100-0")
    changed["spec"]["unschedulable"] = True
    apply_node_event(cache, "MODIFIED", changed)
    assert cache["gpu-a100-0"]["spec"]["unschedulable"] is True
    apply_node_event(cache, "BOOKMARK", {"metadata": {"name": "gpu-a100-0", "resourceVersion": "9"}})
    assert "gpu-a100-0" in cache
    apply_node_event(cache, "DELETED", changed)
    assert cache == {}


# --------------------------------------------------------------------------- the backend
def write_nodes(path: Path, nodes: list[dict]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": nodes}))
    os.replace(tmp, path)


def test_backend_reads_a_saved_document_again_when_it_changes(tmp_path):
    path = tmp_path / "nodes.json"
    write_nodes(path, [node("gpu-a100-0"), node("gpu-t4-ts-0")])
    backend = get_backend("kubernetes", {"nodes_file": str(path)}, clock=lambda: NOW)
    assert backend.inventory_refresh_s == 15
    assert len(backend.inventory()) == 12
    write_nodes(path, [node("gpu-t4-ts-0")])
    os.utime(path, ns=(1, 1))  # a different mtime even within the same clock tick
    assert {g.node for g in backend.inventory()} == {"gpu-t4-ts-0"}
    samples = backend.sample()
    assert all(s.utilization_pct is None and s.memory_total_mib == 15360 for s in samples.values())


def test_backend_errors_say_what_is_wrong(tmp_path):
    with pytest.raises(ValueError, match="unknown config key"):
        get_backend("kubernetes", {"nodefile": "x"})
    with pytest.raises(ValueError, match="memory_mib"):
        get_backend("kubernetes", {"memory_mib": {"A100": "80GB"}})
    with pytest.raises(DeviceUnavailable, match="cannot read"):
        get_backend("kubernetes", {"nodes_file": str(tmp_path / "missing.json")}).inventory()
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(DeviceUnavailable, match="kubectl get nodes -o json"):
        get_backend("kubernetes", {"nodes_file": str(tmp_path / "bad.json")}).inventory()


def test_backend_without_a_reachable_api_server_says_so(tmp_path):
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(KUBECONFIG_NO_SERVER)
    backend = get_backend("kubernetes", {"kubeconfig": str(kubeconfig), "request_timeout_s": 3})
    try:
        with pytest.raises(DeviceUnavailable, match="could not list the cluster's nodes within 3 s"):
            backend.inventory()
    finally:
        backend.close()


KUBECONFIG_NO_SERVER = """apiVersion: v1
kind: Config
clusters:
- name: none
  cluster: {server: "https://127.0.0.1:9"}
contexts:
- name: none
  context: {cluster: none, user: none}
current-context: none
users:
- name: none
  user: {token: unused}
"""


# --------------------------------------------------------------------------- the broker follows the cluster
def test_broker_ends_leases_on_a_lost_node_and_queues_requests_for_a_cordoned_one(tmp_path, monkeypatch):
    patch_auth(monkeypatch)
    path = tmp_path / "nodes.json"
    write_nodes(path, [node("gpu-a100-0"), node("gpu-t4-ts-0")])

    async def main():
        app = make_broker(tmp_path, ManualClock(), device_backend="kubernetes", devices={"nodes_file": str(path)})
        await app.start_async()
        try:
            alice, bob = BrokerClient(broker_url(app), "alice"), BrokerClient(broker_url(app), "bob")
            pool = await alice.pool()
            assert len(pool["devices"]) == 12
            t4 = await alice.request_lease({"gpus": 2, "model": "T4", "duration_s": 3600})
            a100 = await bob.request_lease({"gpus": 1, "model": "A100*", "duration_s": 3600})
            assert (t4["state"], t4["placement"]["node"]) == ("active", "gpu-t4-ts-0")
            assert a100["placement"]["node"] == "gpu-a100-0"

            # the T4 node is deleted from the cluster, the A100 node cordoned
            cordoned = node("gpu-a100-0")
            cordoned["spec"]["unschedulable"] = True
            write_nodes(path, [cordoned])
            os.utime(path, ns=(2, 2))
            await app.jobs.refresh_inventory()
            lost = await alice.get_lease(t4["id"])
            assert lost["state"] == "failed" and "left the pool" in lost["end_reason"]
            kept = await bob.get_lease(a100["id"])
            assert kept["state"] == "active"  # running work on a cordoned node goes on
            waiting = await alice.request_lease({"gpus": 1, "model": "A100*", "duration_s": 600})
            assert waiting["state"] == "queued"  # not refused: the node may come back

            write_nodes(path, [node("gpu-a100-0")])  # uncordoned
            os.utime(path, ns=(3, 3))
            await app.jobs.refresh_inventory()
            await app.manager.tick()
            assert (await alice.get_lease(waiting["id"]))["state"] == "active"

            # a failed read keeps the pool: an API hiccup must not end leases
            path.unlink()
            await app.jobs.refresh_inventory()
            assert (await bob.get_lease(a100["id"]))["state"] == "active"
        finally:
            await app.stop_async()

    asyncio.run(main())


def test_a_uuid_seen_on_two_nodes_is_kept_once_and_reported():
    twin = node("gpu-a10-hami-0")
    twin["metadata"]["name"] = "gpu-a10-hami-1"  # e.g. a node image cloned with HAMi's annotation
    problems: list[str] = []
    gpus = inventory_from_nodes([node("gpu-a10-hami-0"), twin], now=NOW, problems=problems)
    assert [g.node for g in gpus] == ["gpu-a10-hami-0", "gpu-a10-hami-0"]
    assert len(problems) == 2 and all("already in the pool" in p for p in problems)


# --------------------------------------------------------------------------- the watch, on the host's loop
class _APIServer:
    """A stand-in Kubernetes API server on 127.0.0.1: ``GET /api/v1/nodes`` lists the nodes;
    with ``watch=true`` it streams the events put in ``events`` (one JSON line each)."""

    def __init__(self, nodes: list[dict]):
        self.nodes = nodes
        self.events: asyncio.Queue = asyncio.Queue()
        self.lists = 0
        self.watches: list[str] = []

    def app(self):
        from tornado import web

        server = self

        class Nodes(web.RequestHandler):
            async def get(self):
                if self.get_argument("watch", "") in ("true", "True", "1"):
                    server.watches.append(self.get_argument("resourceVersion", ""))
                    self.set_header("Content-Type", "application/json")
                    while True:
                        event = await server.events.get()
                        self.write(json.dumps(event) + "\n")
                        await self.flush()
                server.lists += 1
                self.write({"kind": "NodeList", "apiVersion": "v1", "metadata": {"resourceVersion": "100"}, "items": server.nodes})

        return web.Application([(r"/api/v1/nodes", Nodes)])


def test_the_node_watch_runs_on_the_hosts_loop_and_inventory_answers_from_it_in_a_worker_thread(tmp_path):
    from tornado.httpserver import HTTPServer
    from tornado.netutil import bind_sockets

    async def main():
        api = _APIServer([node("gpu-a100-0")])
        sockets = bind_sockets(0, "127.0.0.1")
        http = HTTPServer(api.app())
        http.add_sockets(sockets)
        port = sockets[0].getsockname()[1]
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(KUBECONFIG_NO_SERVER.replace("https://127.0.0.1:9", f"http://127.0.0.1:{port}"))
        backend = get_backend("kubernetes", {"kubeconfig": str(kubeconfig), "request_timeout_s": 10, "refresh_s": 3600})
        loop = asyncio.get_running_loop()
        try:
            # before start(): inventory lists in the calling thread (the broker calls it in a worker)
            gpus = await loop.run_in_executor(None, backend.inventory)
            assert {g.node for g in gpus} == {"gpu-a100-0"} and all(g.healthy for g in gpus)
            assert api.lists == 1 and not backend.watching
            backend.start()
            for _ in range(100):
                if api.watches:
                    break
                await asyncio.sleep(0.05)
            assert api.watches == ["100"]  # watches from the version it listed, without listing again
            cordoned = node("gpu-a100-0")
            cordoned["spec"]["unschedulable"] = True
            cordoned["metadata"]["resourceVersion"] = "101"
            await api.events.put({"type": "MODIFIED", "object": cordoned})
            added = node("gpu-t4-ts-0")
            added["metadata"]["resourceVersion"] = "102"
            await api.events.put({"type": "ADDED", "object": added})
            for _ in range(100):
                gpus = await loop.run_in_executor(None, backend.inventory)
                if {g.node for g in gpus} == {"gpu-a100-0", "gpu-t4-ts-0"}:
                    break
                await asyncio.sleep(0.05)
            assert {g.node for g in gpus} == {"gpu-a100-0", "gpu-t4-ts-0"}
            assert not any(g.healthy for g in gpus if g.node == "gpu-a100-0")  # cordoned: kept, unhealthy
            assert backend.watching and api.lists == 1  # every answer came from the watch's cache
        finally:
            backend.close()
            await asyncio.sleep(0)
            http.stop()
        assert not backend.watching

    asyncio.run(main())
