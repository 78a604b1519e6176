"""HTTP handlers of the broker: the REST API, the event feed, metrics and the admin page.

Authentication is JupyterHub's: API handlers take ``Authorization: token …`` (HubAuth) and
answer 401 instead of redirecting; the admin page logs browsers in through OAuth (HubOAuth).
Callers with the admin scope (``custom:gpulease:admin`` by default) or hub admins act on
every lease; everyone else on their own.
"""

from __future__ import annotations

import html
import json
import math
import time
from typing import Any

from jupyterhub.services.auth import HubOAuthCallbackHandler, HubOAuthenticated
from tornado import web
from tornado.iostream import StreamClosedError

from ..core.model import BadRequest, Conflict, Forbidden, LeaseError, LeaseState, NotFound
from ..core.request import parse_ask
from ..core.text import format_duration

STATE_FILTERS = {"live", "queued", "active", "ended", "all"} | {s.value for s in LeaseState}
MAX_POLL_S = 300.0
MAX_NAME_LEN = 255  # user and server names: JupyterHub's limit, and the store's column width
MAX_EVENT_ID = 2**63 - 1  # the largest id a SQL integer column holds


def _number(body: dict, name: str, *, minimum: float | None = None, strict_min: bool = False) -> float | None:
    if name not in body or body[name] is None:
        return None
    v = body[name]
    try:
        finite = not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
    except OverflowError:  # an integer too large for a float
        finite = False
    if not finite:
        shown = repr(v) if len(repr(v)) <= 40 else repr(v)[:40] + "…"
        raise BadRequest(f"'{name}' must be a number of seconds, got {shown}", field=name)
    if minimum is not None and (v <= minimum if strict_min else v < minimum):
        raise BadRequest(f"'{name}' must be {'greater than' if strict_min else 'at least'} {minimum:g}, got {v!r}", field=name)
    return float(v)


def _reject_constant(name: str):
    # NaN and Infinity are not JSON: stored, they would break browsers' JSON.parse and PostgreSQL
    raise ValueError(f"{name} is not a JSON number")


class BaseHandler(web.RequestHandler):
    """Shared plumbing: JSON errors, the manager, who the caller is."""

    @property
    def log(self):
        return self.settings["gpulease_broker"].log

    @property
    def manager(self):
        return self.settings["gpulease_manager"]

    @property
    def broker(self):
        return self.settings["gpulease_broker"]

    @property
    def admin_scope(self) -> str:
        return self.settings.get("gpulease_admin_scope", "custom:gpulease:admin")

    @property
    def caller(self) -> dict[str, Any]:
        return self.current_user

    @property
    def caller_name(self) -> str:
        return self.current_user["name"]

    @property
    def is_admin(self) -> bool:
        model = self.current_user or {}
        if model.get("admin"):
            return True
        scopes = set(model.get("scopes") or ())
        return self.admin_scope in scopes

    @property
    def actor(self) -> str:
        model = self.current_user or {}
        return f"service:{model['name']}" if model.get("kind") == "service" else model.get("name", "")

    def check_owner(self, lease) -> None:
        if lease.user != self.caller_name and not self.is_admin:
            raise Forbidden(f"lease {lease.id} belongs to another user", field="id")


