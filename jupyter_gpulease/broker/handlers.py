"""HTTP handlers of the broker's REST API, its event feed and its metrics.

Authentication is JupyterHub's: API handlers take ``Authorization: token …`` (HubAuth) and
answer 401 instead of redirecting. Callers with the admin scope (``custom:gpulease:admin`` by
default) or hub admins act on every lease; everyone else on their own. Handlers talk to the
:class:`~jupyter_gpulease.broker.manager.LeaseManager` about leases, and every answer they give
about a lease is its committed state (see the manager's contract); the other parts they read
(the hub side, the health keeper, the unleased-use detector) are in the web app's settings.
Input is bounded and parsed by :mod:`jupyter_gpulease.broker.inputs`.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Callable
from typing import Any

from jupyterhub.services.auth import HubAuthenticated, UserNotAllowed
from tornado import web
from tornado.iostream import StreamClosedError

from ..core.model import BadRequest, Conflict, Forbidden, LeaseError, LeaseState, NotFound
from ..core.request import Ask, parse_ask
from . import inputs
from .feed import TooManyStreams
from .keys import KEY_CHARS, scoped_key
from .listing import LIST_LIMIT, MAX_LIST_LIMIT, Cursor
from .manager import STOPPING, Unavailable

RELEASE_FIELDS = {"reason", "state", "keep_server", "grace_s"}
MAX_REVOKE_GRACE_S = 7 * 86400  # an admin's revoke may wait a week at most
STATE_FILTERS = {"live", "queued", "active", "ended", "all"} | {s.value for s in LeaseState}
MAX_POLL_S = 300.0
MAX_NAME_LEN = 255  # user and server names: JupyterHub's limit, and the store's column width
MAX_EVENT_ID = 2**63 - 1  # the largest id a SQL integer column holds
PAGE_SLICE = 100  # leases serialised between two turns of the loop when a page is written
MAX_ESTIMATES = 32
ERROR_NAMES = {400: "BadRequest", 401: "Unauthorized", 403: "Forbidden", 404: "NotFound", 405: "MethodNotAllowed", 413: "TooLarge", 429: "TooManyRequests"}

LEASE_ID_ROUTE = r"([A-Za-z0-9_.\-]+)"  # a lease id in a URL path (the API's and the pages')


class BrokerHandler:
    """Shared plumbing of the API's handlers and the pages: the manager, who the caller is."""

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
    def hub_side(self):
        """What the broker asks of its hub (:class:`.hubside.HubSide`: a user's groups)."""
        return self.settings["gpulease_hub_side"]

    @property
    def health(self):
        """The GPU health keeper (:class:`.health.HealthKeeper`); None where this broker keeps none."""
        return self.settings.get("gpulease_health")

    @property
    def unleased(self):
        """The detector of unleased GPU use (:class:`.unleased.UnleasedDetector`); None where off."""
        return self.settings.get("gpulease_unleased")

    @property
    def limits(self) -> inputs.Limits:
        return self.settings.get("gpulease_limits") or inputs.Limits()

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
    def caller_groups(self) -> tuple[str, ...]:
        return tuple(self.current_user.get("groups") or ())

    @property
    def is_admin(self) -> bool:
        model = self.current_user or {}
        if model.get("admin"):
            return True
        return self.admin_scope in set(model.get("scopes") or ())

    @property
    def actor(self) -> str:
        model = self.current_user or {}
        return f"service:{model['name']}" if model.get("kind") == "service" else model.get("name", "")

    def check_owner(self, lease: dict) -> None:
        if lease["user"] != self.caller_name and not self.is_admin:
            raise Forbidden(f"lease {lease['id']} belongs to another user", field="id")

    def lease_json(self, d: dict) -> dict:
        return self.manager.lease_json(d, viewer=self.caller_name, admin=self.is_admin)

    def log_exception(self, typ, value, tb) -> None:
        # tornado's own line names the whole URI, query string (and any token in it) included
        if isinstance(value, web.HTTPError):
            if value.log_message:
                self._reported = True
                self.log.warning("%d %s %s: %s", value.status_code, self.request.method, self.request.path, value.log_message % value.args if value.args else value.log_message)
        else:
            self.log.error("Uncaught exception in %s %s", self.request.method, self.request.path, exc_info=(typ, value, tb))


