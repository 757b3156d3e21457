"""The delivery log of a real broker over real sockets: every event written once, in
strictly increasing seq, across rotation, the disk bound and restarts; off by default
with nothing on disk. Plus the writer's overflow policies on their own."""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trio
from proton import Message

from amqbroker.app import BrokerApp
from amqbroker.core import delivery_log as dl
from amqbroker.core.entry import Entry
from amqbroker.pipeline import delivery_log_format as fmt
from amqbroker.settings import Settings
from amqbroker.store.delivery_log import DeliveryLogWriter
from tests.client import Client, wait_until
from tests.conftest import StoppableFactory
from tests.pipeline.conftest import require_module

pq = require_module("pyarrow.parquet")

Run = Callable[..., Awaitable[tuple[BrokerApp, trio.Event]]]


@pytest.fixture
def run(stoppable: StoppableFactory) -> Run:
    """Start a broker that the test can stop (and restart on the same data dir)."""
    return functools.partial(
        stoppable, node_id="n1", delivery_log=True, delivery_log_flush_interval=0.05
    )


async def stop(app: BrokerApp, done: trio.Event, clients: list[Client]) -> None:
    for c in clients:
        c.abort()
    app.request_shutdown()
    with trio.fail_after(10):
        await done.wait()


def read_log(directory: Path, markers: bool = False) -> list[dict[str, Any]]:
    """Every record of the complete files of one node, in file order (without the
    ``started`` / ``unbound`` markers unless `markers`)."""
    assert not list(directory.glob("*" + fmt.INPROGRESS)), "a file was left in progress"
    rows: list[dict[str, Any]] = []
    for p in sorted(directory.glob(fmt.PREFIX + "*")):
        if p.suffix == ".parquet":
            t = pq.read_table(p)
            assert t.schema.equals(fmt.arrow_schema()), t.schema
            part = t.to_pylist()
        else:
            part = [json.loads(line) for line in p.read_text().splitlines()]
            for r in part:
                assert tuple(r) == fmt.FIELD_NAMES
        assert part, f"{p.name} is empty"
        assert p.name == fmt.file_name(part[0]["seq"], p.suffix[1:]), p.name
        rows.extend(part)
    return rows if markers else [r for r in rows if r["event"] not in fmt.MARKERS]


def msg(mid: str, **kw: Any) -> Message:
    return Message(id=mid, body=mid, **kw)


def events_of(rows: list[dict[str, Any]], mid: str) -> list[tuple[Any, ...]]:
    return [(r["event"], r["queue"], r["outcome"]) for r in rows if r["message_id"] == mid]


