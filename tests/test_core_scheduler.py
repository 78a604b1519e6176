"""Behaviour of the core scheduler: placement, order, backfill, quotas, time, preemption."""

import pytest

from jupyter_gpulease.core import events as ev
from jupyter_gpulease.core.model import GPU, BadRequest, Conflict, Forbidden, LeaseState, MigInstance, NotFound, Refused
from jupyter_gpulease.core.policy import HOUR, Policy, Quota, Tier
from jupyter_gpulease.core.request import Ask, parse_request
from jupyter_gpulease.core.scheduler import Scheduler


def P(**kw):
    """A policy; leases need no confirmation unless a test asks for it."""
    kw.setdefault("confirm_timeout_s", None)
    return Policy(**kw)

T0 = 1_000_000.0


def gpus(n=1, node="n1", model="A100", mem=81920, start=0):
    return [GPU(f"GPU-{node}-{start + i}", node, start + i, model, mem) for i in range(n)]


def mig_gpu(node="n9"):
    return GPU(
        f"GPU-{node}-mig",
        node,
        0,
        "A100",
        81920,
        mig=(MigInstance(f"MIG-{node}-0", "3g.40gb", 40960, 0), MigInstance(f"MIG-{node}-1", "1g.10gb", 9856, 1)),
    )


def ask(s, user, req=None, now=T0, **kw):
    kw.setdefault("duration_s", HOUR)
    lease = s.new_lease(Ask(user=user, request=parse_request(req or {"gpus": 1}), **kw), now)
    s.submit(lease, now)
    return lease


def kinds(events, kind):
    return [e for e in events if e.kind == kind]


# ------------------------------------------------------------------ placement
def test_whole_gpus_go_to_one_node_and_prefer_the_tightest_fit():
    s = Scheduler(gpus(4, "big") + gpus(2, "small"), P())
    a = ask(s, "a", {"gpus": 2})
    s.tick(T0)
    assert a.state is LeaseState.ACTIVE
    assert {sl.node for sl in a.placement.slices} == {"small"}  # keeps the 4-GPU node whole
    b = ask(s, "b", {"gpus": 3})
    s.tick(T0)
    assert b.state is LeaseState.ACTIVE and b.placement.node == "big" and len(b.placement.slices) == 3


def test_shares_pack_onto_one_gpu_without_exceeding_memory_or_compute():
    s = Scheduler(gpus(2), P())
    a = ask(s, "a", {"share": 0.5})
    b = ask(s, "b", {"share": 0.5})
    c = ask(s, "c", {"share": 0.25, "memory_mib": 1000})
    s.tick(T0)
    assert a.placement.slices[0].gpu_uuid == b.placement.slices[0].gpu_uuid  # packed together
    assert c.placement.slices[0].gpu_uuid != a.placement.slices[0].gpu_uuid
    st = s.pool.gpus[a.placement.slices[0].gpu_uuid]
    assert st.free_milli == 0 and st.free_mem == 81920 - 2 * 40960
    # a whole GPU no longer fits anywhere: one is full, the other shared
    d = ask(s, "d", {"gpus": 1})
    s.tick(T0)
    assert d.state is LeaseState.QUEUED


def test_share_by_memory_takes_the_matching_compute_fraction():
    s = Scheduler(gpus(1, mem=40000), P())
    a = ask(s, "a", {"memory_mib": 10000})
    s.tick(T0)
    sl = a.placement.slices[0]
    assert sl.memory_mib == 10000 and sl.share_milli == 250


def test_mig_requests_get_an_instance_of_their_profile_and_nothing_else_uses_mig_gpus():
    s = Scheduler([mig_gpu()], P())
    a = ask(s, "a", {"mig_profile": "1g.10gb"})
    s.tick(T0)
    assert a.placement.slices[0].mig_uuid == "MIG-n9-1"
    assert a.placement.device_ids() == ["MIG-n9-1"]
    with pytest.raises(Refused, match="MIG"):
        s.new_lease(Ask(user="b", request=parse_request({"share": 0.5})), T0)
    with pytest.raises(Refused):
        s.new_lease(Ask(user="b", request=parse_request({"gpus": 1})), T0)


