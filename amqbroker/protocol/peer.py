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
(`x-opt-amqbroker-bridge-id`, entry node id + boot id + per-bridge sequence); a header
says durable for a durable message. The receiving node unwraps it, so consumers get
exactly the bytes the producer sent. Both ends work on bytes (issue 20: proton's
encode + decode of the envelope cost ~50 us per forwarded message): `wrap_forward`
concatenates the few prefixes, `unwrap_forward` checks the exact layout it writes and
slices the original bytes out, falling back to a framed walk of the sections
(`scanner.annotated_body`) for any other encoding of the same envelope, such as the
amqp-value binary that earlier versions let proton write.

Transfers, dispositions and flow of the cluster links go through the cffi layer
(`fastpath`, ARCHITECTURE decision 1) like the broker's own connections; the object
API only opens and closes things. A sender's `on_credit` runs once per batch of input,
after all its dispositions were handled.

Invariants: every outcome callback is called exactly once (on the peer's outcome, or
with "lost" from `input_closed` / `abort`); callbacks run synchronously inside
`feed`/`input_closed`, never re-entrantly from `send`.
"""

from __future__ import annotations

import functools
import logging
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import proton
from proton import Collector, Connection, Delivery, Endpoint, Event, Link, Transport

from amqbroker.protocol import amqp_message
from amqbroker.protocol import fastpath as fp
from amqbroker.protocol.scanner import ScanError, annotated_body

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


#: the bytes of a message to a peer (`amqp_message.encode`, proton for the rare value it
#: does not write)
encode_message = functools.partial(amqp_message.encode, proton_fallback=True)


def decode_message(data: bytes) -> PeerMessage:
    m = amqp_message.decode_any(data)
    return PeerMessage(
        id=m.id,
        correlation_id=m.correlation_id,
        reply_to=m.reply_to,
        properties=dict(m.properties or {}),
        body=m.body,
    )


# The envelope, encoded by hand (proton.Message.encode/decode cost ~25 us each: ARCHITECTURE
# decision 2). header {durable: true} only for a durable message (a missing header
# reads as non-durable); message-annotations map {bridge id, target}; one data section
# holding the original bytes.
_HEADER_DURABLE = b"\x00\x53\x70\xc0\x02\x01\x41"
_MA_BRIDGE_ID = b"\xa3" + bytes((len(BRIDGE_ID),)) + BRIDGE_ID.encode()
_MA_TARGET = b"\xa3" + bytes((len(BRIDGE_TARGET),)) + BRIDGE_TARGET.encode()
_ENVELOPE_KEYS = (BRIDGE_ID.encode(), BRIDGE_TARGET.encode())
_PACK_U32 = struct.Struct(">I").pack
_PACK_SIZE_COUNT = struct.Struct(">II").pack
_U32 = struct.Struct(">I").unpack_from


def _str(raw: bytes) -> bytes:
    n = len(raw)
    return (b"\xa1" + bytes((n,)) if n < 0x100 else b"\xb1" + _PACK_U32(n)) + raw


def wrap_forward(data: bytes, *, bridge_id: str, target: str, durable: bool) -> bytes:
    """The envelope carrying one forwarded message to its owning node.

    Byte-level: the original bytes are copied once into the data section, never
    decoded. `unwrap_forward` (and `proton.Message.decode`) read it back."""
    entries = b"".join((_MA_BRIDGE_ID, _str(bridge_id.encode()), _MA_TARGET, _str(target.encode())))
    n = len(entries)
    if n < 0xFF:
        ma = b"\x00\x53\x72\xc1" + bytes((n + 1, 4)) + entries
    else:
        ma = b"\x00\x53\x72\xd1" + _PACK_SIZE_COUNT(n + 4, 4) + entries
    size = len(data)
    if size < 0x100:
        section = b"\x00\x53\x75\xa0" + bytes((size,))
    else:
        section = b"\x00\x53\x75\xb0" + _PACK_U32(size)
    if durable:
        return b"".join((_HEADER_DURABLE, ma, section, data))
    return b"".join((ma, section, data))


_N_BID = len(_MA_BRIDGE_ID)
_N_TARGET = len(_MA_TARGET)


def _unwrap_own(data: bytes) -> tuple[str, str, bytes] | None:
    """`unwrap_forward` for exactly the layout `wrap_forward` writes (map8, str8
    values, keys in its order); None for anything else (the general walk decides).
    Every offset is checked against the enclosing sizes, so a damaged envelope never
    passes: it reads as None (or ValueError for bad UTF-8)."""
    try:
        return _unwrap_layout(data)
    except IndexError:
        return None  # truncated


def _unwrap_layout(data: bytes) -> tuple[str, str, bytes] | None:
    p = 7 if data.startswith(_HEADER_DURABLE) else 0
    if not data.startswith(b"\x00\x53\x72\xc1", p) or data[p + 5 : p + 6] != b"\x04":
        return None
    map_end = p + 6 + data[p + 4] - 1
    q = p + 6
    if not data.startswith(_MA_BRIDGE_ID, q):
        return None
    q += _N_BID
    if data[q : q + 1] != b"\xa1":
        return None
    bs = q + 2
    q = bs + data[q + 1]
    if not data.startswith(_MA_TARGET, q):
        return None
    be = q
    q += _N_TARGET
    if data[q : q + 1] != b"\xa1":
        return None
    ts = q + 2
    q = ts + data[q + 1]
    if q != map_end or not data.startswith(b"\x00\x53\x75", q):
        return None
    c = data[q + 3 : q + 4]
    if c == b"\xa0":
        start = q + 5
        size = data[q + 4]
    elif c == b"\xb0" and len(data) >= q + 8:
        start = q + 8
        size = _U32(data, q + 4)[0]
    else:
        return None
    if start + size != len(data):
        return None  # more sections (a footer) or truncated: the general walk decides
    try:
        return data[bs:be].decode(), data[ts:q].decode(), data[start:]
    except UnicodeDecodeError as exc:
        raise ValueError(f"undecodable forwarded message: {exc}") from exc


def unwrap_forward(data: bytes) -> tuple[str, str, bytes]:
    """(bridge id, target queue, original bytes); ValueError when not an envelope.

    Also reads the envelopes proton encoded (earlier versions: an amqp-value binary
    body and an empty properties section). Walks the section heads and the annotations
    map only; the original bytes are sliced, not decoded."""
    fast = _unwrap_own(data)
    if fast is not None:
        return fast
    try:
        (bid, target), start, end = annotated_body(data, _ENVELOPE_KEYS)
    except ScanError as exc:
        raise ValueError(f"undecodable forwarded message: {exc}") from exc
    if bid is None or target is None:
        raise ValueError(
            f"a forwarded message needs the {BRIDGE_ID} and {BRIDGE_TARGET} annotations "
            "and the original message as its data section"
        )
    return bid, target, data[start:end]


class PeerSender:
    """A sending link. Transfers and their outcomes go through the cffi layer
    (`fastpath`): one raw delivery per message, no proton wrapper objects."""

    def __init__(self, engine: PeerEngine, link: Link) -> None:
        self.engine = engine
        self.link = link
        self.ptr = link._impl
        self.tagger = fp.Tagger()
        #: called (once per batch of input) when credit arrived or outcomes settled
        self.on_credit: Callable[[], None] | None = None

    @property
    def credit(self) -> int:
        return fp.credit(self.ptr) if self.opened else 0

    @property
    def opened(self) -> bool:
        return bool(self.link.state & Endpoint.REMOTE_ACTIVE) and not (
            self.link.state & Endpoint.REMOTE_CLOSED
        )

    def send(self, data: bytes, on_outcome: Callable[[str, str], None] | None = None) -> None:
        ptr = self.ptr
        d = _new_delivery(ptr, self.tagger.next())
        _link_send(ptr, data, len(data))
        _link_advance(ptr)
        if on_outcome is not None:
            self.engine._outcomes[d] = on_outcome
        else:
            _delivery_settle(d)
        self.engine.mark_dirty()

    def on_delivery(self, d: Any) -> None:
        """The peer's disposition of one of our transfers."""
        state = _remote_state(d)
        if not state and not _remotely_settled(d):
            return
        engine = self.engine
        cb = engine._outcomes.pop(d, None)
        desc = ""
        if state == fp.PN_REJECTED:
            cond = Delivery.wrap(d).remote.condition  # rare: the object API is fine
            desc = f"{cond.name}: {cond.description}" if cond is not None else ""
        _delivery_settle(d)
        engine.mark_dirty()
        if cb is not None:
            cb(_OUTCOMES.get(state, "settled"), desc)
        engine._credit_due.add(self)

    def on_flow(self) -> None:
        self.engine._credit_due.add(self)


