"""Per-queue group settings over real sockets (issue 3; GROUPING.md sections 2, 3.2,
3.10, 3.12, D10): group-buckets, group-rebalance(-pause-dispatch), consumers-before-
dispatch, delay-before-dispatch and the ActiveMQ Classic aliases, and every setting
configured three ways: an exact address-setting pattern, a wildcard pattern, and the
address string of the link that auto-creates the queue (`q?group-buckets=2`).

Rotation rule R (GROUPING 3.4) decides every owner: priority, then round robin in attach
order; the pointer moves past the chosen consumer after an ungrouped delivery or a new
binding and goes back to the first consumer on any attach/detach.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio

from amqbroker.app import BrokerApp
from tests.client import Client, Receiver
from tests.conftest import BrokerFactory, ClientFactory
from tests.integration.groups_helpers import (
    BUCKET,
    FIRST,
    assert_idle,
    flags,
    msg,
    queue_of,
    take,
    until,
)

# ----------------------------------------------------------------------- group-buckets


async def test_buckets_default_one_entry_per_group(
    broker: BrokerApp, client: ClientFactory, autojump_clock: Any
) -> None:
    c1, c2 = await client(broker), await client(broker)
    rs = [await c1.receiver("q", credit=20), await c2.receiver("q", credit=20)]
    rs.append(await c1.receiver("q", credit=20))
    s = await c2.sender("q")
    # groupA, grp1 and id1 share a bucket for N=4; here each id is its own group
    ids = ["groupA", "groupB", "groupC", "grp1", "id1"]
    await s.send_many([msg(f"{g}-1", g) for g in ids] + [msg(f"{g}-2", g) for g in ids])
    assert await take(rs[0], 4) == ["groupA-1", "grp1-1", "groupA-2", "grp1-2"]
    assert await take(rs[1], 4) == ["groupB-1", "id1-1", "groupB-2", "id1-2"]
    assert await take(rs[2], 2) == ["groupC-1", "groupC-2"]
    q = queue_of(broker, "q")
    assert q.group_count() == 5
    assert sorted(g["group"] for g in q.list_groups()) == sorted(ids)
    await assert_idle(broker, c1, c2)


async def test_buckets_zero_turns_grouping_off(
    make_broker: BrokerFactory, client: ClientFactory, autojump_clock: Any
) -> None:
    app = await make_broker(
        address_settings={"#": {"default_group_buckets": 0, "default_group_first_key": FIRST}}
    )
    c1, c2 = await client(app), await client(app)
    r1 = await c1.receiver("q", credit=20)
    r2 = await c2.receiver("q", credit=20)
    s = await c1.sender("q")
    await s.send_many([msg(f"A{i}", "A") for i in range(4)] + [msg("B0", "B")])
    got1 = await r1.receive_n(3)
    got2 = await r2.receive_n(2)
    assert flags(got1) == [("A0", False), ("A2", False), ("B0", False)]
    assert flags(got2) == [("A1", False), ("A3", False)]
    # the group fields still reach the consumer untouched
    assert [g.group_id for g in got1 + got2] == ["A", "A", "B", "A", "A"]
    assert queue_of(app, "q").group_count() == 0
    for g in got1:
        r1.accept(g)
    for g in got2:
        r2.accept(g)
    await assert_idle(app, c1, c2)


# GROUPING.md 3.2 test vectors: id -> bucket for N = 2, 3, 4, 16, 1024
VECTORS = {
    "groupA": {2: 0, 3: 0, 4: 2, 16: 2, 1024: 978},
    "groupB": {2: 1, 3: 1, 4: 1, 16: 1, 1024: 1009},
    "groupC": {2: 0, 3: 2, 4: 0, 16: 0, 1024: 16},
    "grp1": {2: 0, 3: 1, 4: 2, 16: 6, 1024: 6},
    "id1": {2: 0, 3: 0, 4: 2, 16: 2, 1024: 66},
    "Group-0": {2: 0, 3: 1, 4: 2, 16: 6, 1024: 470},
    "": {2: 0, 3: 0, 4: 0, 16: 0, 1024: 0},
}


@pytest.mark.parametrize("n", [2, 3, 4, 16, 1024])
async def test_buckets_n_groups_in_one_bucket_share_an_owner(
    make_broker: BrokerFactory, client: ClientFactory, autojump_clock: Any, n: int
) -> None:
    app = await make_broker(
        address_settings={"#": {"default_group_buckets": n, "default_group_first_key": FIRST}}
    )
    c1, c2 = await client(app), await client(app)
    rs = [
        await c1.receiver("q", credit=50),
        await c2.receiver("q", credit=50),
        await c1.receiver("q", credit=50),
    ]
    s = await c2.sender("q")
    ids = list(VECTORS)
    await s.send_many([msg(f"{g}|1", g) for g in ids] + [msg(f"{g}|2", g) for g in ids])
    # expected: each newly seen bucket goes to the next consumer in rotation; the first
    # message of a bucket (not of each group) carries the first-key flag
    owner_of: dict[int, int] = {}
    expected: list[list[tuple[str, bool]]] = [[], [], []]
    for rnd in (1, 2):
        for g in ids:
            b = VECTORS[g][n]
            first = b not in owner_of
            if first:
                owner_of[b] = len(owner_of) % 3
            expected[owner_of[b]].append((f"{g}|{rnd}", first))
    for r, exp in zip(rs, expected, strict=True):
        got = await r.receive_n(len(exp))
        for d in got:
            r.accept(d)
        assert flags(got) == exp
        await r.expect_none(0.1)
    q = queue_of(app, "q")
    assert q.group_count() == len(owner_of)
    assert sorted(g["group"] for g in q.list_groups()) == sorted(f"{BUCKET}{b}" for b in owner_of)
    await assert_idle(app, c1, c2)


# --------------------------------------------------------------------- group-rebalance


@pytest.mark.parametrize("rebalance", [True, False])
async def test_group_rebalance_when_a_consumer_joins(
    make_broker: BrokerFactory, client: ClientFactory, autojump_clock: Any, rebalance: bool
) -> None:
    """Artemis GroupingTest.testGroupRebalance: after consumer 3 joins, A, B, C bind to
    c1, c2, c3. Without rebalance the bindings survive the new consumer."""
    app = await make_broker(
        address_settings={
            "#": {"default_group_rebalance": rebalance, "default_group_first_key": FIRST}
        }
    )
    c1, c2 = await client(app), await client(app)
    r1 = await c1.receiver("q", credit=50)
    r2 = await c2.receiver("q", credit=50)
    s = await c1.sender("q")
    await s.send_many([msg("A1", "A"), msg("B1", "B"), msg("C1", "C")])
    assert flags(await r1.receive_n(2)) == [("A1", True), ("C1", True)]
    assert flags(await r2.receive_n(1)) == [("B1", True)]
    r3 = await c2.receiver("q", credit=50)
    await s.send_many([msg("A2", "A"), msg("B2", "B"), msg("C2", "C")])
    if rebalance:
        assert flags(await r1.receive_n(1)) == [("A2", True)]
        assert flags(await r2.receive_n(1)) == [("B2", True)]
        assert flags(await r3.receive_n(1)) == [("C2", True)]
    else:
        assert flags(await r1.receive_n(2)) == [("A2", False), ("C2", False)]
        assert flags(await r2.receive_n(1)) == [("B2", False)]
        await r3.expect_none(0.2)
    assert queue_of(app, "q").group_count() == 3


@pytest.mark.parametrize("pause", [True, False])
async def test_group_rebalance_pause_dispatch(
    make_broker: BrokerFactory, client: ClientFactory, autojump_clock: Any, pause: bool
) -> None:
    """Artemis GroupingTest.testGroupRebalancePauseDispatch: c1 holds a C message
    unsettled when consumer 3 joins; nothing is dispatched until c1 settles it, then
    A -> c1, B -> c2, C -> c3. Without pause-dispatch C2 reaches c3 at once, while C1
    is still unsettled at c1."""
    app = await make_broker(
        address_settings={
            "#": {
                "default_group_rebalance": True,
                "default_group_rebalance_pause_dispatch": pause,
            }
        }
    )
    c1, c2, c3 = await client(app), await client(app), await client(app)
    r1 = await c1.receiver("q", credit=50)
    r2 = await c2.receiver("q", credit=50)
    s = await c3.sender("q")
    await s.send_many([msg("A1", "A"), msg("B1", "B"), msg("C1", "C")])
    a1, c1_msg = await r1.receive_n(2)
    assert (a1.body, c1_msg.body) == ("A1", "C1")
    assert await take(r2, 1) == ["B1"]
    r1.accept(a1)
    await until(app, "q", "in_flight", 1)  # only C1 is still in flight
    r3 = await c3.receiver("q", credit=50)
    await s.send_many([msg("A2", "A"), msg("B2", "B"), msg("C2", "C"), msg("U1")])
    if pause:
        for r in (r1, r2, r3):
            await r.expect_none(0.3)
        assert queue_of(app, "q").statistics()["dispatching"] is False
        r1.accept(c1_msg)
        assert await take(r1, 2) == ["A2", "U1"]
        assert await take(r2, 1) == ["B2"]
        assert await take(r3, 1) == ["C2"]
        assert queue_of(app, "q").statistics()["dispatching"] is True
    else:
        assert await take(r1, 2) == ["A2", "U1"]
        assert await take(r2, 1) == ["B2"]
        assert await take(r3, 1) == ["C2"]
        r1.accept(c1_msg)
    await assert_idle(app, c1, c2, c3)


# ------------------------------------------------- consumers/delay-before-dispatch


async def test_consumers_before_dispatch(
    make_broker: BrokerFactory, client: ClientFactory, autojump_clock: Any
) -> None:
    """The groups spread over all three consumers instead of going to the first one
    (the purpose of the setting, GROUPING 3.12; Classic MessageGroupDelayedTest). The
    third receiver's credit travels in the same write as its attach, as with every
    AMQP client."""
    app = await make_broker(address_settings={"#": {"default_consumers_before_dispatch": 3}})
    c1, c2 = await client(app), await client(app)
    s = await c1.sender("q")
    await s.send_many([msg(f"{g}{i}", g) for i in (1, 2) for g in "ABC"])
    r1 = await c1.receiver("q", credit=50)
    await r1.expect_none(0.5)
    r2 = await c2.receiver("q", credit=50)
    await r1.expect_none(0.5)
    await r2.expect_none(0.1)
    r3 = await c1.receiver("q", credit=50)
    assert await take(r1, 2) == ["A1", "A2"]
    assert await take(r2, 2) == ["B1", "B2"]
    assert await take(r3, 2) == ["C1", "C2"]
    await assert_idle(app, c1, c2)


async def test_dispatch_gate_closes_again_when_the_last_consumer_leaves(
    make_broker: BrokerFactory, client: ClientFactory, autojump_clock: Any
) -> None:
    app = await make_broker(address_settings={"#": {"default_consumers_before_dispatch": 2}})
    c1, c2 = await client(app), await client(app)
    s = await c1.sender("q")
    r1 = await c1.receiver("q", credit=50)
    r2 = await c2.receiver("q", credit=50)
    await s.send_many([msg("A1", "A"), msg("B1", "B")])
    assert await take(r1, 1) == ["A1"]
    assert await take(r2, 1) == ["B1"]
    await r2.close()  # one consumer left: dispatch goes on
    await s.send(msg("B2", "B"))
    assert await take(r1, 1) == ["B2"]
    await r1.close()  # the last one left: the gate applies afresh
    await s.send_many([msg("A3", "A"), msg("B3", "B")])
    r3 = await c2.receiver("q", credit=50)
    await r3.expect_none(0.5)
    r4 = await c1.receiver("q", credit=0)  # opens the gate; only r3 can take anything
    assert await take(r3, 2) == ["A3", "B3"]
    r4.flow(10)
    await r4.expect_none(0.2)
    await assert_idle(app, c1, c2)


async def test_delay_before_dispatch_starts_dispatch_without_enough_consumers(
    make_broker: BrokerFactory, client: ClientFactory, autojump_clock: Any
) -> None:
    app = await make_broker(
        address_settings={
            "#": {"default_consumers_before_dispatch": 3, "default_delay_before_dispatch": 2000}
        }
    )
    c1, c2 = await client(app), await client(app)
    s = await c1.sender("q")
    await s.send_many([msg(f"{g}{i}", g) for i in (1, 2) for g in "ABC"])
    t0 = trio.current_time()
    r1 = await c1.receiver("q", credit=50)
    r2 = await c2.receiver("q", credit=50)
    await r1.expect_none(1.9)  # timer driven: nothing else happens meanwhile
    await r2.expect_none(0.0)
    assert await take(r1, 4) == ["A1", "C1", "A2", "C2"]
    assert await take(r2, 2) == ["B1", "B2"]
    assert 2.0 <= trio.current_time() - t0 < 2.5
    await assert_idle(app, c1, c2)


async def test_classic_alias_consumers_before_dispatch_starts(
    broker: BrokerApp, client: ClientFactory, autojump_clock: Any
) -> None:
    """consumersBeforeDispatchStarts with timeBeforeDispatchStarts: the count is reached
    before the time, dispatch starts when the second consumer attaches."""
    c1, c2 = await client(broker), await client(broker)
    r1 = await c1.receiver("cq?consumersBeforeDispatchStarts=2&timeBeforeDispatchStarts=5000")
    q = queue_of(broker, "cq")
    assert (q.policy.consumers_before_dispatch, q.policy.delay_before_dispatch) == (2, 5000)
    s = await c2.sender("cq")
    await s.send_many([msg("A1", "A"), msg("B1", "B"), msg("A2", "A")])
    r1.flow(50)
    await r1.expect_none(3.0)
    r2 = await c2.receiver("cq", credit=0)  # the second consumer opens the gate
    assert await take(r1, 3) == ["A1", "B1", "A2"]
    r2.flow(10)
    await r2.expect_none(0.2)
    await assert_idle(broker, c1, c2)


async def test_classic_alias_implicit_delay_of_one_second(
    broker: BrokerApp, client: ClientFactory, autojump_clock: Any
) -> None:
    """consumersBeforeDispatchStarts alone: Classic's implicit 1000 ms applies (D10)."""
    c1, c2 = await client(broker), await client(broker)
    t0 = trio.current_time()
    r1 = await c1.receiver("cq1?consumersBeforeDispatchStarts=2", credit=50)
    q = queue_of(broker, "cq1")
    assert (q.policy.consumers_before_dispatch, q.policy.delay_before_dispatch) == (2, 1000)
    s = await c2.sender("cq1")
    await s.send_many([msg("A1", "A"), msg("B1", "B")])
    await r1.expect_none(0.9)
    assert await take(r1, 2) == ["A1", "B1"]
    assert 1.0 <= trio.current_time() - t0 < 1.5
    await assert_idle(broker, c1, c2)


