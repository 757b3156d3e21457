"""A queue: ordered messages, attached consumers, and the group dispatcher.

Theory of operation
-------------------
Messages wait in the *main order*: one deque per priority level (0..9), each sorted by
`seq`. A dispatch pass takes the head of the highest non-empty level and decides:

* ungrouped message: the next consumer, by priority then round robin, that has credit
  and accepts it (filter slot, undeliverable-here marks);
* message of an unbound group: chosen the same way (or least-loaded), and the group is
  bound to that consumer (unless the message closes the group, sequence -1);
* message of a bound group: only its owner may take it.

A message that cannot go now is *parked* instead of blocking the queue (decision D4,
skip-ahead): it moves out of the main order to the tail of its group's `parked` deque,
and the group joins its owner's `parked_groups`; when the owner gets credit it is served
from there first. Each message is thus examined O(1) times whatever the number of
groups or blocked groups, and nothing behind a blocked group waits for it. The
per-group ordering guard (GROUPING 3.5.1) is the Group invariant: while a group has
parked messages, every later message of the group joins them, so no message ever
overtakes an earlier one of its group. `group_skip_ahead=False` stops the pass at a busy
owner instead, which is Artemis's strict head-of-line behaviour.

Returned messages (release, modify, consumer detach) go back to their `seq` position.
On detach the consumer's unsettled messages are back in place *before* its groups are
released (C-1), so a new owner sees them first (C-2). A message waiting out its
redelivery delay *holds* its group: later messages of the group park until it is back.

Invariants (checked by the property-based tests):
- a message is in exactly one place: main order, a group's parked deque, `_unmatched`,
  a redelivery timer, in flight to one consumer, or the page;
- a bound group has exactly one owner, registered in `owner.bound`;
- `count` covers every message the queue holds, in flight and paged included; `bytes`
  (and the address size / memory budget) cover the messages in memory only.

Paging (address_full_policy PAGE, see `amqbroker.store.paging`): while the address is
full, or as long as anything is paged, `enqueue` hands the message (seq assigned) to
the page store instead of the in-memory structures, so every paged message is newer
than every message in memory. `depage` takes the oldest paged messages back (in seq
order, read by the store layer off the event loop) and puts them at the tail of the
main order, where grouping applies to them exactly as to any arriving message.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from amqbroker.core import delivery_log as dl
from amqbroker.core.consumer import Consumer
from amqbroker.core.delivery_log import DeliveryLog
from amqbroker.core.entry import Entry
from amqbroker.core.groups import EXCLUSIVE, Group, bucket_of, key_name
from amqbroker.core.persistence import NoPersistence, Persistence
from amqbroker.core.timers import Timer, Timers

if TYPE_CHECKING:
    from amqbroker.core.address import Address

log = logging.getLogger(__name__)

LEVELS = 10

#: group_seq of a closing message (-1) once its close has taken effect: if it is
#: redelivered it neither binds nor unbinds (a newer instance of the group may be bound
#: by then). Outside the int32 range, so no sender can produce it.
SPENT_CLOSE = -(1 << 40)


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


class _Tier:
    """Consumers of one priority level, in attach order, with the round-robin pointer."""

    __slots__ = ("consumers", "priority", "rr")

    def __init__(self, priority: int) -> None:
        self.priority = priority
        self.consumers: list[Consumer] = []
        self.rr = 0


class Queue:
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
        self._host = host
        self._clock = host.clock
        self._timers = host.timers
        self._store: Persistence = persistence if persistence is not None else NoPersistence()
        #: the delivery log, None when off (each event site tests this once)
        self._dlog: DeliveryLog | None = getattr(host, "dlog", None)
        self.deleted = False
        self._levels: list[deque[Entry]] = [deque() for _ in range(LEVELS)]
        self._top = -1
        self._main = 0
        self._seq = 0
        self._groups: dict[Any, Group] = {}
        self._tiers: list[_Tier] = []
        self._consumer_seq = itertools.count(1)
        self._consumers_n = 0
        self._unmatched: deque[Entry] = deque()
        self._retry_unmatched_on_credit = False
        self._undeliverable: dict[Entry, set[Consumer]] = {}
        self._in_dispatch = False
        self._again = False
        self._ready_seen = False
        self._busy_accepting = False
        self._gate_open = False
        self._gate_timer: Timer | None = None
        self._paused = False
        self._pause_timer: Timer | None = None
        self._delayed: set[Timer] = set()
        self._stuck_groups = 0
        self._delivered = 0
        #: owner-less groups created because no consumer accepted their first message
        self._orphans: dict[Any, Group] = {}
        #: messages held (main + parked + unmatched + delayed + in flight)
        self.count = 0
        self.bytes = 0
        self.inflight = 0
        self.enqueued = 0
        self.acked = 0
        self.expired_count = 0
        self.dead_lettered = 0
        self.stuck_messages = 0
        #: telemetry: bindings made (a group got an owner: first, or a new one after
        #: detach, reset, rebalance or close), and seconds groups spent blocked (with
        #: parked messages) in episodes that have ended; see `group_blocked_seconds`
        self.group_owner_changes = 0
        self.group_blocked_time = 0.0
        # management: admin pause and the coarse clock (see "admin pause and ages")
        self._admin_paused = False
        self._stamp_armed = False
        self._coarse = 0.0
        self._arrivals: list[tuple[int, float]] = []
        #: paging (see the paging section): set by the broker for a PAGE address
        self.pager: Pager | None = None
        self.paged_count = 0
        self.paged_bytes = 0
        #: highest seq that has left the page (read back or purged): persisted with a
        #: durable queue as `paged_through`
        self.page_mark = 0
        self._last_paged = 0
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
        if old is not None and (
            old.group_buckets != policy.group_buckets or old.exclusive != policy.exclusive
        ):
            self.reset_all_groups()
            for e in self._all_waiting():
                e.gkey = self._key_of(e.group_id)

    def _key_of(self, group_id: str | None) -> Any:
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
        self._seq += 1
        e.seq = self._seq
        if not self._stamp_armed:
            self._stamp(e.seq)
        if self.pager is not None and (self.paged_count or (self.address and self.address.full)):
            self._page_out(e)
            return
        gid = e.group_id
        e.gkey = self._key_of(gid) if (gid is not None or self._policy.exclusive) else None
        n = len(e.data)
        self.count += 1
        self.bytes += n
        a = self.address
        if a is not None:
            a.size += n
            a.budget.used += n
        self.enqueued += 1
        if self._dlog is not None:
            self._dlog.event(dl.ROUTED, self.name, e)
        if self.durable and e.durable:
            self._store.message_added(self.qid, e)
        if e.deliver_at and self._schedule(e):
            return
        # fast path: nothing queued ahead, so this message is the head: make the
        # decision a dispatch pass would make, without entering one
        if (
            not self._main
            and self._gate_open
            and not self._paused
            and not self._admin_paused
            and not self._in_dispatch
            and not e.expiry
            and self._offer_head(e)
        ):
            return
        p = e.priority
        self._levels[p].append(e)
        self._main += 1
        if p > self._top:
            self._top = p
        self.dispatch()

    def restore(self, entries: Iterable[Entry]) -> None:
        """Put recovered messages back (already in seq order, seq kept)."""
        for e in entries:
            e.gkey = (
                self._key_of(e.group_id)
                if (e.group_id is not None or self._policy.exclusive)
                else None
            )
            self._seq = max(self._seq, e.seq)
            self._account(e)
            if e.deliver_at and self._schedule(e):
                continue
            self._insert_main(e)

    def _schedule(self, e: Entry) -> bool:
        """Hold a message until its delivery time (JMS delivery delay). Like a
        redelivery delay it holds its group: later messages of the group wait behind
        it instead of overtaking it. False when the time has already come."""
        now = self._clock()
        at = e.deliver_at / 1000.0
        if at <= now:
            e.deliver_at = 0
            return False
        hg = None
        if e.gkey is not None:
            hg = self._groups.get(e.gkey)
            if hg is None:
                hg = Group(e.gkey, None, now)
                self._groups[e.gkey] = hg
            hg.held += 1
        self.scheduled += 1

        def due() -> None:
            self.scheduled -= 1
            e.deliver_at = 0
            self._undelay(e, hg, t)

        t = self._timers.call_at(at, due)
        self._delayed.add(t)
        return True

    def _account(self, e: Entry) -> None:
        n = len(e.data)
        self.count += 1
        self.bytes += n
        a = self.address
        if a is not None:
            a.size += n
            a.budget.used += n

    def _insert_main(self, e: Entry) -> None:
        """Insert at the seq position within its priority level."""
        p = e.priority
        self._main += 1
        self._top = max(self._top, p)
        _insert_by_seq(self._levels[p], e)

    def _merge_main(self, entries: list[Entry]) -> None:
        """Put back several messages at their seq positions: O(k log k) when they are
        all older than what is queued (the usual case), O(n + k log k) otherwise."""
        if not entries:
            return
        if len(entries) == 1:
            self._insert_main(entries[0])
            return
        by_level: dict[int, list[Entry]] = {}
        for e in entries:
            by_level.setdefault(e.priority, []).append(e)
        for p, es in by_level.items():
            es.sort(key=_seq)
            dq = self._levels[p]
            if not dq or es[-1].seq < dq[0].seq:
                dq.extendleft(reversed(es))
            elif es[0].seq > dq[-1].seq:
                dq.extend(es)
            else:
                self._levels[p] = deque(heapq.merge(dq, es, key=_seq))
            self._main += len(es)
            self._top = max(self._top, p)

    # ---------------------------------------------------------------- dispatch
    def dispatch(self) -> None:
        """Deliver what can be delivered now (bounded by the dispatch batch)."""
        if self._in_dispatch:
            self._again = True
            return
        if not self._main or not self._consumers_n or self._paused or self._admin_paused:
            return
        if not self._gate_open and not self._check_gate():
            return
        for tier in self._tiers:
            for c in tier.consumers:
                if c.credit > 0 and not c.blocked:
                    break
            else:
                continue
            break
        else:
            return  # every consumer is busy: nothing can move
        self._in_dispatch = True
        try:
            while True:
                self._again = False
                self._dispatch_main()
                if not self._again or not self._main:
                    break
        finally:
            self._in_dispatch = False

    def _dispatch_main(self) -> None:
        budget = self._policy.dispatch_batch
        strict = not self._policy.group_skip_ahead
        first_key = self.first_key is not None
        least_loaded = self._policy.group_owner_policy == "least-loaded"
        levels = self._levels
        groups = self._groups
        now_ms = -1  # read the clock only when a message has an expiry
        while budget > 0:
            lvl = self._top
            while lvl >= 0 and not levels[lvl]:
                lvl -= 1
            self._top = lvl
            if lvl < 0:
                return
            dq = levels[lvl]
            e = dq[0]
            budget -= 1
            if e.expiry:
                if now_ms < 0:
                    now_ms = int(self._clock() * 1000)
                if e.expiry <= now_ms:
                    dq.popleft()
                    self._main -= 1
                    self._expire(e)
                    continue
            key = e.gkey
            if key is None:
                c = self._pick(e)
                if c is None:
                    if not self._ready_seen:
                        return  # every consumer is busy
                    dq.popleft()
                    self._main -= 1
                    self._to_unmatched(e)
                    continue
                dq.popleft()
                self._main -= 1
                self._deliver(c, e, False)
                continue
            g = groups.get(key)
            if g is None:
                c = self._pick_owner(e) if least_loaded else self._pick(e)
                if c is None:
                    if not self._ready_seen:
                        return
                    # nobody ready accepts the group's first message: hold the group
                    dq.popleft()
                    self._main -= 1
                    g = Group(key, None, self._clock())
                    groups[key] = g
                    g.parked = deque((e,))
                    g.parked_at = self._clock()
                    self._orphans[key] = g
                    self._retry_unmatched_on_credit = True
                    continue
                dq.popleft()
                self._main -= 1
                gs = e.group_seq
                if gs in (-1, SPENT_CLOSE) and key is not EXCLUSIVE:
                    # a closing message of an unbound group: no binding, no flag
                    e.group_seq = SPENT_CLOSE
                    self._deliver(c, e, False)
                else:
                    self._bind(key, c)
                    self._deliver(c, e, first_key)
                continue
            o = g.owner
            if g.parked is not None or g.held or o is None:
                dq.popleft()
                self._main -= 1
                self._park(g, e)
                continue
            if o.credit <= 0 or o.blocked:
                if strict:
                    return
                dq.popleft()
                self._main -= 1
                self._park(g, e)
                if not g.waiting:
                    g.waiting = True
                    o.parked_groups.append(g)
                continue
            if (o.filter is not None or self._undeliverable) and not self._accepts(o, e):
                dq.popleft()
                self._main -= 1
                self._park(g, e)
                self._report_stuck(g, e)
                continue
            dq.popleft()
            self._main -= 1
            self._deliver(o, e, False)
            if e.group_seq == -1 and key is not EXCLUSIVE:
                e.group_seq = SPENT_CLOSE
                self._unbind(g)
        if self._main:
            self._host.schedule_dispatch(self)

    def _offer_head(self, e: Entry) -> bool:
        """Deliver `e` as the head of an empty main order if a dispatch pass would
        deliver it now (same rules as `_dispatch_main`); False leaves every other
        outcome (park, unmatched, wait) to the normal pass."""
        key = e.gkey
        if key is None:
            c = self._pick(e)
            if c is None:
                return False
            self._deliver(c, e, False)
            return True
        g = self._groups.get(key)
        if g is None:
            if self._policy.group_owner_policy == "least-loaded":
                c = self._pick_owner(e)
            else:
                c = self._pick(e)
            if c is None:
                return False
            gs = e.group_seq
            if gs in (-1, SPENT_CLOSE) and key is not EXCLUSIVE:
                e.group_seq = SPENT_CLOSE
                self._deliver(c, e, False)
            else:
                self._bind(key, c)
                self._deliver(c, e, self.first_key is not None)
            return True
        o = g.owner
        if o is None or g.parked is not None or g.held or o.credit <= 0 or o.blocked:
            return False
        if (o.filter is not None or self._undeliverable) and not self._accepts(o, e):
            return False
        self._deliver(o, e, False)
        if e.group_seq == -1 and key is not EXCLUSIVE:
            e.group_seq = SPENT_CLOSE
            self._unbind(g)
        return True

    def _park(self, g: Group, e: Entry) -> None:
        if g.parked is None:
            g.parked = deque((e,))
            g.parked_at = self._clock()
        else:
            g.parked.append(e)

    def _pick(self, e: Entry) -> Consumer | None:
        """Round robin within the highest priority tier that has a taker."""
        self._ready_seen = False
        check = bool(self._undeliverable)
        for tier in self._tiers:
            cs = tier.consumers
            n = len(cs)
            start = tier.rr
            for i in range(n):
                idx = start + i
                if idx >= n:
                    idx -= n
                c = cs[idx]
                if c.credit > 0 and not c.blocked:
                    self._ready_seen = True
                    if (c.filter is None and not check) or self._accepts(c, e):
                        tier.rr = idx + 1 if idx + 1 < n else 0
                        return c
        return None

    def _pick_owner(self, e: Entry) -> Consumer | None:
        """least-loaded: fewest bound groups, then least recently served."""
        self._ready_seen = False
        for tier in self._tiers:
            best: Consumer | None = None
            for c in tier.consumers:
                if c.credit > 0 and not c.blocked:
                    self._ready_seen = True
                    if not self._accepts(c, e):
                        continue
                    if best is None or (len(c.bound), c.last_delivery) < (
                        len(best.bound),
                        best.last_delivery,
                    ):
                        best = c
            if best is not None:
                return best
        return None

    def _accepts(self, c: Consumer, e: Entry) -> bool:
        if c.filter is not None and not c.filter(e):
            return False
        marks = self._undeliverable.get(e)
        return marks is None or c not in marks

    def _deliver(self, c: Consumer, e: Entry, first: bool) -> None:
        c.credit -= 1
        self._delivered += 1
        c.last_delivery = self._delivered  # least-loaded tie-break: least recently served
        if c.presettled:
            c.deliver(e, first)
            self._remove(e)
            self.acked += 1
            c.settled += 1  # slow-consumer counters: settled when sent
            if not self._main and not c.parked_groups:
                c.idle_marks += 1
            if self._dlog is not None:
                self._dlog.event(dl.DISPATCHED, self.name, e, c)
                self._dlog.event(dl.SETTLED, self.name, e, c, dl.ACCEPTED)
        else:
            c.inflight += 1
            self.inflight += 1
            if e.durable and self.durable and c.counts_attempts:
                self._store.message_delivered(self.qid, e)
            c.deliver(e, first)
            if self._dlog is not None:
                self._dlog.event(dl.DISPATCHED, self.name, e, c)

    def _bind(self, key: Any, c: Consumer) -> Group:
        self.group_owner_changes += 1
        g = Group(key, c, self._clock())
        self._groups[key] = g
        c.bound[key] = g
        return g

    def _unbind(self, g: Group, collect: list[Entry] | None = None) -> None:
        """Release a group's binding; its parked messages go back to the main order
        (or into `collect`, for one merge after a bulk release)."""
        o = g.owner
        if o is not None:
            o.bound.pop(g.key, None)
            if g.waiting:
                g.waiting = False
                with contextlib.suppress(ValueError):
                    o.parked_groups.remove(g)
            g.owner = None
        if g.stuck:
            g.stuck = False
            self._stuck_groups -= 1
        if g.held:
            return  # stays (owner-less) until its delayed message is back
        del self._groups[g.key]
        self._unparked(g)
        if g.parked:
            parked = list(g.parked)
            g.parked = None
            if collect is not None:
                collect.extend(parked)
            else:
                self._merge_main(parked)

    def _report_stuck(self, g: Group, e: Entry) -> None:
        if g.stuck:
            return
        g.stuck = True
        self._stuck_groups += 1
        self.stuck_messages += 1
        o = g.owner
        owner = f"{o.name!r} of connection {o.connection_id}" if o is not None else "?"
        log.warning(
            "queue %r: group %r is bound to consumer %s, which does not accept its next "
            "message (seq %d: filter or undeliverable-here); the group waits until it is "
            "reset (amqbroker groups reset), the consumer detaches, or "
            "group_unbind_on_undeliverable is set",
            self.name,
            key_name(g.key),
            owner,
            e.seq,
        )

    # --------------------------------------------------- consumers and credit
    def add_consumer(self, c: Consumer) -> None:
        c.queue = self
        c.seq = next(self._consumer_seq)
        c.attached_at = self._clock()
        for tier in self._tiers:
            if tier.priority == c.priority:
                break
        else:
            tier = _Tier(c.priority)
            self._tiers.append(tier)
            self._tiers.sort(key=lambda t: -t.priority)
        tier.consumers.append(c)
        for t in self._tiers:
            t.rr = 0
        self._consumers_n += 1
        if self._policy.group_rebalance and self._groups:
            self.reset_all_groups(dispatch=False)
            if self._policy.group_rebalance_pause_dispatch and self.inflight:
                self._pause()
        if not self._gate_open:
            d = self._policy.delay_before_dispatch
            if d >= 0 and self._gate_timer is None:
                self._gate_timer = self._timers.call_at(
                    self._clock() + d / 1000.0, self._gate_deadline
                )
        self._retry_unmatched()
        if c.credit > 0:
            self.dispatch()
        else:
            # Its credit usually arrives in the same input batch as the attach:
            # dispatching now would bind groups (rebalance, a gate just opened)
            # before the new consumer can take any. Run after the batch instead.
            self._host.schedule_dispatch(self)

    def remove_consumer(
        self, c: Consumer, unsettled: Iterable[Entry] = (), *, failed: bool = True
    ) -> None:
        """Detach: unsettled messages back to their positions first, then the
        consumer's groups are released (C-1, C-2).

        `failed`: the consumer went away without closing (connection lost, crash,
        idle timeout): each unsettled message counts one failed delivery attempt
        (delivery-count + 1, max-delivery-attempts applies). A clean detach or close
        returns them uncounted, as Artemis does: a JMS client's prefetched messages
        were never seen by the application, and a client reports what it did process
        with its own dispositions (modified delivery-failed)."""
        if c.queue is not self:
            return
        c.queue = None
        for tier in self._tiers:
            if c in tier.consumers:
                tier.consumers.remove(c)
                if not tier.consumers:
                    self._tiers.remove(tier)
                break
        for t in self._tiers:
            t.rr = 0
        self._consumers_n -= 1
        back: list[Entry] = []
        n = 0
        dlog = self._dlog
        for e in unsettled:
            n += 1
            if not failed or self._count_failure(e):
                if not failed and e.durable and self.durable and c.counts_attempts:
                    self._store.message_returned(self.qid, e)
                back.append(e)
                if dlog is not None:
                    dlog.event(dl.RELEASED, self.name, e, c)
        self.inflight -= n
        c.inflight = 0
        released: list[Entry] = []
        for g in list(c.bound.values()):
            g.waiting = False  # parked_groups is cleared at once below, not one by one
            self._unbind(g, released)
        c.parked_groups.clear()
        for e in back:
            hg = self._groups.get(e.gkey) if e.gkey is not None else None
            if hg is not None and (hg.parked is not None or hg.held):
                self._insert_parked(hg, e)
            else:
                released.append(e)
        self._merge_main(released)
        for marks in self._undeliverable.values():
            marks.discard(c)
        if not self._consumers_n:
            self._gate_open = False
            if self._gate_timer is not None:
                self._gate_timer.cancel()
                self._gate_timer = None
        self._check_pause()
        self._retry_unmatched()
        self.dispatch()
        if not self._consumers_n:
            self._host.queue_idle(self)

    def credit_changed(self, c: Consumer) -> None:
        """The protocol layer calls this after a flow frame or an output unblock."""
        if c.credit <= 0 or c.blocked or c.queue is not self:
            return
        if c.parked_groups:
            self._serve(c)
        if self._retry_unmatched_on_credit:
            self._retry_unmatched()
        self.dispatch()

    def _serve(self, c: Consumer) -> None:
        """Give a consumer its parked groups' messages (older than the main order)."""
        if self._admin_paused:
            return
        pg = c.parked_groups
        now_ms = -1
        while pg and c.credit > 0 and not c.blocked:
            g = pg[0]
            q = g.parked
            if g.held or g.owner is not c or not q:
                pg.popleft()
                g.waiting = False
                if g.owner is c and q is not None and not q:
                    g.parked = None
                    self._unparked(g)
                continue
            while q and c.credit > 0 and not c.blocked:
                e = q[0]
                if e.expiry:
                    if now_ms < 0:
                        now_ms = int(self._clock() * 1000)
                    if e.expiry <= now_ms:
                        q.popleft()
                        self._expire(e)
                        continue
                if (c.filter is not None or self._undeliverable) and not self._accepts(c, e):
                    pg.popleft()
                    g.waiting = False
                    self._report_stuck(g, e)
                    break
                q.popleft()
                self._deliver(c, e, False)
                if e.group_seq == -1 and g.key is not EXCLUSIVE:
                    e.group_seq = SPENT_CLOSE
                    g.waiting = False
                    pg.popleft()
                    g.parked = q if q else None
                    self._unbind(g)
                    break
            else:
                if not q:
                    g.parked = None
                    self._unparked(g)
                    g.waiting = False
                    pg.popleft()

    def _resume_group(self, g: Group) -> None:
        """A group may move again (its delayed message is back, or its stuck head
        expired): an owner gets its parked messages, an owner-less group goes back
        to the main order to be bound afresh."""
        o = g.owner
        if o is None:
            if g.held:
                return
            del self._groups[g.key]
            self._unparked(g)
            self._orphans.pop(g.key, None)
            if g.parked:
                parked = list(g.parked)
                g.parked = None
                self._merge_main(parked)
            return
        if g.parked and not g.waiting:
            g.waiting = True
            o.parked_groups.append(g)
        if o.credit > 0 and not o.blocked:
            self._serve(o)

    # -------------------------------------------------------------- settlement
    def ack(self, c: Consumer, e: Entry) -> None:
        """Consumer accepted (settlement hook: a transaction will buffer this call)."""
        c.inflight -= 1
        self.inflight -= 1
        self.acked += 1
        c.settled += 1  # inline `_settled_by`: this is the hot path
        if not c.inflight and not self._main and not c.parked_groups:
            c.idle_marks += 1
        if e.gkey is not None:  # inline `_group_settled`: this is the hot path
            if not self._stamp_armed:
                self._stamp(self._seq + 1)
            g = self._groups.get(e.gkey)
            if g is not None:
                g.settled_at = self._coarse
        if self._dlog is not None:
            self._dlog.event(dl.SETTLED, self.name, e, c, dl.ACCEPTED)
        self._remove(e)
        if self._paused and not self.inflight:
            self._check_pause()

    def reject(self, c: Consumer, e: Entry) -> None:
        """`rejected`: dead-letter (or drop when no dead-letter address is set)."""
        c.inflight -= 1
        self.inflight -= 1
        if self._dlog is not None:
            self._dlog.event(dl.SETTLED, self.name, e, c, dl.REJECTED)
        # the copy is routed before the original is acknowledged: a crash in between
        # can duplicate the message, never lose it
        self.dead_lettered += 1
        if e.gkey is not None:
            self._group_settled(e)
        self._host.dead_letter(self, e, "rejected by consumer")
        self._remove(e)
        if self._paused and not self.inflight:
            self._check_pause()
        self._settled_by(c)

    def _settled_by(self, c: Consumer) -> None:
        """Slow-consumer counters (see `core.consumer`): one more settlement, and an
        idle mark when nothing else waits for the consumer."""
        c.settled += 1
        if not c.inflight and not self._main and not c.parked_groups:
            c.idle_marks += 1

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
        if e.gkey is not None:
            self._group_settled(e)
        if self._dlog is not None:
            self._dlog.event(
                dl.SETTLED,
                self.name,
                e,
                c,
                dl.MODIFIED if (delivery_failed or undeliverable_here) else dl.RELEASED_OUTCOME,
            )
        if delivery_failed and not self._count_failure(e):
            self._check_pause()
            self._settled_by(c)
            return
        if not delivery_failed and e.durable and self.durable and c.counts_attempts:
            self._store.message_returned(self.qid, e)
        g = self._groups.get(e.gkey) if e.gkey is not None else None
        if undeliverable_here:
            self._undeliverable.setdefault(e, set()).add(c)
            if g is not None and g.owner is c and self._policy.group_unbind_on_undeliverable:
                self._unbind(g)
                g = self._groups.get(e.gkey)
        delay = self._policy.redelivery_delay if delivery_failed else 0
        if delay > 0:
            # hold the group (bound or not) until this message is back: later messages
            # of the group must not overtake it (GROUPING 3.9 a)
            hg = None
            if e.gkey is not None:
                hg = g
                if hg is None:
                    hg = Group(e.gkey, None, self._clock())
                    self._groups[e.gkey] = hg
                    self._orphans.pop(e.gkey, None)
                hg.held += 1
            t = self._timers.call_at(
                self._clock() + delay / 1000.0, lambda: self._undelay(e, hg, t)
            )
            self._delayed.add(t)
        elif g is not None and (g.parked is not None or g.held):
            self._insert_parked(g, e)
            if g.owner is not None and not g.held:
                self._resume_group(g)
        else:
            self._insert_main(e)
        self._check_pause()
        if self._undeliverable and (self._unmatched or self._orphans):
            self._retry_unmatched_on_credit = True
        self.dispatch()
        self._settled_by(c)

    def _undelay(self, e: Entry, g: Group | None, t: Timer) -> None:
        self._delayed.discard(t)
        if self.deleted:
            return
        if g is not None and self._groups.get(g.key) is g and g.held:
            # release exactly the hold this message took
            self._insert_parked(g, e)
            g.held -= 1
            if not g.held:
                self._resume_group(g)
        else:
            self._insert_main(e)
        self.dispatch()

    def _insert_parked(self, g: Group, e: Entry) -> None:
        if g.parked is None:
            g.parked = deque((e,))
            g.parked_at = self._clock()
        else:
            _insert_by_seq(g.parked, e)

    def _count_failure(self, e: Entry) -> bool:
        """Increment delivery-count; dead-letter past max-delivery-attempts.
        Returns True when the message stays in the queue."""
        e.delivery_count += 1
        m = self._policy.max_delivery_attempts
        if m >= 0 and e.delivery_count >= m:
            self.dead_lettered += 1
            self._host.dead_letter(
                self, e, f"delivery attempts reached max-delivery-attempts ({m})"
            )
            self._remove(e)
            return False
        if self.durable and e.durable:
            self._store.delivery_count_updated(self.qid, e)
        return True

    def _remove(self, e: Entry) -> None:
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
        if self._undeliverable:
            self._undeliverable.pop(e, None)
        if self.durable and e.durable:
            self._store.message_acked(self.qid, e)

    def _expire(self, e: Entry) -> None:
        self.expired_count += 1
        self._host.expired(self, e)
        self._remove(e)

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

    # ------------------------------------------------- unmatched / gate / pause
    def _to_unmatched(self, e: Entry) -> None:
        self._unmatched.append(e)
        self._retry_unmatched_on_credit = True

    def _retry_unmatched(self) -> None:
        """Give unmatched messages and owner-less groups another chance (after a
        consumer change, or credit when a busy consumer might take them)."""
        self._retry_unmatched_on_credit = False
        back: list[Entry] = []
        if self._unmatched:
            back.extend(self._unmatched)
            self._unmatched.clear()
        if self._orphans:
            orphans = list(self._orphans.values())
            self._orphans.clear()
            for g in orphans:
                if self._groups.get(g.key) is not g or g.owner is not None or g.held:
                    continue
                del self._groups[g.key]
                self._unparked(g)
                if g.parked:
                    back.extend(g.parked)
                    g.parked = None
        if back:
            self._merge_main(back)

    def _check_gate(self) -> bool:
        """consumers-before-dispatch / delay-before-dispatch (GROUPING 3.12)."""
        if self.inflight:
            return False
        if self._consumers_n >= self._policy.consumers_before_dispatch:
            self._open_gate()
            return True
        return False

    def _open_gate(self) -> None:
        self._gate_open = True
        if self._gate_timer is not None:
            self._gate_timer.cancel()
            self._gate_timer = None

    def _gate_deadline(self) -> None:
        self._gate_timer = None
        if self._consumers_n and not self._gate_open and not self.deleted:
            self._open_gate()
            self.dispatch()

    @property
    def dispatching(self) -> bool:
        return self._gate_open and not self._paused and not self._admin_paused

    def _pause(self) -> None:
        self._paused = True
        t = self._policy.group_pause_dispatch_timeout
        if t >= 0 and self._pause_timer is None:
            self._pause_timer = self._timers.call_at(
                self._clock() + t / 1000.0, self._pause_deadline
            )

    def _pause_deadline(self) -> None:
        self._pause_timer = None
        if self._paused:
            log.warning(
                "queue %r: dispatch was paused for a group rebalance and %d message(s) are "
                "still unsettled after group_pause_dispatch_timeout; resuming dispatch",
                self.name,
                self.inflight,
            )
            self._unpause()

    def _check_pause(self) -> None:
        if self._paused and not self.inflight:
            self._unpause()

    def _unpause(self) -> None:
        self._paused = False
        if self._pause_timer is not None:
            self._pause_timer.cancel()
            self._pause_timer = None
        for tier in self._tiers:
            for c in tier.consumers:
                if c.parked_groups and c.credit > 0:
                    self._serve(c)
        self.dispatch()

    # ------------------------------------------ admin pause and ages (management)
    # An operator's pause (`admin_pause`, management `pause`) stops delivery until
    # `admin_resume`, independently of the rebalance pause above: messages still
    # arrive, settle, expire and can be purged or moved; none is delivered. It is not
    # persisted: a restarted broker dispatches again.
    #
    # Ages without a clock read per message: the queue keeps a *coarse clock*
    # `_coarse`, read from the real clock at the first enqueue or grouped settlement
    # after `age_resolution` seconds without a read (a one-shot timer re-arms it). Each
    # read leaves an *arrival mark* (n, t): every message with seq >= n arrived at or
    # after t. A message's arrival time is the latest mark with n <= its seq: at most
    # `age_resolution` before its real arrival, so the age reported is an upper bound
    # within that resolution. Marks below every held message are dropped; past
    # `age_marks` every other one of the older half is dropped, so memory stays
    # bounded and only very old messages lose precision. Messages without a mark left
    # (recovered after a restart, or back from a long delay after a prune) count from
    # the oldest mark: their age is then a lower bound.

    def admin_pause(self) -> bool:
        """Stop delivering (management `pause`); False when already paused."""
        if self._admin_paused:
            return False
        self._admin_paused = True
        return True

    def admin_resume(self) -> bool:
        """Deliver again (management `resume`); False when not paused."""
        if not self._admin_paused:
            return False
        self._admin_paused = False
        for c in self.consumers():
            if c.parked_groups and c.credit > 0 and not c.blocked:
                self._serve(c)
        self.dispatch()
        return True

    @property
    def paused(self) -> bool:
        """Paused by an operator (not the transient rebalance pause)."""
        return self._admin_paused

    def _stamp(self, n: int) -> None:
        """Read the clock into `_coarse` and leave the mark (n, now)."""
        now = self._clock()
        self._coarse = now
        self._stamp_armed = True
        arr = self._arrivals
        if arr and arr[-1][0] == n:
            arr[-1] = (n, now)
        else:
            arr.append((n, now))
            if len(arr) > self._policy.age_marks:
                self._prune_arrivals()
        self._timers.call_at(now + self._policy.age_resolution, self._unstamp)

    def _unstamp(self) -> None:
        self._stamp_armed = False

    def _group_settled(self, e: Entry) -> None:
        """A message of a group was settled (any outcome): the group's `settled_at`."""
        if not self._stamp_armed:
            self._stamp(self._seq + 1)
        g = self._groups.get(e.gkey)
        if g is not None:
            g.settled_at = self._coarse

    def arrival_time(self, seq: int) -> float | None:
        """When message `seq` arrived (see above); None before the first message."""
        arr = self._arrivals
        if not arr:
            return None
        i = bisect_right(arr, (seq, float("inf"))) - 1
        return arr[max(i, 0)][1]

    def oldest_waiting_seq(self) -> int | None:
        """Seq of the oldest message waiting in memory (not in flight or delayed)."""
        lo = self._seq + 1
        for dq in self._levels:
            if dq:
                lo = min(lo, dq[0].seq)
        for g in self._groups.values():
            if g.parked:
                lo = min(lo, g.parked[0].seq)
        for e in self._unmatched:
            lo = min(lo, e.seq)
        return lo if lo <= self._seq else None

    def _prune_arrivals(self) -> None:
        arr = self._arrivals
        lo = self.oldest_waiting_seq() or self._seq + 1
        for c in self.consumers():
            for e in _unsettled(c):
                lo = min(lo, e.seq)
        if self.paged_count:
            lo = min(lo, self.page_mark + 1)
        i = bisect_right(arr, (lo, float("inf"))) - 1
        if i > 0:
            del arr[:i]  # keep the latest mark at or below the oldest held message
        cap = self._policy.age_marks
        if len(arr) > cap:
            half = len(arr) // 2
            arr[:half] = arr[:half:2]

    def group_details(self) -> list[dict[str, Any]]:
        """`list_groups` rows plus what management shows: `bucket` (index when
        bucketed), `settled_at`, and the oldest waiting message (`oldest_seq`) with
        its `oldest_arrival` time (None when nothing of the group waits)."""
        oldest: dict[Any, int] = {}
        for e in self._all_waiting():
            k = e.gkey
            if k is not None and e.seq < oldest.get(k, e.seq + 1):
                oldest[k] = e.seq
        bound = [g for g in self._groups.values() if g.key is not EXCLUSIVE and g.owner]
        rows = self.list_groups()
        for g, r in zip(bound, rows, strict=True):
            seq = oldest.get(g.key)
            r["bucket"] = g.key if isinstance(g.key, int) else None
            r["settled_at"] = g.settled_at
            r["oldest_seq"] = seq
            r["oldest_arrival"] = self.arrival_time(seq) if seq is not None else None
        return rows

    def take_waiting(self, match: Callable[[Entry], bool], sink: Callable[[Entry], None]) -> int:
        """Take every waiting message `match` accepts (main order, parked, unmatched;
        not in flight, delayed or paged) out of the queue: `sink` gets each one, in
        queue order, before the queue forgets it, so a move to another queue records
        the new copy before this queue's acknowledgement (a crash in between
        duplicates a message, never loses it). Returns how many were taken."""
        taken: list[Entry] = []
        for i, dq in enumerate(self._levels):
            keep: deque[Entry] = deque()
            for e in dq:
                (taken if match(e) else keep).append(e)
            if len(keep) != len(dq):
                self._main -= len(dq) - len(keep)
                self._levels[i] = keep
        touched: list[Group] = []
        for g in self._groups.values():
            q = g.parked
            if q:
                kept: deque[Entry] = deque()
                for e in q:
                    (taken if match(e) else kept).append(e)
                if len(kept) != len(q):
                    g.parked = kept or None
                    touched.append(g)
        if self._unmatched:
            rest: deque[Entry] = deque()
            for e in self._unmatched:
                (taken if match(e) else rest).append(e)
            self._unmatched = rest
        taken.sort(key=_browse_order)
        for e in taken:
            sink(e)
        for e in taken:
            self._remove(e)
        for g in touched:
            if g.stuck:  # the stuck head may be gone: the group can move again
                g.stuck = False
                self._stuck_groups -= 1
            if self._groups.get(g.key) is g:
                self._resume_group(g)
        if taken:
            self.dispatch()
        return len(taken)

    # -------------------------------------------------------------- management
    def group_count(self) -> int:
        return sum(1 for g in self._groups.values() if g.key is not EXCLUSIVE and g.owner)

    # Telemetry (read by amqbroker.telemetry when it collects, never per message).
    def _unparked(self, g: Group) -> None:
        """A group's blocked episode ended (its parked deque emptied or went back to
        the main order, or the group went away): add the episode to the total."""
        if g.parked_at:
            self.group_blocked_time += self._clock() - g.parked_at
            g.parked_at = 0.0

    def group_blocked_seconds(self) -> float:
        """Seconds groups have spent blocked: ended episodes plus the ongoing ones
        (so the figure grows while a group waits, and never goes back). O(groups)."""
        now = self._clock()
        return self.group_blocked_time + sum(
            now - g.parked_at for g in self._groups.values() if g.parked_at
        )

    def largest_groups(self, n: int) -> list[tuple[str, int, int]]:
        """(group name, waiting messages, seq of its oldest waiting message) for the
        `n` groups with the most waiting messages (main order + parked, not in flight).
        O(waiting messages): for a periodic collector, not the hot path."""
        if n <= 0:
            return []
        backlog: dict[Any, list[int]] = {}
        for e in self._all_waiting():
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

    def hold_group(self, group_id: str) -> bool:
        """Hold a group: its messages wait, in order, and none is delivered until
        `unhold_group` (a cluster node that comes back asks the arbiter who owns a
        group before it serves it). False when this queue does not group."""
        key = self._key_of(group_id)
        if key is None or key is EXCLUSIVE:
            return False
        g = self._groups.get(key)
        if g is None:
            g = Group(key, None, self._clock())
            self._groups[key] = g
            self._orphans.pop(key, None)
        g.held += 1
        return True

    def unhold_group(self, group_id: str) -> None:
        """Undo one `hold_group`: the group moves again (bound afresh if unbound)."""
        key = self._key_of(group_id)
        g = self._groups.get(key) if key is not None else None
        if g is None or not g.held:
            return
        g.held -= 1
        if not g.held:
            self._resume_group(g)
            self.dispatch()

    def reset_group(self, group_id: str) -> bool:
        key = self._key_of(group_id)
        g = self._groups.get(key) if key is not None else None
        if g is None or g.owner is None:
            return False
        self._unbind(g)
        self.dispatch()
        return True

    def reset_all_groups(self, *, dispatch: bool = True) -> int:
        bound = [g for g in self._groups.values() if g.owner is not None]
        back: list[Entry] = []
        for g in bound:
            self._unbind(g, back)
        self._merge_main(back)
        if dispatch:
            self.dispatch()
        return len(bound)

    def list_groups(self) -> list[dict[str, Any]]:
        backlog: dict[Any, int] = {}
        for e in self._all_waiting():
            if e.gkey is not None:
                backlog[e.gkey] = backlog.get(e.gkey, 0) + 1
        inflight: dict[Any, int] = {}
        for c in self.consumers():
            for e in _unsettled(c):
                if e.gkey is not None:
                    inflight[e.gkey] = inflight.get(e.gkey, 0) + 1
        out = []
        for g in self._groups.values():
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

    def browse(self) -> list[Entry]:
        """The messages waiting in the queue (not in flight, not scheduled), in queue
        order: what a browser (distribution-mode copy) sees, as a snapshot."""
        out = list(self._all_waiting())
        out.sort(key=_browse_order)
        return out

    def consumers(self) -> list[Consumer]:
        return [c for t in self._tiers for c in t.consumers]

    @property
    def consumer_count(self) -> int:
        return self._consumers_n

    @property
    def ready_count(self) -> int:
        """Messages in the main order: waiting for any consumer that has credit (not
        parked on a group, unmatched, delayed or in flight)."""
        return self._main

    def _all_waiting(self) -> Iterable[Entry]:
        for dq in self._levels:
            yield from dq
        for g in self._groups.values():
            if g.parked:
                yield from g.parked
        yield from self._unmatched

    def expire_scan(self) -> int:
        """Periodic reaper: remove expired messages that are not in flight."""
        now_ms = int(self._clock() * 1000)
        expired: list[Entry] = []
        for i, dq in enumerate(self._levels):
            if any(e.expiry and e.expiry <= now_ms for e in dq):
                keep = deque(e for e in dq if not (e.expiry and e.expiry <= now_ms))
                expired.extend(e for e in dq if e.expiry and e.expiry <= now_ms)
                self._main -= len(dq) - len(keep)
                self._levels[i] = keep
        touched: list[Group] = []
        for g in self._groups.values():
            q = g.parked
            if q and any(e.expiry and e.expiry <= now_ms for e in q):
                expired.extend(e for e in q if e.expiry and e.expiry <= now_ms)
                g.parked = deque(e for e in q if not (e.expiry and e.expiry <= now_ms)) or None
                if g.parked is None:
                    self._unparked(g)
                touched.append(g)
        if self._unmatched:
            expired.extend(e for e in self._unmatched if e.expiry and e.expiry <= now_ms)
            self._unmatched = deque(
                e for e in self._unmatched if not (e.expiry and e.expiry <= now_ms)
            )
        for e in expired:
            self._expire(e)
        for g in touched:
            # a stuck head may have expired: the group can move again
            if g.stuck:
                g.stuck = False
                self._stuck_groups -= 1
            if self._groups.get(g.key) is g:
                self._resume_group(g)
        if expired:
            self.dispatch()
        return len(expired)

    def purge(self) -> int:
        """Drop every queued (not in flight) message, paged ones included."""
        paged = self._drop_paged()
        dropped = list(self._all_waiting())
        for dq in self._levels:
            dq.clear()
        self._main = 0
        for g in self._groups.values():
            g.parked = None
            self._unparked(g)
        self._unmatched.clear()
        for e in dropped:
            self._remove(e)
        return len(dropped) + paged

    def close(self) -> list[Consumer]:
        """Queue deleted: returns the consumers the protocol layer must detach."""
        self.deleted = True
        for t in self._delayed:
            t.cancel()
        self._delayed.clear()
        for timer in (self._gate_timer, self._pause_timer):
            if timer is not None:
                timer.cancel()
        return self.consumers()

    def statistics(self) -> dict[str, Any]:
        return {
            "messages": self.count,
            "bytes": self.bytes,
            "consumers": self._consumers_n,
            "in_flight": self.inflight,
            "enqueued": self.enqueued,
            "acknowledged": self.acked,
            "expired": self.expired_count,
            "dead_lettered": self.dead_lettered,
            "groups": self.group_count(),
            "blocked_groups": sum(1 for g in self._groups.values() if g.parked),
            "stuck_groups": self._stuck_groups,
            "stuck_messages": self.stuck_messages,
            "group_owner_changes": self.group_owner_changes,
            "group_blocked_seconds": self.group_blocked_seconds(),
            "unmatched": len(self._unmatched),
            "delayed": len(self._delayed),
            "scheduled": self.scheduled,
            "dispatching": self.dispatching,
            "paged_messages": self.paged_count,
            "paged_bytes": self.paged_bytes,
        }

    # ------------------------------------------------------------------ paging
    # The page store holds the newest messages of a queue while its address is over
    # its memory limit (policy PAGE); see the module docstring and store/paging.py.
    def _page_out(self, e: Entry) -> None:
        """`e` (seq set) goes to the page instead of memory. A durable message is not
        journaled while paged: the page record is its durable copy."""
        assert self.pager is not None
        self.count += 1
        self.enqueued += 1
        n = len(e.data)
        if not self.paged_count and self.address is not None:
            self.address.budget.paging.add(self)
        self.paged_count += 1
        self.paged_bytes += n
        self._last_paged = e.seq
        self.pager.page(self.qid, e)

    def depage(self, entries: Iterable[Entry]) -> None:
        """Take back the oldest paged messages (in seq order, seq kept): they join the
        tail of the main order and are dispatched like arriving messages. A durable
        one on a durable queue is journaled now (the broker wraps this call and the
        new `page_mark` in one atomic journal record)."""
        for e in entries:
            n = len(e.data)
            self.paged_count -= 1
            self.paged_bytes -= n
            self.count -= 1
            self.page_mark = e.seq
            e.gkey = (
                self._key_of(e.group_id)
                if (e.group_id is not None or self._policy.exclusive)
                else None
            )
            self._account(e)
            if self.durable and e.durable:
                self._store.message_added(self.qid, e)
            if e.deliver_at and self._schedule(e):
                continue
            self._insert_main(e)
        self._paging_ended()
        self.dispatch()

    def page_lost(self, n: int, nbytes: int) -> None:
        """Paged messages the store could not read back (corrupt page, logged)."""
        self.paged_count -= n
        self.paged_bytes -= nbytes
        self.count -= n
        self._paging_ended()

    def restore_paged(self, n: int, nbytes: int, max_seq: int, mark: int) -> None:
        """Recovery: `n` durable messages are in the page (seq up to `max_seq`);
        `mark` is the persisted `paged_through`."""
        self.page_mark = mark
        self._seq = max(self._seq, max_seq, mark)
        if n:
            self.count += n
            self.paged_count += n
            self.paged_bytes += nbytes
            self._last_paged = max_seq
            if self.address is not None:
                self.address.budget.paging.add(self)

    def _drop_paged(self) -> int:
        n = self.paged_count
        if n and self.pager is not None:
            self.pager.drop(self.qid)
            self.count -= n
            self.paged_count = 0
            self.paged_bytes = 0
            self.page_mark = self._last_paged
            self._paging_ended()
        return n

    def _paging_ended(self) -> None:
        if not self.paged_count and self.address is not None:
            self.address.budget.paging.discard(self)

    def __repr__(self) -> str:
        return f"<Queue {self.name!r} count={self.count} consumers={self._consumers_n}>"


def _seq(e: Entry) -> int:
    return e.seq


def _browse_order(e: Entry) -> tuple[int, int]:
    return (-e.priority, e.seq)


def _insert_by_seq(dq: deque[Entry], e: Entry) -> None:
    """Insert into a seq-sorted deque; O(1) at either end, where returns usually go."""
    if not dq or dq[-1].seq < e.seq:
        dq.append(e)
    elif dq[0].seq > e.seq:
        dq.appendleft(e)
    else:
        i = 0
        for x in dq:
            if x.seq > e.seq:
                break
            i += 1
        dq.insert(i, e)


def _unsettled(c: Consumer) -> Iterable[Entry]:
    f = getattr(c, "unsettled_entries", None)
    return f() if f is not None else ()
