"""What the broker asks of the hub: its API with the broker's token, a user's groups, stopping
a server whose lease ended, and the periodic check that every lease still has its server (with
the config's group names the hub does not know). The calls themselves are :mod:`.hubapi`'s. A
part of :class:`.app.GPULeaseBroker`.
"""

from __future__ import annotations

import os

from ..core.events import ENDED
from . import hubapi


class HubSide:
    """The broker's side of its hub."""

    def hub_home_url(self) -> str:
        """The hub's home page, for links from the broker's pages."""
        return "/" + (os.environ.get("JUPYTERHUB_BASE_URL", "/").strip("/") + "/hub/home").lstrip("/")

    @property
    def hub(self):
        """The Hub API with the broker's own token."""
        from ..client import HubClient

        if getattr(self, "_hub", None) is None:
            api_url = os.environ.get("JUPYTERHUB_API_URL") or (self.hub_auth.api_url if getattr(self, "hub_auth", None) else "")
            token = os.environ.get("JUPYTERHUB_API_TOKEN") or (self.hub_auth.api_token if getattr(self, "hub_auth", None) else "")
            self._hub = HubClient(api_url or "http://127.0.0.1:8081/hub/api", token)
        return self._hub

    async def user_groups(self, user: str) -> tuple[str, ...]:
        return await hubapi.user_groups(self.hub, user, self.log)

    async def stop_server(self, user: str, server: str, why: str) -> None:
        await hubapi.stop_server(self.hub, user, server, why, self.log)

    async def _hub_user_exists(self, name: str) -> bool | None:
        """Whether the hub has a user called ``name`` (None: the hub did not answer)."""
        from ..client import BrokerError

        try:
            return await self.hub.user(name) is not None
        except BrokerError:
            return None

    def _on_events(self, written, events) -> None:
        if not self.stop_servers_on_end:
            return
        for e in events:
            lease = getattr(e, "lease", None)
            if e.kind == ENDED and e.from_state == "active" and e.to_state in self.stop_server_states and lease is not None:
                self._background(self.stop_server(lease.user, lease.server, e.to_state))

    RECONCILE_REASON = hubapi.RECONCILE_REASON

    async def reconcile(self) -> list[str]:
        """One check with the hub (see ``reconcile_interval``); the ids of the leases it ended."""
        if not hasattr(self, "_reconcile_state"):
            self._reconcile_state = hubapi.ReconcileState()
        return await hubapi.reconcile(self.manager, self.hub, self._reconcile_state, grace=self.reconcile_grace, interval=self.reconcile_interval, log=self.log)

    async def check_hub_groups(self) -> None:
        """Warn about group names in the config the hub does not know; again when that changes."""
        unknown = await hubapi.unknown_groups(self.policy, self.hub, self.log)
        if unknown is None:
            return
        before = getattr(self, "_unknown_groups", {})
        where = self.config_file or "(command line)"
        for g in sorted(set(unknown) - set(before)):
            self.log.warning("Config %s: the hub has no group %r (named in %s); nobody gets what it gives. Fix: create the group on the hub or correct the name",
                             where, g, ", ".join(unknown[g]))
        for g in sorted(set(before) - set(unknown)):
            self.log.info("Config %s: the hub has the group %r now", where, g)
        self._unknown_groups = unknown

    async def _reconcile(self) -> None:
        try:
            await self.reconcile()
            await self.check_hub_groups()
        except Exception:
            self.log.exception("lease check with the hub failed")
