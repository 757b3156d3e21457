"""The network layer over a socketpair: a real `Driver` (net) running a real
`AmqpConnection` (protocol) on one end, a Proton client engine (`Transport` +
`Connection`, pumped by hand) on the other. No listener, no app, no data directory:
what the driver adds to the engine tests is the socket, the tasks and the lifetime
(the connection slot, the hub's map, the release callback).
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import proton
import pytest
import trio
from proton import Endpoint, Message

from amqbroker.core.auth import Authenticator
from amqbroker.core.broker import Broker
from amqbroker.core.timers import Timers
from amqbroker.net.driver import Driver, Hub
from amqbroker.protocol.connection import AmqpConnection, ConnectionLimits

#: seconds a test waits for a condition before failing (real clock: real sockets)
WAIT = 5.0


class Client:
    """A Proton client engine on one end of the socketpair, pumped by `until`."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.transport = proton.Transport()
        self.transport.sasl().allowed_mechs("ANONYMOUS")
        self.conn = proton.Connection()
        self.conn.container = "net-test-client"
        self.transport.bind(self.conn)
        self.eof = False

    def step(self) -> None:
        """Write what the engine has, read what the socket has (never blocks)."""
        t = self.transport
        n = t.pending()
        if n > 0:
            try:
                sent = self.sock.send(t.peek(n))
            except BlockingIOError:
                sent = 0
            t.pop(sent)
        while not self.eof:
            try:
                data = self.sock.recv(65536)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                self.eof = True
                t.close_tail()
                return
            t.push(data)

    async def until(self, pred: Callable[[], bool]) -> None:
        with trio.fail_after(WAIT):
            while True:
                self.step()
                if pred():
                    return
                with trio.move_on_after(0.01):
                    await trio.lowlevel.wait_readable(self.sock)


@dataclass
class Net:
    hub: Hub
    broker: Broker
    driver: Driver
    client: Client
    done: trio.Event
    released: list[str] = field(default_factory=list)


@pytest.fixture
async def net(nursery: trio.Nursery) -> AsyncIterator[Net]:
    broker = Broker(clock=lambda: 1_700_000_000.0, timers=Timers())
    hub = Hub()
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    conn = AmqpConnection(
        broker,
        limits=ConnectionLimits(),
        auth=Authenticator({}, require_auth=False),
        conn_id="c1",
        peer="socketpair",
        on_dirty=hub.on_dirty,
    )
    released: list[str] = []
    driver = Driver(
        hub, conn, ours, handshake_timeout=WAIT, on_release=lambda: released.append("c1")
    )
    done = trio.Event()

    async def run() -> None:
        try:
            await driver.run()
        finally:
            done.set()

    nursery.start_soon(run)
    n = Net(hub, broker, driver, Client(theirs), done, released)
    try:
        yield n
    finally:
        theirs.close()


def _idle(n: Net) -> None:
    """Everything the driver held is given back."""
    assert n.hub.slots == 0
    assert n.hub.drivers == {}
    assert n.released == ["c1"]


async def test_open_and_close_handshake(net: Net) -> None:
    c = net.client
    assert net.hub.slots == 1 and list(net.hub.drivers) == [net.driver.conn]
    c.conn.open()
    await c.until(lambda: bool(c.conn.state & Endpoint.REMOTE_ACTIVE))
    assert c.conn.remote_container == "amqbroker"
    c.conn.close()
    await c.until(lambda: bool(c.conn.state & Endpoint.REMOTE_CLOSED))
    # our close is written: the slot is free even before the peer hangs up
    assert net.hub.slots == 0
    c.sock.close()
    with trio.fail_after(WAIT):
        await net.done.wait()
    _idle(net)


async def test_a_message_through(net: Net) -> None:
    c = net.client
    c.conn.open()
    session = c.conn.session()
    session.open()
    snd = session.sender("s")
    snd.target.address = "q"
    snd.open()
    rcv = session.receiver("r")
    rcv.source.address = "q"
    rcv.open()
    rcv.flow(10)
    await c.until(lambda: snd.credit > 0)
    d = snd.delivery(b"t1")
    snd.send(Message(body="hello over a socket", group_id="g1").encode())
    snd.advance()
    await c.until(lambda: rcv.current is not None and not rcv.current.partial)
    got = rcv.current
    assert got is not None
    m = Message()
    m.decode(rcv.recv(got.pending))
    rcv.advance()
    got.update(got.ACCEPTED)
    got.settle()
    assert m.body == "hello over a socket" and m.group_id == "g1"
    await c.until(lambda: d.remote_state == d.ACCEPTED)
    c.conn.close()
    await c.until(lambda: bool(c.conn.state & Endpoint.REMOTE_CLOSED))
    c.sock.close()
    with trio.fail_after(WAIT):
        await net.done.wait()
    _idle(net)
    # the auto-created queue went with its last consumer, nothing left in flight
    assert all(q.consumer_count == 0 and q.inflight == 0 for q in net.broker.queues.values())


#: a frame header announcing 256 bytes (doff 2, AMQP frame, channel 0), then 2 of them
HALF_A_FRAME = b"\x00\x00\x01\x00\x02\x00\x00\x00\x00\x53"


@pytest.mark.parametrize("when", ["in SASL", "after the AMQP open"])
async def test_peer_drops_mid_frame_frees_the_slot(net: Net, when: str) -> None:
    c = net.client
    if when == "in SASL":
        c.sock.sendall(b"AMQP\x03\x01\x00\x00" + HALF_A_FRAME)
    else:
        c.conn.open()
        await c.until(lambda: bool(c.conn.state & Endpoint.REMOTE_ACTIVE))
        assert net.driver.conn.opened
        c.sock.sendall(HALF_A_FRAME)
    c.sock.close()
    with trio.fail_after(WAIT):
        await net.done.wait()
    _idle(net)
