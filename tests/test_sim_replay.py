"""Small replays with known outcomes, through the real core scheduler."""

import math
from dataclasses import replace

import pytest

from jupyter_gpulease.core import scheduler as core_scheduler
from jupyter_gpulease.sim import policies as P
from jupyter_gpulease.sim.metrics import StepSeries, jain, percentile, share_within
from jupyter_gpulease.sim.replay import replay
from jupyter_gpulease.sim.report import summarize, table
from jupyter_gpulease.sim.workload import Job, Workload, WorkloadAssumptions, uniform_pool


def wl(*jobs):
    return Workload(list(jobs), WorkloadAssumptions("test"))


def waits(result):
    return {r.job.id: r.first_wait for r in result.records}


def test_second_job_on_one_gpu_waits_exactly_the_first_ones_remaining_time():
    w = wl(Job("a", 0, 1000, "LS", 100), Job("b", 10, 1000, "LS", 50))
    for sp in (P.static(), P.static_backfill(), P.gpulease()):
        r = replay(w, uniform_pool(1, 1), sp)
        assert waits(r) == {"a": 0, "b": 90}, sp.name
        assert r.end_time == 150
        s = summarize(r)
        assert s["gpu_hours_held"] == pytest.approx(150 / 3600)
        assert s["never_served"] == 0


def test_strict_fcfs_holds_small_jobs_behind_a_big_one_and_backfill_lets_them_pass():
    w = wl(Job("a", 0, 1000, "LS", 100), Job("big", 1, 2000, "LS", 100), Job("small", 2, 1000, "LS", 10))
    pool = uniform_pool(1, 2)
    fcfs = waits(replay(w, pool, P.static()))
    assert fcfs == {"a": 0, "big": 99, "small": 198}
    bf = waits(replay(w, pool, P.static_backfill()))
    assert bf == {"a": 0, "big": 99, "small": 0}


def test_kubernetes_style_backfill_starves_the_big_job_but_gpulease_reserves_for_it():
    # a stream of 1-GPU jobs keeps one of two GPUs busy at every instant: the 2-GPU job never
    # finds both free without a reservation
    jobs = [Job("a0", 0, 1000, "LS", 100), Job("big", 1, 2000, "LS", 100)]
    jobs += [Job(f"s{i}", 50 + 100 * i, 1000, "LS", 120) for i in range(30)]
    pool = uniform_pool(1, 2)
    bf = waits(replay(wl(*jobs), pool, P.static_backfill()))
    gl = waits(replay(wl(*jobs), pool, P.gpulease()))
    assert bf["big"] > 2500  # starved until the stream ends
    assert gl["big"] < 200  # the reservation stops the stream from passing it


def test_gpulease_packs_shares_where_static_rounds_them_up_to_whole_gpus():
    w = wl(Job("a", 0, 500, "LS", 100), Job("b", 0, 400, "LS", 100))
    st = replay(w, uniform_pool(1, 1), P.static_backfill())
    gl = replay(w, uniform_pool(1, 1), P.gpulease())
    assert sorted(waits(st).values()) == [0, 100]
    assert waits(gl) == {"a": 0, "b": 0}
    s_st, s_gl = summarize(st), summarize(gl)
    assert s_st["busy_held_ratio"] == pytest.approx(0.45)  # 0.9 GPU-busy on 1 GPU held, 2 × 100 s
    assert s_gl["busy_held_ratio"] == pytest.approx(1.0)


