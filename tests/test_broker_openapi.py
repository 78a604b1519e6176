"""The served OpenAPI document, fuzzed with schemathesis: no request makes the broker fail.

A broker in its own thread (the caller named by the token, see brokerutil) serves
``api/openapi.json``; schemathesis generates requests from it, valid and invalid, for every
operation, and each must be answered with a status the document declares and never a 5xx.
Bounded for CI: a fixed number of examples per operation (``GPULEASE_FUZZ_EXAMPLES``, default
30; about a minute here).
"""

import os

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error, status_code_conformance

from brokerutil import _fake_authenticate, broker_in_thread, broker_url
from jupyter_gpulease.broker import handlers

EXAMPLES = int(os.environ.get("GPULEASE_FUZZ_EXAMPLES", "30"))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    real = handlers.APIHandler.authenticate
    handlers.APIHandler.authenticate = _fake_authenticate
    try:
        with broker_in_thread(tmp_path_factory.mktemp("fuzz")) as app:
            yield app
    finally:
        handlers.APIHandler.authenticate = real


def _no_wait(case) -> None:
    if case.path == "/api/events" and isinstance(case.query, dict):
        # a valid long-poll waits up to `timeout` seconds for an event: do not wait
        raw = case.query.get("timeout")
        try:
            if raw is None or 0 <= float(raw) <= 300:
                case.query["timeout"] = 0
        except (TypeError, ValueError):
            pass


def test_no_generated_request_gets_a_server_error(served):
    schema = schemathesis.openapi.from_url(broker_url(served) + "api/openapi.json")
    tried = []
    for result in schema.get_all_operations():
        op = result.ok()
        if op.path in ("/api/events/stream", "/", "/admin"):
            # a stream never ends (tests/test_broker_inputs.py covers it); the pages log browsers
            # in through a hub, which this broker has not (tests/test_broker_hub.py covers them)
            continue

        @given(case=op.as_strategy())
        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None)
        def fuzz(case):
            _no_wait(case)
            for token in ("admin-fuzz", "alice"):
                response = case.call(headers={"Authorization": f"token {token}"}, timeout=30)
                case.validate_response(response, checks=[not_a_server_error, status_code_conformance])

        fuzz()
        tried.append(f"{op.method.upper()} {op.path}")
    assert len(tried) >= 15, tried
