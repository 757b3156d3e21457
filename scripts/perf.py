#!/usr/bin/env python3
"""amqbroker's own benchmark: a fast AMQP 1.0 load client and the scenarios of issues 3 and 4.

Run it with the project's virtualenv (it needs python-qpid-proton and the stdlib only):

    .venv/bin/python scripts/perf.py --start-broker --scenario A,C,D,E,L
    .venv/bin/python scripts/perf.py --port 5672 --producers 1 --consumers 4 --groups 1000
    .venv/bin/python scripts/perf.py --start-broker --scenario G1K,G100K,G1M,HOL,MEM --runs 1
    .venv/bin/python scripts/perf.py --ceiling --scenario A,C      # the client's own ceiling

The client
----------
Every producer and every consumer is its own OS process (a copy of this script started
with ``--_worker``), so the client scales past one core. Each drives one connection
with one link through Proton's engine: the object API only sets the connection and the
link up; transfers, dispositions and flow go through ``cproton_ffi.lib`` directly (the
object API is ~10x slower and would make the client the bottleneck). Sockets are
non-blocking; reads push up to 1 MiB into the transport before the events are handled,
and the transport's output is written in one ``send`` per batch.

Messages are hand-encoded: [header durable=true] [properties with group-id] data
section. The first 32 body bytes carry a magic, the CLOCK_MONOTONIC send time, the
producer, the message index, the group and the group sequence, so the consumers
measure latency (same host, same clock) and check grouping: every group must reach one
consumer only, in order.

Producers keep at most ``--window`` unsettled deliveries (never more than the link
credit), settle each on the broker's outcome and count every non-accepted outcome as
an error. Consumers grant ``--credit``, topped up when half is used, and accept and
settle every delivery. Processes report progress through a small shared file (mmap)
and take "go"/"stop" on stdin.

What is printed per run: msgs/s (first send -> last receive), latency p50/p90/p99/max,
broker CPU % and CPU us per message (/proc/PID/stat), broker RSS (sampled every 100 ms),
the client's own CPU us per message (all its processes), and "other cores": machine
load from unrelated processes during the run (a shared machine is noisy; compare runs
with similar values). The broker process is --broker-pid, or the one started with
--start-broker, or the local process listening on the port (/proc/net/tcp +
/proc/*/fd). Benchmarks are never tests: nothing here asserts a time.

Scenarios (--scenario, comma separated)
---------------------------------------
A     1 producer -> 1 consumer, 100 B, at-least-once (200,000 messages)
C     1 producer -> 4 consumers
D     presettled sends
E     durable messages (header durable=true, durable terminus)
L     fixed 1,000 msgs/s (10,000 messages): latency
G1K   1 producer -> 4 consumers, 1,000 groups
G100K 1 producer -> 4 consumers, 100,000 groups
G1M   1 producer -> 4 consumers, 1,000,000 groups (1,000,000 messages): broker RSS
      growth per bound group (RSS with every group bound minus RSS before, / groups)
HOL   Artemis's head-of-line case: a slow consumer (credit 1, holds each message
      --hol-hold-ms) owns a group whose 100 messages sit at the head of the queue,
      1,000 ungrouped messages behind them, then 3 consumers with normal credit start:
      time until the 1,000 ungrouped are consumed. Runs twice: once on an ordinary
      queue, once on an address under "hol-strict." (amqbroker's strict setting
      group_skip_ahead=false, which --start-broker sets through
      AMQBROKER_ADDRESS_SETTINGS; set it yourself for a broker you started).
MEM   1,000,000 x 100 B sent to a queue without consumer: broker RSS growth per queued
      message beyond its payload; then drained by one consumer.

Options given explicitly override a scenario's values (e.g. ``--scenario A --count
20000``). Without --scenario one run is made from the options.

JMS features (any scenario)
---------------------------
--selector [TEXT]  every consumer attaches with a JMS selector filter (key jms-selector,
      descriptor 0x0000468C00000004; default "kind = 'load' AND n >= 0") and producers
      add application properties kind='load' (string) and n=<message index> (long), so
      that the default selector matches every message. --app-props adds the properties
      without a selector (the baseline that isolates the filter).
--txn-batch N  producers send in local transactions of N messages, on the raw path too:
      a coordinator link (capability amqp:local-transactions) on the producer's session,
      Declare -> declared {txn-id}, N transfers carrying transactional-state {txn-id},
      Discharge [txn-id, false], and the next Declare only after its accepted.
      "producers ... msgs/s" is then the committed rate.
Runs with these options are labelled e.g. "C+sel", "A+txn100".

--ceiling runs the same worker processes against a minimal in-script "null broker" (a
raw-cffi relay: accepts connections, forwards every transfer from producer links to
consumer links, settles; no queue logic) and so shows what the client itself can move
on this machine, and at what CPU cost per message. The group check is skipped there (the
relay does not group).

--report NAME=FILE ... combines the --json output of several brokers into a markdown
table with ratios (first NAME / each other); scripts/compare-peers uses it.
"""

from __future__ import annotations

import argparse
import array
import contextlib
import json
import math
import mmap
import os
import re
import select
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

SCRIPT = os.path.abspath(__file__)
ROOT = Path(SCRIPT).resolve().parent.parent

# ----------------------------------------------------------------------------- payload

MAGIC = 0x31465245_50514D41  # "AMQPERF1" little-endian
#: magic, send time (CLOCK_MONOTONIC ns), producer, message index, group, group sequence
PAYLOAD = struct.Struct("<QqIIII")
MIN_SIZE = PAYLOAD.size
NO_GROUP = 0xFFFFFFFF

#: header section {durable: true}
DURABLE_HEADER = b"\x00\x53\x70\xc0\x02\x01\x41"
#: properties section, list8 of 11 fields: 10 nulls then group-id as str8
_PROPS_HEAD = b"\x00\x53\x73\xc0"
_PROPS_NULLS = b"\x0b" + b"\x40" * 10 + b"\xa1"

#: application properties of --selector runs: kind='load' (str8), n=<message index> (long)
_APP_PROPS_FIXED = b"\xa1\x04kind\xa1\x04load"
N_FIELD = struct.Struct(">q")
#: offset of n's 8 value bytes in the section app_props() returns
APP_PROPS_N_OFFSET = 6 + len(_APP_PROPS_FIXED) + 4
DEFAULT_SELECTOR = "kind = 'load' AND n >= 0"
#: the JMS selector filter (Qpid JMS sends it under the key jms-selector)
SELECTOR_FILTER_KEY = "jms-selector"
SELECTOR_FILTER_CODE = 0x0000468C00000004
#: transactions (AMQP 1.0 part 4): declare, discharge, declared, transactional-state
TXN_DECLARE, TXN_DISCHARGE, TXN_DECLARED, TXN_STATE = 0x31, 0x32, 0x33, 0x34
#: amqp-value section holding a Declare with an empty field list
DECLARE_MESSAGE = b"\x00\x53\x77\x00\x53\x31\x45"


def discharge_message(txn_id: bytes, fail: bool = False) -> bytes:
    """amqp-value section holding Discharge [txn-id, fail]."""
    fields = b"\xa0%c%s%s" % (len(txn_id), txn_id, b"\x41" if fail else b"\x42")
    return b"\x00\x53\x77\x00\x53\x32\xc0%c\x02%s" % (len(fields) + 1, fields)


#: hol-strict.# gets group_skip_ahead=false when --start-broker starts amqbroker
HOL_STRICT_PREFIX = "hol-strict."
#: producers prebuild the properties of up to this many groups (~60 B each)
GROUP_HEAD_CACHE = 200_000
#: below this many bound groups, RSS growth per group is noise (not reported)
RSS_PER_GROUP_MIN = 100_000
HOL_GROUPED = 100
HOL_UNGROUPED = 1000
HOL_FAST_CONSUMERS = 3


