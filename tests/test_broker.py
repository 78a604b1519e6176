"""The broker in-process, over real HTTP on 127.0.0.1, with a clock the tests move.

Unit level: the caller is named by the token (see brokerutil.patch_auth), so these tests
cover the REST API, the manager and the store without a hub. test_broker_hub.py runs the
same broker behind a real JupyterHub.
"""

import asyncio
import json

import pytest

from brokerutil import ManualClock, broker_url, make_broker, patch_auth
from jupyter_gpulease.client import BrokerClient, BrokerError

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def _auth(monkeypatch):
    patch_auth(monkeypatch)


def run_with_broker(tmp_path, scenario, clock=None, **kw):
    """Start a broker, run ``scenario(app, client_for)``, stop the broker."""
    clock = clock or ManualClock()

    async def main():
        app = make_broker(tmp_path, clock, **kw)
        await app.start_async()
        try:
            return await scenario(app, lambda user: BrokerClient(broker_url(app), user))
        finally:
            await app.stop_async()

    return asyncio.run(main())


async def expect_error(coro, status, field=None):
    with pytest.raises(BrokerError) as info:
        await coro
    err = info.value
    assert err.status == status, f"expected {status}, got {err.status}: {err.message}"
    if field is not None:
        assert err.field == field, f"expected the error to name {field!r}, got {err.field!r}: {err.message}"
        assert err.message
    return err


def test_a_free_gpu_is_granted_at_once_and_only_its_holder_sees_it(tmp_path):
    async def scenario(app, client):
        alice, bob, admin = client("alice"), client("bob"), client("admin-carol")
        lease = await alice.request_lease({"gpus": 1, "model": "A100*", "duration_s": 3600})
        assert lease["state"] == "active"
        assert lease["user"] == "alice" and lease["groups"] == ["physics"]
        assert lease["placement"]["slices"][0]["model"] == "A100-SXM4-80GB"
        assert lease["expires_at"] == lease["granted_at"] + 3600
        assert (await alice.get_lease(lease["id"]))["id"] == lease["id"]
        assert [x["id"] for x in await alice.list_leases()] == [lease["id"]]
        assert await bob.list_leases() == []
        await expect_error(bob.get_lease(lease["id"]), 403)
        await expect_error(bob.release(lease["id"]), 403)
        await expect_error(bob.list_leases(user="alice"), 403, "user")
        assert [x["id"] for x in await admin.list_leases()] == [lease["id"]]
        assert [x["id"] for x in await admin.list_leases(user="alice")] == [lease["id"]]
        await expect_error(alice.get_lease("no-such-lease"), 404)

    run_with_broker(tmp_path, scenario)


def test_a_queued_lease_shows_position_and_eta_and_starts_when_the_gpu_is_released(tmp_path):
    async def scenario(app, client):
        alice, bob = client("alice"), client("bob")
        first = await alice.request_lease({"gpus": 2, "model": "A100*", "duration_s": 3600})
        waiting = await bob.request_lease({"gpus": 1, "model": "A100*"})
        assert waiting["state"] == "queued"
        q = waiting["queue"]
        assert (q["position"], q["length"]) == (1, 1)
        assert q["eta"] == first["expires_at"]
        assert "A100" in q["waiting_for"]
        # bob sees his own entry; alice sees bob's anonymised
        assert (await bob.queue())[0]["user"] == "bob"
        other = (await alice.queue())[0]
        assert other["user"] == "…" and "meta" not in other
        # a long poll started now returns bob's grant once alice releases
        poll = asyncio.ensure_future(bob.events(since=app.manager.last_event_id, lease_id=waiting["id"], timeout=20))
        await asyncio.sleep(0.2)
        assert not poll.done()
        released = await alice.release(first["id"], reason="done")
        assert released["state"] == "released"
        feed = await asyncio.wait_for(poll, 20)
        assert [e["kind"] for e in feed["events"]] == ["granted"]
        assert feed["last_id"] == feed["events"][-1]["id"]
        assert (await bob.get_lease(waiting["id"]))["state"] == "active"

    run_with_broker(tmp_path, scenario)


