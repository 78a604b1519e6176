"""Alerts as webhooks, for admins without Prometheus: the broker checks the same conditions as
the shipped Prometheus rules (``config/gpulease-alerts.yml``) on what it holds, and POSTs each
alert when it starts firing and when it resolves.

The checks (every ``GPULeaseBroker.alert_check_interval`` seconds, on the loop, from memory):

==========================  ==============================================================
``GPULeaseIdleLease``       an active lease's GPUs idle for ``alert_idle_lease_s``
``GPULeaseGPUHot``          a GPU within ``alert_hot_margin_c`` of its own slowdown threshold
``GPULeaseCriticalXID``     a new XID error of the device kind (not the application's), for
                            ``alert_xid_window_s`` after the last one
``GPULeaseDeviceUnhealthy`` a GPU its device backend or the broker's sample reports unhealthy
``GPULeaseDeviceCordoned``  a GPU that takes no new grants (cordoned or draining)
``GPULeaseQueueWaitHigh``   the 95th percentile of the waits (ended in the last 30 min, and
                            those still waiting) over ``alert_queue_wait_p95_s``
``GPULeaseUnleasedUse``     a process uses a GPU without a lease
==========================  ==============================================================

The broker cannot report its own death: that one (``GPULeaseBrokerDown``) needs Prometheus or
another watcher.

Each webhook (``GPULeaseBroker.alert_webhooks``) has a URL and a format: ``json`` (the alert as
an object: status, name, severity, summary, labels, times, the admin page's link), ``slack``
(``{"text": ...}`` with a Slack link; Mattermost and Rocket.Chat read it too) or ``teams`` (a
Microsoft Teams message card with a button to the admin page). A delivery that fails (a
connection error or a status other than 2xx) is tried again with exponential back-off and
jitter (``jupyterhub.utils.exponential_backoff``) for ``alert_retry_s`` seconds, then dropped
with a warning in the log; deliveries run in the background and never hold up the loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest

from ..core.events import GRANTED
from ..core.lease import lease_idle_s
from ..core.model import LeaseState
from ..core.text import format_duration
from .metrics import backend_healthy, cordons

log = logging.getLogger(__name__)

FORMATS = ("json", "slack", "teams")
QUEUE_WINDOW_S = 1800.0  # the waits that ended in the last half hour count for the p95
SEVERITY_COLOR = {"critical": "D32F2F", "warning": "F9A825", "info": "1976D2"}


@dataclass(frozen=True)
class Alert:
    """One firing condition. ``key`` tells it apart from others of the same name (a device, a lease)."""

    name: str
    key: str
    severity: str
    summary: str
    labels: dict[str, str] = field(default_factory=dict)


@dataclass
class Thresholds:
    idle_lease_s: float = 7200.0
    hot_margin_c: float = 5.0
    xid_window_s: float = 600.0
    queue_wait_p95_s: float = 1800.0


def p95(values: list[float]) -> float | None:
    """The 95th percentile (nearest rank), None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


