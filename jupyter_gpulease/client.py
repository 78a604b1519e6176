"""The one HTTP client of the project: every call to the lease broker and to the Hub API.

Used by the spawner, the server extension, the kernel magics, the command line and the
broker itself (for its Hub-API calls). It does not import jupyterhub (single-user images may
not have it); only tornado.

Retries: a call that could not reach its server (connection refused or reset, a timeout) or
got 502/503/504 (a proxy whose service is restarting, the broker's own ``{"error":
"Unavailable"}`` while it stops, the hub's proxy's JSON or HTML page) is tried again with
exponential back-off (0.1 s, 0.2 s, 0.4 s … at most 5 s apart, with jitter; no sooner than a
``Retry-After`` the answer asks for) until its ``retry_for`` deadline. That carries clients
through a broker restart or a standby's take-over. Calls that change something are retried
only when they carry an ``Idempotency-Key`` header, which every :class:`BrokerClient` write
sends: the broker answers a repeated key with the result of the first call, so a retry after a
lost answer never makes a second lease or a second extension. A caller that may send a create
again itself, after the client gave up (the broker away longer than ``retry_for``), passes its
own key (``request_lease(body, key=...)``) and sends the same one again.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import quote, urlencode, urlsplit, urlunsplit

from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest

SERVICE_NAME = "gpulease"
RETRY_STATUSES = frozenset({502, 503, 504})
LIST_PAGE_MAX = 2000  # the most leases the broker answers in one page of a list


class BrokerError(Exception):
    """The server said no (``status`` 400/401/403/404/409/…), or could not be reached (``status`` 0).

    ``message`` is meant for a person; ``field`` names the request field at fault when there
    is one.
    """

    def __init__(self, status: int, message: str, field: str | None = None, error: str = ""):
        super().__init__(f"{status}: {message}" if status else message)
        self.status = status
        self.message = message
        self.field = field
        self.error = error



@dataclass(frozen=True)
class Backoff:
    """The project's one retry back-off: delays of ``first`` seconds growing by ``factor`` up to
    ``cap``, each shortened at random by up to half (jitter, so that clients do not retry in
    step); ``retry_for``: how long :func:`fetch_json` keeps retrying one call in all.

    A retry loop takes ``delays = backoff.delays()`` and ``next(delays)`` before each wait, and
    starts over with a fresh ``backoff.delays()`` once a try succeeds (the hub's long-running
    loops do)."""

    retry_for: float = 30.0
    first: float = 0.1
    factor: float = 2.0
    cap: float = 5.0

    def delays(self) -> Iterator[float]:
        d = self.first
        while True:
            yield d * random.uniform(0.5, 1.0)
            d = min(self.cap, d * self.factor)


NO_RETRY = Backoff(retry_for=0)


def join_url(base: str, path: str) -> str:
    """``path`` under ``base`` with one slash between them (``base`` is a URL or a URL path)."""
    return base.rstrip("/") + "/" + path.lstrip("/")


def _parse(body: bytes) -> Any:
    if not body:
        return None
    try:
        return json.loads(body)
    except ValueError:
        return None


async def fetch_json(
    method: str,
    url: str,
    *,
    token: str = "",
    body: Any = None,
    headers: dict[str, str] | None = None,
    timeout: float = 30.0,
    backoff: Backoff = Backoff(),
    what: str = "the server",
    http_client: AsyncHTTPClient | None = None,
) -> tuple[int, Any, dict[str, str]]:
    """One HTTP call with JSON in and out, retried as the module doc says.

    Returns ``(status, parsed JSON or None, response headers)`` for 2xx/3xx answers; raises
    :class:`BrokerError` for 4xx/5xx (the server's ``message``/``field``/``error`` when it sent
    JSON) and with status 0 when ``what`` could not be reached within ``backoff.retry_for``.
    ``http_client``: the tornado client to send with (default: the process-wide one).
    """
    hdrs = {"Accept": "application/json", **(headers or {})}
    if token:
        hdrs["Authorization"] = f"token {token}"
    data = None
    if body is not None:
        hdrs["Content-Type"] = "application/json"
        data = json.dumps(body)
    elif method in ("POST", "PUT", "PATCH"):
        data = ""
    safe = method in ("GET", "HEAD", "OPTIONS", "DELETE") or "Idempotency-Key" in hdrs
    deadline = time.monotonic() + backoff.retry_for
    delays = backoff.delays()
    while True:
        req = HTTPRequest(
            url,
            method=method,
            headers=hdrs,
            body=data,
            request_timeout=timeout,
            connect_timeout=min(10.0, timeout),
            follow_redirects=False,
            allow_nonstandard_methods=True,
        )
        try:
            resp = await (http_client or AsyncHTTPClient()).fetch(req)
            return resp.code, _parse(resp.body), dict(resp.headers)
        except HTTPClientError as e:
            if e.code in (301, 302, 303, 307, 308) and e.response is not None:
                return e.code, None, dict(e.response.headers)
            retryable = e.code == 599 or e.code in RETRY_STATUSES
            error = _error(e, url, what)
            wait = _retry_after(e.response, backoff.cap) if retryable else 0.0
        except OSError as e:
            retryable = True
            error = BrokerError(0, f"cannot reach {what} at {_base(url)}: {e}")
            wait = 0.0
        # a timeout (599) of a call that changes something may have been carried out: retry
        # only with an idempotency key
        if not retryable or not (safe or error.status in (502, 503) or _refused(error)):
            raise error
        delay = max(next(delays), wait)
        if time.monotonic() + delay > deadline:
            raise error
        await asyncio.sleep(delay)


def new_request_key(kind: str) -> str:
    """A fresh ``Idempotency-Key`` for one create, naming its kind of caller (``"spawn"``,
    ``"server"``): sent again with the same create, it gets the lease the first one made."""
    return f"{kind}-{uuid.uuid4().hex}"


def _retry_after(resp, cap: float) -> float:
    """The seconds an answer's ``Retry-After`` asks to wait (at most ``cap``; 0: none, or a date)."""
    raw = resp.headers.get("Retry-After", "") if resp is not None else ""
    try:
        return min(cap, max(0.0, float(raw)))
    except ValueError:
        return 0.0


