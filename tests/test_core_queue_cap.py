"""The per-user cap on waiting requests (``max_queued_per_user``), and what a waiting lease is
promised: both read from the scheduler's own indexes (core alone, no broker)."""

import pytest

from jupyter_gpulease.core.model import GPU, LeaseState, MigInstance, TooManyQueued
from jupyter_gpulease.core.policy import SETTINGS, Policy
from jupyter_gpulease.core.request import Ask, parse_request
from jupyter_gpulease.core.scheduler import Scheduler

T0 = 1_000_000.0
ONE = parse_request({"gpus": 1})


def pool(n: int = 1):
    return [GPU(f"GPU-{i}", "n1", i, "L4", 23034) for i in range(n)]


def ask(sched: Scheduler, user: str, now: float = T0, **kw):
    """``user`` asks for one GPU: the lease (submitted and scheduled), or the error."""
    lease = sched.new_lease(Ask(user=user, request=kw.pop("request", ONE), duration_s=3600, **kw), now)
    sched.submit(lease, now)
    sched.tick(now)
    return lease


def test_the_setting_is_declared_once_with_a_generous_default_and_zero_for_none():
    s = {x.name: x for x in SETTINGS}["max_queued_per_user"]
    assert s.kind is int and s.default == 100 and s.zero_is_off
    assert Policy(max_queued_per_user=0).max_queued_per_user is None
    with pytest.raises(ValueError, match="max_queued_per_user must be at least 0"):
        Policy(max_queued_per_user=-1)


def test_a_user_with_as_many_waiting_requests_as_the_policy_allows_is_refused_429_naming_the_setting_and_count():
    sched = Scheduler(pool(1), Policy(max_queued_per_user=2, confirm_timeout_s=None))
    held = ask(sched, "alice")  # granted: it does not wait
    waiting = [ask(sched, "alice"), ask(sched, "alice")]
    assert held.state is LeaseState.ACTIVE and [x.state for x in waiting] == [LeaseState.QUEUED] * 2
    with pytest.raises(TooManyQueued) as e:
        ask(sched, "alice")
    assert e.value.status == 429 and e.value.field is None
    assert "alice has 2 requests waiting" in e.value.message and "max_queued_per_user (2)" in e.value.message
    assert ask(sched, "bob").state is LeaseState.QUEUED  # others are not held back by alice's queue
    estimate = sched.estimate(Ask(user="alice", request=ONE, duration_s=3600), T0)
    assert estimate.start == "never" and isinstance(estimate.refused, TooManyQueued)
    sched.release(waiting[0].id, T0 + 1)  # withdrawn: a place is free again
    assert ask(sched, "alice", T0 + 2).state is LeaseState.QUEUED


def test_without_a_cap_any_number_of_requests_waits():
    sched = Scheduler(pool(1), Policy(max_queued_per_user=0, confirm_timeout_s=None))
    leases = [ask(sched, "alice") for _ in range(150)]
    assert sum(x.state is LeaseState.QUEUED for x in leases) == 149


def test_the_devices_promised_to_a_waiting_lease_name_their_holders_through_the_pool():
    mig = GPU("GPU-m", "n2", 0, "A100-SXM4-80GB", 81920, mig=(MigInstance("MIG-0", "3g.40gb", 40960, 0), MigInstance("MIG-1", "3g.40gb", 40960, 1)))
    sched = Scheduler([*pool(1), mig], Policy(confirm_timeout_s=None))
    whole = ask(sched, "alice")
    parts = [ask(sched, u, request=parse_request({"mig": "3g.40gb"})) for u in ("bob", "carol")]
    assert [x.state for x in (whole, *parts)] == [LeaseState.ACTIVE] * 3
    waiting_whole = ask(sched, "dave")
    waiting_mig = ask(sched, "erin", request=parse_request({"mig": "3g.40gb"}))
    assert [h.id for h in sched.promised_holders(waiting_whole.id)] == [whole.id]
    [holder] = sched.promised_holders(waiting_mig.id)  # the holder of the promised instance, not its neighbour
    assert holder.id in {p.id for p in parts} and holder.placement.slices[0].mig_uuid in {"MIG-0", "MIG-1"}
    assert sched.promised_holders(whole.id) is None  # nothing is promised to a lease that holds its GPU
