"""Group bindings over their lifetime, over real sockets (issue 3; GROUPING.md 3.7-3.9,
3.11, D5, D13): owner leaving (detach, connection close, crash), released / modified
messages, redelivery delay, group-first-key, exclusive queues, stuck groups.

Rotation rule R (GROUPING 3.4) decides every new owner here: priority, then round robin
in attach order; the pointer moves past the chosen consumer after an ungrouped delivery
or a new binding and goes back to the first consumer on any attach/detach.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import trio
from proton import Message

from amqbroker.app import BrokerApp
from tests.conftest import BrokerFactory, ClientFactory
from tests.integration.groups_helpers import (
    CLOSE,
    FIRST,
    assert_idle,
    msg,
    stats,
    summary,
    take,
    until,
)

# ------------------------------------------------------------- owner leaves (C-1/C-2)


@pytest.mark.parametrize("how", ["detach", "connection-close", "crash"])
async def test_owner_leaving_returns_unsettled_first_then_group_moves(
    broker: BrokerApp, client: ClientFactory, autojump_clock: Any, how: str
) -> None:
    c1, c2, c3 = await client(broker), await client(broker), await client(broker)
    r1 = await c1.receiver("q", credit=3)
    r2 = await c2.receiver("q", credit=20)
    r3 = await c3.receiver("q", credit=20)
    s = await c3.sender("q")
    await s.send_many([msg("A1", "A"), msg("B1", "B"), msg("A2", "A"), msg("A3", "A")])
    await s.send_many([msg("A4", "A"), msg("A5", "A")])  # r1 has no credit left: they wait
    held = await r1.receive_n(3)  # never settled
    assert [g.body for g in held] == ["A1", "A2", "A3"]
    assert await take(r2, 1) == ["B1"]
    await r3.expect_none(0.2)
    if how == "detach":
        await r1.close()
    elif how == "connection-close":
        await c1.close()
    else:
        c1.abort()
    # rotation restarts at the first consumer (r2): it gets the returned messages first,
    # in order, then the ones that were waiting. Delivery-count (GROUPING 3.8, Artemis):
    # a clean detach/close returns them uncounted, a lost connection counts a failure.
    got = await r2.receive_n(5)
    for g in got:
        r2.accept(g)
    n = 1 if how == "crash" else 0
    assert [(g.body, g.message.delivery_count) for g in got] == [
        ("A1", n),
        ("A2", n),
        ("A3", n),
        ("A4", 0),
        ("A5", 0),
    ]
    await s.send(msg("A6", "A"))
    assert await take(r2, 1) == ["A6"]
    await r3.expect_none(0.2)
    assert stats(broker, "q")["groups"] == 2
    await assert_idle(broker, c1, c2, c3)


async def test_new_owner_with_little_credit_still_gets_returned_messages_first(
    broker: BrokerApp, client: ClientFactory, autojump_clock: Any
) -> None:
    c1, c2 = await client(broker), await client(broker)
    r1 = await c1.receiver("q", credit=2)
    r2 = await c2.receiver("q", credit=3)
    r3 = await c1.receiver("q", credit=20)
    s = await c2.sender("q")
    await s.send_many([msg("A1", "A"), msg("B1", "B"), msg("A2", "A"), msg("A3", "A")])
    held = await r1.receive_n(2)
    assert [g.body for g in held] == ["A1", "A2"]
    assert await take(r2, 1) == ["B1"]  # r2 keeps 2 credits
    await r1.close()  # returns A1, A2 (A3 was waiting for r1's credit)
    got = await r2.receive_n(2)
    assert [(g.body, g.message.delivery_count) for g in got] == [("A1", 0), ("A2", 0)]
    # r2 (A's new owner) is out of credit: later A messages wait for it, even with r3 idle
    await s.send_many([msg("A4", "A"), msg("U1")])
    assert await take(r3, 1) == ["U1"]
    await r3.expect_none(0.2)
    r2.flow(10)
    assert await take(r2, 2) == ["A3", "A4"]
    for g in got:
        r2.accept(g)
    await assert_idle(broker, c1, c2)


# ------------------------------------------------------ released / modified messages


async def test_released_messages_go_back_to_the_same_owner(
    broker: BrokerApp, client: ClientFactory, autojump_clock: Any
) -> None:
    c1, c2 = await client(broker), await client(broker)
    r1 = await c1.receiver("q", credit=20)
    r2 = await c2.receiver("q", credit=20)
    s = await c2.sender("q")
    await s.send_many([msg("A1", "A"), msg("B1", "B"), msg("A2", "A"), msg("A3", "A")])
    first = await r1.receive_n(3)
    assert [g.body for g in first] == ["A1", "A2", "A3"]
    assert await take(r2, 1) == ["B1"]
    r1.release(first[0])
    r1.release(first[1])
    again = await r1.receive_n(2)
    assert [(g.body, g.message.delivery_count) for g in again] == [("A1", 0), ("A2", 0)]
    await s.send(msg("A4", "A"))
    assert await take(r1, 1) == ["A4"]
    await r2.expect_none(0.2)
    for g in [*again, first[2]]:
        r1.accept(g)
    await assert_idle(broker, c1, c2)


async def test_returned_messages_are_redelivered_in_group_order(
    broker: BrokerApp, client: ClientFactory, autojump_clock: Any
) -> None:
    """Settled out of order while the owner has no credit: they come back in queue
    order, before the group's later messages, and only to the owner."""
    c1, c2 = await client(broker), await client(broker)
    r1 = await c1.receiver("q", credit=3)
    r2 = await c2.receiver("q", credit=20)
    s = await c2.sender("q")
    await s.send_many([msg("A1", "A"), msg("A2", "A"), msg("A3", "A"), msg("A4", "A")])
    first = await r1.receive_n(3)
    r1.release(first[2])
    r1.modify(first[1], failed=True)
    r1.release(first[0])
    await s.send(msg("A5", "A"))
    await r2.expect_none(0.5)
    await r1.expect_none(0.1)
    r1.flow(10)
    got = await r1.receive_n(5)
    for g in got:
        r1.accept(g)
    assert [(g.body, g.message.delivery_count) for g in got] == [
        ("A1", 0),
        ("A2", 1),
        ("A3", 0),
        ("A4", 0),
        ("A5", 0),
    ]
    await r2.expect_none(0.2)
    await assert_idle(broker, c1, c2)


