"""The proxy's error target, built alone: API paths get the services' JSON error at once, every
other path the hub's own page (a fake hub here; the real hub and proxy in test_broker_chaos.py)."""

from __future__ import annotations

import asyncio
import json

from tornado.httpclient import AsyncHTTPClient, HTTPClientError
from tornado.httpserver import HTTPServer
from tornado.web import Application, RequestHandler

from hubharness import free_port
from jupyter_gpulease.hub.proxy import ErrorPages


class HubErrorPage(RequestHandler):
    asked: list[str] = []

    def get(self, code):
        HubErrorPage.asked.append(self.get_argument("url"))
        self.set_status(int(code))
        self.set_header("Content-Type", "text/html")
        self.finish(f"<html><title>JupyterHub</title>{code}</html>")


async def ask(pages: ErrorPages, code: int, failed: str):
    try:
        resp = await AsyncHTTPClient().fetch(f"{pages.url}error/{code}?url={failed}")
    except HTTPClientError as e:
        resp = e.response
    return resp.code, resp.headers.get("Content-Type", ""), resp.headers.get("Retry-After"), resp.body


def test_api_paths_get_json_at_once_and_pages_the_hubs_own():
    async def main():
        port = free_port()
        hub = HTTPServer(Application([(r"/jh/hub/error/(\d+)", HubErrorPage)]))
        hub.listen(port, "127.0.0.1")
        pages = ErrorPages(hub_error_url=f"http://127.0.0.1:{port}/jh/hub/error", base_url="/jh/", json_paths=[r"services/[^/]+/api/"])
        pages.start()
        try:
            api = await ask(pages, 503, "/jh/services/gpulease/api/leases%3Fstate%3Dall")
            none = await ask(pages, 404, "/jh/services/gone/api/x")
            page = await ask(pages, 503, "/jh/user/alice/lab")
            other_prefix = await ask(pages, 503, "/services/gpulease/api/leases")  # not under the hub's base URL
            return api, none, page, other_prefix
        finally:
            pages.stop()
            hub.stop()

    HubErrorPage.asked = []
    api, none, page, other_prefix = asyncio.run(main())
    assert api[0] == 200 and "application/json" in api[1] and api[2] == "1"  # the proxy keeps its own status and the content type
    assert json.loads(api[3])["error"] == "Unavailable"
    assert json.loads(none[3])["error"] == "NotFound"
    assert "text/html" in page[1] and b"JupyterHub" in page[3] and "text/html" in other_prefix[1]
    assert HubErrorPage.asked == ["/jh/user/alice/lab", "/services/gpulease/api/leases"], "the hub renders pages only"