def data_section_head(size: int) -> bytes:
    """Descriptor and length of a data section of `size` bytes."""
    if size <= 255:
        return b"\x00\x53\x75\xa0" + bytes((size,))
    return b"\x00\x53\x75\xb0" + size.to_bytes(4, "big")


def group_id(g: int) -> bytes:
    return b"g%d" % g


def app_props(n: int) -> bytes:
    """The application-properties section of --selector/--app-props runs:
    {kind: 'load', n: <n as long>} (map8; n fixed-width, so a template is rewritten in
    place at APP_PROPS_N_OFFSET)."""
    body = _APP_PROPS_FIXED + b"\xa1\x01n\x81" + N_FIELD.pack(n)
    return b"\x00\x53\x74\xc1%c\x04%s" % (len(body) + 1, body)


def message_head(
    size: int, *, durable: bool = False, group: int | None = None, n: int | None = None
) -> bytes:
    """Everything of a message before its body's bytes: [header] [properties]
    [application-properties, when `n` is given] and the data section's descriptor and
    length."""
    head = DURABLE_HEADER if durable else b""
    if group is not None:
        gid = group_id(group)
        head += b"%s%c%s%c%s" % (_PROPS_HEAD, 13 + len(gid), _PROPS_NULLS, len(gid), gid)
    if n is not None:
        head += app_props(n)
    return head + data_section_head(size)


def encode_message(
    payload: bytes,
    size: int,
    *,
    durable: bool = False,
    group: int | None = None,
    n: int | None = None,
) -> bytes:
    """A complete bare message as the producers build it. `payload` is the packed
    32-byte head of the body; the rest of the body is padding."""
    head = message_head(size, durable=durable, group=group, n=n)
    return head + payload + b"x" * (size - len(payload))


# --------------------------------------------------------------------------- statistics


def percentile(sorted_values: Any, p: float) -> Any:
    """Nearest-rank percentile of an ascending sequence (None when empty)."""
    n = len(sorted_values)
    if n == 0:
        return None
    k = math.ceil(p / 100.0 * n) - 1
    return sorted_values[min(max(k, 0), n - 1)]


def latency_summary(latencies_ns: Any) -> dict[str, float | None]:
    """p50/p90/p99/max in microseconds of a sequence of latencies in ns."""
    values = sorted(latencies_ns)
    out: dict[str, float | None] = {}
    for name, p in (("p50", 50), ("p90", 90), ("p99", 99), ("max", 100)):
        v = percentile(values, p)
        out[f"lat_{name}_us"] = None if v is None else round(v / 1000.0, 1)
    return out


def split_evenly(total: int, parts: int) -> list[int]:
    """`total` split into `parts` integers differing by at most one, larger first."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def median_or_none(values: list[Any]) -> Any:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


# ----------------------------------------------------------------------- /proc helpers

CLK_TCK = os.sysconf("SC_CLK_TCK")


def parse_stat_cpu_ticks(stat_text: str) -> int:
    """utime + stime (clock ticks, all threads) from the text of /proc/PID/stat."""
    rest = stat_text[stat_text.rindex(")") + 2 :].split()
    # rest[0] is field 3 (state); utime and stime are fields 14 and 15
    return int(rest[11]) + int(rest[12])


def proc_cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        return parse_stat_cpu_ticks(f.read()) / CLK_TCK


def parse_status_kb(status_text: str, key: str = "VmRSS") -> int | None:
    """A kB field (VmRSS, VmHWM, ...) of the text of /proc/PID/status."""
    for line in status_text.splitlines():
        name, _, value = line.partition(":")
        if name == key:
            return int(value.split()[0])
    return None


def proc_rss_kb(pid: int, key: str = "VmRSS") -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            return parse_status_kb(f.read(), key)
    except OSError:
        return None


def proc_cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def parse_listen_inodes(proc_net_tcp_text: str, port: int) -> set[str]:
    """Socket inodes in LISTEN state (0A) on `port` in the text of /proc/net/tcp[6]."""
    inodes = set()
    for line in proc_net_tcp_text.splitlines()[1:]:
        parts = line.split()
        if len(parts) < 10:
            continue
        local, state, inode = parts[1], parts[3], parts[9]
        if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
            inodes.add(inode)
    return inodes


def find_pid_by_port(port: int) -> int | None:
    """The local process listening on TCP `port` (None if not found or not visible)."""
    inodes: set[str] = set()
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as f:
                inodes |= parse_listen_inodes(f.read(), port)
        except OSError:
            continue
    if not inodes:
        return None
    targets = {f"socket:[{i}]" for i in inodes}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fd_dir = f"/proc/{entry}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"{fd_dir}/{fd}") in targets:
                    return int(entry)
            except OSError:
                continue
    return None


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine spent busy (all cores) since boot."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    return (sum(v) - v[3] - v[4]) / CLK_TCK


class RssSampler:
    """Samples a process's VmRSS every `period` seconds in a thread; keeps the max."""

    def __init__(self, pid: int | None, period: float = 0.1) -> None:
        self.pid = pid
        self.period = period
        self.max_kb = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> RssSampler:
        if self.pid:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while True:
            kb = proc_rss_kb(self.pid) if self.pid else None
            if kb is None:
                return
            self.max_kb = max(self.max_kb, kb)
            if self._stop.wait(self.period):
                return

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.pid:
            kb = proc_rss_kb(self.pid)
            if kb:
                self.max_kb = max(self.max_kb, kb)


# ============================================================================ workers
#
# Everything below down to "orchestration" runs in the worker processes (and the null
# broker). The per-message code binds cffi functions as globals or locals on purpose.

try:
    import proton
    from cproton_ffi import ffi, lib
except ImportError:  # pragma: no cover - the project depends on python-qpid-proton
    proton = ffi = lib = None

IBUF = 256 * 1024
OBUF = 256 * 1024
READ_BATCH = 1024 * 1024

if lib is not None:
    _peek = lib.pn_collector_peek
    _pop = lib.pn_collector_pop
    _etype = lib.pn_event_type
    _edelivery = lib.pn_event_delivery
    _elink = lib.pn_event_link
    _dlink = lib.pn_delivery_link
    _partial = lib.pn_delivery_partial
    _readable = lib.pn_delivery_readable
    _pending = lib.pn_delivery_pending
    _recv = lib.pn_link_recv
    _send = lib.pn_link_send
    _advance = lib.pn_link_advance
    _new_delivery = lib.pn_delivery
    _settle = lib.pn_delivery_settle
    _update = lib.pn_delivery_update
    _remote_state = lib.pn_delivery_remote_state
    _remote_settled = lib.pn_delivery_settled
    _credit = lib.pn_link_credit
    _flow = lib.pn_link_flow
    _unsettled = lib.pn_link_unsettled
    _t_capacity = lib.pn_transport_capacity
    _t_push = lib.pn_transport_push
    _t_pending = lib.pn_transport_pending
    _t_peek = lib.pn_transport_peek
    _t_pop = lib.pn_transport_pop
    _t_close_tail = lib.pn_transport_close_tail
    _t_close_head = lib.pn_transport_close_head
    _t_tick = lib.pn_transport_tick
    PN_DELIVERY = lib.PN_DELIVERY
    PN_LINK_FLOW = lib.PN_LINK_FLOW
    PN_TRANSPORT = lib.PN_TRANSPORT
    PN_ACCEPTED = lib.PN_ACCEPTED
    _local_state = lib.pn_delivery_local
    _remote_disp = lib.pn_delivery_remote
    _disp_data = lib.pn_disposition_data
    _d_clear = lib.pn_data_clear
    _d_put_list = lib.pn_data_put_list
    _d_put_binary = lib.pn_data_put_binary
    _d_enter = lib.pn_data_enter
    _d_exit = lib.pn_data_exit
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

