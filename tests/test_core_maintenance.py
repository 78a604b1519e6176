"""Maintenance windows in the scheduler: no grant runs into a window of its GPUs, a lease is
shortened to fit where the policy allows, ETAs fall after the windows in the way."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jupyter_gpulease.core.health import XID_TABLE, Action, assess, new_xids, xid_action
from jupyter_gpulease.core.maintenance import MaintenanceWindow
from jupyter_gpulease.core.model import GPU, Conflict, LeaseError, LeaseState, MigInstance
from jupyter_gpulease.core.policy import Policy
from jupyter_gpulease.core.request import Ask, parse_request
from jupyter_gpulease.core.scheduler import Scheduler

T0 = 1_000_000.0
H = 3600.0

POOL = [GPU(f"G{n}{i}", f"n{n}", i, "A100" if n == 0 else "L4", 81920 if n == 0 else 24576) for n in range(2) for i in range(2)] + [
    GPU("GM", "n2", 0, "A100", 81920, mig=(MigInstance("M0", "3g.40gb", 40960, 0), MigInstance("M1", "3g.40gb", 40960, 1)))
]
BY_UUID = {g.uuid: g for g in POOL}


def ask(s, now, req, dur, user="u", tier=None):
    lease = s.new_lease(Ask(user=user, request=parse_request(req), duration_s=dur, tier=tier), now)
    s.submit(lease, now)
    return lease


def windows_of(s, gpu_uuid):
    g = BY_UUID.get(gpu_uuid) or next(g for g in POOL if any(m.uuid == gpu_uuid for m in g.mig))
    return [w for w in s.windows if w.covers(g)]


def overlaps(lease, s):
    """The windows an active lease's grant runs into."""
    return [w for sl in lease.placement.slices for w in windows_of(s, sl.gpu_uuid) if w.start < lease.expires_at and lease.granted_at < w.end]


# ------------------------------------------------------------------------- examples
def test_a_lease_that_would_run_into_a_window_waits_until_after_it():
    s = Scheduler([GPU("G0", "n", 0, "A100", 81920)], Policy(confirm_timeout_s=None))
    s.set_maintenance([MaintenanceWindow("w1", T0 + H, T0 + 3 * H, "firmware update", devices=frozenset({"G0"}))])
    short = ask(s, T0, {"gpus": 1}, 1800)
    s.tick(T0)
    assert short.state is LeaseState.ACTIVE  # ends before the window
    s.release(short.id, T0 + 60)
    long = ask(s, T0 + 60, {"gpus": 1}, 2 * H)
    s.tick(T0 + 60)
    assert long.state is LeaseState.QUEUED
    assert s.eta(long.id) == T0 + 3 * H
    why = s.waiting_for(long.id)
    assert "maintenance window" in why and "firmware update" in why and "after the window" in why
    est = s.estimate(Ask(user="v", request=parse_request({"gpus": 1}), duration_s=2 * H), T0 + 60)
    assert est.start == "queued" and est.eta >= T0 + 3 * H and "maintenance window" in est.waiting_for
    s.tick(T0 + 3 * H)
    assert long.state is LeaseState.ACTIVE and long.granted_at == T0 + 3 * H


def test_node_window_and_shortened_grant_when_the_policy_allows():
    s = Scheduler([GPU("G0", "n", 0, "A100", 81920)], Policy(confirm_timeout_s=None, maintenance_shorten_min_s=1800))
    s.set_maintenance([MaintenanceWindow("w1", T0 + H, T0 + 2 * H, "rack power work", nodes=frozenset({"n"}))])
    lease = ask(s, T0, {"gpus": 1}, 4 * H)
    events = s.tick(T0)
    assert lease.state is LeaseState.ACTIVE and lease.expires_at == T0 + H
    assert any("maintenance window" in (e.reason or "") and "rack power work" in e.reason for e in events)
    with pytest.raises(Conflict, match="maintenance window"):
        s.extend(lease.id, T0 + 60, by_s=600)
    # too short to be worth it: waits instead
    s.release(lease.id, T0 + 60)
    late = ask(s, T0 + H - 600, {"gpus": 1}, 4 * H)
    s.tick(T0 + H - 600)
    assert late.state is LeaseState.QUEUED and s.eta(late.id) == T0 + 2 * H


def test_a_window_under_way_keeps_its_gpu_out_and_mig_and_shares_wait_too():
    s = Scheduler(POOL, Policy(confirm_timeout_s=None))
    s.set_maintenance([MaintenanceWindow("w", T0 - 60, T0 + H, "", devices=frozenset({"GM", "G00", "G01"}))])
    mig = ask(s, T0, {"mig_profile": "3g.40gb"}, 600)
    share = ask(s, T0, {"share": 0.5, "model": "A100"}, 600)
    l4 = ask(s, T0, {"gpus": 1, "model": "L4"}, 600)
    s.tick(T0)
    assert mig.state is LeaseState.QUEUED and s.eta(mig.id) == T0 + H
    assert share.state is LeaseState.QUEUED and s.eta(share.id) == T0 + H
    assert l4.state is LeaseState.ACTIVE


