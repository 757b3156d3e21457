"""Engine tests: Proton client engines pumped in memory against our `AmqpConnection`.

No sockets and no trio: a core `Broker` with an injected clock, one server-side
`AmqpConnection` per client, and a Proton client `Transport` + `Connection` for each.
`Harness.pump` moves bytes both ways until nothing moves (client output -> `feed`,
`output` -> client `push`, then `consumed` and `flushed`, as the net layer does).

Every scenario runs twice, once moving whole buffers and once one byte at a time (the
h11 habit from ARCHITECTURE.md), and both runs must produce the same trace: the same
deliveries in the same order with the same delivery-counts, outcomes and conditions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import proton
from proton import Delivery, Disposition, Endpoint, Link, Message, Terminus

from amqbroker.core.address_settings import AddressSettings, AddressSettingsRepository
from amqbroker.core.auth import Authenticator
from amqbroker.core.broker import Broker
from amqbroker.core.timers import Timers
from amqbroker.protocol.connection import AmqpConnection, ConnectionLimits

CHUNKINGS: tuple[int | None, ...] = (None, 1)
MAX_PUMP_ROUNDS = 100_000


@dataclass
class Got:
    """One delivery as the client engine saw it."""

    body: Any
    delivery_count: int
    settled: bool
    raw: bytes
    delivery: Delivery
    message: Message

    def key(self) -> tuple[Any, int, bool]:
        return (self.body, self.delivery_count, self.settled)


@dataclass
class Rcv:
    link: Link
    got: list[Got] = field(default_factory=list)

    def take(self) -> list[Got]:
        out = self.got
        self.got = []
        return out


class Peer:
    """One client engine and the broker's server-side connection for it."""

    def __init__(
        self,
        h: Harness,
        name: str,
        *,
        sasl: bool = True,
        limits: ConnectionLimits | None = None,
        client_max_frame: int | None = None,
    ) -> None:
        self.h = h
        self.name = name
        self.server = AmqpConnection(
            h.broker,
            limits=limits or ConnectionLimits(),
            auth=Authenticator({}, require_auth=False),
            conn_id=name,
        )
        self.transport = proton.Transport()
        if client_max_frame is not None:
            self.transport.max_frame_size = client_max_frame
        if sasl:
            s = self.transport.sasl()
            s.allowed_mechs("ANONYMOUS")
        self.conn = proton.Connection()
        self.conn.container = f"client-{name}"
        self.transport.bind(self.conn)
        self.conn.open()
        self.session = self.conn.session()
        self.session.open()
        self.receivers: list[Rcv] = []
        self._tags = 0
        self.client_eos = False
        self.server_eos = False
        self.gone = False
        #: every byte the broker sent to this client, to inspect frames on the wire
        self.wire = bytearray()

    # ------------------------------------------------------------ links
    def sender(
        self,
        address: str | None,
        *,
        presettled: bool = False,
        dynamic: bool = False,
        capabilities: list[str] | None = None,
        name: str | None = None,
        session: Any = None,
    ) -> Link:
        link = (session or self.session).sender(name or f"{self.name}-s{self._next()}")
        if address is not None:
            link.target.address = address
        link.target.dynamic = dynamic
        if capabilities:
            _put_symbols(link.target.capabilities, capabilities)
        if presettled:
            link.snd_settle_mode = Link.SND_SETTLED
        link.open()
        return link

    def receiver(
        self,
        address: str | None,
        *,
        credit: int = 0,
        presettled: bool = False,
        dynamic: bool = False,
        capabilities: list[str] | None = None,
        name: str | None = None,
    ) -> Rcv:
        link = self.session.receiver(name or f"{self.name}-r{self._next()}")
        if address is not None:
            link.source.address = address
        link.source.dynamic = dynamic
        if capabilities:
            _put_symbols(link.source.capabilities, capabilities)
        if presettled:
            link.snd_settle_mode = Link.SND_SETTLED
        link.open()
        if credit:
            link.flow(credit)
        r = Rcv(link)
        self.receivers.append(r)
        return r

    def _next(self) -> int:
        self._tags += 1
        return self._tags

    def send(self, link: Link, msg: Message | bytes) -> Delivery:
        raw = msg if isinstance(msg, bytes) else bytes(msg.encode())
        d = link.delivery(f"t{self._next()}")
        link.send(raw)
        link.advance()
        if link.snd_settle_mode == Link.SND_SETTLED:
            d.settle()
        return d

    # ------------------------------------------------------------ pumping
    def client_to_server(self, chunk: int | None) -> bool:
        if self.client_eos or self.gone:
            return False
        n = self.transport.pending()
        if n < 0:
            self.client_eos = True
            self.server.input_closed()
            return True
        if n == 0:
            return False
        data = self.transport.peek(n)
        self.transport.pop(n)
        if chunk is None:
            self.server.feed(data)
        else:
            for i in range(0, len(data), chunk):
                self.server.feed(data[i : i + chunk])
        return True

    def server_to_client(self, chunk: int | None) -> bool:
        if self.gone:
            return False
        srv = self.server
        srv.process()
        moved = False
        while True:
            out = srv.output()
            if out is None:
                if not self.server_eos:
                    self.server_eos = True
                    self.transport.close_tail()
                    moved = True
                break
            if not out:
                break
            k = len(out) if chunk is None else min(chunk, len(out))
            k = min(k, self.transport.capacity())
            if k <= 0:
                break
            data = bytes(out[:k])
            self.wire += data
            self.transport.push(data)
            srv.consumed(k)
            moved = True
        srv.flushed()
        return moved

    def attaches_from_broker(self) -> dict[str, list[Any]]:
        """The fields of every attach performative the broker sent, by link name."""
        out: dict[str, list[Any]] = {}
        for desc, fields in performatives(bytes(self.wire)):
            if desc == ATTACH:
                out[str(fields[0])] = fields
        return out

    def collect(self) -> None:
        for r in self.receivers:
            link = r.link
            while True:
                d = link.current
                if d is None or not d.readable or d.partial:
                    break
                raw = link.recv(d.pending)
                link.advance()
                m = Message()
                m.decode(raw)
                r.got.append(Got(m.body, m.delivery_count, d.settled, raw, d, m))


