"""One check with the hub per token at a time.

A broker that has just taken over knows no token yet: every call asks the hub who its token
belongs to, until the answer is cached (``token_cache_max_age``). The calls that waited in the
socket's queue during the hand-over all come at once, a few per client, and each asked the hub
for itself: under 200 clients of 20 users, 200 questions where 20 were needed, to a hub as busy
as the broker then. :class:`TokenChecks` lets the calls that bring the same token while its
check is on its way wait for that check's answer instead of asking again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any


class TokenChecks:
    """Checks of tokens in flight, by the ``Authorization`` header that carries the token: the
    first call starts the check (``check()``), those that come before it is answered share its
    answer, or its error. Nothing is kept once answered (the hub's client caches answers)."""

    def __init__(self):
        self._pending: dict[str, asyncio.Future] = {}

    def __len__(self) -> int:
        return len(self._pending)

    async def check(self, header: str, check: Callable[[], Awaitable[Any]]) -> Any:
        if not header:
            return await check()
        pending = self._pending.get(header)
        if pending is None:
            pending = self._pending[header] = asyncio.ensure_future(check())
            pending.add_done_callback(lambda _done: self._pending.pop(header, None))
        # shielded: a caller that goes away does not cancel the others' answer
        return await asyncio.shield(pending)