# ------------------------------------------------------------------------- properties
requests = st.one_of(
    st.builds(lambda n, m: {"gpus": n, **({"model": m} if m else {})}, st.integers(1, 2), st.sampled_from([None, "A100", "L4"])),
    st.builds(lambda f: {"share": f}, st.sampled_from([0.25, 0.5])),
    st.just({"mig_profile": "3g.40gb"}),
)
windows = st.lists(
    st.builds(
        lambda i, start, length, dev, node: MaintenanceWindow(f"w{i}", T0 + start, T0 + start + length, "maintenance",
                                                              devices=frozenset(dev), nodes=frozenset(node)),
        st.integers(0, 99), st.integers(-3600, 8 * 3600), st.integers(600, 4 * 3600),
        st.sets(st.sampled_from([g.uuid for g in POOL] + ["M0"]), max_size=2), st.sets(st.sampled_from(["n0", "n1", "n2"]), max_size=1),
    ),
    min_size=1, max_size=4,
)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("ask"), st.sampled_from(["u1", "u2", "u3"]), requests, st.sampled_from(["production", "experiment", "learning"]), st.integers(600, 4 * 3600)),
        st.tuples(st.just("release"), st.integers(0, 40)),
        st.tuples(st.just("time"), st.integers(1, 2 * 3600)),
        st.tuples(st.just("extend"), st.integers(0, 40), st.integers(60, 3600)),
    ),
    max_size=50,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops, windows, st.sampled_from([None, 1800.0]))
def test_no_grant_ever_overlaps_a_window_of_its_devices(seq, ws, shorten):
    pol = Policy(confirm_timeout_s=None, reservation_depth=5, maintenance_shorten_min_s=shorten)
    s = Scheduler(POOL, pol)
    s.set_maintenance(ws)
    now = T0
    leases = []
    for op in seq:
        try:
            if op[0] == "ask":
                _, user, req, tier, dur = op
                leases.append(ask(s, now, req, min(dur, pol.tiers[tier].max_duration_s), user=user, tier=tier))
            elif op[0] == "release" and leases:
                s.release(leases[op[1] % len(leases)].id, now)
            elif op[0] == "time":
                now += op[1]
            elif op[0] == "extend" and leases:
                s.extend(leases[op[1] % len(leases)].id, now, by_s=op[2])
        except LeaseError:
            pass
        s.tick(now)
        for lease in leases:
            if lease.granted_at is not None and lease.state is LeaseState.ACTIVE:
                assert not overlaps(lease, s), (lease.to_dict(), ws)
        # every ETA is a slot clear of the windows of the devices promised
        for lid, eta in s._found.eta.items():
            lease = s.leases[lid]
            for dev, holder in s._found.promised_to.items():
                if holder == lid:
                    for w in windows_of(s, dev):
                        assert not (w.start < eta + lease.duration_s and eta < w.end), (lid, eta, w)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 2), st.integers(600, 3 * 3600)), min_size=2, max_size=20), windows)
def test_etas_account_for_windows_and_the_head_starts_by_its_eta(jobs, ws):
    s = Scheduler([GPU(f"G0{i}", "n0", i, "A100", 81920) for i in range(2)], Policy(confirm_timeout_s=None, preemption=False, fair_share=False))
    s.set_maintenance(ws)
    now = T0
    leases = [ask(s, now, {"gpus": n}, d) for n, d in jobs]
    s.tick(now)
    promised = {}
    for _ in range(500):
        if not s.leases:
            break
        q = s.queue()
        if q and s.eta(q[0].id) is not None:
            promised.setdefault(q[0].id, s.eta(q[0].id))
        nxt = s.next_deadline()
        assert nxt is not None
        now = max(now, nxt)
        s.tick(now)
    assert not s.leases
    for lease in leases:
        assert lease.state is LeaseState.EXPIRED
        assert not [w for w in ws if any(w.covers(GPU(sl.gpu_uuid, sl.node, sl.index, sl.model, sl.memory_mib)) for sl in lease.placement.slices)
                    and w.start < lease.expires_at and lease.granted_at < w.end]
        if lease.id in promised:
            assert lease.granted_at <= promised[lease.id] + 1e-6


# ------------------------------------------------------------------------- the XID table
def test_xid_classes():
    assert {c for c, x in XID_TABLE.items() if x.action is Action.APPLICATION} == {13, 31, 43, 45, 68}
    assert all(xid_action(c) is Action.DRAIN_NOW for c in (48, 64, 74, 79, 95))
    assert xid_action(63) is Action.DRAIN_WHEN_IDLE
    assert xid_action(999) is Action.WATCH
    assert new_xids({79: 1}, {79: 2, 13: 1}) == {79: 1, 13: 1}
    f = assess({"lost": False}, xids={13: 3})
    assert [x.action for x in f] == [Action.APPLICATION]
    f = assess({"row_remap_pending": True, "throttle": ["hw_thermal"]}, temperature_c=91, slowdown_c=90, xids={79: 1}, ecc_new=2)
    assert [x.code for x in f][:2] == ["xid:79", "ecc_dbe"] and f[0].action is Action.DRAIN_NOW
    assert {x.code for x in f} >= {"row_remap_pending", "hot", "throttle:hw_thermal"}
    assert assess({}, temperature_c=89, slowdown_c=90) == []


def test_the_docs_show_the_one_xid_table():
    """The XID reference page is generated from the table itself, and the health guide links to it."""
    import importlib.util
    import sys
    from pathlib import Path

    from jupyter_gpulease.core.health import xid_table_markdown

    docs = Path(__file__).resolve().parents[1] / "docs"
    spec = importlib.util.spec_from_file_location("gpulease_reference", docs / "_ext" / "gpulease_reference.py")
    reference = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = reference  # its dataclasses look their module up there
    spec.loader.exec_module(reference)
    assert "% gpulease-generate: xid" in (docs / "reference" / "xid.md").read_text()
    assert reference.xid_reference().strip() == xid_table_markdown()
    assert "../reference/xid.md" in (docs / "how-to" / "health-and-maintenance.md").read_text()
