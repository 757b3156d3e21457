"""The server-side SASL layer, against a real Proton client engine pumped in memory.

Server side of every pump: SaslServer in front of a Proton server transport on which
sasl() is never called, exactly as the broker wires it.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import struct
from dataclasses import dataclass, field
from typing import Any

import proton
import pytest
import scramp
from hypothesis import given, settings
from hypothesis import strategies as st
from proton import Collector, Connection, Event, Transport

from amqbroker.core.auth import Authenticator, hash_password, hash_password_scram
from amqbroker.protocol.sasl import (
    AMQP_HEADER,
    SASL_HEADER,
    TRANSITIONS,
    Input,
    Outcome,
    SaslServer,
    State,
)

PASSWORD = "s3cret"
USERS = {
    "bob": hash_password(PASSWORD, iterations=1_000),
    "alice": hash_password("alice-pw", iterations=1_000),
}

CHUNKS = [None, 1, 7]  # whole writes, one byte at a time, odd-sized pieces


@pytest.fixture
def strict() -> Authenticator:
    return Authenticator(USERS, require_auth=True)


@pytest.fixture
def lax() -> Authenticator:
    return Authenticator(USERS, require_auth=False)


# --- helpers: frames ----------------------------------------------------------------------


def sasl_frame(body: bytes, *, doff: int = 2, frame_type: int = 1, channel: int = 0) -> bytes:
    ext = b"\0" * (doff * 4 - 8) if doff > 2 else b""
    return struct.pack(">IBBH", 8 + len(ext) + len(body), doff, frame_type, channel) + ext + body


def described_list(descriptor: int | str, *fields: tuple[str, Any]) -> bytes:
    data = proton.Data()
    data.put_described()
    data.enter()
    if isinstance(descriptor, int):
        data.put_ulong(descriptor)
    else:
        data.put_symbol(descriptor)
    data.put_list()
    data.enter()
    for kind, value in fields:
        if kind == "null":
            data.put_null()
        else:
            getattr(data, f"put_{kind}")(value)
    data.exit()
    data.exit()
    encoded: bytes = data.encode()
    return encoded


def init_frame(mech: str, response: bytes | None = None, hostname: str | None = None) -> bytes:
    fields: list[tuple[str, Any]] = [("symbol", mech)]
    fields.append(("binary", response) if response is not None else ("null", None))
    if hostname is not None:
        fields.append(("string", hostname))
    return sasl_frame(described_list(0x41, *fields))


def plain_init(user: str, password: str, authzid: str = "", hostname: str | None = None) -> bytes:
    response = f"{authzid}\0{user}\0{password}".encode()
    return init_frame("PLAIN", response, hostname)


def decode_frames(data: bytes) -> tuple[bytes | None, list[tuple[int, list[Any]]]]:
    """Split server output into (protocol header or None, [(descriptor, fields)])."""
    header = None
    if data.startswith(b"AMQP"):
        header, data = data[:8], data[8:]
    frames: list[tuple[int, list[Any]]] = []
    while data:
        size, doff, frame_type, _ = struct.unpack_from(">IBBH", data)
        assert frame_type == 1
        d = proton.Data()
        assert d.decode(data[doff * 4 : size]) == size - doff * 4
        d.rewind()
        d.next()
        d.enter()
        d.next()
        descriptor = d.get_ulong()
        d.next()
        d.enter()
        fields: list[Any] = []
        while d.next() is not None:
            value = d.get_object()
            # a binary is a view into the Data's memory, which goes away with it
            fields.append(bytes(value) if isinstance(value, memoryview) else value)
        frames.append((int(descriptor), fields))
        data = data[size:]
    return header, frames


def outcome_code(data: bytes) -> int | None:
    _, frames = decode_frames(data)
    codes = [fields[0] for descriptor, fields in frames if descriptor == 0x44]
    assert len(codes) <= 1
    return int(codes[0]) if codes else None


def drain(transport: Transport) -> bytes:
    """Everything a Proton transport has to write."""
    pending = transport.pending()
    if pending <= 0:
        return b""
    out = transport.peek(pending)
    transport.pop(pending)
    return bytes(out or b"")


def feed(server: SaslServer, data: bytes, chunk: int | None) -> None:
    if chunk is None:
        server.feed(data)
        return
    for i in range(0, len(data), chunk):
        server.feed(data[i : i + chunk])


def snapshot(server: SaslServer) -> tuple[Any, ...]:
    return (
        server.state,
        server.user,
        server.mechanism,
        server.error,
        server.take_output(),
        server.take_passthrough(),
    )


# --- helpers: a Proton client against SaslServer + a SASL-less Proton server -------------


@dataclass
class Pump:
    auth: Authenticator
    mech: str | None  # None: the client does not use SASL at all
    user: str | None = None
    password: str | None = None
    chunk: int | None = None
    max_frame: int = 65536
    hostname: str | None = None
    client_bytes: bytearray = field(default_factory=bytearray)

    def __post_init__(self) -> None:
        self.client = Connection()
        if self.user is not None:
            self.client.user = self.user
        if self.password is not None:
            self.client.password = self.password
        self.client.hostname = "broker.example"
        self.ct = Transport()
        self.csasl = None
        if self.mech is not None:
            self.csasl = self.ct.sasl()
            self.csasl.allowed_mechs(self.mech)
            self.csasl.allow_insecure_mechs = True
        self.ct.bind(self.client)
        self.client.open()

        self.sasl = SaslServer(self.auth, max_frame=self.max_frame, hostname=self.hostname)
        self.server = Connection()
        self.st = Transport(Transport.SERVER)  # no sasl(): plain AMQP header expected
        self.collector = Collector()
        self.server.collect(self.collector)
        self.st.bind(self.server)
        self.remote_opened = False
        self.socket_closed = False

    def step(self) -> bool:
        moved = False
        out = b"" if self.socket_closed else drain(self.ct)
        if out:
            self.client_bytes += out
            feed(self.sasl, out, self.chunk)
            moved = True
        passthrough = self.sasl.take_passthrough()
        if passthrough:
            self.st.push(passthrough)
            moved = True
        while (event := self.collector.peek()) is not None:
            if event.type == Event.CONNECTION_REMOTE_OPEN:
                self.remote_opened = True
                self.server.open()
            self.collector.pop()
        to_client = self.sasl.take_output()  # always before anything Proton produces
        if self.sasl.done:
            to_client += drain(self.st)
        if to_client and not self.ct.closed:
            self.ct.push(to_client)
            self.ct.pending()  # let the client engine process it
            moved = True
        if self.sasl.failed and not self.socket_closed:
            self.socket_closed = True  # the broker closes the socket after the output
            if not self.ct.closed:
                self.ct.close_tail()
                self.ct.pending()
            moved = True
        return moved

    def run(self) -> Pump:
        for _ in range(100):
            if not self.step():
                break
        return self

    @property
    def both_open(self) -> bool:
        active = proton.Endpoint.LOCAL_ACTIVE | proton.Endpoint.REMOTE_ACTIVE
        return bool(self.client.state == active and self.server.state == active)

    @property
    def client_condition(self) -> str | None:
        cond = self.ct.condition
        return None if cond is None else str(cond.name)


# --- Proton client end to end -------------------------------------------------------------


@pytest.mark.parametrize("chunk", CHUNKS)
def test_plain_good_credentials(strict: Authenticator, chunk: int | None) -> None:
    p = Pump(strict, "PLAIN", "bob", PASSWORD, chunk=chunk).run()
    assert p.both_open
    assert p.sasl.done and not p.sasl.failed
    assert p.sasl.user == "bob"
    assert p.sasl.mechanism == "PLAIN"
    assert p.sasl.error is None
    assert p.csasl is not None and p.csasl.outcome == proton.SASL.OK
    assert p.remote_opened


@pytest.mark.parametrize("chunk", CHUNKS)
def test_plain_bad_password(strict: Authenticator, chunk: int | None) -> None:
    p = Pump(strict, "PLAIN", "bob", "wrong", chunk=chunk).run()
    assert not p.both_open and not p.remote_opened
    assert p.sasl.failed and not p.sasl.done
    assert p.sasl.user is None
    assert p.sasl.error == "authentication failed for user 'bob' (PLAIN)"
    assert p.ct.closed
    assert p.client_condition == "amqp:unauthorized-access"
    assert p.csasl is not None and p.csasl.outcome == proton.SASL.AUTH


def test_plain_unknown_user(strict: Authenticator) -> None:
    p = Pump(strict, "PLAIN", "mallory", PASSWORD).run()
    assert p.sasl.failed
    assert p.sasl.error is not None and "'mallory'" in p.sasl.error
    assert p.client_condition == "amqp:unauthorized-access"
    assert not p.remote_opened


def test_plain_other_users_password(strict: Authenticator) -> None:
    p = Pump(strict, "PLAIN", "bob", "alice-pw").run()
    assert p.sasl.failed
    assert p.client_condition == "amqp:unauthorized-access"


@pytest.mark.parametrize("chunk", CHUNKS)
def test_anonymous_allowed(lax: Authenticator, chunk: int | None) -> None:
    p = Pump(lax, "ANONYMOUS", chunk=chunk).run()
    assert p.both_open
    assert p.sasl.user == "anonymous"
    assert p.sasl.mechanism == "ANONYMOUS"


def test_plain_also_works_when_auth_optional(lax: Authenticator) -> None:
    p = Pump(lax, "PLAIN", "alice", "alice-pw").run()
    assert p.both_open
    assert p.sasl.user == "alice"


def test_anonymous_refused_when_auth_required(strict: Authenticator) -> None:
    # Only PLAIN is offered: the Proton client gives up on its own...
    p = Pump(strict, "ANONYMOUS").run()
    assert not p.both_open and not p.remote_opened
    assert p.client_condition == "amqp:unauthorized-access"
    assert not p.sasl.done
    # ... and a client that tries anyway is refused by the server.
    server = SaslServer(strict)
    server.feed(SASL_HEADER + init_frame("ANONYMOUS", b"trace"))
    assert server.failed
    assert outcome_code(server.take_output()) == Outcome.AUTH
    assert server.error is not None and "'ANONYMOUS'" in server.error
    assert "not offered" in server.error


@pytest.mark.parametrize("chunk", CHUNKS)
def test_client_without_sasl_when_auth_optional(lax: Authenticator, chunk: int | None) -> None:
    p = Pump(lax, None, chunk=chunk).run()
    assert p.both_open
    assert p.sasl.done
    assert p.sasl.user == "anonymous"
    assert p.sasl.mechanism is None


@pytest.mark.parametrize("chunk", CHUNKS)
def test_client_without_sasl_when_auth_required(strict: Authenticator, chunk: int | None) -> None:
    p = Pump(strict, None, chunk=chunk).run()
    assert not p.both_open and not p.remote_opened
    assert p.sasl.failed
    assert p.sasl.error is not None and "authentication is required" in p.sasl.error
    # The client learns that the server speaks SASL on this port.
    assert p.client_condition == "amqp:connection:framing-error"
    assert p.ct.condition is not None and "SASL" in str(p.ct.condition.description)


def test_no_mechanism_to_offer() -> None:
    nobody = Authenticator({}, require_auth=True)
    p = Pump(nobody, "PLAIN", "bob", PASSWORD).run()
    assert p.sasl.failed
    assert p.sasl.error is not None and "no SASL mechanism" in p.sasl.error
    assert p.client_condition == "amqp:unauthorized-access"
    # Header and an empty mechanism list, but no outcome (Proton would misread it).
    server = SaslServer(nobody)
    server.feed(SASL_HEADER)
    header, frames = decode_frames(server.take_output())
    assert header == SASL_HEADER
    assert [descriptor for descriptor, _ in frames] == [0x40]


def test_mechanisms_frame_contents(lax: Authenticator) -> None:
    server = SaslServer(lax)
    server.feed(SASL_HEADER)
    header, frames = decode_frames(server.take_output())
    assert header == SASL_HEADER
    assert len(frames) == 1
    descriptor, fields = frames[0]
    assert descriptor == 0x40
    assert [str(m) for m in fields[0]] == ["PLAIN", "ANONYMOUS"]
    assert server.state is State.AWAIT_INIT


@pytest.mark.parametrize("chunk", CHUNKS)
def test_pipelined_replay(strict: Authenticator, chunk: int | None) -> None:
    """Everything a successful client sent, in a single write, gives the same result."""
    p = Pump(strict, "PLAIN", "bob", PASSWORD).run()
    assert p.both_open
    stream = bytes(p.client_bytes)
    server = SaslServer(strict)
    feed(server, stream, chunk)
    assert server.done and server.user == "bob"
    header, frames = decode_frames(server.take_output())
    assert header == SASL_HEADER
    assert [d for d, _ in frames] == [0x40, 0x44]
    assert frames[1][1][0] == Outcome.OK
    passthrough = server.take_passthrough()
    assert passthrough.startswith(AMQP_HEADER)
    assert stream.startswith(SASL_HEADER)
    assert stream.endswith(passthrough)


@pytest.mark.parametrize("chunk", CHUNKS)
def test_pipelined_sasl_and_amqp_in_one_write(lax: Authenticator, chunk: int | None) -> None:
    """SASL header, sasl-init and a Proton client's AMQP header + open in one write."""
    client = Connection()
    client.container = "pipelining-client"
    ct = Transport()
    ct.bind(client)
    client.open()
    amqp_bytes = drain(ct)
    assert amqp_bytes.startswith(AMQP_HEADER)

    server = SaslServer(lax)
    feed(server, SASL_HEADER + plain_init("alice", "alice-pw") + amqp_bytes, chunk)
    assert server.done and server.user == "alice" and server.mechanism == "PLAIN"
    _, frames = decode_frames(server.take_output())
    assert frames[-1] == (0x44, [Outcome.OK])
    assert server.take_passthrough() == amqp_bytes

    # The passthrough is a valid AMQP stream for a SASL-less Proton server.
    sconn = Connection()
    st = Transport(Transport.SERVER)
    collector = Collector()
    sconn.collect(collector)
    st.bind(sconn)
    st.push(amqp_bytes)
    types = []
    while (event := collector.peek()) is not None:
        types.append(event.type)
        collector.pop()
    assert Event.CONNECTION_REMOTE_OPEN in types
    assert sconn.remote_container == "pipelining-client"
    # Later input goes straight through.
    server.feed(b"more")
    assert server.take_passthrough() == b"more"
    assert server.take_output() == b""


