"""Composition root: builds the broker from settings and runs it under one nursery.

Tasks (all children of the root nursery): one accept loop per listener, one driver
per connection (in a separate nursery, so shutdown can give connections a deadline),
the store writer (group commit: take everything buffered, write + fsync in a worker
thread, then settle the producers waiting for that batch), the core timer loop, the
deferred-dispatch loop and the expiry reaper.

Graceful shutdown (SIGINT/SIGTERM or `request_shutdown`): stop accepting; flush the
store so producers waiting for a sync get their `accepted`; close every connection
(their consumers' unsettled messages go back to the queues in order); wait for peers
to answer the close until `shutdown_timeout`; write the final store batch; release
the data directory.

Time: the core gets an epoch-aligned clock built on `trio.current_time()`, so tests
running under trio's autojump clock move the core's time too.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from amqbroker import __version__
from amqbroker.core.address_settings import AddressSettingsRepository
from amqbroker.core.auth import Authenticator
from amqbroker.core.broker import Broker
from amqbroker.core.timers import Timers
from amqbroker.net.driver import Driver, Hub
from amqbroker.net.listener import ListenError, accept_loop, bind, bound_address
from amqbroker.protocol.codec import ScannerCodec
from amqbroker.protocol.connection import AmqpConnection, ConnectionLimits
from amqbroker.protocol.fastpath import check_binding
from amqbroker.protocol.links import SyncTracker
from amqbroker.protocol.management import ManagementNode
from amqbroker.protocol.scanner import log_message_id
from amqbroker.settings import Settings, parse_listener
from amqbroker.store.delivery_log import DeliveryLogWriter, pyarrow_available
from amqbroker.store.journal import Journal

log = logging.getLogger("amqbroker")


class _NoClock(trio.abc.Clock):
    """Placeholder until `run` binds the trio run's clock."""

    def start_clock(self) -> None:  # pragma: no cover - never run
        pass

    def current_time(self) -> float:
        raise RuntimeError("BrokerApp.clock() used before run()")

    def deadline_to_sleep_time(self, deadline: float) -> float:  # pragma: no cover
        return deadline


class StartupError(Exception):
    """The broker cannot start; the message says why and what to do."""


