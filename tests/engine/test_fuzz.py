"""Hostile byte streams fed to `AmqpConnection` in memory (no sockets, no trio).

A Proton client engine records a *valid* client byte stream once (protocol headers,
SASL ANONYMOUS, open, begin, attach a producer and a consumer, transfers including
multi-frame ones at a 512-byte max frame size, flow, dispositions, detach, end,
close). Hypothesis then mutates it (truncate, flip bytes, insert garbage at a frame
boundary, corrupt a frame's size, data offset, type or performative descriptor,
garbage in place of the SASL exchange) and the result is fed to a fresh server
connection in random chunks, exactly as the net layer does (`feed`, `output` /
`consumed` / `flushed`, `input_closed`).

What must hold for every input:

* no exception escapes the connection's API and nothing is logged at ERROR (the
  control handler turns an unexpected exception into a logged `amqp:internal-error`,
  which would hide a bug: it fails the test here);
* when the connection ends in error, the condition is an AMQP one a broken peer
  deserves (framing, decode, SASL failure, session errors...), never internal-error;
* a corrupted frame header (size below 8 or above the max frame size, data offset
  below 2, unknown frame type) ends the connection with `amqp:connection:framing-error`
  and a performative with an unknown descriptor with `amqp:decode-error` (or
  framing-error, Proton's answer to descriptor 0x00); a string field that is not
  UTF-8 with `amqp:decode-error`;
* after the input ends, every registry is empty: no link, session, consumer, in-flight
  message, temporary queue, producer count or sole-container claim is left behind.

Message payloads get their own test: random and truncated sections sent as transfers
by a real client engine must each be answered (accepted or rejected with
`amqp:decode-error`), never end the connection.

Bounded for CI (~6 s in all). A longer run: ``AMQBROKER_FUZZ_EXAMPLES=5000 pytest
tests/engine/test_fuzz.py``.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import proton
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from proton import Delivery, Endpoint, Message

from amqbroker.core.auth import Authenticator
from amqbroker.core.broker import Broker
from amqbroker.core.timers import Timers
from amqbroker.protocol.connection import AmqpConnection, ConnectionLimits

#: examples per test; raise it for a longer run
EXAMPLES = int(os.environ.get("AMQBROKER_FUZZ_EXAMPLES", "0") or 0)
#: the client's max frame size: the larger messages take several transfer frames
MAX_FRAME = 512
LIMITS = ConnectionLimits(idle_timeout=0)
SERVER_MAX_FRAME = LIMITS.max_frame_size
SASL_HEADER = b"AMQP\x03\x01\x00\x00"
AMQP_HEADER = b"AMQP\x00\x01\x00\x00"

FRAMING_ERROR = "amqp:connection:framing-error"
DECODE_ERROR = "amqp:decode-error"
#: never the answer to a peer's bytes: it means the broker hit a bug
INTERNAL_ERROR = "amqp:internal-error"


def fuzz_settings(n: int) -> Any:
    return settings(
        max_examples=EXAMPLES or n,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        derandomize=not EXAMPLES,  # CI: the same examples every run; a long run explores
    )


# ----------------------------------------------------------------------------- harness


def new_broker() -> Broker:
    return Broker(clock=lambda: 1_700_000_000.0, timers=Timers())


def new_server(broker: Broker, name: str = "fuzz") -> AmqpConnection:
    return AmqpConnection(
        broker,
        limits=LIMITS,
        auth=Authenticator({}, require_auth=False),
        conn_id=name,
    )


def drain(server: AmqpConnection) -> bytes:
    """Take the server's output as the net layer does; returns it."""
    out = bytearray()
    server.process()
    for _ in range(10_000):
        b = server.output()
        if not b:
            break
        out += bytes(b)
        server.consumed(len(b))
    server.flushed()
    return bytes(out)


