"""Addresses: where producers send. An anycast address feeds its one queue; a
multicast address copies each message to every subscriber's queue.

The address also owns the full policy (GROUPING is per queue; size is per address):
`size` is the sum of the bytes of the messages held by its queues, kept up to date by
the queues. Under BLOCK, producers that find the address full register here and are
resumed (granted credit again) when space returns; under FAIL the routing call raises
`ResourceLimitExceeded`, which the protocol turns into a `rejected` outcome.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from amqbroker.core.queue import Queue

ANYCAST = "anycast"
MULTICAST = "multicast"


class Producer(Protocol):
    def resume(self) -> None:
        """Space is available again: grant credit."""


class Address:
    __slots__ = (
        "auto_created",
        "blocked_producers",
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
        #: producer links currently attached with this address as target
        self.producers = 0

    @property
    def full(self) -> bool:
        return self.max_size >= 0 and self.size >= self.max_size

    def block(self, producer: Producer) -> None:
        self.blocked_producers.add(producer)

    def forget(self, producer: Producer) -> None:
        self.blocked_producers.discard(producer)

    def unblock(self) -> None:
        producers = list(self.blocked_producers)
        self.blocked_producers.clear()
        for p in producers:
            p.resume()

    def __repr__(self) -> str:
        return f"<Address {self.name!r} {self.routing} queues={len(self.queues)}>"
