"""Unit tests of the group dispatcher (`amqbroker.core.queue.Queue`), driven through
`core_harness` (fake clock, timers run by hand, recording consumers).

Section numbers refer to ../shared/docs/GROUPING.md. Every test asserts exact delivery
targets and orders. Payload labels: ``G3`` is the third message sent to group ``G``,
``u2`` the second ungrouped one.
"""

from __future__ import annotations

import logging
from collections import deque

import pytest

from amqbroker.core.address import ANYCAST
from amqbroker.core.address_settings import AddressSettings
from amqbroker.core.broker import Broker
from amqbroker.core.entry import Entry
from amqbroker.core.groups import artemis_hash, bucket_of
from amqbroker.core.queue import QueuePolicy
from amqbroker.core.timers import Timers
from tests.unit.core_harness import FakeClock, FakeConsumer, Harness, count_core_lines, label

FIRST = "JMSXGroupFirstForConsumer"


def labels(entries: list[Entry]) -> list[str]:
    return [label(e) for e in entries]


# ------------------------------------------------------------------ harness sanity


def test_broker_uses_the_timers_it_is_given() -> None:
    """The app's timer loop drives the `Timers` it passes to `Broker` (an empty Timers
    once was falsy and got replaced, so no core timer ever fired)."""
    t = Timers()
    b = Broker(clock=FakeClock(), timers=t)
    assert b.timers is t


# -------------------------------------------------------------- ungrouped dispatch


def test_ungrouped_round_robin_in_attach_order() -> None:
    h = Harness()
    c1, c2, c3 = (h.attach(n, 10) for n in ("c1", "c2", "c3"))
    h.send_many(*[None] * 7)
    assert c1.labels == ["u1", "u4", "u7"]
    assert c2.labels == ["u2", "u5"]
    assert c3.labels == ["u3", "u6"]


def test_ungrouped_round_robin_skips_busy_consumers() -> None:
    h = Harness()
    c1 = h.attach("c1", 10)
    c2 = h.attach("c2", 0)
    c3 = h.attach("c3", 10)
    h.send_many(None, None, None, None)
    assert (c1.labels, c2.labels, c3.labels) == (["u1", "u3"], [], ["u2", "u4"])
    h.credit(c2, 1)
    h.send_many(None, None)  # the cursor is after c3: c1, then c2
    assert (c1.take(), c2.take(), c3.take()) == (["u1", "u3", "u5"], ["u6"], ["u2", "u4"])


def test_queued_messages_wait_for_credit_in_order() -> None:
    h = Harness()
    c = h.attach("c", 0)
    h.send_many(None, None, None)
    assert c.labels == []
    assert h.queue.count == 3
    h.credit(c, 2)
    assert c.labels == ["u1", "u2"]
    h.credit(c, 5)
    assert c.labels == ["u1", "u2", "u3"]


def test_consumer_priority_tiers() -> None:
    h = Harness()
    hi = h.attach("hi", 2, priority=5)
    lo1 = h.attach("lo1", 10)
    lo2 = h.attach("lo2", 10)
    h.send_many(*[None] * 6)
    assert hi.take() == ["u1", "u2"]
    assert lo1.take() == ["u3", "u5"]
    assert lo2.take() == ["u4", "u6"]
    h.credit(hi, 1)
    h.send(None)
    h.send("G")  # hi is busy again: the new group goes to the low tier
    assert (hi.take(), lo1.take(), lo2.take()) == (["u7"], ["G1"], [])
    h.credit(hi, 5)
    h.send("H")  # a new group goes to the highest tier with a taker
    h.send("G")  # ... but a bound group stays with its owner
    assert (hi.take(), lo1.take(), lo2.take()) == (["H1"], ["G2"], [])


def test_message_priority_levels() -> None:
    h = Harness()
    c = h.attach("c", 0)
    h.send(priority=1)
    h.send(priority=9)
    h.send(priority=4)
    h.send(priority=9)
    h.credit(c, 10)
    assert c.labels == ["u2", "u4", "u3", "u1"]


# ---------------------------------------------------------- binding: rule R (3.4)


def test_new_groups_round_robin_cursor_not_advanced_by_bound_deliveries() -> None:
    """GROUPING 3.4 rule R / JMSMessageGroupsTest.testGroupSeqCloseGroup."""
    h = Harness()
    c1, c2, c3 = (h.attach(n, 10) for n in ("c1", "c2", "c3"))
    h.send("G")
    h.send("G")
    assert h.queue.group_count() == 1
    h.send("G", -1)
    assert h.queue.group_count() == 0
    h.send("H")  # next new binding: c2, then c3
    h.send("I")
    h.send("G")  # a fresh G binding: the cursor wrapped to c1
    assert c1.labels == ["G1", "G2", "G3", "G4"]
    assert c2.labels == ["H1"]
    assert c3.labels == ["I1"]
    assert h.queue.group_count() == 3


def test_cursor_moves_on_ungrouped_and_new_bindings_only() -> None:
    h = Harness()
    c1, c2, c3 = (h.attach(n, 10) for n in ("c1", "c2", "c3"))
    h.send("G")  # c1, cursor -> c2
    h.send("G")  # c1 (bound), cursor stays
    h.send(None)  # c2, cursor -> c3
    h.send("G")  # c1
    h.send("H")  # c3, cursor -> c1
    h.send(None)  # c1
    h.send("H")  # c3
    assert c1.labels == ["G1", "G2", "G3", "u2"]
    assert c2.labels == ["u1"]
    assert c3.labels == ["H1", "H2"]


def test_attach_and_detach_reset_the_cursor() -> None:
    h = Harness()
    c1, c2, _c3 = (h.attach(n, 10) for n in ("c1", "c2", "c3"))
    h.send("A")  # c1, cursor -> c2
    c4 = h.attach("c4", 10)  # cursor back to c1
    h.send("B")  # c1, cursor -> c2
    h.detach(c4)  # cursor back to c1
    h.send("C")
    h.send("D")
    assert c1.labels == ["A1", "B1", "C1"]
    assert c2.labels == ["D1"]


def test_cursor_reset_applies_to_every_priority_tier() -> None:
    h = Harness()
    hi = h.attach("hi", 0, priority=9)
    a = h.attach("a", 10)
    b = h.attach("b", 10)
    h.send("A")  # a, cursor of tier 0 -> b
    h.detach(hi)
    h.send("B")  # cursor reset: a again
    assert (a.labels, b.labels) == (["A1", "B1"], [])


def test_least_loaded_prefers_fewest_bound_groups() -> None:
    h = Harness(QueuePolicy(group_owner_policy="least-loaded"))
    c1, c2, c3 = (h.attach(n, 10) for n in ("c1", "c2", "c3"))
    h.send_many("A", "B", "C", "A", "B")
    assert (c1.labels, c2.labels, c3.labels) == (["A1", "A2"], ["B1", "B2"], ["C1"])
    c4 = h.attach("c4", 10)  # under least-loaded a late consumer wins the next new group
    h.send("D")
    assert c4.labels == ["D1"]
    h.send("C", -1)  # c3 now owns nothing
    h.send("E")
    assert c3.labels == ["C1", "C2", "E1"]


