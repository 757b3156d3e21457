"""Group keys, bucket hashing, the per-group state of a queue and its lifecycle.

A queue's *group table* maps a group key to a `Group`. The key is the group id
(`group-buckets = -1`), a bucket index (`group-buckets = N`), or `EXCLUSIVE` for an
exclusive queue (one implicit group holding every message, which gives exclusive
queues the same ordered hand-over as groups). `group-buckets = 0` means no key.

Bucket hashing reproduces Artemis's `SimpleString.hashCode` so a group lands in the
same bucket as on Artemis (GROUPING.md 3.2): UTF-16LE bytes, each taken as a signed
byte, h = int32(31*h + b); bucket = (h & 0x7FFFFFFF) % N. The management key
`_AMQ_GROUP_BUCKET_INT_KEY_<n>` names bucket (n & 0x7FFFFFFF) % N directly.

Group lifecycle
---------------
A group's state is read off its fields (`state_of`), never stored twice:

========  ==========================================================================
FREE      not in the group table (the next message binds it afresh)
BOUND     has an owner; nothing parked, not held
BLOCKED   has an owner and parked messages (owner busy, or an earlier message back)
STUCK     the owner refused the group's head message (filter / undeliverable-here);
          reported once, cleared by unbind, or when the head expires or is taken
HELD      `held` > 0: a message of the group waits out a delay, or a cluster node
          holds it; nothing of the group is delivered (owner or not)
ORPHAN    no owner, not held: nobody ready accepted its first message; its messages
          wait parked until a consumer change or credit retries them
========  ==========================================================================

`TRANSITIONS` is the table of legal (state, event) pairs with the states each may
lead to; `GroupDispatcher.step` (core/group_dispatch.py) is the one function that
applies an event, and raises `IllegalGroupTransition` for a pair not in the table.
Appending to an already non-empty parked deque is not an event (the state does not
change): the dispatch pass does that inline.
"""

from __future__ import annotations

import re
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


#: what Java's Integer.parseInt reads: a sign and decimal digits, nothing else (Python's
#: int() also takes surrounding whitespace and underscores between digits)
_JAVA_INT = re.compile(r"[+-]?\d+")


def bucket_of(group_id: str, buckets: int) -> int:
    """The bucket of `group_id` among `buckets`, as Artemis computes it: the number of
    a `_AMQ_GROUP_BUCKET_INT_KEY_<n>` id when `<n>` is an int32 Java would parse,
    else the id's hash."""
    if group_id.startswith(BUCKET_KEY_PREFIX):
        digits = group_id[len(BUCKET_KEY_PREFIX) :]
        if _JAVA_INT.fullmatch(digits):
            n = int(digits)
            if -(1 << 31) <= n < (1 << 31):
                return (n & 0x7FFFFFFF) % buckets
    return (artemis_hash(group_id) & 0x7FFFFFFF) % buckets


def key_name(key: Any) -> str:
    """How a group key is shown to operators."""
    if isinstance(key, int):
        return f"{BUCKET_KEY_PREFIX}{key}"
    return str(key)


# states
FREE = "free"
BOUND = "bound"
BLOCKED = "blocked"
STUCK = "stuck"
HELD = "held"
ORPHAN = "orphan"

# events
BIND = "bind"  # a consumer takes the first message of a free group
WAIT = "wait"  # nobody ready accepts the first message: the group waits owner-less
PARK = "park"  # a message joins the group's parked messages (at its seq position)
STICK = "stick"  # the owner refused the head message
DRAIN = "drain"  # the parked messages are all gone (delivered or expired)
HOLD = "hold"  # one more hold (delay, redelivery delay, cluster node)
UNHOLD = "unhold"  # one hold ends; the last one resumes the group
RESUME = "resume"  # the group may move: owner served, owner-less one rebinds afresh
UNSTICK = "unstick"  # the stuck head may be gone (expired, taken): clear, resume
UNBIND = "unbind"  # the owner lets go (close, detach, reset, rebalance)

_OWNED = (BOUND, BLOCKED, STUCK)
_LIVE = (*_OWNED, HELD, ORPHAN)

#: (state, event) -> the states the event may lead to
TRANSITIONS: dict[tuple[str, str], tuple[str, ...]] = {
    (FREE, BIND): (BOUND,),
    (FREE, WAIT): (ORPHAN,),
    (FREE, HOLD): (HELD,),
    **{(s, PARK): (BLOCKED if s == BOUND else s,) for s in _LIVE},
    (BLOCKED, STICK): (STUCK,),
    (STUCK, STICK): (STUCK,),
    (BOUND, DRAIN): (BOUND,),
    (BLOCKED, DRAIN): (BOUND,),
    (STUCK, DRAIN): (STUCK,),
    (HELD, DRAIN): (HELD,),
    **{(s, HOLD): (HELD,) for s in _LIVE},
    (HELD, UNHOLD): (HELD, *_OWNED, FREE),
    **{(s, RESUME): (s,) for s in _OWNED},
    (HELD, RESUME): (HELD,),
    (ORPHAN, RESUME): (FREE,),
    **{(s, UNSTICK): (*_OWNED, HELD, FREE) for s in _LIVE},
    **{(s, UNBIND): (FREE,) for s in _OWNED},
    (HELD, UNBIND): (HELD,),
}


class IllegalGroupTransition(RuntimeError):
    def __init__(self, state: str, event: str, key: Any) -> None:
        super().__init__(f"group {key_name(key)!r}: event {event!r} in state {state!r}")
        self.state = state
        self.event = event


def state_of(g: Group | None) -> str:
    if g is None:
        return FREE
    if g.held:
        return HELD
    if g.owner is None:
        return ORPHAN
    if g.stuck:
        return STUCK
    if g.parked:
        return BLOCKED
    return BOUND


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
