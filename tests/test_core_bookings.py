"""Bookings: GPUs reserved ahead for a person, a group or a course. Placed ahead of time on
concrete GPUs; kept free of everyone else's grants in their time; their owner's requests take
them first from their start; given back when not used; moved off a GPU that fails."""

import dataclasses

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from jupyter_gpulease.core.bookings import ACCEPTED, ACTIVE, ENDED, Booking, place
from jupyter_gpulease.core.maintenance import MaintenanceWindow
from jupyter_gpulease.core.model import GPU, Conflict, LeaseError, LeaseState, MigInstance
from jupyter_gpulease.core.policy import Policy
from jupyter_gpulease.core.request import Ask, parse_request
from jupyter_gpulease.core.scheduler import Scheduler

T0 = 1_000_000.0
H = 3600.0
DAY = 86400.0

POOL = [GPU(f"G{n}{i}", f"n{n}", i, "A100" if n == 0 else "L4", 81920 if n == 0 else 24576) for n in range(2) for i in range(2)] + [
    GPU("GM", "n2", 0, "A100", 81920, mig=(MigInstance("M0", "3g.40gb", 40960, 0), MigInstance("M1", "3g.40gb", 40960, 1)))
]


def ask(s, now, req, dur, user="u", tier=None, groups=()):
    lease = s.new_lease(Ask(user=user, request=parse_request(req), duration_s=dur, tier=tier, groups=tuple(groups)), now)
    s.submit(lease, now)
    return lease


def booking(bid, start, end, req, users=("owner",), groups=()):
    return Booking(bid, start, end, parse_request(req), users=frozenset(users), groups=frozenset(groups))


def booked(s, b):
    got = s.place_booking(b, T0)
    assert got.ok, got.reason
    return got.booking


# ------------------------------------------------------------------------- placing
def test_place_picks_gpus_of_its_kind_and_refuses_with_the_next_window():
    a = place(booking("a", T0 + H, T0 + 3 * H, {"gpus": 2, "model": "A100"}), POOL, [])
    assert a.ok and a.booking.devices == {"G00", "G01"} and a.booking.state == ACCEPTED
    mig = place(booking("m", T0 + H, T0 + 3 * H, {"mig_profile": "3g.40gb"}), POOL, [a.booking])
    assert mig.ok and mig.booking.slices[0].mig_uuid in ("M0", "M1")
    # the A100s are booked then: refused, with the reason and the next window of the same length
    b = place(booking("b", T0 + 2 * H, T0 + 4 * H, {"gpus": 1, "model": "A100", "min_memory_mib": 81920}), POOL, [a.booking, mig.booking])
    assert not b.ok and "booked by others" in b.reason and b.next_start == T0 + 3 * H and "earliest" in b.reason
    # a maintenance window is in the way as well: the next window starts after both
    w = MaintenanceWindow("w", T0 + 3 * H, T0 + 5 * H, "firmware", devices=frozenset({"G00", "G01", "GM"}))
    b = place(booking("b", T0 + 2 * H, T0 + 4 * H, {"gpus": 1, "model": "A100"}), POOL, [a.booking], [w])
    assert not b.ok and "maintenance window" in b.reason and b.next_start == T0 + 5 * H
    # nothing within the search
    b = place(booking("b", T0 + 2 * H, T0 + 4 * H, {"gpus": 1, "model": "A100"}), POOL, [a.booking], [w], search_s=H)
    assert not b.ok and b.next_start is None and "none within" in b.reason


def test_a_booking_of_a_model_the_pool_lacks_is_refused_with_the_reason():
    got = place(booking("h", T0, T0 + H, {"gpus": 1, "model": "H100"}), POOL, [])
    assert not got.ok and got.next_start is None and "H100" in got.reason and "A100" in got.reason
    assert not place(booking("x", T0 + H, T0, {"gpus": 1}), POOL, []).ok


