"""The hot path: Proton's engine driven through its cffi layer.

python-qpid-proton's object API wraps every event, link and delivery in Python objects
(~8,600 msgs/s for a producer->broker->consumer hop). Calling `cproton_ffi.lib`
directly for the per-message work is ~10x faster (ARCHITECTURE.md decision 1). This
module is the only place that does so; everything else (open, attach, detach, close,
errors) uses the object API. The raw layer is not a public API, which is why the
project pins python-qpid-proton==0.40.*; its symbols are bound and checked once, in
`amqbroker.protocol.binding` (shared with the perf client), and `check_binding()` makes
the app import it before any socket is opened.

Per-message work done here, and nothing else:
* `pump`: drain the connection's collector; transfers (PN_DELIVERY) and flow
  (PN_LINK_FLOW) go straight to the link handler found by raw pointer, other events go
  to the connection's control handler (object API).
* `receive`: copy a complete incoming transfer into one bytes object.
* `send`: create a delivery with a 4-byte tag from a counter, write, advance.
* settle / update / disposition details, input push and output peek/pop.
* transactional delivery states (part 4): read only once the state code is 0x34, set
  for the coordinator's and transactional transfers' answers.

Invariant: no proton pointer outlives its owner here. Link handlers are registered in
the connection's `links` map (raw pointer -> handler) while the link is open, and
removed before the link is freed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from proton import Data, Described

from amqbroker.protocol.binding import (
    NULL,
    PN_ACCEPTED,
    PN_DELIVERY,
    PN_LINK_FLOW,
    PN_MODIFIED,
    PN_RECEIVED,
    PN_REJECTED,
    PN_RELEASED,
    PN_TRANSPORT,
    delivery_aborted,
    delivery_partial,
    delivery_pending,
    delivery_remote_state,
    delivery_settle,
    delivery_settled,
    delivery_update,
    event_link,
    event_session,
    event_type,
    ffi,
    link_advance,
    link_flow,
    link_recv,
    link_send,
    link_session,
    new_delivery,
    unpack,
)
from amqbroker.protocol.binding import collector_peek as _peek
from amqbroker.protocol.binding import collector_pop as _pop
from amqbroker.protocol.binding import condition_set_description as _cond_set_desc
from amqbroker.protocol.binding import condition_set_name as _cond_set_name
from amqbroker.protocol.binding import delivery_link as _dlink
from amqbroker.protocol.binding import delivery_local as _local_disp
from amqbroker.protocol.binding import delivery_readable as _readable
from amqbroker.protocol.binding import delivery_remote as _remote_disp
from amqbroker.protocol.binding import disposition_condition as _disp_condition
from amqbroker.protocol.binding import disposition_data as _disp_data
from amqbroker.protocol.binding import disposition_is_failed as _is_failed
from amqbroker.protocol.binding import disposition_is_undeliverable as _is_undeliverable
from amqbroker.protocol.binding import event_delivery as _edelivery
from amqbroker.protocol.binding import event_link as _elink
from amqbroker.protocol.binding import event_type as _etype
from amqbroker.protocol.binding import from_buffer as _from_buffer
from amqbroker.protocol.binding import link_credit as _credit
from amqbroker.protocol.binding import link_drained as _drained
from amqbroker.protocol.binding import link_get_drain as _get_drain
from amqbroker.protocol.binding import transport_capacity as _t_capacity
from amqbroker.protocol.binding import transport_close_head as _t_close_head
from amqbroker.protocol.binding import transport_close_tail as _t_close_tail
from amqbroker.protocol.binding import transport_peek as _t_peek
from amqbroker.protocol.binding import transport_pending as _t_pending
from amqbroker.protocol.binding import transport_pop as _t_pop
from amqbroker.protocol.binding import transport_push as _t_push
from amqbroker.protocol.binding import transport_tick as _t_tick

if TYPE_CHECKING:
    from collections.abc import Callable

# The raw per-message primitives the link adapters bind as module globals (a global
# lookup is cheaper than an attribute lookup on every message), and the control-path
# accessors connection.py uses (raw event -> object-API wrapper): re-exported from
# `binding`, which declares and checks every symbol; nothing outside this package
# calls them.
__all__ = [
    "NULL",
    "PN_ACCEPTED",
    "PN_DELIVERY",
    "PN_LINK_FLOW",
    "PN_MODIFIED",
    "PN_RECEIVED",
    "PN_REJECTED",
    "PN_RELEASED",
    "PN_TRANSPORT",
    "delivery_aborted",
    "delivery_partial",
    "delivery_pending",
    "delivery_remote_state",
    "delivery_settle",
    "delivery_settled",
    "delivery_update",
    "event_link",
    "event_session",
    "event_type",
    "link_advance",
    "link_flow",
    "link_recv",
    "link_send",
    "link_session",
    "new_delivery",
    "unpack",
]


def check_binding() -> None:
    """Importing this module already verified the binding; kept for the app's start-up
    check so that a bad wheel fails before any socket is opened."""


class LinkHandler(Protocol):
    def on_delivery(self, d: Any) -> None: ...

    def on_flow(self) -> None: ...


def pump(
    collector: Any,
    links: dict[Any, LinkHandler],
    control: Callable[[Any], None],
) -> None:
    """Handle every event waiting in the collector."""
    while True:
        ev = _peek(collector)
        if not ev:
            return
        t = _etype(ev)
        if t == PN_DELIVERY:
            d = _edelivery(ev)
            h = links.get(_dlink(d))
            if h is not None:
                h.on_delivery(d)
        elif t == PN_LINK_FLOW:
            h = links.get(_elink(ev))
            if h is not None:
                h.on_flow()
        elif t != PN_TRANSPORT:
            control(ev)
        _pop(collector)


class RecvBuffer:
    """A reusable receive buffer that grows to the largest message seen (bounded by
    the max message size the link advertises)."""

    __slots__ = ("buf", "size")

    def __init__(self, size: int = 65536) -> None:
        self.size = size
        self.buf = ffi.new("char[]", size)

    def grow(self, n: int) -> None:
        self.size = n
        self.buf = ffi.new("char[]", n)

    def receive(self, link: Any, d: Any) -> bytes | None:
        """The complete message of delivery `d`, or None while it is partial."""
        if delivery_partial(d) or not _readable(d):
            return None
        n = delivery_pending(d)
        if n > self.size:
            self.size = n
            self.buf = ffi.new("char[]", n)
        buf = self.buf
        got = link_recv(link, buf, n)
        link_advance(link)
        if got < 0:
            return b""
        data: bytes = unpack(buf, got)
        return data


def aborted(d: Any) -> bool:
    return bool(delivery_aborted(d))


def remotely_settled(d: Any) -> bool:
    return bool(delivery_settled(d))


class Tagger:
    """Delivery tags for one outgoing link: a 4-byte counter in a reused buffer, passed
    as one prebuilt pn_bytes_t (tags must be unique among the link's unsettled
    deliveries; 2**32 outstanding deliveries cannot happen)."""

    __slots__ = ("_bytes", "_ptr", "n", "tag")

    def __init__(self) -> None:
        self._ptr = ffi.new("uint32_t *")
        self._bytes = ffi.new("pn_bytes_t *", (4, ffi.cast("char *", self._ptr)))
        #: pass to new_delivery(link, tag) after `next()`
        self.tag = self._bytes[0]
        self.n = 0

    def next(self) -> Any:
        n = self.n = (self.n + 1) & 0xFFFFFFFF
        self._ptr[0] = n
        return self.tag


def settle(d: Any) -> None:
    delivery_settle(d)


def accept(d: Any) -> None:
    delivery_update(d, PN_ACCEPTED)
    delivery_settle(d)


def reject(d: Any, condition: str, description: str) -> None:
    cond = _disp_condition(_local_disp(d))
    _cond_set_name(cond, condition.encode())
    _cond_set_desc(cond, description.encode())
    delivery_update(d, PN_REJECTED)
    delivery_settle(d)


def release(d: Any) -> None:
    delivery_update(d, PN_RELEASED)
    delivery_settle(d)


def outcome(d: Any) -> tuple[int, bool, bool]:
    """(remote state, delivery-failed, undeliverable-here) of a consumer's disposition."""
    state = delivery_remote_state(d)
    if state == PN_MODIFIED:
        disp = _remote_disp(d)
        return state, bool(_is_failed(disp)), bool(_is_undeliverable(disp))
    return state, False, False


