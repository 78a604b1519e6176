"""End to end: the broker as a managed service of a REAL JupyterHub behind configurable-http-proxy.

No auth is faked here: every call carries a token the hub issued, through the proxy, and
the broker checks it with the hub (HubAuth). The pool is simulated.
"""

import asyncio
import json
import os
import re
import signal
import threading
import time
import urllib.error
import urllib.parse

import pytest

from brokerhub import hub_for_broker, wait_for_broker
from hubharness import pid_alive, wait_for
from jupyter_gpulease.client import BrokerClient, BrokerError

pytestmark = pytest.mark.timeout(180)

# typos an admin makes: a group that does not exist on the hub, in a tier and in the quotas
TYPOS = """
c.GPULeaseBroker.tiers = {
    "experiment": {"priority": 20},
    "staff": {"priority": 30, "groups": ["stafff"]},
    "learning": {"priority": 10, "preemptible": True, "preempted_by": ["staf"]},
}
c.GPULeaseBroker.group_quotas = {"physics": {"max_gpus": 4}, "studnets": {"max_gpus": 2}}
c.GPULeaseBroker.reconcile_interval = 2
"""


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    h = hub_for_broker(tmp_path_factory.mktemp("hub"), extra_config=TYPOS)
    h.start()
    try:
        h.tokens = {name: h.create_token(name) for name in ("alice", "bob", "carol", "root")}
        wait_for_broker(h, h.tokens["alice"])
        yield h
    finally:
        h.stop()


def test_names_in_the_config_that_match_nothing_are_warned_about_at_start_and_when_the_hub_changes(hub):
    def log():
        return hub.log_file.read_text(errors="replace")

    wait_for(lambda: "the hub has no group 'stafff'" in log(), 30, "no warning about the group 'stafff'")
    text = log()
    assert "tiers['staff'].groups" in text and "the hub has no group 'studnets'" in text and "group_quotas" in text
    assert "the hub has no group 'physics'" not in text
    assert "preempted_by names 'staf', which is not a tier" in text
    # the admin creates the group on the hub: the broker notices at its next check
    status, _ = hub.api("POST", "groups/stafff")
    assert status == 201
    wait_for(lambda: "the hub has the group 'stafff' now" in log(), 30, "the new group was not noticed")
    assert log().count("the hub has no group 'studnets'") == 1, "a warning was repeated although nothing changed"


def client(hub, who) -> BrokerClient:
    return BrokerClient(hub.service_url("gpulease"), hub.tokens.get(who, who))


def run(coro):
    return asyncio.run(coro)


async def expect(coro, status, field=None):
    with pytest.raises(BrokerError) as info:
        await coro
    assert info.value.status == status, f"expected {status}, got {info.value.status}: {info.value.message}"
    if field is not None:
        assert info.value.field == field, f"expected the message to name {field!r}: {info.value.field!r} {info.value.message}"
    return info.value


def test_user_tokens_see_only_their_own_leases(hub):
    async def scenario():
        alice, bob = client(hub, "alice"), client(hub, "bob")
        a = await alice.request_lease({"gpus": 1, "model": "L4", "duration_s": 3600})
        b = await bob.request_lease({"share": 0.5, "model": "L4"})
        assert a["user"] == "alice" and a["state"] == "active"
        assert a["groups"] == ["physics"], "groups come from the hub's user model"
        assert {x["id"] for x in await alice.list_leases()} == {a["id"]}
        assert {x["id"] for x in await bob.list_leases()} == {b["id"]}
        await expect(bob.get_lease(a["id"]), 403)
        await expect(bob.extend(a["id"], by_s=60), 403)
        await expect(bob.release(a["id"]), 403)
        await expect(bob.list_leases(user="alice"), 403, "user")
        await expect(alice.request_lease({"gpus": 1, "user": "bob"}), 403, "user")
        for lease, who in ((a, alice), (b, bob)):
            assert (await who.release(lease["id"]))["state"] == "released"

    run(scenario())


