"""The broker's HTTP client: the one module that talks to the lease broker over HTTP.

Used by the spawner, the server extension, the kernel magics and the command line. It does
not import jupyterhub (single-user images may not have it); only tornado.
"""

from __future__ import annotations

import json
import os
from typing import Any
from urllib.parse import urlencode, urlsplit, urlunsplit

from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest

SERVICE_NAME = "gpulease"


class BrokerError(Exception):
    """The broker said no (``status`` 400/401/403/404/409), or could not be reached (``status`` 0).

    ``message`` is the broker's own words, meant for a person; ``field`` names the request
    field at fault when there is one.
    """

    def __init__(self, status: int, message: str, field: str | None = None, error: str = ""):
        super().__init__(f"{status}: {message}" if status else message)
        self.status = status
        self.message = message
        self.field = field
        self.error = error


def _join(base: str, path: str) -> str:
    return base.rstrip("/") + "/" + path.lstrip("/")


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
        return _join(env["JUPYTERHUB_SERVICE_URL"], env.get("JUPYTERHUB_SERVICE_PREFIX", "/"))
    for var in ("JUPYTERHUB_PUBLIC_HUB_URL", "JUPYTERHUB_API_URL"):
        url = env.get(var)
        if url:
            parts = urlsplit(url)
            base = env.get("JUPYTERHUB_BASE_URL", "/")
            return urlunsplit((parts.scheme, parts.netloc, _join(base, f"services/{SERVICE_NAME}/"), "", ""))
    return ""


class BrokerClient:
    """Async client of the broker's REST API (see the README's API summary)."""

    def __init__(self, url: str, token: str, *, timeout: float = 30):
        if not url:
            raise BrokerError(0, "no broker URL: set GPULEASE_BROKER_URL (e.g. http://127.0.0.1:8000/services/gpulease/)")
        self.url = url if url.endswith("/") else url + "/"
        self.token = token
        self.timeout = timeout

    @classmethod
    def from_env(cls) -> BrokerClient:
        token = os.environ.get("GPULEASE_TOKEN") or os.environ.get("JUPYTERHUB_API_TOKEN", "")
        return cls(default_broker_url(), token)

    def __repr__(self) -> str:
        return f"BrokerClient({self.url!r})"

    async def _call(self, method: str, path: str, body: Any = None, *, query: dict | None = None, timeout: float | None = None) -> Any:
        url = _join(self.url, path)
        if query:
            q = {k: v for k, v in query.items() if v is not None}
            if q:
                url += "?" + urlencode(q)
        headers = {"Accept": "application/json"}
        if self.token:
            headers["Authorization"] = f"token {self.token}"
        data = None
        if body is not None:
            headers["Content-Type"] = "application/json"
            data = json.dumps(body)
        elif method in ("POST", "PUT", "PATCH"):
            data = ""
        req = HTTPRequest(
            url,
            method=method,
            headers=headers,
            body=data,
            request_timeout=timeout or self.timeout,
            connect_timeout=min(10.0, self.timeout),
            follow_redirects=False,
            allow_nonstandard_methods=True,
        )
        try:
            resp = await AsyncHTTPClient().fetch(req)
        except HTTPClientError as e:
            raise self._error(e) from None
        except OSError as e:
            raise BrokerError(0, f"cannot reach the lease broker at {self.url}: {e}") from None
        if not resp.body:
            return None
        return json.loads(resp.body)

    def _error(self, e: HTTPClientError) -> BrokerError:
        if e.code == 599:
            return BrokerError(0, f"cannot reach the lease broker at {self.url}: {e.message}")
        body = e.response.body if e.response is not None else b""
        try:
            d = json.loads(body or b"{}")
        except ValueError:
            d = {}
        if not isinstance(d, dict):
            d = {}
        message = d.get("message") or (e.response.reason if e.response is not None else "") or str(e)
        if e.code in (301, 302, 303, 307):
            message = "the broker asked to log in: the token was missing or refused"
        return BrokerError(e.code, message, d.get("field"), d.get("error", ""))

    # ------------------------------------------------------------------ the API
    async def pool(self, user: str | None = None, groups: list[str] | tuple[str, ...] | None = None) -> dict:
        """The pool, with the tiers and quota/usage of the caller, or (admins) of ``user``.

        ``groups``: ``user``'s groups, when the caller knows them (the spawner does); without
        them the broker asks the hub for them.
        """
        if user is None:
            return await self._call("GET", "api/pool")
        query = [("user", user)] + [("group", g) for g in (groups or ())]
        return await self._call("GET", "api/pool?" + urlencode(query))

    async def request_lease(self, body: dict) -> dict:
        return await self._call("POST", "api/leases", body)

    async def get_lease(self, lease_id: str) -> dict:
        return await self._call("GET", f"api/leases/{lease_id}")

    async def list_leases(self, state: str | None = None, user: str | None = None, limit: int | None = None) -> list[dict]:
        """Leases by state ('live' by default; 'ended' and 'all' list at most ``limit`` ended ones, newest first)."""
        return (await self._call("GET", "api/leases", query={"state": state, "user": user, "limit": limit}))["leases"]

    async def extend(self, lease_id: str, *, by_s: float | None = None, until: float | None = None) -> dict:
        body: dict[str, Any] = {}
        if by_s is not None:
            body["by_s"] = by_s
        if until is not None:
            body["until"] = until
        return await self._call("POST", f"api/leases/{lease_id}/extend", body)

    async def release(self, lease_id: str, reason: str = "", state: str | None = None) -> dict:
        """End a lease: queued -> withdrawn, active -> ``state`` (default 'released'; the holder's
        own release, also when an admin such as the spawner acts for the holder), or 'revoked' /
        'reclaimed' (admins)."""
        body: dict[str, Any] = {"reason": reason}
        if state is not None:
            body["state"] = state
        return await self._call("POST", f"api/leases/{lease_id}/release", body)

    async def confirm(self, lease_id: str) -> dict:
        return await self._call("POST", f"api/leases/{lease_id}/confirm", {})

    async def heartbeat(self, lease_id: str, usage: dict | None = None) -> dict:
        return await self._call("POST", f"api/leases/{lease_id}/heartbeat", {"usage": usage or {}})

    async def estimate(self, asks: list[dict]) -> list[dict]:
        """What each ask (a body of ``POST api/leases``) would get now, without asking: one estimate per ask, in order."""
        return (await self._call("POST", "api/estimate", {"asks": list(asks)}))["estimates"]

    async def queue(self) -> list[dict]:
        return (await self._call("GET", "api/queue"))["queue"]

    async def events(self, since: int = 0, lease_id: str | None = None, timeout: float = 30) -> dict:
        """Long-poll: events after ``since``; waits up to ``timeout`` s for the first one."""
        return await self._call(
            "GET",
            "api/events",
            query={"since": int(since), "lease": lease_id, "timeout": timeout},
            timeout=max(self.timeout, timeout + 15),
        )
