"""The hub link's parts, each built alone with an in-memory broker client: the event feed
(LeaseFeed), the lease ends with their outbox (LeaseEnds) and the broker check (functions);
and the link's feed kept running for an event listener alone."""

from __future__ import annotations

import asyncio
import logging

from jupyter_gpulease.client import BrokerError
from jupyter_gpulease.core.request import SPAWNER_META
from jupyter_gpulease.hub import linkcheck
from jupyter_gpulease.hub.link import BrokerLink
from jupyter_gpulease.hub.linkends import LeaseEnds
from jupyter_gpulease.hub.linkfeed import LeaseFeed
from jupyter_gpulease.hub.outbox import ReleaseOutbox


class FakeClient:
    """An in-memory broker with the :class:`~jupyter_gpulease.client.BrokerClient` methods the
    link's parts call. ``down = True``: every call fails as when the broker cannot be reached
    (status 0); ``fail[method]``: what the next calls of ``method`` raise, one each (None: that
    call answers)."""

    def __init__(self):
        self.leases: dict[str, dict] = {}
        self.events_log: list[dict] = []
        self.calls: list[tuple] = []
        self.fail: dict[str, list[Exception | None]] = {}
        self.down = False
        self.draining = False
        self._changed = asyncio.Event()

    def _call(self, method: str, *args) -> None:
        self.calls.append((method, *args))
        if self.down:
            raise BrokerError(0, "cannot reach the lease broker")
        queued = self.fail.get(method)
        if queued:
            error = queued.pop(0)
            if error is not None:
                raise error

    def emit(self, lease_id: str, kind: str, **kw) -> dict:
        ev = {"id": len(self.events_log) + 1, "lease_id": lease_id, "kind": kind, "time": 0.0, **kw}
        self.events_log.append(ev)
        self._changed.set()
        self._changed = asyncio.Event()
        return ev

    def add(self, lease_id: str, user: str = "alice", server: str = "", state: str = "active", **kw) -> dict:
        lease = {"id": lease_id, "user": user, "server": server, "state": state, "created_at": 1.0,
                 "meta": {"spawner": SPAWNER_META}, **kw}
        self.leases[lease_id] = lease
        return lease

    async def events(self, since=0, lease_id=None, timeout=30):
        self._call("events", since)
        if since == "latest":
            return {"events": [], "last_id": len(self.events_log)}
        new = [e for e in self.events_log[int(since):] if lease_id in (None, e["lease_id"])]
        if not new and timeout:
            changed = self._changed
            try:
                async with asyncio.timeout(timeout):
                    await changed.wait()
            except TimeoutError:
                pass
            if self.down:
                raise BrokerError(0, "cannot reach the lease broker")
            new = [e for e in self.events_log[int(since):] if lease_id in (None, e["lease_id"])]
        return {"events": new, "last_id": new[-1]["id"] if new else int(since)}

    async def list_leases(self, state=None, user=None):
        self._call("list_leases", state, user)
        return [dict(lease) for lease in self.leases.values() if user in (None, lease["user"])
                and (state != "live" or lease["state"] in ("queued", "active"))]

    async def release(self, lease_id, reason="", state="released"):
        self._call("release", lease_id, reason)
        lease = self.leases.get(lease_id)
        if lease is None:
            raise BrokerError(404, "no such lease")
        if lease["state"] not in ("queued", "active"):
            raise BrokerError(409, "already ended")
        lease["state"] = "withdrawn" if lease["state"] == "queued" else state
        return dict(lease)

    async def pool(self, user=None, groups=None):
        self._call("pool", user)
        return {"gpus": [], "draining": self.draining}

    async def drain(self, on=True, reason=""):
        self._call("drain", on)
        self.draining = on
        return {"draining": on}


