"""Protocol behaviour over real sockets: open, limits, frame size, idle timeout and
heartbeats, attach refusals, a standard blocking client, and empty registries after a
busy scenario.

Clients are the trio-native Proton engine client (`tests.client`); one test uses
python-qpid-proton's own `BlockingConnection` in a worker thread. Time-dependent tests
use trio's autojump clock, never real sleeps.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio
from proton import Delivery, Endpoint, Link, Message, Terminus

from amqbroker.app import BrokerApp
from tests.client import (
    Client,
    ClientError,
    Receiver,
    Sender,
    _put_symbols,
    roundtrip,
    wait_ended,
    wait_until,
)
from tests.conftest import BrokerFactory, ConnectFactory

NO_AUTO_CREATE = {"#": {"auto_create_addresses": False, "auto_create_queues": False}}


# ------------------------------------------------------------------------------ helpers


class SilentClient(Client):
    """A peer that completes SASL and open, then never sends another byte."""

    async def _ticker(self) -> None:
        return


def all_zero(app: BrokerApp) -> bool:
    return all(v == 0 for v in app.registry_sizes().values())


# ----------------------------------------------------------------------------- open


async def test_open_offers_anonymous_relay_and_container_id(
    broker: BrokerApp, connect: ConnectFactory
) -> None:
    c = await connect(container="my-app-42")
    assert "ANONYMOUS-RELAY" in c.offered_capabilities
    assert c.conn.remote_container == "amqbroker"
    props = c.conn.remote_properties or {}
    assert props.get("product") == "amqbroker"
    await roundtrip(c)
    assert "my-app-42" in [conn.remote_container for conn in broker.hub.drivers]


async def test_open_without_sasl(connect: ConnectFactory) -> None:
    c = await connect(sasl=False)
    assert c.conn.state & Endpoint.REMOTE_ACTIVE
    s = await c.sender("nosasl")
    d = await s.send(Message(body="plain"))
    assert d.remote_state == Delivery.ACCEPTED


async def test_max_frame_size_and_channel_max_from_settings(
    make_broker: BrokerFactory, nursery: trio.Nursery
) -> None:
    app = await make_broker(max_frame_size=4096, channel_max=9)
    c = await Client.connect(app.listening[0][1], nursery=nursery)
    try:
        assert c.transport.remote_max_frame_size == 4096
        assert c.transport.remote_channel_max == 9
        # a message bigger than a frame still travels intact both ways
        big = "y" * 70_000  # frames of 4096 to the broker, of 32 KiB (Proton's) back
        s = await c.sender("frames")
        d = await s.send(Message(body=big))
        assert d.remote_state == Delivery.ACCEPTED
        r = await c.receiver("frames", credit=1)
        got = await r.receive()
        assert got.body == big
        r.accept(got)
    finally:
        c.abort()


# ---------------------------------------------------------------------------- limits


async def test_session_limit_refuses_with_resource_limit_exceeded(
    make_broker: BrokerFactory, nursery: trio.Nursery
) -> None:
    app = await make_broker(max_sessions_per_connection=2)
    c = await Client.connect(app.listening[0][1], nursery=nursery)
    try:
        second = c.conn.session()
        second.open()
        third = c.conn.session()
        third.open()
        await c._flush()
        await c._wait(lambda: third.state & Endpoint.REMOTE_CLOSED, 10)
        assert second.state & Endpoint.REMOTE_ACTIVE
        cond = third.remote_condition
        assert cond is not None
        assert cond.name == "amqp:resource-limit-exceeded"
        assert "max_sessions_per_connection" in (cond.description or "")
        # the connection itself stays usable
        s = await c.sender("sess")
        d = await s.send(Message(body="ok"))
        assert d.remote_state == Delivery.ACCEPTED
    finally:
        c.abort()


async def test_link_limit_refuses_with_resource_limit_exceeded(
    make_broker: BrokerFactory, nursery: trio.Nursery
) -> None:
    app = await make_broker(max_links_per_connection=2)
    c = await Client.connect(app.listening[0][1], nursery=nursery)
    try:
        s1 = await c.sender("lim")
        await c.receiver("lim", credit=1)
        with pytest.raises(ClientError) as exc:
            await c.sender("lim")
        assert "amqp:resource-limit-exceeded" in str(exc.value)
        assert "max_links_per_connection" in str(exc.value)
        # closing one makes room for another
        await s1.close()
        s3 = await c.sender("lim")
        d = await s3.send(Message(body="fits"))
        assert d.remote_state == Delivery.ACCEPTED
    finally:
        c.abort()


# ---------------------------------------------------------------------- idle timeout


async def test_idle_timeout_advertised_and_silent_peer_closed(
    make_broker: BrokerFactory, nursery: trio.Nursery, autojump_clock: Any
) -> None:
    app = await make_broker(idle_timeout=4)
    c = await SilentClient.connect(app.listening[0][1], nursery=nursery)
    try:
        # AMQP 2.4.5: a peer SHOULD advertise half its real threshold
        advertised = c.transport.remote_idle_timeout
        assert 0 < advertised <= 4
        # it holds an unsettled message when it falls silent
        s = await c.sender("idle.q")
        await s.send(Message(body="held"))
        r = await c.receiver("idle.q", credit=1)
        assert (await r.receive()).body == "held"
        t0 = trio.current_time()
        await wait_ended(c, 30)
        elapsed = trio.current_time() - t0
        assert c.closed_by_peer
        cond = c.remote_condition
        assert cond is not None and cond.name == "amqp:resource-limit-exceeded"
        assert 4 - 0.5 <= elapsed <= 8, elapsed
        await wait_until(lambda: all_zero(app))
        # a lost connection: the message is back, one failed attempt counted
        assert app.broker is not None
        q = app.broker.queues["idle.q"]
        assert (q.count, q.inflight) == (1, 0)
        assert [e.delivery_count for e in q._all_waiting()] == [1]
    finally:
        c.abort()


async def test_heartbeats_keep_quiet_client_alive(
    make_broker: BrokerFactory, nursery: trio.Nursery, autojump_clock: Any
) -> None:
    app = await make_broker(idle_timeout=2)
    # the client also asks for heartbeats: the broker must send them
    c = await Client.connect(app.listening[0][1], nursery=nursery, idle_timeout=2)
    try:
        s = await c.sender("hb")
        r = await c.receiver("hb", credit=5)
        await trio.sleep(30)  # fifteen idle timeouts of silence but for heartbeats
        assert not c._dead
        assert not c.closed_by_peer, c.remote_condition
        assert c.transport.condition is None
        await s.send(Message(body="still here"))
        got = await r.receive()
        assert got.body == "still here"
        r.accept(got)
    finally:
        c.abort()


# -------------------------------------------------------------------------- refusals


async def test_attach_to_missing_address_refused_not_found(
    make_broker: BrokerFactory, nursery: trio.Nursery
) -> None:
    app = await make_broker(address_settings=NO_AUTO_CREATE)
    c = await Client.connect(app.listening[0][1], nursery=nursery)
    try:
        for make in (c.receiver, c.sender):
            with pytest.raises(ClientError) as exc:
                await make("nowhere")
            assert "amqp:not-found" in str(exc.value)
        links = [lk for lk in _links(c) if lk.name.startswith(("receiver", "sender"))]
        assert len(links) == 2
        for lk in links:
            assert lk.state & Endpoint.REMOTE_CLOSED
            cond = lk.remote_condition
            assert cond is not None and cond.name == "amqp:not-found"
            assert "nowhere" in (cond.description or "")
            term = lk.remote_source if lk.is_receiver else lk.remote_target
            assert term.address is None
        assert app.broker is not None
        assert "nowhere" not in app.broker.addresses
        assert "nowhere" not in app.broker.queues
        # the connection is still fine
        await roundtrip(c)
        assert c.conn.state & Endpoint.REMOTE_ACTIVE
    finally:
        c.abort()


async def test_coordinator_link_refused_not_implemented(connect: ConnectFactory) -> None:
    """Distributed transactions are refused (local ones: test_transactions.py)."""
    c = await connect()
    link = c._session.sender("qpid-jms:coordinator:ID:1")
    link.target.type = Terminus.COORDINATOR
    _put_symbols(link.target.capabilities, ["amqp:distributed-transactions"])
    link.open()
    s = Sender(c, link)
    await c._flush()
    with pytest.raises(ClientError) as exc:
        await s.wait_open()
    cond = link.remote_condition
    assert cond is not None and cond.name == "amqp:not-implemented", str(exc.value)
    assert cond.description


async def test_topic_queue_capability_mismatch_precondition_failed(
    broker: BrokerApp, connect: ConnectFactory
) -> None:
    c = await connect()
    await c.sender("a.queue", capabilities=["queue"])
    await c.receiver("a.topic", capabilities=["topic"])
    cases = [
        (c.receiver, "a.queue", ["topic"]),
        (c.sender, "a.queue", ["topic"]),
        (c.receiver, "a.topic", ["queue"]),
        (c.sender, "a.topic", ["queue"]),
    ]
    for make, address, caps in cases:
        with pytest.raises(ClientError) as exc:
            await make(address, capabilities=caps)
        msg = str(exc.value)
        assert "amqp:precondition-failed" in msg, (address, caps, msg)
        assert address in msg
    assert broker.broker is not None
    assert broker.broker.addresses["a.queue"].routing == "anycast"
    assert broker.broker.addresses["a.topic"].routing == "multicast"


def _links(c: Client) -> list[Link]:
    out = []
    lk = c.conn.link_head(0)
    while lk is not None:
        out.append(lk)
        lk = lk.next(0)
    return out


# ---------------------------------------------------------- a standard blocking client


def _blocking_send_receive(port: int) -> tuple[list[Any], list[Any]]:
    from proton.utils import BlockingConnection

    conn = BlockingConnection(f"amqp://127.0.0.1:{port}", timeout=10)
    try:
        snd = conn.create_sender("blocking.q")
        states = [str(snd.send(Message(body=f"b{i}", id=i)).remote_state) for i in range(3)]
        rcv = conn.create_receiver("blocking.q", credit=10)
        bodies = []
        for _ in range(3):
            bodies.append(rcv.receive(timeout=10).body)
            rcv.accept()  # settles one delivery (the oldest unsettled)
        snd.close()
        rcv.close()
    finally:
        conn.close()
    return states, bodies


async def test_blocking_connection_send_and_receive(broker: BrokerApp, port: int) -> None:
    states, bodies = await trio.to_thread.run_sync(_blocking_send_receive, port)
    assert states == [str(Delivery.ACCEPTED)] * 3
    assert bodies == ["b0", "b1", "b2"]
    # its close completed after the accept: the broker has processed it
    assert broker.broker is not None
    q = broker.broker.queues.get("blocking.q")
    assert q is None or (q.count == 0 and q.inflight == 0)


# ----------------------------------------------------------------------- registries


async def test_registries_empty_after_busy_scenario(
    make_broker: BrokerFactory, nursery: trio.Nursery, autojump_clock: Any
) -> None:
    app = await make_broker(
        link_credit=4,
        address_settings={
            "#": {"dead_letter_address": "DLQ"},
            "full.#": {"max_size_bytes": 600, "address_full_policy": "BLOCK"},
        },
    )
    port = app.listening[0][1]
    clients: list[Client] = []

    async def client() -> Client:
        c = await Client.connect(port, nursery=nursery)
        clients.append(c)
        return c

    try:
        prod = await client()
        cons = await client()
        cons2 = await client()
        senders = {a: await prod.sender(a) for a in ("busy.1", "busy.2", "busy.3")}
        relay = await prod.sender(None)
        receivers: list[Receiver] = []
        for a in ("busy.1", "busy.2", "busy.3"):
            receivers.append(await cons.receiver(a, credit=5))
            receivers.append(await cons2.receiver(a, credit=3, presettled=a == "busy.3"))
        topic_subs = [await cons.receiver("busy.t", capabilities=["topic"], credit=10)]
        topic_subs.append(await cons2.receiver("busy.t", capabilities=["topic"], credit=10))
        dyn = await cons.receiver(None, dynamic=True, credit=10)
        dyn_sender = await cons2.sender(None, dynamic=True, name="qpid-jms:temp-queue-creator:1")
        for i in range(12):
            for a, s in senders.items():
                await s.send(Message(body=f"{a}-{i}"))
        for i in range(3):
            await relay.send(Message(address="busy.t", body=f"t{i}"))
            await relay.send(Message(address=dyn.address, body=f"d{i}"))
            await relay.send(Message(address=dyn_sender.address, body=f"ds{i}"))
        for r in receivers:
            first = await r.receive()
            await r.receive()  # left unsettled (unless the link is presettled)
            r.accept(first)
        for r in topic_subs:
            assert (await r.receive()).body == "t0"
        assert (await dyn.receive()).body == "d0"
        # a producer blocked on a full address
        blocker = await client()
        full = await blocker.sender("full.q")
        while full.credit > 0:
            await full.send(Message(body="z" * 200))
            await roundtrip(blocker)
        assert app.broker is not None
        assert app.registry_sizes()["blocked_producers"] == 1
        assert app.registry_sizes()["in_flight"] > 0
        assert app.registry_sizes()["temporary_queues"] == 4  # 2 dynamic + 2 subscriptions
        # everyone leaves: some abort with unsettled messages, some close cleanly
        cons.abort()
        blocker.abort()
        await cons2.close()
        await prod.close()
        await wait_until(lambda: all_zero(app), timeout=20)
    finally:
        for c in clients:
            c.abort()
    sizes = app.registry_sizes()
    assert sizes == {k: 0 for k in sizes}, sizes
    assert app.broker is not None
    assert not [q for q in app.broker.queues.values() if q.temporary]
    assert not [n for n in app.broker.queues if n.startswith("busy.t::")]
    # unsettled messages went back: nothing was lost on the anycast queues
    assert app.broker.queues["busy.1"].count + app.broker.queues["busy.2"].count > 0


async def test_connection_refused_link_state_does_not_leak(
    make_broker: BrokerFactory, nursery: trio.Nursery, autojump_clock: Any
) -> None:
    app = await make_broker(address_settings=NO_AUTO_CREATE, max_links_per_connection=3)
    c = await Client.connect(app.listening[0][1], nursery=nursery)
    try:
        # refused links never count against max_links_per_connection
        for _ in range(5):
            with pytest.raises(ClientError) as exc:
                await c.receiver("missing")
            assert "amqp:not-found" in str(exc.value)
        link = c._session.receiver("presettled-refused")
        link.snd_settle_mode = Link.SND_SETTLED
        link.source.address = "missing"
        link.open()
        await roundtrip(c)
        assert app.registry_sizes()["links"] == 0
    finally:
        c.abort()
    await wait_until(lambda: all_zero(app))


async def test_consumer_with_an_unknown_filter_is_refused_not_ignored(
    broker: BrokerApp, connect: ConnectFactory
) -> None:
    """A filter the broker does not apply is refused with amqp:not-implemented: a
    client that never checks the echoed filter set (Qpid JMS) would otherwise get every
    message."""
    c = await connect()
    link = c._session.receiver("sel")
    link.source.address = "sel.q"
    f = link.source.filter
    f.put_map()
    f.enter()
    f.put_symbol("xquery")
    f.put_described()
    f.enter()
    f.put_symbol("apache.org:xquery-filter:string")
    f.put_string("/a/b")
    f.exit()
    f.exit()
    link.open()
    r = Receiver(c, link)
    await c._flush()  # send the attach (Client.receiver does this itself)
    with pytest.raises(ClientError, match=r"amqp:not-implemented: .*xquery"):
        await r.wait_open()
    # the connection is still usable without a filter
    ok = await c.receiver("sel.q", credit=1)
    s = await c.sender("sel.q")
    await s.send(Message(body="plain"))
    assert (await ok.receive()).body == "plain"
