"""The hub's proxy, answering API paths it cannot reach with JSON instead of the hub's HTML page.

configurable-http-proxy asks an *error target* for the answer it gives when a route's target
does not answer (a service restarting, the lease broker killed in the middle of a call before
its standby takes over): JupyterHub points it at the hub's own error page, rendered from the
hub's templates for a browser. A program calling a service's REST API got that page, and the
hub rendered one page per retry while the machine was busiest.

:class:`GPULeaseProxy` (``c.JupyterHub.proxy_class = "jupyter_gpulease.hub.proxy.GPULeaseProxy"``)
is JupyterHub's :class:`~jupyterhub.proxy.ConfigurableHTTPProxy` with its own error target,
:class:`ErrorPages`, served in the hub's process: a path under a service's API
(``json_error_paths``) gets the error as the services answer theirs, ``{"error": "Unavailable",
"message": …}`` with ``Content-Type: application/json`` (the proxy passes the content type on,
and no other header: a ``Retry-After`` is the service's own to send), at once and without the
hub; every other path gets the hub's page, as before. Clients of the project retry on either
(:mod:`jupyter_gpulease.client`).
"""

from __future__ import annotations

import json
import re
from http import HTTPStatus
from urllib.parse import urlsplit

from jupyterhub.proxy import ConfigurableHTTPProxy
from jupyterhub.utils import url_path_join
from tornado import web
from tornado.httpclient import AsyncHTTPClient, HTTPClientError
from tornado.httpserver import HTTPServer
from tornado.netutil import bind_sockets
from traitlets import List, Unicode

ERROR_NAMES = {404: "NotFound", 500: "Error", 502: "Unavailable", 503: "Unavailable", 504: "Unavailable"}
UNAVAILABLE = "the service is not answering right now (restarting, or handing over to its standby); try again in a moment"


def json_error(code: int) -> dict[str, str]:
    """The answer for an API path the proxy could not reach (``code``: the proxy's status)."""
    if code == 404:
        return {"error": "NotFound", "message": "no service answers at this path"}
    return {"error": ERROR_NAMES.get(code, "Error"), "message": UNAVAILABLE if code in (502, 503, 504) else HTTPStatus(code).phrase}


class ErrorPages:
    """The proxy's error target: ``GET <url>/error/<code>?url=<the path that failed>``.

    ``json_paths``: regular expressions of the paths (after ``base_url``) answered with JSON;
    ``hub_error_url``: the hub's own error target, asked for every other path. Serves on
    127.0.0.1, a free port, on the running event loop (:meth:`start`)."""

    def __init__(self, *, hub_error_url: str, base_url: str = "/", json_paths: list[str] = (), http_client: AsyncHTTPClient | None = None):
        self.hub_error_url = hub_error_url
        self.base_url = base_url if base_url.endswith("/") else base_url + "/"
        self.json_paths = [re.compile(p) for p in json_paths]
        self.http_client = http_client
        self.url = ""
        self._server: HTTPServer | None = None

    def wants_json(self, failed_url: str) -> bool:
        """Whether the path that failed is one of the API paths."""
        path = urlsplit(failed_url).path
        if not path.startswith(self.base_url):
            return False
        rest = path[len(self.base_url):]
        return any(p.match(rest) for p in self.json_paths)

    def start(self) -> str:
        """Listen (once); the URL to give the proxy as its error target's base."""
        if self._server is None:
            sockets = bind_sockets(0, "127.0.0.1")
            self._server = HTTPServer(web.Application([(r"/error/(\d+)", _ErrorHandler, {"pages": self})]))
            self._server.add_sockets(sockets)
            self.url = f"http://127.0.0.1:{sockets[0].getsockname()[1]}/"
        return self.url

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    async def hub_page(self, code: int, failed_url: str) -> tuple[str, bytes]:
        """(content type, body) of the hub's own page for this error; a line of text when the hub does not answer."""
        url = url_path_join(self.hub_error_url, str(code)) + "?" + web.urlencode({"url": failed_url})
        try:
            resp = await (self.http_client or AsyncHTTPClient()).fetch(url, request_timeout=10)
        except HTTPClientError as e:
            resp = e.response
        except OSError:
            resp = None
        if resp is None or not resp.body:
            return "text/plain; charset=utf-8", HTTPStatus(code).phrase.encode()
        return resp.headers.get("Content-Type", "text/html"), resp.body


class _ErrorHandler(web.RequestHandler):
    def initialize(self, pages: ErrorPages) -> None:
        self.pages = pages

    async def get(self, code_s: str) -> None:
        code = int(code_s)
        failed = self.get_argument("url", "")
        if self.pages.wants_json(failed):
            self.set_header("Content-Type", "application/json; charset=utf-8")
            if code in (502, 503, 504):
                self.set_header("Retry-After", "1")
            self.finish(json.dumps(json_error(code)))
            return
        ctype, body = await self.pages.hub_page(code, failed)
        self.set_header("Content-Type", ctype)
        self.finish(body)

    def log_exception(self, typ, value, tb) -> None:
        pass  # the proxy logs the error it asks about


class _HubWithErrorTarget:
    """The hub as :meth:`ConfigurableHTTPProxy.start` reads it, but for its URL: the error target's."""

    def __init__(self, hub, url: str):
        self._hub = hub
        self.url = url

    def __getattr__(self, name):
        return getattr(self._hub, name)


class GPULeaseProxy(ConfigurableHTTPProxy):
    """configurable-http-proxy, started by the hub as usual, whose error target answers API paths
    with JSON (see the module doc)."""

    json_error_paths = List(
        Unicode(),
        [r"services/[^/]+/api/"],
        help="""Regular expressions of the paths (after the hub's base URL) that are REST APIs:
        when the proxy cannot reach their target, the caller gets a JSON error
        (``{"error": "Unavailable", "message": ...}``) instead of the hub's HTML page. Default:
        every service's ``api/``. Example: [r"services/[^/]+/api/", r"user/[^/]+/api/"].""",
    ).tag(config=True)

    _pages: ErrorPages | None = None

    async def start(self):
        if self._pages is None:
            self._pages = ErrorPages(hub_error_url=url_path_join(self.hub.url, "error"), base_url=self.app.base_url if self.app else "/",
                                     json_paths=list(self.json_error_paths))
        if self.app is not None and self.app.internal_ssl:
            return await super().start()  # the hub's pages are asked over TLS there: keep its own target
        url = self._pages.start()
        # ConfigurableHTTPProxy.start() gives the proxy `--error-target <hub.url>/error` and has no
        # option for another target; the hub's URL is read there and nowhere else in it
        # (add_hub_route reads the hub's host, which is left as it is)
        hub = self.hub
        self.hub = _HubWithErrorTarget(hub, url)
        try:
            return await super().start()
        finally:
            self.hub = hub

    def stop(self):
        super().stop()
        if self._pages is not None:
            self._pages.stop()
