"""The store writer loops (`amqbroker.store.writer`) with a disk that hangs: shutdown
bounds each write, abandons the one past its deadline, logs it and writes nothing
more; without a bound a slow write is waited for and settles its producers."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import pytest
import trio

from amqbroker.core.delivery_log import ROUTED
from amqbroker.store.delivery_log import FIELDS
from amqbroker.store.delivery_log import Batch as LogBatch
from amqbroker.store.writer import DeliveryLogLoop, StoreWriter


class Batch:
    records = 3
    sync_ms = 1.0


class FakeJournal:
    """One batch buffered; `write_batch` waits for `disk` (a hung disk until set)."""

    def __init__(self, disk: threading.Event) -> None:
        self.disk = disk
        self.batch_no = 2
        self.synced_batch_no = 1
        self.pending = True
        self.writes = 0

    def take_batch(self) -> Batch | None:
        if not self.pending:
            return None
        self.pending = False
        return Batch()

    def write_batch(self, batch: Batch) -> None:
        self.disk.wait(30)
        self.writes += 1

    def batch_done(self, batch: Batch) -> None:
        self.synced_batch_no = self.batch_no


class FakePager:
    pending = False
    unsynced = False

    def take(self) -> None:
        return None

    def cycle_done(self, cycle: int) -> None:
        pass


def _writer(journal: FakeJournal, settled: list[int]) -> StoreWriter:
    w = StoreWriter(
        journal,  # type: ignore[arg-type]
        FakePager(),  # type: ignore[arg-type]
        data_dir=Path("/nowhere"),
        sync=True,
        flush=lambda: None,
        wake_depage=lambda: None,
        on_failure=lambda: None,
    )
    w.settled = settled.append
    return w


async def test_a_hung_store_write_is_abandoned_at_the_shutdown_deadline(
    caplog: pytest.LogCaptureFixture,
) -> None:
    disk = threading.Event()
    j = FakeJournal(disk)
    settled: list[int] = []
    w = _writer(j, settled)
    assert w.ticket() == 1
    w.bound_writes(0.2)
    try:
        with trio.fail_after(5):
            await w.final_flush()
    finally:
        disk.set()  # let the abandoned worker thread end
    assert w.abandoned and not w.failed
    assert settled == []  # its producers were not told their messages are stored
    assert "abandoned store cycle 1 (3 journal record(s))" in caplog.text
    # nothing more is written to an abandoned store
    j.pending = True
    assert not await w.commit_one()


async def test_without_a_bound_a_slow_store_write_is_waited_for() -> None:
    disk = threading.Event()
    j = FakeJournal(disk)
    settled: list[int] = []
    w = _writer(j, settled)

    async def slow_disk() -> None:
        await trio.sleep(0.3)
        disk.set()

    async with trio.open_nursery() as n:
        n.start_soon(slow_disk)
        await w.final_flush()
    assert not w.abandoned and j.writes == 1
    assert settled == [1] and w.cycle_done == 1


class FakeDeliveryLog:
    def __init__(self, disk: threading.Event) -> None:
        self.disk = disk
        self.wake: Any = None
        self.take_at = 10
        self.dropped = 0
        self.directory = Path("/nowhere/delivery-log")
        self.buf = LogBatch([0.0, ROUTED, *[None] * (FIELDS - 2)] * 4)
        self.closed = False

    @property
    def pending(self) -> int:
        return self.buf.n_rows

    def take_batch(self) -> LogBatch | None:
        batch, self.buf = self.buf, LogBatch()
        return batch if batch.values else None

    def write_batch(self, batch: list[Any]) -> None:
        self.disk.wait(30)

    def close(self) -> None:
        self.closed = True


async def test_a_hung_delivery_log_write_is_abandoned_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR)
    disk = threading.Event()
    dl = FakeDeliveryLog(disk)
    loop = DeliveryLogLoop(dl, flush_interval=1.0, flush=lambda: None)  # type: ignore[arg-type]
    assert dl.wake is not None  # the loop wakes itself at a quarter full
    loop.bound_writes(0.2)
    try:
        with trio.fail_after(5):
            await loop.final_flush()
    finally:
        disk.set()
    assert loop.abandoned and dl.dropped == 4 and not dl.closed
    assert "abandoned 4 record(s)" in caplog.text
