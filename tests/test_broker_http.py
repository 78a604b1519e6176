"""The REST API at the HTTP level, over raw sockets (tornado.web handlers, broker/handlers.py).

In-process broker (the caller named by the token, see brokerutil): keep-alive, HTTP/1.0, chunked
bodies, HEAD, percent-encoded and undecodable paths, headers (no ETag on no-store answers); a
body over the limit answered 413 from its headers; a client that hangs up while its call waits
for the commit; and the pages beside the API.
"""

import asyncio
import json
import logging

import pytest

from brokerutil import ManualClock, make_broker, patch_auth
from jupyter_gpulease.broker.handlers import PoolHandler

pytestmark = pytest.mark.timeout(120)
BASE = "/services/gpulease/"


@pytest.fixture(autouse=True)
def _auth(monkeypatch):
    patch_auth(monkeypatch)


class Errors(logging.Handler):
    """Every ERROR record logged anywhere while a test runs."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture
def errors():
    h = Errors()
    loggers = [logging.getLogger(), logging.getLogger("tornado"), logging.getLogger("GPULeaseBroker")]
    for lg in loggers:
        lg.addHandler(h)
    yield h.records
    for lg in loggers:
        lg.removeHandler(h)


async def read_response(reader, method="GET"):
    """(status, headers (lower-case names), body) of one HTTP/1.x response."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        if line:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
    if method == "HEAD":
        return status, headers, b""
    if "content-length" in headers:
        return status, headers, await reader.readexactly(int(headers["content-length"]))
    body = b""
    if headers.get("transfer-encoding") == "chunked":
        while True:
            size = int((await reader.readline()).strip(), 16)
            chunk = await reader.readexactly(size + 2)
            if size == 0:
                return status, headers, body
            body += chunk[:-2]
    return status, headers, await reader.read()


def request(method, path, body=b"", user="alice", version="HTTP/1.1", extra=""):
    head = f"{method} {BASE}{path} {version}\r\nHost: 127.0.0.1\r\n{extra}" + (f"Authorization: token {user}\r\n" if user else "")
    if body:
        head += f"Content-Length: {len(body)}\r\nContent-Type: application/json\r\n"
    return head.encode() + b"\r\n" + body


async def with_broker(tmp_path, test):
    app = make_broker(tmp_path, ManualClock())
    await app.start_async()
    try:
        port = int(app.bind_url.rsplit(":", 1)[1].strip("/"))
        await test(app, port)
    finally:
        await app.stop_async()


def test_one_keep_alive_connection_carries_calls_with_their_headers(tmp_path, errors):
    async def test(app, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request("POST", "api/leases", json.dumps({"gpus": 1}).encode()))
        status, headers, body = await read_response(reader)
        lease = json.loads(body)
        assert status == 201 and lease["state"] == "active"
        assert headers["location"] == f"{BASE}api/leases/{lease['id']}"
        assert headers["content-type"] == "application/json; charset=utf-8" and headers["cache-control"] == "no-store"
        assert headers["content-length"] == str(len(body)) and headers["date"].endswith("GMT")
        assert "etag" not in headers
        # the same connection: a read, then an unknown lease (404 as JSON), then another user's (403)
        writer.write(request("GET", f"api/leases/{lease['id']}") + request("GET", "api/leases/nosuch") + request("GET", f"api/leases/{lease['id']}", user="bob"))
        (s1, _, b1), (s2, _, b2), (s3, _, b3) = [await read_response(reader) for _ in range(3)]
        assert (s1, json.loads(b1)["id"]) == (200, lease["id"])
        assert (s2, json.loads(b2)["error"]) == (404, "NotFound")
        assert (s3, json.loads(b3)["error"]) == (403, "Forbidden")
        writer.close()
        assert app.store.get_lease_dict(lease["id"])["state"] == "active"

    asyncio.run(with_broker(tmp_path, test))
    assert not errors


def test_http_1_0_chunked_bodies_and_head(tmp_path, errors):
    async def test(app, port):
        # HTTP/1.0 without keep-alive: one answer, then the broker closes the connection
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request("GET", "api/pool", version="HTTP/1.0"))
        status, _, body = await read_response(reader)
        assert status == 200 and json.loads(body)["user"] == "alice"
        assert await asyncio.wait_for(reader.read(), 10) == b""
        writer.close()
        # a chunked request body, then HEAD (405 with its Allow, no body) on the same connection
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        payload = json.dumps({"gpus": 1}).encode()
        chunked = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (payload[:5], payload[5:])) + b"0\r\n\r\n"
        writer.write(request("POST", "api/leases", extra="Transfer-Encoding: chunked\r\nContent-Type: application/json\r\n") + chunked)
        status, _, body = await read_response(reader)
        assert status == 201 and json.loads(body)["state"] == "active"
        writer.write(request("HEAD", "api/pool"))
        status, headers, _ = await read_response(reader, "HEAD")
        assert status == 405 and headers["allow"] == "GET"
        writer.write(request("GET", "api/leases"))
        status, _, body = await read_response(reader)
        assert status == 200 and len(json.loads(body)["leases"]) == 1
        writer.close()

    asyncio.run(with_broker(tmp_path, test))
    assert not errors


