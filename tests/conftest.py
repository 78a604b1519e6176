"""Shared pytest setup: test helpers on the path, and the browser for the browser tests.

pytest-jupyter's fixtures (jp_serverapp, jp_fetch) are loaded here; that plugin runs those
``async def`` tests itself (no pytest-asyncio).

Tools the tests run but pip does not install are found (and the proxy installed) by
:mod:`tooling`: configurable-http-proxy for tests that run a real JupyterHub, Chromium for the
browser tests (skipped with a one-line reason without it, except in CI, where that fails).
"""

import os
import sys

import pytest

# Test helpers (fake_pynvml, the hub harness, tooling) live next to the tests.
sys.path.insert(0, os.path.dirname(__file__))

# pytest-jupyter's jp_serverapp / jp_fetch (those tests are plain `async def`, run by the plugin)
pytest_plugins = ["pytest_jupyter.jupyter_server", "pgserver"]  # pgserver: a real PostgreSQL (fixtures postgres, db_url)

import tooling  # noqa: E402 - after the path is set


def _missing(reason: str):
    if tooling.in_ci():
        pytest.fail(f"{reason} (CI is set: browser tests must run)", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def chromium() -> str:
    """The Chromium executable for Playwright; skips (fails in CI) when there is none."""
    path = tooling.find_chromium()
    if path is None:
        _missing(tooling.chromium_missing_reason())
    return path


@pytest.fixture(scope="session")
def playwright_sync_api(chromium):
    """Playwright's sync API (the pip package; its own browser download is never used)."""
    try:
        import playwright.sync_api as api
    except ImportError:
        _missing("the Python package playwright is not installed (pip install -e '.[test]')")
    return api


# the server-extension tests load serverutil as a plugin (its fixtures) and import its helpers
pytest.register_assert_rewrite("serverutil")