def test_bad_requests_get_400_naming_the_field_and_change_nothing(tmp_path):
    async def scenario(app, client):
        alice = client("alice")
        cases = [
            ({"gpus": 0}, "gpus"),
            ({"gpus": 1000}, "gpus"),
            ({"gpus": 1, "model": "V100"}, "model"),
            ({"gpus": 1, "tier": "platinum"}, "tier"),
            ({"gpus": 1, "duration_s": 10 * 24 * 3600}, "duration_s"),
            ({"gpus": 1, "duration_s": -5}, "duration_s"),
            ({"gpus": 1, "max_wait_s": "soon"}, "max_wait_s"),
            ({"share": 1.5}, "share"),
            ({"gpus": 1, "colour": "blue"}, "colour"),
            ({"gpus": 1, "meta": [1]}, "meta"),
        ]
        for body, field in cases:
            await expect_error(alice.request_lease(body), 400, field)
        await expect_error(alice.request_lease({"gpus": 1, "user": "bob"}), 403, "user")
        # malformed JSON straight through HTTP
        err = await expect_error(_raw_post(alice, b"{not json"), 400, "body")
        assert "JSON" in err.message
        await expect_error(_raw_post(alice, b"[1, 2]"), 400, "body")
        assert await alice.list_leases(state="all") == []
        assert app.manager.scheduler.leases == {}
        assert app.store.count_leases() == 0

    run_with_broker(tmp_path, scenario)


async def _raw_post(client, raw: bytes):
    from tornado.httpclient import AsyncHTTPClient, HTTPClientError

    try:
        await AsyncHTTPClient().fetch(client.url + "api/leases", method="POST", body=raw, headers={"Authorization": f"token {client.token}"})
    except HTTPClientError as e:
        from jupyter_gpulease.client import _error

        raise _error(e, client.url, "the lease broker") from None


def test_ended_leases_cannot_be_extended_or_released_again(tmp_path):
    async def scenario(app, client):
        alice = client("alice")
        lease = await alice.request_lease({"gpus": 1})
        await alice.release(lease["id"])
        await expect_error(alice.extend(lease["id"], by_s=600), 409)
        await expect_error(alice.release(lease["id"]), 409)
        ended = await alice.get_lease(lease["id"])
        assert ended["state"] == "released"
        assert [x["id"] for x in await alice.list_leases(state="ended")] == [lease["id"]]

    run_with_broker(tmp_path, scenario)


def test_extend_confirm_heartbeat_and_withdraw(tmp_path):
    async def scenario(app, client):
        alice = client("alice")
        lease = await alice.request_lease({"gpus": 1, "model": "L4", "duration_s": 3600})
        extended = await alice.extend(lease["id"], by_s=1800)
        assert extended["expires_at"] > lease["expires_at"]
        await expect_error(alice.extend(lease["id"]), 400, "by_s")
        assert (await alice.confirm(lease["id"]))["confirmed_at"] is not None
        hb = await alice.heartbeat(lease["id"], {"gpu_util": 42})
        assert hb["usage"] == {"gpu_util": 42}
        assert app.store.get_lease(lease["id"]).usage == {"gpu_util": 42}
        # fill the L4s and withdraw a queued one
        await alice.request_lease({"gpus": 1, "model": "L4"})
        queued = await alice.request_lease({"gpus": 1, "model": "L4"})
        assert queued["state"] == "queued"
        assert (await alice.release(queued["id"]))["state"] == "withdrawn"

    run_with_broker(tmp_path, scenario)


def test_a_lease_expires_when_the_clock_passes_its_end(tmp_path):
    clock = ManualClock()

    async def scenario(app, client):
        alice = client("alice")
        lease = await alice.request_lease({"gpus": 1, "duration_s": 600})
        clock.advance(601)
        await app.manager.tick()
        ended = await alice.get_lease(lease["id"])
        assert ended["state"] == "expired"
        feed = await alice.events(since=0, lease_id=lease["id"], timeout=0)
        assert [e["kind"] for e in feed["events"]][-1] == "ended"

    run_with_broker(tmp_path, scenario, clock=clock)