def test_least_loaded_tie_goes_to_least_recently_served_consumer() -> None:
    """GROUPING 3.4: least-loaded = fewest bound groups first, ties -> the consumer that
    least recently received a message."""
    h = Harness(QueuePolicy(group_owner_policy="least-loaded"))
    c1 = h.attach("c1", 10)
    c2 = h.attach("c2", 10)
    h.send("A")  # tie (nobody served yet): c1
    h.advance(10)
    h.send("B")  # c2
    h.advance(10)
    h.send("B", -1)  # c2 served at t=20
    h.advance(10)
    h.send("A", -1)  # c1 served at t=30
    h.advance(10)
    assert (c1.labels, c2.labels) == (["A1", "A2"], ["B1", "B2"])
    h.send("C")  # both own 0 groups; c2 was served least recently
    assert c2.labels[-1] == "C1", (c1.labels, c2.labels)


# ------------------------------------------------------ skip-ahead / strict (D4)


def test_skip_ahead_busy_owner_does_not_block_others() -> None:
    h = Harness()
    c1 = h.attach("c1", 1)
    c2 = h.attach("c2", 0)
    h.send("G")  # binds c1, which is now out of credit
    h.credit(c2, 10)
    h.send("G")
    h.send(None)
    h.send("H")
    h.send("G")
    h.send(None)
    assert c1.labels == ["G1"]
    assert c2.labels == ["u1", "H1", "u2"]
    st = h.queue.statistics()
    assert (st["groups"], st["blocked_groups"], st["messages"]) == (2, 1, 6)
    (g,) = [x for x in h.queue.list_groups() if x["group"] == "G"]
    assert (g["consumer"], g["backlog"], g["in_flight"], g["blocked"]) == ("c1", 2, 1, True)
    h.credit(c1, 10)
    assert c1.labels == ["G1", "G2", "G3"]
    assert h.queue.statistics()["blocked_groups"] == 0
    h.send("G")
    assert c1.labels == ["G1", "G2", "G3", "G4"]


def test_skip_ahead_head_of_line_case_from_the_artemis_manual() -> None:
    """100 grouped messages for a slow consumer at the head, 1000 ungrouped behind."""
    h = Harness()
    slow = h.attach("slow", 1)
    fast = h.attach("fast", 0)
    for _ in range(100):
        h.send("G")
    for _ in range(1000):
        h.send(None)
    h.credit(fast, 2000)
    assert slow.labels == ["G1"]
    assert fast.labels == [f"u{i}" for i in range(1, 1001)]
    h.credit(slow, 1000)
    assert slow.labels == [f"G{i}" for i in range(1, 101)]


def test_strict_mode_stops_at_busy_owner() -> None:
    h = Harness(QueuePolicy(group_skip_ahead=False))
    c1 = h.attach("c1", 1)
    c2 = h.attach("c2", 0)
    h.send("G")
    h.credit(c2, 10)
    h.send("G")
    h.send(None)
    h.send("H")
    h.send("G")
    h.send(None)
    assert c1.labels == ["G1"]
    assert c2.labels == []  # head-of-line blocked behind G2
    h.credit(c1, 10)
    # G2 to c1; u1: cursor after c1 -> c2; H1: cursor -> c1; G3 -> c1; u2 -> c2
    assert c1.labels == ["G1", "G2", "H1", "G3"]
    assert c2.labels == ["u1", "u2"]


def test_a_message_for_a_busy_owner_is_parked_on_arrival() -> None:
    """With nothing queued ahead, a message whose group's owner has no credit goes
    straight to the group's parked messages (the pass's answer, without the pass);
    under strict head-of-line (no skip-ahead) it stays at the head of the order."""
    for skip in (True, False):
        h = Harness(QueuePolicy(group_skip_ahead=skip))
        c1 = h.attach("c1", 1)
        c2 = h.attach("c2", 0)
        h.send("G")
        h.send("G")
        g = h.queue.dispatcher.table["G"]
        if skip:
            assert h.queue.n_main == 0
            assert [label(e) for e in g.parked or ()] == ["G2"]
            assert g.waiting and c1.parked_groups == deque([g])
        else:
            assert h.queue.n_main == 1 and g.parked is None
        h.send("G")  # joins G2, behind it
        h.credit(c2, 10)
        assert c2.labels == []
        h.credit(c1, 10)
        assert c1.labels == ["G1", "G2", "G3"]
        assert h.queue.n_main == 0 and g.parked is None


def test_unbound_group_first_message_without_taker_holds_the_group() -> None:
    """3.5.1: if nobody ready accepts a new group's first message, later messages of the
    group must not bind elsewhere and overtake it."""
    h = Harness()
    c1 = h.attach("c1", 10, filter=lambda e: label(e) != "G1")
    c2 = h.attach("c2", 0)
    h.send("G")
    h.send("G")
    h.send(None)
    assert c1.labels == ["u1"]
    h.credit(c2, 10)
    assert c2.labels == ["G1", "G2"]
    h.send("G")
    assert c2.labels == ["G1", "G2", "G3"]


# -------------------------------------------------------------- group close (3.6)


def test_close_goes_to_owner_and_next_message_binds_afresh() -> None:
    h = Harness(QueuePolicy(group_first_key=FIRST))
    c1 = h.attach("c1", 10)
    c2 = h.attach("c2", 10)
    h.send("G")
    h.send("G")
    h.send("G", -1)
    h.send("G")
    h.send("G")
    assert c1.labels == ["G1", "G2", "G3"]
    assert c1.firsts == ["G1"]
    assert c2.labels == ["G4", "G5"]
    assert c2.firsts == ["G4"]
    assert h.queue.group_count() == 1


def test_close_of_unbound_group_creates_no_binding() -> None:
    h = Harness(QueuePolicy(group_first_key=FIRST))
    c1 = h.attach("c1", 10)
    c2 = h.attach("c2", 10)
    h.send("G", -1)  # normal choice (c1), no binding, no flag; cursor advances
    assert h.queue.group_count() == 0
    h.send("G")
    assert (c1.labels, c1.firsts) == (["G1"], [])
    assert (c2.labels, c2.firsts) == (["G2"], ["G2"])
    assert h.queue.group_count() == 1


def test_close_waits_for_busy_owner_then_releases_the_group() -> None:
    h = Harness(QueuePolicy(group_first_key=FIRST))
    c1 = h.attach("c1", 1)
    c2 = h.attach("c2", 10)
    h.send("G")  # c1 (cursor -> c2)
    h.send("G", -1)  # parked for c1
    h.send("G")  # parked behind the close
    h.send("H")  # c2 (cursor -> c1)
    assert (c1.labels, c2.labels) == (["G1"], ["H1"])
    assert h.queue.group_count() == 2
    h.credit(c1, 1)
    # the close goes to c1 and ends the group; G3 starts a new one (c1 busy -> c2)
    assert c1.labels == ["G1", "G2"]
    assert c2.labels == ["H1", "G3"]
    assert c2.firsts == ["H1", "G3"]
    (g,) = [x for x in h.queue.list_groups() if x["group"] == "G"]
    assert g["consumer"] == "c2"


# ------------------------------------------------ detach / returns (3.8, C-1, C-2)