def test_pipelined_rest_discarded_on_failure(strict: Authenticator) -> None:
    server = SaslServer(strict)
    server.feed(SASL_HEADER + plain_init("bob", "nope") + AMQP_HEADER + b"open...")
    assert server.failed
    assert server.take_passthrough() == b""
    assert outcome_code(server.take_output()) == Outcome.AUTH
    server.feed(b"more")
    assert server.take_output() == b"" and server.take_passthrough() == b""


def test_hostname_sent_by_client_is_recorded(strict: Authenticator) -> None:
    server = SaslServer(strict)
    server.feed(SASL_HEADER + plain_init("bob", PASSWORD, hostname="broker.example"))
    assert server.done
    assert server.client_hostname == "broker.example"


@pytest.mark.parametrize(
    ("configured", "sent", "ok"),
    [
        ("broker.example", "broker.example", True),
        ("broker.example", "BROKER.example.", True),
        ("broker.example", None, True),
        ("broker.example", "other.example", False),
        (None, "anything", True),
    ],
)
def test_hostname_check(
    strict: Authenticator, configured: str | None, sent: str | None, ok: bool
) -> None:
    server = SaslServer(strict, hostname=configured)
    server.feed(SASL_HEADER + plain_init("bob", PASSWORD, hostname=sent))
    assert server.done is ok
    if not ok:
        assert outcome_code(server.take_output()) == Outcome.SYS_PERM
        assert server.error is not None and "'other.example'" in server.error


