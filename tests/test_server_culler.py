"""The cull_arbiter_hook for jupyterhub-idle-culler 2, against a real broker holding real leases."""

from __future__ import annotations

import asyncio
import datetime
import time

from brokerutil import broker_in_thread, broker_url, patch_auth
from jupyter_gpulease.broker.manager import SystemClock
from jupyter_gpulease.client import BrokerClient
from jupyter_gpulease.culler import GPUCullArbiter
from serverutil import POOL, broker_call


def server(user, name=""):
    """A server model as the hub's API gives it to the culler."""
    return {"name": name, "full_name": f"{user}/{name}", "last_activity": None, "ready": True}


def minutes(m):
    return datetime.timedelta(minutes=m)


def test_gpu_work_keeps_a_server_and_an_idle_lease_lets_it_go_sooner(tmp_path, monkeypatch):
    patch_auth(monkeypatch)
    with broker_in_thread(tmp_path, pool=POOL, clock=SystemClock()) as app:
        url = broker_url(app)
        leases = {}
        for user in ("alice", "bob"):
            _, leases[user] = broker_call(url, "POST", "api/leases", {"gpus": 1}, token=user)
        # what the users' server extensions report in their heartbeats
        now = time.time()
        broker_call(url, "POST", f"api/leases/{leases['alice']['id']}/heartbeat",
                    {"usage": {"t": now, "gpu_busy": True, "last_gpu_activity": now}}, token="alice")
        broker_call(url, "POST", f"api/leases/{leases['bob']['id']}/heartbeat",
                    {"usage": {"t": now, "gpu_busy": False, "last_gpu_activity": now - 3 * 3600}}, token="bob")
        calls = []

        class CountingClient(BrokerClient):
            async def list_leases(self, *a, **kw):
                calls.append(1)
                return await super().list_leases(*a, **kw)

        arbiter = GPUCullArbiter(gpu_idle_limit=1800, client=CountingClient(url, "admin-culler"))
        limit = 3600  # the culler's --timeout

        async def decide():
            return await asyncio.gather(
                arbiter(inactive=minutes(300), inactive_limit=limit, server=server("alice")),  # silent for the hub, computing on the GPU
                arbiter(inactive=minutes(40), inactive_limit=limit, server=server("bob")),  # idle lease, 40 min inactive
                arbiter(inactive=minutes(20), inactive_limit=limit, server=server("bob")),
                arbiter(inactive=minutes(40), inactive_limit=limit, server=server("carol")),  # no lease: the culler's rule
                arbiter(inactive=minutes(61), inactive_limit=limit, server=server("carol")),
                arbiter(inactive=minutes(61), inactive_limit=limit, server=server("alice", "other")),  # another server of hers
            )

        assert asyncio.run(decide()) == [False, True, False, False, True, True]
        assert len(calls) == 1  # one listing for the whole pass
        # bob's lease ended before the culler stops his server, saying why
        _, ended = broker_call(url, "GET", f"api/leases/{leases['bob']['id']}", token="bob")
        assert ended["state"] == "released" and ended["keep_server"] is True
        assert "culled by the idle culler: no activity for 40 min and its GPU idle (last GPU work 3 h ago)" in ended["end_message"]
        _, alive = broker_call(url, "GET", f"api/leases/{leases['alice']['id']}", token="alice")
        assert alive["state"] == "active"


def test_decisions_are_logged_once_and_a_culled_servers_lease_says_so(tmp_path, monkeypatch):
    import logging

    patch_auth(monkeypatch)
    with broker_in_thread(tmp_path, pool=POOL, clock=SystemClock()) as app:
        url = broker_url(app)
        _, busy = broker_call(url, "POST", "api/leases", {"gpus": 1}, token="alice")
        broker_call(url, "POST", f"api/leases/{busy['id']}/heartbeat", {"usage": {"t": time.time(), "gpu_busy": True, "last_gpu_activity": time.time()}},
                    token="alice")
        _, silent = broker_call(url, "POST", "api/leases", {"gpus": 1}, token="dave")  # its server sent no usage yet
        lines = []

        class Lines(logging.Handler):
            def emit(self, record):
                lines.append(record.getMessage())

        logger = logging.getLogger("test-culler-decisions")
        logger.setLevel(logging.INFO)  # the culler's default level
        logger.addHandler(Lines())
        logger.propagate = False
        arbiter = GPUCullArbiter(gpu_idle_limit=1800, cache_s=0, logger=logger, client=BrokerClient(url, "admin-culler"))

        async def passes():
            kept = [await arbiter(inactive=minutes(m), inactive_limit=3600, server=server("alice")) for m in (70, 75, 80)]
            early = await arbiter(inactive=minutes(40), inactive_limit=3600, server=server("dave"))  # no usage: not early
            late = await arbiter(inactive=minutes(61), inactive_limit=3600, server=server("dave"))
            return kept, early, late

        assert asyncio.run(passes()) == ([False, False, False], False, True)
        assert lines[0] == f"GPU cull arbiter: deciding with the GPU leases of the broker at {url}"
        assert lines[1].startswith("GPU cull arbiter: keeping alice/: its GPU is working now") and "the culler's limit: 1 h" in lines[1]
        assert lines[2] == f"GPU cull arbiter: released lease {silent['id']} of dave/ (culled by the idle culler: no activity for 1 h 1 min)"
        assert len(lines) == 3  # three passes over alice, one line
        _, ended = broker_call(url, "GET", f"api/leases/{silent['id']}", token="dave")
        assert ended["state"] == "released" and ended["end_reason"] == "culled by the idle culler: no activity for 1 h 1 min"