def test_detach_returns_unsettled_first_in_order_then_group_moves() -> None:
    h = Harness(QueuePolicy(group_first_key=FIRST))
    c1 = h.attach("c1", 2)
    c2 = h.attach("c2", 0)
    g1, g2 = h.send("G"), h.send("G")
    h.send("G")
    h.send("G")
    h.send(None)
    h.credit(c2, 10)
    assert c1.labels == ["G1", "G2"]
    assert c2.take() == ["u1"]
    # the link reports its unsettled deliveries in any order
    h.queue.remove_consumer(c1, [g2, g1])
    c1.unsettled.clear()
    assert c2.labels == ["G1", "G2", "G3", "G4"]
    assert c2.firsts == ["G1"]
    assert (g1.delivery_count, g2.delivery_count) == (1, 1)
    assert [d.entry.delivery_count for d in c2.deliveries] == [1, 1, 0, 0]
    assert [x["consumer"] for x in h.queue.list_groups()] == ["c2"]


def test_detach_returned_messages_go_before_newer_main_messages() -> None:
    h = Harness()
    c1 = h.attach("c1", 3)
    h.send("G")
    h.send(None)
    h.send("H")
    h.send_many("G", None, "H")  # queued: c1 has no credit left
    c2 = h.attach("c2", 0)
    h.detach(c1)
    h.credit(c2, 10)
    assert c2.labels == ["G1", "u1", "H1", "G2", "u2", "H2"]


def test_clean_detach_returns_messages_uncounted() -> None:
    h = _dlq_harness(1)
    c1 = h.attach("c1", 10)
    c2 = h.attach("c2", 0)
    h.send_many("G", "G")
    h.detach(c1, failed=False)  # clean close: not a failed attempt, even at max 1
    h.credit(c2, 10)
    assert c2.labels == ["G1", "G2"]
    assert [d.entry.delivery_count for d in c2.deliveries] == [0, 0]
    assert h.broker.dead == []
    h.detach(c2)  # connection lost: counted, max-delivery-attempts 1 reached
    assert h.queue.count == 0
    assert labels([e for _, e, _ in h.broker.dead]) == ["G1", "G2"]


def test_detach_with_nothing_unsettled_releases_groups() -> None:
    h = Harness()
    c1 = h.attach("c1", 10)
    c2 = h.attach("c2", 10)
    h.send("G")
    h.ack(c1)
    h.detach(c1)
    assert h.queue.group_count() == 0
    h.send("G")
    assert c2.labels == ["G2"]


# -------------------------------------------------------- settlement outcomes (3.9)


def test_release_goes_back_to_the_same_owner_in_order() -> None:
    h = Harness()
    c1 = h.attach("c1", 3)
    c2 = h.attach("c2", 0)
    h.send_many("G", "G", "G")
    h.credit(c2, 10)
    e2 = h.release(c1, "G2")
    e1 = h.release(c1, "G1")
    h.send("G")
    h.send(None)
    assert c2.labels == ["u1"]  # never a message of G
    h.credit(c1, 10)
    assert c1.labels == ["G1", "G2", "G3", "G1", "G2", "G4"]
    assert (e1.delivery_count, e2.delivery_count) == (0, 0)  # released: not incremented


def test_release_with_credit_redelivers_immediately_to_owner() -> None:
    h = Harness()
    c1 = h.attach("c1", 10)
    c2 = h.attach("c2", 10)
    h.send_many("G", "G")
    h.release(c1, "G1")
    assert c1.labels == ["G1", "G2", "G1"]
    assert c2.labels == []


def test_modified_failed_increments_delivery_count_and_keeps_owner() -> None:
    h = Harness()
    c1 = h.attach("c1", 10)
    c2 = h.attach("c2", 10)
    h.send("G")
    e = h.release(c1, "G1", failed=True)
    assert e.delivery_count == 1
    e = h.release(c1, "G1", failed=True)
    assert e.delivery_count == 2
    assert c1.labels == ["G1", "G1", "G1"]
    assert c2.labels == []


def test_redelivery_delay_holds_the_whole_group() -> None:
    h = Harness(QueuePolicy(redelivery_delay=100))
    c1 = h.attach("c1", 10)
    c2 = h.attach("c2", 10)
    h.send("G")  # c1
    h.send("H")  # c2
    h.release(c1, "G1", failed=True)
    assert h.queue.statistics()["delayed"] == 1
    h.send("G")  # held behind G1
    h.send("H")
    h.send(None)
    assert c1.labels == ["G1", "u1"]
    assert c2.labels == ["H1", "H2"]
    h.advance(99)
    assert c1.labels == ["G1", "u1"]
    h.advance(1)
    assert c1.labels == ["G1", "u1", "G1", "G2"]
    assert c1.deliveries[2].entry.delivery_count == 1
    assert h.queue.statistics()["delayed"] == 0


def test_plain_release_is_not_delayed() -> None:
    h = Harness(QueuePolicy(redelivery_delay=100))
    c1 = h.attach("c1", 10)
    h.send("G")
    h.release(c1, "G1")
    assert c1.labels == ["G1", "G1"]


def test_owner_detaches_during_redelivery_delay() -> None:
    h = Harness(QueuePolicy(redelivery_delay=100, group_first_key=FIRST))
    c1 = h.attach("c1", 10)
    c2 = h.attach("c2", 10)
    h.send("G")
    h.release(c1, "G1", failed=True)
    h.send("G")
    h.detach(c1)
    assert c2.labels == []
    h.advance(100)
    assert c2.labels == ["G1", "G2"]
    assert c2.firsts == ["G1"]


def test_redelivery_delay_hold_is_not_released_by_an_unrelated_timer() -> None:
    """3.9 (a): a message delayed while its group was unbound (here after resetGroup)
    still holds the group, and only its own timer releases that hold: neither a later
    message of the group nor another group's delayed message may let G2/G3 overtake
    G1, and the other group H is not held by G's delay."""
    h = Harness(QueuePolicy(redelivery_delay=100))
    c1 = h.attach("c1", 10)
    h.send("G")
    h.send("H")
    assert h.queue.reset_group("G")
    h.release(c1, "G1", failed=True)  # due at t=100, the group is unbound
    h.advance(10)
    h.release(c1, "H1", failed=True)  # due at t=110, holds H only
    h.send("G")
    h.send("G")
    h.send("H")
    assert c1.take() == ["G1", "H1"]  # G2, G3 wait for G1; H2 waits for H1
    h.advance(90)  # t=100: G1 is back, then G2, G3 in order; H still held
    assert c1.take() == ["G1", "G2", "G3"]
    h.advance(10)  # t=110: H1 is back, then H2
    assert c1.take() == ["H1", "H2"]


def test_redelivery_delay_holds_group_even_when_unbound() -> None:
    """3.9 (a): a group whose message waits out its redelivery delay is blocked until
    the message is back, whether or not the group is bound at that moment (unbound
    here by resetGroup; a rebalance or a close does the same)."""
    h = Harness(QueuePolicy(redelivery_delay=100))
    c1 = h.attach("c1", 10)
    c2 = h.attach("c2", 10)
    h.send("G")
    assert h.queue.reset_group("G")
    h.release(c1, "G1", failed=True)
    h.send("G")
    assert (c1.labels, c2.labels) == (["G1"], [])  # G2 must wait for G1
    h.advance(100)
    assert c1.labels + c2.labels == ["G1", "G1", "G2"]