def test_long_job_extends_its_lease_when_nobody_waits_and_expires_when_someone_does():
    long = Job("long", 0, 1000, "Burstable", 5 * 3600)  # experiment tier: 2 h default, 8 h max
    r = replay(wl(long), uniform_pool(1, 1), P.gpulease())
    rec = r.records[0]
    assert rec.extensions >= 1 and rec.expired == 0 and rec.work_done_s == pytest.approx(5 * 3600)
    w2 = wl(long, Job("next", 60, 1000, "Burstable", 60))
    r2 = replay(w2, uniform_pool(1, 1), P.gpulease(), requeue_expired=False)
    rec = r2.records[0]
    assert rec.expired == 1 and rec.extensions_refused >= 1
    assert rec.work_done_s == pytest.approx(2 * 3600)
    assert summarize(r2)["work_lost_gpu_hours"] == pytest.approx(3.0)
    assert waits(r2)["next"] == pytest.approx(2 * 3600 - 60)
    # by default its user asks again for the rest of the work: nothing is lost
    r3 = replay(w2, uniform_pool(1, 1), P.gpulease())
    rec = r3.records[0]
    assert rec.expired == 1 and r3.counters["requeued"] == 1
    assert rec.work_done_s == pytest.approx(5 * 3600)
    s3 = summarize(r3)
    assert s3["work_lost_gpu_hours"] == pytest.approx(0.0) and s3["requeued_after_expiry"] == 1
    assert rec.return_waits == [pytest.approx(60)]  # it waited for "next" to finish
    # the first wait hides that wait; the per-pod total counts it
    assert s3["wait"]["max_s"] == pytest.approx(2 * 3600 - 60)
    assert s3["wait_total"]["n"] == 2 and s3["wait_total"]["mean_s"] == pytest.approx((60 + 2 * 3600 - 60) / 2)
    assert s3["resubmit_waits"] == 1 and s3["total_wait_within_10min"] == pytest.approx(0.5)
    assert "all waits within 10 min" in table([s3])


def test_best_effort_job_is_preempted_after_the_grace_and_resumes_its_work():
    w = wl(Job("be", 0, 1000, "BE", 3000), Job("ls", 100, 1000, "LS", 100))
    r = replay(w, uniform_pool(1, 1), P.gpulease())
    be, ls = r.records
    assert ls.first_wait == pytest.approx(600)  # the learning tier's 10-minute grace
    assert be.preempted == 1 and be.finished
    assert be.work_done_s == pytest.approx(3000)  # resumed where it stopped (assumption)
    assert be.return_waits == [pytest.approx(100)]
    assert summarize(r)["preemptions"] == 1


def test_batch_variant_preempts_a_pod_after_a_kubernetes_like_grace():
    w = wl(Job("be", 0, 1000, "BE", 3000), Job("ls", 100, 1000, "LS", 100))
    sp = P.gpulease_batch()
    assert sp.policy.tiers["learning"].grace_s == P.BATCH_GRACE_S == 30
    # non-preemptible tiers renew hourly; the rest of the policy is gpulease's
    assert sp.policy.tiers["production"].max_duration_s == P.BATCH_STEP_S == 3600
    assert sp.policy.tiers["experiment"].default_duration_s == 3600
    assert sp.policy.multi_gpu_aging == P.BATCH_MULTI_GPU_AGING == 0.5
    assert replace(sp.policy, tiers=P.gpulease().policy.tiers, multi_gpu_aging=1.0) == P.gpulease().policy
    assert "ASSUMPTION" in sp.description and "30 s" in sp.description
    r = replay(w, uniform_pool(1, 1), sp)
    be, ls = r.records
    assert ls.first_wait == pytest.approx(30)
    assert be.preempted == 1 and be.work_done_s == pytest.approx(3000)
    assert P.for_trace("gpulease", batch=True).policy.tiers["learning"].grace_s == 30
    assert P.for_trace("gpulease", batch=False).policy.tiers["learning"].grace_s == 600
    assert P.for_trace("static", batch=True).name == "static"


def session(bursts, gpus=1, arrival=0.0, name="s"):
    return Job(name, arrival, 1000 * gpus, "notebook", kind="session", bursts=bursts)


def test_static_session_holds_its_gpu_from_first_burst_until_the_linger_after_the_last():
    r = replay(wl(session([(0, 300), (900, 300)])), uniform_pool(1, 1), P.static(), linger_s=3600)
    rec = r.records[0]
    assert rec.busy_s == 600 and rec.held_s == 1200 + 3600 and rec.reclaims == 0


