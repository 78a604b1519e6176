"""REST and live feed under ``{base_url}gpulease/api/`` (see docs/server-api.md for the JSON).

Authenticated and authorized like every jupyter_server handler (the server's token or the
user's login cookie; on JupyterHub, only the server's owner and those the hub allows).
Errors are ``{"error", "message", "field"}`` with the status a person can act on: 400 for a
bad request, 409 for a state that does not allow it, 502 when the broker cannot be reached;
the broker's own refusals keep their status and words.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

from jupyter_server.auth.decorator import authorized
from jupyter_server.base.handlers import APIHandler
from jupyter_server.extension.handler import ExtensionHandlerMixin
from jupyter_server.utils import url_path_join
from tornado import web
from tornado.iostream import StreamClosedError

from ..client import BrokerError

AUTH_RESOURCE = "gpulease"
CONTROLLER_SETTING = "gpulease_controller"  # the web_app setting the extension's controller is under
KEEPALIVE_S = 15.0


class GPULeaseAPIHandler(ExtensionHandlerMixin, APIHandler):
    auth_resource = AUTH_RESOURCE

    @property
    def controller(self):
        return self.settings[CONTROLLER_SETTING]

    def write_json(self, data: Any, status: int = 200) -> None:
        self.set_status(status)
        self.set_header("Content-Type", "application/json; charset=utf-8")
        self.finish(json.dumps(data, default=str))

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        if isinstance(exc, _Refusal):
            body = {"error": exc.error, "message": exc.message, "field": exc.field}
        else:
            message = getattr(exc, "log_message", None) or self._reason
            if isinstance(exc, web.HTTPError) and exc.args[1:] and message:
                message = message % exc.args[1:]
            body = {"error": {400: "BadRequest", 401: "Unauthorized", 403: "Forbidden", 404: "NotFound", 409: "Conflict"}.get(status_code, "Error"),
                    "message": message or self._reason, "field": None}
        self.set_header("Content-Type", "application/json; charset=utf-8")
        self.finish(json.dumps(body))

    def json_body(self) -> dict[str, Any]:
        raw = self.request.body
        if not raw or not raw.strip():
            return {}
        try:
            body = json.loads(raw, parse_constant=_no_constant)
        except (ValueError, UnicodeDecodeError) as e:
            raise _Refusal(400, f"the request body is not valid JSON: {e}", "body") from None
        if not isinstance(body, dict):
            raise _Refusal(400, "the request body must be a JSON object", "body")
        return body

    async def broker(self, coro):
        """Await a broker call; its refusals become this request's answer."""
        try:
            return await coro
        except BrokerError as e:
            status = e.status if 400 <= e.status < 500 else 502
            raise _Refusal(status, e.message if e.status else f"the lease broker cannot be reached: {e.message}", e.field, e.error or None) from None


class _Refusal(web.HTTPError):
    def __init__(self, status: int, message: str, field: str | None = None, error: str | None = None):
        super().__init__(status)
        self.message = message
        self.field = field
        self.error = error or {400: "BadRequest", 403: "Forbidden", 404: "NotFound", 409: "Conflict", 502: "BrokerUnavailable"}.get(status, "Error")


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def _number(body: dict, name: str, *, positive: bool = True) -> float | None:
    if name not in body or body[name] is None:
        return None
    v = body[name]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _Refusal(400, f"'{name}' must be a number of seconds, got {v!r}", name)
    if positive and v <= 0:
        raise _Refusal(400, f"'{name}' must be more than 0, got {v!r}", name)
    return float(v)


def _unknown(body: dict, allowed: set[str]) -> None:
    extra = sorted(set(body) - allowed)
    if extra:
        raise _Refusal(400, f"unknown field(s) {', '.join(map(repr, extra))}; allowed: {', '.join(sorted(allowed)) or 'none'}", extra[0])