def test_redelivered_close_message_does_not_end_a_newer_binding() -> None:
    """3.6: a close ends the binding it is delivered under. Here the close of the first
    G instance comes back (released) after G was bound again to c2; redelivered to c2 it
    ends c2's binding too, so G4 binds to c3 while c2 still holds G3 unsettled: two
    owners of one group instance. (GROUPING is silent on returned closes; Artemis
    behaves the same. Expected here: G4 stays with c2.)"""
    h = Harness()
    c1, c2, c3 = (h.attach(n, 10) for n in ("c1", "c2", "c3"))
    h.send("G")
    h.send("G", -1)
    h.send("G")  # G3: a new instance, bound to c2
    h.release(c1, "G2")  # the old close goes to G's current owner, c2
    h.send("G")
    assert c2.labels == ["G3", "G2", "G4"]
    assert c3.labels == []


# -------------------------------------------------- undeliverable-here / stuck (D5)


def test_undeliverable_here_avoids_that_consumer_for_ungrouped() -> None:
    h = Harness()
    c1 = h.attach("c1", 10)
    c2 = h.attach("c2", 10)
    h.send_many(None, None)  # u1 -> c1, u2 -> c2; cursor back at c1
    e = h.release(c1, "u1", undeliverable=True)
    assert e.delivery_count == 0
    assert c2.labels == ["u2", "u1"]
    assert c1.labels == ["u1"]


def test_undeliverable_here_only_consumer_waits_for_another() -> None:
    h = Harness()
    c1 = h.attach("c1", 10)
    h.send(None)
    h.release(c1, "u1", undeliverable=True)
    h.send(None)
    assert c1.labels == ["u1", "u2"]
    assert h.queue.statistics()["unmatched"] == 1
    c2 = h.attach("c2", 10)
    assert c2.labels == ["u1"]
    assert h.queue.statistics()["unmatched"] == 0


def test_owner_undeliverable_here_makes_the_group_stuck(caplog: pytest.LogCaptureFixture) -> None:
    h = Harness(QueuePolicy(group_first_key=FIRST))
    c1 = h.attach("c1", 10)
    c2 = h.attach("c2", 10)
    h.send_many("G", "G")
    with caplog.at_level(logging.WARNING, logger="amqbroker.core.queue"):
        h.release(c1, "G1", undeliverable=True)
        h.send("G")
        h.send("G")
        h.add_credit(c1, 1)
    assert c1.labels == ["G1", "G2"]
    assert c2.labels == []
    st = h.queue.statistics()
    assert (st["stuck_groups"], st["stuck_messages"]) == (1, 1)
    (g,) = h.queue.list_groups()
    assert (g["consumer"], g["stuck"], g["backlog"], g["in_flight"]) == ("c1", True, 3, 1)
    assert sum("does not accept" in r.getMessage() for r in caplog.records) == 1
    h.ack(c1, "G2")
    h.detach(c1)
    assert c2.labels == ["G1", "G3", "G4"]
    assert c2.firsts == ["G1"]
    assert h.queue.statistics()["stuck_groups"] == 0


def test_group_unbind_on_undeliverable_moves_the_group() -> None:
    h = Harness(QueuePolicy(group_unbind_on_undeliverable=True, group_first_key=FIRST))
    c1 = h.attach("c1", 10)
    c2 = h.attach("c2", 10)
    h.send_many("G", "G")
    h.release(c1, "G1", undeliverable=True)
    h.send("G")
    assert c2.labels == ["G1", "G3"]
    assert c2.firsts == ["G1"]
    assert h.queue.list_groups()[0]["consumer"] == "c2"
    assert h.queue.statistics()["stuck_groups"] == 0


def test_owner_filter_never_matching_makes_the_group_stuck_until_reset() -> None:
    h = Harness()
    c1 = h.attach("c1", 10, filter=lambda e: label(e) != "G2")
    c2 = h.attach("c2", 10)
    h.send_many("G", "G", "G")
    assert c1.labels == ["G1"]
    assert c2.labels == []
    assert h.queue.statistics()["stuck_groups"] == 1
    assert h.queue.reset_group("G")
    assert c2.labels == ["G2", "G3"]
    assert h.queue.statistics()["stuck_groups"] == 0


# -------------------------------------------------------- dead letters, rejects


def _dlq_harness(max_attempts: int = 3, dla: str | None = "DLQ") -> Harness:
    s = AddressSettings(max_delivery_attempts=max_attempts, dead_letter_address=dla)
    h = Harness(settings={"q": s}, keep_broker_policy=True)
    h.broker.create_address("DLQ", ANYCAST, durable=False)
    return h


def test_max_delivery_attempts_dead_letters_and_group_continues() -> None:
    h = _dlq_harness(3)
    assert h.queue.policy.max_delivery_attempts == 3
    c1 = h.attach("c1", 10)
    c2 = h.attach("c2", 10)
    h.send_many("G", "G")
    for _ in range(3):
        h.release(c1, "G1", failed=True)
    assert c1.labels == ["G1", "G2", "G1", "G1"]
    assert h.queue.count == 1
    assert h.queue.dead_lettered == 1
    assert h.broker.queues["DLQ"].count == 1
    ((qname, e, reason),) = h.broker.dead
    assert (qname, label(e)) == ("q", "G1")
    assert "max-delivery-attempts (3)" in reason
    h.send("G")
    assert c1.labels[-1] == "G3"
    assert c2.labels == []


def test_detach_counts_as_a_failed_delivery() -> None:
    h = _dlq_harness(2)
    c1 = h.attach("c1", 10)
    h.send("G")
    h.detach(c1)
    c2 = h.attach("c2", 10)
    assert c2.labels == ["G1"]
    assert c2.deliveries[0].entry.delivery_count == 1
    h.detach(c2)
    assert h.queue.count == 0
    assert h.broker.queues["DLQ"].count == 1


def test_reject_dead_letters_and_group_continues() -> None:
    h = _dlq_harness(10)
    c1 = h.attach("c1", 10)
    h.send_many("G", "G")
    h.reject(c1, "G1")
    h.send("G")
    assert c1.labels == ["G1", "G2", "G3"]
    assert h.broker.queues["DLQ"].count == 1
    assert (h.queue.count, h.queue.inflight, h.queue.dead_lettered) == (2, 2, 1)


def test_dead_letter_without_address_drops() -> None:
    h = _dlq_harness(1, dla=None)
    c1 = h.attach("c1", 10)
    h.send("G")
    h.release(c1, "G1", failed=True)
    assert h.queue.count == 0
    assert h.broker.dropped_dead_letters == 1
    assert h.broker.queues["DLQ"].count == 0


# ------------------------------------------------------------------------ expiry


def test_expired_at_dispatch_group_continues() -> None:
    h = Harness()
    c = h.attach("c", 0)
    h.send("G", expiry=h.expiry_in(100))
    h.send("G")
    h.send(None, expiry=h.expiry_in(100))
    h.send(None)
    h.send("H", expiry=h.expiry_in(1000))
    h.advance(200)
    h.credit(c, 10)
    assert c.labels == ["G2", "u2", "H1"]
    assert h.queue.expired_count == 2
    assert labels([e for _, e in h.broker.expired_entries]) == ["G1", "u1"]
    assert h.queue.count == 3


