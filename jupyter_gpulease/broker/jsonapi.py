"""The REST API's request path: Tornado's HTTP/1.1 server, a lean handler in place of tornado.web's.

Every call of the API is JSON in, JSON out, authenticated by a token header. tornado.web's
``RequestHandler`` does more per call than that needs (a template namespace and a formatted
``Date`` per handler, a router over every page's route, ETag and output-transform checks, a
second coroutine for ``prepare``), and under load that machinery was a fifth of what the broker
cost per call: ``benchmarks/bench_broker.py`` runs the same load against a bare ``RequestHandler``
(``tornado.web alone``) and against a bare delegate on Tornado's HTTP/1.1 server like the one
here (``HTTP/1.1 alone``); at 1,000 calls/s the first costs the event loop ~600 µs of CPU per
call, the second ~450 µs, and the broker's loop thread went from ~800 to ~700 µs per call.

:class:`APIServer` sits in front of the tornado ``Application``: a request whose path is one of
the API's routes goes to a :class:`JSONHandler` subclass; any other request (the pages, the OAuth
callback) goes on to the ``Application`` untouched. HTTP parsing, keep-alive, chunked encoding and
HTTP/1.0 all stay Tornado's (``HTTP1Connection``).

The API's body limit is :class:`APIServer`'s own (``body_limit``): a call whose body is larger
(its ``Content-Length``, or what a chunked body has reached) is answered 413 by its handler's
``_handle_request_exception`` with a ``TooLarge`` error, before authentication. The body is read
to its end and dropped as it comes (no more than one read's chunk is held), then the answer goes
out and the connection stays open: a client, or a proxy in front of the broker, that is still
sending when the answer comes gets it whole, instead of a connection closed under it (which
configurable-http-proxy turns into its own 503 page). A body declared larger than
``discard_limit`` is not read: the 413 goes out at once and the connection closes.

:class:`JSONHandler` keeps the part of ``RequestHandler``'s interface that the API's handlers and
JupyterHub's ``HubAuth.get_user(handler)`` use, with the same meaning: ``settings``, ``request``
(a ``tornado.httputil.HTTPServerRequest``), ``get_argument(s)`` (query string only: the API's
bodies are JSON), ``get_cookie``, ``set_status``, ``set_header``, ``write``, ``flush``, ``finish``,
``prepare``, ``write_error``, ``log_exception``, ``on_connection_close``, ``on_finish``, and
errors through ``send_error`` with ``tornado.web.HTTPError``. A method the class does not define
is 405 after ``prepare``, as in tornado.
"""

from __future__ import annotations

import asyncio
import re
import sys
import time
from collections.abc import Awaitable
from typing import Any

from tornado import httputil, web
from tornado.escape import url_unescape
from tornado.log import app_log, gen_log

_MISSING: Any = object()
DISCARD_LIMIT = 64 * 1024 * 1024  # the largest too-large body read to its end (and dropped) before the 413
_CONTROL_CHARS = re.compile(r"[\x00-\x08\x0e-\x1f]")  # what tornado turns into spaces in arguments
_HEADER_VALUE = re.compile(r"[\x09\x20-\x7e\x80-\xff]*")  # what tornado lets into a header's value
_date = [0, ""]


def http_date() -> str:
    """The ``Date`` header's value, formatted once a second rather than once a call."""
    now = int(time.time())
    if now != _date[0]:
        _date[1] = httputil.format_timestamp(now)
        _date[0] = now
    return _date[1]


def _done() -> asyncio.Future:
    f = asyncio.get_running_loop().create_future()
    f.set_result(None)
    return f


