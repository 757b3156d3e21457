"""Outbound connections: the socket half of a cluster node's client connection to a peer.

`OutboundDriver.run` connects to host:port, builds a fresh `PeerEngine` through the
factory for every attempt, and pumps it: the reader feeds received bytes, the writer
sends whatever the engine has (woken through the engine's `on_dirty`), the ticker runs
heartbeats / idle timeout. When the socket ends it reports `on_down` and reconnects
after a backoff that doubles from `backoff_initial` to `backoff_max` (reset once a
connection has opened); an attempt that fails before the AMQP open (connection
refused, unreachable) is reported to `on_fail`, if given. It runs until cancelled.

After every batch of input the hub is flushed, because the engine's callbacks run
broker code (acknowledging a forwarded message dispatches the next one, a management
answer routes a message) that writes into other connections.
"""

from __future__ import annotations

import logging
import math
import ssl
from collections.abc import Callable, Sequence

import trio

from amqbroker.net.driver import Hub
from amqbroker.protocol.peer import PeerEngine

log = logging.getLogger(__name__)


class OutboundDriver:
    def __init__(
        self,
        hub: Hub,
        *,
        name: str,
        host: str,
        port: int,
        factory: Callable[[Callable[[], None]], PeerEngine],
        on_up: Callable[[PeerEngine], None],
        on_down: Callable[[PeerEngine | None, str], None],
        backoff_initial: float = 0.2,
        backoff_max: float = 5.0,
        connect_timeout: float = 5.0,
        on_fail: Callable[[str], None] | None = None,
        more: Sequence[tuple[str, int]] = (),
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.hub = hub
        self.name = name
        #: every address to try, in order; `host`/`port` is the one in use
        self.addresses: tuple[tuple[str, int], ...] = ((host, port), *more)
        self._index = 0
        self.host = host
        self.port = port
        self.factory = factory
        self.on_up = on_up
        self.on_down = on_down
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.connect_timeout = connect_timeout
        self.on_fail = on_fail
        #: TLS for every attempt (the peer's certificate verified, for the host dialled)
        self.ssl_context = ssl_context
        self.engine: PeerEngine | None = None
        self.connected = False
        self.attempts = 0
        self.last_error = ""
        self._write_lot = trio.lowlevel.ParkingLot()
        self._tick_lot = trio.lowlevel.ParkingLot()
        self._kick: trio.Event = trio.Event()

    def _wake_writer(self) -> None:
        self._write_lot.unpark_all()

    def kick(self) -> None:
        """Reconnect now instead of waiting for the rest of the backoff."""
        self._kick.set()

    def _next_address(self) -> None:
        self._index = (self._index + 1) % len(self.addresses)
        self.host, self.port = self.addresses[self._index]

    async def run(self) -> None:
        backoff = self.backoff_initial
        failed_in_row = 0
        while True:
            self.attempts += 1
            opened = False
            try:
                opened = await self._one()
            except (OSError, trio.TooSlowError, trio.BrokenResourceError) as exc:
                self.last_error = _reason(exc)
                if len(self.addresses) > 1:
                    self.last_error = f"{self.host}:{self.port}: {self.last_error}"
            if not opened and self.on_fail is not None:
                self.on_fail(self.last_error)
            if opened:
                backoff = self.backoff_initial
                failed_in_row = 0
            else:
                failed_in_row += 1
            if len(self.addresses) > 1:
                self._next_address()
                if not opened and failed_in_row % len(self.addresses):
                    continue  # the next alternative at once; the backoff after a round
            self._kick = trio.Event()
            with trio.move_on_after(backoff):
                await self._kick.wait()
            backoff = min(backoff * 2, self.backoff_max)

    async def _one(self) -> bool:
        stream: trio.abc.Stream
        with trio.fail_after(self.connect_timeout):
            tcp = await trio.open_tcp_stream(self.host, self.port)
            tcp.setsockopt(trio.socket.IPPROTO_TCP, trio.socket.TCP_NODELAY, 1)
            stream = tcp
            if self.ssl_context is not None:
                tls = trio.SSLStream(tcp, self.ssl_context, server_hostname=self.host)
                try:
                    await tls.do_handshake()
                except BaseException:
                    await tcp.aclose()
                    raise
                stream = tls
        engine = self.factory(self._wake_writer)
        self.engine = engine
        self.connected = True
        up = False
        try:
            async with stream, trio.open_nursery() as n:
                n.start_soon(self._writer, stream, engine)
                n.start_soon(self._ticker, engine)
                buf_stream = stream
                while True:
                    try:
                        data = await buf_stream.receive_some(65536)
                    except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                        self.last_error = str(exc) or "connection reset"
                        break
                    if not data:
                        self.last_error = engine.error or "connection closed by the peer"
                        break
                    engine.feed(bytes(data))  # bytes already from a socket (no copy)
                    if not up and engine.opened:
                        up = True
                        self.last_error = ""
                        self.on_up(engine)
                    if engine.closed_by_peer:
                        self.last_error = engine.error or "closed by the peer"
                    self._write_lot.unpark_all()
                    self._tick_lot.unpark_all()
                    self.hub.flush()
                n.cancel_scope.cancel()
        finally:
            self.connected = False
            engine.input_closed()
            self.engine = None
            self.on_down(engine if up else None, self.last_error)
            self.hub.flush()
        return up

    async def _writer(self, stream: trio.abc.Stream, engine: PeerEngine) -> None:
        while True:
            out = engine.output()
            if out:
                try:
                    await stream.send_all(out)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return
                continue
            await self._write_lot.park()

    async def _ticker(self, engine: PeerEngine) -> None:
        while True:
            nxt = engine.tick(trio.current_time())
            self._write_lot.unpark_all()
            with trio.move_on_at(nxt if nxt else math.inf):
                await self._tick_lot.park()


def _reason(exc: BaseException) -> str:
    """Why an attempt failed, for the log (a TLS handshake's error is its cause)."""
    if isinstance(exc, trio.TooSlowError):
        return "connect timed out"
    cause = exc.__cause__ if isinstance(exc, trio.BrokenResourceError) else None
    if isinstance(cause, ssl.SSLError):
        return f"TLS handshake failed: {cause.reason or cause}"
    return str(exc) or str(cause or "") or type(exc).__name__
