"""The null broker of --ceiling: a raw-cffi relay with no queue logic.

Every transfer from a producer link goes to the next consumer link with credit;
producers' deliveries are accepted on arrival, consumers' settled on their outcome.
It shows what the client itself can move on this machine.
"""

from __future__ import annotations

import argparse
import contextlib
import select
import signal
import socket
import sys
from collections import deque
from typing import Any

import proton

from amqbroker.protocol.binding import collector_peek as _peek
from amqbroker.protocol.binding import collector_pop as _pop
from amqbroker.protocol.binding import delivery_link as _dlink
from amqbroker.protocol.binding import delivery_partial as _partial
from amqbroker.protocol.binding import delivery_pending as _pending
from amqbroker.protocol.binding import delivery_readable as _readable
from amqbroker.protocol.binding import delivery_remote_state as _remote_state
from amqbroker.protocol.binding import delivery_settle as _settle
from amqbroker.protocol.binding import delivery_settled as _remote_settled
from amqbroker.protocol.binding import delivery_update as _update
from amqbroker.protocol.binding import event_delivery as _edelivery
from amqbroker.protocol.binding import event_link as _elink
from amqbroker.protocol.binding import event_type as _etype
from amqbroker.protocol.binding import ffi, lib
from amqbroker.protocol.binding import link_advance as _advance
from amqbroker.protocol.binding import link_credit as _credit
from amqbroker.protocol.binding import link_flow as _flow
from amqbroker.protocol.binding import link_recv as _recv
from amqbroker.protocol.binding import link_send as _send
from amqbroker.protocol.binding import new_delivery as _new_delivery
from amqbroker.protocol.binding import transport_pending as _t_pending
from amqbroker.tools.perf.engine import (
    IGNORED_EVENTS,
    PN_ACCEPTED,
    PN_CONNECTION_REMOTE_CLOSE,
    PN_DELIVERY,
    PN_LINK_REMOTE_OPEN,
    PN_TRANSPORT_CLOSED,
    Wire,
    mask_for,
)

# ======================================================================== null broker


