"""Invariants of the scheduler under random sequences of requests, releases, time, extension."""

from collections import defaultdict

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jupyter_gpulease.core.model import GPU, MILLI, LeaseError, LeaseState, MigInstance
from jupyter_gpulease.core.policy import Policy, Quota
from jupyter_gpulease.core.request import Ask, parse_request
from jupyter_gpulease.core.scheduler import Scheduler

T0 = 1_000_000.0

POOL = [GPU(f"G{n}{i}", f"n{n}", i, "A100" if n == 0 else "L4", 81920 if n == 0 else 24576) for n in range(2) for i in range(2)] + [
    GPU("GM", "n2", 0, "A100", 81920, mig=(MigInstance("M0", "3g.40gb", 40960, 0), MigInstance("M1", "3g.40gb", 40960, 1)))
]

requests = st.one_of(
    st.builds(lambda n, m: {"gpus": n, **({"model": m} if m else {})}, st.integers(1, 2), st.sampled_from([None, "A100", "L4"])),
    st.builds(lambda f: {"share": f}, st.sampled_from([0.1, 0.25, 0.5, 0.75])),
    st.builds(lambda mem: {"memory_mib": mem}, st.sampled_from([4096, 20000, 40000])),
    st.just({"mig_profile": "3g.40gb"}),
)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("ask"), st.sampled_from(["u1", "u2", "u3"]), requests, st.sampled_from(["production", "experiment", "learning"]), st.integers(60, 4 * 3600)),
        st.tuples(st.just("release"), st.integers(0, 40)),
        st.tuples(st.just("time"), st.integers(1, 3 * 3600)),
        st.tuples(st.just("extend"), st.integers(0, 40), st.integers(60, 3600)),
        st.tuples(st.just("heartbeat"), st.integers(0, 40)),
    ),
    max_size=60,
)


def check_invariants(s: Scheduler, all_leases):
    # capacity: never more compute or memory than a GPU has; never two holders of a whole GPU or MIG instance
    use_milli = defaultdict(int)
    use_mem = defaultdict(int)
    whole = defaultdict(int)
    mig_holders = defaultdict(int)
    for lease in all_leases:
        states = [x for x in LeaseState if lease.state is x]
        assert len(states) == 1  # exactly one state
        live = lease.id in s.leases
        assert live == (not lease.state.terminal)
        if lease.state is LeaseState.ACTIVE:
            assert lease.placement is not None and lease.granted_at is not None and lease.expires_at > lease.granted_at - 1e-9
            for sl in lease.placement.slices:
                if sl.mig_uuid:
                    mig_holders[sl.mig_uuid] += 1
                else:
                    use_milli[sl.gpu_uuid] += sl.share_milli
                    use_mem[sl.gpu_uuid] += sl.memory_mib
                    if sl.share_milli == MILLI:
                        whole[sl.gpu_uuid] += 1
    for g in POOL:
        assert use_milli[g.uuid] <= MILLI
        assert use_mem[g.uuid] <= g.memory_mib
        if whole[g.uuid]:
            assert whole[g.uuid] == 1 and use_milli[g.uuid] == MILLI
        st_ = s.pool.gpus[g.uuid]
        if not g.mig:
            assert st_.free_milli == MILLI - use_milli[g.uuid]  # the pool agrees with the leases
            assert st_.free_mem == g.memory_mib - use_mem[g.uuid]
    assert all(v == 1 for v in mig_holders.values())
    # positions asked one by one (the order is built lazily) agree with the full order
    queued = sorted(lease.id for lease in s.leases.values() if lease.state is LeaseState.QUEUED)
    positions = {lid: s.queue_position(lid) for lid in reversed(queued[: len(queued) // 2 + 1])} if queued else {}
    # queue order respected: tiers by priority, never a lower tier before a higher one
    q = s.queue()
    for lid, (pos, length) in positions.items():
        assert q[pos - 1].id == lid and length == len(q)
    prios = [s.policy.tiers[lease.tier].priority for lease in q]
    assert prios == sorted(prios, reverse=True)
    assert all(lease.state is LeaseState.QUEUED for lease in q)
    assert len(q) == sum(1 for lease in s.leases.values() if lease.state is LeaseState.QUEUED)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops, st.booleans(), st.booleans(), st.sampled_from(("best_fit", "fragmentation")))
def test_invariants_hold_under_random_operations(seq, fair, quota, share_placement):
    pol = Policy(
        fair_share=fair, confirm_timeout_s=1800, default_user_quota=Quota(max_gpus=2) if quota else Quota(), reservation_depth=5, share_placement=share_placement
    )
    s = Scheduler(POOL, pol)
    now = T0
    all_leases = []
    for op in seq:
        try:
            if op[0] == "ask":
                _, user, req, tier, dur = op
                lease = s.new_lease(Ask(user=user, request=parse_request(req), tier=tier, duration_s=min(dur, pol.tiers[tier].max_duration_s)), now)
                s.submit(lease, now)
                all_leases.append(lease)
            elif op[0] == "release" and all_leases:
                s.release(all_leases[op[1] % len(all_leases)].id, now)
            elif op[0] == "time":
                now += op[1]
            elif op[0] == "extend" and all_leases:
                s.extend(all_leases[op[2 - 1] % len(all_leases)].id, now, by_s=op[2])
            elif op[0] == "heartbeat" and all_leases:
                s.heartbeat(all_leases[op[1] % len(all_leases)].id, now)
        except LeaseError:
            pass
        s.tick(now)
        check_invariants(s, all_leases)
    # granted leases never started before they were asked for, and waiting never runs backwards
    for lease in all_leases:
        if lease.granted_at is not None:
            assert lease.granted_at >= lease.created_at


def _head_is_never_delayed(jobs, pol):
    """Run ``jobs`` (gpus, duration, tier) to completion; the first waiting lease starts no later
    than its ETA at the time it became the head, and no grant is longer than asked."""
    s = Scheduler([GPU(f"G{i}", "n", i, "A100", 81920) for i in range(2)], pol)
    now = T0
    leases = []
    for n, d, tier in jobs:
        lease = s.new_lease(Ask(user="u", request=parse_request({"gpus": n}), duration_s=d, tier=tier), now)
        s.submit(lease, now)
        leases.append(lease)
    s.tick(now)
    promised = {}
    while s.leases:
        q = s.queue()
        if q:
            eta = s.eta(q[0].id)
            assert eta is not None
            promised.setdefault(q[0].id, eta)
        for lease in s.active():
            assert lease.expires_at - lease.granted_at <= lease.duration_s + 1e-6
        nxt = s.next_deadline()
        assert nxt is not None
        now = nxt
        s.tick(now)
    for lease in leases:
        if lease.id in promised:
            assert lease.granted_at <= promised[lease.id] + 1e-6


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 2), st.integers(600, 3 * 3600)), min_size=2, max_size=25))
def test_backfill_never_delays_the_head_of_the_queue(jobs):
    _head_is_never_delayed([(n, d, None) for n, d in jobs], Policy(confirm_timeout_s=None, preemption=False, fair_share=False))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 2), st.integers(600, 3 * 3600), st.sampled_from(["experiment", "learning"])), min_size=2, max_size=25))
def test_short_grants_never_delay_the_head_of_the_queue(jobs):
    """Preemptible leases that start on promised GPUs (short grants) end before the promise begins."""
    _head_is_never_delayed(jobs, Policy(confirm_timeout_s=None, preemption=False, fair_share=False, aging_s=None))