@pytest.mark.parametrize("file_format", ["parquet", "jsonl"])
async def test_every_event_written_once(run: Run, tmp_path: Path, file_format: str) -> None:
    app, done = await run(delivery_log_format=file_format)
    port = app.listening[0][1]
    async with trio.open_nursery() as n:
        c = await Client.connect(port, nursery=n, container="audit-client")
        s = await c.sender("q1", name="tx")
        for i in range(3):
            await s.send(msg(f"m{i}", group_id="g", group_sequence=i + 1))
        r = await c.receiver("q1", credit=10, name="rx")
        got = await r.receive_n(3)
        r.accept(got[0])
        r.release(got[1])
        r.reject(got[2])
        again = await r.receive()
        assert again.message.id == "m1"
        r.accept(again)
        # expiry: a message whose ttl passes while no consumer is attached
        s2 = await c.sender("q2")
        await s2.send(msg("m3", ttl=0.001))
        await trio.sleep(0.05)
        r2 = await c.receiver("q2", credit=1)
        await r2.expect_none(0.2)
        # released without an outcome: a consumer that detaches with it unsettled
        await s.send(msg("m4"))
        r.flow(1)
        held = await r.receive()
        assert held.message.id == "m4"
        await r.close()
        r3 = await c.receiver("q1", credit=1)
        r3.accept(await r3.receive())
        await wait_until(lambda: app.broker is not None and app.broker.queues["q1"].count == 0)
        conn_id = next(iter(app.hub.drivers)).conn_id
        await stop(app, done, [c])
        n.cancel_scope.cancel()

    directory = tmp_path / "data" / "delivery-log" / "n1"
    every = read_log(directory, markers=True)
    seqs = [r["seq"] for r in every]
    assert seqs == list(range(1, len(every) + 1)), "seq must be contiguous and increasing"
    assert every[0]["event"] == "started"  # the boot marker
    rows = read_log(directory)
    ts = [r["ts_us"] for r in rows]
    assert ts == sorted(ts)
    assert {r["node"] for r in rows} == {"n1"}
    assert {r["owner_epoch"] for r in rows} == {0}
    assert set(r["event"] for r in rows) <= set(fmt.EVENTS)

    assert events_of(rows, "m0") == [
        ("received", "q1", None),
        ("routed", "q1", None),
        ("dispatched", "q1", None),
        ("settled", "q1", "accepted"),
    ]
    assert events_of(rows, "m1") == [
        ("received", "q1", None),
        ("routed", "q1", None),
        ("dispatched", "q1", None),
        ("settled", "q1", "released"),
        ("dispatched", "q1", None),
        ("settled", "q1", "accepted"),
    ]
    assert events_of(rows, "m2") == [
        ("received", "q1", None),
        ("routed", "q1", None),
        ("dispatched", "q1", None),
        ("settled", "q1", "rejected"),
        ("dead_lettered", "q1", None),
    ]
    assert events_of(rows, "m3") == [
        ("received", "q2", None),
        ("routed", "q2", None),
        ("expired", "q2", None),
    ]
    assert events_of(rows, "m4") == [
        ("received", "q1", None),
        ("routed", "q1", None),
        ("dispatched", "q1", None),
        ("released", "q1", None),
        ("dispatched", "q1", None),
        ("settled", "q1", "accepted"),
    ]
    assert len(rows) == 4 + 6 + 5 + 3 + 6

    by_mid = {r["message_id"]: r for r in rows if r["event"] == "received"}
    assert by_mid["m1"]["producer"] == f"{conn_id}/tx"
    assert by_mid["m1"]["group_id"] == "g"
    assert by_mid["m1"]["group_seq"] == 2
    assert by_mid["m4"]["group_id"] is None
    assert by_mid["m4"]["group_seq"] is None
    dispatched = [r for r in rows if r["event"] == "dispatched" and r["message_id"] == "m1"]
    assert [r["consumer"] for r in dispatched] == [f"{conn_id}/rx", f"{conn_id}/rx"]
    # the producer follows the message into its queue events
    assert {r["producer"] for r in rows if r["message_id"] == "m1"} == {f"{conn_id}/tx"}
    # and its identity across reconnects: the client's container-id and the link name
    assert {r["producer_identity"] for r in rows if r["message_id"] == "m1"} == {"audit-client/tx"}
    # delivery-count is that of the moment: the release did not count a failure
    assert [r["delivery_count"] for r in dispatched] == [0, 0]


async def test_rotation_bound_and_restart(run: Run, tmp_path: Path) -> None:
    settings = {
        "delivery_log_rotate_bytes": 4096,
        "delivery_log_max_bytes": 40_000,
        "delivery_log_format": "jsonl",
    }
    directory = tmp_path / "data" / "delivery-log" / "n1"
    total = 0
    for round_ in range(2):
        app, done = await run(**settings)
        async with trio.open_nursery() as n:
            c = await Client.connect(app.listening[0][1], nursery=n)
            s = await c.sender("rot")
            r = await c.receiver("rot", credit=1000, presettled=True)
            for batch in range(5):
                await s.send_many([msg(f"r{round_}-{batch}-{i}") for i in range(60)])
                await r.receive_n(60)
                # the writer takes this round's records as one batch: several files
                w = app.dlog
                assert w is not None
                await wait_until(lambda w=w: w.pending == 0)
            total += 5 * 60
            await stop(app, done, [c])
            n.cancel_scope.cancel()
    files = sorted(directory.glob(fmt.PREFIX + "*"))
    assert len(files) > 3
    assert sum(p.stat().st_size for p in files) <= 40_000
    rows = read_log(directory, markers=True)
    seqs = [r["seq"] for r in rows]
    assert seqs == sorted(set(seqs)), "seq strictly increasing across files and restarts"
    # each message: received, routed, dispatched, settled: 4 * total records were made,
    # and a started marker per boot; the oldest files are gone, the newest are complete
    assert seqs[0] > 1
    assert seqs[-1] == 4 * total + 2
    assert seqs == list(range(seqs[0], seqs[-1] + 1))
    assert rows[-1]["message_id"] == "r1-4-59"