def test_idle_reclaim_takes_the_gpu_back_and_a_quick_return_counts_as_regretted():
    sp = P.gpulease_release(P.IdleRule(timeout_s=300))  # the kernel's state not modelled: no restore
    r = replay(wl(session([(0, 300), (900, 300), (5000, 60)])), uniform_pool(1, 1), sp, linger_s=3600)
    rec = r.records[0]
    assert rec.reclaims == 3  # after each burst
    assert rec.regretted == 1  # back at 900, 5 min after losing it at 600
    assert rec.held_s == (300 + 300) + (300 + 300) + (60 + 300)
    assert rec.busy_s == 660
    s = summarize(r)["notebook"]
    assert s["regretted_reclaims"] == 1 and s["returning_waits"] == 2 and s["returning_wait_mean_s"] == 0


def test_a_returning_session_waits_and_shifts_the_rest_of_its_work():
    sp = P.gpulease_release(P.IdleRule(timeout_s=60))
    # s1 loses its GPU after its first burst; s2 takes it for 1000 s (+60 s idle); s1 comes back at 500
    w = wl(session([(0, 100), (500, 100), (700, 100)], name="s1"), session([(0, 1000)], arrival=200, name="s2"))
    r = replay(w, uniform_pool(1, 1), sp, linger_s=3600)
    s1 = r.records[0]
    # back at 500, granted when s2's GPU is reclaimed at 1260; its third cell then comes
    # 200 s after the second as in the trace, after s1's own GPU was reclaimed again: no wait
    assert s1.return_waits == [pytest.approx(760), 0]
    assert s1.shift == pytest.approx(760)
    assert s1.busy_s == 300


def test_learnt_idle_timeout_runs_and_reports(capsys):
    bursts = [(i * 400.0, 100.0) for i in range(10)]
    r = replay(wl(session(bursts)), uniform_pool(1, 1), P.gpulease(), linger_s=3600)
    assert r.records[0].busy_s == 1000
    print(table([summarize(r)]))
    assert "regretted reclaims" in capsys.readouterr().out


def test_replay_decisions_come_from_the_core_scheduler(monkeypatch):
    calls = {"tick": 0}
    real_tick = core_scheduler.Scheduler.tick

    def counting_tick(self, now):
        calls["tick"] += 1
        return real_tick(self, now)

    monkeypatch.setattr(core_scheduler.Scheduler, "tick", counting_tick)
    w = wl(Job("a", 0, 1000, "LS", 100), Job("b", 10, 1000, "LS", 50))
    r = replay(w, uniform_pool(1, 1), P.static())
    assert calls["tick"] == r.ticks > 0
    # a scheduler that never grants: nothing is served
    monkeypatch.setattr(core_scheduler.Scheduler, "schedule", lambda self, now: [])
    r = replay(w, uniform_pool(1, 1), P.static())
    assert summarize(r)["never_served"] == 2


def test_requests_that_can_never_fit_are_refused_and_never_served():
    r = replay(wl(Job("huge", 0, 16000, "LS", 10)), uniform_pool(1, 8), P.gpulease())
    s = summarize(r)
    assert s["refused"] == 1 and s["never_served"] == 1 and s["started_within_10min"] == 0


def test_policy_file_defines_more_policies(tmp_path):
    p = tmp_path / "pol.toml"
    p.write_text('[[policy]]\nname = "lease-10m"\nidle_timeout_s = 600\nbackfill = false\n[policy.qos_tiers]\nBE = "experiment"\n')
    (sp,) = P.load_policy_file(str(p))
    assert sp.name == "lease-10m" and sp.idle.timeout_s == 600 and not sp.policy.backfill and sp.tier_for("BE") == "experiment"
    bad = tmp_path / "bad.toml"
    bad.write_text('[[policy]]\nname = "x"\nbogus = 1\n')
    with pytest.raises(ValueError, match="unknown setting"):
        P.load_policy_file(str(bad))


