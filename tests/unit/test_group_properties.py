"""Property-based tests of the group dispatcher (issue 3): random interleavings of
sends, consumer attach/detach/crash, credit, acks, releases, modified(failed) and
modified(undeliverable-here), rejects, time, and rebalances, against the broker core.

Invariants, checked at every delivery (inside `Consumer.deliver`) and after every step:

(1) first-delivery order: a message is never delivered for the first time before an
    earlier message of its group (instance, see below) was delivered.
(1b) group order, including redeliveries: when a message of a group is delivered, no
    earlier message of the group is waiting in the queue (queued, parked, returned, or
    waiting out its redelivery delay). This is what "released messages go back to the
    same owner in order" and "a redelivery delay holds the whole group" (GROUPING 3.9)
    amount to. Messages may be redelivered (at-least-once).
(2) one owner at a time: when a message of a group is delivered to consumer X, no other
    consumer holds an unsettled message of the same group.
(3) accounting: `count`/`bytes` equal the messages not yet acked or dead-lettered,
    `inflight` equals what the consumers hold unsettled; nothing is delivered to a
    consumer that already holds it. At teardown every consumer goes away, a fresh
    consumer drains the queue and acks everything: every message was acked exactly
    once or dead-lettered exactly once (max-delivery-attempts = 5; reject), and
    `count == bytes == inflight == 0`.

Where the strict invariant (2) holds, and how the machines are structured:

* Without group closes, (2) holds as is with no rebalance, and with rebalance only
  together with `group_rebalance_pause_dispatch` (GROUPING 3.10: without the pause a
  rebalance moves a group while its old owner still processes it, by design; so the
  rebalance machine always pauses). Resets and `group_unbind_on_undeliverable` move
  groups by design and are not used here.
* A close (sequence -1) ends a group *instance*: the next message of the same id binds
  afresh (GROUPING 3.6) while the old owner may still hold unsettled messages of the
  closed instance. So with closes the group of a message is (id, instance), where the
  instance counts the closes of that id sent before it. GROUPING says nothing about a
  message of a closed instance that comes back (release, detach) after the id was bound
  again: the code gives it to the id's current owner, like Artemis. (1)/(1b) are still
  checked per instance. (2) is checked for *open* instances only (whose close has not
  been delivered yet); `TestClosesOwner` checks it and `TestClosesOrder` does not.
  A returned close message that is redelivered ends the id's *new* binding, which
  breaks (2) for the new instance (regression tests below; GROUPING is silent on it).
* With buckets the group is the bucket (a close releases the whole bucket).
* On an exclusive queue every message is in the one implicit group and group ids
  (including -1) are ignored, so (2) means one consumer with unsettled messages at a
  time, closes or not.

Counterexamples hypothesis found are kept, shrunk, as `test_regression_*` at the end.
A run with failures spends most of its time shrinking (up to ~100 s on 2 cores without
a `.hypothesis` database; ~15 s when the database replays them); a passing run of the
whole file takes ~25 s.
"""

from __future__ import annotations

import itertools
import sys
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, ClassVar

from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from amqbroker.core.entry import Entry
from amqbroker.core.groups import bucket_of
from amqbroker.core.queue import QueuePolicy
from tests.unit.core_harness import Delivery, FakeConsumer, Harness, label

GROUPS = ("A", "B", "C", "D", None, None)
FILTERS: dict[str, Any] = {
    "all": None,
    "no-D": lambda e: e.group_id != "D",
    "grouped-only": lambda e: e.group_id is not None,
}
MAX_CONSUMERS = 3

