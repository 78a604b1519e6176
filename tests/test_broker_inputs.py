"""Hostile input: every malformed or oversized request gets its 4xx, and changes nothing.

In-process broker over real HTTP (the caller named by the token, see brokerutil). The cases
are those an attacker's fuzzer found: oversized bodies and fields, deep JSON, numbers written
with Unicode digits or stray signs, methods a route does not have.
"""

import asyncio
import json

import pytest
from tornado.httpclient import AsyncHTTPClient

from brokerutil import ManualClock, broker_url, make_broker, patch_auth
from jupyter_gpulease.broker.feed import Feed
from jupyter_gpulease.client import BrokerClient, BrokerError
from jupyter_gpulease.core.model import BadRequest
from jupyter_gpulease.core.request import parse_number

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _auth(monkeypatch):
    patch_auth(monkeypatch)


async def call(app, method, path, body=None, user="alice", headers=None):
    raw = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    if raw is None and method in ("POST", "PUT", "PATCH"):
        raw = b""
    r = await AsyncHTTPClient().fetch(broker_url(app) + path, method=method, body=raw, raise_error=False, allow_nonstandard_methods=True,
                                      headers={"Authorization": f"token {user}", **(headers or {})})
    try:
        return r.code, json.loads(r.body) if r.body else None
    except ValueError:
        return r.code, r.body


BIG = "x" * 5000

# (method, path, body, expected status, the field the error names or None)
CASES = [
    ("POST", "api/leases", {"gpus": "--5"}, 400, "gpus"),
    ("POST", "api/leases", {"gpus": "²"}, 400, "gpus"),
    ("POST", "api/leases", {"gpus": "+1"}, 400, "gpus"),
    ("POST", "api/leases", {"gpus": True}, 400, "gpus"),
    ("POST", "api/leases", {"memory_mib": "³"}, 400, "memory_mib"),
    ("POST", "api/leases", {"min_memory_mib": "--1", "gpus": 1}, 400, "min_memory_mib"),
    ("POST", "api/leases", {"share": "٠.5"}, 400, "share"),
    ("POST", "api/leases", {"gpus": 1, "duration_s": "1e999"}, 400, "duration_s"),
    ("POST", "api/leases", {"gpus": 1, "max_wait_s": "-1"}, 400, "max_wait_s"),
    ("POST", "api/leases", {"gpus": 1, "meta": {"blob": BIG}}, 413, "meta"),
    ("POST", "api/leases", b'{"gpus": 1, "duration_s": NaN}', 400, "body"),
    ("POST", "api/leases", b"[" * 100_000, 413, "body"),
    ("POST", "api/leases", b'{"a":' * 20 + b"1" + b"}" * 20, 400, "body"),
    ("POST", "api/leases", b"{" + b'"meta": {"a": ' + b'{"b": ' * 30 + b"1" + b"}" * 31 + b"}", 400, "body"),
    ("POST", "api/leases", b'{"gpus": 1, "colour": "blue"}', 400, "colour"),
    ("POST", "api/leases", {"gpus": 1, "prefer_gpus": "GPU-1"}, 400, "prefer_gpus"),
    ("POST", "api/leases", {"gpus": 1, "user": "bob"}, 403, "user"),
    ("GET", "api/leases?limit=%C2%B2", None, 400, "limit"),
    ("GET", "api/leases?limit=-1", None, 400, "limit"),
    ("GET", "api/leases?limit=1e3", None, 400, "limit"),
    ("GET", "api/leases?state=sleeping", None, 400, "state"),
    ("GET", "api/events?since=%C2%B2", None, 400, "since"),
    ("GET", "api/events?since=--1", None, 400, "since"),
    ("GET", "api/events?timeout=nan", None, 400, "timeout"),
    ("GET", "api/events?timeout=1000", None, 400, "timeout"),
    ("GET", "api/pool?all=maybe", None, 400, "all"),
    ("POST", "api/leases?dry_run=perhaps", {"gpus": 1}, 400, "dry_run"),
    ("POST", "api/estimate", {"asks": "gpus"}, 400, "asks"),
    ("POST", "api/estimate", {"asks": [{"gpus": 1}] * 40}, 400, "asks"),
    ("POST", "api/drain", {"drain": True}, 403, "drain"),
    ("GET", "api/nothing-here", None, 404, None),
    ("PUT", "api/leases", {"gpus": 1}, 405, None),
    ("PATCH", "api/pool", {}, 405, None),
    ("BREW", "api/pool", None, 405, None),
]