class StatusHandler(GPULeaseAPIHandler):
    @web.authenticated
    @authorized
    async def get(self):
        history = self.get_argument("history", "1") not in ("0", "false", "no")
        seconds = self.get_argument("seconds", None)
        history_s = None
        if seconds is not None:
            try:
                history_s = float(seconds)
                if not math.isfinite(history_s) or history_s <= 0:
                    raise ValueError
            except ValueError:
                raise _Refusal(400, f"'seconds' must be a positive number, got {seconds!r}", "seconds") from None
        self.write_json(self.controller.status(history=history, history_s=history_s))


class FeedHandler(GPULeaseAPIHandler):
    """Server-sent events: ``status`` first, then every event as it happens (see docs/server-api.md)."""

    def initialize(self, *args, **kwargs):
        super().initialize(*args, **kwargs)
        self._closed = False

    def on_connection_close(self):
        self._closed = True

    async def _send(self, event_id: int, kind: str, data: dict) -> None:
        self.write(f"id: {event_id}\nevent: {kind}\ndata: {json.dumps(data, default=str)}\n\n")
        await self.flush()

    @web.authenticated
    @authorized
    async def get(self):
        since_arg = self.request.headers.get("Last-Event-ID") or self.get_argument("since", "")
        since = None
        if since_arg:
            if not since_arg.isdigit():
                raise _Refusal(400, f"'since' (or Last-Event-ID) must be an event id, got {since_arg!r}", "since")
            since = int(since_arg)
        history = self.get_argument("history", "0") not in ("0", "false", "no")
        self.set_header("Content-Type", "text/event-stream; charset=utf-8")
        self.set_header("Cache-Control", "no-cache")
        self.set_header("X-Accel-Buffering", "no")  # proxies: do not buffer the stream
        feed = self.controller.feed
        sub = feed.subscribe()
        try:
            status = self.controller.status(history=history)
            await self._send(feed.last_id, "status", status)
            if since is not None:
                for ev in feed.since(since):
                    await self._send(ev.id, ev.kind, ev.to_dict())
            while not self._closed and not sub.dropped:
                try:
                    ev = await asyncio.wait_for(sub.queue.get(), KEEPALIVE_S)
                except TimeoutError:
                    self.write(": keep-alive\n\n")
                    await self.flush()
                    continue
                await self._send(ev.id, ev.kind, ev.to_dict())
        except StreamClosedError:
            pass
        finally:
            feed.unsubscribe(sub)
        if not self._closed:
            self.finish()


class LeaseRequestHandler(GPULeaseAPIHandler):
    ALLOWED = {"kind", "gpus", "share", "memory_mib", "mig_profile", "mig", "model", "models", "min_memory_mib", "tier", "duration_s",
               "max_wait_s", "meta", "prefer_gpus", "require_gpus"}

    @web.authenticated
    @authorized
    async def post(self):
        body = self.json_body()
        _unknown(body, self.ALLOWED)
        lease = await self.broker(self.controller.request(body))
        self.write_json(self.controller.lease_json(lease), 201 if lease.get("state") == "active" else 202)


class LeaseActionHandler(GPULeaseAPIHandler):
    @web.authenticated
    @authorized
    async def post(self, action):
        body = self.json_body()
        if action == "extend":
            _unknown(body, {"by_s", "until"})
            by_s, until = _number(body, "by_s"), _number(body, "until")
            if (by_s is None) == (until is None):
                raise _Refusal(400, "give exactly one of 'by_s' (seconds) or 'until' (epoch seconds)", "by_s")
            lease = await self.broker(self.controller.extend(by_s=by_s, until=until))
        else:
            _unknown(body, {"reason", "force"})
            reason = body.get("reason", "")
            if not isinstance(reason, str) or len(reason) > 1000:
                raise _Refusal(400, "'reason' must be a string of at most 1000 characters", "reason")
            force = body.get("force", False)
            if not isinstance(force, bool):
                raise _Refusal(400, "'force' must be true or false", "force")
            lease = await self.broker(self.controller.release(reason=reason, force=force))
        self.write_json(self.controller.lease_json(lease))


