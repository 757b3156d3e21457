"""A queue: the storage of ordered messages, their accounting and their settlement.

Theory of operation
-------------------
Messages wait in the *main order*: one deque per priority level (0..9), each sorted by
`seq`. Where a message goes from there is the group dispatcher's decision
(`amqbroker.core.group_dispatch`, `Queue.dispatcher`): consumers, the group table,
the dispatch pass and the enqueue fast path (a message that arrives with nothing
queued ahead is offered at once, and delivered or parked without entering a pass).
Who takes the first message of a group is the queue's owner policy
(`amqbroker.core.owner_policies`); when the queue may dispatch at all is its gate
(`amqbroker.core.dispatch_gate`).

A message that cannot go now is *parked* instead of blocking the queue (decision D4,
skip-ahead): it moves out of the main order to the tail of its group's `parked` deque,
and the group joins its owner's `parked_groups`; when the owner gets credit it is served
from there first. `group_skip_ahead=False` stops the pass at a busy owner instead,
which is Artemis's strict head-of-line behaviour.

Returned messages (release, modify, consumer detach) go back to their `seq` position.
On detach the consumer's unsettled messages are back in place *before* its groups are
released (C-1), so a new owner sees them first (C-2). A message waiting out its
redelivery delay (or a scheduled delivery time) *holds* its group: later messages of
the group park until it is back.

Invariants (checked by the property-based tests):
- a message is in exactly one place: main order, a group's parked deque, unmatched,
  a delay timer, in flight to one consumer, or the page;
- a bound group has exactly one owner, registered in `owner.bound`;
- `count` covers every message the queue holds, in flight and paged included; `bytes`
  (and the address size / memory budget) cover the messages in memory only.

Views (listing groups, taking waiting messages, the expiry scan) live in
`amqbroker.core.queue_views`, paging in `amqbroker.core.queue_paging`, message ages
in `amqbroker.core.arrivals`; the queue exposes them under their usual names.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from amqbroker.core import delivery_log as dl
from amqbroker.core import queue_paging, queue_views
from amqbroker.core.arrivals import ArrivalMarks
from amqbroker.core.consumer import Consumer
from amqbroker.core.delivery_log import DeliveryLog
from amqbroker.core.entry import Entry
from amqbroker.core.group_dispatch import (
    DELIVERED,
    NO_TAKER,
    OWNER_BUSY,
    SPENT_CLOSE,
    GroupDispatcher,
    _insert_by_seq,
)
from amqbroker.core.groups import EXCLUSIVE, HOLD, bucket_of
from amqbroker.core.persistence import NoPersistence, Persistence
from amqbroker.core.timers import Timers

if TYPE_CHECKING:
    from amqbroker.core.address import Address

__all__ = ["LEVELS", "SPENT_CLOSE", "Pager", "Queue", "QueueHost", "QueuePolicy"]

LEVELS = 10


@dataclass(frozen=True)
class QueuePolicy:
    """Everything a queue's behaviour depends on (resolved from address settings and
    the queue's own options). Times are milliseconds, as in Artemis's settings."""

    group_buckets: int = -1
    group_rebalance: bool = False
    group_rebalance_pause_dispatch: bool = False
    group_first_key: str | None = None
    exclusive: bool = False
    consumers_before_dispatch: int = 0
    delay_before_dispatch: int = -1
    group_skip_ahead: bool = True
    group_owner_policy: str = "round-robin"
    group_unbind_on_undeliverable: bool = False
    group_pause_dispatch_timeout: int = -1
    group_id_from_application_properties: bool = True
    max_delivery_attempts: int = 10
    redelivery_delay: int = 0
    dispatch_batch: int = 10_000
    #: seconds; resolution of message ages and group settle times (management)
    age_resolution: float = 1.0
    #: most arrival marks a queue keeps (older ones are thinned out)
    age_marks: int = 1024


class Pager(Protocol):
    """The page store as the core sees it (`amqbroker.store.paging.PageStore`): calls
    only buffer, the application writes and reads."""

    def page(self, qid: int, entry: Entry) -> None: ...

    def drop(self, qid: int) -> None: ...

    def forget(self, qid: int) -> None: ...


class QueueHost(Protocol):
    """What a queue needs from the broker that owns it."""

    clock: Callable[[], float]
    timers: Timers

    def schedule_dispatch(self, queue: Queue) -> None: ...

    def dead_letter(self, queue: Queue, entry: Entry, reason: str) -> None: ...

    def expired(self, queue: Queue, entry: Entry) -> None: ...

    def queue_idle(self, queue: Queue) -> None: ...


class Queue:
    # Views and paging are functions of their own modules; these names keep the
    # queue's interface (management, telemetry, the cluster and the store call them).
    browse = queue_views.browse
    list_groups = queue_views.list_groups
    group_details = queue_views.group_details
    group_count = queue_views.group_count
    largest_groups = queue_views.largest_groups
    group_blocked_seconds = queue_views.group_blocked_seconds
    oldest_waiting_seq = queue_views.oldest_waiting_seq
    take_waiting = queue_views.take_waiting
    expire_scan = queue_views.expire_scan
    _all_waiting = queue_views.all_waiting
    depage = queue_paging.depage
    page_lost = queue_paging.page_lost
    restore_paged = queue_paging.restore_paged

    def __init__(
        self,
        name: str,
        host: QueueHost,
        *,
        qid: int = 0,
        address: Address | None = None,
        policy: QueuePolicy | None = None,
        durable: bool = False,
        temporary: bool = False,
        auto_created: bool = False,
        subscription: bool = False,
        persistence: Persistence | None = None,
        options: dict[str, Any] | None = None,
    ) -> None:
        self.name = name
        self.qid = qid
        self.address = address
        self.durable = durable
        self.temporary = temporary
        self.auto_created = auto_created
        #: a multicast subscriber's own queue: deleted when its consumer leaves
        self.subscription = subscription
        #: queue options given in the address string (persisted with the queue)
        self.options = dict(options or {})
        #: name of the topic subscription this queue holds (durable or shared), if any
        self.subscription_name: str | None = None
        #: the subscription's selector (text) and compiled filter, applied at routing
        self.selector: str | None = None
        self.filter: Callable[[Entry], bool] | None = None
        #: no-local subscription: messages from `no_local_origin` are not routed here
        self.no_local = False
        self.no_local_origin: str | None = None
        #: messages waiting for their scheduled delivery time
        self.scheduled = 0
        self.host = host
        self.clock = host.clock
        self.timers = host.timers
        self.store: Persistence = persistence if persistence is not None else NoPersistence()
        #: the delivery log, None when off (each event site tests this once)
        self.dlog: DeliveryLog | None = getattr(host, "dlog", None)
        self.deleted = False
        #: the main order: one seq-sorted deque per priority; `top` bounds the highest
        #: non-empty level, `n_main` counts the messages in it
        self.levels: list[deque[Entry]] = [deque() for _ in range(LEVELS)]
        self.top = -1
        self.n_main = 0
        self.last_seq = 0
        #: messages held (main + parked + unmatched + delayed + in flight)
        self.count = 0
        self.bytes = 0
        self.inflight = 0
        self.enqueued = 0
        self.acked = 0
        self.expired_count = 0
        self.dead_lettered = 0
        self.stuck_messages = 0
        self.ages = ArrivalMarks(self)
        self.arrival_time = self.ages.arrival_time
        #: paging (see `queue_paging`): set by the broker for a PAGE address
        self.pager: Pager | None = None
        self.paged_count = 0
        self.paged_bytes = 0
        #: highest seq that has left the page (read back or purged): persisted with a
        #: durable queue as `paged_through`
        self.page_mark = 0
        self.last_paged = 0
        self.first_key: str | None = None
        d = self.dispatcher = GroupDispatcher(self)
        # the hot path's shortcuts into the dispatcher (objects it never replaces)
        self._groups = d.table
        self._marks = d.marks
        self._gate = d.gate
        # the dispatcher's operations, under the queue's names
        self.dispatch = d.dispatch
        self.remove_consumer = d.remove_consumer
        self.credit_changed = d.credit_changed
        self.consumers = d.consumers
        self.hold_group = d.hold_group
        self.unhold_group = d.unhold_group
        self.reset_group = d.reset_group
        self.reset_all_groups = d.reset_all_groups
        self.admin_pause = d.gate.admin_pause
        self.admin_resume = d.gate.admin_resume
        self.policy = policy or QueuePolicy()

    # ------------------------------------------------------------------ policy
    @property
    def policy(self) -> QueuePolicy:
        return self._policy

    @policy.setter
    def policy(self, policy: QueuePolicy) -> None:
        """Replace the policy; a change of grouping mode clears the group table."""
        old = getattr(self, "_policy", None)
        self._policy = policy
        grouped = policy.exclusive or policy.group_buckets != 0
        self.first_key = policy.group_first_key if grouped else None
        self.dispatcher.set_policy()
        if old is not None and (
            old.group_buckets != policy.group_buckets or old.exclusive != policy.exclusive
        ):
            self.reset_all_groups()
            for e in self._all_waiting():
                e.gkey = self.key_of(e.group_id)

    def key_of(self, group_id: str | None) -> Any:
        p = self._policy
        if p.exclusive:
            return EXCLUSIVE
        if group_id is None or p.group_buckets == 0:
            return None
        if p.group_buckets < 0:
            return group_id
        return bucket_of(group_id, p.group_buckets)

    # ----------------------------------------------------------------- enqueue
    def admits(self, e: Entry) -> bool:
        """Whether a routed message belongs in this queue (subscription selector and
        no-local; plain queues admit everything)."""
        if self.no_local_origin is not None and e.origin == self.no_local_origin:
            return False
        f = self.filter
        return f is None or f(e)

    def enqueue(self, e: Entry) -> None:
        """Add a message at the tail (routing calls this)."""
        self.last_seq += 1
        e.seq = self.last_seq
        if not self.ages.armed:
            self.ages.stamp(e.seq)
        if self.pager is not None and (self.paged_count or (self.address and self.address.full)):
            queue_paging.page_out(self, e)
            return
        # `key_of`, inline: this runs once per message
        gid = e.group_id
        pol = self._policy
        if pol.exclusive:
            e.gkey = EXCLUSIVE
        elif gid is None or not (b := pol.group_buckets):
            e.gkey = None
        else:
            e.gkey = gid if b < 0 else bucket_of(gid, b)
        n = len(e.data)
        self.count += 1
        self.bytes += n
        a = self.address
        if a is not None:
            a.size += n
            a.budget.used += n
        self.enqueued += 1
        dlog = self.dlog
        if dlog is not None and dlog.held is not e:  # a held one is folded (accept)
            dlog.event(dl.ROUTED, self.name, e)
        if self.durable and e.durable:
            self.store.message_added(self.qid, e)
        if e.deliver_at and self.schedule(e):
            return
        # fast path: nothing queued ahead, so this message is the head: make the
        # decision a dispatch pass would make, without entering one
        d = self.dispatcher
        if not self.n_main and d.flowing and not d.in_dispatch and not e.expiry:
            r = d.offer(e)
            if r == DELIVERED:
                return
            if r != NO_TAKER and (r != OWNER_BUSY or pol.group_skip_ahead):
                d.park(e, r)  # what the pass would do with it, without the pass
                return
        p = e.priority
        self.levels[p].append(e)
        self.n_main += 1
        if p > self.top:
            self.top = p
        d.dispatch()

    def restore(self, entries: Iterable[Entry]) -> None:
        """Put recovered messages back (already in seq order, seq kept)."""
        for e in entries:
            e.gkey = (
                self.key_of(e.group_id)
                if (e.group_id is not None or self._policy.exclusive)
                else None
            )
            self.last_seq = max(self.last_seq, e.seq)
            self.account(e)
            if e.deliver_at and self.schedule(e):
                continue
            self.insert_main(e)

    def schedule(self, e: Entry) -> bool:
        """Hold a message until its delivery time (JMS delivery delay). Like a
        redelivery delay it holds its group: later messages of the group wait behind
        it instead of overtaking it. False when the time has already come."""
        at = e.deliver_at / 1000.0
        if at <= self.clock():
            e.deliver_at = 0
            return False
        hg = self.dispatcher.step(HOLD, e.gkey) if e.gkey is not None else None
        self.scheduled += 1
        self.dispatcher.hold_until(e, hg, at, scheduled=True)
        return True

    def account(self, e: Entry) -> None:
        n = len(e.data)
        self.count += 1
        self.bytes += n
        a = self.address
        if a is not None:
            a.size += n
            a.budget.used += n

    def insert_main(self, e: Entry) -> None:
        """Insert at the seq position within its priority level."""
        p = e.priority
        self.n_main += 1
        self.top = max(self.top, p)
        _insert_by_seq(self.levels[p], e)

    def merge_main(self, entries: list[Entry]) -> None:
        """Put back several messages at their seq positions: O(k log k) when they are
        all older than what is queued (the usual case), O(n + k log k) otherwise."""
        if not entries:
            return
        if len(entries) == 1:
            self.insert_main(entries[0])
            return
        by_level: dict[int, list[Entry]] = {}
        for e in entries:
            by_level.setdefault(e.priority, []).append(e)
        for p, es in by_level.items():
            es.sort(key=_seq)
            dq = self.levels[p]
            if not dq or es[-1].seq < dq[0].seq:
                dq.extendleft(reversed(es))
            elif es[0].seq > dq[-1].seq:
                dq.extend(es)
            else:
                self.levels[p] = deque(heapq.merge(dq, es, key=_seq))
            self.n_main += len(es)
            self.top = max(self.top, p)

    # -------------------------------------------------------------- settlement
    def ack(self, c: Consumer, e: Entry) -> None:
        """Consumer accepted (settlement hook: a transaction will buffer this call)."""
        c.inflight -= 1
        self.inflight -= 1
        self.acked += 1
        c.settled += 1  # slow-consumer counters, inline: this is the hot path
        if not c.inflight and not self.n_main and not c.parked_groups:
            c.idle_marks += 1
        if e.gkey is not None:  # the group's settle time, inline: this is the hot path
            if not self.ages.armed:
                self.ages.stamp(self.last_seq + 1)
            g = self._groups.get(e.gkey)
            if g is not None:
                g.settled_at = self.ages.coarse
        if self.dlog is not None:
            self.dlog.event(dl.SETTLED, self.name, e, c, dl.ACCEPTED)
        self.remove(e)
        if self._gate.paused and not self.inflight:
            self._gate.check_pause()

    def reject(self, c: Consumer, e: Entry) -> None:
        """`rejected`: dead-letter (or drop when no dead-letter address is set)."""
        c.inflight -= 1
        self.inflight -= 1
        if self.dlog is not None:
            self.dlog.event(dl.SETTLED, self.name, e, c, dl.REJECTED)
        # the copy is routed before the original is acknowledged: a crash in between
        # can duplicate the message, never lose it
        self.dead_lettered += 1
        _group_settled(self, e)
        self.host.dead_letter(self, e, "rejected by consumer")
        self.remove(e)
        if self._gate.paused and not self.inflight:
            self._gate.check_pause()
        _idle_mark(self, c)

    def release(
        self,
        c: Consumer,
        e: Entry,
        *,
        delivery_failed: bool = False,
        undeliverable_here: bool = False,
    ) -> None:
        """`released` / `modified`: back to its position, for the same owner."""
        c.inflight -= 1
        self.inflight -= 1
        _group_settled(self, e)
        if self.dlog is not None:
            self.dlog.event(
                dl.SETTLED,
                self.name,
                e,
                c,
                dl.MODIFIED if (delivery_failed or undeliverable_here) else dl.RELEASED_OUTCOME,
            )
        if delivery_failed and not self.count_failure(e):
            self.dispatcher.gate.check_pause()
            _idle_mark(self, c)
            return
        if not delivery_failed and e.durable and self.durable and c.counts_attempts:
            self.store.message_returned(self.qid, e)
        delay = self._policy.redelivery_delay if delivery_failed else 0
        self.dispatcher.put_back(c, e, delay, undeliverable_here)
        _idle_mark(self, c)

    def count_failure(self, e: Entry) -> bool:
        """Increment delivery-count; dead-letter past max-delivery-attempts.
        Returns True when the message stays in the queue."""
        e.delivery_count += 1
        m = self._policy.max_delivery_attempts
        if m >= 0 and e.delivery_count >= m:
            self.dead_lettered += 1
            self.host.dead_letter(self, e, f"delivery attempts reached max-delivery-attempts ({m})")
            self.remove(e)
            return False
        if self.durable and e.durable:
            self.store.delivery_count_updated(self.qid, e)
        return True

    def remove(self, e: Entry) -> None:
        """The queue forgets `e` (settled, expired, dead-lettered, moved, purged)."""
        n = len(e.data)
        self.count -= 1
        self.bytes -= n
        a = self.address
        if a is not None:
            a.size -= n
            b = a.budget
            b.used -= n
            if b.waiting and b.used < b.limit:
                b.release()
            if a.blocked_producers and not a.full:
                a.unblock()
            if b.paging and b.on_room is not None:
                b.on_room()
        if self._marks:
            self._marks.pop(e, None)
        if self.durable and e.durable:
            self.store.message_acked(self.qid, e)

    def expire(self, e: Entry) -> None:
        self.expired_count += 1
        self.host.expired(self, e)
        self.remove(e)

    # ------------------------------------------------------------ transactions
    # A transaction holds a consumer's outcome until discharge; the message stays in
    # flight. If the consumer detached meanwhile (its `inflight` was reset by
    # `remove_consumer`, which never saw the held message), the outcome is applied
    # through these: the same settlement, with a stand-in consumer for the accounting.
    def ack_detached(self, e: Entry) -> None:
        """Commit of an `accepted` whose consumer is gone."""
        self.ack(Consumer("(detached)"), e)

    def reject_detached(self, e: Entry) -> None:
        """Commit of a `rejected` whose consumer is gone (dead-letter)."""
        self.reject(Consumer("(detached)"), e)

    def return_detached(self, e: Entry, *, delivery_failed: bool = True) -> None:
        """Rollback (or a committed release/modified) of a message whose consumer is
        gone: back to its position (its group's parked messages, or the main order;
        a held group keeps its hold), delivery-count + 1 when `delivery_failed`."""
        self.release(Consumer("(detached)"), e, delivery_failed=delivery_failed)

    # ------------------------------------------------------------------ state
    def add_consumer(self, c: Consumer) -> None:
        c.queue = self
        self.dispatcher.add_consumer(c)

    @property
    def dispatching(self) -> bool:
        return self.dispatcher.gate.dispatching

    @property
    def paused(self) -> bool:
        """Paused by an operator (not the transient rebalance pause)."""
        return self.dispatcher.gate.admin_paused

    @property
    def consumer_count(self) -> int:
        return self.dispatcher.consumers_n

    @property
    def ready_count(self) -> int:
        """Messages in the main order: waiting for any consumer that has credit (not
        parked on a group, unmatched, delayed or in flight)."""
        return self.n_main

    def purge(self) -> int:
        """Drop every queued (not in flight) message, paged ones included."""
        paged = queue_paging.drop_paged(self)
        dropped = list(self._all_waiting())
        for dq in self.levels:
            dq.clear()
        self.n_main = 0
        d = self.dispatcher
        for g in d.table.values():
            g.parked = None
            d._unparked(g)
        d.unmatched.clear()
        for e in dropped:
            self.remove(e)
        return len(dropped) + paged

    def close(self) -> list[Consumer]:
        """Queue deleted: returns the consumers the protocol layer must detach."""
        self.deleted = True
        self.dispatcher.close()
        return self.consumers()

    def statistics(self) -> dict[str, Any]:
        d = self.dispatcher
        return {
            "messages": self.count,
            "bytes": self.bytes,
            "consumers": d.consumers_n,
            "in_flight": self.inflight,
            "enqueued": self.enqueued,
            "acknowledged": self.acked,
            "expired": self.expired_count,
            "dead_lettered": self.dead_lettered,
            "groups": self.group_count(),
            "blocked_groups": sum(1 for g in d.table.values() if g.parked),
            "stuck_groups": d.stuck_groups,
            "stuck_messages": self.stuck_messages,
            "group_owner_changes": d.owner_changes,
            "group_blocked_seconds": self.group_blocked_seconds(),
            "unmatched": len(d.unmatched),
            "delayed": len(d.delayed),
            "scheduled": self.scheduled,
            "dispatching": self.dispatching,
            "paged_messages": self.paged_count,
            "paged_bytes": self.paged_bytes,
        }

    def __repr__(self) -> str:
        return f"<Queue {self.name!r} count={self.count} consumers={self.dispatcher.consumers_n}>"


def _seq(e: Entry) -> int:
    return e.seq


def _group_settled(q: Queue, e: Entry) -> None:
    """A message of a group was settled (any outcome): the group's `settled_at`."""
    if e.gkey is None:
        return
    ages = q.ages
    if not ages.armed:
        ages.stamp(q.last_seq + 1)
    g = q.dispatcher.table.get(e.gkey)
    if g is not None:
        g.settled_at = ages.coarse


def _idle_mark(q: Queue, c: Consumer) -> None:
    """Slow-consumer counters (see `core.consumer`): one more settlement, and an idle
    mark when nothing else waits for the consumer."""
    c.settled += 1
    if not c.inflight and not q.n_main and not c.parked_groups:
        c.idle_marks += 1
