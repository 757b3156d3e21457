"""One driver per connection, and the hub that flushes connections after a batch.

A driver runs one connection on one transport with three tasks: the reader (wait for
input, feed the connection), the writer (sends output the flush could not) and the
ticker (heartbeats / idle timeout at the deadlines Proton asks for, the opening
handshake deadline, the close linger). `ConnectionDriver` holds what every transport
shares (lifetime, the reader loop, ticker, close linger); two subclasses own the
bytes (`_receive`, the writer, `flush_now`):

* `Driver`, the plain path: a non-blocking stdlib socket. `_receive` `recv_into`s a
  reused buffer and waits readable only when the socket has nothing (other tasks get
  a turn every MAX_READS_PER_WAKEUP reads); `flush_now` writes with non-blocking sends in the
  caller's task, and the writer task only wakes when the socket's send buffer was full.
* `StreamDriver`: any trio `Stream`, used for TLS (`trio.SSLStream`, see `net.tls`).
  `_receive` awaits `receive_some`; since a stream write is a coroutine, `flush_now`
  only processes the connection and wakes the writer task, which sends the
  connection's output with `send_all`, then reports it as consumed. Output stays in
  the connection's engine until it is sent, so `output_high_water` back-pressure works
  the same as on the plain path. Only the writer task peeks the output.

The plain path does not pay for the stream one: no indirection per read or send.

No task switch per message (ARCHITECTURE decision 3): a batch of input is fed to the
connection, which routes and dispatches synchronously, writing into other
connections' engines. Those connections mark themselves dirty; `Hub.flush` then
writes each one's pending output (plain) or wakes its writer (stream), in the
reader's task.

Lifetime: the driver ends when the peer closes the transport, the transport fails, or
the connection's output is finished (after our close frame) and the peer closed its
side or the linger (`handshake_timeout`) ran out. Ending always runs the connection's
cleanup, so unsettled messages go back to their queues. A driver holds a connection
slot (`Hub.slots`, what `max_connections` counts; the app's `on_release` frees the
per-address one) until its output is finished or it ends, whichever is first: a
peer that keeps its socket open after our close or refusal does not keep others
out. One deadline,
`handshake_timeout` after the accept, bounds the whole opening (TLS handshake, SASL,
AMQP open).
"""

from __future__ import annotations

import logging
import math
import socket
from collections.abc import Callable

import trio

from amqbroker.protocol.connection import AmqpConnection

log = logging.getLogger(__name__)

#: reads per wake-up before giving other tasks a turn
MAX_READS_PER_WAKEUP = 16


class Hub:
    """Connections with output to write, flushed at the end of each batch."""

    def __init__(self) -> None:
        self._dirty: list[AmqpConnection] = []
        self.drivers: dict[AmqpConnection, ConnectionDriver] = {}
        #: called after every flush (wakes the store writer)
        self.after_flush: list[Callable[[], object]] = []
        #: unparked whenever a driver ends (shutdown waits on it)
        self.drivers_changed = trio.lowlevel.ParkingLot()
        #: connections holding a slot (what max_connections counts): every driver
        #: until its output is finished (our close frame, or refusal, is written)
        self.slots = 0

    def on_dirty(self, conn: AmqpConnection) -> None:
        self._dirty.append(conn)

    def flush(self) -> None:
        while self._dirty:
            batch = self._dirty
            self._dirty = []
            for conn in batch:
                d = self.drivers.get(conn)
                if d is not None:
                    d.flush_now()
                else:
                    conn.dirty = False
        for cb in self.after_flush:
            cb()

    @property
    def pending(self) -> int:
        return len(self._dirty)

    async def close_all(
        self, deadline: float, keep: frozenset[AmqpConnection] = frozenset()
    ) -> None:
        """Shutdown: close every connection but `keep` ("amqp:connection:forced") and
        wait, until trio's `deadline`, for their drivers to end (past it they are
        left to the caller, which cancels them)."""
        for conn in list(self.drivers):
            if conn not in keep:
                conn.close("amqp:connection:forced", "the broker is shutting down")
        self.flush()
        with trio.move_on_at(deadline) as scope:
            while any(c not in keep for c in self.drivers):
                await self.drivers_changed.park()
        if scope.cancelled_caught:
            log.warning(
                "%d connection(s) did not close within shutdown_timeout; dropping them",
                sum(c not in keep for c in self.drivers),
            )


def _shutdown_write(sock: socket.socket | trio.socket.SocketType) -> bool:
    """TCP's half-close (SHUT_WR) of `sock`; False if the socket refused it."""
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        return False
    return True


