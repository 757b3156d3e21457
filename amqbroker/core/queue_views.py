"""Views of a queue and bulk operations over its waiting messages.

Nothing here is on the hot path: management, telemetry, the reaper and the cluster's
node-loss handling call these (each O(waiting messages) or O(groups)). A waiting
message is in the main order, in a group's parked deque, or unmatched; not in flight,
delayed or paged. Each function takes the queue first; `Queue` exposes them under
the same names (`queue.list_groups()`...).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

from amqbroker.core.arrivals import ArrivalMarks
from amqbroker.core.dispatch_host import QueueStore
from amqbroker.core.group_dispatch import GroupDispatcher
from amqbroker.core.groups import EXCLUSIVE, Group, key_name

if TYPE_CHECKING:
    from amqbroker.core.consumer import Consumer
    from amqbroker.core.entry import Entry


class ViewedQueue(QueueStore, Protocol):
    """The queue as its views see it (`amqbroker.core.queue.Queue`)."""

    last_seq: int
    dispatcher: GroupDispatcher
    ages: ArrivalMarks

    def consumers(self) -> list[Consumer]: ...

    def dispatch(self) -> None: ...


def all_waiting(q: ViewedQueue) -> Iterable[Entry]:
    for dq in q.levels:
        yield from dq
    for g in q.dispatcher.table.values():
        if g.parked:
            yield from g.parked
    yield from q.dispatcher.unmatched


def browse_order(e: Entry) -> tuple[int, int]:
    return (-e.priority, e.seq)


def browse(q: ViewedQueue) -> list[Entry]:
    """The messages waiting in the queue (not in flight, not scheduled), in queue
    order: what a browser (distribution-mode copy) sees, as a snapshot."""
    out = list(all_waiting(q))
    out.sort(key=browse_order)
    return out


def unsettled(c: Consumer) -> Iterable[Entry]:
    f = getattr(c, "unsettled_entries", None)
    return f() if f is not None else ()


def oldest_waiting_seq(q: ViewedQueue) -> int | None:
    """Seq of the oldest message waiting in memory (not in flight or delayed)."""
    lo = q.last_seq + 1
    for dq in q.levels:
        if dq:
            lo = min(lo, dq[0].seq)
    for g in q.dispatcher.table.values():
        if g.parked:
            lo = min(lo, g.parked[0].seq)
    for e in q.dispatcher.unmatched:
        lo = min(lo, e.seq)
    return lo if lo <= q.last_seq else None


# ------------------------------------------------------------------- groups
def group_count(q: ViewedQueue) -> int:
    return sum(1 for g in q.dispatcher.table.values() if g.key is not EXCLUSIVE and g.owner)


def group_blocked_seconds(q: ViewedQueue) -> float:
    """Seconds groups have spent blocked: ended episodes plus the ongoing ones
    (so the figure grows while a group waits, and never goes back). O(groups)."""
    now = q.clock()
    d = q.dispatcher
    return d.blocked_time + sum(now - g.parked_at for g in d.table.values() if g.parked_at)


def largest_groups(q: ViewedQueue, n: int) -> list[tuple[str, int, int]]:
    """(group name, waiting messages, seq of its oldest waiting message) for the
    `n` groups with the most waiting messages (main order + parked, not in flight).
    O(waiting messages): for a periodic collector, not the hot path."""
    if n <= 0:
        return []
    backlog: dict[Any, list[int]] = {}
    for e in all_waiting(q):
        k = e.gkey
        if k is None or k is EXCLUSIVE:
            continue
        b = backlog.get(k)
        if b is None:
            backlog[k] = [1, e.seq]
        else:
            b[0] += 1
            if e.seq < b[1]:
                b[1] = e.seq
    top = heapq.nlargest(n, backlog.items(), key=lambda kv: kv[1][0])
    return [(key_name(k), b[0], b[1]) for k, b in top]


def list_groups(q: ViewedQueue) -> list[dict[str, Any]]:
    backlog: dict[Any, int] = {}
    for e in all_waiting(q):
        if e.gkey is not None:
            backlog[e.gkey] = backlog.get(e.gkey, 0) + 1
    inflight: dict[Any, int] = {}
    for c in q.consumers():
        for e in unsettled(c):
            if e.gkey is not None:
                inflight[e.gkey] = inflight.get(e.gkey, 0) + 1
    out = []
    for g in q.dispatcher.table.values():
        if g.key is EXCLUSIVE or g.owner is None:
            continue
        o = g.owner
        out.append(
            {
                "group": key_name(g.key),
                "consumer": o.name,
                "connection": o.connection_id,
                "container": o.container_id,
                "bound_since": g.bound_at,
                "backlog": backlog.get(g.key, 0),
                "in_flight": inflight.get(g.key, 0),
                "blocked": bool(g.parked),
                "stuck": g.stuck,
            }
        )
    return out


def group_details(q: ViewedQueue) -> list[dict[str, Any]]:
    """`list_groups` rows plus what management shows: `bucket` (index when
    bucketed), `settled_at`, and the oldest waiting message (`oldest_seq`) with
    its `oldest_arrival` time (None when nothing of the group waits)."""
    oldest: dict[Any, int] = {}
    for e in all_waiting(q):
        k = e.gkey
        if k is not None and e.seq < oldest.get(k, e.seq + 1):
            oldest[k] = e.seq
    bound = [g for g in q.dispatcher.table.values() if g.key is not EXCLUSIVE and g.owner]
    rows = list_groups(q)
    for g, r in zip(bound, rows, strict=True):
        seq = oldest.get(g.key)
        r["bucket"] = g.key if isinstance(g.key, int) else None
        r["settled_at"] = g.settled_at
        r["oldest_seq"] = seq
        r["oldest_arrival"] = q.ages.arrival_time(seq) if seq is not None else None
    return rows


# ------------------------------------------------- bulk removal of waiting messages
def _take(q: ViewedQueue, take: Callable[[Entry], bool]) -> tuple[list[Entry], list[Group]]:
    """Take every waiting message `take` accepts out of the main order, the parked
    deques and the unmatched messages (still counted: the caller removes them).
    Returns them and the groups whose parked deques lost some."""
    taken: list[Entry] = []
    levels = q.levels
    for i, dq in enumerate(levels):
        keep: deque[Entry] = deque()
        for e in dq:
            (taken if take(e) else keep).append(e)
        if len(keep) != len(dq):
            q.n_main -= len(dq) - len(keep)
            levels[i] = keep
    touched: list[Group] = []
    d = q.dispatcher
    for g in d.table.values():
        pq = g.parked
        if pq:
            kept: deque[Entry] = deque()
            for e in pq:
                (taken if take(e) else kept).append(e)
            if len(kept) != len(pq):
                g.parked = kept or None
                if g.parked is None:
                    d._unparked(g)
                touched.append(g)
    if d.unmatched:
        rest: deque[Entry] = deque()
        for e in d.unmatched:
            (taken if take(e) else rest).append(e)
        d.unmatched = rest
    return taken, touched


def expire_scan(q: ViewedQueue) -> int:
    """Periodic reaper: remove expired messages that are not in flight."""
    now_ms = int(q.clock() * 1000)
    expired, touched = _take(q, lambda e: bool(e.expiry and e.expiry <= now_ms))
    for e in expired:
        q.expire(e)
    return _resume(q, touched, len(expired))  # a stuck head may have expired


def _resume(q: ViewedQueue, touched: Any, taken: int) -> int:
    """After messages were taken out: un-stick the groups touched, dispatch again."""
    q.dispatcher.unstick(touched)
    if taken:
        q.dispatch()
    return taken


def take_waiting(
    q: ViewedQueue, match: Callable[[Entry], bool], sink: Callable[[Entry], None]
) -> int:
    """Take every waiting message `match` accepts (main order, parked, unmatched;
    not in flight, delayed or paged) out of the queue: `sink` gets each one, in
    queue order, before the queue forgets it, so a move to another queue records
    the new copy before this queue's acknowledgement (a crash in between
    duplicates a message, never loses it). Returns how many were taken."""
    taken, touched = _take(q, match)
    taken.sort(key=browse_order)
    for e in taken:
        sink(e)
    for e in taken:
        q.remove(e)
    return _resume(q, touched, len(taken))  # the stuck head may be gone