# ------------------------------------------------------------------------- in the scheduler
def test_others_keep_off_a_booking_and_its_owner_gets_it_at_its_start():
    s = Scheduler([GPU("G0", "n", 0, "A100", 81920)], Policy(confirm_timeout_s=None))
    b = booked(s, booking("course", T0 + H, T0 + 3 * H, {"gpus": 1}, groups=("ml101",)))
    short = ask(s, T0, {"gpus": 1}, 1800, user="v")  # ends before the booking
    s.tick(T0)
    assert short.state is LeaseState.ACTIVE
    s.release(short.id, T0 + 60)
    other = ask(s, T0 + 60, {"gpus": 1}, 2 * H, user="v", tier="production")
    mine = ask(s, T0 + 60, {"gpus": 1}, 4 * H, user="student", groups=("ml101",))
    s.tick(T0 + 60)
    assert other.state is LeaseState.QUEUED and s.eta(other.id) == T0 + 3 * H
    assert "booked" in s.waiting_for(other.id) and "after the booking" in s.waiting_for(other.id)
    with pytest.raises(LeaseError):
        s.extend(short.id, T0 + 60, by_s=60)  # (released: nothing to extend)
    s.tick(T0 + H)
    assert mine.state is LeaseState.ACTIVE and mine.granted_at == T0 + H and mine.expires_at == T0 + 3 * H  # capped at the booking's end
    assert mine.placement.slices[0].gpu_uuid == "G0" and mine.meta["booking"] == "course"
    assert s.bookings["course"].state == ACTIVE
    with pytest.raises(Conflict):
        s.extend(mine.id, T0 + H, by_s=600)
    assert [c.what for c in s.pop_booking_changes()] == ["accepted", "active"]
    s.tick(T0 + 3 * H)
    assert s.bookings["course"].state == ENDED and other.state is LeaseState.ACTIVE
    assert b.devices == {"G0"}


def test_a_preemptible_short_grant_is_cut_at_the_booking_start():
    s = Scheduler([GPU("G0", "n", 0, "A100", 81920)], Policy(confirm_timeout_s=None))
    booked(s, booking("b", T0 + H, T0 + 2 * H, {"gpus": 1}))
    lease = ask(s, T0, {"gpus": 1}, 3 * H, user="v", tier="learning")
    events = s.tick(T0)
    assert lease.state is LeaseState.ACTIVE and lease.expires_at == T0 + H
    assert any("a booking of its GPU begins then" in (e.reason or "") for e in events)


def test_unused_booking_is_given_back_and_early_end():
    s = Scheduler([GPU("G0", "n", 0, "A100", 81920), GPU("G1", "n", 1, "A100", 81920)], Policy(confirm_timeout_s=None))
    booked(s, booking("idle", T0 + H, T0 + 4 * H, {"gpus": 1}))
    booked(s, booking("early", T0 + H, T0 + 4 * H, {"gpus": 1}, users=("w",)))
    s.pop_booking_changes()
    waiting = ask(s, T0, {"gpus": 1}, 3 * H, user="v")
    s.tick(T0)
    assert waiting.state is LeaseState.QUEUED and s.eta(waiting.id) == T0 + 4 * H
    change = s.end_booking("early", T0 + 60)
    assert change.what == ENDED and change.booking.reason == "ended early"
    with pytest.raises(Conflict):
        s.end_booking("early", T0 + 61)
    s.tick(T0 + 60)
    assert waiting.state is LeaseState.ACTIVE
    s.tick(T0 + H + 899)
    assert s.bookings["idle"].state == ACCEPTED
    assert s.next_deadline() <= T0 + H + 900
    s.tick(T0 + H + 900)
    b = s.bookings["idle"]
    assert b.state == ENDED and b.reason == "not used within 15 min"
    assert [c.what for c in s.pop_booking_changes()] == ["ended", "ended"]


