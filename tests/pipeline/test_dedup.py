"""Duplicate detection (address setting duplicate_detection_window) on a real broker:
duplicates within the window are accepted and dropped, ids beyond it are accepted
again, the window is per address, _AMQ_DUPL_ID wins over the message-id, and what a
restart keeps."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio
from proton import Delivery, Message

from amqbroker.app import BrokerApp
from amqbroker.core.address import DuplicateWindow
from tests.client import Client, coordinator, declare, discharge, txn_send_many
from tests.conftest import StoppableFactory

SETTINGS = {
    "#": {},
    "dd.#": {"duplicate_detection_window": 3},
    "dd.two": {"duplicate_detection_window": 2},
}

Run = Callable[..., Awaitable[tuple[BrokerApp, trio.Event]]]


@pytest.fixture
def run(stoppable: StoppableFactory) -> Run:
    return functools.partial(stoppable, address_settings=SETTINGS)


def m(mid: Any, body: str | None = None, dupl: Any = None, durable: bool = False) -> Message:
    props = {"_AMQ_DUPL_ID": dupl} if dupl is not None else None
    return Message(id=mid, body=body or str(mid), properties=props, durable=durable)


async def send_all(c: Client, address: str, msgs: list[Message]) -> None:
    s = await c.sender(address)
    for d in await s.send_many(msgs):
        assert d.remote_state == Delivery.ACCEPTED


async def bodies(c: Client, address: str, n: int) -> list[str]:
    r = await c.receiver(address, credit=n + 1)
    got = await r.receive_n(n)
    for x in got:
        r.accept(x)
    await r.expect_none(0.1)
    await r.close()
    return [x.body for x in got]


async def test_duplicates_within_the_window_are_dropped(run: Run) -> None:
    app, _ = await run()
    async with trio.open_nursery() as n:
        c = await Client.connect(app.listening[0][1], nursery=n)
        await send_all(c, "dd.a", [m("a", "a1"), m("b"), m("a", "a2"), m("c"), m("b", "b2")])
        assert await bodies(c, "dd.a", 3) == ["a1", "b", "c"]
        assert app.broker is not None
        assert app.broker.statistics()["duplicates_dropped"] == 2
        # beyond the window (3): a, b, c, d -> "a" was evicted by "d"
        await send_all(c, "dd.a", [m("d"), m("a", "a3"), m("d", "d2")])
        assert await bodies(c, "dd.a", 2) == ["d", "a3"]
        c.abort()
        n.cancel_scope.cancel()


async def test_window_size_and_ids_of_every_type(run: Run) -> None:
    app, _ = await run()
    async with trio.open_nursery() as n:
        c = await Client.connect(app.listening[0][1], nursery=n)
        # window 2 (the more specific pattern): x, y, z evicts x
        await send_all(c, "dd.two", [m("x"), m("y"), m("z"), m("x", "x2"), m("z", "z2")])
        assert await bodies(c, "dd.two", 4) == ["x", "y", "z", "x2"]
        # ulong and binary message-ids; messages without any id are never duplicates
        await send_all(
            c, "dd.b", [m(7, "7a"), m(b"\x01", "b1"), m(7, "7b"), m(None, "n1"), m(None, "n2")]
        )
        assert await bodies(c, "dd.b", 4) == ["7a", "b1", "n1", "n2"]
        c.abort()
        n.cancel_scope.cancel()


async def test_the_window_is_per_address_and_off_by_default(run: Run) -> None:
    app, _ = await run()
    async with trio.open_nursery() as n:
        c = await Client.connect(app.listening[0][1], nursery=n)
        await send_all(c, "dd.one", [m("same", "one")])
        await send_all(c, "dd.other", [m("same", "other")])
        await send_all(c, "plain", [m("same", "p1"), m("same", "p2")])
        assert await bodies(c, "dd.one", 1) == ["one"]
        assert await bodies(c, "dd.other", 1) == ["other"]
        assert await bodies(c, "plain", 2) == ["p1", "p2"]
        assert app.broker is not None
        assert app.broker.addresses["plain"].dedup is None
        c.abort()
        n.cancel_scope.cancel()


async def test_amq_dupl_id_wins_over_the_message_id(run: Run) -> None:
    app, _ = await run()
    async with trio.open_nursery() as n:
        c = await Client.connect(app.listening[0][1], nursery=n)
        await send_all(
            c,
            "dd.x",
            [
                m("id1", "first", dupl="task-1"),
                m("id2", "retry", dupl="task-1"),  # same _AMQ_DUPL_ID: dropped
                m("id1", "other", dupl="task-2"),  # same message-id, new dupl id: kept
            ],
        )
        assert await bodies(c, "dd.x", 2) == ["first", "other"]
        c.abort()
        n.cancel_scope.cancel()


async def test_restart_keeps_the_ids_of_queued_messages_only(run: Run) -> None:
    app, done = await run()
    async with trio.open_nursery() as n:
        c = await Client.connect(app.listening[0][1], nursery=n)
        await send_all(c, "dd.r", [m("consumed", durable=True)])
        assert await bodies(c, "dd.r", 1) == ["consumed"]
        await send_all(c, "dd.r", [m("queued", durable=True)])
        c.abort()
        app.request_shutdown()
        with trio.fail_after(10):
            await done.wait()
        n.cancel_scope.cancel()
    app, _ = await run()
    async with trio.open_nursery() as n:
        c = await Client.connect(app.listening[0][1], nursery=n)
        # recovered from the journal: still a duplicate; consumed before: forgotten
        await send_all(
            c,
            "dd.r",
            [m("queued", "queued-again", durable=True), m("consumed", "c2", durable=True)],
        )
        assert await bodies(c, "dd.r", 2) == ["queued", "c2"]
        c.abort()
        n.cancel_scope.cancel()


async def test_transactional_sends_are_checked_at_commit(run: Run) -> None:
    app, _ = await run()
    async with trio.open_nursery() as n:
        c = await Client.connect(app.listening[0][1], nursery=n)
        co = await coordinator(c)
        s = await c.sender("dd.t")
        # a rolled-back send leaves no id behind: its retry goes through
        txn = await declare(co)
        await txn_send_many(s, [m("t1", "rolled-back")], txn)
        await discharge(co, txn, fail=True)
        txn = await declare(co)
        await txn_send_many(s, [m("t1", "retry"), m("t1", "dup-in-txn")], txn)
        d = await discharge(co, txn)
        assert d.remote_state == Delivery.ACCEPTED
        assert await bodies(c, "dd.t", 1) == ["retry"]
        assert app.broker is not None
        assert app.broker.statistics()["duplicates_dropped"] == 1
        c.abort()
        n.cancel_scope.cancel()


def test_window_ring() -> None:
    w = DuplicateWindow(2)
    assert [w.seen(k) for k in ["a", "b", "a", "c", "a", "b"]] == [
        False,
        False,
        True,
        False,
        False,
        False,
    ]
    assert w.ids == set(w.order) and len(w.order) == 2
