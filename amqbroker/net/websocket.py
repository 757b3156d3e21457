"""AMQP over WebSocket (the OASIS AMQP WebSocket Binding): the ws:// and wss:// listeners.

Theory of operation
-------------------
A connection accepted on a WebSocket listener goes through `handshake`: for wss:// the
TLS handshake of `amqbroker.net.tls` first, then the HTTP/1.1 upgrade, parsed with h11
(the server side is written here rather than with wsproto's handshake helper so that
bytes a client sends right behind its request are kept, not dropped). The upgrade must
be a GET with ``Upgrade: websocket``, ``Connection: Upgrade``, ``Sec-WebSocket-Version:
13`` and a key, and must offer the ``amqp`` subprotocol, which the broker selects in
``Sec-WebSocket-Protocol``. Anything else is answered with HTTP 400 (426 for another
WebSocket version) whose body is one line saying why, and closed. The whole opening
(TLS, upgrade, then SASL and the AMQP open in the driver) must finish within
``handshake_timeout`` of the accept.

After the upgrade, `WebSocketStream` is a trio ``Stream`` over the WebSocket, so the
connection runs on the existing `StreamDriver` unchanged (`WebSocketDriver` only adds
the close frame): ``receive_some`` returns the payload of binary messages as one byte
stream (AMQP frames may span messages, one message may hold several frames), and
``send_all`` sends its bytes as binary messages. wsproto (sans-IO) parses and builds
the WebSocket frames; it never touches the socket.

RFC 6455 behaviour: a ping is answered with a pong carrying its payload; pongs are
ignored; the peer's close frame is answered with a close frame echoing its code and
is the end of input; the broker's own end of output (after its AMQP close, or a SASL
failure) is a close frame with 1000, and the connection ends when the peer answers it
(or the driver's linger, ``handshake_timeout``, runs out). A violation fails the
connection at once with a close frame and its code, logged once at INFO with the peer:

* a text message: 1003 (AMQP travels in binary messages);
* a message larger than ``ws_max_message_size``: 1009;
* anything wsproto rejects (bad frame, unmasked client frame, bad close payload,
  invalid UTF-8, a continuation without a start...): its code, usually 1002.

Then the driver ends (it sees a broken transport), the socket is closed and the
connection's slots are freed.

Bounds: the upgrade request (headers) is at most `MAX_REQUEST_HEAD` bytes (h11);
input is read ``read_buffer_size`` bytes at a time and the payload of one read is
handed over before the next read, so nothing here grows with the size of a message;
a message larger than ``ws_max_message_size`` ends the connection (the AMQP engine
bounds frames by ``max_frame_size`` on its own); the broker's output goes out in
messages of at most ``ws_max_message_size`` bytes. No extension (permessage-deflate)
is negotiated.

Invariants: one sender at a time on the transport (`_send_lock`: the driver's writer
sends data, the reader sends pongs and close frames); the wsproto connection object
is only called synchronously, so its state always matches the bytes sent.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import logging
import socket
import ssl

import h11
import trio
from wsproto.connection import Connection, ConnectionState, ConnectionType
from wsproto.events import BytesMessage, CloseConnection, Event, Ping, TextMessage
from wsproto.frame_protocol import CloseReason

from amqbroker.core.errors import PeerError
from amqbroker.net.driver import StreamDriver
from amqbroker.net.tls import handshake as tls_handshake

log = logging.getLogger(__name__)

#: the subprotocol of the OASIS AMQP WebSocket Binding
SUBPROTOCOL = "amqp"
#: largest upgrade request line + headers (h11 refuses a longer one: HTTP 400)
MAX_REQUEST_HEAD = 16 * 1024
#: how long a failed connection's close frame may wait to go out (a peer that does
#: not read must not delay the end of the connection)
FAIL_CLOSE_TIMEOUT = 1.0
_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"  # RFC 6455, 1.3


def accept_token(key: bytes) -> bytes:
    """Sec-WebSocket-Accept for a Sec-WebSocket-Key (RFC 6455, 4.2.2)."""
    return base64.b64encode(hashlib.sha1(key.strip() + _GUID).digest())


# ------------------------------------------------------------------------- the stream


class WebSocketStream(trio.abc.HalfCloseableStream):
    """A trio Stream over an upgraded WebSocket (see the module docstring).

    `socket` is the TCP socket under everything (under TLS for wss), which the driver
    closes when the connection ends."""

    def __init__(
        self,
        inner: trio.abc.Stream,
        ws: Connection,
        *,
        socket: trio.socket.SocketType,
        peer: str,
        max_message_size: int,
        read_size: int = 65536,
    ) -> None:
        self.inner = inner
        self.socket = socket
        self.peer = peer
        self.max_message_size = max_message_size
        self.read_size = read_size
        self._ws = ws
        self._send_lock = trio.Lock()
        self._pending = bytearray()  # payload received, not yet returned
        self._message_bytes = 0  # payload of the binary message in progress
        self._eof = False
        self._failed: str | None = None

    @property
    def state(self) -> ConnectionState:
        return self._ws.state

    # ------------------------------------------------------------------- input
    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        while not self._pending:
            if self._failed is not None:
                raise trio.BrokenResourceError(self._failed)
            if self._eof:
                return b""
            await self._handle_events()
            if self._pending or self._eof or self._failed is not None:
                continue
            try:
                data = await self.inner.receive_some(self.read_size)
            except trio.BrokenResourceError as exc:
                self._failed = f"transport error: {exc.__cause__ or exc}"
                raise
            if not data:  # TCP end without a close frame (RFC 6455: 1006)
                self._eof = True
                return b""
            self._ws.receive_data(bytes(data) if isinstance(data, bytearray) else data)
        n = len(self._pending) if max_bytes is None else min(max_bytes, len(self._pending))
        out = bytes(self._pending[:n])
        del self._pending[:n]
        return out

    async def _handle_events(self) -> None:
        """Take the events of the input fed so far (at most one read's worth)."""
        ws = self._ws
        for event in ws.events():
            if isinstance(event, BytesMessage):
                self._message_bytes += len(event.data)
                if self._message_bytes > self.max_message_size:
                    await self._fail(
                        CloseReason.MESSAGE_TOO_BIG,
                        f"a message larger than ws_max_message_size ({self.max_message_size} "
                        "bytes)",
                    )
                    return
                self._pending += event.data
                if event.message_finished:
                    self._message_bytes = 0
            elif isinstance(event, TextMessage):
                await self._fail(
                    CloseReason.UNSUPPORTED_DATA,
                    "a text message (AMQP over WebSocket uses binary messages)",
                )
                return
            elif isinstance(event, Ping):
                await self._send(event.response())
            elif isinstance(event, CloseConnection):
                if ws.state in (ConnectionState.OPEN, ConnectionState.LOCAL_CLOSING):
                    # wsproto reports a protocol violation as a close event without
                    # changing its state; a close frame from the peer changes it
                    await self._fail(event.code, event.reason or "protocol error")
                    return
                if ws.state is ConnectionState.REMOTE_CLOSING:  # echo the peer's code
                    await self._send(event.response())
                self._eof = True
                return
            # Pong: nothing to do (the broker sends no pings: AMQP has heartbeats)

    async def _fail(self, code: int, reason: str) -> None:
        """Fail the WebSocket: a close frame with `code` (best effort, bounded), then
        every receive raises BrokenResourceError."""
        # the driver logs it once, with the connection and the peer
        self._failed = f"WebSocket failed: {reason} (closed with {int(code)})"
        with trio.move_on_after(FAIL_CLOSE_TIMEOUT):
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await self._send(CloseConnection(code=code, reason=reason))

    async def _send(self, event: Event) -> None:
        """A control frame (pong, close); built under the lock, so wsproto's state
        follows the bytes sent. Dropped once wsproto may no longer send it (after
        our close frame; a pong after the peer's)."""
        async with self._send_lock:
            state = self._ws.state
            if state is not ConnectionState.OPEN and not (
                state is ConnectionState.REMOTE_CLOSING and isinstance(event, CloseConnection)
            ):
                return
            await self.inner.send_all(self._ws.send(event))

    # ------------------------------------------------------------------ output
    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        """`data` as binary messages of at most max_message_size bytes each."""
        ws = self._ws
        view = memoryview(data)
        step = self.max_message_size
        async with self._send_lock:
            for i in range(0, len(view), step):
                if ws.state is not ConnectionState.OPEN:
                    raise trio.BrokenResourceError(
                        self._failed or "the WebSocket is closing: no more data can be sent"
                    )
                await self.inner.send_all(ws.send(BytesMessage(data=bytes(view[i : i + step]))))

    async def send_eof(self) -> None:
        """The end of our output: a close frame with 1000 (normal closure)."""
        await self._send(CloseConnection(code=CloseReason.NORMAL_CLOSURE))

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def aclose(self) -> None:
        await self.inner.aclose()


class WebSocketDriver(StreamDriver):
    """`StreamDriver` on a `WebSocketStream`: the end of the broker's output is a
    WebSocket close frame, sent by the writer after its last data (a TCP half-close
    would cut the WebSocket without its closing handshake)."""

    def _half_close(self) -> bool:
        return True  # the close frame follows from `_writer`

    async def _writer(self) -> None:
        await super()._writer()
        stream = self.stream
        if not (self._closing and isinstance(stream, WebSocketStream)):
            return
        if self._done:
            # the connection failed (framing error, idle timeout): the driver ends
            # now, but the AMQP close it wrote still gets its close frame (bounded)
            with (
                trio.CancelScope(shield=True),
                trio.move_on_after(FAIL_CLOSE_TIMEOUT),
                contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError),
            ):
                await stream.send_eof()
            return
        try:
            await stream.send_eof()
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            log.info("%s: transport error: %s", self.conn.log_prefix(), exc.__cause__ or exc)
            self._finish()


