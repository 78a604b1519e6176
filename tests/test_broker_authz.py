"""Who may do what: every endpoint of the broker x every kind of caller, through a REAL hub.

Callers: no token, a token the hub never issued, another user (bob), the lease's owner (alice),
the owner's server (the token the hub gave alice's running single-user server, as the server
extension uses it), and a lease admin (carol, with custom:gpulease:admin). Each call's status is
checked, and what the answer reveals where a status alone would not show a leak.
"""

import pytest

from brokerhub import hub_for_broker, server_token, wait_for_broker

pytestmark = pytest.mark.timeout(600)

ANON, BAD, OTHER, OWNER, SERVER, ADMIN = "anonymous", "bad token", "other user", "owner", "owner's server", "admin"
CALLERS = (ANON, BAD, OTHER, OWNER, SERVER, ADMIN)


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    # a loaded machine may take a while to start a single-user server
    h = hub_for_broker(tmp_path_factory.mktemp("authz"), server_role=True, config_lines=["c.Spawner.http_timeout = 180", "c.Spawner.start_timeout = 180"])
    h.start()
    try:
        h.tokens = {OTHER: h.create_token("bob"), OWNER: h.create_token("alice"), ADMIN: h.create_token("carol"), BAD: "0" * 32, ANON: None}
        wait_for_broker(h, h.tokens[OWNER])
        h.tokens[SERVER] = server_token(h, "alice")
        yield h
    finally:
        h.stop()


def call(hub, who, method, path, body=None, **kw):
    return hub.request(method, hub.service_url("gpulease") + path, body, token=hub.tokens[who], **kw)


def new_lease(hub, model="L4") -> str:
    status, lease = call(hub, OWNER, "POST", "api/leases", {"gpus": 1, "model": model})
    assert status == 201, lease
    return lease["id"]


def end(hub, lease_id):
    call(hub, ADMIN, "POST", f"api/leases/{lease_id}/release", {"state": "revoked", "reason": "test cleanup"})


def expect(hub, method, path, body, statuses: dict, fresh_lease: bool = False):
    """Call as every caller; ``statuses`` maps caller -> status (ANON and BAD default to 401).
    ``fresh_lease``: each caller acts on its own new lease of alice's ({id} in path)."""
    want = {ANON: 401, BAD: 401, **statuses}
    got = {}
    for who in CALLERS:
        lid = new_lease(hub) if fresh_lease else None
        p = path.format(id=lid) if lid else path
        status, answer = call(hub, who, method, p, body)
        got[who] = status
        if status >= 400:
            assert isinstance(answer, dict) and answer.get("message"), (who, method, p, status, answer)
        if lid:
            end(hub, lid)
    assert got == want, f"{method} {path}: {got}"


