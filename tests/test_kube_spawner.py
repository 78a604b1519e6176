"""GPULeaseKubeSpawner: the pod KubeSpawner would create for every kind of lease.

No Kubernetes API server can run here, so the test builds what can be real: the leases come
from a real broker whose pool the ``kubernetes`` backend read from recorded GPU node documents
(constructed from NVIDIA/HAMi/DRA documentation, see fixtures/kubernetes/make_fixtures.py);
the pod comes from a real GPULeaseKubeSpawner built without a cluster (its client points at a
port where nothing listens and is never called) through KubeSpawner's own ``make_pod``. Each pod
is validated against the Kubernetes 1.34 OpenAPI schema (strict: unknown fields fail) and
checked the way the scheduler would: it must fit the leased node — affinity, selectors,
taints, allocatable extended resources, DRA devices — and no other node of the cluster.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import kubernetes_validate
import pytest
from kubernetes_asyncio.client import ApiClient
from traitlets import TraitError
from traitlets.config import Config

from brokerutil import ManualClock, broker_url, make_broker, patch_auth
from jupyter_gpulease.client import BrokerClient
from jupyter_gpulease.devices.kubenodes import items_of
from jupyter_gpulease.hub.kube import GPULeaseKubeSpawner, KubeGPUOptions, PlacementError, pod_gpu_spec

FIXTURES = Path(__file__).parent / "fixtures" / "kubernetes"
NODES = {n["metadata"]["name"]: n for n in items_of(json.loads((FIXTURES / "gpu-nodes.json").read_text()), "Node")}
SLICES = items_of(json.loads((FIXTURES / "resource-slices.json").read_text()), "ResourceSlice")
K8S = "1.34"
HAMI_SCHEDULER_RESOURCES = {"nvidia.com/gpumem", "nvidia.com/gpucores", "nvidia.com/gpumem-percentage"}
KUBECONFIG = """apiVersion: v1
kind: Config
clusters:
- name: none
  cluster: {server: "https://127.0.0.1:9"}
contexts:
- name: none
  context: {cluster: none, user: none, namespace: jupyterhub}
current-context: none
users:
- name: none
  user: {token: unused}
