"""Local transactions (AMQP 1.0 part 4) as Qpid JMS uses them, over real sockets: the
coordinator link, declare / discharge, transactional sends and acknowledgements,
rollback on close, the bound, and durability (restart, SIGKILL)."""

from __future__ import annotations

import dataclasses
import random
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio
from proton import Delivery, Described, Message, Terminus, ulong

from amqbroker.app import BrokerApp
from amqbroker.core.queue import Queue
from tests.client import (
    TRANSACTIONAL,
    Client,
    ClientError,
    Received,
    Sender,
    control,
    coordinator,
    declare,
    discharge,
    roundtrip,
    txn_send_many,
    txn_send_nowait,
    txn_settle,
    wait_until,
)
from tests.conftest import BrokerFactory, ConnectFactory
from tests.integration.broker_process import BrokerProcess, BrokerProcesses

# ------------------------------------------------------------------------------ helpers


def queue(app: BrokerApp, name: str) -> Queue:
    assert app.broker is not None
    return app.broker.queues[name]


def bodies(got: list[Received]) -> list[Any]:
    return [g.body for g in got]


def msgs(*names: str, **kw: Any) -> list[Message]:
    return [Message(body=n, **kw) for n in names]


def assert_txn_accepted(d: Delivery, txn_id: bytes) -> None:
    assert d.remote_state == TRANSACTIONAL, d.remote_state
    data = d.remote.data
    assert data is not None
    assert bytes(data[0]) == txn_id
    out = data[1]
    assert isinstance(out, Described)
    assert int(out.descriptor) == 0x24  # accepted


def assert_rejected(d: Delivery, condition: str) -> str:
    assert d.remote_state == Delivery.REJECTED, d.remote_state
    cond = d.remote.condition
    assert cond is not None
    assert cond.name == condition, (cond.name, cond.description)
    assert cond.description
    return str(cond.description)


async def fill(s: Sender, names: list[str], **kw: Any) -> None:
    ds = await s.send_many(msgs(*names, **kw))
    assert [d.remote_state for d in ds] == [Delivery.ACCEPTED] * len(ds)


# ---------------------------------------------------------------- coordinator link


async def test_coordinator_link_is_attached_and_declares_unique_ids(
    broker: BrokerApp, connect: ConnectFactory
) -> None:
    c = await connect()
    co = await coordinator(c, name="qpid-jms:coordinator:ID:1:1")
    assert co.link.remote_target.type == Terminus.COORDINATOR
    assert co.credit > 0
    ids = [await declare(co) for _ in range(3)]
    assert len(set(ids)) == 3
    co2 = await coordinator(c)
    assert (await declare(co2)) not in ids


async def test_coordinator_without_local_transactions_capability_is_refused(
    broker: BrokerApp, connect: ConnectFactory
) -> None:
    c = await connect()
    with pytest.raises(ClientError, match="local transactions"):
        await coordinator(c, capabilities=["amqp:distributed-transactions"])


async def test_malformed_and_unknown_coordinator_messages_are_rejected(
    broker: BrokerApp, connect: ConnectFactory
) -> None:
    c = await connect()
    co = await coordinator(c)
    assert_rejected(await control(co, "hello"), "amqp:decode-error")
    assert_rejected(await control(co, Described(ulong(0x77), [])), "amqp:decode-error")
    assert_rejected(await control(co, Described(ulong(0x32), [])), "amqp:decode-error")
    # the link stays usable
    assert await declare(co)


async def test_symbolic_descriptors_are_understood(
    broker: BrokerApp, connect: ConnectFactory
) -> None:
    from proton import symbol

    c = await connect()
    co = await coordinator(c)
    d = await control(co, Described(symbol("amqp:declare:list"), []))
    assert d.remote_state == 0x33
    txn = bytes(d.remote.data[0])
    d = await control(co, Described(symbol("amqp:discharge:list"), [txn, False]))
    assert d.remote_state == Delivery.ACCEPTED


async def test_discharge_of_unknown_or_discharged_txn_is_rejected(
    broker: BrokerApp, connect: ConnectFactory
) -> None:
    c = await connect()
    co = await coordinator(c)
    desc = assert_rejected(await discharge(co, b"nope"), "amqp:transaction:unknown-id")
    assert "unknown transaction" in desc
    txn = await declare(co)
    assert (await discharge(co, txn)).remote_state == Delivery.ACCEPTED
    assert_rejected(await discharge(co, txn), "amqp:transaction:unknown-id")
    assert_rejected(await discharge(co, txn, fail=True), "amqp:transaction:unknown-id")
    # txn-ids are per connection: another connection does not know this one's
    c2 = await connect()
    co2 = await coordinator(c2)
    txn = await declare(co)
    assert_rejected(await discharge(co2, txn), "amqp:transaction:unknown-id")
    assert (await discharge(co, txn)).remote_state == Delivery.ACCEPTED


