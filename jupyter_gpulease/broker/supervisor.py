"""The broker's supervisor: one active broker, hot standbys, and a quick restart.

JupyterHub restarts a managed service that died only at its next service poll (10-30 s). The
supervisor is the process the hub starts; it runs ``1 + standbys`` broker processes with the
same command line. They all wait on the database's lock (see
:meth:`jupyter_gpulease.store.LeaseStore.acquire_leadership`); the one that holds it restores
the leases from the database and serves, the others stand by, already imported and
configured. When the active broker dies (killed, out of memory, its database connection
lost), the kernel or PostgreSQL releases its lock, a standby takes over within about a second,
and the supervisor starts a new standby. Clients carry on through the hand-over by retrying
(:mod:`jupyter_gpulease.client`).

A supervisor that dies (killed, out of memory) costs no more than a broker that dies. Every
worker holds the read end of a pipe whose write end only the supervisor holds; its end of
file tells the worker at once that the supervisor is gone (``SUPERVISOR_FD``). A standby then
stops. The broker that serves serves on, alone, until the hub starts the service again (its
next poll, 10-30 s later): once a broker of the new supervisor waits for the database's lock
(:meth:`jupyter_gpulease.store.LeaseStore.successor_waiting`), it hands over as on a stop:
it stops listening, commits what it decided, lets go of the lock, closes its connections and
exits, and the waiting broker takes over within about a second. A stop (SIGTERM, SIGINT) lets
go of the lock as soon as the last decision is committed.

The supervisor also holds the brokers' listening socket (bound before it starts them, handed to
each: ``LISTEN_FDS``). The broker that serves accepts on it; while none does (the one that
served was killed, the standby is taking over), the kernel keeps the connections that come in
its queue until the next broker accepts them, instead of refusing them: a client, or the hub's
proxy, never sees the broker gone for the moment of a hand-over, only a slower answer. (Where
the address is taken, by a broker that serves on after its own supervisor died, the brokers
bind it themselves, as they do without a supervisor.)

A worker that exits with the config-error status stops the supervisor with that status;
workers that keep failing by themselves (5 non-zero exits within a minute: a database that
stays away) stop it too, with the hub's own restart as the next resort. A worker killed by a
signal is replaced every time.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections import deque

EXIT_CONFIG = 2
CRASH_LOOP = (5, 60.0)  # this many workers failing by themselves within this many seconds: give up
SUPERVISOR_FD = "GPULEASE_SUPERVISOR_FD"  # a worker's environment: its end of the supervisor's pipe
LISTEN_FDS = "GPULEASE_LISTEN_FDS"  # a worker's environment: the listening sockets the supervisor holds
LISTEN_BACKLOG = 4096  # connections the kernel keeps while no broker accepts (a hand-over under many clients)


def listening_sockets(host: str, port: int, log: logging.Logger | None = None) -> list[socket.socket]:
    """The brokers' listening sockets on ``host``:``port``, as a broker would bind them; none
    (logged) where the address is taken."""
    from tornado.netutil import bind_sockets

    try:
        return bind_sockets(port, address=host, backlog=LISTEN_BACKLOG)
    except OSError as e:
        (log or logging.getLogger(__name__)).info("The brokers' address %s:%s is taken (%s): each broker binds it itself once it serves", host, port, e)
        return []


def inherited_sockets() -> list[socket.socket]:
    """A worker: the listening sockets its supervisor holds for it (none without a supervisor)."""
    raw = os.environ.pop(LISTEN_FDS, "")
    return [socket.socket(fileno=int(fd)) for fd in raw.split(",") if fd.strip()]


class Supervisor:
    """Runs the brokers (``argv``: their command line) and restarts them (see the module doc).
    ``listen``: the (host, port) the brokers serve on, whose socket the supervisor holds for
    them; None: each broker binds its own. ``replace_delay_s``: how long after a broker died
    its replacement starts while another broker lives (the standby that takes over has the
    machine's CPU to itself meanwhile: a new broker's start and its reading ahead cost seconds
    of it); at once when none does."""

    def __init__(self, argv: list[str], *, standbys: int = 1, log: logging.Logger | None = None, python: str = sys.executable,
                 listen: tuple[str, int] | None = None, replace_delay_s: float = 3.0):
        self.cmd = [python, "-m", "jupyter_gpulease.broker", *argv, "--GPULeaseBroker.worker=True"]
        self.size = 1 + max(0, int(standbys))
        self.log = log or logging.getLogger(__name__)
        self.children: dict[int, subprocess.Popen] = {}
        self.deaths: deque[float] = deque()
        self.stopping = False
        # the workers read this pipe; only the supervisor holds its write end (never written):
        # when the supervisor dies, however, the workers read its end of file
        self._alive_r, self._alive_w = os.pipe()
        self.sockets = listening_sockets(*listen, log=self.log) if listen is not None else []
        self.replace_delay_s = replace_delay_s
        self.due: list[float] = []  # when the replacements of brokers that died start

    def _start_one(self) -> None:
        fds = [s.fileno() for s in self.sockets]
        env = {**os.environ, SUPERVISOR_FD: str(self._alive_r), LISTEN_FDS: ",".join(map(str, fds))}
        p = subprocess.Popen(self.cmd, env=env, pass_fds=(self._alive_r, *fds))
        self.children[p.pid] = p

    def _on_signal(self, sig, _frame) -> None:
        if not self.stopping:
            self.log.info("Supervisor received %s: stopping %d broker process(es)", signal.Signals(sig).name, len(self.children))
        self.stopping = True
        for p in list(self.children.values()):
            try:
                p.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass

    def run(self) -> int:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        self.log.info("Broker supervisor (pid %d): starting one broker and %d standby", os.getpid(), self.size - 1)
        for _ in range(self.size):
            self._start_one()
        rc = 0
        stop_deadline = None
        while self.children or (self.due and not self.stopping):
            while self.due and not self.stopping and (self.due[0] <= time.monotonic() or not self.children):
                self.due.pop(0)
                self._start_one()
            ended = [(pid, p.poll()) for pid, p in list(self.children.items()) if p.poll() is not None]
            if not ended:
                if self.stopping:
                    stop_deadline = stop_deadline or time.monotonic() + 25
                    if time.monotonic() > stop_deadline:
                        for p in self.children.values():
                            p.kill()
                time.sleep(0.05)
                continue
            for pid, code in ended:
                del self.children[pid]
                if self.stopping:
                    continue
                how = f"signal {signal.Signals(-code).name}" if code < 0 else f"status {code}"
                if code == EXIT_CONFIG:
                    self.log.error("A broker process exited with a config error; stopping (fix the config and restart the hub)")
                    rc = EXIT_CONFIG
                    self._on_signal(signal.SIGTERM, None)
                    continue
                now = time.monotonic()
                if code > 0:  # it failed by itself (killed by a signal: replaced, not counted)
                    self.deaths.append(now)
                while self.deaths and self.deaths[0] < now - CRASH_LOOP[1]:
                    self.deaths.popleft()
                if len(self.deaths) >= CRASH_LOOP[0]:
                    self.log.error("Broker processes died %d times within %g s (last: %s); the supervisor stops, the hub will restart it",
                                   len(self.deaths), CRASH_LOOP[1], how)
                    rc = 1
                    self._on_signal(signal.SIGTERM, None)
                    continue
                if any(p.poll() is None for p in self.children.values()):  # a standby takes over
                    self.log.warning("Broker process %d ended (%s); a standby takes over, a new one starts in %g s", pid, how, self.replace_delay_s)
                    self.due.append(now + self.replace_delay_s)
                else:
                    self.log.warning("Broker process %d ended (%s); starting a new one", pid, how)
                    self._start_one()
        self.log.info("Broker supervisor stopped")
        return rc
