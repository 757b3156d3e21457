"""The worker processes: one connection with one link each (producer or consumer).

A worker is ``python -m amqbroker.tools.perf --_worker SPEC`` (SPEC: JSON). It opens
its link, reports READY in its status slot, and takes "go" / "stop" on stdin.
Producers keep at most ``window`` unsettled deliveries (never more than the link
credit) and count every non-accepted outcome as an error; with --txn-batch they send
in local transactions on the raw path (coordinator link, Declare, N transactional
transfers, Discharge). Consumers grant ``credit``, topped up when half is used, accept
and settle every delivery, record latencies and check group order. At the end each
prints one JSON line (its result) on stdout.
"""

from __future__ import annotations

import array
import contextlib
import json
import math
import mmap
import os
import select
import signal
import socket
import time
from collections import deque
from pathlib import Path
from typing import Any

import proton

from amqbroker.protocol.binding import collector_peek as _peek
from amqbroker.protocol.binding import collector_pop as _pop
from amqbroker.protocol.binding import data_clear as _d_clear
from amqbroker.protocol.binding import data_enter as _d_enter
from amqbroker.protocol.binding import data_exit as _d_exit
from amqbroker.protocol.binding import data_put_binary as _d_put_binary
from amqbroker.protocol.binding import data_put_list as _d_put_list
from amqbroker.protocol.binding import delivery_link as _dlink
from amqbroker.protocol.binding import delivery_local as _local_state
from amqbroker.protocol.binding import delivery_partial as _partial
from amqbroker.protocol.binding import delivery_pending as _pending
from amqbroker.protocol.binding import delivery_readable as _readable
from amqbroker.protocol.binding import delivery_remote as _remote_disp
from amqbroker.protocol.binding import delivery_remote_state as _remote_state
from amqbroker.protocol.binding import delivery_settle as _settle
from amqbroker.protocol.binding import delivery_settled as _remote_settled
from amqbroker.protocol.binding import delivery_update as _update
from amqbroker.protocol.binding import disposition_data as _disp_data
from amqbroker.protocol.binding import event_delivery as _edelivery
from amqbroker.protocol.binding import event_type as _etype
from amqbroker.protocol.binding import ffi, lib
from amqbroker.protocol.binding import link_advance as _advance
from amqbroker.protocol.binding import link_credit as _credit
from amqbroker.protocol.binding import link_flow as _flow
from amqbroker.protocol.binding import link_recv as _recv
from amqbroker.protocol.binding import link_send as _send
from amqbroker.protocol.binding import link_unsettled as _unsettled
from amqbroker.protocol.binding import new_delivery as _new_delivery
from amqbroker.protocol.binding import transport_pending as _t_pending
from amqbroker.protocol.binding import transport_tick as _t_tick
from amqbroker.tools.perf.encoding import (
    APP_PROPS_N_OFFSET,
    DECLARE_MESSAGE,
    DURABLE_HEADER,
    MAGIC,
    MIN_SIZE,
    N_FIELD,
    NO_GROUP,
    PAYLOAD,
    SELECTOR_FILTER_CODE,
    SELECTOR_FILTER_KEY,
    TXN_DECLARED,
    TXN_STATE,
    discharge_message,
    message_head,
)
from amqbroker.tools.perf.engine import (
    IGNORED_EVENTS,
    PN_ACCEPTED,
    PN_CONNECTION_REMOTE_CLOSE,
    PN_DELIVERY,
    PN_LINK_REMOTE_OPEN,
    PN_REMOTE_CLOSES,
    PN_TERMINAL,
    PN_TRANSPORT_CLOSED,
    PN_TRANSPORT_ERROR,
    Wire,
    _condition_text,
    mask_for,
)
from amqbroker.tools.perf.options import GROUP_HEAD_CACHE
from amqbroker.tools.perf.status import (
    SLOT,
    ST_DONE,
    ST_FAILED,
    ST_READY,
    ST_STARTING,
    ST_STOPPED,
)