async def test_modified_delivery_failed_counts_and_dead_letters_then_group_continues(
    make_broker: BrokerFactory, client: ClientFactory, autojump_clock: Any
) -> None:
    app = await make_broker(address_settings={"#": {"max_delivery_attempts": 3}})
    c1, c2 = await client(app), await client(app)
    r1 = await c1.receiver("q", credit=20)
    r2 = await c2.receiver("q", credit=20)
    s = await c2.sender("q")
    await s.send(msg("A1", "A"))
    counts = []
    for _ in range(3):
        g = await r1.receive()
        assert g.body == "A1"
        counts.append(g.message.delivery_count)
        r1.modify(g, failed=True)
    assert counts == [0, 1, 2]
    # the third failure reached max-delivery-attempts: A1 is gone, A keeps its owner
    await s.send_many([msg("A2", "A"), msg("U1")])
    assert await take(r1, 1) == ["A2"]
    assert await take(r2, 1) == ["U1"]
    await r1.expect_none(0.2)
    assert stats(app, "q")["dead_lettered"] == 1
    await assert_idle(app, c1, c2)


# ------------------------------------------------------------------ redelivery delay


async def test_redelivery_delay_holds_the_whole_group_only(
    make_broker: BrokerFactory, client: ClientFactory, autojump_clock: Any
) -> None:
    app = await make_broker(address_settings={"#": {"redelivery_delay": 1000}})
    c1, c2 = await client(app), await client(app)
    r1 = await c1.receiver("q", credit=20)
    r2 = await c2.receiver("q", credit=20)
    s = await c2.sender("q")
    await s.send_many([msg("A1", "A"), msg("B1", "B")])
    a1 = await r1.receive()
    assert await take(r2, 1) == ["B1"]
    t0 = trio.current_time()
    r1.modify(a1, failed=True)
    await until(app, "q", "delayed", 1)
    await s.send_many([msg("A2", "A"), msg("B2", "B"), msg("U1")])
    assert await take(r2, 1) == ["B2"]  # other groups do not wait
    assert await take(r1, 1) == ["U1"]  # nor do ungrouped messages, even for A's owner
    await r1.expect_none(0.9)  # A2 must not overtake the delayed A1
    got = await r1.receive_n(2)
    elapsed = trio.current_time() - t0
    assert [(g.body, g.message.delivery_count) for g in got] == [("A1", 1), ("A2", 0)]
    assert 1.0 <= elapsed < 1.5
    for g in got:
        r1.accept(g)
    await r2.expect_none(0.2)
    await assert_idle(app, c1, c2)