def test_leases_survive_a_broker_restart_with_their_placements(tmp_path):
    clock = ManualClock()

    async def first(app, client):
        alice, bob = client("alice"), client("bob")
        a = await alice.request_lease({"gpus": 2, "model": "A100*"})
        b = await bob.request_lease({"gpus": 1, "model": "A100*"})
        return a, b

    a, b = run_with_broker(tmp_path, first, clock=clock)

    async def second(app, client):
        alice, bob = client("alice"), client("bob")
        a2, b2 = await alice.get_lease(a["id"]), await bob.get_lease(b["id"])
        assert a2["state"] == "active" and a2["placement"] == a["placement"]
        assert b2["state"] == "queued" and b2["queue"]["position"] == 1
        await alice.release(a["id"])
        assert (await bob.get_lease(b["id"]))["state"] == "active"
        new = await bob.request_lease({"gpus": 1})
        assert new["id"] not in (a["id"], b["id"])

    run_with_broker(tmp_path, second, clock=clock)


def test_admin_requests_for_a_user_and_revokes(tmp_path):
    async def scenario(app, client):
        admin, alice = client("admin-spawner"), client("alice")
        lease = await admin.request_lease({"gpus": 1, "user": "alice", "groups": ["physics"], "server": "gpu", "meta": {"by": "spawner"}})
        assert lease["user"] == "alice" and lease["server"] == "gpu"
        assert (await alice.get_lease(lease["id"]))["meta"] == {"by": "spawner"}
        ended = await admin.release(lease["id"], reason="maintenance")
        assert ended["state"] == "revoked"
        events = (await admin.events(0, lease_id=lease["id"], timeout=0))["events"]
        assert events[0]["actor"] == "admin:admin-spawner"

    run_with_broker(tmp_path, scenario)


def test_pool_lists_devices_capacity_tiers_and_usage(tmp_path):
    async def scenario(app, client):
        alice = client("alice")
        await alice.request_lease({"gpus": 1, "model": "L4"})
        pool = await alice.pool()
        assert len(pool["devices"]) == 4
        assert set(pool["capacity"]) == {"A100-SXM4-80GB", "L4"}
        assert {t["name"] for t in pool["tiers"]} >= {"experiment"}
        assert pool["usage"]["gpus_held"] == 1
        assert pool["queue_length"] == 0

    run_with_broker(tmp_path, scenario)


def test_unauthenticated_calls_get_401_and_openapi_is_public(tmp_path):
    async def scenario(app, client):
        await expect_error(client("invalid").pool(), 401)
        await expect_error(BrokerClient(broker_url(app), "").list_leases(), 401)
        from tornado.httpclient import AsyncHTTPClient

        resp = await AsyncHTTPClient().fetch(broker_url(app) + "api/openapi.json")
        import json

        spec = json.loads(resp.body)
        assert "/api/leases/{id}/extend" in spec["paths"]

    run_with_broker(tmp_path, scenario)


def test_metrics_count_leases_gpus_and_grants(tmp_path):
    async def scenario(app, client):
        from tornado.httpclient import AsyncHTTPClient

        alice = client("alice")
        await alice.request_lease({"gpus": 2, "model": "A100*"})
        await alice.request_lease({"gpus": 1, "model": "A100*"})
        resp = await AsyncHTTPClient().fetch(broker_url(app) + "metrics", headers={"Authorization": "token alice"}, raise_error=False)
        assert resp.code == 403 and "custom:gpulease:metrics" in json.loads(resp.body)["message"]  # a user reads no one's metrics
        resp = await AsyncHTTPClient().fetch(broker_url(app) + "metrics", headers={"Authorization": "token prometheus"})
        text = resp.body.decode()
        assert 'gpulease_leases{state="active",tier="experiment"} 1.0' in text
        assert 'gpulease_leases{state="queued",tier="experiment"} 1.0' in text
        assert 'gpulease_gpus_total{model="A100-SXM4-80GB"} 2.0' in text
        assert 'gpulease_gpus_allocated{model="A100-SXM4-80GB"} 2.0' in text
        assert "gpulease_queue_length 1.0" in text
        assert 'gpulease_grants_total{tier="experiment"} 1.0' in text
        assert "gpulease_wait_seconds_bucket" in text

    run_with_broker(tmp_path, scenario)


