"""Bookings in the broker: made, listed, read and ended over REST; refused with the reason and
nothing changed; durable across a restart; honoured at their start; given back when unused;
as an iCalendar; from the command line."""

import asyncio
import datetime as dt
import json

import pytest
from tornado.httpclient import AsyncHTTPClient

from brokerutil import ManualClock, broker_url, make_broker, patch_auth
from jupyter_gpulease.client import BrokerClient, BrokerError

pytestmark = pytest.mark.timeout(60)

POOL = [
    {"node": "n1", "model": "A100-SXM4-80GB", "count": 2, "memory_mib": 81920},
    {"node": "n2", "model": "L4", "count": 2, "memory_mib": 23034},
]
H = 3600.0
TWO_A100 = {"gpus": 2, "model": "A100*"}


@pytest.fixture(autouse=True)
def _auth(monkeypatch):
    patch_auth(monkeypatch)


def run(tmp_path, scenario, clock=None, **traits):
    clock = clock or ManualClock()

    async def main():
        app = make_broker(tmp_path, clock, pool=POOL, device_sample_interval=3600, **traits)
        await app.start_async()
        try:
            return await scenario(app, clock, lambda user: BrokerClient(broker_url(app), user))
        finally:
            await app.stop_async()

    return asyncio.run(main())


async def tick(app, clock, seconds):
    clock.advance(seconds)
    await app.manager.tick()
    await app.manager.flush()


async def fetch_raw(app, path, user):
    resp = await AsyncHTTPClient().fetch(broker_url(app) + path, headers={"Authorization": f"token {user}"}, raise_error=False)
    return resp


def test_create_list_get_and_end_early(tmp_path):
    async def scenario(app, clock, client):
        alice, bob, admin = client("alice"), client("bob"), client("admin-dan")
        now = clock.now()
        b = await alice.book(start=now + H, end=now + 3 * H, request=TWO_A100, title="thesis run")
        assert b["state"] == "accepted" and b["users"] == ["alice"] and b["gpus"] == 2 and len(b["slices"]) == 2
        assert b["summary"] == "2 × A100-SXM4-80GB for alice" and b["created_by"] == "alice" and b["created_at"] == now
        assert [x["id"] for x in await alice.bookings()] == [b["id"]]
        assert await bob.bookings() == []
        assert [x["id"] for x in await admin.bookings()] == [b["id"]]
        assert [x["id"] for x in await admin.bookings("alice", pool="A100*")] == [b["id"]]
        assert await admin.bookings(pool="L4") == []
        assert await admin.bookings(start=now + 4 * H) == []
        iso = dt.datetime.fromtimestamp(now + 2 * H, dt.UTC).isoformat()
        assert [x["id"] for x in await admin.bookings(start=iso)] == [b["id"]]
        assert (await alice.get_booking(b["id"]))["title"] == "thesis run"
        # an event on the feed, for admins
        events = (await admin.events(0, timeout=0))["events"]
        [ev] = [e for e in events if e["kind"] == "booking"]
        assert ev["data"]["booking"] == b["id"] and ev["data"]["what"] == "accepted" and ev["to_state"] == "accepted"
        with pytest.raises(BrokerError) as e:
            await bob.get_booking(b["id"])
        assert e.value.status == 403
        with pytest.raises(BrokerError) as e:
            await bob.unbook(b["id"])
        assert e.value.status == 403
        with pytest.raises(BrokerError) as e:
            await alice.get_booking("abcdef012345")
        assert e.value.status == 404
        ended = await alice.unbook(b["id"])
        assert ended["state"] == "ended" and "ended early by alice" in ended["reason"]
        with pytest.raises(BrokerError) as e:
            await alice.unbook(b["id"])
        assert e.value.status == 409
        # the GPUs are free to book again
        again = await bob.book(start=now + H, end=now + 3 * H, request=TWO_A100)
        assert again["state"] == "accepted"

    run(tmp_path, scenario)


