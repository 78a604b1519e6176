"""The broker's Prometheus metrics: what an admin reads, and that counters survive a fail-over.

In-process tests (a clock the test moves, the caller named by the token) check the series'
values; the end-to-end test runs a real JupyterHub with the broker as its managed service (one
active process, one standby) and a real Prometheus that scrapes it through the hub's proxy with
the shipped scrape config (config/prometheus.yml, which the alerts guide shows), then kills the active
broker and asks Prometheus whether any counter was reset.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from tornado.httpclient import AsyncHTTPClient

from brokerutil import ManualClock, broker_url, make_broker, patch_auth
from hubharness import free_port, pid_alive, wait_for
from jupyter_gpulease.client import BrokerClient

ROOT = Path(__file__).resolve().parent.parent
SCRAPE_CONFIG = ROOT / "config" / "prometheus.yml"
PROMETHEUS = shutil.which("prometheus")

pytestmark = pytest.mark.timeout(180)


def parse(text: str) -> dict[tuple[str, frozenset], float]:
    """The exposition as {(sample name, labels): value}."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples, name: str, **labels) -> float | None:
    return samples.get((name, frozenset(labels.items())))


async def scrape(app, token: str = "prometheus") -> dict:
    resp = await AsyncHTTPClient().fetch(broker_url(app) + "metrics", headers={"Authorization": f"token {token}"})
    return parse(resp.body.decode())


def run_broker(tmp_path, scenario, clock=None, **kw):
    clock = clock or ManualClock()

    async def main():
        app = make_broker(tmp_path, clock, **kw)
        await app.start_async()
        try:
            return await scenario(app, lambda user: BrokerClient(broker_url(app), user))
        finally:
            await app.stop_async()

    return asyncio.run(main())


# --------------------------------------------------------------------------- in-process
def test_metrics_show_groups_the_queue_every_end_of_a_wait_end_reasons_and_devices(tmp_path, monkeypatch):
    patch_auth(monkeypatch)
    clock = ManualClock()

    async def scenario(app, client):
        alice, bob, dave, admin = client("alice"), client("bob"), client("dave"), client("admin-carol")
        held = await alice.request_lease({"gpus": 2, "model": "A100*", "duration_s": 7200})
        assert held["state"] == "active"
        waiting = await bob.request_lease({"gpus": 1, "model": "A100*"})
        limited = await dave.request_lease({"gpus": 1, "model": "A100*", "max_wait_s": 120})
        assert waiting["state"] == limited["state"] == "queued"
        clock.advance(60)
        gpu = held["placement"]["slices"][0]["gpu_uuid"]
        await alice.heartbeat(held["id"], {"devices": {
            gpu: {"busy_s": 15, "idle_s": 45, "mem_peak_mib": 1024, "health": "1 critical XID error(s), the last XID 79"},
            "GPU-made-up": {"busy_s": 1, "idle_s": 1, "mem_peak_mib": 1},  # not in the pool: adds no series
        }})

        m = await scrape(app)
        assert value(m, "gpulease_group_leases", state="active", tier="experiment", group="physics") == 1
        assert value(m, "gpulease_group_leases", state="queued", tier="experiment", group="chemistry") == 1
        assert value(m, "gpulease_group_leases", state="queued", tier="experiment", group="none") == 1  # dave has no group
        assert value(m, "gpulease_group_gpus_held", tier="experiment", model="A100-SXM4-80GB", group="physics") == 2
        assert value(m, "gpulease_queue_waiting", tier="experiment") == 2
        assert value(m, "gpulease_queue_oldest_wait_seconds", tier="experiment") == 60
        dev = {"uuid": gpu, "node": "n1", "model": "A100-SXM4-80GB"}
        assert value(m, "gpulease_device_held", **dev) == 1
        assert value(m, "gpulease_device_healthy", **dev) == 1
        assert value(m, "gpulease_device_busy_ratio", **dev) == 0.25
        assert value(m, "gpulease_device_memory_peak_bytes", **dev) == 1024 * 1024 * 1024
        assert value(m, "gpulease_device_health_problem", **dev) == 1
        assert not any("GPU-made-up" in dict(labels).get("uuid", "") for _, labels in m)
        assert not any("user" in dict(labels) for _, labels in m), "per-user series are off by default"
        # nobody has stopped waiting yet but the granted lease
        assert value(m, "gpulease_wait_seconds_count", tier="experiment", outcome="granted") == 1
        assert value(m, "gpulease_wait_seconds_count", tier="experiment", outcome="withdrawn") is None

        await bob.release(waiting["id"])  # withdrawn after 60 s
        clock.advance(61)
        await app.manager.tick()  # dave's wait limit of 120 s runs out
        assert (await dave.get_lease(limited["id"]))["state"] == "withdrawn"
        await admin.release(held["id"], reason="maintenance", state="revoked")

        m = await scrape(app)
        assert value(m, "gpulease_wait_seconds_count", tier="experiment", outcome="withdrawn") == 1
        assert value(m, "gpulease_wait_seconds_sum", tier="experiment", outcome="withdrawn") == 60
        assert value(m, "gpulease_wait_seconds_bucket", tier="experiment", outcome="withdrawn", le="30.0") == 0
        assert value(m, "gpulease_wait_seconds_bucket", tier="experiment", outcome="withdrawn", le="60.0") == 1
        assert value(m, "gpulease_wait_seconds_count", tier="experiment", outcome="timed_out") == 1
        assert value(m, "gpulease_wait_seconds_sum", tier="experiment", outcome="timed_out") == 120
        assert value(m, "gpulease_ends_total", state="withdrawn", reason="withdrawn", tier="experiment") == 1
        assert value(m, "gpulease_ends_total", state="withdrawn", reason="wait_limit", tier="experiment") == 1
        assert value(m, "gpulease_ends_total", state="revoked", reason="revoked", tier="experiment") == 1
        assert value(m, "gpulease_requests_total", tier="experiment") == 3
        assert value(m, "gpulease_grants_total", tier="experiment") == 1
        assert value(m, "gpulease_queue_waiting", tier="experiment") == 0
        assert value(m, "gpulease_queue_oldest_wait_seconds", tier="experiment") == 0
        assert value(m, "gpulease_device_held", **dev) == 0
        assert value(m, "gpulease_device_busy_ratio", **dev) is None  # no holder reports on it now

    run_broker(tmp_path, scenario, clock)