def test_the_admin_page_lists_holders_queue_and_pool():
    import tempfile
    from pathlib import Path

    from jupyter_gpulease.broker.pages import render_admin_page

    tmp = Path(tempfile.mkdtemp())
    app = make_broker(tmp)

    async def fill():
        from jupyter_gpulease.core.request import Ask, parse_request

        m = app.manager
        await m.start()
        await m.request(Ask(user="alice", request=parse_request({"gpus": 2, "model": "A100*"})))
        await m.request(Ask(user="bob<script>", request=parse_request({"gpus": 1, "model": "A100*"})))
        page = render_admin_page(m, health=app.health)
        await m.close()
        return page

    page = asyncio.run(fill())
    assert "alice" in page and "A100-SXM4-80GB #0 on n1" in page
    assert "bob&lt;script&gt;" in page and "bob<script>" not in page
    assert "Queue" in page and "Pool" in page


def test_the_event_stream_sends_server_sent_events_of_the_callers_leases(tmp_path):
    async def scenario(app, client):
        from tornado.httpclient import AsyncHTTPClient, HTTPRequest

        alice, bob = client("alice"), client("bob")
        chunks: list[bytes] = []
        got_grant = asyncio.Event()

        def on_chunk(chunk):
            chunks.append(chunk)
            if b"event: granted" in b"".join(chunks):
                got_grant.set()

        req = HTTPRequest(broker_url(app) + "api/events/stream?since=0", headers={"Authorization": "token bob"}, streaming_callback=on_chunk, request_timeout=30)
        fetch = asyncio.ensure_future(AsyncHTTPClient(force_instance=True).fetch(req, raise_error=False))
        await alice.request_lease({"gpus": 1, "model": "L4"})
        mine = await bob.request_lease({"gpus": 1, "model": "L4"})
        await asyncio.wait_for(got_grant.wait(), 20)
        text = b"".join(chunks).decode()
        assert f'"lease_id": "{mine["id"]}"' in text
        assert text.count("event: ") == 2, "bob sees only his own lease's events"
        assert "id: " in text
        fetch.cancel()

    run_with_broker(tmp_path, scenario)


def test_an_expired_lease_stops_its_server_through_the_hub_api_when_configured(tmp_path):
    """stop_servers_on_end: the broker DELETEs the holder's server (a recording stand-in for the Hub API)."""
    from tornado import web
    from traitlets.config import Config

    from hubharness import free_port

    calls: list[tuple[str, str, str]] = []

    class FakeHubAPI(web.RequestHandler):
        def delete(self, path):
            calls.append(("DELETE", path, self.request.headers.get("Authorization", "")))
            self.set_status(204)

    hub_port = free_port()
    clock = ManualClock()

    async def scenario():
        fake = web.Application([(r"/hub/api/(.*)", FakeHubAPI)]).listen(hub_port, "127.0.0.1")
        app = make_broker(tmp_path, clock, stop_servers_on_end=True, confirm_timeout_s=0)
        app.update_config(Config({"HubAuth": {"api_url": f"http://127.0.0.1:{hub_port}/hub/api", "api_token": "broker-token"}}))
        await app.start_async()
        try:
            alice = BrokerClient(broker_url(app), "alice")
            named = await alice.request_lease({"gpus": 1, "duration_s": 600, "server": "gpu"})
            default = await alice.request_lease({"gpus": 1, "duration_s": 1200})
            released = await alice.request_lease({"gpus": 1, "duration_s": 600})
            await alice.release(released["id"])  # the holder's own release stops nothing
            clock.advance(601)
            await app.manager.tick()
            for _ in range(100):
                if calls:
                    break
                await asyncio.sleep(0.05)
            assert calls == [("DELETE", "users/alice/servers/gpu", "token broker-token")]
            clock.advance(600)
            await app.manager.tick()
            for _ in range(100):
                if len(calls) > 1:
                    break
                await asyncio.sleep(0.05)
            assert calls[1][:2] == ("DELETE", "users/alice/server")
            assert (await alice.get_lease(named["id"]))["state"] == "expired"
            assert (await alice.get_lease(default["id"]))["state"] == "expired"
        finally:
            await app.stop_async()
            fake.stop()

    asyncio.run(scenario())


