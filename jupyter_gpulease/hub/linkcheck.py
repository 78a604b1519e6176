"""The hub's start-up check of its broker: URL, token and scopes, said in one line an admin can act
on, and the problem a user reads while the broker is unreachable. A part of :class:`.link.BrokerLink`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from ..client import Backoff, BrokerError


class LinkCheck:
    """The broker check of :class:`.link.BrokerLink` (its attributes are the link's)."""

    def _note_problem(self, kind: str, text: str) -> None:
        self.problem_kind, self.problem = kind, text

    def _clear_problem(self, kind: str) -> None:
        if self.problem_kind == kind:
            self.problem_kind, self.problem = "", ""

    async def check(self, *, patience: float = 120, clock: Callable[[], float] = time.monotonic) -> str:
        """Check the URL and the token once the broker answers; log ONE line for the admin and
        return it. Waits (with back-off, quietly) up to ``patience`` seconds for a broker that is
        not up yet (the hub starts its services after its spawners), then says so and goes on
        waiting in the background."""
        delays = Backoff(first=0.5, cap=10.0).delays()
        start = clock()
        warned = False
        while True:
            try:
                async with asyncio.timeout(min(10.0, self.timeout)):
                    line, kind = await self._check_once()
            except TimeoutError:
                line, kind = f"GPU lease broker at {self.url}: not answering yet (no answer within {min(10.0, self.timeout):g} s)", "unreachable"
            if kind != "unreachable":
                break
            self._note_problem(kind, line)
            if not warned and clock() - start >= patience:
                self.log.warning("%s; the hub keeps trying (check c.GPULeaseSpawner.broker_url)", line)
                warned = True
            await asyncio.sleep(next(delays))
        self.checked = True
        if kind:
            self._note_problem(kind, line)
            self.log.error("%s", line)
        else:
            self._clear_problem(self.problem_kind)
            self.log.info("%s", line)
        return line

    async def _check_once(self) -> tuple[str, str]:
        where = f"GPU lease broker at {self.url}"
        try:
            pool = await self.client.pool() or {}
        except BrokerError as e:
            if e.status == 0 or e.status in (502, 503, 504):
                return f"{where}: not answering yet ({e.message})", "unreachable"
            if e.status == 401 or e.error == "login":
                return (f"{where}: the spawner's token is not valid (the hub does not know it): set "
                        "c.GPULeaseSpawner.broker_api_token to the api_token of a service in c.JupyterHub.services"), "token"
            if e.status == 403:
                return (f"{where}: the spawner's token may not use the broker ({e.message}): give its service a role "
                        "with the scopes custom:gpulease:admin and access:services!service=gpulease"), "scope"
            if e.status in (301, 302, 303, 307):
                return (f"{where}: the spawner's token was refused (the broker asked to log in): set "
                        "c.GPULeaseSpawner.broker_api_token to the api_token of a service in c.JupyterHub.services"), "token"
            return (f"{where}: this URL does not lead to the lease broker's API ({e.status} {e.message} for api/pool); "
                    "check c.GPULeaseSpawner.broker_url, prefix included (e.g. http://127.0.0.1:10101/services/gpulease/)"), "url"
        except ValueError:  # an answer that is not JSON: some other web server
            return (f"{where}: this URL answers, but not as the lease broker (not JSON for api/pool); "
                    "check c.GPULeaseSpawner.broker_url, prefix included"), "url"
        if pool.get("draining"):
            # only a hub's shutdown drains the broker, for the shutdown's length; a broker left
            # draining (a hub killed mid-shutdown, a broker that outlived its hub) grants again
            try:
                await self.client.drain(False)
                self.log.warning("GPU lease broker at %s was not granting leases (drain mode left from a hub shutdown); it grants again", self.url)
            except BrokerError as e:
                self.log.warning("GPU lease broker at %s is in drain mode and could not be resumed: %s", self.url, e.message)
        # the admin scope: only an admin may see another user's pool
        try:
            await self.client.pool(user="gpulease-check", groups=["gpulease-check"])
        except BrokerError as e:
            if e.status == 403:
                return (f"{where}: the spawner's token lacks the scope custom:gpulease:admin, so it cannot ask for "
                        "leases on behalf of users: add it to the role of the spawner's service"), "scope"
            if e.status == 0 or e.status >= 500:
                return f"{where}: not answering yet ({e.message})", "unreachable"
        except ValueError:
            pass
        return f"{where}: connected; the spawner's token may ask for leases on behalf of users", ""

    def user_message(self) -> str:
        """What a user is told when a spawn cannot reach the broker because of a known problem."""
        if self.problem_kind in ("token", "scope", "url"):
            return ("GPU leases do not work on this hub right now because of a configuration problem; the administrator "
                    "finds the details in the hub's log. Choose a CPU-only server meanwhile.")
        return ""