def credit(link: Any) -> int:
    return int(_credit(link))


def drain_requested(link: Any) -> bool:
    return bool(_get_drain(link))


def drained(link: Any) -> int:
    return int(_drained(link))


def flow(link: Any, n: int) -> None:
    link_flow(link, n)


def push_input(transport: Any, data: bytes | bytearray | memoryview) -> int:
    """Push bytes into the transport; returns how many were taken, or <0 when the
    transport's input side is closed."""
    total = 0
    n = len(data)
    mv = memoryview(data)
    while total < n:
        cap = _t_capacity(transport)
        if cap < 0:
            return cap if total == 0 else total
        if cap == 0:
            break
        k = min(cap, n - total)
        r = _t_push(transport, _from_buffer(mv[total : total + k]), k)
        if r < 0:
            return r if total == 0 else total
        total += k
    return total


class OutputBuffer:
    """Peeks the transport's pending output into one reused buffer."""

    __slots__ = ("buf", "size", "view")

    def __init__(self, size: int = 262144) -> None:
        self.size = size
        self.buf = ffi.new("char[]", size)
        self.view = memoryview(ffi.buffer(self.buf))

    def peek(self, transport: Any) -> memoryview | None:
        """Pending output (up to the buffer size); empty when none, None when the
        transport's output side is closed."""
        n = _t_pending(transport)
        if n < 0:
            return None
        if n == 0:
            return self.view[:0]
        n = min(n, self.size)
        _t_peek(transport, self.buf, n)
        return self.view[:n]


