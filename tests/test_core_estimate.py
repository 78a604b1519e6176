"""What a request would get, asked before it is made: the same as what it gets when it is made."""

import itertools
import random

import pytest

from jupyter_gpulease.core.model import GPU, LeaseError, LeaseState, MigInstance
from jupyter_gpulease.core.policy import DEFAULT_TIERS, HOUR, Policy, Quota
from jupyter_gpulease.core.request import Ask, parse_request
from jupyter_gpulease.core.scheduler import Scheduler

T0 = 1_000_000.0
IDS = itertools.count()


def pool():
    out = [GPU(f"GPU-{n}-{i}", f"n{n}", i, "A100", 81920) for n in range(2) for i in range(4)]
    out.append(GPU("GPU-m", "n2", 0, "A100", 81920, mig=tuple(MigInstance(f"MIG-{k}", "1g.10gb", 10240, k) for k in range(3))))
    return out


def submit(s, now, **kw):
    lease = s.new_lease(Ask(**kw), now, lease_id=f"L{next(IDS)}")
    s.submit(lease, now)
    return lease


def test_a_request_that_fits_now_is_told_so_with_the_length_it_would_get():
    s = Scheduler(pool(), Policy(confirm_timeout_s=None))
    e = s.estimate(Ask(user="ann", request=parse_request({"gpus": 2}), duration_s=HOUR), T0)
    assert e.start == "now" and e.duration_s == HOUR and len(e.placement.slices) == 2
    assert s.queue_length() == 0 and not s.leases and s.capacity()["A100"]["idle_gpus"] == 8  # nothing changed


def test_a_request_that_would_wait_gets_its_position_and_eta_and_whether_it_beats_its_wait_limit():
    s = Scheduler(pool(), Policy(confirm_timeout_s=None))
    for u in "abcdefgh":
        submit(s, T0, user=u, duration_s=2 * HOUR)
    s.tick(T0)
    submit(s, T0 + 1, user="x", request=parse_request({"gpus": 4}), duration_s=HOUR)
    s.tick(T0 + 1)
    e = s.estimate(Ask(user="ann", duration_s=HOUR, max_wait_s=600), T0 + 2)
    assert e.start == "queued" and (e.position, e.length) == (2, 2)
    assert e.eta == pytest.approx(T0 + 2 * HOUR) and e.within_wait_limit is False
    assert s.estimate(Ask(user="ann", duration_s=HOUR, max_wait_s=3 * HOUR), T0 + 2).within_wait_limit is True
    assert s.queue_length() == 1


def test_a_request_that_can_never_start_is_refused_with_the_reason():
    s = Scheduler(pool(), Policy())
    e = s.estimate(Ask(user="ann", request=parse_request({"gpus": 5})), T0)
    assert e.start == "never" and e.refused.field == "gpus" and "the most any node has is 4" in e.refused.message
    assert e.to_dict()["refused"]["field"] == "gpus"


def test_a_wait_on_a_quota_has_an_eta_when_the_blocking_lease_ends():
    s = Scheduler(pool(), Policy(confirm_timeout_s=None, default_user_quota=Quota(max_gpus=1)))
    held = submit(s, T0, user="ann", duration_s=HOUR)
    s.tick(T0)
    waiting = submit(s, T0 + 5, user="ann", duration_s=HOUR)
    s.tick(T0 + 5)
    info = s.queue_info(waiting.id)
    assert "quota" in info["waiting_for"] and info["eta"] == held.expires_at
    assert s.estimate(Ask(user="ann", duration_s=HOUR), T0 + 6).eta == held.expires_at


def test_queue_info_says_when_the_eta_is_after_the_wait_limit():
    s = Scheduler(pool()[:1], Policy(confirm_timeout_s=None))
    submit(s, T0, user="ann", duration_s=8 * HOUR)
    s.tick(T0)
    w = submit(s, T0, user="bob", duration_s=HOUR, max_wait_s=3600)
    s.tick(T0)
    info = s.queue_info(w.id)
    assert info["eta_after_wait_limit"] is True and info["gives_up_at"] == T0 + 3600 and info["eta"] == T0 + 8 * HOUR


def test_a_preemption_shows_up_in_the_eta_of_a_higher_tier_request():
    s = Scheduler(pool(), Policy(confirm_timeout_s=None))
    for u in "abcdefgh":
        submit(s, T0, user=u, tier="learning", duration_s=4 * HOUR)
    s.tick(T0)
    e = s.estimate(Ask(user="boss", tier="production", duration_s=HOUR), T0 + 1)
    assert e.start == "queued" and e.eta == pytest.approx(T0 + 1 + DEFAULT_TIERS["learning"].grace_s)
    assert all(lease.preempt_at is None for lease in s.leases.values())  # nobody was warned


def test_while_draining_nothing_is_granted_and_the_queue_says_why():
    s = Scheduler(pool(), Policy(confirm_timeout_s=None))
    s.set_draining(True)
    w = submit(s, T0, user="ann")
    s.tick(T0)
    assert w.state is LeaseState.QUEUED and "draining" in s.waiting_for(w.id)
    assert s.estimate(Ask(user="bob"), T0).start == "queued"
    s.set_draining(False)
    s.tick(T0 + 1)
    assert w.state is LeaseState.ACTIVE


@pytest.mark.parametrize("seed", range(25))
def test_the_estimate_is_what_the_request_gets_when_it_is_made(seed):
    rng = random.Random(seed)
    tiers = dict(DEFAULT_TIERS)
    s = Scheduler(pool(), Policy(tiers=tiers, confirm_timeout_s=None, default_user_quota=Quota(max_gpus=rng.choice([None, 3])),
                                 reservation_depth=rng.choice([2, 100])))
    now = T0
    kinds = [{"gpus": 1}, {"gpus": 2}, {"gpus": 4}, {"share": 0.5}, {"share": 0.25}, {"mig_profile": "1g.10gb"}]
    for _ in range(rng.randint(5, 30)):
        now += rng.choice([0, 10, 300])
        if rng.random() < 0.2 and s.leases:
            s.release(rng.choice(sorted(s.leases)), now)
        else:
            try:
                submit(s, now, user=f"u{rng.randrange(5)}", request=parse_request(rng.choice(kinds)), tier=rng.choice(list(tiers)),
                       duration_s=rng.choice([1800, HOUR, 3 * HOUR]))
            except LeaseError:
                pass  # over a quota: refused, as it would be
        s.tick(now)
    ask = Ask(user=f"u{rng.randrange(6)}", request=parse_request(rng.choice(kinds)), tier=rng.choice(list(tiers)), duration_s=HOUR)
    e = s.estimate(ask, now)
    if e.start == "never":
        with pytest.raises(LeaseError, match=e.refused.message):
            s.new_lease(ask, now)
        return
    lease = s.new_lease(ask, now)
    s.submit(lease, now)
    s.tick(now)
    if e.start == "now":
        assert lease.state is LeaseState.ACTIVE and lease.placement == e.placement and lease.expires_at == pytest.approx(now + e.duration_s)
    else:
        assert lease.state is LeaseState.QUEUED
        info = s.queue_info(lease.id)
        assert (info["position"], info["length"], info["eta"]) == (e.position, e.length, e.eta)
        assert info["waiting_for"] == e.waiting_for