def test_model_globs_and_lists_constrain_placement():
    s = Scheduler(gpus(1, "n1", "A100-SXM4-80GB") + gpus(1, "n2", "L4", 24576), P())
    a = ask(s, "a", {"model": "a100*"})
    b = ask(s, "b", {"model": ["H100*", "L4"]})
    s.tick(T0)
    assert a.placement.slices[0].model == "A100-SXM4-80GB"
    assert b.placement.slices[0].model == "L4"


# ------------------------------------------------------------------ refusals
@pytest.mark.parametrize(
    "req,match",
    [
        ({"gpus": 3}, "most any node has"),
        ({"model": "H100"}, "no GPU model in the pool matches 'H100'"),
        ({"mig_profile": "7g.80gb"}, "no GPU offers MIG profile"),
        ({"memory_mib": 200000}, "largest GPU has"),
        ({"min_memory_mib": 100000}, "at least 100000 MiB"),
    ],
)
def test_impossible_requests_are_refused_at_once_with_the_reason(req, match):
    s = Scheduler(gpus(2), P())
    with pytest.raises(Refused, match=match):
        s.new_lease(Ask(user="a", request=parse_request(req)), T0)
    assert not s.leases


@pytest.mark.parametrize(
    "body,field",
    [
        ({"gpus": 0}, "gpus"),
        ({"gpus": "two"}, "gpus"),
        ({"gpus": 1.5}, "gpus"),
        ({"share": 1.5}, "share"),
        ({"share": 0}, "share"),
        ({"model": 7}, "model"),
        ({"kind": "tpu"}, "kind"),
        ([1, 2], None),
    ],
)
def test_malformed_requests_name_the_field(body, field):
    with pytest.raises(BadRequest) as e:
        parse_request(body)
    assert e.value.field == field


def test_tier_rules_duration_limits_and_who_may_use_a_tier():
    pol = P(tiers={"prod": Tier("prod", 10, max_duration_s=HOUR, default_duration_s=HOUR, groups=("staff",)), "open": Tier("open", 1)}, default_tier="open")
    s = Scheduler(gpus(1), pol)
    with pytest.raises(Forbidden, match="may not use tier 'prod'"):
        s.new_lease(Ask(user="a", request=parse_request({}), tier="prod"), T0)
    s.new_lease(Ask(user="a", groups=["staff"], request=parse_request({}), tier="prod"), T0)
    with pytest.raises(BadRequest, match="over the 1 h limit") as e:
        s.new_lease(Ask(user="a", groups=["staff"], request=parse_request({}), tier="prod", duration_s=2 * HOUR), T0)
    assert e.value.field == "duration_s"
    with pytest.raises(BadRequest, match=r"unknown tier 'gold'; tiers open to a: open$"):  # not 'prod': a may not use it
        s.new_lease(Ask(user="a", request=parse_request({}), tier="gold"), T0)
    with pytest.raises(BadRequest, match=r"unknown tier 'gold'; tiers open to b: open, prod$"):
        s.new_lease(Ask(user="b", groups=["staff"], request=parse_request({}), tier="gold"), T0)


# ------------------------------------------------------------------ order
def test_higher_tier_goes_first_then_arrival():
    s = Scheduler(gpus(1), P(preemption=False))
    hold = ask(s, "x")
    s.tick(T0)
    low = ask(s, "a", tier="learning", now=T0 + 1)
    high = ask(s, "b", tier="production", now=T0 + 2)
    mid = ask(s, "c", tier="experiment", now=T0 + 3)
    s.tick(T0 + 3)
    assert [lease.user for lease in s.queue()] == ["b", "c", "a"]
    s.release(hold.id, T0 + 10)
    s.tick(T0 + 10)
    assert high.state is LeaseState.ACTIVE and mid.state is LeaseState.QUEUED and low.state is LeaseState.QUEUED


