"""Group keys, bucket hashing and the per-group state of a queue.

A queue's *group table* maps a group key to a `Group`. The key is the group id
(`group-buckets = -1`), a bucket index (`group-buckets = N`), or `EXCLUSIVE` for an
exclusive queue (one implicit group holding every message, which gives exclusive
queues the same ordered hand-over as groups). `group-buckets = 0` means no key.

Bucket hashing reproduces Artemis's `SimpleString.hashCode` so a group lands in the
same bucket as on Artemis (GROUPING.md 3.2): UTF-16LE bytes, each taken as a signed
byte, h = int32(31*h + b); bucket = (h & 0x7FFFFFFF) % N. The management key
`_AMQ_GROUP_BUCKET_INT_KEY_<n>` names bucket (n & 0x7FFFFFFF) % N directly.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from amqbroker.core.consumer import Consumer
    from amqbroker.core.entry import Entry

BUCKET_KEY_PREFIX = "_AMQ_GROUP_BUCKET_INT_KEY_"


class _Exclusive:
    __slots__ = ()

    def __repr__(self) -> str:
        return "EXCLUSIVE"


EXCLUSIVE: Any = _Exclusive()


def artemis_hash(group_id: str) -> int:
    """Artemis SimpleString.hashCode over the UTF-16LE encoding (signed 32-bit)."""
    h = 0
    for b in group_id.encode("utf-16-le"):
        h = (31 * h + (b - 256 if b > 127 else b)) & 0xFFFFFFFF
    return h - (1 << 32) if h >= (1 << 31) else h


def bucket_of(group_id: str, buckets: int) -> int:
    if group_id.startswith(BUCKET_KEY_PREFIX):
        try:
            n = int(group_id[len(BUCKET_KEY_PREFIX) :])
        except ValueError:
            pass
        else:
            if -(1 << 31) <= n < (1 << 31):
                return (n & 0x7FFFFFFF) % buckets
    return (artemis_hash(group_id) & 0x7FFFFFFF) % buckets


def key_name(key: Any) -> str:
    """How a group key is shown to operators."""
    if isinstance(key, int):
        return f"{BUCKET_KEY_PREFIX}{key}"
    return str(key)


class Group:
    """State of one bound (or held) group in one queue.

    `parked` holds messages of this group taken out of the queue's main order because
    they cannot go yet (owner busy, owner refuses them, or an earlier message is
    waiting out its redelivery delay). Invariant: while `parked` is not empty every
    message of this group still in the main order is newer than all of `parked`, so
    new arrivals join the tail of `parked` and group order holds.

    `settled_at` is when a message of the group was last settled (any outcome), or
    when the group was bound if none has been since: management reports the time
    since then. It is the queue's coarse clock (`Queue._coarse`, at most
    `QueuePolicy.age_resolution` old), so the hot path never reads the clock for it.
    """

    __slots__ = (
        "bound_at",
        "held",
        "key",
        "owner",
        "parked",
        "parked_at",
        "settled_at",
        "stuck",
        "waiting",
    )

    def __init__(self, key: Any, owner: Consumer | None, now: float) -> None:
        self.key = key
        self.owner = owner
        self.parked: deque[Entry] | None = None
        #: number of this group's messages waiting out a redelivery delay
        self.held = 0
        #: True while queued on owner.parked_groups waiting for credit
        self.waiting = False
        #: owner can never take the head message (filter / undeliverable-here), reported once
        self.stuck = False
        self.bound_at = now
        #: when `parked` last went from empty to non-empty (0.0 = not blocked); the
        #: queue adds each blocked episode to its telemetry total when it ends
        self.parked_at = 0.0
        self.settled_at = now