def _set_txn_state(d: Any, txn_bytes: bytes) -> None:
    """Mark delivery `d` transactional-state {txn-id}, as Qpid JMS sends it."""
    data = _disp_data(_local_state(d))
    _d_clear(data)
    _d_put_list(data)
    _d_enter(data)
    _d_put_binary(data, txn_bytes)
    _d_exit(data)
    _update(d, TXN_STATE)


class ClientWorker:
    """One connection with one link (producer or consumer) in its own process."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.slot = int(spec["slot"])
        self.size = int(spec["size"])
        self.errors = 0
        self.first_error: str | None = None
        self.state = ST_STARTING
        self.stopping = False
        self.closed = False
        self.going = False
        self.t_first = 0
        self.t_last = 0
        self._status_file = open(spec["status"], "r+b")  # noqa: SIM115 - closed in close()
        self._mm = mmap.mmap(self._status_file.fileno(), 0)
        self._stop_deadline = 0.0
        self._last_tick = 0.0
        self._stdin_buf = b""

        sock = socket.create_connection((spec["host"], int(spec["port"])), timeout=10)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        self.sock = sock
        t = proton.Transport()
        if not spec.get("no_sasl"):
            sasl = t.sasl()
            sasl.allowed_mechs("PLAIN" if spec.get("user") else "ANONYMOUS")
            sasl.allow_insecure_mechs = True
        c = proton.Connection()
        c.container = f"amqbroker-perf-{os.getpid()}"
        c.hostname = spec["host"]
        if spec.get("user"):
            c.user = spec["user"]
            c.password = spec.get("password") or ""
        coll = proton.Collector()
        c.collect(coll)
        t.bind(c)
        c.open()
        ssn = c.session()
        ssn.open()
        self.transport, self.conn, self.collector = t, c, coll
        self.link = self.make_link(ssn)
        self.link.open()
        self.t = t._impl
        self.coll = coll._impl
        self.lp = self.link._impl
        self.wire = Wire(sock, self.t)

    def make_link(self, ssn: Any) -> Any:
        raise NotImplementedError

    # ---------------------------------------------------------------- plumbing
    def fail(self, text: str) -> None:
        self.errors += 1
        if self.first_error is None:
            self.first_error = text
        self.state = ST_FAILED

    def control(self, ev: Any, et: int) -> None:
        if et == PN_LINK_REMOTE_OPEN:
            if self.state == ST_STARTING:
                self.state = ST_READY
                self.on_ready()
        elif et in PN_REMOTE_CLOSES:
            if not self.stopping:
                text = (
                    _condition_text(self.link.remote_condition)
                    or _condition_text(self.conn.remote_condition)
                    or (
                        "the broker closed the connection"
                        if et == PN_CONNECTION_REMOTE_CLOSE
                        else "the broker closed the link"
                    )
                )
                self.fail(text)
                self.conn.close()
            elif et == PN_CONNECTION_REMOTE_CLOSE:
                self.conn.close()
        elif et == PN_TRANSPORT_ERROR:
            if not self.stopping:
                self.fail(_condition_text(self.transport.condition) or "transport error")
        elif et == PN_TRANSPORT_CLOSED:
            self.closed = True
            if not self.stopping and self.state != ST_FAILED:
                self.fail(_condition_text(self.transport.condition) or "connection lost")

    def on_ready(self) -> None:
        pass

    def command(self, line: str) -> None:
        if line == "go":
            self.going = True
            self.on_go()
        elif line == "stop":
            self.begin_stop()

    def on_go(self) -> None:
        pass

    def begin_stop(self) -> None:
        if not self.stopping:
            self.stopping = True
            self._stop_deadline = time.monotonic() + 5.0
            self.conn.close()

    def read_stdin(self) -> None:
        try:
            data = os.read(0, 4096)
        except BlockingIOError:
            return
        if not data:
            self.begin_stop()
            return
        self._stdin_buf += data
        while b"\n" in self._stdin_buf:
            line, _, self._stdin_buf = self._stdin_buf.partition(b"\n")
            self.command(line.decode().strip())

    def publish(self) -> None:
        raise NotImplementedError

    def pump(self) -> None:
        raise NotImplementedError

    def work(self) -> None:
        pass

    def after_flush(self) -> None:
        pass

    def timeout_ms(self) -> int:
        return 1000

    def loop(self) -> None:
        os.set_blocking(0, False)
        poller = select.poll()
        sfd = self.sock.fileno()
        mask = select.POLLIN
        poller.register(sfd, mask)
        poller.register(0, select.POLLIN)
        wire = self.wire
        while True:
            self.pump()
            self.work()
            wire.flush()
            self.after_flush()
            now = time.monotonic()
            if now - self._last_tick >= 1.0:
                self._last_tick = now
                _t_tick(self.t, int(now * 1000))
            if wire.eof and mask:
                # the socket is finished: stop polling it (it would report POLLHUP forever)
                poller.unregister(sfd)
                mask = 0
                if not self.stopping and self.state != ST_FAILED:
                    self.fail(wire.error or "the broker closed the socket")
            self.publish()
            if self.stopping and (self.closed or wire.eof or now >= self._stop_deadline):
                return
            if mask:
                want = mask_for(wire)
                if want != mask:
                    mask = want
                    poller.modify(sfd, mask)
            for fd, _ev in poller.poll(self.timeout_ms() if mask else 100):
                if fd == sfd:
                    wire.read()
                else:
                    self.read_stdin()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()
        self._mm.close()
        self._status_file.close()

    def result(self) -> dict[str, Any]:
        return {
            "slot": self.slot,
            "role": self.spec["role"],
            "errors": self.errors,
            "first_error": self.first_error,
            "t_first": self.t_first,
            "t_last": self.t_last,
        }


class ProducerWorker(ClientWorker):
    def __init__(self, spec: dict[str, Any]) -> None:
        super().__init__(spec)
        self.pid = int(spec.get("producer_id", 0))
        self.presettled = bool(spec.get("presettled"))
        self.window = int(spec.get("window", 1000))
        self.rate = float(spec.get("rate") or 0.0)
        self.segments = [
            (int(s["n"]), int(s.get("groups", 0)), int(s.get("gbase", 0)), int(s.get("gseq0", 0)))
            for s in spec["segments"]
        ]
        self.target = sum(s[0] for s in self.segments)
        self.sent = 0
        self.acked = 0
        self.not_accepted = 0
        self.t_start = 0
        self._tagp = ffi.new("uint32_t *")
        self._tagb = ffi.new("pn_bytes_t *", (4, ffi.cast("char *", self._tagp)))
        self.tag = self._tagb[0]
        durable = bool(spec.get("durable"))
        self.durable = durable
        self.pad = b"x" * (self.size - MIN_SIZE)
        # ungrouped messages: one template, the payload head rewritten in place
        head = message_head(self.size, durable=durable)
        self.template = bytearray(head + bytes(MIN_SIZE) + self.pad)
        self.tpl_off = len(head)
        self.tpl_ptr = ffi.from_buffer(self.template)
        self._seg_index = 0
        self._seg_start = 0
        self._heads_key: tuple[int, int] | None = None
        self._heads: list[bytes] = []
        # --selector/--app-props: application properties kind='load', n=<index>
        self.with_props = bool(spec.get("app_props"))
        self.n_off = -1
        if self.with_props:
            head = message_head(self.size, durable=durable, n=0)
            self.template = bytearray(head + bytes(MIN_SIZE) + self.pad)
            self.tpl_off = len(head)
            self.tpl_ptr = ffi.from_buffer(self.template)
            self.n_off = len(DURABLE_HEADER if durable else b"") + APP_PROPS_N_OFFSET
        # --txn-batch: local transactions of txn_batch messages (raw path as well)
        self.settled = 0
        self.committed = 0
        self.txn_sent = 0  # messages sent in the open transaction
        self.txn_phase = "declare"  # declare | declaring | open | discharge | discharging
        self.txn_id = b""
        self._txn_buf: Any = None
        self._txn_bytes: Any = None
        self.coord_lp = self.coord._impl if self.coord is not None else None
        self._ctagp = ffi.new("uint32_t *")
        self._ctagb = ffi.new("pn_bytes_t *", (4, ffi.cast("char *", self._ctagp)))
        self._ctl_sent = 0

    def make_link(self, ssn: Any) -> Any:
        self.txn_batch = int(self.spec.get("txn_batch") or 0)
        self.coord: Any = None
        if self.txn_batch:
            # the transaction coordinator, as Qpid JMS attaches it
            coord = ssn.sender(f"perf-coordinator-{self.slot}")
            coord.target.type = proton.Terminus.COORDINATOR
            caps = coord.target.capabilities
            caps.put_array(False, proton.Data.SYMBOL)
            caps.enter()
            caps.put_symbol("amqp:local-transactions")
            caps.exit()
            coord.open()
            self.coord = coord
        link = ssn.sender(f"perf-sender-{self.slot}")
        link.target.address = self.spec["address"]
        if self.spec.get("durable"):
            link.target.durability = proton.Terminus.CONFIGURATION
        link.snd_settle_mode = (
            proton.Link.SND_SETTLED if self.spec.get("presettled") else proton.Link.SND_UNSETTLED
        )
        link.rcv_settle_mode = proton.Link.RCV_FIRST
        return link

    def on_go(self) -> None:
        self.t_start = time.monotonic_ns()

    def control(self, ev: Any, et: int) -> None:
        if et == PN_LINK_REMOTE_OPEN and self.coord is not None:
            active = proton.Endpoint.REMOTE_ACTIVE
            if not (self.link.state & active and self.coord.state & active):
                return  # ready once both the sender and the coordinator are attached
        super().control(ev, et)

    def pump(self) -> None:
        coll = self.coll
        coord_lp = self.coord_lp
        # a transactional transfer is answered with transactional-state {txn, accepted}
        ok = TXN_STATE if coord_lp is not None else PN_ACCEPTED
        while True:
            ev = _peek(coll)
            if not ev:
                break
            et = _etype(ev)
            if et == PN_DELIVERY:
                d = _edelivery(ev)
                st = _remote_state(d)
                if coord_lp is not None and _dlink(d) == coord_lp:
                    self.on_coordinator(d, st)
                elif st in PN_TERMINAL or _remote_settled(d):
                    if st != ok:
                        self.not_accepted += 1
                        if self.first_error is None:
                            self.first_error = f"outcome {st} (not accepted)"
                    _settle(d)
            elif et not in IGNORED_EVENTS:
                self.control(ev, et)
            _pop(coll)
        if coord_lp is not None:
            self.settled = self.sent - _unsettled(self.lp)
            self.acked = self.committed
            if self.committed >= self.target and self.state == ST_READY and self.going:
                self.state = ST_DONE
                self.t_last = time.monotonic_ns()
        elif not self.presettled:
            self.acked = self.settled = self.sent - _unsettled(self.lp)
            if self.acked >= self.target and self.state == ST_READY and self.going:
                self.state = ST_DONE
                self.t_last = time.monotonic_ns()

    # ------------------------------------------------------------ transactions
    def on_coordinator(self, d: Any, st: int) -> None:
        """The coordinator's answer to a Declare (declared {txn-id}) or a Discharge
        (accepted)."""
        if not (st or _remote_settled(d)):
            return
        if self.txn_phase == "declaring" and st == TXN_DECLARED:
            data = _disp_data(_remote_disp(d))
            lib.pn_data_rewind(data)
            txn_id = b""
            if lib.pn_data_next(data) and _d_enter(data) and lib.pn_data_next(data):
                b = lib.pn_data_get_binary(data)
                txn_id = bytes(ffi.buffer(b.start, b.size)) if b.size else b""
            if not txn_id:
                self.fail("declared without a txn-id")
            self.txn_id = txn_id
            self._txn_buf = ffi.new("char[]", txn_id)
            self._txn_bytes = ffi.new("pn_bytes_t *", (len(txn_id), self._txn_buf))[0]
            self.txn_sent = 0
            self.txn_phase = "open"
        elif self.txn_phase == "discharging" and st == PN_ACCEPTED:
            self.committed += self.txn_sent
            self.txn_sent = 0
            self.txn_phase = "declare"
        else:
            self.fail(f"coordinator answered {st:#x} in phase {self.txn_phase}")
        _settle(d)

    def send_control(self, body: bytes) -> bool:
        """One Declare/Discharge on the coordinator link (False: no credit yet)."""
        lp = self.coord_lp
        if _credit(lp) <= 0:
            return False
        self._ctagp[0] = self._ctl_sent
        self._ctl_sent += 1
        _new_delivery(lp, self._ctagb[0])
        _send(lp, body, len(body))
        _advance(lp)
        return True

    def work_txn(self) -> int:
        """Drive the transaction; returns how many messages may be sent now."""
        phase = self.txn_phase
        if phase == "declare":
            if self.sent < self.target and self.send_control(DECLARE_MESSAGE):
                self.txn_phase = "declaring"
            return 0
        if phase == "open":
            left = min(self.txn_batch, self.target - self.committed) - self.txn_sent
            if left > 0:
                return left
            if self.send_control(discharge_message(self.txn_id)):
                self.txn_phase = "discharging"
        return 0

    def after_flush(self) -> None:
        # presettled: done once everything is sent and written to the socket
        if (
            self.presettled
            and self.coord_lp is None
            and self.state == ST_READY
            and self.going
            and self.sent >= self.target
            and _t_pending(self.t) == 0
        ):
            self.state = ST_DONE
            self.t_last = time.monotonic_ns()

    def work(self) -> None:
        if not self.going or self.state != ST_READY:
            return
        txn = self.coord_lp is not None
        # with transactions: declare/discharge even when everything is sent
        allowed = self.work_txn() if txn else self.target
        if self.sent >= self.target:
            return
        lp = self.lp
        sent = self.sent
        n = min(int(_credit(lp)), self.target - sent, allowed)
        if not self.presettled:
            n = min(n, self.window - (sent - self.settled))
        if self.rate > 0:
            due = int((time.monotonic_ns() - self.t_start) * self.rate / 1e9) + 1
            n = min(n, due - sent)
        if n <= 0:
            return
        end = sent + n
        if txn:
            self.txn_sent += n
        now_ns = time.monotonic_ns
        new_delivery, send, advance, settle = _new_delivery, _send, _advance, _settle
        tagp, tag = self._tagp, self.tag
        presettled = self.presettled
        pid = self.pid
        pack_into, pack = PAYLOAD.pack_into, PAYLOAD.pack
        n_off = self.n_off
        n_pack = N_FIELD.pack_into
        txn_bytes = self._txn_bytes
        if self.t_first == 0:
            self.t_first = now_ns()
        while sent < end:
            seg_n, groups, gbase, gseq0 = self.segments[self._seg_index]
            seg_end = self._seg_start + seg_n
            if sent >= seg_end:
                self._seg_index += 1
                self._seg_start = seg_end
                continue
            stop = min(end, seg_end)
            if groups == 0:
                tpl, tpl_ptr, off, tlen = (
                    self.template,
                    self.tpl_ptr,
                    self.tpl_off,
                    len(self.template),
                )
                while sent < stop:
                    tagp[0] = sent & 0xFFFFFFFF
                    d = new_delivery(lp, tag)
                    if txn:
                        _set_txn_state(d, txn_bytes)
                    if n_off >= 0:
                        n_pack(tpl, n_off, sent)
                    pack_into(tpl, off, MAGIC, now_ns(), pid, sent, NO_GROUP, 0)
                    send(lp, tpl_ptr, tlen)
                    advance(lp)
                    if presettled:
                        settle(d)
                    sent += 1
            else:
                heads = self._group_heads(groups, gbase)
                pad = self.pad
                k0 = self._seg_start
                while sent < stop:
                    q, r = divmod(sent - k0, groups)
                    g = gbase + r
                    tagp[0] = sent & 0xFFFFFFFF
                    d = new_delivery(lp, tag)
                    if txn:
                        _set_txn_state(d, txn_bytes)
                    if n_off >= 0:
                        head = message_head(self.size, durable=self.durable, group=g, n=sent)
                    else:
                        head = heads[r] if heads else self.group_head(g)
                    msg = head + pack(MAGIC, now_ns(), pid, sent, g, gseq0 + q)
                    msg += pad
                    send(lp, msg, len(msg))
                    advance(lp)
                    if presettled:
                        settle(d)
                    sent += 1
        self.sent = sent

    def group_head(self, g: int) -> bytes:
        return message_head(self.size, durable=self.durable, group=g)

    def _group_heads(self, groups: int, gbase: int) -> list[bytes] | None:
        """Prebuilt heads of a segment's groups (None for very many groups: built per message)."""
        if groups > GROUP_HEAD_CACHE:
            return None
        key = (groups, gbase)
        if self._heads_key != key:
            self._heads_key = key
            self._heads = [self.group_head(gbase + r) for r in range(groups)]
        return self._heads

    def timeout_ms(self) -> int:
        if self.rate > 0 and self.going and self.sent < self.target and self.state == ST_READY:
            next_ns = self.t_start + self.sent * 1e9 / self.rate
            return max(0, min(1000, math.ceil((next_ns - time.monotonic_ns()) / 1e6)))
        return 1000

    def publish(self) -> None:
        SLOT.pack_into(
            self._mm,
            self.slot * SLOT.size,
            self.state,
            self.sent,
            self.acked if not self.presettled else self.sent,
            self.errors,
            self.not_accepted,
            self.t_first,
            self.t_last,
            0,
        )

    def result(self) -> dict[str, Any]:
        r = super().result()
        r.update(sent=self.sent, acked=self.acked, not_accepted=self.not_accepted)
        if self.coord_lp is not None:
            r["committed"] = self.committed
        return r


