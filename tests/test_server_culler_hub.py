"""The idle culler's GPU hook end to end: jupyterhub-idle-culler 2 run by a real JupyterHub as
the idle-culler guide's hub config says (its service entry, role and config file are the guide's own code blocks,
with short timeouts), the broker as the hub's managed service on a simulated pool, the lease
spawner, and real single-user servers with the extension.

alice's kernel computes on her GPU while the hub sees no activity from her server: the culler
keeps it past its --timeout and says why, once. bob's server holds a lease whose GPU is idle: it
is culled before the culler's timeout, the culler's log says why, and the lease's end says that it
was culled. The hook found the broker through the Hub API alone; a token without the scopes it
needs gets one line that says which.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import re
import time
from pathlib import Path

import pytest

from hubharness import wait_for
from jupyter_gpulease.culler import GPUCullArbiter
from leasehub import LeaseHub
from serverutil import SimGPUs

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "how-to" / "idle-culler.md"
POOL = [{"node": "n1", "model": "L4", "count": 2, "memory_mib": 23034}]
TIMEOUT = 30  # the culler's --timeout
GPU_IDLE_LIMIT = 18  # the hook's: a server whose GPU lease is idle goes after this long without activity
CULL_EVERY = 2


def readme_block(first_line: str) -> str:
    """The idle-culler guide's code block whose first line is ``first_line``."""
    blocks = [m.group(1) for m in re.finditer(r"^```python\n(.*?)^```", GUIDE.read_text(), re.S | re.M)]
    found = [b for b in blocks if b.splitlines()[0].strip() == first_line]
    assert len(found) == 1, f"{GUIDE.name} has {len(found)} code blocks that start with {first_line!r}"
    return found[0]


def culler_service(config_file: Path) -> tuple[dict, dict]:
    """The guide's service entry and role of the culler, with this test's timeouts and config file."""
    from traitlets.config import Config

    c = Config()
    c.JupyterHub.services = []
    c.JupyterHub.load_roles = []
    exec(readme_block("# jupyterhub_config.py: the idle culler (after the services and roles above)"), {"c": c})
    (service,) = c.JupyterHub.services
    (role,) = c.JupyterHub.load_roles
    args = [a for a in service["command"] if not a.startswith(("--timeout=", "--config="))]
    assert len(args) == len(service["command"]) - 2, service["command"]
    service["command"] = [*args, f"--timeout={TIMEOUT}", f"--cull-every={CULL_EVERY}", f"--config={config_file}"]
    return service, role


def make_hub(tmp: Path) -> tuple[LeaseHub, SimGPUs]:
    """(hub, the simulated GPUs): the guide's culler as a service of the hub, with its hook's
    config file; servers that sample every 0.25 s, send a heartbeat every second and never
    reclaim an idle GPU themselves."""
    sim = SimGPUs(str(tmp / "sim-gpus.json"), POOL)
    culler_conf = tmp / "idle_culler_config.py"
    hook = readme_block("# idle_culler_config.py")
    assert "gpu_idle_limit=1800" in hook
    culler_conf.write_text(hook.replace("gpu_idle_limit=1800", f"gpu_idle_limit={GPU_IDLE_LIMIT}"))
    culler, culler_role = culler_service(culler_conf)
    hub = LeaseHub(
        tmp,
        admin_users=["root"],
        services=[culler],
        roles=[culler_role],
        pool=POOL,
        server_devices=sim.config,
        server_config=[
            "c.GPULeaseExtension.sample_interval = 0.25",
            "c.GPULeaseExtension.heartbeat_interval = 1",
            "c.GPUIdleRule.gpu_idle_timeout = 3600",  # the server's own idle reclaim stays out of this
            "c.GPUIdleRule.gpu_idle_timeout_learn = False",
        ],
        hub_config=["c.Spawner.default_url = '/tree'"],
    )
    return hub.start(), sim


def lease_of(hub: LeaseHub, user: str) -> dict | None:
    """``user``'s newest lease, live or ended."""
    return next(iter(hub.leases(user, "all")), None)


def culler_lines(hub, needle):
    return [line for line in hub.log_file.read_text(errors="replace").splitlines() if needle in line]


