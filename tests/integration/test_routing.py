"""Routing over real sockets: anonymous relay, dynamic nodes, multicast, address
settings matched by wildcard (auto-create, max-delivery-attempts, dead-letter and
expiry addresses, redelivery delay, max size with FAIL and BLOCK), expiry and priority.

Time-dependent tests use trio's autojump clock (the broker's clock is built on
`trio.current_time()`), never real sleeps.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio
from proton import Delivery, Message, symbol

from amqbroker.app import BrokerApp
from amqbroker.core.queue import Queue
from tests.client import Client, ClientError, Sender, roundtrip
from tests.conftest import BrokerFactory, ConnectFactory

NO_AUTO_CREATE = {"#": {"auto_create_addresses": False, "auto_create_queues": False}}

# ------------------------------------------------------------------------------ helpers


def queues(app: BrokerApp) -> dict[str, Queue]:
    assert app.broker is not None
    return app.broker.queues


async def fill(s: Sender, msgs: list[Message]) -> None:
    for m in msgs:
        d = await s.send(m)
        assert d.remote_state == Delivery.ACCEPTED, d.remote_state


def ann(msg: Message, key: str) -> Any:
    return (msg.annotations or {}).get(symbol(key))


# ------------------------------------------------------------------ anonymous relay


async def test_anonymous_relay_routes_each_message_by_its_to(connect: ConnectFactory) -> None:
    c = await connect()
    assert "ANONYMOUS-RELAY" in c.offered_capabilities
    s = await c.sender(None)
    assert s.address is None
    await fill(
        s,
        [
            Message(address="relay.a", body="a1"),
            Message(address="relay.b", body="b1"),
            Message(address="relay.a", body="a2"),
        ],
    )
    ra = await c.receiver("relay.a", credit=5)
    rb = await c.receiver("relay.b", credit=5)
    assert [g.body for g in await ra.receive_n(2)] == ["a1", "a2"]
    assert [g.body for g in await rb.receive_n(1)] == ["b1"]
    await roundtrip(c)
    assert not ra.queue and not rb.queue


async def test_anonymous_relay_without_to_is_rejected(
    broker: BrokerApp, connect: ConnectFactory
) -> None:
    c = await connect()
    s = await c.sender(None)
    d = await s.send(Message(body="where to?"))
    assert d.remote_state == Delivery.REJECTED
    cond = d.remote.condition
    assert cond is not None and cond.name
    assert "to" in (cond.description or "")
    # the link stays usable
    d2 = await s.send(Message(address="relay.after", body="ok"))
    assert d2.remote_state == Delivery.ACCEPTED
    assert queues(broker)["relay.after"].count == 1


async def test_anonymous_relay_to_missing_address_rejected_not_found(
    make_broker: BrokerFactory, nursery: trio.Nursery
) -> None:
    app = await make_broker(
        address_settings=NO_AUTO_CREATE,
        addresses=[{"name": "known", "routing": "anycast"}],
    )
    c = await Client.connect(app.listening[0][1], nursery=nursery)
    try:
        s = await c.sender(None)
        d = await s.send(Message(address="unknown", body="x"))
        assert d.remote_state == Delivery.REJECTED
        cond = d.remote.condition
        assert cond is not None and cond.name == "amqp:not-found"
        assert "unknown" in (cond.description or "")
        assert "unknown" not in queues(app)
        ok = await s.send(Message(address="known", body="y"))
        assert ok.remote_state == Delivery.ACCEPTED
        assert queues(app)["known"].count == 1
    finally:
        c.abort()


# --------------------------------------------------------------------- dynamic nodes


async def test_dynamic_receiver_gets_temporary_queue_deleted_on_close(
    broker: BrokerApp, connect: ConnectFactory
) -> None:
    c = await connect()
    r = await c.receiver(None, dynamic=True, credit=5)
    addr = r.address
    assert addr
    assert addr in queues(broker)
    assert queues(broker)[addr].temporary
    p = await connect()
    s = await p.sender(addr)
    await fill(s, [Message(body="reply-1"), Message(body="reply-2")])
    got = await r.receive_n(2)
    assert [g.body for g in got] == ["reply-1", "reply-2"]
    r.accept(got[0])  # one left unsettled: deleted with its queue
    await r.close()
    assert addr not in queues(broker)
    assert broker.broker is not None
    assert addr not in broker.broker.addresses or broker.broker.addresses[addr].producers
    # a second dynamic receiver gets another name
    r2 = await c.receiver(None, dynamic=True)
    assert r2.address and r2.address != addr


async def test_dynamic_sender_temp_queue_creator(
    broker: BrokerApp, connect: ConnectFactory
) -> None:
    c = await connect()
    creator = await c.sender(
        None,
        dynamic=True,
        capabilities=["temporary-queue"],
        name="qpid-jms:temp-queue-creator:ID:1:1:1",
    )
    addr = creator.address
    assert addr
    assert queues(broker)[addr].temporary
    consumer = await c.receiver(addr, credit=5)
    p = await connect()
    s = await p.sender(addr)
    await fill(s, [Message(body="to-temp")])
    assert (await consumer.receive()).body == "to-temp"
    await creator.close()
    assert addr not in queues(broker)
    # the consumer of a deleted temporary queue is told so
    await c._wait(lambda: consumer.closed_by_peer, 10)
    cond = consumer.remote_condition
    assert cond is not None and cond.name == "amqp:resource-deleted"


# ------------------------------------------------------------------------- multicast


async def test_topic_subscribers_each_get_a_copy_and_queues_go_away(
    broker: BrokerApp, connect: ConnectFactory
) -> None:
    c1 = await connect()
    c2 = await connect()
    r1 = await c1.receiver("news", capabilities=["topic"], credit=10)
    r2 = await c2.receiver("news", capabilities=["topic"], credit=10)
    subs = [n for n in queues(broker) if n.startswith("news")]
    assert len(subs) == 2
    assert "news" not in queues(broker)  # no anycast queue for a topic
    p = await connect()
    s = await p.sender("news", capabilities=["topic"])
    await fill(s, [Message(body=f"n{i}") for i in range(3)])
    assert [g.body for g in await r1.receive_n(3)] == ["n0", "n1", "n2"]
    assert [g.body for g in await r2.receive_n(3)] == ["n0", "n1", "n2"]
    await r1.close()
    assert len([n for n in queues(broker) if n.startswith("news")]) == 1
    await r2.close()
    assert not [n for n in queues(broker) if n.startswith("news")]


async def test_topic_without_subscribers_accepts_and_drops(
    broker: BrokerApp, connect: ConnectFactory
) -> None:
    p = await connect()
    s = await p.sender("lonely", capabilities=["topic"])
    await fill(s, [Message(body="nobody hears this")])
    assert broker.broker is not None
    assert broker.broker.addresses["lonely"].routing == "multicast"
    assert broker.broker.dropped_no_route >= 1
    c = await connect()
    r = await c.receiver("lonely", capabilities=["topic"], credit=5)
    await roundtrip(c)
    assert not r.queue
    await fill(s, [Message(body="now someone")])
    assert (await r.receive()).body == "now someone"


# ----------------------------------------------------------- address settings by wildcard


async def test_auto_create_most_specific_pattern_wins(
    make_broker: BrokerFactory, nursery: trio.Nursery
) -> None:
    app = await make_broker(
        address_settings={
            "#": {"auto_create_addresses": False, "auto_create_queues": False},
            "app.#": {"auto_create_addresses": True, "auto_create_queues": True},
            "app.secret": {"auto_create_addresses": False},
        }
    )
    c = await Client.connect(app.listening[0][1], nursery=nursery)
    try:
        s = await c.sender("app.orders")
        r = await c.receiver("app.events.eu", credit=1)
        assert s.address == "app.orders"
        assert r.address == "app.events.eu"
        for addr in ("other", "app.secret"):
            for kind in ("sender", "receiver"):
                link = (
                    await c.sender(addr, wait=False)
                    if kind == "sender"
                    else await c.receiver(addr, wait=False)
                )
                await c._wait(lambda lk=link: lk.closed_by_peer, 10)
                cond = link.remote_condition
                assert cond is not None and cond.name == "amqp:not-found", (addr, kind)
        assert "other" not in queues(app)
        assert "app.secret" not in queues(app)
    finally:
        c.abort()


async def test_max_delivery_attempts_and_dead_letter_address_by_pattern(
    make_broker: BrokerFactory, nursery: trio.Nursery
) -> None:
    app = await make_broker(
        address_settings={
            "#": {"max_delivery_attempts": 5, "dead_letter_address": "DLQ.all"},
            "orders.#": {"dead_letter_address": "DLQ.orders"},
            "orders.fragile": {"max_delivery_attempts": 1},
        }
    )
    c = await Client.connect(app.listening[0][1], nursery=nursery)
    try:
        s = await c.sender(None)
        await fill(
            s,
            [
                Message(address="orders.fragile", body="fragile"),
                Message(address="orders.eu", body="eu"),
                Message(address="misc", body="misc"),
            ],
        )
        # one failed attempt dead-letters only where max is 1
        for addr in ("orders.fragile", "orders.eu"):
            r = await c.receiver(addr, credit=1)
            g = await r.receive()
            r.modify(g, failed=True)
            await roundtrip(c)
            await r.close()
        fragile = queues(app).get("orders.fragile")  # auto-deleted once empty
        assert fragile is None or fragile.count == 0
        assert queues(app)["orders.eu"].count == 1
        # rejection: dead-letter address from the most specific pattern that sets it
        for addr in ("orders.eu", "misc"):
            r = await c.receiver(addr, credit=1)
            g = await r.receive()
            r.reject(g)
            await roundtrip(c)
            await r.close()
        d_orders = await c.receiver("DLQ.orders", credit=5)
        d_all = await c.receiver("DLQ.all", credit=5)
        got_orders = await d_orders.receive_n(2)
        got_all = await d_all.receive_n(1)
        await roundtrip(c)
        assert not d_orders.queue and not d_all.queue
        assert [g.body for g in got_orders] == ["fragile", "eu"]
        assert [ann(g.message, "x-opt-ORIG-ADDRESS") for g in got_orders] == [
            "orders.fragile",
            "orders.eu",
        ]
        assert [g.body for g in got_all] == ["misc"]
        assert ann(got_all[0].message, "x-opt-ORIG-QUEUE") == "misc"
    finally:
        c.abort()


async def test_redelivery_delay_by_pattern(
    make_broker: BrokerFactory, nursery: trio.Nursery, autojump_clock: Any
) -> None:
    app = await make_broker(address_settings={"slow.#": {"redelivery_delay": 5000}})
    c = await Client.connect(app.listening[0][1], nursery=nursery)
    try:
        s = await c.sender(None)
        await fill(
            s, [Message(address="slow.q", body="slow"), Message(address="fast.q", body="fast")]
        )
        waits = {}
        for addr in ("slow.q", "fast.q"):
            r = await c.receiver(addr, credit=5)
            g = await r.receive()
            t0 = trio.current_time()
            r.modify(g, failed=True)
            again = await r.receive(timeout=30)
            waits[addr] = trio.current_time() - t0
            assert again.message.delivery_count == 1
            r.accept(again)
        assert waits["slow.q"] >= 5.0, waits
        assert waits["fast.q"] < 1.0, waits
    finally:
        c.abort()


async def test_full_address_fail_policy_rejects(
    make_broker: BrokerFactory, nursery: trio.Nursery
) -> None:
    app = await make_broker(
        address_settings={
            "#": {"max_size_bytes": 1000, "address_full_policy": "FAIL"},
            "lim.big": {"max_size_bytes": -1},
        }
    )
    c = await Client.connect(app.listening[0][1], nursery=nursery)
    try:
        small = await c.sender("lim.small")
        big = await c.sender("lim.big")
        body = "x" * 300
        states = [(await small.send(Message(body=body))).remote_state for _ in range(6)]
        assert states[0] == Delivery.ACCEPTED
        assert Delivery.REJECTED in states
        first_rejected = states.index(Delivery.REJECTED)
        assert all(st == Delivery.REJECTED for st in states[first_rejected:])
        d = await small.send(Message(body=body))
        cond = d.remote.condition
        assert cond is not None and cond.name == "amqp:resource-limit-exceeded"
        assert "lim.small" in (cond.description or "")
        assert "full" in (cond.description or "")
        # the more specific pattern lifts the limit
        for _ in range(6):
            assert (await big.send(Message(body=body))).remote_state == Delivery.ACCEPTED
        # room again once consumed
        r = await c.receiver("lim.small", credit=10)
        for g in await r.receive_n(first_rejected):
            r.accept(g)
        await roundtrip(c)
        assert queues(app)["lim.small"].count == 0
        assert (await small.send(Message(body=body))).remote_state == Delivery.ACCEPTED
    finally:
        c.abort()


async def test_full_address_block_policy_withholds_credit(
    make_broker: BrokerFactory, nursery: trio.Nursery, autojump_clock: Any
) -> None:
    app = await make_broker(
        link_credit=4,
        address_settings={"blk.#": {"max_size_bytes": 1000, "address_full_policy": "BLOCK"}},
    )
    port = app.listening[0][1]
    p = await Client.connect(port, nursery=nursery)
    c = await Client.connect(port, nursery=nursery)
    try:
        s = await p.sender("blk.q")
        assert s.credit > 0
        sent = 0
        while True:
            await roundtrip(p)
            if s.credit == 0:
                break
            d = await s.send(Message(body="b" * 300))
            assert d.remote_state == Delivery.ACCEPTED
            sent += 1
            assert sent < 50, "the broker never stopped granting credit"
        assert app.broker is not None
        a = app.broker.addresses["blk.q"]
        assert a.size >= a.max_size
        # no credit while full, however long we wait
        await trio.sleep(10)
        await roundtrip(p)
        assert s.credit == 0
        assert app.registry_sizes()["blocked_producers"] == 1
        # a consumer makes room: credit comes back
        r = await c.receiver("blk.q", credit=sent)
        for g in await r.receive_n(sent):
            r.accept(g)
        await roundtrip(c)
        await p._wait(lambda: s.credit > 0, 10)
        d = await s.send(Message(body="after"))
        assert d.remote_state == Delivery.ACCEPTED
        r.flow(1)
        assert (await r.receive()).body == "after"
    finally:
        p.abort()
        c.abort()


# ------------------------------------------------------------------ expiry and priority


async def test_expired_messages_never_delivered_and_go_to_expiry_address(
    make_broker: BrokerFactory, nursery: trio.Nursery, autojump_clock: Any
) -> None:
    app = await make_broker(
        address_settings={
            "#": {"expiry_address": "EXP.all"},
            "exp.special.#": {"expiry_address": "EXP.special"},
        }
    )
    c = await Client.connect(app.listening[0][1], nursery=nursery)
    try:
        s = await c.sender(None)
        # a consumer already attached, without credit, on one address; none on the other
        waiting = await c.receiver("exp.q", credit=0)
        now = app.clock()
        await fill(
            s,
            [
                Message(address="exp.q", body="ttl", ttl=1.0),
                Message(address="exp.q", body="abs", expiry_time=now + 1.0),
                Message(address="exp.q", body="keeps", ttl=600.0),
                Message(address="exp.special.q", body="special", ttl=1.0),
                Message(address="exp.q", body="forever"),
            ],
        )
        await trio.sleep(2)
        waiting.flow(10)
        later = await c.receiver("exp.special.q", credit=10)
        got = await waiting.receive_n(2)
        await roundtrip(c)
        assert [g.body for g in got] == ["keeps", "forever"]
        assert not waiting.queue
        assert not later.queue
        e_all = await c.receiver("EXP.all", credit=10)
        e_special = await c.receiver("EXP.special", credit=10)
        exp_all = await e_all.receive_n(2)
        exp_special = await e_special.receive_n(1)
        await roundtrip(c)
        assert sorted(g.body for g in exp_all) == ["abs", "ttl"]
        assert [g.body for g in exp_special] == ["special"]
        assert all(ann(g.message, "x-opt-ORIG-ADDRESS") == "exp.q" for g in exp_all)
        assert ann(exp_special[0].message, "x-opt-ORIG-ADDRESS") == "exp.special.q"
    finally:
        c.abort()


async def test_expired_while_consumer_connected_not_delivered(
    make_broker: BrokerFactory, nursery: trio.Nursery, autojump_clock: Any
) -> None:
    app = await make_broker()
    c = await Client.connect(app.listening[0][1], nursery=nursery)
    try:
        s = await c.sender("exp2.q")
        r = await c.receiver("exp2.q", credit=1)
        await fill(s, [Message(body="first"), Message(body="short", ttl=0.5)])
        g = await r.receive()
        assert g.body == "first"
        await trio.sleep(1)
        r.flow(5)
        await roundtrip(c)
        assert not r.queue
        assert queues(app)["exp2.q"].count == 1  # only "first", in flight
    finally:
        c.abort()


async def test_priority_higher_first_fifo_within_level(
    broker: BrokerApp, connect: ConnectFactory
) -> None:
    p = await connect()
    s = await p.sender("prio.q")
    sent = [(1, "p1"), (9, "p9a"), (4, "p4"), (0, "p0"), (7, "p7"), (9, "p9b"), (4, "p4b")]
    await fill(s, [Message(body=b, priority=pr) for pr, b in sent])
    c = await connect()
    r = await c.receiver("prio.q", credit=20)
    got = await r.receive_n(len(sent))
    assert [g.body for g in got] == ["p9a", "p9b", "p7", "p4", "p4b", "p1", "p0"]
    assert [g.message.priority for g in got] == [9, 9, 7, 4, 4, 1, 0]


async def test_bad_address_option_refuses_only_that_link(
    broker: BrokerApp, connect: ConnectFactory
) -> None:
    """An unknown option in the address string is the client's mistake: that link is
    refused with amqp:invalid-field and a description naming the option; the
    connection stays usable."""
    c = await connect()
    with pytest.raises(ClientError, match=r"amqp:invalid-field: .*bogus"):
        await c.receiver("perf?bogus=1", credit=1)
    with pytest.raises(ClientError, match=r"amqp:invalid-field: .*group-buckets"):
        await c.sender("perf?group-buckets=notanumber")
    s = await c.sender("perf")
    r = await c.receiver("perf", credit=1)
    await s.send(Message(body="still fine"))
    assert (await r.receive()).body == "still fine"


async def test_global_max_size_blocks_producers_on_every_address(
    make_broker: BrokerFactory, nursery: trio.Nursery, autojump_clock: Any
) -> None:
    """global_max_size bounds the bytes held by all queues together: once reached,
    producers on *other* addresses stop getting credit too (BLOCK), and all of them
    get credit again when a consumer makes room anywhere."""
    app = await make_broker(link_credit=4, global_max_size=2000)
    port = app.listening[0][1]
    p = await Client.connect(port, nursery=nursery)
    c = await Client.connect(port, nursery=nursery)
    try:
        s1 = await p.sender("g.one")
        sent = 0
        while True:
            await roundtrip(p)
            if s1.credit == 0:
                break
            assert (await s1.send(Message(body="x" * 300))).remote_state == Delivery.ACCEPTED
            sent += 1
            assert sent < 50, "the broker never stopped granting credit"
        assert app.broker is not None
        assert app.broker.budget.used >= 2000
        # a producer on another address, under no per-address limit, is held too
        s2 = await p.sender("g.two")
        await roundtrip(p)
        assert s2.credit == 0
        assert app.registry_sizes()["blocked_producers"] == 2
        # consuming g.one makes room for both
        r = await c.receiver("g.one", credit=sent)
        for g in await r.receive_n(sent):
            r.accept(g)
        await roundtrip(c)
        await p._wait(lambda: s1.credit > 0 and s2.credit > 0, 10)
        assert (await s2.send(Message(body="ok"))).remote_state == Delivery.ACCEPTED
    finally:
        p.abort()
        c.abort()


async def test_global_max_size_with_fail_policy_rejects(
    make_broker: BrokerFactory, nursery: trio.Nursery
) -> None:
    app = await make_broker(
        global_max_size=1000, address_settings={"#": {"address_full_policy": "FAIL"}}
    )
    c = await Client.connect(app.listening[0][1], nursery=nursery)
    try:
        s = await c.sender("gf.q")
        states = [(await s.send(Message(body="y" * 300))).remote_state for _ in range(6)]
        assert states[0] == Delivery.ACCEPTED
        assert states[-1] == Delivery.REJECTED
        d = await s.send(Message(body="y" * 300))
        cond = d.remote.condition
        assert cond is not None and cond.name == "amqp:resource-limit-exceeded"
        assert "global_max_size" in (cond.description or "")
    finally:
        c.abort()


async def test_send_to_a_deleted_temporary_queue_is_refused(
    broker: BrokerApp, connect: ConnectFactory
) -> None:
    """A reply to a temporary queue that no longer exists must not silently create a
    permanent queue of that name (a JMS reply to a deleted TemporaryQueue)."""
    c = await connect()
    r = await c.receiver(None, dynamic=True, credit=1)
    name = r.address
    assert name is not None
    await r.close()
    assert broker.broker is not None
    assert name not in broker.broker.queues
    relay = await c.sender(None)
    d = await relay.send(Message(address=name, body="late reply"))
    assert d.remote_state == Delivery.REJECTED
    assert d.remote.condition is not None
    assert d.remote.condition.name == "amqp:not-found"
    assert name not in broker.broker.queues