async def test_redelivery_delay_keeps_group_order_when_the_owner_leaves(
    make_broker: BrokerFactory, client: ClientFactory, autojump_clock: Any
) -> None:
    app = await make_broker(address_settings={"#": {"redelivery_delay": 1000}})
    c1, c2 = await client(app), await client(app)
    r1 = await c1.receiver("q", credit=20)
    r2 = await c2.receiver("q", credit=20)
    s = await c2.sender("q")
    await s.send(msg("A1", "A"))
    a1 = await r1.receive()
    r1.modify(a1, failed=True)
    await r1.close()
    await s.send_many([msg("A2", "A"), msg("A3", "A")])
    await r2.expect_none(0.9)  # A2, A3 wait for the delayed A1
    got = await r2.receive_n(3)
    assert [(g.body, g.message.delivery_count) for g in got] == [
        ("A1", 1),
        ("A2", 0),
        ("A3", 0),
    ]
    for g in got:
        r2.accept(g)
    await assert_idle(app, c1, c2)


# -------------------------------------------------------------------- group-first-key


async def test_first_key_marks_the_first_message_of_each_new_binding(
    make_broker: BrokerFactory, client: ClientFactory, autojump_clock: Any
) -> None:
    app = await make_broker(address_settings={"#": {"default_group_first_key": FIRST}})
    c1, c2 = await client(app), await client(app)
    r1 = await c1.receiver("q", credit=50)
    r2 = await c2.receiver("q", credit=50)
    s = await c1.sender("q")
    sent = [
        msg("A1", "A", colour="red"),  # new binding -> r1, flagged
        msg("A2", "A"),  # r1
        msg("B1", "B", n=7),  # new binding -> r2, flagged
        msg("U1", colour="blue"),  # ungrouped -> r1, never flagged
        msg("A3", "A", CLOSE),  # closing message -> r1, not flagged
        msg("A4", "A"),  # A binds afresh -> r2, flagged
        msg("X-close", "X", CLOSE),  # closes an unbound group -> r1, no binding, no flag
        msg("X1", "X"),  # new binding -> r2, flagged
        msg("B2", "B"),  # r2
    ]
    for m in sent:
        await s.send(m)
    got1 = await r1.receive_n(5)
    got2 = await r2.receive_n(4)
    assert summary(got1) == [
        ("A1", 0, True),
        ("A2", 0, False),
        ("U1", 0, False),
        ("A3", 0, False),
        ("X-close", 0, False),
    ]
    assert summary(got2) == [
        ("B1", 0, True),
        ("A4", 0, True),
        ("X1", 0, True),
        ("B2", 0, False),
    ]
    # nothing else of the message changes: unflagged deliveries are byte-identical to
    # what was sent; flagged ones differ only by the added application property
    by_body = {m.body: m for m in sent}
    for g in got1 + got2:
        original = by_body[g.body]
        if FIRST not in g.properties:
            assert bytes(g.raw) == bytes(original.encode()), g.body
            continue
        copy = Message()
        copy.decode(g.raw)
        props: dict[str, Any] = dict(copy.properties or {})
        assert props.pop(FIRST) is True
        assert list(props) == list(original.properties or {})  # appended, order kept
        copy.properties = props or None  # type: ignore[assignment]
        expected = Message()
        expected.decode(original.encode())
        assert bytes(copy.encode()) == bytes(expected.encode()), g.body
        assert (copy.body, copy.group_id, copy.group_sequence) == (
            original.body,
            original.group_id,
            original.group_sequence,
        )
    for g in got1:
        r1.accept(g)
    for g in got2:
        r2.accept(g)
    await assert_idle(app, c1, c2)