SETTINGS = settings(
    max_examples=200,
    stateful_step_count=60,
    deadline=None,
    # no "explain" phase: it re-runs the failing example under a tracer (slow) and the
    # trace in the assertion message already tells the story
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


@dataclass
class Msg:
    entry: Entry
    index: int
    #: the group (id, bucket or the exclusive sentinel) and its instance; key None = ungrouped
    key: Any
    instance: int
    closes: bool
    state: str = "queued"  # queued | inflight | done
    holder: FakeConsumer | None = None
    first_delivered: bool = False
    acked: int = 0
    dead: int = 0

    @property
    def label(self) -> str:
        return label(self.entry)


class GroupMachine(RuleBasedStateMachine):
    policy: ClassVar[QueuePolicy] = QueuePolicy(max_delivery_attempts=5)
    #: send group closes (-1)
    closes: ClassVar[bool] = False
    #: "id", "bucket4" or "exclusive": what a message's group is for the invariants
    key_mode: ClassVar[str] = "id"
    #: check invariant (2)
    check_owner: ClassVar[bool] = True
    #: group ids sent (None = ungrouped)
    groups_sent: ClassVar[tuple[str | None, ...]] = GROUPS

    def __init__(self) -> None:
        super().__init__()
        self.h = Harness(self.policy)
        self.q = self.h.queue
        self.msgs: dict[Entry, Msg] = {}
        self.groups: dict[tuple[Any, int], list[Msg]] = defaultdict(list)
        self.instance: dict[Any, int] = defaultdict(int)
        self.close_msg: dict[tuple[Any, int], Msg] = {}
        self.attached: list[FakeConsumer] = []
        self._names = itertools.count(1)
        self._dead_seen = 0
        self.trace: list[str] = []

    # ------------------------------------------------------------ bookkeeping
    def _key(self, e: Entry) -> Any:
        if self.key_mode == "exclusive":
            return "EXCLUSIVE"
        if e.group_id is None:
            return None
        if self.key_mode == "bucket4":
            return bucket_of(e.group_id, 4)
        return e.group_id

    def _sync_dead(self) -> None:
        dead = self.h.broker.dead
        while self._dead_seen < len(dead):
            qname, e, _ = dead[self._dead_seen]
            self._dead_seen += 1
            if qname != self.q.name:
                continue
            m = self.msgs[e]
            m.dead += 1
            m.state = "done"
            m.holder = None

    def _open(self, m: Msg) -> bool:
        c = self.close_msg.get((m.key, m.instance))
        return c is None or not c.first_delivered

    def _on_deliver(self, d: Delivery) -> None:
        self._sync_dead()
        m = self.msgs[d.entry]
        c = d.consumer
        where = f"{m.label} -> {c.name}; trace: {self.trace}"
        assert m.state == "queued", f"delivered while {m.state} (holder {m.holder}): {where}"
        if m.key is not None:
            earlier = [x for x in self.groups[(m.key, m.instance)] if x.index < m.index]
            if not m.first_delivered:
                missing = [x.label for x in earlier if not x.first_delivered]
                assert not missing, f"(1) first delivery before {missing}: {where}"
            waiting = [x.label for x in earlier if x.state == "queued"]
            assert not waiting, f"(1b) delivered while earlier {waiting} wait: {where}"
            if self.check_owner and self._open(m):
                others = [
                    f"{x.label}@{x.holder.name}"
                    for x in self.groups[(m.key, m.instance)]
                    if x.state == "inflight" and x.holder is not None and x.holder is not c
                ]
                assert not others, f"(2) other consumers hold {others}: {where}"
        m.first_delivered = True
        if c.presettled:
            m.state = "done"
            m.acked += 1
        else:
            m.state = "inflight"
            m.holder = c

    def _consumer(self, i: int) -> FakeConsumer:
        return self.attached[i % len(self.attached)]

    def _pick_unsettled(self, i: int, j: int) -> tuple[FakeConsumer, Entry] | None:
        c = self._consumer(i)
        if not c.unsettled:
            return None
        es = list(c.unsettled)
        return c, es[j % len(es)]

    def _returning(self, e: Entry) -> None:
        m = self.msgs[e]
        m.state = "queued"
        m.holder = None

    # ------------------------------------------------------------------ rules
    def put(self, gid: str | None, close: bool = False) -> None:
        """Send one message of group `gid` (None: ungrouped); `close` sends sequence -1."""
        seq = -1 if close else 0
        e = self.h.make(gid, seq)
        key = self._key(e)
        inst = self.instance[key] if key is not None else 0
        closes = seq == -1 and self.key_mode != "exclusive"
        m = Msg(e, len(self.msgs), key, inst, closes)
        self.msgs[e] = m
        if key is not None:
            self.groups[(key, inst)].append(m)
            if closes:
                self.close_msg[(key, inst)] = m
                self.instance[key] += 1
        self.trace.append(f"send {m.label}{'(-1)' if seq else ''}")
        self.q.enqueue(e)

    @rule(g=st.integers(0, 5), close=st.integers(0, 3))
    def send(self, g: int, close: int) -> None:
        gid = self.groups_sent[g % len(self.groups_sent)]
        self.put(gid, self.closes and gid is not None and close == 0)

    @rule(g=st.integers(0, 5), close=st.integers(0, 3))
    def send_again(self, g: int, close: int) -> None:
        """Same as `send` (a second rule doubles the share of sends in a run)."""
        self.send(g, close)

    @precondition(lambda self: len(self.attached) < MAX_CONSUMERS)
    @rule(
        credit=st.integers(0, 6),
        flt=st.sampled_from(sorted(FILTERS)),
        presettled=st.integers(0, 9).map(lambda i: i == 0),
    )
    def attach(self, credit: int, flt: str = "all", presettled: bool = False) -> None:
        name = f"c{next(self._names)}"
        c = FakeConsumer(name, self.h.clock, presettled=presettled)
        c.on_deliver = self._on_deliver
        c.filter = FILTERS[flt]
        c.credit = credit
        self.attached.append(c)
        self.trace.append(f"attach {name} credit={credit} {flt}{' presettled' * c.presettled}")
        self.q.add_consumer(c)
        if credit:
            self.q.credit_changed(c)

    @precondition(lambda self: self.attached)
    @rule(i=st.integers(0, 3), how=st.sampled_from(["crash", "close", "release+close"]))
    def detach(self, i: int, how: str = "crash") -> None:
        """crash: connection lost, unsettled messages come back counted as failed
        attempts; close: clean detach, they come back uncounted; release+close: the
        client releases them one by one first (the owner is still attached then)."""
        c = self._consumer(i)
        self.trace.append(f"{how} {c.name}")
        if how == "release+close":
            for e in list(c.unsettled):
                del c.unsettled[e]
                self._returning(e)
                self.q.release(c, e)
        unsettled = list(c.unsettled)
        c.unsettled.clear()
        for e in unsettled:
            self._returning(e)
        self.attached.remove(c)
        self.q.remove_consumer(c, unsettled, failed=how == "crash")

    @rule()
    def end_of_batch(self) -> None:
        """The event loop continues deferred dispatches (attach without credit, dispatch
        batches) when an input batch is done."""
        self.trace.append("end of batch")
        self.h.run_deferred()

    @precondition(lambda self: self.attached)
    @rule(i=st.integers(0, 3), n=st.integers(0, 6))
    def flow(self, i: int, n: int) -> None:
        c = self._consumer(i)
        self.trace.append(f"credit {c.name}={n}")
        c.credit = n
        self.q.credit_changed(c)

    @precondition(lambda self: self.attached)
    @rule(i=st.integers(0, 3), j=st.integers(0, 10))
    def ack(self, i: int, j: int) -> None:
        got = self._pick_unsettled(i, j)
        if got is None:
            return
        c, e = got
        m = self.msgs[e]
        self.trace.append(f"ack {c.name} {m.label}")
        del c.unsettled[e]
        m.state = "done"
        m.holder = None
        m.acked += 1
        self.q.ack(c, e)

    @precondition(lambda self: self.attached)
    @rule(
        i=st.integers(0, 3),
        j=st.integers(0, 10),
        outcome=st.sampled_from(["released", "failed", "undeliverable", "rejected"]),
    )
    def settle_other(self, i: int, j: int, outcome: str) -> None:
        got = self._pick_unsettled(i, j)
        if got is None:
            return
        c, e = got
        self.trace.append(f"{outcome} {c.name} {label(e)}")
        del c.unsettled[e]
        if outcome == "rejected":
            m = self.msgs[e]
            m.state = "done"
            m.holder = None
            self.q.reject(c, e)
            return
        self._returning(e)
        self.q.release(
            c,
            e,
            delivery_failed=outcome == "failed",
            undeliverable_here=outcome == "undeliverable",
        )

    @precondition(lambda self: self.policy.redelivery_delay > 0)
    @rule(ms=st.sampled_from([1, 10, 50, 200]))
    def advance(self, ms: int) -> None:
        self.trace.append(f"advance {ms}")
        self.h.advance(ms)

    # ------------------------------------------------------------- invariants
    @invariant()
    def accounting(self) -> None:
        self._sync_dead()
        live = [m for m in self.msgs.values() if m.state != "done"]
        assert self.q.count == len(live), (self.q.count, len(live), self.trace)
        assert self.q.bytes == sum(len(m.entry.data) for m in live)
        held = sum(len(c.unsettled) for c in self.attached)
        assert self.q.inflight == held == sum(m.state == "inflight" for m in live)
        for c in self.attached:
            assert not c.duplicates, (c.name, c.duplicates, self.trace)
            for e in c.unsettled:
                m = self.msgs[e]
                assert m.state == "inflight" and m.holder is c, (m, self.trace)
        for m in self.msgs.values():
            assert m.acked + m.dead <= 1, (m, self.trace)

    def teardown(self) -> None:
        if sys.exc_info()[1] is not None:
            return  # a step already failed: keep that failure, do not drain
        self.trace.append("teardown")
        self.h.advance(10_000)
        while self.attached:
            self.detach(0)
        self.h.advance(10_000)
        self.h.run_deferred()
        drain = FakeConsumer("drain", self.h.clock)
        drain.on_deliver = self._on_deliver
        drain.credit = 10_000
        self.attached.append(drain)
        self.q.add_consumer(drain)
        self.q.credit_changed(drain)
        for _ in range(20):
            for e in list(drain.unsettled):
                m = self.msgs[e]
                del drain.unsettled[e]
                m.state = "done"
                m.holder = None
                m.acked += 1
                self.q.ack(drain, e)
            self.h.advance(10_000)
            self.h.run_deferred()
            drain.credit = 10_000
            self.q.credit_changed(drain)
            if not self.q.count:
                break
        self._sync_dead()
        bad = [(m.label, m.acked, m.dead) for m in self.msgs.values() if m.acked + m.dead != 1]
        assert not bad, (bad, self.q.statistics(), self.trace)
        assert (self.q.count, self.q.bytes, self.q.inflight) == (0, 0, 0), self.q.statistics()
        assert self.q.acked == sum(m.acked for m in self.msgs.values())


# ----------------------------------------------------------------------- variants

FEWER = settings(SETTINGS, max_examples=100)


class PlainMachine(GroupMachine):
    """No rebalance; redelivery delay on."""

    policy = QueuePolicy(max_delivery_attempts=5, redelivery_delay=50)


class RebalancePauseMachine(GroupMachine):
    """Every attach rebalances, with pause-dispatch."""

    policy = QueuePolicy(
        max_delivery_attempts=5,
        redelivery_delay=50,
        group_rebalance=True,
        group_rebalance_pause_dispatch=True,
    )


class StrictLeastLoadedMachine(GroupMachine):
    """Artemis's strict head-of-line mode, with the least-loaded owner policy."""

    policy = QueuePolicy(
        max_delivery_attempts=5, group_skip_ahead=False, group_owner_policy="least-loaded"
    )


class BucketsMachine(GroupMachine):
    policy = QueuePolicy(max_delivery_attempts=5, redelivery_delay=50, group_buckets=4)
    key_mode = "bucket4"


class ClosesOrderMachine(GroupMachine):
    """Group closes: order and accounting only."""

    policy = QueuePolicy(max_delivery_attempts=5, redelivery_delay=50)
    closes = True
    check_owner = False
    groups_sent = ("A", "B", None)


class ClosesOwnerMachine(GroupMachine):
    """Group closes: also one owner per open group instance."""

    policy = QueuePolicy(max_delivery_attempts=5)
    closes = True
    groups_sent = ("A", "B", None)


class ExclusiveMachine(GroupMachine):
    """Exclusive queue; closes are sent and must be ignored."""

    policy = QueuePolicy(max_delivery_attempts=5, redelivery_delay=50, exclusive=True)
    key_mode = "exclusive"
    closes = True


TestPlain = PlainMachine.TestCase
TestPlain.settings = SETTINGS
TestRebalancePause = RebalancePauseMachine.TestCase
TestRebalancePause.settings = SETTINGS
TestStrictLeastLoaded = StrictLeastLoadedMachine.TestCase
TestStrictLeastLoaded.settings = FEWER
TestBuckets = BucketsMachine.TestCase
TestBuckets.settings = FEWER
TestClosesOrder = ClosesOrderMachine.TestCase
TestClosesOrder.settings = FEWER
TestClosesOwner = ClosesOwnerMachine.TestCase
TestClosesOwner.settings = FEWER
TestExclusive = ExclusiveMachine.TestCase
TestExclusive.settings = FEWER


# -------------------------------------------- regressions (shrunk counterexamples)


def _finish(m: GroupMachine) -> None:
    m.accounting()
    m.teardown()


def test_regression_rebalance_pause_redelivery_delay_must_hold_unbound_group() -> None:
    """TestRebalancePause: the attach of c2 rebalances (A unbound) and pauses (A1 in
    flight); A1 fails with a redelivery delay; the pause ends and A2 goes to c2 while A1
    waits out its delay (1b). `Queue.release` holds a group only if it is bound."""
    m = RebalancePauseMachine()
    m.put("A")
    m.put("A")
    m.attach(credit=1)
    m.attach(credit=1, presettled=True)
    m.settle_other(i=0, j=0, outcome="failed")
    _finish(m)


def test_regression_returned_close_message_ends_the_new_binding() -> None:
    """TestClosesOwner: B1(-1) goes to c1 without binding; B2, B3 bind B to c1. c1
    releases B1: redelivered to c1, the close *again* ends the binding of the new
    instance; c1 releases B2, which binds B to c2 while c1 still holds B3 (2)."""
    m = ClosesOwnerMachine()
    m.put("B", close=True)
    m.put("B")
    m.put("B")
    m.attach(credit=4)
    m.attach(credit=1, presettled=True)
    m.settle_other(i=0, j=0, outcome="released")  # B1
    m.settle_other(i=0, j=0, outcome="released")  # B2
    _finish(m)


def test_regression_crashed_holder_of_close_message_moves_the_new_binding() -> None:
    """The same through a consumer crash: c1 holds the close of instance 0 when c2
    already owns instance 1; c1 crashes, the close is redelivered to c2 and ends its
    binding, and A's next message binds to c3 while c2 holds A3."""
    m = ClosesOwnerMachine()
    m.attach(credit=10)  # c1
    m.attach(credit=3)  # c2
    m.attach(credit=10)  # c3
    m.put("A")  # c1
    m.put("A", close=True)  # c1, ends instance 0
    m.put("A")  # A3: instance 1 binds c2
    m.detach(i=0, how="crash")  # c1 crashes holding A1, A2(-1): both go to c2
    m.put("A")  # c2 has no credit left: A4 binds c3 while c2 holds A3
    _finish(m)


def test_regression_exclusive_queue_close_releases_exclusive_consumer() -> None:
    """TestExclusive: A1(-1) goes to c2 without making it exclusive; A2(-1) then goes
    to c1 while c2 holds A1 (2). On an exclusive queue group ids must be ignored."""
    m = ExclusiveMachine()
    m.put("A", close=True)
    m.put("A", close=True)
    m.attach(credit=0, presettled=True)
    m.attach(credit=1)
    m.flow(i=0, n=1)
    _finish(m)


def test_regression_closed_group_redelivery_delay_must_hold_its_close() -> None:
    """TestClosesOrder: B1, B2(-1) go to c1 (the close unbinds B); B1 fails with a
    redelivery delay (B is unbound, so nothing holds it); c1 crashes and the returned
    close B2 goes to c2 while B1 still waits out its delay (1b)."""
    m = ClosesOrderMachine()
    m.attach(credit=10)  # c1
    m.put("B")
    m.put("B", close=True)
    m.attach(credit=10)  # c2
    m.settle_other(i=0, j=0, outcome="failed")  # B1
    m.detach(i=0, how="crash")
    _finish(m)
