"""Shared pytest setup.

Keep this minimal. Modules that use pytest-jupyter's fixtures (jp_serverapp, jp_fetch) declare
``pytest_plugins = ["pytest_jupyter.jupyter_server"]`` here once they exist; that plugin must
run those ``async def`` tests itself (no pytest-asyncio).
"""

import os
import sys

# Test helpers (fake_pynvml, the hub harness) live next to the tests.
sys.path.insert(0, os.path.dirname(__file__))

# pytest-jupyter's jp_serverapp / jp_fetch (those tests are plain `async def`, run by the plugin)
pytest_plugins = ["pytest_jupyter.jupyter_server"]