# ----------------------------------------------------------------------- the upgrade


def http_response(status: int, phrase: str, text: str, headers: tuple[str, ...] = ()) -> bytes:
    """A complete HTTP/1.1 response with a one-line plain-text body, then close."""
    body = (text + "\n").encode()
    head = [
        f"HTTP/1.1 {status} {phrase}",
        "Content-Type: text/plain; charset=utf-8",
        f"Content-Length: {len(body)}",
        "Connection: close",
        *headers,
    ]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class _Refused(PeerError):
    def __init__(self, reason: str, status: int = 400, headers: tuple[str, ...] = ()) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status
        self.headers = headers


def _check_request(req: h11.Request) -> bytes:
    """The client's key if `req` is a WebSocket upgrade offering amqp; else _Refused."""
    hint = "; this is an AMQP over WebSocket listener (subprotocol amqp)"
    if req.method != b"GET":
        raise _Refused(f"the upgrade must be a GET, not {req.method.decode('latin-1')}{hint}")
    if req.http_version != b"1.1":
        raise _Refused(f"the upgrade needs HTTP/1.1{hint}")
    headers: dict[bytes, list[bytes]] = {}
    for name, value in req.headers:
        headers.setdefault(name.lower(), []).append(value)

    def tokens(name: bytes) -> list[str]:
        values = b",".join(headers.get(name, []))
        return [t.strip().decode("latin-1") for t in values.split(b",") if t.strip()]

    if "websocket" not in (t.lower() for t in tokens(b"upgrade")):
        raise _Refused(f"not a WebSocket upgrade (no Upgrade: websocket header){hint}")
    if "upgrade" not in (t.lower() for t in tokens(b"connection")):
        raise _Refused(f"not a WebSocket upgrade (no Connection: Upgrade header){hint}")
    if tokens(b"sec-websocket-version") != ["13"]:
        raise _Refused(
            "unsupported WebSocket version (Sec-WebSocket-Version must be 13)",
            426,
            ("Sec-WebSocket-Version: 13",),
        )
    keys = headers.get(b"sec-websocket-key", [])
    try:
        nonce = base64.b64decode(keys[0], validate=True) if len(keys) == 1 else b""
    except ValueError:  # binascii.Error
        nonce = b""
    if len(nonce) != 16:
        raise _Refused("missing or malformed Sec-WebSocket-Key")
    offered = tokens(b"sec-websocket-protocol")
    if SUBPROTOCOL not in offered:
        said = ", ".join(offered) if offered else "none"
        raise _Refused(
            f"the client must offer the WebSocket subprotocol {SUBPROTOCOL!r} "
            f"(Sec-WebSocket-Protocol: {SUBPROTOCOL}); it offered {said}"
        )
    return keys[0]