def test_a_stranger_on_a_booked_gpu_is_warned_off_with_its_grace():
    s = Scheduler([GPU("G0", "n", 0, "A100", 81920)], Policy(confirm_timeout_s=None))
    lease = ask(s, T0, {"gpus": 1}, 4 * H, user="v", tier="learning")
    s.tick(T0)
    assert lease.state is LeaseState.ACTIVE
    booked(s, booking("b", T0 + H, T0 + 2 * H, {"gpus": 1}))
    assert s.tick(T0 + 60) == []  # not yet: its grace (10 min) is timed to end at the start
    events = s.tick(T0 + H - 600)
    assert lease.preempt_at == T0 + H and any("booked" in e.reason for e in events)
    mine = ask(s, T0 + H - 300, {"gpus": 1}, H, user="owner")
    s.tick(T0 + H)
    assert lease.state is LeaseState.REVOKED and mine.state is LeaseState.ACTIVE and mine.granted_at == T0 + H


def test_a_failed_gpu_moves_the_booking_or_marks_it():
    gpus = [GPU("G0", "n", 0, "A100", 81920), GPU("G1", "n", 1, "A100", 81920)]
    s = Scheduler(gpus, Policy(confirm_timeout_s=None))
    b = booked(s, booking("b", T0 + H, T0 + 2 * H, {"gpus": 1}))
    sick = next(iter(b.devices))
    s.pop_booking_changes()
    s.set_inventory([dataclasses.replace(g, healthy=g.uuid != sick) for g in gpus], T0)
    moved = s.bookings["b"]
    assert moved.devices and sick not in moved.devices and not moved.problem
    assert [c.what for c in s.pop_booking_changes()] == ["moved"]
    s.set_inventory([dataclasses.replace(g, healthy=False) for g in gpus], T0 + 60)
    marked = s.bookings["b"]
    assert marked.state == ACCEPTED and "out of service" in marked.problem
    s.set_inventory(gpus, T0 + 120)
    assert not s.bookings["b"].problem
    mine = ask(s, T0 + H, {"gpus": 1}, 1800, user="owner")
    s.tick(T0 + H)
    assert mine.state is LeaseState.ACTIVE and mine.placement.slices[0].gpu_uuid in s.bookings["b"].devices
    s.extend(mine.id, T0 + H, by_s=600)  # within the booking: allowed (nobody waits)
    with pytest.raises(Conflict, match="booking b, which ends"):
        s.extend(mine.id, T0 + H, by_s=H)


# ------------------------------------------------------------------------- properties
requests = st.one_of(
    st.builds(lambda n, m: {"gpus": n, **({"model": m} if m else {})}, st.integers(1, 2), st.sampled_from([None, "A100", "L4"])),
    st.builds(lambda f: {"share": f}, st.sampled_from([0.25, 0.5])),
    st.just({"mig_profile": "3g.40gb"}),
)
bookings_st = st.lists(
    st.tuples(requests, st.integers(0, 6 * 3600), st.integers(1800, 3 * 3600)), min_size=1, max_size=4,
)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("ask"), st.sampled_from(["u1", "u2", "o0"]), requests, st.sampled_from(["production", "experiment", "learning"]),
                  st.integers(600, 4 * 3600)),
        st.tuples(st.just("release"), st.integers(0, 40)),
        st.tuples(st.just("time"), st.integers(1, 2 * 3600)),
        st.tuples(st.just("extend"), st.integers(0, 40), st.integers(60, 3600)),
        st.tuples(st.just("fail"), st.sampled_from([g.uuid for g in POOL])),
    ),
    max_size=50,
)


