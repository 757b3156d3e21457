"""The core's view of a consumer: an outgoing link attached to one queue.

The protocol layer subclasses `Consumer` and implements `deliver`, which writes the
message into the connection's engine. The core owns the dispatch decisions and the
counters; the subclass owns the mapping from wire deliveries to entries (so the core
never holds a proton object).

`credit` mirrors the link credit: the protocol layer sets it from flow frames and the
core decrements it per delivery. `blocked` is set by the protocol layer while the
connection's unsent output is above its high-water mark. A consumer is *busy* when it
has no credit or is blocked.

Slow-consumer counters (read by `amqbroker.core.slow_consumers`; the queue keeps them):
`settled` counts the deliveries this consumer has settled, whatever the outcome
(presettled ones when they are sent); `idle_marks` counts the moments it was left with
nothing to do (its last unsettled delivery settled while nothing waited in the queue's
main order or in its groups). Both only ever grow. `slow_sample` and `slow` belong to
the detector: its previous sample of these counters and whether the consumer is in a
reported slow episode.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from amqbroker.core.entry import Entry
    from amqbroker.core.queue import Queue


class BoundGroup(Protocol):
    """A group as its owner holds it (`amqbroker.core.groups.Group`): what a consumer's
    `bound` and `parked_groups` give the dispatcher. A Protocol, so this module does
    not import the group machinery (which imports it)."""

    key: Any
    owner: Consumer | None
    parked: deque[Entry] | None
    held: int
    waiting: bool
    parked_at: float


class Consumer:
    #: a delivery to this consumer is a delivery attempt (delivery-count, recorded
    #: before delivery by the store): False for internal consumers such as the
    #: cluster's bridge links, whose resends after a crash are no failed attempt
    counts_attempts: bool = True

    __slots__ = (
        "attached_at",
        "blocked",
        "bound",
        "connection_id",
        "container_id",
        "credit",
        "filter",
        "idle_marks",
        "inflight",
        "last_delivery",
        "log_id",
        "name",
        "parked_groups",
        "presettled",
        "priority",
        "queue",
        "seq",
        "settled",
        "slow",
        "slow_sample",
    )

    def __init__(
        self,
        name: str,
        *,
        priority: int = 0,
        presettled: bool = False,
        connection_id: str = "",
        container_id: str = "",
    ) -> None:
        self.name = name
        self.priority = priority
        self.presettled = presettled
        self.connection_id = connection_id
        self.container_id = container_id
        #: "<connection id>/<link name>": the consumer column of the delivery log
        self.log_id = f"{connection_id}/{name}" if connection_id else None
        self.queue: Queue | None = None
        self.credit = 0
        self.blocked = False
        #: filter slot (selectors, no-local): None = take everything
        self.filter: Callable[[Entry], bool] | None = None
        #: unsettled deliveries to this consumer
        self.inflight = 0
        #: groups bound to this consumer, keyed by group key
        self.bound: dict[Any, BoundGroup] = {}
        #: bound groups with parked messages waiting for this consumer's credit
        self.parked_groups: deque[BoundGroup] = deque()
        self.last_delivery = 0.0
        self.attached_at = 0.0
        #: attach order within the queue (tie breaker)
        self.seq = 0
        #: deliveries settled (any outcome; presettled ones when sent)
        self.settled = 0
        #: times the consumer was left with nothing to do (see the module docstring)
        self.idle_marks = 0
        #: the slow-consumer detector's previous sample, and whether it reported us
        self.slow_sample: Any = None
        self.slow = False

    def deliver(self, entry: Entry, first: bool) -> None:
        """Send `entry` on the wire. `first` asks for the group-first flag property."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<Consumer {self.name!r} credit={self.credit} inflight={self.inflight}>"