#: status slot of a worker in the shared file: state, then role-specific counters
SLOT = struct.Struct("<8q")
ST_STARTING, ST_READY, ST_DONE, ST_STOPPED, ST_FAILED = 0, 1, 2, 3, -1
# producer: state, sent, acked, errors, not_accepted, t_first_send, t_last, 0
# consumer: state, received, ungrouped, errors, order_violations, t_first, t_last, t_last_ungrouped
F_STATE, F_COUNT, F_AUX, F_ERRORS, F_BAD, F_T_FIRST, F_T_LAST, F_T_AUX = range(8)


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


def mask_for(wire: Wire) -> int:
    if wire.eof:
        return 0
    return select.POLLIN | select.POLLOUT if wire.want_write else select.POLLIN


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
        local, ddata, update = _local_state, _disp_data, _update
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
                        # transactional-state {txn-id}, as Qpid JMS sends it
                        data = ddata(local(d))
                        _d_clear(data)
                        _d_put_list(data)
                        _d_enter(data)
                        _d_put_binary(data, txn_bytes)
                        _d_exit(data)
                        update(d, TXN_STATE)
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
                        data = ddata(local(d))
                        _d_clear(data)
                        _d_put_list(data)
                        _d_enter(data)
                        _d_put_binary(data, txn_bytes)
                        _d_exit(data)
                        update(d, TXN_STATE)
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
            nc = conns.get(fd)
            if nc is not None:
                nc.wire.read()
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


# ====================================================================== orchestration


class RunError(Exception):
    pass


@dataclass(frozen=True)
class Scenario:
    name: str
    what: str
    kind: str = "flow"  # flow | hol | mem
    count: int = 200_000
    size: int = 100
    producers: int = 1
    consumers: int = 1
    groups: int = 0
    durable: bool = False
    presettled: bool = False
    rate: float = 0.0


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("A", "1 producer -> 1 consumer, 100 B, at-least-once"),
        Scenario("C", "1 producer -> 4 consumers", consumers=4),
        Scenario("D", "presettled sends", presettled=True),
        Scenario("E", "durable messages", durable=True),
        Scenario("L", "fixed 1,000 msgs/s, latency", rate=1000.0, count=10_000),
        Scenario("G1K", "1 -> 4 consumers, 1,000 groups", consumers=4, groups=1000),
        Scenario("G100K", "1 -> 4 consumers, 100,000 groups", consumers=4, groups=100_000),
        Scenario(
            "G1M",
            "1 -> 4 consumers, 1,000,000 groups",
            consumers=4,
            groups=1_000_000,
            count=1_000_000,
        ),
        Scenario("HOL", "head-of-line: slow group owner at the head", kind="hol", consumers=4),
        Scenario("MEM", "1,000,000 queued messages, no consumer", kind="mem", count=1_000_000),
    )
}

#: options that, given explicitly, override a scenario's value
_OVERRIDABLE = (
    "count",
    "size",
    "producers",
    "consumers",
    "groups",
    "durable",
    "presettled",
    "rate",
)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="perf.py",
        description="amqbroker's benchmark: a fast multi-process AMQP 1.0 load client "
        "(Proton's cffi layer) printing msgs/s, latency, broker CPU and RSS.",
        epilog="Scenarios: "
        + "; ".join(f"{s.name}: {s.what}" for s in SCENARIOS.values())
        + ". See the module docstring for details.",
    )
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=5672)
    ap.add_argument(
        "--address", default="perf", help="queue name base (a unique suffix is added per run)"
    )
    ap.add_argument("--address-prefix", default="", help="e.g. /queue/ for RabbitMQ 3.x")
    ap.add_argument("--scenario", default=None, help="comma-separated: " + ",".join(SCENARIOS))
    ap.add_argument("--count", type=int, default=None, help="messages per run (default 200000)")
    ap.add_argument(
        "--size", type=int, default=None, help=f"body bytes (>= {MIN_SIZE}; default 100)"
    )
    ap.add_argument("--producers", type=int, default=None, help="producer processes (default 1)")
    ap.add_argument("--consumers", type=int, default=None, help="consumer processes (default 1)")
    ap.add_argument(
        "--groups", type=int, default=None, help="group ids to cycle over (0 = ungrouped)"
    )
    ap.add_argument("--durable", action="store_true", default=None, help="header durable=true")
    ap.add_argument("--presettled", action="store_true", default=None, help="presettled sends")
    ap.add_argument(
        "--rate", type=float, default=None, help="fixed total msgs/s (0 = as fast as possible)"
    )
    ap.add_argument(
        "--selector",
        nargs="?",
        const=DEFAULT_SELECTOR,
        default=None,
        metavar="TEXT",
        help="every consumer attaches with this JMS selector (jms-selector filter); producers "
        f"add application properties kind='load', n=<index> (default {DEFAULT_SELECTOR!r}, "
        "which matches every message)",
    )
    ap.add_argument(
        "--app-props",
        action="store_true",
        help="producers add the --selector application properties, consumers no selector "
        "(the baseline that isolates the filter's cost)",
    )
    ap.add_argument(
        "--txn-batch",
        type=int,
        default=0,
        metavar="N",
        help="producers send in local transactions of N messages (declare, N transfers, "
        "discharge, wait for its outcome; 0 = none)",
    )
    ap.add_argument("--window", type=int, default=1000, help="producer max unsettled (1000)")
    ap.add_argument("--credit", type=int, default=1000, help="consumer credit (1000)")
    ap.add_argument("--runs", type=int, default=3, help="runs per scenario (3)")
    ap.add_argument(
        "--warmup",
        type=int,
        default=10_000,
        help="messages of a discarded first run of A (10000; 0 = none)",
    )
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per run phase (300)")
    ap.add_argument("--json", action="store_true", help="one JSON line per run on stdout")
    ap.add_argument("--label", default=None, help="name of the broker in the output")
    ap.add_argument(
        "--broker-pid", type=int, default=None, help="default: the local listener on --port"
    )
    ap.add_argument(
        "--start-broker", action="store_true", help="start amqbroker (--port 0, temp data dir)"
    )
    ap.add_argument(
        "--ceiling", action="store_true", help="measure the client against an in-script null broker"
    )
    ap.add_argument(
        "--hol-hold-ms", type=float, default=10.0, help="HOL: slow consumer's time per message"
    )
    ap.add_argument("--user", default=None, help="SASL PLAIN user (default ANONYMOUS)")
    ap.add_argument("--password", default=None)
    ap.add_argument("--no-sasl", action="store_true", help="no SASL layer")
    ap.add_argument(
        "--report", nargs="+", metavar="NAME=FILE", help="combine --json files into a table"
    )
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.report:
        return args
    if args.start_broker and args.ceiling:
        ap.error("--start-broker and --ceiling exclude each other")
    try:
        args.scenarios = resolve_scenarios(args)
    except ValueError as exc:
        ap.error(str(exc))
    if args.ceiling:
        bad = [s.name for s in args.scenarios if s.kind != "flow"]
        if bad:
            ap.error(f"--ceiling does not apply to {','.join(bad)} (needs a real queue)")
    if args.window < 1 or args.credit < 1 or args.runs < 1:
        ap.error("--window, --credit and --runs must be >= 1")
    if args.txn_batch < 0:
        ap.error("--txn-batch must be >= 0")
    if args.selector is not None and not args.selector.strip():
        ap.error("--selector must not be empty")
    if args.ceiling and args.txn_batch:
        ap.error("--txn-batch needs a real broker (the null broker has no coordinator)")
    return args


