"""The simulator writes the broker's usage records, and the report over them adds up.

``jupyter gpulease simulate --usage-db FILE`` replays a shipped trace through the broker's own
recorder; the report read back from that store (``report --db``) must equal the replay's own
totals: held and busy GPU-hours per user (the traces' jobs) and in all, every lease counted
once, and the users' sums equal to the pool's allocated GPU-hours.
"""

from __future__ import annotations

import json
from collections import defaultdict

import pytest

from jupyter_gpulease.broker.usage import Accounting, UsageAPI
from jupyter_gpulease.sim.cli import build_parser, run
from jupyter_gpulease.store import LeaseStore

pytestmark = pytest.mark.timeout(300)


def replay_with_records(tmp_path, *argv):
    db = tmp_path / "usage.sqlite"
    doc = run(build_parser().parse_args([*argv, "--usage-db", str(db), "--no-progress"]))
    return doc, doc["_results"][0], f"sqlite:///{db}"


@pytest.mark.parametrize("argv", [
    ("--trace", "notebook", "--limit", "300", "--policies", "gpulease"),
    ("--trace", "alibaba", "--limit", "400", "--policies", "gpulease", "--pool-nodes", "4"),
], ids=["notebook-sessions", "alibaba-pods"])
def test_the_report_over_a_replayed_trace_equals_the_simulators_own_totals(tmp_path, argv):
    doc, result, url = replay_with_records(tmp_path, *argv)
    held, busy = defaultdict(float), defaultdict(float)
    for rec in result.records:
        held[rec.job.id] += rec.held_s
        busy[rec.job.id] += rec.busy_s
    store = LeaseStore(url)
    try:
        api = UsageAPI(store, Accounting())
        rep = api.report(by="user", start=0.0, end=result.end_time + 86400 * 365 * 40)
    finally:
        store.close()
    rows = {r["key"]: r for r in rep["rows"]}
    users = {u for u, h in held.items() if h > 0}
    assert users and set(rows) == users
    for u in users:
        assert rows[u]["held_gpu_h"] == pytest.approx(held[u] / 3600, rel=1e-6, abs=1e-6), u
        assert rows[u]["busy_gpu_h"] == pytest.approx(busy[u] / 3600, rel=1e-6, abs=1e-6), u
    total_held, total_busy = sum(held.values()) / 3600, sum(busy.values()) / 3600
    assert rep["totals"]["held_gpu_h"] == pytest.approx(total_held, rel=1e-6)
    assert rep["totals"]["busy_gpu_h"] == pytest.approx(total_busy, rel=1e-6)
    # the users' sums are the pool's: GPU-hours allocated over the replay
    pool_held = result.allocated.integral(result.allocated.times[0], result.end_time) / 3600
    assert sum(r["held_gpu_h"] for r in rep["rows"]) == pytest.approx(pool_held, rel=1e-6)
    # every lease counted once: one record per grant
    assert rep["totals"]["leases"] == result.counters["granted"] == doc["usage_db"]["leases"]
    json.dumps(rep)  # the report is plain JSON


def test_the_cli_names_the_file_it_wrote(tmp_path, capsys):
    from jupyter_gpulease.sim.cli import main

    db = tmp_path / "u.sqlite"
    assert main(["--trace", "notebook", "--limit", "50", "--policies", "gpulease,static", "--usage-db", str(db), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "usage records: " in out and "of gpulease in" in out and str(db) in out


def test_reclaims_that_suspend_count_as_suspends(tmp_path):
    _, result, url = replay_with_records(tmp_path, "--trace", "notebook", "--limit", "200", "--policies", "gpulease")
    store = LeaseStore(url)
    try:
        rep = UsageAPI(store).report(by="tier", start=0.0, end=result.end_time + 86400)
    finally:
        store.close()
    reclaims = sum(r.reclaims for r in result.records)
    assert rep["totals"]["reclaims"] == reclaims > 0
    assert 0 < rep["totals"]["suspends"] <= reclaims