class APIHandler(BaseHandler):
    """JSON in, JSON out; errors as ``{"error", "message", "field"}``."""

    def set_default_headers(self):
        self.set_header("Content-Type", "application/json; charset=utf-8")
        self.set_header("Cache-Control", "no-store")

    def check_xsrf_cookie(self):
        # token-authenticated only (no cookies are read here): no cross-site forgery to guard against
        return

    async def prepare(self):
        model = await self.authenticate()
        if not model:
            raise web.HTTPError(401, "a valid JupyterHub token is required: send 'Authorization: token <token>'")
        self.current_user = model

    async def authenticate(self) -> dict | None:
        """The caller's hub model, or None. Unit tests override this in a subclass."""
        hub_auth = self.settings["hub_auth"]
        self.hub_auth = hub_auth
        model = await hub_auth.get_user(self, sync=False)
        if not model:
            return None
        model.setdefault("kind", "user")
        scopes = hub_auth.access_scopes
        if scopes and not hub_auth.check_scopes(scopes, model):
            raise web.HTTPError(403, f"{model['kind']} {model['name']} may not use this service: it lacks the scope {' or '.join(sorted(scopes))}")
        return model

    def get_login_url(self):
        raise web.HTTPError(401, "a valid JupyterHub token is required")

    def write_json(self, data: Any, status: int = 200) -> None:
        self.set_status(status)
        self.finish(json.dumps(data))

    def write_error(self, status_code: int, **kwargs):
        exc = kwargs.get("exc_info", (None, None, None))[1]
        if isinstance(exc, LeaseError):
            body = exc.to_dict()
        else:
            message = getattr(exc, "log_message", None) or self._reason
            if isinstance(exc, web.HTTPError) and exc.args[1:]:
                message = message % exc.args[1:]
            body = {"error": {401: "Unauthorized", 403: "Forbidden", 404: "NotFound", 405: "MethodNotAllowed"}.get(status_code, "Error"), "message": message}
        self.set_header("Content-Type", "application/json; charset=utf-8")
        self.finish(json.dumps(body))

    def _handle_request_exception(self, e: BaseException) -> None:
        if isinstance(e, LeaseError):
            self.log.info("%s %s -> %s %s: %s", self.request.method, self.request.path, e.status, type(e).__name__, e.message)
            if not self._finished:
                self.set_status(e.status)
                self.write_error(e.status, exc_info=(type(e), e, e.__traceback__))
            return
        super()._handle_request_exception(e)

    def json_body(self) -> dict[str, Any]:
        raw = self.request.body
        if not raw or not raw.strip():
            return {}
        try:
            body = json.loads(raw, parse_constant=_reject_constant)
        except (ValueError, UnicodeDecodeError) as e:
            raise BadRequest(f"the request body is not valid JSON: {e}", field="body") from None
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object", field="body")
        return body

    async def lease_for_caller(self, lease_id: str, *, live: bool = False):
        """The lease, checked: 404 unknown, 403 someone else's, 409 (``live``) already ended."""
        lease = await self.manager.get(lease_id)
        self.check_owner(lease)
        if live and lease.state.terminal:
            raise Conflict(f"lease {lease_id} has already ended ({lease.state.value})", field="state")
        return lease


class PoolHandler(APIHandler):
    """The pool; tiers and quota/usage of the caller, or (admins, ``?user=U``) of user U.

    U's groups: the ``group`` arguments (``&group=a&group=b``) when the caller passes any (the
    spawner does: it knows them), else the hub's user model (the broker's token needs
    ``read:users:groups``), else none.
    """

    async def get(self):
        sched = self.manager.scheduler
        user = self.get_argument("user", None)
        if user is not None and user != self.caller_name:
            if not user.strip():
                raise BadRequest("'user' must be a user name", field="user")
            if not self.is_admin:
                raise Forbidden(f"only callers with the {self.admin_scope} scope may see another user's tiers and quota", field="user")
            groups = tuple(self.get_arguments("group"))
            if not groups:
                groups = await self.broker.user_groups(user)
            name, for_admin = user, False
        else:
            name, groups, for_admin = self.caller_name, tuple(self.caller.get("groups") or ()), self.is_admin
        tiers = [t.to_dict() for t in sched.policy.tiers.values() if for_admin or t.allows(name, groups)]
        self.write_json(
            {
                "devices": [g.to_dict() for g in sched.inventory.values()],
                "capacity": sched.capacity(),
                "tiers": tiers,
                "default_tier": sched.policy.default_tier,
                "user": name,
                "usage": sched.user_usage(name, groups, self.manager.now()),
                "queue_length": sched.queue_length(),
            }
        )


ENDED_LIMIT = 1000  # ended leases listed at most, newest first, unless ?limit= says otherwise


