"""The delivery log's Parquet child process (issue 22): the files it writes, a child
that dies (restarted, the records in flight lost and counted), a child that keeps
dying (the log switched off with one ERROR line), the child stopping with its writer
and publishing its file when the broker dies."""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from amqbroker.core import delivery_log as dl
from amqbroker.core.entry import Entry
from amqbroker.pipeline import delivery_log_format as fmt
from amqbroker.store import delivery_log as mod
from amqbroker.store.delivery_log import DeliveryLogWriter
from tests.pipeline.test_delivery_log import read_log

pytest.importorskip("pyarrow.parquet")


def _writer(tmp_path: Path) -> DeliveryLogWriter:
    w = DeliveryLogWriter(
        tmp_path / "delivery-log",
        buffer_records=1000,
        clock=lambda: 1.5,
        message_id=lambda data: data.decode(),
    )
    w.open("w1")
    assert w._child is not None  # Parquet: written by a child process
    return w


def _events(w: DeliveryLogWriter, first: int, n: int) -> None:
    for i in range(first, first + n):
        w.event(dl.ROUTED, "q", Entry(f"id{i}".encode()))


def _kill_child(w: DeliveryLogWriter) -> None:
    child = w._child
    assert child is not None
    os.kill(child.pid, signal.SIGKILL)
    child._proc.wait()


def test_child_writes_the_same_records(tmp_path: Path) -> None:
    w = _writer(tmp_path)
    _events(w, 0, 10)
    w.set_owner_epoch(7)
    _events(w, 10, 5)
    w.write_batch(w.take_batch() or [])
    stats = w.statistics()
    assert stats["written"] == 16 and stats["files"] == 1
    child = w._child
    assert child is not None
    w.close()
    assert child._proc.returncode == 0  # stopped with its writer
    rows = read_log(tmp_path / "delivery-log" / "w1", markers=True)
    assert [r["seq"] for r in rows] == list(range(1, 17))
    assert rows[0]["event"] == "started"
    assert [r["owner_epoch"] for r in rows] == [0] * 11 + [7] * 5
    assert rows[1]["message_id"] == "id0" and rows[1]["ts_us"] == 1_500_000
    assert w.statistics()["bytes"] > 0


def test_a_child_dead_between_batches_is_restarted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    w = _writer(tmp_path)
    _events(w, 0, 10)
    w.write_batch(w.take_batch() or [])  # seq 1-11, in the child's unfinished file
    _kill_child(w)
    _events(w, 10, 10)
    with caplog.at_level(logging.ERROR, logger=mod.__name__):
        w.write_batch(w.take_batch() or [])  # a new child: repairs the .inprogress file
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "restarted" in errors[0], errors
    assert not w.off
    w.close()
    rows = read_log(tmp_path / "delivery-log" / "w1")
    # the dead child's unfinished file (no footer) is gone: the audit sees the gap
    assert [r["seq"] for r in rows] == list(range(12, 22))


def test_a_child_dying_during_a_write_loses_that_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = _writer(tmp_path)
    _events(w, 0, 5)
    w.write_batch(w.take_batch() or [])
    assert w.written == 6
    real = mod.ChildWriter.write
    _always_dying(monkeypatch)
    _events(w, 5, 5)
    with pytest.raises(OSError, match="died"):
        w.write_batch(w.take_batch() or [])  # the app logs it (ERROR) and counts it
    monkeypatch.setattr(mod.ChildWriter, "write", real)
    _events(w, 10, 5)
    w.write_batch(w.take_batch() or [])
    assert w.written == 11 and not w.off
    w.close()
    rows = read_log(tmp_path / "delivery-log" / "w1")
    assert [r["seq"] for r in rows] == list(range(12, 17))


def _always_dying(monkeypatch: pytest.MonkeyPatch) -> None:
    real = mod.ChildWriter.write

    def dying(self: mod.ChildWriter, epochs: Any, batch: Any) -> None:
        os.kill(self.pid, signal.SIGKILL)
        self._proc.wait()
        real(self, epochs, batch)

    monkeypatch.setattr(mod.ChildWriter, "write", dying)


def test_a_child_that_keeps_dying_switches_the_log_off(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = _writer(tmp_path)
    _always_dying(monkeypatch)
    with caplog.at_level(logging.ERROR, logger=mod.__name__):
        for attempt in range(w.child_failures):
            _events(w, 10 * attempt, 10)
            batch = w.take_batch() or []
            if attempt < w.child_failures - 1:
                with pytest.raises(OSError, match="died"):
                    w.write_batch(batch)  # the app logs these (ERROR, records lost)
            else:
                w.write_batch(batch)  # switched off: no exception, one ERROR line
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert w.off and w._child is None
    assert len(errors) == 1 and "switched off" in errors[0], errors
    # later records are counted, never buffered, never block producers
    before = w.dropped
    _events(w, 100, 50)
    assert w.pending == 0 and not w.full and w.dropped == before + 50
    assert w.take_batch() is None
    w.close()


def test_the_child_publishes_its_file_when_the_broker_dies(tmp_path: Path) -> None:
    w = _writer(tmp_path)
    _events(w, 0, 10)
    w.write_batch(w.take_batch() or [])
    child = w._child
    assert child is not None
    # what a dead parent leaves the child: the end of its input
    assert child._proc.stdin is not None
    child._proc.stdin.close()
    assert child._proc.wait(timeout=30) == 0
    child.kill()  # closes the parent's end of its output
    d = tmp_path / "delivery-log" / "w1"
    assert not list(d.glob("*" + fmt.INPROGRESS))
    assert [r["seq"] for r in read_log(d, markers=True)] == list(range(1, 12))