def test_expired_while_parked() -> None:
    h = Harness()
    c1 = h.attach("c1", 1)
    c2 = h.attach("c2", 10)
    h.send("G")
    h.send("G", expiry=h.expiry_in(100))
    h.send("G")
    assert h.queue.statistics()["blocked_groups"] == 1
    h.advance(200)
    h.credit(c1, 10)
    assert c1.labels == ["G1", "G3"]
    assert c2.labels == []
    assert h.queue.expired_count == 1


def test_expire_scan_removes_queued_parked_and_unmatched() -> None:
    h = Harness()
    c1 = h.attach("c1", 1)
    h.send("G")  # bound to c1, which is now busy
    h.send(None, expiry=h.expiry_in(100))  # main (every consumer busy)
    h.send("G", expiry=h.expiry_in(100))
    h.send("G")
    assert h.queue.expire_scan() == 0
    c2 = h.attach("c2", 10, filter=lambda e: not label(e).startswith("x"))
    h.send(tag="x1", expiry=h.expiry_in(100))  # nobody ready accepts it: unmatched
    st = h.queue.statistics()
    assert (st["blocked_groups"], st["unmatched"]) == (1, 1)
    assert c2.labels == ["u1"]
    h.advance(200)
    assert h.queue.expire_scan() == 2
    assert labels([e for _, e in h.broker.expired_entries]) == ["G2", "x1"]
    assert h.queue.statistics()["unmatched"] == 0
    h.credit(c1, 10)
    assert c1.labels == ["G1", "G3"]
    assert h.queue.group_count() == 1


def test_expiry_of_stuck_head_lets_the_group_continue() -> None:
    """3.9 Expiry: the group continues with the next message. Here the owner's filter
    refuses G2 (stuck); once G2 has expired, G3 must go to the owner."""
    h = Harness()
    c1 = h.attach("c1", 10, filter=lambda e: label(e) != "G2")
    h.send("G")
    h.send("G", expiry=h.expiry_in(100))
    h.send("G")
    assert c1.labels == ["G1"]
    h.advance(200)
    assert h.queue.expire_scan() == 1
    h.credit(c1, 10)
    assert c1.labels == ["G1", "G3"]
    assert h.queue.statistics()["stuck_groups"] == 0


def test_expired_messages_go_to_the_expiry_address() -> None:
    h = Harness(settings={"q": AddressSettings(expiry_address="EXP")})
    h.broker.create_address("EXP", ANYCAST, durable=False)
    c = h.attach("c", 0)
    h.send("G", expiry=h.expiry_in(50))
    h.advance(100)
    h.credit(c, 1)
    assert c.labels == []
    assert h.broker.queues["EXP"].count == 1
    assert h.queue.count == 0


# ----------------------------------------------------------------- buckets (3.2)

VECTORS = [
    ("groupA", -1280684078, {2: 0, 3: 0, 4: 2, 16: 2, 1024: 978}),
    ("groupB", -1280684047, {2: 1, 3: 1, 4: 1, 16: 1, 1024: 1009}),
    ("groupC", -1280684016, {2: 0, 3: 2, 4: 0, 16: 0, 1024: 16}),
    ("grp1", -1907067898, {2: 0, 3: 1, 4: 2, 16: 6, 1024: 6}),
    ("id1", -1285925822, {2: 0, 3: 0, 4: 2, 16: 2, 1024: 66}),
    ("Group-0", 915627478, {2: 0, 3: 1, 4: 2, 16: 6, 1024: 470}),
    ("", 0, {2: 0, 3: 0, 4: 0, 16: 0, 1024: 0}),
]


@pytest.mark.parametrize(("gid", "h", "buckets"), VECTORS)
def test_bucket_hash_test_vectors(gid: str, h: int, buckets: dict[int, int]) -> None:
    assert artemis_hash(gid) == h
    assert {n: bucket_of(gid, n) for n in buckets} == buckets


def test_bucket_int_key() -> None:
    assert bucket_of("_AMQ_GROUP_BUCKET_INT_KEY_6", 4) == 2
    assert bucket_of("_AMQ_GROUP_BUCKET_INT_KEY_-1", 4) == 3
    bad = "_AMQ_GROUP_BUCKET_INT_KEY_x"
    assert bucket_of(bad, 1024) == (artemis_hash(bad) & 0x7FFFFFFF) % 1024


def test_buckets_share_owner_first_flag_close_and_reset() -> None:
    h = Harness(QueuePolicy(group_buckets=4, group_first_key=FIRST))
    c1, c2, c3 = (h.attach(n, 10) for n in ("c1", "c2", "c3"))
    h.send("groupA")  # bucket 2 -> c1
    h.send("groupB")  # bucket 1 -> c2
    h.send("id1")  # bucket 2: already c1's, not flagged
    h.send("groupC")  # bucket 0 -> c3
    assert c1.labels == ["groupA1", "id11"]
    assert c1.firsts == ["groupA1"]
    assert (c2.labels, c2.firsts) == (["groupB1"], ["groupB1"])
    assert (c3.labels, c3.firsts) == (["groupC1"], ["groupC1"])
    assert h.queue.group_count() == 3
    listed = {g["group"]: g["consumer"] for g in h.queue.list_groups()}
    assert listed == {
        "_AMQ_GROUP_BUCKET_INT_KEY_2": "c1",
        "_AMQ_GROUP_BUCKET_INT_KEY_1": "c2",
        "_AMQ_GROUP_BUCKET_INT_KEY_0": "c3",
    }
    h.send("id1", -1)  # closes the whole bucket 2
    assert c1.labels[-1] == "id12"
    assert h.queue.group_count() == 2
    h.credit(c1, 0)
    h.send("groupA")  # bucket 2 binds afresh (cursor at c1, busy -> c2), flagged
    assert (c2.labels[-1], c2.firsts[-1]) == ("groupA2", "groupA2")
    assert h.queue.reset_group("grp1")  # grp1 is in bucket 2: resets it
    assert h.queue.group_count() == 2
    assert h.queue.reset_group("_AMQ_GROUP_BUCKET_INT_KEY_4")  # bucket 0
    assert {g["group"] for g in h.queue.list_groups()} == {"_AMQ_GROUP_BUCKET_INT_KEY_1"}


def test_buckets_zero_disables_grouping() -> None:
    h = Harness(QueuePolicy(group_buckets=0, group_first_key=FIRST))
    c1 = h.attach("c1", 10)
    c2 = h.attach("c2", 10)
    h.send_many("G", "G", "G")
    assert (c1.labels, c2.labels) == (["G1", "G3"], ["G2"])
    assert c1.firsts == c2.firsts == []
    assert h.queue.group_count() == 0


# ------------------------------------------------------------ exclusive (3.11)