class _FakeHub:
    """A recording stand-in for the Hub API: GET users/{name} answers from ``users`` (404 if absent)."""

    def __init__(self):
        from tornado import web

        from hubharness import free_port

        self.users: dict[str, dict] = {}
        self.calls: list[tuple[str, str, str]] = []
        self.port = free_port()
        fake = self

        class UserAPI(web.RequestHandler):
            def get(self, name):
                fake.calls.append(("GET", name, self.request.headers.get("Authorization", "")))
                if name not in fake.users:
                    raise web.HTTPError(404)
                self.finish(fake.users[name])

        self.app = web.Application([(r"/hub/api/users/([^/]+)", UserAPI)])
        self.server = None

    def start(self):
        self.server = self.app.listen(self.port, "127.0.0.1")

    def stop(self):
        self.server.stop()

    def configure(self, app):
        from traitlets.config import Config

        app.update_config(Config({"HubAuth": {"api_url": f"http://127.0.0.1:{self.port}/hub/api", "api_token": "broker-token"}}))


def test_admins_see_another_users_tiers_and_quota_others_get_403(tmp_path):
    tiers = {
        "open": {"priority": 10, "max_duration_s": 3600, "default_duration_s": 600},
        "physics": {"priority": 20, "max_duration_s": 3600, "default_duration_s": 600, "groups": ["physics"]},
    }
    hub = _FakeHub()
    hub.users["bob"] = {"name": "bob", "groups": ["physics"], "servers": {}}

    async def scenario():
        hub.start()
        app = make_broker(tmp_path, ManualClock(), tiers=tiers, default_tier="open", default_user_quota={"max_gpus": 3})
        hub.configure(app)
        await app.start_async()
        try:
            admin, alice, bob = (BrokerClient(broker_url(app), n) for n in ("admin-spawner", "alice", "bob"))
            await alice.request_lease({"gpus": 1, "model": "L4"})
            # the caller names the groups: no hub call
            pool = await admin.pool(user="alice", groups=["physics"])
            assert pool["user"] == "alice"
            assert {t["name"] for t in pool["tiers"]} == {"open", "physics"}
            assert pool["usage"]["gpus_held"] == 1
            assert not hub.calls
            # no groups given: the broker asks the hub (bob is in physics there)
            pool = await admin.pool(user="bob")
            assert {t["name"] for t in pool["tiers"]} == {"open", "physics"}
            assert pool["usage"]["gpus_held"] == 0
            assert hub.calls == [("GET", "bob", "token broker-token")]
            # a user the hub does not know: no groups
            pool = await admin.pool(user="zoe")
            assert {t["name"] for t in pool["tiers"]} == {"open"}
            # an admin's own pool lists the tiers the admin's own requests may use; every tier on request
            assert {t["name"] for t in (await admin.pool())["tiers"]} == {"open"}
            assert {t["name"] for t in (await admin.pool(every_tier=True))["tiers"]} == {"open", "physics"}
            await expect_error(bob.pool(every_tier=True), 403, "all")
            assert {t["name"] for t in (await bob.pool(user="bob"))["tiers"]} == {"open"}  # token groups: chemistry
            await expect_error(bob.pool(user="alice"), 403, "user")
            await expect_error(admin.pool(user=" "), 400, "user")
            # client.release(state=): the spawner ends a lease as its holder would ('released', not 'revoked')
            lease = (await admin.list_leases(user="alice"))[0]
            await expect_error(bob.release(lease["id"], state="revoked"), 403)
            ended = await admin.release(lease["id"], reason="server stopped", state="released")
            assert ended["state"] == "released" and ended["end_reason"] == "server stopped"
        finally:
            await app.stop_async()
            hub.stop()

    asyncio.run(scenario())


