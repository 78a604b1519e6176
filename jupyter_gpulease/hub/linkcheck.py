"""The hub's start-up check of its broker: URL, token and scopes, said in one line an admin can act
on, and the message a user reads while a configuration problem keeps GPU leases from working.

Plain functions of a broker client and its URL: :class:`.link.BrokerLink` calls them and keeps
the outcome (its ``problem`` and ``problem_kind``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from ..client import Backoff, BrokerError

log = logging.getLogger("jupyter_gpulease.hub")

# the problem kinds of a check ("" when the broker can be used)
UNREACHABLE, URL, TOKEN, SCOPE = "unreachable", "url", "token", "scope"


async def check_broker_once(client: Any, url: str, *, logger: logging.Logger | logging.LoggerAdapter | None = None) -> tuple[str, str]:
    """Ask the broker at ``url`` once, through ``client`` (:class:`~jupyter_gpulease.client.BrokerClient`'s
    ``pool`` and ``drain``): the line for the admin and the problem kind ("" when the token may
    ask for leases on behalf of users; else ``unreachable``, ``url``, ``token`` or ``scope``).

    A broker left in drain mode (a hub killed in the middle of its shutdown) is told to grant
    again."""
    logger = logger or log
    where = f"GPU lease broker at {url}"
    try:
        pool = await client.pool() or {}
    except BrokerError as e:
        if e.status == 0 or e.status in (502, 503, 504):
            return f"{where}: not answering yet ({e.message})", UNREACHABLE
        if e.status == 401 or e.error == "login":
            return (f"{where}: the spawner's token is not valid (the hub does not know it): set "
                    "c.GPULeaseSpawner.broker_api_token to the api_token of a service in c.JupyterHub.services"), TOKEN
        if e.status == 403:
            return (f"{where}: the spawner's token may not use the broker ({e.message}): give its service a role "
                    "with the scopes custom:gpulease:admin and access:services!service=gpulease"), SCOPE
        if e.status in (301, 302, 303, 307):
            return (f"{where}: the spawner's token was refused (the broker asked to log in): set "
                    "c.GPULeaseSpawner.broker_api_token to the api_token of a service in c.JupyterHub.services"), TOKEN
        return (f"{where}: this URL does not lead to the lease broker's API ({e.status} {e.message} for api/pool); "
                "check c.GPULeaseSpawner.broker_url, prefix included (e.g. http://127.0.0.1:10101/services/gpulease/)"), URL
    except ValueError:  # an answer that is not JSON: some other web server
        return (f"{where}: this URL answers, but not as the lease broker (not JSON for api/pool); "
                "check c.GPULeaseSpawner.broker_url, prefix included"), URL
    if pool.get("draining"):
        # only a hub's shutdown drains the broker, for the shutdown's length; a broker left
        # draining (a hub killed mid-shutdown, a broker that outlived its hub) grants again
        try:
            await client.drain(False)
            logger.warning("GPU lease broker at %s was not granting leases (drain mode left from a hub shutdown); it grants again", url)
        except BrokerError as e:
            logger.warning("GPU lease broker at %s is in drain mode and could not be resumed: %s", url, e.message)
    # the admin scope: only an admin may see another user's pool
    try:
        await client.pool(user="gpulease-check", groups=["gpulease-check"])
    except BrokerError as e:
        if e.status == 403:
            return (f"{where}: the spawner's token lacks the scope custom:gpulease:admin, so it cannot ask for "
                    "leases on behalf of users: add it to the role of the spawner's service"), SCOPE
        if e.status == 0 or e.status >= 500:
            return f"{where}: not answering yet ({e.message})", UNREACHABLE
    except ValueError:
        pass
    return f"{where}: connected; the spawner's token may ask for leases on behalf of users", ""


async def check_broker(client: Any, url: str, *, timeout: float = 30, patience: float = 120,
                       clock: Callable[[], float] = time.monotonic,
                       logger: logging.Logger | logging.LoggerAdapter | None = None,
                       on_unreachable: Callable[[str], Any] | None = None) -> tuple[str, str]:
    """Check the URL and the token once the broker answers; log ONE line for the admin and
    return it with its problem kind (see :func:`check_broker_once`).

    Waits (with back-off, quietly) for a broker that is not up yet (the hub starts its services
    after its spawners), calling ``on_unreachable(line)`` after each try that found nobody; after
    ``patience`` seconds it says so once and goes on waiting. Each try lasts at most
    ``min(10, timeout)`` seconds."""
    logger = logger or log
    per_try = min(10.0, timeout)
    delays = Backoff(first=0.5, cap=10.0).delays()
    start = clock()
    warned = False
    while True:
        try:
            async with asyncio.timeout(per_try):
                line, kind = await check_broker_once(client, url, logger=logger)
        except TimeoutError:
            line, kind = f"GPU lease broker at {url}: not answering yet (no answer within {per_try:g} s)", UNREACHABLE
        if kind != UNREACHABLE:
            break
        if on_unreachable is not None:
            on_unreachable(line)
        if not warned and clock() - start >= patience:
            logger.warning("%s; the hub keeps trying (check c.GPULeaseSpawner.broker_url)", line)
            warned = True
        await asyncio.sleep(next(delays))
    if kind:
        logger.error("%s", line)
    else:
        logger.info("%s", line)
    return line, kind


def user_message(problem_kind: str) -> str:
    """What a user is told when a spawn cannot reach the broker because of ``problem_kind``
    ("" when there is nothing a user should read: none, or the broker only away for now)."""
    if problem_kind in (TOKEN, SCOPE, URL):
        return ("GPU leases do not work on this hub right now because of a configuration problem; the administrator "
                "finds the details in the hub's log. Choose a CPU-only server meanwhile.")
    return ""