def test_without_the_broker_the_culler_decides_by_activity_alone():
    arbiter = GPUCullArbiter(client=BrokerClient("http://127.0.0.1:9/services/gpulease/", "t", retry_for=0))

    async def decide():
        return [await arbiter(inactive=minutes(m), inactive_limit=3600, server=server("alice")) for m in (30, 90)]

    assert asyncio.run(decide()) == [False, True]


def test_the_guide_and_the_example_config_run_the_culler_alike():
    """The idle-culler guide's blocks, config/jupyterhub_config.py's culler entry and config/idle_culler_config.py agree,
    and the role holds every scope the culler and the hook need."""
    import re
    from pathlib import Path

    from jupyter_gpulease.culler import CULLER_ROLE_SCOPES

    root = Path(__file__).resolve().parent.parent
    guide = (root / "docs" / "how-to" / "idle-culler.md").read_text()
    blocks = {b.splitlines()[0]: b for b in re.findall(r"^```python\n(.*?)^```", guide, re.S | re.M)}
    hub = blocks["# jupyterhub_config.py: the idle culler (after the services and roles above)"]
    hook = blocks["# idle_culler_config.py"]
    example = (root / "config" / "jupyterhub_config.py").read_text()

    def scopes(code):
        block = re.search(r'"scopes": \[(.*?)\]', code[code.index('"name": "idle-culler"'):], re.S)
        return set(re.findall(r'"([^"]+)"', block.group(1)))

    assert scopes(hub) == scopes(example) == set(CULLER_ROLE_SCOPES)
    assert '"jupyterhub_idle_culler", "--timeout=3600"' in hub and '"jupyterhub_idle_culler", "--timeout=3600"' in example
    (line,) = [x for x in hook.splitlines() if "cull_arbiter_hook" in x]
    assert line in (root / "config" / "idle_culler_config.py").read_text()


class FakeBroker:
    """What the hook asks of the broker's client: the active leases, and a release."""

    url = "http://broker.invalid/services/gpulease/"

    def __init__(self, leases):
        self.leases, self.released = leases, []

    async def list_leases(self, state=None, **kw):
        return self.leases

    async def release(self, lease_id, reason="", state=None, *, keep_server=False):
        self.released.append((lease_id, reason))
        return {}


def test_the_idle_time_of_a_lease_is_taken_from_its_heartbeats_whatever_the_servers_clock():
    import logging

    broker_now = 1_000_000.0
    skew = -5000.0  # the server's clock is 5000 s behind the broker's (and the culler's)
    beat = broker_now - 60  # its last heartbeat, a minute ago (broker time)
    usage = {"t": beat + skew, "gpu_busy": False, "last_gpu_activity": beat + skew - 39 * 60}  # idle for 39 min at that heartbeat
    lease = {"id": "L1", "user": "erin", "server": "", "state": "active", "granted_at": broker_now - 7200, "last_heartbeat": beat, "usage": usage}
    broker = FakeBroker([lease])
    lines = []

    class Lines(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    logger = logging.getLogger("test-culler-skew")
    logger.setLevel(logging.INFO)
    logger.addHandler(Lines())
    logger.propagate = False
    arbiter = GPUCullArbiter(gpu_idle_limit=1800, busy_window_s=600, client=broker, logger=logger, clock=lambda: broker_now)
    culled = asyncio.run(arbiter(inactive=minutes(45), inactive_limit=3600, server=server("erin")))
    assert culled is True
    # 40 min, not the 2 h 3 min the server's skewed clock would make of it
    assert broker.released == [("L1", "culled by the idle culler: no activity for 45 min and its GPU idle (last GPU work 40 min ago)")]
    assert any("culling erin/ early" in line and "the culler's limit: 1 h" in line for line in lines), lines

    # work within the busy window, as measured the same way, keeps the server
    usage["last_gpu_activity"] = usage["t"] - 120
    arbiter = GPUCullArbiter(gpu_idle_limit=1800, busy_window_s=600, client=FakeBroker([lease]), logger=logger, clock=lambda: broker_now)
    assert asyncio.run(arbiter(inactive=minutes(90), inactive_limit=3600, server=server("erin"))) is False
    assert "its GPU is worked 3 min ago" in lines[-1]