def test_bad_input_is_refused_naming_the_field_and_changes_nothing(tmp_path):
    async def scenario(app, clock, client):
        alice, bob, admin = client("alice"), client("bob"), client("admin-dan")
        now = clock.now()
        held = await bob.book(start=now + H, end=now + 3 * H, request=TWO_A100)
        cases = [
            (alice, {"start": now - 2 * H, "end": now - H, "request": TWO_A100}, 400, "end", "already over"),
            (alice, {"start": now - 2 * H, "end": now + H, "request": TWO_A100}, 400, "start", "in the past"),
            (alice, {"start": now + 2 * H, "end": now + H, "request": TWO_A100}, 400, "end", "after 'start'"),
            (alice, {"start": now + 15 * 86400, "end": now + 15 * 86400 + H, "request": TWO_A100}, 400, "start", "ahead"),
            (alice, {"start": now + H, "end": now + 10 * H, "request": TWO_A100}, 400, "end", "at most 8 h"),
            (alice, {"start": now + H, "end": now + 2 * H, "request": {"gpus": 1, "model": "H100*"}}, 400, "request.model", "H100"),
            (alice, {"start": now + H, "end": now + 2 * H, "request": "2 GPUs"}, 400, "request", "object"),
            (alice, {"start": "tomorrow", "end": now + 2 * H, "request": TWO_A100}, 400, "start", "ISO 8601"),
            (alice, {"start": now + H, "end": now + 2 * H}, 400, "request", "missing"),
            (alice, {"start": now + H, "end": now + 2 * H, "request": TWO_A100, "colour": "red"}, 400, "colour", "unknown"),
            (alice, {"start": now + H, "end": now + 2 * H, "request": TWO_A100, "users": ["bob"]}, 403, "users", "admins"),
            (alice, {"start": now + H, "end": now + 2 * H, "request": TWO_A100, "groups": ["physics"]}, 403, "groups", "admins"),
            # booked by bob: refused with the earliest start that would work
            (alice, {"start": now + 2 * H, "end": now + 4 * H, "request": TWO_A100}, 409, "start", "booked by others"),
        ]
        before = await admin.bookings()
        for who, body, status, field, words in cases:
            with pytest.raises(BrokerError) as e:
                await who._call("POST", "api/bookings", body)
            assert (e.value.status, e.value.field) == (status, field), (body, e.value)
            assert words in e.value.message, (body, e.value.message)
        assert await admin.bookings() == before
        # the 409's body names the next start that would work: bob's booking's end
        resp = await AsyncHTTPClient().fetch(broker_url(app) + "api/bookings", method="POST", raise_error=False,
                                             headers={"Authorization": "token alice"},
                                             body=json.dumps({"start": now + 2 * H, "end": now + 4 * H, "request": TWO_A100}))
        body = json.loads(resp.body)
        assert resp.code == 409 and body["next_start"] == pytest.approx(held["end"])
        # over the GPU-hours per week: 2 GPUs × 8 h twice, then 2 × 8 h more is 48 > 40
        await alice.book(start=now + 86400, end=now + 86400 + 8 * H, request=TWO_A100)
        await alice.book(start=now + 2 * 86400, end=now + 2 * 86400 + 8 * H, request=TWO_A100)
        with pytest.raises(BrokerError) as e:
            await alice.book(start=now + 3 * 86400, end=now + 3 * 86400 + 8 * H, request=TWO_A100)
        assert e.value.status == 409 and "GPU-hours" in e.value.message
        # admins book for anyone, a group, past the allowance
        g = await admin.book(start=now + 3 * 86400, end=now + 3 * 86400 + 8 * H, request=TWO_A100, groups=["physics"], users=["carol"])
        assert g["groups"] == ["physics"] and g["users"] == ["carol"] and g["created_by"] == "admin-dan"
        assert g["id"] in [x["id"] for x in await alice.bookings()]  # alice is in physics
        assert g["id"] in [x["id"] for x in await client("carol").bookings()]

    run(tmp_path, scenario)


def test_who_may_book_and_bookings_off(tmp_path):
    async def scenario(app, clock, client):
        now = clock.now()
        with pytest.raises(BrokerError) as e:
            await client("bob").book(start=now + H, end=now + 2 * H, request=TWO_A100)
        assert e.value.status == 403 and "physics" in e.value.message
        assert (await client("alice").book(start=now + H, end=now + 2 * H, request=TWO_A100))["state"] == "accepted"

    run(tmp_path, scenario, booking_groups=["physics"])

    async def off(app, clock, client):
        now = clock.now()
        with pytest.raises(BrokerError) as e:
            await client("alice").book(start=now + H, end=now + 2 * H, request=TWO_A100)
        assert e.value.status == 403
        assert (await client("admin-dan").book(start=now + H, end=now + 2 * H, request=TWO_A100, users=["alice"]))["state"] == "accepted"

    run(tmp_path, off, booking_gpu_hours_per_week=0, db_name="off.sqlite")


