"""What the broker asks of its hub: a user's groups, stopping a server whose lease ended, and the
periodic check that every lease still has its server (with the config's group names the hub
does not know). The calls themselves are :mod:`.hubapi`'s. Held by :class:`.app.GPULeaseBroker`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable

from ..client import BrokerError, HubClient
from ..core.events import ENDED
from ..core.health import HEALTH_META
from ..tasks import BackgroundTasks
from . import hubapi

log = logging.getLogger(__name__)

STOP_SERVER_STATES = ("expired", "preempted", "revoked", "failed")


def hub_home_url() -> str:
    """The hub's home page, for links from the broker's pages."""
    return "/" + (os.environ.get("JUPYTERHUB_BASE_URL", "/").strip("/") + "/hub/home").lstrip("/")


class HubSide:
    """The broker's side of its hub.

    ``manager``: the leases (the check ends those whose server is gone); ``policy``: the group
    names the config uses; ``hub``: gives the Hub API client with the broker's own token (made
    when first needed: the web app's ``HubAuth`` may say where the hub is); ``tasks``: where
    server stops run in the background. The settings: ``stop_servers_on_end`` and
    ``stop_server_states`` (which ends stop their server), ``reconcile_grace`` and
    ``reconcile_interval`` (the check), ``config_file`` (named in warnings)."""

    def __init__(self, manager, policy, *, hub: Callable[[], HubClient], tasks: BackgroundTasks, logger: logging.Logger | None = None,
                 stop_servers_on_end: bool = False, stop_server_states: Iterable[str] = STOP_SERVER_STATES,
                 reconcile_grace: float = 120.0, reconcile_interval: float = 300.0, config_file: str = ""):
        self.manager = manager
        self.policy = policy
        self._hub = hub
        self.tasks = tasks
        self.log = logger or log
        self.stop_servers_on_end = stop_servers_on_end
        self.stop_server_states = tuple(stop_server_states)
        self.reconcile_grace = reconcile_grace
        self.reconcile_interval = reconcile_interval
        self.config_file = config_file
        self.reconcile_state = hubapi.ReconcileState()
        self.unknown_groups: dict[str, list[str]] = {}  # group names the config uses that the hub lacks (as last told)

    @property
    def hub(self) -> HubClient:
        """The Hub API with the broker's own token."""
        return self._hub()

    async def user_groups(self, user: str) -> tuple[str, ...]:
        return await hubapi.user_groups(self.hub, user, self.log)

    async def stop_server(self, user: str, server: str, why: str) -> None:
        await hubapi.stop_server(self.hub, user, server, why, self.log)

    async def user_exists(self, name: str) -> bool | None:
        """Whether the hub has a user called ``name`` (None: the hub did not answer)."""
        try:
            return await self.hub.user(name) is not None
        except BrokerError:
            return None

    def on_events(self, written, events) -> None:
        """A listener of the manager's commits: stop the servers of leases the broker ended
        (``stop_servers_on_end``)."""
        if not self.stop_servers_on_end:
            return
        for e in events:
            lease = getattr(e, "lease", None)
            if e.kind == ENDED and e.from_state == "active" and e.to_state in self.stop_server_states and lease is not None \
                    and HEALTH_META not in lease.meta:  # a lease moved off a sick GPU: its spawner decides
                self.tasks.start(self.stop_server(lease.user, lease.server, e.to_state), what="a background task of the broker")

    async def reconcile(self) -> list[str]:
        """One check with the hub (see ``reconcile_interval``); the ids of the leases it ended."""
        return await hubapi.reconcile(self.manager, self.hub, self.reconcile_state, grace=self.reconcile_grace, interval=self.reconcile_interval,
                                      log=self.log)

    async def check_hub_groups(self) -> None:
        """Warn about group names in the config the hub does not know; again when that changes."""
        unknown = await hubapi.unknown_groups(self.policy, self.hub, self.log)
        if unknown is None:
            return
        before = self.unknown_groups
        where = self.config_file or "(command line)"
        for g in sorted(set(unknown) - set(before)):
            self.log.warning("Config %s: the hub has no group %r (named in %s); nobody gets what it gives. Fix: create the group on the hub or correct the name",
                             where, g, ", ".join(unknown[g]))
        for g in sorted(set(before) - set(unknown)):
            self.log.info("Config %s: the hub has the group %r now", where, g)
        self.unknown_groups = unknown

    async def check(self) -> None:
        """The periodic job: :meth:`reconcile`, then :meth:`check_hub_groups`; a failure is logged."""
        try:
            await self.reconcile()
            await self.check_hub_groups()
        except Exception:
            self.log.exception("lease check with the hub failed")
