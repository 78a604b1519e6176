"""deploy/: the Zero to JupyterHub values fragment, the RBAC manifest, the e2e script.

No cluster runs here, so the fragment is assembled into hub config the way the chart's
jupyterhub_config.py does it (hub.config sections, hub.services, hub.loadRoles, hub.extraConfig
with the chart's secret lookup) and the real spawner and broker are built from the result: a
misspelled option, a port that does not line up or a preset the spawner rejects fails here.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import types
from pathlib import Path
from urllib.parse import urlsplit

import kubernetes_validate
import yaml
from traitlets.config import Config, PyFileConfigLoader

from jupyter_gpulease.broker.app import GPULeaseBroker
from jupyter_gpulease.core.policy_config import policy_from_config
from jupyter_gpulease.devices import get_backend

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
VALUES = yaml.safe_load((DEPLOY / "z2jh-values.yaml").read_text())
SECRETS = {"hub.services.gpulease.apiToken": "broker-token", "hub.services.gpulease-spawner.apiToken": "spawner-token"}
# the chart's values this fragment may use (its values.schema.yaml, chart 4.x)
CHART_KEYS = {
    "hub": {"image", "services", "service", "networkPolicy", "loadRoles", "config", "extraConfig", "extraFiles"},
    "singleuser": {"image", "networkPolicy"},
}


def chart_config(values: dict) -> Config:
    """hub config from chart values, as the chart's jupyterhub_config.py builds it."""
    c = Config()
    for section, cfg in (values["hub"].get("config") or {}).items():
        assert section[:1].isupper(), f"hub.config.{section} is not a Configurable class name"
        c[section].update(cfg)
    services = []
    for key, declared in (values["hub"].get("services") or {}).items():
        service = dict(declared)
        service.setdefault("name", key)
        service.pop("apiToken", None)
        service["api_token"] = SECRETS.get(f"hub.services.{key}.apiToken", "generated")
        services.append(service)
    c.JupyterHub.services = services
    c.JupyterHub.load_roles = [dict(role, name=key) for key, role in (values["hub"].get("loadRoles") or {}).items()]
    z2jh = types.ModuleType("z2jh")
    z2jh.get_secret_value = lambda key, default="never-explicitly-set": SECRETS.get(key, default)
    sys.modules["z2jh"] = z2jh
    try:
        for _key, config_py in sorted((values["hub"].get("extraConfig") or {}).items()):
            # the chart runs each snippet with exec() in its config namespace; so does this test
            exec(compile(config_py, "extraConfig", "exec"), {"c": c, "get_secret_value": z2jh.get_secret_value})
    finally:
        del sys.modules["z2jh"]
    return c


def test_the_fragment_uses_only_chart_keys_and_files_the_chart_mounts():
    assert set(VALUES) <= set(CHART_KEYS)
    for part, keys in CHART_KEYS.items():
        assert set(VALUES[part]) <= keys, f"{part}: {set(VALUES[part]) - keys}"
    for name, f in VALUES["hub"]["extraFiles"].items():
        assert set(f) == {"mountPath", "stringData"}, name