def test_exclusive_queue_one_consumer_in_order_hand_over() -> None:
    h = Harness(QueuePolicy(exclusive=True, group_first_key=FIRST))
    c1 = h.attach("c1", 10)
    c2 = h.attach("c2", 10)
    h.send_many("G", "H", None, "G")
    assert c1.labels == ["G1", "H1", "u1", "G2"]
    assert c1.firsts == ["G1"]
    assert c2.labels == []
    assert h.queue.group_count() == 0
    assert h.queue.list_groups() == []
    c1.credit = 0  # busy: nothing goes to c2
    h.send(None)
    assert c2.labels == []
    h.detach(c1)
    assert c2.labels == ["G1", "H1", "u1", "G2", "u2"]
    assert c2.firsts == ["G1"]
    assert [d.entry.delivery_count for d in c2.deliveries] == [1, 1, 1, 1, 0]


def test_exclusive_queue_ignores_group_close() -> None:
    """3.11 / table 4: group ids are ignored on an exclusive queue, so a message with
    group-sequence -1 must not end the exclusive consumer's role."""
    h = Harness(QueuePolicy(exclusive=True))
    c1 = h.attach("c1", 10)
    c2 = h.attach("c2", 10)
    h.send("G")
    h.send("G", -1)
    h.send("G")
    h.send(None)
    assert c1.labels == ["G1", "G2", "G3", "u1"]
    assert c2.labels == []


def test_exclusive_first_message_with_close_sequence_binds() -> None:
    h = Harness(QueuePolicy(exclusive=True))
    c1 = h.attach("c1", 10)
    c2 = h.attach("c2", 10)
    h.send("G", -1)
    h.send(None)
    assert (c1.labels, c2.labels) == (["G1", "u1"], [])


# ----------------------------------------------------------- first-key (3.7)


def test_first_key_rules() -> None:
    h = Harness(QueuePolicy(group_first_key=FIRST))
    c1 = h.attach("c1", 10)
    c2 = h.attach("c2", 10)
    h.send("G")  # c1, flagged
    h.send(None)  # c2, never flagged
    h.send("G")  # c1, not flagged
    h.release(c1, "G1")  # redelivery to the same owner: not flagged
    assert [(d.label, d.first) for d in c1.deliveries] == [
        ("G1", True),
        ("G2", False),
        ("G1", False),
    ]
    assert c2.firsts == []
    h.queue.reset_group("G")
    h.send("G")  # cursor after c2 -> c1: flagged again after a reset
    assert c1.deliveries[-1].first
    h.detach(c1)  # its unsettled G2, G1, G3 move to c2, the first one flagged
    assert [(d.label, d.first) for d in c2.deliveries] == [
        ("u1", False),
        ("G1", True),
        ("G2", False),
        ("G3", False),
    ]


def test_no_first_flag_without_first_key() -> None:
    h = Harness()
    c1 = h.attach("c1", 10)
    h.send("G")
    assert c1.firsts == []


# ------------------------------------------------------------- rebalance (3.10)


def test_rebalance_clears_bindings_on_attach() -> None:
    """GroupingTest.testGroupRebalance: after consumer 3 is added, A, B, C bind to
    c1, c2, c3."""
    h = Harness(QueuePolicy(group_rebalance=True, group_first_key=FIRST))
    c1 = h.attach("c1", 10)
    c2 = h.attach("c2", 10)
    h.send_many("A", "B", "C")
    assert (c1.take(), c2.take()) == (["A1", "C1"], ["B1"])
    c3 = h.attach("c3", 10)
    assert h.queue.group_count() == 0
    h.send_many("A", "B", "C")
    assert (c1.labels, c2.labels, c3.labels) == (["A2"], ["B2"], ["C2"])
    assert (c1.firsts, c2.firsts, c3.firsts) == (["A2"], ["B2"], ["C2"])
    h.ack_all(c1)
    h.detach(c3)  # removal never rebalances: A and B stay; C2 comes back, binds afresh
    assert {g["group"]: g["consumer"] for g in h.queue.list_groups()} == {
        "A": "c1",
        "B": "c2",
        "C": "c1",
    }
    assert c1.labels == ["A2", "C2"]


def test_rebalance_pause_dispatch_waits_for_in_flight() -> None:
    """GroupingTest.testGroupRebalancePauseDispatch."""
    h = Harness(QueuePolicy(group_rebalance=True, group_rebalance_pause_dispatch=True))
    c1 = h.attach("c1", 10)
    c2 = h.attach("c2", 10)
    h.send_many("A", "B", "C")
    h.ack(c1, "A1")
    h.ack(c2, "B1")
    assert (c1.take(), c2.take()) == (["A1", "C1"], ["B1"])
    c3 = h.attach("c3", 10)
    assert not h.queue.dispatching
    assert h.queue.statistics()["dispatching"] is False
    h.send_many("A", "B", "C", None)
    h.credit(c2, 20)
    assert (c1.labels, c2.labels, c3.labels) == ([], [], [])
    h.ack(c1, "C1")
    assert h.queue.dispatching
    assert (c1.labels, c2.labels, c3.labels) == (["A2", "u1"], ["B2"], ["C2"])


def test_rebalance_pause_released_by_detach_of_the_holder() -> None:
    h = Harness(QueuePolicy(group_rebalance=True, group_rebalance_pause_dispatch=True))
    c1 = h.attach("c1", 10)
    h.send("A")
    c2 = h.attach("c2", 10)
    assert not h.queue.dispatching
    h.send("B")
    h.detach(c1)
    assert h.queue.dispatching
    assert c2.labels == ["A1", "B1"]


def test_rebalance_pause_dispatch_timeout(caplog: pytest.LogCaptureFixture) -> None:
    h = Harness(
        QueuePolicy(
            group_rebalance=True,
            group_rebalance_pause_dispatch=True,
            group_pause_dispatch_timeout=500,
        )
    )
    c1 = h.attach("c1", 10)
    h.send("A")
    c2 = h.attach("c2", 10)
    h.send_many("A", "B")
    h.advance(499)
    assert not h.queue.dispatching
    assert (c1.labels, c2.labels) == (["A1"], [])
    with caplog.at_level(logging.WARNING, logger="amqbroker.core.queue"):
        h.advance(1)
    assert h.queue.dispatching
    assert (c1.labels, c2.labels) == (["A1", "A2"], ["B1"])
    assert any("group_pause_dispatch_timeout" in r.getMessage() for r in caplog.records)


def test_rebalance_without_in_flight_does_not_pause() -> None:
    h = Harness(QueuePolicy(group_rebalance=True, group_rebalance_pause_dispatch=True))
    c1 = h.attach("c1", 10)
    h.send("A")
    h.ack(c1)
    c2 = h.attach("c2", 10)
    assert h.queue.dispatching
    h.send_many("A", "B")
    assert (c1.labels, c2.labels) == (["A1", "A2"], ["B1"])


# ------------------------------------------------- dispatch gates (3.12, D10)


def test_consumers_before_dispatch() -> None:
    h = Harness(QueuePolicy(consumers_before_dispatch=3))
    for _ in range(3):
        h.send_many("A", "B", "C")
    c1 = h.attach("c1", 10)
    c2 = h.attach("c2", 10)
    assert (c1.labels, c2.labels) == ([], [])
    assert not h.queue.dispatching
    c3 = h.attach("c3", 10)
    assert h.queue.dispatching
    assert c1.labels == ["A1", "A2", "A3"]
    assert c2.labels == ["B1", "B2", "B3"]
    assert c3.labels == ["C1", "C2", "C3"]


