"""The group dispatcher of a queue: consumers, the group table, and every decision.

Theory of operation
-------------------
The queue (`amqbroker.core.queue`) stores messages; this dispatcher decides where they
go. `offer(e)` is the one decision for a message at the head of the main order:

* ungrouped: the next consumer, by priority then round robin, that has credit and
  accepts it (filter slot, undeliverable-here marks);
* first message of a free group: the queue's owner policy picks the consumer
  (`amqbroker.core.owner_policies`), and the group is bound to it (unless the message
  closes the group, sequence -1);
* message of a bound group: only its owner may take it.

It delivers when it can and otherwise says why not (`Offer`); the enqueue fast path
(nothing queued ahead) and the dispatch pass (`_pass`) both call it. The pass turns
the other outcomes into a place for the message (`park` for the three that park); the
fast path parks too (skip-ahead only: the message is the head, so the pass would make
the same decision for it) and leaves NO_TAKER, and OWNER_BUSY under strict
head-of-line, to the pass:

=========== ===================================================================
NO_TAKER    every consumer busy: stop the pass; else ungrouped -> unmatched,
            grouped -> the group waits owner-less (WAIT)
WAIT_GROUP  the group has parked messages, is held or has no owner: park
OWNER_BUSY  park, and queue the group on its owner's `parked_groups` (strict
            head-of-line, `group_skip_ahead=False`: stop the pass instead)
REFUSED     the owner will never take it: park and report the group stuck
=========== ===================================================================

A parked message waits in its group's `parked` deque (decision D4, skip-ahead); when
the owner gets credit it is served from there first (`serve`). Each message is thus
examined O(1) times whatever the number of groups or blocked groups. The per-group
ordering guard (GROUPING 3.5.1) is the Group invariant: while a group has parked
messages every later message of the group joins them.

Every change of a group's lifecycle state goes through `step` (the transition table
is `amqbroker.core.groups.TRANSITIONS`).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from amqbroker.core import delivery_log as dl
from amqbroker.core.dispatch_gate import DispatchGate
from amqbroker.core.dispatch_host import QueueStore
from amqbroker.core.groups import (
    BIND,
    DRAIN,
    EXCLUSIVE,
    HOLD,
    PARK,
    RESUME,
    STICK,
    TRANSITIONS,
    UNBIND,
    UNHOLD,
    UNSTICK,
    WAIT,
    Group,
    IllegalGroupTransition,
    key_name,
    state_of,
)
from amqbroker.core.owner_policies import (
    Marks,
    OwnerPolicy,
    Tier,
    accepts,
    any_ready,
    owner_policy,
    round_robin,
)

if TYPE_CHECKING:
    from amqbroker.core.consumer import Consumer
    from amqbroker.core.entry import Entry
    from amqbroker.core.timers import Timer

log = logging.getLogger("amqbroker.core.queue")

#: group_seq of a closing message (-1) once its close has taken effect: if it is
#: redelivered it neither binds nor unbinds (a newer instance of the group may be bound
#: by then). Outside the int32 range, so no sender can produce it.
SPENT_CLOSE = -(1 << 40)

# `offer` results
DELIVERED = 0
NO_TAKER = 1
WAIT_GROUP = 2
OWNER_BUSY = 3
REFUSED = 4


class GroupDispatcher:
    def __init__(self, q: QueueStore) -> None:
        self.q = q
        #: the group table: key -> Group
        self.table: dict[Any, Group] = {}
        #: owner-less groups created because no consumer accepted their first message
        self.orphans: dict[Any, Group] = {}
        self.tiers: list[Tier] = []
        self.consumers_n = 0
        self._consumer_seq = itertools.count(1)
        #: ungrouped messages no ready consumer accepted
        self.unmatched: deque[Entry] = deque()
        self.retry_on_credit = False
        self.marks: Marks = {}
        self.in_dispatch = False
        self._again = False
        #: delay timers: messages out of the order until their delivery time or the end
        #: of their redelivery delay
        self.delayed: set[Timer] = set()
        self.stuck_groups = 0
        self.delivered = 0
        #: telemetry: bindings made, and seconds groups spent blocked in ended episodes
        self.owner_changes = 0
        self.blocked_time = 0.0
        #: no gate, pause or admin pause stops dispatch (kept by `gate`)
        self.flowing = False
        self.gate = DispatchGate(self)
        self.choose_owner: OwnerPolicy = round_robin
        #: the bound group `offer` last declined a message for (the pass parks it there)
        self.last_group: Group = Group(None, None, 0.0)
        self.first = False

    def set_policy(self) -> None:
        """The queue's policy changed: re-read what the dispatcher caches."""
        self.choose_owner = owner_policy(self.q.policy.group_owner_policy)
        self.first = self.q.first_key is not None

    def consumers(self) -> list[Consumer]:
        return [c for t in self.tiers for c in t.consumers]

    def serve_parked(self) -> None:
        """Serve every consumer that has parked groups and credit (dispatch resumes)."""
        for c in self.consumers():
            if c.parked_groups and c.credit > 0 and not c.blocked:
                self.serve(c)

    # ------------------------------------------------------------ the decision
    def offer(self, e: Entry) -> int:
        """Deliver `e` (the head of the main order, taken out of it) if a consumer may
        take it now, and return DELIVERED; otherwise change nothing and say why."""
        key = e.gkey
        marks = self.marks
        if key is None:
            c = round_robin(self.tiers, e, marks)
            if c is None:
                return NO_TAKER
            self.deliver(c, e, False)
            return DELIVERED
        g = self.table.get(key)
        if g is None:
            c = self.choose_owner(self.tiers, e, marks)
            if c is None:
                return NO_TAKER
            if e.group_seq in (-1, SPENT_CLOSE) and key is not EXCLUSIVE:
                # a closing message of an unbound group: no binding, no flag
                e.group_seq = SPENT_CLOSE
                self.deliver(c, e, False)
            else:
                self.step(BIND, key, c=c)
                self.deliver(c, e, self.first)
            return DELIVERED
        if e.group_id is key:
            # the group's own key object from here on, not the message's equal copy:
            # a backlog and the delivery log's batches hold one string per group
            # (measured: fewer cache misses per message; `marshal` writes a reference)
            e.group_id = e.gkey = g.key
        o = g.owner
        self.last_group = g
        if g.parked is not None or g.held or o is None:
            return WAIT_GROUP
        if o.credit <= 0 or o.blocked:
            return OWNER_BUSY
        if (o.filter is not None or marks) and not accepts(o, e, marks):
            return REFUSED
        self.deliver(o, e, False)
        if e.group_seq == -1 and key is not EXCLUSIVE:
            e.group_seq = SPENT_CLOSE
            self.step(UNBIND, key)
        return DELIVERED

    def deliver(self, c: Consumer, e: Entry, first: bool) -> None:
        q = self.q
        c.credit -= 1
        self.delivered += 1
        c.last_delivery = self.delivered  # least-loaded tie-break: least recently served
        dlog = q.dlog
        if c.presettled:
            c.deliver(e, first)
            q.remove(e)
            q.acked += 1
            c.settled += 1  # slow-consumer counters: settled when sent
            if not q.n_main and not c.parked_groups:
                c.idle_marks += 1
            if dlog is not None:
                dlog.event(dl.DISPATCHED, q.name, e, c)
                dlog.event(dl.SETTLED, q.name, e, c, dl.ACCEPTED)
        else:
            c.inflight += 1
            q.inflight += 1
            if e.durable and q.durable and c.counts_attempts:
                q.store.message_delivered(q.qid, e)
            c.deliver(e, first)
            if dlog is not None:
                dlog.event(dl.DISPATCHED, q.name, e, c)

    # ---------------------------------------------------------------- the pass
    def dispatch(self) -> None:
        """Deliver what can be delivered now (bounded by the dispatch batch)."""
        if self.in_dispatch:
            self._again = True
            return
        q = self.q
        gate = self.gate
        if not q.n_main or not self.consumers_n or gate.paused or gate.admin_paused:
            return
        if not gate.open and not gate.check():
            return
        for tier in self.tiers:  # `any_ready`, inline: this runs once per arrival
            for c in tier.consumers:
                if c.credit > 0 and not c.blocked:
                    break
            else:
                continue
            break
        else:
            return  # every consumer is busy: nothing can move
        self.in_dispatch = True
        try:
            while True:
                self._again = False
                self._pass()
                if not self._again or not q.n_main:
                    break
        finally:
            self.in_dispatch = False

    def _pass(self) -> None:
        q = self.q
        policy = q.policy
        budget = policy.dispatch_batch
        strict = not policy.group_skip_ahead
        levels = q.levels
        offer = self.offer
        now_ms = -1  # read the clock only when a message has an expiry
        while budget > 0:
            lvl = q.top
            while lvl >= 0 and not levels[lvl]:
                lvl -= 1
            q.top = lvl
            if lvl < 0:
                return
            dq = levels[lvl]
            e = dq.popleft()
            q.n_main -= 1
            budget -= 1
            if e.expiry:
                if now_ms < 0:
                    now_ms = int(q.clock() * 1000)
                if e.expiry <= now_ms:
                    q.expire(e)
                    continue
            r = offer(e)
            if r == DELIVERED:
                continue
            key = e.gkey
            if r == NO_TAKER:
                if not any_ready(self.tiers):
                    dq.appendleft(e)  # every consumer is busy
                    q.n_main += 1
                    return
                if key is None:
                    self.unmatched.append(e)
                    self.retry_on_credit = True
                else:
                    self.step(WAIT, key, e)
                continue
            if r == OWNER_BUSY and strict:
                dq.appendleft(e)
                q.n_main += 1
                return
            self.park(e, r)
        if q.n_main:
            q.host.schedule_dispatch(q)

    def park(self, e: Entry, r: int) -> None:
        """Park `e`, which `offer` just declined with `r` (WAIT_GROUP, OWNER_BUSY or
        REFUSED), in the group `offer` looked at: the pass's answer, also given by
        the enqueue fast path to a message nothing is queued ahead of (the same
        decision the pass would make for it, one pass sooner)."""
        g = self.last_group
        pq = g.parked
        if pq is not None:
            pq.append(e)  # newer than every parked message: no state change
        else:
            # PARK, inline (the hot path): the effect `step` applies
            g.parked = deque((e,))
            g.parked_at = self.q.clock()
        if r == OWNER_BUSY:
            if not g.waiting:
                g.waiting = True
                o = g.owner
                assert o is not None
                o.parked_groups.append(g)
        elif r == REFUSED:
            self.step(STICK, g.key, e)

    def serve(self, c: Consumer) -> None:
        """Give a consumer its parked groups' messages (older than the main order)."""
        if self.gate.admin_paused:
            return
        q = self.q
        pg = c.parked_groups
        now_ms = -1
        while pg and c.credit > 0 and not c.blocked:
            g = pg[0]
            pq = g.parked
            if g.held or g.owner is not c or not pq:
                pg.popleft()
                g.waiting = False
                if g.owner is c and pq is not None and not pq:
                    self.step(DRAIN, g.key)
                continue
            while pq and c.credit > 0 and not c.blocked:
                e = pq[0]
                if e.expiry:
                    if now_ms < 0:
                        now_ms = int(q.clock() * 1000)
                    if e.expiry <= now_ms:
                        pq.popleft()
                        q.expire(e)
                        continue
                if (c.filter is not None or self.marks) and not accepts(c, e, self.marks):
                    pg.popleft()
                    g.waiting = False
                    self.step(STICK, g.key, e)
                    break
                pq.popleft()
                self.deliver(c, e, False)
                if e.group_seq == -1 and g.key is not EXCLUSIVE:
                    e.group_seq = SPENT_CLOSE
                    g.waiting = False
                    pg.popleft()
                    g.parked = pq if pq else None
                    self.step(UNBIND, g.key)
                    break
            else:
                if not pq:
                    # DRAIN, inline (the hot path): the effect `step` applies
                    g.parked = None
                    if g.parked_at:
                        self.blocked_time += q.clock() - g.parked_at
                        g.parked_at = 0.0
                    g.waiting = False
                    pg.popleft()

    # --------------------------------------------------- the group lifecycle
    def step(
        self,
        event: str,
        key: Any,
        e: Entry | None = None,
        *,
        c: Consumer | None = None,
        collect: list[Entry] | None = None,
    ) -> Group | None:
        """Apply one lifecycle event to the group `key` (see `groups.TRANSITIONS`).

        BIND needs the owner `c`; WAIT, PARK and STICK the message `e`; UNBIND and
        RESUME put the messages they free into `collect` when given (one merge after
        a bulk release), else back into the main order. Returns the group, None
        when the event left the group table without it."""
        table = self.table
        g = table.get(key)
        state = state_of(g)
        if (state, event) not in TRANSITIONS:
            raise IllegalGroupTransition(state, event, key)
        q = self.q
        if g is None:  # BIND, WAIT, HOLD: a new group
            g = Group(key, c, q.clock())
            table[key] = g
            if event == BIND:
                assert c is not None
                self.owner_changes += 1
                c.bound[key] = g
            elif event == WAIT:
                assert e is not None
                g.parked = deque((e,))
                g.parked_at = q.clock()
                self.orphans[key] = g
                self.retry_on_credit = True
            else:
                self.orphans.pop(key, None)
                g.held += 1
            return g
        if event == PARK:
            assert e is not None
            if g.parked is None:
                g.parked = deque((e,))
                g.parked_at = q.clock()
            else:
                _insert_by_seq(g.parked, e)
        elif event == STICK:
            assert e is not None
            if not g.stuck:
                self._report_stuck(g, e)
        elif event == DRAIN:
            g.parked = None
            self._unparked(g)
        elif event == HOLD:
            g.held += 1
        elif event == UNHOLD:
            g.held -= 1
            if not g.held:
                return self._resume(g, collect)
        elif event == RESUME:
            return self._resume(g, collect)
        elif event == UNSTICK:
            if g.stuck:
                g.stuck = False
                self.stuck_groups -= 1
            return self._resume(g, collect)
        elif event == UNBIND:
            return self._unbind(g, collect)
        return g

    def _resume(self, g: Group, collect: list[Entry] | None) -> Group | None:
        """The group may move again (its delayed message is back, its stuck head is
        gone, a consumer change retries it): an owner gets its parked messages, an
        owner-less group leaves the table and its messages go back to the main order
        to be bound afresh."""
        o = g.owner
        if o is None:
            if g.held:
                return g
            del self.table[g.key]
            self._unparked(g)
            self.orphans.pop(g.key, None)
            self._free_parked(g, collect)
            return None
        if g.parked and not g.waiting:
            g.waiting = True
            o.parked_groups.append(g)
        if o.credit > 0 and not o.blocked:
            self.serve(o)
        return g

    def _unbind(self, g: Group, collect: list[Entry] | None) -> Group | None:
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
            self.stuck_groups -= 1
        if g.held:
            return g  # stays (owner-less) until its delayed message is back
        del self.table[g.key]
        self._unparked(g)
        self._free_parked(g, collect)
        return None

    def _free_parked(self, g: Group, collect: list[Entry] | None) -> None:
        if g.parked:
            parked = list(g.parked)
            g.parked = None
            if collect is not None:
                collect.extend(parked)
            else:
                self.q.merge_main(parked)

    def _unparked(self, g: Group) -> None:
        """A group's blocked episode ended (its parked deque emptied or went back to
        the main order, or the group went away): add the episode to the total."""
        if g.parked_at:
            self.blocked_time += self.q.clock() - g.parked_at
            g.parked_at = 0.0

    def _report_stuck(self, g: Group, e: Entry) -> None:
        g.stuck = True
        self.stuck_groups += 1
        q = self.q
        q.stuck_messages += 1
        o = g.owner
        owner = f"{o.name!r} of connection {o.connection_id}" if o is not None else "?"
        log.warning(
            "queue %r: group %r is bound to consumer %s, which does not accept its next "
            "message (seq %d: filter or undeliverable-here); the group waits until it is "
            "reset (amqbroker groups reset), the consumer detaches, or "
            "group_unbind_on_undeliverable is set",
            q.name,
            key_name(g.key),
            owner,
            e.seq,
        )

    # --------------------------------------------------- consumers and credit
    def add_consumer(self, c: Consumer) -> None:
        """Attach `c` (the queue has set `c.queue`)."""
        q = self.q
        c.seq = next(self._consumer_seq)
        c.attached_at = q.clock()
        for tier in self.tiers:
            if tier.priority == c.priority:
                break
        else:
            tier = Tier(c.priority)
            self.tiers.append(tier)
            self.tiers.sort(key=lambda t: -t.priority)
        tier.consumers.append(c)
        for t in self.tiers:
            t.rr = 0
        self.consumers_n += 1
        policy = q.policy
        if policy.group_rebalance and self.table:
            self.reset_all_groups(dispatch=False)
            if policy.group_rebalance_pause_dispatch and q.inflight:
                self.gate.pause()
        self.gate.consumer_added()
        self.retry_unmatched()
        if c.credit > 0:
            self.dispatch()
        else:
            # Its credit usually arrives in the same input batch as the attach:
            # dispatching now would bind groups (rebalance, a gate just opened)
            # before the new consumer can take any. Run after the batch instead.
            q.host.schedule_dispatch(q)

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
        q = self.q
        if c.queue is not q:
            return
        c.queue = None
        for tier in self.tiers:
            if c in tier.consumers:
                tier.consumers.remove(c)
                if not tier.consumers:
                    self.tiers.remove(tier)
                break
        for t in self.tiers:
            t.rr = 0
        self.consumers_n -= 1
        back: list[Entry] = []
        n = 0
        dlog = q.dlog
        for e in unsettled:
            n += 1
            if not failed or q.count_failure(e):
                if not failed and e.durable and q.durable and c.counts_attempts:
                    q.store.message_returned(q.qid, e)
                back.append(e)
                if dlog is not None:
                    dlog.event(dl.RELEASED, q.name, e, c)
        q.inflight -= n
        c.inflight = 0
        released: list[Entry] = []
        for g in list(c.bound.values()):
            g.waiting = False  # parked_groups is cleared at once below, not one by one
            self.step(UNBIND, g.key, collect=released)
        c.parked_groups.clear()
        table = self.table
        for e in back:
            hg = table.get(e.gkey) if e.gkey is not None else None
            if hg is not None and (hg.parked is not None or hg.held):
                self.step(PARK, e.gkey, e)
            else:
                released.append(e)
        q.merge_main(released)
        for marks in self.marks.values():
            marks.discard(c)
        if not self.consumers_n:
            self.gate.last_consumer_gone()
        self.gate.check_pause()
        self.retry_unmatched()
        self.dispatch()
        if not self.consumers_n:
            q.host.queue_idle(q)

    def credit_changed(self, c: Consumer) -> None:
        """The protocol layer calls this after a flow frame or an output unblock."""
        if c.credit <= 0 or c.blocked or c.queue is not self.q:
            return
        if c.parked_groups:
            self.serve(c)
        if self.retry_on_credit:
            self.retry_unmatched()
        self.dispatch()

    def retry_unmatched(self) -> None:
        """Give unmatched messages and owner-less groups another chance (after a
        consumer change, or credit when a busy consumer might take them)."""
        self.retry_on_credit = False
        back: list[Entry] = []
        if self.unmatched:
            back.extend(self.unmatched)
            self.unmatched.clear()
        if self.orphans:
            orphans = list(self.orphans.values())
            self.orphans.clear()
            table = self.table
            for g in orphans:
                if table.get(g.key) is g and g.owner is None and not g.held:
                    self.step(RESUME, g.key, collect=back)
        if back:
            self.q.merge_main(back)

    def put_back(self, c: Consumer, e: Entry, delay: int, undeliverable_here: bool) -> None:
        """A message `c` released or modified goes back: to its group's parked
        messages when the group is blocked or held, else to its main-order position;
        after `delay` ms when it waits out a redelivery delay (holding its group)."""
        key = e.gkey
        g = self.table.get(key) if key is not None else None
        q = self.q
        if undeliverable_here:
            self.marks.setdefault(e, set()).add(c)
            if g is not None and g.owner is c and q.policy.group_unbind_on_undeliverable:
                g = self.step(UNBIND, key)
        if delay > 0:
            # hold the group (bound or not) until this message is back: later messages
            # of the group must not overtake it (GROUPING 3.9 a)
            hg = self.step(HOLD, key) if key is not None else None
            self.hold_until(e, hg, q.clock() + delay / 1000.0)
        elif g is not None and (g.parked is not None or g.held):
            self.step(PARK, key, e)
            if g.owner is not None and not g.held:
                self.step(RESUME, key)
        else:
            q.insert_main(e)
        self.gate.check_pause()
        if self.marks and (self.unmatched or self.orphans):
            self.retry_on_credit = True
        self.dispatch()

    def hold_until(self, e: Entry, g: Group | None, at: float, *, scheduled: bool = False) -> None:
        """`e` is out of the queue's order until `at` (a delay timer); `g` is the group
        hold it took (released when it is back)."""
        q = self.q

        def due() -> None:
            self.delayed.discard(t)
            if scheduled:
                q.scheduled -= 1
                e.deliver_at = 0
            if not q.deleted:
                self._undelay(e, g)

        t = q.timers.call_at(at, due)
        self.delayed.add(t)

    def close(self) -> None:
        """The queue is deleted: no timer fires for it any more."""
        for t in self.delayed:
            t.cancel()
        self.delayed.clear()
        self.gate.close()

    def _undelay(self, e: Entry, g: Group | None) -> None:
        if g is not None and self.table.get(g.key) is g and g.held:
            # release exactly the hold this message took
            self.step(PARK, g.key, e)
            self.step(UNHOLD, g.key)
        else:
            self.q.insert_main(e)
        self.dispatch()

    # ---------------------------------------------------------- management
    def hold_group(self, group_id: str) -> bool:
        """Hold a group: its messages wait, in order, and none is delivered until
        `unhold_group` (a cluster node that comes back asks the arbiter who owns a
        group before it serves it). False when this queue does not group."""
        key = self.q.key_of(group_id)
        if key is None or key is EXCLUSIVE:
            return False
        self.step(HOLD, key)
        return True

    def unhold_group(self, group_id: str) -> None:
        """Undo one `hold_group`: the group moves again (bound afresh if unbound)."""
        key = self.q.key_of(group_id)
        g = self.table.get(key) if key is not None else None
        if g is None or not g.held:
            return
        self.step(UNHOLD, key)
        if not g.held:
            self.dispatch()

    def reset_group(self, group_id: str) -> bool:
        key = self.q.key_of(group_id)
        g = self.table.get(key) if key is not None else None
        if g is None or g.owner is None:
            return False
        self.step(UNBIND, key)
        self.dispatch()
        return True

    def reset_all_groups(self, *, dispatch: bool = True) -> int:
        bound = [g for g in self.table.values() if g.owner is not None]
        back: list[Entry] = []
        for g in bound:
            self.step(UNBIND, g.key, collect=back)
        self.q.merge_main(back)
        if dispatch:
            self.dispatch()
        return len(bound)

    def unstick(self, touched: list[Group]) -> None:
        """Messages were taken out of these groups' parked deques (expired, moved):
        a stuck head may be gone, so each may move again."""
        table = self.table
        for g in touched:
            if table.get(g.key) is g:
                self.step(UNSTICK, g.key)


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