async def test_first_key_not_added_on_redelivery_to_the_same_owner(
    make_broker: BrokerFactory, client: ClientFactory, autojump_clock: Any
) -> None:
    app = await make_broker(address_settings={"#": {"default_group_first_key": FIRST}})
    c1, c2 = await client(app), await client(app)
    r1 = await c1.receiver("q", credit=20)
    r2 = await c2.receiver("q", credit=20)
    s = await c2.sender("q")
    await s.send_many([msg("A1", "A"), msg("A2", "A")])
    got = await r1.receive_n(2)
    assert summary(got) == [("A1", 0, True), ("A2", 0, False)]
    r1.release(got[0])
    again = await r1.receive()
    assert summary([again]) == [("A1", 0, False)]
    r1.modify(again, failed=True)
    again = await r1.receive()
    assert summary([again]) == [("A1", 1, False)]
    r1.accept(again)
    r1.accept(got[1])
    await r2.expect_none(0.2)
    await assert_idle(app, c1, c2)


async def test_first_key_added_again_when_the_group_moves_to_a_new_owner(
    make_broker: BrokerFactory, client: ClientFactory, autojump_clock: Any
) -> None:
    app = await make_broker(address_settings={"#": {"default_group_first_key": FIRST}})
    c1, c2 = await client(app), await client(app)
    r1 = await c1.receiver("q", credit=20)
    r2 = await c2.receiver("q", credit=20)
    s = await c2.sender("q")
    await s.send_many([msg("A1", "A"), msg("A2", "A")])
    got = await r1.receive_n(2)
    assert summary(got) == [("A1", 0, True), ("A2", 0, False)]
    c1.abort()
    moved = await r2.receive_n(2)
    assert summary(moved) == [("A1", 1, True), ("A2", 1, False)]
    for g in moved:
        r2.accept(g)
    await assert_idle(app, c1, c2)


# ------------------------------------------------------------------- exclusive queues


async def test_exclusive_queue_one_consumer_group_ids_ignored_in_order_hand_over(
    make_broker: BrokerFactory, client: ClientFactory, autojump_clock: Any
) -> None:
    app = await make_broker(
        address_settings={
            "ex.#": {"default_exclusive_queue": True, "default_group_first_key": FIRST}
        }
    )
    c1, c2 = await client(app), await client(app)
    r1 = await c1.receiver("ex.q", credit=3)
    r2 = await c2.receiver("ex.q", credit=20)
    s = await c2.sender("ex.q")
    await s.send_many(
        [msg("A1", "A"), msg("B1", "B"), msg("U1"), msg("A2", "A"), msg("U2"), msg("C1", "C")]
    )
    got = await r1.receive_n(3)
    assert summary(got) == [("A1", 0, True), ("B1", 0, False), ("U1", 0, False)]
    # r1 is out of credit: everything waits for it although r2 has credit
    await r2.expect_none(0.5)
    assert stats(app, "ex.q")["groups"] == 0
    r1.accept(got[0])
    await r1.close()  # B1, U1 unsettled: back first (uncounted), then r2 takes over
    moved = await r2.receive_n(5)
    assert summary(moved) == [
        ("B1", 0, True),
        ("U1", 0, False),
        ("A2", 0, False),
        ("U2", 0, False),
        ("C1", 0, False),
    ]
    for g in moved:
        r2.accept(g)
    await s.send_many([msg("B2", "B"), msg("U3")])
    assert await take(r2, 2) == ["B2", "U3"]
    await assert_idle(app, c1, c2)


async def test_exclusive_queue_from_address_string(
    broker: BrokerApp, client: ClientFactory, autojump_clock: Any
) -> None:
    c1, c2 = await client(broker), await client(broker)
    r1 = await c1.receiver("exq?exclusive=true", credit=10)
    r2 = await c2.receiver("exq", credit=10)
    s = await c2.sender("exq")
    await s.send_many([msg("A1", "A"), msg("B1", "B"), msg("U1"), msg("U2")])
    assert await take(r1, 4) == ["A1", "B1", "U1", "U2"]
    await r2.expect_none(0.2)
    await assert_idle(broker, c1, c2)


# ---------------------------------------------------------------------- stuck groups


def _stuck_lines(caplog: pytest.LogCaptureFixture, group: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING
        and r.name.startswith("amqbroker")
        and f"group {group!r}" in r.getMessage()
    ]


