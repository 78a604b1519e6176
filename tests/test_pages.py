"""The hub's pages in a researcher's words: the lease on the home page, why it ended, what to do;
spawn failures as sentences without the exception's internals."""

from __future__ import annotations

import asyncio
from pathlib import Path

import jinja2
from jupyterhub.utils import format_exception

from jupyter_gpulease.hub import pages
from jupyter_gpulease.hub.spawner import spawn_error

NOW = 1_800_000_000.0
ACTIVE = {
    "id": "L1", "state": "active", "tier": "research", "expires_at": NOW + 72 * 60,
    "request": {"kind": "gpu", "gpus": 2, "model": ["L4"]},
    "placement": {"node": "gpu-02", "slices": [
        {"gpu_uuid": "GPU-1", "node": "gpu-02", "model": "L4", "memory_mib": 23034, "share": 1.0},
        {"gpu_uuid": "GPU-2", "node": "gpu-02", "model": "L4", "memory_mib": 23034, "share": 1.0}]},
}


def status(**kw):
    args = {"lease": None, "last_end": None, "server_active": True, "server_ready": True, "cpu_only": False,
            "broker_url": "http://127.0.0.1:10101/services/gpulease/", "now": NOW}
    args.update(kw)
    return pages.lease_status(**args)


def test_a_running_server_shows_what_it_holds_its_tier_and_time_left():
    s = status(lease=ACTIVE)
    assert s["kind"] == "active"
    assert s["headline"] == "Your server holds 2 × L4 on gpu-02"
    assert s["lines"][0] == "Tier: research"
    assert s["time_left"] == "1 h 12 min" and s["until"]
    assert s["expires_at"] == ACTIVE["expires_at"]
    assert s["leases_url"] == "/services/gpulease/"


def test_a_waiting_spawn_shows_its_place_in_the_queue():
    queued = {"id": "L2", "state": "queued", "request": {"kind": "share", "share": 0.5, "model": ["L4"]},
              "queue": {"position": 2, "length": 5, "eta": NOW + 14 * 60}}
    s = status(lease=queued, server_ready=False)
    assert s["kind"] == "queued"
    assert s["headline"] == "Waiting for a 0.5 share of one L4"
    assert s["lines"][0] == "Position 2 of 5 in the queue"
    assert s["lines"][1].startswith("Expected to start in about 14 min")


def test_after_a_preemption_the_page_says_by_which_tier_and_what_to_do():
    ended = dict(ACTIVE, state="preempted", ended_at=NOW - 60, end_reason="preempted",
                 ended_by={"kind": "preemption", "tier": "production", "user": "carol"})
    s = status(last_end=ended, server_active=False)
    assert s["kind"] == "ended"
    assert s["headline"].startswith("Your GPU lease (2 × L4 on gpu-02) ended at ")
    assert s["lines"][0] == "It was preempted for carol's 'production' request. (preempted)"
    assert s["lines"][1] == "Your server was stopped."
    assert "Start again to queue for a new lease" in s["next_step"]
    # the broker's own sentence wins when it has one
    s = status(last_end=dict(ended, end_message="Preempted for a 'production' request after a 10 min warning."), server_active=False)
    assert s["lines"][0] == "Preempted for a 'production' request after a 10 min warning."


def test_each_kind_of_end_has_its_own_next_step():
    for state, words in [("expired", "reached its time limit"), ("reclaimed", "given back while idle"),
                         ("revoked", "ask your administrator")]:
        s = status(last_end=dict(ACTIVE, state=state, end_reason="maintenance"), server_active=state == "reclaimed")
        assert s["kind"] == "ended" and words in s["next_step"], (state, s)
    assert status(last_end=dict(ACTIVE, state="reclaimed"), server_active=True)["lines"][1] == "Your server keeps running without a GPU."
    # an end the user caused (stopping the server) is nothing to explain
    assert status(last_end=dict(ACTIVE, state="released"), server_active=False)["kind"] == "none"


def test_the_end_the_spawner_remembers_is_enough_without_the_leases_placement():
    remembered = {"lease_id": "L1", "state": "expired", "end_reason": "time limit", "ended_at": NOW - 120, "ended_by": "broker"}
    s = status(last_end=remembered, server_active=False)
    assert s["kind"] == "ended" and s["lease_id"] == "L1"
    assert s["headline"].startswith("Your GPU lease ended at ")
    assert s["lines"] == ["It reached the end of its time.", "Your server was stopped."]


def test_a_cpu_only_server_says_so():
    assert status(cpu_only=True)["headline"] == "Your server runs without a GPU"


