"""Reads that do not hold others up: lists a page at a time (the cursor, the reads' page built
alone with a fake store, the API's pages written in slices, the client and the command line
following the pages), one value per query argument, and the per-user cap on waiting requests
through the API.

No timing: what is asserted is the structure (pages, cursors, limits, slices)."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlencode

import pytest
from tornado import web
from tornado.httpclient import AsyncHTTPClient

from brokerutil import ManualClock, broker_url, make_broker, patch_auth
from jupyter_gpulease.broker import handlers
from jupyter_gpulease.broker.feed import Feed
from jupyter_gpulease.broker.listing import LIST_LIMIT, MAX_LIST_LIMIT, Cursor, key_of
from jupyter_gpulease.broker.reads import LeaseReads
from jupyter_gpulease.client import BrokerClient
from jupyter_gpulease.core.model import BadRequest
from jupyter_gpulease.core.policy import Policy
from jupyter_gpulease.core.scheduler import Scheduler
from jupyter_gpulease.devices.declared import parse_inventory
from jupyter_gpulease.store import Batch

pytestmark = pytest.mark.timeout(120)
T0 = 1_700_000_000.0


# ---------------------------------------------------------------------- the cursor
def test_a_cursor_goes_back_and_forth_and_belongs_to_its_list():
    c = Cursor("live", (T0, 7, "abc"))
    text = c.encode("all", "alice")
    assert text.isascii() and "=" not in text and Cursor.decode(text, "all", "alice") == c
    assert Cursor.decode(Cursor("ended").encode("ended", None), "ended", None) == Cursor("ended")
    for state, user in (("live", "alice"), ("all", None), ("all", "bob")):
        with pytest.raises(BadRequest, match="belongs to another list") as e:
            Cursor.decode(text, state, user)
        assert e.value.field == "cursor"
    for junk in ("", "x" * 2000, "not base64!", "e30", "bm9wZQ", "é"):  # e30: {}; bm9wZQ: nope
        with pytest.raises(BadRequest, match="not a cursor of this list") as e:
            Cursor.decode(junk, "all", "alice")
        assert e.value.field == "cursor"


# ---------------------------------------------------------------------- the reads' page, alone
class FakeStore:
    """Ended leases as the store lists them: newest first, after a (created_at, seq, id) key."""

    def __init__(self, ended: list[dict]):
        self.ended = ended
        self.asked: list[tuple] = []

    def list_lease_dicts(self, user, states, *, limit=None, before=None):
        self.asked.append((user, tuple(states), limit, before))
        rows = sorted((d for d in self.ended if (user is None or d["user"] == user) and d["state"] in states), key=key_of, reverse=True)
        rows = [d for d in rows if before is None or key_of(d) < tuple(before)]
        return rows[:limit] if limit else rows


def lease(i: int, state: str = "active", user: str = "alice", at: float = T0) -> dict:
    return {"id": f"L{i:03d}", "user": user, "state": state, "created_at": at, "seq": i, "tier": "experiment"}


def reads_over(live: list[dict], ended: list[dict]) -> tuple[LeaseReads, FakeStore]:
    sched = Scheduler(parse_inventory([{"node": "n1", "model": "L4", "count": 1, "memory_mib": 23034}]), Policy())
    store = FakeStore(ended)

    async def flush():
        pass

    reads = LeaseReads(sched, store, readers=ThreadPoolExecutor(1), feed=Feed(), flush=flush, now=lambda: T0)
    reads.restore(live, {})
    return reads, store


async def every_page(reads: LeaseReads, state: str, limit: int, user: str | None = None) -> list[list[str]]:
    pages, after = [], None
    while True:
        got, after = await reads.page(user=user, state=state, limit=limit, after=after)
        pages.append([d["id"] for d in got])
        if after is None:
            return pages


def test_live_leases_come_a_page_at_a_time_oldest_first_and_the_last_page_says_so():
    live = [lease(i, "queued" if i % 3 == 0 else "active", at=T0 + (i // 2)) for i in range(1, 8)]  # ties in time: arrival decides
    reads, store = reads_over(list(reversed(live)), [])
    assert asyncio.run(every_page(reads, "live", 3)) == [["L001", "L002", "L003"], ["L004", "L005", "L006"], ["L007"]]
    assert asyncio.run(every_page(reads, "queued", 1)) == [["L003"], ["L006"]]
    assert asyncio.run(every_page(reads, "live", 7)) == [[f"L{i:03d}" for i in range(1, 8)]]  # a full last page: no empty one after it
    assert asyncio.run(every_page(reads, "live", 3, user="bob")) == [[]]
    assert store.asked == []  # live lists are read from memory


def test_all_lists_the_live_leases_then_the_ended_ones_newest_first_across_pages():
    live = [lease(i) for i in (1, 2, 3)]
    ended = [lease(i, "released", at=T0 - 100 + i) for i in (4, 5, 6, 7)]
    reads, store = reads_over(live, ended)
    assert asyncio.run(every_page(reads, "all", 2)) == [["L001", "L002"], ["L003", "L007"], ["L006", "L005"], ["L004"]]
    assert asyncio.run(every_page(reads, "all", 3)) == [["L001", "L002", "L003"], ["L007", "L006", "L005"], ["L004"]]
    assert asyncio.run(every_page(reads, "ended", 10)) == [["L007", "L006", "L005", "L004"]]
    assert asyncio.run(every_page(reads, "released", 4)) == [["L007", "L006", "L005", "L004"]]
    assert all(limit is not None and limit <= 11 for _, _, limit, _ in store.asked)  # a page never reads more than it answers (and one)


def test_a_lease_that_ended_after_its_live_copy_was_taken_shows_once_on_a_page_as_ended():
    reads, store = reads_over([lease(1), lease(2)], [])
    store.ended.append(dict(lease(2), state="released"))  # ended, its commit not applied to the reads yet
    got, after = asyncio.run(reads.page(state="all", limit=10))
    assert [(d["id"], d["state"]) for d in got] == [("L001", "active"), ("L002", "released")] and after is None


def test_a_lease_that_starts_or_ends_between_two_pages_moves_nothing_under_the_client():
    reads, _ = reads_over([lease(i) for i in range(1, 6)], [])
    first, after = asyncio.run(reads.page(state="live", limit=2))
    reads.apply(Batch(leases={"L001": dict(lease(1), state="released"), "L009": lease(9, at=T0 + 60)}))
    second, after = asyncio.run(reads.page(state="live", limit=2, after=after))
    rest, after = asyncio.run(reads.page(state="live", limit=10, after=after))
    assert [d["id"] for d in first + second + rest] == ["L001", "L002", "L003", "L004", "L005", "L009"] and after is None


# ---------------------------------------------------------------------- through the API
@pytest.fixture(autouse=True)
def _auth(monkeypatch):
    patch_auth(monkeypatch)


def with_broker(tmp_path, scenario, **traits):
    async def main():
        app = make_broker(tmp_path, ManualClock(T0), pool=[{"node": "n1", "model": "L4", "count": 2, "memory_mib": 23034}], **traits)
        await app.start_async()
        try:
            return await scenario(app)
        finally:
            await app.stop_async()

    return asyncio.run(main())


async def call(app, path: str, user: str = "alice", **kw):
    r = await AsyncHTTPClient().fetch(broker_url(app) + path, headers={"Authorization": f"token {user}"}, raise_error=False, **kw)
    return r.code, json.loads(r.body)


async def make_leases(app, n: int, user: str = "alice") -> list[str]:
    client = BrokerClient(broker_url(app), user)
    return [(await client.request_lease({"gpus": 1, "duration_s": 3600}))["id"] for _ in range(n)]


def test_a_list_without_the_new_arguments_is_the_first_page_and_the_cursor_leads_to_the_rest(tmp_path):
    async def scenario(app):
        ids = await make_leases(app, 5)  # two active, three queued: oldest first
        status, page = await call(app, "api/leases")
        assert status == 200 and [x["id"] for x in page["leases"]] == ids and page["limit"] == LIST_LIMIT and page["next_cursor"] is None
        seen, cursor, pages = [], None, 0
        while True:
            q = {"limit": 2, **({"cursor": cursor} if cursor else {})}
            status, page = await call(app, "api/leases?" + urlencode(q))
            assert status == 200 and page["limit"] == 2 and len(page["leases"]) <= 2
            seen += [x["id"] for x in page["leases"]]
            pages += 1
            cursor = page["next_cursor"]
            if cursor is None:
                break
        assert seen == ids and pages == 3
        status, page = await call(app, "api/leases?limit=100000")  # what older clients asked for: the largest page
        assert status == 200 and page["limit"] == MAX_LIST_LIMIT
        status, page = await call(app, "api/leases?limit=2")
        status, err = await call(app, "api/leases?" + urlencode({"state": "all", "cursor": page["next_cursor"]}))
        assert status == 400 and err["field"] == "cursor" and "another list" in err["message"]
        status, err = await call(app, "api/leases?cursor=nonsense")
        assert status == 400 and err["field"] == "cursor"
        status, err = await call(app, "api/leases?limit=0")
        assert status == 400 and err["field"] == "limit"

    with_broker(tmp_path, scenario)


def test_a_large_page_is_written_in_slices_whole_and_valid(tmp_path, monkeypatch):
    monkeypatch.setattr(handlers, "PAGE_SLICE", 2)
    flushed: list[int] = []

    def flush(self, *args, **kw):  # each slice goes out (and the loop turns) before the next is made
        flushed.append(1)
        return web.RequestHandler.flush(self, *args, **kw)

    monkeypatch.setattr(handlers.LeasesHandler, "flush", flush)

    async def scenario(app):
        ids = await make_leases(app, 7)
        flushed.clear()
        r = await AsyncHTTPClient().fetch(broker_url(app) + "api/leases?limit=6", headers={"Authorization": "token alice"})
        assert r.code == 200 and r.headers.get("Transfer-Encoding") == "chunked" and len(flushed) == 3 + 1  # three slices, then the end
        page = json.loads(r.body)
        assert [x["id"] for x in page["leases"]] == ids[:6] and page["limit"] == 6 and page["next_cursor"]
        assert all(x["state"] in ("active", "queued") and ("queue" in x) == (x["state"] == "queued") for x in page["leases"])
        flushed.clear()
        r = await AsyncHTTPClient().fetch(broker_url(app) + "api/leases?limit=2", headers={"Authorization": "token alice"})
        assert json.loads(r.body)["leases"] and "Transfer-Encoding" not in r.headers and len(flushed) == 1  # one slice: at once, whole

    with_broker(tmp_path, scenario)


def test_the_client_follows_every_page_and_stops_at_its_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(handlers, "LIST_LIMIT", 2)  # the broker's default page: two leases

    async def scenario(app):
        ids = await make_leases(app, 5)
        alice = BrokerClient(broker_url(app), "alice")
        for lid in ids[:2]:
            await alice.release(lid)  # ended, newest first after the live ones
        assert [x["id"] for x in await alice.list_leases()] == ids[2:]
        assert [x["id"] for x in await alice.list_leases(state="all")] == ids[2:] + ids[1::-1]
        assert [x["id"] for x in await alice.list_leases(state="all", limit=4)] == ids[2:] + ids[1:2]
        assert [x["id"] for x in await BrokerClient(broker_url(app), "admin-dan").list_leases()] == ids[2:]

    with_broker(tmp_path, scenario)


# ---------------------------------------------------------------------- one value per query argument
@pytest.mark.parametrize("path,name", [
    ("api/leases?user=alice&user=bob", "user"),
    ("api/leases?state=live&state=all", "state"),
    ("api/events?since=1&since=2&timeout=0", "since"),
    ("api/queue?x=1&x=2", "x"),
    ("api/usage?since=30d&since=7d", "since"),
    ("api/health?a=&a=", "a"),
    ("api/nowhere?user=a&user=b", "user"),
])
def test_a_query_argument_given_twice_is_a_400_naming_it_on_every_api_path(tmp_path, path, name):
    async def scenario(app):
        status, err = await call(app, path, user="admin-dan")
        assert status == 400 and err["field"] == name and "given 2 times" in err["message"]
        status, pool = await call(app, "api/pool?user=alice&group=physics&group=chemistry", user="admin-dan")  # a list argument may repeat
        assert status == 200 and pool["user"] == "alice"

    with_broker(tmp_path, scenario)


# ---------------------------------------------------------------------- the cap on waiting requests
def test_one_request_over_the_users_waiting_cap_is_answered_429_naming_the_setting(tmp_path):
    async def scenario(app):
        alice = BrokerClient(broker_url(app), "alice")
        await make_leases(app, 2 + 3)  # two granted, three waiting
        r = await AsyncHTTPClient().fetch(broker_url(app) + "api/leases", method="POST", body=json.dumps({"gpus": 1}),
                                          headers={"Authorization": "token alice"}, raise_error=False)
        err = json.loads(r.body)
        assert r.code == 429 and err["error"] == "TooManyQueued"
        assert "alice has 3 requests waiting" in err["message"] and "max_queued_per_user (3)" in err["message"]
        assert len(await alice.list_leases(state="queued")) == 3  # nothing was queued
        assert (await make_leases(app, 1, user="bob")) != []  # another user's request still waits its turn
        estimate = await alice._call("POST", "api/leases?dry_run=true", {"gpus": 1})
        assert estimate["start"] == "never" and "max_queued_per_user" in estimate["refused"]["message"]

    with_broker(tmp_path, scenario, max_queued_per_user=3)
