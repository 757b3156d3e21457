"""Proton's engine through its cffi layer (`cproton_ffi.lib`): the function aliases
the per-message code binds, and `Wire`, a non-blocking socket feeding one transport.

The object API only sets connections and links up; transfers, dispositions and flow go
through `lib` directly (the object API is ~10x slower and would make the client the
bottleneck). Reads push up to READ_BATCH bytes into the transport before the events
are handled; output is written in one `send` per batch.
"""

from __future__ import annotations

import select
import socket
from typing import Any

from amqbroker.protocol.binding import ffi, lib
from amqbroker.protocol.binding import transport_capacity as _t_capacity
from amqbroker.protocol.binding import transport_close_head as _t_close_head
from amqbroker.protocol.binding import transport_close_tail as _t_close_tail
from amqbroker.protocol.binding import transport_peek as _t_peek
from amqbroker.protocol.binding import transport_pending as _t_pending
from amqbroker.protocol.binding import transport_pop as _t_pop
from amqbroker.protocol.binding import transport_push as _t_push

# ============================================================================ workers
#
# This runs in the worker processes (and the null broker). The per-message code binds
# cffi functions as globals or locals on purpose.

IBUF = 256 * 1024
OBUF = 256 * 1024
READ_BATCH = 1024 * 1024

PN_DELIVERY = lib.PN_DELIVERY
PN_LINK_FLOW = lib.PN_LINK_FLOW
PN_TRANSPORT = lib.PN_TRANSPORT
PN_ACCEPTED = lib.PN_ACCEPTED
IGNORED_EVENTS = frozenset((lib.PN_LINK_FLOW, lib.PN_TRANSPORT))
PN_TERMINAL = frozenset((lib.PN_ACCEPTED, lib.PN_REJECTED, lib.PN_RELEASED, lib.PN_MODIFIED))
PN_LINK_REMOTE_OPEN = lib.PN_LINK_REMOTE_OPEN
PN_REMOTE_CLOSES = frozenset(
    (
        lib.PN_LINK_REMOTE_CLOSE,
        lib.PN_LINK_REMOTE_DETACH,
        lib.PN_SESSION_REMOTE_CLOSE,
        lib.PN_CONNECTION_REMOTE_CLOSE,
    )
)
PN_CONNECTION_REMOTE_CLOSE = lib.PN_CONNECTION_REMOTE_CLOSE
PN_TRANSPORT_ERROR = lib.PN_TRANSPORT_ERROR
PN_TRANSPORT_CLOSED = lib.PN_TRANSPORT_CLOSED


class Wire:
    """A non-blocking socket feeding one Proton transport, with batched reads/writes."""

    def __init__(self, sock: socket.socket, transport_ptr: Any) -> None:
        self.sock = sock
        self.t = transport_ptr
        self.ibuf = ffi.new("char[]", IBUF)
        self.iview = ffi.buffer(self.ibuf)
        self.obuf = ffi.new("char[]", OBUF)
        self.oview = memoryview(ffi.buffer(self.obuf))
        self.want_write = False
        self.eof = False
        self.error: str | None = None

    def read(self) -> int:
        """Read what the socket has (up to READ_BATCH) into the transport."""
        t = self.t
        total = 0
        while total < READ_BATCH:
            cap = _t_capacity(t)
            if cap <= 0:
                break
            want = min(cap, IBUF)
            try:
                n = self.sock.recv_into(self.iview, want)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                self.error = f"socket error: {exc}"
                self.eof = True
                _t_close_tail(t)
                break
            if n == 0:
                self.eof = True
                _t_close_tail(t)
                break
            _t_push(t, self.ibuf, n)
            total += n
            if n < want:
                break
        return total

    def flush(self) -> None:
        """Write the transport's pending output until the socket would block."""
        t = self.t
        while True:
            n = _t_pending(t)
            if n <= 0:
                self.want_write = False
                return
            k = min(n, OBUF)
            _t_peek(t, self.obuf, k)
            try:
                sent = self.sock.send(self.oview[:k])
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as exc:
                self.error = f"socket error: {exc}"
                _t_close_head(t)
                self.want_write = False
                return
            if sent:
                _t_pop(t, sent)
            if sent < k:
                self.want_write = True
                return


def _condition_text(cond: Any) -> str | None:
    if cond is None or not getattr(cond, "name", None):
        return None
    return f"{cond.name}: {cond.description or ''}".strip()


def mask_for(wire: Wire) -> int:
    if wire.eof:
        return 0
    return select.POLLIN | select.POLLOUT if wire.want_write else select.POLLIN