class BrokerApp:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.hub = Hub()
        self.listening: list[tuple[str, int]] = []
        self.journal: Journal | None = None
        #: this broker's name (node_id, or <hostname>-<port> once listening)
        self.node_id = settings.node_id
        #: the delivery log writer (None when delivery_log is off)
        self.dlog: DeliveryLogWriter | None = None
        self._dlog_lot = trio.lowlevel.ParkingLot()
        self.broker: Broker | None = None
        self.recovered_messages = 0
        self.recovered_queues = 0
        self._shutdown = trio.Event()
        self._store_lot = trio.lowlevel.ParkingLot()
        #: one batch at a time: the writer loop and the final flush both commit
        self._store_lock = trio.Lock()
        self._dlog_lock = trio.Lock()
        self._timer_lot = trio.lowlevel.ParkingLot()
        self._deferred_lot = trio.lowlevel.ParkingLot()
        self._conn_ids = itertools.count(1)
        self._conn_nursery: trio.Nursery | None = None
        self._epoch0 = 0.0
        self._trio0 = 0.0
        self._clock_offset = 0.0
        self._trio_clock: trio.abc.Clock = _NoClock()
        self.exit_code = 0

    # ---------------------------------------------------------------- clock
    def clock(self) -> float:
        # the run's clock object directly: trio.current_time() costs three frames,
        # and the core reads the clock when it binds a group
        return self._clock_offset + self._trio_clock.current_time()

    def _to_trio(self, t: float) -> float:
        return t - self._epoch0 + self._trio0

    # ---------------------------------------------------------------- build
    def _build(self) -> None:
        s = self.settings
        check_binding()
        data_dir = Path(s.data_dir).expanduser().resolve()
        try:
            data_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StartupError(
                f"cannot create the data directory {data_dir}: {exc.strerror}; "
                "choose another with --data-dir"
            ) from exc
        self.data_dir = data_dir
        journal = Journal(
            data_dir / "journal",
            sync=s.store_sync,
            segment_size=s.store_segment_size,
            max_batch_bytes=s.store_max_batch_bytes,
            compact_min_bytes=s.store_compact_min_bytes,
            compact_live_ratio=s.store_compact_live_ratio,
        )
        recovered = journal.open()
        self.journal = journal
        self.timers = Timers(on_change=self._timer_lot.unpark_all)
        if s.delivery_log:
            if s.delivery_log_format == "parquet" and not pyarrow_available():
                journal.close()
                raise StartupError(
                    "delivery_log_format = parquet needs pyarrow, which is not installed: "
                    "install it with pip install 'amqbroker[spark]', or set "
                    "delivery_log_format = jsonl"
                )
            self.dlog = DeliveryLogWriter(
                data_dir / "delivery-log",
                file_format=s.delivery_log_format,
                rotate_bytes=s.delivery_log_rotate_bytes,
                max_bytes=s.delivery_log_max_bytes,
                buffer_records=s.delivery_log_buffer_records,
                overflow=s.delivery_log_overflow,
                # wall-clock time (a C call, no Python frame): the audit compares
                # timestamps across nodes
                clock=time.time,
                message_id=log_message_id,
                wake=self._dlog_lot.unpark_all,
            )
        broker = Broker(
            address_settings=AddressSettingsRepository(s.address_settings),
            persistence=journal,
            clock=self.clock,
            timers=self.timers,
            codec=ScannerCodec(),
            dispatch_batch=s.dispatch_batch,
            temporary_queue_prefix=s.temporary_queue_prefix,
            wake=self._deferred_lot.unpark_all,
            global_max_size=s.global_max_size,
            delivery_log=self.dlog,
        )
        self.broker = broker
        for rq in recovered.queues:
            broker.restore_queue(rq.qid, rq.name, rq.attributes, rq.entries)
            self.recovered_queues += 1
            self.recovered_messages += len(rq.entries)
        for ac in s.addresses:
            broker.create_address(ac.name, ac.routing, durable=ac.durable)
        self.auth = Authenticator(s.users, require_auth=s.require_auth)
        self.sync = SyncTracker(lambda: journal.batch_no)
        self.management = ManagementNode(broker)
        self.hub.after_flush.append(self._store_lot.unpark_all)
        self._limits = ConnectionLimits(
            container_id="amqbroker",
            max_frame_size=s.max_frame_size,
            channel_max=s.channel_max,
            max_sessions=s.max_sessions_per_connection,
            max_links=s.max_links_per_connection,
            idle_timeout=s.idle_timeout,
            max_message_size=s.max_message_size,
            link_credit=s.link_credit,
            max_transaction_messages=s.max_transaction_messages,
            output_high_water=s.output_high_water,
            output_low_water=s.output_low_water,
        )
        self._refuse_limits = dataclasses.replace(
            self._limits,
            refuse_reason=(
                f"the broker has reached max_connections ({s.max_connections}); "
                "try again later or raise max_connections"
            ),
        )

    # ------------------------------------------------------------------ run
    async def run(
        self,
        *,
        task_status: trio.TaskStatus[BrokerApp] = trio.TASK_STATUS_IGNORED,
        handle_signals: bool = False,
        ready: Callable[[BrokerApp], None] | None = None,
    ) -> None:
        self._epoch0 = time.time()
        self._trio0 = trio.current_time()
        self._trio_clock = trio.lowlevel.current_clock()
        self._clock_offset = self._epoch0 - self._trio0
        self._build()
        s = self.settings
        sockets: list[socket.socket] = []
        try:
            for host, port in [(s.host, s.port)] + [parse_listener(x) for x in s.extra_listeners]:
                sockets.append(bind(host, port))
        except ListenError as exc:
            for sk in sockets:
                sk.close()
            self._close_store()
            raise StartupError(str(exc)) from exc
        self.listening = [bound_address(sk) for sk in sockets]
        self.node_id = s.node_id or f"{socket.gethostname()}-{self.listening[0][1]}"
        if self.dlog is not None:
            try:
                self.dlog.open(self.node_id)
            except OSError as exc:
                for sk in sockets:
                    sk.close()
                self._close_store()
                raise StartupError(
                    f"cannot open the delivery log in {self.dlog.root}: {exc}; fix the "
                    "directory or set delivery_log = false"
                ) from exc
        try:
            async with trio.open_nursery() as root:
                root.start_soon(self._store_loop)
                root.start_soon(self._timer_loop)
                root.start_soon(self._deferred_loop)
                if self.dlog is not None:
                    root.start_soon(self._dlog_loop)
                if s.expiry_scan_period > 0:
                    root.start_soon(self._expiry_loop)
                if handle_signals:
                    # installed before we report ready: a signal right after the
                    # "listening" line must already stop the broker gracefully
                    await root.start(self._signal_loop)
                async with trio.open_nursery() as conns:
                    self._conn_nursery = conns
                    async with trio.open_nursery() as accepting:
                        for sk in sockets:
                            accepting.start_soon(accept_loop, sk, self._serve, conns)
                        log.info(
                            "amqbroker %s listening on %s; data in %s (%d queue(s), %d "
                            "message(s) recovered)",
                            __version__,
                            ", ".join(f"amqp://{h}:{p}" for h, p in self.listening),
                            self.data_dir,
                            self.recovered_queues,
                            self.recovered_messages,
                        )
                        if ready is not None:
                            ready(self)
                        task_status.started(self)
                        await self._shutdown.wait()
                        accepting.cancel_scope.cancel()
                    await self._graceful_close(conns)
                root.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await self._final_flush()
                await self._dlog_final_flush()
            self._close_store()
        log.info("amqbroker stopped")

    def request_shutdown(self) -> None:
        self._shutdown.set()

    async def _signal_loop(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            task_status.started()
            async for signum in signals:
                if self._shutdown.is_set():
                    log.warning("second signal: stopping now")
                    raise KeyboardInterrupt
                log.info(
                    "received %s: stopping (up to %.0f s to settle in-flight messages)",
                    signal.Signals(signum).name,
                    self.settings.shutdown_timeout,
                )
                self.request_shutdown()

    async def _serve(self, sock: socket.socket, peer: str) -> None:
        assert self.broker is not None
        n = next(self._conn_ids)
        limits = self._limits
        if len(self.hub.drivers) >= self.settings.max_connections:
            limits = self._refuse_limits
            log.warning(
                "refusing connection from %s: max_connections (%d) reached",
                peer,
                self.settings.max_connections,
            )
        conn = AmqpConnection(
            self.broker,
            limits=limits,
            auth=self.auth,
            conn_id=f"c{n}",
            peer=peer,
            sync=self.sync,
            management=self.management,
            on_dirty=self.hub.on_dirty,
        )
        driver = Driver(
            self.hub,
            conn,
            sock,
            read_size=self.settings.read_buffer_size,
            handshake_timeout=self.settings.handshake_timeout,
        )
        await driver.run()

    async def _graceful_close(self, conns: trio.Nursery) -> None:
        """Settle what producers wait for, close connections, wait for the peers."""
        deadline = trio.current_time() + self.settings.shutdown_timeout
        await self._final_flush()
        for conn in list(self.hub.drivers):
            conn.close("amqp:connection:forced", "the broker is shutting down")
        self.hub.flush()
        with trio.move_on_at(deadline) as scope:
            while self.hub.drivers:
                await self.hub.drivers_changed.park()
        if scope.cancelled_caught:
            log.warning(
                "%d connection(s) did not close within shutdown_timeout; dropping them",
                len(self.hub.drivers),
            )
        conns.cancel_scope.cancel()

    # ---------------------------------------------------------- store writer
    async def _store_loop(self) -> None:
        j = self.journal
        assert j is not None
        while True:
            if not j.pending:
                await self._store_lot.park()
                continue
            try:
                async with self._store_lock:
                    await self._commit_one(j)
            except OSError as exc:
                log.critical(
                    "cannot write the journal in %s: %s; stopping the broker so that no "
                    "message is accepted without being stored (free disk space or fix "
                    "the directory, then start again)",
                    self.data_dir,
                    exc,
                )
                self.exit_code = 3
                self.request_shutdown()
                return

    async def _commit_one(self, j: Journal) -> bool:
        """Take, write (+ fsync in a worker thread) and complete one batch; settle
        the producers that waited for it. False when nothing was buffered."""
        batch = j.take_batch()
        if batch is None:
            return False
        if self.settings.store_sync:
            await trio.to_thread.run_sync(j.write_batch, batch)
        else:
            j.write_batch(batch)  # no fsync: cheap enough for the event loop
        no = j.batch_done(batch)
        self.sync.synced(no)
        self.hub.flush()
        return True

    async def _final_flush(self) -> None:
        j = self.journal
        if j is None:
            return
        try:
            async with self._store_lock:
                while await self._commit_one(j):
                    pass
        except OSError as exc:
            log.critical("cannot write the final journal batch: %s", exc)
            self.exit_code = 3

    def _close_store(self) -> None:
        if self.journal is not None:
            try:
                self.journal.close()
            finally:
                self.journal = None

    # ---------------------------------------------------- delivery log writer
    async def _dlog_loop(self) -> None:
        """Write the delivery log buffer in a worker thread: every
        delivery_log_flush_interval, or at once when it is a quarter full."""
        w = self.dlog
        assert w is not None
        interval = self.settings.delivery_log_flush_interval
        while True:
            if w.pending < w.take_at:
                with trio.move_on_after(interval):
                    await self._dlog_lot.park()
            async with self._dlog_lock:
                await self._dlog_write(w)
            self.hub.flush()  # producers resumed by take_batch get their credit

    async def _dlog_write(self, w: DeliveryLogWriter) -> bool:
        batch = w.take_batch()
        if batch is None:
            return False
        try:
            # shielded: a batch taken from the buffer is written even when the loop
            # is cancelled at shutdown (the final flush writes what is left)
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(w.write_batch, batch)
        except Exception as exc:  # an OSError, or a bug: never stop the broker for it
            w.dropped += len(batch)
            log.error(
                "cannot write the delivery log in %s: %s; %d record(s) lost (free disk "
                "space or fix the directory; the broker goes on)",
                w.directory,
                exc,
                len(batch),
            )
            w.abandon_file()
        return True

    async def _dlog_final_flush(self) -> None:
        w = self.dlog
        if w is None:
            return
        async with self._dlog_lock:
            while await self._dlog_write(w):
                pass
            try:
                await trio.to_thread.run_sync(w.close)
            except OSError as exc:
                log.error("cannot close the delivery log file: %s", exc)

    # ----------------------------------------------------------- core timers
    async def _timer_loop(self) -> None:
        timers = self.timers
        while True:
            timers.run_due(self.clock())
            self.hub.flush()
            nd = timers.next_deadline()
            at = self._to_trio(nd) if nd is not None else math.inf
            with trio.move_on_at(at):
                await self._timer_lot.park()

    async def _deferred_loop(self) -> None:
        broker = self.broker
        assert broker is not None
        while True:
            await self._deferred_lot.park()
            while broker.run_deferred():
                self.hub.flush()
                await trio.lowlevel.checkpoint()
            self.hub.flush()

    async def _expiry_loop(self) -> None:
        broker = self.broker
        assert broker is not None
        while True:
            await trio.sleep(self.settings.expiry_scan_period)
            n = broker.expire_scan()
            if n:
                log.debug("expiry reaper removed %d message(s)", n)
            self.hub.flush()

    # ------------------------------------------------------------ inspection
    def registry_sizes(self) -> dict[str, int]:
        """Sizes of every per-connection / per-link structure (all 0 when idle)."""
        b = self.broker
        assert b is not None
        out: dict[str, int] = {
            "connections": len(self.hub.drivers),
            "dirty_connections": self.hub.pending,
            "links": sum(c.open_links for c in self.hub.drivers),
            "sessions": sum(c.open_sessions for c in self.hub.drivers),
            "sync_waiters": len(self.sync.waiters),
            "temporary_queues": sum(1 for q in b.queues.values() if q.temporary),
            "consumers": sum(q.consumer_count for q in b.queues.values()),
            "in_flight": sum(q.inflight for q in b.queues.values()),
            "blocked_producers": sum(len(a.blocked_producers) for a in b.addresses.values()),
            "producers": sum(a.producers for a in b.addresses.values()),
            "pending_dispatch": b.statistics()["pending_dispatch"],
        }
        return out

    def statistics(self) -> dict[str, Any]:
        assert self.broker is not None
        stats: dict[str, Any] = {"broker": self.broker.statistics()}
        if self.journal is not None:
            stats["store"] = self.journal.statistics()
        if self.dlog is not None:
            stats["delivery_log"] = self.dlog.statistics()
        stats["queues"] = {q.name: q.statistics() for q in self.broker.queues.values()}
        return stats