def evaluate(manager, limits: Thresholds, now: float, *, recent_waits: list[float] = (), xid_since: dict[str, float] | None = None,
             telemetry=None, health=None, unleased=None) -> list[Alert]:
    """Every alert that fires now, from the broker's memory (pure but for reading ``manager``
    and, where the broker runs them, its device ``telemetry``, GPU ``health`` keeper and
    ``unleased``-use detector).

    ``recent_waits``: seconds waited by leases whose wait ended in the last half hour;
    ``xid_since``: device uuid -> broker time of its last new device-kind XID."""
    out: list[Alert] = []
    inventory = manager.inventory()
    gpus = {g.uuid: g for g in inventory}
    sound = backend_healthy(health)
    live = list(manager.committed.values())
    for d in live:
        idle = lease_idle_s(d, now)
        if idle is not None and idle >= limits.idle_lease_s:
            slices = (d.get("placement") or {}).get("slices") or [{}]
            gpus_of = f"{len(slices)} × {slices[0].get('model', 'GPU')}"
            out.append(Alert("GPULeaseIdleLease", d["id"], "warning",
                             f"{d['user']}'s lease {d['id'][:8]} ({gpus_of} on {slices[0].get('node', '?')}) has sat idle for {format_duration(idle)}",
                             {"lease": d["id"], "user": d["user"], "tier": d["tier"]}))
    samples = telemetry.current() if telemetry is not None else {}
    for uuid, s in sorted(samples.items()):
        g = gpus.get(uuid)
        if g is None or s.parent_uuid:
            continue
        where = {"uuid": uuid, "node": g.node, "model": g.model}
        name = f"GPU {g.index} ({g.model}) on {g.node}"
        slow = getattr(s, "temperature_slowdown_c", None)
        if s.temperature_c is not None and slow is not None and s.temperature_c >= slow - limits.hot_margin_c:
            severity = "critical" if s.temperature_c >= slow else "warning"
            out.append(Alert("GPULeaseGPUHot", uuid, severity, f"{name} is at {s.temperature_c:.0f} °C; it slows down at {slow:.0f} °C", where))
        if not s.health.ok and sound.get(uuid, g.healthy):
            out.append(Alert("GPULeaseDeviceUnhealthy", uuid, "critical", f"{name}: {s.health.message()}", where))
    for g in gpus.values():
        if not sound.get(g.uuid, g.healthy):
            out.append(Alert("GPULeaseDeviceUnhealthy", g.uuid, "critical", f"GPU {g.index} ({g.model}) on {g.node} is reported unhealthy by the device backend",
                             {"uuid": g.uuid, "node": g.node, "model": g.model}))
    for uuid, reason in sorted(cordons(health, inventory).items()):
        g = gpus.get(uuid)
        if g is not None:
            out.append(Alert("GPULeaseDeviceCordoned", uuid, "warning", f"GPU {g.index} ({g.model}) on {g.node} takes no new leases: {reason}",
                             {"uuid": uuid, "node": g.node, "model": g.model}))
    for uuid, at in sorted((xid_since or {}).items()):
        g = gpus.get(uuid)
        if g is not None and now - at <= limits.xid_window_s:
            code = ""
            if telemetry is not None:
                codes = [c for (u, c) in telemetry.xids if u == uuid]
                code = f" (XID {codes[-1]})" if codes else ""
            out.append(Alert("GPULeaseCriticalXID", uuid, "critical", f"GPU {g.index} ({g.model}) on {g.node} reported a critical XID error{code}",
                             {"uuid": uuid, "node": g.node, "model": g.model}))
    waits = list(recent_waits) + [max(0.0, now - d["created_at"]) for d in live if d["state"] == LeaseState.QUEUED.value]
    q = p95(waits)
    if q is not None and q > limits.queue_wait_p95_s:
        out.append(Alert("GPULeaseQueueWaitHigh", "queue", "warning",
                         f"95% of the waits in the queue are under {format_duration(q)}, over the limit of {format_duration(limits.queue_wait_p95_s)} "
                         f"({len(waits)} waits in the last {format_duration(QUEUE_WINDOW_S)})", {}))
    by_gpu: dict[str, list[dict]] = {}
    for f in unleased.findings if unleased is not None else ():
        by_gpu.setdefault(str(f.get("gpu_uuid", "")), []).append(f)
    for uuid, found in sorted(by_gpu.items()):
        g = gpus.get(uuid)
        where = f"GPU {g.index} ({g.model}) on {g.node}" if g is not None else uuid
        owners = sorted({str(f.get("owner") or f.get("unix_user") or f.get("uid") or "?") for f in found})
        out.append(Alert("GPULeaseUnleasedUse", uuid, "warning", f"{len(found)} process(es) use {where} without a lease (owner: {', '.join(owners)})",
                         {"uuid": uuid, **({"node": g.node, "model": g.model} if g is not None else {})}))
    return out


# ---------------------------------------------------------------------- payloads
def _iso(t: float | None) -> str | None:
    return None if t is None else datetime.fromtimestamp(t, UTC).isoformat().replace("+00:00", "Z")


def payload(fmt: str, alert: Alert, status: str, *, started: float, ended: float | None, link: str) -> dict[str, Any]:
    """The body of one delivery in format ``fmt`` (see the module doc)."""
    firing = status == "firing"
    head = f"[{'FIRING' if firing else 'RESOLVED'}] {alert.name}"
    if fmt == "slack":
        text = f"{head}: {alert.summary}"
        if not firing:
            text += f" (resolved after {format_duration((ended or started) - started)})"
        if link:
            text += f" · <{link}|admin page>"
        return {"text": text}
    if fmt == "teams":
        card: dict[str, Any] = {
            "@type": "MessageCard",
            "@context": "https://schema.org/extensions",
            "summary": f"{head}: {alert.summary}"[:200],
            "themeColor": SEVERITY_COLOR.get(alert.severity, "1976D2") if firing else "2E7D32",
            "title": head,
            "text": alert.summary,
        }
        if link:
            card["potentialAction"] = [{"@type": "OpenUri", "name": "Open the admin page", "targets": [{"os": "default", "uri": link}]}]
        return card
    return {
        "status": status,
        "alert": alert.name,
        "key": alert.key,
        "severity": alert.severity,
        "summary": alert.summary,
        "labels": dict(alert.labels),
        "starts_at": _iso(started),
        "ends_at": _iso(ended),
        "admin_url": link,
    }