def variant(args: argparse.Namespace) -> str:
    """Suffix of the scenario name for the JMS feature options ('' for a plain run)."""
    out = ""
    if args.selector:
        out += "+sel"
    elif args.app_props:
        out += "+props"
    if args.txn_batch:
        out += f"+txn{args.txn_batch}"
    return out


def resolve_scenarios(args: argparse.Namespace) -> list[Scenario]:
    """The scenarios to run, with explicitly given options applied; ValueError if bad."""
    overrides = {k: getattr(args, k) for k in _OVERRIDABLE if getattr(args, k) is not None}
    if args.scenario:
        names = [n.strip().upper() for n in args.scenario.split(",") if n.strip()]
        unknown = [n for n in names if n not in SCENARIOS]
        if unknown:
            raise ValueError(
                f"unknown scenario(s) {','.join(unknown)}; known: {','.join(SCENARIOS)}"
            )
        chosen = [replace(SCENARIOS[n], **overrides) for n in names]
    else:
        chosen = [replace(Scenario("custom", "from the options"), **overrides)]
    for s in chosen:
        if s.size < MIN_SIZE:
            raise ValueError(f"--size must be at least {MIN_SIZE} (the body carries the timestamp)")
        if s.count < 1 or s.producers < 1 or s.consumers < 1 or s.groups < 0 or s.rate < 0:
            raise ValueError(
                "--count, --producers, --consumers must be >= 1; --groups, --rate >= 0"
            )
        if 0 < s.groups < s.producers:
            raise ValueError(
                "--groups must be 0 or at least --producers (each producer owns its groups)"
            )
        if s.groups >= NO_GROUP:
            raise ValueError("--groups is too large")
    return chosen


def producer_segments(count: int, groups: int, producers: int) -> list[list[dict[str, int]]]:
    """Per producer, the segments it sends: its share of the messages, cycling over its
    own block of group ids (so each group has one sender and a well-defined order)."""
    counts = split_evenly(count, producers)
    if groups == 0:
        return [[{"n": n}] for n in counts]
    gcounts = split_evenly(groups, producers)
    out, base = [], 0
    for n, g in zip(counts, gcounts, strict=True):
        out.append([{"n": n, "groups": g, "gbase": base, "gseq0": 0}])
        base += g
    return out


# ------------------------------------------------------------------------- targets


@dataclass
class Target:
    host: str
    port: int
    pid: int | None
    label: str
    proc: subprocess.Popen[bytes] | None = None
    tmpdir: str | None = None
    strict_configured: bool = False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.tmpdir:
            shutil.rmtree(self.tmpdir, ignore_errors=True)


LISTENING_RE = re.compile(r"listening on (?:amqp://)?([\w.:\[\]-]+):(\d+)")


def strict_address_settings(existing: str | None) -> str:
    """AMQBROKER_ADDRESS_SETTINGS with hol-strict.# -> group_skip_ahead=false added."""
    table = json.loads(existing) if existing else {}
    table.setdefault(HOL_STRICT_PREFIX + "#", {}).setdefault("group_skip_ahead", False)
    return json.dumps(table)


def _wait_listening(proc: subprocess.Popen[bytes], out_path: Path, what: str) -> int:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        text = out_path.read_text(errors="replace") if out_path.exists() else ""
        m = LISTENING_RE.search(text)
        if m:
            return int(m.group(2))
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    raise RunError(
        f"{what} did not start; its output:\n{out_path.read_text(errors='replace')[-3000:]}"
    )


def start_broker(args: argparse.Namespace) -> Target:
    tmp = tempfile.mkdtemp(prefix="amqbroker-perf-")
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env["AMQBROKER_ADDRESS_SETTINGS"] = strict_address_settings(
        env.get("AMQBROKER_ADDRESS_SETTINGS")
    )
    out = Path(tmp) / "broker.out"
    cmd = [sys.executable, "-m", "amqbroker", "run", "--host", "127.0.0.1", "--port", "0"]
    cmd += ["--data-dir", str(Path(tmp) / "data")]
    with open(out, "wb") as fo, open(Path(tmp) / "broker.log", "wb") as fe:
        proc = subprocess.Popen(
            cmd, stdout=fo, stderr=fe, stdin=subprocess.DEVNULL, env=env, cwd=ROOT
        )
    target = Target("127.0.0.1", 0, proc.pid, args.label or "amqbroker", proc, tmp, True)
    try:
        target.port = _wait_listening(proc, out, "amqbroker")
    except BaseException:
        with contextlib.suppress(OSError):
            print((Path(tmp) / "broker.log").read_text(errors="replace")[-3000:], file=sys.stderr)
        target.stop()
        raise
    return target


def start_null_broker(args: argparse.Namespace) -> Target:
    tmp = tempfile.mkdtemp(prefix="amqbroker-perf-null-")
    out = Path(tmp) / "null.out"
    cmd = [sys.executable, SCRIPT, "--_null-broker", "--credit", str(args.window)]
    with open(out, "wb") as fo:
        proc = subprocess.Popen(cmd, stdout=fo, stderr=None, stdin=subprocess.DEVNULL)
    target = Target("127.0.0.1", 0, proc.pid, args.label or "null-broker", proc, tmp)
    try:
        target.port = _wait_listening(proc, out, "the null broker")
    except BaseException:
        target.stop()
        raise
    return target


# -------------------------------------------------------------------------- fleet


@dataclass
class Worker:
    proc: subprocess.Popen[bytes]
    slot: int
    role: str
    result: dict[str, Any] | None = None

    @property
    def name(self) -> str:
        return f"{self.role} #{self.slot}"