async def until(predicate, timeout=10.0, what="condition"):
    """Wait (on the running loop) until ``predicate()`` is true; fail after ``timeout`` s."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


# ---------------------------------------------------------------------------------------- the feed
def test_the_feed_starts_at_the_latest_event_and_hands_each_event_in_order_to_its_listeners_then_its_callable():
    async def main():
        client = FakeClient()
        client.emit("old", "requested")  # before the feed: not replayed
        heard, handed = [], []
        resyncs = []

        async def resync():
            resyncs.append(len(handed))

        feed = LeaseFeed(client, on_event=lambda ev: handed.append(("event", ev["id"], len(heard))),
                         resync=resync, feed_timeout=0.05)
        feed.add_listener(lambda ev: heard.append((ev["kind"], ev.get("id"))))
        await until(lambda: feed.connected, what="the feed to connect")
        for lid, kind in (("L1", "requested"), ("L1", "granted"), ("L2", "requested"), ("L1", "ended")):
            client.emit(lid, kind)
        await until(lambda: len(handed) == 4, what="four events")
        feed.close()
        return heard, handed, resyncs, feed

    heard, handed, resyncs, feed = asyncio.run(main())
    assert heard == [("resync", None), ("requested", 2), ("granted", 3), ("requested", 4), ("ended", 5)]
    # in order, each after the listeners heard it
    assert handed == [("event", 2, 2), ("event", 3, 3), ("event", 4, 4), ("event", 5, 5)]
    assert resyncs == [0]
    assert feed.cursor == 5 and not feed.connected


def test_the_feed_reconnects_after_the_broker_went_away_resyncs_and_misses_no_event():
    async def main():
        client = FakeClient()
        handed, resyncs, unreachable, connects = [], [], [], []

        async def resync():
            resyncs.append(len(handed))

        feed = LeaseFeed(client, on_event=lambda ev: handed.append(ev["kind"]), resync=resync,
                         needed=lambda: True, on_connected=lambda: connects.append(True),
                         on_unreachable=unreachable.append, feed_timeout=0.05)
        feed.start()
        await until(lambda: feed.connected, what="the feed to connect")
        client.emit("L1", "requested")
        await until(lambda: handed == ["requested"], what="the first event")
        client.down = True
        await until(lambda: not feed.connected and unreachable, what="the feed to notice the broker is away")
        client.emit("L1", "granted")  # while the feed is away
        client.down = False
        await until(lambda: feed.connected and handed == ["requested", "granted"], what="the feed to come back")
        client.emit("L1", "ended")
        await until(lambda: handed == ["requested", "granted", "ended"], what="an event after the reconnect")
        feed.close()
        return handed, resyncs, unreachable, connects

    handed, resyncs, unreachable, connects = asyncio.run(main())
    assert handed == ["requested", "granted", "ended"]  # the one sent while it was away included
    assert resyncs == [0, 1]  # at the start, and again after the gap, before its events
    assert len(connects) == 2
    assert unreachable[0] == "cannot reach the lease broker"


def test_a_feed_refused_by_the_broker_is_no_unreachable_broker_and_a_broker_without_since_latest_is_paged_through(caplog):
    async def main():
        client = FakeClient()
        for i in range(3):
            client.emit(f"L{i}", "requested")
        client.fail["events"] = [BrokerError(400, "since must be a number"), BrokerError(403, "not allowed")]
        handed, unreachable = [], []
        feed = LeaseFeed(client, on_event=lambda ev: handed.append(ev["id"]), needed=lambda: True,
                         on_unreachable=unreachable.append, feed_timeout=0.05)
        feed.start()
        await until(lambda: feed.connected, what="the feed to connect")
        client.emit("L9", "requested")
        await until(lambda: handed, what="the new event")
        feed.close()
        return handed, unreachable

    with caplog.at_level(logging.ERROR, logger="jupyter_gpulease.hub"):
        handed, unreachable = asyncio.run(main())
    assert handed == [4]  # history paged through, not replayed
    assert unreachable == []
    assert "refused the hub's event feed" in caplog.text


def test_the_feed_runs_while_anyone_needs_it_and_a_new_listener_starts_it_again():
    async def main():
        client = FakeClient()
        need = {"owner": False}
        feed = LeaseFeed(client, needed=lambda: need["owner"], feed_timeout=0.05)
        feed.start()
        assert not feed.running  # nobody needs it
        need["owner"] = True
        feed.start()
        await until(lambda: feed.connected, what="the feed to connect")
        need["owner"] = False
        await until(lambda: not feed.running, what="the feed to stop")
        assert not feed.connected
        heard = []
        remove = feed.add_listener(heard.append)  # a listener alone: the feed runs again
        assert feed.running
        for n in range(5):
            await asyncio.sleep(0.12)  # longer than a long-poll each time
            client.emit(f"L{n}", "granted")
            await until(lambda n=n: len([e for e in heard if e["kind"] == "granted"]) == n + 1, what=f"event {n}")
        remove()
        await until(lambda: not feed.running, what="the feed to stop without its listener")
        return heard

    heard = asyncio.run(main())
    assert [e["kind"] for e in heard] == ["resync"] + ["granted"] * 5


def test_a_link_with_only_an_event_listener_keeps_receiving_events():
    """The device guard subscribes with add_event_listener; with no spawner alive and no lease
    followed it must still hear the 'granted' of a lease a server took itself."""
    async def main():
        client = FakeClient()
        link = BrokerLink("http://broker/", "t", client=client, feed_timeout=0.05)
        heard = []
        link.add_event_listener(heard.append)
        assert not link.watches and not link.spawners
        await until(lambda: link.connected, what="the link's feed to connect")
        for n in range(3):
            await asyncio.sleep(0.12)
            client.emit(f"S{n}", "granted")
            await until(lambda n=n: [e.get("lease_id") for e in heard if e["kind"] == "granted"] == [f"S{i}" for i in range(n + 1)],
                        what=f"the grant of S{n}")
        await link.close()
        return heard, link

    heard, link = asyncio.run(main())
    assert heard[0]["kind"] == "resync"
    assert not link.connected


# ---------------------------------------------------------------------------------------- the ends
def test_a_release_is_retried_until_the_broker_answers_and_kept_in_the_outbox_meanwhile(tmp_path):
    path = tmp_path / "pending.json"

    async def main():
        client = FakeClient()
        client.add("L1")
        answered = []
        ends = LeaseEnds(client, ReleaseOutbox(path), on_lease=answered.append)
        client.down = True
        task = ends.end_lease("L1", "server stopped", who="alice")
        assert ends.end_lease("L1", "server stopped") is task  # one task per lease
        await until(lambda: len([c for c in client.calls if c[0] == "release"]) >= 2, what="a retry")
        assert ends.ending == ["L1"]
        kept = ReleaseOutbox(path).leases  # on disk: the next hub process would send it
        client.down = False
        lease = await asyncio.wait_for(task, 30)
        return client, ends, kept, lease, answered

    client, ends, kept, lease, answered = asyncio.run(main())
    assert kept["L1"]["reason"] == "server stopped" and kept["L1"]["who"] == "alice"
    assert lease["state"] == "released" and client.leases["L1"]["state"] == "released"
    assert answered == [lease]
    assert ends.ending == [] and not ends.outbox and not path.exists()


def test_a_release_the_broker_has_nothing_to_end_for_ends_at_once_without_retry(tmp_path):
    async def main():
        client = FakeClient()
        client.add("L2", state="expired")
        client.add("L3")
        gone = []
        ends = LeaseEnds(client, ReleaseOutbox(tmp_path / "pending.json"), on_gone=gone.append)
        unknown = await ends.end_lease("L1", "server stopped")
        ended = await ends.end_lease("L2", "server stopped")
        client.fail["release"] = [BrokerError(403, "not yours")]  # refused for good
        refused = await ends.end_lease("L3", "server stopped")
        return client, ends, gone, (unknown, ended, refused)

    client, ends, gone, results = asyncio.run(main())
    assert results == (None, None, None)
    assert [c[1] for c in client.calls if c[0] == "release"] == ["L1", "L2", "L3"]  # one try each
    assert gone == ["L1", "L2"]  # 404 and 409: the owner reads them again
    assert client.leases["L3"]["state"] == "active" and not ends.outbox


def test_ending_a_servers_leases_while_the_broker_is_away_leaves_the_order_to_the_outbox(tmp_path):
    path = tmp_path / "pending.json"

    async def main():
        client = FakeClient()
        client.add("L1")  # the spawner's
        client.add("L2", meta={"spawner": SPAWNER_META, "taken_by": "server"})
        client.add("L3", server="other")  # another server of hers
        client.add("L4", user="bob")
        client.add("L5", meta={})  # not the spawner's
        ends = LeaseEnds(client, ReleaseOutbox(path))
        client.down = True
        started = await ends.end_server_leases("alice", "", "its server stopped", keep=("L1",), wait=0.2)
        kept = dict(ReleaseOutbox(path).servers)
        client.down = False
        await until(lambda: not ends.outbox, timeout=30, what="the outbox to empty")
        await until(lambda: not ends.ending, what="the ends to finish")
        ends.close()
        return client, started, kept

    client, started, kept = asyncio.run(main())
    assert started is None
    (entry,) = kept.values()
    assert entry["user"] == "alice" and entry["server"] == "" and entry["keep"] == ["L1"]
    assert {lid: lease["state"] for lid, lease in client.leases.items()} == {
        "L1": "active", "L2": "released", "L3": "active", "L4": "active", "L5": "active"}
    assert not path.exists()


def test_ending_a_servers_leases_with_the_broker_up_and_keeping_the_ends_under_way_at_exit(tmp_path):
    path = tmp_path / "pending.json"

    async def main():
        client = FakeClient()
        client.add("L1", server="gpu")
        client.add("L2", server="gpu")
        ends = LeaseEnds(client, ReleaseOutbox(path))
        assert await ends.end_server_leases("alice", "gpu", "its server stopped") == 2
        assert await ends.flush(5) == []
        client.add("L3")
        client.fail["release"] = [BrokerError(503, "busy")] * 100
        ends.end_lease("L3", "server stopped", who="alice")
        assert await ends.flush(0.2) == ["L3"]
        persisted = ends.persist_pending()
        return client, persisted

    client, persisted = asyncio.run(main())
    assert client.leases["L1"]["state"] == client.leases["L2"]["state"] == "released"
    assert persisted == 1
    assert ReleaseOutbox(path).leases["L3"]["reason"] == "server stopped"


# ---------------------------------------------------------------------------------------- the check
URL = "http://127.0.0.1:10101/services/gpulease/"


def check_once(client):
    return asyncio.run(linkcheck.check_broker_once(client, URL))


def test_the_check_says_in_one_line_what_is_wrong_with_the_url_or_the_token():
    client = FakeClient()
    line, kind = check_once(client)
    assert kind == "" and line == f"GPU lease broker at {URL}: connected; the spawner's token may ask for leases on behalf of users"

    client.fail["pool"] = [BrokerError(401, "Unauthorized")]
    line, kind = check_once(client)
    assert kind == "token" and "token is not valid" in line and "broker_api_token" in line

    client.fail["pool"] = [BrokerError(302, "Found", error="")]
    line, kind = check_once(client)
    assert kind == "token" and "asked to log in" in line

    client.fail["pool"] = [BrokerError(403, "missing scope access:services")]
    line, kind = check_once(client)
    assert kind == "scope" and "may not use the broker (missing scope access:services)" in line

    client.fail["pool"] = [None, BrokerError(403, "not an admin")]  # the user's pool answers, another user's not
    line, kind = check_once(client)
    assert kind == "scope" and "lacks the scope custom:gpulease:admin" in line

    client.fail["pool"] = [BrokerError(404, "Not Found")]
    line, kind = check_once(client)
    assert kind == "url" and "does not lead to the lease broker" in line and "broker_url" in line

    client.fail["pool"] = [ValueError("not JSON")]
    line, kind = check_once(client)
    assert kind == "url" and "not as the lease broker" in line

    client.down = True
    line, kind = check_once(client)
    assert kind == "unreachable" and "not answering" in line


def test_the_check_lets_a_broker_left_draining_grant_again():
    client = FakeClient()
    client.draining = True
    line, kind = check_once(client)
    assert kind == "" and "connected" in line and client.draining is False and ("drain", False) in client.calls


def test_the_check_waits_for_a_broker_that_is_not_up_yet_and_warns_once_after_its_patience(caplog):
    now = [0.0]

    def clock():
        now[0] += 60.0  # each look at the clock: a minute later
        return now[0]

    client = FakeClient()
    client.fail["pool"] = [BrokerError(0, "connection refused"), BrokerError(503, "starting")]
    waiting = []
    with caplog.at_level(logging.INFO, logger="jupyter_gpulease.hub"):
        line, kind = asyncio.run(linkcheck.check_broker(client, URL, patience=90, clock=clock, on_unreachable=waiting.append))
    assert kind == "" and "connected" in line
    assert len(waiting) == 2 and all("not answering yet" in w for w in waiting)
    assert caplog.text.count("the hub keeps trying") == 1
    assert caplog.records[-1].getMessage() == line


def test_the_link_keeps_the_checks_problem_and_tells_users_only_of_a_configuration_problem():
    async def main():
        client = FakeClient()
        client.fail["pool"] = [BrokerError(401, "Unauthorized")]
        link = BrokerLink(URL, "t", client=client)
        line = await link.check()
        return link, line

    link, line = asyncio.run(main())
    assert link.checked and link.problem_kind == "token" and link.problem == line
    assert "configuration problem" in link.user_message()
    assert linkcheck.user_message("unreachable") == linkcheck.user_message("") == ""
