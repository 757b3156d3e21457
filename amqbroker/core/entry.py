"""One queued message: the only per-message Python object the broker keeps.

An `Entry` holds the message exactly as it was received (`data`, the encoded AMQP
sections) plus the few fields the broker routes and dispatches on, scanned once at
arrival by the protocol layer. The bytes are never decoded again on the hot path; when
the broker must change something on the wire (delivery-count, an annotation it adds)
the protocol layer splices a copy at send time and the stored `data` stays as received.

Each queue gets its own Entry for a message (multicast shares the `data` bytes object
between the copies), so per-queue state such as `delivery_count` and `seq` lives here.

Invariants:
- `seq` is unique and increasing within a queue; queue order is `seq` order within a
  priority level, and a returned message goes back to its `seq` position.
- `gkey` is the group key *for this queue* (group id, bucket index, the exclusive
  sentinel, or None when ungrouped); the queue computes it from `group_id` on enqueue.
  Once the dispatcher has looked up a bound group for a message whose key is its group
  id, both name the group's own key string (an equal value, one object per group).
"""

from __future__ import annotations

from typing import Any


class Entry:
    __slots__ = (
        "data",
        "deliver_at",
        "delivery_count",
        "durable",
        "expiry",
        "fields",
        "gkey",
        "group_id",
        "group_seq",
        "origin",
        "priority",
        "seq",
        "store_ref",
        "trace",
    )

    def __init__(
        self,
        data: bytes,
        durable: bool = False,
        priority: int = 4,
        expiry: int = 0,
        delivery_count: int = 0,
        group_id: str | None = None,
        group_seq: int = 0,
    ) -> None:
        self.data = data
        #: header.durable as sent
        self.durable = durable
        #: 0..9 (AMQP priorities above 9 are clamped to 9, as JMS brokers do)
        self.priority = priority
        #: absolute expiry time in epoch milliseconds; 0 = never expires
        self.expiry = expiry
        #: prior unsuccessful delivery attempts (AMQP header.delivery-count)
        self.delivery_count = delivery_count
        #: group id of the message (properties.group-id or the application-property fallback)
        self.group_id = group_id
        #: group sequence as a signed 32-bit int; -1 closes the group
        self.group_seq = group_seq
        #: position in its queue (set by the queue on enqueue)
        self.seq = 0
        #: group key in its queue (set by the queue on enqueue)
        self.gkey: Any = None
        #: opaque slot for the store (e.g. the journal segment holding the record)
        self.store_ref = 0
        #: scheduled delivery time in epoch milliseconds (JMS delivery delay); 0 = now
        self.deliver_at = 0
        #: the decoded fields a selector reads, cached on first evaluation (None until
        #: then; filled by the protocol layer, opaque to the core)
        self.fields: Any = None
        #: id of the connection that sent the message (no-local); None when unknown
        self.origin: str | None = None
        #: delivery log only: (message-id text, producer id, producer identity), set
        #: at `received` or on the first event; None while the log is off
        self.trace: tuple[str | None, str | None, str | None] | None = None

    @property
    def size(self) -> int:
        return len(self.data)

    def copy(self) -> Entry:
        """A fresh entry for another queue, sharing the message bytes."""
        e = Entry(
            self.data,
            self.durable,
            self.priority,
            self.expiry,
            self.delivery_count,
            self.group_id,
            self.group_seq,
        )
        e.deliver_at = self.deliver_at
        e.fields = self.fields
        e.origin = self.origin
        e.trace = self.trace
        return e

    def __repr__(self) -> str:
        return (
            f"Entry(seq={self.seq}, size={len(self.data)}, group={self.group_id!r}/"
            f"{self.group_seq}, dc={self.delivery_count}, prio={self.priority})"
        )