def test_admin_scope_and_hub_admins_see_all_and_act_for_users(hub):
    async def scenario():
        alice, carol, root = client(hub, "alice"), client(hub, "carol"), client(hub, "root")
        mine = await alice.request_lease({"gpus": 1, "model": "L4"})
        for_bob = await carol.request_lease({"gpus": 1, "model": "L4", "user": "bob", "server": "gpu", "meta": {"spawner": "test"}})
        assert for_bob["user"] == "bob" and for_bob["server"] == "gpu"
        for admin in (carol, root):
            ids = {x["id"] for x in await admin.list_leases()}
            assert {mine["id"], for_bob["id"]} <= ids
            assert (await admin.get_lease(mine["id"]))["user"] == "alice"
        assert {x["id"] for x in await client(hub, "bob").list_leases()} == {for_bob["id"]}
        revoked = await carol.release(mine["id"], reason="maintenance")
        assert revoked["state"] == "revoked"
        await root.release(for_bob["id"])

    run(scenario())


def test_errors_have_the_right_status_and_name_the_field(hub):
    async def scenario():
        alice = client(hub, "alice")
        await expect(BrokerClient(hub.service_url("gpulease"), "").pool(), 401)
        await expect(BrokerClient(hub.service_url("gpulease"), "not-a-real-token").list_leases(), 401)
        await expect(alice.get_lease("0123456789abcdef"), 404)
        before = await client(hub, "carol").list_leases(state="all")
        for body, field in [
            ({"gpus": 1, "model": "V100"}, "model"),
            ({"gpus": 0}, "gpus"),
            ({"gpus": 1000}, "gpus"),
            ({"gpus": 1, "tier": "gold"}, "tier"),
            ({"gpus": 1, "duration_s": 365 * 86400}, "duration_s"),
        ]:
            err = await expect(alice.request_lease(body), 400, field)
            assert field.split("_")[0] in err.message.lower() or field in err.message
        status, reply = hub.request("POST", hub.service_url("gpulease") + "api/leases", b"{oops", token=hub.tokens["alice"])
        assert status == 400 and reply["field"] == "body" and "JSON" in reply["message"]
        after = await client(hub, "carol").list_leases(state="all")
        assert [x["id"] for x in after] == [x["id"] for x in before], "a bad request left a lease behind"
        # 409: extend a released lease
        lease = await alice.request_lease({"gpus": 1, "model": "L4"})
        await alice.release(lease["id"])
        err = await expect(alice.extend(lease["id"], by_s=600), 409)
        assert "released" in err.message
        assert (await alice.get_lease(lease["id"]))["state"] == "released"

    run(scenario())


def test_the_long_poll_feed_returns_the_grant_of_a_queued_lease(hub):
    async def scenario():
        alice, bob = client(hub, "alice"), client(hub, "bob")
        big = await alice.request_lease({"gpus": 2, "model": "A100*"})
        assert big["state"] == "active"
        waiting = await bob.request_lease({"gpus": 1, "model": "A100*"})
        assert waiting["state"] == "queued" and waiting["queue"]["position"] == 1
        since = (await bob.events(0, lease_id=waiting["id"], timeout=0))["last_id"]
        poll = asyncio.ensure_future(bob.events(since, lease_id=waiting["id"], timeout=30))
        await asyncio.sleep(0.3)
        await alice.release(big["id"])
        feed = await asyncio.wait_for(poll, 40)
        assert [e["kind"] for e in feed["events"]] == ["granted"]
        # bob's feed never shows alice's events
        mine = (await bob.events(0, timeout=0))["events"]
        assert all(e["lease_id"] != big["id"] for e in mine)
        await bob.release(waiting["id"])

    run(scenario())


def test_the_admin_page_sends_browsers_to_the_hub_login(hub):
    status, _ = hub.request("GET", hub.service_url("gpulease"))
    # urllib follows redirects to the hub's login page: it ends at a 200 HTML page of the hub
    assert status == 200
    import urllib.request

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *a, **kw):
            return None

    opener = urllib.request.build_opener(NoRedirect)
    with pytest.raises(urllib.error.HTTPError) as info:
        opener.open(hub.service_url("gpulease"), timeout=10)
    assert info.value.code == 302
    assert "/hub/api/oauth2/authorize" in info.value.headers["Location"]