async def test_classic_alias_time_before_dispatch_starts(
    broker: BrokerApp, client: ClientFactory, autojump_clock: Any
) -> None:
    c1, c2 = await client(broker), await client(broker)
    t0 = trio.current_time()
    r1 = await c1.receiver("cq2?timeBeforeDispatchStarts=1500&consumersBeforeDispatchStarts=3")
    q = queue_of(broker, "cq2")
    assert (q.policy.consumers_before_dispatch, q.policy.delay_before_dispatch) == (3, 1500)
    r1.flow(50)
    s = await c2.sender("cq2")
    await s.send_many([msg("A1", "A"), msg("B1", "B")])
    await r1.expect_none(1.4)
    assert await take(r1, 2) == ["A1", "B1"]
    assert 1.5 <= trio.current_time() - t0 < 2.0
    await assert_idle(broker, c1, c2)


# ------------------------------------------------- every setting, three ways


Scenario = Callable[[BrokerApp, ClientFactory, str, str], Awaitable[None]]


async def _open(
    app: BrokerApp, client: ClientFactory, first: str, name: str, n: int = 2
) -> tuple[list[Client], Any, list[Receiver]]:
    """A sender on `first` (it creates the queue: with the string way it carries the
    options), then n receivers alternately on the plain name and on `first`."""
    cs = [await client(app), await client(app)]
    s = await cs[0].sender(first)
    rs = [await cs[i % 2].receiver(name if i % 2 == 0 else first, credit=50) for i in range(n)]
    return cs, s, rs