class Recorder:
    """A Proton client engine against a server connection; records every byte the
    client sends."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.server = new_server(broker, "recorder")
        self.sent = bytearray()
        #: where each burst of client output started (the causal chunking)
        self.bursts: list[int] = []
        t = proton.Transport()
        t.max_frame_size = MAX_FRAME
        t.sasl().allowed_mechs("ANONYMOUS")
        c = proton.Connection()
        c.container = "fuzz-client"
        t.bind(c)
        self.transport = t
        self.conn = c
        c.open()
        self.session = c.session()
        self.session.open()

    def pump(self) -> None:
        for _ in range(10_000):
            moved = False
            n = self.transport.pending()
            if n > 0:
                data = self.transport.peek(n)
                self.transport.pop(n)
                self.bursts.append(len(self.sent))
                self.sent += data
                self.server.feed(data)
                moved = True
            out = drain(self.server)
            if out:
                self.transport.push(out)
                moved = True
            while self.broker.run_deferred():
                pass
            if not moved:
                return
        raise AssertionError("no quiescence")


def record(payloads: list[bytes], *, consume: bool = True) -> tuple[bytes, list[int], list[Any]]:
    """A valid client stream sending `payloads` to queue q (and consuming them when
    `consume`); returns the stream, where each burst of it started (feeding it in
    those chunks keeps it causal: a transfer never arrives before the credit it
    needed was granted) and the producer's deliveries."""
    r = Recorder(new_broker())
    snd = r.session.sender("producer")
    snd.target.address = "q"
    snd.open()
    rcv = None
    if consume:
        rcv = r.session.receiver("consumer")
        rcv.source.address = "q"
        rcv.open()
        rcv.flow(len(payloads) + 1)
    r.pump()
    ds = []
    for i, p in enumerate(payloads):
        d = snd.delivery(f"t{i}")
        snd.send(p)
        snd.advance()
        ds.append(d)
    r.pump()
    if rcv is not None:
        while True:
            d = rcv.current
            if d is None or not d.readable or d.partial:
                break
            rcv.recv(d.pending)
            rcv.advance()
            d.update(Delivery.ACCEPTED)
            d.settle()
        r.pump()
        rcv.close()
    snd.close()
    r.session.close()
    r.conn.close()
    r.pump()
    return bytes(r.sent), r.bursts, ds


def message(i: int, size: int = 20) -> bytes:
    m = Message(body="x" * size, id=i, group_id=f"g{i % 3}", durable=bool(i % 2))
    m.properties = {"n": i}
    return bytes(m.encode())


@functools.cache
def _base() -> tuple[bytes, tuple[int, ...]]:
    # small and large (multi-frame at 512 bytes) messages, all accepted and consumed
    stream, bursts, ds = record([message(0), message(1, 1500), message(2), message(3, 700)])
    assert [d.remote_state for d in ds] == [Delivery.ACCEPTED] * 4
    return stream, tuple(bursts)


def base_stream() -> bytes:
    return _base()[0]


def base_cuts(cuts: list[int], *, shift_from: int = -1, by: int = 0) -> list[int]:
    """The recorded burst boundaries (shifted by `by` from `shift_from` on, for an
    insertion) plus `cuts`."""
    return [c + by if c >= shift_from >= 0 else c for c in _base()[1]] + cuts


def frames(stream: bytes) -> list[tuple[int, int]]:
    """(offset, length) of every protocol header and frame of a valid stream."""
    out = []
    p = 0
    while p < len(stream):
        n = 8 if stream[p : p + 4] == b"AMQP" else int.from_bytes(stream[p : p + 4], "big")
        out.append((p, n))
        p += n
    assert p == len(stream)
    return out


def amqp_frames(stream: bytes) -> list[tuple[int, int]]:
    """The AMQP (type 0) frames after the AMQP header, with a performative body."""
    fs = frames(stream)
    start = next(i for i, (p, _) in enumerate(fs) if stream[p : p + 8] == AMQP_HEADER)
    return [(p, n) for p, n in fs[start + 1 :] if n > 8 and stream[p + 5] == 0]


class Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextmanager
def no_errors_logged() -> Iterator[None]:
    h = Errors()
    lg = logging.getLogger("amqbroker")
    lg.addHandler(h)
    try:
        yield
    finally:
        lg.removeHandler(h)
    assert not h.records, [r.getMessage() + (r.exc_text or "") for r in h.records]


def condition(server: AmqpConnection) -> str | None:
    """The error the connection ended with, if any."""
    t = server._transport.condition
    if t is not None:
        return str(t.name)
    c = server._pconn.condition
    return str(c.name) if c is not None else None