@pytest.mark.parametrize("method,path,body,status,field", CASES, ids=[f"{c[0]} {c[1][:40]} {str(c[2])[:30]}" for c in CASES])
def test_bad_input_gets_its_4xx_and_changes_nothing(tmp_path, method, path, body, status, field):
    async def main():
        app = make_broker(tmp_path, ManualClock())
        await app.start_async()
        try:
            code, answer = await call(app, method, path, body)
            assert code == status, (code, answer)
            if field is not None:
                assert isinstance(answer, dict) and answer.get("field") == field and answer.get("message"), answer
            assert app.store.count_leases() == 0 and not app.manager.scheduler.leases
        finally:
            await app.stop_async()

    asyncio.run(main())


def test_lease_actions_answer_other_methods_with_405_and_the_lease_is_untouched(tmp_path):
    async def main():
        app = make_broker(tmp_path, ManualClock())
        await app.start_async()
        try:
            lease = await BrokerClient(broker_url(app), "alice").request_lease({"gpus": 1})
            for action in ("extend", "release", "confirm", "heartbeat"):
                for method in ("GET", "DELETE", "PUT"):
                    code, answer = await call(app, method, f"api/leases/{lease['id']}/{action}", {} if method == "PUT" else None)
                    assert code == 405, (method, action, code, answer)
                    assert "POST" in answer["message"]
            code, answer = await call(app, "POST", f"api/leases/{lease['id']}/release", {"reason": "r" * 1001})
            assert (code, answer["field"]) == (413, "reason")
            code, answer = await call(app, "POST", f"api/leases/{lease['id']}/heartbeat", {"usage": {"x": "y" * 5000}})
            assert (code, answer["field"]) == (413, "usage")
            code, answer = await call(app, "POST", f"api/leases/{lease['id']}/extend", {"by_s": "³"})
            assert (code, answer["field"]) == (400, "by_s")
            code, answer = await call(app, "POST", f"api/leases/{lease['id']}/release", {"keep_server": "yes"})
            assert (code, answer["field"]) == (400, "keep_server")
            code, answer = await call(app, "POST", "api/leases", {"gpus": 1}, headers={"Idempotency-Key": "no spaces allowed"})
            assert (code, answer["field"]) == (400, "Idempotency-Key")
            got = await BrokerClient(broker_url(app), "alice").get_lease(lease["id"])
            assert got["state"] == "active" and got["usage"] == {} and got["expires_at"] == lease["expires_at"]
            assert app.store.count_leases() == 1
        finally:
            await app.stop_async()

    asyncio.run(main())


def test_a_token_in_the_url_is_never_logged(tmp_path):
    import logging

    lines = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(self.format(record))

    async def main():
        app = make_broker(tmp_path, ManualClock())
        app.log.addHandler(Keep())
        app.log.setLevel(logging.DEBUG)
        await app.start_async()
        try:
            code, _ = await call(app, "GET", "api/pool?token=s3cr3t-token-value", user="invalid")
            assert code == 401
            code, _ = await call(app, "GET", "api/leases?limit=%C2%B2&token=s3cr3t-token-value")
            assert code == 400
        finally:
            await app.stop_async()

    asyncio.run(main())
    text = "\n".join(lines)
    assert "s3cr3t" not in text
    assert "401 GET /services/gpulease/api/pool" in text


@pytest.mark.parametrize("value", ["²", "--5", "+5", "5-", "1_000", "0x10", " ", "", "٣", "1e5", "inf", "nan", True, None, [1], {"a": 1}])
def test_the_one_number_parser_refuses_what_is_not_a_plain_decimal(value):
    with pytest.raises(BadRequest) as info:
        parse_number(value, "n", integer=True)
    assert info.value.field == "n"