async def scenario_buckets(app: BrokerApp, client: ClientFactory, first: str, name: str) -> None:
    cs, s, (r1, r2) = await _open(app, client, first, name)
    # N=2: groupA and groupC share bucket 0 (default -1 would give groupC to r2)
    await s.send_many([msg("a", "groupA"), msg("c", "groupC"), msg("b", "groupB")])
    assert await take(r1, 2) == ["a", "c"]
    assert await take(r2, 1) == ["b"]
    assert queue_of(app, name).group_count() == 2
    await assert_idle(app, *cs)


async def scenario_buckets_off(
    app: BrokerApp, client: ClientFactory, first: str, name: str
) -> None:
    cs, s, (r1, r2) = await _open(app, client, first, name)
    await s.send_many([msg(f"A{i}", "A") for i in range(4)])
    assert await take(r1, 2) == ["A0", "A2"]
    assert await take(r2, 2) == ["A1", "A3"]
    assert queue_of(app, name).group_count() == 0
    await assert_idle(app, *cs)


async def scenario_rebalance(app: BrokerApp, client: ClientFactory, first: str, name: str) -> None:
    cs, s, (r1, r2) = await _open(app, client, first, name)
    await s.send_many([msg("A1", "A"), msg("B1", "B"), msg("C1", "C")])
    assert await take(r1, 2) == ["A1", "C1"]
    assert await take(r2, 1) == ["B1"]
    r3 = await cs[1].receiver(name, credit=50)
    await s.send_many([msg("A2", "A"), msg("B2", "B"), msg("C2", "C")])
    assert await take(r1, 1) == ["A2"]
    assert await take(r2, 1) == ["B2"]
    assert await take(r3, 1) == ["C2"]
    await assert_idle(app, *cs)


