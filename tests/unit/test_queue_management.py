"""Unit tests of the queue's management support (`Queue` section "admin pause and
ages"; `DeadLetters.move_messages`): the operator's pause, arrival times from the coarse
clock and their bounded marks, group settle times, and taking waiting messages out of
every place they can wait (main order, a group's parked messages, unmatched)."""

from __future__ import annotations

from amqbroker.core.queue import QueuePolicy
from tests.unit.core_harness import T0, Harness


def test_admin_pause_holds_every_path_until_resume() -> None:
    h = Harness()
    c = h.attach("c", 1)
    h.send("A")  # A bound to c, c out of credit
    h.send("A")  # parked for c
    assert h.queue.admin_pause() and not h.queue.admin_pause()
    h.send(None)
    h.add_credit(c, 5)  # would serve the parked A2 and u1
    assert c.labels == ["A1"]
    assert not h.queue.dispatching and h.queue.paused
    assert h.queue.admin_resume() and not h.queue.admin_resume()
    assert c.labels == ["A1", "A2", "u1"]


def test_arrival_times_are_within_the_resolution_and_marks_stay_bounded() -> None:
    h = Harness(policy=QueuePolicy(age_resolution=1.0, age_marks=8))
    q = h.queue
    sent = []
    for _ in range(100):  # one message every 0.3 s, none consumed
        sent.append((h.send("A"), h.clock.t))
        h.advance(300)
    for e, t in sent[-20:]:  # recent ones: within the resolution
        arrived = q.arrival_time(e.seq)
        assert arrived is not None and t - 1.0 <= arrived <= t
    assert len(q.ages.marks) <= 8
    # thinned old marks only get coarser: still never later than the real arrival
    for e, t in sent:
        arrived = q.arrival_time(e.seq)
        assert arrived is not None and arrived <= t
    assert q.arrival_time(sent[0][0].seq) == T0  # the first mark is kept


def test_marks_below_the_oldest_message_are_dropped() -> None:
    h = Harness(policy=QueuePolicy(age_resolution=1.0, age_marks=4))
    c = h.attach("c", 1000)
    for _ in range(20):
        h.send(None)
        h.ack(c)
        h.advance(2000)
    e = h.send(None)
    assert len(h.queue.ages.marks) <= 4
    assert h.queue.arrival_time(e.seq) == h.clock.t


def test_group_settle_time_and_oldest_waiting_message() -> None:
    h = Harness(policy=QueuePolicy(age_resolution=1.0))
    c = h.attach("c", 1)
    h.send("A")
    h.advance(5000)
    h.send("A")  # waits for credit
    h.advance(3000)
    [row] = h.queue.group_details()
    assert (row["settled_at"], row["oldest_seq"], row["oldest_arrival"]) == (T0, 2, T0 + 5)
    h.ack(c)
    [row] = h.queue.group_details()
    assert row["settled_at"] == T0 + 8  # the settlement read the clock (8 s > resolution)


def test_take_waiting_from_main_parked_and_unmatched_then_groups_move_on() -> None:
    h = Harness()
    c = h.attach("c", 1, filter=lambda e: e.data != b"u1")
    h.send("A")  # to c
    h.send("A")  # parked (c has no credit)
    h.send(None)  # u1: c refuses it -> unmatched once dispatch tries
    h.add_credit(c, 0)
    dst = h.broker.create_address("dst", "anycast", durable=False).queues[0]
    moved = h.broker.dead_letters.move_messages(h.queue, dst, lambda e: e.data in (b"A2", b"u1"))
    assert moved == 2
    assert sorted(e.data for e in dst.browse()) == [b"A2", b"u1"]
    assert (h.queue.count, dst.count) == (1, 2)  # A1 stays (in flight)
    [row] = h.queue.group_details()
    assert (row["backlog"], row["blocked"]) == (0, False)


def test_a_held_group_waits_in_order_while_other_groups_flow_then_binds_afresh() -> None:
    """`hold_group` (a returning cluster node asks the arbiter before it serves a
    recovered group, issue 20): nothing of the group is delivered, other groups flow,
    and after `unhold_group` its messages go out in order to one new owner, with the
    first flag; a group held twice needs two unholds."""
    h = Harness()
    q = h.queue
    h.send_many("A", "B", "A")
    assert q.hold_group("A") and q.hold_group("A")
    c = h.attach("c", 10)
    assert c.labels == ["B1"]
    h.send("A")
    q.unhold_group("A")
    assert c.labels == ["B1"]  # still held once
    q.unhold_group("A")
    assert c.labels == ["B1", "A1", "A2", "A3"]
    q.unhold_group("A")  # not held any more: no effect
    assert c.labels == ["B1", "A1", "A2", "A3"]


def test_holding_a_group_bound_to_a_consumer_stops_it_until_unheld() -> None:
    h = Harness()
    q = h.queue
    c = h.attach("c", 10)
    h.send("A")
    assert c.labels == ["A1"]
    assert q.hold_group("A")
    h.send_many("A", "B")
    assert c.labels == ["A1", "B1"]
    q.unhold_group("A")
    assert c.labels == ["A1", "B1", "A2"]


def test_an_exclusive_or_ungrouped_queue_cannot_hold_a_group() -> None:
    assert not Harness(policy=QueuePolicy(exclusive=True)).queue.hold_group("A")
    assert not Harness(policy=QueuePolicy(group_buckets=0)).queue.hold_group("A")
