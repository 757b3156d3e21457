"""Composition root: builds the broker from settings and runs it under one nursery.

It only wires: the parts live where they belong, and this module builds them from
the settings, starts their tasks and stops them in order.

Tasks (all children of the root nursery): one accept loop per listener, handing each
socket to the admission (`net.server.ConnectionServer`: connection limits, TLS and
WebSocket openings, one driver per connection, in a separate nursery so shutdown can
give connections a deadline), the store writer and the delivery-log writer
(`store.writer`: group commit, write + fsync in a worker thread, then settle the
producers waiting for that cycle), the core timer loop, the deferred-dispatch loop,
the depager, the expiry reaper and the slow-consumer check.

Slow consumers: every `slow_consumer_check_period` seconds `_slow_consumer_loop` asks
the core's `SlowConsumerDetector` which consumers started a slow episode; each is
logged, and with `slow_consumer_policy = "KILL"` its link is detached through its
connection (`AmqpConnection.detach_link`).

Paging: `_depage_loop` wakes when memory is freed while a queue has paged messages
(or a store cycle completed); for each paging queue with room below the low-water
mark it reads the oldest records in a worker thread (`PageStore.read`) and hands them
to `Broker.paging.depage`. A durable queue is read back only while the journal holds less
than 2 x `store_max_batch_bytes` unwritten (its records are journaled again on the
way back; without this bound a slow disk would let the journal buffer grow). On
start, the page store is opened after the journal's queues are restored, so each
durable queue's page backlog is counted (not loaded) from its `paged_through` mark.

Graceful shutdown (SIGINT/SIGTERM or `request_shutdown`): stop accepting; flush the
store so producers waiting for a sync get their `accepted`; close every connection
(their consumers' unsettled messages go back to the queues in order); wait for peers
to answer the close until `shutdown_timeout`; write the final store batch; release
the data directory. From the start of the shutdown each store or delivery-log write
may take at most `shutdown_timeout` (the one running included), so a hung disk
cannot hang the shutdown: a write past it is abandoned and logged (`store.writer`).

Primary/backup (issue 23, `amqbroker.ha`): with ``ha_role = "primary"`` the store
writer gets the `ha.primary.Primary` replicator and the `$management` node serves the
`$ha.replication` source to the cluster user. With ``ha_role = "backup"`` `run` opens
no listener and builds no broker: it runs a `ha.mirror.Mirror` of the primary's store
into the data dir until `promote()` (or SIGUSR1) is called, then stops the mirror and
runs the normal broker on the mirrored data dir in the same process, as a primary
(a backup may then attach to it). A shutdown request before that just stops the
mirror.

Time: the core gets an epoch-aligned clock built on `trio.current_time()`, so tests
running under trio's autojump clock move the core's time too.
"""

from __future__ import annotations

