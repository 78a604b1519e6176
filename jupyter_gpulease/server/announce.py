"""What the extension tells the user: warnings, notices, reclaim and resume events in the feed.

:class:`Announcer` is the parts' one way into the :class:`~.feed.Feed`; it keeps what the
status repeats: the standing notices and the resume in progress.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from .feed import Feed
from .kernels import KernelRecord

log = logging.getLogger(__name__)


def _present(extra: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in extra.items() if v is not None}


class Announcer:
    def __init__(self, feed: Feed, clock: Callable[[], float]):
        self.feed = feed
        self.clock = clock
        self.notices: list[dict[str, Any]] = []  # standing notices (env, attribution, broker), for the status
        self.resume: dict[str, Any] | None = None  # the resume in progress, for the status

    def publish(self, kind: str, data: dict[str, Any]) -> None:
        self.feed.publish(kind, data)

    def warn(self, kind: str, message: str, **extra: Any) -> None:
        log.info("GPU warning (%s): %s", kind, message)
        self.feed.publish("warning", {"kind": kind, "message": message, **_present(extra)})

    def notice(self, kind: str, message: str, **extra: Any) -> None:
        """A standing notice (one per kind): in the status until replaced or cleared, and in the feed."""
        self.notices = [n for n in self.notices if n["kind"] != kind] + [{"kind": kind, "message": message, "time": self.clock(), **extra}]
        self.feed.publish("notice", {"kind": kind, "message": message, **extra})

    def notice_of(self, kind: str) -> dict[str, Any] | None:
        return next((n for n in self.notices if n["kind"] == kind), None)

    def clear_notice(self, kind: str, **extra: Any) -> None:
        if self.notice_of(kind) is None:
            return
        self.notices = [n for n in self.notices if n["kind"] != kind]
        self.feed.publish("notice", {"kind": kind, "message": "", **extra, "cleared": True})

    def reclaim_event(self, rec: KernelRecord, action: str, outcome: str, message: str, **extra: Any) -> None:
        log.info("GPU reclaim: kernel %s %s %s: %s", rec.id, action, outcome, message)
        self.feed.publish("reclaim", {"kernel_id": rec.id, "action": action, "outcome": outcome, "message": message, **_present(extra)})

    def resume_event(self, rec: KernelRecord, stage: str, message: str, *, quiet: bool = False, **extra: Any) -> None:
        data = {"kernel_id": rec.id, "stage": stage, "message": message, **_present(extra)}
        before = self.resume
        self.resume = data if stage in ("waiting", "restoring") else None
        if quiet and before and all(before.get(k) == data.get(k) for k in ("position", "stage", "may_start_sooner_at")):
            return  # nothing new to say: only the status changes
        self.feed.publish("resume", data)
