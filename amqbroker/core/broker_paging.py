"""Paging hand-back: reading paged messages back into their queues.

The queues of a PAGE address (address_full_policy PAGE, with a page store) page
messages while the address is full (`Queue.pager`). The application's depage task
(`app._depage_loop`) asks the broker's `Depager` (`Broker.paging`) which queues may
read back now (`candidates`: their address is below `low_water`, a fraction of its
limit), how many bytes (`room`: at most `read_ahead` per step), and hands what the page
store read to `depage`. See `amqbroker.store.paging` for the store's side.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from amqbroker.core.queue_records import queue_attributes

if TYPE_CHECKING:
    from amqbroker.core.address import MemoryBudget
    from amqbroker.core.entry import Entry
    from amqbroker.core.persistence import Persistence
    from amqbroker.core.queue import Queue


class Depager:
    """Which paging queues read back, how much, and the read-back itself."""

    def __init__(
        self, budget: MemoryBudget, store: Persistence, low_water: float, read_ahead: int
    ) -> None:
        self.budget = budget
        self.store = store
        self.low_water = low_water
        self.read_ahead = read_ahead

    def candidates(self) -> list[Queue]:
        """Paging queues whose address has room to read messages back now."""
        lw = self.low_water
        return [
            q
            for q in self.budget.paging
            if not q.deleted and q.address is not None and q.address.page_room(lw)
        ]

    def room(self, q: Queue) -> int:
        """Bytes `q` may read back now (0: none; at most `read_ahead`)."""
        if q.deleted or not q.paged_count or q.address is None:
            return 0
        room = q.address.page_room(self.low_water)
        if room < 0 or room > self.read_ahead:
            return self.read_ahead
        return room

    def depage(self, q: Queue, entries: list[Entry]) -> None:
        """Enqueue messages read back from `q`'s page. For a durable queue their ADD
        records and the new `paged_through` mark are one atomic journal record, so
        after a crash the messages are in the journal or still in the page, never
        both or neither (see `amqbroker.store.paging`)."""
        if q.deleted:
            return
        if not q.durable:
            q.depage(entries)
            return
        self.store.begin_atomic()
        try:
            q.depage(entries)
        finally:
            self.store.queue_declared(q.qid, q.name, queue_attributes(q))
            self.store.end_atomic()
