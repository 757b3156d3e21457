"""Connection admission: each accepted socket becomes a connection driver, or a refusal.

`ConnectionServer` is what the listeners' accept loops call (`serve` for plain AMQP,
`serve_tls`, `serve_ws`, `serve_wss`). It counts connections against the limits,
opens the TLS / WebSocket layer, builds the connection (through the app's
`new_connection`, which gives it the broker, auth and management) and runs its driver.

Connection limits: `max_connections` (all connections, refused ones included, until
the broker's close or refusal is written: `Hub.slots`; the linger waiting for the
peer to close its side is not counted) and `max_connections_per_address` (admitted
connections per client IP, counted in `per_address` until the same point, whose entry
goes when its last connection is released). A connection over either is opened and
closed at once with amqp:resource-limit-exceeded and a description naming the
setting. TLS handshakes and WebSocket openings in progress count towards
`max_connections` too: past it their socket is closed at once (nothing can be said to
the client before TLS or the upgrade).

Invariant: every admitted connection's `per_address` count is taken back exactly
once (the driver's `release_slot`, or `serve`'s finally), so the map is empty when no
client is connected.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import socket
import ssl
from collections.abc import Callable

import trio

from amqbroker.net.driver import ConnectionDriver, Driver, Hub, StreamDriver
from amqbroker.net.tls import handshake as tls_handshake
from amqbroker.net.websocket import WebSocketDriver, WebSocketStream
from amqbroker.net.websocket import handshake as ws_handshake
from amqbroker.protocol.connection import AmqpConnection, ConnectionLimits
from amqbroker.settings import Settings

log = logging.getLogger("amqbroker")

#: (limits, connection id, peer "host:port", TLS identity) -> a new connection
NewConnection = Callable[[ConnectionLimits, str, str, str | None], AmqpConnection]


class ConnectionServer:
    """Admission and one driver per accepted connection (see the module docstring)."""

    def __init__(
        self,
        hub: Hub,
        settings: Settings,
        *,
        limits: ConnectionLimits,
        new_connection: NewConnection,
        tls_context: ssl.SSLContext | None = None,
    ) -> None:
        self.hub = hub
        self.settings = settings
        #: the limits of every admitted connection (tests may replace them)
        self.limits = limits
        self.refuse_limits = dataclasses.replace(
            limits,
            refuse_reason=(
                f"the broker has reached max_connections ({settings.max_connections}); "
                "try again later or raise max_connections"
            ),
        )
        self.new_connection = new_connection
        self.tls_context = tls_context
        #: TLS handshakes in progress (they count towards max_connections)
        self.tls_handshakes = 0
        #: WebSocket openings (TLS for wss, then the upgrade) in progress: they count
        #: towards max_connections like TLS handshakes
        self.ws_handshakes = 0
        #: client IP -> admitted connections from it (no entry at 0)
        self.per_address: dict[str, int] = {}
        self.refused_per_address = 0
        self._conn_ids = itertools.count(1)

    def _full(self) -> bool:
        """max_connections reached, counting the openings in progress."""
        return (
            self.hub.slots + self.tls_handshakes + self.ws_handshakes
            >= self.settings.max_connections
        )

    async def serve_tls(self, sock: socket.socket, peer: str) -> None:
        """A connection on a TLS listener: the TLS handshake, then `serve` on the
        stream. Handshakes in progress count towards max_connections: past it the
        socket is closed at once (nothing can be said to the client before TLS)."""
        assert self.tls_context is not None
        s = self.settings
        accepted_at = trio.current_time()
        if self._full():
            log.warning(
                "refusing TLS connection from %s: max_connections (%d) reached (counting "
                "%d TLS handshake(s) in progress); closed before the handshake",
                peer,
                s.max_connections,
                self.tls_handshakes,
            )
            sock.close()
            return
        self.tls_handshakes += 1
        try:
            shaken = await tls_handshake(
                sock,
                self.tls_context,
                peer=peer,
                deadline=accepted_at + s.handshake_timeout,
                handshake_timeout=s.handshake_timeout,
            )
        finally:
            self.tls_handshakes -= 1
        if shaken is not None:
            stream, identity = shaken
            await self.serve(
                sock, peer, stream=stream, tls_identity=identity, accepted_at=accepted_at
            )

    async def serve_wss(self, sock: socket.socket, peer: str) -> None:
        await self.serve_ws(sock, peer, tls=True)

    async def serve_ws(self, sock: socket.socket, peer: str, *, tls: bool = False) -> None:
        """A connection on a WebSocket listener: TLS (wss) and the HTTP upgrade
        (`amqbroker.net.websocket`), then `serve` on the WebSocket stream. Counted
        towards max_connections and bounded by handshake_timeout like `serve_tls`."""
        s = self.settings
        accepted_at = trio.current_time()
        if self._full():
            log.warning(
                "refusing WebSocket connection from %s: max_connections (%d) reached "
                "(counting %d TLS/WebSocket handshake(s) in progress); closed before the "
                "upgrade",
                peer,
                s.max_connections,
                self.tls_handshakes + self.ws_handshakes,
            )
            sock.close()
            return
        self.ws_handshakes += 1
        try:
            opened = await ws_handshake(
                sock,
                peer=peer,
                tls_context=self.tls_context if tls else None,
                deadline=accepted_at + s.handshake_timeout,
                handshake_timeout=s.handshake_timeout,
                max_message_size=s.ws_max_message_size,
                read_size=s.read_buffer_size,
            )
        finally:
            self.ws_handshakes -= 1
        if opened is not None:
            stream, identity = opened
            await self.serve(
                sock, peer, stream=stream, tls_identity=identity, accepted_at=accepted_at
            )

    async def serve(
        self,
        sock: socket.socket,
        peer: str,
        *,
        stream: trio.SSLStream[trio.SocketStream] | WebSocketStream | None = None,
        tls_identity: str | None = None,
        accepted_at: float | None = None,
    ) -> None:
        """One connection: `sock` on the plain path, or `stream` (TLS or WebSocket,
        handshake done; `accepted_at` starts the opening deadline) over it."""
        s = self.settings
        n = next(self._conn_ids)
        limits = self.limits
        ip = peer.rpartition(":")[0] or peer  # "host:port", IPv6 host unbracketed
        per_address = s.max_connections_per_address
        admitted = False
        if self.hub.slots >= s.max_connections:
            limits = self.refuse_limits
            log.warning(
                "refusing connection from %s: max_connections (%d) reached",
                peer,
                s.max_connections,
            )
        elif per_address > 0 and self.per_address.get(ip, 0) >= per_address:
            limits = dataclasses.replace(
                self.limits,
                refuse_reason=(
                    f"too many connections from {ip}: max_connections_per_address "
                    f"({per_address}) reached; close connections you no longer use, or "
                    "ask the operator to raise max_connections_per_address"
                ),
            )
            self.refused_per_address += 1
            log.warning(
                "refusing connection from %s: max_connections_per_address (%d) reached for %s",
                peer,
                per_address,
                ip,
            )
        else:
            admitted = True
        conn = self.new_connection(limits, f"c{n}", peer, tls_identity)
        release: Callable[[], None] | None = None
        if admitted:  # counted from here on: the driver's release_slot takes it back

            def release() -> None:
                left = self.per_address[ip] - 1
                if left:
                    self.per_address[ip] = left
                else:
                    del self.per_address[ip]

            self.per_address[ip] = self.per_address.get(ip, 0) + 1
        driver: ConnectionDriver
        if stream is None:
            driver = Driver(
                self.hub,
                conn,
                sock,
                read_size=s.read_buffer_size,
                handshake_timeout=s.handshake_timeout,
                on_release=release,
            )
        else:
            driver = (WebSocketDriver if isinstance(stream, WebSocketStream) else StreamDriver)(
                self.hub,
                conn,
                stream,
                sock=(
                    stream.socket
                    if isinstance(stream, WebSocketStream)
                    else stream.transport_stream.socket
                ),
                read_size=s.read_buffer_size,
                handshake_timeout=s.handshake_timeout,
                accepted_at=accepted_at,
                on_release=release,
            )
        try:
            await driver.run()
        finally:
            driver.release_slot()
