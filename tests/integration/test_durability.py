"""Durability of the real broker process: kill -9, restart, torn records, graceful stop.

Every test runs `python -m amqbroker run` as a subprocess (see broker_process.py) with
the store synced (`store_sync`, the default) and talks to it with the trio Proton
client over TCP.

A note on acknowledgements: a consumer that settles first (the usual receiver settle
mode) gets no confirmation that the broker recorded its ack. Where a test needs the
acks on disk before it kills the broker, it sends one durable message to another queue
on the same connection *after* the acks and waits for that message's `accepted`: the
journal numbers its group-commit batches in the order records are appended, and a
producer is settled only once every batch up to its ADD record is synced, so the
earlier ACK records are synced too (see amqbroker/store/journal.py).
"""

from __future__ import annotations

import contextlib
import random
import re
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio
from proton import Delivery, Message, ProtonException

from tests.client import Client, ClientError, Received, Sender
from tests.integration.broker_process import BrokerProcess, BrokerProcesses

pytestmark = pytest.mark.slow


@pytest.fixture
async def procs(nursery: trio.Nursery, tmp_path: Path) -> AsyncIterator[BrokerProcesses]:
    p = BrokerProcesses(nursery, cwd=tmp_path)
    try:
        yield p
    finally:
        await p.aclose()


class Clients:
    def __init__(self, nursery: trio.Nursery) -> None:
        self.nursery = nursery
        self.clients: list[Client] = []

    async def connect(self, port: int | None, **kw: Any) -> Client:
        assert port is not None
        c = await Client.connect(port, nursery=self.nursery, **kw)
        self.clients.append(c)
        return c


@pytest.fixture
async def clients(nursery: trio.Nursery) -> AsyncIterator[Clients]:
    cs = Clients(nursery)
    try:
        yield cs
    finally:
        for c in cs.clients:
            c.abort()


# --------------------------------------------------------------------------- helpers


def body(i: int, pad: int = 64) -> str:
    return f"m{i:06d}" + "." * pad


def index(r: Received) -> int:
    return int(str(r.body)[1:7])


def accepted(deliveries: list[Delivery]) -> list[int]:
    return [i for i, d in enumerate(deliveries) if d.remote_state == Delivery.ACCEPTED]


async def send_all_accepted(s: Sender, first: int, n: int, **kw: Any) -> None:
    ds = await s.send_many([Message(body=body(i), durable=True, **kw) for i in range(first, n)])
    states = [d.remote_state for d in ds]
    assert states == [Delivery.ACCEPTED] * len(ds), states


async def barrier(c: Client, address: str = "barrier") -> None:
    """Everything this connection did before is in a synced journal batch (see module
    docstring). Dispositions queued on the client are written first."""
    await c._flush()
    s = await c.sender(address)
    d = await s.send(Message(body="barrier", durable=True))
    assert d.remote_state == Delivery.ACCEPTED


async def drain_queue(c: Client, address: str, max_n: int = 100_000) -> list[Received]:
    """Everything the queue holds right now, in delivery order (left unsettled)."""
    r = await c.receiver(address, credit=max_n)
    await r.drain(timeout=60)
    got = list(r.queue)
    r.queue.clear()
    return got


def input_ended(c: Client) -> bool:
    """The client's reader saw the end of the socket (EOF or error)."""
    try:
        return bool(c.transport.capacity() < 0)
    except ProtonException:
        return True


async def wait_closed(c: Client, timeout: float = 15) -> None:
    """Wait until the broker closed the connection, or the client read everything the
    socket delivered (a failed *send* marks the client dead while a close frame may
    still wait in the receive buffer, so `_dead` alone is not the end)."""
    with trio.fail_after(timeout):
        while not (c.closed_by_peer or input_ended(c)):
            await c._changed.wait()


async def fail_with(bp: BrokerProcess, problem: str) -> None:
    """Fail, with the broker's complete output (waits a little for it to exit)."""
    with trio.move_on_after(10):
        await bp.wait_exit()
    raise AssertionError(f"{problem}\n{bp.describe()}")


def journal_files(data: Path) -> dict[str, int]:
    """Sizes of the journal's files (the broker may delete one while we look)."""
    sizes: dict[str, int] = {}
    for p in (data / "journal").iterdir():
        with contextlib.suppress(FileNotFoundError):
            if p.is_file():
                sizes[p.name] = p.stat().st_size
    return sizes


