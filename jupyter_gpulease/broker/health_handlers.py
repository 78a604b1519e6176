"""REST for GPU health and maintenance (see :mod:`.health`).

* ``GET api/health`` — cordons (device or node, mode, reason, since, hold) and maintenance
  windows still to come; everyone may read them (users read the reasons on the spawn form).
* ``POST api/health/cordon`` ``{"kind": "device"|"node", "name", "reason", "drain": false}`` —
  admins: no new grants there (``drain``: and its holders move to a healthy GPU).
* ``POST api/health/uncordon`` ``{"kind", "name"}`` — admins: back in the pool.
* ``GET api/maintenance``; ``POST api/maintenance`` ``{"start", "end", "reason", "devices": [...],
  "nodes": [...]}`` (times: epoch seconds or ISO 8601 with a zone); ``DELETE api/maintenance/<id>``.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from ..core.model import BadRequest, Forbidden, NotFound
from .handlers import APIHandler


def _keeper(handler):
    keeper = handler.health
    if keeper is None:
        raise NotFound("GPU health and maintenance are not kept by this broker", field="health")
    return keeper


def _admin(handler, what: str) -> None:
    if not handler.is_admin:
        raise Forbidden(f"only callers with the {handler.admin_scope} scope may {what}", field="admin")


def _actor(handler) -> str:
    """Who acts, as the lease's end names it ("Revoked by carol (admin): …")."""
    return handler.actor if handler.actor.startswith("service:") else f"admin:{handler.caller_name}"


def _only(body: dict[str, Any], allowed: set[str]) -> None:
    extra = sorted(set(body) - allowed)
    if extra:
        raise BadRequest(f"unknown field(s) {', '.join(map(repr, extra))}; allowed: {', '.join(sorted(allowed))}", field=extra[0])


def parse_time(v: Any, name: str) -> float:
    """Epoch seconds, or an ISO 8601 time with its zone ("2026-12-01T12:00:00Z")."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    if isinstance(v, str) and v.strip():
        try:
            t = dt.datetime.fromisoformat(v.strip().replace("Z", "+00:00"))
        except ValueError:
            pass
        else:
            if t.tzinfo is not None:
                return t.timestamp()
    raise BadRequest(f"'{name}' must be epoch seconds or an ISO 8601 time with its zone, e.g. 2026-12-01T12:00:00Z", field=name)


def _text(body: dict[str, Any], name: str, limit: int) -> str:
    v = body.get(name)
    if not isinstance(v, str) or not v.strip():
        raise BadRequest(f"'{name}' must be a non-empty string", field=name)
    if len(v) > limit:
        raise BadRequest(f"'{name}' is longer than {limit} characters", field=name)
    return v.strip()


def _names(body: dict[str, Any], name: str) -> list[str]:
    v = body.get(name, [])
    if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v) or len(v) > 1000:
        raise BadRequest(f"'{name}' must be a list of names", field=name)
    return v


class HealthHandler(APIHandler):
    async def get(self):
        state = _keeper(self).state_json()
        if not self.is_admin:
            for c in state["cordons"]:
                c.pop("actor", None)
            for w in state["maintenance"]:
                w.pop("actor", None)
        self.write_json(state)


class CordonHandler(APIHandler):
    async def post(self, action: str):
        keeper = _keeper(self)
        _admin(self, f"{action} a GPU or a node")
        body = self.json_body()
        if action == "cordon":
            _only(body, {"kind", "name", "reason", "drain"})
            drain = body.get("drain", False)
            if not isinstance(drain, bool):
                raise BadRequest("'drain' must be true or false", field="drain")
            out = await keeper.cordon(body.get("kind"), body.get("name"), reason=_text(body, "reason", self.limits.reason_chars), actor=_actor(self), drain=drain)
        else:
            _only(body, {"kind", "name"})
            out = await keeper.uncordon(body.get("kind"), body.get("name"), actor=_actor(self))
        self.write_json(out)


class MaintenanceHandler(APIHandler):
    async def get(self, window_id: str | None = None):
        state = _keeper(self).state_json()["maintenance"]
        if window_id:
            got = [w for w in state if w["id"] == window_id]
            if not got:
                raise NotFound(f"no maintenance window {window_id!r}", field="id")
            self.write_json(got[0])
            return
        self.write_json(state)

    async def post(self, window_id: str | None = None):
        keeper = _keeper(self)
        _admin(self, "set maintenance windows")
        if window_id:
            raise BadRequest("POST api/maintenance (no id) sets a window", field="id")
        body = self.json_body()
        _only(body, {"start", "end", "reason", "devices", "nodes"})
        out = await keeper.add_window(start=parse_time(body.get("start"), "start"), end=parse_time(body.get("end"), "end"),
                                      reason=_text(body, "reason", self.limits.reason_chars), devices=_names(body, "devices"),
                                      nodes=_names(body, "nodes"), actor=_actor(self))
        self.write_json(out, 201)

    async def delete(self, window_id: str | None = None):
        keeper = _keeper(self)
        _admin(self, "remove maintenance windows")
        if not window_id:
            raise BadRequest("name the window: DELETE api/maintenance/<id>", field="id")
        self.write_json(await keeper.delete_window(window_id, actor=_actor(self)))


def api_handlers(prefix: str) -> list[tuple]:
    p = prefix
    return [
        (p + r"api/health/?", HealthHandler),
        (p + r"api/health/(cordon|uncordon)/?", CordonHandler),
        (p + r"api/maintenance/?", MaintenanceHandler),
        (p + r"api/maintenance/([0-9a-f]{1,32})/?", MaintenanceHandler),
    ]