class BaseHandler(BrokerHandler, web.RequestHandler):
    """A tornado.web handler with the broker's plumbing (the pages)."""


@web.stream_request_body
class APIHandler(BrokerHandler, HubAuthenticated, web.RequestHandler):
    """JSON in, JSON out; errors as ``{"error", "message", "field"}``.

    A tornado.web handler authenticated by JupyterHub's :class:`HubAuthenticated` with a token
    only (no cookie is trusted, so there is no cross-site forgery to guard against): the token is
    checked in :meth:`prepare` without blocking the loop, and a caller without one is answered
    401 instead of redirected. Every answer is ``Cache-Control: no-store``, so no ETag is hashed.

    The body streams in (``stream_request_body``) so that its size is judged from the headers
    before it is read: a body over the limit (``Content-Length``, or what a chunked body has
    reached) is read to its end and dropped as it comes, then answered 413 before any
    authentication, and the connection serves on (a client or a proxy still sending gets the
    answer whole instead of a connection closed under it). A body declared larger than
    :data:`~jupyter_gpulease.broker.inputs.DISCARD_BYTES` is not read: the 413 goes out at once
    and the connection closes. Handlers read the body with :meth:`json_body` (or :attr:`body`).
    """

    def initialize(self) -> None:
        self._chunks: list[bytes] | None = []
        self._received = 0
        self._too_large: int | None = None  # the body's size (declared, or read so far) when over the limit
        self._body: bytes | None = None
        self._early_error: web.HTTPError | None = None

    def set_default_headers(self):
        self.set_header("Content-Type", "application/json; charset=utf-8")
        self.set_header("Cache-Control", "no-store")

    def compute_etag(self):
        return None  # answers are 'Cache-Control: no-store': nothing to hash

    def check_xsrf_cookie(self):
        return None  # token-authenticated only: no cookie is read, no cross-site forgery to guard against

    @property
    def hub_auth(self):
        return self.settings["hub_auth"]

    @hub_auth.setter
    def hub_auth(self, value):  # HubAuthenticated assigns it in some paths
        pass

    def get_current_user(self):
        return None  # the caller is known once prepare() has checked the token (off the loop's back)

    def get_login_url(self):
        raise web.HTTPError(401, "a valid JupyterHub token is required: send 'Authorization: token <token>'")

    # -- the body ---------------------------------------------------------------------------------
    def _check_declared_size(self) -> None:
        """A ``Content-Length`` over the limit: drop the body as it comes (413 after it), or
        answer at once when it is not worth reading. A chunked body is counted as it comes."""
        headers = self.request.headers
        length = headers.get("Content-Length")
        limit = self.limits.body_bytes
        discard = max(inputs.DISCARD_BYTES, limit)
        if length is None:
            if "chunked" in headers.get("Transfer-Encoding", "").lower():
                self.request.connection.set_max_body_size(discard)
            return
        if not length.isdigit() or int(length) <= limit:
            return  # what fits, or a malformed length (tornado's 400)
        self._refuse_body(int(length))
        # never tornado's own "Content-Length too long" (a 400 and a dropped connection)
        self.request.connection.set_max_body_size(int(length))
        if int(length) > discard:
            self.set_header("Connection", "close")
            self._answer_too_large()  # not worth reading: answered now, the connection closes

    def _refuse_body(self, size: int) -> None:
        self._too_large, self._chunks = size, None
        self._answer_after_body(self._answer_too_large)

    def _answer_too_large(self) -> None:
        size = max(self._too_large or 0, self._received)
        raise inputs.TooLarge(f"the request body is {size} bytes; the broker takes at most {self.limits.body_bytes}", field="body")

    def _answer_after_body(self, answer: Callable[[], None]) -> None:
        """The call's method (called once the body is in) becomes ``answer``: an answer given
        while the body is still coming would close the connection under its sender."""
        setattr(self, (self.request.method or "GET").lower(), lambda *args, **kwargs: answer())

    def data_received(self, chunk: bytes) -> None:
        self._received += len(chunk)
        if self._chunks is None:
            return  # over the limit: dropped as it comes
        if self._received > self.limits.body_bytes:
            self._refuse_body(self._received)
            return
        self._chunks.append(chunk)

    @property
    def body(self) -> bytes:
        """The request body (within the limit: a larger one never reaches a handler's method)."""
        if self._body is None:
            self._body = self.request.body = b"".join(self._chunks or ())
        return self._body

    def decode_argument(self, value: bytes, name: str | None = None) -> str:
        try:
            return super().decode_argument(value, name)
        except web.HTTPError as e:
            if name is not None:
                raise  # a query argument: the handler's method is running
            self._early_error = e  # a path argument: answered after the body (see prepare)
            return ""

    # -- who calls ----------------------------------------------------------------------------------
    async def prepare(self):
        """Before the body is read: judge its size, then the caller. An error here is answered
        once the body is in, so that the connection serves on."""
        self._track()
        self._check_declared_size()
        if self._too_large is not None:
            return  # answered 413 once the body is in, before any authentication
        try:
            if self._early_error is not None:
                raise self._early_error
            if self.needs_token:
                model = await self.authenticate()
                if not model:
                    raise web.HTTPError(401, "a valid JupyterHub token is required: send 'Authorization: token <token>'")
                self.current_user = model
            self._check_query()
        except Exception as e:
            self._answer_after_body(functools.partial(_raise, e))

    @property
    def needs_token(self) -> bool:
        """Whether a call must bring a hub token (the API's description does not)."""
        return True

    #: query arguments a call may give more than once (each value counts); any other given
    #: twice is a 400: which of ``?user=bob&user=alice`` was meant is not for the broker to guess
    repeatable_arguments: frozenset[str] = frozenset()

    def _check_query(self) -> None:
        for name, values in self.request.query_arguments.items():
            if len(values) > 1 and name not in self.repeatable_arguments:
                raise BadRequest(f"the query argument {name!r} is given {len(values)} times; give it once", field=name)

    def _track(self) -> None:
        """The broker's stop lets the calls it is answering finish (see ``stop_async``)."""
        calls = self.settings.get("gpulease_calls")
        task = asyncio.current_task()
        if calls is not None and task is not None:
            calls.add(task)
            task.add_done_callback(calls.discard)

    async def authenticate(self) -> dict | None:
        """The caller's hub model, or None. Unit tests override this in a subclass."""
        checks = self.settings.get("gpulease_token_checks")  # one check with the hub per token at a time (tokens.py)
        try:
            if checks is None:
                model = await self.hub_auth.get_user(self, sync=False)
            else:
                model = await checks.check(self.request.headers.get("Authorization", ""), lambda: self.hub_auth.get_user(self, sync=False))
        except web.HTTPError as e:
            if e.status_code >= 500:  # the hub did not answer the token check
                raise HubUnavailable("cannot check the token with the hub right now; try again in a moment") from None
            raise
        if not model:
            return None
        try:
            return self.check_hub_user(model)  # the service's access scopes
        except UserNotAllowed:
            raise web.HTTPError(403, f"{model['kind']} {model['name']} may not use this service: it lacks the scope {' or '.join(sorted(self.hub_scopes))}") from None

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
            if status_code == 405:
                message = f"{self.request.method} is not allowed here; allowed: {', '.join(self.allowed_methods())}"
                self.set_header("Allow", ", ".join(self.allowed_methods()))
            elif status_code >= 500:
                message = "the broker failed to answer; the error is in its log"
            body = {"error": ERROR_NAMES.get(status_code, "Error"), "message": message}
        if status_code == 503:
            self.set_header("Retry-After", "1")  # stopping: its standby or the restarted broker answers within a second or so
        self.set_header("Content-Type", "application/json; charset=utf-8")
        self.finish(json.dumps(body))

    def allowed_methods(self) -> list[str]:
        return [m for m in ("GET", "POST", "DELETE") if getattr(type(self), m.lower()) is not getattr(web.RequestHandler, m.lower())]

    def _handle_request_exception(self, e: BaseException) -> None:
        manager = self.settings.get("gpulease_manager")
        if not isinstance(e, (LeaseError, web.HTTPError)) and manager is not None and manager.closed:
            # a call caught by the broker's stop (its store closed under it): the client retries
            self.log.info("%s %s during the broker's stop: %s", self.request.method, self.request.path, type(e).__name__)
            e = Unavailable(STOPPING)
        if isinstance(e, LeaseError):
            self.log.info("%s %s %s -> %s %s: %s", e.status, self.request.method, self.request.path, type(e).__name__, e.field or "-", e.message)
            self._reported = True
            if not self._finished:
                self.set_status(e.status)
                self.write_error(e.status, exc_info=(type(e), e, e.__traceback__))
            return
        super()._handle_request_exception(e)

    def json_body(self) -> dict[str, Any]:
        return inputs.parse_body(self.body, self.limits)

    @property
    def request_key(self) -> str | None:
        """The client's ``Idempotency-Key`` (a retried call sends the same one)."""
        key = self.request.headers.get("Idempotency-Key")
        if key is None:
            return None
        key = key.strip()
        if not key or len(key) > KEY_CHARS or not key.isascii() or not all(c.isalnum() or c in "-_." for c in key):
            raise BadRequest("'Idempotency-Key' must be 1 to 64 letters, digits, '-', '_' or '.'", field="Idempotency-Key")
        return scoped_key(self.caller_name, key)

    def query_number(self, name: str, default: Any, **kw) -> Any:
        raw = self.get_argument(name, None)
        if raw is None:
            return default
        return inputs.parse_number(raw, name, **kw)

    async def lease_for_caller(self, lease_id: str, *, live: bool = False) -> dict:
        """The committed lease, checked: 404 unknown, 403 someone else's, 409 (``live``) ended."""
        d = await self.manager.get(lease_id)
        self.check_owner(d)
        if live and d["state"] not in ("queued", "active"):
            raise Conflict(f"lease {lease_id} has already ended ({d['state']})", field="state")
        return d


