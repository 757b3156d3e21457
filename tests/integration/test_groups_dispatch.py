"""Group dispatch over real sockets (issue 3, GROUPING.md sections 1, 3.3-3.6).

Every test attaches several receivers (on one or more connections) and asserts which
receiver got which message, in which order. Consumers are chosen by rule R
(GROUPING 3.4): priority first, then round robin in attach order; the rotation pointer
moves past the chosen consumer after an ungrouped delivery or a new binding, and is
reset to the first consumer on any attach/detach.
"""

from __future__ import annotations

from typing import Any

import pytest
from proton import Message

from amqbroker.app import BrokerApp
from tests.conftest import BrokerFactory, ClientFactory
from tests.integration.groups_helpers import CLOSE, assert_idle, msg, take, take_all

# --------------------------------------------------------------------------- owners


async def test_groups_stick_to_one_owner_in_queue_order(
    broker: BrokerApp, client: ClientFactory, autojump_clock: Any
) -> None:
    c1 = await client(broker)
    c2 = await client(broker)
    r1 = await c1.receiver("q", credit=50)
    r2 = await c2.receiver("q", credit=50)
    r3 = await c1.receiver("q", credit=50)
    s = await c2.sender("q")
    sent = [msg(f"{g}{i}", g) for i in range(4) for g in "ABC"]
    await s.send_many(sent)
    assert await take(r1, 4) == ["A0", "A1", "A2", "A3"]
    assert await take(r2, 4) == ["B0", "B1", "B2", "B3"]
    assert await take(r3, 4) == ["C0", "C1", "C2", "C3"]
    # a later burst still goes to the same owners, whatever the rotation pointer says
    await s.send_many([msg("C4", "C"), msg("A4", "A"), msg("C5", "C"), msg("B4", "B")])
    assert await take(r1, 1) == ["A4"]
    assert await take(r2, 1) == ["B4"]
    assert await take(r3, 2) == ["C4", "C5"]
    for r in (r1, r2, r3):
        await r.expect_none(0.2)
    assert broker.broker is not None
    assert broker.broker.queues["q"].group_count() == 3
    await assert_idle(broker, c1, c2)


async def test_ungrouped_messages_round_robin_between_groups(
    broker: BrokerApp, client: ClientFactory, autojump_clock: Any
) -> None:
    c1 = await client(broker)
    c2 = await client(broker)
    r1 = await c1.receiver("q", credit=50)
    r2 = await c2.receiver("q", credit=50)
    s = await c1.sender("q")
    # A binds r1 (pointer -> r2), U1 r2 (-> r1), U2 r1 (-> r2), B binds r2 (-> r1), U3 r1
    await s.send_many(
        [msg("A1", "A"), msg("U1"), msg("U2"), msg("A2", "A"), msg("B1", "B"), msg("U3")]
    )
    assert await take(r1, 4) == ["A1", "U2", "A2", "U3"]
    assert await take(r2, 2) == ["U1", "B1"]
    await assert_idle(broker, c1, c2)


# ----------------------------------------------------------- group id and sequence


async def test_empty_string_is_a_group_id(
    broker: BrokerApp, client: ClientFactory, autojump_clock: Any
) -> None:
    c = await client(broker)
    r1 = await c.receiver("q", credit=10)
    r2 = await c.receiver("q", credit=10)
    s = await c.sender("q")
    # grouped: both "" messages to r1; as ungrouped they would alternate r1, r2, r1, r2
    await s.send_many([msg("E1", ""), msg("E2", ""), msg("U1"), msg("U2")])
    assert await take(r1, 3) == ["E1", "E2", "U2"]
    assert await take(r2, 1) == ["U1"]
    assert broker.broker is not None
    assert [g["group"] for g in broker.broker.queues["q"].list_groups()] == [""]


@pytest.mark.parametrize("prop", ["JMSXGroupID", "_AMQ_GROUP_ID"])
async def test_group_id_from_application_property_fallback(
    broker: BrokerApp, client: ClientFactory, autojump_clock: Any, prop: str
) -> None:
    c = await client(broker)
    r1 = await c.receiver("q", credit=10)
    r2 = await c.receiver("q", credit=10)
    s = await c.sender("q")
    # grouped: G,G -> r1 and H,H -> r2; round robin would give r1 G1,H1 and r2 G2,H2
    await s.send_many([Message(body=b, properties={prop: b[0]}) for b in ("G1", "G2", "H1", "H2")])
    assert await take(r1, 2) == ["G1", "G2"]
    assert await take(r2, 2) == ["H1", "H2"]
    assert broker.broker is not None
    assert broker.broker.queues["q"].group_count() == 2