def test_a_booking_survives_a_restart(tmp_path):
    holder = {}
    clock = ManualClock()

    async def first(app, clock, client):
        holder["b"] = await client("alice").book(start=clock.now() + H, end=clock.now() + 3 * H, request=TWO_A100, title="lab")

    async def second(app, clock, client):
        alice = client("alice")
        [b] = await alice.bookings()
        assert {k: b[k] for k in ("id", "start", "end", "slices", "state", "title", "created_by")} == \
            {k: holder["b"][k] for k in ("id", "start", "end", "slices", "state", "title", "created_by")}
        # bob's two-hour lease would run into the booking on both A100s: it waits
        lease = await client("bob").request_lease({"gpus": 1, "model": "A100*", "duration_s": 2 * H})
        assert lease["state"] == "queued" and "booked" in lease["queue"]["waiting_for"]
        await alice.unbook(b["id"])

    async def third(app, clock, client):
        [b] = await client("alice").bookings()
        assert b["state"] == "ended" and "ended early" in b["reason"]

    run(tmp_path, first, clock)
    run(tmp_path, second, clock)
    run(tmp_path, third, clock)


def test_the_owners_request_at_the_start_gets_the_booked_gpus(tmp_path):
    async def scenario(app, clock, client):
        alice, bob = client("alice"), client("bob")
        now = clock.now()
        b = await alice.book(start=now + H, end=now + 3 * H, request={"gpus": 1, "model": "A100*"})
        booked = b["slices"][0]["gpu_uuid"]
        # bob takes the other A100 for long; the booked one he may only have until the booking starts
        other = await bob.request_lease({"gpus": 1, "model": "A100*", "duration_s": 8 * H})
        assert other["state"] == "active" and other["placement"]["slices"][0]["gpu_uuid"] != booked
        await tick(app, clock, H)
        lease = await alice.request_lease({"gpus": 1, "model": "A100*", "duration_s": 4 * H})
        assert lease["state"] == "active" and lease["placement"]["slices"][0]["gpu_uuid"] == booked
        assert lease["meta"].get("booking") == b["id"]
        assert lease["expires_at"] == pytest.approx(b["end"])  # until the booking's end at the latest
        got = await alice.get_booking(b["id"])
        assert got["state"] == "active" and got["used_at"] == pytest.approx(clock.now())

    run(tmp_path, scenario)


def test_an_unused_booking_ends_after_its_grace_with_an_event(tmp_path):
    async def scenario(app, clock, client):
        alice, admin = client("alice"), client("admin-dan")
        now = clock.now()
        b = await alice.book(start=now + H, end=now + 3 * H, request=TWO_A100)
        await tick(app, clock, H + 600)
        assert (await alice.get_booking(b["id"]))["state"] == "accepted"
        await tick(app, clock, 301)
        got = await alice.get_booking(b["id"])
        assert got["state"] == "ended" and "not used within 15 min" in got["reason"]
        evs = [e for e in (await admin.events(0, timeout=0))["events"] if e["kind"] == "booking"]
        assert [e["data"]["what"] for e in evs] == ["accepted", "ended"]
        assert "not used" in evs[-1]["reason"]

    run(tmp_path, scenario)


def parse_ics(raw: bytes) -> list[dict]:
    """A small RFC 5545 check: CRLF lines of at most 75 octets, unfolded; VCALENDAR around VEVENTs with their properties."""
    assert raw.endswith(b"\r\n") and b"\n" not in raw.replace(b"\r\n", b"")
    lines = raw.split(b"\r\n")[:-1]
    assert all(len(x) <= 75 for x in lines)
    unfolded: list[str] = []
    for x in lines:
        if x.startswith(b" "):
            unfolded[-1] += x[1:].decode("utf-8")
        else:
            unfolded.append(x.decode("utf-8"))
    assert unfolded[0] == "BEGIN:VCALENDAR" and unfolded[-1] == "END:VCALENDAR" and "VERSION:2.0" in unfolded
    assert any(x.startswith("PRODID:") for x in unfolded)
    events, cur = [], None
    for x in unfolded[1:-1]:
        if x == "BEGIN:VEVENT":
            cur = {}
        elif x == "END:VEVENT":
            events.append(cur)
            cur = None
        elif cur is not None:
            name, _, value = x.partition(":")
            cur[name] = value.replace("\\n", "\n").replace("\\,", ",").replace("\\;", ";").replace("\\\\", "\\")
    for e in events:
        for need in ("UID", "DTSTAMP", "DTSTART", "DTEND", "SUMMARY"):
            assert need in e, (need, e)
        for t in ("DTSTAMP", "DTSTART", "DTEND"):
            dt.datetime.strptime(e[t], "%Y%m%dT%H%M%SZ")
    return events