class PeerReceiver:
    def __init__(
        self, engine: PeerEngine, link: Link, on_message: Callable[[PeerMessage], None]
    ) -> None:
        self.engine = engine
        self.link = link
        self.ptr = link._impl
        self.rbuf = fp.RecvBuffer(4096)
        self.on_message = on_message
        self.credit_window = 1000

    @property
    def address(self) -> str | None:
        src = self.link.remote_source
        return src.address if src is not None else None

    @property
    def opened(self) -> bool:
        return bool(self.link.state & Endpoint.REMOTE_ACTIVE) and not (
            self.link.state & Endpoint.REMOTE_CLOSED
        )

    def on_delivery(self, d: Any) -> None:
        ptr = self.ptr
        raw = self.rbuf.receive(ptr, d)
        if raw is None:
            return  # partial
        fp.accept(d)
        credit = fp.credit(ptr)
        if credit < self.credit_window // 2:
            fp.flow(ptr, self.credit_window - credit)
        self.engine.mark_dirty()
        try:
            msg = decode_message(raw)
        except Exception as exc:
            log.warning("undecodable message on a cluster connection: %s", exc)
        else:
            self.on_message(msg)

    def on_flow(self) -> None:
        pass


class PeerRawReceiver:
    """A receiver whose transfers the caller settles later: `on_transfer(bytes,
    settle)` gets each whole transfer; `settle(True)` accepts it, `settle(False)`
    rejects it, and only then is one more credit granted. So at most `credit`
    transfers are ever unsettled (the replication stream's window, issue 23)."""

    def __init__(
        self,
        engine: PeerEngine,
        link: Link,
        on_transfer: Callable[[bytes, Callable[[bool], None]], None],
    ) -> None:
        self.engine = engine
        self.link = link
        self.ptr = link._impl
        self.rbuf = fp.RecvBuffer(65536)
        self.on_transfer = on_transfer

    @property
    def opened(self) -> bool:
        return bool(self.link.state & Endpoint.REMOTE_ACTIVE) and not (
            self.link.state & Endpoint.REMOTE_CLOSED
        )

    @property
    def closed_by_peer(self) -> bool:
        return bool(self.link.state & Endpoint.REMOTE_CLOSED)

    @property
    def error(self) -> str:
        cond = self.link.remote_condition
        return "" if cond is None else f"{cond.name}: {cond.description}"

    def on_delivery(self, d: Any) -> None:
        raw = self.rbuf.receive(self.ptr, d)
        if raw is None:
            return  # partial
        done = False

        def settle(ok: bool) -> None:
            nonlocal done
            if done or self.engine.ended:
                return
            done = True
            if ok:
                fp.accept(d)
            else:
                fp.reject(d, "amqp:internal-error", "the backup could not apply the frame")
            fp.flow(self.ptr, 1)
            self.engine.mark_dirty()

        self.on_transfer(raw, settle)

    def on_flow(self) -> None:
        pass


