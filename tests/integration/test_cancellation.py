"""Cancellation in the middle of an operation, then the invariants (issue 21, item 6).

The operation interrupted is a transaction commit over real sockets (the trio test
client and a coordinator link, as Qpid JMS uses them), on an in-process broker with
`store_sync` on, so the store writer writes and fsyncs in a worker thread. A test
holds that write with `WriteGate` (a wrapper around the journal's `write_batch`,
which the writer calls in the worker thread): the commit has been applied in memory,
its records are in the batch being written, and the discharge waits for the sync.
Then the test shuts the broker down, cancels it, or drops the client's connection,
releases the write, and checks:

* nothing accepted is lost: a commit the client saw accepted is there, after a
  restart too; the messages sent outside the transaction are there;
* the transaction is whole: its acks and its sends are all applied or none;
* no double delivery: a message acked in the committed transaction never comes back,
  and every other message comes back exactly once;
* the store recovers cleanly: no store warning or error on restart, and it holds
  what the broker held in memory.
"""

from __future__ import annotations

import functools
import logging
import threading
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from proton import Delivery, Described, Message, ulong

from amqbroker.app import BrokerApp
from amqbroker.core.queue import Queue
from amqbroker.settings import Settings
from amqbroker.store.journal import Journal
from tests.client import (
    DISCHARGE,
    Client,
    Received,
    Sender,
    coordinator,
    declare,
    roundtrip,
    txn_send_many,
    txn_settle,
    wait_ended,
    wait_until,
)
from tests.conftest import StoppableFactory

ADDRESS = "cancel.q"
GATE_TIMEOUT = 30.0


class WriteGate:
    """Hold the journal's next `write_batch` call in its worker thread until
    `release()`; `entered` is set (in trio) once the worker is held there."""

    def __init__(self, journal: Journal, monkeypatch: pytest.MonkeyPatch) -> None:
        self.entered = trio.Event()
        self._go = threading.Event()
        self._armed = False
        self._token = trio.lowlevel.current_trio_token()
        write = journal.write_batch

        def gated(batch: Any) -> None:
            if self._armed:
                self._armed = False
                self._token.run_sync_soon(self.entered.set)
                # bounded: a test that never releases fails on its own deadline
                self._go.wait(GATE_TIMEOUT)
            write(batch)

        monkeypatch.setattr(journal, "write_batch", gated)

    def arm(self) -> None:
        self._armed = True

    def release(self) -> None:
        self._go.set()


def queue(app: BrokerApp) -> Queue:
    assert app.broker is not None
    return app.broker.queues[ADDRESS]


def journal(app: BrokerApp) -> Journal:
    j = app.journal
    assert j is not None
    return j


def store_problems(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        f"{r.levelname} {r.name}: {r.getMessage()}"
        for r in caplog.records
        if r.name.startswith("amqbroker.store") and r.levelno >= logging.WARNING
    ]


async def store_idle(app: BrokerApp) -> None:
    """Until everything the journal buffered is written and synced (so the next batch
    the writer takes holds only what the test does next)."""
    j = journal(app)
    await wait_until(lambda: not j.pending and j.synced_batch_no == j.batch_no)


async def drain(c: Client) -> list[tuple[str, int]]:
    """(body, delivery-count) of everything the queue holds, in delivery order."""
    r = await c.receiver(ADDRESS, credit=1000)
    await r.drain(timeout=30)
    got = [(str(g.body), int(g.message.delivery_count)) for g in r.queue]
    r.queue.clear()
    return got


class Scenario:
    """One connection: m1..m4 sent durable and accepted, all four received; a
    transaction acks m1, m2 and sends t1, t2 (durable); the commit is sent while the
    journal write is held."""

    def __init__(self, c: Client) -> None:
        self.c = c
        self.discharge: Delivery | None = None

    async def prepare(self) -> None:
        c = self.c
        s = await c.sender(ADDRESS)
        ds = await s.send_many([Message(body=b, durable=True) for b in ("m1", "m2", "m3", "m4")])
        assert [d.remote_state for d in ds] == [Delivery.ACCEPTED] * 4
        # credit for exactly these four: t1, t2 stay queued when the commit routes them
        r = await c.receiver(ADDRESS, credit=4)
        got: list[Received] = await r.receive_n(4)
        assert [g.body for g in got] == ["m1", "m2", "m3", "m4"]
        self.co: Sender = await coordinator(c)
        self.txn = await declare(self.co)
        txn_settle(r, got[0], self.txn)
        txn_settle(r, got[1], self.txn)
        ts = await txn_send_many(s, [Message(body=b, durable=True) for b in ("t1", "t2")], self.txn)
        assert all(d.remote_state for d in ts)
        await roundtrip(c)

    async def commit_nowait(self) -> None:
        self.discharge = self.co.send_nowait(
            Message(body=Described(ulong(DISCHARGE), [self.txn, False]))
        )
        await self.c._flush()