async def test_group_id_precedence(
    broker: BrokerApp, client: ClientFactory, autojump_clock: Any
) -> None:
    """properties.group-id beats JMSXGroupID, which beats _AMQ_GROUP_ID."""
    c = await client(broker)
    r1 = await c.receiver("q", credit=20)
    r2 = await c.receiver("q", credit=20)
    s = await c.sender("q")
    await s.send_many(
        [
            msg("X1", "X", JMSXGroupID="Y"),  # group X -> r1
            msg("Y1", JMSXGroupID="Y"),  # group Y (new) -> r2
            msg("X2", "X"),  # X -> r1
            msg("Y2", JMSXGroupID="Y", _AMQ_GROUP_ID="X"),  # Y -> r2
            msg("Z1", _AMQ_GROUP_ID="Z"),  # new group Z -> r1
            msg("Y3", JMSXGroupID="Y", _AMQ_GROUP_ID="Z"),  # Y -> r2
            msg("Z2", "Z", JMSXGroupID="Y"),  # Z -> r1
        ]
    )
    assert await take(r1, 4) == ["X1", "X2", "Z1", "Z2"]
    assert await take(r2, 3) == ["Y1", "Y2", "Y3"]
    await r1.expect_none(0.2)
    await r2.expect_none(0.2)


async def test_non_string_application_group_id_is_ignored(
    broker: BrokerApp, client: ClientFactory, autojump_clock: Any
) -> None:
    c = await client(broker)
    r1 = await c.receiver("q", credit=10)
    r2 = await c.receiver("q", credit=10)
    s = await c.sender("q")
    await s.send_many([msg(f"m{i}", JMSXGroupID=7, _AMQ_GROUP_ID=8) for i in range(4)])
    assert await take(r1, 2) == ["m0", "m2"]
    assert await take(r2, 2) == ["m1", "m3"]
    assert broker.broker is not None
    assert broker.broker.queues["q"].group_count() == 0


async def test_application_property_fallback_can_be_switched_off(
    make_broker: BrokerFactory, client: ClientFactory, autojump_clock: Any
) -> None:
    app = await make_broker(
        address_settings={"strict.#": {"group_id_from_application_properties": False}}
    )
    c = await client(app)
    r1 = await c.receiver("strict.q", credit=20)
    r2 = await c.receiver("strict.q", credit=20)
    s = await c.sender("strict.q")
    # JMSXGroupID / _AMQ_GROUP_ID are ordinary properties now: plain round robin
    await s.send_many(
        [
            msg("j1", JMSXGroupID="G"),
            msg("j2", JMSXGroupID="G"),
            msg("a1", _AMQ_GROUP_ID="G"),
            msg("a2", _AMQ_GROUP_ID="G"),
        ]
    )
    assert await take(r1, 2) == ["j1", "a1"]
    assert await take(r2, 2) == ["j2", "a2"]
    # properties.group-id still groups
    await s.send_many([msg("P1", "P"), msg("P2", "P"), msg("P3", "P"), msg("P4", "P")])
    assert await take(r1, 4) == ["P1", "P2", "P3", "P4"]
    await r2.expect_none(0.2)
    assert app.broker is not None
    assert app.broker.queues["strict.q"].group_count() == 1
    # an address the pattern does not match keeps the default (fallback on)
    r3 = await c.receiver("other.q", credit=20)
    r4 = await c.receiver("other.q", credit=20)
    s2 = await c.sender("other.q")
    await s2.send_many([msg("j1", JMSXGroupID="G"), msg("j2", JMSXGroupID="G")])
    assert await take(r3, 2) == ["j1", "j2"]
    await r4.expect_none(0.2)
    await assert_idle(app, c)


def _close_message(body: str, how: str) -> Message:
    if how == "group-sequence":
        return msg(body, "G", CLOSE)
    if how == "JMSXGroupSeq":
        return msg(body, JMSXGroupID="G", JMSXGroupSeq=-1)
    assert how == "_AMQ_GROUP_SEQUENCE"
    return msg(body, _AMQ_GROUP_ID="G", _AMQ_GROUP_SEQUENCE=-1)


