"""Send and receive over real sockets with a real AMQP engine (Proton)."""

from __future__ import annotations

from typing import Any

from proton import Delivery, Message

from amqbroker.app import BrokerApp
from tests.client import Client
from tests.conftest import ConnectFactory, wait_idle


async def test_send_then_receive_in_order(connect: ConnectFactory) -> None:
    c = await connect()
    s = await c.sender("q1")
    for i in range(10):
        d = await s.send(Message(body=f"m{i}"))
        assert d.remote_state == Delivery.ACCEPTED
    r = await c.receiver("q1", credit=20)
    got = await r.receive_n(10)
    assert [g.body for g in got] == [f"m{i}" for i in range(10)]
    for g in got:
        r.accept(g)


async def test_receive_then_send_two_connections(connect: ConnectFactory) -> None:
    consumer = await connect()
    r = await consumer.receiver("q2", credit=5)
    producer = await connect()
    s = await producer.sender("q2")
    await s.send(Message(body="hello"))
    g = await r.receive()
    assert g.body == "hello"
    r.accept(g)


async def test_registries_empty_after_clients_leave(
    broker: BrokerApp, connect: ConnectFactory
) -> None:
    c = await connect()
    s = await c.sender("q3")
    r = await c.receiver("q3", credit=5)
    await s.send(Message(body="x"))
    got = await r.receive()
    assert got.body == "x"
    await c.close()
    c2 = await connect()
    await c2.close()
    sizes = await wait_idle(broker)
    assert sizes == {k: 0 for k in sizes}, sizes


async def test_several_listeners_share_one_broker(make_broker: Any, nursery: Any) -> None:
    """extra_listeners: every listener serves the same broker (one queue seen from both)."""
    app = await make_broker(extra_listeners=["127.0.0.1:0"])
    assert len(app.listening) == 2
    (_, p1), (_, p2) = app.listening
    assert p1 != p2
    a = await Client.connect(p1, nursery=nursery)
    b = await Client.connect(p2, nursery=nursery)
    try:
        s = await a.sender("shared")
        r = await b.receiver("shared", credit=1)
        await s.send(Message(body="across listeners"))
        assert (await r.receive()).body == "across listeners"
    finally:
        a.abort()
        b.abort()
