"""`ZkWorker.run` leaves no kazoo client behind, even when its worker thread is blocked
in a kazoo call that only a reconnection would answer (a request queued while
disconnected). A client left behind retries a gone ZooKeeper for the rest of the
process: in the test run it did, and its retry jitter broke unrelated tests.

A step ZooKeeper refuses is tried again on its own, not only on the next change: the
change that would have woken the worker may never come."""

from __future__ import annotations

import threading

import pytest
import trio

from amqbroker.cluster.zk import LEAVE_GRACE, ZkWorker
from tests.cluster.zk_harness import (  # noqa: F401
    ZooKeeperServer,
    free_port,
    zk_path,
    zookeeper,
)

pytest.importorskip("kazoo")

SESSION_TIMEOUT_MS = 10_000  # the old bound: a blocked worker was abandoned after 15 s
WAIT = 30.0
STATE_TRIES = 500  # x 10 ms: the client begins connecting at once


class Blocking(ZkWorker[str]):
    """Its one evaluation calls ZooKeeper while never connected: kazoo queues the
    request until a connection that never comes."""

    def __init__(self, hosts: str) -> None:
        super().__init__(
            hosts,
            view="lost",
            thread_name="zk-test-blocking",
            what="a test step",
            session_timeout_ms=SESSION_TIMEOUT_MS,
            reconnect_max_delay_ms=200,
        )
        self.calling = threading.Event()

    def _evaluate(self) -> None:
        from kazoo.exceptions import ConnectionClosedError

        for _ in range(STATE_TRIES):
            try:
                self.calling.set()
                self._client.exists("/")  # queued, then blocks: nobody listens at `hosts`
            except ConnectionClosedError:
                # the client has not begun connecting yet (still CLOSED): try again
                threading.Event().wait(0.01)
            else:
                return

    def _lost_view(self) -> str:
        return "lost"

    def _dispatch(self, view: str, old: str) -> None:
        pass


def kazoo_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.endswith("(zk_loop)")]


async def test_run_closes_the_client_under_a_worker_blocked_in_a_call() -> None:
    before = set(kazoo_threads())
    worker = Blocking(f"127.0.0.1:{free_port()}")  # nothing listens there
    with trio.fail_after(WAIT):
        async with trio.open_nursery() as nursery:
            await nursery.start(worker.run)
            worker._wake.put("evaluate")
            assert await trio.to_thread.run_sync(worker.calling.wait, WAIT)
            mine = [t for t in kazoo_threads() if t not in before]
            assert len(mine) == 1  # the client's connection thread, retrying
            start = trio.current_time()
            nursery.cancel_scope.cancel()
        took = trio.current_time() - start
    assert worker._thread is not None and not worker._thread.is_alive()
    await trio.to_thread.run_sync(mine[0].join, WAIT)
    assert not mine[0].is_alive(), "the kazoo client outlived run()"
    # ended about LEAVE_GRACE after the cancel, not after the session timeout + 5 s
    assert took < LEAVE_GRACE + SESSION_TIMEOUT_MS / 1000


class Refused(ZkWorker[str]):
    """Each evaluation creates a znode under `parent`, which does not exist at first:
    ZooKeeper refuses the step (NoNodeError), and no watch is set that a later change
    could fire."""

    def __init__(self, hosts: str, parent: str) -> None:
        super().__init__(
            hosts,
            view="lost",
            thread_name="zk-test-refused",
            what="a test step",
            session_timeout_ms=5_000,
            reconnect_max_delay_ms=200,
        )
        self.parent = parent
        self.refused = threading.Event()
        self.created = trio.Event()

    def _evaluate(self) -> None:
        from kazoo.exceptions import NoNodeError

        if self._session_or_lost() is None:
            return
        try:
            self._my_node = self._client.create(f"{self.parent}/m_", ephemeral=True, sequence=True)
        except NoNodeError:
            self.refused.set()
            raise
        self._publish("created")

    def _lost_view(self) -> str:
        return "lost"

    def _dispatch(self, view: str, old: str) -> None:
        if view == "created":
            self.created.set()


async def test_a_refused_step_is_tried_again_without_a_change(
    zookeeper: ZooKeeperServer,  # noqa: F811
    zk_path: str,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    from kazoo.client import KazooClient

    worker = Refused(zookeeper.hosts, f"{zk_path}/parent")
    with trio.fail_after(WAIT):
        async with trio.open_nursery() as nursery:
            await nursery.start(worker.run)
            worker._wake.put("evaluate")
            assert await trio.to_thread.run_sync(worker.refused.wait, WAIT)
            assert worker.view == "lost"

            def create_parent() -> None:  # another client: no watch of the worker fires
                c = KazooClient(hosts=zookeeper.hosts, timeout=5.0)
                c.start(timeout=10)
                try:
                    c.ensure_path(worker.parent)
                finally:
                    c.stop()
                    c.close()

            await trio.to_thread.run_sync(create_parent)
            await worker.created.wait()
            nursery.cancel_scope.cancel()
    refusals = [r for r in caplog.records if "ZooKeeper refused a test step" in r.getMessage()]
    assert refusals and refusals[0].levelname == "WARNING"
    assert "retrying in 0.05 s or on the next change" in refusals[0].getMessage()
    assert all(r.levelname == "DEBUG" for r in refusals[1:])