def test_fair_share_puts_the_lighter_user_first_and_interleaves_heavy_queues():
    s = Scheduler(gpus(1), P())
    s.record_usage("heavy", (), T0 - 2 * HOUR, T0 - HOUR, 1000)
    ask(s, "x")
    s.tick(T0)
    h1 = ask(s, "heavy", now=T0 + 1)
    h2 = ask(s, "heavy", now=T0 + 2)
    l1 = ask(s, "light", now=T0 + 3)
    l2 = ask(s, "light", now=T0 + 4)
    s.tick(T0 + 5)
    order = [lease.id for lease in s.queue()]
    assert order[0] == l1.id  # lighter user first despite arriving later
    assert order.index(h1.id) < order.index(l2.id) or order.index(h1.id) < order.index(h2.id)
    assert order.index(h1.id) < order.index(h2.id)  # arrival within a user


def test_fair_share_usage_decays_with_the_half_life():
    s = Scheduler(gpus(1), P(fair_share_half_life_s=HOUR))
    s.record_usage("u", (), T0 - HOUR, T0, 1000)
    assert s.user_usage("u", (), T0)["fair_share_usage_gpu_hours"] == pytest.approx(1.0)
    assert s.user_usage("u", (), T0 + HOUR)["fair_share_usage_gpu_hours"] == pytest.approx(0.5)


# ------------------------------------------------------------------ backfill and ETA
def test_backfill_starts_a_short_job_that_does_not_delay_the_reserved_head():
    s = Scheduler(gpus(2), P(preemption=False))
    ask(s, "a", duration_s=HOUR)  # GPU 0 until T0+1h
    s.tick(T0)
    big = ask(s, "b", {"gpus": 2}, duration_s=HOUR)  # must wait for GPU 0: reserved at T0+1h
    short = ask(s, "c", duration_s=HOUR / 2)  # fits on GPU 1 before the reservation
    long = ask(s, "d", duration_s=2 * HOUR)  # would delay the head: must wait
    s.tick(T0)
    assert big.state is LeaseState.QUEUED and s.eta(big.id) == pytest.approx(T0 + HOUR)
    assert short.state is LeaseState.ACTIVE
    assert long.state is LeaseState.QUEUED
    assert s.eta(long.id) == pytest.approx(T0 + 2 * HOUR)
    # the head starts exactly when promised
    evs = s.tick(T0 + HOUR)
    assert big.state is LeaseState.ACTIVE
    assert kinds(evs, ev.GRANTED)[0].lease_id == big.id


def test_without_backfill_nothing_passes_a_waiting_lease():
    s = Scheduler(gpus(2), P(backfill=False, preemption=False))
    ask(s, "a")
    s.tick(T0)
    ask(s, "b", {"gpus": 2})
    short = ask(s, "c", duration_s=600)  # short enough to backfill, were backfill on
    s.tick(T0)
    assert short.state is LeaseState.QUEUED


def test_eta_and_position_of_a_queued_lease():
    s = Scheduler(gpus(1), P())
    ask(s, "a", duration_s=HOUR)
    s.tick(T0)
    b = ask(s, "b", duration_s=HOUR)
    c = ask(s, "c", duration_s=HOUR)
    s.tick(T0)
    assert s.queue_info(b.id)["position"] == 1 and s.queue_info(b.id)["length"] == 2
    assert s.queue_info(b.id)["eta"] == pytest.approx(T0 + HOUR)
    assert s.queue_info(c.id)["eta"] == pytest.approx(T0 + 2 * HOUR)
    assert "1 × GPU" in s.queue_info(c.id)["waiting_for"]


# ------------------------------------------------------------------ quotas
def test_concurrent_quota_holds_back_without_refusing_and_shares_count_by_fraction():
    s = Scheduler(gpus(4), P(default_user_quota=Quota(max_gpus=1)))
    a = ask(s, "u", {"share": 0.5})
    b = ask(s, "u", {"share": 0.5})
    c = ask(s, "u", {"share": 0.5})
    s.tick(T0)
    assert a.state is b.state is LeaseState.ACTIVE
    assert c.state is LeaseState.QUEUED and "quota" in s.waiting_for(c.id)
    with pytest.raises(Refused, match="limit of 1 concurrent GPUs"):
        s.new_lease(Ask(user="u", request=parse_request({"gpus": 2})), T0)
    s.release(a.id, T0 + 1)
    s.tick(T0 + 1)
    assert c.state is LeaseState.ACTIVE