class PoolHandler(APIHandler):
    """The pool; tiers and quota/usage of the caller, or (admins, ``?user=U``) of user U.

    Everyone sees the tiers open to them (a hub admin too: the tiers their own spawns may use);
    admins may add ``?all=true`` for every tier. U's groups: the ``group`` arguments when the
    caller passes any (the spawner does: it knows them), else the hub's user model (the
    broker's token needs ``read:users:groups``), else none.
    """

    repeatable_arguments = frozenset({"group"})

    async def get(self):
        user = self.get_argument("user", None)
        every = inputs.query_flag(self.get_argument("all", None), "all")
        if every and not self.is_admin:
            raise Forbidden(f"only callers with the {self.admin_scope} scope may list every tier", field="all")
        if user is not None and user != self.caller_name:
            if not user.strip() or len(user) > MAX_NAME_LEN:
                raise BadRequest("'user' must be a user name", field="user")
            if not self.is_admin:
                raise Forbidden(f"only callers with the {self.admin_scope} scope may see another user's tiers and quota", field="user")
            groups = tuple(self.get_arguments("group"))
            if not groups:
                groups = await self.hub_side.user_groups(user)
            name = user
        else:
            name, groups = self.caller_name, self.caller_groups
        m = self.manager
        out = m.pool()
        out.update(
            {
                "tiers": [t.to_dict() for t in m.tiers_for(name, groups, every=every)],
                "min_duration_s": m.policy.min_duration_s,
                "user": name,
                "usage": m.usage(name, groups),
            }
        )
        self.write_json(out)


