"""The client side of a cluster connection: a sans-IO Proton client engine.

A cluster node is an ordinary AMQP 1.0 client of each of its peers (issue 15, GROUPING
section 7): this module is the protocol half of that client. Like `AmqpConnection` it
never touches a socket: the net layer (`net.outbound`) feeds received bytes with
`feed`, writes what `output` returns, calls `tick` for heartbeats and `input_closed`
when the socket ends. Whenever the engine has something new to send it calls
`on_dirty` so the net layer's writer wakes up.

The cluster layer (above net) must not import proton, so everything it needs is here
in plain Python: `PeerSender.send(bytes, on_outcome)` (outcome names "accepted",
"rejected", "released", "modified", or "lost" when the connection ended first),
`PeerReceiver` delivering decoded `PeerMessage`s, and `encode_message` /
`wrap_forward` / `unwrap_forward` for management requests and forwarded messages.

Forwarded messages travel in an envelope: an AMQP message whose single data section
is the original message, byte for byte, and whose message annotations carry the target
queue (`x-opt-amqbroker-target`) and the bridge duplicate id
(`x-opt-amqbroker-bridge-id`, entry node id + boot id + per-bridge sequence). The
receiving node unwraps it, so consumers get exactly the bytes the producer sent.

Invariants: every outcome callback is called exactly once (on the peer's outcome, or
with "lost" from `input_closed` / `abort`); callbacks run synchronously inside
`feed`/`input_closed`, never re-entrantly from `send`.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import proton
from proton import Collector, Connection, Delivery, Endpoint, Event, Link, Message, Transport

log = logging.getLogger(__name__)

BRIDGE_ID = "x-opt-amqbroker-bridge-id"
BRIDGE_TARGET = "x-opt-amqbroker-target"

_OUTCOMES: dict[int, str] = {
    Delivery.ACCEPTED: "accepted",
    Delivery.REJECTED: "rejected",
    Delivery.RELEASED: "released",
    Delivery.MODIFIED: "modified",
}


@dataclass
class PeerMessage:
    """A decoded message received on a cluster connection."""

    id: Any = None
    correlation_id: Any = None
    reply_to: str | None = None
    properties: dict[str, Any] = field(default_factory=dict)
    body: Any = None


def encode_message(
    *,
    id: Any = None,
    correlation_id: Any = None,
    reply_to: str | None = None,
    to: str | None = None,
    properties: dict[str, Any] | None = None,
    body: Any = None,
) -> bytes:
    m: Any = Message(body=body)
    if id is not None:
        m.id = id
    if correlation_id is not None:
        m.correlation_id = correlation_id
    if reply_to is not None:
        m.reply_to = reply_to
    if to is not None:
        m.address = to
    if properties:
        m.properties = dict(properties)
    return bytes(m.encode())


def decode_message(data: bytes) -> PeerMessage:
    m = Message()
    m.decode(data)
    return PeerMessage(
        id=m.id,
        correlation_id=m.correlation_id,
        reply_to=m.reply_to,
        properties=dict(m.properties or {}),
        body=m.body,
    )


def wrap_forward(data: bytes, *, bridge_id: str, target: str, durable: bool) -> bytes:
    """The envelope carrying one forwarded message to its owning node."""
    m = Message(body=data)  # bytes -> one data section
    m.durable = durable
    m.annotations = {
        proton.symbol(BRIDGE_ID): bridge_id,
        proton.symbol(BRIDGE_TARGET): target,
    }
    return bytes(m.encode())


def unwrap_forward(data: bytes) -> tuple[str, str, bytes]:
    """(bridge id, target queue, original bytes); ValueError when not an envelope."""
    m = Message()
    try:
        m.decode(data)
    except Exception as exc:
        raise ValueError(f"undecodable forwarded message: {exc}") from exc
    ann = {str(k): v for k, v in (m.annotations or {}).items()}
    bid = ann.get(BRIDGE_ID)
    target = ann.get(BRIDGE_TARGET)
    body = m.body
    if isinstance(body, memoryview | bytearray):
        body = bytes(body)
    if not isinstance(bid, str) or not isinstance(target, str) or not isinstance(body, bytes):
        raise ValueError(
            f"a forwarded message needs the {BRIDGE_ID} and {BRIDGE_TARGET} annotations "
            "and the original message as its data section"
        )
    return bid, target, body


class PeerSender:
    def __init__(self, engine: PeerEngine, link: Link) -> None:
        self.engine = engine
        self.link = link
        self._tags = itertools.count(1)
        self.on_credit: Callable[[], None] | None = None

    @property
    def credit(self) -> int:
        return int(self.link.credit) if self.opened else 0

    @property
    def opened(self) -> bool:
        return bool(self.link.state & Endpoint.REMOTE_ACTIVE) and not (
            self.link.state & Endpoint.REMOTE_CLOSED
        )

    def send(self, data: bytes, on_outcome: Callable[[str, str], None] | None = None) -> None:
        d = self.link.delivery(str(next(self._tags)))
        self.link.send(data)
        self.link.advance()
        if on_outcome is not None:
            self.engine._outcomes[d] = on_outcome
        else:
            d.settle()
        self.engine.mark_dirty()


class PeerReceiver:
    def __init__(
        self, engine: PeerEngine, link: Link, on_message: Callable[[PeerMessage], None]
    ) -> None:
        self.engine = engine
        self.link = link
        self.on_message = on_message
        self.credit_window = 100

    @property
    def address(self) -> str | None:
        src = self.link.remote_source
        return src.address if src is not None else None

    @property
    def opened(self) -> bool:
        return bool(self.link.state & Endpoint.REMOTE_ACTIVE) and not (
            self.link.state & Endpoint.REMOTE_CLOSED
        )


class PeerEngine:
    """One outbound AMQP connection to a peer node (SASL PLAIN or ANONYMOUS)."""

    def __init__(
        self,
        *,
        container_id: str,
        user: str = "",
        password: str = "",
        idle_timeout: float = 0.0,
        on_dirty: Callable[[], None] | None = None,
        on_event: Callable[[], None] | None = None,
    ) -> None:
        self.on_dirty = on_dirty
        #: called after any state change (link opened, connection opened/closed)
        self.on_event = on_event
        t = Transport()
        if idle_timeout > 0:
            t.idle_timeout = idle_timeout
        sasl = t.sasl()
        sasl.allowed_mechs("PLAIN" if user else "ANONYMOUS")
        sasl.allow_insecure_mechs = True
        c = Connection()
        c.container = container_id
        if user:
            c.user = user
            c.password = password
        coll = Collector()
        c.collect(coll)
        t.bind(c)
        self.transport = t
        self.conn = c
        self.collector = coll
        self._outcomes: dict[Delivery, Callable[[str, str], None]] = {}
        self._senders: dict[Link, PeerSender] = {}
        self._receivers: dict[Link, PeerReceiver] = {}
        self.ended = False
        c.open()
        self.session = c.session()
        self.session.open()

    # ----------------------------------------------------------------- state
    @property
    def opened(self) -> bool:
        return bool(self.conn.state & Endpoint.REMOTE_ACTIVE) and not self.closed_by_peer

    @property
    def closed_by_peer(self) -> bool:
        return bool(self.conn.state & Endpoint.REMOTE_CLOSED)

    @property
    def error(self) -> str:
        cond = self.conn.remote_condition or self.transport.condition
        if cond is None:
            return ""
        return f"{cond.name}: {cond.description}"

    def mark_dirty(self) -> None:
        if self.on_dirty is not None:
            self.on_dirty()

    # ----------------------------------------------------------------- links
    def sender(self, address: str, name: str) -> PeerSender:
        link = self.session.sender(name)
        link.target.address = address
        link.source.address = name
        link.open()
        s = PeerSender(self, link)
        self._senders[link] = s
        self.mark_dirty()
        return s

    def receiver(
        self,
        on_message: Callable[[PeerMessage], None],
        name: str,
        *,
        address: str | None = None,
        credit: int = 100,
    ) -> PeerReceiver:
        """A receiver; without an address it is dynamic (a temporary queue on the
        peer, deleted with the link), the reply-to of management requests."""
        link = self.session.receiver(name)
        if address is None:
            link.source.dynamic = True
        else:
            link.source.address = address
        link.open()
        link.flow(credit)
        r = PeerReceiver(self, link, on_message)
        r.credit_window = credit
        self._receivers[link] = r
        self.mark_dirty()
        return r

    # ------------------------------------------------------------------- I/O
    def feed(self, data: bytes) -> None:
        while data:
            cap = self.transport.capacity()
            if cap <= 0:
                break
            self.transport.push(data[:cap])
            data = data[cap:]
            self.process()
        self.process()

    def output(self) -> bytes:
        try:
            p = self.transport.pending()
        except proton.ProtonException:
            return b""
        if p <= 0:
            return b""
        out = bytes(self.transport.peek(p) or b"")
        self.transport.pop(p)
        return out

    def tick(self, now: float) -> float:
        """Heartbeats / idle timeout; returns the next deadline (trio seconds, 0 = none)."""
        nxt = float(self.transport.tick(now))
        self.process()
        return nxt

    def close(self) -> None:
        if not self.ended:
            self.conn.close()
            self.mark_dirty()

    def input_closed(self) -> None:
        """The socket ended: every pending outcome becomes "lost"."""
        if self.ended:
            return
        try:
            self.transport.close_tail()
            self.transport.close_head()
        except proton.ProtonException:
            pass
        self.process()
        self.ended = True
        outcomes = list(self._outcomes.values())
        self._outcomes.clear()
        for cb in outcomes:
            cb("lost", "the cluster connection ended before the peer settled the message")
        if self.on_event is not None:
            self.on_event()

    # ---------------------------------------------------------------- events
    def process(self) -> None:
        changed = False
        while True:
            ev = self.collector.peek()
            if ev is None:
                break
            t = ev.type
            if t == Event.DELIVERY:
                self._on_delivery(ev.link, ev.delivery)
            elif t == Event.LINK_FLOW:
                s = self._senders.get(ev.link)  # type: ignore[arg-type]
                if s is not None and s.on_credit is not None:
                    s.on_credit()
            elif t in (
                Event.CONNECTION_REMOTE_OPEN,
                Event.CONNECTION_REMOTE_CLOSE,
                Event.LINK_REMOTE_OPEN,
                Event.LINK_REMOTE_CLOSE,
                Event.LINK_REMOTE_DETACH,
                Event.TRANSPORT_ERROR,
                Event.TRANSPORT_CLOSED,
            ):
                changed = True
                if t == Event.CONNECTION_REMOTE_CLOSE and not (
                    self.conn.state & Endpoint.LOCAL_CLOSED
                ):
                    self.conn.close()
                    self.mark_dirty()
            self.collector.pop()
        if changed and self.on_event is not None:
            self.on_event()

    def _on_delivery(self, link: Any, d: Any) -> None:
        if link.is_sender:
            if not (d.remote_state or d.remote_settled):
                return
            cb = self._outcomes.pop(d, None)
            outcome = _OUTCOMES.get(int(d.remote_state), "settled")
            desc = ""
            if d.remote_state == Delivery.REJECTED:
                cond = d.remote.condition
                desc = f"{cond.name}: {cond.description}" if cond is not None else ""
            d.settle()
            self.mark_dirty()
            if cb is not None:
                cb(outcome, desc)
            s = self._senders.get(link)
            if s is not None and s.on_credit is not None:
                s.on_credit()
            return
        if not d.readable or d.partial:
            return
        raw = link.recv(d.pending)
        link.advance()
        d.update(Delivery.ACCEPTED)
        d.settle()
        r = self._receivers.get(link)
        if r is not None:
            if link.credit < r.credit_window // 2:
                link.flow(r.credit_window - link.credit)
            try:
                msg = decode_message(raw)
            except Exception as exc:
                log.warning("undecodable message on a cluster connection: %s", exc)
            else:
                r.on_message(msg)
        self.mark_dirty()
