"""The Grafana dashboard (config/grafana-dashboard.json): every query of every panel runs in a
real Prometheus that scraped a real broker, without an error, and answers with data.

The broker runs on simulated GPUs with a clock the test moves, and goes through what the
dashboard shows: leases held and waiting, a wait that ends in a grant, a lease that ends, an
idle lease, a hot GPU and a critical XID. Grafana's own variables are replaced as Grafana
would (``$__rate_interval``, ``$__range``); a variable the test does not know fails it.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from brokerutil import ManualClock, broker_in_thread, patch_auth
from hubharness import wait_for
from jupyter_gpulease.client import BrokerClient
from test_alertmanager_e2e import PROMETHEUS, need
from test_broker_prometheus import Prometheus

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "config" / "grafana-dashboard.json"
GRAFANA_VARS = {"$__rate_interval": "1m", "$__range": "5m", "$__interval": "15s"}

pytestmark = pytest.mark.timeout(180)


def panels(dash: dict) -> list[dict]:
    out = []
    for p in dash["panels"]:
        out.append(p)
        out += p.get("panels", [])
    return out


def queries(dash: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL with Grafana's variables replaced) of every target."""
    out = []
    for p in panels(dash):
        for t in p.get("targets", ()):
            expr = t["expr"]
            for var, v in GRAFANA_VARS.items():
                expr = expr.replace(var, v)
            assert "$" not in expr, f"panel {p['title']!r}: a variable the test does not know in {t['expr']!r}"
            out.append((p["title"], expr))
    return out


def test_the_dashboard_is_grafana_json_with_the_four_sections():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "gpulease" and dash["title"]
    rows = [p["title"] for p in dash["panels"] if p["type"] == "row"]
    assert rows == ["Pool", "Queue", "Users", "Health"]
    ids = [p["id"] for p in panels(dash)]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    for p in panels(dash):
        if p["type"] != "row":
            # every panel reads the dashboard's Prometheus data source variable
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
            assert p["targets"], p["title"]
            g = p["gridPos"]
            assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
    assert {v["name"] for v in dash["templating"]["list"]} == {"datasource"}
    assert len(queries(dash)) >= 30


def query(prom: Prometheus, path: str, params: dict) -> dict:
    with urllib.request.urlopen(f"{prom.url}/api/v1/{path}?" + urllib.parse.urlencode(params), timeout=10) as r:
        return json.load(r)


def test_every_dashboard_query_answers_with_data_from_a_real_broker(tmp_path, monkeypatch):
    need(PROMETHEUS, "prometheus")
    patch_auth(monkeypatch)
    clock = ManualClock()
    dash = json.loads(DASHBOARD.read_text())
    prom = None
    with broker_in_thread(tmp_path, clock=clock, device_sample_interval=1.0) as app:
        try:
            base = app.bind_url.rstrip("/")
            prom = Prometheus(tmp_path, {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "scrape_configs": [{"job_name": "gpulease", "metrics_path": app.base_url + "metrics",
                                    "authorization": {"type": "token", "credentials": "prometheus"},
                                    "static_configs": [{"targets": [base.split("//", 1)[1]]}]}],
            })
            alice, bob = (BrokerClient(base + app.base_url, u) for u in ("alice", "bob"))

            async def scenario():
                held = await alice.request_lease({"gpus": 2, "model": "A100*", "duration_s": 4 * 3600})
                waiting = await bob.request_lease({"gpus": 1, "model": "A100*"})
                assert (held["state"], waiting["state"]) == ("active", "queued")
                await asyncio.sleep(2)  # a few scrapes with bob in the queue
                clock.advance(90)
                await alice.release(held["id"])  # bob is granted after 90 s in the queue
                small = await alice.request_lease({"gpus": 1, "model": "L4"})
                assert small["state"] == "active"
                await alice.heartbeat(small["id"], {"t": 10.0, "gpu_busy": False, "last_gpu_activity": 4.0, "devices": {}})
                return small

            small = asyncio.run(scenario())
            gpu = small["placement"]["slices"][0]["gpu_uuid"]
            app.backend.set_device(gpu, temperature_c=84.0)
            other = next(g.uuid for g in app.manager.inventory() if g.model == "L4" and g.uuid != gpu)
            app.backend.inject_xid(other, 79)
            wait_for(lambda: prom.values('gpulease_grants_total') == [3], 60, f"Prometheus never saw the third grant:\n{prom.log_tail()}", interval=0.5)
            wait_for(lambda: prom.values('gpulease_device_xid_errors_total{xid="79"}') == [1], 60, "Prometheus never saw the XID", interval=0.5)
            time.sleep(3)  # a few more scrapes: every rate has two samples of what changed

            failures, empty = [], []
            now = time.time()
            for title, expr in queries(dash):
                instant = query(prom, "query", {"query": expr})
                ranged = query(prom, "query_range", {"query": expr, "start": now - 60, "end": now, "step": "5"})
                for reply in (instant, ranged):
                    if reply["status"] != "success" or reply.get("warnings"):
                        failures.append(f"{title}: {expr}: {reply}")
                if not instant["data"]["result"]:
                    empty.append(f"{title}: {expr}")
            assert not failures, "queries that Prometheus refused:\n" + "\n".join(failures)
            assert not empty, "queries without data although the broker has it:\n" + "\n".join(empty)

            # a few answers checked for what they say
            assert prom.values('sum(gpulease_gpus_total)') == [4]
            idle = query(prom, "query", {"query": "topk(10, gpulease_lease_idle_seconds)"})["data"]["result"]
            assert [r["metric"]["lease"] for r in idle] == [small["id"]]
            problem = query(prom, "query", {"query": next(e for t, e in queries(dash) if t == "Devices with a problem")})["data"]["result"]
            assert {r["metric"]["uuid"] for r in problem} == {other}
            headroom = {r["metric"]["uuid"]: float(r["value"][1]) for r in query(prom, "query", {"query": next(
                e for t, e in queries(dash) if t == "Headroom to the slowdown threshold")})["data"]["result"]}
            assert headroom[gpu] == 6.0  # 84 °C against the simulated card's 90
        finally:
            if prom is not None:
                prom.stop()

