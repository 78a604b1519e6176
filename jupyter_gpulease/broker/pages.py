"""The broker's pages, from autoescaped Jinja2 templates (``templates/``).

* the service root (what the hub's Services menu links to): "my leases" for every user —
  their leases now (queue position, time left, extend and release buttons) and their history
  with how each lease ended; admins get a link to
* ``admin``: who holds what, the queue with ETAs, the pool, and a Revoke button per lease
  (with the reason its user then reads on the hub's home page); the admin scope only, others
  get a page saying so, with a link back to their own leases.
* the usage figures (:mod:`.usage_pages`): on ``admin`` where the GPU-hours went (plots, cost,
  idle holders, right-sizing, ``admin/usage.csv``); on "my leases" the user's own figures and
  hints (``usage.csv``).

Browsers log in through the hub (HubOAuth); forms carry JupyterHub's xsrf token.
"""

from __future__ import annotations

import time
from typing import Any

from jinja2 import Environment, PackageLoader, select_autoescape
from jupyterhub.services.auth import HubOAuthCallbackHandler, HubOAuthenticated
from tornado import web

from ..core.model import BadRequest, LeaseError, LeaseState
from ..core.request import SPAWNER_META
from . import usage_pages
from .handlers import LEASE_ID_ROUTE, BaseHandler
from .inputs import parse_number, short_text
from .present import describe_placement, describe_request, format_duration, local_time

HISTORY = 50  # ended leases shown on "my leases"

_env = Environment(loader=PackageLoader("jupyter_gpulease.broker", "templates"), autoescape=select_autoescape(["html"]), trim_blocks=True, lstrip_blocks=True)


def render(name: str, **context: Any) -> str:
    return _env.get_template(name).render(**context)


class PageHandler(HubOAuthenticated, BaseHandler):
    """A page for a browser: logs in through the hub, errors as pages."""

    @property
    def hub_auth(self):
        return self.settings["hub_oauth"]

    @hub_auth.setter
    def hub_auth(self, value):  # HubAuthenticated assigns it in some paths
        pass

    @property
    def base_url(self) -> str:
        return self.broker.base_url

    def get_current_user(self):
        try:
            return super().get_current_user()
        except web.HTTPError as e:
            if e.status_code >= 500:  # the hub did not answer the login check
                raise web.HTTPError(503, "The hub cannot be reached to check your login right now; try again in a moment.") from None
            raise

    def hub_home(self) -> str:
        return self.broker.hub_home_url()

    def page(self, name: str, code: int = 200, **context: Any) -> None:
        self.set_status(code)
        self.set_header("Content-Type", "text/html; charset=utf-8")
        self.set_header("Cache-Control", "no-store")
        self.finish(render(name, base_url=self.base_url, hub_home=self.hub_home(), **context))

    def write_error(self, status_code: int, **kwargs):
        exc = kwargs.get("exc_info", (None, None, None))[1]
        message = getattr(exc, "message", None) or getattr(exc, "log_message", None) or self._reason
        if status_code >= 500:
            message = "The broker failed to show this page; the error is in its log."
        titles = {403: "Not allowed", 404: "Not found"}
        self.page("error.html", status_code, status=status_code, title=titles.get(status_code, self._reason), message=message)


def _lease_view(m, d: dict[str, Any], now: float, viewer: str, admin: bool) -> dict[str, Any]:
    v = m.lease_json(d, viewer=viewer, admin=admin)
    v["asks"] = describe_request(v["request"])
    v["placement"] = describe_placement(v.get("placement"))
    for k in ("expires", "granted", "ended", "created"):
        t = v.get(f"{k}_at")
        v[f"{k}_text"] = local_time(t, now)
        v[f"{k}_in"] = format_duration(t - now) if t is not None else "-"
        v[f"{k}_ago"] = format_duration(now - t) if t is not None else "-"
    q = v.get("queue")
    if q:
        q = dict(q)
        q["eta_text"] = local_time(q.get("eta"), now)
        q["eta_in"] = ("in " + format_duration(q["eta"] - now)) if q.get("eta") else ""
        v["queue"] = q
    return v