def pending_output(transport: Any) -> int:
    """Bytes of output the transport has ready (<0 once its output is closed)."""
    return int(_t_pending(transport))


def pop_output(transport: Any, n: int) -> None:
    _t_pop(transport, n)


def input_open(transport: Any) -> bool:
    """The transport still takes input (Proton closes its input side on a frame it
    cannot dispatch, sometimes without a condition)."""
    return bool(_t_capacity(transport) >= 0)


def close_input(transport: Any) -> None:
    _t_close_tail(transport)


def close_output(transport: Any) -> None:
    _t_close_head(transport)


def tick(transport: Any, now_ms: int) -> int:
    return int(_t_tick(transport, now_ms))


# ------------------------------------------------------------------ transactions
# Delivery states of AMQP part 4, by descriptor code (what pn_delivery_remote_state
# returns for a state proton does not know). Only read after the state code says so:
# the non-transactional hot path pays one integer comparison, nothing more.
PN_DECLARED = 0x33
PN_TRANSACTIONAL = 0x34

_OUTCOME_SYMBOLS = {
    "amqp:received:list": PN_RECEIVED,
    "amqp:accepted:list": PN_ACCEPTED,
    "amqp:rejected:list": PN_REJECTED,
    "amqp:released:list": PN_RELEASED,
    "amqp:modified:list": PN_MODIFIED,
}


def _descriptor_code(descriptor: Any) -> int:
    if isinstance(descriptor, int):
        return int(descriptor)
    return _OUTCOME_SYMBOLS.get(str(descriptor), -1)


def transactional_state(d: Any) -> tuple[bytes, int, bool, bool] | None:
    """The remote transactional-state of a delivery (remote state PN_TRANSACTIONAL):
    (txn-id, outcome code or 0 when none, delivery-failed, undeliverable-here).
    None when it is malformed (no binary txn-id, or an outcome that is not one)."""
    data = Data(_disp_data(_remote_disp(d)))
    data.rewind()
    try:
        fields = data.get_object() if data.next() else None
    except Exception:  # any undecodable state is "malformed"
        return None
    if not isinstance(fields, list) or not fields:
        return None
    txn = fields[0]
    if not isinstance(txn, (bytes, bytearray, memoryview)):
        return None
    txn_id = bytes(txn)
    if len(fields) < 2 or fields[1] is None:
        return txn_id, 0, False, False
    out = fields[1]
    if not isinstance(out, Described):
        return None
    code = _descriptor_code(out.descriptor)
    if code not in (PN_ACCEPTED, PN_REJECTED, PN_RELEASED, PN_MODIFIED):
        return None
    failed = undeliverable = False
    if code == PN_MODIFIED and isinstance(out.value, list):
        v = out.value
        failed = bool(v[0]) if len(v) > 0 and v[0] is not None else False
        undeliverable = bool(v[1]) if len(v) > 1 and v[1] is not None else False
    return txn_id, code, failed, undeliverable


def _set_local_data(d: Any, txn_id: bytes, outcome: int) -> None:
    data = Data(_disp_data(_local_disp(d)))
    data.clear()
    data.put_list()
    data.enter()
    data.put_binary(txn_id)
    if outcome:
        data.put_described()
        data.enter()
        data.put_ulong(outcome)
        data.put_list()
        data.exit()
    data.exit()


def declared(d: Any, txn_id: bytes) -> None:
    """Settle a coordinator's declare with `declared` {txn-id}."""
    _set_local_data(d, txn_id, 0)
    delivery_update(d, PN_DECLARED)
    delivery_settle(d)


def transactional_accept(d: Any, txn_id: bytes) -> None:
    """Settle a transactional transfer with transactional-state {txn-id, accepted}."""
    _set_local_data(d, txn_id, PN_ACCEPTED)
    delivery_update(d, PN_TRANSACTIONAL)
    delivery_settle(d)