class JSONHandler:
    """One call of the API (see the module's docstring for what it keeps of ``RequestHandler``)."""

    SUPPORTED_METHODS = ("GET", "HEAD", "POST", "DELETE", "PATCH", "PUT", "OPTIONS")  # tornado's
    current_user: Any = None

    def __init__(self, application: web.Application, request: httputil.HTTPServerRequest):
        self.application = application
        self.settings = application.settings
        self.request = request
        self._finished = False
        self._headers_written = False
        self.clear()
        request.connection.set_close_callback(self.on_connection_close)

    # -- what subclasses override -----------------------------------------------------------
    def set_default_headers(self) -> None:
        pass

    def prepare(self) -> Awaitable[None] | None:
        return None

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        self.finish(f"{status_code}: {self._reason}")

    def log_exception(self, typ, value, tb) -> None:
        if isinstance(value, web.HTTPError):
            if value.log_message:
                gen_log.warning("%d %s %s: %s", value.status_code, self.request.method, self.request.path, value.log_message % value.args if value.args else value.log_message)
        else:
            app_log.error("Uncaught exception in %s %s", self.request.method, self.request.path, exc_info=(typ, value, tb))

    def on_connection_close(self) -> None:
        pass

    def on_finish(self) -> None:
        pass

    # -- the request -----------------------------------------------------------------------------
    def get_arguments(self, name: str, strip: bool = True) -> list[str]:
        """Every value of query argument ``name``: UTF-8 (else 400), control characters as spaces."""
        out = []
        for raw in self.request.query_arguments.get(name, ()):
            try:
                value = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise web.HTTPError(400, "Invalid unicode in %s: %r", name, raw[:40]) from None
            value = _CONTROL_CHARS.sub(" ", value)
            out.append(value.strip() if strip else value)
        return out

    def get_argument(self, name: str, default: Any = _MISSING, strip: bool = True) -> Any:
        """The last value of query argument ``name``; without one, ``default`` (none given: 400)."""
        values = self.get_arguments(name, strip)
        if values:
            return values[-1]
        if default is _MISSING:
            raise web.MissingArgumentError(name)
        return default

    def get_cookie(self, name: str, default: str | None = None) -> str | None:
        if "Cookie" not in self.request.headers:
            return default
        morsel = self.request.cookies.get(name)
        return default if morsel is None else morsel.value

    # -- the answer ---------------------------------------------------------------------------
    def clear(self) -> None:
        self._headers = httputil.HTTPHeaders()
        self._headers["Date"] = http_date()
        self.set_default_headers()
        self._write_buffer: list[bytes] = []
        self._status_code = 200
        self._reason = "OK"

    def set_status(self, status_code: int, reason: str | None = None) -> None:
        self._status_code = status_code
        self._reason = reason or httputil.responses.get(status_code, "Unknown")

    def get_status(self) -> int:
        return self._status_code

    def set_header(self, name: str, value: Any) -> None:
        value = str(value)
        if _HEADER_VALUE.fullmatch(value) is None:  # no header injection
            raise ValueError(f"unsafe header value {value!r}")
        self._headers[name] = value

    def clear_header(self, name: str) -> None:
        self._headers.pop(name, None)

    def write(self, chunk: str | bytes) -> None:
        if self._finished:
            raise RuntimeError("write() after finish()")
        self._write_buffer.append(chunk.encode() if isinstance(chunk, str) else chunk)

    def flush(self) -> asyncio.Future:
        """Send what is written; the first flush sends the headers (chunked when no length is set)."""
        chunk = b"".join(self._write_buffer) if self.request.method != "HEAD" else b""  # HEAD: headers only
        self._write_buffer = []
        conn = self.request.connection
        if not self._headers_written:
            self._headers_written = True
            return conn.write_headers(httputil.ResponseStartLine("", self._status_code, self._reason), self._headers, chunk)
        return conn.write(chunk) if chunk else _done()

    def finish(self, chunk: str | bytes | None = None) -> asyncio.Future:
        if self._finished:
            raise RuntimeError("finish() called twice")
        if chunk is not None:
            self.write(chunk)
        if not self._headers_written:
            self._headers["Content-Length"] = str(sum(map(len, self._write_buffer)))
        conn = self.request.connection
        conn.set_close_callback(None)
        future = self.flush()
        conn.finish()
        self._finished = True
        self.application.log_request(self)
        self.on_finish()
        return future

    def send_error(self, status_code: int = 500, **kwargs: Any) -> None:
        if self._headers_written:
            gen_log.error("Cannot send error response after headers written")
            if not self._finished:
                try:
                    self.finish()
                except Exception:
                    gen_log.error("Failed to flush partial response", exc_info=True)
            return
        self.clear()
        reason = kwargs.get("reason")
        exc = kwargs.get("exc_info", (None, None, None))[1]
        if isinstance(exc, web.HTTPError) and exc.reason:
            reason = exc.reason
        self.set_status(status_code, reason=reason)
        try:
            self.write_error(status_code, **kwargs)
        except Exception:
            app_log.error("Uncaught exception in write_error", exc_info=True)
        if not self._finished:
            self.finish()

    def _request_summary(self) -> str:
        # the path only: a query string may carry a token
        return f"{self.request.method} {self.request.path}"

    # -- running it ---------------------------------------------------------------------------
    def _handle_request_exception(self, e: BaseException) -> None:
        if isinstance(e, web.Finish):
            if not self._finished:
                self.finish(*e.args)
            return
        try:
            self.log_exception(*sys.exc_info())
        except Exception:
            app_log.error("Error in exception logger", exc_info=True)
        if self._finished:
            return
        self.send_error(e.status_code if isinstance(e, web.HTTPError) else 500, exc_info=sys.exc_info())

    async def _execute(self, path_args: list[str]) -> None:
        try:
            method = self.request.method or ""
            if method not in self.SUPPORTED_METHODS:
                raise web.HTTPError(405)
            ready = self.prepare()
            if ready is not None:
                await ready
            if self._finished:
                return
            call = getattr(self, method.lower(), None)  # as in tornado: a method not defined is 405 after prepare
            if call is None:
                raise web.HTTPError(405)
            result = call(*path_args)
            if result is not None:
                await result
            if not self._finished:
                self.finish()
        except Exception as e:
            try:
                self._handle_request_exception(e)
            except Exception:
                app_log.error("Exception in exception handler", exc_info=True)


def _path_arg(raw: str | None) -> str | None:
    if raw is None:
        return None
    try:  # as tornado: percent-decoded to bytes, then strict UTF-8
        return url_unescape(raw, encoding=None, plus=False).decode("utf-8")
    except UnicodeDecodeError:
        raise web.HTTPError(400, "Invalid unicode in the path") from None


