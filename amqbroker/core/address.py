"""Addresses: where producers send. An anycast address feeds its one queue; a
multicast address copies each message to every subscriber's queue.

The address also owns the full policy (GROUPING is per queue; size is per address):
`size` is the sum of the bytes of the messages held by its queues, kept up to date by
the queues. Under BLOCK, producers that find the address full register here and are
resumed (granted credit again) when space returns; under FAIL the routing call raises
`ResourceLimitExceeded`, which the protocol turns into a `rejected` outcome; under PAGE
producers are never held back: the address's queues page new messages to disk while it
is full (`Queue._page_out`) and read them back once it is below its low-water mark
(`page_room`), so `size` and the budget count the bytes in memory only.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from amqbroker.core.queue import Queue

log = logging.getLogger(__name__)

ANYCAST = "anycast"
MULTICAST = "multicast"


class MemoryBudget:
    """The broker-wide bound on message bytes held in queues (`global_max_size`).

    Every queue adds and removes its messages' bytes here as well as on its address.
    While the budget is spent, every address counts as full and applies its own full
    policy (BLOCK: producers get no credit; FAIL: messages are rejected); addresses
    whose producers wait on the budget are resumed when it has room again."""

    __slots__ = ("limit", "on_room", "paging", "used", "waiting", "warned")

    def __init__(self, limit: int = -1) -> None:
        #: -1 = unlimited
        self.limit = limit
        self.used = 0
        self.waiting: set[Address] = set()
        self.warned = False
        #: queues holding paged messages (PAGE policy)
        self.paging: set[Any] = set()
        #: called when memory was freed while a queue pages (the broker wakes the
        #: application's depage task)
        self.on_room: Callable[[], object] | None = None

    @property
    def full(self) -> bool:
        return self.limit >= 0 and self.used >= self.limit

    def release(self) -> None:
        waiting = list(self.waiting)
        self.waiting.clear()
        self.warned = False
        for a in waiting:
            if not a.full:
                a.unblock()
            else:
                self.waiting.add(a)


class DuplicateWindow:
    """The last `size` duplicate ids routed to an address (Artemis's duplicate-id
    cache): a ring (deque) for the order and a set for the look-up, O(1) per message.

    Invariant: `ids` holds exactly the elements of `order` (at most `size`)."""

    __slots__ = ("ids", "order", "size")

    def __init__(self, size: int) -> None:
        self.size = size
        self.ids: set[Hashable] = set()
        self.order: deque[Hashable] = deque()

    def seen(self, key: Hashable) -> bool:
        """True if `key` is in the window; otherwise remember it (evicting the oldest
        id when the window is full) and return False."""
        ids = self.ids
        if key in ids:
            return True
        ids.add(key)
        order = self.order
        order.append(key)
        if len(order) > self.size:
            ids.discard(order.popleft())
        return False


class Producer(Protocol):
    def resume(self) -> None:
        """Space is available again: grant credit."""


class Address:
    __slots__ = (
        "auto_created",
        "blocked_producers",
        "budget",
        "dedup",
        "full_policy",
        "max_size",
        "name",
        "producers",
        "queues",
        "routing",
        "settings",
        "size",
    )

    def __init__(
        self,
        name: str,
        routing: str,
        *,
        settings: Any = None,
        max_size: int = -1,
        full_policy: str = "BLOCK",
        auto_created: bool = False,
        budget: MemoryBudget | None = None,
    ) -> None:
        self.name = name
        self.routing = routing
        self.settings = settings
        self.queues: list[Queue] = []
        self.size = 0
        #: -1 = unlimited
        self.max_size = max_size
        self.full_policy = full_policy
        self.auto_created = auto_created
        self.blocked_producers: set[Producer] = set()
        #: shared by every address of a broker
        self.budget = budget if budget is not None else MemoryBudget()
        #: producer links currently attached with this address as target
        self.producers = 0
        #: duplicate-detection window (address setting duplicate_detection_window);
        #: None = off
        self.dedup: DuplicateWindow | None = None
        n = getattr(settings, "duplicate_detection_window", 0)
        if n:
            self.dedup = DuplicateWindow(n)

    @property
    def full(self) -> bool:
        """At its own max_size_bytes, or the broker's global_max_size is reached."""
        return (self.max_size >= 0 and self.size >= self.max_size) or self.budget.full

    def full_reason(self) -> str:
        if self.max_size >= 0 and self.size >= self.max_size:
            return (
                f"address '{self.name}' is full ({self.size} of {self.max_size} bytes); "
                "consume messages or raise max_size_bytes for this address"
            )
        b = self.budget
        return (
            f"the broker holds {b.used} bytes of messages, its global_max_size "
            f"({b.limit}); consume messages or raise global_max_size"
        )

    def page_room(self, low_water: float) -> int:
        """Bytes a paging queue of this address may read back now: 0 while the
        address or the broker is at or above `low_water` (a fraction) of its limit,
        else the room left below the limit (-1: no limit applies)."""
        room = -1
        if self.max_size >= 0:
            if self.size >= self.max_size * low_water:
                return 0
            room = self.max_size - self.size
        b = self.budget
        if b.limit >= 0:
            if b.used >= b.limit * low_water:
                return 0
            free = b.limit - b.used
            room = free if room < 0 else min(room, free)
        return room

    def block(self, producer: Producer) -> None:
        self.blocked_producers.add(producer)
        b = self.budget
        if b.full:
            b.waiting.add(self)
            if not b.warned:
                b.warned = True
                log.warning(
                    "the broker holds %d bytes of messages, its global_max_size (%d): "
                    "producers get no more credit until consumers make room",
                    b.used,
                    b.limit,
                )

    def forget(self, producer: Producer) -> None:
        self.blocked_producers.discard(producer)

    def unblock(self) -> None:
        producers = list(self.blocked_producers)
        self.blocked_producers.clear()
        for p in producers:
            p.resume()

    def __repr__(self) -> str:
        return f"<Address {self.name!r} {self.routing} queues={len(self.queues)}>"