async def test_off_by_default_creates_nothing(make_broker: Any, tmp_path: Path) -> None:
    app = await make_broker()
    assert Settings().delivery_log is False
    assert app.dlog is None and app.broker is not None and app.broker.dlog is None
    async with trio.open_nursery() as n:
        c = await Client.connect(app.listening[0][1], nursery=n)
        s = await c.sender("q")
        await s.send(msg("x"))
        r = await c.receiver("q", credit=1)
        r.accept(await r.receive())
        assert app.broker.queues["q"].dlog is None
        c.abort()
        n.cancel_scope.cancel()
    assert log_dirs(tmp_path) == []


def log_dirs(root: Path) -> list[Path]:
    assert (root / "data0" / "journal").is_dir()  # the broker did write its data dir
    return list(root.rglob(fmt.DIRECTORY))


async def test_parquet_crash_leftover_is_repaired(run: Run, tmp_path: Path) -> None:
    directory = tmp_path / "data" / "delivery-log" / "n1"
    directory.mkdir(parents=True)
    (directory / (fmt.file_name(1, "parquet") + fmt.INPROGRESS)).write_bytes(b"PAR1 torn")
    app, done = await run()
    async with trio.open_nursery() as n:
        c = await Client.connect(app.listening[0][1], nursery=n)
        s = await c.sender("q")
        await s.send(msg("after"))
        await stop(app, done, [c])
        n.cancel_scope.cancel()
    rows = read_log(directory)
    assert [r["event"] for r in rows] == ["received", "routed"]


async def test_block_overflow_holds_producer_credit(run: Run, tmp_path: Path) -> None:
    """A slow writer: the producer gets no credit while the buffer is full, and every
    record is written (nothing dropped)."""
    app, done = await run(
        delivery_log_format="jsonl", delivery_log_buffer_records=100, link_credit=100
    )
    w = app.dlog
    assert w is not None
    slow_write = w.write_batch
    blocked: list[int] = []
    # the worker thread is a disk that stalls until the buffer has filled and a
    # producer was held (bounded: a broker that never blocks fails the assertion below)
    filled = threading.Event()

    def write_batch(batch: Any) -> None:
        filled.wait(timeout=10)
        slow_write(batch)

    def block(producer: Any) -> None:
        blocked.append(w.pending)
        filled.set()
        DeliveryLogWriter.block(w, producer)

    w.write_batch = write_batch  # type: ignore[method-assign]
    w.block = block  # type: ignore[method-assign]
    async with trio.open_nursery() as n:
        c = await Client.connect(app.listening[0][1], nursery=n)
        s = await c.sender("slow")
        for k in range(12):  # (the test client flushes once per send_many)
            await s.send_many([msg(f"s{k}-{i}") for i in range(50)])
        await stop(app, done, [c])
        n.cancel_scope.cancel()
    assert blocked and min(blocked) >= 100
    rows = read_log(tmp_path / "data" / "delivery-log" / "n1")
    assert [r["seq"] for r in rows] == list(range(2, 1202))  # 1: the started marker
    assert w.dropped == 0


async def test_a_failed_write_loses_records_not_the_broker(run: Run, tmp_path: Path) -> None:
    app, done = await run(delivery_log_format="jsonl")
    w = app.dlog
    assert w is not None
    real = w.write_batch
    failures: list[int] = []

    def failing(batch: Any) -> None:
        if not failures:
            failures.append(batch.records())
            raise OSError(28, "No space left on device")
        real(batch)

    w.write_batch = failing  # type: ignore[method-assign]
    async with trio.open_nursery() as n:
        c = await Client.connect(app.listening[0][1], nursery=n)
        s = await c.sender("q")
        await s.send(msg("lost"))
        await wait_until(lambda: bool(failures))
        await s.send(msg("kept"))
        r = await c.receiver("q", credit=2)
        got = await r.receive_n(2)
        assert [x.message.id for x in got] == ["lost", "kept"]
        await stop(app, done, [c])
        n.cancel_scope.cancel()
    assert w.dropped == failures[0] == 3  # the started marker, received, routed
    rows = read_log(tmp_path / "data" / "delivery-log" / "n1")
    assert rows[0]["seq"] == 4 and rows[0]["message_id"] == "kept"


# ------------------------------------------------------------- the writer alone


class _Producer:
    def __init__(self) -> None:
        self.resumed = 0

    def resume(self) -> None:
        self.resumed += 1


def _new_writer(
    tmp_path: Path, file_format: str, overflow: str, child: bool | None = None
) -> DeliveryLogWriter:
    """A writer of 100 buffered records at clock 1.5 s whose message-id is the data
    (not opened)."""
    return DeliveryLogWriter(
        tmp_path / "delivery-log",
        file_format=file_format,
        buffer_records=100,
        overflow=overflow,
        clock=lambda: 1.5,
        message_id=lambda data: data.decode(),
        child=child,
    )