class MyLeasesPage(PageHandler):
    """Every user's own leases: now and history."""

    @web.authenticated
    async def get(self):
        await self.show()

    async def show(self, message: str = "", error: bool = False, status: int = 200) -> None:
        m = self.manager
        now = m.now()
        me = self.caller_name
        live = [_lease_view(m, d, now, me, self.is_admin) for d in m.live(me)]
        ended = [_lease_view(m, d, now, me, self.is_admin) for d in await m.list(user=me, state="ended", limit=HISTORY)]
        usage = await self.usage_figures(me)
        self.page("leases.html", status, user=me, is_admin=self.is_admin, live=live, ended=ended, message=message, error=error, xsrf=self.xsrf_token.decode() if isinstance(self.xsrf_token, bytes) else self.xsrf_token, draining=m.draining, usage=usage)

    async def usage_figures(self, user: str) -> dict | None:
        """The caller's own usage figures and hints for the period the page asks for (None: no usage records kept)."""
        source = usage_pages.UsageSource.of(self.broker)
        if source is None:
            return None
        period = self.usage_period()
        return await usage_pages.my_usage(source, user, period)

    def usage_period(self) -> dict:
        try:
            return usage_pages.parse_period(self.get_query_argument("since", None), self.get_query_argument("from", None),
                                            self.get_query_argument("to", None), self.manager.now())
        except BadRequest as e:
            raise web.HTTPError(400, e.message) from None


class LeaseFormHandler(MyLeasesPage):
    """The buttons of "my leases": extend or release one of the caller's leases."""

    @web.authenticated
    async def post(self, lease_id: str, action: str):
        m = self.manager
        try:
            d = await m.get(lease_id)
            if d["user"] != self.caller_name:
                raise web.HTTPError(403, "this lease belongs to another user")
            short = lease_id[:12]
            if action == "extend":
                by = parse_number(self.get_body_argument("by", "3600"), "by", minimum=60, maximum=366 * 86400, unit="seconds")
                d = await m.extend(lease_id, by_s=float(by), actor=self.caller_name)
                message = f"Lease {short} now runs until {local_time(d['expires_at'])} ({format_duration(d['expires_at'] - m.now())} from now)."
            else:
                keep = self.get_body_argument("keep_server", "") == "1"
                d = await m.release(lease_id, state=LeaseState.RELEASED, reason=f"released by {self.caller_name} on the leases page", actor=self.caller_name, keep_server=keep)
                if d["state"] == LeaseState.WITHDRAWN.value:
                    message = f"Request {short} withdrawn."
                elif keep:
                    message = f"Lease {short} released; its server keeps running without GPUs."
                else:
                    message = f"Lease {short} released; the server that used it will be stopped."
        except LeaseError as e:
            await self.show(message=e.message, error=True, status=e.status)
            return
        await self.show(message=message)


def admin_context(m, viewer: str, *, health=None, unleased=None) -> dict[str, Any]:
    """What the admin page shows: active leases, the queue, the pool (committed state), and
    what the GPU ``health`` keeper and the ``unleased`` detector keep (None: not kept)."""
    now = m.now()
    active = [_lease_view(m, d, now, viewer, True) for d in m.live() if d["state"] == LeaseState.ACTIVE.value]
    queue = [_lease_view(m, d, now, viewer, True) for d in m.queue()]
    from .health_pages import health_view

    pool = [
        {"node": g.node, "index": g.index, "model": g.model, "memory": f"{g.memory_mib} MiB", "mig": ", ".join(x.profile for x in g.mig), "healthy": g.healthy, "uuid": g.uuid,
         **((health.device_note(g) or {}) if health is not None else {})}
        for g in sorted(m.inventory(), key=lambda g: (g.node, g.index))
    ]
    return dict(active=active, queue=queue, pool=pool, health=health_view(health, now), now=now, now_text=time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now)),
                draining=m.draining, unleased=[_unleased_view(u, now) for u in unleased.findings] if unleased is not None else [],
                unleased_action=unleased.action if unleased is not None else None)