class LeasesHandler(APIHandler):
    """``GET api/leases``: one page of a list (see :mod:`.listing`); ``POST``: a request."""

    async def get(self):
        state = self.get_argument("state", "live")
        if state not in STATE_FILTERS:
            raise BadRequest(f"'state' must be one of {', '.join(sorted(STATE_FILTERS))}, got {state!r}", field="state")
        user = self.get_argument("user", None)
        if user is not None and user != self.caller_name and not self.is_admin:
            raise Forbidden("only admins may list other users' leases", field="user")
        if user is None and not self.is_admin:
            user = self.caller_name
        # a larger limit (older clients asked for up to 100,000) is taken as the largest page
        limit = min(self.query_number("limit", LIST_LIMIT, integer=True, minimum=1, maximum=100_000), MAX_LIST_LIMIT)
        raw = self.get_argument("cursor", None)
        after = Cursor.decode(raw, state, user) if raw is not None else None
        leases, more = await self.manager.page(user=user, state=state, limit=limit, after=after)
        await self.write_page(leases, limit, more.encode(state, user) if more is not None else None)

    async def write_page(self, leases: list[dict], limit: int, next_cursor: str | None) -> None:
        """``{"leases": [...], "limit", "next_cursor"}``, written in slices of
        :data:`PAGE_SLICE` leases: the loop answers other calls between two of them, and no
        large answer is held whole in memory."""
        tail = f'], "limit": {limit}, "next_cursor": {json.dumps(next_cursor)}}}'
        if len(leases) <= PAGE_SLICE:
            self.finish('{"leases": [' + ", ".join(json.dumps(self.lease_json(d)) for d in leases) + tail)
            return
        self.write('{"leases": [')
        for i in range(0, len(leases), PAGE_SLICE):
            self.write((", " if i else "") + ", ".join(json.dumps(self.lease_json(d)) for d in leases[i:i + PAGE_SLICE]))
            try:
                await self.flush()
            except StreamClosedError:
                return  # the client went away
        self.finish(tail)

    async def post(self):
        body = self.json_body()
        if inputs.query_flag(self.get_argument("dry_run", None), "dry_run"):
            self.write_json(await estimate(self, body))
            return
        ask = ask_of(self, body)
        d = await self.manager.request(ask, actor=self.actor if ask.user == self.caller_name else f"admin:{self.caller_name}", key=self.request_key)
        self.set_header("Location", f"{self.request.path.rstrip('/')}/{d['id']}")
        self.write_json(self.lease_json(d), 201)



