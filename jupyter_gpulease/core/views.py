"""What the last scheduling pass found for each waiting lease: ETA, what it waits for, which
devices are promised to whom, and the queue order as of that pass (materialised lazily)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from .model import Lease


class LastPass:
    """The findings of one pass, kept until the next one."""

    def __init__(self):
        self.eta: dict[str, float] = {}  # waiting lease id -> when its reservation starts
        self.waiting_for: dict[str, str] = {}  # waiting lease id -> what it waits for, in words
        self.promised_to: dict[str, str] = {}  # GPU or MIG uuid -> the first waiting lease promised it
        self.quota_held: set[str] = set()  # waiting leases held back by a concurrent quota
        self._order: list[Lease] | None = None
        self._pos: dict[str, int] = {}
        self._order_iter: Iterator[Lease] | None = None
        self._order_version = -1

    def clear(self) -> None:
        self.eta.clear()
        self.waiting_for.clear()
        self.promised_to.clear()
        self.quota_held.clear()
        self._order = None

    def forget(self, lease_id: str) -> None:
        """A lease left the queue."""
        self.eta.pop(lease_id, None)
        self.waiting_for.pop(lease_id, None)
        self.quota_held.discard(lease_id)

    def order_until(self, lease_id: str | None, version: int, make_order: Callable[[], Iterator[Lease]]) -> tuple[list[Lease], dict[str, int]]:
        """The queue order up to ``lease_id`` (None: all of it), computed once per queue ``version``.

        The order is materialised lazily: the position of a lease near the head costs only the
        leases ahead of it, which matters on very long queues (100,000 leases take ~0.2 s).
        """
        if self._order is None or version != self._order_version:
            self._order, self._pos = [], {}
            self._order_iter = make_order()
            self._order_version = version
        if lease_id is not None and lease_id in self._pos:
            return self._order, self._pos
        order, pos = self._order, self._pos
        for lease in self._order_iter:
            pos[lease.id] = len(order)
            order.append(lease)
            if lease.id == lease_id:
                break
        return order, pos