# --- raw protocol errors, each at several chunkings ----------------------------------------

# (id, Authenticator fixture, input, outcome code (None: no outcome), reply is only our
#  protocol header, substring of `error`)
ERROR_CASES: list[tuple[str, str, bytes, int | None, bool, str]] = [
    ("http", "strict", b"GET / HTTP/1.1\r\n\r\n", None, True, "byte 0 is 0x47"),
    ("tls-hello", "strict", b"\x16\x03\x01\x02\x00\x01\x00", None, True, "TLS handshake"),
    ("late-mismatch", "strict", b"AMQX\x03\x01\x00\x00", None, True, "byte 3 is 0x58"),
    ("amqp-tls", "strict", b"AMQP\x02\x01\x00\x00", None, True, "TLS is not offered"),
    ("amqp-0-9-1", "lax", b"AMQP\x00\x00\x09\x01", None, True, "unsupported protocol header"),
    ("sasl-v2", "strict", b"AMQP\x03\x02\x00\x00", None, True, "unsupported protocol header"),
    (
        "oversized",
        "strict",
        SASL_HEADER + struct.pack(">IBBH", 70_000, 2, 1, 0),
        Outcome.SYS_PERM,
        False,
        "70000 bytes exceeds max_frame 65536",
    ),
    (
        "tiny-size",
        "strict",
        SASL_HEADER + struct.pack(">I", 5) + b"\0" * 4,
        Outcome.SYS_PERM,
        False,
        "smaller than a frame header",
    ),
    (
        "bad-doff",
        "strict",
        SASL_HEADER + struct.pack(">IBBH", 12, 1, 1, 0) + b"\0" * 4,
        Outcome.SYS_PERM,
        False,
        "bad data offset 1",
    ),
    (
        "doff-past-end",
        "strict",
        SASL_HEADER + struct.pack(">IBBH", 12, 4, 1, 0) + b"\0" * 4,
        Outcome.SYS_PERM,
        False,
        "bad data offset 4",
    ),
    (
        "amqp-frame",
        "lax",
        SASL_HEADER + sasl_frame(described_list(0x10, ("string", "c")), frame_type=0),
        Outcome.SYS_PERM,
        False,
        "an AMQP frame before SASL completed",
    ),
    ("empty-frame", "strict", SASL_HEADER + sasl_frame(b""), Outcome.SYS_PERM, False, "empty"),
    (
        "garbage-body",
        "strict",
        SASL_HEADER + sasl_frame(b"\xff\xff\xff"),
        Outcome.SYS_PERM,
        False,
        "undecodable",
    ),
    (
        "truncated-body",
        "strict",
        SASL_HEADER + sasl_frame(plain_init("bob", PASSWORD)[8:-3]),
        Outcome.SYS_PERM,
        False,
        "undecodable",
    ),
    (
        "trailing-bytes",
        "strict",
        SASL_HEADER + sasl_frame(plain_init("bob", PASSWORD)[8:] + b"\x40"),
        Outcome.SYS_PERM,
        False,
        "1 stray bytes",
    ),
    (
        "not-described",
        "strict",
        SASL_HEADER + sasl_frame(b"\xa1\x03abc"),
        Outcome.SYS_PERM,
        False,
        "not a described type",
    ),
    (
        "unknown-descriptor",
        "strict",
        SASL_HEADER + sasl_frame(described_list(0x99)),
        Outcome.SYS_PERM,
        False,
        "unknown SASL frame descriptor 153",
    ),
    (
        "not-a-list",
        "strict",
        SASL_HEADER + sasl_frame(b"\x00\x53\x41\xa1\x03abc"),
        Outcome.SYS_PERM,
        False,
        "sasl-init body is not a list",
    ),
    (
        "mechanism-not-symbol",
        "strict",
        SASL_HEADER + sasl_frame(described_list(0x41, ("string", "PLAIN"))),
        Outcome.SYS_PERM,
        False,
        "mechanism is missing or not a symbol",
    ),
    (
        "response-not-binary",
        "strict",
        SASL_HEADER + sasl_frame(described_list(0x41, ("symbol", "PLAIN"), ("string", "x"))),
        Outcome.SYS_PERM,
        False,
        "initial-response is not binary",
    ),
    (
        "response-before-init",
        "strict",
        SASL_HEADER + sasl_frame(described_list(0x43, ("binary", b"\0bob\0x"))),
        Outcome.SYS_PERM,
        False,
        "unexpected sasl-response in state AWAIT_INIT (sasl-init must come first)",
    ),
    (
        "client-sends-outcome",
        "strict",
        SASL_HEADER + sasl_frame(described_list(0x44, ("ubyte", 0))),
        Outcome.SYS_PERM,
        False,
        "unexpected sasl-outcome",
    ),
    (
        "second-header",
        "strict",
        SASL_HEADER + AMQP_HEADER,
        Outcome.SYS_PERM,
        False,
        "protocol header received where a SASL frame was expected",
    ),
    (
        "unknown-mechanism",
        "strict",
        SASL_HEADER + init_frame("SCRAM-SHA-256", b"n,,n=bob,r=abc"),
        Outcome.AUTH,
        False,
        "'SCRAM-SHA-256', which is not offered (offered: PLAIN)",
    ),
    (
        "plain-no-response",
        "strict",
        SASL_HEADER + init_frame("PLAIN"),
        Outcome.AUTH,
        False,
        "PLAIN without an initial response",
    ),
    (
        "plain-no-nul",
        "strict",
        SASL_HEADER + init_frame("PLAIN", b"bob:secret"),
        Outcome.AUTH,
        False,
        "malformed PLAIN response",
    ),
    (
        "plain-not-utf8",
        "strict",
        SASL_HEADER + init_frame("PLAIN", b"\0b\xffb\0pw"),
        Outcome.AUTH,
        False,
        "not UTF-8",
    ),
    (
        "plain-empty-user",
        "strict",
        SASL_HEADER + init_frame("PLAIN", b"\0\0pw"),
        Outcome.AUTH,
        False,
        "empty user name",
    ),
    (
        "plain-authzid",
        "strict",
        SASL_HEADER + plain_init("bob", PASSWORD, authzid="alice"),
        Outcome.AUTH,
        False,
        "user 'bob' acting as 'alice' (PLAIN)",
    ),
    (
        "no-sasl-auth-required",
        "strict",
        AMQP_HEADER + b"\0\0\0\x08\x02\0\0\0",
        None,
        True,
        "authentication is required",
    ),
]


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize(
    ("auth_name", "data", "code", "header_only", "problem"),
    [case[1:] for case in ERROR_CASES],
    ids=[case[0] for case in ERROR_CASES],
)
def test_protocol_errors(
    request: pytest.FixtureRequest,
    auth_name: str,
    data: bytes,
    code: int | None,
    header_only: bool,
    problem: str,
    chunk: int | None,
) -> None:
    auth: Authenticator = request.getfixturevalue(auth_name)
    server = SaslServer(auth)
    feed(server, data, chunk)
    assert server.failed and not server.done
    assert server.state is State.FAILED
    assert server.user is None and server.mechanism is None
    assert server.error is not None and problem in server.error
    output = server.take_output()
    header, frames = decode_frames(output)
    assert header == SASL_HEADER  # always exactly one header
    if header_only:
        assert frames == []
    else:
        assert outcome_code(output) == code
        assert frames[-1][0] == 0x44
    assert server.take_passthrough() == b""
    # Once failed, nothing more comes out.
    server.feed(SASL_HEADER + plain_init("bob", PASSWORD))
    assert server.take_output() == b"" and server.take_passthrough() == b""


