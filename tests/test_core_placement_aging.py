"""Preemption-aware placement and aging in the core scheduler."""

import pytest

from jupyter_gpulease.core import events as ev
from jupyter_gpulease.core.model import GPU, Conflict, LeaseState
from jupyter_gpulease.core.policy import HOUR, Policy
from jupyter_gpulease.core.request import Ask, parse_request
from jupyter_gpulease.core.scheduler import Scheduler

T0 = 1_000_000.0


def pool(nodes=2, per_node=4):
    return [GPU(f"GPU-n{n}-{i}", f"n{n}", i, "A100", 81920) for n in range(nodes) for i in range(per_node)]


def lease(s, user, gpus=1, tier="experiment", now=T0, duration_s=HOUR):
    lease = s.new_lease(Ask(user=user, request=parse_request({"gpus": gpus}), tier=tier, duration_s=duration_s), now)
    s.submit(lease, now)
    return lease


def node_of(s, lease):
    return s.get(lease.id).placement.slices[0].node


def test_non_preemptible_leases_are_kept_together():
    s = Scheduler(pool(), Policy(confirm_timeout_s=None))
    a = lease(s, "a", tier="learning")
    s.tick(T0)
    b = lease(s, "b", tier="production")
    s.tick(T0)
    c = lease(s, "c", tier="experiment")
    d = lease(s, "d", tier="learning")
    s.tick(T0)
    # preemptible work on one node, non-preemptible on the other
    assert node_of(s, b) == node_of(s, c) != node_of(s, a) == node_of(s, d)


def test_segregation_lets_preemption_free_a_whole_node():
    s = Scheduler(pool(), Policy(confirm_timeout_s=None))
    for u, t in (("l1", "learning"), ("l2", "learning"), ("l3", "learning"), ("p1", "production"), ("p2", "production"), ("p3", "production")):
        lease(s, u, tier=t, duration_s=4 * HOUR)
        s.tick(T0)
    big = lease(s, "big", gpus=4, tier="production", now=T0 + 1)
    out = s.tick(T0 + 1)
    assert [e.kind for e in out if e.kind == ev.PREEMPT_WARNED]  # the learning node is emptied
    out = s.tick(T0 + 1 + 11 * 60)
    assert s.get(big.id).state is LeaseState.ACTIVE


def test_blind_placement_when_off():
    s = Scheduler(pool(), Policy(confirm_timeout_s=None, placement_by_preemptibility=False))
    a = lease(s, "a", tier="learning")
    s.tick(T0)
    b = lease(s, "b", tier="production")
    s.tick(T0)
    assert node_of(s, a) == node_of(s, b)  # best fit, blind to tiers


def test_aged_lease_is_considered_before_newer_higher_tier_leases():
    s = Scheduler(pool(1, 2), Policy(confirm_timeout_s=None, aging_s=1800, preemption=False))
    hold = lease(s, "h", gpus=2, tier="production", duration_s=HOUR)
    s.tick(T0)
    old = lease(s, "old", gpus=2, tier="experiment", now=T0 + 10)
    s.tick(T0 + 10)
    new = lease(s, "new", gpus=1, tier="production", now=T0 + 2000)
    s.tick(T0 + 2000)
    assert [lease.id for lease in s.queue()] == [old.id, new.id]
    s.release(hold.id, T0 + 2100)
    s.tick(T0 + 2100)
    assert s.get(old.id).state is LeaseState.ACTIVE
    assert s.get(new.id).state is LeaseState.QUEUED


def test_no_aging_keeps_strict_tier_order():
    s = Scheduler(pool(1, 2), Policy(confirm_timeout_s=None, aging_s=None, preemption=False))
    hold = lease(s, "h", gpus=2, tier="production", duration_s=HOUR)
    s.tick(T0)
    old = lease(s, "old", gpus=2, tier="experiment", now=T0 + 10)
    new = lease(s, "new", gpus=1, tier="production", now=T0 + 2000)
    s.tick(T0 + 2000)
    assert [lease.id for lease in s.queue()] == [new.id, old.id]
    s.release(hold.id, T0 + 2100)
    s.tick(T0 + 2100)
    assert s.get(new.id).state is LeaseState.ACTIVE


