"""Lists of leases page by page: the cursor a page ends with.

A list (``GET api/leases``) answers at most ``limit`` leases (:data:`LIST_LIMIT` unless the
call says otherwise, never more than :data:`MAX_LIST_LIMIT`) and, when more follow,
``next_cursor``: the same call with ``cursor=<next_cursor>`` answers the next page. Live
leases come oldest first (creation, then arrival), ended ones newest first; ``state=all``
lists the live ones, then the ended ones. A cursor says where the last page ended (its last
lease's creation time, arrival and id: a keyset), so a page costs the same however far a
client has gone, and a lease that starts or ends between two pages moves nothing under the
client: it is on a later page, or on none. A live lease that ends while a client pages through
``all`` can be listed twice, live then ended (the ids tell).

A cursor is opaque to clients (base64url of a small JSON object) and belongs to the list it
was made for (``state`` and ``user``): given with another list, it is a 400.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from dataclasses import dataclass
from typing import Any

from ..core.model import BadRequest

LIST_LIMIT = 500  # leases per page when a call gives no limit
MAX_LIST_LIMIT = 2000  # the most one page holds: a larger limit is taken as this one
MAX_CURSOR_CHARS = 1024
PHASES = ("live", "ended")

Key = tuple[float, int, str]  # a lease's place in a list: (created_at, seq, id)


def key_of(d: dict[str, Any]) -> Key:
    """A lease dict's place in a list."""
    return (float(d["created_at"]), int(d.get("seq") or 0), str(d["id"]))


@dataclass(frozen=True)
class Cursor:
    """Where a page ended: in the ``phase`` of the list ('live', then 'ended' with ``state=all``),
    after the lease at ``key`` (None: at the start of that phase)."""

    phase: str
    key: Key | None = None

    def encode(self, state: str, user: str | None) -> str:
        """The cursor as the API gives it, for the list of ``state`` and ``user``."""
        doc = {"s": state, "u": user, "p": self.phase, "k": list(self.key) if self.key is not None else None}
        return base64.urlsafe_b64encode(json.dumps(doc, separators=(",", ":")).encode()).decode().rstrip("=")

    @classmethod
    def decode(cls, text: str, state: str, user: str | None) -> Cursor:
        """The cursor a client sent for the list of ``state`` and ``user``; BadRequest (field
        ``cursor``) when it is not one of the broker's or belongs to another list."""
        bad = BadRequest("'cursor' is not a cursor of this list: give the next_cursor of the page before, unchanged", field="cursor")
        if not text or len(text) > MAX_CURSOR_CHARS or not text.isascii():
            raise bad
        try:
            doc = json.loads(base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)))
        except (ValueError, binascii.Error):
            raise bad from None
        if not isinstance(doc, dict) or set(doc) != {"s", "u", "p", "k"} or doc["p"] not in PHASES:
            raise bad
        if doc["s"] != state or doc["u"] != user:
            raise BadRequest(f"'cursor' belongs to another list (state={doc['s']!r}, user={doc['u']!r}): give the same state and user as "
                             "the call that answered it, or start again without a cursor", field="cursor")
        k = doc["k"]
        if k is None:
            return cls(doc["p"])
        if not (isinstance(k, list) and len(k) == 3 and _number(k[0]) and isinstance(k[1], int) and not isinstance(k[1], bool)
                and isinstance(k[2], str)):
            raise bad
        return cls(doc["p"], (float(k[0]), k[1], k[2]))


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