def test_every_endpoint_answers_each_kind_of_caller_as_it_should(hub):
    lease = new_lease(hub)
    try:
        ok_all = {OTHER: 200, OWNER: 200, SERVER: 200, ADMIN: 200}
        owner_only = {OTHER: 403, OWNER: 200, SERVER: 200, ADMIN: 200}
        expect(hub, "GET", "api/pool", None, ok_all)
        expect(hub, "GET", "api/pool?user=alice", None, owner_only)
        expect(hub, "GET", "api/pool?all=true", None, {OTHER: 403, OWNER: 403, SERVER: 403, ADMIN: 200})
        expect(hub, "GET", "api/leases", None, ok_all)
        expect(hub, "GET", "api/leases?user=alice&state=all", None, owner_only)
        expect(hub, "GET", f"api/leases/{lease}", None, owner_only)
        expect(hub, "GET", "api/leases/no-such-lease", None, {OTHER: 404, OWNER: 404, SERVER: 404, ADMIN: 404})
        expect(hub, "POST", "api/estimate", {"asks": [{"gpus": 1}]}, ok_all)
        expect(hub, "POST", "api/leases?dry_run=true", {"gpus": 1}, ok_all)
        expect(hub, "POST", "api/leases", {"gpus": 1, "user": "alice"}, {OTHER: 403, OWNER: 403, SERVER: 403, ADMIN: 201})
        for lid in [x["id"] for x in call(hub, ADMIN, "GET", "api/leases?user=alice")[1]["leases"] if x["id"] != lease]:
            end(hub, lid)
        expect(hub, "POST", f"api/leases/{lease}/extend", {"by_s": 60}, owner_only)
        expect(hub, "POST", f"api/leases/{lease}/confirm", {}, owner_only)
        expect(hub, "POST", f"api/leases/{lease}/heartbeat", {"usage": {"gpu_util": 3}}, owner_only)
        expect(hub, "POST", "api/leases/{id}/release", {}, owner_only, fresh_lease=True)
        expect(hub, "DELETE", "api/leases/{id}", None, owner_only, fresh_lease=True)
        expect(hub, "POST", "api/leases/{id}/release", {"state": "reclaimed"}, owner_only, fresh_lease=True)
        expect(hub, "POST", "api/leases/{id}/release", {"state": "revoked"}, {OTHER: 403, OWNER: 403, SERVER: 403, ADMIN: 200}, fresh_lease=True)
        expect(hub, "GET", "api/queue", None, ok_all)
        expect(hub, "GET", "api/drain", None, ok_all)
        expect(hub, "POST", "api/drain", {"drain": False}, {OTHER: 403, OWNER: 403, SERVER: 403, ADMIN: 200})
        expect(hub, "GET", "api/events?timeout=0", None, ok_all)
        expect(hub, "GET", f"api/events?lease={lease}&timeout=0", None, owner_only)
        expect(hub, "GET", "metrics", None, {OTHER: 403, OWNER: 403, SERVER: 403, ADMIN: 200})  # the metrics name every lease
        expect(hub, "GET", "api/openapi.json", None, {ANON: 200, BAD: 200, **ok_all})
        expect(hub, "GET", f"api/leases/{lease}/extend", None, {OTHER: 405, OWNER: 405, SERVER: 405, ADMIN: 405})
        # a token in the URL is not a way in
        status, _ = hub.request("GET", hub.service_url("gpulease") + f"api/pool?token={hub.tokens[OWNER]}")
        assert status == 401
    finally:
        end(hub, lease)


def test_answers_reveal_nothing_of_other_users(hub):
    lease = new_lease(hub)
    blocker = new_lease(hub, "A100*")
    second = new_lease(hub, "A100*")
    status, queued = call(hub, OWNER, "POST", "api/leases", {"gpus": 1, "model": "A100*"})
    assert status == 201 and queued["state"] == "queued"
    try:
        status, mine = call(hub, OTHER, "GET", "api/leases?state=all")
        assert status == 200 and all(x["user"] == "bob" for x in mine["leases"])
        status, q = call(hub, OTHER, "GET", "api/queue")
        (entry,) = q["queue"]
        assert set(entry) <= {"user", "tier", "request", "state", "queue"} and entry["user"] == "…"
        assert queued["id"] not in str(q)
        assert set(entry["queue"]) == {"position", "length", "eta"}
        status, q = call(hub, ADMIN, "GET", "api/queue")
        assert q["queue"][0]["id"] == queued["id"] and q["queue"][0]["user"] == "alice"
        status, feed = call(hub, OTHER, "GET", "api/events?timeout=0")
        assert status == 200 and not any(e["lease_id"] in (lease, queued["id"]) for e in feed["events"])
        status, pool = call(hub, OTHER, "GET", "api/pool")
        assert "alice" not in str(pool)
    finally:
        for lid in (queued["id"], second, blocker, lease):
            end(hub, lid)


def test_the_pages_send_strangers_to_the_login_and_keep_the_admin_page_for_admins(hub):
    import urllib.error
    import urllib.request

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *a, **kw):
            return None

    opener = urllib.request.build_opener(NoRedirect)
    for path in ("", "admin"):
        with pytest.raises(urllib.error.HTTPError) as info:
            opener.open(hub.service_url("gpulease") + path, timeout=30)
        assert info.value.code == 302 and "oauth2/authorize" in info.value.headers["Location"]
    # with a token (what a script would send) the pages answer as for a logged-in browser
    status, page = call(hub, OTHER, "GET", "")
    assert status == 200 and "GPU leases of bob" in page
    status, page = call(hub, OTHER, "GET", "admin")
    assert status == 403 and "custom:gpulease:admin" in page
    status, page = call(hub, ADMIN, "GET", "admin")
    assert status == 200 and "Who holds what" in page
