"""The pure parts of usage records: right-sizing rules, the group a user's hours count to,
prices, periods, and the recorder's arithmetic (hours, counters that go back, the cap of busy
at held)."""

from __future__ import annotations

import pytest

from jupyter_gpulease.broker.usage import Accounting, PeriodError, UsageRecorder, _hours, parse_since, period
from jupyter_gpulease.core.model import Lease, LeaseState, Placement, Slice
from jupyter_gpulease.core.request import Request
from jupyter_gpulease.core.rightsizing import gb, suggest

A100 = "A100-SXM4-80GB"
OFFERS = [
    {"kind": "mig", "model": A100, "mig_profile": "1g.10gb", "memory_mib": 10240, "fraction": 0.125},
    {"kind": "mig", "model": A100, "mig_profile": "3g.40gb", "memory_mib": 40960, "fraction": 0.5},
    {"kind": "share", "model": A100, "share": 0.25, "memory_mib": 20480, "fraction": 0.25},
    {"kind": "share", "model": A100, "share": 0.5, "memory_mib": 40960, "fraction": 0.5},
]


def row(peak=9216, asked_s=3600.0, held_s=3000.0, gpus=1, kind="gpu", devices=None, **kw):
    return {"model": A100, "slice_kind": kind, "slice": str(gpus), "gpus": gpus, "fraction": float(gpus), "mem_mib": 81920 * gpus,
            "asked_s": asked_s, "held_s": held_s, "mem_peak_mib": peak, "devices": devices or {}, **kw}


def test_memory_rule_needs_evidence_and_a_real_saving():
    assert suggest([row()] * 2, OFFERS, min_leases=3) == []  # too few leases
    out = suggest([row()] * 3, OFFERS, min_leases=3)
    assert [s["kind"] for s in out] == ["memory"] and out[0]["suggested"]["mig_profile"] == "1g.10gb"
    # 30 GB at the 95th percentile: a 3g.40gb slice or a half share, not a 1g.10gb
    out = suggest([row(peak=30 * 1024)] * 4, OFFERS, min_leases=3)
    assert out[0]["suggested"]["mig_profile"] == "3g.40gb" and out[0]["alternatives"][0]["share"] == 0.5
    # 45 GB: more than half the card, nothing to say
    assert suggest([row(peak=45 * 1024)] * 4, OFFERS, min_leases=3) == []
    # one big lease in twenty falls outside the 95th percentile, two do not
    assert suggest([row()] * 19 + [row(peak=70000)], OFFERS)[0]["kind"] == "memory"
    assert suggest([row()] * 18 + [row(peak=70000)] * 2, OFFERS) == []
    # leases that never said their memory tell nothing
    assert suggest([row(peak=0)] * 5, OFFERS) == []


def test_duration_and_gpu_count_rules():
    out = suggest([row(peak=60000, asked_s=8 * 3600, held_s=h * 3600) for h in (1.5, 2, 2, 2.5, 3)], OFFERS)
    assert [s["kind"] for s in out] == ["duration"]
    assert out[0]["text"] == "asks 8 h, uses 2 h at the median: 3 h would do for 90% of leases" and out[0]["suggested"]["duration_s"] == 3 * 3600
    # a lease held most of what it asked: nothing
    assert suggest([row(peak=60000, asked_s=8 * 3600, held_s=7 * 3600)] * 5, OFFERS) == []
    busy = {"a": {"busy_gpu_s": 100.0}, "b": {"busy_gpu_s": 0.0}, "c": {"busy_gpu_s": 0.0}, "d": {"busy_gpu_s": 5.0}}
    out = suggest([row(gpus=4, peak=60000, devices=busy)] * 3, OFFERS)
    assert [s["text"] for s in out] == [f"holds 4 GPUs, two are never busy in most leases: 2 × {A100} would do"]
    all_busy = {k: {"busy_gpu_s": 1.0} for k in "abcd"}
    assert suggest([row(gpus=4, peak=60000, devices=all_busy)] * 3, OFFERS) == []


def test_the_group_hours_count_to_and_prices():
    acc = Accounting(prices={A100: 3.0, "H100*": 5.0, "*": 1.0}, group_order=("physics", "chemistry"), teams={"zoe": "biology"})
    assert acc.team("alice", ("chemistry", "physics")) == "physics"
    assert acc.team("bob", ("zeta", "alpha")) == "alpha"  # no listed group: the first alphabetically
    assert acc.team("carl", ()) == "none"
    assert acc.team("zoe", ("physics",)) == "biology"
    assert (acc.price(A100), acc.price("H100-SXM5-80GB"), acc.price("L4")) == (3.0, 5.0, 1.0)
    assert Accounting().price("L4") == 0.0
    assert acc.cost(A100, 7200, 3600) == 6.0
    assert Accounting(prices={A100: 3.0}, charge_idle=False).cost(A100, 7200, 3600) == 3.0
    assert gb(81920) == "80 GB" and gb(9216) == "9 GB" and gb(512) == "0.5 GB"