# ------------------------------------------------------------------- transactional sends


async def test_sends_are_routed_only_at_commit_in_order(
    broker: BrokerApp, connect: ConnectFactory
) -> None:
    c = await connect()
    co = await coordinator(c)
    s = await c.sender("tx.send")
    r = await c.receiver("tx.send", credit=100)
    txn = await declare(co)
    names = [f"m{i}" for i in range(10)]
    ds = await txn_send_many(s, msgs(*names), txn)
    for d in ds:
        assert_txn_accepted(d, txn)
    await roundtrip(c)
    assert not r.queue
    assert queue(broker, "tx.send").count == 0
    # a plain send is routed at once, ahead of the transaction's
    await fill(s, ["plain"])
    assert bodies(await r.receive_n(1)) == ["plain"]
    assert (await discharge(co, txn)).remote_state == Delivery.ACCEPTED
    assert bodies(await r.receive_n(10)) == names


async def test_rollback_drops_sends(broker: BrokerApp, connect: ConnectFactory) -> None:
    c = await connect()
    co = await coordinator(c)
    s = await c.sender("tx.rb")
    txn = await declare(co)
    await txn_send_many(s, msgs("a", "b", "c"), txn)
    assert (await discharge(co, txn, fail=True)).remote_state == Delivery.ACCEPTED
    txn2 = await declare(co)
    await txn_send_many(s, msgs("d"), txn2)
    assert (await discharge(co, txn2)).remote_state == Delivery.ACCEPTED
    r = await c.receiver("tx.rb", credit=10)
    assert bodies(await r.receive_n(1)) == ["d"]
    await r.expect_none(0.5)
    assert queue(broker, "tx.rb").count == 1


async def test_transfer_in_unknown_transaction_is_rejected(
    broker: BrokerApp, connect: ConnectFactory
) -> None:
    c = await connect()
    s = await c.sender("tx.unknown")
    (d,) = await txn_send_many(s, msgs("x"), b"\x00\x00\x00\x00\x00\x00\x00\x63")
    assert_rejected(d, "amqp:transaction:unknown-id")
    assert queue(broker, "tx.unknown").count == 0


async def test_sends_of_one_transaction_on_several_links_and_anonymous_relay(
    broker: BrokerApp, connect: ConnectFactory
) -> None:
    c = await connect()
    co = await coordinator(c)
    s1 = await c.sender("tx.multi.a")
    anon = await c.sender(None)
    txn = await declare(co)
    await txn_send_many(s1, msgs("a1", "a2"), txn)
    await txn_send_many(anon, [Message(body="b1", address="tx.multi.b")], txn)
    await roundtrip(c)
    assert queue(broker, "tx.multi.a").count == 0
    assert queue(broker, "tx.multi.b").count == 0
    assert (await discharge(co, txn)).remote_state == Delivery.ACCEPTED
    assert queue(broker, "tx.multi.a").count == 2
    assert queue(broker, "tx.multi.b").count == 1


# ------------------------------------------------------------ transactional acks


async def test_transactional_acks_hold_messages_until_commit(
    broker: BrokerApp, connect: ConnectFactory
) -> None:
    c = await connect()
    s = await c.sender("tx.ack")
    await fill(s, ["a", "b", "c"])
    co = await coordinator(c)
    r = await c.receiver("tx.ack", credit=10)
    got = await r.receive_n(3)
    txn = await declare(co)
    for g in got:
        txn_settle(r, g, txn)
    await roundtrip(c)
    q = queue(broker, "tx.ack")
    assert (q.count, q.inflight, q.acked) == (3, 3, 0)
    await r.expect_none(0.5)  # nothing is redelivered meanwhile
    assert (await discharge(co, txn)).remote_state == Delivery.ACCEPTED
    assert (q.count, q.inflight, q.acked) == (0, 0, 3)
    assert queue(broker, "tx.ack").consumers()[0].inflight == 0