def test_paths_are_decoded_as_tornado_did(tmp_path):
    async def test(app, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request("GET", "api/%ff%fe") + request("GET", "api/lea%73es") + request("GET", "api/nothing%20here") + request("GET", "api/pool/"))
        (s1, _, b1), (s2, _, b2), (s3, _, b3), (s4, _, b4) = [await read_response(reader) for _ in range(4)]
        assert (s1, json.loads(b1)["error"]) == (400, "BadRequest")  # not UTF-8
        assert (s2, json.loads(b2)["error"]) == (404, "NotFound")  # routes match the path as sent
        assert s3 == 404 and json.loads(b3)["message"].endswith("api/nothing%20here")  # the path as sent
        assert s4 == 200 and "devices" in json.loads(b4)  # a trailing slash is the same route
        writer.close()

    asyncio.run(with_broker(tmp_path, test))


def test_a_client_that_hangs_up_mid_call_loses_nothing_and_breaks_nothing(tmp_path, errors):
    async def test(app, port):
        gone = []
        for i in range(20):  # each hangs up before its answer (the call waits for its commit)
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request("POST", "api/leases", json.dumps({"gpus": 1, "share": 0.25}).encode()))
            await writer.drain()
            if i % 2:
                writer.transport.abort()  # a reset
            else:
                writer.close()  # a close: the broker has read the call and answers a socket that is gone
            gone.append(writer)
        # the broker goes on answering, and every request it took is on disk, granted or queued
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        seen, steady = None, 0
        for _ in range(200):  # until the list and the disk agree, five polls in a row
            writer.write(request("GET", "api/leases?state=all"))
            status, _, body = await read_response(reader)
            assert status == 200
            leases = json.loads(body)["leases"]
            ids = {d["id"] for d in leases}
            agree = ids == {d["id"] for d in app.store.list_lease_dicts()} and all(d["state"] in ("active", "queued") for d in leases)
            steady = steady + 1 if agree and ids == seen else 0
            seen = ids
            if steady == 5:
                break
            await asyncio.sleep(0.05)
        assert steady == 5
        assert len(leases) >= 10  # the closed ones at least were taken
        writer.close()

    asyncio.run(with_broker(tmp_path, test))
    assert not errors


def test_other_paths_still_reach_the_tornado_application(tmp_path):
    async def test(app, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request("GET", "", user=None, extra="Accept: text/html\r\n"))
        status, headers, _ = await read_response(reader)
        assert status == 302 and "/hub/api/oauth2/authorize" in headers["location"]  # the pages log in through the hub
        writer.write(request("GET", "no/such/page", user=None))
        status, headers, _ = await read_response(reader)
        assert status == 404 and headers["content-type"].startswith("text/html")
        writer.close()

    asyncio.run(with_broker(tmp_path, test))


def test_a_handler_cannot_inject_a_header():
    h = PoolHandler.__new__(PoolHandler)
    h._headers = {}
    with pytest.raises(ValueError):
        h.set_header("Location", "/x\r\nSet-Cookie: a=b")
    h.set_header("Location", "/services/gpulease/api/leases/abc")
    assert h._headers == {"Location": "/services/gpulease/api/leases/abc"}


def test_a_body_over_the_limit_gets_a_json_413_and_the_connection_serves_on(tmp_path, errors):
    """A 10 MB body (Content-Length, then chunked) is read and dropped, answered 413 in the API's
    error format before any authentication, and the connection carries the next call; calls on
    other connections are answered while it comes in. A body too large to be worth reading is
    answered at once, and that connection closes."""
    big = b"x" * (10 * 1024 * 1024)

    async def test(app, port):
        limit = app.max_body_bytes
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        other_r, other_w = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request("POST", "api/leases", user=None, extra=f"Content-Length: {len(big)}\r\n"))
        answered_meanwhile = 0
        for i in range(0, len(big), 1024 * 1024):  # the body in 1 MiB pieces; another client meanwhile
            writer.write(big[i : i + 1024 * 1024])
            await writer.drain()
            other_w.write(request("GET", "api/pool"))
            status, _, _ = await read_response(other_r)
            answered_meanwhile += status == 200
        status, headers, body = await read_response(reader)
        assert status == 413 and headers["content-type"] == "application/json; charset=utf-8"
        assert json.loads(body) == {"error": "TooLarge", "field": "body", "message": f"the request body is {len(big)} bytes; the broker takes at most {limit}"}
        assert answered_meanwhile == 10
        # the same connection goes on: a chunked body over the limit, then a call that fits
        chunked = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (big[:300_000], big[300_000:1_000_000])) + b"0\r\n\r\n"
        writer.write(request("POST", "api/leases", extra="Transfer-Encoding: chunked\r\n") + chunked)
        status, _, body = await read_response(reader)
        assert status == 413 and json.loads(body)["message"] == f"the request body is 1000000 bytes; the broker takes at most {limit}"
        writer.write(request("POST", "api/leases", json.dumps({"gpus": 1}).encode()))
        status, _, body = await read_response(reader)
        assert status == 201
        assert [d["id"] for d in app.store.list_lease_dicts()] == [json.loads(body)["id"]]  # the refused ones left nothing
        writer.close()
        other_w.close()
        # declared over the part worth reading: answered without reading, then closed
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request("POST", "api/leases", extra="Content-Length: 1000000000\r\n") + b"x" * 1000)
        status, headers, body = await read_response(reader)
        assert status == 413 and headers["connection"] == "close"
        assert json.loads(body)["message"] == f"the request body is 1000000000 bytes; the broker takes at most {limit}"
        assert await asyncio.wait_for(reader.read(), 10) == b""
        writer.close()

    asyncio.run(with_broker(tmp_path, test))
    assert not errors