def _plain_message(body: str, how: str) -> Message:
    if how == "group-sequence":
        return msg(body, "G")
    if how == "JMSXGroupSeq":
        return msg(body, JMSXGroupID="G")
    return msg(body, _AMQ_GROUP_ID="G")


@pytest.mark.parametrize("how", ["group-sequence", "JMSXGroupSeq", "_AMQ_GROUP_SEQUENCE"])
async def test_sequence_minus_one_closes_group_and_rebinds_round_robin(
    broker: BrokerApp, client: ClientFactory, autojump_clock: Any, how: str
) -> None:
    """Artemis JMSMessageGroupsTest.testGroupSeqCloseGroup: c1, then c2, then c3."""
    c1 = await client(broker)
    c2 = await client(broker)
    rs = [
        await c1.receiver("q", credit=50),
        await c2.receiver("q", credit=50),
        await c1.receiver("q", credit=50),
    ]
    s = await c2.sender("q")
    assert broker.broker is not None
    q = broker.broker.queues["q"]
    for n, r in enumerate(rs):
        await s.send(_plain_message(f"b{n}-1", how))
        assert q.group_count() == 1
        await s.send_many([_plain_message(f"b{n}-2", how), _close_message(f"b{n}-3", how)])
        got = await take_all(r, 3)
        assert [g.body for g in got] == [f"b{n}-1", f"b{n}-2", f"b{n}-3"]
        assert q.group_count() == 0
        for other in rs:
            await other.expect_none(0.1)
    if how == "group-sequence":
        # the closing message keeps its group fields: uint 4294967295 on the wire
        await s.send_many([msg("x1", "G"), msg("x2", "G", CLOSE)])
        got = await take_all(rs[0], 2)
        assert [(g.body, g.message.group_sequence) for g in got] == [("x1", 0), ("x2", CLOSE)]
    await assert_idle(broker, c1, c2)


@pytest.mark.parametrize("seq", [1, 2, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFE])
async def test_other_sequence_values_do_not_change_the_binding(
    broker: BrokerApp, client: ClientFactory, autojump_clock: Any, seq: int
) -> None:
    c = await client(broker)
    r1 = await c.receiver("q", credit=20)
    r2 = await c.receiver("q", credit=20)
    s = await c.sender("q")
    await s.send(msg("G1", "G"))
    await s.send_many([msg("G2", "G", seq), msg("G3", "G", seq), msg("G4", "G")])
    assert await take(r1, 4) == ["G1", "G2", "G3", "G4"]
    await r2.expect_none(0.2)
    assert broker.broker is not None
    assert broker.broker.queues["q"].group_count() == 1


async def test_close_message_of_unbound_group_creates_no_binding(
    broker: BrokerApp, client: ClientFactory, autojump_clock: Any
) -> None:
    c = await client(broker)
    r1 = await c.receiver("q", credit=20)
    r2 = await c.receiver("q", credit=20)
    s = await c.sender("q")
    assert broker.broker is not None
    q = broker.broker.queues["q"]
    await s.send(msg("G-close", "G", CLOSE))  # chosen like any message: r1, no binding
    assert q.group_count() == 0
    await s.send_many([msg("G1", "G"), msg("G2", "G")])  # fresh binding: next in rotation
    assert await take(r1, 1) == ["G-close"]
    assert await take(r2, 2) == ["G1", "G2"]
    assert q.group_count() == 1


# ------------------------------------------------------------ choosing an owner


async def test_new_groups_go_to_highest_priority_consumers_first(
    broker: BrokerApp, client: ClientFactory, autojump_clock: Any
) -> None:
    c1 = await client(broker)
    c2 = await client(broker)
    lo = await c1.receiver("q", credit=20, priority=0)
    hi1 = await c2.receiver("q", credit=2, priority=5)
    hi2 = await c1.receiver("q", credit=2, priority=5)
    s = await c2.sender("q")
    await s.send_many([msg("A1", "A"), msg("B1", "B"), msg("C1", "C"), msg("D1", "D")])
    assert await take(hi1, 2) == ["A1", "C1"]
    assert await take(hi2, 2) == ["B1", "D1"]
    await lo.expect_none(0.2)
    # both high-priority consumers are out of credit: a new group falls to priority 0,
    # but a bound group waits for its (high-priority) owner
    await s.send_many([msg("E1", "E"), msg("A2", "A"), msg("E2", "E")])
    assert await take(lo, 2) == ["E1", "E2"]
    await hi1.expect_none(0.2)
    hi1.flow(1)
    assert await take(hi1, 1) == ["A2"]
    await lo.expect_none(0.2)
    await assert_idle(broker, c1, c2)