class _Call(httputil.HTTPMessageDelegate):
    """One request on a connection: the API's when its path is one of the routes, else the app's."""

    __slots__ = ("answered", "chunks", "conn", "headers", "inner", "received", "route", "server", "server_conn", "start_line", "too_large")

    def __init__(self, server: APIServer, server_conn: object, conn: httputil.HTTPConnection):
        self.server = server
        self.server_conn = server_conn
        self.conn = conn
        self.chunks: list[bytes] | None = []
        self.inner: httputil.HTTPMessageDelegate | None = None
        self.received = 0
        self.too_large: int | None = None  # the body's size (declared, or read so far) when over the limit
        self.answered = False

    def headers_received(self, start_line, headers):
        path = start_line.path.partition("?")[0]
        if path.startswith(self.server.prefix):
            for pattern, cls in self.server.routes:
                m = pattern.fullmatch(path)
                if m is not None:
                    self.start_line, self.headers, self.route = start_line, headers, (cls, m.groups())
                    self._check_length(headers)
                    return None
        self.inner = self.server.app.start_request(self.server_conn, self.conn)
        return self.inner.headers_received(start_line, headers)

    def _check_length(self, headers) -> None:
        """A body over the API's limit: drop it as it comes and answer 413 (see the module doc)."""
        limit = self.server.body_limit
        if limit is None:
            return
        length = headers.get("Content-Length")
        if length is None:
            if "chunked" in headers.get("Transfer-Encoding", "").lower():
                self.conn.set_max_body_size(self.server.discard_limit)  # counted as it comes
            return
        if not length.isdigit() or (declared := int(length)) <= limit:
            return  # what fits, or a malformed length (tornado's 400)
        self.too_large, self.chunks = declared, None
        # never tornado's own "Content-Length too long" (a 400 and a dropped connection)
        self.conn.set_max_body_size(declared)
        if declared > self.server.discard_limit:
            self._answer_too_large(close=True)  # not worth reading: answer now, the connection closes

    def _answer_too_large(self, *, close: bool = False) -> None:
        from .inputs import TooLarge

        self.answered = True
        request = httputil.HTTPServerRequest(connection=self.conn, server_connection=self.server_conn, start_line=self.start_line, headers=self.headers)
        request.body = b""
        handler = self.route[0](self.server.app, request)
        if close:
            handler.set_header("Connection", "close")
        error = TooLarge(f"the request body is {self.too_large} bytes; the broker takes at most {self.server.body_limit}", field="body")
        handler._handle_request_exception(error)

    def data_received(self, chunk):
        if self.inner is not None:
            return self.inner.data_received(chunk)
        self.received += len(chunk)
        if self.chunks is not None:
            self.chunks.append(chunk)
            if self.server.body_limit is not None and self.received > self.server.body_limit:
                self.chunks = None  # a chunked body over the limit: drop it from here on
        return None

    def finish(self) -> None:
        if self.inner is not None:
            self.inner.finish()
            return
        if self.answered:
            return
        if self.chunks is None:  # over the limit: the body is read (and dropped), answer now
            self.too_large = max(self.too_large or 0, self.received)
            self._answer_too_large()
            return
        request = httputil.HTTPServerRequest(connection=self.conn, server_connection=self.server_conn, start_line=self.start_line, headers=self.headers)
        request.body = b"".join(self.chunks)
        cls, groups = self.route
        handler = cls(self.server.app, request)
        try:
            path_args = [_path_arg(g) for g in groups]
        except web.HTTPError as e:
            handler._handle_request_exception(e)
            return
        task = asyncio.ensure_future(handler._execute(path_args))
        self.server.calls.add(task)
        task.add_done_callback(self.server.calls.discard)

    def on_connection_close(self) -> None:
        if self.inner is not None:
            self.inner.on_connection_close()
        self.chunks = None


class APIServer(httputil.HTTPServerConnectionDelegate):
    """What ``tornado.httpserver.HTTPServer`` serves: the API's routes, then ``app`` for the rest.

    ``routes``: ``(regex, JSONHandler subclass)`` pairs tried in order, each matching the whole
    path (its groups are the handler's arguments); ``prefix``: what every route's path starts with;
    ``body_limit``: the largest body a call may send, bytes (None: the server's ``max_body_size``
    alone); ``discard_limit``: the largest too-large body read and dropped before the 413.
    """

    def __init__(self, app: web.Application, routes: list[tuple[str, type[JSONHandler]]], prefix: str, *,
                 body_limit: int | None = None, discard_limit: int = DISCARD_LIMIT):
        self.app = app
        self.prefix = prefix
        self.body_limit = body_limit
        self.discard_limit = max(discard_limit, body_limit or 0)
        self.routes = [(re.compile(pattern), cls) for pattern, cls in routes]
        self.calls: set[asyncio.Future] = set()  # running calls (the loop keeps weak references only)

    def start_request(self, server_conn, request_conn):
        return _Call(self, server_conn, request_conn)

    def on_close(self, server_conn) -> None:
        self.app.on_close(server_conn)
