"""A backup process before it serves: build its `Mirror` from the settings and run it
until it is promoted (or stopped).

`BrokerApp.run` with ``ha_role = "backup"`` calls `run_mirror`: no listener is opened
and no broker is built; the mirror copies the primary's store into the data dir. A
promotion (`BrokerApp.promote`: the pair's lease decided, or SIGUSR1 for a manual
failover without ZooKeeper) ends it with True, and the app then runs the broker on the
mirrored data dir in the same process; a shutdown request ends it with False.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from pathlib import Path

import trio

from amqbroker import __version__
from amqbroker.ha.mirror import Mirror, read_state
from amqbroker.net.driver import Hub
from amqbroker.net.tls import client_context
from amqbroker.settings import Settings, parse_listener
from amqbroker.telemetry import Source, Telemetry

log = logging.getLogger("amqbroker")


def build_mirror(s: Settings, hub: Hub) -> Mirror:
    """The mirror of ``s.ha_primary`` into ``s.data_dir`` (created); OSError when the
    directory cannot be created."""
    data_dir = Path(s.data_dir).expanduser().resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    host, port = parse_listener(s.ha_primary)
    mirror = Mirror(
        data_dir,
        host=host,
        port=port,
        user=s.cluster_user,
        password=s.cluster_password,
        window=s.ha_window,
        sync=s.store_sync,
        idle_timeout=s.idle_timeout,
        backoff_initial=s.cluster_reconnect_initial,
        backoff_max=s.cluster_reconnect_max,
        hub=hub,
        node_id=s.node_id or s.cluster_node_id or "backup",
        ssl_context=client_context(s.cluster_tls_ca_file) if s.cluster_tls else None,
    )
    state = read_state(data_dir)
    log.info(
        "amqbroker %s HA backup of %s; data in %s (%s)",
        __version__,
        s.ha_primary,
        data_dir,
        f"copy of stream {state.get('stream', '?')[:8]}, epoch {state.get('epoch')}"
        if state
        else "no copy in sync yet",
    )
    return mirror


def say_promoted(mirror: Mirror) -> None:
    log.warning(
        "HA backup: promoted; stopping the mirror (%s) and starting the broker on %s",
        "in sync" if mirror.in_sync else "NOT in sync",
        mirror.data_dir,
    )


def standby_telemetry(s: Settings, source: Source) -> Telemetry | None:
    """The telemetry of a standby (its Prometheus endpoint bound), when it is on: it
    exports the HA metrics of the mirror (no broker runs yet); TelemetryError when it
    cannot start."""
    if not Telemetry.wanted(s):
        return None
    telemetry = Telemetry(s, source)
    telemetry.bind()
    return telemetry


async def run_mirror(
    mirror: Mirror,
    *,
    promoted: trio.Event,
    shutdown: trio.Event,
    signals: bool,
    promote: Callable[[], None],
    started: Callable[[], None],
    telemetry: Telemetry | None = None,
) -> bool:
    """Run `mirror` until `promoted` is set (True) or `shutdown` is (False); with
    `signals`, SIGUSR1 calls `promote` and SIGINT/SIGTERM set the shutdown. With
    `telemetry` (bound: `standby_telemetry`), its endpoint runs meanwhile and is
    closed before this returns (the promoted broker binds it again)."""
    try:
        return await _run(mirror, promoted, shutdown, signals, promote, started, telemetry)
    finally:
        if telemetry is not None:
            telemetry.shutdown()


async def _run(
    mirror: Mirror,
    promoted: trio.Event,
    shutdown: trio.Event,
    signals: bool,
    promote: Callable[[], None],
    started: Callable[[], None],
    telemetry: Telemetry | None,
) -> bool:
    async with trio.open_nursery() as n:
        await n.start(mirror.run)
        if telemetry is not None:
            await n.start(telemetry.run)
            log.info("telemetry: %s", telemetry.describe())
        if signals:
            await n.start(_signal_loop, promote, shutdown.set)
        started()

        async def stop_on_shutdown() -> None:
            await shutdown.wait()
            n.cancel_scope.cancel()

        n.start_soon(stop_on_shutdown)
        await promoted.wait()
        n.cancel_scope.cancel()
    if not promoted.is_set():
        log.info("amqbroker HA backup stopped")
    return promoted.is_set()


async def _signal_loop(
    promote: Callable[[], None],
    stop: Callable[[], None],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGUSR1) as sigs:
        task_status.started()
        async for signum in sigs:
            if signum == signal.SIGUSR1:
                promote()
            else:
                stop()