def assert_clean(bp: BrokerProcess) -> None:
    assert "Traceback" not in bp.stderr, bp.describe()
    assert " ERROR " not in bp.stderr, bp.describe()
    assert " CRITICAL " not in bp.stderr, bp.describe()


# ------------------------------------------------------------- kill -9 while sending


async def _producer(c: Client, s: Sender, n: int, out: list[Delivery], first: int = 0) -> None:
    """Send n durable messages (bodies from `first` on) as fast as credit allows;
    stops when the link or the connection ends."""
    try:
        for i in range(n):
            if s.credit <= 0:
                await c._flush()
                await c._wait(lambda: s.credit > 0 or s.closed_by_peer or c.closed_by_peer, 30)
                if s.closed_by_peer or c.closed_by_peer:
                    return
            if c.closed_by_peer or c._dead:
                return
            out.append(s.send_nowait(Message(body=body(first + i), durable=True)))
            if i % 16 == 15:
                await c._flush()
        await c._flush()
    except ClientError:  # the connection died under us: expected when killed
        return


@pytest.mark.parametrize(
    ("seed", "kill_after"),
    [(0, 1), (1, None), (2, None), (3, None)],
    ids=["after-first-accept", "random-1", "random-2", "random-3"],
)
async def test_kill_9_while_sending_loses_no_accepted_message(
    procs: BrokerProcesses,
    clients: Clients,
    nursery: trio.Nursery,
    tmp_path: Path,
    seed: int,
    kill_after: int | None,
) -> None:
    n = 3000
    rng = random.Random(seed)
    if kill_after is None:
        kill_after = rng.randint(10, n // 2)
    data = tmp_path / "data"
    bp = await procs.start(data)
    c = await clients.connect(bp.port)
    queues = ["crash.a", "crash.b"]
    sent: dict[str, list[Delivery]] = {q: [] for q in queues}
    for q in queues:
        s = await c.sender(q)
        nursery.start_soon(_producer, c, s, n, sent[q])

    # kill after `kill_after` accepts on the first queue, with more sends in flight
    await c._wait(lambda: len(accepted(sent["crash.a"])) >= kill_after, 60)
    assert await bp.crash() == -signal.SIGKILL
    await wait_closed(c)
    seen_accepted = {q: accepted(sent[q]) for q in queues}
    in_flight = {q: len(sent[q]) - len(seen_accepted[q]) for q in queues}
    assert len(seen_accepted["crash.a"]) >= kill_after
    assert sum(in_flight.values()) > 0, "nothing was in flight at the kill: test too weak"

    bp2 = await procs.start(data)
    c2 = await clients.connect(bp2.port)
    for q in queues:
        got = [index(r) for r in await drain_queue(c2, q)]
        acc = seen_accepted[q]
        assert got == sorted(got), f"{q}: order lost after restart"
        assert set(got) <= set(range(len(sent[q]))), f"{q}: a message nobody sent"
        missing = sorted(set(acc) - set(got))
        assert not missing, (
            f"{q}: {len(missing)} accepted message(s) lost (first {missing[:10]}); "
            f"accepted {len(acc)}, recovered {len(got)}, kill after {kill_after}, seed {seed}"
        )
        acc_set = set(acc)
        assert [i for i in got if i in acc_set] == acc, f"{q}: accepted ones out of order"
        assert len(got) == len(set(got)), f"{q}: duplicates"
    assert_clean(bp2)


# -------------------------------------------------------------- acks are recorded


async def test_acknowledged_messages_stay_acknowledged_after_kill_9(
    procs: BrokerProcesses, clients: Clients, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    bp = await procs.start(data)
    c = await clients.connect(bp.port)
    s = await c.sender("ack.q")
    await send_all_accepted(s, 0, 100)
    r = await c.receiver("ack.q", credit=100)
    got = await r.receive_n(100)
    assert [index(g) for g in got] == list(range(100))
    for g in got[:50]:
        r.accept(g)
    await barrier(c)
    assert await bp.crash() == -signal.SIGKILL

    bp2 = await procs.start(data)
    c2 = await clients.connect(bp2.port)
    back = await drain_queue(c2, "ack.q")
    assert [index(g) for g in back] == list(range(50, 100))
    assert_clean(bp2)


async def test_acks_of_interleaved_consumers_are_recorded(
    procs: BrokerProcesses, clients: Clients, tmp_path: Path
) -> None:
    """Acks out of queue order (every third message) leave exactly the rest, in order."""
    data = tmp_path / "data"
    bp = await procs.start(data)
    c = await clients.connect(bp.port)
    s = await c.sender("ack.holes")
    await send_all_accepted(s, 0, 60)
    r = await c.receiver("ack.holes", credit=60)
    got = await r.receive_n(60)
    for g in reversed(got):
        if index(g) % 3 == 0:
            r.accept(g)
    await barrier(c)
    assert await bp.crash() == -signal.SIGKILL

    bp2 = await procs.start(data)
    c2 = await clients.connect(bp2.port)
    back = await drain_queue(c2, "ack.holes")
    assert [index(g) for g in back] == [i for i in range(60) if i % 3]


# -------------------------------------------------- non-durable, delivery-count


async def test_durable_messages_survive_kill_9_non_durable_may_vanish(
    procs: BrokerProcesses, clients: Clients, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    bp = await procs.start(data)
    c = await clients.connect(bp.port)
    s = await c.sender("mix.q")
    msgs = [Message(body=body(i), durable=i % 2 == 0) for i in range(40)]
    ds = await s.send_many(msgs)
    assert all(d.remote_state == Delivery.ACCEPTED for d in ds)
    assert await bp.crash() == -signal.SIGKILL

    bp2 = await procs.start(data)
    c2 = await clients.connect(bp2.port)
    got = [index(g) for g in await drain_queue(c2, "mix.q")]
    assert [i for i in got if i % 2 == 0] == list(range(0, 40, 2))
    assert got == sorted(got)
    assert len(got) == len(set(got))


async def test_delivery_count_is_recovered(
    procs: BrokerProcesses, clients: Clients, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    bp = await procs.start(data)
    c = await clients.connect(bp.port)
    s = await c.sender("dc.q")
    await send_all_accepted(s, 0, 5)
    r = await c.receiver("dc.q", credit=5)
    m = await r.receive_n(5)
    assert [index(x) for x in m] == [0, 1, 2, 3, 4]
    assert [x.message.delivery_count for x in m] == [0] * 5
    r.modify(m[0], failed=True)  # +1
    r.modify(m[1], failed=True)  # +1
    r.release(m[2])  # no attempt counted
    r.modify(m[3], failed=False)  # no attempt counted
    r.accept(m[4])
    # dispositions first: Proton would otherwise put the flow frame before them
    await c._flush()
    r.flow(4)
    again = {index(x): x for x in await r.receive_n(4)}
    # (the order of these redeliveries is not what this test is about)
    assert {i: x.message.delivery_count for i, x in again.items()} == {0: 1, 1: 1, 2: 0, 3: 0}
    r.modify(again[0], failed=True)  # m0: 2, back in the queue (no credit left)
    r.accept(again[3])
    # m1 (count 1) and m2 (count 0) stay unsettled
    await barrier(c)
    assert r.credit == 0
    assert await bp.crash() == -signal.SIGKILL

    bp2 = await procs.start(data)
    c2 = await clients.connect(bp2.port)
    back = await drain_queue(c2, "dc.q")
    counts = {index(x): x.message.delivery_count for x in back}
    assert [index(x) for x in back] == [0, 1, 2]
    assert counts[0] == 2, counts
    # unsettled when the broker died: that attempt counts, as a lost connection's does
    # (store_delivery_count_before_delivery, issue 20)
    assert counts[1] == 2, counts
    assert counts[2] == 1, counts


# ---------------------------------------------------------------- graceful stop


async def test_sigterm_with_unsettled_consumer_and_busy_producer(
    procs: BrokerProcesses, clients: Clients, nursery: trio.Nursery, tmp_path: Path
) -> None:
    shutdown_timeout = 5.0
    data = tmp_path / "data"
    env = {"AMQBROKER_SHUTDOWN_TIMEOUT": str(shutdown_timeout)}
    bp = await procs.start(data, env=env)
    producer = await clients.connect(bp.port)
    s = await producer.sender("gs.q")
    await send_all_accepted(s, 0, 20)

    consumer = await clients.connect(bp.port)
    r = await consumer.receiver("gs.q", credit=10)
    held = await r.receive_n(10)
    assert [index(g) for g in held] == list(range(10))

    # the producer keeps sending (bodies from 20 on) while the broker stops
    stream: list[Delivery] = []
    s2 = await producer.sender("gs.q")

    async def produce() -> None:
        try:
            i = 20
            while not producer.closed_by_peer and not producer._dead:
                await producer._wait(
                    lambda: s2.credit > 0 or s2.closed_by_peer or producer.closed_by_peer, 30
                )
                if s2.closed_by_peer or producer.closed_by_peer:
                    return
                stream.append(s2.send_nowait(Message(body=body(i), durable=True)))
                i += 1
                if i % 8 == 0:
                    await producer._flush()
        except ClientError:
            return

    nursery.start_soon(produce)
    await producer._wait(lambda: len(accepted(stream)) >= 50, 30)

    t0 = trio.current_time()
    bp.send_signal(signal.SIGTERM)
    for c in (consumer, producer):
        await wait_closed(c, timeout=shutdown_timeout + 5)
        if not c.closed_by_peer:
            await fail_with(bp, "the socket dropped without an AMQP close")
        cond = c.remote_condition
        assert cond is not None and cond.name == "amqp:connection:forced", cond
        await c.close()  # answer the close, as a real client does
    rc = await bp.wait_exit(timeout=shutdown_timeout + 10)
    elapsed = trio.current_time() - t0
    assert rc == 0, bp.describe()
    assert elapsed < shutdown_timeout + 2, f"took {elapsed:.1f} s"
    assert "Traceback" not in bp.stderr, bp.describe()
    produced = [i + 20 for i in accepted(stream)]

    bp2 = await procs.start(data, env=env)
    c2 = await clients.connect(bp2.port)
    got = [index(g) for g in await drain_queue(c2, "gs.q")]
    # the 10 unsettled ones are back at the head, in order, then the rest
    assert got[:20] == list(range(20)), got[:25]
    tail = got[20:]
    assert tail == sorted(tail)
    pset = set(produced)
    assert [i for i in tail if i in pset] == produced, "an accepted message is missing"


async def test_sigterm_with_clients_that_never_answer_close(
    procs: BrokerProcesses, clients: Clients, tmp_path: Path
) -> None:
    """Peers that ignore the close cannot hold the broker beyond shutdown_timeout."""
    shutdown_timeout = 2.0
    data = tmp_path / "data"
    bp = await procs.start(data, env={"AMQBROKER_SHUTDOWN_TIMEOUT": str(shutdown_timeout)})
    c = await clients.connect(bp.port)
    s = await c.sender("deaf.q")
    await send_all_accepted(s, 0, 5)
    r = await c.receiver("deaf.q", credit=5)
    assert len(await r.receive_n(5)) == 5
    t0 = trio.current_time()
    bp.send_signal(signal.SIGTERM)
    rc = await bp.wait_exit(timeout=shutdown_timeout + 10)
    elapsed = trio.current_time() - t0
    assert rc == 0, bp.describe()
    assert elapsed < shutdown_timeout + 2, f"took {elapsed:.1f} s"
    assert c.closed_by_peer
    assert c.remote_condition.name == "amqp:connection:forced"

    bp2 = await procs.start(data)
    c2 = await clients.connect(bp2.port)
    assert [index(g) for g in await drain_queue(c2, "deaf.q")] == list(range(5))


async def test_sigterm_while_durable_sends_stream_in(
    procs: BrokerProcesses, clients: Clients, nursery: trio.Nursery, tmp_path: Path
) -> None:
    """SIGTERM while a producer streams durable messages (so the store writer is busy
    with a batch most of the time): a clean exit 0 every time, and every accepted
    message there afterwards. Five rounds on the same data directory."""
    data = tmp_path / "data"
    acc: list[int] = []
    first = 0
    for _ in range(5):
        bp = await procs.start(data)
        c = await clients.connect(bp.port)
        s = await c.sender("busy.q")
        ds: list[Delivery] = []
        nursery.start_soon(_producer, c, s, 100_000, ds, first)
        await c._wait(lambda ds=ds: len(accepted(ds)) >= 20, 30)
        bp.send_signal(signal.SIGTERM)
        await wait_closed(c)
        await c.close()
        rc = await bp.wait_exit()
        assert rc == 0, bp.describe()
        assert "Traceback" not in bp.stderr, bp.describe()
        acc += [first + i for i in accepted(ds)]
        first += len(ds)

    bp2 = await procs.start(data)
    c2 = await clients.connect(bp2.port)
    got = [index(g) for g in await drain_queue(c2, "busy.q")]
    aset = set(acc)
    assert [i for i in got if i in aset] == acc


# ------------------------------------------------------------------ bounded store


async def test_store_stays_bounded_over_many_send_ack_cycles(
    procs: BrokerProcesses, clients: Clients, tmp_path: Path
) -> None:
    segment = 4096
    compact_min = 8192
    data = tmp_path / "data"
    env = {
        "AMQBROKER_STORE_SEGMENT_SIZE": str(segment),
        "AMQBROKER_STORE_COMPACT_MIN_BYTES": str(compact_min),
    }
    bp = await procs.start(data, env=env)
    c = await clients.connect(bp.port)
    s = await c.sender("bounded.q")
    r = await c.receiver("bounded.q", credit=0)
    cycles, per_cycle, pad = 160, 10, 300
    written = 0
    largest = 0
    for k in range(cycles):
        first = k * per_cycle
        msgs = [
            Message(body=body(i, pad=pad), durable=True) for i in range(first, first + per_cycle)
        ]
        ds = await s.send_many(msgs)
        assert all(d.remote_state == Delivery.ACCEPTED for d in ds)
        written += sum(len(m.encode()) for m in msgs)
        r.flow(per_cycle)
        got = await r.receive_n(per_cycle)
        assert [index(g) for g in got] == list(range(first, first + per_cycle))
        for g in got:
            r.accept(g)
        size = sum(journal_files(data).values())
        largest = max(largest, size)
    # live data at any moment: one cycle's messages (~4 KB). The journal's own bound
    # is about max(compact_min_bytes, live / compact_live_ratio) plus a couple of
    # segments; allow twice that, still far below what was written.
    bound = 2 * (compact_min + 3 * segment)
    assert written > 10 * bound
    assert largest <= bound, (
        f"journal grew to {largest} bytes (bound {bound}, {written} bytes of messages "
        f"written): {journal_files(data)}"
    )
    await barrier(c)
    assert await bp.crash() == -signal.SIGKILL

    # compaction resurrected nothing and lost nothing
    bp2 = await procs.start(data, env=env)
    c2 = await clients.connect(bp2.port)
    assert await drain_queue(c2, "bounded.q") == []
    assert_clean(bp2)


# ------------------------------------------------------------- torn last record


async def test_torn_last_record_is_skipped_with_a_warning(
    procs: BrokerProcesses, clients: Clients, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    bp = await procs.start(data)
    c = await clients.connect(bp.port)
    s = await c.sender("torn.q")
    await send_all_accepted(s, 0, 10)
    assert await bp.crash() == -signal.SIGKILL

    segments = sorted((data / "journal").glob("segment-*.log"))
    assert segments, journal_files(data)
    last = segments[-1]
    size = last.stat().st_size
    with last.open("r+b") as f:
        f.truncate(size - 3)

    bp2 = await procs.start(data)
    line = (await bp2.wait_for_line(re.escape(str(last)), timeout=5)).string
    assert "WARNING" in line, line
    c2 = await clients.connect(bp2.port)
    got = await drain_queue(c2, "torn.q")
    assert [index(g) for g in got] == list(range(9))
    assert "Traceback" not in bp2.stderr, bp2.describe()
    # appending continues after the cut: a new message, another crash, all there
    s2 = await c2.sender("torn.q")
    await send_all_accepted(s2, 10, 11)
    assert await bp2.crash() == -signal.SIGKILL

    bp3 = await procs.start(data)
    c3 = await clients.connect(bp3.port)
    got = await drain_queue(c3, "torn.q")
    assert [index(g) for g in got] == [*range(9), 10]
    assert_clean(bp3)
    assert " WARNING " not in bp3.stderr, bp3.describe()


# ------------------------------------------------------------ one broker per dir


async def test_second_broker_on_same_data_dir_refuses_to_start(
    procs: BrokerProcesses, clients: Clients, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    bp = await procs.start(data)
    c = await clients.connect(bp.port)
    s = await c.sender("lock.q")
    await send_all_accepted(s, 0, 3)

    second = await procs.spawn(["run", "--port", "0", "--data-dir", str(data)])
    rc = await second.wait_exit(timeout=20)
    assert rc > 0, second.describe()
    assert str(data) in second.stderr, second.describe()
    assert "lock" in second.stderr.lower(), second.describe()
    assert "Traceback" not in second.stderr, second.describe()
    assert "listening on" not in second.stderr, second.describe()

    # the first broker is unharmed
    assert bp.running
    r = await c.receiver("lock.q", credit=3)
    assert [index(g) for g in await r.receive_n(3)] == [0, 1, 2]