class LeasesHandler(APIHandler):
    async def get(self):
        state = self.get_argument("state", "live")
        if state not in STATE_FILTERS:
            raise BadRequest(f"'state' must be one of {', '.join(sorted(STATE_FILTERS))}, got {state!r}", field="state")
        user = self.get_argument("user", None)
        if user is not None and user != self.caller_name and not self.is_admin:
            raise Forbidden("only admins may list other users' leases", field="user")
        if user is None and not self.is_admin:
            user = self.caller_name
        limit_arg = self.get_argument("limit", str(ENDED_LIMIT))
        if not limit_arg.isdigit() or not 1 <= int(limit_arg) <= 100_000:
            raise BadRequest(f"'limit' must be a whole number from 1 to 100000, got {limit_arg!r}", field="limit")
        leases = await self.manager.list(user=user, state=state, limit=int(limit_arg))
        self.write_json({"leases": [self.manager.lease_json(lease) for lease in leases]})

    async def post(self):
        body = self.json_body()
        user, groups = self.caller_name, tuple(self.caller.get("groups") or ())
        if "user" in body or "groups" in body:
            if not self.is_admin:
                raise Forbidden(f"only callers with the {self.admin_scope} scope may request leases for another user", field="user" if "user" in body else "groups")
            if "user" in body:
                if not isinstance(body["user"], str) or not body["user"].strip() or len(body["user"].strip()) > MAX_NAME_LEN:
                    raise BadRequest(f"'user' must be a user name (at most {MAX_NAME_LEN} characters)", field="user")
                user = body["user"].strip()
                groups = ()
            if "groups" in body:
                g = body["groups"]
                if not isinstance(g, list) or not all(isinstance(x, str) for x in g):
                    raise BadRequest("'groups' must be a list of group names", field="groups")
                groups = tuple(g)
        ask = parse_ask(body, user=user, groups=groups, also=("user", "groups"))
        lease = await self.manager.request(ask, actor=self.actor if user == self.caller_name else f"admin:{self.caller_name}")
        self.set_header("Location", f"{self.request.path.rstrip('/')}/{lease.id}")
        self.write_json(self.manager.lease_json(lease), 201)


class LeaseHandler(APIHandler):
    async def get(self, lease_id):
        lease = await self.lease_for_caller(lease_id)
        self.write_json(self.manager.lease_json(lease))

    async def delete(self, lease_id):
        await self._release(lease_id, {})

    async def _release(self, lease_id, body):
        lease = await self.lease_for_caller(lease_id, live=True)
        reason = body.get("reason", "") or ""
        if not isinstance(reason, str):
            raise BadRequest("'reason' must be a string", field="reason")
        state = LeaseState.RELEASED
        if "state" in body:
            # admins end leases as 'revoked' (or 'reclaimed' for the idle reclaimer)
            allowed = {"released", "reclaimed", "revoked"}
            if not isinstance(body["state"], str) or body["state"] not in allowed:
                raise BadRequest(f"'state' must be one of {', '.join(sorted(allowed))}, got {body['state']!r}", field="state")
            if body["state"] == "revoked" and not self.is_admin:
                raise Forbidden("only admins may revoke a lease", field="state")
            state = LeaseState(body["state"])
        elif lease.user != self.caller_name:
            state = LeaseState.REVOKED
        lease = await self.manager.release(lease_id, state=state, reason=reason or f"released by {self.caller_name}", actor=self.actor)
        self.write_json(self.manager.lease_json(lease))


class LeaseActionHandler(LeaseHandler):
    async def post(self, lease_id, action):
        body = self.json_body()
        if action == "release":
            return await self._release(lease_id, body)
        await self.lease_for_caller(lease_id, live=True)
        if action == "extend":
            by_s = _number(body, "by_s", minimum=0, strict_min=True)
            until = _number(body, "until", minimum=0, strict_min=True)
            if (by_s is None) == (until is None):
                raise BadRequest("give exactly one of 'by_s' (seconds) or 'until' (epoch seconds)", field="by_s")
            lease = await self.manager.extend(lease_id, by_s=by_s, until=until, actor=self.actor)
        elif action == "confirm":
            lease = await self.manager.confirm(lease_id, actor=self.actor)
        elif action == "heartbeat":
            usage = body.get("usage") or {}
            if not isinstance(usage, dict):
                raise BadRequest("'usage' must be a JSON object", field="usage")
            lease = await self.manager.heartbeat(lease_id, usage)
        else:  # the route only lets the four actions through
            raise NotFound(f"no action {action!r}")
        self.write_json(self.manager.lease_json(lease))


class QueueHandler(APIHandler):
    async def get(self):
        out = []
        for lease in self.manager.scheduler.queue():
            d = self.manager.lease_json(lease)
            if lease.user != self.caller_name and not self.is_admin:
                d = anonymise(d)
            out.append(d)
        self.write_json({"queue": out})


def anonymise(d: dict[str, Any]) -> dict[str, Any]:
    """Another user's queue entry as a non-admin sees it: shape and place, no names."""
    keep = ("id", "request", "tier", "duration_s", "state", "created_at", "queue")
    out = {k: d.get(k) for k in keep}
    out["user"] = "…"
    return out