def test_the_hub_config_builds_a_kube_spawner_with_the_documented_gpu_settings(tmp_path, monkeypatch):
    import kubernetes_asyncio.config.kube_config
    import kubespawner.clients
    from jupyterhub.app import JupyterHub

    from jupyter_gpulease.hub.kube import GPULeaseKubeSpawner

    c = chart_config(VALUES)
    hub = JupyterHub(config=c)
    assert hub.spawner_class is GPULeaseKubeSpawner  # "gpulease-kube", the entry point
    # every option set for the spawner is one of its traits (a typo would be ignored by traitlets)
    for section in ("GPULeaseSpawner", "GPULeaseKubeSpawner", "KubeSpawner"):
        unknown = set(c[section]) - set(GPULeaseKubeSpawner.class_trait_names(config=True))
        assert not unknown, f"{section}: {unknown}"

    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text("apiVersion: v1\nkind: Config\nclusters: [{name: x, cluster: {server: 'https://127.0.0.1:9'}}]\n"
                          "contexts: [{name: x, context: {cluster: x, user: x}}]\ncurrent-context: x\nusers: [{name: x, user: {token: t}}]\n")
    monkeypatch.setattr(kubernetes_asyncio.config.kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    kubespawner.clients.load_config.cache_clear()

    async def build():
        sp = GPULeaseKubeSpawner(_mock=True, config=c)
        try:
            return {k: getattr(sp, k) for k in ("broker_url", "server_broker_url", "broker_api_token", "gpu_share_mode",
                                                "mig_strategy", "node_pinning", "use_dra", "server_token_scopes")}, sp.presets
        finally:
            await sp.api.api_client.close()

    traits, presets = asyncio.run(build())
    kubespawner.clients.load_config.cache_clear()
    assert traits["broker_api_token"] == "spawner-token"  # from the chart's secret, through extraConfig
    assert traits["gpu_share_mode"] == "replicas" and traits["mig_strategy"] == "mixed" and traits["use_dra"] is False
    assert "access:services!service=gpulease" in traits["server_token_scopes"]
    assert {p.slug for p in presets} == {"cpu", "t4-quarter", "a100", "a100-mig"}
    # the scopes the spawner's token carries exist, and users may reach the broker
    assert "custom:gpulease:admin" in c.JupyterHub.custom_scopes
    roles = {r["name"]: r for r in c.JupyterHub.load_roles}
    assert roles["gpulease-spawner"]["services"] == ["gpulease-spawner"] and "custom:gpulease:admin" in roles["gpulease-spawner"]["scopes"]
    assert "access:services!service=gpulease" in roles["user"]["scopes"] and "self" in roles["user"]["scopes"]
    assert "admin:servers" in roles["gpulease-broker"]["scopes"]


def test_the_broker_service_ports_and_urls_line_up():
    hub = VALUES["hub"]
    service = hub["services"]["gpulease"]
    port = urlsplit(service["url"]).port
    bind = next(a.split("=", 1)[1] for a in service["command"] if a.startswith("--bind-url="))
    assert urlsplit(bind).port == port and urlsplit(bind).hostname == "0.0.0.0"
    assert [p["port"] for p in hub["service"]["extraPorts"]] == [port] == [p["targetPort"] for p in hub["service"]["extraPorts"]]
    assert hub["networkPolicy"]["allowedIngressPorts"] == [port]
    (rule,) = VALUES["singleuser"]["networkPolicy"]["egress"]
    assert [p["port"] for p in rule["ports"]] == [port]
    spawner = hub["config"]["GPULeaseSpawner"]
    assert urlsplit(spawner["broker_url"]).port == urlsplit(spawner["server_broker_url"]).port == port
    assert urlsplit(spawner["server_broker_url"]).hostname == urlsplit(service["url"]).hostname == "hub"
    assert spawner["broker_url"].endswith("/services/gpulease/")


def test_the_broker_command_and_its_config_file_load(tmp_path):
    service = VALUES["hub"]["services"]["gpulease"]
    assert service["command"][:4] == ["python3", "-m", "jupyter_gpulease.cli", "broker"]
    (conf,) = [f for f in VALUES["hub"]["extraFiles"].values() if f["mountPath"].endswith("gpulease_config.py")]
    path = tmp_path / "gpulease_config.py"
    path.write_text(conf["stringData"])
    args = [a if not a.startswith("--config=") else f"--config={path}" for a in service["command"][4:]]
    app = GPULeaseBroker()
    app.parse_command_line(args)
    app.update_config(PyFileConfigLoader(path.name, str(tmp_path)).load_config())
    assert app.bind_url == "http://0.0.0.0:10101"
    assert app.device_backend == "kubernetes" and app.stop_servers_on_end is True
    assert app.db_url.startswith("sqlite:////srv/jupyterhub/")
    policy = policy_from_config(app)  # the tiers as the broker reads them
    assert set(policy.tiers) == {"production", "experiment", "learning"}
    backend = get_backend(app.device_backend, app.devices)  # builds without touching the API
    assert backend.label_selector == "nvidia.com/gpu.present=true" and backend.lost_after_s == 300


def test_rbac_is_valid_and_grants_what_the_backend_and_spawner_call():
    docs = [d for d in yaml.safe_load_all((DEPLOY / "rbac.yaml").read_text()) if d]
    for d in docs:
        kubernetes_validate.validate(d, "1.34", strict=True)
    by_kind = {d["kind"]: d for d in docs}

    def allows(rules, group, resource, verb):
        return any(group in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"] for r in rules)

    cluster = by_kind["ClusterRole"]["rules"]
    for verb in ("list", "watch"):  # KubernetesBackend: list_node, then a watch
        assert allows(cluster, "", "nodes", verb)
    assert allows(cluster, "resource.k8s.io", "resourceslices", "list")
    ns = by_kind["Role"]["rules"]
    for verb in ("create", "patch", "delete"):  # GPULeaseKubeSpawner: create, own (patch), delete claims
        assert allows(ns, "resource.k8s.io", "resourceclaims", verb)
    assert by_kind["ClusterRoleBinding"]["roleRef"]["name"] == by_kind["ClusterRole"]["metadata"]["name"]
    assert by_kind["RoleBinding"]["roleRef"]["name"] == by_kind["Role"]["metadata"]["name"]


def test_the_e2e_script_and_image_recipes_are_well_formed():
    subprocess.run(["bash", "-n", str(DEPLOY / "e2e-check.sh")], check=True)
    hub = (DEPLOY / "Dockerfile").read_text()
    assert '"jupyter-gpulease[kube]"' in hub and "FROM ${HUB_IMAGE}" in hub
    pyproject = (DEPLOY.parent / "pyproject.toml").read_text()
    assert "\nkube = [" in pyproject  # the extra the image installs