async def _read_upgrade(stream: trio.abc.Stream, read_size: int) -> tuple[bytes, bytes] | None:
    """Read the upgrade request: (client key, bytes received after it), None if the
    client closed first; _Refused if it is not an acceptable upgrade."""
    h = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_REQUEST_HEAD)
    key: bytes | None = None
    while True:
        try:
            event = h.next_event()
        except h11.RemoteProtocolError as exc:
            raise _Refused(f"not a valid HTTP/1.1 request ({exc})") from None
        if event is h11.NEED_DATA:
            data = await stream.receive_some(read_size)
            if not data:
                return None
            h.receive_data(bytes(data))
        elif isinstance(event, h11.Request):
            key = _check_request(event)  # refused before any body is read
        elif isinstance(event, h11.Data):
            raise _Refused("the upgrade request must not have a body")
        elif event is h11.PAUSED and key is not None:
            return key, h.trailing_data[0]
        elif isinstance(event, h11.ConnectionClosed):
            return None
        # EndOfMessage: PAUSED follows (an upgrade was proposed)


def _shutdown(sock: socket.socket | trio.socket.SocketType) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_WR)


async def handshake(
    sock: socket.socket,
    *,
    peer: str,
    tls_context: ssl.SSLContext | None,
    deadline: float,
    handshake_timeout: float,
    max_message_size: int,
    read_size: int,
) -> tuple[WebSocketStream, str | None] | None:
    """The opening of an accepted ws:// (or wss://, with `tls_context`) connection by
    `deadline` (trio time). Returns the stream and the TLS client identity, or None
    after logging why (the socket is then closed)."""
    identity: str | None = None
    inner: trio.abc.Stream
    if tls_context is not None:
        shaken = await tls_handshake(
            sock, tls_context, peer=peer, deadline=deadline, handshake_timeout=handshake_timeout
        )
        if shaken is None:
            return None  # logged and closed
        ssl_stream, identity = shaken
        tsock = ssl_stream.transport_stream.socket
        inner = ssl_stream
    else:
        tsock = trio.socket.from_stdlib_socket(sock)
        inner = trio.SocketStream(tsock)
    handed_over = False
    reason: str | None = None
    try:
        with trio.move_on_at(deadline):
            try:
                got = await _read_upgrade(inner, read_size)
            except _Refused as exc:
                reason = f"refused with HTTP {exc.status}: {exc.reason}"
                phrase = "Upgrade Required" if exc.status == 426 else "Bad Request"
                try:
                    await inner.send_all(http_response(exc.status, phrase, exc.reason, exc.headers))
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
                else:
                    _shutdown(tsock)  # FIN after the response, not a reset
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                reason = f"transport error: {exc.__cause__ or exc}"
            else:
                if got is None:
                    reason = "the client closed the connection before the upgrade"
                else:
                    key, rest = got
                    await inner.send_all(
                        (
                            "HTTP/1.1 101 Switching Protocols\r\n"
                            "Upgrade: websocket\r\n"
                            "Connection: Upgrade\r\n"
                            f"Sec-WebSocket-Accept: {accept_token(key).decode()}\r\n"
                            f"Sec-WebSocket-Protocol: {SUBPROTOCOL}\r\n\r\n"
                        ).encode()
                    )
                    ws = Connection(ConnectionType.SERVER, trailing_data=rest)
                    handed_over = True
                    stream = WebSocketStream(
                        inner,
                        ws,
                        socket=tsock,
                        peer=peer,
                        max_message_size=max_message_size,
                        read_size=read_size,
                    )
                    return stream, identity
    except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
        reason = f"transport error: {exc.__cause__ or exc}"
    finally:
        if not handed_over:  # refused, failed, late or cancelled (shutdown)
            tsock.close()
    if reason is None:
        reason = f"not finished within handshake_timeout ({handshake_timeout:.1f} s)"
    log.info("WebSocket upgrade from %s failed: %s; connection closed", peer, reason)
    return None