def feed_all(stream: bytes, cuts: list[int]) -> tuple[AmqpConnection, Broker]:
    """Feed `stream` to a fresh connection, split at `cuts`, then end the input."""
    broker = new_broker()
    server = new_server(broker)
    with no_errors_logged():
        prev = 0
        for c in [*sorted(set(cuts)), len(stream)]:
            if c <= prev or c > len(stream):
                continue
            server.feed(stream[prev:c])
            drain(server)
            while broker.run_deferred():
                pass
            prev = c
        server.input_closed()
        drain(server)
        server.abort()
        while broker.run_deferred():
            pass
    assert_clean(server, broker)
    return server, broker


def assert_clean(server: AmqpConnection, broker: Broker) -> None:
    c = condition(server)
    # Proton answers broken frames with many conditions (framing, decode, session
    # errors, not-allowed...): any AMQP condition but internal-error is the peer's fault
    assert c is None or (c.startswith("amqp:") and c != INTERNAL_ERROR), c
    assert server.links == {}
    assert server.open_sessions == 0
    assert server.unsettled_count == 0
    assert not server.txns
    assert broker.containers == {}
    for q in broker.queues.values():
        assert q.consumer_count == 0, q.name
        assert q.inflight == 0, q.name
        assert not q.temporary, q.name
    for a in broker.addresses.values():
        assert a.producers == 0, a.name
        assert not a.blocked_producers, a.name


cuts_st = st.lists(st.integers(min_value=1, max_value=6000), max_size=8)


# ------------------------------------------------------------------------------- tests


def test_valid_stream_is_accepted_in_any_chunking() -> None:
    """The baseline the mutations start from: clean, every message delivered."""
    stream = base_stream()
    for cuts in (base_cuts([]), list(range(1, len(stream)))):
        server, broker = feed_all(stream, cuts)
        assert condition(server) is None
        assert broker.routed == 4
        assert broker.statistics()["messages"] == 0  # all consumed


@fuzz_settings(150)
@given(data=st.data(), cuts=cuts_st)
def test_truncated_stream(data: st.DataObject, cuts: list[int]) -> None:
    stream = base_stream()
    end = data.draw(st.integers(min_value=0, max_value=len(stream) - 1))
    feed_all(stream[:end], base_cuts(cuts))


@fuzz_settings(300)
@given(data=st.data(), cuts=cuts_st)
def test_flipped_bytes(data: st.DataObject, cuts: list[int]) -> None:
    stream = bytearray(base_stream())
    for _ in range(data.draw(st.integers(min_value=1, max_value=6))):
        i = data.draw(st.integers(min_value=0, max_value=len(stream) - 1))
        stream[i] = data.draw(st.integers(min_value=0, max_value=255))
    feed_all(bytes(stream), base_cuts(cuts))


@fuzz_settings(200)
@given(data=st.data(), garbage=st.binary(min_size=1, max_size=300), cuts=cuts_st)
def test_garbage_inserted_at_a_frame_boundary(
    data: st.DataObject, garbage: bytes, cuts: list[int]
) -> None:
    stream = base_stream()
    fs = frames(stream)
    p, _ = fs[data.draw(st.integers(min_value=0, max_value=len(fs) - 1))]
    feed_all(stream[:p] + garbage + stream[p:], base_cuts(cuts, shift_from=p, by=len(garbage)))


@fuzz_settings(150)
@given(data=st.data(), cuts=cuts_st)
def test_bad_frame_header_is_a_framing_error(data: st.DataObject, cuts: list[int]) -> None:
    stream = bytearray(base_stream())
    fs = amqp_frames(bytes(stream))
    p, _ = fs[data.draw(st.integers(min_value=0, max_value=len(fs) - 1))]
    kind = data.draw(st.sampled_from(["small", "large", "doff", "type"]))
    if kind == "small":
        stream[p : p + 4] = data.draw(st.integers(min_value=0, max_value=7)).to_bytes(4, "big")
    elif kind == "large":
        n = data.draw(st.integers(min_value=SERVER_MAX_FRAME + 1, max_value=2**32 - 1))
        stream[p : p + 4] = n.to_bytes(4, "big")
    elif kind == "doff":
        stream[p + 4] = data.draw(st.integers(min_value=0, max_value=1))
    else:
        stream[p + 5] = data.draw(st.integers(min_value=2, max_value=255))
    server, _ = feed_all(bytes(stream), base_cuts(cuts))
    assert condition(server) == FRAMING_ERROR, (kind, condition(server))