def test_gpu_hour_quota_refuses_what_would_go_over_and_names_what_is_left():
    s = Scheduler(gpus(4), P(default_user_quota=Quota(gpu_hours=3, period_s=24 * HOUR)))
    s.record_usage("u", (), T0 - 3 * HOUR, T0 - HOUR, 1000)  # 2 GPU-hours used
    with pytest.raises(Refused, match=r"1\.0 left"):
        s.new_lease(Ask(user="u", request=parse_request({"gpus": 1}), duration_s=2 * HOUR), T0)
    s.new_lease(Ask(user="u", request=parse_request({"gpus": 1}), duration_s=HOUR), T0)


def test_group_quota_counts_all_members():
    s = Scheduler(gpus(4), P(group_quotas={"lab": Quota(max_gpus=2)}))
    a = ask(s, "a", {"gpus": 2}, groups=["lab"])
    b = ask(s, "b", {"gpus": 1}, groups=["lab"])
    s.tick(T0)
    assert a.state is LeaseState.ACTIVE and b.state is LeaseState.QUEUED
    assert "group 'lab'" in s.waiting_for(b.id)


# ------------------------------------------------------------------ time
def test_expired_lease_frees_its_gpu_for_the_next_in_queue_after_a_warning():
    s = Scheduler(gpus(1), P(warn_before_s=600))
    a = ask(s, "a", duration_s=HOUR)
    s.tick(T0)
    b = ask(s, "b")
    s.tick(T0)
    warned = s.tick(T0 + HOUR - 600)
    assert [e.kind for e in warned] == [ev.WARNED] and warned[0].lease_id == a.id
    assert s.tick(T0 + HOUR - 300) == []  # warned once
    evs = s.tick(T0 + HOUR)
    ended = kinds(evs, ev.ENDED)[0]
    assert ended.lease_id == a.id and ended.to_state == "expired" and a.ended_at == T0 + HOUR
    assert b.state is LeaseState.ACTIVE and b.placement.slices[0].gpu_uuid == a.placement.slices[0].gpu_uuid


def test_extension_moves_expiry_within_tier_limits_and_resets_the_warning():
    s = Scheduler(gpus(1), P(warn_before_s=600))
    a = ask(s, "a", duration_s=HOUR, tier="experiment")  # max 8 h
    s.tick(T0)
    s.tick(T0 + HOUR - 600)
    assert a.warned_at is not None
    s.extend(a.id, T0 + HOUR - 500, by_s=HOUR)
    assert a.expires_at == T0 + 2 * HOUR and a.warned_at is None
    assert s.tick(T0 + HOUR) == []  # old expiry does nothing now
    with pytest.raises(Refused, match="at most 8 h ahead"):
        s.extend(a.id, T0 + HOUR, by_s=8 * HOUR)
    with pytest.raises(BadRequest):
        s.extend(a.id, T0 + HOUR, by_s=-5)
    s.tick(T0 + 2 * HOUR)
    assert a.state is LeaseState.EXPIRED
    with pytest.raises(NotFound):
        s.extend(a.id, T0 + 2 * HOUR, by_s=60)


def test_extension_refused_when_someone_waits_for_the_gpu_unless_configured():
    for contended_ok in (False, True):
        s = Scheduler(gpus(1), P(extend_when_contended=contended_ok))
        a = ask(s, "a")
        s.tick(T0)
        ask(s, "b")
        s.tick(T0)
        if contended_ok:
            s.extend(a.id, T0 + 10, by_s=600)
        else:
            with pytest.raises(Conflict, match="waiting for this GPU"):
                s.extend(a.id, T0 + 10, by_s=600)


