"""Spawn options in the user's own words: errors name the option the user gave, in its units."""

from __future__ import annotations

import pytest

from jupyter_gpulease.hub.options import OptionsError, parse_user_options

POOL = {
    "devices": [
        {"uuid": "GPU-a0", "node": "n1", "index": 0, "model": "A100-SXM4-80GB", "memory_mib": 81920, "mig": [], "healthy": True},
        {"uuid": "GPU-l0", "node": "n2", "index": 0, "model": "L4", "memory_mib": 23034, "mig": [], "healthy": True},
        {"uuid": "GPU-l1", "node": "n2", "index": 1, "model": "L4", "memory_mib": 23034, "mig": [], "healthy": True},
    ],
    "tiers": [
        {"name": "research", "priority": 20, "max_duration_s": 8 * 3600, "default_duration_s": 7200},
        {"name": "course", "priority": 10, "max_duration_s": 4 * 3600, "default_duration_s": 3600, "preemptible": True},
    ],
    "default_tier": "course",
    "min_duration_s": 600,
}


@pytest.mark.parametrize("opts, field, words", [
    # the duration in hours, answered in hours, against the default tier when none is named
    ({"gpus": 1, "duration_h": 100}, "duration_h", "a duration of 100 h is over the limit of the default tier, 'course': 4 h"),
    ({"gpus": 1, "duration_s": 100 * 3600, "tier": "research"}, "duration_s",
     "a duration of 360000 s (4 d 4 h) is over the 'research' tier's limit of 28800 s (8 h)"),
    # the hub's shortest lease
    ({"gpus": 1, "duration_h": 0.01}, "duration_h", "shorter than this hub's shortest lease, 0.167 h (10 min); ask for at least 0.167 h (10 min)"),
    # one GPU per node: no "ask for 1 to 1"
    ({"gpus": 2, "model": "A100*"}, "gpus", "at most 1 GPU of model A100* sits on one node; ask for 1"),
    ({"gpus": 3, "model": "L4"}, "gpus", "ask for 1 to 2"),
    # the kinds include a server without a GPU
    ({"kind": "tpu"}, "kind", "'kind' must be 'gpu', 'share', 'mig' or 'cpu' (no GPU), got 'tpu'"),
    # no presets on this hub: say so instead of "choose one of: none are configured"
    ({"preset": "big"}, "preset", "this hub has no presets; ask with 'gpus', 'share' or 'mig_profile' instead"),
])
def test_errors_name_the_option_given_in_its_units(opts, field, words):
    with pytest.raises(OptionsError) as e:
        parse_user_options(opts, pool=POOL)
    assert e.value.field == field
    assert words in e.value.message
    assert "none are configured" not in e.value.message and "1 to 1" not in e.value.message


def test_without_cpu_servers_the_kinds_offered_leave_cpu_out():
    with pytest.raises(OptionsError) as e:
        parse_user_options({"kind": "tpu"}, allow_cpu_only=False, pool=POOL)
    assert "'gpu', 'share' or 'mig'" in e.value.message and "cpu" not in e.value.message
