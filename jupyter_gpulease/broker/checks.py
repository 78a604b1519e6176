"""Config mistakes, found before they cost anything.

A config error ends the broker with ONE line that names the option, the file and the fix
(:class:`ConfigError`), never a traceback; names that match nothing (a tier's
``preempted_by``, a group the hub does not know) are warnings, because the broker can still
serve. ``jupyter gpulease broker --check-config`` runs every check an admin wants before
restarting the hub, including the database and the hub's groups when it can reach the hub.
"""

from __future__ import annotations

import asyncio
import os
import sys
import traceback


class ConfigError(Exception):
    """The broker's config cannot work; the message is one line an admin can act on."""


def _where(path: str) -> str:
    return path or "(command line)"


def load_config_file(app, path: str) -> None:
    """Load a traitlets config file; its own errors become one line with the file and line."""
    from traitlets import TraitError
    from traitlets.config import Application

    load = getattr(Application.load_config_file, "__wrapped__", Application.load_config_file)  # without traitlets' exit(1)
    try:
        load(app, path)
    except TraitError as e:
        raise ConfigError(trait_error(path, e)) from None
    except SyntaxError as e:
        raise ConfigError(f"{path}, line {e.lineno}: {e.msg} (fix: correct the Python syntax there)") from None
    except Exception as e:  # anything a config file may raise
        line = _line_in(path, e)
        raise ConfigError(f"{path}{line}: {type(e).__name__}: {e} (fix: correct that line of the config file)") from None


def trait_error(path: str, e: Exception) -> str:
    """traitlets' "The 'x' trait of a GPULeaseBroker instance expected a float, not the str
    'often'." as one line naming the option and the fix."""
    import re

    m = re.match(r"The '(\w+)' trait of an? (\w+) instance (.*)", str(e))
    if m:
        name, cls, rest = m.groups()
        return f"{_where(path)}: {cls}.{name}: {rest.rstrip('.')} (fix: give {cls}.{name} a value of that kind; `--generate-config` shows its help)"
    return f"{_where(path)}: {e} (fix: correct that option)"


def _line_in(path: str, e: BaseException) -> str:
    for frame in reversed(traceback.extract_tb(e.__traceback__)):
        if os.path.abspath(frame.filename) == os.path.abspath(path):
            return f", line {frame.lineno}"
    return ""


def build(app, fn, *, what: str):
    """``fn()``, with any error in building ``what`` from the config turned into one line."""
    from traitlets import TraitError

    try:
        return fn()
    except ConfigError as e:
        raise ConfigError(f"{_where(app.config_file)}: {e}") from None
    except TraitError as e:
        raise ConfigError(trait_error(app.config_file, e)) from None
    except (ValueError, TypeError, KeyError) as e:
        message = named(str(e))
        fix = "use one of the known settings" if "unknown setting" in message else f"correct {what} in the config file"
        raise ConfigError(f"{_where(app.config_file)}: {message} (fix: {fix}; `jupyter gpulease broker --generate-config` writes every option with its help)") from None
    except Exception as e:
        from ..store import StoreError

        if isinstance(e, StoreError) or type(e).__name__ in ("DeviceUnavailable",):
            raise ConfigError(f"{_where(app.config_file)}: {e}") from None
        raise


def named(message: str) -> str:
    """A policy or pool error with the option it is about in front: ``GPULeaseBroker.tiers['fast']: …``."""
    import re

    if message.startswith("GPULeaseBroker"):
        return message
    m = re.match(r"tiers: tier '([^']+)': (.*)", message, re.S)
    if m:
        return f"GPULeaseBroker.tiers[{m.group(1)!r}]: {m.group(2)}"
    m = re.match(r"((?:group_quotas|user_quotas)\['[^']+'\]|default_user_quota): (?:quota: )?(.*)", message, re.S)
    if m:
        return f"GPULeaseBroker.{m.group(1)}: {m.group(2)}"
    m = re.match(r"(\w+)(?: |: )(.*)", message, re.S)
    if m and m.group(1) in _OPTIONS:
        return f"GPULeaseBroker.{m.group(1)}: {m.group(2)}"
    lower = message.lower()
    if "gpus entry" in lower or "device" in lower or "mig" in lower:
        return f"GPULeaseBroker.devices: {message}"
    return message


