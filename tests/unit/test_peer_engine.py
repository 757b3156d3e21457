"""`PeerEngine` (the client side of a cluster link) against an in-memory proton server.

Transfers, dispositions and flow go through the cffi layer since issue 20: every
outcome reaches its callback exactly once (with the rejection's condition), credit is
reported once per batch of input, and what is unsettled when the input ends is "lost".
"""

from __future__ import annotations

from typing import Any

from proton import Collector, Condition, Connection, Delivery, Event, Transport

from amqbroker.protocol.peer import PeerEngine, PeerMessage


class Server:
    """A proton server engine that accepts every link, grants 10 credit to a sender
    and rejects the transfers whose payload is b"bad"."""

    def __init__(self) -> None:
        self.transport = Transport(Transport.SERVER)
        self.transport.sasl().allowed_mechs("ANONYMOUS")
        self.conn = Connection()
        self.collector = Collector()
        self.conn.collect(self.collector)
        self.transport.bind(self.conn)
        self.received: list[bytes] = []
        self.senders: list[Any] = []

    def serve(self) -> None:
        while (ev := self.collector.peek()) is not None:
            if ev.type == Event.CONNECTION_REMOTE_OPEN:
                self.conn.open()
            elif ev.type == Event.SESSION_REMOTE_OPEN:
                ev.session.open()
            elif ev.type == Event.LINK_REMOTE_OPEN:
                link = ev.link
                link.target.address = link.remote_target.address
                if link.remote_source.dynamic:
                    link.source.address = "tmp.replies"
                else:
                    link.source.address = link.remote_source.address
                link.open()
                if link.is_receiver:
                    link.flow(10)
                else:
                    self.senders.append(link)
            elif ev.type == Event.DELIVERY and ev.link.is_receiver and not ev.delivery.partial:
                d = ev.delivery
                body = ev.link.recv(d.pending)
                ev.link.advance()
                self.received.append(body)
                if body == b"bad":
                    d.local.condition = Condition("amqp:decode-error", "not an envelope")
                    d.update(Delivery.REJECTED)
                else:
                    d.update(Delivery.ACCEPTED)
                d.settle()
            self.collector.pop()


def pump(engine: PeerEngine, server: Server, rounds: int = 6) -> None:
    for _ in range(rounds):
        out = engine.output()
        if out:
            server.transport.push(out)
        server.serve()
        p = server.transport.pending()
        if p > 0:
            engine.feed(bytes(server.transport.peek(p)))
            server.transport.pop(p)


def test_outcomes_credit_and_lost() -> None:
    dirty: list[int] = []
    engine = PeerEngine(container_id="node2", on_dirty=lambda: dirty.append(1))
    server = Server()
    s = engine.sender("$cluster.inbound", "node2->node1.bridge")
    credits: list[int] = []
    s.on_credit = lambda: credits.append(s.credit)
    pump(engine, server)
    assert s.opened and s.credit == 10
    assert credits == [10]

    outcomes: list[tuple[str, str]] = []
    s.send(b"one", lambda o, d: outcomes.append((o, d)))
    s.send(b"bad", lambda o, d: outcomes.append((o, d)))
    s.send(b"presettled")
    pump(engine, server)
    assert server.received == [b"one", b"bad", b"presettled"]
    assert sorted(outcomes) == [
        ("accepted", ""),
        ("rejected", "amqp:decode-error: not an envelope"),
    ]
    assert credits[-1] == 7  # once for the batch of two outcomes, not once per outcome
    assert not engine._outcomes

    s.send(b"late", lambda o, d: outcomes.append((o, d)))
    engine.input_closed()
    assert outcomes[-1][0] == "lost"
    assert not engine._outcomes
    assert dirty  # the writer was woken


def test_receiver_delivers_decoded_messages_and_tops_up_credit() -> None:
    from amqbroker.protocol.peer import encode_message

    engine = PeerEngine(container_id="node2")
    server = Server()
    got: list[PeerMessage] = []
    r = engine.receiver(got.append, "node2->node1.replies", credit=4)
    pump(engine, server)
    assert r.opened and r.address == "tmp.replies"
    (link,) = server.senders
    for i in range(10):
        d = link.delivery(str(i))
        link.send(encode_message(correlation_id=f"c{i}", properties={"statusCode": 200}, body=i))
        link.advance()
        pump(engine, server, 2)
    pump(engine, server)
    assert [(m.correlation_id, m.body) for m in got] == [(f"c{i}", i) for i in range(10)]
    assert got[0].properties == {"statusCode": 200}
    assert d.remote_state == Delivery.ACCEPTED