def test_metric_math():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([10], 95) == 10
    assert percentile([], 50) is None
    assert percentile(list(range(101)), 95) == 95
    assert jain([1, 1, 1, 1]) == 1
    assert jain([1, 0, 0, 0]) == 0.25
    assert share_within([0, 100, 700], 600) == pytest.approx(2 / 3)
    s = StepSeries(0)
    s.set(10, 2)
    s.add(20, 1)
    s.set(30, 0)
    assert s.integral(0, 40) == 2 * 10 + 3 * 10
    assert s.time_mean(0, 40) == pytest.approx(50 / 40)
    assert s.at(25) == 3 and s.at(-1) == 0
    assert math.isclose(s.integral(15, 25), 2 * 5 + 3 * 5)


def test_a_suspended_kernel_comes_back_on_its_gpu_after_the_restore_and_keeps_its_state():
    sp = P.gpulease_suspend(P.IdleRule(timeout_s=300))
    r = replay(wl(session([(0, 300), (900, 300)])), uniform_pool(1, 2), sp, linger_s=3600)
    rec = r.records[0]
    # reclaimed at 600, back at 900: a GPU at once, then the restore before the cell runs
    assert rec.resume_delays == [P.RESTORE_S] and rec.state_lost == 0 and rec.shift == P.RESTORE_S
    assert rec.busy_s == 600 and rec.held_s == 600 + (P.RESTORE_S + 300 + 300)
    s = summarize(r)["notebook"]
    assert (s["reclaim_action"], s["kernel_state_lost"], s["resume_delay_mean_s"]) == ("suspend", 0, P.RESTORE_S)
    assert "back after reclaim: delay mean" in table([summarize(r)])


def test_a_resume_asks_for_its_former_gpu_first():
    # s0 holds GPU 0 until 2060; s1 gets GPU 1 at 10 and loses it at 170; when s1 comes back
    # at 2510 both GPUs are free: best fit alone would give it GPU 0, the resume asks for GPU 1
    w = wl(session([(0, 2000)], name="s0"), session([(0, 100), (2500, 100)], arrival=10, name="s1"))

    def grants(sp):
        got = []
        replay(w, uniform_pool(1, 2), sp, linger_s=3600, on_event=lambda e: e.kind == "granted" and e.lease.user == "s1" and got.append(e.lease.placement.slices[0].index))
        return got

    assert grants(P.gpulease_suspend(P.IdleRule(timeout_s=60))) == [1, 1]
    assert grants(P.gpulease_restart(P.IdleRule(timeout_s=60))) == [1, 0]  # nothing to go back to


def test_a_restart_loses_the_kernel_state_and_the_cell_waits_for_the_reload():
    sp = P.gpulease_restart(P.IdleRule(timeout_s=300))
    r = replay(wl(session([(0, 300), (900, 300)])), uniform_pool(1, 1), sp, linger_s=3600)
    rec = r.records[0]
    assert rec.resume_delays == [P.RELOAD_S] and rec.state_lost == 1 and rec.shift == P.RELOAD_S


def test_a_kernel_on_several_gpus_that_cannot_be_suspended_is_restarted():
    sp = P.gpulease_suspend(P.IdleRule(timeout_s=300), multi_gpu=False)
    r = replay(wl(session([(0, 300), (900, 300)], gpus=2)), uniform_pool(1, 2), sp, linger_s=3600)
    assert r.records[0].state_lost == 1 and r.records[0].resume_delays == [P.RELOAD_S]
    r = replay(wl(session([(0, 300), (900, 300)], gpus=2)), uniform_pool(1, 2), P.gpulease_suspend(P.IdleRule(timeout_s=300)), linger_s=3600)
    assert r.records[0].state_lost == 0 and r.records[0].resume_delays == [P.RESTORE_S]