def ask_of(h: APIHandler, body: dict) -> Ask:
    """A lease request body as the caller may make it: core's :func:`parse_ask` (every field
    checked once), ``user``/``groups`` for admins only, ``meta`` within its size limit."""
    user, groups = h.caller_name, h.caller_groups
    if "user" in body or "groups" in body:
        if not h.is_admin:
            raise Forbidden(f"only callers with the {h.admin_scope} scope may request leases for another user", field="user" if "user" in body else "groups")
        if "user" in body:
            if not isinstance(body["user"], str) or not body["user"].strip() or len(body["user"].strip()) > MAX_NAME_LEN:
                raise BadRequest(f"'user' must be a user name (at most {MAX_NAME_LEN} characters)", field="user")
            user, groups = body["user"].strip(), ()
        if "groups" in body:
            g = body["groups"]
            if not isinstance(g, list) or len(g) > 1000 or not all(isinstance(x, str) and 0 < len(x) <= MAX_NAME_LEN for x in g):
                raise BadRequest("'groups' must be a list of group names", field="groups")
            groups = tuple(g)
    inputs.json_object(body, "meta", h.limits.meta_bytes)
    return parse_ask(body, user=user, groups=groups, also=("user", "groups"))


async def estimate(handler: APIHandler, body: dict) -> dict[str, Any]:
    """What a request would get now, without making it: start now, queued (position, ETA), or never."""
    try:
        ask = ask_of(handler, body)
    except Forbidden:
        raise  # acting for another user is refused, not estimated
    except LeaseError as e:
        return {"start": "never", "refused": {"field": e.field, "message": e.message}}
    return handler.manager.estimate(ask)