async def test_transactional_reject_and_release_apply_at_commit(
    make_broker: BrokerFactory, connect: ConnectFactory, client: Any
) -> None:
    app = await make_broker(address_settings={"tx.out": {"dead_letter_address": "tx.dlq"}})
    c = await client(app)
    s = await c.sender("tx.out")
    await fill(s, ["rej", "rel"])
    co = await coordinator(c)
    r = await c.receiver("tx.out", credit=1)
    (g1,) = await r.receive_n(1)
    txn = await declare(co)
    txn_settle(r, g1, txn, Delivery.REJECTED)
    r.flow(1)
    (g2,) = await r.receive_n(1)
    txn_settle(r, g2, txn, Delivery.RELEASED)
    await roundtrip(c)
    q = queue(app, "tx.out")
    assert (q.count, q.inflight) == (2, 2)
    assert (await discharge(co, txn)).remote_state == Delivery.ACCEPTED
    # rejected -> dead-lettered; released -> back, and redelivered uncounted
    r.flow(1)
    (back,) = await r.receive_n(1)
    assert (back.body, back.message.delivery_count) == ("rel", 0)
    dl = await c.receiver("tx.dlq", credit=5)
    assert bodies(await dl.receive_n(1)) == ["rej"]


async def test_rollback_returns_acked_messages_in_order_to_the_same_group_owner(
    broker: BrokerApp, connect: ConnectFactory
) -> None:
    p = await connect()
    s = await p.sender("tx.grp")
    c1 = await connect()
    c2 = await connect()
    r1 = await c1.receiver("tx.grp", credit=10)
    r2 = await c2.receiver("tx.grp", credit=10)
    await fill(s, ["A1", "A2", "A3"], group_id="A")
    await fill(s, ["B1"], group_id="B")
    got = await r1.receive_n(3)
    assert bodies(got) == ["A1", "A2", "A3"]
    assert bodies(await r2.receive_n(1)) == ["B1"]
    co = await coordinator(c1)
    txn = await declare(co)
    txn_settle(r1, got[0], txn)
    txn_settle(r1, got[1], txn)
    r1.accept(got[2])  # outside the transaction: stays acknowledged
    await roundtrip(c1)
    assert (await discharge(co, txn, fail=True)).remote_state == Delivery.ACCEPTED
    again = await r1.receive_n(2)
    assert [(g.body, g.message.delivery_count) for g in again] == [("A1", 1), ("A2", 1)]
    await r2.expect_none(0.5)
    q = queue(broker, "tx.grp")
    assert q.count == 3  # A1, A2 (in flight again), B1 (in flight)
    # a second transaction commits them
    txn2 = await declare(co)
    for g in again:
        txn_settle(r1, g, txn2)
    assert (await discharge(co, txn2)).remote_state == Delivery.ACCEPTED
    assert q.count == 1


async def test_unknown_txn_in_a_disposition_returns_the_message(
    broker: BrokerApp, connect: ConnectFactory
) -> None:
    c = await connect()
    s = await c.sender("tx.badack")
    await fill(s, ["x"])
    r = await c.receiver("tx.badack", credit=10)
    (g,) = await r.receive_n(1)
    txn_settle(r, g, b"not-a-txn")
    (back,) = await r.receive_n(1)
    assert (back.body, back.message.delivery_count) == ("x", 1)


async def test_consumer_detached_before_commit(broker: BrokerApp, connect: ConnectFactory) -> None:
    c = await connect()
    s = await c.sender("tx.det")
    await fill(s, ["a", "b", "c", "d"])
    co = await coordinator(c)
    r = await c.receiver("tx.det", credit=4)
    got = await r.receive_n(4)
    txn_commit = await declare(co)
    txn_settle(r, got[0], txn_commit)
    txn_settle(r, got[1], txn_commit)
    txn_rb = await declare(co)
    txn_settle(r, got[2], txn_rb)
    await roundtrip(c)
    await r.close()  # d (unsettled) goes back at once; the others stay in flight
    q = queue(broker, "tx.det")
    assert (q.count, q.inflight) == (4, 3)
    assert (await discharge(co, txn_commit)).remote_state == Delivery.ACCEPTED
    assert (q.count, q.inflight, q.acked) == (2, 1, 2)
    assert (await discharge(co, txn_rb, fail=True)).remote_state == Delivery.ACCEPTED
    assert (q.count, q.inflight) == (2, 0)
    r2 = await c.receiver("tx.det", credit=10)
    back = await r2.receive_n(2)
    assert [(g.body, g.message.delivery_count) for g in back] == [("c", 1), ("d", 0)]