COMMITTED = ["m3", "m4", "t1", "t2"]
ROLLED_BACK = ["m1", "m2", "m3", "m4"]


def assert_whole(got: list[tuple[str, int]]) -> list[str]:
    """The queue holds the committed state or the rolled-back one, each message once."""
    bodies = [b for b, _ in got]
    assert len(bodies) == len(set(bodies)), f"a message delivered twice: {got}"
    assert bodies in (COMMITTED, ROLLED_BACK), f"a transaction applied in part: {got}"
    return bodies


async def restart_and_drain(
    stoppable: StoppableFactory, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> list[tuple[str, int]]:
    caplog.clear()
    app, done = await stoppable(store_sync=True)
    assert store_problems(caplog) == []
    c = await Client.connect(app.listening[0][1], nursery=nursery)
    try:
        return await drain(c)
    finally:
        c.abort()
        app.request_shutdown()
        with trio.fail_after(30):
            await done.wait()


# ----------------------------------------------------------- shutdown during a commit


async def commit_held(
    app: BrokerApp, nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> tuple[Client, Scenario, WriteGate]:
    """A client with the scenario prepared and its commit sent, held in the store
    writer's worker thread while the commit's batch is being written."""
    c = await Client.connect(app.listening[0][1], nursery=nursery)
    sc = Scenario(c)
    await sc.prepare()
    await store_idle(app)
    gate = WriteGate(journal(app), monkeypatch)
    gate.arm()
    await sc.commit_nowait()
    with trio.fail_after(10):
        await gate.entered.wait()
    return c, sc, gate


async def test_graceful_shutdown_during_a_commit_answers_it_and_keeps_it(
    stoppable: StoppableFactory,
    nursery: trio.Nursery,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """SIGTERM-style shutdown while the commit's batch is being written: shutdown
    waits for the write, the client gets the commit's `accepted` before the broker
    closes the connection, and after a restart the commit is there, whole."""
    caplog.set_level(logging.WARNING)
    app, done = await stoppable(store_sync=True)
    c, sc, gate = await commit_held(app, nursery, monkeypatch)
    q = queue(app)
    # applied in memory: m1, m2 acked; m3, m4 in flight; t1, t2 queued
    assert (q.count, q.inflight) == (4, 2)
    app.request_shutdown()
    await trio.testing.wait_all_tasks_blocked(cushion=0.05)
    assert sc.discharge is not None
    assert not sc.discharge.settled, "commit answered before its records were written"
    assert not done.is_set(), "broker stopped with a store write in progress"
    gate.release()
    with trio.fail_after(30):
        await done.wait()
    await wait_ended(c, timeout=10)
    assert sc.discharge.remote_state == Delivery.ACCEPTED
    c.abort()

    got = await restart_and_drain(stoppable, nursery, caplog)
    assert assert_whole(got) == COMMITTED
    assert store_problems(caplog) == []


async def test_cancelled_broker_during_a_commit_leaves_the_store_whole(
    nursery: trio.Nursery,
    tmp_path: Path,
    stoppable: StoppableFactory,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The broker's task is cancelled (not asked to stop) while the commit's batch is
    being written: the write is not abandoned halfway, the store closes cleanly and a
    restart recovers the commit whole; if the client saw `accepted`, it is there."""
    caplog.set_level(logging.WARNING)
    settings = Settings(port=0, data_dir=tmp_path / "data", store_sync=True, expiry_scan_period=0)
    app = BrokerApp(settings)
    c: Client | None = None
    async with trio.open_nursery() as inner:
        await inner.start(functools.partial(app.run))
        c, sc, gate = await commit_held(app, nursery, monkeypatch)
        inner.cancel_scope.cancel()
        gate.release()  # before the nursery waits for app.run to unwind
    assert app.journal is None  # closed in run's finally
    assert store_problems(caplog) == []
    await wait_ended(c, timeout=10)
    answered = sc.discharge is not None and sc.discharge.remote_state == Delivery.ACCEPTED
    c.abort()

    got = await restart_and_drain(stoppable, nursery, caplog)
    bodies = assert_whole(got)
    # the batch holding the commit was written before the cancellation took effect
    assert bodies == COMMITTED, (answered, got)
    assert store_problems(caplog) == []


# --------------------------------------- a connection dropped while a commit discharges


async def test_connection_dropped_while_the_commit_waits_for_the_store(
    stoppable: StoppableFactory,
    nursery: trio.Nursery,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The client goes away after the broker applied the commit but before the store
    synced it (the discharge is unanswered). The commit stands: its acked messages
    never come back, its sends are delivered once; the consumer's other unsettled
    messages return counted (connection lost). Memory and store agree after a
    restart."""
    caplog.set_level(logging.WARNING)
    app, done = await stoppable(store_sync=True)
    c, sc, gate = await commit_held(app, nursery, monkeypatch)
    c.abort()
    q = queue(app)
    await wait_until(lambda: q.consumer_count == 0)
    assert sc.discharge is not None and not sc.discharge.settled
    gate.release()
    await store_idle(app)
    assert (q.count, q.inflight) == (4, 0)

    c2 = await Client.connect(app.listening[0][1], nursery=nursery)
    got = await drain(c2)
    assert assert_whole(got) == COMMITTED
    assert got == [("m3", 1), ("m4", 1), ("t1", 0), ("t2", 0)]
    c2.abort()
    await wait_until(lambda: q.consumer_count == 0)
    assert (q.count, q.inflight) == (4, 0)
    app.request_shutdown()
    with trio.fail_after(30):
        await done.wait()

    again = await restart_and_drain(stoppable, nursery, caplog)
    assert [b for b, _ in again] == COMMITTED
    assert store_problems(caplog) == []


@pytest.mark.parametrize("sent", [True, False], ids=["discharge-sent", "discharge-unsent"])
async def test_connection_dropped_as_the_commit_is_sent(
    stoppable: StoppableFactory,
    nursery: trio.Nursery,
    caplog: pytest.LogCaptureFixture,
    sent: bool,
) -> None:
    """The client aborts its socket right after writing the discharge (`sent`: the
    broker reads it before the end of the stream and commits) or with the discharge
    still in its own buffer (never sent: the broker rolls the transaction back when
    the connection is lost). Either way the transaction is whole, every message is
    delivered once afterwards, and a restart gives the same answer. Rolled back: m1,
    m2 come back counted (rollback) like m3, m4 (connection lost)."""
    caplog.set_level(logging.WARNING)
    app, done = await stoppable(store_sync=True)
    c = await Client.connect(app.listening[0][1], nursery=nursery)
    sc = Scenario(c)
    await sc.prepare()
    if sent:
        await sc.commit_nowait()
    else:
        sc.discharge = sc.co.send_nowait(
            Message(body=Described(ulong(DISCHARGE), [sc.txn, False]))
        )  # not flushed: dropped with the socket
    c.abort()
    q = queue(app)
    await wait_until(lambda: q.consumer_count == 0)
    await store_idle(app)
    assert q.inflight == 0

    c2 = await Client.connect(app.listening[0][1], nursery=nursery)
    got = await drain(c2)
    bodies = assert_whole(got)
    if not sent:
        assert bodies == ROLLED_BACK
    if bodies == ROLLED_BACK:
        assert got == [("m1", 1), ("m2", 1), ("m3", 1), ("m4", 1)]
    else:
        assert got == [("m3", 1), ("m4", 1), ("t1", 0), ("t2", 0)]
    c2.abort()
    await wait_until(lambda: q.consumer_count == 0)
    app.request_shutdown()
    with trio.fail_after(30):
        await done.wait()

    again = await restart_and_drain(stoppable, nursery, caplog)
    assert [b for b, _ in again] == bodies
    assert store_problems(caplog) == []