class BrokerAlerts:
    """Checks and delivers (see the module doc). Reads the ``manager`` and, where the broker runs
    them (None: not), its device ``telemetry``, GPU ``health`` keeper and ``unleased``-use
    detector; hears of grants through :meth:`on_events` (a listener of the manager's commits)."""

    def __init__(self, manager, webhooks: list[dict[str, str]], *, limits: Thresholds | None = None, link: str = "",
                 retry_s: float = 300.0, logger: logging.Logger | None = None, telemetry=None, health=None, unleased=None):
        self.manager = manager
        self.telemetry = telemetry
        self.health = health
        self.unleased = unleased
        self.webhooks = [dict(w) for w in webhooks]
        self.limits = limits or Thresholds()
        self.link = link
        self.retry_s = float(retry_s)
        self.log = logger or log
        self.firing: dict[tuple[str, str], tuple[Alert, float]] = {}
        self.delivered = 0
        self.failed = 0
        self._sending: set[asyncio.Task] = set()
        self._waits: deque[tuple[float, float]] = deque()  # (when the wait ended, seconds waited)
        self._xid_since: dict[str, float] = {}
        self._xid_counts: dict[str, float] = {}

    def on_events(self, written, events) -> None:
        """A listener of the manager's commits: the waits that ended in a grant."""
        for e in events:
            if e.kind == GRANTED:
                w = e.data.get("waited_s")
                lease = getattr(e, "lease", None)
                if w is None and lease is not None:
                    w = e.time - lease.created_at
                if w is not None:
                    self._waits.append((e.time, float(w)))

    def _new_xids(self, now: float) -> None:
        telemetry = self.telemetry
        if telemetry is None:
            return
        from .telemetry import xid_kind

        counts: dict[str, float] = {}
        for (uuid, code), n in telemetry.xids.items():
            if xid_kind(code) == "device":
                counts[uuid] = counts.get(uuid, 0.0) + n
        for uuid, n in counts.items():
            if n > self._xid_counts.get(uuid, 0.0):
                self._xid_since[uuid] = now
        self._xid_counts = counts

    async def check(self) -> list[Alert]:
        """One check: deliver what started firing and what resolved; the alerts firing now."""
        now = self.manager.now()
        while self._waits and self._waits[0][0] < now - QUEUE_WINDOW_S:
            self._waits.popleft()
        self._new_xids(now)
        alerts = evaluate(self.manager, self.limits, now, recent_waits=[w for _, w in self._waits], xid_since=self._xid_since,
                          telemetry=self.telemetry, health=self.health, unleased=self.unleased)
        current = {(a.name, a.key): a for a in alerts}
        for k, a in current.items():
            if k not in self.firing:
                self.firing[k] = (a, now)
                self.log.warning("Alert %s: %s", a.name, a.summary)
                self._deliver(a, "firing", now, None)
        for k in [k for k in self.firing if k not in current]:
            a, started = self.firing.pop(k)
            self.log.info("Alert resolved %s: %s", a.name, a.summary)
            self._deliver(a, "resolved", started, now)
        return alerts

    def _deliver(self, alert: Alert, status: str, started: float, ended: float | None) -> None:
        for hook in self.webhooks:
            body = payload(hook.get("format", "json"), alert, status, started=started, ended=ended, link=self.link)
            task = asyncio.ensure_future(self._post(hook["url"], body, alert))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _post(self, url: str, body: dict[str, Any], alert: Alert) -> None:
        from jupyterhub.utils import exponential_backoff

        data = json.dumps(body).encode()
        errors: list[str] = []

        async def attempt() -> bool:
            req = HTTPRequest(url, method="POST", body=data, headers={"Content-Type": "application/json"}, request_timeout=10, connect_timeout=5)
            try:
                await AsyncHTTPClient().fetch(req)
                return True
            except HTTPClientError as e:
                errors.append(f"HTTP {e.code}")
            except (TimeoutError, OSError) as e:
                errors.append(str(e) or type(e).__name__)
            return False

        started = time.monotonic()
        try:
            await exponential_backoff(attempt, f"alert {alert.name} not delivered to {url}", start_wait=1.0, max_wait=60.0, timeout=self.retry_s)
        except TimeoutError:
            self.failed += 1
            self.log.warning("Alert %s not delivered to %s after %d tries in %.0f s (last: %s); dropped", alert.name, _safe(url), len(errors),
                             time.monotonic() - started, errors[-1] if errors else "?")
            return
        self.delivered += 1
        if errors:
            self.log.info("Alert %s delivered to %s after %d failed tries", alert.name, _safe(url), len(errors))

    async def close(self, timeout: float = 2.0) -> None:
        """Give deliveries in flight ``timeout`` seconds, then cancel them."""
        tasks = [t for t in self._sending if not t.done()]
        if tasks:
            _done, pending = await asyncio.wait(tasks, timeout=timeout)
            for t in pending:
                t.cancel()


def _safe(url: str) -> str:
    """A webhook URL without its path (Slack's and Teams' paths are secrets)."""
    from urllib.parse import urlsplit

    p = urlsplit(url)
    return f"{p.scheme}://{p.netloc}/…" if p.path not in ("", "/") else url