async def test_new_groups_skip_consumers_without_credit(
    broker: BrokerApp, client: ClientFactory, autojump_clock: Any
) -> None:
    c1 = await client(broker)
    c2 = await client(broker)
    r1 = await c1.receiver("q", credit=0)
    r2 = await c2.receiver("q", credit=20)
    r3 = await c1.receiver("q", credit=20)
    s = await c2.sender("q")
    await s.send_many([msg("A1", "A"), msg("B1", "B"), msg("C1", "C")])
    assert await take(r2, 2) == ["A1", "C1"]
    assert await take(r3, 1) == ["B1"]
    await r1.expect_none(0.2)
    # r1 gets credit: the rotation continues after C's owner r2 -> r3, r1, r2
    r1.flow(20)
    await r1.expect_none(0.2)  # credit alone moves no bound group
    await s.send_many([msg("D1", "D"), msg("E1", "E"), msg("F1", "F"), msg("A2", "A")])
    assert await take(r3, 1) == ["D1"]
    assert await take(r1, 1) == ["E1"]
    assert await take(r2, 2) == ["F1", "A2"]


@pytest.mark.parametrize(
    ("policy", "expect_r1", "expect_r2"),
    [
        ("round-robin", ["A1", "U1", "C1"], ["B1", "U2", "B-close"]),
        ("least-loaded", ["A1", "U1"], ["B1", "U2", "B-close", "C1"]),
    ],
)
async def test_group_owner_policy(
    make_broker: BrokerFactory,
    client: ClientFactory,
    autojump_clock: Any,
    policy: str,
    expect_r1: list[str],
    expect_r2: list[str],
) -> None:
    """After B closes, r1 owns one group and r2 none; the rotation points at r1.
    Round robin gives the new group C to r1, least-loaded to r2."""
    app = await make_broker(address_settings={"#": {"group_owner_policy": policy}})
    c1 = await client(app)
    c2 = await client(app)
    r1 = await c1.receiver("q", credit=20)
    r2 = await c2.receiver("q", credit=20)
    s = await c1.sender("q")
    for m in [
        msg("A1", "A"),
        msg("B1", "B"),
        msg("U1"),
        msg("U2"),
        msg("B-close", "B", CLOSE),
        msg("C1", "C"),
    ]:
        await s.send(m)
    assert await take(r1, len(expect_r1)) == expect_r1
    assert await take(r2, len(expect_r2)) == expect_r2
    await r1.expect_none(0.2)
    await r2.expect_none(0.2)
    await assert_idle(app, c1, c2)


# ----------------------------------------------------------- head-of-line blocking


async def test_busy_owner_does_not_block_other_groups_or_ungrouped(
    broker: BrokerApp, client: ClientFactory, autojump_clock: Any
) -> None:
    c1 = await client(broker)
    c2 = await client(broker)
    r1 = await c1.receiver("q", credit=1)
    r2 = await c2.receiver("q", credit=50)
    s = await c2.sender("q")
    await s.send(msg("A1", "A"))
    assert await take(r1, 1) == ["A1"]  # r1 owns A and has no credit left
    await s.send_many(
        [msg("A2", "A"), msg("A3", "A"), msg("U1"), msg("U2"), msg("B1", "B"), msg("B2", "B")]
    )
    assert await take(r2, 4) == ["U1", "U2", "B1", "B2"]
    await s.send_many([msg("A4", "A"), msg("U3")])
    assert await take(r2, 1) == ["U3"]
    await r1.expect_none(0.2)
    r1.flow(10)
    assert await take(r1, 3) == ["A2", "A3", "A4"]
    await r2.expect_none(0.2)
    await assert_idle(broker, c1, c2)


