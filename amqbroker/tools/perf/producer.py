"""The producer worker process: `ProducerWorker` (see `amqbroker.tools.perf.workers`).

It keeps at most ``window`` unsettled deliveries (never more than the link credit) and
counts every non-accepted outcome as an error; with --txn-batch it sends in local
transactions on the raw path (coordinator link, Declare, N transactional transfers,
Discharge). Its per-message code calls the cffi aliases of the workers' import header
as module globals of this module (imported from `workers`, the same objects).
"""

from __future__ import annotations

import math
import time
from typing import Any

import proton

from amqbroker.tools.perf.workers import (
    APP_PROPS_N_OFFSET,
    DECLARE_MESSAGE,
    DURABLE_HEADER,
    GROUP_HEAD_CACHE,
    IGNORED_EVENTS,
    MAGIC,
    MIN_SIZE,
    N_FIELD,
    NO_GROUP,
    PAYLOAD,
    PN_ACCEPTED,
    PN_DELIVERY,
    PN_LINK_REMOTE_OPEN,
    PN_TERMINAL,
    SLOT,
    ST_DONE,
    ST_READY,
    TXN_DECLARED,
    TXN_STATE,
    ClientWorker,
    _advance,
    _credit,
    _d_clear,
    _d_enter,
    _d_exit,
    _d_put_binary,
    _d_put_list,
    _disp_data,
    _dlink,
    _edelivery,
    _etype,
    _local_state,
    _new_delivery,
    _peek,
    _pop,
    _remote_disp,
    _remote_settled,
    _remote_state,
    _send,
    _settle,
    _t_pending,
    _unsettled,
    _update,
    discharge_message,
    ffi,
    lib,
    message_head,
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
