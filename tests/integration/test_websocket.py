"""AMQP over WebSocket (ws:// and wss://), over real sockets with real clients.

Two WebSocket clients: rhea with the npm `ws` package (`interop/node/rhea_client.js
--websocket`, as a browser application uses it), and `WsClient` below, a small trio
client on wsproto (python-qpid-proton's engine cannot do WebSocket) that speaks the
AMQP bytes by hand with `tests.integration.amqp_wire`. Certificates for wss come from
trustme. Time-dependent tests run under trio's autojump clock: a connection that must
be closed "promptly" must be closed within 1 s of trio time, far below idle_timeout.
"""

from __future__ import annotations

import contextlib
import logging
import ssl
import struct
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio
import trustme
from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Event,
    Ping,
    Pong,
    Request,
    TextMessage,
)
from wsproto.frame_protocol import FrameProtocol

from amqbroker.app import BrokerApp
from amqbroker.core.auth import hash_password
from amqbroker.net.websocket import accept_token
from tests.client import wait_until
from tests.conftest import BrokerFactory, wait_idle
from tests.integration.amqp_wire import (
    BEGIN,
    BEGIN_CODE,
    CLOSE,
    CLOSE_CODE,
    HEADER,
    OPEN,
    OPEN_CODE,
    AmqpWire,
    error_of,
)
from tests.integration.test_rhea_interop import CLIENT, CLIENT_TIMEOUT, RUN_TIMEOUT, _node, _parse

WS_LOGGER = "amqbroker.net.websocket"


# ----------------------------------------------------------------- a wsproto client


class WsClient:
    """A WebSocket client: wsproto over a trio stream (TCP, or TLS for wss)."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.ws = WSConnection(ConnectionType.CLIENT)
        self.pending: deque[Event] = deque()
        self.eof = False

    @classmethod
    async def connect(cls, port: int, ssl_context: ssl.SSLContext | None = None) -> WsClient:
        stream: trio.abc.Stream = await trio.open_tcp_stream("127.0.0.1", port)
        if ssl_context is not None:
            tls = trio.SSLStream(stream, ssl_context, server_hostname="127.0.0.1")
            await tls.do_handshake()
            stream = tls
        return cls(stream)

    async def upgrade(self, subprotocols: tuple[str, ...] = ("binary", "amqp")) -> Event | None:
        await self.send(Request(host="127.0.0.1", target="/", subprotocols=list(subprotocols)))
        return await self.event()

    async def raw(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def send(self, event: Event) -> None:
        await self.raw(self.ws.send(event))

    async def binary(self, *messages: bytes) -> None:
        for m in messages:
            await self.send(BytesMessage(data=m))

    async def event(self) -> Event | None:
        """The next WebSocket event; None once the broker closed the TCP connection."""
        while not self.pending:
            self.pending.extend(self.ws.events())
            if self.pending:
                break
            if self.eof:
                return None
            try:
                data = await self.stream.receive_some(65536)
            except trio.BrokenResourceError:  # a reset, or TLS without close_notify
                data = b""
            if not data:
                self.eof = True
                await self.aclose()
                continue
            self.ws.receive_data(data)
        return self.pending.popleft()

    async def closed_with(self) -> CloseConnection:
        """Skip data until the broker's close frame; answer it; then the TCP end."""
        while True:
            ev = await self.event()
            assert ev is not None, "the broker closed TCP without a close frame"
            if isinstance(ev, CloseConnection):
                break
            assert isinstance(ev, BytesMessage), ev
        if self.ws.state.name == "REMOTE_CLOSING":
            await self.send(ev.response())
        assert await self.event() is None, "the broker kept the connection open"
        return ev

    # duck-typed as the socket of `AmqpWire`: recv is the next binary message's payload
    async def recv(self, _n: int) -> bytes:
        ev = await self.event()
        if ev is None or isinstance(ev, CloseConnection):
            if ev is not None:
                self.pending.appendleft(ev)  # for closed_with
            return b""
        assert isinstance(ev, BytesMessage), f"the broker sent {ev!r}, not a binary message"
        return bytes(ev.data)

    def wire(self) -> AmqpWire:
        return AmqpWire(self)  # type: ignore[arg-type]

    async def aclose(self) -> None:
        with contextlib.suppress(trio.BrokenResourceError):
            await self.stream.aclose()