@fuzz_settings(150)
@given(data=st.data(), cuts=cuts_st)
def test_unknown_descriptor_is_a_decode_error(data: st.DataObject, cuts: list[int]) -> None:
    stream = bytearray(base_stream())
    fs = amqp_frames(bytes(stream))
    p, _ = fs[data.draw(st.integers(min_value=0, max_value=len(fs) - 1))]
    body = p + stream[p + 4] * 4
    # performative: 0x00 0x53 <code>; codes 0x10-0x18 are the nine performatives
    assert stream[body : body + 2] == b"\x00\x53", bytes(stream[body : body + 3])
    code = data.draw(
        st.integers(min_value=0, max_value=255).filter(lambda c: not 0x10 <= c <= 0x18)
    )
    stream[body + 2] = code
    server, _ = feed_all(bytes(stream), base_cuts(cuts))
    # Proton reads 0x00 (a described descriptor) as a malformed frame
    assert condition(server) in (DECODE_ERROR, FRAMING_ERROR), (hex(code), condition(server))


@fuzz_settings(200)
@given(garbage=st.binary(min_size=1, max_size=600), cuts=cuts_st, header=st.booleans())
def test_sasl_garbage_fails_the_exchange(garbage: bytes, cuts: list[int], header: bool) -> None:
    stream = (SASL_HEADER if header else b"") + garbage
    broker = new_broker()
    server = new_server(broker)
    with no_errors_logged():
        prev = 0
        for c in [*sorted(set(cuts)), len(stream)]:
            if prev < c <= len(stream):
                server.feed(stream[prev:c])
                drain(server)
                prev = c
        done = server.output() is None
        server.input_closed()
        drain(server)
    assert_clean(server, broker)
    # garbage is never taken for a successful exchange followed by an AMQP open
    assert not server.opened
    if header and len(garbage) >= 4 and garbage[0] != 0:
        # the first frame's size is at least 16 MiB, more than the SASL frame limit
        assert done, "an oversized SASL frame must fail the exchange at once"


#: a few hand-made messages with every section the scanner reads
SECTIONED = [
    bytes(
        Message(
            body=b"payload" * 5,
            id="m1",
            group_id="g",
            group_sequence=7,
            address="q",
            durable=True,
            priority=4,
            ttl=60,
            properties={"JMSXGroupID": "g2", "k": 1},
            annotations={"x-opt-delivery-delay": 0, "x-opt-jms-msg-type": 3},
            instructions={"x-opt-i": "v"},
        ).encode()
    ),
    message(5, 40),
]


@fuzz_settings(200)
@given(data=st.data())
def test_malformed_message_payloads_are_answered_not_fatal(data: st.DataObject) -> None:
    """Truncated sections, flipped bytes and raw garbage as message payloads: each
    transfer gets an outcome (accepted, or rejected with decode-error) and the
    connection stays up."""
    payloads = []
    for _ in range(data.draw(st.integers(min_value=1, max_value=4))):
        base = bytearray(data.draw(st.sampled_from(SECTIONED)))
        how = data.draw(st.sampled_from(["truncate", "flip", "garbage", "splice"]))
        if how == "truncate":
            base = base[: data.draw(st.integers(min_value=0, max_value=len(base) - 1))]
        elif how == "flip":
            for _ in range(data.draw(st.integers(min_value=1, max_value=4))):
                i = data.draw(st.integers(min_value=0, max_value=len(base) - 1))
                base[i] = data.draw(st.integers(min_value=0, max_value=255))
        elif how == "garbage":
            base = bytearray(data.draw(st.binary(min_size=0, max_size=1200)))
        else:
            i = data.draw(st.integers(min_value=0, max_value=len(base)))
            base[i:i] = data.draw(st.binary(min_size=1, max_size=40))
        payloads.append(bytes(base))
    r = Recorder(new_broker())
    snd = r.session.sender("producer")
    snd.target.address = "q"
    snd.open()
    rcv = r.session.receiver("consumer")
    rcv.source.address = "q"
    rcv.open()
    rcv.flow(10)
    with no_errors_logged():
        r.pump()
        ds = []
        for i, p in enumerate(payloads):
            d = snd.delivery(f"t{i}")
            snd.send(p)
            snd.advance()
            ds.append(d)
        r.pump()
        got = 0
        while (d := rcv.current) is not None and d.readable and not d.partial:
            rcv.recv(d.pending)
            rcv.advance()
            d.update(Delivery.RELEASED if got % 2 else Delivery.ACCEPTED)
            d.settle()
            got += 1
        r.pump()
        assert r.conn.state & Endpoint.REMOTE_ACTIVE, r.conn.remote_condition
        for d in ds:
            assert d.remote_state in (Delivery.ACCEPTED, Delivery.REJECTED), d.remote_state
            if d.remote_state == Delivery.REJECTED:
                c = d.remote.condition
                assert c is not None and c.name == DECODE_ERROR, c
                assert c.description
        accepted = sum(1 for d in ds if d.remote_state == Delivery.ACCEPTED)
        assert got <= accepted
        r.conn.close()
        r.pump()
    assert_clean(r.server, r.broker)


