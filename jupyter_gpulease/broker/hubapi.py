"""What the broker asks of the Hub API, as plain async functions (in the manner of
jupyterhub-idle-culler): users' groups, stopping a server whose lease ended, the check that
every lease of a JupyterHub spawner still has its server, and the check that the group
names in the broker's config exist on the hub.

All calls go through :class:`jupyter_gpulease.client.HubClient` (retries with back-off).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ..client import BrokerError, HubClient
from ..core.model import LeaseError, LeaseState
from ..core.request import SPAWNER_META

RECONCILE_REASON = "its server is not running (found by the broker's check with the hub)"


async def user_groups(hub: HubClient, user: str, log: logging.Logger) -> tuple[str, ...]:
    """``user``'s groups from the hub (needs ``read:users:groups``); none if the hub will not say."""
    try:
        model = await hub.user(user)
    except BrokerError as e:
        log.warning("Could not read the groups of %s from the hub (%s); counting none", user, e.message)
        return ()
    if isinstance(model, dict) and isinstance(model.get("groups"), list):
        return tuple(str(g) for g in model["groups"])
    return ()


async def stop_server(hub: HubClient, user: str, server: str, why: str, log: logging.Logger) -> None:
    """Ask the hub to stop ``user``'s ``server`` (its lease ended: ``why``)."""
    try:
        await hub.stop_server(user, server)
        log.info("Asked the hub to stop %s's server %r: its lease was %s", user, server, why)
    except BrokerError as e:
        if e.status in (400, 404):  # not running any more
            log.info("Server %r of %s was not running (%s)", server, user, e.status)
        elif e.status == 0:
            log.error("Could not reach the hub to stop %s's server %r: %s", user, server, e.message)
        else:
            log.error("Could not stop %s's server %r after its lease was %s: %s %s", user, server, why, e.status, e.message)


@dataclass
class ReconcileState:
    """What one check remembers for the next: since when each lease's server is missing."""

    gone_since: dict[str, float] = field(default_factory=dict)
    trouble: str = ""


async def reconcile(manager, hub: HubClient, state: ReconcileState, *, grace: float, interval: float, log: logging.Logger) -> list[str]:
    """End leases of a JupyterHub spawner whose server has been gone from the hub for ``grace``
    seconds: active ones are revoked, queued ones withdrawn (a hub that died mid-spawn leaves
    one behind; granted, it would hold GPUs nobody uses). Returns the ids ended. A hub that does
    not answer, or answers without server models, changes nothing (logged once until it
    answers again)."""
    held = [d for d in manager.live() if (d.get("meta") or {}).get("spawner") == SPAWNER_META]
    ids = {d["id"] for d in held}
    for lid in list(state.gone_since):
        if lid not in ids:
            del state.gone_since[lid]
    servers_of: dict[str, dict] = {}
    ended: list[str] = []
    for lease in held:
        user = lease["user"]
        if user not in servers_of:
            try:
                model = await hub.user(user)
            except BrokerError as e:
                model, status = False, e.status
            else:
                status = 200 if model is not None else 404
            if model is None:
                servers_of[user] = {}  # the user is gone, and their servers with them
            elif isinstance(model, dict) and isinstance(model.get("servers"), dict):
                servers_of[user] = model["servers"]
            else:
                trouble = ("did not answer" if status == 0 else
                           f"answered {status}" + (" without server models" if status == 200 else "") +
                           " (the broker's service needs the scopes read:users and read:servers)")
                if trouble != state.trouble:
                    log.warning("Lease check with the hub skipped: the hub %s; checking again in %g s", trouble, interval)
                    state.trouble = trouble
                return ended
        if state.trouble:
            log.info("Lease check with the hub: the hub answers again")
            state.trouble = ""
        now = manager.now()
        if (lease.get("server") or "") in servers_of[user]:
            state.gone_since.pop(lease["id"], None)
            continue
        gone = state.gone_since.setdefault(lease["id"], now)
        granted = lease["granted_at"] if lease.get("granted_at") is not None else lease["created_at"]
        if now - gone < grace or now - granted < grace:
            continue
        try:
            await manager.release(lease["id"], state=LeaseState.REVOKED, reason=RECONCILE_REASON, actor="broker:reconcile")
        except LeaseError:  # it ended meanwhile
            continue
        finally:
            state.gone_since.pop(lease["id"], None)
        log.warning("Ended lease %s of %s (server %r): %s", lease["id"], user, lease.get("server", ""), RECONCILE_REASON)
        ended.append(lease["id"])
    return ended


def configured_groups(policy) -> dict[str, list[str]]:
    """Group name -> where the broker's config names it (tier groups, group quotas)."""
    where: dict[str, list[str]] = {}
    for t in policy.tiers.values():
        for g in t.groups:
            where.setdefault(g, []).append(f"tiers[{t.name!r}].groups")
    for g in policy.group_quotas:
        where.setdefault(g, []).append("group_quotas")
    return where


async def unknown_groups(policy, hub: HubClient, log: logging.Logger | None = None) -> dict[str, list[str]] | None:
    """Groups the config names that the hub does not know (name -> options); None when the hub
    would not list its groups (the broker's service needs ``read:groups``)."""
    wanted = configured_groups(policy)
    if not wanted:
        return {}
    try:
        known = set(await hub.groups())
    except BrokerError as e:
        if e.status == 403 and log is not None and not getattr(hub, "_told_list_groups", False):
            hub._told_list_groups = True
            log.warning("The hub does not let the broker list its groups (%s), so group names in the config are not checked; "
                        "add the scope list:groups to the broker service's role", e.message)
        return None
    return {g: opts for g, opts in wanted.items() if g not in known}