class EventsHandler(APIHandler):
    """Long-poll feed: events after ``since``; waits up to ``timeout`` s for the first one."""

    async def _filters(self):
        lease_id = self.get_argument("lease", None)
        user = None if self.is_admin else self.caller_name
        if lease_id:
            await self.lease_for_caller(lease_id)
        return lease_id, user

    def _since(self) -> int:
        raw = self.get_argument("since", None)
        if raw is None:
            raw = self.request.headers.get("Last-Event-ID", "0")
        try:
            since = int(raw)
        except ValueError:
            raise BadRequest(f"'since' must be an event id (a whole number), got {raw!r}", field="since") from None
        if not 0 <= since <= MAX_EVENT_ID:
            raise BadRequest(f"'since' must be an event id between 0 and {MAX_EVENT_ID}", field="since")
        return since

    async def get(self):
        since = self._since()
        try:
            timeout = float(self.get_argument("timeout", "30"))
        except ValueError:
            raise BadRequest("'timeout' must be a number of seconds", field="timeout") from None
        if not 0 <= timeout <= MAX_POLL_S:
            raise BadRequest(f"'timeout' must be between 0 and {MAX_POLL_S:g} seconds", field="timeout")
        lease_id, user = await self._filters()
        deadline = time.monotonic() + timeout
        while True:
            events = await self.manager.events_since(since, lease_id=lease_id, user=user)
            left = deadline - time.monotonic()
            if events or left <= 0 or self.request.connection.stream.closed() or self.manager.closed:
                break
            await self.manager.wait_for_events(left)
        last = events[-1]["id"] if events else max(since, 0)
        self.write_json({"events": events, "last_id": last})


class EventStreamHandler(EventsHandler):
    """Server-sent events: the same payloads as the long-poll feed, one ``data:`` line each."""

    def set_default_headers(self):
        self.set_header("Content-Type", "text/event-stream")
        self.set_header("Cache-Control", "no-cache")
        self.set_header("X-Accel-Buffering", "no")

    def on_connection_close(self):
        self._closed = True
        self.manager.wake_waiters()

    async def get(self):
        since = self._since()
        lease_id, user = await self._filters()
        self._closed = False
        keepalive = float(self.settings.get("gpulease_sse_keepalive", 15))
        try:
            self.write(": connected\n\n")
            await self.flush()
            while not self._closed and not self.manager.closed:
                events = await self.manager.events_since(since, lease_id=lease_id, user=user)
                for e in events:
                    self.write(f"id: {e['id']}\nevent: {e['kind']}\ndata: {json.dumps(e)}\n\n")
                    since = e["id"]
                if not events:
                    self.write(": keepalive\n\n")
                await self.flush()
                if not events:
                    await self.manager.wait_for_events(keepalive)
        except StreamClosedError:
            pass
        if not self._finished:
            try:
                self.finish()
            except StreamClosedError:
                pass


class OpenAPIHandler(APIHandler):
    async def prepare(self):
        # the description of the API is public
        return

    def get(self):
        self.write_json(self.settings["gpulease_openapi"])


class MetricsHandler(APIHandler):
    async def prepare(self):
        if self.settings.get("gpulease_authenticate_metrics", True):
            await super().prepare()

    def get(self):
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        self.set_header("Content-Type", CONTENT_TYPE_LATEST)
        self.finish(generate_latest(self.settings["gpulease_metrics"].registry))


# --------------------------------------------------------------------------- admin page
class AdminPageHandler(HubOAuthenticated, BaseHandler):
    """Who holds what, the queue with ETAs, and the pool. Admin scope only; browsers log in via OAuth."""

    @property
    def hub_auth(self):
        return self.settings["hub_oauth"]

    @hub_auth.setter
    def hub_auth(self, value):  # HubAuthenticated assigns it in some paths
        pass

    @web.authenticated
    def get(self):
        if not self.is_admin:
            raise web.HTTPError(403, f"the lease admin page needs the {self.admin_scope} scope")
        self.set_header("Content-Type", "text/html; charset=utf-8")
        self.finish(render_admin_page(self.manager, self.manager.now()))


def _fmt_time(t: float | None, now: float) -> str:
    if t is None:
        return "—"
    d = t - now
    rel = f"in {format_duration(d)}" if d >= 0 else f"{format_duration(-d)} ago"
    return f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(t))} ({rel})"