def test_the_culler_keeps_a_server_whose_gpu_works_and_culls_an_idle_lease_early_saying_why(tmp_path):
    hub, sim = make_hub(tmp_path)
    try:
        alice = hub.create_token("alice")
        # alice: a server with a lease, a kernel that computes on her GPU
        assert hub.spawn("alice", {"gpus": 1})[0] in (201, 202)
        hub.wait_ready("alice", 120)
        kernel = hub.start_kernel("alice", alice)

        def kernel_on_gpu():
            _, st = hub.gpu_api("alice", alice, "status")
            k = next((k for k in st["kernels"] if k["id"] == kernel), None)
            return k and k["pid"] and (k["pid"], st["devices"][0]["uuid"])

        pid, uuid = wait_for(kernel_on_gpu, 60, "alice's server does not see her kernel")
        sim.run(pid, 4000, sm=90.0, uuid=uuid)
        wait_for(lambda: (lease_of(hub, "alice").get("usage") or {}).get("gpu_busy"), 30,
                 "alice's heartbeats do not say that her GPU works")

        # bob: a server with a lease and no GPU work
        assert hub.spawn("bob", {"gpus": 1})[0] in (201, 202)
        hub.wait_ready("bob", 120)
        bob_lease = lease_of(hub, "bob")
        assert bob_lease["state"] == "active"

        # bob's server goes before the culler's own timeout: its GPU lease is idle
        wait_for(lambda: not hub.ready_server("bob"), GPU_IDLE_LIMIT + 60, f"bob's server was not culled\n{hub.log_tail(40)}")
        (early,) = culler_lines(hub, "GPU cull arbiter: culling bob/ early")
        assert f"the culler's limit: {TIMEOUT} s" in early and "its GPU idle (no GPU work since the lease began)" in early
        assert f"released its lease {bob_lease['id']}" in early
        assert culler_lines(hub, "Culling server bob")
        ended = hub.lease(bob_lease["id"])
        assert ended["state"] == "released", ended
        assert ended["end_message"].startswith("Released by the service idle-culler: culled by the idle culler: no activity for "), ended
        assert ended["end_message"].endswith("and its GPU idle (no GPU work since the lease began)."), ended
        # the spawner's own release at stop found it ended, quietly
        assert not culler_lines(hub, f"refused to release lease {bob_lease['id']}")

        # alice's server stays past the culler's timeout, through several passes, and the log says why once
        wait_for(lambda: culler_lines(hub, "GPU cull arbiter: keeping alice/"), TIMEOUT + 60, "the culler does not say why it keeps alice's server")
        time.sleep(3 * CULL_EVERY + 1)
        (kept,) = culler_lines(hub, "GPU cull arbiter: keeping alice/")
        assert "its GPU is working now" in kept and f"the culler's limit: {TIMEOUT} s" in kept
        s = hub.ready_server("alice")
        assert s, "alice's server was culled while her GPU worked"
        last = datetime.datetime.fromisoformat((s["last_activity"] or s["started"]).replace("Z", "+00:00"))
        assert (datetime.datetime.now(datetime.UTC) - last).total_seconds() > TIMEOUT  # the hub saw nothing of her for longer
        assert lease_of(hub, "alice")["state"] == "active"
        assert not culler_lines(hub, "Culling server alice")

        # the hook found the broker through the Hub API, with no setting of its own, and said so once
        (found,) = culler_lines(hub, "GPU cull arbiter: deciding with the GPU leases of the broker at ")
        assert found.endswith(f"at {hub.broker.url}")
        assert not culler_lines(hub, "culler decides by activity alone")

        # a token without the scopes the hook needs: one line that says which, then the culler's rule
        messages = []

        class Lines(logging.Handler):
            def emit(self, record):
                messages.append(record.getMessage())

        logger = logging.getLogger("test-culler-scopes")
        logger.addHandler(Lines())
        logger.propagate = False

        async def two_passes(token):
            arbiter = GPUCullArbiter(gpu_idle_limit=1, token=token, hub_api_url=hub.hub_api_url, cache_s=0, logger=logger)
            return [await arbiter(inactive=datetime.timedelta(seconds=5), inactive_limit=10, server={"full_name": "bob/"})
                    for _ in range(2)]

        no_services = hub.create_token("root", scopes=["access:services"])
        assert asyncio.run(two_passes(no_services)) == [False, False]
        (line,) = messages
        assert "add the scope read:services!service=gpulease to the culler's role" in line, line
        messages.clear()
        no_admin = hub.create_token("root", scopes=["access:services", "read:services"])
        assert asyncio.run(two_passes(no_admin)) == [False, False]
        (line,) = messages
        assert "lacks custom:gpulease:admin: add them to the culler's role" in line, line
    finally:
        hub.close()