import logging
import math
import signal
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from amqbroker import __version__
from amqbroker.cluster.election import ElectionUnavailable
from amqbroker.cluster.node import ClusterNode
from amqbroker.core.address_settings import AddressSettingsRepository
from amqbroker.core.auth import Authenticator
from amqbroker.core.authz import Authorizer
from amqbroker.core.broker import Broker
from amqbroker.core.queue_records import restore_queue
from amqbroker.core.slow_consumers import KILL, SlowConsumerDetector
from amqbroker.core.timers import Timers
from amqbroker.ha.backup_mode import build_mirror, run_mirror, say_promoted, standby_telemetry
from amqbroker.ha.mirror import Mirror
from amqbroker.ha.primary import Primary, answer_alone, serve_replication
from amqbroker.ha.status import LeaseStatus, process_status, report
from amqbroker.net.driver import Hub
from amqbroker.net.listener import ListenError, accept_loop, bind, bound_address
from amqbroker.net.server import ConnectionServer
from amqbroker.net.tls import TlsConfigError, server_context
from amqbroker.pipeline.delivery_log_format import seq_floor
from amqbroker.protocol.codec import ScannerCodec
from amqbroker.protocol.connection import AmqpConnection, ConnectionLimits
from amqbroker.protocol.fastpath import check_binding
from amqbroker.protocol.links import ConsumerLink, SyncTracker
from amqbroker.protocol.management import ManagementNode
from amqbroker.protocol.scanner import log_message_id
from amqbroker.settings import Settings, parse_listener
from amqbroker.store.delivery_log import DeliveryLogWriter, pyarrow_available
from amqbroker.store.journal import Journal
from amqbroker.store.paging import PageStore
from amqbroker.store.writer import DeliveryLogLoop, StoreWriter
from amqbroker.telemetry import Telemetry, TelemetryError

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
        #: bound TLS listeners (amqps), in tls_listeners order
        self.tls_listening: list[tuple[str, int]] = []
        #: bound WebSocket listeners (ws://, wss://), in ws_listeners / wss_listeners order
        self.ws_listening: list[tuple[str, int]] = []
        self.wss_listening: list[tuple[str, int]] = []
        #: connection admission (limits, per-address counts); built by _build
        self.server: ConnectionServer | None = None
        self.journal: Journal | None = None
        #: this broker's name (node_id, or <hostname>-<port> once listening)
        self.node_id = settings.node_id
        #: the delivery log writer (None when delivery_log is off)
        self.dlog: DeliveryLogWriter | None = None
        self.dlog_loop: DeliveryLogLoop | None = None
        #: the journal + page store group commit
        self.store: StoreWriter | None = None
        self.broker: Broker | None = None
        self.recovered_messages = 0
        self.recovered_queues = 0
        self._shutdown = trio.Event()
        self._timer_lot = trio.lowlevel.ParkingLot()
        self._deferred_lot = trio.lowlevel.ParkingLot()
        self._depage_lot = trio.lowlevel.ParkingLot()
        self.pager: PageStore | None = None
        self.slow_consumers: SlowConsumerDetector | None = None
        self.slow_consumers_detached = 0
        self._epoch0 = 0.0
        self._trio0 = 0.0
        self._clock_offset = 0.0
        self._trio_clock: trio.abc.Clock = _NoClock()
        self.exit_code = 0
        self.cluster: ClusterNode | None = None
        #: metrics and traces (amqbroker.telemetry); None while all of it is off.
        #: `span_exporter`, when set before run() (tests, embedders), gets every span.
        self.telemetry: Telemetry | None = None
        self.span_exporter: Any = None
        #: HA role: "", "primary" or "backup" (a promoted backup becomes "primary")
        self.ha_role = settings.ha_role
        #: the backup's mirror while it runs (ha_role = "backup")
        self.mirror: Mirror | None = None
        #: the primary's replication (ha_role = "primary")
        self.primary: Primary | None = None
        self._promote = trio.Event()
        self._started = False
        #: the epoch stamped on every replication frame (set by the pair's lease)
        self.ha_epoch: Callable[[], int] = lambda: 0
        #: asked before a store cycle no backup acknowledged completes (the pair's
        #: lease: False fences this primary); by default always allowed
        self.ha_alone: Callable[[], Awaitable[bool]] = answer_alone
        #: the pair member's view of the lease, for `ha_report` (set by the pair)
        self.ha_lease: Callable[[], LeaseStatus] | None = None
        #: where clients may fail over to (the open's failover-server-list)
        self.failover_servers: Callable[[], list[tuple[str, int]]] | None = None
        #: told each change of a backup's claim (epoch of its complete copy, or None)
        self.mirror_claim: Callable[[int | None], None] | None = None

    # ---------------------------------------------------------------- clock
    def clock(self) -> float:
        # the run's clock object directly: trio.current_time() costs three frames,
        # and the core reads the clock when it binds a group
        return self._clock_offset + self._trio_clock.current_time()

    def _to_trio(self, t: float) -> float:
        return t - self._epoch0 + self._trio0

    def cluster_waiting(self) -> list[dict[str, Any]]:
        """Lost cluster nodes whose groups wait for them (telemetry reads it)."""
        return self.cluster.waiting() if self.cluster is not None else []

    # ---------------------------------------------------------------- build
    def _build(self) -> None:
        s = self.settings
        check_binding()
        tls_context = None
        if s.tls_listeners or s.wss_listeners:
            try:
                tls_context = server_context(
                    cert_file=s.tls_cert_file,
                    key_file=s.tls_key_file,
                    ca_file=s.tls_ca_file,
                    client_auth=s.tls_client_auth,
                    min_version=s.tls_min_version,
                )
            except TlsConfigError as exc:
                raise StartupError(f"TLS: {exc}") from exc
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
            count_before_delivery=s.store_delivery_count_before_delivery,
        )
        recovered = journal.open()
        self.journal = journal
        pager = PageStore(data_dir / "paging", segment_size=s.page_size_bytes, sync=s.store_sync)
        self.pager = pager
        self.store = StoreWriter(
            journal,
            pager,
            data_dir=data_dir,
            sync=s.store_sync,
            flush=self.hub.flush,
            wake_depage=self._depage_lot.unpark_all,
            on_failure=self._store_failed,
            batch_synced=self.telemetry.store_batch if self.telemetry is not None else None,
        )
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
                child_failures=s.delivery_log_child_failures,
                child_exit_timeout=s.delivery_log_child_exit_timeout,
                # wall-clock time (a C call, no Python frame): the audit compares
                # timestamps across nodes
                clock=time.time,
                message_id=log_message_id,
            )
            self.dlog_loop = DeliveryLogLoop(
                self.dlog, flush_interval=s.delivery_log_flush_interval, flush=self.hub.flush
            )
        broker = Broker(
            address_settings=AddressSettingsRepository(s.address_settings),
            persistence=journal,
            clock=self.clock,
            timers=self.timers,
            codec=ScannerCodec(),
            dispatch_batch=s.dispatch_batch,
            age_resolution=s.message_age_resolution,
            age_marks=s.message_age_marks,
            temporary_queue_prefix=s.temporary_queue_prefix,
            wake=self._deferred_lot.unpark_all,
            global_max_size=s.global_max_size,
            pager=pager,
            page_low_water=s.page_low_water,
            page_read_ahead=s.page_read_ahead_bytes,
            depage_wake=self._depage_lot.unpark_all,
            delivery_log=self.dlog,
        )
        self.broker = broker
        for rq in recovered.queues:
            restore_queue(broker, rq.qid, rq.name, rq.attributes, rq.entries)
            self.recovered_queues += 1
            self.recovered_messages += len(rq.entries)
        restored = {q.qid: q for q in broker.queues.values() if q.durable}
        for qid, back in pager.open({i: q.page_mark for i, q in restored.items()}).items():
            q = restored[qid]
            if q.pager is None:
                log.warning(
                    "queue %r has %d paged message(s) but its address policy is no longer "
                    "PAGE; they are read back as memory frees up, and the queue pages "
                    "when full until then",
                    q.name,
                    back.count,
                )
                q.pager = pager
            q.restore_paged(back.count, back.nbytes, back.max_seq, q.page_mark)
            self.recovered_messages += back.count
        for ac in s.addresses:
            broker.create_address(ac.name, ac.routing, durable=ac.durable)
        self.auth = Authenticator(
            s.users,
            require_auth=s.require_auth,
            allow_anonymous=s.allow_anonymous,
            tls_users=s.tls_identity_users,
        )
        self.authz = Authorizer(
            s.security, s.roles, s.security_enabled, cache_size=s.security_cache_size
        )
        if s.security_enabled and not s.security:
            log.warning(
                "security_enabled is true but [security] has no rules: every attach is "
                "refused with amqp:unauthorized-access; add rules or set "
                "security_enabled = false"
            )
        self.sync = SyncTracker(self.store.ticket)
        self.store.settled = self.sync.synced
        self.management = ManagementNode(
            broker,
            connections=lambda: list(self.hub.drivers),
            store_statistics=journal.statistics,
            ha_status=self.ha_report if self.ha_role else None,
        )
        if s.cluster_node_id:
            try:
                self.cluster = ClusterNode(s, broker, self.hub, self.management, data_dir)
            except (ElectionUnavailable, TlsConfigError) as exc:
                self._close_store()
                raise StartupError(str(exc)) from exc
        if self.ha_role == "primary":
            self.primary = serve_replication(
                s,
                broker,
                self.store,
                data_dir,
                flush=self.hub.flush,
                sources=self.management.sources,
                epoch=lambda: self.ha_epoch(),  # noqa: PLW0108 (late-bound: set by the lease)
                alone=lambda: self.ha_alone(),  # noqa: PLW0108 (late-bound)
            )
        self.hub.after_flush.append(self.store.wake)
        limits = ConnectionLimits(
            container_id="amqbroker",
            max_frame_size=s.max_frame_size,
            channel_max=s.channel_max,
            max_sessions=s.max_sessions_per_connection,
            max_links=s.max_links_per_connection,
            idle_timeout=s.idle_timeout,
            max_message_size=s.max_message_size,
            link_credit=s.link_credit,
            max_transaction_messages=s.max_transaction_messages,
            relay_authz_cache=s.security_relay_cache_size,
            output_high_water=s.output_high_water,
            output_low_water=s.output_low_water,
            route_tracer=self.telemetry.route_tracer if self.telemetry else None,
            dispatch_tracer=self.telemetry.dispatch_tracer if self.telemetry else None,
            failover_servers=self.failover_servers,
        )
        self.server = ConnectionServer(
            self.hub,
            s,
            limits=limits,
            new_connection=self._new_connection,
            tls_context=tls_context,
        )

    def _new_connection(
        self, limits: ConnectionLimits, conn_id: str, peer: str, tls_identity: str | None
    ) -> AmqpConnection:
        assert self.broker is not None
        return AmqpConnection(
            self.broker,
            limits=limits,
            auth=self.auth,
            conn_id=conn_id,
            peer=peer,
            sync=self.sync,
            management=self.management,
            authz=self.authz,
            on_dirty=self.hub.on_dirty,
            tls_identity=tls_identity,
        )

    # ------------------------------------------------------------------ run
    async def run(
        self,
        *,
        task_status: trio.TaskStatus[BrokerApp] = trio.TASK_STATUS_IGNORED,
        handle_signals: bool = False,
        ready: Callable[[BrokerApp], None] | None = None,
    ) -> None:
        if self.ha_role == "backup":
            if not await self._run_mirror(task_status, handle_signals):
                return
            self.ha_role = "primary"
        await self._run_broker(task_status=task_status, handle_signals=handle_signals, ready=ready)

    # ------------------------------------------------------------- HA backup
    def ha_status(self) -> dict[str, Any]:
        """The HA role and its replication state (the backup's mirror counters, or
        the primary's stream to its backup); {"role": ""} without HA."""
        return process_status(self.ha_role, self.mirror, self.primary)

    def ha_report(self) -> dict[str, Any]:
        """The operator's view: role, lease, lag (`amqbroker.ha.status.report`)."""
        refusing = self.broker is not None and self.broker.durable_refused is not None
        lease = self.ha_lease() if self.ha_lease is not None else None
        return report(self.ha_status(), lease, self.settings.ha_unreplicated, refusing)

    def promote(self) -> None:
        """A backup stops mirroring and serves clients on its copy (the lease decides
        when; see issue 23). No effect unless the mirror runs."""
        if self.mirror is not None and not self._promote.is_set():
            say_promoted(self.mirror)
            self._promote.set()

    async def _run_mirror(self, task_status: trio.TaskStatus[BrokerApp], signals: bool) -> bool:
        """Mirror the primary (telemetry: HA metrics) until promoted (True) or stopped."""
        try:
            self.mirror = build_mirror(self.settings, self.hub)
            telemetry = standby_telemetry(self.settings, self)
        except OSError as exc:
            raise StartupError(f"cannot create the data directory: {exc}") from exc
        except (TlsConfigError, TelemetryError) as exc:
            raise StartupError(str(exc)) from exc
        self.data_dir = self.mirror.data_dir
        self.mirror.on_claim = self.mirror_claim

        def started() -> None:
            self._started = True
            task_status.started(self)

        try:
            return await run_mirror(
                self.mirror,
                promoted=self._promote,
                shutdown=self._shutdown,
                signals=signals,
                promote=self.promote,
                started=started,
                telemetry=telemetry,
            )
        finally:
            self.mirror = None

    # ---------------------------------------------------------- the broker
    async def _run_broker(
        self,
        *,
        task_status: trio.TaskStatus[BrokerApp],
        handle_signals: bool,
        ready: Callable[[BrokerApp], None] | None,
    ) -> None:
        self._epoch0 = time.time()
        self._trio0 = trio.current_time()
        self._trio_clock = trio.lowlevel.current_clock()
        self._clock_offset = self._epoch0 - self._trio0
        if Telemetry.wanted(self.settings):
            try:
                self.telemetry = Telemetry(self.settings, self, span_exporter=self.span_exporter)
            except TelemetryError as exc:
                raise StartupError(str(exc)) from exc
        self._build()
        s = self.settings
        sockets: list[socket.socket] = []
        tls_sockets: list[socket.socket] = []
        ws_sockets: list[socket.socket] = []
        wss_sockets: list[socket.socket] = []
        try:
            for host, port in [(s.host, s.port)] + [parse_listener(x) for x in s.extra_listeners]:
                sockets.append(bind(host, port))
            for host, port in [parse_listener(x) for x in s.tls_listeners]:
                tls_sockets.append(bind(host, port))
            for host, port in [parse_listener(x) for x in s.ws_listeners]:
                ws_sockets.append(bind(host, port))
            for host, port in [parse_listener(x) for x in s.wss_listeners]:
                wss_sockets.append(bind(host, port))
            if self.telemetry is not None:
                self.telemetry.bind()
        except (ListenError, TelemetryError) as exc:
            for sk in sockets + tls_sockets + ws_sockets + wss_sockets:
                sk.close()
            self._close_store()
            raise StartupError(str(exc)) from exc
        self.listening = [bound_address(sk) for sk in sockets]
        self.tls_listening = [bound_address(sk) for sk in tls_sockets]
        self.ws_listening = [bound_address(sk) for sk in ws_sockets]
        self.wss_listening = [bound_address(sk) for sk in wss_sockets]
        self.node_id = (
            s.node_id or s.cluster_node_id or f"{socket.gethostname()}-{self.listening[0][1]}"
        )
        if self.dlog is not None:
            try:
                # a pair member live at epoch E numbers its records from E << 40 on:
                # the node id's log goes on after the other member's
                self.dlog.open(self.node_id, seq_floor(self.ha_epoch()))
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
                assert self.store is not None and self.server is not None
                server = self.server
                root.start_soon(self.store.run)
                root.start_soon(self._timer_loop)
                root.start_soon(self._deferred_loop)
                root.start_soon(self._depage_loop)
                if self.dlog_loop is not None:
                    root.start_soon(self.dlog_loop.run)
                if s.expiry_scan_period > 0:
                    root.start_soon(self._expiry_loop)
                if self.primary is not None:
                    await root.start(self.primary.run)
                if self.cluster is not None:
                    # cluster connections start before clients are accepted
                    await root.start(self.cluster.run)
                if s.slow_consumer_threshold > 0:
                    self.slow_consumers = SlowConsumerDetector(s.slow_consumer_threshold)
                    root.start_soon(self._slow_consumer_loop, self.slow_consumers)
                if self.telemetry is not None:
                    await root.start(self.telemetry.run)
                    log.info("telemetry: %s", self.telemetry.describe())
                if handle_signals:
                    # installed before we report ready: a signal right after the
                    # "listening" line must already stop the broker gracefully
                    await root.start(self._signal_loop)
                async with trio.open_nursery() as conns:
                    async with trio.open_nursery() as accepting:
                        for sk in sockets:
                            accepting.start_soon(accept_loop, sk, server.serve, conns)
                        for sk in tls_sockets:
                            accepting.start_soon(accept_loop, sk, server.serve_tls, conns)
                        for sk in ws_sockets:
                            accepting.start_soon(accept_loop, sk, server.serve_ws, conns)
                        for sk in wss_sockets:
                            accepting.start_soon(accept_loop, sk, server.serve_wss, conns)
                        log.info(
                            "amqbroker %s listening on %s; data in %s (%d queue(s), %d "
                            "message(s) recovered)",
                            __version__,
                            ", ".join(
                                [f"amqp://{h}:{p}" for h, p in self.listening]
                                + [f"amqps://{h}:{p}" for h, p in self.tls_listening]
                                + [f"ws://{h}:{p}" for h, p in self.ws_listening]
                                + [f"wss://{h}:{p}" for h, p in self.wss_listening]
                            ),
                            self.data_dir,
                            self.recovered_queues,
                            self.recovered_messages,
                        )
                        if ready is not None:
                            ready(self)
                        if not self._started:
                            self._started = True
                            task_status.started(self)
                        await self._shutdown.wait()
                        accepting.cancel_scope.cancel()
                    await self._graceful_close(conns)
                root.cancel_scope.cancel()
        finally:
            # shielded; each write has a deadline (store.writer), so a hung disk
            # cannot hang the shutdown
            self._bound_writes()
            with trio.CancelScope(shield=True):
                await self._final_flush()
                if self.dlog_loop is not None:
                    await self.dlog_loop.final_flush()
            self._close_store()
            if self.telemetry is not None:
                self.telemetry.shutdown()
        log.info("amqbroker stopped")

    def request_shutdown(self) -> None:
        self._shutdown.set()

    async def _signal_loop(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        # a pair member also takes SIGUSR1 (promote): once live it is ignored, where
        # its default action would kill the live broker
        sigs = (signal.SIGINT, signal.SIGTERM) + ((signal.SIGUSR1,) if self.ha_role else ())
        with trio.open_signal_receiver(*sigs) as signals:
            task_status.started()
            async for signum in signals:
                if signum == signal.SIGUSR1:
                    log.info("received SIGUSR1 (promote): this broker is already live")
                    continue
                if self._shutdown.is_set():
                    log.warning("second signal: stopping now")
                    raise KeyboardInterrupt
                log.info(
                    "received %s: stopping (up to %.0f s to settle in-flight messages)",
                    signal.Signals(signum).name,
                    self.settings.shutdown_timeout,
                )
                self.request_shutdown()

    async def _graceful_close(self, conns: trio.Nursery) -> None:
        """Settle what producers wait for, close connections, wait for the peers. A
        backup's replication link goes last, after the store cycle of what the other
        closes released, so the backup's copy stays complete (a hand-over's need)."""
        deadline = trio.current_time() + self.settings.shutdown_timeout
        self._bound_writes()
        await self._final_flush()
        keep = self.primary.connections() if self.primary is not None else frozenset()
        await self.hub.close_all(deadline, keep)
        if keep:
            await self._final_flush()
            await self.hub.close_all(deadline)
        conns.cancel_scope.cancel()

    # ---------------------------------------------------------------- store
    def _store_failed(self) -> None:
        """The store writer could not write (it logged why): stop the broker."""
        self.exit_code = 3
        self.request_shutdown()

    def _bound_writes(self) -> None:
        """Shutdown: a store or delivery-log write that takes longer than
        shutdown_timeout is abandoned (and logged) instead of hanging the broker."""
        timeout = self.settings.shutdown_timeout
        if self.store is not None:
            self.store.bound_writes(timeout)
        if self.dlog_loop is not None:
            self.dlog_loop.bound_writes(timeout)

    async def _final_flush(self) -> None:
        """Write what the store holds (shutdown)."""
        if self.store is not None and self.journal is not None:
            await self.store.final_flush()
            if self.store.failed or self.store.abandoned:
                self.exit_code = 3

    def _close_store(self) -> None:
        if self.cluster is not None:
            self.cluster.close()
        if self.journal is not None:
            if self.store is not None and self.store.abandoned:
                # a worker thread may still be writing it: leave the files (and the
                # data directory's lock) to the process's exit
                log.critical("the journal is left open: a write to it never finished")
                self.journal = None
                return
            try:
                self.journal.close()
            finally:
                self.journal = None

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

    async def _depage_loop(self) -> None:
        """Read paged messages back while their address has room (see the module
        docstring); parks when there is nothing to read or no room."""
        broker = self.broker
        pager = self.pager
        j = self.journal
        store = self.store
        assert broker is not None and pager is not None and j is not None and store is not None
        # reading back into a durable queue journals the messages again: do not run
        # ahead of the journal writer (its buffer would grow without bound)
        backlog_max = 2 * self.settings.store_max_batch_bytes
        while True:
            progressed = False
            for q in broker.paging.candidates():
                if q.durable and j.statistics()["buffered_bytes"] > backlog_max:
                    continue  # woken again when a store cycle completes
                room = broker.paging.room(q)
                plan = pager.plan(q.qid, room) if room > 0 else None
                if plan is None:
                    continue  # no room, or its records are not written yet
                await trio.to_thread.run_sync(pager.read, plan)
                # a durable queue's read is recorded in the journal (paged_through) by
                # the cycle after the current one at the latest: the segment waits for it
                entries = pager.consumed(plan, store.cycle + 1 if q.durable else 0)
                if entries is None:
                    continue  # purged or deleted meanwhile
                if plan.lost:
                    q.page_lost(plan.lost, plan.lost_bytes)
                broker.paging.depage(q, entries)
                self.hub.flush()
                progressed = True
            if not progressed:
                await self._depage_lot.park()

    async def _expiry_loop(self) -> None:
        broker = self.broker
        assert broker is not None
        while True:
            await trio.sleep(self.settings.expiry_scan_period)
            n = broker.dead_letters.expire_scan()
            if n:
                log.debug("expiry reaper removed %d message(s)", n)
            self.hub.flush()

    async def _slow_consumer_loop(self, detector: SlowConsumerDetector) -> None:
        broker = self.broker
        assert broker is not None
        s = self.settings
        kill = s.slow_consumer_policy == KILL
        while True:
            await trio.sleep(s.slow_consumer_check_period)
            for v in detector.check(list(broker.queues.values()), self.clock()):
                c = v.consumer
                if not isinstance(c, ConsumerLink):
                    continue  # every attached consumer is a link; nothing else to tell
                where = c.conn.log_prefix(c.name, queue=v.queue)
                if not kill:
                    log.warning(
                        "%s: slow consumer: %s; it keeps its messages "
                        "(slow_consumer_policy = NOTIFY)",
                        where,
                        v.describe(),
                    )
                    continue
                log.warning(
                    "%s: slow consumer: %s; detaching it (slow_consumer_policy = KILL)",
                    where,
                    v.describe(),
                )
                self.slow_consumers_detached += 1
                c.conn.detach_link(
                    c,
                    "amqp:resource-limit-exceeded",
                    f"{v.describe()}, so the broker detached it (slow_consumer_policy = "
                    "KILL); its unsettled messages went back to the queue. Settle "
                    "messages faster, or share the load among more consumers",
                )
            self.hub.flush()

    # ------------------------------------------------------------ inspection
    def registry_sizes(self) -> dict[str, int]:
        """Sizes of every per-connection / per-link structure (all 0 when idle)."""
        b = self.broker
        assert b is not None
        out: dict[str, int] = {
            "connections": len(self.hub.drivers),
            "connections_per_address": len(self.server.per_address) if self.server else 0,
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
        if self.pager is not None:
            stats["paging"] = self.pager.statistics()
        if self.dlog is not None:
            stats["delivery_log"] = self.dlog.statistics()
        if self.primary is not None:
            stats["ha"] = {"role": self.ha_role, **self.primary.status()}
        stats["queues"] = {q.name: q.statistics() for q in self.broker.queues.values()}
        stats["limits"] = {
            "connections_refused_per_address": (
                self.server.refused_per_address if self.server is not None else 0
            ),
            "slow_consumers_detected": (
                self.slow_consumers.detected if self.slow_consumers is not None else 0
            ),
            "slow_consumers_detached": self.slow_consumers_detached,
        }
        return stats