def test_the_admin_page_shows_lease_admins_the_holders_and_refuses_others(hub):
    async def hold():
        return await client(hub, "alice").request_lease({"gpus": 1, "model": "L4"})

    lease = run(hold())
    try:
        browser = hub.login("carol")
        page = browser.open(hub.service_url("gpulease") + "admin", timeout=60).read().decode()
        assert "Who holds what" in page and "alice" in page and lease["id"] in page
        # the service root (the hub's Services menu) is carol's own leases, with a link to the admin page
        mine = browser.open(hub.service_url("gpulease"), timeout=60).read().decode()
        assert "GPU leases of carol" in mine and 'href="/services/gpulease/admin"' in mine
        other = hub.login("bob")
        with pytest.raises(urllib.error.HTTPError) as info:
            other.open(hub.service_url("gpulease") + "admin", timeout=60)
        assert info.value.code == 403
        refusal = info.value.read().decode()
        assert "custom:gpulease:admin" in refusal and 'href="/services/gpulease/"' in refusal, refusal
        # the form token of bob's own page (he holds a lease, so it has forms) does not let him
        # revoke through the admin form
        bobs = run(client(hub, "bob").request_lease({"gpus": 1, "model": "L4"}))
        try:
            bob_xsrf = _form_xsrf(other.open(hub.service_url("gpulease"), timeout=60).read().decode())
            with pytest.raises(urllib.error.HTTPError) as info:
                other.open(f"{hub.service_url('gpulease')}admin/leases/{lease['id']}/revoke",
                           data=urllib.parse.urlencode({"_xsrf": bob_xsrf, "reason": "mine now"}).encode(), timeout=60)
            assert info.value.code == 403
        finally:
            run(client(hub, "bob").release(bobs["id"]))
        assert run(client(hub, "alice").get_lease(lease["id"]))["state"] == "active"
        # carol revokes: a reason is required, and it is what alice then reads
        revoke = f"{hub.service_url('gpulease')}admin/leases/{lease['id']}/revoke"
        xsrf = _form_xsrf(page)
        with pytest.raises(urllib.error.HTTPError) as info:
            browser.open(revoke, data=urllib.parse.urlencode({"_xsrf": xsrf, "reason": " "}).encode(), timeout=60)
        assert info.value.code == 400 and "say why the lease is revoked" in info.value.read().decode()
        done = browser.open(revoke, data=urllib.parse.urlencode({"_xsrf": xsrf, "reason": "node maintenance"}).encode(), timeout=60).read().decode()
        assert "revoked; its holder is told" in done and lease["id"] not in done.split('id="queue"')[0].split('id="active"')[1]
        ended = run(client(hub, "alice").get_lease(lease["id"]))
        assert ended["state"] == "revoked" and ended["ended_by"] == {"kind": "admin", "user": "carol"}
        assert ended["end_message"].startswith("Revoked by carol (admin)") and "node maintenance" in ended["end_message"]
    finally:
        if run(client(hub, "alice").get_lease(lease["id"]))["state"] == "active":
            run(client(hub, "alice").release(lease["id"]))


def _form_xsrf(page: str) -> str:
    import re

    m = re.search(r'name="_xsrf" value="([^"]+)"', page)
    assert m, "the page has no xsrf token in its forms"
    return m.group(1)


