"""The server-side SASL layer, against a real Proton client engine pumped in memory.

Server side of every pump: SaslServer in front of a Proton server transport on which
sasl() is never called, exactly as the broker wires it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

import proton
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from proton import Collector, Connection, Event, Transport

from amqbroker.core.auth import Authenticator, hash_password
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
            fields.append(d.get_object())
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
    }
    assert all(target in (State.AWAIT_INIT, State.DONE) for _, target in TRANSITIONS.values())


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