def test_per_user_series_appear_only_when_switched_on(tmp_path, monkeypatch):
    patch_auth(monkeypatch)

    async def scenario(app, client):
        await client("alice").request_lease({"gpus": 1, "model": "L4"})
        m = await scrape(app)
        assert value(m, "gpulease_user_leases", state="active", tier="experiment", user="alice") == 1
        assert value(m, "gpulease_user_gpus_held", tier="experiment", model="L4", user="alice") == 1

    run_broker(tmp_path, scenario, metrics_per_user=True)


def test_end_reasons_map_every_way_a_lease_ends_to_a_small_fixed_set():
    from jupyter_gpulease.broker.metrics import END_REASONS, end_reason, wait_outcome

    cases = {
        ("released", "alice", "done"): "released",
        ("released", "service:gpulease-spawner", "the server stopped"): "server_stopped",
        ("expired", "broker", ""): "expired",
        ("reclaimed", "alice", "idle"): "reclaimed",
        ("preempted", "broker", ""): "preempted",
        ("revoked", "admin:carol", "maintenance"): "revoked",
        ("revoked", "broker", "something the broker says one day"): "revoked",
        ("revoked", "broker", "its holder stopped sending heartbeats (5 min without one)"): "heartbeat_lost",
        ("revoked", "broker", "never confirmed by its holder within 10 min of the grant"): "unconfirmed",
        ("revoked", "broker:reconcile", "its server is not running"): "server_gone",
        ("withdrawn", "bob", ""): "withdrawn",
        ("withdrawn", "broker", "not granted within its wait limit of 2 min"): "wait_limit",
        ("failed", "broker", "its GPU left the pool"): "failed",
        ("something-new", "x", ""): "other",
    }
    for args, want in cases.items():
        assert end_reason(*args) == want, args
        assert want in END_REASONS
    assert [wait_outcome(s, a) for s, a in (("active", "broker"), ("withdrawn", "bob"), ("withdrawn", "broker"), ("failed", "broker"))] == \
        ["granted", "withdrawn", "timed_out", "failed"]


