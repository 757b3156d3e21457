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
  a redelivery timer, or in flight to one consumer;
- a bound group has exactly one owner, registered in `owner.bound`;
- `count`/`bytes` cover every message the queue holds, in flight included.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
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
        if not self._main or not self._consumers_n or self._paused:
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
            if self._dlog is not None:
                self._dlog.event(dl.DISPATCHED, self.name, e, c)
                self._dlog.event(dl.SETTLED, self.name, e, c, dl.ACCEPTED)
        else:
            c.inflight += 1
            self.inflight += 1
            c.deliver(e, first)
            if self._dlog is not None:
                self._dlog.event(dl.DISPATCHED, self.name, e, c)

    def _bind(self, key: Any, c: Consumer) -> Group:
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
        owner = g.owner.name if g.owner is not None else "?"
        log.warning(
            "queue %r: group %r is bound to consumer %r, which does not accept its next "
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
        self._host.dead_letter(self, e, "rejected by consumer")
        self._remove(e)
        if self._paused and not self.inflight:
            self._check_pause()

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
            return
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
        return self._gate_open and not self._paused

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

    # -------------------------------------------------------------- management
    def group_count(self) -> int:
        return sum(1 for g in self._groups.values() if g.key is not EXCLUSIVE and g.owner)

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
        """Drop every queued (not in flight) message."""
        dropped = list(self._all_waiting())
        for dq in self._levels:
            dq.clear()
        self._main = 0
        for g in self._groups.values():
            g.parked = None
        self._unmatched.clear()
        for e in dropped:
            self._remove(e)
        return len(dropped)

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
            "unmatched": len(self._unmatched),
            "delayed": len(self._delayed),
            "scheduled": self.scheduled,
            "dispatching": self.dispatching,
        }

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
