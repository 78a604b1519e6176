"""Prometheus metrics of the broker.

Everything is read at scrape time by one collector, from what the broker already holds in
memory: the manager's committed leases (gauges by state, tier, group and model; the queue; the
pool's devices and what the holders' heartbeats said about them) and the manager's counter
totals. Nothing is updated per call: a scrape walks the live leases once on
the event loop (:meth:`BrokerMetrics.render`) and writes the text in a thread.

Counters (requests, grants, ends by reason, the queue-wait histogram) are *durable*: the
manager counts each committed batch of events with :func:`count_events` (the app hands it
the function) and writes the
increments in the same transaction as the events (the store's ``metric_totals`` table). A
broker that takes over after a fail-over loads the totals and continues every series, with its
first ``_created`` time, so Prometheus sees no reset.

Cardinality is bounded by the configuration, never by traffic: tiers, the pool's models and
devices, the hub's groups (a lease counts under its user's first group, or "none"), and fixed
sets of end reasons and wait outcomes. Per-user series exist only when an admin switches them
on (``GPULeaseBroker.metrics_per_user``): one series per user who holds or waits for a lease.
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter as _Tally
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.samples import Sample

from ..core.events import ENDED, GRANTED, REQUESTED, Event
from ..core.lease import lease_idle_s  # the one measure of an idle lease, the idle culler's hook's too
from ..core.model import LeaseState
from ..core.unleased import UNLEASED_STOP, UNLEASED_USE

WAIT_BUCKETS = (1, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200, 14400, 28800, 86400)
_BUCKET_NAMES = (*(str(float(b)) for b in WAIT_BUCKETS), "+Inf")

# why a lease ended: a fixed set (the ``reason`` label of gpulease_ends_total)
END_REASONS = {
    "released": "the holder gave it back",
    "server_stopped": "the spawner (a hub service) ended it: its server stopped or did not start",
    "expired": "its time ran out",
    "reclaimed": "taken back because its GPUs sat idle",
    "preempted": "taken back for a waiting higher-tier request",
    "revoked": "ended by an admin",
    "heartbeat_lost": "its server stopped sending heartbeats",
    "unconfirmed": "its server never confirmed the grant",
    "server_gone": "the hub says its server is not running",
    "withdrawn": "left the queue: withdrawn by its requester",
    "wait_limit": "left the queue: not granted within its wait limit",
    "failed": "could not be honoured (its GPUs left the pool, or it can no longer be granted)",
    "other": "any other end",
}
# whose process used a GPU without a lease, and how stopping one went (the unleased-use series)
UNLEASED_OWNERS = ("hub_user", "not_hub_user")
STOP_OUTCOMES = ("stopped", "not_stopped")
# how a wait in the queue ended: the ``outcome`` label of gpulease_wait_seconds
WAIT_OUTCOMES = ("granted", "withdrawn", "timed_out", "failed")
NO_GROUP = "none"
MIB = 1024 * 1024


def end_reason(state: str, actor: str = "", reason: str = "") -> str:
    """The ``reason`` label of a lease that ended in ``state``, ended by ``actor`` (see END_REASONS)."""
    if state == LeaseState.RELEASED.value:
        return "server_stopped" if actor.startswith("service:") else "released"
    if state == LeaseState.REVOKED.value:
        if actor == "broker" and reason.startswith("never confirmed"):
            return "unconfirmed"
        if actor == "broker" and reason.startswith("its holder stopped sending heartbeats"):
            return "heartbeat_lost"
        if actor == "broker:reconcile":
            return "server_gone"
        return "revoked"
    if state == LeaseState.WITHDRAWN.value:
        return "wait_limit" if actor == "broker" else "withdrawn"
    if state in END_REASONS:
        return state
    return "other"


def wait_outcome(state: str, actor: str = "") -> str:
    """The ``outcome`` label of a wait in the queue that ended with the lease going to ``state``."""
    if state == LeaseState.ACTIVE.value:
        return "granted"
    if state == LeaseState.WITHDRAWN.value:
        return "timed_out" if actor == "broker" else "withdrawn"
    return "failed"


def count_events(events: Iterable[Event]) -> dict[tuple[str, tuple[str, ...]], float]:
    """The increments of the counter totals that ``events`` make: (name, label values) -> amount.

    Names: ``requests`` (tier), ``grants`` (tier), ``ends`` (state, reason, tier) and the wait
    histogram as ``wait_bucket`` (tier, outcome, le; not cumulative), ``wait_sum`` and
    ``wait_count`` (tier, outcome). Pure: the manager runs it before the commit.
    """
    out: dict[tuple[str, tuple[str, ...]], float] = {}

    def add(name: str, labels: tuple[str, ...], n: float = 1.0) -> None:
        key = (name, labels)
        out[key] = out.get(key, 0.0) + n

    def waited(tier: str, outcome: str, seconds: float) -> None:
        seconds = max(0.0, float(seconds))
        le = next((name for b, name in zip(WAIT_BUCKETS, _BUCKET_NAMES) if seconds <= b), "+Inf")
        add("wait_bucket", (tier, outcome, le))
        add("wait_sum", (tier, outcome), seconds)
        add("wait_count", (tier, outcome))

    for e in events:
        lease = getattr(e, "lease", None)
        tier = lease.tier if lease is not None else str(e.data.get("tier", ""))
        if e.kind == REQUESTED:
            add("requests", (tier,))
        elif e.kind == GRANTED:
            add("grants", (tier,))
            w = e.data.get("waited_s")
            if w is None and lease is not None:
                w = e.time - lease.created_at
            waited(tier, "granted", w or 0.0)
        elif e.kind == ENDED:
            add("ends", (e.to_state, end_reason(e.to_state, e.actor, e.reason), tier))
            if e.from_state == LeaseState.QUEUED.value and lease is not None:
                waited(tier, wait_outcome(e.to_state, e.actor), e.time - lease.created_at)
        elif e.kind == UNLEASED_USE:
            add("unleased_findings", (str(e.data.get("model", "")), "hub_user" if e.data.get("hub_user") else "not_hub_user"))
        elif e.kind == UNLEASED_STOP:
            outcome = (e.data.get("stop") or {}).get("outcome")
            add("unleased_stops", (str(e.data.get("model", "")), outcome if outcome in STOP_OUTCOMES else "not_stopped"))
    return out


def backend_healthy(health) -> dict[str, bool]:
    """Device uuid -> whether its device backend reports it healthy, from the broker's health
    keeper (broker/health.py; None: none runs). The scheduler's pool marks a cordoned GPU
    unhealthy too (no new grants); the health series keep the two apart."""
    return {g.uuid: g.healthy for g in health.raw} if health is not None else {}


def cordons(health, gpus) -> dict[str, str]:
    """Device uuid -> why it takes no new grants: its cordon (its own or its node's), from the
    broker's health keeper (broker/health.py; None: none runs), for the pool's ``gpus``."""
    if health is None:
        return {}
    out = {}
    for g in gpus:
        row = health.cordon_of(g)
        if row is not None:
            out[g.uuid] = str(row.get("reason") or row.get("mode") or "cordoned")
    return out


def _group(d: dict[str, Any]) -> str:
    groups = d.get("groups") or ()
    return str(groups[0]) if groups else NO_GROUP


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


class _BrokerCollector:
    """Every series of the broker, read at scrape time (see the module doc)."""

    def __init__(self, manager, *, per_user: bool = False, telemetry=None, health=None, unleased=None):
        self.manager = manager
        self.per_user = per_user
        self.telemetry = telemetry
        self.health = health
        self.unleased = unleased
        self._sampled: tuple[tuple, list] | None = None  # (the sample it was built from, the families)

    def collect(self):
        m = self.manager
        tiers = list(m.policy.tiers)
        live = list(m.committed.values())
        yield from self._leases(live, tiers)
        yield from self._queue(live, tiers, m.now())
        yield from self._pool(live)
        yield from self._device_figures()
        yield from self._lease_idle(live, m.now())
        yield from self._unleased()
        yield from self._counters(tiers)

        commits = CounterMetricFamily("gpulease_store_commits", "Transactions this broker process committed (restarts at a fail-over: see _created)")
        commits.add_metric([], m.commits, created=m.started_at or None)
        yield commits
        started = GaugeMetricFamily("gpulease_broker_start_time_seconds", "When the broker process now serving took over (Unix time)")
        started.add_metric([], m.started_at)
        yield started
        draining = GaugeMetricFamily("gpulease_draining", "1 while the broker grants no leases (drain mode)")
        draining.add_metric([], 1 if m.draining else 0)
        yield draining

    # ------------------------------------------------------------------ leases and GPUs held
    def _leases(self, live: list[dict[str, Any]], tiers: list[str]):
        by_tier: _Tally = _Tally()
        by_group: _Tally = _Tally()
        held_group: dict[tuple[str, str, str], float] = {}
        by_user: _Tally = _Tally()
        held_user: dict[tuple[str, str, str], float] = {}
        for d in live:
            state, tier, group = d["state"], d["tier"], _group(d)
            by_tier[(state, tier)] += 1
            by_group[(state, tier, group)] += 1
            if self.per_user:
                by_user[(state, tier, d["user"])] += 1
            if state == LeaseState.ACTIVE.value and d.get("placement"):
                for s in d["placement"]["slices"]:
                    share = float(s.get("share", 1))
                    k = (tier, s["model"], group)
                    held_group[k] = held_group.get(k, 0.0) + share
                    if self.per_user:
                        k = (tier, s["model"], d["user"])
                        held_user[k] = held_user.get(k, 0.0) + share

        leases = GaugeMetricFamily("gpulease_leases", "Live leases by state and tier", labels=["state", "tier"])
        for state in (LeaseState.QUEUED.value, LeaseState.ACTIVE.value):
            for tier in sorted(set(tiers) | {t for _, t in by_tier}):
                leases.add_metric([state, tier], by_tier.get((state, tier), 0))
        yield leases
        g = GaugeMetricFamily("gpulease_group_leases", "Live leases by state, tier and the user's first group ('none': no group)", labels=["state", "tier", "group"])
        for (state, tier, group), n in sorted(by_group.items()):
            g.add_metric([state, tier, group], n)
        yield g
        g = GaugeMetricFamily("gpulease_group_gpus_held", "GPUs held by active leases by tier, model and the user's first group (shares count by fraction)",
                              labels=["tier", "model", "group"])
        for (tier, model, group), n in sorted(held_group.items()):
            g.add_metric([tier, model, group], n)
        yield g
        if self.per_user:
            g = GaugeMetricFamily("gpulease_user_leases", "Live leases by state, tier and user (GPULeaseBroker.metrics_per_user)", labels=["state", "tier", "user"])
            for (state, tier, user), n in sorted(by_user.items()):
                g.add_metric([state, tier, user], n)
            yield g
            g = GaugeMetricFamily("gpulease_user_gpus_held", "GPUs held by active leases by tier, model and user (GPULeaseBroker.metrics_per_user)",
                                  labels=["tier", "model", "user"])
            for (tier, model, user), n in sorted(held_user.items()):
                g.add_metric([tier, model, user], n)
            yield g

    # ------------------------------------------------------------------ the queue
    def _queue(self, live: list[dict[str, Any]], tiers: list[str], now: float):
        waiting: _Tally = _Tally()
        oldest: dict[str, float] = {}
        for d in live:
            if d["state"] == LeaseState.QUEUED.value:
                t = d["tier"]
                waiting[t] += 1
                oldest[t] = min(oldest.get(t, d["created_at"]), d["created_at"])
        q = GaugeMetricFamily("gpulease_queue_length", "Leases waiting in the queue")
        q.add_metric([], sum(waiting.values()))
        yield q
        w = GaugeMetricFamily("gpulease_queue_waiting", "Leases waiting in the queue by tier", labels=["tier"])
        o = GaugeMetricFamily("gpulease_queue_oldest_wait_seconds", "How long the longest-waiting lease of the tier has waited so far (0: none waits)", labels=["tier"])
        for t in sorted(set(tiers) | set(waiting)):
            w.add_metric([t], waiting.get(t, 0))
            o.add_metric([t], max(0.0, now - oldest[t]) if t in oldest else 0.0)
        yield w
        yield o

    # ------------------------------------------------------------------ the pool's devices
    def _pool(self, live: list[dict[str, Any]]):
        gpus = self.manager.inventory()
        sound = backend_healthy(self.health)  # a cordon is not ill health: gpulease_device_cordoned says it
        models = _Tally(g.model for g in gpus)
        total = GaugeMetricFamily("gpulease_gpus_total", "GPUs in the pool by model", labels=["model"])
        unhealthy = GaugeMetricFamily("gpulease_gpus_unhealthy", "GPUs of the pool its device backend reports unhealthy, by model", labels=["model"])
        allocated = GaugeMetricFamily("gpulease_gpus_allocated", "GPUs held by active leases by model (shares count by fraction)", labels=["model"])
        held_model: dict[str, float] = dict.fromkeys(models, 0.0)
        held_gpu: dict[str, float] = {}
        # the newest heartbeat report of each device: (heartbeat time, figures)
        reports: dict[str, tuple[float, dict[str, Any]]] = {}
        for d in live:
            if d["state"] != LeaseState.ACTIVE.value or not d.get("placement"):
                continue
            for s in d["placement"]["slices"]:
                share = float(s.get("share", 1))
                held_model[s["model"]] = held_model.get(s["model"], 0.0) + share
                held_gpu[s["gpu_uuid"]] = held_gpu.get(s["gpu_uuid"], 0.0) + share
            usage = d.get("usage")
            devices = usage.get("devices") if isinstance(usage, dict) else None
            if isinstance(devices, dict):
                at = _number(d.get("last_heartbeat")) or 0.0
                for uuid, figures in devices.items():
                    if isinstance(figures, dict) and (uuid not in reports or reports[uuid][0] <= at):
                        reports[uuid] = (at, figures)
        for model, n in sorted(models.items()):
            total.add_metric([model], n)
            unhealthy.add_metric([model], sum(1 for g in gpus if g.model == model and not sound.get(g.uuid, g.healthy)))
        for model, n in sorted(held_model.items()):
            allocated.add_metric([model], n)
        yield total
        yield unhealthy
        yield allocated

        labels = ["uuid", "node", "model"]
        healthy = GaugeMetricFamily("gpulease_device_healthy", "1 while the device backend reports the GPU healthy, 0 when not (then nothing new is granted on it; a cordon: gpulease_device_cordoned)",
                                    labels=labels)
        held = GaugeMetricFamily("gpulease_device_held", "Share of the GPU held by active leases (0 to 1; a MIG instance counts by its share)", labels=labels)
        busy = GaugeMetricFamily("gpulease_device_busy_ratio", "Share of the time since the grant the holder's server saw the device busy (last heartbeat; GPU or MIG instance)",
                                 labels=labels)
        mem = GaugeMetricFamily("gpulease_device_memory_peak_bytes", "Peak memory used on the device since the grant (last heartbeat; GPU or MIG instance)", labels=labels)
        problem = GaugeMetricFamily("gpulease_device_health_problem", "1 when the holder's last heartbeat reported a driver problem with the device (XID, ECC, lost), else 0",
                                    labels=labels)
        known: dict[str, tuple[str, str]] = {}
        for g in gpus:
            key = [g.uuid, g.node, g.model]
            known[g.uuid] = (g.node, g.model)
            for mig in g.mig:
                known[mig.uuid] = (g.node, g.model)
            healthy.add_metric(key, 1 if sound.get(g.uuid, g.healthy) else 0)
            held.add_metric(key, min(1.0, held_gpu.get(g.uuid, 0.0)))
        # only devices of the pool: a heartbeat cannot add series
        for uuid, (_, figures) in sorted(reports.items()):
            if uuid not in known:
                continue
            key = [uuid, *known[uuid]]
            b, i = _number(figures.get("busy_s")), _number(figures.get("idle_s"))
            if b is not None and i is not None and b + i > 0:
                busy.add_metric(key, max(0.0, min(1.0, b / (b + i))))
            peak = _number(figures.get("mem_peak_mib"))
            if peak is not None:
                mem.add_metric(key, max(0.0, peak) * MIB)
            problem.add_metric(key, 1 if figures.get("health") else 0)
        yield from (healthy, held, busy, mem, problem)

    # ------------------------------------------------------------------ the broker's own device samples
    def _device_figures(self):
        """What the broker's device backend samples (broker/telemetry.py): utilization, memory,
        temperature against the card's own slowdown threshold, power, and XID errors as a
        counter. Backends that sample nothing on the broker's machine export none of these.

        These families change only with a new sample: they are built once per sample and the
        same objects are yielded by every scrape until the next (a scrape of a large pool stays
        cheap on the loop; see benchmarks/bench_metrics.py)."""
        telemetry = self.telemetry
        samples = telemetry.current() if telemetry is not None else {}
        key = (telemetry.sampled_at if telemetry is not None else None, bool(samples), len(self.manager.scheduler.inventory))
        if self._sampled is None or self._sampled[0] != key:
            self._sampled = (key, list(self._sampled_families(telemetry, samples)))
        yield from self._sampled[1]
        yield from self._availability()

    def _sampled_families(self, telemetry, samples: dict[str, Any]):
        labels = ["uuid", "node", "model"]
        util = GaugeMetricFamily("gpulease_device_utilization_ratio", "Compute utilization of the device over the driver's last sample period (0 to 1; GPU or MIG instance)", labels=labels)
        used = GaugeMetricFamily("gpulease_device_memory_used_bytes", "Memory used on the device now (GPU or MIG instance)", labels=labels)
        total = GaugeMetricFamily("gpulease_device_memory_total_bytes", "Memory of the device (GPU or MIG instance)", labels=labels)
        temp = GaugeMetricFamily("gpulease_device_temperature_celsius", "GPU core temperature", labels=labels)
        slowdown = GaugeMetricFamily("gpulease_device_slowdown_temperature_celsius",
                                     "The card's own slowdown threshold (NVML): at or above it the driver slows the clocks", labels=labels)
        power = GaugeMetricFamily("gpulease_device_power_watts", "Power draw of the GPU", labels=labels)
        limit = GaugeMetricFamily("gpulease_device_power_limit_watts", "Power limit the driver enforces on the GPU", labels=labels)
        driver_ok = GaugeMetricFamily("gpulease_device_driver_healthy",
                                      "1 while the broker's own sample of the GPU shows no problem (lost, a critical XID since its last reset, uncorrectable ECC), else 0", labels=labels)
        xids = CounterMetricFamily("gpulease_device_xid_errors", "Critical XID errors the driver reported, by device, XID code and kind "
                                   "(application: the holder's program faulted, the GPU is fine; device: the GPU or its driver)", labels=[*labels, "xid", "kind"])
        known: dict[str, tuple[str, str]] = {}
        for g in self.manager.inventory():
            known[g.uuid] = (g.node, g.model)
            for mig in g.mig:
                known[mig.uuid] = (g.node, g.model)
        for uuid, s in sorted(samples.items()):
            if uuid not in known:
                continue
            key = [uuid, *known[uuid]]
            whole = not s.parent_uuid  # an instance repeats its GPU's temperature, power and health
            for fam, raw, scale in ((util, s.utilization_pct, 0.01), (used, s.memory_used_mib, MIB), (total, s.memory_total_mib, MIB)):
                v = _number(raw)
                if v is not None:
                    fam.add_metric(key, max(0.0, v) * scale)
            if not whole:
                continue
            for fam, raw in ((temp, s.temperature_c), (slowdown, s.temperature_slowdown_c), (power, s.power_w), (limit, s.power_limit_w)):
                v = _number(raw)
                if v is not None:
                    fam.add_metric(key, v)
            driver_ok.add_metric(key, 1 if s.health.ok else 0)
        if telemetry is not None:
            from .telemetry import xid_kind

            for (uuid, code), n in sorted(telemetry.xids.items()):
                if uuid in known:
                    xids.add_metric([uuid, *known[uuid], str(code), xid_kind(code)], n, created=telemetry.started_at)
        yield from (util, used, total, temp, slowdown, power, limit, driver_ok, xids)

    def _availability(self):
        """What takes a device out of new grants besides its health: a cordon, a maintenance window."""
        labels = ["uuid", "node", "model"]
        cordoned = GaugeMetricFamily("gpulease_device_cordoned", "1 while the GPU takes no new leases because it is cordoned or draining (the admin page says why), else 0",
                                     labels=labels)
        maintenance = GaugeMetricFamily("gpulease_device_in_maintenance", "1 while a maintenance window of the GPU is under way, else 0", labels=labels)
        upcoming = GaugeMetricFamily("gpulease_device_next_maintenance_start_seconds", "When the next maintenance window of the GPU begins (Unix time; no series: none)",
                                     labels=labels)
        gpus = self.manager.inventory()
        out = cordons(self.health, gpus)
        now = self.manager.now()
        windows_on = self.manager.scheduler.windows_on
        for g in gpus:
            key = [g.uuid, g.node, g.model]
            cordoned.add_metric(key, 1 if g.uuid in out else 0)
            ws = windows_on(g.uuid, now)
            maintenance.add_metric(key, 1 if ws and ws[0].start <= now else 0)
            if ws:
                upcoming.add_metric(key, ws[0].start)
        yield from (cordoned, maintenance, upcoming)

    # ------------------------------------------------------------------ idle leases
    def _lease_idle(self, live: list[dict[str, Any]], now: float):
        idle = GaugeMetricFamily("gpulease_lease_idle_seconds", "How long the GPUs of an active lease have sat idle, as its server's heartbeats say "
                                 "(0 while it computes; no series before the first heartbeat)", labels=["lease", "tier", "model", "node", *(["user"] if self.per_user else [])])
        for d in live:
            v = lease_idle_s(d, now)
            if v is None:
                continue
            slices = (d.get("placement") or {}).get("slices") or [{}]
            labels = [d["id"], d["tier"], str(slices[0].get("model", "")), str(slices[0].get("node", ""))]
            idle.add_metric([*labels, *([d["user"]] if self.per_user else [])], v)
        yield idle

    # ------------------------------------------------------------------ unleased GPU use
    def _unleased(self):
        procs = GaugeMetricFamily("gpulease_unleased_processes", "Processes using a GPU (or MIG instance) their owner does not lease, by the GPU's model",
                                  labels=["model"])
        mem = GaugeMetricFamily("gpulease_unleased_memory_bytes", "GPU memory held by processes without a lease, by the GPU's model (as the driver reports it)",
                                labels=["model"])
        count: _Tally = _Tally()
        held: dict[str, float] = {}
        for d in self.unleased.findings if self.unleased is not None else ():
            count[d["model"]] += 1
            held[d["model"]] = held.get(d["model"], 0.0) + max(0.0, _number(d.get("used_memory_mib")) or 0.0) * MIB
        for model in sorted({g.model for g in self.manager.inventory()} | set(count)):
            procs.add_metric([model], count.get(model, 0))
            mem.add_metric([model], held.get(model, 0.0))
        yield procs
        yield mem

    # ------------------------------------------------------------------ durable counters
    def _counters(self, tiers: list[str]):
        totals = self.manager.totals
        requests = CounterMetricFamily("gpulease_requests", "Leases requested", labels=["tier"])
        grants = CounterMetricFamily("gpulease_grants", "Leases granted", labels=["tier"])
        ends = CounterMetricFamily("gpulease_ends", "Leases ended, by final state and why (reason: " + ", ".join(END_REASONS) + ")", labels=["state", "reason", "tier"])
        findings = CounterMetricFamily("gpulease_unleased_findings", "Processes found using a GPU their owner does not lease, by the GPU's model and "
                                       "whose (owner: " + ", ".join(UNLEASED_OWNERS) + ")", labels=["model", "owner"])
        stops = CounterMetricFamily("gpulease_unleased_stops", "Processes of unleased GPU use the broker stopped, or could not (outcome: "
                                    + ", ".join(STOP_OUTCOMES) + "), by the GPU's model", labels=["model", "outcome"])
        families = {"requests": requests, "grants": grants, "ends": ends, "unleased_findings": findings, "unleased_stops": stops}
        # usage records (broker/usage.py): GPU-seconds held and busy, in GPU-equivalents (a share or MIG slice: its fraction)
        usage = {
            "usage_held": CounterMetricFamily("gpulease_usage_held_gpu_seconds", "GPU-seconds held by leases (a share or MIG instance counts its "
                                              "fraction), by the group the hours count to and the GPU model", labels=["group", "model"]),
            "usage_busy": CounterMetricFamily("gpulease_usage_busy_gpu_seconds", "GPU-seconds of held GPUs that were busy (as the servers' idle rule "
                                              "counts it), by group and model", labels=["group", "model"]),
        }
        if self.per_user:
            usage["usage_user_held"] = CounterMetricFamily("gpulease_user_usage_held_gpu_seconds", "GPU-seconds held, per user", labels=["group", "model", "user"])
            usage["usage_user_busy"] = CounterMetricFamily("gpulease_user_usage_busy_gpu_seconds", "GPU-seconds busy, per user", labels=["group", "model", "user"])
        families.update(usage)
        wait: dict[tuple[str, ...], dict[str, Any]] = {}
        for (name, labels), (value, created) in sorted(totals.items()):
            fam = families.get(name)
            if fam is not None:
                fam.add_metric(list(labels), value, created=created)
            elif name in ("wait_bucket", "wait_sum", "wait_count"):
                key = labels[:2]
                h = wait.setdefault(key, {"buckets": {}, "sum": 0.0, "created": created})
                h["created"] = min(h["created"], created)
                if name == "wait_bucket":
                    h["buckets"][labels[2]] = value
                elif name == "wait_sum":
                    h["sum"] = value
        yield requests
        yield grants
        yield ends
        yield findings
        yield stops
        yield from usage.values()
        hist = HistogramMetricFamily("gpulease_wait_seconds", "Time leases waited in the queue, observed when the wait ended, by tier and outcome ("
                                     + ", ".join(WAIT_OUTCOMES) + ")", labels=["tier", "outcome"])
        for (tier, outcome), h in sorted(wait.items()):
            acc, buckets = 0.0, []
            for le in _BUCKET_NAMES:
                acc += h["buckets"].get(le, 0.0)
                buckets.append((le, acc))
            hist.add_metric([tier, outcome], buckets, h["sum"])
            hist.samples.append(Sample("gpulease_wait_seconds_created", {"tier": tier, "outcome": outcome}, h["created"]))
        yield hist


class BrokerMetrics:
    """The broker's Prometheus registry; each broker has its own (several can live in one process).

    Reads the ``manager`` (the leases, the pool, the counters), and where the broker runs them
    (None: not) its device ``telemetry``, GPU ``health`` keeper and ``unleased``-use detector."""

    def __init__(self, manager, *, per_user: bool = False, telemetry=None, health=None, unleased=None):
        self.manager = manager
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_BrokerCollector(manager, per_user=per_user, telemetry=telemetry, health=health, unleased=unleased))

    async def render(self) -> bytes:
        """The exposition text: the figures are gathered on the event loop (they read the
        manager's state, which only the loop changes), the text is written in a thread (the
        larger part of a scrape's work on a big pool)."""
        families = list(self.registry.collect())
        return await asyncio.get_running_loop().run_in_executor(None, generate_latest, _Gathered(families))


class _Gathered:
    """Metric families already collected, in the shape ``generate_latest`` reads."""

    def __init__(self, families: list):
        self.families = families

    def collect(self):
        return iter(self.families)