# ------------------------------------------------------ regressions found by the fuzzer


def client_view(stream: bytes, limits: ConnectionLimits = LIMITS) -> tuple[Any, AmqpConnection]:
    """Feed `stream` in its recorded bursts; returns the server's answer as a Proton
    client transport sees it, and the server connection (input not ended)."""
    broker = new_broker()
    server = AmqpConnection(
        broker, limits=limits, auth=Authenticator({}, require_auth=False), conn_id="reg"
    )
    out = bytearray()
    with no_errors_logged():
        prev = 0
        for c in [*base_cuts([]), len(stream)]:
            if prev < c:
                server.feed(stream[prev:c])
                out += drain(server)
                prev = c
    t = proton.Transport()
    t.sasl().allowed_mechs("ANONYMOUS")
    c = proton.Connection()
    t.bind(c)
    t.push(bytes(out))
    return c, server


def test_sasl_init_with_a_non_ascii_mechanism_fails_sasl_not_the_broker() -> None:
    """Was: UnicodeDecodeError escaped `feed` and ended the whole broker."""
    stream = base_stream()
    i = stream.index(b"ANONYMOUS")
    bad = stream[:i] + b"\x80" + stream[i + 1 :]
    broker = new_broker()
    server = new_server(broker)
    with no_errors_logged():
        server.feed(bad)
        drain(server)
    assert server.output() is None  # failed and finished
    assert not server.opened
    assert server._sasl is not None and "not valid ascii" in (server._sasl.error or "")


def test_open_with_invalid_utf8_container_is_a_decode_error_and_later_links_are_ignored() -> None:
    """Was: internal-error (logged as a broker bug), and the links the peer attached
    after the close stayed registered for ever (producer counts, consumers)."""
    stream = base_stream()
    bad = stream.replace(b"fuzz-client", b"\xc3(zz-client")
    c, server = client_view(bad)
    assert c.remote_condition is not None
    assert c.remote_condition.name == DECODE_ERROR
    assert "UTF-8" in c.remote_condition.description
    assert server.links == {}
    assert server.open_sessions == 0
    assert all(a.producers == 0 for a in server.broker.addresses.values())


def test_links_attached_to_a_refused_connection_are_not_registered() -> None:
    """max_connections refusal closes right after open; a client that pipelined its
    begin and attaches must leave nothing behind."""
    limits = ConnectionLimits(idle_timeout=0, refuse_reason="too many connections")
    c, server = client_view(base_stream(), limits)
    assert c.remote_condition is not None
    assert c.remote_condition.name == "amqp:resource-limit-exceeded"
    assert server.links == {}
    assert server.open_sessions == 0
    assert server.broker.routed == 0
    assert all(q.consumer_count == 0 for q in server.broker.queues.values())
    assert all(a.producers == 0 for a in server.broker.addresses.values())


def test_transfer_without_payload_is_rejected_with_decode_error() -> None:
    """Was: settled with no outcome at all (the producer could not tell what happened)."""
    _, _, ds = record([b"", message(1)], consume=False)
    assert ds[0].remote_state == Delivery.REJECTED
    cond = ds[0].remote.condition
    assert cond is not None and cond.name == DECODE_ERROR
    assert "empty message" in cond.description
    assert ds[1].remote_state == Delivery.ACCEPTED
