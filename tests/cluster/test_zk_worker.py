"""`ZkWorker.run` leaves no kazoo client behind, even when its worker thread is blocked
in a kazoo call that only a reconnection would answer (a request queued while
disconnected). A client left behind retries a gone ZooKeeper for the rest of the
process: in the test run it did, and its retry jitter broke unrelated tests."""

from __future__ import annotations

import threading

import pytest
import trio

from amqbroker.cluster.zk import LEAVE_GRACE, ZkWorker
from tests.cluster.zk_harness import free_port

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