def test_attach_without_credit_defers_dispatch_so_gate_sees_its_credit() -> None:
    h = Harness(QueuePolicy(consumers_before_dispatch=3))
    h.send_many("A", "B", "C", "A", "B", "C")
    c1 = h.attach("c1", 10)
    c2 = h.attach("c2", 10)
    c3 = h.attach("c3", 0)  # the count is reached, but the dispatch waits ...
    assert (c1.labels, c2.labels) == ([], [])
    assert h.broker.statistics()["pending_dispatch"] == 1
    h.credit(c3, 10)  # ... for its flow, in the same input batch
    h.run_deferred()
    assert (c1.labels, c2.labels, c3.labels) == (["A1", "A2"], ["B1", "B2"], ["C1", "C2"])


def test_attach_without_credit_deferred_dispatch_still_runs() -> None:
    h = Harness(QueuePolicy(consumers_before_dispatch=2))
    h.send_many("A", "B")
    c1 = h.attach("c1", 10)
    h.attach("c2", 0)  # never gets credit
    assert c1.labels == []
    h.run_deferred()
    assert c1.labels == ["A1", "B1"]


def test_delay_before_dispatch_timer_opens_the_gate() -> None:
    h = Harness(QueuePolicy(consumers_before_dispatch=3, delay_before_dispatch=100))
    h.send_many("A", "B", "C")
    c1 = h.attach("c1", 10)
    h.advance(50)
    c2 = h.attach("c2", 10)
    h.advance(49)
    assert (c1.labels, c2.labels) == ([], [])
    h.advance(1)  # 100 ms after the first attach, no other event needed
    assert h.queue.dispatching
    assert (c1.labels, c2.labels) == (["A1", "C1"], ["B1"])


def test_gate_closes_when_last_consumer_leaves_and_rearms() -> None:
    h = Harness(QueuePolicy(consumers_before_dispatch=2, delay_before_dispatch=100))
    c1 = h.attach("c1", 10)
    c2 = h.attach("c2", 10)
    h.send("A")
    assert c1.labels == ["A1"]
    h.ack(c1)
    h.detach(c2)  # others remain: dispatch goes on
    h.send("A")
    assert c1.labels == ["A1", "A2"]
    h.ack(c1)
    h.detach(c1)
    assert not h.queue.dispatching
    h.advance(1000)
    h.send("B")
    c3 = h.attach("c3", 10)
    h.advance(99)
    assert c3.labels == []
    h.advance(1)
    assert c3.labels == ["B1"]


def test_delay_timer_cancelled_when_gate_opens_by_count() -> None:
    h = Harness(QueuePolicy(consumers_before_dispatch=2, delay_before_dispatch=100))
    h.send("A")
    c1 = h.attach("c1", 10)  # deadline t=100
    h.advance(10)
    c2 = h.attach("c2", 10)  # count reached: open, deadline cancelled
    assert c1.labels == ["A1"]
    h.ack(c1)
    h.advance(10)
    h.detach(c1)
    h.detach(c2)  # gate closed again
    h.advance(30)
    c3 = h.attach("c3", 10)  # a fresh wait: deadline t=150
    h.send("B")
    h.advance(50)  # t=100: the first deadline must not open the gate
    assert c3.labels == []
    assert not h.queue.dispatching
    h.advance(50)  # t=150
    assert c3.labels == ["B1"]


# ------------------------------------------------------------- management (6)


def test_reset_group_count_and_reset_all() -> None:
    """QueueControlTest.testResetGroups: 3 -> reset one -> 2 -> send -> 3 -> resetAll -> 0."""
    h = Harness()
    c1, c2, c3 = (h.attach(n, 10) for n in ("c1", "c2", "c3"))
    h.send_many("A", "B", "C")
    assert h.queue.group_count() == 3
    assert h.queue.reset_group("A") is True
    assert h.queue.group_count() == 2
    assert h.queue.reset_group("A") is False
    assert h.queue.reset_group("nope") is False
    h.send("A")
    assert h.queue.group_count() == 3
    assert c1.labels == ["A1", "A2"]  # the cursor was back at c1
    assert h.queue.reset_all_groups() == 3
    assert h.queue.group_count() == 0
    assert h.queue.list_groups() == []
    h.send_many("C", "B")  # the cursor is after c1 (A2)
    assert (c1.labels, c2.labels, c3.labels) == (["A1", "A2"], ["B1", "C2"], ["C1", "B2"])


def test_reset_group_moves_parked_messages_at_once() -> None:
    h = Harness(QueuePolicy(group_first_key=FIRST))
    c1 = h.attach("c1", 1)
    c2 = h.attach("c2", 10)
    h.send_many("A", "A", "A")
    assert (c1.labels, c2.labels) == (["A1"], [])
    assert h.queue.reset_group("A")
    assert (c2.labels, c2.firsts) == (["A2", "A3"], ["A2"])


def test_list_groups_fields() -> None:
    h = Harness()
    c1 = h.attach("c1", 1)
    c2 = h.attach("c2", 5)
    t_a = h.clock()
    h.send("A")
    h.advance(10)
    h.send_many("A", "A", "B")
    assert c1.labels == ["A1"]
    by = {g["group"]: g for g in h.queue.list_groups()}
    assert by["A"] == {
        "group": "A",
        "consumer": "c1",
        "connection": "conn-c1",
        "container": "container-c1",
        "bound_since": t_a,
        "backlog": 2,
        "in_flight": 1,
        "blocked": True,
        "stuck": False,
    }
    assert (by["B"]["consumer"], by["B"]["backlog"], by["B"]["in_flight"]) == ("c2", 0, 1)
    assert by["B"]["blocked"] is False
    assert by["B"]["bound_since"] == h.clock()
    _ = c2


# --------------------------------------------------------- dispatch batch (Broker)


def test_dispatch_batch_continues_through_run_deferred() -> None:
    h = Harness(QueuePolicy(dispatch_batch=3))
    c = h.attach("c", 0)
    for _ in range(8):
        h.send(None)
    h.credit(c, 100)
    assert c.labels == ["u1", "u2", "u3"]
    assert h.broker.statistics()["pending_dispatch"] == 1
    assert h.broker.wakes >= 1
    assert h.broker.run_deferred() is True
    assert len(c.labels) == 6
    assert h.broker.run_deferred() is False
    assert c.labels == [f"u{i}" for i in range(1, 9)]
    assert h.broker.statistics()["pending_dispatch"] == 0


def test_dispatch_batch_with_groups_keeps_group_order() -> None:
    h = Harness(QueuePolicy(dispatch_batch=2))
    c1 = h.attach("c1", 1, filter=lambda e: label(e).startswith("G"))
    c2 = h.attach("c2", 0)
    h.send("G")
    for _ in range(3):
        h.send_many("G", None, "H")
    # G2 was parked on arrival (its owner c1 had no credit), so the main order
    # starts at u1: batch u1, H1 -> c2
    assert h.queue.n_main == 8
    h.credit(c2, 100)
    assert (c1.labels, c2.labels) == (["G1"], ["u1", "H1"])
    h.credit(c1, 100)  # G2 from the parked group, then a batch: G3 -> c1, u2 -> c2
    assert (c1.labels, c2.labels) == (["G1", "G2", "G3"], ["u1", "H1", "u2"])
    rounds = 0
    while h.broker.run_deferred():  # H2, G4; then u3, H3 (the last call)
        rounds += 1
    assert rounds == 1
    assert c1.labels == ["G1", "G2", "G3", "G4"]
    assert c2.labels == ["u1", "H1", "u2", "H2", "u3", "H3"]
    assert h.queue.count == 10