def test_the_one_number_parser_takes_json_numbers_and_ascii_decimals():
    assert parse_number("42", "n", integer=True) == 42
    assert parse_number(" 7 ", "n", integer=True) == 7
    assert parse_number("1.5", "n") == 1.5
    assert parse_number(3, "n") == 3
    assert parse_number("-3", "n") == -3
    with pytest.raises(BadRequest, match="at least 1"):
        parse_number("0", "n", integer=True, minimum=1)


def test_slow_stream_clients_are_dropped_with_a_reason_and_streams_are_capped_per_user():
    async def main():
        feed = Feed(buffer=3, max_per_user=2)
        slow = feed.subscribe("alice")
        other = feed.subscribe("alice", capped=True)
        with pytest.raises(Exception, match="limit per user"):
            feed.subscribe("alice")
        idle = [feed.subscribe("bob", capped=False) for _ in range(400)]  # an admin's many idle streams
        feed.publish(({"id": i, "lease_id": "L", "kind": "k"}, "alice") for i in range(1, 6))
        assert slow.dropped and "read too slowly" in slow.dropped
        assert other.dropped  # both fell behind by more than 3
        assert all(not s.events and not s.dropped for s in idle), "an event of alice's touched bob's streams"
        assert feed.open_streams("alice") == 0  # dropped streams make room
        feed.subscribe("alice")

    asyncio.run(main())


def test_the_event_stream_cap_answers_429(tmp_path):
    async def main():
        app = make_broker(tmp_path, ManualClock(), max_streams_per_user=1)
        await app.start_async()
        try:
            chunks = []
            first = asyncio.ensure_future(AsyncHTTPClient().fetch(
                broker_url(app) + "api/events/stream", headers={"Authorization": "token alice"}, request_timeout=30,
                streaming_callback=chunks.append, raise_error=False))
            for _ in range(200):
                if chunks:
                    break
                await asyncio.sleep(0.05)
            assert chunks, "the first stream never connected"
            code, answer = await call(app, "GET", "api/events?timeout=5")
            assert code == 429 and answer["field"] == "stream"
            code, _ = await call(app, "GET", "api/events?timeout=0", user="bob")
            assert code == 200
        finally:
            await app.stop_async()
            await asyncio.wait_for(first, 30)

    asyncio.run(main())


def test_an_extension_refused_because_someone_waits_is_a_409_conflict_with_its_reason(tmp_path):
    """Nothing in the request is wrong: the pool's state refuses it now (409, no field), and the
    client carries the message to the user; once nobody waits, the same call extends."""

    async def main():
        app = make_broker(tmp_path, ManualClock(), pool=[{"node": "n1", "model": "L4", "count": 1, "memory_mib": 23034}])
        await app.start_async()
        try:
            alice, bob = BrokerClient(broker_url(app), "alice"), BrokerClient(broker_url(app), "bob")
            lease = await alice.request_lease({"gpus": 1})
            waiting = await bob.request_lease({"gpus": 1})
            assert (lease["state"], waiting["state"]) == ("active", "queued")
            code, answer = await call(app, "POST", f"api/leases/{lease['id']}/extend", {"by_s": 600})
            assert code == 409 and answer["error"] == "Conflict" and "field" not in answer
            assert "someone is waiting for this GPU" in answer["message"] and lease["id"] in answer["message"]
            try:
                await alice.extend(lease["id"], by_s=600)
                raise AssertionError("extended while someone waits")
            except BrokerError as e:
                assert e.status == 409 and "someone is waiting for this GPU" in e.message
            assert (await alice.get_lease(lease["id"]))["expires_at"] == lease["expires_at"]
            await bob.release(waiting["id"])
            extended = await alice.extend(lease["id"], by_s=600)
            assert extended["expires_at"] == lease["expires_at"] + 600
        finally:
            await app.stop_async()

    asyncio.run(main())