def _refused(error: BrokerError) -> bool:
    # nothing was sent when the connection was refused: always safe to retry
    return error.status == 0 and ("refused" in error.message.lower() or "errno 111" in error.message.lower())


def _base(url: str) -> str:
    p = urlsplit(url)
    return urlunsplit((p.scheme, p.netloc, p.path, "", ""))


def _error(e: HTTPClientError, url: str, what: str) -> BrokerError:
    if e.code == 599:
        return BrokerError(0, f"cannot reach {what} at {_base(url)}: {e.message}")
    resp = e.response
    d = _parse(resp.body if resp is not None else b"")
    if not isinstance(d, dict):
        d = {}
    message = d.get("message") or (resp.reason if resp is not None else "") or str(e)
    return BrokerError(e.code, message, d.get("field"), d.get("error", ""))


def default_broker_url(env: dict[str, str] | None = None) -> str:
    """Where the broker is, from the environment.

    1. ``GPULEASE_BROKER_URL`` (the full base URL, prefix included);
    2. inside the broker's own process (a hub service): ``JUPYTERHUB_SERVICE_URL`` + prefix;
    3. the hub's public URL (``JUPYTERHUB_PUBLIC_HUB_URL``, or the host of ``JUPYTERHUB_API_URL``)
       + ``services/gpulease/``.
    Empty when none of these is set.
    """
    env = os.environ if env is None else env
    if env.get("GPULEASE_BROKER_URL"):
        return env["GPULEASE_BROKER_URL"]
    if env.get("JUPYTERHUB_SERVICE_NAME") == SERVICE_NAME and env.get("JUPYTERHUB_SERVICE_URL"):
        return join_url(env["JUPYTERHUB_SERVICE_URL"], env.get("JUPYTERHUB_SERVICE_PREFIX", "/"))
    for var in ("JUPYTERHUB_PUBLIC_HUB_URL", "JUPYTERHUB_API_URL"):
        url = env.get(var)
        if url:
            parts = urlsplit(url)
            base = env.get("JUPYTERHUB_BASE_URL", "/")
            return urlunsplit((parts.scheme, parts.netloc, join_url(base, f"services/{SERVICE_NAME}/"), "", ""))
    return ""


