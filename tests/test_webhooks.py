"""Alert webhooks from the broker (broker/alerts.py), for admins without Prometheus, delivered to
real HTTP receivers on 127.0.0.1: the plain JSON, Slack's and Teams' formats, each with the
admin page's link; a delivery that fails is tried again with back-off, one that keeps failing
is dropped with a warning; an alert that ends is delivered as resolved."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from traitlets import TraitError
from traitlets.config import Config

from brokerutil import ManualClock, broker_url, make_broker, patch_auth
from jupyter_gpulease.broker.alerts import Alert, p95, payload
from jupyter_gpulease.client import BrokerClient

pytestmark = pytest.mark.timeout(120)


class Receiver:
    """An HTTP receiver on 127.0.0.1 that answers 503 to its first ``fail_first`` POSTs."""

    def __init__(self, fail_first: int = 0):
        self.bodies: list[dict] = []
        self.tries = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                outer.tries += 1
                if outer.tries <= fail_first:
                    self.send_response(503)
                else:
                    assert self.headers["Content-Type"] == "application/json"
                    outer.bodies.append(json.loads(body))
                    self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


class Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


async def until(predicate, timeout: float = 20.0):
    for _ in range(int(timeout / 0.05)):
        if predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("timed out")


def test_alerts_go_to_json_slack_and_teams_receivers_with_a_link_retried_and_resolved(tmp_path, monkeypatch):
    patch_auth(monkeypatch)
    clock = ManualClock()
    plain, slack, teams, flaky, dead = Receiver(), Receiver(), Receiver(), Receiver(fail_first=2), Receiver(fail_first=10**6)
    hooks = [{"url": plain.url, "format": "json"}, {"url": slack.url, "format": "slack"}, {"url": teams.url, "format": "teams"},
             {"url": flaky.url}, {"url": dead.url, "format": "JSON"}]

    async def main():
        app = make_broker(tmp_path, clock, alert_webhooks=hooks, alert_retry_s=4.0, public_url="https://hub.example.org/", device_sample_interval=3600)
        seen = Lines()
        app.log.addHandler(seen)
        await app.start_async()
        try:
            alice = BrokerClient(broker_url(app), "alice")
            held = await alice.request_lease({"gpus": 1, "model": "L4", "duration_s": 8 * 3600})
            await alice.heartbeat(held["id"], {"t": 100.0, "gpu_busy": False, "last_gpu_activity": 100.0, "devices": {}})
            assert await app.alerts.check() == []  # nothing is wrong yet
            clock.advance(2 * 3600 + 1)  # idle past alert_idle_lease_s (2 h)
            gpu = held["placement"]["slices"][0]["gpu_uuid"]
            app.backend.set_device(gpu, temperature_c=91.0)  # at the simulated card's slowdown of 90
            await app.telemetry.sample()
            firing = await app.alerts.check()
            assert {a.name for a in firing} == {"GPULeaseIdleLease", "GPULeaseGPUHot"}
            await until(lambda: len(plain.bodies) == len(slack.bodies) == len(teams.bodies) == len(flaky.bodies) == 2)
            assert await app.alerts.check() == firing  # still firing: nothing is sent again
            await asyncio.sleep(0.3)
            assert len(plain.bodies) == 2

            await alice.release(held["id"])
            app.backend.set_device(gpu, temperature_c=50.0)
            await app.telemetry.sample()
            assert await app.alerts.check() == []
            await until(lambda: len(plain.bodies) == len(slack.bodies) == len(teams.bodies) == 4)
            await until(lambda: app.alerts.failed == 4, timeout=30)  # the dead receiver's 4 deliveries, dropped after 4 s each
            return held, gpu, seen.lines
        finally:
            await app.stop_async()

    try:
        held, gpu, lines = asyncio.run(main())
    finally:
        for r in (plain, slack, teams, flaky, dead):
            r.stop()
    link = "https://hub.example.org/services/gpulease/admin"

    by = {(b["alert"], b["status"]): b for b in plain.bodies}
    idle = by[("GPULeaseIdleLease", "firing")]
    assert idle["severity"] == "warning" and idle["labels"] == {"lease": held["id"], "user": "alice", "tier": "experiment"}
    assert idle["summary"].startswith(f"alice's lease {held['id'][:8]} (1 × L4 on n2) has sat idle for 2 h")
    assert idle["admin_url"] == link and idle["ends_at"] is None and idle["starts_at"].endswith("Z")
    hot = by[("GPULeaseGPUHot", "firing")]
    assert hot["severity"] == "critical" and hot["labels"]["uuid"] == gpu and "91 °C; it slows down at 90 °C" in hot["summary"]
    assert by[("GPULeaseIdleLease", "resolved")]["ends_at"] is not None
    assert set(by) == {("GPULeaseIdleLease", "firing"), ("GPULeaseGPUHot", "firing"), ("GPULeaseIdleLease", "resolved"), ("GPULeaseGPUHot", "resolved")}

    texts = sorted(b["text"] for b in slack.bodies)
    assert any(t.startswith("[FIRING] GPULeaseGPUHot: GPU ") and t.endswith(f" · <{link}|admin page>") for t in texts), texts
    assert any(t.startswith("[RESOLVED] GPULeaseIdleLease: ") and "(resolved after 0 s)" in t for t in texts), texts

    card = next(b for b in teams.bodies if b["title"] == "[FIRING] GPULeaseIdleLease")
    assert card["@type"] == "MessageCard" and card["text"] == idle["summary"]
    assert card["potentialAction"] == [{"@type": "OpenUri", "name": "Open the admin page", "targets": [{"os": "default", "uri": link}]}]
    assert next(b for b in teams.bodies if b["title"] == "[RESOLVED] GPULeaseIdleLease")["themeColor"] == "2E7D32"

    # the flaky receiver answered 503 twice: both deliveries came through on a later try
    assert flaky.tries == 4 + 2 and len(flaky.bodies) == 4
    assert dead.bodies == [] and dead.tries >= 8  # each of its 4 deliveries tried at least twice
    dropped = [line for line in lines if " not delivered to " in line]
    assert len(dropped) == 4, lines
    # the log names the receiver without its path (Slack's and Teams' paths are secrets)
    assert all(f"http://127.0.0.1:{dead.server.server_address[1]}/…" in line and "/hook" not in line for line in dropped)
    assert any(re.search(r"delivered to http://127.0.0.1:\d+/… after [12] failed tries", line) for line in lines), lines


@pytest.mark.parametrize("hooks, words", [
    ([{"url": "ftp://example.org/x"}], "needs a 'url' that starts with http:// or https://"),
    ([{"format": "json"}], "needs a 'url'"),
    ([{"url": "https://example.org/x", "format": "email"}], "alert_webhooks[0]: 'format' must be 'json', 'slack' or 'teams', got 'email'"),
    ([{"url": "https://example.org/x", "secret": "s"}], "unknown key(s) 'secret'"),
])
def test_a_bad_webhook_in_the_config_is_refused_in_words(tmp_path, hooks, words):
    from jupyter_gpulease.broker.app import GPULeaseBroker

    c = Config()
    c.GPULeaseBroker.alert_webhooks = hooks
    c.GPULeaseBroker.config_file = ""
    c.GPULeaseBroker.db_url = f"sqlite:///{tmp_path / 'b.sqlite'}"
    with pytest.raises(TraitError) as e:
        GPULeaseBroker(config=c).initialize([], build_manager=False)
    assert words in str(e.value)


def test_queue_wait_p95_and_unleased_use_are_alerted_from_the_broker_memory(tmp_path, monkeypatch):
    patch_auth(monkeypatch)
    clock = ManualClock()

    async def main():
        app = make_broker(tmp_path, clock, alert_webhooks=[{"url": "http://127.0.0.1:9/x"}], alert_queue_wait_p95_s=600, alert_retry_s=0)
        await app.start_async()
        try:
            alice, bob = BrokerClient(broker_url(app), "alice"), BrokerClient(broker_url(app), "bob")
            await alice.request_lease({"gpus": 2, "model": "A100*"})
            await bob.request_lease({"gpus": 1, "model": "A100*"})
            clock.advance(601)
            names = {a.name for a in await app.alerts.check()}
            assert "GPULeaseQueueWaitHigh" in names
            # a process on an L4 nobody leases (the simulated driver lists it; the broker reads its owner from /proc)
            import os

            l4 = next(g.uuid for g in app.manager.inventory() if g.model == "L4")
            app.backend.add_process(l4, os.getpid(), 1024, 50)
            await app.unleased.check()
            unleased = [a for a in await app.alerts.check() if a.name == "GPULeaseUnleasedUse"]
            assert len(unleased) == 1 and unleased[0].labels["uuid"] == l4 and "1 process(es) use GPU" in unleased[0].summary
        finally:
            await app.stop_async()

    asyncio.run(main())


def test_p95_and_payload_words():
    assert p95([]) is None
    assert p95([5.0]) == 5.0
    assert p95([float(i) for i in range(1, 101)]) == 95.0
    a = Alert("GPULeaseGPUHot", "GPU-1", "warning", "GPU 0 (L4) on n1 is at 86 °C; it slows down at 90 °C", {"uuid": "GPU-1"})
    assert payload("slack", a, "firing", started=0.0, ended=None, link="") == {"text": "[FIRING] GPULeaseGPUHot: GPU 0 (L4) on n1 is at 86 °C; it slows down at 90 °C"}
    assert "potentialAction" not in payload("teams", a, "firing", started=0.0, ended=None, link="")
    assert payload("json", a, "resolved", started=0.0, ended=60.0, link="x")["ends_at"] == "1970-01-01T00:01:00Z"