def test_periods():
    assert parse_since("30d") == 30 * 86400 and parse_since("12h") == 43200 and parse_since("2w") == 14 * 86400
    assert period(since="1d", now=1000.0 + 86400) == (1000.0, 1000.0 + 86400)
    assert period(start="2026-11-01", end="2026-11-02") == (1793491200.0, 1793577600.0)
    assert period(start="2026-11-01T01:00+01:00", end=1793577600.0)[0] == 1793491200.0
    for kw, field in (({"since": "x"}, "since"), ({"start": "nope"}, "from"), ({"end": "nope"}, "to"), ({"start": "2026-11-02", "end": "2026-11-01"}, "from"),
                      ({"start": "nan"}, "from"), ({"end": "inf"}, "to"), ({"start": "1e308"}, "from"), ({"start": "-5"}, "from"),
                      ({"since": "0d"}, "since"), ({"since": "99999999999w"}, "since")):
        with pytest.raises(PeriodError) as info:
            period(**kw)
        assert info.value.field == field


def test_hours_split_an_interval_at_the_hour():
    assert list(_hours(3000.0, 8000.0)) == [(0, 600.0), (3600, 3600.0), (7200, 800.0)]
    assert list(_hours(3600.0, 3600.0)) == []


def lease(gpus=1, share_milli=1000, granted=0.0):
    sl = tuple(Slice(f"GPU-{i}", "n1", i, A100, 81920 * share_milli // 1000, share_milli) for i in range(gpus))
    return Lease(id="L1", user="alice", request=Request(gpus=gpus), tier="default", duration_s=3600.0, created_at=granted - 60,
                 groups=("physics",), state=LeaseState.ACTIVE, granted_at=granted, placement=Placement(sl))


def test_the_recorder_counts_intervals_caps_busy_at_held_and_survives_a_counter_that_goes_back():
    r = UsageRecorder()
    lz = lease(granted=0.0)
    r.granted(lz, 0.0)
    lz.usage = {"devices": {"GPU-0": {"busy_s": 500.0, "idle_s": 100.0}}}
    r.heartbeat(lz, 600.0)
    lz.usage = {"devices": {"GPU-0": {"busy_s": 9999.0, "idle_s": 100.0}}}  # more than time allows: capped at held
    r.heartbeat(lz, 1200.0)
    lz.usage = {"devices": {"GPU-0": {"busy_s": 50.0, "idle_s": 10.0}}}  # the server started again: 50 s are new
    r.heartbeat(lz, 1800.0)
    row = r.live["L1"].row
    assert row["held_gpu_s"] == 1800.0 and row["busy_gpu_s"] == 1200.0 + 50.0
    assert row["queue_wait_s"] == 60.0
    lz.state, lz.ended_at = LeaseState.RECLAIMED, 2400.0
    r.ended(lz, 2400.0)
    b = r.take()
    assert b.leases["L1"]["held_gpu_s"] == 2400.0 and b.leases["L1"]["reclaims"] == 1 and b.leases["L1"]["state"] == {}
    assert sum(v[5] for (h, lid, k), v in b.hours.items() if not k) == pytest.approx(2400.0)
    assert b.totals[("usage_held", ("physics", A100))] == pytest.approx(2400.0)
    assert "L1" not in r.live and r.take() is None


def test_heartbeats_records_are_handed_over_every_write_interval_grants_and_ends_at_once():
    r = UsageRecorder(write_s=60.0)
    lz = lease(granted=0.0)
    r.granted(lz, 0.0)
    assert r.take(0.0).leases["L1"]["held_gpu_s"] == 0.0  # a grant: at once
    for t in (30.0, 50.0):
        lz.usage = {"devices": {"GPU-0": {"busy_s": t / 2, "idle_s": t / 2}}}
        r.heartbeat(lz, t)
        assert r.take(t) is None  # a heartbeat's commit carries no usage rows
    lz.usage = {"devices": {"GPU-0": {"busy_s": 40.0, "idle_s": 40.0}}}
    r.heartbeat(lz, 80.0)
    b = r.take(80.0)  # 80 s after the last hand-over: the three heartbeats in one batch
    assert b.leases["L1"]["held_gpu_s"] == 80.0 and b.leases["L1"]["busy_gpu_s"] == 40.0
    assert b.leases["L1"]["state"]["last_t"] == 80.0  # what a restarted broker goes on from
    assert sum(v[5] for (h, lid, k), v in b.hours.items() if not k) == pytest.approx(80.0)
    lz.state, lz.ended_at = LeaseState.RELEASED, 90.0
    r.ended(lz, 90.0)
    assert r.take(90.0).leases["L1"]["held_gpu_s"] == 90.0  # an end: at once


def test_a_share_counts_its_fraction():
    r = UsageRecorder()
    lz = lease(share_milli=250)
    r.granted(lz, 0.0)
    lz.state, lz.ended_at = LeaseState.RELEASED, 3600.0
    r.ended(lz, 3600.0)
    assert r.take().leases["L1"]["held_gpu_s"] == 900.0


@pytest.mark.parametrize(("start_h", "end_h", "held_h", "step"), [
    (-10, 100, 50, "hour"),  # all of it (10:00 of day 0 to 12:00 of day 2)
    (12, 53, 41, "day"),  # day 0 12:00 to day 2 05:00: the whole day 1 from the daily roll-up, the edges by the hour
    (24, 48, 24, "day"),  # exactly day 1
    (30, 30.5, 1, "hour"),  # within one hour: the hour that starts in the period
    (0, 11, 1, "day"),  # a part of a day only
])
def test_a_period_of_whole_days_and_edge_hours_adds_up_as_the_hours_do(tmp_path, start_h, end_h, held_h, step):
    from jupyter_gpulease.broker.usage import UsageAPI
    from jupyter_gpulease.store import LeaseStore

    day0 = 1_800_000_000 - 1_800_000_000 % 86400
    t = day0 + 10 * 3600  # granted at 10:00 of day 0, held 50 h
    r = UsageRecorder()
    lz = lease(granted=t)
    r.granted(lz, t)
    lz.state, lz.ended_at = LeaseState.RELEASED, t + 50 * 3600
    r.ended(lz, t + 50 * 3600)
    store = LeaseStore(f"sqlite:///{tmp_path / 'u.sqlite'}")
    try:
        store.write_usage(r.take())
        api = UsageAPI(store)
        start, end = day0 + start_h * 3600, day0 + end_h * 3600
        rep = api.report(by="group", start=start, end=end)
        assert rep["totals"]["held_gpu_h"] == pytest.approx(held_h)
        s = api.series(by="model", start=start, end=end, step=step)
        assert sum(p["held_gpu_h"] for p in s["points"]) == pytest.approx(held_h)
    finally:
        store.close()


def test_postgresql_and_sqlite_give_the_same_report(tmp_path, postgres):
    from jupyter_gpulease.broker.usage import UsageAPI
    from jupyter_gpulease.store import LeaseStore

    r = UsageRecorder(Accounting(teams={"u0": "red", "u1": "red", "u2": "blue"}))
    t0 = 1_800_000_000.0
    for i in range(40):  # 40 leases of 3 users, waits of 0 to 39 minutes, held 1 to 5 h
        lz = lease(granted=t0 + i * 1800)
        lz.id, lz.user, lz.created_at = f"L{i}", f"u{i % 3}", t0 + i * 1800 - i * 60
        r.granted(lz, lz.granted_at)
        lz.state, lz.ended_at = LeaseState.RELEASED, lz.granted_at + (1 + i % 5) * 3600
        r.ended(lz, lz.ended_at)
    batch = r.take()
    reports = []
    for url in (f"sqlite:///{tmp_path / 'u.sqlite'}", postgres.create_database("same_report")):
        store = LeaseStore(url)
        try:
            store.write_usage(batch)
            api = UsageAPI(store)
            reports.append([api.report(by=by, start=t0 - 86400, end=t0 + 5 * 86400) for by in ("user", "group", "model")])
        finally:
            store.close()
    assert reports[0] == reports[1]
    by_user = {x["key"]: x for x in reports[0][0]["rows"]}
    assert by_user["u0"]["queue_wait_p50_s"] == 1170.0  # 0, 3, …, 39 min: between 18 and 21 and reports[0][0]["totals"]["queue_wait_p95_s"] == pytest.approx(2223.0)


def test_a_raw_sample_gathers_the_heartbeats_of_its_interval_and_the_end_writes_the_last():
    r = UsageRecorder(sample_s=300.0)
    lz = lease(granted=0.0)
    r.granted(lz, 0.0)
    for i in range(1, 21):  # 20 heartbeats, 30 s apart: 10 minutes
        lz.usage = {"devices": {"GPU-0": {"busy_s": 15.0 * i, "idle_s": 15.0 * i}}}
        r.heartbeat(lz, 30.0 * i)
    samples = r.take().samples
    assert [(s[3], s[4]) for s in samples] == [(0.0, 300.0)]  # the first five minutes; the next still gathering
    assert samples[0][5] == pytest.approx(300.0) and samples[0][6] == pytest.approx(150.0)
    lz.state, lz.ended_at = LeaseState.RELEASED, 630.0
    r.ended(lz, 630.0)
    samples = r.take().samples
    assert [(s[3], s[4]) for s in samples] == [(300.0, 600.0), (600.0, 630.0)]
    assert sum(s[5] for s in samples) == pytest.approx(330.0)
    # 0: a sample per heartbeat
    r = UsageRecorder(sample_s=0.0)
    lz = lease(granted=0.0)
    r.granted(lz, 0.0)
    for i in range(1, 4):
        lz.usage = {"devices": {}}
        r.heartbeat(lz, 30.0 * i)
    assert [(s[3], s[4]) for s in r.take().samples] == [(0.0, 30.0), (30.0, 60.0)]  # the third waits for the next