def test_my_leases_page_shows_a_users_leases_and_their_buttons_work(hub):
    """Every user's page at the service root: leases now and history, extend and release buttons."""
    import urllib.parse

    async def hold():
        return await client(hub, "alice").request_lease({"gpus": 1, "model": "L4", "duration_s": 3600})

    lease = run(hold())
    browser = hub.login("alice")
    url = hub.service_url("gpulease")
    page = browser.open(url, timeout=60).read().decode()
    assert "GPU leases of alice" in page and lease["id"][:12] in page and "L4 #" in page
    assert "admin" not in page.split("</nav>")[0], "a non-admin must not be linked to the admin page"
    xsrf = _form_xsrf(page)
    # extend by 2 h through the page's form
    done = browser.open(f"{url}leases/{lease['id']}/extend", data=urllib.parse.urlencode({"_xsrf": xsrf, "by": "7200"}).encode(), timeout=60)
    assert "now runs until" in done.read().decode()
    after = run(client(hub, "alice").get_lease(lease["id"]))
    assert after["expires_at"] > lease["expires_at"] + 3000
    # release, keeping the server: the lease says so for the spawner
    done = browser.open(f"{url}leases/{lease['id']}/release", data=urllib.parse.urlencode({"_xsrf": xsrf, "keep_server": "1"}).encode(), timeout=60)
    text = done.read().decode()
    assert "keeps running without GPUs" in text
    ended = run(client(hub, "alice").get_lease(lease["id"]))
    assert ended["state"] == "released" and ended["keep_server"] is True
    assert ended["ended_by"]["kind"] == "holder" and ended["end_message"].startswith("Released")
    # the history lists it with how it ended
    assert ended["end_message"].split(":")[0] in text and 'id="history"' in text
    # a form post without the xsrf token does nothing
    other = run(client(hub, "alice").request_lease({"gpus": 1, "model": "L4"}))
    try:
        with pytest.raises(urllib.error.HTTPError) as info:
            browser.open(f"{url}leases/{other['id']}/release", data=b"keep_server=1", timeout=60)
        assert info.value.code in (302, 403)
        assert run(client(hub, "alice").get_lease(other["id"]))["state"] == "active"
        # nor may bob's page act on alice's lease
        bob = hub.login("bob")
        bob_page = bob.open(url, timeout=60).read().decode()
        with pytest.raises(urllib.error.HTTPError) as info:
            bob.open(f"{url}leases/{other['id']}/release", data=urllib.parse.urlencode({"_xsrf": _form_xsrf(bob_page) if "_xsrf" in bob_page else ""}).encode(), timeout=60)
        assert info.value.code == 403
        assert run(client(hub, "alice").get_lease(other["id"]))["state"] == "active"
    finally:
        run(client(hub, "alice").release(other["id"]))


def test_a_10_mb_body_gets_the_brokers_json_413_through_the_proxy_and_directly_and_stalls_nothing(hub):
    """configurable-http-proxy forwards a 10 MB body; the broker answers 413 in its error format
    (not a dropped connection, which the proxy turns into its 503 page), and sent directly the
    same; the calls of other clients meanwhile are answered."""
    token = hub.tokens["alice"]
    direct = next(s["url"] for s in hub.services if s["name"] == "gpulease").rstrip("/") + "/services/gpulease/"
    big = json.dumps({"gpus": 1, "meta": {"blob": "x" * (10 * 1024 * 1024)}}).encode()
    expected = {"error": "TooLarge", "field": "body", "message": f"the request body is {len(big)} bytes; the broker takes at most {64 * 1024}"}
    answers: list[int] = []
    stop = threading.Event()

    def others():
        while not stop.is_set():
            answers.append(hub.request("GET", hub.service_url("gpulease") + "api/pool", token=token, timeout=30)[0])

    t = threading.Thread(target=others, daemon=True)
    t.start()
    try:
        for base in [hub.service_url("gpulease")] * 3 + [direct]:
            status, body = hub.request("POST", base + "api/leases", big, token=token, timeout=60)
            assert (status, body) == (413, expected), (base, status, str(body)[:300])
    finally:
        stop.set()
        t.join(60)
    assert answers and set(answers) == {200}, answers
    assert not [x for x in run(client(hub, "alice").list_leases()) if x.get("meta", {}).get("blob")]