class Fleet:
    """The worker processes of one run and their shared status file."""

    def __init__(self, args: argparse.Namespace, target: Target, address: str, nslots: int) -> None:
        self.args = args
        self.target = target
        self.address = address
        self.dir = Path(tempfile.mkdtemp(prefix="amqbroker-perf-run-"))
        self.status_path = self.dir / "status.bin"
        self.status_path.write_bytes(bytes(SLOT.size * nslots))
        self._f = open(self.status_path, "r+b")  # noqa: SIM115 - closed in close()
        self.mm = mmap.mmap(self._f.fileno(), 0)
        self.workers: list[Worker] = []
        self.nslots = nslots

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def spawn(self, role: str, **extra: Any) -> Worker:
        slot = len(self.workers)
        if slot >= self.nslots:
            raise RunError("internal: too many workers for the status file")
        a = self.args
        spec = {
            "role": role,
            "slot": slot,
            "status": str(self.status_path),
            "out": str(self.dir),
            "host": self.target.host,
            "port": self.target.port,
            "address": self.address,
            "user": a.user,
            "password": a.password,
            "no_sasl": a.no_sasl,
            "window": a.window,
            "credit": a.credit,
            "selector": a.selector,
            "app_props": bool(a.selector or a.app_props),
            "txn_batch": a.txn_batch,
        }
        spec.update(extra)
        proc = subprocess.Popen(
            [sys.executable, SCRIPT, "--_worker", json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        w = Worker(proc, slot, role)
        self.workers.append(w)
        return w

    def slot(self, w: Worker) -> tuple[int, ...]:
        return SLOT.unpack_from(self.mm, w.slot * SLOT.size)

    def send(self, workers: list[Worker], cmd: str) -> None:
        for w in workers:
            if w.proc.poll() is None and w.proc.stdin is not None:
                with contextlib.suppress(OSError):
                    w.proc.stdin.write(cmd.encode() + b"\n")
                    w.proc.stdin.flush()

    def wait(self, what: str, cond: Any, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if cond():
                return
            for w in self.workers:
                st = self.slot(w)
                if st[F_STATE] == ST_FAILED or st[F_ERRORS] > 0:
                    raise RunError(f"{w.name} failed while waiting for {what}")
                if w.proc.poll() is not None and w.result is None:
                    raise RunError(
                        f"{w.name} exited (rc={w.proc.returncode}) while waiting for {what}"
                    )
            if time.monotonic() > deadline:
                raise RunError(f"timed out after {timeout:.0f} s waiting for {what}")
            time.sleep(0.005)

    def wait_ready(self, workers: list[Worker]) -> None:
        self.wait(
            "the links to open",
            lambda: all(self.slot(w)[F_STATE] >= ST_READY for w in workers),
            min(self.args.timeout, 60),
        )

    def cpu_seconds(self) -> dict[int, float]:
        """CPU seconds used so far by each live worker process, by pid."""
        out = {}
        for w in self.workers:
            with contextlib.suppress(OSError, ValueError):
                out[w.proc.pid] = proc_cpu_seconds(w.proc.pid)
        return out

    def stop(self, workers: list[Worker] | None = None) -> None:
        ws = [w for w in (workers or self.workers) if w.result is None]
        self.send(ws, "stop")
        for w in ws:
            try:
                out, _ = w.proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                w.proc.kill()
                out, _ = w.proc.communicate()
            lines = [ln for ln in out.decode(errors="replace").splitlines() if ln.startswith("{")]
            try:
                w.result = json.loads(lines[-1]) if lines else {}
            except ValueError:
                w.result = {}
            if not w.result:
                w.result = {
                    "errors": 1,
                    "first_error": f"{w.name} gave no result (rc={w.proc.returncode})",
                }

    def close(self) -> None:
        for w in self.workers:
            if w.proc.poll() is None:
                w.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired, ValueError, OSError):
                w.proc.communicate(timeout=10)
        self.mm.close()
        self._f.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def first_error(self) -> str | None:
        for w in self.workers:
            if w.result and w.result.get("first_error"):
                return f"{w.name}: {w.result['first_error']}"
        return None


# ---------------------------------------------------------------------- measuring


class Window:
    """Broker CPU, client CPU and machine load between `start` and `end`."""

    def __init__(self, pid: int | None, fleet: Fleet) -> None:
        self.pid = pid
        self.fleet = fleet

    def _broker_cpu(self) -> float | None:
        if not self.pid:
            return None
        try:
            return proc_cpu_seconds(self.pid)
        except OSError:
            return None

    def start(self) -> None:
        self.t0 = time.monotonic()
        self.b0 = self._broker_cpu()
        self.c0 = self.fleet.cpu_seconds()
        self.m0 = machine_busy_seconds()
        self.rss0 = proc_rss_kb(self.pid) if self.pid else None

    def end(self) -> None:
        self.t1 = time.monotonic()
        self.b1 = self._broker_cpu()
        self.c1 = self.fleet.cpu_seconds()
        self.m1 = machine_busy_seconds()
        self.rss1 = proc_rss_kb(self.pid) if self.pid else None

    def metrics(self, messages: int) -> dict[str, Any]:
        wall = max(self.t1 - self.t0, 1e-9)
        bcpu = None if self.b0 is None or self.b1 is None else self.b1 - self.b0
        per_proc = [t - self.c0.get(pid, 0.0) for pid, t in self.c1.items()]
        ccpu = sum(per_proc)
        busiest = max(per_proc, default=0.0)
        other = (self.m1 - self.m0) - (bcpu or 0.0) - ccpu
        n = max(messages, 1)
        return {
            "wall_s": round(wall, 3),
            "broker_cpu_pct": None if bcpu is None else round(100 * bcpu / wall, 1),
            "broker_cpu_us_per_msg": None if bcpu is None else round(1e6 * bcpu / n, 2),
            "client_cpu_pct": round(100 * ccpu / wall, 1),
            "client_cpu_us_per_msg": round(1e6 * ccpu / n, 2),
            # each client process on its own core could not go faster than this
            "client_ceiling_est_msgs_per_s": round(n / busiest) if busiest > 0 else None,
            "other_cores": round(max(0.0, other) / wall, 2),
            "broker_rss_before_kb": self.rss0,
            "broker_rss_after_kb": self.rss1,
        }


def _consumer_results(fleet: Fleet, consumers: list[Worker], check_groups: bool) -> dict[str, Any]:
    lat = array.array("q")
    groups = array.array("I")
    out: dict[str, Any] = {"received": 0, "bad_payload": 0, "order_violations": 0, "errors": 0}
    for w in consumers:
        r = w.result or {}
        out["received"] += int(r.get("received", 0))
        out["bad_payload"] += int(r.get("bad_payload", 0))
        out["order_violations"] += int(r.get("order_violations", 0))
        out["errors"] += int(r.get("errors", 0))
        for key, arr in (("lat_file", lat), ("groups_file", groups)):
            path = r.get(key)
            if path and os.path.exists(path):
                with open(path, "rb") as f:
                    arr.frombytes(f.read())
    out.update(latency_summary(lat))
    if check_groups:
        split = len(groups) - len(set(groups))
        out["groups_seen"] = len(groups) - split
        out["group_split"] = split
        ok = split == 0 and out["order_violations"] == 0
        out["group_check"] = "ok" if ok else "FAILED"
    return out


def _sum_producers(producers: list[Worker]) -> dict[str, int]:
    res = [w.result or {} for w in producers]
    return {
        "sent": sum(int(r.get("sent", 0)) for r in res),
        "acked": sum(int(r.get("acked", 0)) for r in res),
        "not_accepted": sum(int(r.get("not_accepted", 0)) for r in res),
        "producer_errors": sum(int(r.get("errors", 0)) for r in res),
    }


def _finish(row: dict[str, Any], expected: int) -> dict[str, Any]:
    received = int(row.get("received", 0))
    missing = max(0, expected - received)
    # nothing is ever released or redelivered in these scenarios: more is a duplicate
    extra = max(0, received - expected)
    row["missing"] = missing
    row["extra"] = extra
    row["errors"] = (
        int(row.get("errors", 0))
        + int(row.pop("producer_errors", 0))
        + int(row.get("not_accepted", 0))
        + int(row.get("bad_payload", 0))
        + missing
        + extra
    )
    row["ok"] = row["errors"] == 0 and row.get("group_check", "ok") in ("ok", "skipped")
    return row


def base_row(
    args: argparse.Namespace, target: Target, sc: Scenario, run: int, address: str
) -> dict[str, Any]:
    return {
        "broker": target.label,
        "scenario": sc.name + variant(args),
        "run": run,
        "address": address,
        "count": sc.count,
        "size": sc.size,
        "producers": sc.producers,
        "consumers": sc.consumers,
        "groups": sc.groups,
        "durable": sc.durable,
        "presettled": sc.presettled,
        "rate": sc.rate,
        "window": args.window,
        "credit": args.credit,
        "selector": args.selector,
        "app_props": bool(args.selector or args.app_props),
        "txn_batch": args.txn_batch,
        "broker_pid": target.pid,
        "ts": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def unique_address(args: argparse.Namespace, base: str, tag: str) -> str:
    """`base` with a unique suffix on its name (before any '?options')."""
    name, sep, query = base.partition("?")
    suffix = f"{tag}-{os.getpid()}-{time.monotonic_ns() % 10**9}"
    return f"{args.address_prefix}{name}-{suffix}{sep}{query}"


def run_flow(args: argparse.Namespace, target: Target, sc: Scenario, run: int) -> dict[str, Any]:
    address = unique_address(args, args.address, f"{sc.name.lower()}{run}")
    row = base_row(args, target, sc, run, address)
    check_groups = sc.groups > 0 and not args.ceiling
    with Fleet(args, target, address, sc.producers + sc.consumers) as fleet:
        consumers = [
            fleet.spawn("consumer", size=sc.size, durable=sc.durable) for _ in range(sc.consumers)
        ]
        try:
            fleet.wait_ready(consumers)
            producers = [
                fleet.spawn(
                    "producer",
                    producer_id=i,
                    size=sc.size,
                    durable=sc.durable,
                    presettled=sc.presettled,
                    rate=sc.rate / sc.producers,
                    segments=segs,
                )
                for i, segs in enumerate(producer_segments(sc.count, sc.groups, sc.producers))
            ]
            fleet.wait_ready(producers)
            win = Window(target.pid, fleet)
            with RssSampler(target.pid) as rss:
                win.start()
                fleet.send(producers, "go")
                fleet.wait(
                    f"{sc.count} messages",
                    lambda: (
                        sum(fleet.slot(w)[F_COUNT] for w in consumers) >= sc.count
                        and all(fleet.slot(w)[F_STATE] == ST_DONE for w in producers)
                    ),
                    args.timeout,
                )
                win.end()
            row["timed_out"] = False
        except RunError as exc:
            row["timed_out"] = "timed out" in str(exc)
            row["run_error"] = str(exc)
            win = None
            rss = None
        fleet.stop()
        row.update(_sum_producers(fleet.workers[sc.consumers :]))
        row.update(_consumer_results(fleet, consumers, check_groups))
        if sc.groups > 0 and args.ceiling:
            row["group_check"] = "skipped"
        firsts = [w.result.get("t_first", 0) for w in fleet.workers[sc.consumers :] if w.result]
        lasts = [w.result.get("t_last", 0) for w in consumers if w.result]
        t_first = min((t for t in firsts if t), default=0)
        t_last = max(lasts, default=0)
        elapsed = (t_last - t_first) / 1e9 if t_first and t_last > t_first else 0.0
        row["elapsed_s"] = round(elapsed, 4)
        row["msgs_per_s"] = round(row["received"] / elapsed, 1) if elapsed else None
        # the producers' own rate: first send -> last outcome (last commit with --txn-batch)
        p_lasts = [w.result.get("t_last", 0) for w in fleet.workers[sc.consumers :] if w.result]
        p_last = max(p_lasts, default=0)
        p_elapsed = (p_last - t_first) / 1e9 if t_first and p_last > t_first else 0.0
        row["producer_msgs_per_s"] = (
            round(row["acked"] / p_elapsed, 1) if p_elapsed and not sc.presettled else None
        )
        if win is not None and rss is not None:
            row.update(win.metrics(sc.count))
            row["broker_rss_max_kb"] = rss.max_kb or None
            bound = min(sc.groups, sc.count)
            if bound >= RSS_PER_GROUP_MIN and not args.ceiling and win.rss0 and win.rss1:
                # RSS with every group bound (consumers still attached) minus before
                row["groups_bound"] = bound
                row["rss_per_group_bytes"] = round((win.rss1 - win.rss0) * 1024 / bound, 1)
        row["first_error"] = (
            "; ".join(e for e in (row.get("run_error"), fleet.first_error()) if e) or None
        )
    return _finish(row, sc.count)


def run_hol(
    args: argparse.Namespace, target: Target, sc: Scenario, run: int, strict: bool
) -> dict[str, Any]:
    base = HOL_STRICT_PREFIX + args.address if strict else args.address
    address = unique_address(args, base, f"hol{run}")
    sc = replace(sc, name="HOL-strict" if strict else "HOL", count=HOL_GROUPED + HOL_UNGROUPED)
    row = base_row(args, target, sc, run, address)
    row.update(consumers=1 + HOL_FAST_CONSUMERS, groups=1, hol_hold_ms=args.hol_hold_ms)
    with Fleet(args, target, address, 3 + HOL_FAST_CONSUMERS) as fleet:
        slow = fleet.spawn("consumer", size=sc.size, credit=1, hold_ms=args.hol_hold_ms)
        fast = [
            fleet.spawn("consumer", size=sc.size, wait_go=True) for _ in range(HOL_FAST_CONSUMERS)
        ]
        consumers = [slow, *fast]
        try:
            fleet.wait_ready(consumers)
            # 1. the slow consumer takes the group's first message: the group is bound to it
            p1 = fleet.spawn(
                "producer", producer_id=0, size=sc.size, segments=[{"n": 1, "groups": 1}]
            )
            fleet.wait_ready([p1])
            fleet.send([p1], "go")
            fleet.wait(
                "the group to bind to the slow consumer",
                lambda: fleet.slot(p1)[F_STATE] == ST_DONE and fleet.slot(slow)[F_COUNT] >= 1,
                args.timeout,
            )
            # 2. the rest of the group, then the ungrouped messages, queue behind it
            segs = [
                {"n": HOL_GROUPED - 1, "groups": 1, "gbase": 0, "gseq0": 1},
                {"n": HOL_UNGROUPED},
            ]
            p2 = fleet.spawn("producer", producer_id=1, size=sc.size, segments=segs)
            fleet.wait_ready([p2])
            fleet.send([p2], "go")
            fleet.wait(
                "the messages to be queued",
                lambda: fleet.slot(p2)[F_STATE] == ST_DONE,
                args.timeout,
            )
            # 3. three consumers with normal credit start
            win = Window(target.pid, fleet)
            win.start()
            t0 = time.monotonic_ns()
            fleet.send(fast, "go")
            fleet.wait(
                "every message",
                lambda: sum(fleet.slot(w)[F_COUNT] for w in consumers) >= sc.count,
                args.timeout,
            )
            win.end()
            row["timed_out"] = False
        except RunError as exc:
            row["timed_out"] = "timed out" in str(exc)
            row["run_error"] = str(exc)
            win = None
            t0 = 0
        fleet.stop()
        row.update(_sum_producers([w for w in fleet.workers if w.role == "producer"]))
        row.update(_consumer_results(fleet, consumers, check_groups=True))
        if win is not None:
            row.update(win.metrics(sc.count))
            t_ung = max(int((w.result or {}).get("t_last_ungrouped", 0)) for w in consumers)
            t_all = max(int((w.result or {}).get("t_last", 0)) for w in consumers)
            row["hol_ungrouped_ms"] = round((t_ung - t0) / 1e6, 1) if t_ung > t0 else None
            row["hol_all_ms"] = round((t_all - t0) / 1e6, 1) if t_all > t0 else None
            row["strict"] = strict
            if strict and not target.strict_configured:
                row["note"] = "strict needs group_skip_ahead=false for hol-strict.# on the broker"
        row["first_error"] = (
            "; ".join(e for e in (row.get("run_error"), fleet.first_error()) if e) or None
        )
    return _finish(row, sc.count)


def run_mem(args: argparse.Namespace, target: Target, sc: Scenario, run: int) -> dict[str, Any]:
    address = unique_address(args, args.address, f"mem{run}")
    row = base_row(args, target, sc, run, address)
    with Fleet(args, target, address, sc.producers + sc.consumers) as fleet:
        producers = [
            fleet.spawn("producer", producer_id=i, size=sc.size, durable=sc.durable, segments=segs)
            for i, segs in enumerate(producer_segments(sc.count, 0, sc.producers))
        ]
        consumers: list[Worker] = []
        try:
            fleet.wait_ready(producers)
            win = Window(target.pid, fleet)
            with RssSampler(target.pid) as rss:
                win.start()
                fleet.send(producers, "go")
                fleet.wait(
                    f"{sc.count} messages to be queued",
                    lambda: all(fleet.slot(w)[F_STATE] == ST_DONE for w in producers),
                    args.timeout,
                )
                win.end()
                queued_rss = proc_rss_kb(target.pid) if target.pid else None
                consumers = [fleet.spawn("consumer", size=sc.size) for _ in range(sc.consumers)]
                fleet.wait(
                    "the queue to drain",
                    lambda: sum(fleet.slot(w)[F_COUNT] for w in consumers) >= sc.count,
                    args.timeout,
                )
            row["timed_out"] = False
        except RunError as exc:
            row["timed_out"] = "timed out" in str(exc)
            row["run_error"] = str(exc)
            win = None
            rss = None
            queued_rss = None
        fleet.stop()
        row.update(_sum_producers(producers))
        row.update(_consumer_results(fleet, consumers, check_groups=False))
        for k in ("lat_p50_us", "lat_p90_us", "lat_p99_us", "lat_max_us"):
            row[k] = None  # queueing time by construction: not a latency figure
        if win is not None and rss is not None:
            row.update(win.metrics(sc.count))
            pf = [w.result.get("t_first", 0) for w in producers if w.result]
            pl = [w.result.get("t_last", 0) for w in producers if w.result]
            if pf and min(pf) and max(pl) > min(pf):
                row["msgs_per_s"] = round(sc.count / ((max(pl) - min(pf)) / 1e9), 1)
            cf = [
                w.result.get("t_first", 0)
                for w in consumers
                if w.result and w.result.get("t_first")
            ]
            cl = [w.result.get("t_last", 0) for w in consumers if w.result]
            if cf and max(cl) > min(cf):
                row["drain_msgs_per_s"] = round(row["received"] / ((max(cl) - min(cf)) / 1e9), 1)
            row["broker_rss_max_kb"] = rss.max_kb or None
            if win.rss0 and queued_rss:
                growth = (queued_rss - win.rss0) * 1024 / sc.count
                row["broker_rss_queued_kb"] = queued_rss
                row["rss_per_msg_bytes"] = round(growth, 1)
                row["rss_per_msg_beyond_payload"] = round(growth - sc.size, 1)
        row["first_error"] = (
            "; ".join(e for e in (row.get("run_error"), fleet.first_error()) if e) or None
        )
    return _finish(row, sc.count)


# ----------------------------------------------------------------------- printing


def _fmt(v: Any, unit: str = "", digits: int = 0) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and digits:
        return f"{v:,.{digits}f}{unit}"
    return f"{round(v):,}{unit}" if isinstance(v, (int, float)) else f"{v}{unit}"


def _lat(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v / 1000:.2f} ms" if v >= 1000 else f"{v:.0f} us"


def format_row(r: dict[str, Any]) -> str:
    parts = [f"{r['broker']} {r['scenario']} run {r['run']}:"]
    if r["scenario"].startswith("HOL"):
        parts.append(
            f"ungrouped consumed after {_fmt(r.get('hol_ungrouped_ms'), ' ms', 1)}, "
            f"everything after {_fmt(r.get('hol_all_ms'), ' ms', 1)}"
        )
    else:
        parts.append(f"{_fmt(r.get('msgs_per_s'))} msgs/s")
        if r.get("producer_msgs_per_s"):
            parts.append(f"(producers {_fmt(r['producer_msgs_per_s'])} msgs/s)")
    if r.get("lat_p50_us") is not None:
        parts.append(
            f"lat p50 {_lat(r['lat_p50_us'])} p90 {_lat(r.get('lat_p90_us'))} "
            f"p99 {_lat(r.get('lat_p99_us'))} max {_lat(r.get('lat_max_us'))}"
        )
    if r.get("broker_cpu_pct") is not None:
        parts.append(
            f"broker {_fmt(r['broker_cpu_pct'])}% CPU "
            f"{_fmt(r.get('broker_cpu_us_per_msg'), ' us/msg', 1)}"
        )
    if r.get("broker_rss_max_kb"):
        parts.append(f"RSS max {r['broker_rss_max_kb'] / 1024:.0f} MiB")
    if r.get("client_cpu_us_per_msg") is not None:
        parts.append(
            f"client {_fmt(r['client_cpu_us_per_msg'], ' us/msg', 1)}"
            f" (ceiling ~{_fmt(r.get('client_ceiling_est_msgs_per_s'))} msgs/s)"
        )
    if r.get("other_cores") is not None:
        parts.append(f"other {r['other_cores']} cores")
    if r.get("rss_per_group_bytes") is not None:
        parts.append(f"RSS/bound group {_fmt(r['rss_per_group_bytes'], ' B', 1)}")
    if r.get("rss_per_msg_bytes") is not None:
        parts.append(
            f"RSS/queued msg {_fmt(r['rss_per_msg_bytes'], ' B', 1)} "
            f"({_fmt(r.get('rss_per_msg_beyond_payload'), ' B', 1)} beyond payload), "
            f"drain {_fmt(r.get('drain_msgs_per_s'))} msgs/s"
        )
    if "group_check" in r:
        parts.append(
            f"groups {r['group_check']}"
            + (
                f" ({r.get('group_split', 0)} split, {r.get('order_violations', 0)} out of order)"
                if r["group_check"] == "FAILED"
                else ""
            )
        )
    parts.append(f"errors {r['errors']}")
    detail = [
        f"{r[k]} {k.replace('_', ' ')}"
        for k in ("not_accepted", "missing", "extra", "bad_payload")
        if r.get(k)
    ]
    if detail:
        parts.append(f"({', '.join(detail)})")
    if r.get("first_error"):
        parts.append(f"[{r['first_error']}]")
    if r.get("note"):
        parts.append(f"({r['note']})")
    return "  ".join(parts)


SUMMARY_KEYS = (
    "msgs_per_s",
    "producer_msgs_per_s",
    "lat_p50_us",
    "lat_p99_us",
    "broker_cpu_us_per_msg",
    "client_cpu_us_per_msg",
    "hol_ungrouped_ms",
    "rss_per_group_bytes",
    "rss_per_msg_beyond_payload",
    "other_cores",
)


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (broker, scenario): medians of the runs, max RSS, total errors."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["broker"], r["scenario"]), []).append(r)
    out = []
    for (broker, scen), rs in groups.items():
        s: dict[str, Any] = {"broker": broker, "scenario": scen, "runs": len(rs)}
        for k in SUMMARY_KEYS:
            s[k] = median_or_none([r.get(k) for r in rs])
        rates = [r["msgs_per_s"] for r in rs if r.get("msgs_per_s")]
        s["msgs_per_s_min"] = min(rates) if rates else None
        s["msgs_per_s_max"] = max(rates) if rates else None
        rss = [r.get("broker_rss_max_kb") for r in rs if r.get("broker_rss_max_kb")]
        s["broker_rss_max_kb"] = max(rss) if rss else None
        s["errors"] = sum(int(r.get("errors", 0)) for r in rs)
        checks = {r.get("group_check") for r in rs if r.get("group_check")}
        s["group_check"] = "FAILED" if "FAILED" in checks else (checks.pop() if checks else None)
        out.append(s)
    return out


def summary_table(summary: list[dict[str, Any]]) -> str:
    head = (
        "| broker | scenario | runs | msgs/s (median) | min-max | p50 | p99 | broker CPU us/msg "
        "| client CPU us/msg | RSS max MiB | errors | groups |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for s in summary:
        rate = (
            f"HOL {s['hol_ungrouped_ms']:.1f} ms"
            if s.get("hol_ungrouped_ms") is not None
            else _fmt(s.get("msgs_per_s"))
        )
        rng = (
            f"{_fmt(s['msgs_per_s_min'])}-{_fmt(s['msgs_per_s_max'])}"
            if s.get("msgs_per_s_min") and s.get("hol_ungrouped_ms") is None
            else "-"
        )
        lines.append(
            f"| {s['broker']} | {s['scenario']} | {s['runs']} | {rate} "
            f"| {rng} "
            f"| {_lat(s.get('lat_p50_us'))} | {_lat(s.get('lat_p99_us'))} "
            f"| {_fmt(s.get('broker_cpu_us_per_msg'), '', 1)} "
            f"| {_fmt(s.get('client_cpu_us_per_msg'), '', 1)} "
            f"| {_fmt((s.get('broker_rss_max_kb') or 0) / 1024 or None)} | {s['errors']} "
            f"| {s.get('group_check') or '-'} |"
        )
    return "\n".join(lines)


def load_rows(path: str) -> list[dict[str, Any]]:
    rows = []
    with open(path) as f:
        for raw in f:
            line = raw.strip()
            if line.startswith("{"):
                rows.append(json.loads(line))
    return rows


def render_report(specs: list[str]) -> str:
    """Markdown table of several brokers' --json results, with first/other ratios."""
    named: list[tuple[str, dict[str, dict[str, Any]]]] = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep:
            raise ValueError(f"--report wants NAME=FILE, got {spec!r}")
        rows = load_rows(path)
        for r in rows:
            r["broker"] = name
        named.append((name, {s["scenario"]: s for s in summarize(rows)}))
    if not named:
        return ""
    first, first_rows = named[0]
    scenarios: list[str] = []
    for _, rs in named:
        scenarios += [s for s in rs if s not in scenarios]
    cols = ["scenario", f"{first} msgs/s"]
    for name, _ in named[1:]:
        cols += [f"{name} msgs/s", f"{first}/{name}"]
    cols += [f"{n} p99" for n, _ in named] + [f"{n} CPU us/msg" for n, _ in named]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for sc in scenarios:
        base = first_rows.get(sc, {})
        cells = [sc, _rate_cell(base)]
        for _, rs in named[1:]:
            other = rs.get(sc, {})
            cells += [_rate_cell(other), _ratio(base, other, sc)]
        cells += [_lat(rs.get(sc, {}).get("lat_p99_us")) for _, rs in named]
        cells += [_fmt(rs.get(sc, {}).get("broker_cpu_us_per_msg"), "", 1) for _, rs in named]
        lines.append("| " + " | ".join(cells) + " |")
    notes = [
        "msgs/s: median of the runs (first send -> last receive); ratio "
        f"{first}/peer (for L, fixed rate: ratio of p99 latencies, peer/{first}; "
        f"for HOL, times peer/{first}; > 1 = {first} better)."
    ]
    bad = [f"{n} {sc}" for n, rs in named for sc, s in rs.items() if s.get("errors")]
    if bad:
        notes.append("runs with errors: " + ", ".join(bad))
    return "\n".join(lines) + "\n\n" + "\n".join(notes)


def _rate_cell(s: dict[str, Any]) -> str:
    if not s:
        return "-"
    if s.get("hol_ungrouped_ms") is not None:
        return f"{s['hol_ungrouped_ms']:.1f} ms"
    cell = _fmt(s.get("msgs_per_s"))
    return cell + (" (errors)" if s.get("errors") else "")


def _ratio(base: dict[str, Any], other: dict[str, Any], scenario: str) -> str:
    if scenario.upper().startswith("L"):
        a, b = other.get("lat_p99_us"), base.get("lat_p99_us")
    elif base.get("hol_ungrouped_ms") is not None:
        a, b = other.get("hol_ungrouped_ms"), base.get("hol_ungrouped_ms")
    else:
        a, b = base.get("msgs_per_s"), other.get("msgs_per_s")
    if not a or not b:
        return "-"
    return f"{a / b:.2f}"


# --------------------------------------------------------------------------- main


def make_target(args: argparse.Namespace) -> Target:
    if args.start_broker:
        return start_broker(args)
    if args.ceiling:
        return start_null_broker(args)
    try:
        socket.create_connection((args.host, args.port), timeout=5).close()
    except OSError as exc:
        raise RunError(f"cannot connect to {args.host}:{args.port}: {exc}") from None
    pid = args.broker_pid
    if pid is None and args.host in ("127.0.0.1", "localhost", "::1"):
        pid = find_pid_by_port(args.port)
    return Target(args.host, args.port, pid, args.label or f"{args.host}:{args.port}")


def run_scenario(
    args: argparse.Namespace, target: Target, sc: Scenario, run: int
) -> list[dict[str, Any]]:
    if sc.kind == "hol":
        return [
            run_hol(args, target, sc, run, strict=False),
            run_hol(args, target, sc, run, strict=True),
        ]
    if sc.kind == "mem":
        return [run_mem(args, target, sc, run)]
    return [run_flow(args, target, sc, run)]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--_worker"]:
        return worker_main(argv[1])
    if argv[:1] == ["--_null-broker"]:
        return null_broker_main(argv[1:])
    args = parse_args(argv)
    if args.report:
        try:
            print(render_report(args.report))
        except (OSError, ValueError) as exc:
            print(f"perf.py: {exc}", file=sys.stderr)
            return 2
        return 0
    info = sys.stderr if args.json else sys.stdout
    rows: list[dict[str, Any]] = []
    try:
        target = make_target(args)
    except RunError as exc:
        print(f"perf.py: {exc}", file=sys.stderr)
        return 2
    try:
        cmd = proc_cmdline(target.pid)[:120] if target.pid else "not found: no CPU/RSS figures"
        with open("/proc/loadavg") as f:
            load = f.read().split()[:3]
        print(
            f"# {target.label} at {target.host}:{target.port} broker pid {target.pid} ({cmd}); "
            f"{os.cpu_count()} cores, load {' '.join(load)}",
            file=info,
            flush=True,
        )
        if args.warmup > 0:
            warm = replace(SCENARIOS["A"], name="warmup", count=args.warmup)
            r = run_flow(args, target, warm, 0)
            print(
                f"# warm-up: {_fmt(r.get('msgs_per_s'))} msgs/s, errors {r['errors']}",
                file=info,
                flush=True,
            )
        for sc in args.scenarios:
            for run in range(1, args.runs + 1):
                for r in run_scenario(args, target, sc, run):
                    rows.append(r)
                    if args.json:
                        print(json.dumps(r), flush=True)
                    print(format_row(r), file=info, flush=True)
        if target.pid and not args.ceiling:
            hwm = proc_rss_kb(target.pid, "VmHWM")
            if hwm:
                print(f"# broker peak RSS since start (VmHWM): {hwm / 1024:.0f} MiB", file=info)
        if rows and (len(rows) > 1 or args.runs > 1):
            print(summary_table(summarize(rows)), file=info)
        if args.ceiling:
            print(
                "# ceiling: the client against a null broker (relay, no queue logic); compare "
                "msgs/s and client CPU us/msg with a real broker's run",
                file=info,
            )
    except KeyboardInterrupt:
        print("perf.py: interrupted", file=sys.stderr)
        return 130
    finally:
        target.stop()
    return 0 if rows and all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