class BrokerClient:
    """Async client of the broker's REST API (see the README's API summary).

    ``retry_for``: seconds to keep retrying a call through a broker restart or hand-over
    (0: one try). ``http_client``: the tornado client to send with; default: the process-wide
    ``AsyncHTTPClient()``, which holds 10 connections for everything in the process. A caller
    that keeps long-polls open or makes many calls at once (the hub) passes its own
    (``AsyncHTTPClient(force_instance=True, max_clients=...)``).
    """

    def __init__(self, url: str, token: str, *, timeout: float = 30, retry_for: float = 30.0,
                 http_client: AsyncHTTPClient | None = None):
        if not url:
            raise BrokerError(0, "no broker URL: set GPULEASE_BROKER_URL (e.g. http://127.0.0.1:8000/services/gpulease/)")
        self.url = url if url.endswith("/") else url + "/"
        self.token = token
        self.timeout = timeout
        self.backoff = Backoff(retry_for=retry_for)
        self.http_client = http_client

    @classmethod
    def from_env(cls, **kw) -> BrokerClient:
        token = os.environ.get("GPULEASE_TOKEN") or os.environ.get("JUPYTERHUB_API_TOKEN", "")
        return cls(default_broker_url(), token, **kw)

    def __repr__(self) -> str:
        return f"BrokerClient({self.url!r})"

    async def _call(self, method: str, path: str, body: Any = None, *, query: dict | None = None, timeout: float | None = None,
                    retry_for: float | None = None, key: str | None = None) -> Any:
        url = join_url(self.url, path)
        if query:
            q = {k: v for k, v in query.items() if v is not None}
            if q:
                url += "?" + urlencode(q)
        headers = {}
        if method == "POST":
            headers["Idempotency-Key"] = key or uuid.uuid4().hex  # one per call (or the caller's), the same for its retries
        status, data, resp_headers = await fetch_json(
            method, url, token=self.token, body=body, headers=headers, timeout=timeout or self.timeout,
            backoff=self.backoff if retry_for is None else replace(self.backoff, retry_for=min(retry_for, self.backoff.retry_for)), what="the lease broker",
            http_client=self.http_client,
        )
        if 300 <= status < 400:
            raise self._redirected(resp_headers.get("Location", ""))
        if data is None and status != 204:
            raise BrokerError(status, f"{self.url} answered without JSON: it does not look like the lease broker's API (the URL ends in /services/{SERVICE_NAME}/)")
        return data

    def _redirected(self, location: str) -> BrokerError:
        if "/hub/login" in location or "oauth" in location:
            if f"/services/{SERVICE_NAME}" in self.url:
                return BrokerError(401, "the broker sent the call to the hub's login page: the token was missing or refused")
            return BrokerError(
                400, f"{self.url} is not the lease broker's API but a page that needs a browser login (it sent the call to {location}); "
                f"the broker's URL ends in /services/{SERVICE_NAME}/, e.g. {join_url(self.url, f'services/{SERVICE_NAME}/')}"
            )
        return BrokerError(400, f"{self.url} redirected the call to {location}: it is not the lease broker's API (the URL ends in /services/{SERVICE_NAME}/)")

    # ------------------------------------------------------------------ the API
    async def pool(self, user: str | None = None, groups: list[str] | tuple[str, ...] | None = None, *, every_tier: bool = False) -> dict:
        """The pool, with the tiers and quota/usage of the caller, or (admins) of ``user``.

        ``groups``: ``user``'s groups, when the caller knows them (the spawner does); without
        them the broker asks the hub for them. ``every_tier``: admins see every tier, not only
        those open to the user.
        """
        query = [("user", user)] if user is not None else []
        query += [("group", g) for g in (groups or ())]
        if every_tier:
            query.append(("all", "true"))
        return await self._call("GET", "api/pool" + ("?" + urlencode(query) if query else ""))

    async def request_lease(self, body: dict, *, key: str | None = None) -> dict:
        """Ask for a lease (``body``: see ``POST api/leases``). ``key``: the call's
        ``Idempotency-Key`` (1-64 letters, digits, ``-``, ``_``, ``.``; default: a new one);
        sent again, the same key gets the lease the first call made, never a second one."""
        return await self._call("POST", "api/leases", body, key=key)

    async def get_lease(self, lease_id: str) -> dict:
        return await self._call("GET", f"api/leases/{quote(lease_id, safe='')}")

    async def list_leases(self, state: str | None = None, user: str | None = None, limit: int | None = None) -> list[dict]:
        """Leases by state ('live' by default: oldest first; ended ones newest first; 'all': the
        live ones, then the ended ones), every page of them: the broker answers a list a page at
        a time and this follows its ``next_cursor`` to the end. ``limit``: at most this many
        (ended histories are long: the CLI passes one). A lease that ends while the pages of
        'all' are read is listed once, as it was last seen."""
        found: dict[str, dict] = {}
        cursor = None
        while True:  # (a limit the broker refuses, such as 0, is its 400 to answer)
            page_size = min(limit - len(found), LIST_PAGE_MAX) if limit is not None else None
            data = await self._call("GET", "api/leases", query={"state": state, "user": user, "limit": page_size, "cursor": cursor})
            for lease in data["leases"]:
                found[lease["id"]] = lease
            cursor = data.get("next_cursor")
            if not cursor or (limit is not None and len(found) >= limit):  # the last page (or a broker that answers lists whole)
                break
        out = list(found.values())
        return out[:limit] if limit is not None else out

    async def extend(self, lease_id: str, *, by_s: float | None = None, until: float | None = None) -> dict:
        body: dict[str, Any] = {}
        if by_s is not None:
            body["by_s"] = by_s
        if until is not None:
            body["until"] = until
        return await self._call("POST", f"api/leases/{quote(lease_id, safe='')}/extend", body)

    async def release(self, lease_id: str, reason: str = "", state: str | None = None, *, keep_server: bool = False) -> dict:
        """End a lease: queued -> withdrawn, active -> ``state``: 'released' (default: the
        holder's own release, also when an admin service such as the spawner acts for it),
        'reclaimed' (the holder's idle reclaim) or 'revoked' (admins). ``keep_server``: the
        holder's server keeps running without GPUs (the spawner does not stop it)."""
        body: dict[str, Any] = {"reason": reason}
        if state is not None:
            body["state"] = state
        if keep_server:
            body["keep_server"] = True
        return await self._call("POST", f"api/leases/{quote(lease_id, safe='')}/release", body)

    async def confirm(self, lease_id: str) -> dict:
        return await self._call("POST", f"api/leases/{quote(lease_id, safe='')}/confirm", {})

    async def heartbeat(self, lease_id: str, usage: dict | None = None, *, retry_for: float | None = None) -> dict:
        """Report usage; the answer is the lease (its state, ``end_message`` once it ended) with
        ``warnings`` (coming preemption, near expiry, the end).

        ``retry_for``: retry this one heartbeat at most so long (at most the client's own
        ``retry_for``); a sender with its own loop passes its interval, so that a broker that is
        away shows as failed heartbeats rather than one heartbeat hanging."""
        return await self._call("POST", f"api/leases/{quote(lease_id, safe='')}/heartbeat", {"usage": usage or {}}, retry_for=retry_for)

    async def estimate(self, asks: list[dict]) -> list[dict]:
        """What each ask (a body of ``POST api/leases``) would get now, without asking: one estimate per ask, in order."""
        return (await self._call("POST", "api/estimate", {"asks": list(asks)}))["estimates"]

    async def queue(self) -> list[dict]:
        return (await self._call("GET", "api/queue"))["queue"]

    async def drain(self, drain: bool = True) -> bool:
        """Admins: stop (or resume) granting leases; queued leases stay queued. Returns whether
        the broker now drains."""
        return (await self._call("POST", "api/drain", {"drain": drain}))["draining"]

    async def unleased(self) -> dict:
        """The caller's unleased GPU use: ``findings`` and the ``warnings`` its server shows."""
        return await self._call("GET", "api/unleased", retry_for=0)

    async def usage_report(self, **query: str) -> dict:
        """The usage report (``GET api/usage``; ``since``, ``from``, ``to``, ``by``, ``user`` as the API takes them)."""
        return await self._call("GET", "api/usage", query=query)

    async def usage_suggestions(self, user: str | None = None) -> list[dict]:
        """Right-sizing suggestions (``GET api/usage/suggestions``): the caller's, or (admins) ``user``'s."""
        data = await self._call("GET", "api/usage/suggestions", query={"user": user}, retry_for=0)
        return data.get("suggestions") or [] if isinstance(data, dict) else list(data or [])

    async def health(self) -> dict:
        """Cordoned GPUs and nodes (with their reasons) and the maintenance windows to come."""
        return await self._call("GET", "api/health")

    async def cordon(self, kind: str, name: str, reason: str, *, drain: bool = False) -> dict:
        """Admins: no new grants on a GPU (``kind='device'``, its UUID) or a node (``drain``: and move its holders)."""
        return await self._call("POST", "api/health/cordon", {"kind": kind, "name": name, "reason": reason, "drain": drain})

    async def uncordon(self, kind: str, name: str) -> dict:
        return await self._call("POST", "api/health/uncordon", {"kind": kind, "name": name})

    async def add_maintenance(self, *, start: float | str, end: float | str, reason: str, devices: list[str] = (), nodes: list[str] = ()) -> dict:
        """Admins: a maintenance window (times: epoch seconds or ISO 8601 with a zone)."""
        return await self._call("POST", "api/maintenance", {"start": start, "end": end, "reason": reason, "devices": list(devices), "nodes": list(nodes)})

    async def delete_maintenance(self, window_id: str) -> dict:
        return await self._call("DELETE", f"api/maintenance/{window_id}")

    async def bookings(self, user: str | None = None, *, pool: str | None = None, start: float | str | None = None, end: float | str | None = None) -> list[dict]:
        """Bookings, soonest first: the caller's own, or (admins) everyone's or ``user``'s; ``pool``: on
        GPUs of that model (a glob); ``start``/``end``: overlapping that window."""
        data = await self._call("GET", "api/bookings", query={"user": user, "pool": pool, "from": start, "to": end})
        return data["bookings"]

    async def get_booking(self, booking_id: str) -> dict:
        return await self._call("GET", f"api/bookings/{quote(booking_id, safe='')}")

    async def book(self, *, start: float | str, end: float | str, request: dict, users: list[str] | None = None,
                   groups: list[str] | None = None, title: str = "") -> dict:
        """Book GPUs ahead (``request``: as ``POST api/leases`` takes it, e.g. ``{"gpus": 2, "model": "A100*"}``;
        times: epoch seconds or ISO 8601 with a zone). ``users``/``groups``: admins, for others."""
        body: dict[str, Any] = {"start": start, "end": end, "request": request}
        if users:
            body["users"] = list(users)
        if groups:
            body["groups"] = list(groups)
        if title:
            body["title"] = title
        return await self._call("POST", "api/bookings", body)

    async def unbook(self, booking_id: str) -> dict:
        """End a booking now (its owner or an admin)."""
        return await self._call("DELETE", f"api/bookings/{quote(booking_id, safe='')}")

    async def events(self, since: int | str = 0, lease_id: str | None = None, timeout: float = 30) -> dict:
        """Long-poll: events after ``since``; waits up to ``timeout`` s for the first one.
        ``since="latest"``: none, at once, with ``last_id`` the newest id (where to follow from)."""
        return await self._call(
            "GET",
            "api/events",
            query={"since": since if since == "latest" else int(since), "lease": lease_id, "timeout": timeout},
            timeout=max(self.timeout, timeout + 15),
        )