class KeepHandler(GPULeaseAPIHandler):
    @web.authenticated
    @authorized
    async def post(self):
        body = self.json_body()
        _unknown(body, {"for_s"})
        for_s = _number(body, "for_s", positive=False)
        if for_s is None:
            raise _Refusal(400, "'for_s' is required: how many seconds to keep the GPU although it is idle (0 ends a keep)", "for_s")
        if for_s < 0:
            raise _Refusal(400, f"'for_s' must be 0 (end the keep) or more, got {body['for_s']!r}", "for_s")
        try:
            until = self.controller.keep(for_s)
        except BrokerError as e:
            raise _Refusal(e.status, e.message, e.field) from None
        self.write_json({"keep_until": until, "max_keep_s": self.controller.max_keep_s})


class ResumeHandler(GPULeaseAPIHandler):
    @web.authenticated
    @authorized
    async def post(self):
        body = self.json_body()
        _unknown(body, {"kernel_id"})
        kid = body.get("kernel_id")
        if kid is not None and (not isinstance(kid, str) or kid not in self.controller.kernels):
            raise _Refusal(404, f"no kernel {kid!r} on this server", "kernel_id")
        started = await self.controller.resume_now(kid)
        if kid is not None and not started:
            raise _Refusal(409, f"kernel {kid} is not suspended", "kernel_id")
        lease = None
        if not started:
            # no suspended kernel, but the unused lease was reclaimed: ask for one like it again
            lease = await self.broker(self.controller.resume_lease())
        if lease is not None:
            self.write_json({"resuming": [], "lease": self.controller.lease_json(lease)}, 201 if lease.get("state") == "active" else 202)
            return
        self.write_json({"resuming": started, "lease": None}, 202 if started else 200)


class KernelDevicesHandler(GPULeaseAPIHandler):
    """A kernel says which devices it uses now (it took a lease's environment, or dropped it)."""

    @web.authenticated
    @authorized
    async def post(self, kernel_id):
        body = self.json_body()
        _unknown(body, {"cuda_visible_devices"})
        devices = body.get("cuda_visible_devices")
        if not isinstance(devices, str) or len(devices) > 4096:
            raise _Refusal(400, "'cuda_visible_devices' must be the kernel's CUDA_VISIBLE_DEVICES (\"\" for none)", "cuda_visible_devices")
        if kernel_id not in self.controller.kernels:
            raise _Refusal(404, f"no kernel {kernel_id!r} on this server", "kernel_id")
        self.controller.kernel_sees(kernel_id, devices)
        self.write_json({"kernel_id": kernel_id, "cuda_visible_devices": devices})


class BrokerReadHandler(GPULeaseAPIHandler):
    """Read-only views of the broker (pool, queue), with the server's token."""

    @web.authenticated
    @authorized
    async def get(self, what):
        client = self.controller.keeper.client
        if client is None:
            raise _Refusal(409, "this server has no lease broker configured (GPULEASE_BROKER_URL)", None)
        if what == "pool":
            self.write_json(await self.broker(client.pool()))
        else:
            self.write_json({"queue": await self.broker(client.queue())})


def handlers(base: str = "gpulease") -> list[tuple]:
    """Routes, relative to the server's base_url (the ExtensionApp prefixes it with url_path_join)."""
    api = url_path_join(base, "api")
    return [
        (url_path_join(api, "status"), StatusHandler),
        (url_path_join(api, "feed"), FeedHandler),
        (url_path_join(api, "lease"), LeaseRequestHandler),
        (url_path_join(api, "lease", "(extend|release)"), LeaseActionHandler),
        (url_path_join(api, "keep"), KeepHandler),
        (url_path_join(api, "resume"), ResumeHandler),
        (url_path_join(api, "kernels", r"([\w-]+)", "devices"), KernelDevicesHandler),
        (url_path_join(api, "(pool|queue)"), BrokerReadHandler),
    ]
