"""Prometheus metrics of the broker.

Gauges (leases by state and tier, GPUs in the pool and allocated, queue length) are read
from the manager's committed state at scrape time; counters and the wait-time histogram are fed by the
events the manager commits. Each broker has its own registry, so several brokers can live
in one test process.
"""

from __future__ import annotations

from collections import Counter as _Tally
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..core.events import ENDED, GRANTED, Event
from ..core.model import LeaseState

WAIT_BUCKETS = (1, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200, 14400, 28800, 86400)


class _ManagerCollector:
    """Gauges of the committed state, read through the manager at scrape time."""

    def __init__(self, manager):
        self.manager = manager

    def collect(self):
        m = self.manager
        leases = GaugeMetricFamily("gpulease_leases", "Live leases by state and tier", labels=["state", "tier"])
        tally = m.lease_counts()
        for state in (LeaseState.QUEUED.value, LeaseState.ACTIVE.value):
            for tier in m.policy.tiers:
                leases.add_metric([state, tier], tally.get((state, tier), 0))
        yield leases

        total = GaugeMetricFamily("gpulease_gpus_total", "GPUs in the pool by model", labels=["model"])
        allocated = GaugeMetricFamily("gpulease_gpus_allocated", "GPUs held by active leases by model (shares count by fraction)", labels=["model"])
        models = _Tally(g.model for g in m.inventory())
        held: dict[str, float] = dict.fromkeys(models, 0.0)
        held.update(m.held_by_model())
        for model, n in sorted(models.items()):
            total.add_metric([model], n)
        for model, n in sorted(held.items()):
            allocated.add_metric([model], n)
        yield total
        yield allocated

        q = GaugeMetricFamily("gpulease_queue_length", "Leases waiting in the queue")
        q.add_metric([], sum(n for (state, _), n in tally.items() if state == LeaseState.QUEUED.value))
        yield q
        commits = CounterMetricFamily("gpulease_store_commits", "Transactions the broker committed (each holds every decision pending when it began)")
        commits.add_metric([], m.commits)
        yield commits
        draining = GaugeMetricFamily("gpulease_draining", "1 while the broker grants no leases (drain mode)")
        draining.add_metric([], 1 if m.draining else 0)
        yield draining


class BrokerMetrics:
    """The broker's Prometheus registry."""

    def __init__(self, manager):
        self.registry = CollectorRegistry(auto_describe=True)
        self.grants = Counter("gpulease_grants", "Leases granted", ["tier"], registry=self.registry)
        self.ends = Counter("gpulease_ends", "Leases ended, by final state", ["state", "tier"], registry=self.registry)
        self.wait = Histogram("gpulease_wait_seconds", "Time from request to grant", ["tier"], buckets=WAIT_BUCKETS, registry=self.registry)
        self.registry.register(_ManagerCollector(manager))

    def observe(self, written: list[dict[str, Any]], events: list[Event]) -> None:
        """Manager listener: count what was just committed."""
        for e in events:
            lease = getattr(e, "lease", None)
            tier = lease.tier if lease is not None else ""
            if e.kind == GRANTED:
                self.grants.labels(tier).inc()
                if lease is not None and lease.granted_at is not None:
                    self.wait.labels(tier).observe(max(0.0, lease.granted_at - lease.created_at))
            elif e.kind == ENDED:
                self.ends.labels(e.to_state, tier).inc()
