"""The idle rule shared by the server extension and the simulator (core/idle.py)."""

import math

import pytest

from jupyter_gpulease.core.idle import GapHistogram, IdleRule, gpu_idle


def test_a_kernel_computing_on_the_gpu_is_never_idle():
    assert not gpu_idle(80.0, executing=True, threshold_pct=5)
    assert not gpu_idle(80.0, executing=False, threshold_pct=5)  # work queued on the GPU, cell finished


def test_a_kernel_executing_a_cell_is_busy_unless_reclaim_busy_says_otherwise():
    assert not gpu_idle(0.0, executing=True, threshold_pct=5)
    assert gpu_idle(0.0, executing=True, threshold_pct=5, reclaim_busy=True)
    # unknown utilization: an executing kernel may be using the GPU, whatever reclaim_busy says
    assert not gpu_idle(None, executing=True, threshold_pct=5, reclaim_busy=True)


def test_a_kernel_under_the_threshold_and_not_executing_is_idle():
    assert gpu_idle(4.9, executing=False, threshold_pct=5)
    assert gpu_idle(None, executing=False, threshold_pct=5)
    assert not gpu_idle(5.0, executing=False, threshold_pct=5)


def test_fixed_timeout_and_never():
    assert IdleRule(timeout_s=1800).timeout([10, 20]) == 1800
    assert IdleRule().timeout() is None and not IdleRule().active


def test_learnt_timeout_is_short_for_a_user_who_never_comes_back_soon_and_longer_for_one_who_does():
    rule = IdleRule(learn=True)
    assert rule.timeout([4 * 3600] * 5) == 60  # gaps of hours: holding longer only costs
    # a user who comes back after ~4 minutes: reclaiming before that would be regretted
    assert rule.timeout([250, 260, 240, 270, 255]) == 300


def test_learnt_timeout_stays_within_the_admin_bounds():
    rule = IdleRule(learn=True, min_s=300, max_s=1200)
    assert rule.timeout([4 * 3600] * 5) == 300
    assert rule.timeout([2500, 2600, 2700]) <= 1200
    assert IdleRule(learn=True, min_s=600).timeout([]) == 900  # no gaps yet: the default
    q = IdleRule(learn=True, method="quantile", min_s=120, max_s=3600, factor=1.5, quantile=50)
    assert q.timeout([10, 20]) == 900  # fewer than min_gaps
    assert q.timeout([100, 200, 300]) == 300.0
    assert q.timeout([10, 10, 10]) == 120


def test_a_population_prior_moves_a_new_users_timeout():
    prior = GapHistogram()
    for _ in range(50):
        prior.add(250)
    prior.add(math.inf)
    assert IdleRule(learn=True).timeout([], prior) == 300
    assert IdleRule(learn=True).timeout([]) == 900  # without one: the default


def test_bad_rules_are_refused():
    with pytest.raises(ValueError, match="method"):
        IdleRule(method="median")
    with pytest.raises(ValueError, match="above the maximum"):
        IdleRule(min_s=600, max_s=60)
