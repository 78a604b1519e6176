"""The lease spawner's part in a running hub's start and shutdown.

JupyterHub starts its managed services (the lease broker among them) *after* it checked its
spawners, and on shutdown stops them *before* its servers. Left alone, a restarted hub could
not tell the broker about servers it found gone, and the leases of servers stopped at shutdown
would stay active until the broker's own check with the hub found them. So when the spawner
module is loaded into a running hub, :func:`attach` adds two steps:

* **at start**: once the broker answers, one log line says whether ``broker_url`` and the
  spawner's token work (wrong URL, invalid token, missing scope: what to fix); a broker left in
  drain mode by an interrupted shutdown grants again;
* **at shutdown**, before the hub's own clean-up stops the broker: the broker stops granting
  (drain mode), spawns waiting in the queue give up with a message saying so, and, when
  ``c.JupyterHub.cleanup_servers`` is true (the default), every server of the lease spawner is
  stopped and its leases (its own, and those it took itself: ``%gpu request``, a resumed
  kernel) released while the broker still runs; then the broker grants again (drain mode
  lasts for the shutdown only). With ``cleanup_servers = False`` the servers go on running and
  keep their leases; the restarted hub follows them again from the saved spawner state.

A server's stop never waits on the broker: a broker that is down (killed, restarting) costs
the shutdown a few seconds, not the servers' stop. What the broker could not take is written
to the hub's outbox file (:mod:`.outbox`) and sent by the next hub process as soon as its
broker answers; the start-up step above sends it.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time

from ..tasks import BackgroundTasks
from .link import BrokerLink

log = logging.getLogger("jupyter_gpulease.hub")

BROKER_WAIT_S = 3.0  # one call to the broker at shutdown: drain mode, at most
FLUSH_S = 10.0  # the releases of the stopped servers, at most, when the broker answers
WITHDRAWN_AT_SHUTDOWN = (
    "The hub is shutting down (a restart or maintenance), so this spawn gave up its place in the GPU queue. "
    "Start your server again once the hub is back."
)


def attach_to_running_hub() -> bool:
    """Attach to the JupyterHub of this process when it runs (its loop is running) and spawns
    with a lease spawner; True when attached (now or before). Reads only JupyterHub's public
    singleton (``JupyterHub.initialized()`` / ``instance()``)."""
    app_module = sys.modules.get("jupyterhub.app")
    if app_module is None or not app_module.JupyterHub.initialized():
        return False
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    app = app_module.JupyterHub.instance()
    if getattr(app, ATTACHED, False):
        return True
    if not uses_lease_spawner(app):
        return False
    attach(app)
    return True


ATTACHED = "gpulease_attached"  # the marker set on a hub the lease spawner attached to


def attach(app) -> None:
    """Hook the lease spawner into the running JupyterHub ``app`` (once per process): its
    shutdown ends leases first, its start checks the broker and logs device access."""
    if getattr(app, ATTACHED, False):
        return
    setattr(app, ATTACHED, True)
    app.spawner_class.log_device_access_at_hub_start(app)
    app.spawner_class.engine_at_hub_start(app)
    original_cleanup = app.cleanup

    async def cleanup():
        try:
            await end_leases_at_shutdown(app)
        except Exception:
            app.log.exception("GPU leases at shutdown failed")
        for link in _links():
            await link.close()  # the broker goes next: no reconnecting to it
        await original_cleanup()
        try:
            await asyncio.get_running_loop().run_in_executor(None, app.spawner_class.device_access_at_hub_stop, app)
        except Exception:
            app.log.exception("Device cgroups at shutdown failed")

    app.cleanup = cleanup
    asyncio.get_running_loop().call_soon(lambda: _tasks.start(check_at_start(app), what="the GPU lease check at hub start"))


_tasks = BackgroundTasks(log)


def uses_lease_spawner(app) -> bool:
    """Whether the hub ``app`` spawns with a lease spawner."""
    return _lease_spawner_class(app) is not None


def _lease_spawner_class(app):
    from .spawner import GPULeaseSpawner

    cls = getattr(app, "spawner_class", None)
    return cls if isinstance(cls, type) and issubclass(cls, GPULeaseSpawner) else None


async def check_at_start(app) -> str | None:
    """Check the broker URL and the spawner's token once the broker answers (it starts after
    the hub's spawners); log one line. None when the hub does not use the lease spawner."""
    cls = _lease_spawner_class(app)
    if cls is None:
        return None
    probe = cls(config=app.config, log=app.log)  # reads the config only: no user, no server
    if not probe.broker_url:
        line = "GPU leases: c.GPULeaseSpawner.broker_url is not set, so every GPU spawn fails; set it to the broker's URL"
        app.log.error("%s", line)
        return line
    link = probe.link
    link.kick_outbox()  # ends an earlier hub process could not send: as soon as the broker answers
    return await link.check()