async def scenario_pause(app: BrokerApp, client: ClientFactory, first: str, name: str) -> None:
    cs, s, (r1, r2) = await _open(app, client, first, name)
    await s.send_many([msg("A1", "A"), msg("B1", "B")])
    a1 = await r1.receive()
    assert await take(r2, 1) == ["B1"]
    r3 = await cs[1].receiver(name, credit=50)
    await s.send_many([msg("A2", "A"), msg("B2", "B"), msg("C2", "C")])
    for r in (r1, r2, r3):
        await r.expect_none(0.2)
    r1.accept(a1)
    assert await take(r1, 1) == ["A2"]
    assert await take(r2, 1) == ["B2"]
    assert await take(r3, 1) == ["C2"]
    await assert_idle(app, *cs)


async def scenario_first_key(app: BrokerApp, client: ClientFactory, first: str, name: str) -> None:
    cs, s, (r1, r2) = await _open(app, client, first, name)
    await s.send_many([msg("A1", "A"), msg("A2", "A"), msg("B1", "B")])
    got = await r1.receive_n(2)
    assert flags(got, "FK") == [("A1", True), ("A2", False)]
    assert flags(await r2.receive_n(1), "FK") == [("B1", True)]
    for g in got:
        r1.accept(g)
    await assert_idle(app, *cs)