def _writer(tmp_path: Path, overflow: str) -> DeliveryLogWriter:
    w = _new_writer(tmp_path, "jsonl", overflow)
    w.open("w1")
    w.write_batch(w.take_batch() or [])  # the started marker (seq 1)
    return w


def test_drop_overflow_counts_and_leaves_a_gap(tmp_path: Path) -> None:
    w = _writer(tmp_path, "drop")
    for i in range(150):
        w.event(dl.ROUTED, "q", Entry(f"id{i}".encode()))
    assert w.pending == 100 and not w.full  # "drop" never holds producer credit
    assert w.dropped == 50
    batch = w.take_batch()
    assert batch is not None and batch.n_rows == 100
    w.write_batch(batch)
    w.event(dl.ROUTED, "q", Entry(b"late"))
    w.write_batch(w.take_batch() or [])
    w.close()
    rows = read_log(tmp_path / "delivery-log" / "w1")
    assert [r["seq"] for r in rows] == [*range(2, 102), 152]
    assert rows[0]["ts_us"] == 1_500_000 and rows[0]["message_id"] == "id0"
    assert w.statistics()["dropped"] == 50


def test_block_overflow_keeps_everything_and_resumes_producers(tmp_path: Path) -> None:
    w = _writer(tmp_path, "block")
    p = _Producer()
    for i in range(120):
        w.event(dl.ROUTED, "q", Entry(f"id{i}".encode()))
    assert w.full and w.dropped == 0
    w.block(p)
    batch = w.take_batch()
    assert p.resumed == 1 and not w.full
    assert batch is not None and batch.n_rows == 120
    w.close()


def test_event_codes_match_the_format() -> None:
    codes = {
        "received": dl.RECEIVED,
        "routed": dl.ROUTED,
        "forwarded": dl.FORWARDED,
        "dispatched": dl.DISPATCHED,
        "settled": dl.SETTLED,
        "released": dl.RELEASED,
        "expired": dl.EXPIRED,
        "dead_lettered": dl.DEAD_LETTERED,
        "started": dl.STARTED,
        "unbound": dl.UNBOUND,
        "late": dl.LATE,
    }
    assert {fmt.EVENTS[code]: code for code in codes.values()} == codes
    assert len(fmt.EVENTS) == len(codes)
    assert [f.name for f in fmt.arrow_schema()] == list(fmt.FIELD_NAMES)


def test_owner_epoch_follows_the_cluster_arbiter(tmp_path: Path) -> None:
    """Records carry the arbiter epoch current when they were recorded, also when the
    epoch changes between an event and the write of its batch (a failover)."""
    w = _writer(tmp_path, "block")
    w.event(dl.ROUTED, "q", Entry(b"a"))
    w.set_owner_epoch(3)
    w.event(dl.ROUTED, "q", Entry(b"b"))
    w.set_owner_epoch(3)  # unchanged: no new mark
    w.event(dl.ROUTED, "q", Entry(b"c"))
    w.set_owner_epoch(4)
    batch = w.take_batch()
    w.event(dl.ROUTED, "q", Entry(b"d"))
    w.write_batch(batch or [])
    w.write_batch(w.take_batch() or [])
    w.close()
    rows = read_log(tmp_path / "delivery-log" / "w1")
    assert [(r["message_id"], r["owner_epoch"]) for r in rows] == [
        ("a", 0),
        ("b", 3),
        ("c", 3),
        ("d", 4),
    ]


def test_markers_boot_and_unbound(tmp_path: Path) -> None:
    """Each open (a boot of the node) writes a ``started`` marker; the cluster's
    ``unbound`` marker names the released instance and the group; seq continues."""
    for _boot in range(2):
        w = _writer(tmp_path, "block")
        w.event(dl.ROUTED, "q", Entry(b"a"))
        w.marker(dl.UNBOUND, "node3/orders", "g1", dl.UNBIND_NODE_LOST)
        w.write_batch(w.take_batch() or [])
        w.close()
    rows = read_log(tmp_path / "delivery-log" / "w1", markers=True)
    assert [(r["seq"], r["event"], r["queue"], r["group_id"]) for r in rows] == [
        (1, "started", None, None),
        (2, "routed", "q", None),
        (3, "unbound", "node3/orders", "g1"),
        (4, "started", None, None),
        (5, "routed", "q", None),
        (6, "unbound", "node3/orders", "g1"),
    ]
    assert all(r["message_id"] is None for r in rows if r["event"] in fmt.MARKERS)
    assert rows[2]["group_seq"] is None and rows[2]["delivery_count"] is None
    # the reason of the release travels in the outcome column
    assert [r["outcome"] for r in rows if r["event"] == "unbound"] == ["node-lost"] * 2