class HubClient:
    """The Hub REST API (``JUPYTERHUB_API_URL``) with a service's token, through :func:`fetch_json`."""

    def __init__(self, api_url: str, token: str, *, timeout: float = 30, retry_for: float = 10.0):
        self.api_url = api_url.rstrip("/") + "/"
        self.token = token
        self.timeout = timeout
        self.backoff = Backoff(retry_for=retry_for)

    async def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        """(status, JSON) of a Hub API call; BrokerError (status 0: no answer) on failure."""
        status, data, _ = await fetch_json(method, join_url(self.api_url, path), token=self.token, body=body, timeout=self.timeout, backoff=self.backoff, what="the hub")
        return status, data

    async def user(self, name: str) -> dict | None:
        """The hub's model of user ``name`` (with ``servers`` and ``groups``); None if there is none."""
        try:
            return (await self.call("GET", f"users/{quote(name, safe='')}"))[1]
        except BrokerError as e:
            if e.status == 404:
                return None
            raise

    async def groups(self) -> list[str]:
        """Names of every group on the hub (needs ``read:groups``)."""
        names: list[str] = []
        offset = 0
        while True:
            _, page = await self.call("GET", f"groups?offset={offset}&limit=200")
            items = page.get("items", []) if isinstance(page, dict) else (page or [])
            names += [g["name"] for g in items if isinstance(g, dict) and "name" in g]
            if len(items) < 200:
                return names
            offset += len(items)

    async def stop_server(self, user: str, server: str = "") -> int:
        path = f"users/{quote(user, safe='')}/servers/{quote(server, safe='')}" if server else f"users/{quote(user, safe='')}/server"
        return (await self.call("DELETE", path))[0]
