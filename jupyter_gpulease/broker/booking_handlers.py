"""REST for bookings (see :mod:`.bookings`). A user books for themselves; an admin for anyone,
for a group or for a list of users.

* ``GET api/bookings[?user=&pool=&from=&to=]`` — bookings soonest first: a user's own (theirs
  by name or by one of their groups), an admin's everyone's (``user``: of that user); ``pool``:
  on GPUs of that model (a glob); ``from``/``to``: overlapping that window.
* ``POST api/bookings`` ``{"start", "end", "request": {...as POST api/leases takes it...},
  "users"?: [...], "groups"?: [...], "title"?}`` (times: epoch seconds or ISO 8601 with a zone)
  — 201 and the booking; 400 naming the field; 403 (for someone else, not allowed to book); 409
  (cannot be honoured: ``next_start`` where a later start of the same length would work).
* ``GET api/bookings/<id>``; ``DELETE api/bookings/<id>`` — end it now (its owner or an admin).
* ``GET api/bookings.ics[?user=]`` — the same bookings as ``GET api/bookings`` as an iCalendar
  (``text/calendar``): a user's own, an admin's the pool's.
"""

from __future__ import annotations

from typing import Any

from ..core.model import BadRequest, Forbidden, NotFound
from .bookings import ics
from .handlers import APIHandler
from .health_handlers import parse_time

BODY = {"start", "end", "request", "users", "groups", "title"}


def _only(body: dict[str, Any], allowed: set[str]) -> None:
    extra = sorted(set(body) - allowed)
    if extra:
        raise BadRequest(f"unknown field(s) {', '.join(map(repr, extra))}; allowed: {', '.join(sorted(allowed))}", field=extra[0])


def _desk(handler):
    desk = handler.settings.get("gpulease_bookings")
    if desk is None:
        raise NotFound("bookings are not kept by this broker", field="bookings")
    return desk


def _actor(handler) -> str:
    return handler.actor if not handler.is_admin or handler.actor.startswith("service:") else f"admin:{handler.caller_name}"


class _Bookings(APIHandler):
    def _listed(self):
        desk = _desk(self)
        user = self.get_argument("user", None)
        start, end = self.get_argument("from", None), self.get_argument("to", None)
        start = None if start is None else parse_time(float(start) if _number(start) else start, "from")
        end = None if end is None else parse_time(float(end) if _number(end) else end, "to")
        if user is not None and user != self.caller_name and not self.is_admin:
            raise Forbidden(f"only callers with the {self.admin_scope} scope may list another user's bookings", field="user")
        if user is None and not self.is_admin:
            user = self.caller_name
        groups = self.caller_groups if user == self.caller_name else ()
        return desk, desk.list(owner=user, owner_groups=groups, model=self.get_argument("pool", None) or None, start=start, end=end)

    async def _mine(self, booking_id: str):
        desk = _desk(self)
        b = await desk.get(booking_id)
        if not desk.visible(b, self.caller_name, self.caller_groups, self.is_admin):
            raise Forbidden(f"booking {booking_id} belongs to someone else", field="id")
        return desk, b


def _number(v: str) -> bool:
    try:
        float(v)
    except ValueError:
        return False
    return True


class BookingsHandler(_Bookings):
    async def get(self, booking_id: str | None = None):
        if booking_id:
            desk, b = await self._mine(booking_id)
            self.write_json(desk.json(b))
            return
        desk, found = self._listed()
        self.write_json({"bookings": [desk.json(b) for b in found]})

    async def post(self, booking_id: str | None = None):
        desk = _desk(self)
        if booking_id:
            raise BadRequest("POST api/bookings (no id) makes a booking", field="id")
        body = self.json_body()
        _only(body, BODY)
        for fld in ("start", "end", "request"):
            if fld not in body:
                raise BadRequest(f"'{fld}' is missing", field=fld)
        for fld in ("users", "groups"):
            if fld in body and not isinstance(body[fld], list):
                raise BadRequest(f"'{fld}' must be a list of names", field=fld)
        title = body.get("title", "")
        if not isinstance(title, str):
            raise BadRequest("'title' must be a string", field="title")
        b = await desk.book(caller=self.caller_name, caller_groups=self.caller_groups, admin=self.is_admin,
                            start=parse_time(body["start"], "start"), end=parse_time(body["end"], "end"), request=body["request"],
                            users=body.get("users"), groups=body.get("groups"), title=title)
        self.set_header("Location", f"{self.request.path.rstrip('/')}/{b.id}")
        self.write_json(desk.json(b), 201)

    async def delete(self, booking_id: str | None = None):
        if not booking_id:
            raise BadRequest("name the booking: DELETE api/bookings/<id>", field="id")
        desk, b = await self._mine(booking_id)
        self.write_json(desk.json(await desk.end(b.id, actor=_actor(self))))


class BookingsCalendarHandler(_Bookings):
    async def get(self):
        _, found = self._listed()
        host = self.request.host.split(":")[0] or "gpulease"
        text = ics(found, now=self.manager.now(), host=host)
        self.set_header("Content-Type", "text/calendar; charset=utf-8")
        self.set_header("Content-Disposition", 'inline; filename="bookings.ics"')
        self.finish(text.encode("utf-8"))


def api_handlers(prefix: str) -> list[tuple[str, Any]]:
    p = prefix
    return [
        (p + r"api/bookings\.ics", BookingsCalendarHandler),
        (p + r"api/bookings/?", BookingsHandler),
        (p + r"api/bookings/([0-9a-f]{1,32})/?", BookingsHandler),
    ]
