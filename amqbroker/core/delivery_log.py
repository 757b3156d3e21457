"""What the core asks of the delivery log (implemented by `amqbroker.store.delivery_log`).

The delivery log records one record per delivery event so that an audit (the PySpark
job in `amqbroker.pipeline`) can prove what the broker did with every message. The
events and where the core emits them (the one place each passes):

=============  ==========================================================  =========
event          emitted by                                                  fields
=============  ==========================================================  =========
received       `core.accept.accept` (the target address in                 producer
               ``queue``), before routing; transactional sends too
routed         `Queue.enqueue` (every way in: producers, transaction       queue
               commits, dead-letter and expiry copies)
forwarded      the cluster (`Routing.deliver_to`): the message leaves      queue
               for another node's queue instance (``queue`` = "<node>/<queue>");
               the wrapped copy's bridge-queue records follow
dispatched     `Queue._deliver`                                            consumer
settled        `Queue.ack` / `reject` / `release` (a consumer's outcome:   outcome
               accepted, rejected, released, modified); also right after
               `dispatched` for a presettled consumer (outcome accepted)
released       `Queue.remove_consumer`: an unsettled message went back to
               its queue without an outcome (detach, connection lost)
expired        `Broker.expired` (called by `Queue._expire`)
dead_lettered  `Broker.dead_letter` (rejected, or out of delivery attempts)
started        the writer itself, first record of each boot (no message)
unbound        the cluster arbiter (`Routing.unbind`, via `marker`):       queue,
               a group's binding to "<node>/<queue>" was released          group
late           the cluster (`Routing.deliver_to`, late): a stranded        queue
               message of a moved group leaves this node after a node
               loss (policy move), before its ``forwarded`` record
=============  ==========================================================  =========

The core calls `DeliveryLog.event` synchronously from the event loop; the
implementation only appends to an in-memory buffer, and a writer in a worker thread
turns the buffer into files (`delivery_log_format.py` in `amqbroker.pipeline` is the
file format). When the log is off the core holds ``None`` and every event site costs
one attribute test.

Invariants: one call per event, except the common arrival below; `entry` is read at
the call (its delivery-count and group are those of that moment); `Entry.trace` caches
the message-id text, the producer id and the producer identity (set by the protocol
layer at `received`, filled lazily otherwise).

The common arrival is one record, not three (issue 22: the log's cost is per record):
when `accept` hands a message to the one queue named as its address, it *holds* the
message's ``received`` record (`DeliveryLog.held`, `held_queue`) instead of recording
it, `Queue.enqueue` records no ``routed`` for a held message, and the log records one
buffered record standing for ``received`` + ``routed`` (`RECEIVED_ROUTED`), or for
those and the ``dispatched`` of the same call (`RECEIVED_DISPATCHED`, when the
message goes out at once). Any other event first records the held one, so the order
of the records is the order of the events; the writer expands a folded record into
the records it stands for (same time, consecutive seqs) before writing: the files
are the same as with one call per event.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from amqbroker.core.consumer import Consumer
    from amqbroker.core.entry import Entry

#: event codes: indices into `amqbroker.pipeline.delivery_log_format.EVENTS` (the
#: names written to the files; a unit test checks they agree)
RECEIVED = 0
ROUTED = 1
FORWARDED = 2
DISPATCHED = 3
SETTLED = 4
RELEASED = 5
EXPIRED = 6
DEAD_LETTERED = 7
STARTED = 8
UNBOUND = 9
LATE = 10
#: buffered only, never written (see the module docstring): one record for received +
#: routed, and one for received + routed + dispatched, of a message taken by the
#: queue named as its address (`records_of`)
FOLDED = 64
RECEIVED_ROUTED = FOLDED
RECEIVED_DISPATCHED = FOLDED + 1


def records_of(code: int) -> int:
    """How many written records a buffered record of event `code` stands for (a
    folded one: two or three; the writer's Arrow expansion computes the same column-wise)."""
    return code - FOLDED + 2 if code >= FOLDED else 1


#: why the arbiter released a binding (the ``outcome`` column of an ``unbound`` marker)
UNBIND_NODE_LOST = "node-lost"  # its node was lost, policy move
UNBIND_IDLE = "idle"  # unused for grouping_group_timeout
UNBIND_CONSUMERLESS = "consumerless"  # no consumer for grouping_consumerless_timeout
UNBIND_QUEUE_DELETED = "queue-deleted"  # its queue instance was deleted
UNBIND_FORCED = "force-removed"  # a proposer reported the binding stale
UNBIND_REASONS = (
    UNBIND_NODE_LOST,
    UNBIND_IDLE,
    UNBIND_CONSUMERLESS,
    UNBIND_QUEUE_DELETED,
    UNBIND_FORCED,
)

#: settled outcomes
ACCEPTED = "accepted"
REJECTED = "rejected"
RELEASED_OUTCOME = "released"
MODIFIED = "modified"


class DeliveryLog(Protocol):
    #: the message whose ``received`` record `accept` holds back (None: none), and the
    #: queue (= address) name it was received at and routed to
    held: Entry | None
    held_queue: str

    def event(
        self,
        event: int,
        queue: str | None,
        entry: Entry,
        consumer: Consumer | None = None,
        outcome: str | None = None,
    ) -> None:
        """Record one event (buffered; never blocks, never raises)."""
        ...

    @property
    def full(self) -> bool:
        """The buffer is at its bound (producers under the `block` overflow policy
        wait for the writer before they get more credit)."""
        ...

    def block(self, producer: BlockedProducer) -> None:
        """Resume `producer` once the writer has taken the buffer."""
        ...

    def forget(self, producer: BlockedProducer) -> None: ...

    def marker(self, event: int, queue: str, group_id: str, reason: str | None = None) -> None:
        """Record a marker about a group, not a message (`UNBOUND`: ``queue`` =
        "<node>/<queue>" of the released binding, `reason` one of `UNBIND_REASONS`);
        buffered, never raises."""
        ...

    def set_owner_epoch(self, epoch: int) -> None:
        """Records from the next event on carry this owner epoch (the cluster's
        grouping-arbiter epoch; 0 on a single node)."""
        ...


class BlockedProducer(Protocol):
    def resume(self) -> None: ...