def test_a_broker_that_takes_over_the_store_continues_every_counter(tmp_path, monkeypatch):
    """A fail-over: a new broker process on the same database goes on from the totals the
    first one committed, with the same _created, instead of starting again from zero."""
    patch_auth(monkeypatch)
    clock = ManualClock()
    counters = ("gpulease_requests_total", "gpulease_grants_total", "gpulease_ends_total", "gpulease_wait_seconds_count",
                "gpulease_wait_seconds_bucket", "gpulease_wait_seconds_sum", "gpulease_requests_created", "gpulease_ends_created",
                "gpulease_wait_seconds_created")

    async def first(app, client):
        alice, bob = client("alice"), client("bob")
        a = await alice.request_lease({"gpus": 2, "model": "A100*"})
        b = await bob.request_lease({"gpus": 1, "model": "A100*"})
        clock.advance(30)
        await bob.release(b["id"])
        await alice.release(a["id"])
        return {k: v for k, v in (await scrape(app)).items() if k[0] in counters}

    async def second(app, client):
        before = {k: v for k, v in (await scrape(app)).items() if k[0] in counters}
        await client("alice").request_lease({"gpus": 1, "model": "L4"})
        return before, await scrape(app)

    was = run_broker(tmp_path, first, clock)
    assert value(was, "gpulease_ends_total", state="withdrawn", reason="withdrawn", tier="experiment") == 1
    assert value(was, "gpulease_ends_total", state="released", reason="released", tier="experiment") == 1
    clock.advance(100)
    after_restart, later = run_broker(tmp_path, second, clock)
    assert after_restart == was, "the counters did not continue where the first broker left them"
    assert value(later, "gpulease_requests_total", tier="experiment") == 3
    assert value(later, "gpulease_grants_total", tier="experiment") == 2
    # the series keep their first _created; the process-local commit counter starts anew
    assert value(later, "gpulease_requests_created", tier="experiment") == value(was, "gpulease_requests_created", tier="experiment")
    assert value(later, "gpulease_store_commits_created") == clock.t > value(was, "gpulease_requests_created", tier="experiment")


# --------------------------------------------------------------------------- end to end
def test_the_shipped_scrape_config_is_valid_and_the_guide_shows_it_verbatim():
    guide = (ROOT / "docs" / "how-to" / "alerts-and-dashboard.md").read_text()
    assert SCRAPE_CONFIG.read_text().strip() in guide
    promtool = shutil.which("promtool")
    if promtool is not None:
        check = subprocess.run([promtool, "check", "config", str(SCRAPE_CONFIG)], check=False, capture_output=True, text=True, timeout=60)
        assert check.returncode == 0, check.stdout + check.stderr


class ReadyProcess:
    """A real Prometheus-family binary on 127.0.0.1 (Prometheus, Alertmanager): its YAML config and
    log in ``tmp``, started by :meth:`start`, ready when ``/-/ready`` answers 200."""

    name = ""

    def start(self, tmp: Path, config: dict, argv: list[str]) -> None:
        cfg = tmp / f"{self.name.lower()}.yml"
        cfg.write_text(yaml.safe_dump(config))
        self.log = tmp / f"{self.name.lower()}.log"
        self.proc = subprocess.Popen([*argv, f"--config.file={cfg}", f"--web.listen-address=127.0.0.1:{self.port}"],
                                     stdout=self.log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
        wait_for(self._ready, 60, f"{self.name} did not become ready:\n{self.log_tail()}", interval=0.3)

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"{self.name} exited:\n{self.log_tail()}")
        try:
            with urllib.request.urlopen(self.url + "/-/ready", timeout=5) as r:
                return r.status == 200
        except OSError:
            return False

    def log_tail(self, n: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:]) if self.log.exists() else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