def test_spawn_failures_read_as_the_message_without_exception_internals():
    e = spawn_error("No GPU became free within 25 s, so the spawn gave up and left the queue.", reason="gpulease_wait_timeout")
    message, _html = format_exception(e)
    assert message == "No GPU became free within 25 s, so the spawn gave up and left the queue."
    assert "SpawnException" not in message and "400" not in message


def test_the_home_page_template_shows_the_lease_panel():
    """The shipped home.html, rendered as JupyterHub renders it (async Jinja2, JupyterHub's own templates behind it)."""
    import jupyterhub.app

    base = jupyterhub.app.JupyterHub()._template_paths_default()[0]
    env = jinja2.Environment(
        loader=jinja2.ChoiceLoader([jinja2.PrefixLoader({"templates": jinja2.FileSystemLoader([base])}, "/"),
                                    jinja2.FileSystemLoader([pages.TEMPLATE_PATH, base])]),
        autoescape=True, enable_async=True)

    class Spawner:
        active = True
        ready = True
        name = ""

        async def lease_status(self):
            return status(lease=ACTIVE)

    class User:
        name = "alice"
        admin = True
        escaped_name = "alice"

        def all_spawners(self, include_default=True):
            return []

    html = asyncio.run(env.get_template("home.html").render_async(
        default_server=Spawner(), user=User(), url="/user/alice/", base_url="/hub/", prefix="/", static_url=lambda p, **k: p,
        allow_named_servers=False, named_server_limit_per_user=0, services=[], parsed_scopes={}, expanded_scopes=set(),
        login_url="/hub/login", logout_url="/hub/logout", xsrf="x", version_hash="", no_spawner_check=True,
        invalid_server_names=[], spawners={}, url_path_join=lambda *a: "/".join(a), announcement=None,
    ))
    assert 'id="gpulease-lease"' in html and 'data-kind="active"' in html
    assert "Your server holds 2 × L4 on gpu-02" in html
    assert 'Time left: <span class="gpulease-time-left" data-expires-at="1800004320.0">1 h 12 min</span>' in html
    assert 'href="/services/gpulease/">My GPU leases' in html
    assert 'href="/services/gpulease/admin">All GPU leases (admin)' in html
    assert Path(pages.TEMPLATE_PATH, "spawn_pending.html").exists()


def test_an_end_remembered_from_the_feed_alone_still_says_who_ended_it():
    remembered = {"lease_id": "L1", "state": "revoked", "end_reason": "node maintenance", "ended_at": NOW - 60, "ended_by": "admin:carol"}
    s = status(last_end=remembered, server_active=False)
    assert s["lines"][0] == "It was revoked by carol (admin): node maintenance."
    broker = dict(remembered, ended_by="broker", end_reason="its server was gone")
    assert status(last_end=broker, server_active=False)["lines"][0] == "It was revoked by the broker: its server was gone."


def test_a_server_being_stopped_is_not_said_to_be_starting():
    s = status(server_ready=False, server_stopping=True)
    assert s["kind"] == "stopping" and s["headline"] == "Your server is being stopped"


def test_an_end_while_the_server_stops_says_it_is_being_stopped():
    ended = {"lease_id": "L1", "state": "revoked", "end_reason": "maintenance", "ended_at": NOW - 5, "ended_by": "admin:carol"}
    s = status(last_end=ended, server_active=True, server_stopping=True)
    assert s["lines"][1] == "Your server is being stopped."


def test_a_lease_the_server_took_itself_shows_on_the_home_page_not_a_server_without_a_gpu():
    """%gpu request in a server started without a GPU: the spawner holds no lease of its own, the broker knows it."""
    from test_spawner_unit import FakeBroker, make_spawner

    async def main():
        broker = FakeBroker()
        s = make_spawner(broker)
        s.running = s.up = True  # a CPU-only server that runs
        assert (await s.lease_status())["headline"] == "Your server runs without a GPU"
        other = await broker.request_lease({"user": "alice", "server": "other", "gpus": 1, "meta": {"taken_by": "server"}})
        mine = await broker.request_lease({"user": "alice", "server": "", "gpus": 1, "model": "L4", "meta": {"taken_by": "server"}})
        broker.grant(other["id"])
        assert (await s.lease_status())["kind"] == "queued"  # its own request waits
        broker.grant(mine["id"])
        st = await s.lease_status()
        assert st["kind"] == "active" and st["headline"] == "Your server holds 1 × L4 on n1" and st["lease_id"] == mine["id"]

    asyncio.run(main())