class ConnectionDriver:
    """What every transport shares; subclasses implement the four transport methods."""

    def __init__(
        self,
        hub: Hub,
        conn: AmqpConnection,
        *,
        read_size: int = 65536,
        handshake_timeout: float = 10.0,
        accepted_at: float | None = None,
        on_release: Callable[[], object] | None = None,
    ) -> None:
        self.hub = hub
        self.conn = conn
        self._on_release = on_release
        self._holds_slot = True
        hub.slots += 1
        self.read_size = read_size
        self.handshake_timeout = handshake_timeout
        start = trio.current_time() if accepted_at is None else accepted_at
        self._handshake_until = start + handshake_timeout
        self._closing = False
        self._linger_until = math.inf
        self._write_lot = trio.lowlevel.ParkingLot()
        self._tick_lot = trio.lowlevel.ParkingLot()
        self._write_blocked = False
        #: the driver is ending (read on the hot path: a plain attribute)
        self._done = False
        self._ticking = False
        #: the driver's lifetime: `run` enters it, `_finish` cancels it (also before
        #: `run` has entered it: the driver then ends at once)
        self._scope = trio.CancelScope()
        hub.drivers[conn] = self

    # ------------------------------------------------------- the transport's part
    async def _receive(self) -> bytes | bytearray | memoryview | None:
        """The next input: data, empty at end of input, None if the transport failed
        (logged). The buffer may be reused by the next call."""
        raise NotImplementedError

    async def _writer(self) -> None:
        raise NotImplementedError

    def flush_now(self) -> None:
        """Write (or start writing) the connection's pending output without blocking."""
        raise NotImplementedError

    def _half_close(self) -> bool:
        """Tell the peer we send no more, if the transport can; False if it failed."""
        return True

    def _close_transport(self) -> None:
        """Release the transport now (no await: runs in `run`'s finally)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ shared
    async def run(self) -> None:
        try:
            with self._scope:
                async with trio.open_nursery() as n:
                    n.start_soon(self._writer)
                    n.start_soon(self._ticker)
                    await self._reader()
                    n.cancel_scope.cancel()
        finally:
            self._done = True
            self.release_slot()
            self.hub.drivers.pop(self.conn, None)
            self.hub.drivers_changed.unpark_all()
            self.conn.abort()
            self._close_transport()
            self.hub.flush()

    def release_slot(self) -> None:
        """Stop counting this connection towards the limits (idempotent): once our
        close is written, only the linger is left, and a refused client that keeps
        its socket open must not keep a legitimate one out."""
        if self._holds_slot:
            self._holds_slot = False
            self.hub.slots -= 1
            if self._on_release is not None:
                self._on_release()

    def _finish(self) -> None:
        self._done = True
        self._scope.cancel()

    async def _reader(self) -> None:
        """Feed the connection until the input ends, the transport fails or the driver
        finishes. One loop for every transport (`_receive` is the transport's part)."""
        conn = self.conn
        hub = self.hub
        while not self._done:
            data = await self._receive()
            if data is None:
                return
            if not data:
                conn.input_closed()
                hub.flush()
                return
            if conn.sasl_may_block:
                await trio.to_thread.run_sync(conn.sasl_feed, bytes(data))
                conn.feed(b"")
            else:
                conn.feed(data)
            hub.flush()
            if not self._ticking and conn.opened:
                self._ticking = True
                self._tick_lot.unpark_all()

    def stop(self) -> None:
        """Drop the connection now (shutdown deadline passed)."""
        self._finish()

    def _output_finished(self) -> None:
        """Our side is done (close frame or SASL failure written): half-close the
        transport and give the peer `handshake_timeout` to close its side, so unread
        input does not turn our close into a reset."""
        if self._closing:
            return
        self._closing = True
        self.release_slot()
        if self.conn.transport_failed:
            # idle timeout, framing error: the peer is gone or broken, don't wait
            self._finish()
            return
        self._linger_until = trio.current_time() + self.handshake_timeout
        if not self._half_close():
            self._finish()
            return
        self._tick_lot.unpark_all()

    def _want_write(self) -> None:
        if not self._write_blocked:
            self._write_blocked = True
            self._write_lot.unpark_all()

    async def _ticker(self) -> None:
        """Heartbeats and idle timeout (Proton's deadlines), the opening handshake
        deadline, and the close linger."""
        conn = self.conn
        handshake_until = self._handshake_until
        while not self._done:
            now = trio.current_time()
            at = math.inf
            if self._ticking and not self._closing:
                deadline = conn.tick(int(now * 1000))
                self.flush_now()
                self.hub.flush()
                if deadline:
                    at = deadline / 1000.0
            if self._closing:
                if now >= self._linger_until:
                    self._finish()
                    return
                at = min(at, self._linger_until)
            elif not conn.opened:
                if now >= handshake_until:
                    log.info(
                        "%s: no AMQP open within handshake_timeout (%.1f s); dropped",
                        conn.log_prefix(),
                        self.handshake_timeout,
                    )
                    self._finish()
                    return
                at = min(at, handshake_until)
            with trio.move_on_at(at):
                await self._tick_lot.park()


class Driver(ConnectionDriver):
    """The plain path: a non-blocking stdlib socket, written from the flushing task."""

    def __init__(
        self,
        hub: Hub,
        conn: AmqpConnection,
        sock: socket.socket,
        *,
        read_size: int = 65536,
        handshake_timeout: float = 10.0,
        accepted_at: float | None = None,
        on_release: Callable[[], object] | None = None,
    ) -> None:
        self.sock = sock
        self._buf = bytearray(read_size)
        self._mv = memoryview(self._buf)
        #: reads since the last wait: after MAX_READS_PER_WAKEUP, other tasks get a turn
        self._reads = 0
        super().__init__(
            hub,
            conn,
            read_size=read_size,
            handshake_timeout=handshake_timeout,
            accepted_at=accepted_at,
            on_release=on_release,
        )

    async def _receive(self) -> memoryview | None:
        sock = self.sock
        if self._reads >= MAX_READS_PER_WAKEUP:
            self._reads = 0
            await trio.lowlevel.checkpoint()
        while True:
            try:
                n = sock.recv_into(self._buf)
            except (BlockingIOError, InterruptedError):
                self._reads = 0
                await trio.lowlevel.wait_readable(sock)
                continue
            except OSError as exc:
                log.info("%s: socket error: %s", self.conn.log_prefix(), exc)
                return None
            self._reads += 1
            return self._mv[:n]

    def flush_now(self) -> None:
        """Write the connection's pending output without blocking."""
        if self._done:
            self.conn.dirty = False
            return
        conn = self.conn
        conn.process()
        sock = self.sock
        while True:
            out = conn.output()
            if out is None:
                conn.flushed()
                self._output_finished()
                return
            if not out:
                break
            try:
                n = sock.send(out)
            except (BlockingIOError, InterruptedError):
                self._want_write()
                break
            except OSError as exc:
                log.info("%s: socket error: %s", conn.log_prefix(), exc)
                conn.abort()
                self._finish()
                return
            conn.consumed(n)
            if n < len(out):
                self._want_write()
                break
        conn.flushed()

    def _half_close(self) -> bool:
        return _shutdown_write(self.sock)

    def _close_transport(self) -> None:
        self.sock.close()

    async def _writer(self) -> None:
        while True:
            await self._write_lot.park()
            while self._write_blocked and not self._done:
                await trio.lowlevel.wait_writable(self.sock)
                self._write_blocked = False
                self.flush_now()
                self.hub.flush()


class StreamDriver(ConnectionDriver):
    """Any trio Stream (TLS): the writer task sends, `flush_now` only wakes it.

    `_close_transport` closes `sock`, the socket under `stream`, without waiting (no
    TLS close_notify, see `net.tls`); the stream object is then dropped."""

    def __init__(
        self,
        hub: Hub,
        conn: AmqpConnection,
        stream: trio.abc.Stream,
        *,
        sock: trio.socket.SocketType,
        read_size: int = 65536,
        handshake_timeout: float = 10.0,
        accepted_at: float | None = None,
        on_release: Callable[[], object] | None = None,
    ) -> None:
        self.stream = stream
        self._socket = sock
        super().__init__(
            hub,
            conn,
            read_size=read_size,
            handshake_timeout=handshake_timeout,
            accepted_at=accepted_at,
            on_release=on_release,
        )

    async def _receive(self) -> bytes | bytearray | None:
        try:
            return await self.stream.receive_some(self.read_size)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            cause = exc.__cause__ or exc
            log.info("%s: transport error: %s", self.conn.log_prefix(), cause)
            return None

    def flush_now(self) -> None:
        """Process the connection and wake the writer (which re-checks the output
        after every send, so a wake-up while it sends is never lost)."""
        conn = self.conn
        if self._done:
            conn.dirty = False
            return
        conn.process()
        self._write_lot.unpark_all()
        conn.flushed()

    async def _writer(self) -> None:
        conn = self.conn
        stream = self.stream
        while not self._done:
            out = conn.output()
            if out is None:
                conn.flushed()
                self._output_finished()
                return
            if not out:
                await self._write_lot.park()
                continue
            # a copy: the connection reuses its output buffer for the next peek
            data = bytes(out)
            try:
                await stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                log.info("%s: transport error: %s", conn.log_prefix(), exc.__cause__ or exc)
                conn.abort()
                self._finish()
                return
            conn.consumed(len(data))
            conn.flushed()
            self.hub.flush()

    def _half_close(self) -> bool:
        # TCP's half-close under the TLS stream, as on the plain path (every byte of
        # TLS is sent: the writer calls this after its last send_all). No close_notify:
        # trio's SSLStream can only send one by closing the whole stream, and the
        # peer already has our AMQP close or SASL outcome (see net.tls).
        return _shutdown_write(self._socket)

    def _close_transport(self) -> None:
        self._socket.close()