class EstimateHandler(APIHandler):
    """``POST api/estimate`` {"asks": [...]}: one estimate per ask (the spawn form's cards)."""

    async def post(self):
        body = self.json_body()
        asks = body.get("asks")
        if set(body) - {"asks"}:
            raise BadRequest("the body must be {\"asks\": [<lease request>, ...]}", field=sorted(set(body) - {"asks"})[0])
        if not isinstance(asks, list) or not all(isinstance(a, dict) for a in asks) or len(asks) > MAX_ESTIMATES:
            raise BadRequest(f"'asks' must be a list of at most {MAX_ESTIMATES} lease requests", field="asks")
        self.write_json({"estimates": [await estimate(self, a) for a in asks]})


class LeaseHandler(APIHandler):
    async def get(self, lease_id):
        self.write_json(self.lease_json(await self.lease_for_caller(lease_id)))

    async def delete(self, lease_id):
        await release(self, lease_id, {})


async def release(handler: APIHandler, lease_id: str, body: dict) -> None:
    """End a lease: queued -> withdrawn; active -> released (the holder, or a service such as
    the spawner acting for it), reclaimed (the holder's idle reclaim) or revoked (an admin)."""
    unknown = sorted(set(body) - RELEASE_FIELDS)
    if unknown:
        raise BadRequest(f"unknown field(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(sorted(RELEASE_FIELDS))}", field=unknown[0])
    reason = inputs.short_text(body, "reason", handler.limits.reason_chars)
    keep_server = inputs.flag(body, "keep_server")
    lease = await handler.lease_for_caller(lease_id)
    owner = lease["user"] == handler.caller_name
    service = handler.caller.get("kind") == "service"
    state = LeaseState.RELEASED if owner or service else LeaseState.REVOKED
    if "state" in body:
        allowed = {"released", "reclaimed", "revoked"}
        if not isinstance(body["state"], str) or body["state"] not in allowed:
            raise BadRequest(f"'state' must be one of {', '.join(sorted(allowed))}, got {body['state']!r}", field="state")
        if body["state"] == "revoked" and not handler.is_admin:
            raise Forbidden("only admins may revoke a lease", field="state")
        state = LeaseState(body["state"])
    actor = handler.actor if owner or service else f"admin:{handler.caller_name}"
    if "grace_s" in body:
        grace = body["grace_s"]
        if state is not LeaseState.REVOKED:
            raise BadRequest("a grace goes with an admin's revoke only (\"state\": \"revoked\")", field="grace_s")
        if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not 0 <= grace <= MAX_REVOKE_GRACE_S:
            raise BadRequest(f"'grace_s' must be a number of seconds from 0 to {MAX_REVOKE_GRACE_S}, got {grace!r}", field="grace_s")
        d = await handler.manager.revoke(lease_id, grace_s=float(grace), reason=reason or f"revoked by {handler.caller_name}",
                                         actor=actor, key=handler.request_key)
        handler.write_json(handler.lease_json(d))
        return
    d = await handler.manager.release(
        lease_id, state=state, reason=reason or f"released by {handler.caller_name}", actor=actor, keep_server=keep_server, key=handler.request_key
    )
    handler.write_json(handler.lease_json(d))