async def test_connection_close_rolls_back(broker: BrokerApp, connect: ConnectFactory) -> None:
    p = await connect()
    s0 = await p.sender("tx.close")
    await fill(s0, ["a", "b"], group_id="G")
    c = await connect()
    co = await coordinator(c)
    s = await c.sender("tx.close")
    r = await c.receiver("tx.close", credit=10)
    got = await r.receive_n(2)
    txn = await declare(co)
    txn_settle(r, got[0], txn)
    await txn_send_many(s, msgs("never"), txn)
    await roundtrip(c)
    await c.close()
    q = queue(broker, "tx.close")
    await wait_until(lambda: q.consumer_count == 0)
    assert (q.count, q.inflight) == (2, 0)
    r2 = await p.receiver("tx.close", credit=10)
    back = await r2.receive_n(2)
    # a: rolled back (+1); b: unsettled at a clean close (uncounted)
    assert [(g.body, g.message.delivery_count) for g in back] == [("a", 1), ("b", 0)]
    await r2.expect_none(0.5)


async def test_connection_lost_rolls_back(broker: BrokerApp, connect: ConnectFactory) -> None:
    c = await connect()
    co = await coordinator(c)
    s = await c.sender("tx.lost")
    await fill(s, ["a"])
    r = await c.receiver("tx.lost", credit=10)
    (g,) = await r.receive_n(1)
    txn = await declare(co)
    txn_settle(r, g, txn)
    await txn_send_many(s, msgs("never"), txn)
    await roundtrip(c)
    c.abort()
    q = queue(broker, "tx.lost")
    await wait_until(lambda: q.consumer_count == 0)
    assert (q.count, q.inflight) == (1, 0)
    p = await connect()
    r2 = await p.receiver("tx.lost", credit=10)
    (back,) = await r2.receive_n(1)
    assert (back.body, back.message.delivery_count) == ("a", 1)


async def test_coordinator_detach_rolls_back_its_transactions(
    broker: BrokerApp, connect: ConnectFactory
) -> None:
    c = await connect()
    co = await coordinator(c)
    s = await c.sender("tx.codet")
    txn = await declare(co)
    await txn_send_many(s, msgs("x"), txn)
    await co.close()
    co2 = await coordinator(c)
    assert_rejected(await discharge(co2, txn), "amqp:transaction:unknown-id")
    assert queue(broker, "tx.codet").count == 0


# --------------------------------------------------------------------------- bound


async def test_transaction_bound(make_broker: BrokerFactory, client: Any) -> None:
    app = await make_broker()
    app.server.limits = dataclasses.replace(app.server.limits, max_transaction_messages=3)
    c = await client(app)
    co = await coordinator(c)
    s = await c.sender("tx.bound")
    await fill(s, ["old"])
    r = await c.receiver("tx.bound", credit=10)
    (old,) = await r.receive_n(1)
    txn = await declare(co)
    txn_settle(r, old, txn)
    ds = await txn_send_many(s, msgs("a", "b", "c"), txn)
    assert_txn_accepted(ds[0], txn)
    assert_txn_accepted(ds[1], txn)
    desc = assert_rejected(ds[2], "amqp:resource-limit-exceeded")
    assert "max_transaction_messages" in desc
    # the transaction is rolled back at commit, with the reason
    d = await discharge(co, txn)
    desc = assert_rejected(d, "amqp:transaction:rollback")
    assert "max_transaction_messages" in desc
    (back,) = await r.receive_n(1)
    assert (back.body, back.message.delivery_count) == ("old", 1)
    assert queue(app, "tx.bound").count == 1
    # an ack past the bound returns its message at once
    txn = await declare(co)
    await txn_send_many(s, msgs("x", "y", "z"), txn)
    txn_settle(r, back, txn)
    (again,) = await r.receive_n(1)
    assert (again.body, again.message.delivery_count) == ("old", 2)
    assert_rejected(await discharge(co, txn), "amqp:transaction:rollback")


# ---------------------------------------------------------------- durability


@pytest.fixture
async def procs(nursery: trio.Nursery, tmp_path: Path) -> AsyncIterator[BrokerProcesses]:
    p = BrokerProcesses(nursery, cwd=tmp_path)
    try:
        yield p
    finally:
        await p.aclose()


async def _drain(c: Client, address: str) -> list[Received]:
    r = await c.receiver(address, credit=100_000)
    await r.drain(timeout=60)
    got = list(r.queue)
    r.queue.clear()
    return got