_OPTIONS = {"default_tier", "tiers", "devices", "device_backend", "db_url"}


def policy_warnings(policy) -> list[str]:
    """Names in the policy that match nothing: they are probably typos."""
    out = []
    names = set(policy.tiers)
    for t in policy.tiers.values():
        for other in t.preempted_by:
            if other not in names:
                out.append(f"tiers[{t.name!r}].preempted_by names {other!r}, which is not a tier (tiers: {', '.join(sorted(names))}); fix the name")
        if t.preempted_by and not t.preemptible:
            out.append(f"tiers[{t.name!r}] lists preempted_by but is not preemptible, so nothing preempts it; set 'preemptible': True")
    for name in policy.user_quotas:
        if not isinstance(name, str) or not name.strip():
            out.append(f"user_quotas has an empty user name {name!r}")
    return out


def check_declared_devices(app) -> None:
    """Build a declared pool ('static', 'simulated') once, so its mistakes are found up front."""
    if app.device_backend in ("static", "simulated"):
        from ..devices import get_backend

        backend = build(app, lambda: get_backend(app.device_backend, app.devices), what="the pool (devices)")
        build(app, backend.inventory, what="the pool (devices)")
        backend.close()


def check_config_main(app) -> int:
    """``--check-config``: every check, one line each; 0 when the broker would start."""
    from ..core.scheduler import Scheduler
    from ..devices import get_backend
    from ..store import LeaseStore
    from . import hubapi

    where = _where(app.config_file)
    problems = 0
    try:
        backend = build(app, lambda: get_backend(app.device_backend, app.devices), what="the pool (devices)")
        inventory = build(app, backend.inventory, what="the pool (devices)")
        Scheduler(inventory, app.policy)
        backend.close()
        print(f"pool: {len(inventory)} GPU(s) from the {app.device_backend!r} device backend")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        problems += 1
    try:
        store = build(app, lambda: LeaseStore(app.db_url, sqlite_synchronous=app.sqlite_synchronous, migrate=False), what="db_url")
        try:
            rev, head = store.schema_revision(), store.head_revision()
            state = "empty (made at start)" if rev is None else f"schema {rev}" + ("" if rev == head else f", upgraded to {head} at start")
            print(f"database: {store.describe()}: {state}")
        finally:
            store.close()
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        problems += 1
    except Exception as e:  # cannot connect, wrong password, …
        print(f"error: {where}: GPULeaseBroker.db_url: cannot open the database: {type(e).__name__}: {str(e).splitlines()[0]}", file=sys.stderr)
        problems += 1
    warnings = policy_warnings(app.policy)
    if os.environ.get("JUPYTERHUB_API_TOKEN") and os.environ.get("JUPYTERHUB_API_URL"):
        unknown = asyncio.run(hubapi.unknown_groups(app.policy, app.hub))
        if unknown is None:
            warnings.append("could not list the hub's groups (the broker service's role needs list:groups and read:groups); group names were not checked")
        else:
            warnings += [f"the hub has no group {g!r} (named in {', '.join(w)})" for g, w in sorted(unknown.items())]
    else:
        named = sorted(hubapi.configured_groups(app.policy))
        if named:
            print(f"groups named: {', '.join(named)} (not checked against the hub: set JUPYTERHUB_API_URL and JUPYTERHUB_API_TOKEN to check them)")
    for w in warnings:
        print(f"warning: {where}: {w}", file=sys.stderr)
    print(f"tiers: {', '.join(f'{t.name} (priority {t.priority})' for t in sorted(app.policy.tiers.values(), key=lambda t: -t.priority))}; default {app.policy.default_tier}")
    if problems:
        print(f"{where}: {problems} error(s); the broker would not start", file=sys.stderr)
        return 2
    print(f"{where}: OK" + (f" ({len(warnings)} warning(s))" if warnings else ""))
    return 0