def test_chunking_does_not_change_results(strict: Authenticator, lax: Authenticator) -> None:
    streams = [
        (strict, SASL_HEADER + plain_init("bob", PASSWORD) + AMQP_HEADER + b"xyz"),
        (lax, SASL_HEADER + init_frame("ANONYMOUS") + AMQP_HEADER),
        (lax, AMQP_HEADER + b"rest of the AMQP stream"),
        *[(strict if case[1] == "strict" else lax, case[2]) for case in ERROR_CASES],
    ]
    for auth, stream in streams:
        results = []
        for chunk in (None, 1, 2, 3, 5, 8, 13):
            server = SaslServer(auth)
            feed(server, stream, chunk)
            results.append(snapshot(server))
        assert all(r == results[0] for r in results), stream


def test_oversized_frame_refused_before_it_arrives(strict: Authenticator) -> None:
    server = SaslServer(strict, max_frame=512)
    server.feed(SASL_HEADER)
    server.take_output()
    server.feed(struct.pack(">I", 513))
    assert server.failed
    assert outcome_code(server.take_output()) == Outcome.SYS_PERM
    assert server.error == "SASL frame of 513 bytes exceeds max_frame 512"


def test_frame_at_max_frame_is_accepted(strict: Authenticator) -> None:
    # A valid sasl-init padded by an extended header (doff > 2) to max_frame bytes or more.
    body = plain_init("bob", PASSWORD)[8:]
    doff = -(-(520 - len(body)) // 4)
    frame = sasl_frame(body, doff=doff)
    assert len(frame) >= 520
    server = SaslServer(strict, max_frame=len(frame))
    server.feed(SASL_HEADER + frame)
    assert server.done and server.user == "bob"
    server = SaslServer(strict, max_frame=len(frame) - 1)
    server.feed(SASL_HEADER + frame)
    assert server.failed


def test_max_frame_minimum(strict: Authenticator) -> None:
    with pytest.raises(ValueError, match="512"):
        SaslServer(strict, max_frame=511)


def test_symbolic_descriptor_and_channel_ignored(strict: Authenticator) -> None:
    body = described_list(
        "amqp:sasl-init:list", ("symbol", "PLAIN"), ("binary", f"\0bob\0{PASSWORD}".encode())
    )
    server = SaslServer(strict)
    server.feed(SASL_HEADER + sasl_frame(body, channel=7))
    assert server.done and server.user == "bob"


def test_extra_init_fields_ignored(lax: Authenticator) -> None:
    body = described_list(
        0x41, ("symbol", "ANONYMOUS"), ("binary", b"x"), ("string", "h"), ("uint", 5)
    )
    server = SaslServer(lax)
    server.feed(SASL_HEADER + sasl_frame(body))
    assert server.done and server.user == "anonymous"
    assert server.client_hostname == "h"


def test_skip_sasl_passthrough(lax: Authenticator) -> None:
    server = SaslServer(lax)
    server.feed(b"AMQP\x00\x01")
    assert server.state is State.AWAIT_HEADER
    assert server.take_passthrough() == b""
    server.feed(b"\x00\x00tail")
    assert server.done and server.user == "anonymous" and server.mechanism is None
    assert server.take_output() == b""
    assert server.take_passthrough() == AMQP_HEADER + b"tail"


def test_nothing_happens_until_a_full_header(strict: Authenticator) -> None:
    server = SaslServer(strict)
    seen: list[tuple[State, bytes]] = []
    for piece in [*(bytes([b]) for b in SASL_HEADER[:-1]), b"", SASL_HEADER[-1:]]:
        server.feed(piece)
        seen.append((server.state, server.take_output()[:8]))
    assert seen[:-1] == [(State.AWAIT_HEADER, b"")] * 8
    assert seen[-1] == (State.AWAIT_INIT, SASL_HEADER)


def test_transition_table_shape() -> None:
    # Legal inputs per state; everything else is an UnexpectedFrame.
    assert {(s, i) for s, i in TRANSITIONS} == {
        (State.AWAIT_HEADER, Input.SASL_HEADER),
        (State.AWAIT_HEADER, Input.AMQP_HEADER),
        (State.AWAIT_INIT, Input.SASL_INIT),
        (State.AWAIT_RESPONSE, Input.SASL_RESPONSE),
    }
    order = [State.AWAIT_HEADER, State.AWAIT_INIT, State.AWAIT_RESPONSE, State.DONE]
    for (state, _), (_, targets) in TRANSITIONS.items():
        assert targets, state
        # the state only moves forward; FAILED is reached only through errors
        assert all(order.index(t) > order.index(state) for t in targets)
    assert TRANSITIONS[State.AWAIT_INIT, Input.SASL_INIT][1] == (
        State.DONE,
        State.AWAIT_RESPONSE,
    )


# --- properties ---------------------------------------------------------------------------

VALID_PIECES = [
    SASL_HEADER,
    AMQP_HEADER,
    plain_init("bob", PASSWORD),
    plain_init("bob", "nope"),
    init_frame("ANONYMOUS"),
    sasl_frame(described_list(0x43, ("binary", b"x"))),
]


@st.composite
def peer_streams(draw: st.DrawFn) -> bytes:
    """Mostly-plausible peer input: valid pieces, their prefixes, and random bytes."""
    parts = draw(
        st.lists(
            st.one_of(
                st.sampled_from(VALID_PIECES),
                st.sampled_from(VALID_PIECES).flatmap(
                    lambda piece: st.integers(0, len(piece)).map(lambda n: piece[:n])
                ),
                st.binary(max_size=40),
            ),
            max_size=6,
        )
    )
    return b"".join(parts)


@settings(max_examples=300, deadline=None)
@given(
    stream=peer_streams(), cuts=st.lists(st.integers(0, 400), max_size=8), lax_auth=st.booleans()
)
def test_any_input_any_chunking(stream: bytes, cuts: list[int], lax_auth: bool) -> None:
    auth = Authenticator(USERS, require_auth=not lax_auth)
    whole = SaslServer(auth, max_frame=512)
    whole.feed(stream)  # never raises
    expected = snapshot(whole)

    chunked = SaslServer(auth, max_frame=512)
    previous = 0
    for cut in sorted({c for c in cuts if c < len(stream)}):
        chunked.feed(stream[previous:cut])
        previous = cut
    chunked.feed(stream[previous:])
    assert snapshot(chunked) == expected

    state, user, mechanism, error, output, passthrough = expected
    assert (error is not None) == (state is State.FAILED)
    assert (user is not None) == (state is State.DONE)
    assert mechanism in ((None, "PLAIN", "ANONYMOUS") if state is State.DONE else (None,))
    if state is not State.DONE:
        assert passthrough == b""
    if output:
        assert output.startswith(SASL_HEADER) and output.count(SASL_HEADER) == 1


# --- SCRAM-SHA-256 ------------------------------------------------------------------------
#
# RFC 7677 section 3 test vector: user "user", password "pencil", salt and iteration
# count below, client nonce "rOprNGfwEbeRWgbNEkqO", server nonce
# "%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0".

RFC_SALT = base64.b64decode("W22ZaJ0SNY7soEsUEjb6gQ==")
RFC_CLIENT_FIRST = b"n,,n=user,r=rOprNGfwEbeRWgbNEkqO"
RFC_SERVER_NONCE = "%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0"
RFC_SERVER_FIRST = (
    b"r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096"
)
RFC_CLIENT_FINAL = (
    b"c=biws,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,"
    b"p=dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ="
)
RFC_SERVER_FINAL = b"v=6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4="
SCRAM = "SCRAM-SHA-256"
SCRAM_ITERATIONS = 4096  # the RFC 7677 minimum keeps these tests fast
NONCE = "S3rv3rN0nc3-fixed-for-tests"

SCRAM_USERS = {
    "user": hash_password_scram("pencil", iterations=4096, salt=RFC_SALT),
    "bob": hash_password_scram(PASSWORD, iterations=SCRAM_ITERATIONS),
    "a,b=c": hash_password_scram("comma", iterations=SCRAM_ITERATIONS),
    "carol": hash_password("carol-pw", iterations=1_000),  # pbkdf2: PLAIN only
}


@pytest.fixture
def scram_auth() -> Authenticator:
    return Authenticator(SCRAM_USERS, require_auth=True)


def response_frame(response: bytes) -> bytes:
    return sasl_frame(described_list(0x43, ("binary", response)))


def scram_server(auth: Authenticator, nonce: str = NONCE, **kw: Any) -> SaslServer:
    return SaslServer(auth, scram_nonce=lambda: nonce, **kw)


def frame_fields(output: bytes, descriptor: int) -> list[Any]:
    _, frames = decode_frames(output)
    matching = [fields for d, fields in frames if d == descriptor]
    assert len(matching) == 1, frames
    return matching[0]


def challenge_of(output: bytes) -> bytes:
    return bytes(frame_fields(output, 0x42)[0])


def client_final(
    password: str,
    client_first: bytes,
    server_first: bytes,
    gs2: bytes = b"n,,",
    extensions: bytes = b"",
) -> bytes:
    """An independent SCRAM-SHA-256 client final step (RFC 5802 section 3), for
    messages scramp will not produce (GS2 flag "y", an authzid, extensions)."""
    attrs = dict(part.split("=", 1) for part in server_first.decode().split(","))
    salted = hashlib.pbkdf2_hmac(
        "sha256", password.encode(), base64.b64decode(attrs["s"]), int(attrs["i"])
    )
    client_key = hmac.new(salted, b"Client Key", "sha256").digest()
    stored_key = hashlib.sha256(client_key).digest()
    without_proof = b"c=" + base64.b64encode(gs2) + b",r=" + attrs["r"].encode() + extensions
    bare = client_first[len(gs2) :]
    auth_message = bare + b"," + server_first + b"," + without_proof
    signature = hmac.new(stored_key, auth_message, "sha256").digest()
    proof = bytes(a ^ b for a, b in zip(client_key, signature, strict=True))
    return without_proof + b",p=" + base64.b64encode(proof)


def test_scram_rfc7677_vector(scram_auth: Authenticator) -> None:
    server = scram_server(scram_auth, RFC_SERVER_NONCE)
    server.feed(SASL_HEADER + init_frame(SCRAM, RFC_CLIENT_FIRST))
    assert server.state is State.AWAIT_RESPONSE
    output = server.take_output()
    assert [str(m) for m in frame_fields(output, 0x40)[0]] == [SCRAM, "PLAIN"]
    assert challenge_of(output) == RFC_SERVER_FIRST
    assert server.user is None and server.mechanism is None
    server.feed(response_frame(RFC_CLIENT_FINAL) + AMQP_HEADER + b"open")
    assert server.done
    assert (server.user, server.mechanism) == ("user", SCRAM)
    assert frame_fields(server.take_output(), 0x44) == [Outcome.OK, RFC_SERVER_FINAL]
    assert server.take_passthrough() == AMQP_HEADER + b"open"


@pytest.mark.parametrize("chunk", CHUNKS)
def test_scram_with_scramp_client(scram_auth: Authenticator, chunk: int | None) -> None:
    """An independent client implementation (scramp), fed in any chunking."""
    client = scramp.ScramClient([SCRAM], "bob", PASSWORD)
    server = SaslServer(scram_auth)  # random server nonce
    feed(server, SASL_HEADER + init_frame(SCRAM, client.get_client_first().encode()), chunk)
    client.set_server_first(challenge_of(server.take_output()).decode())
    assert server.may_block
    feed(server, response_frame(client.get_client_final().encode()), chunk)
    assert server.done and server.user == "bob" and server.mechanism == SCRAM
    code, server_final = frame_fields(server.take_output(), 0x44)
    assert code == Outcome.OK
    client.set_server_final(server_final.decode())  # raises unless the signature is right
    assert not server.may_block


def test_scram_user_name_escapes(scram_auth: Authenticator) -> None:
    client = scramp.ScramClient([SCRAM], "a,b=c", "comma")
    first = client.get_client_first().encode()
    assert b"n=a=2Cb=3Dc," in first
    server = SaslServer(scram_auth)
    server.feed(SASL_HEADER + init_frame(SCRAM, first))
    client.set_server_first(challenge_of(server.take_output()).decode())
    server.feed(response_frame(client.get_client_final().encode()))
    assert server.done and server.user == "a,b=c"


def test_scram_wrong_password(scram_auth: Authenticator) -> None:
    client = scramp.ScramClient([SCRAM], "bob", "not-the-password")
    server = SaslServer(scram_auth)
    server.feed(SASL_HEADER + init_frame(SCRAM, client.get_client_first().encode()))
    client.set_server_first(challenge_of(server.take_output()).decode())
    server.feed(response_frame(client.get_client_final().encode()) + AMQP_HEADER)
    assert server.failed and server.user is None and server.mechanism is None
    # an auth outcome, without additional data (part 5.3.3.6: only on success)
    assert frame_fields(server.take_output(), 0x44) == [Outcome.AUTH]
    assert server.error == (
        "authentication failed for user 'bob' (SCRAM-SHA-256): wrong password "
        "(the client proof does not match)"
    )
    assert server.take_passthrough() == b""


@pytest.mark.parametrize(
    ("user", "problem"),
    [
        ("mallory", "no such user"),
        ("carol", "pbkdf2-sha256 hash, which works with PLAIN only"),
    ],
)
def test_scram_user_without_scram_credentials_gets_a_full_exchange(
    scram_auth: Authenticator, user: str, problem: str
) -> None:
    """Unknown users (and pbkdf2-only users) get a challenge shaped like a real one,
    with a salt that is the same on every attempt; the failure comes at the end."""
    challenges = []
    for _ in range(2):
        client = scramp.ScramClient([SCRAM], user, "whatever")
        server = SaslServer(scram_auth)
        server.feed(SASL_HEADER + init_frame(SCRAM, client.get_client_first().encode()))
        challenge = challenge_of(server.take_output())
        challenges.append(dict(part.split("=", 1) for part in challenge.decode().split(",")))
        client.set_server_first(challenge.decode())
        server.feed(response_frame(client.get_client_final().encode()))
        assert server.failed
        assert frame_fields(server.take_output(), 0x44) == [Outcome.AUTH]
        assert server.error is not None and problem in server.error
        assert f"user {user!r}" in server.error
    first, second = challenges
    assert first["s"] == second["s"], "the fake salt changes between attempts"
    assert len(base64.b64decode(first["s"])) == 16  # like a real salt
    assert first["i"] == str(SCRAM_ITERATIONS)  # like the real users'
    real = scram_server(scram_auth)
    real.feed(SASL_HEADER + init_frame(SCRAM, b"n,,n=other-unknown,r=abc"))
    other = dict(p.split("=", 1) for p in challenge_of(real.take_output()).decode().split(","))
    assert other["s"] != first["s"], "every unknown user gets the same salt"


def test_scram_challenge_for_a_known_user_uses_the_stored_salt(scram_auth: Authenticator) -> None:
    stored_salt = SCRAM_USERS["bob"].split("$")[2]
    server = scram_server(scram_auth)
    server.feed(SASL_HEADER + init_frame(SCRAM, b"n,,n=bob,r=clientnonce"))
    assert challenge_of(server.take_output()) == (
        f"r=clientnonce{NONCE},s={stored_salt},i={SCRAM_ITERATIONS}".encode()
    )


def test_scram_bad_proof(scram_auth: Authenticator) -> None:
    server = scram_server(scram_auth, RFC_SERVER_NONCE)
    server.feed(SASL_HEADER + init_frame(SCRAM, RFC_CLIENT_FIRST))
    server.take_output()
    proof = bytearray(base64.b64decode(RFC_CLIENT_FINAL.rsplit(b",p=", 1)[1]))
    proof[0] ^= 1
    final = RFC_CLIENT_FINAL.rsplit(b",p=", 1)[0] + b",p=" + base64.b64encode(bytes(proof))
    server.feed(response_frame(final))
    assert server.failed
    assert frame_fields(server.take_output(), 0x44) == [Outcome.AUTH]
    assert server.error is not None and "wrong password" in server.error


@pytest.mark.parametrize(
    "nonce",
    [
        b"rOprNGfwEbeRWgbNEkqO",  # the client's part only
        b"rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k1",  # altered
        b"rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0x",  # extended
    ],
)
def test_scram_bad_nonce(scram_auth: Authenticator, nonce: bytes) -> None:
    server = scram_server(scram_auth, RFC_SERVER_NONCE)
    server.feed(SASL_HEADER + init_frame(SCRAM, RFC_CLIENT_FIRST))
    server.take_output()
    # the proof is the RFC's: only the nonce is wrong
    final = RFC_CLIENT_FINAL.replace(RFC_SERVER_FIRST[2:52], nonce)
    server.feed(response_frame(final))
    assert server.failed
    assert frame_fields(server.take_output(), 0x44) == [Outcome.AUTH]
    assert server.error is not None and "the nonce (r=) is not the one of this exchange" in (
        server.error
    )


@pytest.mark.parametrize("gs2", [b"n,,", b"y,,", b"n,a=bob,", b"y,a=bob,"])
def test_scram_gs2_without_channel_binding_is_accepted(
    scram_auth: Authenticator, gs2: bytes
) -> None:
    first = gs2 + b"n=bob,r=cn0nce"
    server = scram_server(scram_auth)
    server.feed(SASL_HEADER + init_frame(SCRAM, first))
    server_first = challenge_of(server.take_output())
    server.feed(response_frame(client_final(PASSWORD, first, server_first, gs2)))
    assert server.done and server.user == "bob", server.error


def test_scram_channel_binding_required_by_client_is_refused(scram_auth: Authenticator) -> None:
    server = scram_server(scram_auth)
    server.feed(SASL_HEADER + init_frame(SCRAM, b"p=tls-server-end-point,,n=bob,r=abc"))
    assert server.failed
    output = server.take_output()
    assert frame_fields(output, 0x44) == [Outcome.AUTH]
    assert 0x42 not in [d for d, _ in decode_frames(output)[1]]  # no challenge
    assert server.error == (
        "the SCRAM-SHA-256 client requires channel binding ('tls-server-end-point'), which "
        "this broker does not support (it offers SCRAM-SHA-256, not SCRAM-SHA-256-PLUS); "
        "configure the client without channel binding"
    )


def test_scram_channel_binding_attribute_must_repeat_the_gs2_header(
    scram_auth: Authenticator,
) -> None:
    # the client said "y" (no binding, thinks we cannot) but sends c= for "n,,"
    first = b"y,,n=bob,r=cn0nce"
    server = scram_server(scram_auth)
    server.feed(SASL_HEADER + init_frame(SCRAM, first))
    server_first = challenge_of(server.take_output())
    final = client_final(PASSWORD, first, server_first, b"y,,").replace(b"c=eSws", b"c=biws")
    server.feed(response_frame(final))
    assert server.failed
    assert frame_fields(server.take_output(), 0x44) == [Outcome.AUTH]
    assert server.error is not None and "channel binding (c=) does not repeat" in server.error


# client-first messages that are refused before any challenge: (message, error substring)
BAD_CLIENT_FIRST = [
    (b"", "no GS2 header"),
    (b"n,,", "no user name (n=)"),
    (b"n,,r=abc", "no user name (n=)"),
    (b"n,,n=bob", "no client nonce (r=)"),
    (b"n,,n=bob,x=1", "no client nonce (r=)"),
    (b"n,,n=bob,r=", "empty client nonce"),
    (b"n,,n=bob,r=a\x7fb", "non-printable"),
    (b"n,,n=,r=abc", "empty user name"),
    (b"n,,n=b=ob,r=abc", "user name (n=) has '=' not followed by 2C or 3D"),
    (b"n,,n=b\0b,r=abc", "contains NUL"),
    (b"x,,n=bob,r=abc", "GS2 channel-binding flag 'x'"),
    (b"n,b=bob,n=bob,r=abc", "GS2 authzid 'b=bob' is not 'a=<name>'"),
    (b"n,a=alice,n=bob,r=abc", "user 'bob' acting as 'alice'"),
    (b"n,,m=ext,n=bob,r=abc", "mandatory extension (m=)"),
    (b"n,,n=bob,r=abc,1x", "attribute '1x' is not 'x=value'"),
    (b"n,,n=bob,r=abc,e", "attribute 'e' is not 'x=value'"),
    (b"n,,n=b\xffb,r=abc", "not UTF-8"),
]


@pytest.mark.parametrize(("message", "problem"), BAD_CLIENT_FIRST)
def test_scram_bad_client_first(scram_auth: Authenticator, message: bytes, problem: str) -> None:
    server = scram_server(scram_auth)
    server.feed(SASL_HEADER + init_frame(SCRAM, message))
    assert server.failed
    output = server.take_output()
    assert [d for d, _ in decode_frames(output)[1]] == [0x40, 0x44]  # no challenge
    assert frame_fields(output, 0x44) == [Outcome.AUTH]
    assert server.error is not None and problem in server.error, server.error


def test_scram_without_initial_response(scram_auth: Authenticator) -> None:
    server = scram_server(scram_auth)
    server.feed(SASL_HEADER + init_frame(SCRAM))
    assert server.failed
    assert frame_fields(server.take_output(), 0x44) == [Outcome.AUTH]
    assert server.error is not None and "without an initial response" in server.error


def test_scram_extensions_in_client_first_are_ignored(scram_auth: Authenticator) -> None:
    first = b"n,,n=bob,r=cn0nce,x=ext,y=more"
    server = scram_server(scram_auth)
    server.feed(SASL_HEADER + init_frame(SCRAM, first))
    server_first = challenge_of(server.take_output())
    server.feed(response_frame(client_final(PASSWORD, first, server_first)))
    assert server.done and server.user == "bob"


_RFC_NONCE = RFC_SERVER_FIRST[2:52]
_RFC_PROOF = RFC_CLIENT_FINAL.rsplit(b",", 1)[1]
# client-final messages after a valid exchange start: (message, error substring)
BAD_CLIENT_FINAL = [
    (b"", "expected 'c=<binding>,r=<nonce>,...,p=<proof>'"),
    (b"r=" + _RFC_NONCE + b",c=biws," + _RFC_PROOF, "expected 'c=<binding>"),
    (b"c=biws," + _RFC_PROOF, "expected 'c=<binding>"),
    (b"c=biws,x=1,r=" + _RFC_NONCE + b"," + _RFC_PROOF, "no nonce (r=)"),
    (b"c=biws,r=" + _RFC_NONCE + b",q=abc", "no proof (p=) at the end"),
    (b"c=biws,r=" + _RFC_NONCE + b"," + _RFC_PROOF + b",x=1", "no proof (p=) at the end"),
    (b"c=b!ws,r=" + _RFC_NONCE + b"," + _RFC_PROOF, "the channel binding (c=) is not valid"),
    (b"c=biws,r=" + _RFC_NONCE + b",p=AAAA", "the proof (p=) is 3 bytes, expected 32"),
    (b"c=biws,r=" + _RFC_NONCE + b",p=%%%", "the proof (p=) is not valid base64"),
    (b"c=biws,r=" + _RFC_NONCE + b",1=2," + _RFC_PROOF, "attribute '1=2' is not"),
    (b"c=biws,r=\xff," + _RFC_PROOF, "not UTF-8"),
]


@pytest.mark.parametrize(("message", "problem"), BAD_CLIENT_FINAL)
def test_scram_bad_client_final(scram_auth: Authenticator, message: bytes, problem: str) -> None:
    server = scram_server(scram_auth, RFC_SERVER_NONCE)
    server.feed(SASL_HEADER + init_frame(SCRAM, RFC_CLIENT_FIRST))
    server.take_output()
    server.feed(response_frame(message))
    assert server.failed and server.user is None
    assert frame_fields(server.take_output(), 0x44) == [Outcome.AUTH]
    assert server.error is not None and problem in server.error, server.error


def test_scram_extensions_in_client_final_are_ignored(scram_auth: Authenticator) -> None:
    first = b"n,,n=bob,r=cn0nce"
    server = scram_server(scram_auth)
    server.feed(SASL_HEADER + init_frame(SCRAM, first))
    server_first = challenge_of(server.take_output())
    # extensions between r= and p= are part of the signed AuthMessage
    final = client_final(PASSWORD, first, server_first, extensions=b",x=ext,z=1")
    assert b",x=ext,z=1,p=" in final
    server.feed(response_frame(final))
    assert server.done and server.user == "bob", server.error


# frame-level problems once the challenge was sent: (stream after the init, code, error)
SCRAM_FRAME_ERRORS = [
    (sasl_frame(described_list(0x43)), Outcome.SYS_PERM, "sasl-response response is missing"),
    (
        sasl_frame(described_list(0x43, ("string", "c=biws"))),
        Outcome.SYS_PERM,
        "sasl-response response is missing or not binary",
    ),
    (
        init_frame(SCRAM, RFC_CLIENT_FIRST),
        Outcome.SYS_PERM,
        "unexpected sasl-init in state AWAIT_RESPONSE (SCRAM-SHA-256 expects a sasl-response)",
    ),
    (AMQP_HEADER, Outcome.SYS_PERM, "protocol header received where a SASL frame"),
    (
        sasl_frame(response_frame(RFC_CLIENT_FINAL)[8:-5]),
        Outcome.SYS_PERM,
        "undecodable SASL frame body",
    ),
    (
        struct.pack(">IBBH", 70_000, 2, 1, 0),
        Outcome.SYS_PERM,
        "70000 bytes exceeds max_frame 65536",
    ),
]


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize(("stream", "code", "problem"), SCRAM_FRAME_ERRORS)
def test_scram_frame_errors_after_the_challenge(
    scram_auth: Authenticator, stream: bytes, code: int, problem: str, chunk: int | None
) -> None:
    server = scram_server(scram_auth, RFC_SERVER_NONCE)
    server.feed(SASL_HEADER + init_frame(SCRAM, RFC_CLIENT_FIRST))
    server.take_output()
    feed(server, stream, chunk)
    assert server.failed
    assert frame_fields(server.take_output(), 0x44) == [code]
    assert server.error is not None and problem in server.error, server.error


def test_scram_truncated_response_waits_for_the_rest(scram_auth: Authenticator) -> None:
    server = scram_server(scram_auth, RFC_SERVER_NONCE)
    server.feed(SASL_HEADER + init_frame(SCRAM, RFC_CLIENT_FIRST))
    server.take_output()
    frame = response_frame(RFC_CLIENT_FINAL)
    for cut in (1, 4, 8, len(frame) - 1):
        partial = scram_server(scram_auth, RFC_SERVER_NONCE)
        partial.feed(SASL_HEADER + init_frame(SCRAM, RFC_CLIENT_FIRST))
        partial.take_output()
        partial.feed(frame[:cut])
        assert partial.state is State.AWAIT_RESPONSE
        assert partial.take_output() == b"" and partial.error is None
        partial.feed(frame[cut:])
        assert partial.done and partial.user == "user"
    # a peer that stops half-way never gets an outcome (the net layer's timeout ends it)
    server.feed(frame[:-1])
    assert server.state is State.AWAIT_RESPONSE and server.take_output() == b""


def test_scram_one_byte_at_a_time_gives_the_same_bytes(scram_auth: Authenticator) -> None:
    streams = [
        SASL_HEADER
        + init_frame(SCRAM, RFC_CLIENT_FIRST)
        + response_frame(RFC_CLIENT_FINAL)
        + AMQP_HEADER
        + b"rest",
        SASL_HEADER + init_frame(SCRAM, RFC_CLIENT_FIRST) + response_frame(b"c=biws"),
        SASL_HEADER + init_frame(SCRAM, b"n,,n=nobody,r=abc") + response_frame(RFC_CLIENT_FINAL),
        *(SASL_HEADER + init_frame(SCRAM, message) for message, _ in BAD_CLIENT_FIRST),
    ]
    for stream in streams:
        results = []
        for chunk in (None, 1, 2, 3, 7, 64):
            server = scram_server(scram_auth, RFC_SERVER_NONCE)
            feed(server, stream, chunk)
            results.append(snapshot(server))
        assert all(r == results[0] for r in results), stream


def test_scram_offered_only_with_scram_users(strict: Authenticator) -> None:
    server = SaslServer(strict)  # pbkdf2 users only
    server.feed(SASL_HEADER)
    assert [str(m) for m in frame_fields(server.take_output(), 0x40)[0]] == ["PLAIN"]


def test_plain_works_for_scram_users(scram_auth: Authenticator) -> None:
    p = Pump(scram_auth, "PLAIN", "bob", PASSWORD).run()
    assert p.both_open and p.sasl.user == "bob" and p.sasl.mechanism == "PLAIN"
    p = Pump(scram_auth, "PLAIN", "bob", "wrong").run()
    assert p.sasl.failed and p.client_condition == "amqp:unauthorized-access"
    p = Pump(scram_auth, "PLAIN", "carol", "carol-pw").run()  # pbkdf2 still works
    assert p.both_open and p.sasl.user == "carol"


def test_proton_client_offered_scram_falls_back_to_plain(scram_auth: Authenticator) -> None:
    """The PyPI Proton wheel has no SCRAM (no Cyrus): offered SCRAM-SHA-256 first, it
    picks PLAIN and still connects."""
    p = Pump(scram_auth, "SCRAM-SHA-256 PLAIN", "bob", PASSWORD).run()
    assert p.both_open and p.sasl.mechanism == "PLAIN"


def test_may_block(scram_auth: Authenticator) -> None:
    anonymous_only = Authenticator({}, require_auth=False)
    assert not SaslServer(anonymous_only).may_block
    server = SaslServer(scram_auth)
    assert server.may_block
    server.feed(SASL_HEADER + init_frame(SCRAM, b"n,,n=bob,r=abc"))
    assert server.state is State.AWAIT_RESPONSE and server.may_block
    server.feed(b"\0\0\0\0")
    assert server.failed and not server.may_block


# --- EXTERNAL -----------------------------------------------------------------------------

SUBJECT = "CN=app1,O=Example"


@pytest.fixture
def tls_auth() -> Authenticator:
    return Authenticator(USERS, require_auth=True, tls_users={SUBJECT: "app"})


def test_external_offered_only_with_a_tls_identity(tls_auth: Authenticator) -> None:
    server = SaslServer(tls_auth)
    server.feed(SASL_HEADER)
    assert [str(m) for m in frame_fields(server.take_output(), 0x40)[0]] == ["PLAIN"]
    server.feed(init_frame("EXTERNAL", b""))
    assert server.failed
    assert server.error is not None and "'EXTERNAL', which is not offered" in server.error
    server = SaslServer(tls_auth, tls_identity=SUBJECT)
    server.feed(SASL_HEADER)
    assert [str(m) for m in frame_fields(server.take_output(), 0x40)[0]] == [
        "EXTERNAL",
        "PLAIN",
    ]


@pytest.mark.parametrize("response", [None, b"", b"app"])
def test_external_mapped_identity(tls_auth: Authenticator, response: bytes | None) -> None:
    server = SaslServer(tls_auth, tls_identity=SUBJECT)
    server.feed(SASL_HEADER + init_frame("EXTERNAL", response) + AMQP_HEADER)
    assert server.done
    assert (server.user, server.mechanism) == ("app", "EXTERNAL")
    assert frame_fields(server.take_output(), 0x44) == [Outcome.OK]
    assert server.take_passthrough() == AMQP_HEADER


def test_external_unmapped_identity_is_refused(tls_auth: Authenticator) -> None:
    server = SaslServer(tls_auth, tls_identity="CN=stranger")
    server.feed(SASL_HEADER + init_frame("EXTERNAL", b""))
    assert server.failed
    assert frame_fields(server.take_output(), 0x44) == [Outcome.AUTH]
    assert server.error == (
        "TLS client certificate 'CN=stranger' is not mapped to a user (EXTERNAL); add it "
        'to tls_identity_users ("<certificate subject>" = "<user>") or use another mechanism'
    )


def test_external_authzid_of_another_user_is_refused(tls_auth: Authenticator) -> None:
    server = SaslServer(tls_auth, tls_identity=SUBJECT)
    server.feed(SASL_HEADER + init_frame("EXTERNAL", b"bob"))
    assert server.failed
    assert frame_fields(server.take_output(), 0x44) == [Outcome.AUTH]
    assert server.error is not None and "maps to user 'app', not 'bob'" in server.error


def test_external_only_broker_without_certificate_offers_nothing() -> None:
    auth = Authenticator({}, require_auth=True, tls_users={SUBJECT: "app"})
    server = SaslServer(auth)
    server.feed(SASL_HEADER)
    assert server.failed
    assert server.error is not None and "did not present" in server.error
    _, frames = decode_frames(server.take_output())
    assert [d for d, _ in frames] == [0x40]  # an empty mechanism list and no outcome
    assert list(frames[0][1][0]) == []


# --- anonymous access policy --------------------------------------------------------------


def test_allow_anonymous_false_offers_no_anonymous() -> None:
    auth = Authenticator(USERS, require_auth=False, allow_anonymous=False)
    server = SaslServer(auth)
    server.feed(SASL_HEADER)
    assert [str(m) for m in frame_fields(server.take_output(), 0x40)[0]] == ["PLAIN"]
    server.feed(init_frame("ANONYMOUS", b""))
    assert server.failed and server.error is not None and "not offered" in server.error
    p = Pump(auth, "ANONYMOUS").run()
    assert not p.remote_opened and p.client_condition == "amqp:unauthorized-access"
    p = Pump(auth, None).run()  # skipping SASL is anonymous access too
    assert p.sasl.failed and not p.remote_opened
    assert p.sasl.error is not None and "authentication is required" in p.sasl.error
    p = Pump(auth, "PLAIN", "bob", PASSWORD).run()
    assert p.both_open


@settings(max_examples=200, deadline=None)
@given(
    first=st.one_of(
        st.binary(max_size=60),
        st.sampled_from([RFC_CLIENT_FIRST, *(m for m, _ in BAD_CLIENT_FIRST)]),
    ),
    final=st.one_of(
        st.binary(max_size=120),
        st.sampled_from([RFC_CLIENT_FINAL, *(m for m, _ in BAD_CLIENT_FINAL)]),
        st.integers(0, len(RFC_CLIENT_FINAL) - 1).map(
            lambda i: RFC_CLIENT_FINAL[:i] + b"!" + RFC_CLIENT_FINAL[i + 1 :]
        ),
    ),
)
def test_scram_any_messages(first: bytes, final: bytes) -> None:
    """Whatever the client sends, the server never raises, answers with exactly one
    outcome, and accepts only the one right client-final of the RFC exchange."""
    auth = Authenticator(SCRAM_USERS, require_auth=True)
    server = scram_server(auth, RFC_SERVER_NONCE)
    server.feed(SASL_HEADER + init_frame(SCRAM, first) + response_frame(final))
    _, frames = decode_frames(server.take_output())
    kinds = [d for d, _ in frames]
    assert kinds[0] == 0x40 and kinds[-1] == 0x44 and kinds.count(0x44) == 1
    assert kinds.count(0x42) <= 1
    ok = first == RFC_CLIENT_FIRST and final == RFC_CLIENT_FINAL
    assert server.done is ok
    assert (server.user == "user") is ok
    assert frames[-1][1][0] == (Outcome.OK if ok else Outcome.AUTH)