class NullConn:
    """One accepted connection of the null broker."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        self.sock = sock
        t = proton.Transport(proton.Transport.SERVER)
        sasl = t.sasl()
        sasl.allowed_mechs("ANONYMOUS")
        sasl.allow_insecure_mechs = True
        c = proton.Connection()
        coll = proton.Collector()
        c.collect(coll)
        t.bind(c)
        self.transport, self.conn, self.collector = t, c, coll
        self.coll = coll._impl
        self.wire = Wire(sock, t._impl)
        self.links: set[Any] = set()
        self.closed = False


def null_broker_main(argv: list[str]) -> int:
    """A relay with no queue logic: every transfer from a producer link goes to the next
    consumer link with credit; producers' deliveries are accepted on arrival, consumers'
    settled on their outcome. Used by --ceiling to measure the client alone."""
    ap = argparse.ArgumentParser(prog="perf.py --_null-broker")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--credit", type=int, default=1000)
    a = ap.parse_args(argv)
    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lsock.bind(("127.0.0.1", a.port))
    lsock.listen(64)
    lsock.setblocking(False)
    print(f"null broker listening on 127.0.0.1:{lsock.getsockname()[1]}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, lambda *_: sys.exit(0))

    window = a.credit
    conns: dict[int, NullConn] = {}
    fifo: deque[bytes] = deque()
    consumers: list[Any] = []
    producers: list[Any] = []
    rr = 0
    tagp = ffi.new("uint32_t *")
    tagb = ffi.new("pn_bytes_t *", (4, ffi.cast("char *", tagp)))
    tag = tagb[0]
    tagn = 0
    buf = ffi.new("char[]", 1 << 20)
    bufsize = 1 << 20
    poller = select.poll()
    poller.register(lsock.fileno(), select.POLLIN)
    masks: dict[int, int] = {}
    is_receiver = lib.pn_link_is_receiver
    PN_CONNECTION_REMOTE_OPEN = lib.PN_CONNECTION_REMOTE_OPEN
    PN_SESSION_REMOTE_OPEN = lib.PN_SESSION_REMOTE_OPEN
    link_closes = (lib.PN_LINK_REMOTE_CLOSE, lib.PN_LINK_REMOTE_DETACH)

    def drop_link(lp: Any) -> None:
        if lp in consumers:
            consumers.remove(lp)
        if lp in producers:
            producers.remove(lp)

    def pump(nc: NullConn) -> None:
        nonlocal bufsize, buf
        coll = nc.coll
        while True:
            ev = _peek(coll)
            if not ev:
                return
            et = _etype(ev)
            if et == PN_DELIVERY:
                d = _edelivery(ev)
                lp = _dlink(d)
                if is_receiver(lp):
                    if not _partial(d) and _readable(d):
                        n = _pending(d)
                        if n > bufsize:
                            bufsize = n
                            buf = ffi.new("char[]", n)
                        got = _recv(lp, buf, n)
                        _advance(lp)
                        if not _remote_settled(d):
                            _update(d, PN_ACCEPTED)
                        _settle(d)
                        if fifo or not send_direct(buf, got):
                            fifo.append(ffi.unpack(buf, got))
                elif _remote_state(d) or _remote_settled(d):
                    _settle(d)
            elif et in IGNORED_EVENTS:
                pass
            elif et == PN_CONNECTION_REMOTE_OPEN:
                lib.pn_connection_open(lib.pn_event_connection(ev))
            elif et == PN_SESSION_REMOTE_OPEN:
                lib.pn_session_open(lib.pn_event_session(ev))
            elif et == PN_LINK_REMOTE_OPEN:
                lp = _elink(ev)
                lib.pn_terminus_copy(lib.pn_link_source(lp), lib.pn_link_remote_source(lp))
                lib.pn_terminus_copy(lib.pn_link_target(lp), lib.pn_link_remote_target(lp))
                lib.pn_link_open(lp)
                nc.links.add(lp)
                if is_receiver(lp):
                    producers.append(lp)
                    _flow(lp, window)
                else:
                    consumers.append(lp)
            elif et in link_closes:
                lp = _elink(ev)
                drop_link(lp)
                nc.links.discard(lp)
                lib.pn_link_close(lp)
            elif et == lib.PN_SESSION_REMOTE_CLOSE:
                lib.pn_session_close(lib.pn_event_session(ev))
            elif et == PN_CONNECTION_REMOTE_CLOSE:
                lib.pn_connection_close(lib.pn_event_connection(ev))
            elif et == PN_TRANSPORT_CLOSED:
                nc.closed = True
            _pop(coll)

    def send_direct(data: Any, n: int) -> bool:
        """Send to the next consumer with credit, if any, without queueing."""
        nonlocal rr, tagn
        nc_ = len(consumers)
        for _ in range(nc_):
            rr = (rr + 1) % nc_
            lp = consumers[rr]
            if _credit(lp) > 0:
                tagn = (tagn + 1) & 0xFFFFFFFF
                tagp[0] = tagn
                _new_delivery(lp, tag)
                _send(lp, data, n)
                _advance(lp)
                return True
        return False

    def forward() -> None:
        nonlocal rr, tagn
        while fifo and consumers:
            nc_ = len(consumers)
            for _ in range(nc_):
                rr = (rr + 1) % nc_
                lp = consumers[rr]
                if _credit(lp) > 0:
                    break
            else:
                return
            data = fifo.popleft()
            tagn = (tagn + 1) & 0xFFFFFFFF
            tagp[0] = tagn
            _new_delivery(lp, tag)
            _send(lp, data, len(data))
            _advance(lp)

    while True:
        for fd, _ev in poller.poll(1000):
            if fd == lsock.fileno():
                while True:
                    try:
                        s, _addr = lsock.accept()
                    except (BlockingIOError, InterruptedError):
                        break
                    nc = NullConn(s)
                    conns[s.fileno()] = nc
                    masks[s.fileno()] = select.POLLIN
                    poller.register(s.fileno(), select.POLLIN)
                continue
            got = conns.get(fd)
            if got is not None:
                got.wire.read()
        for nc in conns.values():
            pump(nc)
        forward()
        if len(fifo) < window:
            for lp in producers:
                c = _credit(lp)
                if c < window // 2:
                    _flow(lp, window - c)
        for fd, nc in list(conns.items()):
            pump(nc)  # events produced by forwarding/flow (none that matter; keep queues short)
            nc.wire.flush()
            done = nc.closed or (nc.wire.eof and _t_pending(nc.wire.t) <= 0)
            if done and not nc.wire.want_write:
                for lp in nc.links:
                    drop_link(lp)
                poller.unregister(fd)
                del conns[fd]
                masks.pop(fd, None)
                with contextlib.suppress(OSError):
                    nc.sock.close()
                continue
            m = mask_for(nc.wire) or select.POLLIN
            if masks.get(fd) != m:
                masks[fd] = m
                poller.modify(fd, m)
