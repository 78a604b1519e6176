"""The one lease view: a broker lease JSON read once, its kinds, environment, actions and words."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from jupyter_gpulease.core import words
from jupyter_gpulease.core.lease import (
    ACTIONS,
    WARNING_ACTIONS,
    KernelState,
    LeaseState,
    LeaseView,
    WarningKind,
    current_warnings,
    lease_environment,
    offered_actions,
)
from jupyter_gpulease.core.tsexport import render

ROOT = Path(__file__).resolve().parent.parent
POOL = {"devices": [{"model": "L4", "memory_mib": 23034}, {"model": "A100-SXM4-80GB", "memory_mib": 81920}]}
ACTIVE = {"id": "0123456789abcdef", "state": "active", "tier": "standard", "expires_at": 1000.0 + 4320, "granted_at": 1000.0,
          "duration_s": 4320, "request": {"kind": "gpu", "gpus": 2, "model": ["L4"]},
          "placement": {"node": "n1", "slices": [
              {"gpu_uuid": "GPU-l0", "node": "n1", "index": 0, "model": "L4", "memory_mib": 23034},
              {"gpu_uuid": "GPU-l1", "node": "n1", "index": 1, "model": "L4", "memory_mib": 23034}]}}
QUEUED = {"id": "fedcba9876543210", "state": "queued", "request": {"kind": "share", "share": 0.5, "model": ["L4"]},
          "queue": {"position": 2, "length": 5, "eta": 1000.0 + 14 * 60, "waiting_for": "a 0.5 share of L4 held by alice"}}


def test_a_view_reads_the_broker_json_once():
    v = LeaseView.from_json(ACTIVE)
    assert v.state is LeaseState.ACTIVE and v.active and not v.queued and not v.ended
    assert v.short_id == "01234567" and v.tier == "standard"
    assert v.devices == ["GPU-l0", "GPU-l1"] and [s.index for s in v.slices] == [0, 1]
    assert v.time_left(1000.0) == 4320 and v.time_left(10**9) == 0
    q = LeaseView.from_json(QUEUED)
    assert q.queued and q.queue is not None and (q.queue.position, q.queue.length) == (2, 5) and q.devices == []
    with pytest.raises(ValueError, match="unknown state 'sleeping'"):
        LeaseView.from_json({**ACTIVE, "state": "sleeping"})
    with pytest.raises(AttributeError):
        v.tier = "other"  # frozen
    assert LeaseView.maybe(None) is None and LeaseView.maybe({}) is None


def test_the_environment_has_the_memory_fraction_of_a_share():
    share = {"id": "L1", "state": "active", "expires_at": 1234, "placement": {"slices": [
        {"gpu_uuid": "GPU-l0", "index": 0, "model": "L4", "memory_mib": 11517, "share": 0.5}]}}
    env = lease_environment(share, gpu_memory_mib={"GPU-l0": 23034}, broker_url="http://b/")
    assert env["GPULEASE_MEMORY_FRACTION"] == "0.5" and env["GPULEASE_SHARE"] == "0.5"
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-l0" and env["GPULEASE_BROKER_URL"] == "http://b/"
    assert env["GPULEASE_EXPIRES_AT"] == "1234" and json.loads(env["GPULEASE_PLACEMENT"])["slices"][0]["share"] == 0.5
    # without the pool's figure, the share stands in for the fraction
    assert LeaseView.from_json(share).environment()["GPULEASE_MEMORY_FRACTION"] == "0.5"
    assert lease_environment(ACTIVE)["GPULEASE_MEMORY_FRACTION"] == "1,1"
    with pytest.raises(ValueError, match="no placement"):
        lease_environment(QUEUED)


def test_the_status_json_carries_the_sentences_the_lab_extension_shows():
    j = LeaseView.from_json(ACTIVE).status_json(1000.0)
    assert j["summary"] == "Lease 01234567 · tier standard" and j["holding"] == "L4 ×2" and j["queue_words"] == ""
    assert j["time_left_s"] == 4320 and j["devices"] == ["GPU-l0", "GPU-l1"] and j["placement"] == ACTIVE["placement"]
    q = LeaseView.from_json(QUEUED).status_json(1000.0)
    assert q["summary"] == "Waiting: position 2 of 5" and q["queue_words"] == "position 2 of 5" and q["holding"] == ""
    ended = LeaseView.from_json({**ACTIVE, "state": "revoked", "end_reason": "maintenance"})
    assert ended.status_json(1000.0)["summary"] == "It was revoked: maintenance."


def test_words_of_a_lease():
    v = LeaseView.from_json(ACTIVE)
    assert words.lease_line(v, 1000.0) == "lease 01234567: L4 #0, L4 #1 (tier standard), 1 h 12 min left"
    assert words.lease_line(QUEUED, 1000.0) == "lease fedcba98 waits for a 0.5 share of one L4: position 2 of 5, about 14 min"
    assert words.queue_message(QUEUED, POOL, 1000.0) == "Waiting for a 0.5 share of one L4 (22 GB): position 2 of 5, about 14 min"
    assert words.holding_words(v) == "2 × L4 on n1"
    assert words.granted_message(v, 1000.0) == "GPU lease 0123456789abcdef granted: L4 (GPU-l0), L4 (GPU-l1), for 1 h 12 min"
    mig = LeaseView.from_json({"id": "m", "state": "active", "placement": {"slices": [
        {"gpu_uuid": "GPU-a", "mig_uuid": "MIG-a1", "mig_profile": "3g.40gb", "index": 0, "model": "A100-SXM4-80GB", "memory_mib": 40960}]}})
    assert words.holding_short(mig) == "A100 3g.40gb" and words.placement_words(mig) == "MIG 3g.40gb of A100-SXM4-80GB #0"
    assert words.request_words({"kind": "gpu", "gpus": 1, "model": ["A100*"]}, POOL) == "1 × A100-SXM4-80GB"
    assert words.request_words({"kind": "gpu", "gpus": 1, "model": ["A100*"]}) == "1 × A100*"
    assert words.request_words({"kind": "mig", "mig_profile": "1g.10gb"}) == "MIG 1g.10gb"
    sooner = {**QUEUED, "queue": {**QUEUED["queue"], "may_start_sooner_at": 1000.0 + 300}}
    assert re.search(r", or sooner: the GPU it waits for is idle and goes back by \d\d:\d\d if it stays idle$", words.queue_words(sooner, 1000.0))
    assert words.queue_words({**QUEUED, "queue": {}}, 0) == "position ? of ?, no estimate yet"


def test_an_end_is_said_once_in_words():
    assert words.end_words({"state": "released", "end_message": "Released from the notebook."}) == "Released from the notebook."
    assert words.end_words({"state": "preempted", "ended_by": {"user": "bob", "tier": "priority"}}) == "It was preempted for bob's 'priority' request."
    assert words.end_words({"state": "revoked", "ended_by": "admin:carol", "end_reason": "maintenance"}) == "It was revoked by carol (admin): maintenance."
    assert words.lease_line({"id": "0123456789", "state": "expired", "end_reason": "time is up"}, 0) == "lease 01234567 expired: time is up"


def test_one_action_table_and_what_is_offered_when():
    active, queued = LeaseView.from_json(ACTIVE), LeaseView.from_json(QUEUED)
    reclaimed = LeaseView.from_json({**ACTIVE, "state": "reclaimed"})
    names = lambda acts: [a.name for a in acts]  # noqa: E731
    assert names(offered_actions(active, ["ok"])) == ["extend", "keep", "release"]
    assert names(offered_actions(active, ["ok", "suspended"])) == ["extend", "keep", "resume", "release"]
    assert names(offered_actions(queued)) == ["release"] and ACTIONS["release"].label_for(queued) == "Withdraw"
    assert names(offered_actions(None, [], reclaimed)) == ["resume"]
    assert names(offered_actions(None, ["resuming"])) == ["resume"] and offered_actions(None) == []
    assert ACTIONS["extend"].to_json(active) == {"name": "extend", "label": "Extend 30 min", "path": "lease/extend", "body": {"by_s": 1800}}
    assert set(WARNING_ACTIONS) <= set(WarningKind) and all(set(v) <= set(ACTIONS) for v in WARNING_ACTIONS.values())


def test_current_warnings_keep_the_latest_of_each_kind_until_its_deadline():
    ws = [{"kind": "reclaim", "kernel_id": "k1", "deadline": 50, "message": "a"},
          {"kind": "reclaim", "kernel_id": "k1", "deadline": 200, "message": "b"},
          {"kind": "expiring", "deadline": 90, "message": "c"}, {"kind": "share_memory", "kernel_id": "k2", "message": "d"}]
    assert [w["message"] for w in current_warnings(ws, 100)] == ["b", "d"]
    assert [w["message"] for w in current_warnings(ws, 0)] == ["b", "c", "d"]


def test_the_kinds_are_the_strings_the_parts_send():
    from jupyter_gpulease.core.unleased import WARNING_KIND

    assert WarningKind(WARNING_KIND) is WarningKind.UNLEASED_USE
    # every kind a warning is published with in the server extension and the broker is a WarningKind
    # the broker's warnings (lease reads, health) are dicts with a literal kind; the server's are
    # published with WarningKind members (a literal kind there would be a bare string again)
    sent = set()
    for name in ("reads.py", "health.py"):  # the lease's warnings, the health and maintenance warnings
        sent |= set(re.findall(r"out\.append\(\{\"kind\": \"(\w+)\"", (ROOT / "jupyter_gpulease" / "broker" / name).read_text()))
    assert {"preemption", "expiring", "gpu_unhealthy", "maintenance"} <= sent
    assert sent <= {k.value for k in WarningKind}, sent - {k.value for k in WarningKind}
    server_calls = []
    for path in (ROOT / "jupyter_gpulease" / "server").glob("*.py"):
        server_calls += re.findall(r"\.warn\(\s*([\w.\"]+)", path.read_text())
    assert server_calls and not any(c.startswith('"') for c in server_calls), server_calls
    members = {c.split(".", 1)[1] for c in server_calls if c.startswith("WarningKind.")}
    assert members and members <= set(WarningKind.__members__)
    assert KernelState.SUSPENDED.put_aside and KernelState.RESUMING.put_aside and not KernelState.OK.put_aside


def test_the_lab_extension_kinds_are_generated_from_the_python_tables():
    committed = (ROOT / "labextension" / "src" / "kinds.ts").read_text()
    assert committed == render(), "labextension/src/kinds.ts is stale: python -m jupyter_gpulease.core.tsexport > labextension/src/kinds.ts"
    for enum, name in ((LeaseState, "LeaseState"), (KernelState, "KernelState"), (WarningKind, "WarningKind")):
        union = re.search(rf"export type {name} = ([^;]+);", committed).group(1)
        assert re.findall(r"'(\w+)'", union) == [m.value for m in enum]


def test_the_idle_time_of_a_lease_comes_from_its_heartbeats_without_the_servers_clock_skew():
    from jupyter_gpulease.core.lease import lease_idle_s

    active = {"state": "active", "granted_at": 1000.0, "last_heartbeat": 1100.0}  # broker times
    # the server's clock is hours off; at its heartbeat its GPU had been idle 30 s by that clock
    for skew in (-7200.0, 0.0, 7200.0):
        usage = {"t": 1100.0 + skew, "gpu_busy": False, "last_gpu_activity": 1070.0 + skew}
        assert lease_idle_s(dict(active, usage=usage), 1200.0) == 130.0
    assert lease_idle_s(dict(active, usage={"t": 5.0, "gpu_busy": True, "last_gpu_activity": 5.0}), 1200.0) == 0.0
    assert lease_idle_s(dict(active, usage={"t": 5.0, "gpu_busy": False, "last_gpu_activity": None}), 1200.0) == 200.0  # idle since the grant
    assert lease_idle_s(dict(active, usage={}), 1200.0) is None and lease_idle_s(dict(active, state="queued", usage={"t": 1.0}), 1200.0) is None
