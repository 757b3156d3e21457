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

import contextlib
import json
import mmap
import os
import select
import signal
import socket
import time
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

# The producer and consumer workers are in producer.py and consumer.py. They import
# what they need of the header above from here (the cffi aliases too: module globals
# there, the same objects), so this header stays the workers' one import list.
__all__ = [
    "APP_PROPS_N_OFFSET",
    "DECLARE_MESSAGE",
    "DURABLE_HEADER",
    "GROUP_HEAD_CACHE",
    "IGNORED_EVENTS",
    "MAGIC",
    "MIN_SIZE",
    "NO_GROUP",
    "N_FIELD",
    "PAYLOAD",
    "PN_ACCEPTED",
    "PN_DELIVERY",
    "PN_LINK_REMOTE_OPEN",
    "PN_TERMINAL",
    "SELECTOR_FILTER_CODE",
    "SELECTOR_FILTER_KEY",
    "SLOT",
    "ST_DONE",
    "ST_READY",
    "TXN_DECLARED",
    "TXN_STATE",
    "ClientWorker",
    "_advance",
    "_credit",
    "_d_clear",
    "_d_enter",
    "_d_exit",
    "_d_put_binary",
    "_d_put_list",
    "_disp_data",
    "_dlink",
    "_edelivery",
    "_etype",
    "_flow",
    "_local_state",
    "_new_delivery",
    "_partial",
    "_peek",
    "_pending",
    "_pop",
    "_readable",
    "_recv",
    "_remote_disp",
    "_remote_settled",
    "_remote_state",
    "_send",
    "_settle",
    "_t_pending",
    "_unsettled",
    "_update",
    "discharge_message",
    "ffi",
    "lib",
    "message_head",
    "worker_main",
]


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


def worker_main(spec_json: str) -> int:
    from amqbroker.tools.perf.consumer import ConsumerWorker  # both import this module
    from amqbroker.tools.perf.producer import ProducerWorker

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
