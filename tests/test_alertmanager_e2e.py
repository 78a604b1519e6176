"""End to end: the shipped alert rules fire in a real Prometheus that scrapes a real broker, and
a real Alertmanager delivers them to a webhook receiver in the test.

Debian's binaries (``prometheus``, ``prometheus-alertmanager``; .ci/run installs both) run on
127.0.0.1 with configs and data folders in the test's temporary folder. The broker runs on
simulated GPUs with a clock the test moves: its lease sits idle for three hours of that clock,
and one of its GPUs is driven to within 5 °C of its own slowdown threshold. The rules are the
shipped file's, thresholds and all; only the test's own config makes things quick: rule
evaluation and scrapes every second, every rule's ``for:`` one second, Alertmanager's group
waits one second.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from brokerutil import ManualClock, broker_in_thread, patch_auth
from hubharness import wait_for
from jupyter_gpulease.client import BrokerClient
from test_broker_prometheus import Prometheus, ReadyProcess

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "config" / "gpulease-alerts.yml"
PROMETHEUS = shutil.which("prometheus")
# Debian names the binary prometheus-alertmanager; the upstream tarball alertmanager
ALERTMANAGER = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")

pytestmark = pytest.mark.timeout(240)


def need(binary: str | None, what: str) -> str:
    if binary is None:
        missing = f"{what} is not installed (apt-get install prometheus prometheus-alertmanager)"
        if os.environ.get("CI"):
            pytest.fail(f"{missing}; .ci/run installs it")
        pytest.skip(missing)
    return binary


class Receiver:
    """A webhook receiver on 127.0.0.1: keeps every JSON body POSTed to it."""

    def __init__(self, status: int = 200):
        self.bodies: list[dict] = []
        self.status = status
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n)
                code = outer.status
                if code == 200:
                    outer.bodies.append({"path": self.path, "headers": dict(self.headers), "json": json.loads(body)})
                self.send_response(code)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Alertmanager(ReadyProcess):
    """A real Alertmanager on 127.0.0.1, its config and data in ``tmp``, no cluster gossip."""

    name = "Alertmanager"

    def __init__(self, tmp: Path, config: dict):
        super().__init__()
        self.start(tmp, config, [ALERTMANAGER, f"--storage.path={tmp / 'alertmanager-data'}", "--cluster.listen-address="])


def quick_rules(tmp: Path) -> Path:
    """The shipped rules with every ``for:`` at one second (the test's config; thresholds unchanged)."""
    rules = yaml.safe_load(RULES.read_text())
    for group in rules["groups"]:
        group["interval"] = "1s"
        for rule in group["rules"]:
            if "for" in rule:
                rule["for"] = "1s"
    path = tmp / "gpulease-alerts.yml"
    path.write_text(yaml.safe_dump(rules, sort_keys=False))
    return path


def test_ci_installs_prometheus_and_alertmanager_where_this_test_looks():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "apt_install prometheus prometheus-alertmanager" in ci
    assert "command -v prometheus-alertmanager" in ci and "command -v promtool" in ci


def test_the_shipped_rules_fire_on_a_hot_gpu_and_an_idle_lease_and_alertmanager_delivers_them(tmp_path, monkeypatch):
    need(PROMETHEUS, "prometheus")
    need(ALERTMANAGER, "prometheus-alertmanager")
    patch_auth(monkeypatch)
    clock = ManualClock()
    receiver = Receiver()
    am = prom = None
    try:
        am = Alertmanager(tmp_path, {
            "route": {"receiver": "test", "group_by": ["alertname", "uuid", "lease"], "group_wait": "1s", "group_interval": "1s", "repeat_interval": "1h"},
            "receivers": [{"name": "test", "webhook_configs": [{"url": receiver.url + "/alerts", "send_resolved": True}]}],
        })
        with broker_in_thread(tmp_path, clock=clock, device_sample_interval=1.0) as app:
            base = app.bind_url.rstrip("/")
            prom = Prometheus(tmp_path, {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "rule_files": [str(quick_rules(tmp_path))],
                "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am.port}"]}]}]},
                "scrape_configs": [{
                    "job_name": "gpulease", "metrics_path": app.base_url + "metrics", "authorization": {"type": "token", "credentials": "prometheus"},
                    "static_configs": [{"targets": [base.split("//", 1)[1]]}],
                }],
            })
            alice = BrokerClient(base + app.base_url, "alice")

            async def hold():
                held = await alice.request_lease({"gpus": 2, "model": "A100*", "duration_s": 8 * 3600})
                assert held["state"] == "active"
                # her server: the GPUs computed until 30 s before this heartbeat, then nothing
                await alice.heartbeat(held["id"], {"t": 100.0, "gpu_busy": False, "last_gpu_activity": 70.0, "devices": {}})
                return held

            held = asyncio.run(hold())
            hot, cool = (s["gpu_uuid"] for s in held["placement"]["slices"])
            wait_for(lambda: prom.values('up{job="gpulease"}') == [1], 60, f"Prometheus did not scrape the broker:\n{prom.log_tail()}", interval=0.5)
            # nothing fires yet: the GPUs are cool (34 °C, slowdown at 90) and the lease idle for 30 s
            assert prom.query('ALERTS{alertname=~"GPULeaseIdleLease|GPULeaseGPUHot"}') == []

            app.backend.set_device(hot, temperature_c=86.0)  # 4 °C under its slowdown threshold of 90
            clock.advance(3 * 3600)  # three hours without a cell on the GPUs

            def delivered():
                firing = {}
                for b in receiver.bodies:
                    for a in b["json"]["alerts"]:
                        if a["status"] == "firing":
                            firing[a["labels"]["alertname"]] = a
                return firing if {"GPULeaseIdleLease", "GPULeaseGPUHot"} <= set(firing) else None

            try:
                firing = wait_for(delivered, 90, "Alertmanager did not deliver both alerts", interval=0.5)
            except AssertionError as e:
                raise AssertionError(f"{e}; delivered: {[b['json'].get('groupLabels') for b in receiver.bodies]}; "
                                     f"Prometheus' alerts: {prom.query('ALERTS')}\n{prom.log_tail()}\n{am.log_tail()}") from None
            idle, heat = firing["GPULeaseIdleLease"], firing["GPULeaseGPUHot"]
            assert idle["labels"]["lease"] == held["id"] and idle["labels"]["severity"] == "warning"
            assert idle["annotations"]["summary"].startswith(f"Lease {held['id']} has held idle GPUs for 3h")
            assert heat["labels"]["uuid"] == hot and heat["labels"]["node"] == "n1"
            assert heat["annotations"]["summary"] == f"GPU {hot} on n1 is at 86 °C, within 5 °C of its slowdown threshold"
            # only the hot GPU: its neighbour in the same lease is cool, and nothing is at the threshold itself
            assert not any(a["labels"].get("uuid") == cool for b in receiver.bodies for a in b["json"]["alerts"])
            assert prom.query('ALERTS{alertname="GPULeaseGPUAtSlowdown"}') == []

            # cooled down: Alertmanager sends the resolution too
            app.backend.set_device(hot, temperature_c=60.0)

            def resolved():
                return any(a["status"] == "resolved" and a["labels"]["alertname"] == "GPULeaseGPUHot" for b in receiver.bodies for a in b["json"]["alerts"])

            wait_for(resolved, 60, f"no resolution delivered:\n{am.log_tail()}", interval=0.5)

            # a GPU nobody holds falls off the bus (XID 79): unhealthy; once reset, healthy again and
            # the alert resolves, the XID counted once
            spare = next(g.uuid for g in app.manager.inventory() if g.uuid not in (hot, cool))
            app.backend.inject_xid(spare, 79)

            def unhealthy(status):
                return any(a["status"] == status and a["labels"]["alertname"] == "GPULeaseDeviceUnhealthy" and a["labels"]["uuid"] == spare
                           for b in receiver.bodies for a in b["json"]["alerts"])

            wait_for(lambda: unhealthy("firing"), 60, f"GPULeaseDeviceUnhealthy was not delivered: {prom.query('ALERTS')}", interval=0.5)
            app.backend.reset_device(spare)
            wait_for(lambda: unhealthy("resolved"), 60, f"GPULeaseDeviceUnhealthy did not resolve after the reset: {prom.query('ALERTS')}",
                     interval=0.5)
            assert prom.values(f'gpulease_device_xid_errors_total{{uuid="{spare}",xid="79"}}') == [1]
    finally:
        if prom is not None:
            prom.stop()
        if am is not None:
            am.stop()
        receiver.stop()
