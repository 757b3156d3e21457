"""Shared fixtures: a real broker on a real socket, and a trio-native AMQP client."""

from __future__ import annotations

import functools
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from amqbroker.app import BrokerApp
from amqbroker.settings import Settings
from tests.client import Client

BrokerFactory = Callable[..., Awaitable[BrokerApp]]

#: seconds a test's kazoo clients get to finish stopping after the test
KAZOO_STOP_WAIT = 15.0


@pytest.fixture(autouse=True)
def no_kazoo_client_left() -> Iterator[None]:
    """Fail the test that leaves a ZooKeeper client running: it would retry a stopped
    ZooKeeper for the rest of the run, and its retry jitter (the global `random`)
    breaks later Hypothesis tests far from the cause."""
    before = set(threading.enumerate())
    yield
    left = [t for t in threading.enumerate() if t.name.endswith("(zk_loop)") and t not in before]
    for t in left:
        t.join(KAZOO_STOP_WAIT / len(left))
    if alive := [t for t in left if t.is_alive()]:
        for t in alive:
            _stop_kazoo_client_of(t)
        pytest.fail(
            f"a kazoo client outlived the test (now stopped, so that later tests do not "
            f"pay for it): {[t.name for t in alive]}"
        )


def _stop_kazoo_client_of(t: threading.Thread) -> None:
    """Stop the client whose connection thread `t` is (kazoo's `zk_loop`, a bound
    method of the client's connection handler): a client left running retries and logs
    for the rest of the run, and the test that left it has already failed."""
    handler = getattr(getattr(t, "_target", None), "__self__", None)
    client = getattr(handler, "client", None)
    if client is None:
        return
    try:
        client.stop()
        client.close()
    except Exception:  # already stopping, or a kazoo version that differs
        pass
    t.join(KAZOO_STOP_WAIT)


@pytest.fixture
async def make_broker(tmp_path: Path) -> AsyncIterator[BrokerFactory]:
    """Start brokers on 127.0.0.1:<any port> with the given settings; each is shut down
    gracefully (and must finish) when the test ends."""
    apps: list[BrokerApp] = []
    async with trio.open_nursery() as n:

        async def start(**overrides: Any) -> BrokerApp:
            values: dict[str, Any] = {
                "port": 0,
                "data_dir": tmp_path / f"data{len(apps)}",
                "store_sync": False,
                "expiry_scan_period": 0,
            }
            values.update(overrides)
            app = BrokerApp(Settings(**values))
            started: BrokerApp = await n.start(functools.partial(app.run))
            apps.append(app)
            return started

        yield start
        for app in apps:
            app.request_shutdown()


StoppableFactory = Callable[..., Awaitable[tuple[BrokerApp, trio.Event]]]


@pytest.fixture
async def stoppable(tmp_path: Path) -> AsyncIterator[StoppableFactory]:
    """Start brokers the test stops itself (and may restart on the same data dir):
    `start(**overrides)` returns the app and an event set once its `run` has returned.
    The data dir is `tmp_path/data` unless overridden; brokers still running at the end
    are shut down."""
    apps: list[BrokerApp] = []
    async with trio.open_nursery() as n:

        async def start(**overrides: Any) -> tuple[BrokerApp, trio.Event]:
            values: dict[str, Any] = {
                "port": 0,
                "data_dir": tmp_path / "data",
                "store_sync": False,
                "expiry_scan_period": 0,
            }
            values.update(overrides)
            app = BrokerApp(Settings(**values))
            done = trio.Event()

            async def runner(task_status: trio.TaskStatus[BrokerApp]) -> None:
                try:
                    await app.run(task_status=task_status)
                finally:
                    done.set()

            await n.start(runner)
            apps.append(app)
            return app, done

        yield start
        for app in apps:
            app.request_shutdown()


@pytest.fixture
async def broker(make_broker: BrokerFactory) -> BrokerApp:
    return await make_broker()


@pytest.fixture
def port(broker: BrokerApp) -> int:
    return broker.listening[0][1]


ConnectFactory = Callable[..., Awaitable[Client]]
ClientFactory = Callable[..., Awaitable[Client]]


@pytest.fixture
async def client(nursery: trio.Nursery) -> AsyncIterator[ClientFactory]:
    """Connect test clients to any broker app started with `make_broker`
    (`connect` is tied to the default `broker`)."""
    clients: list[Client] = []

    async def _connect(app: BrokerApp, **kw: Any) -> Client:
        c = await Client.connect(app.listening[0][1], nursery=nursery, **kw)
        clients.append(c)
        return c

    yield _connect
    for c in clients:
        c.abort()


@pytest.fixture
async def connect(port: int, nursery: trio.Nursery) -> AsyncIterator[ConnectFactory]:
    clients: list[Client] = []

    async def _connect(p: int | None = None, **kw: Any) -> Client:
        c = await Client.connect(p if p is not None else port, nursery=nursery, **kw)
        clients.append(c)
        return c

    yield _connect
    for c in clients:
        c.abort()


async def wait_idle(app: BrokerApp, timeout: float = 5.0) -> dict[str, int]:
    """Wait (bounded) until every per-connection / per-link registry of the broker is
    empty, i.e. it has processed the clients' goodbyes; returns the sizes."""
    with trio.move_on_after(timeout):
        while any(app.registry_sizes().values()):
            # a driver ending is what usually lags; re-check at least every 10 ms
            with trio.move_on_after(0.01):
                await app.hub.drivers_changed.park()
    return app.registry_sizes()
