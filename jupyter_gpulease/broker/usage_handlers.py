"""REST API of usage records: the report, usage over time, right-sizing suggestions.

* ``GET api/usage?since=30d|from=..&to=..&by=user|group|model|tier|notebook&format=json|csv[&user=X]``
* ``GET api/usage/series?since=..&step=hour|day&by=group|model|user|tier[&user=X]``
* ``GET api/usage/suggestions[?user=X]``

An admin sees everyone (and may name a ``user``); anybody else sees only their own leases:
naming another user is answered 403, and group suggestions are for admins. The queries run in
the broker's reader threads (:mod:`jupyter_gpulease.broker.usage`).
"""

from __future__ import annotations

from typing import Any

from ..core.model import BadRequest, Forbidden
from .handlers import APIHandler
from .usage import BY, STEPS, PeriodError

MAX_ARG = 255  # the longest argument (a user name: JupyterHub allows 255 characters)


class _UsageHandler(APIHandler):
    @property
    def api(self):
        return self.broker.usage

    def arg(self, name: str, default: str | None = None) -> str | None:
        v = self.get_argument(name, None)
        if v is None or v == "":
            return default
        if len(v) > MAX_ARG:
            raise BadRequest(f"'{name}' is longer than {MAX_ARG} characters", field=name)
        return v

    def choice(self, name: str, default: str, allowed) -> str:
        v = self.arg(name, default)
        if v not in allowed:
            raise BadRequest(f"'{name}' must be one of {', '.join(allowed)}; got {v!r}", field=name)
        return v

    def whose(self) -> str | None:
        """The user the answer is about: the caller unless an admin asks for all (or another)."""
        user = self.arg("user")
        if self.is_admin:
            return user
        if user is not None and user != self.caller_name:
            raise Forbidden("only an admin may read another user's usage", field="user")
        return self.caller_name

    def span(self) -> dict[str, Any]:
        since, start, end = self.arg("since"), self.arg("from"), self.arg("to")
        if since and (start or end):
            raise BadRequest("give either 'since' or 'from'/'to', not both", field="since")
        return {"since": since, "start": start, "end": end}

    async def query(self, fn, **kw):
        try:
            return await self.manager.in_reader(fn, **kw)
        except PeriodError as e:
            raise BadRequest(str(e), field=e.field) from None


class UsageHandler(_UsageHandler):
    async def get(self):
        by = self.choice("by", "user", BY)
        fmt = self.choice("format", "json", ("json", "csv"))
        user = self.whose()
        span = self.span()
        if fmt == "csv":
            text = await self.query(self.api.csv, by=by, user=user, **span)
            self.set_header("Content-Type", "text/csv; charset=utf-8")
            self.set_header("Content-Disposition", f'attachment; filename="gpu-usage-by-{by}.csv"')
            self.finish(text)
            return
        self.write_json(await self.query(self.api.report, by=by, user=user, **span))


class UsageSeriesHandler(_UsageHandler):
    async def get(self):
        by = self.choice("by", "group", ("group", "model", "user", "tier"))
        step = self.choice("step", "hour", tuple(STEPS))
        user = self.whose()
        self.write_json(await self.query(self.api.series, by=by, step=step, user=user, **self.span()))


class UsageSuggestionsHandler(_UsageHandler):
    async def get(self):
        user = self.whose()
        self.write_json(await self.query(self.api.suggestions, user=user, **self.span()))


def api_handlers(prefix: str) -> list[tuple]:
    return [
        (prefix + r"api/usage/?", UsageHandler),
        (prefix + r"api/usage/series/?", UsageSeriesHandler),
        (prefix + r"api/usage/suggestions/?", UsageSuggestionsHandler),
    ]