class LeaseActionHandler(APIHandler):
    """``POST api/leases/{id}/{extend|release|confirm|heartbeat}``; other methods are 405."""

    async def post(self, lease_id, action):
        body = self.json_body()
        if action == "release":
            return await release(self, lease_id, body)
        if action == "heartbeat":
            usage = inputs.json_object(body, "usage", self.limits.usage_bytes) if "usage" in body else None
            await self.lease_for_caller(lease_id)
            d = await self.manager.heartbeat(lease_id, usage)
            out = self.lease_json(d)
            out["warnings"] = self.manager.warnings(d)
            self.write_json(out)
            return
        await self.lease_for_caller(lease_id, live=True)
        if action == "extend":
            unknown = sorted(set(body) - {"by_s", "until"})
            if unknown:
                raise BadRequest(f"unknown field(s) {', '.join(map(repr, unknown))}; allowed: by_s, until", field=unknown[0])
            by_s = inputs.optional_number(body, "by_s", above=0, unit="seconds")
            until = inputs.optional_number(body, "until", above=0, unit="seconds since the epoch")
            if (by_s is None) == (until is None):
                raise BadRequest("give exactly one of 'by_s' (seconds) or 'until' (epoch seconds)", field="by_s")
            d = await self.manager.extend(lease_id, by_s=by_s, until=until, actor=self.actor, key=self.request_key)
        else:  # confirm; the route lets only the four actions through
            d = await self.manager.confirm(lease_id, actor=self.actor, key=self.request_key)
        self.write_json(self.lease_json(d))


class QueueHandler(APIHandler):
    """The queue in scheduling order. Admins see every entry; others see their own whole and,
    of everyone else's, only what a position needs: place, tier and size of the request."""

    async def get(self):
        out = []
        for i, d in enumerate(self.manager.queue(), 1):
            if self.is_admin or d["user"] == self.caller_name:
                out.append(self.lease_json(d))
            else:
                q = self.manager.queue_info(d) or {}
                out.append({"user": "…", "tier": d["tier"], "request": d["request"], "state": "queued", "queue": {"position": q.get("position", i), "length": q.get("length"), "eta": q.get("eta")}})
        self.write_json({"queue": out})


class DrainHandler(APIHandler):
    """``GET api/drain``: whether the broker grants; ``POST api/drain`` {"drain": bool}: stop or
    resume granting (admins; the hub's shutdown stops grants before it stops servers)."""

    async def get(self):
        self.write_json({"draining": self.manager.draining})

    async def post(self):
        if not self.is_admin:
            raise Forbidden(f"only callers with the {self.admin_scope} scope may stop or resume grants", field="drain")
        body = self.json_body()
        if set(body) - {"drain"} or "drain" not in body:
            raise BadRequest("the body must be {\"drain\": true} or {\"drain\": false}", field="drain")
        await self.manager.set_draining(inputs.flag(body, "drain"), actor=self.actor)
        self.write_json({"draining": self.manager.draining})


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
        return inputs.parse_number(raw, "since", integer=True, minimum=0, maximum=MAX_EVENT_ID)

    def _subscribe(self, user, lease_id):
        try:
            return self.manager.feed.subscribe(user, lease_id, capped=not self.is_admin)
        except TooManyStreams as e:
            self.set_status(429)
            raise _TooMany(e.message, field="stream") from None

    async def get(self):
        if self.get_argument("since", None) == "latest":
            # where to follow from without replaying history: no events, the newest committed id
            await self._filters()
            self.write_json({"events": [], "last_id": self.manager.last_event_id})
            return
        since = self._since()
        timeout = self.query_number("timeout", 30.0, minimum=0, maximum=MAX_POLL_S, unit="seconds")
        limit = self.query_number("limit", 500, integer=True, minimum=1, maximum=5000)
        lease_id, user = await self._filters()
        events = await self.manager.events_since(since, lease_id=lease_id, user=user, limit=limit)
        if not events and timeout > 0:
            with self._subscribe(user, lease_id) as sub:
                # what was committed between the read above and the subscription
                events = await self.manager.events_since(since, lease_id=lease_id, user=user, limit=limit)
                if not events and await sub.wait(timeout):
                    events = sub.take(since)[:limit]
        last = events[-1]["id"] if events else since
        self.write_json({"events": events, "last_id": last})


def _raise(e: BaseException) -> None:
    raise e


class HubUnavailable(LeaseError):
    status = 503


class _TooMany(LeaseError):
    status = 429