_new_delivery = fp.new_delivery
_link_send = fp.link_send
_link_advance = fp.link_advance
_delivery_settle = fp.delivery_settle
_remote_state = fp.delivery_remote_state
_remotely_settled = fp.delivery_settled

#: control events that may change what `on_event` reports (opened, closed, links)
_STATE_EVENTS = frozenset(
    e.number
    for e in (
        Event.CONNECTION_REMOTE_OPEN,
        Event.CONNECTION_REMOTE_CLOSE,
        Event.LINK_REMOTE_OPEN,
        Event.LINK_REMOTE_CLOSE,
        Event.LINK_REMOTE_DETACH,
        Event.TRANSPORT_ERROR,
        Event.TRANSPORT_CLOSED,
    )
)
_CONNECTION_REMOTE_CLOSE = Event.CONNECTION_REMOTE_CLOSE.number


class PeerEngine:
    """One outbound AMQP connection to a peer node (SASL PLAIN or ANONYMOUS).

    Control (open, attach, SASL, close) uses proton's object API; transfers,
    dispositions and flow are pumped through `fastpath` (ARCHITECTURE decision 1).
    Senders' `on_credit` callbacks are called once per batch of input (after every
    event of the batch is handled), not once per disposition."""

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
        self._t = t._impl
        self._coll = coll._impl
        #: raw delivery -> outcome callback, every unsettled transfer of every sender
        self._outcomes: dict[Any, Callable[[str, str], None]] = {}
        #: raw link -> its sender or receiver (alive as long as this engine)
        self._links: dict[Any, fp.LinkHandler] = {}
        self._credit_due: set[PeerSender] = set()
        self._changed = False
        #: output was announced with `on_dirty` and not yet taken by `output`
        self._dirty = False
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
        if not self._dirty:
            self._dirty = True
            if self.on_dirty is not None:
                self.on_dirty()

    # ----------------------------------------------------------------- links
    def sender(self, address: str, name: str) -> PeerSender:
        link = self.session.sender(name)
        link.target.address = address
        link.source.address = name
        link.open()
        s = PeerSender(self, link)
        self._links[s.ptr] = s
        self.mark_dirty()
        return s

    def receiver(
        self,
        on_message: Callable[[PeerMessage], None],
        name: str,
        *,
        address: str | None = None,
        credit: int = 1000,
    ) -> PeerReceiver:
        """A receiver; without an address it is dynamic (a temporary queue on the
        peer, deleted with the link), the reply-to of management requests. `credit` is
        its window, topped up at half: a burst of answers (1,000 new groups proposed at
        once) must not wait a round trip per 50 of them."""
        link = self.session.receiver(name)
        if address is None:
            link.source.dynamic = True
        else:
            link.source.address = address
        link.open()
        link.flow(credit)
        r = PeerReceiver(self, link, on_message)
        r.credit_window = credit
        self._links[r.ptr] = r
        self.mark_dirty()
        return r

    def raw_receiver(
        self,
        on_transfer: Callable[[bytes, Callable[[bool], None]], None],
        name: str,
        *,
        address: str,
        credit: int,
    ) -> PeerRawReceiver:
        """A receiver from `address` whose transfers the caller settles (see
        `PeerRawReceiver`); `credit` transfers at most are unsettled."""
        link = self.session.receiver(name)
        link.source.address = address
        link.snd_settle_mode = Link.SND_UNSETTLED
        link.rcv_settle_mode = Link.RCV_FIRST
        link.open()
        link.flow(credit)
        r = PeerRawReceiver(self, link, on_transfer)
        self._links[r.ptr] = r
        self.mark_dirty()
        return r

    # ------------------------------------------------------------------- I/O
    def feed(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            n = fp.push_input(self._t, view)
            if n <= 0:
                break
            view = view[n:]
            self.process()
        self.process()

    def output(self) -> bytes:
        self._dirty = False
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
        self._credit_due.clear()
        for cb in outcomes:
            cb("lost", "the cluster connection ended before the peer settled the message")
        if self.on_event is not None:
            self.on_event()

    # ---------------------------------------------------------------- events
    def process(self) -> None:
        fp.pump(self._coll, self._links, self._control)
        if self._credit_due:
            due = list(self._credit_due)
            self._credit_due.clear()
            for s in due:
                if s.on_credit is not None:
                    s.on_credit()
        if self._changed:
            self._changed = False
            if self.on_event is not None:
                self.on_event()

    def _control(self, ev: Any) -> None:
        t = fp.event_type(ev)
        if t in _STATE_EVENTS:
            self._changed = True
            if t == _CONNECTION_REMOTE_CLOSE and not (self.conn.state & Endpoint.LOCAL_CLOSED):
                self.conn.close()
                self.mark_dirty()