class Prometheus(ReadyProcess):
    """A real Prometheus on 127.0.0.1 with a config and a data folder in ``tmp``."""

    name = "Prometheus"

    def __init__(self, tmp: Path, config: dict):
        super().__init__()
        self.start(tmp, config, [PROMETHEUS, f"--storage.tsdb.path={tmp / 'prometheus-data'}"])

    def query(self, promql: str) -> list[dict]:
        with urllib.request.urlopen(f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": promql}), timeout=10) as r:
            reply = json.load(r)
        assert reply["status"] == "success", reply
        return reply["data"]["result"]

    def values(self, promql: str) -> list[float]:
        return [float(s["value"][1]) for s in self.query(promql)]


PROMETHEUS_SERVICE = """
c.JupyterHub.services.append({{"name": "prometheus", "api_token": {token!r}}})
c.JupyterHub.load_roles.append({{"name": "prometheus", "scopes": ["access:services!service=gpulease", "custom:gpulease:metrics"], "services": ["prometheus"]}})
"""


def scrape_config_for(hub, token: str) -> dict:
    """The shipped scrape config, pointed at the test's hub (http on loopback) with the service's token."""
    config = yaml.safe_load(SCRAPE_CONFIG.read_text())
    job = config["scrape_configs"][0]
    assert job["authorization"]["credentials"] and job["metrics_path"] == "/services/gpulease/metrics"
    job["authorization"]["credentials"] = token
    job["scheme"] = "http"
    job["static_configs"] = [{"targets": [urllib.parse.urlsplit(hub.url).netloc]}]
    job["scrape_interval"] = "1s"  # the test waits for scrapes: the shipped 30 s would be slow
    return config


def test_prometheus_scrapes_the_broker_through_the_hub_and_sees_no_reset_at_a_fail_over(tmp_path):
    from brokerhub import active_broker_pid, hub_for_broker, wait_for_broker

    if PROMETHEUS is None:
        missing = "the prometheus binary is not installed (apt-get install prometheus)"
        if os.environ.get("CI"):
            pytest.fail(f"{missing}; .ci/run installs it")
        pytest.skip(missing)
    token = os.urandom(16).hex()
    hub = hub_for_broker(tmp_path, config_lines=[PROMETHEUS_SERVICE.format(token=token)])
    hub.start()
    prom = None
    try:
        tokens = {u: hub.create_token(u) for u in ("alice", "bob")}
        wait_for_broker(hub, tokens["alice"])
        prom = Prometheus(tmp_path, scrape_config_for(hub, token))
        alice = BrokerClient(hub.service_url("gpulease"), tokens["alice"])
        bob = BrokerClient(hub.service_url("gpulease"), tokens["bob"])

        def seen(promql: str, what: str) -> list[float]:
            return wait_for(lambda: prom.values(promql), 60, f"Prometheus never saw {what} ({promql}):\n{prom.log_tail()}", interval=0.5)

        async def hold_and_wait():
            held = await alice.request_lease({"gpus": 2, "model": "A100*"})
            waiting = await bob.request_lease({"gpus": 1, "model": "A100*"})
            assert (held["state"], waiting["state"]) == ("active", "queued")
            return held, waiting

        held, waiting = asyncio.run(hold_and_wait())
        assert seen('up{job="gpulease"} == 1', "the broker up") == [1]
        assert seen('gpulease_group_gpus_held{group="physics",model="A100-SXM4-80GB"}', "alice's group holding GPUs") == [2]
        assert seen('gpulease_group_leases{state="queued",group="none"}', "bob's waiting lease (no group)") == [1]
        assert seen('gpulease_queue_oldest_wait_seconds > 0', "a current wait") != []

        asyncio.run(bob.release(waiting["id"]))
        asyncio.run(alice.release(held["id"]))
        assert seen('gpulease_wait_seconds_count{outcome="withdrawn"}', "a withdrawn wait") == [1]
        assert seen('gpulease_wait_seconds_count{outcome="granted"}', "a granted wait") == [1]
        assert seen('gpulease_ends_total{reason="released",state="released"}', "an end by release") == [1]
        assert seen('gpulease_ends_total{reason="withdrawn"}', "an end by withdrawal") == [1]

        # fail-over: kill the active broker; the standby takes over the same database
        started = seen("gpulease_broker_start_time_seconds", "the broker's start time")[0]
        pid = wait_for(lambda: active_broker_pid(hub), 30, "no broker holds the database's lock")
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not pid_alive(pid), 10, f"broker PID {pid} survived SIGKILL")
        wait_for(lambda: (p := active_broker_pid(hub)) and p != pid, 60, "the standby did not take over")
        seen(f"gpulease_broker_start_time_seconds > {started}", "the new broker scraped")
        asyncio.run(alice.request_lease({"gpus": 1, "model": "L4"}))
        assert seen('gpulease_grants_total == 2', "the grant after the fail-over added to the grant before it") == [2]
        time.sleep(1.5)  # one more scrape, so a reset would be inside the range below
        for counter in ("gpulease_grants_total", "gpulease_ends_total", "gpulease_requests_total", "gpulease_wait_seconds_count"):
            resets = prom.values(f"resets({counter}[5m])")
            assert resets and all(r == 0 for r in resets), f"Prometheus saw {counter} reset at the fail-over: {resets}"
        assert prom.values('gpulease_ends_total{reason="released"}') == [1]
    finally:
        if prom is not None:
            prom.stop()
        hub.stop()


def test_counter_totals_add_up_in_the_store_and_keep_their_first_created(db_url):
    """The totals table on SQLite and PostgreSQL: written with the events, summed per series."""
    from jupyter_gpulease.store import Batch, LeaseStore

    store = LeaseStore(db_url)
    try:
        store.upgrade()
        event = {"lease_id": "l1", "kind": "requested", "time": 1.0, "from_state": "", "to_state": "queued", "reason": "", "actor": "alice", "data": {}}
        store.write(Batch(events=[event], totals={("requests", ("gold",)): 1.0, ("wait_sum", ("gold", "granted")): 2.5}, at=100.0))
        store.write(Batch(events=[dict(event, time=2.0)], totals={("requests", ("gold",)): 2.0, ("requests", ("silver",)): 1.0}, at=200.0))
        assert store.load_totals() == {
            ("requests", ("gold",)): [3.0, 100.0],
            ("requests", ("silver",)): [1.0, 200.0],
            ("wait_sum", ("gold", "granted")): [2.5, 100.0],
        }
        assert store.count_events() == 2  # the same transactions as the events
    finally:
        store.close()