def test_a_lower_tier_waiter_cannot_cut_a_higher_tier_lease_short_until_it_has_aged():
    s = Scheduler(gpus(1), P(aging_s=1800))
    a = ask(s, "a", tier="production")
    s.tick(T0)
    b = ask(s, "b", tier="learning", now=T0 + 60)
    s.tick(T0 + 60)
    assert s.eta(b.id) == a.expires_at  # the GPU is promised to b ...
    s.extend(a.id, T0 + 120, by_s=600)  # ... yet a learning waiter does not stop production work
    s.tick(T0 + 60 + 1800)
    with pytest.raises(Conflict, match="someone is waiting for this GPU"):
        s.extend(a.id, T0 + 60 + 1800, by_s=600)  # after waiting aging_s it does
    # a waiter of the same tier blocks at once
    s2 = Scheduler(gpus(1), P(aging_s=1800))
    c = ask(s2, "c", tier="learning")
    s2.tick(T0)
    ask(s2, "d", tier="learning", now=T0 + 60)
    s2.tick(T0 + 60)
    with pytest.raises(Conflict, match="waiting for this GPU"):
        s2.extend(c.id, T0 + 120, by_s=600)
    # without aging, a lower tier never blocks a higher tier's extension, however long it waits
    s3 = Scheduler(gpus(1), P(aging_s=None))
    e = ask(s3, "e", tier="experiment")
    s3.tick(T0)
    f = ask(s3, "f", tier="learning", now=T0 + 60)
    s3.tick(T0 + 50 * 60)
    s3.extend(e.id, T0 + 50 * 60, by_s=HOUR)
    assert e.state is LeaseState.ACTIVE and f.state is LeaseState.QUEUED


def test_extending_a_queued_lease_is_a_conflict():
    s = Scheduler(gpus(1), P())
    ask(s, "a")
    s.tick(T0)
    b = ask(s, "b")
    s.tick(T0)
    with pytest.raises(Conflict):
        s.extend(b.id, T0, by_s=60)


def test_max_wait_withdraws_a_lease_that_waited_too_long():
    s = Scheduler(gpus(1), P())
    ask(s, "a")
    s.tick(T0)
    b = ask(s, "b", max_wait_s=600)
    s.tick(T0)
    evs = s.tick(T0 + 601)
    assert b.state is LeaseState.WITHDRAWN and "wait limit" in b.end_reason
    assert kinds(evs, ev.ENDED)[0].lease_id == b.id


def test_unconfirmed_lease_is_revoked_and_confirmed_one_stays():
    s = Scheduler(gpus(2), P(confirm_timeout_s=300))
    a = ask(s, "a")
    b = ask(s, "b")
    s.tick(T0)
    s.confirm(b.id, T0 + 10)
    s.tick(T0 + 301)
    assert a.state is LeaseState.REVOKED and "never confirmed" in a.end_reason
    assert b.state is LeaseState.ACTIVE


def test_holder_that_stops_heartbeating_loses_the_lease():
    s = Scheduler(gpus(1), P(heartbeat_timeout_s=120, confirm_timeout_s=None))
    a = ask(s, "a")
    s.tick(T0)
    s.heartbeat(a.id, T0 + 100, {"utilization": 50})
    s.tick(T0 + 200)
    assert a.state is LeaseState.ACTIVE and a.usage == {"utilization": 50}
    s.tick(T0 + 221)
    assert a.state is LeaseState.REVOKED and "heartbeats" in a.end_reason


def test_release_of_queued_is_withdrawal_and_double_release_conflicts():
    s = Scheduler(gpus(1), P())
    a = ask(s, "a")
    s.tick(T0)
    b = ask(s, "b")
    s.release(b.id, T0)
    assert b.state is LeaseState.WITHDRAWN
    s.release(a.id, T0)
    assert a.state is LeaseState.RELEASED
    with pytest.raises(NotFound):
        s.release(a.id, T0)


# ------------------------------------------------------------------ preemption
def _preempt_setup(**pol):
    s = Scheduler(gpus(2), P(**pol))
    learners = [ask(s, u, tier="learning") for u in ("l1", "l2")]
    s.tick(T0)
    learners[0].granted_at = T0 - HOUR  # l1 has run longer: more work to lose
    return s, learners


def test_preemption_warns_the_cheapest_victim_and_reclaims_after_grace():
    s, (l1, l2) = _preempt_setup()
    p = ask(s, "boss", tier="production", now=T0 + 60)
    evs = s.tick(T0 + 60)
    warned = kinds(evs, ev.PREEMPT_WARNED)
    assert [e.lease_id for e in warned] == [l2.id]  # least lost work
    assert l2.preempt_at == T0 + 60 + 600
    assert s.eta(p.id) == pytest.approx(T0 + 660)
    assert "preempted" in s.waiting_for(p.id)
    # another pass does not pick more victims
    assert not kinds(s.schedule(T0 + 70), ev.PREEMPT_WARNED)
    evs = s.tick(T0 + 660)
    assert l2.state is LeaseState.PREEMPTED and p.state is LeaseState.ACTIVE and l1.state is LeaseState.ACTIVE
    assert p.placement.slices[0].gpu_uuid == l2.placement.slices[0].gpu_uuid