async def scenario_exclusive(app: BrokerApp, client: ClientFactory, first: str, name: str) -> None:
    cs, s, (r1, r2) = await _open(app, client, first, name)
    await s.send_many([msg("A1", "A"), msg("B1", "B"), msg("U1")])
    assert await take(r1, 3) == ["A1", "B1", "U1"]
    await r2.expect_none(0.2)
    await assert_idle(app, *cs)


async def scenario_consumers_before(
    app: BrokerApp, client: ClientFactory, first: str, name: str
) -> None:
    cs, s, (r1,) = await _open(app, client, first, name, n=1)
    await s.send_many([msg("A1", "A"), msg("B1", "B")])
    await r1.expect_none(0.5)
    await cs[1].receiver(first, credit=0)  # the second consumer opens the gate
    assert await take(r1, 2) == ["A1", "B1"]
    await assert_idle(app, *cs)


async def scenario_delay_before(
    app: BrokerApp, client: ClientFactory, first: str, name: str
) -> None:
    t0 = trio.current_time()
    cs, s, (r1,) = await _open(app, client, first, name, n=1)
    await s.send_many([msg("A1", "A"), msg("B1", "B")])
    await r1.expect_none(0.9)
    assert await take(r1, 2) == ["A1", "B1"]
    assert 1.0 <= trio.current_time() - t0 < 1.5
    await assert_idle(app, *cs)


# setting -> (address-setting defaults, address-string options, behaviour check)
SETTINGS: dict[str, tuple[dict[str, Any], str, Scenario]] = {
    "group-buckets": ({"default_group_buckets": 2}, "group-buckets=2", scenario_buckets),
    "group-buckets-0": ({"default_group_buckets": 0}, "group-buckets=0", scenario_buckets_off),
    "group-rebalance": (
        {"default_group_rebalance": True},
        "group-rebalance=true",
        scenario_rebalance,
    ),
    "group-rebalance-pause-dispatch": (
        {"default_group_rebalance": True, "default_group_rebalance_pause_dispatch": True},
        "group-rebalance=true&group-rebalance-pause-dispatch=true",
        scenario_pause,
    ),
    "group-first-key": (
        {"default_group_first_key": "FK"},
        "group-first-key=FK",
        scenario_first_key,
    ),
    "exclusive": ({"default_exclusive_queue": True}, "exclusive=true", scenario_exclusive),
    "consumers-before-dispatch": (
        {"default_consumers_before_dispatch": 2},
        "consumers-before-dispatch=2",
        scenario_consumers_before,
    ),
    "delay-before-dispatch": (
        {"default_consumers_before_dispatch": 5, "default_delay_before_dispatch": 1000},
        "consumers-before-dispatch=5&delay-before-dispatch=1000",
        scenario_delay_before,
    ),
}


