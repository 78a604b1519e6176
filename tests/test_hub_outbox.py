"""Lease ends that outlive the hub: the outbox file, the link that sends it, and a stop that
never waits on the broker (the fake broker of test_spawner_unit stands in for the real one;
the end-to-end case with a real hub and a broker kept down is in test_spawner_shutdown.py)."""

from __future__ import annotations

import asyncio
import json

from jupyter_gpulease.core.request import SPAWNER_META
from jupyter_gpulease.hub.link import BrokerLink
from jupyter_gpulease.hub.outbox import ReleaseOutbox
from test_spawner_unit import FakeBroker, make_spawner, until


def test_the_outbox_keeps_its_entries_across_processes_and_sets_a_damaged_file_aside(tmp_path):
    path = tmp_path / "pending.json"
    box = ReleaseOutbox(path)
    assert not box and not path.exists()
    box.add_lease("L1", reason="server stopped", who="alice")
    key = box.add_server("alice", "gpu", reason="its server stopped", before=100.0, keep=("L1",))
    again = ReleaseOutbox(path)  # the next hub process
    assert again.leases["L1"]["reason"] == "server stopped"
    assert again.servers[key] == {"user": "alice", "server": "gpu", "before": 100.0, "reason": "its server stopped", "keep": ["L1"]}
    again.done_lease("L1")
    again.done_server(key)
    assert not path.exists()  # nothing pending: no file

    path.write_text("{not json")
    box = ReleaseOutbox(path)
    assert not box and not path.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("pending.json.bad-")]


def test_a_stop_while_the_broker_is_down_stops_the_server_and_the_next_hub_ends_every_lease(tmp_path):
    """The broker is down when alice's server stops: the engine stops it all the same, the
    spawner's lease and the one the server took itself (%gpu request) go to the outbox, and a
    new hub process (a new link on the same file) ends both once the broker answers, and
    nothing of bob's."""
    path = tmp_path / "pending.json"

    async def first_hub(broker):
        s = make_spawner(broker)
        s._link = BrokerLink("http://broker/", "t", client=broker, feed_timeout=1, outbox_path=str(path))
        s.user_options = {"gpus": 1}
        await s.start()
        # taken from inside the server: bound to it by its server name and meta
        own = await broker.request_lease({"user": "alice", "server": "", "share": 0.5, "meta": {"spawner": SPAWNER_META, "taken_by": "server"}})
        bobs = await broker.request_lease({"user": "bob", "server": "", "gpus": 1, "meta": {"spawner": SPAWNER_META}})
        broker.down = True
        await asyncio.wait_for(s.stop(), 30)
        assert not s.running  # the engine stopped the server without the broker
        s._link.persist_pending()
        await s._link.close()
        return own, bobs

    async def second_hub(broker):
        link = BrokerLink("http://broker/", "t", client=broker, feed_timeout=1, outbox_path=str(path))
        assert len(link.outbox) == 2  # the spawner's lease and the order for the server's own
        link.kick_outbox()
        await asyncio.sleep(0.3)
        assert broker.leases["L1"]["state"] == "active"  # still down: nothing lost, nothing sent
        broker.down = False
        await until(lambda: not link.outbox, timeout=15, what="the outbox to empty")
        await link.close()

    async def main():
        broker = FakeBroker(grant_at_once=True)
        own, bobs = await first_hub(broker)
        saved = json.loads(path.read_text())
        assert set(saved["leases"]) == {"L1"} and len(saved["servers"]) == 1
        await second_hub(broker)
        return broker, own, bobs

    broker, own, bobs = asyncio.run(main())
    assert broker.leases["L1"]["state"] == "released"
    assert broker.leases[own["id"]]["state"] == "released"
    assert broker.leases[bobs["id"]]["state"] == "active"
    assert not path.exists()


def test_a_stop_with_the_broker_up_ends_the_leases_the_server_took_itself_before_it_returns(tmp_path):
    async def main():
        broker = FakeBroker(grant_at_once=True)
        s = make_spawner(broker)
        s.user_options = {"gpus": 1}
        await s.start()
        resumed = await broker.request_lease({"user": "alice", "server": "", "gpus": 1,
                                              "meta": {"spawner": SPAWNER_META, "taken_by": "server", "resume_of": "L1"}})
        other = await broker.request_lease({"user": "alice", "server": "other", "gpus": 1, "meta": {"spawner": SPAWNER_META}})
        await s.stop()
        return broker, resumed, other

    broker, resumed, other = asyncio.run(main())
    assert broker.leases["L1"]["state"] == "released"
    assert broker.leases[resumed["id"]]["state"] == "released"
    assert broker.leases[other["id"]]["state"] == "active"  # another server of hers


def test_a_poll_never_waits_out_the_brokers_retries_and_asks_nothing_while_the_hub_shuts_down():
    async def main():
        broker = FakeBroker(grant_at_once=True)
        s = make_spawner(broker, broker_timeout=30)
        s.user_options = {"gpus": 1}
        await s.start()
        s._unfollow()
        calls = len(broker.calls)

        async def hang(lid):
            await asyncio.sleep(3600)
        broker.get_lease = hang
        s.link.feed.connected = False  # the feed is away: poll() reads the lease itself
        assert await asyncio.wait_for(s.poll(), 20) is None  # bounded: about 5 s, not the client's 30 s
        s.link.shutting_down = True
        assert await asyncio.wait_for(s.poll(), 1) is None
        return broker.calls[calls:]
    asyncio.run(main())