"""

# what each user asks the broker for, and the node the lease must land on
REQUESTS = {
    "whole": ({"gpus": 2, "model": "A100-SXM4-80GB"}, "gpu-a100-0"),
    "mig-mixed": ({"mig_profile": "2g.20gb"}, "gpu-a100-mig-0"),
    "mig-single": ({"mig_profile": "1g.10gb", "model": "H100*"}, "gpu-h100-mig-single-0"),
    "share-timeslice": ({"share": 0.25, "model": "T4"}, "gpu-t4-ts-0"),
    "share-mps": ({"share": 0.25, "model": "L4"}, "gpu-l4-mps-0"),
    "share-hami": ({"share": 0.5, "model": "A10"}, "gpu-a10-hami-0"),
    "whole-hami": ({"gpus": 1, "model": "A10"}, "gpu-a10-hami-0"),
    "whole-dra": ({"gpus": 1, "model": "H100*"}, "gpu-dra-0"),
    "mig-dra": ({"mig_profile": "3g.40gb", "model": "H100*"}, "gpu-dra-0"),
    "whole-v100": ({"gpus": 3, "model": "V100*"}, "gpu-v100-0"),
}


@pytest.fixture(scope="module")
def leases(tmp_path_factory):
    """Lease JSON from a real broker over the recorded cluster (DRA slices read), one per kind."""
    tmp = tmp_path_factory.mktemp("kubebroker")
    mp = pytest.MonkeyPatch()
    patch_auth(mp)

    async def main():
        app = make_broker(tmp, ManualClock(), device_backend="kubernetes",
                          devices={"nodes_file": str(FIXTURES / "gpu-nodes.json"), "resource_slices_file": str(FIXTURES / "resource-slices.json"),
                                   "dra": True})
        await app.start_async()
        try:
            out = {}
            for kind, (body, _node) in REQUESTS.items():
                out[kind] = await BrokerClient(broker_url(app), f"user-{kind}").request_lease({**body, "duration_s": 3600})
            return out
        finally:
            await app.stop_async()

    try:
        got = asyncio.run(main())
    finally:
        mp.undo()
    for kind, (_body, node) in REQUESTS.items():
        assert got[kind]["state"] == "active", (kind, got[kind])
        assert got[kind]["placement"]["node"] == node, (kind, got[kind]["placement"])
    return got


@pytest.fixture(autouse=True)
def no_cluster(tmp_path, monkeypatch):
    """KubeSpawner reads a kubeconfig when built; this one names a port where nothing listens."""
    import kubernetes_asyncio.config.kube_config
    import kubespawner.clients

    path = tmp_path / "kubeconfig"
    path.write_text(KUBECONFIG)
    # the client reads $KUBECONFIG when imported, so point its default location at the file
    monkeypatch.setattr(kubernetes_asyncio.config.kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(path))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    kubespawner.clients.load_config.cache_clear()
    yield
    kubespawner.clients.load_config.cache_clear()


def make_spawner(**traits) -> GPULeaseKubeSpawner:
    c = Config()
    c.GPULeaseSpawner.broker_url = "http://hub:8081/services/gpulease/"
    c.GPULeaseSpawner.server_broker_url = "http://proxy-public/services/gpulease/"
    for k, v in traits.items():
        setattr(c.GPULeaseKubeSpawner, k, v)
    return GPULeaseKubeSpawner(_mock=True, config=c)


def build_pod(lease: dict | None, **traits) -> tuple[dict, GPULeaseKubeSpawner]:
    """The pod manifest (as the API would get it) for a server holding ``lease`` (None: CPU only)."""

    async def go():
        sp = make_spawner(**traits)
        try:
            if lease is not None:
                sp.apply_placement(lease)
            pod = await sp.get_pod_manifest()
            async with ApiClient() as api:
                return api.sanitize_for_serialization(pod), sp
        finally:
            await sp.api.api_client.close()

    pod, sp = asyncio.run(go())
    kubernetes_validate.validate(pod, K8S, strict=True)
    return pod, sp


def env_of(pod: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in pod["spec"]["containers"][0].get("env", [])}


def gpu_resources(pod: dict) -> dict[str, str]:
    res = pod["spec"]["containers"][0].get("resources") or {}
    limits = {k: v for k, v in (res.get("limits") or {}).items() if k.startswith("nvidia.com/")}
    requests = {k: v for k, v in (res.get("requests") or {}).items() if k.startswith("nvidia.com/")}
    assert limits == requests, "extended resources need requests equal to limits"
    return limits


# --------------------------------------------------------------------------- a scheduler's eye
def _expr_ok(expr: dict, value: str | None) -> bool:
    op, values = expr["operator"], expr.get("values") or []
    return {"In": value in values, "NotIn": value not in values, "Exists": value is not None,
            "DoesNotExist": value is None}[op]


def _tolerates(tolerations: list[dict], taint: dict) -> bool:
    for t in tolerations:
        if t.get("effect") and t["effect"] != taint["effect"]:
            continue
        if t.get("operator") == "Exists" and (not t.get("key") or t["key"] == taint["key"]):
            return True
        if t.get("key") == taint["key"] and t.get("value") == taint.get("value"):
            return True
    return False


def fits(pod: dict, node: dict, claims: list[dict] = ()) -> bool:
    """Would the scheduler place ``pod`` on ``node``? (the filters that matter for GPUs)"""
    spec, meta = pod["spec"], node["metadata"]
    labels, name = meta.get("labels") or {}, meta["name"]
    if spec.get("nodeName") and spec["nodeName"] != name:
        return False
    if any(labels.get(k) != v for k, v in (spec.get("nodeSelector") or {}).items()):
        return False
    required = (((spec.get("affinity") or {}).get("nodeAffinity") or {}).get("requiredDuringSchedulingIgnoredDuringExecution") or {})
    terms = required.get("nodeSelectorTerms") or []
    if terms and not any(
        all(_expr_ok(e, labels.get(e["key"])) for e in t.get("matchExpressions") or [])
        and all(_expr_ok(f, name if f["key"] == "metadata.name" else None) for f in t.get("matchFields") or [])
        for t in terms
    ):
        return False
    taints = [t for t in (node["spec"].get("taints") or []) if t["effect"] in ("NoSchedule", "NoExecute")]
    if not all(_tolerates(spec.get("tolerations") or [], t) for t in taints):
        return False
    allocatable = node["status"].get("allocatable") or {}
    for res, qty in gpu_resources(pod).items():
        if res in HAMI_SCHEDULER_RESOURCES:
            continue  # HAMi's scheduler counts these from its register annotation
        if int(allocatable.get(res, "0")) < int(qty):
            return False
    for claim in claims:  # every requested device must be published on this node
        for req in claim["spec"]["devices"]["requests"]:
            uuid = re.search(r'uuid == "([^"]+)"', req["exactly"]["selectors"][0]["cel"]["expression"]).group(1)
            on_node = [d for s in SLICES if s["spec"]["nodeName"] == name for d in s["spec"]["devices"]
                       if d["attributes"]["uuid"]["string"] == uuid]
            if not on_node:
                return False
    return True


def assert_lands_only_on(pod: dict, node: str, claims: list[dict] = ()) -> None:
    assert fits(pod, NODES[node], claims), f"the pod does not fit its leased node {node}"
    others = [n for n in NODES if n != node and fits(pod, NODES[n], claims)]
    assert others == [], f"the pod could also land on {others}"


# --------------------------------------------------------------------------- every kind of lease
def test_whole_gpus_ask_for_nvidia_gpu_on_the_leased_node_and_model(leases):
    lease = leases["whole"]
    pod, _ = build_pod(lease)
    assert gpu_resources(pod) == {"nvidia.com/gpu": "2"}
    (term,) = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert term["matchFields"] == [{"key": "metadata.name", "operator": "In", "values": ["gpu-a100-0"]}]
    (product,) = term["matchExpressions"]
    assert product["key"] == "nvidia.com/gpu.product" and "NVIDIA-A100-SXM4-80GB" in product["values"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["spec"]["tolerations"]
    env = env_of(pod)
    assert env["GPULEASE_LEASE_ID"] == lease["id"] and env["GPULEASE_DEVICE_CHOICE"] == "engine"
    assert env["GPULEASE_ENGINE"] == "kubernetes"
    assert env["GPULEASE_BROKER_URL"] == "http://proxy-public/services/gpulease/"
    assert "CUDA_VISIBLE_DEVICES" not in env  # the device plugin picks; the broker's names would hide the GPUs
    assert pod["metadata"]["annotations"]["gpulease.jupyter.org/lease-id"] == lease["id"]
    assert_lands_only_on(pod, "gpu-a100-0")


def test_whole_gpus_skip_the_gpu_the_device_plugin_reports_unhealthy(leases):
    lease = leases["whole-v100"]
    assert sorted(s["index"] for s in lease["placement"]["slices"]) == [0, 1, 2]
    pod, _ = build_pod(lease)
    assert gpu_resources(pod) == {"nvidia.com/gpu": "3"}
    assert_lands_only_on(pod, "gpu-v100-0")


def test_a_mig_lease_asks_for_its_profile_with_the_mixed_strategy(leases):
    pod, _ = build_pod(leases["mig-mixed"])
    assert gpu_resources(pod) == {"nvidia.com/mig-2g.20gb": "1"}
    assert_lands_only_on(pod, "gpu-a100-mig-0")


def test_a_mig_lease_asks_for_nvidia_gpu_on_the_profile_product_with_the_single_strategy(leases):
    pod, _ = build_pod(leases["mig-single"], mig_strategy="single")
    assert gpu_resources(pod) == {"nvidia.com/gpu": "1"}
    exprs = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]["matchExpressions"]
    assert "NVIDIA-H100-80GB-HBM3-MIG-1g.10gb" in exprs[0]["values"]
    assert_lands_only_on(pod, "gpu-h100-mig-single-0")


def test_a_share_is_one_time_slicing_replica_on_a_shared_product(leases):
    lease = leases["share-timeslice"]
    pod, _ = build_pod(lease)
    assert gpu_resources(pod) == {"nvidia.com/gpu": "1"}
    env = env_of(pod)
    assert env["GPULEASE_SHARE"] == "0.25" and env["GPULEASE_MEMORY_MIB"] == str(lease["placement"]["slices"][0]["memory_mib"])
    assert_lands_only_on(pod, "gpu-t4-ts-0")


def test_a_share_uses_the_renamed_shared_resource_where_mps_renames_it(leases):
    pod, _ = build_pod(leases["share-mps"], shared_gpu_resource="nvidia.com/gpu.shared")
    assert gpu_resources(pod) == {"nvidia.com/gpu.shared": "1"}
    assert_lands_only_on(pod, "gpu-l4-mps-0")
    # without the rename the pod asks for nvidia.com/gpu, which that node does not offer
    plain, _ = build_pod(leases["share-mps"])
    assert not fits(plain, NODES["gpu-l4-mps-0"])


def test_a_hami_share_asks_for_memory_and_cores_on_the_leased_gpu(leases):
    lease = leases["share-hami"]
    pod, _ = build_pod(lease, gpu_share_mode="hami", gpu_scheduler_name="hami-scheduler")
    (s,) = lease["placement"]["slices"]
    assert gpu_resources(pod) == {"nvidia.com/gpu": "1", "nvidia.com/gpumem": str(s["memory_mib"]), "nvidia.com/gpucores": "50"}
    assert pod["metadata"]["annotations"]["nvidia.com/use-gpuuuid"] == s["gpu_uuid"]
    assert s["gpu_uuid"].startswith("GPU-3f1c2a10-")  # HAMi's UUID, from its register annotation
    assert pod["spec"]["schedulerName"] == "hami-scheduler"
    env = env_of(pod)
    assert env["CUDA_VISIBLE_DEVICES"] == s["gpu_uuid"] and env["GPULEASE_DEVICE_CHOICE"] == "broker"
    assert_lands_only_on(pod, "gpu-a10-hami-0")


def test_a_whole_gpu_under_hami_asks_for_all_of_it(leases):
    pod, _ = build_pod(leases["whole-hami"], gpu_share_mode="hami")
    assert gpu_resources(pod) == {"nvidia.com/gpu": "1", "nvidia.com/gpucores": "100", "nvidia.com/gpumem-percentage": "100"}
    assert_lands_only_on(pod, "gpu-a10-hami-0")


def test_with_dra_a_resource_claim_pins_the_exact_leased_gpu(leases):
    lease = leases["whole-dra"]
    pod, sp = build_pod(lease, use_dra=True, namespace="jupyterhub")
    claim = sp._gpu_spec.claim
    kubernetes_validate.validate(claim, K8S, strict=True)
    (s,) = lease["placement"]["slices"]
    (req,) = claim["spec"]["devices"]["requests"]
    assert req["exactly"]["deviceClassName"] == "gpu.nvidia.com" and req["exactly"]["count"] == 1
    assert req["exactly"]["selectors"] == [{"cel": {"expression": f'device.attributes["gpu.nvidia.com"].uuid == "{s["gpu_uuid"]}"'}}]
    assert claim["metadata"]["name"] == sp.claim_name and claim["metadata"]["namespace"] == "jupyterhub"
    assert pod["spec"]["resourceClaims"] == [{"name": "gpulease-gpus", "resourceClaimName": sp.claim_name}]
    assert pod["spec"]["containers"][0]["resources"]["claims"] == [{"name": "gpulease-gpus"}]
    assert gpu_resources(pod) == {}
    env = env_of(pod)
    assert env["CUDA_VISIBLE_DEVICES"] == s["gpu_uuid"] and env["GPULEASE_DEVICE_CHOICE"] == "broker"
    assert_lands_only_on(pod, "gpu-dra-0", [claim])


def test_with_dra_a_mig_lease_claims_its_mig_device(leases):
    lease = leases["mig-dra"]
    pod, sp = build_pod(lease, use_dra=True)
    claim = sp._gpu_spec.claim
    kubernetes_validate.validate(claim, K8S, strict=True)
    (s,) = lease["placement"]["slices"]
    (req,) = claim["spec"]["devices"]["requests"]
    assert req["exactly"]["deviceClassName"] == "mig.nvidia.com"
    assert s["mig_uuid"] in req["exactly"]["selectors"][0]["cel"]["expression"]
    assert env_of(pod)["CUDA_VISIBLE_DEVICES"] == s["mig_uuid"]
    assert_lands_only_on(pod, "gpu-dra-0", [claim])


def test_with_dra_on_a_lease_of_device_plugin_gpus_falls_back_to_counting(leases):
    pod, sp = build_pod(leases["whole"], use_dra=True)  # no real UUIDs: a claim could match nothing
    assert sp._gpu_spec.claim is None and gpu_resources(pod) == {"nvidia.com/gpu": "2"}


def test_a_cpu_only_pod_asks_for_no_gpu_and_hides_the_node_gpus():
    pod, _ = build_pod(None)
    assert gpu_resources(pod) == {}
    env = env_of(pod)
    assert env["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert not (pod["spec"].get("affinity") or {}).get("nodeAffinity")
    assert not any(t.get("key") == "nvidia.com/gpu" for t in pod["spec"].get("tolerations") or [])
    assert not fits(pod, NODES["gpu-a100-0"]) and fits(pod, NODES["cpu-0"])


# --------------------------------------------------------------------------- admin settings
def test_the_leased_node_is_anded_into_every_affinity_term_the_admin_set(leases):
    admin_terms = [
        {"matchExpressions": [{"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["zone-a"]}]},
        {"matchExpressions": [{"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["zone-b"]}]},
    ]
    pod, _ = build_pod(leases["whole"], node_affinity_required=admin_terms)
    terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert len(terms) == 2
    for t in terms:
        assert t["matchFields"] == [{"key": "metadata.name", "operator": "In", "values": ["gpu-a100-0"]}]
        assert [e["key"] for e in t["matchExpressions"]] == ["topology.kubernetes.io/zone", "nvidia.com/gpu.product"]
    assert_lands_only_on(pod, "gpu-a100-0")


@pytest.mark.parametrize("pinning", ["hostname", "node_name"])
def test_other_node_pinning_modes(leases, pinning):
    pod, _ = build_pod(leases["whole"], node_pinning=pinning)
    if pinning == "hostname":
        assert pod["spec"]["nodeSelector"]["kubernetes.io/hostname"] == "gpu-a100-0"
    else:
        assert pod["spec"]["nodeName"] == "gpu-a100-0"
    assert_lands_only_on(pod, "gpu-a100-0")


def test_admin_tolerations_replace_the_default_gpu_toleration(leases):
    aks = [{"key": "sku", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"}]
    pod, _ = build_pod(leases["whole"], gpu_tolerations=aks)
    assert {"key": "sku", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"} in pod["spec"]["tolerations"]
    assert not fits(pod, NODES["gpu-a100-0"])  # that node's nvidia.com/gpu taint is not tolerated now


def test_shares_on_a_hub_without_gpu_sharing_fail_with_a_message(leases):
    with pytest.raises(PlacementError, match="does not offer shares of a GPU on Kubernetes"):
        pod_gpu_spec(leases["share-timeslice"], KubeGPUOptions(share_mode="none"))

    async def go():
        sp = make_spawner(gpu_share_mode="none")
        try:
            with pytest.raises(Exception) as info:
                sp.lease_choice({"share": 0.25})
            return info.value
        finally:
            await sp.api.api_client.close()

    err = asyncio.run(go())
    assert getattr(err, "status_code", None) == 400 and "does not offer shares" in str(getattr(err, "jupyterhub_message", "") or err)


def test_bad_settings_are_refused_by_name():
    for trait, value in (("gpu_share_mode", "mps"), ("mig_strategy", "none"), ("node_pinning", "label"), ("on_lease_end", "keep")):
        with pytest.raises(TraitError, match=trait):
            setattr(GPULeaseKubeSpawner.__new__(GPULeaseKubeSpawner), trait, value)


def test_spawner_state_keeps_the_lease_and_the_pod_across_a_hub_restart(leases):
    async def go():
        sp = make_spawner()
        sp2 = make_spawner()
        try:
            sp.lease_id = leases["whole"]["id"]
            state = json.loads(json.dumps(sp.get_state()))
            sp2.load_state(state)
            return state, sp2.lease_id, sp2.pod_name
        finally:
            await sp.api.api_client.close()
            await sp2.api.api_client.close()

    state, lease_id, pod_name = asyncio.run(go())
    assert state["gpulease"]["lease_id"] == lease_id == leases["whole"]["id"]
    assert state["pod_name"] == pod_name


def test_the_claim_is_made_between_the_grant_and_kubespawners_start_through_public_hooks(leases, monkeypatch):
    made = []

    async def create_claim(self, claim):
        made.append(claim["metadata"]["name"])

    monkeypatch.setattr(GPULeaseKubeSpawner, "_create_claim", create_claim)

    async def go():
        sp = make_spawner(use_dra=True)
        try:
            sp.apply_placement(leases["whole-dra"])
            await sp.before_engine_start()  # the lease spawner calls it right before KubeSpawner's start()
            return sp.claim_name
        finally:
            await sp.api.api_client.close()

    assert made == [asyncio.run(go())]
    # KubeSpawner's own start and its progress handshake are left to it
    assert "_start" not in vars(GPULeaseKubeSpawner) and "_start_future" not in vars(GPULeaseKubeSpawner)