def render_admin_page(manager, now: float) -> str:
    sched = manager.scheduler
    esc = html.escape
    active = [lease for lease in manager.live() if lease.state is LeaseState.ACTIVE]
    queue = sched.queue()

    def placement(lease) -> str:
        if not lease.placement:
            return "—"
        return esc(", ".join(f"{s.node}/{s.index} {s.model}" + (f" {s.mig_profile}" if s.mig_profile else "") + (f" ×{s.share_milli / 1000:g}" if s.share_milli != 1000 else "") for s in lease.placement.slices))

    rows_active = "".join(
        f"<tr><td>{esc(lease.user)}</td><td>{esc(lease.server or '(default)')}</td><td>{esc(lease.tier)}</td><td>{esc(lease.request.describe())}</td>"
        f"<td>{placement(lease)}</td><td>{esc(_fmt_time(lease.granted_at, now))}</td><td>{esc(_fmt_time(lease.expires_at, now))}</td>"
        f"<td><code>{esc(lease.id)}</code></td></tr>"
        for lease in active
    )
    rows_queue = []
    for i, lease in enumerate(queue, 1):
        info = manager.queue_info(lease) or {}
        rows_queue.append(
            f"<tr><td>{i}</td><td>{esc(lease.user)}</td><td>{esc(lease.tier)}</td><td>{esc(lease.request.describe())}</td>"
            f"<td>{esc(_fmt_time(lease.created_at, now))}</td><td>{esc(_fmt_time(info.get('eta'), now))}</td>"
            f"<td>{esc(info.get('waiting_for') or '')}</td><td><code>{esc(lease.id)}</code></td></tr>"
        )
    rows_pool = "".join(
        f"<tr><td>{esc(g.node)}</td><td>{g.index}</td><td>{esc(g.model)}</td><td>{g.memory_mib}</td>"
        f"<td>{esc(', '.join(m.profile for m in g.mig)) or '—'}</td><td>{'yes' if g.healthy else 'NO'}</td><td><code>{esc(g.uuid)}</code></td></tr>"
        for g in sorted(sched.inventory.values(), key=lambda g: (g.node, g.index))
    )
    style = (
        "body{font-family:system-ui,sans-serif;margin:2em;color:#222}table{border-collapse:collapse;margin-bottom:2em}"
        "td,th{border:1px solid #ccc;padding:.3em .6em;text-align:left}th{background:#f3f3f3}code{font-size:.85em}"
    )
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>GPU leases</title><style>{style}</style></head>
<body>
<h1>GPU leases</h1>
<p>{len(active)} active, {len(queue)} queued, {len(sched.inventory)} GPUs in the pool. Page made {esc(time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(now)))}.</p>
<h2>Who holds what</h2>
<table><tr><th>User</th><th>Server</th><th>Tier</th><th>Asked for</th><th>Placement</th><th>Granted</th><th>Expires</th><th>Lease</th></tr>
{rows_active or '<tr><td colspan="8">nobody holds a lease</td></tr>'}</table>
<h2>Queue</h2>
<table><tr><th>#</th><th>User</th><th>Tier</th><th>Asks for</th><th>Since</th><th>ETA</th><th>Waiting for</th><th>Lease</th></tr>
{''.join(rows_queue) or '<tr><td colspan="8">the queue is empty</td></tr>'}</table>
<h2>Pool</h2>
<table><tr><th>Node</th><th>Index</th><th>Model</th><th>Memory (MiB)</th><th>MIG</th><th>Healthy</th><th>UUID</th></tr>
{rows_pool}</table>
</body></html>
"""


class OAuthCallbackHandler(HubOAuthCallbackHandler):
    """Finishes the admin page's OAuth login with the broker's own HubOAuth (it holds the PKCE state)."""

    @property
    def hub_auth(self):
        return self.settings["hub_oauth"]

    @hub_auth.setter
    def hub_auth(self, value):
        pass


def make_handlers(prefix: str, oauth_callback_handler=OAuthCallbackHandler) -> list[tuple]:
    """Routes under the service ``prefix`` (which starts and ends with '/')."""
    p = prefix
    lease_id = r"([A-Za-z0-9_.\-]+)"
    return [
        (p + r"api/pool/?", PoolHandler),
        (p + r"api/leases/?", LeasesHandler),
        (p + rf"api/leases/{lease_id}/?", LeaseHandler),
        (p + rf"api/leases/{lease_id}/(extend|release|confirm|heartbeat)/?", LeaseActionHandler),
        (p + r"api/queue/?", QueueHandler),
        (p + r"api/events/?", EventsHandler),
        (p + r"api/events/stream/?", EventStreamHandler),
        (p + r"api/openapi.json", OpenAPIHandler),
        (p + r"metrics/?", MetricsHandler),
        (p + r"oauth_callback", oauth_callback_handler),
        (p + r"?", AdminPageHandler),
    ]
