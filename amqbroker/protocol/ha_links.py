"""The primary's end of the replication stream: the `$ha.replication` source link.

A backup (`amqbroker.ha.mirror`) attaches a receiver to `$ha.replication` on its
primary, authenticated as the cluster user; this link sends it the frames of
`amqbroker.ha.stream` as unsettled transfers, each with an outcome callback called
exactly once: "accepted" once the backup applied the frame durably, anything else
(or "lost" when the link or connection ends first) otherwise. The stream logic
(what to send, when the backup is in sync) lives in `amqbroker.ha.primary`, behind the
`ReplicationSink` callbacks; this module only speaks AMQP (sans-IO, like every
protocol module).

Each transfer is a well-formed AMQP message: one data section (descriptor 0x75,
vbin32) holding the frame. The section header goes out as a separate `pn_link_send`
of the same delivery, so the frame is never copied; `data_section_body` strips it
on the backup.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from amqbroker.core.errors import Unauthorized
from amqbroker.protocol import fastpath as fp

if TYPE_CHECKING:
    from amqbroker.core.broker import Broker
    from amqbroker.protocol.connection import AmqpConnection

REPLICATION_ADDRESS = "$ha.replication"

_DATA_SECTION = b"\x00\x53\x75\xb0"
#: bytes before the frame in a transfer
DATA_SECTION_SIZE = 8
_U32 = struct.Struct(">I")


def data_section(n: int) -> bytes:
    """The header of a data section of `n` bytes (vbin32)."""
    return _DATA_SECTION + _U32.pack(n)


def data_section_body(message: bytes) -> bytes:
    """The bytes of a message that is exactly one data section; ValueError otherwise."""
    if message[:4] != _DATA_SECTION or len(message) < 8:
        raise ValueError("not a replication frame (one data section expected)")
    (n,) = _U32.unpack_from(message, 4)
    if 8 + n != len(message):
        raise ValueError("replication frame: data section length mismatch")
    return message[8:]


Outcome = Callable[[str], None]


class ReplicationSink(Protocol):
    """The stream side (amqbroker.ha.primary) of a replication link."""

    def attached(self, link: ReplicationLink) -> None: ...

    def credit_changed(self, link: ReplicationLink) -> None: ...

    def detached(self, link: ReplicationLink) -> None: ...


_OUTCOMES: dict[int, str] = {
    fp.PN_ACCEPTED: "accepted",
    fp.PN_REJECTED: "rejected",
    fp.PN_RELEASED: "released",
    fp.PN_MODIFIED: "modified",
}


class ReplicationLink:
    """One backup's receiver on `$ha.replication` (see the module docstring)."""

    def __init__(self, conn: AmqpConnection, link: Any, sink: ReplicationSink) -> None:
        self.conn = conn
        self.link = link
        self.ptr = link._impl
        self.sink = sink
        self.tagger = fp.Tagger()
        self._outcomes: dict[Any, Outcome] = {}
        self.closed = False
        #: the peer's address and connection, for log lines
        self.peer = conn.peer or "?"
        #: address / queue for `attach.link_prefix`
        self.address = None
        self.queue = None

    @property
    def credit(self) -> int:
        return 0 if self.closed else fp.credit(self.ptr)

    @property
    def in_flight(self) -> int:
        return len(self._outcomes)

    def start(self) -> None:
        self.sink.attached(self)

    def send(self, data: bytes, on_outcome: Outcome) -> None:
        """One frame as an unsettled transfer (the caller checked `credit`)."""
        if self.closed:
            on_outcome("lost")
            return
        ptr = self.ptr
        d = fp.new_delivery(ptr, self.tagger.next())
        head = data_section(len(data))
        fp.link_send(ptr, head, len(head))
        fp.link_send(ptr, data, len(data))
        fp.link_advance(ptr)
        self._outcomes[d] = on_outcome
        self.conn.mark_dirty()

    def on_delivery(self, d: Any) -> None:
        state = fp.delivery_remote_state(d)
        if not state and not fp.delivery_settled(d):
            return
        cb = self._outcomes.pop(d, None)
        fp.delivery_settle(d)
        self.conn.mark_dirty()
        if cb is not None:
            cb(_OUTCOMES.get(state, "settled"))
        self.sink.credit_changed(self)

    def on_flow(self) -> None:
        self.sink.credit_changed(self)

    def close(self, condition: str, description: str) -> None:
        """Detach from our side (the backup is dropped: it resyncs when it returns)."""
        self.conn.detach_link(self, condition, description)  # type: ignore[arg-type]

    def detach(self, broker: Broker, failed: bool = False) -> None:
        if self.closed:
            return
        self.closed = True
        # the sink first: it learns the backup went away before its frames are lost
        self.sink.detached(self)
        outcomes = list(self._outcomes.values())
        self._outcomes.clear()
        for cb in outcomes:
            cb("lost")


def replication_factory(
    sink: ReplicationSink, authorize: Callable[[AmqpConnection], str | None]
) -> Callable[[AmqpConnection, Any], ReplicationLink]:
    """A `ManagementNode.sources` factory; `authorize` returns a refusal reason or None."""

    def make(conn: AmqpConnection, link: Any) -> ReplicationLink:
        reason = authorize(conn)
        if reason is not None:
            raise Unauthorized(reason)
        return ReplicationLink(conn, link, sink)

    return make