def _unleased_view(u: dict[str, Any], now: float) -> dict[str, Any]:
    """One finding of unleased GPU use as the admin page shows it: who, which GPU, how long, how much memory, what happens."""
    v = dict(u)
    v["since_text"] = local_time(u["since"], now)
    v["for_text"] = format_duration(max(0.0, now - u["since"]))
    v["memory"] = f"{u['used_memory_mib']} MiB" if u.get("used_memory_mib") is not None else "not reported"
    stop = u.get("stop") or {}
    if stop.get("outcome") == "not_stopped":
        v["action"] = f"not stopped: {stop.get('message', '')}"
    elif stop:
        v["action"] = "being stopped"
    elif u.get("stop_at") is not None:
        v["action"] = f"stopped in {format_duration(max(0.0, u['stop_at'] - now))} (at {local_time(u['stop_at'], now)})"
    else:
        v["action"] = "reported" + (", its owner warned" if u.get("hub_user") else "")
    return v


def render_admin_page(m, viewer: str = "", base_url: str = "/services/gpulease/", hub_home: str = "/hub/home", *, health=None, unleased=None) -> str:
    return render("admin.html", base_url=base_url, hub_home=hub_home, **admin_context(m, viewer, health=health, unleased=unleased))


class AdminPage(PageHandler):
    """Who holds what, the queue with ETAs, and the pool. Admin scope only."""

    def check_admin(self) -> None:
        if not self.is_admin:
            raise web.HTTPError(403, f"The lease admin page is for callers with the {self.admin_scope} scope. Your own leases are on the leases page.")

    usage: dict | None = None  # the usage section, when the page shows it
    confirmation: dict | None = None  # a health action waiting for its Confirm (AdminHealthHandler)

    @web.authenticated
    async def get(self):
        self.check_admin()
        await self.load_usage()
        self.show()

    async def load_usage(self) -> None:
        """The usage section for the period the page asks for (none when the broker keeps no usage records)."""
        source = usage_pages.UsageSource.of(self.broker)
        if source is not None:
            self.usage = await usage_pages.admin_usage(source, MyLeasesPage.usage_period(self))

    def show(self, message: str = "", error: bool = False, status: int = 200) -> None:
        xsrf = self.xsrf_token.decode() if isinstance(self.xsrf_token, bytes) else self.xsrf_token
        self.page("admin.html", status, message=message, error=error, xsrf=xsrf, graces=REVOKE_GRACES, usage=self.usage,
                  health_confirm=self.confirmation,
                  **admin_context(self.manager, self.caller_name, health=self.health, unleased=self.unleased))


class UsageCSV(PageHandler):
    """The pages' CSV download: ``admin/usage.csv`` (admins: everyone's rows) or ``usage.csv``
    (the caller's own), for the period and grouping asked (``by=user|group|model|tier|notebook``)."""

    def initialize(self, admin: bool = False):
        self.admin = admin

    @web.authenticated
    async def get(self):
        if self.admin:
            AdminPage.check_admin(self)
        source = usage_pages.UsageSource.of(self.broker)
        if source is None:
            raise web.HTTPError(404, "This broker keeps no usage records.")
        period = MyLeasesPage.usage_period(self)
        by = self.get_query_argument("by", "user")
        if by not in usage_pages.REPORT_BY:
            raise web.HTTPError(400, f"by is one of {', '.join(usage_pages.REPORT_BY)}, not {by!r}")
        text = await source.csv(by=by, start=period["start"], end=period["end"], user=None if self.admin else self.caller_name)
        stamp = time.strftime("%Y%m%d", time.gmtime(period["end"]))
        self.set_header("Content-Type", "text/csv; charset=utf-8")
        self.set_header("Content-Disposition", f'attachment; filename="gpu-usage-by-{by}-{stamp}.csv"')
        self.set_header("Cache-Control", "no-store")
        self.finish(text)


REVOKE_GRACES = ((0, "now"), (300, "in 5 min"), (900, "in 15 min"), (3600, "in 1 h"))  # the admin page's choices


def after_revoke(d: dict) -> str:
    """What happens to the holder's server when its lease ends, as its spawner said it would
    (``meta.on_end``, set by the lease spawner from its ``on_lease_end``)."""
    meta = d.get("meta") or {}
    if meta.get("spawner") != SPAWNER_META:
        return "its holder is told"
    if meta.get("on_end") == "keep" or meta.get("taken_by") == "server":
        return "its server keeps running without the GPU, and its user is told why"
    return "its server is stopped, and its user is told why on the hub's home page"