def test_the_check_with_the_hub_revokes_leases_whose_server_is_gone_after_the_grace(tmp_path):
    import logging

    from jupyter_gpulease.broker.hubapi import RECONCILE_REASON

    hub = _FakeHub()
    hub.users["alice"] = {"name": "alice", "servers": {"": {"name": "", "ready": True}}}
    hub.users["bob"] = {"name": "bob", "servers": {"other": {"name": "other", "pending": "spawn"}}}
    clock = ManualClock()
    messages: list[str] = []

    class Record(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    async def scenario():
        hub.start()
        app = make_broker(tmp_path, clock, reconcile_interval=0, reconcile_grace=120, confirm_timeout_s=0)
        hub.configure(app)
        app.log.addHandler(Record())
        await app.start_async()
        try:
            admin = BrokerClient(broker_url(app), "admin-spawner")
            spawned = {"spawner": "jupyter-gpulease"}
            a = await admin.request_lease({"gpus": 1, "user": "alice", "meta": spawned})
            b = await admin.request_lease({"gpus": 1, "user": "bob", "server": "gpu", "meta": spawned})
            c = await admin.request_lease({"gpus": 1, "user": "carol", "meta": spawned})  # unknown to the hub
            d = await admin.request_lease({"gpus": 1, "user": "bob", "server": "gpu"})  # not a spawner's: never checked
            assert all(x["state"] == "active" for x in (a, b, c, d))
            assert await app.hub_side.reconcile() == []  # gone, but granted just now
            clock.advance(60)
            assert await app.hub_side.reconcile() == []  # gone for 60 s only
            clock.advance(61)
            assert sorted(await app.hub_side.reconcile()) == sorted([b["id"], c["id"]])
            for x in (b, c):
                ended = await admin.get_lease(x["id"])
                assert ended["state"] == "revoked"
                assert ended["end_reason"] == RECONCILE_REASON
            assert (await admin.get_lease(a["id"]))["state"] == "active"
            assert (await admin.get_lease(d["id"]))["state"] == "active"
            assert {name for _, name, _ in hub.calls} == {"alice", "bob", "carol"}
            assert all(auth == "token broker-token" for _, _, auth in hub.calls)

            # a server that comes back within the grace resets it
            del hub.users["alice"]["servers"][""]
            clock.advance(10)
            assert await app.hub_side.reconcile() == []
            hub.users["alice"]["servers"][""] = {"name": ""}
            clock.advance(200)
            assert await app.hub_side.reconcile() == []
            # a hub that does not answer changes nothing, and says so once
            hub.stop()
            del hub.users["alice"]["servers"][""]
            for _ in range(3):
                clock.advance(300)
                assert await app.hub_side.reconcile() == []
            assert (await admin.get_lease(a["id"]))["state"] == "active"
            assert sum("Lease check with the hub skipped" in m for m in messages) == 1
        finally:
            await app.stop_async()

    asyncio.run(scenario())


def test_the_check_with_the_hub_runs_at_start_and_periodically(tmp_path):
    hub = _FakeHub()
    hub.users["alice"] = {"name": "alice", "servers": {}}

    async def scenario():
        hub.start()
        app = make_broker(tmp_path, ManualClock(), reconcile_interval=0.05, reconcile_grace=0, confirm_timeout_s=0)
        hub.configure(app)
        await app.start_async()
        try:
            admin = BrokerClient(broker_url(app), "admin-spawner")
            a = await admin.request_lease({"gpus": 1, "user": "alice", "meta": {"spawner": "jupyter-gpulease"}})
            for _ in range(200):
                if (await admin.get_lease(a["id"]))["state"] != "active":
                    break
                await asyncio.sleep(0.05)
            assert (await admin.get_lease(a["id"]))["state"] == "revoked"
        finally:
            await app.stop_async()
            hub.stop()

    asyncio.run(scenario())


def test_out_of_range_numbers_long_names_and_non_json_constants_get_400_and_change_nothing(tmp_path):
    async def scenario(app, client):
        alice, admin = client("alice"), client("admin-carol")
        lease = await alice.request_lease({"gpus": 1})
        huge = 10**400  # a JSON integer too large for a float
        for body, field in [
            ({"gpus": 1, "duration_s": huge}, "duration_s"),
            ({"gpus": 1, "max_wait_s": huge}, "max_wait_s"),
            ({"gpus": 1, "server": "x" * 256}, "server"),
        ]:
            await expect_error(alice.request_lease(body), 400, field)
        await expect_error(admin.request_lease({"gpus": 1, "user": "u" * 256}), 400, "user")
        await expect_error(alice.extend(lease["id"], by_s=huge), 400, "by_s")
        await expect_error(alice.extend(lease["id"], until=huge), 400, "until")
        await expect_error(alice._call("POST", f"api/leases/{lease['id']}/release", {"state": ["released"]}), 400, "state")
        await expect_error(alice._call("GET", "api/events", query={"since": 10**30, "timeout": 0}), 400, "since")
        # NaN is not JSON: a browser could not read the lease back, PostgreSQL would not store it
        err = await expect_error(_raw_post(alice, b'{"gpus": 1, "meta": {"x": NaN}}'), 400, "body")
        assert "NaN" in err.message
        assert [x["id"] for x in await alice.list_leases(state="all")] == [lease["id"]]
        assert (await alice.get_lease(lease["id"]))["state"] == "active"
        assert app.store.count_leases() == 1

    run_with_broker(tmp_path, scenario)


def test_the_check_with_the_hub_withdraws_a_queued_lease_whose_spawn_the_hub_forgot(tmp_path):
    hub = _FakeHub()
    # alice's spawn is still pending on the hub; bob's hub died mid-spawn and forgot it
    hub.users["alice"] = {"name": "alice", "servers": {"": {"name": "", "pending": "spawn"}}}
    hub.users["bob"] = {"name": "bob", "servers": {}}
    clock = ManualClock()

    async def scenario():
        hub.start()
        app = make_broker(tmp_path, clock, reconcile_interval=0, reconcile_grace=120, confirm_timeout_s=0)
        hub.configure(app)
        await app.start_async()
        try:
            admin = BrokerClient(broker_url(app), "admin-spawner")
            spawned = {"spawner": "jupyter-gpulease"}
            held = await admin.request_lease({"gpus": 2, "model": "A100*", "user": "carol"})  # not a spawner's
            a = await admin.request_lease({"gpus": 1, "model": "A100*", "user": "alice", "meta": spawned})
            b = await admin.request_lease({"gpus": 1, "model": "A100*", "user": "bob", "meta": spawned})
            assert (held["state"], a["state"], b["state"]) == ("active", "queued", "queued")
            assert await app.hub_side.reconcile() == []  # asked for just now
            clock.advance(121)
            assert await app.hub_side.reconcile() == [b["id"]]
            assert (await admin.get_lease(b["id"]))["state"] == "withdrawn"
            assert (await admin.get_lease(a["id"]))["state"] == "queued"
            # the GPU that frees up goes to the spawn that is still waiting, not to the forgotten one
            await admin.release(held["id"])
            assert (await admin.get_lease(a["id"]))["state"] == "active"
        finally:
            await app.stop_async()
            hub.stop()

    asyncio.run(scenario())


def test_ended_leases_are_listed_newest_first_up_to_a_limit(tmp_path):
    async def scenario(app, client):
        alice = client("alice")
        ids = []
        for _ in range(3):
            lease = await alice.request_lease({"gpus": 1, "model": "A100*"})
            await alice.release(lease["id"])
            ids.append(lease["id"])
        assert [x["id"] for x in await alice.list_leases(state="ended", limit=2)] == ids[::-1][:2]
        assert len(await alice.list_leases(state="all")) == 3
        await expect_error(alice.list_leases(state="ended", limit=0), 400, "limit")
        await expect_error(alice._call("GET", "api/leases", query={"state": "ended", "limit": "many"}), 400, "limit")

    run_with_broker(tmp_path, scenario)


def test_since_latest_gives_where_to_follow_the_feed_from_without_history(tmp_path):
    async def scenario(app, client):
        alice, bob = client("alice"), client("bob")
        lease = await alice.request_lease({"gpus": 1})
        await alice.release(lease["id"])
        feed = await bob.events(since="latest", timeout=0)
        newest = (await alice.events(since=0, timeout=0))["last_id"]
        assert feed == {"events": [], "last_id": newest} and newest > 0
        other = await bob.request_lease({"gpus": 1})
        after = await bob.events(since=feed["last_id"], timeout=0)
        assert {e["lease_id"] for e in after["events"]} == {other["id"]}

    run_with_broker(tmp_path, scenario)


def test_a_call_caught_by_the_brokers_stop_gets_503_to_retry_not_500(tmp_path):
    async def scenario(app, client):
        lease = await client("alice").request_lease({"gpus": 1})
        await app.manager.close()  # what SIGTERM does, while connections are still open
        once = BrokerClient(broker_url(app), "alice", retry_for=0)
        err = await expect_error(once.release(lease["id"]), 503)
        assert "stopping" in err.message
        await expect_error(once.request_lease({"gpus": 1}), 503)

    run_with_broker(tmp_path, scenario)
