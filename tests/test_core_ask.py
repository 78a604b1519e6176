"""One request type, checked once: numbers, the ask's fields, and what the policy says about it."""

import pytest

from jupyter_gpulease.core.model import GPU, BadRequest, Forbidden, LeaseState, MigInstance, Refused, SliceKind
from jupyter_gpulease.core.policy import HOUR, Policy, Quota, Tier
from jupyter_gpulease.core.request import Ask, Request, parse_ask, parse_number, parse_request
from jupyter_gpulease.core.scheduler import Scheduler

T0 = 1_000_000.0


def pool():
    return [
        GPU("GPU-a0", "n1", 0, "A100-SXM4-80GB", 81920),
        GPU("GPU-a1", "n1", 1, "A100-SXM4-80GB", 81920),
        GPU("GPU-l0", "n2", 0, "L4", 23034),
        GPU("GPU-m0", "n2", 1, "A100-SXM4-80GB", 81920, mig=(MigInstance("MIG-0", "3g.40gb", 40960, 0), MigInstance("MIG-1", "3g.40gb", 40960, 1))),
    ]


# ------------------------------------------------------------------ numbers
@pytest.mark.parametrize("value,expected", [(3, 3), (3.0, 3), ("3", 3), (" 7 ", 7)])
def test_whole_numbers_come_from_json_numbers_or_plain_digits(value, expected):
    assert parse_number(value, "gpus", integer=True) == expected


@pytest.mark.parametrize("value", ["²", "--5", "+1", "1e3", "3.5", True, float("nan"), float("inf"), [1], None, "five"])
def test_anything_else_is_not_a_whole_number(value):
    with pytest.raises(BadRequest, match="'gpus' must be a whole number") as e:
        parse_number(value, "gpus", integer=True)
    assert e.value.field == "gpus"


def test_ranges_say_what_is_allowed_in_the_fields_unit():
    with pytest.raises(BadRequest, match="'gpus' must be at least 1, got 0"):
        parse_number(0, "gpus", integer=True, minimum=1)
    with pytest.raises(BadRequest, match="'n' must be from 1 to 8, got 9"):
        parse_number(9, "n", integer=True, minimum=1, maximum=8)
    with pytest.raises(BadRequest, match="'n' must be 1, got 2"):
        parse_number(2, "n", integer=True, minimum=1, maximum=1)
    with pytest.raises(BadRequest, match="'duration_h' must be more than 0 hours"):
        parse_number(-1, "duration_h", above=0, unit="hours")
    with pytest.raises(BadRequest, match="far out of range"):
        parse_number(10**400, "gpus", integer=True)


# ------------------------------------------------------------------ the ask
def test_an_ask_reads_the_units_people_use():
    a = parse_ask({"gpus": 1, "duration_h": 1.5, "max_wait_min": 30}, user="ann")
    assert (a.duration_s, a.max_wait_s, a.duration_field) == (5400, 1800, "duration_h")
    assert parse_ask({"share": 0.5, "duration_s": "2h"}, user="ann").duration_s == 7200
    with pytest.raises(BadRequest, match="give the duration once") as e:
        parse_ask({"duration_s": 60, "duration_h": 2}, user="ann")
    assert e.value.field == "duration_h"


def test_an_ask_refuses_unknown_fields_and_names_the_allowed_ones():
    with pytest.raises(BadRequest, match=r"unknown field.*'colour'.*allowed:") as e:
        parse_ask({"gpus": 1, "colour": "red"}, user="ann")
    assert e.value.field == "colour"
    assert parse_ask({"gpus": 1, "user": "bob"}, user="ann", also=("user",)).user == "ann"  # the caller decides who


@pytest.mark.parametrize(
    "body,field",
    [({"prefer_gpus": "GPU-a0"}, "prefer_gpus"), ({"require_gpus": [""]}, "require_gpus"), ({"meta": []}, "meta"),
     ({"server": 5}, "server"), ({"duration_s": 0}, "duration_s"), ({"duration_h": "soon"}, "duration_h"), ({"max_wait_s": -1}, "max_wait_s"),
     ({"tier": 3}, "tier"), ({"kind": "tpu"}, "kind")],
)
def test_a_malformed_ask_names_the_field(body, field):
    with pytest.raises(BadRequest) as e:
        parse_ask(body, user="ann")
    assert e.value.field == field


def test_the_kind_error_lists_cpu_where_servers_may_run_without_a_gpu():
    with pytest.raises(BadRequest, match="'cpu'"):
        parse_request({"kind": "tpu"})


def test_an_ask_goes_over_the_wire_and_back_unchanged():
    a = Ask(user="ann", request=parse_request({"share": 0.25, "model": "A100*"}), tier="learning", duration_s=1800.0, max_wait_s=60.0,
            server="gpu", meta={"k": 1}, prefer_gpus=("GPU-a0",), require_gpus=("GPU-a0", "GPU-a1"))
    assert parse_ask(a.to_body(), user="ann") == a


def test_requests_keep_their_shape_through_json():
    for body in ({"gpus": 2, "model": "A100*"}, {"share": 0.5, "memory_mib": 20000}, {"memory_mib": 10240}, {"mig_profile": "3g.40gb"}):
        r = parse_request(body)
        assert Request.from_dict(r.to_dict()) == r
    assert parse_request({"mig": "3g.40gb"}).kind is SliceKind.MIG