@pytest.mark.parametrize("file_format", ["jsonl", "parquet"])
def test_seq_is_implicit_but_exact_around_drops_and_markers(
    tmp_path: Path, file_format: str
) -> None:
    """Records carry no seq of their own (`Batch`): a marker buffered after dropped
    records keeps the seq it was given, and the next batch continues after the gap."""
    if file_format == "parquet":
        pytest.importorskip("pyarrow.parquet")
    w = _new_writer(tmp_path, file_format, "drop")
    w.open("w1")  # started: seq 1
    for i in range(99):
        w.event(dl.ROUTED, "q", Entry(f"id{i}".encode()))  # seq 2-100
    w.event(dl.ROUTED, "q", Entry(b"dropped"))  # 101, dropped
    w.marker(dl.UNBOUND, "n/q", "g1", dl.UNBIND_IDLE)  # 102, kept
    w.event(dl.ROUTED, "q", Entry(b"dropped"))  # 103, dropped
    w.marker(dl.UNBOUND, "n/q", "g2", dl.UNBIND_IDLE)  # 104, kept
    assert w.statistics()["seq"] == 104
    w.set_owner_epoch(5)  # from 105 on
    batch = w.take_batch()
    assert batch is not None and batch.n_rows == 102
    w.event(dl.ROUTED, "q", Entry(b"next"))  # 105
    w.write_batch(batch)
    w.write_batch(w.take_batch() or [])
    w.close()
    rows = read_log(tmp_path / "delivery-log" / "w1", markers=True)
    assert [r["seq"] for r in rows] == [*range(1, 101), 102, 104, 105]
    assert [r["group_id"] for r in rows[-3:]] == ["g1", "g2", None]
    assert [r["owner_epoch"] for r in rows[-3:]] == [0, 0, 5]
    assert w.statistics()["dropped"] == 2


@pytest.mark.parametrize("file_format", ["jsonl", "parquet"])
def test_folded_records_take_the_seqs_of_the_records_they_stand_for(
    tmp_path: Path, file_format: str
) -> None:
    """A folded record (received + routed [+ dispatched], `accept`'s common arrival)
    takes two or three seqs in the buffer, in a drop, and in the file."""
    if file_format == "parquet":
        pytest.importorskip("pyarrow.parquet")
    w = _new_writer(tmp_path, file_format, "drop", child=False)
    w.open("w1")  # started: seq 1
    w.event(dl.RECEIVED_DISPATCHED, "q", Entry(b"a"))  # 2-4
    for i in range(97):
        w.event(dl.ROUTED, "q", Entry(f"id{i}".encode()))  # 5-101
    w.event(dl.RECEIVED_ROUTED, "q", Entry(b"b"))  # 102-103: the 100th buffered
    w.event(dl.RECEIVED_DISPATCHED, "q", Entry(b"dropped"))  # 104-106, dropped
    w.marker(dl.UNBOUND, "n/q", "g1", dl.UNBIND_IDLE)  # 107, kept
    assert w.statistics()["seq"] == 107
    assert w.dropped == 3
    batch = w.take_batch()
    assert batch is not None and batch.n_rows == 101 and batch.records() == 104
    w.event(dl.RECEIVED_ROUTED, "q", Entry(b"c"))  # 108-109
    w.write_batch(batch)
    w.write_batch(w.take_batch() or [])
    w.close()
    rows = read_log(tmp_path / "delivery-log" / "w1", markers=True)
    assert [r["seq"] for r in rows] == [*range(1, 104), 107, 108, 109]
    assert [(r["event"], r["message_id"]) for r in rows[1:4]] == [
        ("received", "a"),
        ("routed", "a"),
        ("dispatched", "a"),
    ]
    assert [(r["seq"], r["event"], r["message_id"]) for r in rows[-5:]] == [
        (102, "received", "b"),
        (103, "routed", "b"),
        (107, "unbound", None),
        (108, "received", "c"),
        (109, "routed", "c"),
    ]
    assert {r["ts_us"] for r in rows} == {1_500_000}
