"""The broker client: where it finds the broker, and how it reports failures."""

import asyncio

import pytest

from hubharness import free_port
from jupyter_gpulease.client import BrokerClient, BrokerError, default_broker_url

pytestmark = pytest.mark.timeout(30)


def test_the_broker_url_comes_from_the_environment():
    assert default_broker_url({"GPULEASE_BROKER_URL": "http://x/services/gpulease/"}) == "http://x/services/gpulease/"
    inside = {"JUPYTERHUB_SERVICE_NAME": "gpulease", "JUPYTERHUB_SERVICE_URL": "http://127.0.0.1:10101", "JUPYTERHUB_SERVICE_PREFIX": "/services/gpulease/"}
    assert default_broker_url(inside) == "http://127.0.0.1:10101/services/gpulease/"
    assert default_broker_url({"JUPYTERHUB_PUBLIC_HUB_URL": "https://hub.example.org/hub/"}) == "https://hub.example.org/services/gpulease/"
    assert default_broker_url({"JUPYTERHUB_API_URL": "http://127.0.0.1:8081/jh/hub/api", "JUPYTERHUB_BASE_URL": "/jh/"}) == "http://127.0.0.1:8081/jh/services/gpulease/"
    assert default_broker_url({}) == ""


def test_from_env_prefers_the_gpulease_token(monkeypatch):
    monkeypatch.setenv("GPULEASE_BROKER_URL", "http://127.0.0.1:1/services/gpulease")
    monkeypatch.setenv("JUPYTERHUB_API_TOKEN", "hub-token")
    monkeypatch.setenv("GPULEASE_TOKEN", "lease-token")
    c = BrokerClient.from_env()
    assert c.url == "http://127.0.0.1:1/services/gpulease/" and c.token == "lease-token"


def test_an_unreachable_broker_is_a_broker_error_with_status_0_after_retrying():
    from jupyter_gpulease.client import Backoff

    waits = []

    class Counted(Backoff):
        def delays(self):
            for d in super().delays():
                waits.append(d)
                yield d

    c = BrokerClient(f"http://127.0.0.1:{free_port()}/services/gpulease/", "t", timeout=5, retry_for=1.0)
    c.backoff = Counted(retry_for=1.0)
    with pytest.raises(BrokerError) as info:
        asyncio.run(c.pool())
    assert info.value.status == 0 and "cannot reach the lease broker" in info.value.message
    # waits of at most 0.1, 0.2 and 0.4 s always fit in 1 s: the call was tried at least 4 times
    # (it stops when the next wait would pass the deadline, after 0.35 s at the earliest)
    assert len(waits) >= 4, f"the client gave up after {len(waits)} wait(s)"


def test_a_heartbeat_is_retried_for_at_most_what_its_sender_asks(monkeypatch):
    """A heartbeat sender has its own loop: it asks for a shorter retry than the client's, so a
    broker that is away shows as failed heartbeats, one per interval, not as one hanging call."""
    from jupyter_gpulease import client as client_mod

    asked = []
    real = client_mod.fetch_json

    async def recording(*args, backoff, **kw):
        asked.append(backoff.retry_for)
        return await real(*args, backoff=backoff, **kw)

    monkeypatch.setattr(client_mod, "fetch_json", recording)
    url = f"http://127.0.0.1:{free_port()}/services/gpulease/"
    c = BrokerClient(url, "t", timeout=5, retry_for=30.0)
    short = BrokerClient(url, "t", timeout=5, retry_for=0.2)
    for client, retry_for in ((c, 0.0), (short, 60.0)):
        with pytest.raises(BrokerError) as info:
            asyncio.run(client.heartbeat("abc", {}, retry_for=retry_for))
        assert info.value.status == 0 and "cannot reach the lease broker" in info.value.message
    assert asked == [0.0, 0.2]  # what the sender asked, never longer than the client's own
    assert c.backoff.retry_for == 30.0  # the client's other calls keep theirs


def test_a_client_retries_through_a_broker_restart_and_a_retried_write_makes_one_lease(tmp_path, monkeypatch):
    """The broker is down when the call starts and comes up a moment later (a standby taking
    over): the call succeeds; a request whose first answer was lost is not made twice."""
    from brokerutil import ManualClock, make_broker, patch_auth

    patch_auth(monkeypatch)

    async def main():
        app = make_broker(tmp_path, ManualClock())
        url = app.bind_url.rstrip("/") + app.base_url
        c = BrokerClient(url, "alice", retry_for=30)
        call = asyncio.ensure_future(c.request_lease({"gpus": 1}))
        await asyncio.sleep(1.0)
        assert not call.done()
        await app.start_async()
        try:
            lease = await asyncio.wait_for(call, 30)
            assert lease["state"] == "active"
            assert app.store.count_leases() == 1
        finally:
            await app.stop_async()

    asyncio.run(main())


def test_the_hub_root_given_as_the_broker_url_is_named_as_the_mistake(tmp_path):
    """`--url http://hub/` answers with a redirect to the hub's login: say the URL is wrong, not the token."""
    from tornado.httpserver import HTTPServer
    from tornado.web import Application, RequestHandler

    class Hub(RequestHandler):
        def get(self, *a):
            self.redirect("/hub/login?next=%2Fapi%2Fpool")

    async def main():
        port = free_port()
        server = HTTPServer(Application([(r"/(.*)", Hub)]))
        server.listen(port, "127.0.0.1")
        try:
            with pytest.raises(BrokerError) as info:
                await BrokerClient(f"http://127.0.0.1:{port}/", "t", retry_for=0).pool()
            assert "not the lease broker's API" in info.value.message and "/services/gpulease/" in info.value.message
            assert "token" not in info.value.message
        finally:
            server.stop()

    asyncio.run(main())


def test_a_create_answered_unavailable_is_sent_again_with_its_key_after_what_retry_after_asks():
    """The proxy's (or a stopping broker's) JSON 503 during a hand-over: the same create, with
    the caller's key, once the wait the answer asks for is over."""
    import json
    import time

    from tornado.httpserver import HTTPServer
    from tornado.web import Application, RequestHandler

    seen = []

    class Broker(RequestHandler):
        def post(self):
            seen.append((time.monotonic(), self.request.headers.get("Idempotency-Key")))
            if len(seen) == 1:
                self.set_status(503)
                self.set_header("Retry-After", "1")
                self.finish(json.dumps({"error": "Unavailable", "message": "the broker is stopping; try again in a moment"}))
                return
            self.set_status(201)
            self.finish(json.dumps({"id": "L1", "state": "active"}))

    async def main():
        port = free_port()
        server = HTTPServer(Application([(r"/api/leases", Broker)]))
        server.listen(port, "127.0.0.1")
        try:
            return await BrokerClient(f"http://127.0.0.1:{port}/", "t", retry_for=10).request_lease({"gpus": 1}, key="spawn-1")
        finally:
            server.stop()

    assert asyncio.run(main())["id"] == "L1"
    (t1, k1), (t2, k2) = seen
    assert k1 == k2 == "spawn-1" and t2 - t1 >= 0.95, "sent again with the same key, after the second Retry-After asked for"


def test_no_url_is_a_clear_error():
    with pytest.raises(BrokerError, match="GPULEASE_BROKER_URL"):
        BrokerClient("", "t")