async def test_undeliverable_here_from_owner_leaves_group_stuck_and_reported(
    broker: BrokerApp,
    client: ClientFactory,
    autojump_clock: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    c1, c2 = await client(broker), await client(broker)
    r1 = await c1.receiver("q", credit=20)
    r2 = await c2.receiver("q", credit=20)
    s = await c2.sender("q")
    await s.send_many([msg("A1", "A"), msg("B1", "B")])
    a1 = await r1.receive()
    assert await take(r2, 1) == ["B1"]
    r1.modify(a1, failed=False, undeliverable=True)
    await until(broker, "q", "stuck_groups", 1)
    await s.send_many([msg("A2", "A"), msg("B2", "B"), msg("U1")])
    assert await take(r2, 1) == ["B2"]  # other groups keep flowing
    assert await take(r1, 1) == ["U1"]  # ungrouped too, even to the stuck group's owner
    await r1.expect_none(0.5)  # A1 refused by its owner, nobody else may take it
    await r2.expect_none(0.1)
    st = stats(broker, "q")
    assert (st["stuck_groups"], st["stuck_messages"]) == (1, 1)
    # more messages and more dispatch passes: still one log line for the group
    await s.send_many([msg("A3", "A"), msg("A4", "A")])
    r1.flow(5)
    await r1.expect_none(0.3)
    assert len(_stuck_lines(caplog, "A")) == 1, _stuck_lines(caplog, "A")
    assert stats(broker, "q")["stuck_groups"] == 1
    # the owner leaves: the group moves and its messages flow again, in order
    await r1.close()
    got = await r2.receive_n(4)
    assert [(g.body, g.message.delivery_count) for g in got] == [
        ("A1", 0),
        ("A2", 0),
        ("A3", 0),
        ("A4", 0),
    ]
    for g in got:
        r2.accept(g)
    assert stats(broker, "q")["stuck_groups"] == 0
    await assert_idle(broker, c1, c2)


async def test_unbind_on_undeliverable_moves_the_group(
    make_broker: BrokerFactory, client: ClientFactory, autojump_clock: Any
) -> None:
    app = await make_broker(
        address_settings={
            "#": {"group_unbind_on_undeliverable": True, "default_group_first_key": FIRST}
        }
    )
    c1, c2 = await client(app), await client(app)
    r1 = await c1.receiver("q", credit=1)
    r2 = await c2.receiver("q", credit=20)
    s = await c2.sender("q")
    await s.send_many([msg("A1", "A"), msg("A2", "A")])
    a1 = await r1.receive()
    assert summary([a1]) == [("A1", 0, True)]
    r1.modify(a1, failed=False, undeliverable=True)
    got = await r2.receive_n(2)
    assert summary(got) == [("A1", 0, True), ("A2", 0, False)]
    for g in got:
        r2.accept(g)
    r1.flow(5)
    await s.send(msg("A3", "A"))
    assert await take(r2, 1) == ["A3"]
    await r1.expect_none(0.2)
    st = stats(app, "q")
    assert (st["stuck_groups"], st["groups"]) == (0, 1)
    await assert_idle(app, c1, c2)


async def test_owner_filter_that_cannot_match_leaves_group_stuck(
    broker: BrokerApp,
    client: ClientFactory,
    autojump_clock: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The protocol layer does not parse selectors yet: the owner's filter is set on the
    core consumer (the filter slot a selector fills), everything else is on the wire."""
    caplog.set_level(logging.WARNING)
    c1, c2 = await client(broker), await client(broker)
    r1 = await c1.receiver("q", credit=20, name="owner")
    r2 = await c2.receiver("q", credit=20, name="other")
    s = await c2.sender("q")
    await s.send(msg("A1", "A"))
    assert await take(r1, 1) == ["A1"]
    assert broker.broker is not None
    q = broker.broker.queues["q"]
    (owner,) = [c for c in q.consumers() if c.name == "owner"]
    owner.filter = lambda e: e.group_id != "A"
    await s.send_many([msg("A2", "A"), msg("A3", "A"), msg("B1", "B")])
    assert await take(r2, 1) == ["B1"]
    await r1.expect_none(0.3)
    await r2.expect_none(0.1)
    st = q.statistics()
    assert (st["stuck_groups"], st["stuck_messages"]) == (1, 1)
    assert len(_stuck_lines(caplog, "A")) == 1
    owner.filter = None
    await r1.close()
    assert await take(r2, 2) == ["A2", "A3"]
    assert q.statistics()["stuck_groups"] == 0
    await assert_idle(broker, c1, c2)
