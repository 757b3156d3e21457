"""The consumer worker process: `ConsumerWorker` (see `amqbroker.tools.perf.workers`).

It grants ``credit``, topped up when half is used, accepts and settles every
delivery, records latencies and checks group order. Its per-message code calls the
cffi aliases of the workers' import header as module globals of this module (imported
from `workers`, the same objects).
"""

from __future__ import annotations

import array
import math
import time
from collections import deque
from pathlib import Path
from typing import Any

import proton

from amqbroker.tools.perf.workers import (
    IGNORED_EVENTS,
    MAGIC,
    NO_GROUP,
    PAYLOAD,
    PN_ACCEPTED,
    PN_DELIVERY,
    SELECTOR_FILTER_CODE,
    SELECTOR_FILTER_KEY,
    SLOT,
    ClientWorker,
    _advance,
    _edelivery,
    _etype,
    _flow,
    _partial,
    _peek,
    _pending,
    _pop,
    _readable,
    _recv,
    _settle,
    _update,
    ffi,
)


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