async def test_strict_setting_reproduces_artemis_head_of_line_blocking(
    make_broker: BrokerFactory, client: ClientFactory, autojump_clock: Any
) -> None:
    app = await make_broker(address_settings={"#": {"group_skip_ahead": False}})
    c1 = await client(app)
    c2 = await client(app)
    r1 = await c1.receiver("q", credit=1)
    r2 = await c2.receiver("q", credit=50)
    s = await c2.sender("q")
    await s.send(msg("A1", "A"))
    assert await take(r1, 1) == ["A1"]
    await s.send_many(
        [msg("A2", "A"), msg("A3", "A"), msg("U1"), msg("U2"), msg("B1", "B"), msg("B2", "B")]
    )
    await r2.expect_none(1.0)  # nothing behind the blocked A2 moves
    r1.flow(2)
    assert await take(r1, 2) == ["A2", "A3"]
    assert await take(r2, 4) == ["U1", "U2", "B1", "B2"]
    await assert_idle(app, c1, c2)


@pytest.mark.parametrize("skip_ahead", [True, False])
async def test_artemis_manual_head_of_line_case(
    make_broker: BrokerFactory, client: ClientFactory, autojump_clock: Any, skip_ahead: bool
) -> None:
    """A few grouped messages for a consumer without credit at the head, ungrouped
    messages behind them (the Artemis manual's FIFO caveat, at small scale)."""
    app = await make_broker(address_settings={"#": {"group_skip_ahead": skip_ahead}})
    c1 = await client(app)
    c2 = await client(app)
    slow = await c1.receiver("hol", credit=1)
    fast = await c2.receiver("hol", credit=100)
    s = await c1.sender("hol")
    await s.send(msg("G1", "G"))
    assert await take(slow, 1) == ["G1"]
    await s.send_many([msg(f"G{i}", "G") for i in range(2, 6)])
    await s.send_many([msg(f"u{i}") for i in range(20)])
    if skip_ahead:
        assert await take(fast, 20) == [f"u{i}" for i in range(20)]
    else:
        await fast.expect_none(1.0)
    slow.flow(4)
    assert await take(slow, 4) == ["G2", "G3", "G4", "G5"]
    if not skip_ahead:
        assert await take(fast, 20) == [f"u{i}" for i in range(20)]
    await slow.expect_none(0.2)
    await fast.expect_none(0.2)
    await assert_idle(app, c1, c2)


async def test_drain_completes_when_only_other_owners_messages_wait(
    broker: BrokerApp, client: ClientFactory, autojump_clock: Any
) -> None:
    c1 = await client(broker)
    c2 = await client(broker)
    r1 = await c1.receiver("q", credit=1)
    r2 = await c2.receiver("q", credit=0)
    s = await c1.sender("q")
    await s.send_many([msg("A1", "A"), msg("A2", "A"), msg("A3", "A")])
    assert await take(r1, 1) == ["A1"]
    r2.flow(5)
    await r2.drain()  # A2, A3 belong to r1: the drain must still complete
    assert r2.credit == 0
    await r2.expect_none(0.2)
    r1.flow(5)
    assert await take(r1, 2) == ["A2", "A3"]


async def test_relay_takes_the_fallback_setting_of_each_destination(
    make_broker: BrokerFactory, client: ClientFactory, autojump_clock: Any
) -> None:
    """The anonymous relay (no address at attach) used to group every message by its
    JMSXGroupID application property, whatever the destination's settings said
    (issue 21): the setting is now resolved per message, from its `to`."""
    app = await make_broker(
        address_settings={"strict.#": {"group_id_from_application_properties": False}}
    )
    c = await client(app)
    r1 = await c.receiver("strict.q", credit=20)
    r2 = await c.receiver("strict.q", credit=20)
    r3 = await c.receiver("other.q", credit=20)
    r4 = await c.receiver("other.q", credit=20)
    relay = await c.sender(None)
    out = []
    for to in ("strict.q", "other.q"):
        for body in ("j1", "j2"):
            m = msg(body, JMSXGroupID="G")
            m.address = to
            out.append(m)
    await relay.send_many(out)
    assert await take(r1, 1) == ["j1"]  # strict: round robin, no group
    assert await take(r2, 1) == ["j2"]
    assert await take(r3, 2) == ["j1", "j2"]  # default: grouped by JMSXGroupID
    await r4.expect_none(0.2)
    assert app.broker is not None
    assert app.broker.queues["strict.q"].group_count() == 0
    assert app.broker.queues["other.q"].group_count() == 1
    await assert_idle(app, c)