# ------------------------------------------------------------------ what the policy says
def test_a_lease_shorter_than_the_minimum_is_refused_naming_the_minimum():
    s = Scheduler(pool(), Policy(min_duration_s=600))
    with pytest.raises(BadRequest, match="under the minimum lease length of 10 min; ask for at least 10 min") as e:
        s.new_lease(Ask(user="ann", duration_s=10), T0)
    assert e.value.field == "duration_s"
    with pytest.raises(BadRequest, match=r"^a duration of 2 d is over the 8 h limit of tier 'experiment'; ask for at most 8 h$") as e:
        s.new_lease(parse_ask({"gpus": 1, "duration_h": 48}, user="ann"), T0)
    assert e.value.field == "duration_h"


def test_a_tier_shorter_than_the_minimum_lease_is_a_config_error():
    with pytest.raises(ValueError, match=r"tier 'short'.*min_duration_s"):
        Policy(tiers={"short": Tier("short", max_duration_s=60, default_duration_s=30)}, default_tier="short")


def test_tiers_and_quotas_are_checked_against_the_ask():
    pol = Policy(tiers={"staff": Tier("staff", groups=("staff",))}, default_tier="staff", default_user_quota=Quota(max_gpus=1))
    s = Scheduler(pool(), pol)
    with pytest.raises(Forbidden, match="ann may not use tier 'staff'"):
        s.new_lease(Ask(user="ann"), T0)
    with pytest.raises(Refused, match="over the limit of 1 concurrent GPUs") as e:
        s.new_lease(Ask(user="ann", groups=("staff",), request=parse_request({"gpus": 2})), T0)
    assert e.value.field == "gpus"


def test_required_gpus_must_exist_and_be_able_to_hold_the_request():
    s = Scheduler(pool(), Policy())
    with pytest.raises(Refused, match="require_gpus") as e:
        s.new_lease(Ask(user="ann", require_gpus=("GPU-nope",)), T0)
    assert e.value.field == "require_gpus"
    with pytest.raises(Refused, match="asks for 2 GPUs on one node"):
        s.new_lease(Ask(user="ann", request=parse_request({"gpus": 2}), require_gpus=("GPU-a0", "GPU-l0")), T0)
    assert s.new_lease(Ask(user="ann", request=parse_request({"mig_profile": "3g.40gb"}), require_gpus=("MIG-1",)), T0)


def test_a_resume_goes_back_to_the_gpu_it_prefers_and_a_requirement_is_kept():
    s = Scheduler(pool(), Policy(confirm_timeout_s=None))
    first = s.new_lease(Ask(user="ann", request=parse_request({"gpus": 1, "model": "A100*"})), T0)
    s.submit(first, T0)
    s.tick(T0)
    assert first.placement.slices[0].gpu_uuid == "GPU-a0"  # best fit picks the first
    back = s.new_lease(Ask(user="bob", request=parse_request({"gpus": 1, "model": "A100*"}), prefer_gpus=("GPU-a1",)), T0)
    s.submit(back, T0)
    s.tick(T0)
    assert back.placement.slices[0].gpu_uuid == "GPU-a1"
    # the preferred GPU is taken: a preference falls back to any GPU, a requirement waits for it
    s.release(back.id, T0 + 1)
    s.release(first.id, T0 + 1)
    hog = s.new_lease(Ask(user="cat", request=parse_request({"gpus": 1, "model": "A100*"}), require_gpus=("GPU-a1",)), T0 + 2)
    s.submit(hog, T0 + 2)
    pref = s.new_lease(Ask(user="dan", request=parse_request({"gpus": 1, "model": "A100*"}), prefer_gpus=("GPU-a1",)), T0 + 2)
    s.submit(pref, T0 + 2)
    req = s.new_lease(Ask(user="eve", request=parse_request({"gpus": 1, "model": "A100*"}), require_gpus=("GPU-a1",)), T0 + 2)
    s.submit(req, T0 + 2)
    s.tick(T0 + 2)
    assert hog.placement.slices[0].gpu_uuid == "GPU-a1"
    assert pref.state is LeaseState.ACTIVE and pref.placement.slices[0].gpu_uuid == "GPU-a0"
    assert req.state is LeaseState.QUEUED and s.eta(req.id) == hog.expires_at


def test_a_resuming_lease_goes_ahead_of_new_requests_of_its_tier_when_the_policy_says_so():
    for resume_priority in (True, False):
        s = Scheduler(pool()[:1], Policy(confirm_timeout_s=None, resume_priority=resume_priority))
        held = s.new_lease(Ask(user="ann", server="", duration_s=HOUR), T0)
        s.submit(held, T0)
        s.tick(T0)
        s.release(held.id, T0 + 60, state=LeaseState.RECLAIMED, reason="idle")  # ann's kernel lost its GPU
        blocker = s.new_lease(Ask(user="zed", duration_s=HOUR), T0 + 60)
        s.submit(blocker, T0 + 60)
        s.tick(T0 + 60)
        newer = s.new_lease(Ask(user="bob"), T0 + 61)
        s.submit(newer, T0 + 61)
        back = s.new_lease(Ask(user="ann"), T0 + 62)  # her next cell: the resume
        s.submit(back, T0 + 62)
        s.tick(T0 + 62)
        assert back.resuming
        assert [x.id for x in s.queue()] == ([back.id, newer.id] if resume_priority else [newer.id, back.id])