def test_a_broker_killed_mid_run_restarts_with_every_lease_and_no_double_grant(hub):
    """SIGKILL the broker while requests are in flight, restart the hub (which restarts its service)."""
    seen: dict[str, dict] = {}
    releasing: set[str] = set()  # a release was sent; its answer may have been lost to the kill
    stop = threading.Event()
    errors: list[str] = []

    def flood():
        async def go():
            alice, bob = client(hub, "alice"), client(hub, "bob")
            i = 0
            while not stop.is_set():
                who = (alice, bob)[i % 2]
                body = [{"gpus": 1, "model": "L4"}, {"share": 0.25, "model": "L4"}, {"gpus": 1, "model": "A100*"}][i % 3]
                try:
                    lease = await who.request_lease(body)
                    seen[lease["id"]] = lease
                    if i % 4 == 3:
                        releasing.add(lease["id"])
                        seen[lease["id"]] = await who.release(lease["id"])
                except BrokerError as e:
                    if e.status not in (0, 502, 503, 599):
                        errors.append(f"{e.status} {e.message}")
                    if e.status in (0, 502, 503):
                        await asyncio.sleep(0.05)
                i += 1

        asyncio.run(go())

    pid = wait_for(lambda: hub.find_process("jupyter_gpulease.broker"), 20, "no broker process below the hub")
    t = threading.Thread(target=flood, daemon=True)
    t.start()
    wait_for(lambda: len(seen) >= 6, 60, "the flood of requests never got going")
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not pid_alive(pid), 10, f"broker PID {pid} survived SIGKILL")
    time.sleep(0.3)
    stop.set()
    t.join(60)
    assert not errors, f"unexpected errors while flooding: {errors[:5]}"
    acknowledged = dict(seen)
    assert acknowledged, "no request was answered before the kill"

    hub.restart()
    wait_for_broker(hub, hub.tokens["carol"])
    # a broker whose supervisor was killed serves on until the restarted service's broker waits
    # for the lock, then hands over: the checks below are for the broker that restored from disk
    wait_for(lambda: hub.log_file.read_text(errors="replace").count("Restored") >= 2, 60, "the restarted broker did not restore")
    wait_for_broker(hub, hub.tokens["carol"])
    new_pid = hub.find_process("jupyter_gpulease.broker")
    assert new_pid and new_pid != pid

    async def check():
        carol = client(hub, "carol")
        for lid, lease in acknowledged.items():
            now = await carol.get_lease(lid)
            assert now["user"] == lease["user"]
            if lease["state"] in ("active", "queued") and now["state"] != lease["state"]:
                # it may have moved on since: a queued one granted when another was released, or a
                # release that was committed while its answer was lost to the kill
                moved_on = lease["state"] == "queued" and now["state"] in ("active", "withdrawn")
                released = lid in releasing and now["state"] in ("released", "withdrawn")
                assert moved_on or released, (lid, lease["state"], now["state"])
            else:
                assert now["state"] == lease["state"], (lid, lease["state"], now["state"])
            if lease["state"] == "active" or (lease["state"] == "released" and lease["placement"]):
                assert now["placement"] == lease["placement"], f"lease {lid} moved"
        active = await carol.list_leases(state="active")
        # nothing granted twice: no GPU is over-committed
        held: dict[str, float] = {}
        for lease in active:
            for s in lease["placement"]["slices"]:
                held[s["gpu_uuid"]] = held.get(s["gpu_uuid"], 0) + s["share"]
        assert all(v <= 1.0 + 1e-9 for v in held.values()), held
        # and the audit log has at most one grant per lease
        events, since = [], 0
        while True:
            page = await carol.events(since, timeout=0)
            if not page["events"]:
                break
            events += page["events"]
            since = page["last_id"]
        grants: dict[str, int] = {}
        for e in events:
            if e["kind"] == "granted":
                grants[e["lease_id"]] = grants.get(e["lease_id"], 0) + 1
        assert all(n == 1 for n in grants.values()), {k: n for k, n in grants.items() if n > 1}
        for lease in active:
            await carol.release(lease["id"])

    run(check())
    log = hub.log_file.read_text(errors="replace")
    assert log.count("Restored") >= 2, "the restarted broker did not log its restore"
    json.dumps(acknowledged)  # everything the API returned is plain JSON