class EventStreamHandler(EventsHandler):
    """Server-sent events: the same payloads as the long-poll feed, one ``data:`` line each.

    A client that reads too slowly is sent ``event: dropped`` with the reason, and the stream
    ends; it reconnects with ``Last-Event-ID`` and catches up."""

    def set_default_headers(self):
        self.set_header("Content-Type", "text/event-stream")
        self.set_header("Cache-Control", "no-cache")
        self.set_header("X-Accel-Buffering", "no")

    def on_connection_close(self):
        super().on_connection_close()
        sub = getattr(self, "_sub", None)
        if sub is not None:
            sub.drop("the client went away")

    def _send(self, events) -> int:
        last = 0
        for e in events:
            self.write(f"id: {e['id']}\nevent: {e['kind']}\ndata: {json.dumps(e)}\n\n")
            last = e["id"]
        return last

    async def get(self):
        since = self._since()
        lease_id, user = await self._filters()
        keepalive = float(self.settings.get("gpulease_sse_keepalive", 15))
        self._sub = sub = self._subscribe(user, lease_id)
        try:
            self.write(": connected\n\n")
            while True:  # catch up from memory or the store, then follow the subscription
                events = await self.manager.events_since(since, lease_id=lease_id, user=user, limit=1000)
                if not events:
                    break
                since = self._send(events) or since
                await self.flush()
            await self.flush()
            while True:
                if not await sub.wait(keepalive):
                    self.write(": keepalive\n\n")
                    await self.flush()
                    continue
                if sub.dropped:
                    if sub.dropped != "the client went away":
                        self.write(f"event: dropped\ndata: {json.dumps({'reason': sub.dropped, 'last_id': since})}\n\n")
                    break
                since = self._send(sub.take(since)) or since
                await self.flush()
        except StreamClosedError:
            pass
        finally:
            sub.close()
        if not self._finished:
            try:
                self.finish()
            except StreamClosedError:
                pass


class OpenAPIHandler(APIHandler):
    needs_token = False  # the description of the API is public

    def get(self):
        self.write_json(self.settings["gpulease_openapi"])


class MetricsHandler(APIHandler):
    @property
    def needs_token(self) -> bool:
        return bool(self.settings.get("gpulease_authenticate_metrics", True))

    async def get(self):
        from prometheus_client import CONTENT_TYPE_LATEST

        if self.needs_token:
            scope = self.settings.get("gpulease_metrics_scope", "custom:gpulease:metrics")
            if not self.is_admin and scope not in set((self.current_user or {}).get("scopes") or ()):
                raise Forbidden(f"reading the metrics needs the scope {scope} (or {self.admin_scope}): they name every lease and "
                                "each group's use; give it to the hub service whose token Prometheus sends")
        body = await self.settings["gpulease_metrics"].render()
        self.set_header("Content-Type", CONTENT_TYPE_LATEST)
        self.finish(body)


class NotFoundHandler(APIHandler):
    """Any other path under ``api/``: a JSON 404 (after authentication, so it reveals nothing)."""

    async def get(self, *args):
        raise NotFound(f"no API endpoint {self.request.path}")

    post = delete = get


def api_handlers(prefix: str) -> list[tuple]:
    """Routes of the REST API under the service ``prefix`` (which starts and ends with '/')."""
    p = prefix
    lease_id = LEASE_ID_ROUTE
    return [
        (p + r"api/pool/?", PoolHandler),
        (p + r"api/leases/?", LeasesHandler),
        (p + r"api/estimate/?", EstimateHandler),
        (p + rf"api/leases/{lease_id}/?", LeaseHandler),
        (p + rf"api/leases/{lease_id}/(extend|release|confirm|heartbeat)/?", LeaseActionHandler),
        (p + r"api/queue/?", QueueHandler),
        (p + r"api/drain/?", DrainHandler),
        (p + r"api/events/?", EventsHandler),
        (p + r"api/events/stream/?", EventStreamHandler),
        (p + r"api/openapi.json", OpenAPIHandler),
        (p + r"metrics/?", MetricsHandler),
        (p + r"api/(.*)", NotFoundHandler),
    ]