# ------------------------------------------------------- statistics / accounting


def test_statistics() -> None:
    h = _dlq_harness(10)
    c1 = h.attach("c1", 2)
    c2 = h.attach("c2", 0, filter=lambda e: not label(e).startswith("x"))
    h.send_many("A", "A")
    h.send("A", expiry=h.expiry_in(10))
    h.send_many("A", "B")
    h.send(tag="x1")
    h.credit(c2, 2)  # A3, A4 parked for c1; B1 -> c2; x1: c2 refuses it -> unmatched
    h.ack(c1, "A1")
    h.reject(c1, "A2")
    h.advance(20)
    assert h.queue.expire_scan() == 1  # A3
    st = h.queue.statistics()
    # time-dependent telemetry figures, checked on their own
    assert st.pop("group_owner_changes") == 2
    assert st.pop("group_blocked_seconds") == pytest.approx(0.02, abs=0.005)
    assert st == {
        "messages": 3,
        "bytes": 6,
        "consumers": 2,
        "in_flight": 1,
        "enqueued": 6,
        "acknowledged": 1,
        "expired": 1,
        "dead_lettered": 1,
        "groups": 2,
        "blocked_groups": 1,
        "stuck_groups": 0,
        "stuck_messages": 0,
        "unmatched": 1,
        "delayed": 0,
        "scheduled": 0,
        "dispatching": True,
        "paged_messages": 0,
        "paged_bytes": 0,
    }


def test_counters_return_to_zero_after_everything_settles() -> None:
    h = Harness(QueuePolicy(redelivery_delay=10, group_first_key=FIRST))
    c1 = h.attach("c1", 3)
    c2 = h.attach("c2", 2)
    for i in range(20):
        h.send(["A", "B", None, "C"][i % 4], -1 if i == 13 else 0)
    h.release(c1, failed=True)
    h.release(c2)
    h.detach(c1)
    h.advance(10)
    c3 = h.attach("c3", 100)
    for c in (c2, c3):
        h.credit(c, 100)
    assert h.queue.inflight == len(c2.unsettled) + len(c3.unsettled)
    h.ack_all(c2)
    h.ack_all(c3)
    h.assert_empty()
    assert h.queue.acked == 20
    assert h.queue.address is not None
    assert h.queue.address.size == 0
    st = h.queue.statistics()
    assert (st["messages"], st["in_flight"], st["blocked_groups"]) == (0, 0, 0)


def test_presettled_consumer_never_holds_in_flight() -> None:
    h = Harness()
    c = h.attach("c", 10, presettled=True)
    h.send_many("G", None, "G")
    assert c.labels == ["G1", "u1", "G2"]
    h.assert_empty()
    assert h.queue.acked == 3


# ------------------------------------------------------------ scaling (not timed)


def _blocked_groups_setup(n: int, *, unmatched: bool) -> Harness:
    """Consumer a owns `n` groups, each with one parked message (a has no credit);
    consumer b is free. With `unmatched`, one message that nobody accepts waits too."""
    h = Harness()
    a = h.attach("a", 0)
    b = h.attach("b", 0, filter=(lambda e: label(e) != "x1") if unmatched else None)
    h.credit(a, n)
    for i in range(n):
        h.send(f"g{i}.")
    for i in range(n):
        h.send(f"g{i}.")
    if unmatched:
        h.send(tag="x1")
    h.credit(b, 1)
    h.send(None)
    assert b.take() == ["u1"]
    st = h.queue.statistics()
    assert (st["groups"], st["blocked_groups"]) == (n, n)
    assert st["unmatched"] == (1 if unmatched else 0)
    return h


def _lines_per_delivery(h: Harness, rounds: int = 40) -> float:
    """Work (core source lines executed) per message delivered to b, while messages
    for the blocked groups, ungrouped messages and new groups arrive and b gets credit
    one flow at a time."""
    b = next(c for c in h.queue.consumers() if c.name == "b")
    assert isinstance(b, FakeConsumer)
    n0 = len(b.deliveries)
    with count_core_lines() as ops:
        for i in range(rounds):
            h.send(None)
            h.send(f"g{i}.")  # joins a blocked group's parked messages
            h.send(f"new{i}")
            h.credit(b, 2)
    delivered = len(b.deliveries) - n0
    assert delivered == 2 * rounds
    return ops.lines / delivered


def test_dispatch_cost_per_message_independent_of_blocked_groups() -> None:
    small = _lines_per_delivery(_blocked_groups_setup(10, unmatched=False))
    large = _lines_per_delivery(_blocked_groups_setup(10_000, unmatched=False))
    assert large <= small * 1.1 + 5, (small, large)


def test_serving_parked_groups_cost_independent_of_their_number() -> None:
    def per_message(n: int) -> float:
        h = _blocked_groups_setup(n, unmatched=False)
        a = next(c for c in h.queue.consumers() if c.name == "a")
        with count_core_lines() as ops:
            for _ in range(40):
                a.credit = 1
                h.queue.credit_changed(a)
        assert h.queue.statistics()["blocked_groups"] == n - 40
        return ops.lines / 40

    small, large = per_message(50), per_message(10_000)
    assert large <= small * 1.1 + 5, (small, large)


def test_dispatch_cost_per_message_independent_of_groups_with_an_unmatched_message() -> None:
    """One message no consumer accepts (a selector matching nothing is common) must not
    make every flow frame cost O(number of groups)."""
    small = _lines_per_delivery(_blocked_groups_setup(10, unmatched=True))
    large = _lines_per_delivery(_blocked_groups_setup(10_000, unmatched=True))
    assert large <= small * 1.1 + 5, (small, large)


def test_reset_all_groups_cost_per_blocked_group_is_constant() -> None:
    """A rebalance (every attach with group_rebalance) or resetAllGroups puts each
    blocked group's parked messages back in the main order. That must cost O(1) per
    message, also when newer messages wait in the main order (every consumer busy)."""

    def per_group(n: int) -> float:
        h = Harness(QueuePolicy(group_rebalance=True))
        a = h.attach("a", n)
        b = h.attach("b", 0)
        for i in range(n):
            h.send(f"g{i}.")  # n groups bound to a, which has no credit left
        h.send(None)
        for i in range(n):
            h.send(f"g{i}.")
        h.credit(b, 1)  # u1 -> b, then the pass parks the groups' messages for a
        assert h.queue.statistics()["blocked_groups"] == n
        for _ in range(n):
            h.send(None)  # newer messages in the main order: every consumer is busy
        with count_core_lines() as ops:
            h.attach("c", 0)  # rebalance: every group unbound
        assert h.queue.group_count() == 0
        assert len(a.labels) == n
        return ops.lines / n

    small, large = per_group(100), per_group(1000)
    assert large <= small * 1.2 + 5, (small, large)