@pytest.mark.slow
async def test_durable_commit_survives_restart(
    procs: BrokerProcesses, nursery: trio.Nursery, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    bp = await procs.start(data)
    assert bp.port is not None
    c = await Client.connect(bp.port, nursery=nursery)
    s = await c.sender("tx.dur")
    await fill(s, ["keep", "acked"], durable=True)
    r = await c.receiver("tx.dur", credit=10)
    got = await r.receive_n(2)
    co = await coordinator(c)
    txn = await declare(co)
    txn_settle(r, got[1], txn)
    await txn_send_many(s, msgs("t1", "t2", durable=True), txn)
    assert (await discharge(co, txn)).remote_state == Delivery.ACCEPTED
    # an open transaction at the crash leaves nothing
    txn2 = await declare(co)
    await txn_send_many(s, msgs("lost", durable=True), txn2)
    txn_settle(r, got[0], txn2)
    await roundtrip(c)
    assert await bp.crash() == -signal.SIGKILL
    c.abort()

    bp2 = await procs.start(data)
    assert bp2.port is not None
    c2 = await Client.connect(bp2.port, nursery=nursery)
    assert bodies(await _drain(c2, "tx.dur")) == ["keep", "t1", "t2"]
    c2.abort()


async def _batches(
    c: Client,
    co: Sender,
    s: Sender,
    batch: int,
    state: dict[int, str],
    kill_at: int,
    killed: trio.Event,
) -> None:
    """Send transactional batches of `batch` durable messages ("b<k>:<i>"), committing
    each; `state[k]` is open / discharging / committed. Sets `killed` once `kill_at`
    transfers (plus discharges) have been sent, so the kill lands anywhere."""
    sent = 0
    k = 0
    try:
        while True:
            txn = await declare(co, timeout=30)
            state[k] = "open"
            for i in range(batch):
                await c._wait(lambda: s.link.credit > 0, 30)
                txn_send_nowait(s, Message(body=f"b{k}:{i}", durable=True), txn)
                sent += 1
                if sent >= kill_at:
                    killed.set()
                if i % 8 == 7:
                    await c._flush()
            await c._flush()
            state[k] = "discharging"
            d = co.send_nowait(Message(body=Described(ulong(0x32), [txn, False])))
            await c._flush()
            sent += 1
            if sent >= kill_at:
                killed.set()
            await c._wait(lambda d=d: d.settled, 30)
            assert d.remote_state == Delivery.ACCEPTED, d.remote_state
            state[k] = "committed"
            k += 1
    except (ClientError, trio.TooSlowError):
        killed.set()
        return


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_sigkill_leaves_each_batch_whole_or_absent(
    procs: BrokerProcesses, nursery: trio.Nursery, tmp_path: Path, seed: int
) -> None:
    rng = random.Random(seed)
    data = tmp_path / "data"
    batch = 20
    expected: dict[int, str] = {}  # over all rounds, keyed by round * 1000 + batch
    for rnd in range(3):
        bp: BrokerProcess = await procs.start(data)
        assert bp.port is not None
        c = await Client.connect(bp.port, nursery=nursery)
        co = await coordinator(c)
        s = await c.sender(f"tx.kill.{rnd}")
        state: dict[int, str] = {}
        killed = trio.Event()
        kill_at = rng.randint(batch // 2, batch * 6)
        nursery.start_soon(_batches, c, co, s, batch, state, kill_at, killed)
        with trio.fail_after(60):
            await killed.wait()
        assert await bp.crash() == -signal.SIGKILL
        c.abort()
        for k, st in state.items():
            expected[rnd * 1000 + k] = st

        bp2 = await procs.start(data)
        assert bp2.port is not None
        c2 = await Client.connect(bp2.port, nursery=nursery)
        for r in range(rnd + 1):
            got = [str(g.body) for g in await _drain(c2, f"tx.kill.{r}")]
            by_batch: dict[int, list[int]] = {}
            for b in got:
                k_s, i_s = b[1:].split(":")
                by_batch.setdefault(int(k_s), []).append(int(i_s))
            for k, idx in by_batch.items():
                assert idx == list(range(batch)), f"round {r} batch {k} partial: {idx}"
                assert expected[r * 1000 + k] in ("committed", "discharging"), (
                    f"round {r} batch {k} was never discharged but is present"
                )
            for key, st in expected.items():
                if key // 1000 == r and st == "committed":
                    assert key % 1000 in by_batch, f"round {r}: committed batch {key} lost"
        await c2.close()
        await bp2.stop()