def test_preemption_is_called_off_when_the_waiter_leaves():
    s, (_l1, l2) = _preempt_setup()
    p = ask(s, "boss", tier="production", now=T0 + 60)
    s.tick(T0 + 60)
    evs = s.release(p.id, T0 + 100)
    assert kinds(evs, ev.PREEMPT_CANCELLED) and l2.preempt_at is None
    s.tick(T0 + 700)
    assert l2.state is LeaseState.ACTIVE


def test_non_preemptible_tiers_are_never_preempted():
    s = Scheduler(gpus(1), P())
    a = ask(s, "a", tier="experiment")
    s.tick(T0)
    ask(s, "boss", tier="production")
    evs = s.tick(T0)
    assert not kinds(evs, ev.PREEMPT_WARNED) and a.preempt_at is None


def test_preempted_lease_cannot_be_extended():
    s, (_l1, l2) = _preempt_setup()
    ask(s, "boss", tier="production", now=T0 + 60)
    s.tick(T0 + 60)
    with pytest.raises(Conflict, match="being preempted"):
        s.extend(l2.id, T0 + 61, by_s=60)


# ------------------------------------------------------------------ restart
def test_restore_rebuilds_occupancy_queue_and_deadlines():
    s = Scheduler(gpus(1), P())
    a = ask(s, "a", duration_s=HOUR)
    s.tick(T0)
    b = ask(s, "b")
    s.tick(T0)
    import copy

    saved = [copy.deepcopy(x) for x in s.leases.values()]
    s2 = Scheduler(gpus(1), P())
    s2.restore(saved)
    s2.tick(T0 + 1)
    assert s2.leases[b.id].state is LeaseState.QUEUED  # nothing granted twice
    s2.tick(T0 + HOUR)
    assert s2.leases[b.id].state is LeaseState.ACTIVE
    assert a.id not in s2.leases


def test_restored_lease_on_a_vanished_gpu_fails_with_a_reason():
    s = Scheduler(gpus(1), P())
    a = ask(s, "a")
    s.tick(T0)
    s2 = Scheduler(gpus(1, node="other"), P())
    import copy

    la = copy.deepcopy(a)
    s2.restore([la])
    evs = s2.tick(T0 + 1)
    assert kinds(evs, ev.ENDED)[0].to_state == "failed"
    assert not s2.leases and s2.pool.idle_by_model["A100"] == 1


def test_a_number_too_large_for_a_float_is_a_bad_request_naming_the_field():
    with pytest.raises(BadRequest) as e:
        parse_request({"share": 10**400})
    assert e.value.field == "share"


def test_extension_is_refused_when_it_would_go_over_the_gpu_hour_quota():
    s = Scheduler(gpus(1), P(default_user_quota=Quota(gpu_hours=3, period_s=24 * HOUR)))
    a = ask(s, "u", duration_s=2 * HOUR)
    s.tick(T0)
    with pytest.raises(Refused, match=r"1\.0 GPU-hours left, enough for 1 h more") as e:
        s.extend(a.id, T0 + 60, by_s=2 * HOUR)
    assert e.value.field == "by_s"
    s.extend(a.id, T0 + 60, by_s=HOUR)
    assert a.expires_at == T0 + 3 * HOUR


def test_a_warning_alone_does_not_run_a_scheduling_pass():
    s = Scheduler(gpus(1), P(warn_before_s=600))
    a = ask(s, "a", duration_s=HOUR)
    ask(s, "b", duration_s=HOUR)
    s.tick(T0)
    passes = s.passes
    evs = s.tick(T0 + HOUR - 600)
    assert [e.kind for e in evs] == [ev.WARNED] and evs[0].lease_id == a.id
    assert s.passes == passes  # nothing a pass decides on has changed
    s.tick(T0 + HOUR)  # the expiry does
    assert s.passes == passes + 1 and a.state is LeaseState.EXPIRED