class ConsumerWorker(ClientWorker):
    def __init__(self, spec: dict[str, Any]) -> None:
        super().__init__(spec)
        self.credit = max(1, int(spec.get("credit", 1000)))
        self.half = max(1, self.credit // 2)
        self.hold_ns = int(float(spec.get("hold_ms", 0)) * 1e6)
        self.wait_go = bool(spec.get("wait_go"))
        self.received = 0
        self.ungrouped = 0
        self.bad_payload = 0
        self.violations = 0
        self.t_last_ungrouped = 0
        self.since_flow = 0
        self.glast: dict[int, int] = {}
        self.lat = array.array("q")
        self.held: deque[tuple[Any, int]] = deque()
        self.bufsize = 65536
        self.buf = ffi.new("char[]", self.bufsize)
        self.view = ffi.buffer(self.buf)
        if not self.wait_go:
            _flow(self.lp, self.credit)

    def make_link(self, ssn: Any) -> Any:
        link = ssn.receiver(f"perf-receiver-{self.slot}")
        link.source.address = self.spec["address"]
        selector = self.spec.get("selector")
        if selector:
            # filter set {jms-selector: described(0x0000468C00000004, selector)}
            f = link.source.filter
            f.put_map()
            f.enter()
            f.put_symbol(SELECTOR_FILTER_KEY)
            f.put_described()
            f.enter()
            f.put_ulong(SELECTOR_FILTER_CODE)
            f.put_string(selector)
            f.exit()
            f.exit()
        if self.spec.get("durable"):
            link.source.durability = proton.Terminus.CONFIGURATION
        link.snd_settle_mode = proton.Link.SND_UNSETTLED
        link.rcv_settle_mode = proton.Link.RCV_FIRST
        return link

    def on_go(self) -> None:
        if self.wait_go:
            _flow(self.lp, self.credit)

    def pump(self) -> None:
        coll, lp = self.coll, self.lp
        size = self.size
        buf, view = self.buf, self.view
        unpack_from = PAYLOAD.unpack_from
        lat_append = self.lat.append
        now_ns = time.monotonic_ns
        glast = self.glast
        hold = self.hold_ns
        received = self.received
        ungrouped = self.ungrouped
        t_ung = self.t_last_ungrouped
        bad = 0
        viol = 0
        since = self.since_flow
        half = self.half
        now = 0
        while True:
            ev = _peek(coll)
            if not ev:
                break
            et = _etype(ev)
            if et == PN_DELIVERY:
                d = _edelivery(ev)
                if not _partial(d) and _readable(d):
                    n = _pending(d)
                    if n > self.bufsize:
                        self.bufsize = n
                        self.buf = buf = ffi.new("char[]", n)
                        self.view = view = ffi.buffer(buf)
                    got = _recv(lp, buf, n)
                    _advance(lp)
                    now = now_ns()
                    received += 1
                    if got >= size:
                        magic, ts, _p, _i, g, gs = unpack_from(view, got - size)
                        if magic == MAGIC:
                            lat_append(now - ts)
                            if g == NO_GROUP:
                                ungrouped += 1
                                t_ung = now
                            else:
                                if gs != glast.get(g, -1) + 1:
                                    viol += 1
                                glast[g] = gs
                        else:
                            bad += 1
                    else:
                        bad += 1
                    if hold:
                        self.held.append((d, now + hold))
                    else:
                        _update(d, PN_ACCEPTED)
                        _settle(d)
                        since += 1
                        if since >= half:
                            _flow(lp, since)
                            since = 0
            elif et not in IGNORED_EVENTS:
                self.control(ev, et)
            _pop(coll)
        if now:
            if self.t_first == 0:
                self.t_first = now
            self.t_last = now
        self.received = received
        self.ungrouped = ungrouped
        self.t_last_ungrouped = t_ung
        self.bad_payload += bad
        self.violations += viol
        self.since_flow = since

    def work(self) -> None:
        if not self.held:
            return
        now = time.monotonic_ns()
        held = self.held
        while held and held[0][1] <= now:
            d, _due = held.popleft()
            _update(d, PN_ACCEPTED)
            _settle(d)
            self.since_flow += 1
            if self.since_flow >= self.half:
                _flow(self.lp, self.since_flow)
                self.since_flow = 0

    def timeout_ms(self) -> int:
        if self.held:
            return max(0, math.ceil((self.held[0][1] - time.monotonic_ns()) / 1e6))
        return 1000

    def begin_stop(self) -> None:
        # Accept what we still hold before closing: a message counted as received but
        # left unsettled would correctly go back to the queue and reach another
        # consumer, which the group check would then report as a split.
        while self.held:
            d, _due = self.held.popleft()
            _update(d, PN_ACCEPTED)
            _settle(d)
        super().begin_stop()

    def publish(self) -> None:
        SLOT.pack_into(
            self._mm,
            self.slot * SLOT.size,
            self.state,
            self.received,
            self.ungrouped,
            self.errors,
            self.violations,
            self.t_first,
            self.t_last,
            self.t_last_ungrouped,
        )

    def result(self) -> dict[str, Any]:
        r = super().result()
        out = Path(self.spec["out"])
        lat_file = out / f"lat-{self.slot}.bin"
        with open(lat_file, "wb") as f:
            self.lat.tofile(f)
        groups_file = out / f"groups-{self.slot}.bin"
        with open(groups_file, "wb") as f:
            array.array("I", self.glast.keys()).tofile(f)
        r.update(
            received=self.received,
            ungrouped=self.ungrouped,
            bad_payload=self.bad_payload,
            order_violations=self.violations,
            t_last_ungrouped=self.t_last_ungrouped,
            lat_file=str(lat_file),
            groups_file=str(groups_file),
        )
        return r


def worker_main(spec_json: str) -> int:
    spec = json.loads(spec_json)
    cls = ProducerWorker if spec["role"] == "producer" else ConsumerWorker
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the orchestrator stops us
    try:
        w = cls(spec)
    except OSError as exc:
        print(json.dumps({"slot": spec["slot"], "errors": 1, "first_error": f"connect: {exc}"}))
        # mark the slot failed so the orchestrator does not wait
        with open(spec["status"], "r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
            SLOT.pack_into(mm, int(spec["slot"]) * SLOT.size, ST_FAILED, 0, 0, 1, 0, 0, 0, 0)
        return 1
    try:
        w.loop()
    except Exception as exc:  # report, do not hide: the orchestrator prints it
        w.fail(f"{type(exc).__name__}: {exc}")
        raise
    finally:
        if w.state != ST_FAILED:
            w.state = ST_STOPPED
        w.publish()
        print(json.dumps(w.result()), flush=True)
        w.close()
    return 0