def test_an_admin_revokes_with_a_grace_the_holder_is_warned_and_the_page_says_what_follows(hub):
    """The admin page's grace: the lease runs on, its holder sees the admin's words as a warning
    (heartbeat answers, the lease's warnings) and the page says when it ends and what then
    happens; the REST API takes the same grace and refuses a bad one."""
    async def clear():  # what earlier tests left live (queued requests granted since) frees the pool
        carol = client(hub, "carol")
        for left in await carol.list_leases(state="live"):
            await carol.release(left["id"], reason="clearing the pool for the next test")
    run(clear())
    lease = run(client(hub, "alice").request_lease({"gpus": 1, "model": "L4"}))
    assert lease["state"] == "active", lease
    try:
        browser = hub.login("carol")
        page = browser.open(hub.service_url("gpulease") + "admin", timeout=60).read().decode()
        assert 'name="grace_s"' in page and ">in 15 min<" in page
        revoke = f"{hub.service_url('gpulease')}admin/leases/{lease['id']}/revoke"
        form = {"_xsrf": _form_xsrf(page), "reason": "node maintenance at noon"}
        with pytest.raises(urllib.error.HTTPError) as info:
            browser.open(revoke, data=urllib.parse.urlencode({**form, "grace_s": "77"}).encode(), timeout=60)
        assert info.value.code == 400 and "the grace must be one of now, in 5 min, in 15 min, in 1 h" in info.value.read().decode()
        done = browser.open(revoke, data=urllib.parse.urlencode({**form, "grace_s": "900"}).encode(), timeout=60).read().decode()
        msg = re.search(r'<p class="msg[^"]*"[^>]*>(.*?)</p>', done, re.S)
        assert msg and "ends in 15 min; alice is warned now. Then its holder is told." in msg.group(1), msg and msg.group(1)
        now = run(client(hub, "alice").heartbeat(lease["id"], {}))
        assert now["state"] == "active"
        (warning,) = [w for w in now["warnings"] if w["kind"] == "preemption"]
        assert warning["message"].startswith("an admin ends this lease in 1") and "node maintenance at noon" in warning["message"]
        # the holder cannot extend past it; a second, longer grace is refused; a revoke now ends it
        run(expect(client(hub, "alice").extend(lease["id"], by_s=600), 409))
        body = {"state": "revoked", "reason": "later", "grace_s": 3600}
        status, answer = hub.request("POST", f"{hub.service_url('gpulease')}api/leases/{lease['id']}/release", body, token=hub.tokens["carol"])
        assert status == 409 and "before this grace is over" in answer["message"], answer
        for bad, who in (({"state": "revoked", "grace_s": -1}, "carol"), ({"state": "revoked", "grace_s": "soon"}, "carol"),
                         ({"state": "released", "grace_s": 60}, "carol"), ({"state": "revoked", "grace_s": 60}, "bob")):
            status, answer = hub.request("POST", f"{hub.service_url('gpulease')}api/leases/{lease['id']}/release", bad, token=hub.tokens[who])
            assert (status, answer.get("field")) in ((400, "grace_s"), (403, "state"), (404, "id")) if who == "carol" else status in (403, 404), (bad, who, status, answer)
        assert run(client(hub, "alice").get_lease(lease["id"]))["state"] == "active"  # nothing of that changed it
        status, answer = hub.request("POST", f"{hub.service_url('gpulease')}api/leases/{lease['id']}/release",
                                     {"state": "revoked", "reason": "now after all", "grace_s": 0}, token=hub.tokens["carol"])
        assert status == 200 and answer["state"] == "revoked" and answer["end_reason"] == "now after all", answer
    finally:
        if run(client(hub, "alice").get_lease(lease["id"]))["state"] == "active":
            run(client(hub, "alice").release(lease["id"]))
