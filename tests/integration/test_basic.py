"""Send and receive over real sockets with a real AMQP engine (Proton)."""

from __future__ import annotations

from proton import Delivery, Message

from amqbroker.app import BrokerApp
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
