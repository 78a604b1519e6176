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
    # the pool's own reason (core's Pool.why_never on the broker's devices): no "ask for 1 to 1"
    ({"gpus": 2, "model": "A100*"}, "gpus", "asks for 2 GPUs on one node, but the most any node has of model A100* is 1"),
    ({"gpus": 3, "model": "L4"}, "gpus", "the most any node has of model L4 is 2"),
    # the kinds include a server without a GPU
    ({"kind": "tpu"}, "kind", "'kind' must be 'gpu', 'share' or 'mig' ('cpu' where a server may run without a GPU), got 'tpu'"),
    # durations as people write them, read by core's parser
    ({"gpus": 1, "duration_s": "a while"}, "duration_s", "'duration_s' must be a number of seconds or a duration like 90m, 2h"),
    # no presets on this hub: say so instead of "choose one of: none are configured"
    ({"preset": "big"}, "preset", "this hub has no presets; ask with 'gpus', 'share' or 'mig_profile' instead"),
])
def test_errors_name_the_option_given_in_its_units(opts, field, words):
    with pytest.raises(OptionsError) as e:
        parse_user_options(opts, pool=POOL)
    assert e.value.field == field
    assert words in e.value.message
    assert "none are configured" not in e.value.message and "1 to 1" not in e.value.message


def test_durations_as_people_write_them():
    assert parse_user_options({"gpus": 1, "duration_s": "1h30m"}, pool=POOL).duration_s == 5400
    assert parse_user_options({"gpus": 1, "duration_h": 2, "max_wait_min": 15}, pool=POOL).max_wait_s == 900


def test_the_hub_side_uses_the_pools_own_refusal_not_a_copy():
    """The reason the form and the REST API give is the one the broker gives for the same devices."""
    from jupyter_gpulease.core.pool import pool_from_devices
    from jupyter_gpulease.core.request import parse_request

    for opts in ({"gpus": 4, "model": "L4"}, {"mig_profile": "7g.80gb"}, {"share": 0.5, "memory_mib": 999999}, {"gpus": 1, "model": "H*"}):
        field, reason = pool_from_devices(POOL["devices"]).why_never(parse_request(opts))
        with pytest.raises(OptionsError) as e:
            parse_user_options(opts, pool=POOL)
        assert (e.value.field, e.value.message) == (field, reason)