class AdminRevokeHandler(AdminPage):
    """The admin page's Revoke button: end another user's lease (or withdraw a request) now or
    after a grace that warns its user, with a reason that its user reads (home page, notebook)."""

    @web.authenticated
    async def post(self, lease_id: str):
        self.check_admin()
        await self.load_usage()  # the page after the revoke shows it too
        m = self.manager
        reason = self.get_body_argument("reason", "").strip()
        try:
            if not reason:
                raise BadRequest("say why the lease is revoked: its user reads the reason", field="reason")
            reason = short_text({"reason": reason}, "reason", self.limits.reason_chars)
            grace_text = self.get_body_argument("grace_s", "0").strip() or "0"
            if grace_text not in {str(g) for g, _ in REVOKE_GRACES}:
                raise BadRequest(f"the grace must be one of {', '.join(w for _, w in REVOKE_GRACES)}", field="grace_s")
            grace = int(grace_text)
            d = await m.get(lease_id)
            actor = self.actor if d["user"] == self.caller_name else f"admin:{self.caller_name}"
            if grace:
                d = await m.revoke(lease_id, grace_s=grace, reason=reason, actor=actor)
            else:
                d = await m.release(lease_id, state=LeaseState.REVOKED, reason=reason, actor=actor)
        except LeaseError as e:
            self.show(message=e.message, error=True, status=e.status)
            return
        short = lease_id[:12]
        if d["state"] == LeaseState.WITHDRAWN.value:
            self.show(message=f"Request {short} of {d['user']} withdrawn.")
        elif d["state"] == LeaseState.ACTIVE.value:
            self.show(message=f"Lease {short} of {d['user']} ends in {format_duration(grace)}; {d['user']} is warned now. "
                              f"Then {after_revoke(d)}.")
        else:
            self.show(message=f"Lease {short} of {d['user']} revoked; {after_revoke(d)}.")


class AdminHealthHandler(AdminPage):
    """``POST admin/health/<action>``: cordon / drain / uncordon a GPU or a node, set or remove a
    maintenance window (see :mod:`.health_pages`); the first POST shows what will happen with a
    Confirm button."""

    @web.authenticated
    async def post(self, action: str):
        from . import health_pages

        self.check_admin()
        keeper = self.health
        if keeper is None:
            raise web.HTTPError(404, "This broker keeps no GPU health state.")
        fields = {k: self.get_body_argument(k, "").strip() for k in ("target", "reason", "start", "end", "window")}
        try:
            kind, name, start, end = health_pages.read_form(action, fields, self.limits.reason_chars)
            if self.get_body_argument("confirm", "").strip() != "1":
                self.confirmation = health_pages.confirmation(action, fields, kind, name, start, end)
                self.show()
                return
            message = await health_pages.apply_action(keeper, action, fields, kind, name, start, end, actor=f"admin:{self.caller_name}")
        except LeaseError as e:
            self.show(message=e.message, error=True, status=e.status)
            return
        self.show(message=message)


class OAuthCallbackHandler(HubOAuthCallbackHandler):
    """Finishes a page's OAuth login with the broker's own HubOAuth (it holds the PKCE state)."""

    @property
    def hub_auth(self):
        return self.settings["hub_oauth"]

    @hub_auth.setter
    def hub_auth(self, value):
        pass


def page_handlers(prefix: str) -> list[tuple]:
    from .health_pages import ACTIONS

    lease_id = LEASE_ID_ROUTE
    return [(prefix + r"admin/health/(" + "|".join(ACTIONS) + ")", AdminHealthHandler),
        (prefix + r"oauth_callback", OAuthCallbackHandler),
        (prefix + r"admin/?", AdminPage),
        (prefix + r"admin/usage\.csv", UsageCSV, {"admin": True}),
        (prefix + r"usage\.csv", UsageCSV),
        (prefix + rf"admin/leases/{lease_id}/revoke", AdminRevokeHandler),
        (prefix + rf"leases/{lease_id}/(extend|release)", LeaseFormHandler),
        (prefix + r"?", MyLeasesPage),
    ]