_TIE_SCRIPT = """
from jupyter_gpulease.core.model import GPU
from jupyter_gpulease.core.request import Ask, parse_request
from jupyter_gpulease.core.policy import HOUR, Policy
from jupyter_gpulease.core.scheduler import Scheduler
gpus = [GPU(f"GPU-{m}{n}-{i}", f"{m}-node{n}", i, m, 81920) for m in ("A100", "H100") for n in range(12) for i in range(4)]
s = Scheduler(gpus, Policy(confirm_timeout_s=None))
out = []
for k in range(30):
    model = ("A100", "H100", "A100|H100")[k % 3]
    lease = s.new_lease(Ask(user=f"u{k}", request=parse_request({"gpus": 4, "model": model}), duration_s=HOUR * (1 + k % 4)), 0.0, lease_id=f"L{k}")
    s.submit(lease, 0.0)
s.tick(0.0)
for l in s.queue():
    out.append((l.id, s.eta(l.id)))
print(sorted((l.user, l.placement.slices[0].node) for l in s.active()), out)
"""


def test_ties_between_equal_nodes_break_the_same_way_whatever_the_hash_seed():
    # placement and reservations walk nodes in inventory order, not a set's (hash-seeded) order,
    # so a replay gives the same result in every process
    import os
    import subprocess
    import sys

    runs = []
    for seed in ("1", "2", "3"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        runs.append(subprocess.run([sys.executable, "-c", _TIE_SCRIPT], env=env, capture_output=True, text=True, check=True).stdout)
    assert runs[0] == runs[1] == runs[2]
    s = Scheduler(pool(3, 4), Policy(confirm_timeout_s=None))
    a = lease(s, "a", gpus=4)
    s.tick(T0)
    assert node_of(s, a) == "n0"  # first of equal nodes in inventory order


# ------------------------------------------------------------------ fragmentation-aware shares
def share(s, user, frac, now=T0):
    lease = s.new_lease(Ask(user=user, request=parse_request({"share": frac}), duration_s=HOUR), now)
    s.submit(lease, now)
    s.tick(now)
    return lease


def gpu_of(s, lease):
    return s.get(lease.id).placement.slices[0].index


def stranding_case(share_placement):
    """Two GPUs; 0.8 shares seen before; GPU 0 holds 0.15, GPU 1 holds 0.1; then a 0.1 share and two 0.8 shares."""
    s = Scheduler(pool(1, 2), Policy(confirm_timeout_s=None, share_placement=share_placement))
    for u in ("h1", "h2"):  # history: two 0.8 shares, done
        share(s, u, 0.8)
    for u in ("h1", "h2"):
        s.release(next(lease.id for lease in s.leases.values() if lease.user == u), T0)
    a = share(s, "a", 0.15)
    b = share(s, "b", 0.9)
    c = share(s, "c", 0.1)
    assert (gpu_of(s, a), gpu_of(s, b), gpu_of(s, c)) == (0, 1, 1)
    s.release(b.id, T0)
    e = share(s, "e", 0.1)
    f = share(s, "f", 0.8)
    g = share(s, "g", 0.8)
    return s, e, f, g


def test_best_fit_strands_room_for_a_large_share():
    s, e, f, g = stranding_case("best_fit")
    assert gpu_of(s, e) == 0  # the fullest GPU: 0.75 free there, 0.9 on the other
    assert s.get(f.id).state is LeaseState.ACTIVE
    assert s.get(g.id).state is LeaseState.QUEUED  # 0.85 free in all, but no GPU has 0.8


def test_fragmentation_aware_placement_keeps_room_for_a_large_share():
    s, e, f, g = stranding_case("fragmentation")
    assert gpu_of(s, e) == 1  # leaves 0.85 and 0.8 free: both 0.8 shares fit
    assert s.get(f.id).state is LeaseState.ACTIVE
    assert s.get(g.id).state is LeaseState.ACTIVE
    assert {gpu_of(s, f), gpu_of(s, g)} == {0, 1}


def test_fragmentation_ties_fall_back_to_best_fit_and_idle_gpus_stay_whole():
    s = Scheduler(pool(2, 2), Policy(confirm_timeout_s=None, share_placement="fragmentation", placement_by_preemptibility=False))
    a = share(s, "a", 0.3)
    b = share(s, "b", 0.3)
    assert gpu_of(s, a) == gpu_of(s, b)  # packed onto one GPU, not spread over idle ones
    assert s.capacity()["A100"]["idle_gpus"] == 3


def test_share_sizes_fragmentation_table():
    from jupyter_gpulease.core.pool import ShareSizes

    sz = ShareSizes(prior=0.0)
    for _ in range(3):
        sz.add(800)
    sz.add(1000)
    t = sz.frag_table()
    assert t[1000] == 0  # an idle GPU takes any request
    assert t[900] == 900 * 0.25  # only the whole-GPU requests cannot use 0.9
    assert t[799] == 799 * 1.0
    sz.add(200)
    assert sz.frag_table()[799] == 799 * 4 / 5  # rebuilt after a new sample


def test_share_placement_is_validated():
    import pytest

    with pytest.raises(ValueError, match="share_placement"):
        Policy(share_placement="worst_fit")


def test_a_multi_gpu_request_ages_sooner_and_older_leases_age_with_it():
    for by_size in (True, False):
        s = Scheduler(pool(1, 4), Policy(confirm_timeout_s=None, aging_s=1800, multi_gpu_aging=0.25 if by_size else 1.0, preemption=False))
        lease(s, "h", gpus=4, tier="production", duration_s=HOUR)
        s.tick(T0)
        small = lease(s, "small", gpus=1, tier="experiment", now=T0 + 10)
        big = lease(s, "big", gpus=4, tier="experiment", now=T0 + 20)
        p = lease(s, "p", gpus=1, tier="production", now=T0 + 600)
        s.tick(T0 + 600)
        order = [lease.id for lease in s.queue()]
        if by_size:
            # 4 GPUs age after 1800 x 0.25 = 450 s; the older small request ages with it, in arrival order
            assert order == [small.id, big.id, p.id]
        else:
            assert order[0] == p.id
        # nothing is aged before its time: at T0 + 400 the big request is still in tier order
        s2 = Scheduler(pool(1, 4), Policy(confirm_timeout_s=None, aging_s=1800, multi_gpu_aging=0.25 if by_size else 1.0, preemption=False))
        lease(s2, "h", gpus=4, tier="production", duration_s=HOUR)
        b2 = lease(s2, "big", gpus=4, tier="experiment", now=T0 + 20)
        p2 = lease(s2, "p", gpus=1, tier="production", now=T0 + 300)
        s2.tick(T0 + 400)
        assert [lease.id for lease in s2.queue()] == [p2.id, b2.id]


def test_a_preemptible_lease_starts_on_promised_gpus_until_the_promise_begins():
    def setup(**kw):
        s = Scheduler(pool(1, 2), Policy(confirm_timeout_s=None, preemption=False, **kw))
        h = lease(s, "h", gpus=1, tier="production", duration_s=HOUR)
        s.tick(T0)
        w = lease(s, "w", gpus=2, tier="production", now=T0 + 60)
        s.tick(T0 + 60)
        assert s.eta(w.id) == T0 + HOUR  # both GPUs promised to w from then on
        return s, h, w

    s, h, w = setup()
    learner = lease(s, "l", gpus=1, tier="learning", now=T0 + 120, duration_s=2 * HOUR)
    e = lease(s, "e", gpus=1, tier="experiment", now=T0 + 120, duration_s=2 * HOUR)
    evs = s.tick(T0 + 120)
    assert learner.state is LeaseState.ACTIVE and learner.expires_at == T0 + HOUR  # cut to when w's promise begins
    granted = [x for x in evs if x.kind == ev.GRANTED]
    assert [x.lease_id for x in granted] == [learner.id]
    assert granted[0].data["short_grant"] is True and "promised to a waiting lease" in granted[0].reason
    assert e.state is LeaseState.QUEUED  # a non-preemptible lease gets no short grant
    assert s.eta(w.id) == T0 + HOUR  # the promise holds
    with pytest.raises(Conflict, match="waiting for this GPU"):
        s.extend(learner.id, T0 + HOUR - 600, by_s=HOUR)
    s.tick(T0 + HOUR)
    assert learner.state is LeaseState.EXPIRED and h.state is LeaseState.EXPIRED
    assert w.state is LeaseState.ACTIVE

    # off: it waits
    s, h, w = setup(short_grants=False)
    learner = lease(s, "l", gpus=1, tier="learning", now=T0 + 120, duration_s=2 * HOUR)
    s.tick(T0 + 120)
    assert learner.state is LeaseState.QUEUED
    # a promise that begins in under 10 minutes is not worth a grant
    s, h, w = setup()
    learner = lease(s, "l", gpus=1, tier="learning", now=T0 + HOUR - 300, duration_s=2 * HOUR)
    s.tick(T0 + HOUR - 300)
    assert learner.state is LeaseState.QUEUED
    # a lease short enough to end before the promise is an ordinary backfill, with its own limit
    s, h, w = setup()
    learner = lease(s, "l", gpus=1, tier="learning", now=T0 + 120, duration_s=1200)
    s.tick(T0 + 120)
    assert learner.state is LeaseState.ACTIVE and learner.expires_at == T0 + 120 + 1200


def test_multi_gpu_aging_is_validated():
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="multi_gpu_aging"):
            Policy(multi_gpu_aging=bad)