def _links() -> list[BrokerLink]:
    return BrokerLink.open_links()


async def _until_not_pending(spawners: list, what: str, timeout: float) -> None:
    """Wait (at most ``timeout`` s) until none of ``spawners`` has the hub's ``pending`` state
    ``what`` ("spawn": its start still runs)."""
    deadline = time.monotonic() + timeout
    while any(getattr(s, "pending", None) == what for s in spawners) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)


def _lease_servers(app) -> list:
    """The hub's running (or starting) servers of a lease spawner."""
    from .spawner import GPULeaseSpawner

    found = []
    for user in list(getattr(app, "users", {}).values()):
        for spawner in list((getattr(user, "spawners", None) or {}).values()):
            if isinstance(spawner, GPULeaseSpawner) and getattr(spawner, "active", False):
                found.append(spawner)
    return found


async def end_leases_at_shutdown(app) -> dict:
    """Stop granting, withdraw waiting spawns, then (``cleanup_servers``) stop every server of
    the lease spawner and give its leases back, waiting a moment for the broker. Nothing here
    waits on a broker that does not answer: the servers stop all the same, and the ends it did
    not take stay in the outbox for the next hub. Returns what was done."""
    done = {"drained": False, "withdrawn": 0, "stopped": 0, "unreleased": [], "kept": 0}
    links = _links()
    if not links:
        return done
    started = time.monotonic()
    cleanup_servers = bool(getattr(app, "cleanup_servers", True))
    for link in links:
        link.shutting_down = True
    reachable = {}
    for link in links:
        try:
            reachable[link] = await asyncio.wait_for(link.drain(True, "the hub is shutting down"), timeout=BROKER_WAIT_S)
        except TimeoutError:
            reachable[link] = False
        if not reachable[link]:
            app.log.warning("GPU leases at shutdown: the broker at %s does not answer; servers stop all the same, "
                            "and their lease ends are sent when it is back", link.url)
    done["drained"] = any(reachable.values())
    spawners = [s for link in links for s in list(link.spawners)]
    waiting = [s for s in spawners if s.withdraw_for_shutdown(WITHDRAWN_AT_SHUTDOWN)]
    done["withdrawn"] = len(waiting)
    await _until_not_pending(waiting, "spawn", 10)
    if cleanup_servers:
        # a spawn past the queue (its engine starting) finishes first, then stops like the rest
        await _until_not_pending([s for s in spawners if s not in waiting and s._lease_pending], "spawn", 15)
        running = [s for s in _lease_servers(app) if s.pending != "stop" and s not in waiting
                   and getattr(s, "user", None) is not None and hasattr(s.user, "stop")]
        results = await asyncio.gather(*(s.user.stop(s.name) for s in running), return_exceptions=True)
        for s, r in zip(running, results):
            if isinstance(r, Exception):
                app.log.error("Could not stop %s at shutdown: %s", s._log_name, r)
        done["stopped"] = len(running)
    for link in links:
        done["unreleased"] += await link.flush(FLUSH_S if reachable[link] else 0.5)
        done["kept"] += link.persist_pending() + len(link.outbox.servers if link.outbox is not None else ())
        if reachable[link]:
            # drain mode is for the shutdown only: a broker that runs on without this hub (its own
            # service, other hubs, servers kept with cleanup_servers = False resuming kernels)
            # grants again; a hub-managed broker is stopped next anyway
            try:
                await asyncio.wait_for(link.drain(False), timeout=BROKER_WAIT_S)
            except TimeoutError:
                pass
    parts = ["no grants while the servers stopped (drain mode, lifted after)" if done["drained"] else "the broker could not be put in drain mode",
             f"{done['withdrawn']} waiting spawn(s) withdrawn"]
    if cleanup_servers:
        parts.append(f"{done['stopped']} server(s) stopped")
    else:
        parts.append("servers keep running with their leases (c.JupyterHub.cleanup_servers = False)")
    if not done["unreleased"] and not done["kept"]:
        parts.append("every lease given back")
    else:
        where = next((str(link.outbox.path) for link in links if link.outbox is not None), "")
        parts.append(f"{len(done['unreleased'])} release(s) not confirmed by the broker"
                     + (f"; {done['kept']} lease end(s) kept in {where}, sent when the hub starts again and its broker answers" if where
                        else "; left to the broker's check with the hub (c.GPULeaseSpawner.pending_ends_file is empty)"))
    app.log.info("GPU leases at shutdown (%.1f s): %s", time.monotonic() - started, "; ".join(parts))
    return done