def test_the_calendar_feeds(tmp_path):
    async def scenario(app, clock, client):
        alice, admin = client("alice"), client("admin-dan")
        now = clock.now()
        b = await alice.book(start=now + H, end=now + 3 * H, request=TWO_A100, title="a very long title, with commas; and a semicolon " * 3)
        c = await admin.book(start=now + 5 * H, end=now + 6 * H, request={"gpus": 1, "model": "L4"}, users=["bob"])
        resp = await fetch_raw(app, "api/bookings.ics", "alice")
        assert resp.code == 200 and resp.headers["Content-Type"].startswith("text/calendar")
        [ev] = parse_ics(resp.body)
        assert ev["UID"].startswith(b["id"] + "@")
        assert ev["SUMMARY"].startswith("2 × A100-SXM4-80GB for alice: a very long title, with commas; and a semicolon")
        assert ev["DTSTART"] == dt.datetime.fromtimestamp(b["start"], dt.UTC).strftime("%Y%m%dT%H%M%SZ")
        assert "State: accepted" in ev["DESCRIPTION"] and b["slices"][0]["gpu_uuid"] in ev["DESCRIPTION"]
        pool = parse_ics((await fetch_raw(app, "api/bookings.ics", "admin-dan")).body)
        assert [e["UID"].split("@")[0] for e in pool] == [b["id"], c["id"]]
        bobs = parse_ics((await fetch_raw(app, "api/bookings.ics?user=bob", "admin-dan")).body)
        assert [e["UID"].split("@")[0] for e in bobs] == [c["id"]]
        assert (await fetch_raw(app, "api/bookings.ics?user=bob", "alice")).code == 403

    run(tmp_path, scenario)


def test_the_cli_round_trip(tmp_path, capsys, monkeypatch):
    import time

    from brokerutil import broker_in_thread
    from jupyter_gpulease.cli import main as jupyter_gpulease

    monkeypatch.delenv("JUPYTERHUB_API_TOKEN", raising=False)
    now = time.time()
    with broker_in_thread(tmp_path, clock=ManualClock(now), pool=POOL) as app:
        monkeypatch.setenv("GPULEASE_BROKER_URL", broker_url(app))
        monkeypatch.setenv("GPULEASE_TOKEN", "alice")
        start, end = str(int(now + H)), str(int(now + 3 * H))
        assert jupyter_gpulease(["book", "--start", start, "--end", end, "--gpus", "2", "--model", "A100*", "--title", "thesis"]) == 0
        out = capsys.readouterr().out
        assert out.startswith("Booking ") and "2 × A100-SXM4-80GB for alice" in out
        booking = out.split()[1].rstrip(":")
        assert jupyter_gpulease(["book", "--start", start, "--end", end, "--gpus", "1", "--model", "A100*", "--for-user", "bob"]) == 1
        assert "only admins" in capsys.readouterr().err
        assert jupyter_gpulease(["book", "--start", start, "--end", end, "--gpus", "1", "--model", "A100*"]) == 1
        assert "booked by others" in capsys.readouterr().err
        monkeypatch.setenv("GPULEASE_TOKEN", "admin-dan")
        assert jupyter_gpulease(["book", "--start", start, "--end", end, "--share", "0.5", "--model", "L4", "--for-user", "bob",
                                 "--for-user", "carol", "--group", "chemistry", "--json"]) == 0
        shared = json.loads(capsys.readouterr().out)
        assert shared["users"] == ["bob", "carol"] and shared["groups"] == ["chemistry"] and shared["request"]["kind"] == "share"
        assert jupyter_gpulease(["bookings", "--user", "alice"]) == 0
        out = capsys.readouterr().out
        assert booking in out and "thesis" in out and shared["id"] not in out
        monkeypatch.setenv("GPULEASE_TOKEN", "alice")
        assert jupyter_gpulease(["unbook", booking]) == 0
        assert f"Booking {booking} ended" in capsys.readouterr().out
        assert jupyter_gpulease(["bookings"]) == 0
        assert "ended early by alice" in capsys.readouterr().out
        assert jupyter_gpulease(["unbook", shared["id"]]) == 1
        assert "someone else" in capsys.readouterr().err