def _place_all(s, specs):
    out = []
    for k, (req, start, length) in enumerate(specs):
        got = s.place_booking(booking(f"b{k}", T0 + start, T0 + start + length, req, users=(f"o{k}",)), T0)
        if got.ok:
            out.append(got.booking)
        else:
            assert got.reason
    return out


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops, bookings_st, st.sampled_from([None, 1800.0]))
def test_no_stranger_runs_into_a_booking_and_bookings_are_honoured(seq, specs, shorten):
    pol = Policy(confirm_timeout_s=None, reservation_depth=5, maintenance_shorten_min_s=shorten)
    s = Scheduler(POOL, pol)
    placed = _place_all(s, specs)
    now = T0
    leases = []
    failed = set()
    moved_at = {}  # booking id -> when it moved off a failed GPU
    exempt = set()  # (booking id, lease id): granted before the booking moved onto its GPUs (warned off with its grace)

    def stranger_overlaps():
        for lease in leases:
            if lease.granted_at is None or lease.placement is None:
                continue
            end = lease.ended_at if lease.state.terminal else s._book.lease_end(lease)
            for b in s.bookings.values():
                # the time a booking kept its GPUs: until it ended (given back, ended early) or its end
                b_end = b.end if b.state != ENDED or b.reason == "its time is over" else None
                if b_end is None or b.owned_by(lease.user, lease.groups) or (b.id, lease.id) in exempt:
                    continue
                if {sl.gpu_uuid for sl in lease.placement.slices} & b.devices and lease.granted_at < b_end and b.start < end:
                    raise AssertionError((lease.to_dict(), b.to_dict()))

    starts = sorted({b.start for b in placed})
    for op in seq:
        try:
            if op[0] == "ask":
                _, user, req, tier, dur = op
                leases.append(ask(s, now, req, min(dur, pol.tiers[tier].max_duration_s), user=user, tier=tier))
            elif op[0] == "release" and leases:
                s.release(leases[op[1] % len(leases)].id, now)
            elif op[0] == "time":
                # stop at each booking's start on the way: its owner's request is granted then
                target = now + op[1]
                for t in starts:
                    if now < t <= target:
                        now = t
                        # its owner asks at the start with a request of the booking's own shape
                        for b in list(s.bookings.values()):
                            if b.start == t and b.live and b.slices and not (b.devices & failed) and b.id not in moved_at:
                                mine = ask(s, now, b.request.to_dict(), H, user=next(iter(b.users)))
                                leases.append(mine)
                                s.tick(now)
                                b2 = s.bookings[b.id]
                                assert mine.state is LeaseState.ACTIVE, (b2.to_dict(), mine.to_dict())
                                assert {sl.gpu_uuid for sl in mine.placement.slices} <= b2.devices
                                assert mine.expires_at <= b2.end
                                event("a booking honoured at its start")
                        s.tick(now)
                        stranger_overlaps()
                now = target
            elif op[0] == "extend" and leases:
                s.extend(leases[op[1] % len(leases)].id, now, by_s=op[2])
            elif op[0] == "fail":
                failed.add(op[1])
                s.set_inventory([dataclasses.replace(g, healthy=g.uuid not in failed) for g in POOL], now)
                for c in s.pop_booking_changes():
                    if c.what == "moved":
                        moved_at[c.booking.id] = now
                        event("a booking moved off a failed GPU")
                        exempt.update((c.booking.id, lease.id) for lease in leases if lease.granted_at is not None)
                for b in s.bookings.values():
                    if b.live and b.end > now:
                        # moved off the failed GPUs, or marked with the reason
                        assert not (b.devices & failed) or "out of service" in b.problem
        except LeaseError:
            pass
        s.tick(now)
        stranger_overlaps()
    stranger_overlaps()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 2), st.integers(600, 3 * 3600)), min_size=2, max_size=20),
       st.lists(st.tuples(st.integers(1, 2), st.integers(0, 8 * 3600), st.integers(1800, 3 * 3600)), min_size=1, max_size=3))
def test_the_head_starts_by_its_eta_with_bookings_known_beforehand(jobs, specs):
    s = Scheduler([GPU(f"G0{i}", "n0", i, "A100", 81920) for i in range(2)], Policy(confirm_timeout_s=None, preemption=False, fair_share=False))
    for k, (n, start, length) in enumerate(specs):
        s.place_booking(booking(f"b{k}", T0 + start, T0 + start + length, {"gpus": n}, users=("owner",)), T0)
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
        if lease.id in promised:
            assert lease.granted_at <= promised[lease.id] + 1e-6
        for b in s.bookings.values():
            if b.reason == "its time is over" or b.state != ENDED:
                assert not ({sl.gpu_uuid for sl in lease.placement.slices} & b.devices and lease.granted_at < b.end and b.start < lease.expires_at)