async def open_amqp(port: int, ssl_context: ssl.SSLContext | None = None) -> WsClient:
    """Upgrade, send the AMQP header + open, read the broker's header + open."""
    c = await WsClient.connect(port, ssl_context)
    ev = await c.upgrade()
    assert isinstance(ev, AcceptConnection), ev
    await c.binary(HEADER + OPEN)
    wire = c.wire()
    assert await wire.header() == HEADER
    await wire.until(OPEN_CODE)
    return c


async def raw_http(port: int, request: bytes) -> tuple[int, list[str], str]:
    """Send `request` as is; (status, header lines, body) of the answer, read to EOF."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    await stream.send_all(request)
    got = b""
    with trio.fail_after(5):
        while chunk := await stream.receive_some(65536):
            got += chunk
    await stream.aclose()
    head, _, body = got.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    return int(lines[0].split()[1]), lines[1:], body.decode()


def ws_port(app: BrokerApp) -> int:
    return app.ws_listening[0][1]


def upgrade_failures(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == WS_LOGGER]


# -------------------------------------------------------------------------- rhea


async def run_rhea(scenario: str, port: int, *args: str, status: int = 0) -> Any:
    argv = [_node(), str(CLIENT), scenario, "--port", str(port), "--timeout", CLIENT_TIMEOUT]
    argv += [*args, "--websocket"]
    with trio.fail_after(RUN_TIMEOUT):
        proc = await trio.run_process(argv, capture_stdout=True, capture_stderr=True, check=False)
    result = _parse(argv, proc.returncode, proc.stdout, proc.stderr)
    if proc.returncode != status:
        pytest.fail(f"rhea_client exited {proc.returncode}, expected {status}\n{result}")
    return result


@pytest.mark.interop
async def test_rhea_grouped_messages_over_websocket_with_sasl_plain(
    make_broker: BrokerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="amqbroker")
    app = await make_broker(
        ws_listeners=["127.0.0.1:0"],
        users={"alice": hash_password("s3cret", iterations=1000)},
        require_auth=True,
    )
    port = ws_port(app)
    assert f"ws://127.0.0.1:{port}" in caplog.text  # the start banner
    auth = ("--username", "alice", "--password", "s3cret")
    run = await run_rhea("groups", port, "--address", "ws.groups", "--count", "20", *auth)
    done = run.one("groups_done")
    assert done["ok"] is True, done["problems"]
    assert done["outcomes"] == {"accepted": 20}
    assert done["assignment"] == {"g0": "r1", "g1": "r2", "g2": "r1", "g3": "r2"}
    assert [e["body"] for e in run.of("message") if e["receiver"] == "r1"] == [
        f"m{i}" for i in range(20) if i % 4 in (0, 2)
    ]
    # the same SASL as over TCP: a wrong password is refused
    refused = await run_rhea("send", port, "--address", "ws.groups", *auth[:3], "wrong", status=3)
    assert refused.of("connected") == []
    assert "amqp:unauthorized-access" in refused.stderr, refused.stderr
    sizes = await wait_idle(app)
    assert all(v == 0 for v in sizes.values()), sizes
    # every connection ended with a closing handshake, none as a transport error
    assert "transport error" not in caplog.text, caplog.text


# ------------------------------------------------------ upgrade and AMQP byte stream


async def test_upgrade_selects_amqp_and_carries_the_amqp_byte_stream(
    make_broker: BrokerFactory,
) -> None:
    app = await make_broker(ws_listeners=["127.0.0.1:0"])
    c = await WsClient.connect(ws_port(app))
    with trio.fail_after(5):
        ev = await c.upgrade(("binary", "AMQPWSB10", "amqp"))
        assert isinstance(ev, AcceptConnection), ev
        assert ev.subprotocol == "amqp"
        # frames spanning messages: the header and the open cut at odd places
        stream = HEADER + OPEN
        await c.binary(stream[:3], stream[3:13], stream[13:])
        wire = c.wire()
        assert await wire.header() == HEADER
        await wire.until(OPEN_CODE)
        # a ping is answered with its payload; pongs are ignored
        await c.send(Pong(payload=b"unsolicited"))
        await c.send(Ping(payload=b"p1"))
        ev = await c.event()
        assert isinstance(ev, Pong) and ev.payload == b"p1", ev
        # several frames in one message: begin, close
        await c.binary(BEGIN + CLOSE)
        await wire.until(BEGIN_CODE)
        assert await wire.until(CLOSE_CODE) == []
        # after its AMQP close the broker closes the WebSocket: 1000, normal closure
        closed = await c.closed_with()
        assert closed.code == 1000
        sizes = await wait_idle(app)
    assert all(v == 0 for v in sizes.values()), sizes


async def test_bytes_sent_right_behind_the_upgrade_request_are_kept(
    make_broker: BrokerFactory,
) -> None:
    app = await make_broker(ws_listeners=["127.0.0.1:0"])
    c = await WsClient.connect(ws_port(app))
    request = c.ws.send(Request(host="127.0.0.1", target="/", subprotocols=["amqp"]))
    frame = FrameProtocol(client=True, extensions=[]).send_data(HEADER + OPEN, True)
    with trio.fail_after(5):
        await c.raw(request + bytes(frame))  # one write: the request, then a message
        assert isinstance(await c.event(), AcceptConnection)
        wire = c.wire()
        assert await wire.header() == HEADER
        await wire.until(OPEN_CODE)
        await c.binary(CLOSE)
        await wire.until(CLOSE_CODE)
        assert (await c.closed_with()).code == 1000


async def test_client_initiated_websocket_close_is_answered(make_broker: BrokerFactory) -> None:
    app = await make_broker(ws_listeners=["127.0.0.1:0"])
    c = await open_amqp(ws_port(app))
    with trio.fail_after(5):
        await c.send(CloseConnection(code=1001, reason="going away"))
        ev = await c.event()
        assert isinstance(ev, CloseConnection) and ev.code == 1001, ev  # echoed
        assert await c.event() is None
        sizes = await wait_idle(app)
    assert all(v == 0 for v in sizes.values()), sizes


REFUSALS = {
    "no amqp subprotocol": (
        b"Sec-WebSocket-Protocol: mqtt, binary\r\n",
        400,
        "the client must offer the WebSocket subprotocol 'amqp'",
        "it offered mqtt, binary",
    ),
    "no subprotocol at all": (b"", 400, "subprotocol 'amqp'", "it offered none"),
}


def upgrade_request(extra: bytes, version: bytes = b"13") -> bytes:
    return (
        b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: "
        + version
        + b"\r\n"
        + extra
        + b"\r\n"
    )


@pytest.mark.parametrize("case", REFUSALS.values(), ids=list(REFUSALS))
async def test_upgrade_without_amqp_is_refused_with_400_and_a_reason(
    make_broker: BrokerFactory, caplog: pytest.LogCaptureFixture, case: tuple[Any, ...]
) -> None:
    extra, status, *phrases = case
    caplog.set_level(logging.INFO, logger="amqbroker")
    app = await make_broker(ws_listeners=["127.0.0.1:0"])
    got_status, headers, body = await raw_http(ws_port(app), upgrade_request(extra))
    assert got_status == status
    assert body.count("\n") == 1 and body.endswith("\n"), body  # one line
    for phrase in phrases:
        assert phrase in body, body
    assert not any(h.lower().startswith("sec-websocket-accept") for h in headers), headers
    (line,) = upgrade_failures(caplog)
    assert f"refused with HTTP {status}: {body.strip()}" in line, line
    assert app.hub.slots == 0 and app.server.ws_handshakes == 0


async def test_other_http_requests_are_refused_with_a_reason(make_broker: BrokerFactory) -> None:
    app = await make_broker(ws_listeners=["127.0.0.1:0"])
    port = ws_port(app)
    status, _, body = await raw_http(port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 400 and "not a WebSocket upgrade" in body, body
    status, headers, body = await raw_http(
        port, upgrade_request(b"Sec-WebSocket-Protocol: amqp\r\n", version=b"8")
    )
    assert status == 426 and "Sec-WebSocket-Version: 13" in headers, (headers, body)
    status, _, body = await raw_http(port, b"\x16\x03\x01 not http\r\n\r\n")
    assert status == 400 and "not a valid HTTP/1.1 request" in body, body
    assert app.hub.slots == 0 and app.server.ws_handshakes == 0


def test_accept_token_is_rfc_6455s() -> None:
    assert accept_token(b"dGhlIHNhbXBsZSBub25jZQ==") == b"s3pPLMBiTxaQ9kYGzzhZRbK+xOo="


# -------------------------------------------------------------------- hostile input


def unmasked_binary(payload: bytes) -> bytes:
    return bytes([0x82, len(payload)]) + payload


#: AMQP empty frames (heartbeats): valid AMQP, so only the WebSocket limit can object
HEARTBEATS = bytes.fromhex("0000000802000000") * 75  # 600 bytes

HOSTILE: dict[str, tuple[Any, int]] = {
    "garbage": (b"\xff\xfe\xfd\xfc garbage", 1002),
    "unmasked client frame": (unmasked_binary(b"\x00\x00\x00\x08"), 1002),
    "text message": (TextMessage(data="AMQP as text?"), 1003),
    "oversized message": (BytesMessage(data=HEARTBEATS * 2), 1009),
    "oversized in fragments": (
        [BytesMessage(data=HEARTBEATS, message_finished=False)] * 2,
        1009,
    ),
}


@pytest.mark.parametrize("case", HOSTILE.values(), ids=list(HOSTILE))
async def test_hostile_input_closes_at_once_and_frees_the_slot(
    make_broker: BrokerFactory, autojump_clock: Any, case: tuple[Any, int]
) -> None:
    hostile, code = case
    app = await make_broker(
        ws_listeners=["127.0.0.1:0"],
        idle_timeout=6,
        max_connections=1,
        max_connections_per_address=1,
        max_frame_size=512,
        ws_max_message_size=1024,
    )
    port = ws_port(app)
    c = await open_amqp(port)
    with trio.fail_after(1):  # far below idle_timeout (6 s)
        if isinstance(hostile, bytes):
            await c.raw(hostile)
        else:
            for ev in hostile if isinstance(hostile, list) else [hostile]:
                await c.send(ev)
        closed = await c.closed_with()
        assert closed.code == code, closed
        assert closed.reason, "no reason in the close frame"
    # the max_connections and per-address slots are free right away
    assert app.hub.slots == 0
    assert app.server.per_address == {}
    with trio.fail_after(1):
        again = await open_amqp(port)
        await again.binary(CLOSE)
        await again.wire().until(CLOSE_CODE)
        assert (await again.closed_with()).code == 1000
    sizes = await wait_idle(app)
    assert all(v == 0 for v in sizes.values()), sizes


# ------------------------------------------------------------------------ the limits


async def test_limits_apply_as_over_tcp(make_broker: BrokerFactory, autojump_clock: Any) -> None:
    app = await make_broker(
        ws_listeners=["127.0.0.1:0"],
        max_connections=2,
        max_connections_per_address=1,
        max_frame_size=512,
        ws_max_message_size=4096,
    )
    port = ws_port(app)
    first = await open_amqp(port)
    # max_connections_per_address: upgraded, then refused by AMQP with the usual error
    second = await WsClient.connect(port)
    with trio.fail_after(1):
        assert isinstance(await second.upgrade(), AcceptConnection)
        await second.binary(HEADER + OPEN)
        wire = second.wire()
        assert await wire.header() == HEADER
        condition, description = error_of(await wire.until(CLOSE_CODE))
        assert condition == "amqp:resource-limit-exceeded"
        assert "max_connections_per_address (1)" in description, description
        assert (await second.closed_with()).code == 1000
    # max_frame_size: a larger frame is a framing error, as over TCP
    with trio.fail_after(1):
        await first.binary(struct.pack(">IBBH", 600, 2, 0, 0) + b"\x00" * 592)
        condition, description = error_of(await first.wire().until(CLOSE_CODE))
        assert condition == "amqp:connection:framing-error", (condition, description)
        assert (await first.closed_with()).code == 1000
    sizes = await wait_idle(app)
    assert all(v == 0 for v in sizes.values()), sizes


async def test_max_connections_counts_upgrades_in_progress(
    make_broker: BrokerFactory, autojump_clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="amqbroker")
    app = await make_broker(ws_listeners=["127.0.0.1:0"], max_connections=1)
    port = ws_port(app)
    # an upgrade in progress holds the only slot: the next connection is closed at once
    slow = await trio.open_tcp_stream("127.0.0.1", port)
    await slow.send_all(b"GET / HTTP/1.1\r\n")
    await wait_until(lambda: app.server.ws_handshakes == 1, timeout=1)
    with trio.fail_after(1):
        refused = await WsClient.connect(port)
        assert await refused.upgrade() is None
    assert "refusing WebSocket connection" in caplog.text
    await slow.aclose()
    await wait_until(lambda: app.server.ws_handshakes == 0, timeout=1)
    with trio.fail_after(1):
        c = await open_amqp(port)
    await c.binary(CLOSE)
    with trio.fail_after(1):
        assert (await c.closed_with()).code == 1000


async def test_the_upgrade_counts_within_the_handshake_timeout(
    make_broker: BrokerFactory, autojump_clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="amqbroker")
    app = await make_broker(ws_listeners=["127.0.0.1:0"], handshake_timeout=5, idle_timeout=60)
    port = ws_port(app)
    # a slow upgrade (3 s), then no AMQP: dropped 5 s after the accept, not after the upgrade
    t0 = trio.current_time()
    c = await WsClient.connect(port)
    request = c.ws.send(Request(host="127.0.0.1", target="/", subprotocols=["amqp"]))
    await c.raw(request[:20])
    await trio.sleep(3)
    await c.raw(request[20:])
    assert isinstance(await c.event(), AcceptConnection)
    with trio.fail_after(10):
        assert await c.event() is None
    assert 5 <= trio.current_time() - t0 < 5.5
    # an upgrade never finished: closed at the deadline, logged
    t0 = trio.current_time()
    silent = await trio.open_tcp_stream("127.0.0.1", port)
    with trio.fail_after(10):
        assert await silent.receive_some(100) == b""
    await silent.aclose()
    assert 5 <= trio.current_time() - t0 < 5.5
    assert any(
        "not finished within handshake_timeout (5.0 s)" in m for m in upgrade_failures(caplog)
    )
    sizes = await wait_idle(app)
    assert all(v == 0 for v in sizes.values()), sizes
    assert app.server.ws_handshakes == 0


# ------------------------------------------------------------------------------ wss


@dataclass
class Pki:
    ca_file: Path
    cert: Path
    key: Path

    def client_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca_file))


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("wss-pki")
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    server = ca.issue_cert("127.0.0.1", "localhost")
    for i, blob in enumerate(server.cert_chain_pems):
        blob.write_to_path(str(d / "server.pem"), append=i > 0)
    server.private_key_pem.write_to_path(str(d / "server.key"))
    return Pki(d / "ca.pem", d / "server.pem", d / "server.key")


async def test_wss_uses_the_tls_settings(
    make_broker: BrokerFactory, pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="amqbroker")
    app = await make_broker(
        wss_listeners=["127.0.0.1:0"], tls_cert_file=str(pki.cert), tls_key_file=str(pki.key)
    )
    port = app.wss_listening[0][1]
    assert f"wss://127.0.0.1:{port}" in caplog.text
    with trio.fail_after(5):
        c = await open_amqp(port, pki.client_context())
        await c.binary(CLOSE)
        assert await c.wire().until(CLOSE_CODE) == []
        assert (await c.closed_with()).code == 1000
    # a client that does not speak TLS fails the TLS handshake, before any upgrade
    with trio.fail_after(5):
        plain = await WsClient.connect(port)
        assert await plain.upgrade() is None
    assert "TLS handshake with" in caplog.text
    sizes = await wait_idle(app)
    assert all(v == 0 for v in sizes.values()), sizes


@pytest.mark.interop
async def test_rhea_over_wss(make_broker: BrokerFactory, pki: Pki) -> None:
    app = await make_broker(
        wss_listeners=["127.0.0.1:0"], tls_cert_file=str(pki.cert), tls_key_file=str(pki.key)
    )
    port = app.wss_listening[0][1]
    run = await run_rhea(
        "roundtrip", port, "--address", "wss.rt", "--count", "5", "--ca", str(pki.ca_file)
    )
    done = run.one("roundtrip_done")
    assert done["outcomes"] == {"accepted": 5} and done["in_order"] is True
    sizes = await wait_idle(app)
    assert all(v == 0 for v in sizes.values()), sizes
