"""The shipped Prometheus rules (config/gpulease-alerts.yml): valid, their own promtool tests
pass, and every series they read is one the broker really exports.

The series check runs a broker in-process on simulated GPUs, drives what the rules watch (a
lease that sits idle, a GPU hot against its own slowdown threshold, an XID of the device's kind
and one of an application's, a wait in the queue) and reads /metrics: a rule that reads a
series no broker writes would never fire, and promtool cannot know that.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from brokerutil import ManualClock, broker_url, make_broker, patch_auth
from jupyter_gpulease.client import BrokerClient
from test_broker_prometheus import scrape, value

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "config" / "gpulease-alerts.yml"
RULE_TESTS = ROOT / "config" / "gpulease-alerts.test.yml"
PROMTOOL = shutil.which("promtool")

pytestmark = pytest.mark.timeout(120)


def need_promtool() -> str:
    if PROMTOOL is None:
        missing = "promtool is not installed (apt-get install prometheus)"
        if os.environ.get("CI"):
            pytest.fail(f"{missing}; .ci/run installs it")
        pytest.skip(missing)
    return PROMTOOL


def rule_names() -> set[str]:
    """The gpulease_* series names the rules read (histogram suffixes stripped)."""
    names = set()
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            names |= set(re.findall(r"\bgpulease_[a-z_]+", rule["expr"]))
    return names


def test_the_rules_are_valid_and_pass_their_promtool_tests():
    promtool = need_promtool()
    check = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60, check=False)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "SUCCESS: 9 rules found" in check.stdout
    run = subprocess.run([promtool, "test", "rules", RULE_TESTS.name], cwd=RULE_TESTS.parent, capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0 and "SUCCESS" in run.stdout, run.stdout + run.stderr
    # every alert of the file has a test of its own
    alerts = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}
    tested = {t["alertname"] for case in yaml.safe_load(RULE_TESTS.read_text())["tests"] for t in case.get("alert_rule_test", ())}
    assert alerts == tested, f"alerts without a promtool test: {sorted(alerts - tested)}"


def test_a_broken_rule_fails_its_promtool_test(tmp_path):
    """The promtool tests can fail: the same tests against rules whose hot threshold was moved."""
    promtool = need_promtool()
    (tmp_path / RULES.name).write_text(RULES.read_text().replace("gpulease_device_slowdown_temperature_celsius - 5", "gpulease_device_slowdown_temperature_celsius - 1"))
    shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)
    run = subprocess.run([promtool, "test", "rules", RULE_TESTS.name], cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode != 0 and "GPULeaseGPUHot" in run.stdout + run.stderr


def test_every_series_the_rules_read_is_exported_by_the_broker(tmp_path, monkeypatch):
    patch_auth(monkeypatch)
    clock = ManualClock()

    async def main():
        app = make_broker(tmp_path, clock, device_sample_interval=3600)
        await app.start_async()
        try:
            alice, bob = BrokerClient(broker_url(app), "alice"), BrokerClient(broker_url(app), "bob")
            held = await alice.request_lease({"gpus": 2, "model": "A100*", "duration_s": 4 * 3600})
            waiting = await bob.request_lease({"gpus": 1, "model": "A100*"})
            assert (held["state"], waiting["state"]) == ("active", "queued")
            hot, sick = (s["gpu_uuid"] for s in held["placement"]["slices"])
            # alice's server: its GPUs last computed 10 s after the grant, then nothing
            clock.advance(60)
            await alice.heartbeat(held["id"], {"t": 5000.0, "gpu_busy": False, "last_gpu_activity": 4960.0, "devices": {}})
            app.backend.set_device(hot, temperature_c=87.5, temperature_slowdown_c=91)
            app.backend.inject_xid(sick, 79)
            await app.telemetry.sample()
            app.backend.inject_xid(sick, 13, count=2)
            await app.telemetry.sample()
            await app.telemetry.sample()  # the same counts again: nothing new
            l4 = next(g for g in app.manager.inventory() if g.model == "L4")
            await app.health.cordon("device", l4.uuid, reason="fan failure", actor="admin-carol")
            await app.health.add_window(start=clock.t + 4 * 3600, end=clock.t + 5 * 3600, reason="BIOS", nodes=["n2"], actor="admin-carol")
            clock.advance(3 * 3600)
            m = await scrape(app)
            app.backend.reset_device(sick)  # repaired: healthy again, its XID counted once
            await app.telemetry.sample()
            await app.telemetry.sample()
            after_reset = await scrape(app)
            assert value(after_reset, "gpulease_device_driver_healthy", uuid=sick, node="n1", model="A100-SXM4-80GB") == 1
            assert value(after_reset, "gpulease_device_xid_errors_total", uuid=sick, xid="79", kind="device", node="n1", model="A100-SXM4-80GB") == 1
            return m, held, hot, sick, l4, clock.t + 3600
        finally:
            await app.stop_async()

    m, held, hot, sick, l4, window_start = asyncio.run(main())
    names = {name for name, _ in m}
    missing = {n for n in rule_names() if not any(x == n or x.startswith(n + "_") or x == n + "_total" for x in names)}
    # the wait histogram is written when a wait ends: the granted lease's wait is one
    assert not missing, f"the rules read series the broker does not export: {sorted(missing)}"

    a100 = {"node": "n1", "model": "A100-SXM4-80GB"}
    assert value(m, "gpulease_device_temperature_celsius", uuid=hot, **a100) == 87.5
    assert value(m, "gpulease_device_slowdown_temperature_celsius", uuid=hot, **a100) == 91
    # the XIDs: a counter per code, 79 of the device's kind, 13 (two more of them) the application's
    assert value(m, "gpulease_device_xid_errors_total", uuid=sick, xid="79", kind="device", **a100) == 1
    assert value(m, "gpulease_device_xid_errors_total", uuid=sick, xid="13", kind="application", **a100) == 2
    assert value(m, "gpulease_device_driver_healthy", uuid=sick, **a100) == 0
    assert value(m, "gpulease_device_driver_healthy", uuid=hot, **a100) == 1
    # idle since 40 s before the heartbeat (server clock), the heartbeat 3 h ago (broker clock)
    assert value(m, "gpulease_lease_idle_seconds", lease=held["id"], tier="experiment", **a100) == 3 * 3600 + 40
    assert value(m, "gpulease_device_cordoned", uuid=hot, **a100) == 0
    # an admin's cordon: cordoned, not unhealthy; the node's window ahead, not under way
    n2 = {"uuid": l4.uuid, "node": "n2", "model": "L4"}
    assert value(m, "gpulease_device_cordoned", **n2) == 1
    assert value(m, "gpulease_device_healthy", **n2) == 1
    assert value(m, "gpulease_gpus_unhealthy", model="L4") == 0
    assert value(m, "gpulease_device_in_maintenance", **n2) == 0
    assert value(m, "gpulease_device_next_maintenance_start_seconds", **n2) == window_start


def test_idle_time_of_a_lease_follows_its_heartbeats():
    from jupyter_gpulease.broker.metrics import lease_idle_s

    active = {"state": "active", "granted_at": 1000.0, "last_heartbeat": 1100.0}
    assert lease_idle_s(dict(active, usage={}), 1200.0) is None  # no heartbeat figures yet
    assert lease_idle_s(dict(active, usage={"t": 50.0, "gpu_busy": True, "last_gpu_activity": 50.0}), 1200.0) == 0.0
    # the server's clock is 1050 s behind the broker's: only the difference counts
    assert lease_idle_s(dict(active, usage={"t": 50.0, "gpu_busy": False, "last_gpu_activity": 20.0}), 1200.0) == 130.0
    # never computed: idle since the grant
    assert lease_idle_s(dict(active, usage={"t": 50.0, "gpu_busy": False, "last_gpu_activity": None}), 1200.0) == 200.0
    assert lease_idle_s(dict(active, state="queued", usage={"t": 1.0}), 1200.0) is None



def test_the_example_prometheus_and_alertmanager_configs_are_valid():
    """config/prometheus.yml loads the rules next to it; config/alertmanager.yml routes them."""
    promtool = need_promtool()
    check = subprocess.run([promtool, "check", "config", str(ROOT / "config" / "prometheus.yml")], capture_output=True, text=True, timeout=60, check=False)
    assert check.returncode == 0 and "SUCCESS: 9 rules found" in check.stdout + check.stderr, check.stdout + check.stderr
    amtool = shutil.which("amtool")
    if amtool is None:
        missing = "amtool is not installed (apt-get install prometheus-alertmanager)"
        if os.environ.get("CI"):
            pytest.fail(f"{missing}; .ci/run installs it")
        pytest.skip(missing)
    check = subprocess.run([amtool, "check-config", str(ROOT / "config" / "alertmanager.yml")], capture_output=True, text=True, timeout=60, check=False)
    assert check.returncode == 0 and "SUCCESS" in check.stdout, check.stdout + check.stderr
    # the example's inhibition names alerts the rules have
    am = yaml.safe_load((ROOT / "config" / "alertmanager.yml").read_text())
    alerts = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}
    for rule in am["inhibit_rules"]:
        for m in rule["source_matchers"] + rule["target_matchers"]:
            assert m.split("=", 1)[1].strip('"') in alerts