class Harness:
    def __init__(
        self,
        chunk: int | None,
        *,
        address_settings: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        self.chunk = chunk
        self.now = 1_700_000_000.0
        repo = None
        if address_settings is not None:
            repo = AddressSettingsRepository(
                {k: AddressSettings(**v) for k, v in address_settings.items()}
            )
        self.broker = Broker(address_settings=repo, clock=lambda: self.now, timers=Timers())
        self.peers: list[Peer] = []

    def peer(self, name: str, **kw: Any) -> Peer:
        p = Peer(self, name, **kw)
        self.peers.append(p)
        return p

    def pump(self) -> None:
        for _ in range(MAX_PUMP_ROUNDS):
            moved = False
            for p in self.peers:
                moved |= p.client_to_server(self.chunk)
                moved |= p.server_to_client(self.chunk)
            self.broker.timers.run_due(self.now)
            while self.broker.run_deferred():
                pass
            if not moved:
                for p in self.peers:
                    p.collect()
                return
        raise AssertionError("the engines kept exchanging bytes: no quiescence")

    def advance(self, seconds: float) -> None:
        self.now += seconds
        self.pump()


Scenario = Callable[[Harness], Any]


def run_both(scenario: Scenario, **harness_kw: Any) -> Any:
    """Run a scenario with whole buffers and with 1-byte chunks; same trace expected."""
    traces = [scenario(Harness(chunk, **harness_kw)) for chunk in CHUNKINGS]
    assert traces[0] == traces[1], f"whole buffers: {traces[0]!r}\n1-byte chunks: {traces[1]!r}"
    return traces[0]


ATTACH = 0x12
ATTACH_SOURCE = 5
ATTACH_TARGET = 6


def performatives(buf: bytes) -> list[tuple[int, list[Any]]]:
    """(descriptor, fields) of every AMQP performative in a byte stream that starts
    with protocol headers (SASL frames and empty frames are skipped)."""
    out: list[tuple[int, list[Any]]] = []
    p = 0
    while p + 8 <= len(buf):
        if buf[p : p + 4] == b"AMQP":
            p += 8
            continue
        size = int.from_bytes(buf[p : p + 4], "big")
        doff = buf[p + 4]
        ftype = buf[p + 5]
        body = buf[p + doff * 4 : p + size]
        p += size
        if ftype != 0 or not body:
            continue
        d = proton.Data()
        d.decode(body)
        d.rewind()
        d.next()
        obj = d.get_object()
        out.append((int(obj.descriptor), list(obj.value)))
    return out


def _put_symbols(data: Any, names: list[str]) -> None:
    data.put_array(False, proton.Data.SYMBOL)
    data.enter()
    for n in names:
        data.put_symbol(n)
    data.exit()


def settle(d: Delivery, state: Any, *, failed: bool = False, undeliverable: bool = False) -> None:
    if state == Disposition.MODIFIED:
        d.local.failed = failed
        d.local.undeliverable = undeliverable
    d.update(state)
    d.settle()


def cond(endpoint: Any) -> tuple[str | None, str | None]:
    c = endpoint.remote_condition
    return (c.name, c.description) if c is not None else (None, None)


def bodies(gots: list[Got]) -> list[Any]:
    return [g.body for g in gots]


# ---------------------------------------------------------------------------- scenarios


def test_open_negotiates_container_capabilities_frame_size_and_channel_max() -> None:
    limits = ConnectionLimits(max_frame_size=4096, channel_max=7)

    def scenario(h: Harness) -> Any:
        with_sasl = h.peer("a", limits=limits)
        without_sasl = h.peer("b", sasl=False, limits=limits)
        h.pump()
        out = []
        for p in (with_sasl, without_sasl):
            assert p.conn.state & Endpoint.REMOTE_ACTIVE, p.name
            assert p.conn.remote_container == "amqbroker"
            caps = [str(c) for c in (p.conn.remote_offered_capabilities or [])]
            assert "ANONYMOUS-RELAY" in caps
            assert p.transport.remote_max_frame_size == 4096
            assert p.transport.remote_channel_max == 7
            assert p.session.state & Endpoint.REMOTE_ACTIVE
            assert p.server.opened
            assert p.server.remote_container == f"client-{p.name}"
            out.append(
                (
                    p.conn.remote_container,
                    caps,
                    p.transport.remote_max_frame_size,
                    p.transport.remote_channel_max,
                )
            )
        return out

    run_both(scenario)


def test_transfer_credit_and_accept_forward_bytes_unchanged() -> None:
    big = "x" * 20_000  # several frames at max-frame-size 4096, in both directions

    def scenario(h: Harness) -> Any:
        small = ConnectionLimits(max_frame_size=4096)
        # multi-frame both ways: the broker takes 4096-byte frames, this consumer too
        prod = h.peer("p", limits=small)
        cons = h.peer("c", limits=small, client_max_frame=4096)
        s = prod.sender("q")
        h.pump()
        assert s.credit > 0
        msgs = [Message(body=f"m{i}", id=f"id-{i}", durable=(i % 2 == 0)) for i in range(5)]
        msgs.append(Message(body=big, properties={"k": "v"}))
        raws = [bytes(m.encode()) for m in msgs]
        ds = [prod.send(s, raw) for raw in raws]
        h.pump()
        assert [d.remote_state for d in ds] == [Delivery.ACCEPTED] * 6
        assert all(d.settled for d in ds)
        q = h.broker.queues["q"]
        assert q.count == 6

        r = cons.receiver("q", credit=2)
        h.pump()
        first = r.take()
        assert bodies(first) == ["m0", "m1"]  # credit 2: no more
        assert r.link.credit == 0
        r.link.flow(10)
        h.pump()
        rest = r.take()
        got = first + rest
        assert bodies(got) == [f"m{i}" for i in range(5)] + [big]
        assert [g.raw for g in got] == raws  # forwarded as received
        assert cons.transport.remote_max_frame_size == 4096
        assert q.inflight == 6
        for g in got:
            settle(g.delivery, Delivery.ACCEPTED)
        h.pump()
        assert q.count == 0
        assert q.inflight == 0
        return [g.key() for g in got], [str(d.remote_state) for d in ds]

    run_both(scenario)


def test_four_outcomes_and_undeliverable_here() -> None:
    def scenario(h: Harness) -> Any:
        prod = h.peer("p")
        a = h.peer("a")
        s = prod.sender("q")
        h.pump()
        for i in range(4):
            prod.send(s, Message(body=f"m{i}"))
        h.pump()
        q = h.broker.queues["q"]
        ra = a.receiver("q", credit=4)
        h.pump()
        g = ra.take()
        assert bodies(g) == ["m0", "m1", "m2", "m3"]
        settle(g[0].delivery, Delivery.ACCEPTED)
        settle(g[1].delivery, Delivery.REJECTED)
        settle(g[2].delivery, Delivery.RELEASED)
        settle(g[3].delivery, Disposition.MODIFIED, failed=True)
        h.pump()
        # accepted gone, rejected dropped (no dead-letter address), two back in the queue
        assert q.count == 2
        assert h.broker.dropped_dead_letters == 1
        assert ra.link.credit == 0
        assert ra.take() == []  # no credit: nothing redelivered yet
        ra.link.flow(2)
        h.pump()
        again = ra.take()
        # back at their positions; released keeps delivery-count, delivery-failed adds one
        assert [g.key() for g in again] == [("m2", 0, False), ("m3", 1, False)]
        settle(again[1].delivery, Delivery.ACCEPTED)
        # undeliverable-here: not redelivered to this consumer even though it has credit
        ra.link.flow(5)
        settle(again[0].delivery, Disposition.MODIFIED, undeliverable=True)
        h.pump()
        assert ra.take() == []
        assert q.count == 1
        b = h.peer("b")
        rb = b.receiver("q", credit=5)
        h.pump()
        gb = rb.take()
        assert [x.key() for x in gb] == [("m2", 0, False)]
        assert ra.take() == []
        settle(gb[0].delivery, Delivery.ACCEPTED)
        h.pump()
        assert q.count == 0
        assert q.inflight == 0
        return [x.key() for x in g + again + gb]

    run_both(scenario)


def test_drain_completes_with_zero_credit() -> None:
    def scenario(h: Harness) -> Any:
        prod = h.peer("p")
        cons = h.peer("c")
        s = prod.sender("q")
        r = cons.receiver("q")
        h.pump()
        for i in range(2):
            prod.send(s, Message(body=f"m{i}"))
        h.pump()
        # fewer messages than credit
        r.link.drain(5)
        h.pump()
        got = r.take()
        assert bodies(got) == ["m0", "m1"]
        assert r.link.credit == 0
        assert not r.link.draining()
        # empty queue
        r.link.drain(3)
        h.pump()
        assert r.take() == []
        assert r.link.credit == 0
        assert not r.link.draining()
        # the broker really has no credit left: a new message waits
        prod.send(s, Message(body="late"))
        h.pump()
        assert r.take() == []
        r.link.flow(1)
        h.pump()
        late = r.take()
        assert bodies(late) == ["late"]
        return [x.key() for x in got + late]

    run_both(scenario)


def _returns_unsettled(how: str) -> Scenario:
    def scenario(h: Harness) -> Any:
        prod = h.peer("p")
        a = h.peer("a")
        s = prod.sender("q")
        h.pump()
        for i in range(5):
            prod.send(s, Message(body=f"m{i}"))
        h.pump()
        ra = a.receiver("q", credit=3)
        h.pump()
        assert bodies(ra.take()) == ["m0", "m1", "m2"]
        q = h.broker.queues["q"]
        assert q.inflight == 3
        if how == "close":
            ra.link.close()
        elif how == "detach":
            ra.link.detach()
        elif how == "session-end":
            a.session.close()
        elif how == "connection-close":
            a.conn.close()
        elif how == "abort":
            a.server.abort()
            a.gone = True
        h.pump()
        assert q.inflight == 0
        assert q.count == 5
        assert a.server.links == {}
        if how in ("connection-close", "abort"):
            assert a.server.open_sessions == 0
        b = h.peer("b")
        rb = b.receiver("q", credit=10)
        h.pump()
        got = rb.take()
        # back at their positions, first in line; a lost connection counts a failed
        # delivery attempt, a clean detach/end/close does not (Artemis, commit 1896b16)
        n = 1 if how == "abort" else 0
        assert [x.key() for x in got] == [
            ("m0", n, False),
            ("m1", n, False),
            ("m2", n, False),
            ("m3", 0, False),
            ("m4", 0, False),
        ]
        return [x.key() for x in got]

    return scenario


def test_link_close_returns_unsettled_in_order() -> None:
    run_both(_returns_unsettled("close"))


def test_link_detach_returns_unsettled_in_order() -> None:
    run_both(_returns_unsettled("detach"))


def test_session_end_returns_unsettled_in_order() -> None:
    run_both(_returns_unsettled("session-end"))


def test_connection_close_returns_unsettled_in_order() -> None:
    run_both(_returns_unsettled("connection-close"))


def test_connection_abort_returns_unsettled_in_order() -> None:
    run_both(_returns_unsettled("abort"))


def test_presettled_producer_and_consumer() -> None:
    def scenario(h: Harness) -> Any:
        prod = h.peer("p")
        cons = h.peer("c")
        s = prod.sender("q", presettled=True)
        h.pump()
        assert s.remote_snd_settle_mode == Link.SND_SETTLED
        for i in range(3):
            prod.send(s, Message(body=f"m{i}"))
        h.pump()
        q = h.broker.queues["q"]
        assert q.count == 3
        r = cons.receiver("q", credit=10, presettled=True)
        h.pump()
        assert r.link.remote_snd_settle_mode == Link.SND_SETTLED
        got = r.take()
        assert [x.key() for x in got] == [("m0", 0, True), ("m1", 0, True), ("m2", 0, True)]
        # settled on delivery: nothing in flight, nothing left
        assert q.inflight == 0
        assert q.count == 0
        return [x.key() for x in got]

    run_both(scenario)


def test_refusals_carry_conditions_and_null_terminus() -> None:
    off = {"#": {"auto_create_addresses": False, "auto_create_queues": False}}

    def scenario(h: Harness) -> Any:
        h.broker.create_address("orders", "anycast")
        h.broker.create_address("news", "multicast")
        p = h.peer("p")
        r_missing = p.receiver("missing", credit=1)
        s_missing = p.sender("missing")
        coord = p.session.sender("coordinator-1")
        coord.target.type = Terminus.COORDINATOR
        # local transactions are supported (test_transactions.py); distributed are not
        _put_symbols(coord.target.capabilities, ["amqp:distributed-transactions"])
        coord.open()
        r_topic_on_queue = p.receiver("orders", credit=1, capabilities=["topic"])
        r_queue_on_topic = p.receiver("news", credit=1, capabilities=["queue"])
        s_topic_on_queue = p.sender("orders", capabilities=["topic"])
        h.pump()
        out = []
        for link, want in (
            (r_missing.link, "amqp:not-found"),
            (s_missing, "amqp:not-found"),
            (coord, "amqp:not-implemented"),
            (r_topic_on_queue.link, "amqp:precondition-failed"),
            (r_queue_on_topic.link, "amqp:precondition-failed"),
            (s_topic_on_queue, "amqp:precondition-failed"),
        ):
            assert link.state & Endpoint.REMOTE_CLOSED, link.name
            name, desc = cond(link)
            assert name == want, (link.name, name, desc)
            assert desc, link.name
            out.append((link.name, name))
        # refused the way Qpid JMS expects (JMS.md): the broker's attach carries a null
        # source for a consumer, a null target for a producer (checked on the wire:
        # Proton reports an empty terminus as UNSPECIFIED too)
        attaches = p.attaches_from_broker()
        for link in (r_missing.link, r_topic_on_queue.link, r_queue_on_topic.link):
            assert attaches[link.name][ATTACH_SOURCE] is None, (link.name, attaches[link.name])
        for link in (s_missing, coord, s_topic_on_queue):
            assert attaches[link.name][ATTACH_TARGET] is None, (link.name, attaches[link.name])
        assert p.server.links == {}
        assert "missing" not in h.broker.queues
        assert "missing" not in h.broker.addresses
        return out

    run_both(scenario, address_settings=off)


def test_session_and_link_limits() -> None:
    limits = ConnectionLimits(max_sessions=2, max_links=2)

    def scenario(h: Harness) -> Any:
        p = h.peer("p", limits=limits)
        ssn2 = p.conn.session()
        ssn2.open()
        ssn3 = p.conn.session()
        ssn3.open()
        h.pump()
        assert ssn2.state & Endpoint.REMOTE_ACTIVE
        assert ssn3.state & Endpoint.REMOTE_CLOSED
        sname, sdesc = cond(ssn3)
        assert sname == "amqp:resource-limit-exceeded"
        assert sdesc is not None and "max_sessions_per_connection" in sdesc
        l1 = p.sender("a")
        l2 = p.receiver("a", credit=1)
        l3 = p.sender("b", session=ssn2)
        h.pump()
        assert l1.state & Endpoint.REMOTE_ACTIVE
        assert l2.link.state & Endpoint.REMOTE_ACTIVE
        assert l3.state & Endpoint.REMOTE_CLOSED
        lname, ldesc = cond(l3)
        assert lname == "amqp:resource-limit-exceeded"
        assert ldesc is not None and "max_links_per_connection" in ldesc
        # closing a link makes room again
        l1.close()
        h.pump()
        l4 = p.sender("c")
        h.pump()
        assert l4.state & Endpoint.REMOTE_ACTIVE
        assert p.server.open_links == 2
        return [sname, lname]

    run_both(scenario)


def test_anonymous_relay_routes_per_message() -> None:
    def scenario(h: Harness) -> Any:
        p = h.peer("p")
        s = p.sender(None)
        h.pump()
        assert s.state & Endpoint.REMOTE_ACTIVE
        assert s.credit > 0
        d1 = p.send(s, Message(address="r1", body="to-r1"))
        d2 = p.send(s, Message(address="r2", body="to-r2"))
        d3 = p.send(s, Message(body="nowhere"))
        h.pump()
        assert d1.remote_state == Delivery.ACCEPTED
        assert d2.remote_state == Delivery.ACCEPTED
        assert d3.remote_state == Delivery.REJECTED
        c = d3.remote.condition
        assert c is not None and c.description
        assert h.broker.queues["r1"].count == 1
        assert h.broker.queues["r2"].count == 1
        c1 = h.peer("c")
        r1 = c1.receiver("r1", credit=5)
        r2 = c1.receiver("r2", credit=5)
        h.pump()
        return bodies(r1.take()), bodies(r2.take()), c.name

    assert run_both(scenario) == (["to-r1"], ["to-r2"], "amqp:precondition-failed")


def test_ttl_expired_messages_never_delivered() -> None:
    def scenario(h: Harness) -> Any:
        p = h.peer("p")
        s = p.sender("q")
        h.pump()
        p.send(s, Message(body="short", ttl=1.0))
        p.send(s, Message(body="long", ttl=100.0))
        p.send(s, Message(body="forever"))
        p.send(s, Message(body="abs", expiry_time=h.now + 1.0))
        h.pump()
        h.advance(2.0)
        c = h.peer("c")
        r = c.receiver("q", credit=10)
        h.pump()
        got = r.take()
        assert bodies(got) == ["long", "forever"]
        return bodies(got)

    run_both(scenario)


def test_dynamic_receiver_queue_deleted_on_close() -> None:
    def scenario(h: Harness) -> Any:
        c = h.peer("c")
        r = c.receiver(None, dynamic=True, credit=5)
        h.pump()
        addr = r.link.remote_source.address
        assert addr
        assert addr in h.broker.queues
        assert h.broker.queues[addr].temporary
        p = h.peer("p")
        s = p.sender(addr)
        h.pump()
        p.send(s, Message(body="reply"))
        h.pump()
        got = r.take()
        assert bodies(got) == ["reply"]
        settle(got[0].delivery, Delivery.ACCEPTED)
        r.link.close()
        h.pump()
        assert addr not in h.broker.queues
        return bodies(got)

    run_both(scenario)


def test_maps_empty_after_everyone_leaves() -> None:
    def scenario(h: Harness) -> Any:
        p = h.peer("p")
        c = h.peer("c")
        s = p.sender("q")
        s2 = p.sender(None)
        r = c.receiver("q", credit=3)
        rt = c.receiver("t", credit=3, capabilities=["topic"])
        rd = c.receiver(None, dynamic=True, credit=3)
        h.pump()
        for i in range(5):
            p.send(s, Message(body=f"m{i}"))
        p.send(s2, Message(address="t", body="topic"))
        h.pump()
        assert len(r.take()) == 3
        assert len(rt.take()) == 1
        assert rd.link.state & Endpoint.REMOTE_ACTIVE
        # consumer leaves with unsettled messages, producer closes cleanly
        c.server.abort()
        c.gone = True
        p.conn.close()
        h.pump()
        for peer in (p, c):
            assert peer.server.links == {}
            assert peer.server.open_sessions == 0
            assert peer.server.unsettled_count == 0
        b = h.broker
        assert all(q.consumer_count == 0 for q in b.queues.values())
        assert all(q.inflight == 0 for q in b.queues.values())
        assert not [q for q in b.queues.values() if q.temporary]
        assert all(a.producers == 0 for a in b.addresses.values())
        assert all(not a.blocked_producers for a in b.addresses.values())
        assert b.queues["q"].count == 5
        return sorted(b.queues)

    assert run_both(scenario) == ["q"]