@pytest.mark.parametrize("way", ["exact", "wildcard", "address-string"])
@pytest.mark.parametrize("setting", list(SETTINGS))
async def test_every_setting_three_ways(
    make_broker: BrokerFactory,
    client: ClientFactory,
    autojump_clock: Any,
    setting: str,
    way: str,
) -> None:
    defaults, options, scenario = SETTINGS[setting]
    if way == "exact":
        name = "cfg.orders"
        app = await make_broker(address_settings={"#": {}, name: defaults})
        first = name
    elif way == "wildcard":
        name = "cfg.orders.eu"
        app = await make_broker(address_settings={"#": {}, "cfg.#": defaults})
        first = name
    else:
        name = "cfg.orders"
        app = await make_broker()
        first = f"{name}?{options}"
    await scenario(app, client, first, name)


async def test_wildcard_settings_do_not_leak_to_other_addresses(
    make_broker: BrokerFactory, client: ClientFactory, autojump_clock: Any
) -> None:
    app = await make_broker(address_settings={"orders.#": {"default_group_buckets": 2}})
    c1, c2 = await client(app), await client(app)
    s = await c1.sender("invoices.eu")
    r1 = await c1.receiver("invoices.eu", credit=50)
    r2 = await c2.receiver("invoices.eu", credit=50)
    await s.send_many([msg("a", "groupA"), msg("c", "groupC"), msg("b", "groupB")])
    assert await take(r1, 2) == ["a", "b"]
    assert await take(r2, 1) == ["c"]
    assert queue_of(app, "invoices.eu").policy.group_buckets == -1
    await assert_idle(app, c1, c2)


async def test_address_string_overrides_address_setting_defaults(
    make_broker: BrokerFactory, client: ClientFactory, autojump_clock: Any
) -> None:
    app = await make_broker(address_settings={"orders.#": {"default_group_buckets": 4}})
    c1, c2 = await client(app), await client(app)
    # orders.x: options in the address turn grouping off
    r1 = await c1.receiver("orders.x?group-buckets=0", credit=50)
    r2 = await c2.receiver("orders.x", credit=50)
    s = await c1.sender("orders.x")
    await s.send_many([msg("A1", "groupA"), msg("A2", "groupA")])
    assert await take(r1, 1) == ["A1"]
    assert await take(r2, 1) == ["A2"]
    # orders.y: the wildcard default (4 buckets): groupA, grp1 and id1 share bucket 2
    r3 = await c1.receiver("orders.y", credit=50)
    r4 = await c2.receiver("orders.y", credit=50)
    s2 = await c2.sender("orders.y")
    await s2.send_many([msg("a", "groupA"), msg("b", "groupB"), msg("g", "grp1"), msg("i", "id1")])
    assert await take(r3, 3) == ["a", "g", "i"]
    assert await take(r4, 1) == ["b"]
    assert queue_of(app, "orders.y").group_count() == 2
    await assert_idle(app, c1, c2)


async def test_auto_create_through_address_string_by_a_consumer(
    broker: BrokerApp, client: ClientFactory, autojump_clock: Any
) -> None:
    """The issue's example: orders?group-buckets=1024&group-rebalance=true."""
    c1, c2 = await client(broker), await client(broker)
    r1 = await c1.receiver("orders?group-buckets=1024&group-rebalance=true", credit=50)
    r2 = await c2.receiver("orders", credit=50)
    q = queue_of(broker, "orders")
    assert (q.policy.group_buckets, q.policy.group_rebalance) == (1024, True)
    s = await c2.sender("orders?group-buckets=1024&group-rebalance=true")
    await s.send_many([msg("a1", "groupA"), msg("b1", "groupB"), msg("c1", "groupC")])
    assert await take(r1, 2) == ["a1", "c1"]
    assert await take(r2, 1) == ["b1"]
    assert sorted(g["group"] for g in q.list_groups()) == sorted(
        f"{BUCKET}{b}" for b in (978, 1009, 16)
    )
    r3 = await c1.receiver("orders", credit=50)  # rebalance: A, B, C -> r1, r2, r3
    await s.send_many([msg("a2", "groupA"), msg("b2", "groupB"), msg("c2", "groupC")])
    assert await take(r1, 1) == ["a2"]
    assert await take(r2, 1) == ["b2"]
    assert await take(r3, 1) == ["c2"]
    await assert_idle(broker, c1, c2)