def test_a_mig_lease_already_being_preempted_is_not_taken_again_for_another_waiter():
    gpu = GPU("G", "n", 0, "A100", 81920, mig=(MigInstance("MIG-a", "3g.40gb", 40960, 0), MigInstance("MIG-b", "3g.40gb", 40960, 1)))
    s = Scheduler([gpu], P())
    ending = ask(s, "l1", {"mig_profile": "3g.40gb"}, tier="learning", duration_s=600)  # ends at T0+600 anyway
    s.tick(T0)
    newer = ask(s, "l2", {"mig_profile": "3g.40gb"}, now=T0 + 10, tier="learning")
    s.tick(T0 + 10)
    first = ask(s, "p1", {"mig_profile": "3g.40gb"}, now=T0 + 20, tier="production")
    s.tick(T0 + 20)
    assert newer.preempt_at == T0 + 20 + 600 and newer.preempted_for == first.id  # the newest: least work lost
    assert s.eta(first.id) == ending.expires_at  # the first waiter is promised the instance that frees first
    second = ask(s, "p2", {"mig_profile": "3g.40gb"}, now=T0 + 30, tier="production")
    s.tick(T0 + 30)
    # the lease in its grace stays preempted for the first waiter: not restarted, not taken over
    assert newer.preempt_at == T0 + 20 + 600 and newer.preempted_for == first.id
    assert s.preempting_for(second.id) is None


# ------------------------------------------------------------------ an admin's revoke with a grace
def test_a_revoke_with_a_grace_warns_the_holder_then_ends_the_lease_as_revoked_with_the_admins_words():
    s = Scheduler(gpus(1), P())
    a = ask(s, "alice")
    s.tick(T0)
    events = s.revoke(a.id, T0 + 10, grace_s=600, reason="node maintenance at noon", actor="admin:carol")
    (warned,) = kinds(events, ev.PREEMPT_WARNED)
    assert warned.actor == "admin:carol" and warned.data == {"preempt_at": T0 + 610, "revoke": True}
    assert "an admin ends this lease in 10 min: node maintenance at noon" in warned.reason
    assert a.state is LeaseState.ACTIVE and a.preempt_at == T0 + 610
    with pytest.raises(Conflict):  # a longer grace than what is already decided
        s.revoke(a.id, T0 + 20, grace_s=3000, reason="again", actor="admin:carol")
    b = ask(s, "bob", now=T0 + 20)
    assert not kinds(s.tick(T0 + 609), ev.ENDED) and a.state is LeaseState.ACTIVE
    ended = kinds(s.tick(T0 + 611), ev.ENDED)
    assert [(e.lease_id, e.to_state, e.reason, e.actor) for e in ended] == [(a.id, "revoked", "node maintenance at noon", "admin:carol")]
    assert a.ended_at == T0 + 610 and b.state is LeaseState.ACTIVE  # the GPU goes to the next in the queue


def test_a_revoke_of_a_queued_request_or_without_a_grace_ends_it_at_once():
    s = Scheduler(gpus(1), P())
    a = ask(s, "alice")
    s.tick(T0)
    b = ask(s, "bob")
    s.revoke(b.id, T0 + 1, grace_s=600, reason="not today", actor="admin:carol")
    assert b.state is LeaseState.WITHDRAWN
    s.revoke(a.id, T0 + 2, grace_s=0, reason="now", actor="admin:carol")
    assert a.state is LeaseState.REVOKED and a.end_reason == "now"


def test_a_revoke_is_kept_across_a_restore():
    s = Scheduler(gpus(1), P())
    a = ask(s, "alice")
    s.tick(T0)
    s.revoke(a.id, T0, grace_s=60, reason="maintenance", actor="admin:carol")
    from jupyter_gpulease.core.model import Lease
    s2 = Scheduler(gpus(1), P())
    s2.restore([Lease.from_dict(a.to_dict())])
    (e,) = kinds(s2.tick(T0 + 61), ev.ENDED)
    assert (e.to_state, e.reason, e.actor) == ("revoked", "maintenance", "admin:carol")
