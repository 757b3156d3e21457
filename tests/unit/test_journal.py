"""Tests for the durable journal (amqbroker.store.journal / records)."""

from __future__ import annotations

import logging
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from amqbroker.core.entry import Entry
from amqbroker.store import journal_compaction, records
from amqbroker.store.journal import (
    Journal,
    JournalError,
    JournalLockedError,
    Recovered,
    segment_path,
)
from tests.unit.journal_crash_child import expected_fields

if TYPE_CHECKING:
    from collections.abc import Iterable

HERE = Path(__file__).resolve().parent

LOGGER = "amqbroker.store.journal"


# --------------------------------------------------------------------------- helpers


def entry(seq: int, data: bytes = b"", **kw: Any) -> Entry:
    e = Entry(data or f"message {seq}".encode(), durable=kw.pop("durable", True), **kw)
    e.seq = seq
    return e


def commit(j: Journal) -> int:
    """Drive group commit until nothing is buffered; returns the number of batches."""
    n = 0
    while (b := j.take_batch()) is not None:
        j.write_batch(b)
        j.batch_done(b)
        n += 1
    return n


def open_journal(path: Path, **kw: Any) -> tuple[Journal, Recovered]:
    kw.setdefault("sync", False)
    j = Journal(path, **kw)
    return j, j.open()


def state(rec: Recovered) -> dict[int, list[tuple[Any, ...]]]:
    return {q.qid: [fields(e) for e in q.entries] for q in rec.queues}


def fields(e: Entry) -> tuple[Any, ...]:
    return (e.seq, e.data, e.priority, e.expiry, e.group_id, e.group_seq, e.delivery_count)


def model_state(model: dict[int, dict[int, Entry]]) -> dict[int, list[tuple[Any, ...]]]:
    return {qid: [fields(m[s]) for s in sorted(m)] for qid, m in model.items()}


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.glob("segment-*.log"))


def segments(path: Path) -> list[Path]:
    return sorted(path.glob("segment-*.log"))


def snapshot(src: Path, dst: Path) -> Path:
    """What a crash at this instant leaves on disk (page cache included)."""
    dst.mkdir(parents=True)
    for p in segments(src):
        shutil.copyfile(p, dst / p.name)
    return dst


def record_offsets(path: Path) -> list[tuple[int, int, bytes]]:
    data = path.read_bytes()
    reader = records.SegmentReader(data)
    out = [(off, rtype, bytes(p)) for off, rtype, p in reader.records()]
    assert reader.problem is None
    return out


# --------------------------------------------------------------------------- round trips


def test_round_trip_all_fields(tmp_path: Path) -> None:
    j, rec = open_journal(tmp_path)
    assert rec.queues == [] and rec.max_qid == 0 and rec.torn_records == 0
    j.queue_declared(2, "orders", {"durable": True, "max": 10, "nested": {"a": [1, 2]}})
    j.queue_declared(1, "événements", {})
    e1 = entry(1, b"\x00\x01binary\xff", priority=9, expiry=1_700_000_000_123, group_id="g1")
    e1.group_seq = -1
    e2 = entry(2, b"", priority=0, group_id="grüppe", group_seq=2**31 - 1)
    e3 = entry(3, b"x" * 5000)
    e4 = entry(7, b"later", delivery_count=3)
    for e in (e1, e2, e3, e4):
        j.message_added(2, e)
    f1 = entry(10, b"other queue")
    j.message_added(1, f1)
    commit(j)
    e3.delivery_count = 5
    j.delivery_count_updated(2, e3)
    j.message_acked(2, e2)
    commit(j)
    j.close()

    j, rec = open_journal(tmp_path)
    assert [q.qid for q in rec.queues] == [1, 2]
    q1, q2 = rec.queues
    assert (q1.name, q1.attributes) == ("événements", {})
    assert (q2.name, q2.attributes) == (
        "orders",
        {"durable": True, "max": 10, "nested": {"a": [1, 2]}},
    )
    assert [fields(e) for e in q2.entries] == [fields(e) for e in (e1, e3, e4)]
    assert [fields(e) for e in q1.entries] == [fields(f1)]
    assert all(e.durable and e.store_ref > 0 for q in rec.queues for e in q.entries)
    assert rec.max_qid == 2 and rec.torn_records == 0
    j.close()


def test_recovered_entries_can_be_acked_and_counted(tmp_path: Path) -> None:
    j, _ = open_journal(tmp_path)
    j.queue_declared(1, "q", {})
    for s in range(1, 6):
        j.message_added(1, entry(s))
    commit(j)
    j.close()

    j, rec = open_journal(tmp_path)
    es = rec.queues[0].entries
    j.message_acked(1, es[0])
    es[1].delivery_count = 4
    j.delivery_count_updated(1, es[1])
    j.message_added(1, es[2])  # re-enqueueing a recovered entry writes nothing
    assert j.statistics()["buffered_records"] == 2
    commit(j)
    j.close()

    j, rec = open_journal(tmp_path)
    assert [(e.seq, e.delivery_count) for e in rec.queues[0].entries] == [
        (2, 4),
        (3, 0),
        (4, 0),
        (5, 0),
    ]
    j.close()


def test_non_durable_and_unknown_messages_write_nothing(tmp_path: Path) -> None:
    j, _ = open_journal(tmp_path)
    j.queue_declared(1, "q", {})
    commit(j)
    n = entry(1, durable=False)
    j.message_added(1, n)
    j.delivery_count_updated(1, n)
    j.message_acked(1, n)
    j.message_acked(1, entry(99))
    j.queue_deleted(42)
    assert j.take_batch() is None
    assert j.batch_no == j.synced_batch_no  # nothing to wait for
    with pytest.raises(JournalError, match="never declared"):
        j.message_added(5, entry(1))
    j.close()


def test_queue_delete_drops_messages_and_later_acks(tmp_path: Path) -> None:
    j, _ = open_journal(tmp_path, segment_size=300)
    j.queue_declared(1, "a", {})
    j.queue_declared(2, "b", {})
    a = [entry(s) for s in range(1, 20)]
    b = [entry(s) for s in range(1, 5)]
    for e in a:
        j.message_added(1, e)
    for e in b:
        j.message_added(2, e)
    commit(j)
    j.queue_deleted(1)
    j.message_acked(1, a[0])  # after the delete: ignored
    j.message_acked(2, b[1])
    commit(j)
    assert j.statistics()["live_records"] == 1 + 3  # queue b + its 3 messages
    j.close()

    j, rec = open_journal(tmp_path)
    assert [q.qid for q in rec.queues] == [2]
    assert [e.seq for e in rec.queues[0].entries] == [1, 3, 4]
    assert rec.max_qid == 2
    j.close()


def test_redeclare_updates_attributes(tmp_path: Path) -> None:
    j, _ = open_journal(tmp_path)
    j.queue_declared(1, "q", {"v": 1})
    j.message_added(1, entry(1))
    j.queue_declared(1, "q", {"v": 2})
    commit(j)
    assert j.statistics()["live_records"] == 2
    j.close()
    j, rec = open_journal(tmp_path)
    assert rec.queues[0].attributes == {"v": 2}
    assert [e.seq for e in rec.queues[0].entries] == [1]
    j.close()


def test_many_segments_and_acks_across_segments(tmp_path: Path) -> None:
    # no compaction: everything stays on disk
    kw: dict[str, Any] = {"segment_size": 512, "compact_min_bytes": 1 << 30}
    j, _ = open_journal(tmp_path, **kw)
    j.queue_declared(1, "q", {})
    model: dict[int, Entry] = {}
    for s in range(1, 301):
        e = entry(s, os.urandom(20 + s % 50))
        j.message_added(1, e)
        model[s] = e
        if s % 3 == 0:
            commit(j)
    commit(j)
    assert len(segments(tmp_path)) > 20
    # ack every other message, in random order, in a few batches
    seqs = list(model)[::2]
    random.Random(3).shuffle(seqs)
    for i, s in enumerate(seqs):
        j.message_acked(1, model.pop(s))
        if i % 17 == 0:
            commit(j)
    commit(j)
    j.close()

    j, rec = open_journal(tmp_path, **kw)
    assert [fields(e) for e in rec.queues[0].entries] == [fields(model[s]) for s in sorted(model)]
    assert rec.torn_records == 0
    j.close()


def test_seq_order_restored_regardless_of_add_order(tmp_path: Path) -> None:
    j, _ = open_journal(tmp_path)
    j.queue_declared(1, "q", {})
    for s in (5, 3, 9, 1):
        j.message_added(1, entry(s))
    commit(j)
    j.close()
    j, rec = open_journal(tmp_path)
    assert [e.seq for e in rec.queues[0].entries] == [1, 3, 5, 9]
    j.close()


# --------------------------------------------------------------------------- group commit


def test_group_commit_one_batch_for_many_appends(tmp_path: Path) -> None:
    j, _ = open_journal(tmp_path)
    j.queue_declared(1, "q", {})
    first = j.batch_no
    assert j.synced_batch_no == first - 1
    nos = set()
    for s in range(1, 501):
        j.message_added(1, entry(s, b"x" * 150))
        nos.add(j.batch_no)
    assert nos == {first}
    b = j.take_batch()
    assert b is not None and b.records == 501 and b.closes == first
    # appends made while the batch is being written go to the next one
    j.message_added(1, entry(501))
    assert j.batch_no == first + 1
    with pytest.raises(JournalError):
        j.take_batch()  # one outstanding batch at a time
    j.write_batch(b)
    assert j.batch_done(b) == first == j.synced_batch_no
    b2 = j.take_batch()
    assert b2 is not None and b2.records == 1 and b2.closes == first + 1
    j.write_batch(b2)
    j.batch_done(b2)
    assert j.take_batch() is None
    st = j.statistics()
    assert st["batches_written"] == 2 and st["records_written"] == 502
    assert st["last_batch_records"] == 1
    j.close()


def test_max_batch_bytes_splits_and_batch_number_completes_with_last_piece(
    tmp_path: Path,
) -> None:
    j, _ = open_journal(tmp_path, max_batch_bytes=1000)
    j.queue_declared(1, "q", {})
    commit(j)
    no = j.batch_no + 1
    for s in range(1, 41):
        j.message_added(1, entry(s, b"y" * 100))  # 150-byte records: 6 fit in 1000
    assert j.batch_no == no
    pieces = []
    while True:
        b = j.take_batch()
        assert b is not None
        assert b.nbytes <= 1000
        pieces.append(b.records)
        if len(pieces) == 2:
            j.message_added(1, entry(100))  # lands in the next batch number
            assert j.batch_no == no + 1
        j.write_batch(b)
        j.batch_done(b)
        if b.closes:
            break
        assert j.synced_batch_no == no - 1  # not before the piece with its last record
    # the last piece finished batch `no` and, as it fit, the record appended meanwhile
    assert b.closes == no + 1 == j.synced_batch_no
    assert pieces == [6, 6, 6, 6, 6, 6, 5]
    assert j.take_batch() is None
    j.close()
    j, rec = open_journal(tmp_path)
    assert [e.seq for e in rec.queues[0].entries] == [*range(1, 41), 100]
    j.close()


def test_oversized_record_goes_out_alone(tmp_path: Path) -> None:
    j, _ = open_journal(tmp_path, max_batch_bytes=100, segment_size=1000)
    j.queue_declared(1, "q", {})
    big = entry(1, b"z" * 5000)
    j.message_added(1, big)
    commit(j)
    j.close()
    j, rec = open_journal(tmp_path)
    assert rec.queues[0].entries[0].data == big.data
    j.close()


def test_sync_true_writes_and_measures(tmp_path: Path) -> None:
    j, _ = open_journal(tmp_path, sync=True, segment_size=4096)
    j.queue_declared(1, "q", {})
    for s in range(1, 100):
        j.message_added(1, entry(s, b"s" * 150))
    commit(j)
    st = j.statistics()
    assert st["last_sync_ms"] >= 0 and st["segments"] >= 2
    j.close()
    j, rec = open_journal(tmp_path, sync=True)
    assert len(rec.queues[0].entries) == 99
    j.close()


# --------------------------------------------------------------------------- torn / corrupt


def _write_base(path: Path) -> tuple[list[Entry], Path]:
    """Two segments; the last holds several records, the final one an ADD of seq 9."""
    j, _ = open_journal(path, segment_size=700, compact_min_bytes=1 << 30)
    j.queue_declared(1, "q", {})
    es = [entry(s, f"payload-{s}-".encode() * 5) for s in range(1, 10)]
    for e in es:
        j.message_added(1, e)
        commit(j)
    j.close()
    segs = segments(path)
    assert len(segs) >= 2 and len(record_offsets(segs[-1])) >= 2
    return es, segs[-1]


def test_torn_tail_at_every_offset(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    base = tmp_path / "base"
    es, last = _write_base(base)
    data = last.read_bytes()
    start = record_offsets(last)[-1][0]
    expected = [fields(e) for e in es[:-1]]
    for cut in range(start, len(data)):
        d = tmp_path / f"cut{cut}"
        snapshot(base, d)
        (d / last.name).write_bytes(data[:cut])
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            j, rec = open_journal(d)
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
        if cut == start:
            assert warnings == [] and rec.torn_records == 0
        else:
            assert len(warnings) == 1, cut
            w = warnings[0]
            assert w.levelno == logging.WARNING
            assert last.name in w.getMessage() and f"offset {start}" in w.getMessage()
            assert rec.torn_records == 1
        assert [fields(e) for e in rec.queues[0].entries] == expected
        assert (d / last.name).stat().st_size == start
        if cut % 7 == 0:  # the journal keeps working after the truncation
            e = entry(50)
            j.message_added(1, e)
            commit(j)
            j.close()
            j, rec = open_journal(d)
            assert [fields(x) for x in rec.queues[0].entries] == [*expected, fields(e)]
            assert rec.torn_records == 0
        j.close()
        shutil.rmtree(d)


def test_crc_failure_in_last_record_is_torn(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    es, last = _write_base(tmp_path)
    start = record_offsets(last)[-1][0]
    data = bytearray(last.read_bytes())
    for pos in (start + 4, start + 8, start + 20, len(data) - 1):  # crc, type, payload
        bad = bytearray(data)
        bad[pos] ^= 0x40
        last.write_bytes(bad)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            j, rec = open_journal(tmp_path)
        assert [r.levelname for r in caplog.records] == ["WARNING"]
        assert [e.seq for e in rec.queues[0].entries] == [e.seq for e in es[:-1]]
        j.close()
        last.write_bytes(data)


def test_zero_filled_tail_is_torn(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    es, last = _write_base(tmp_path)
    size = last.stat().st_size
    with last.open("ab") as f:
        f.write(bytes(4096))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        j, rec = open_journal(tmp_path)
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert len(rec.queues[0].entries) == len(es)
    assert last.stat().st_size == size
    j.close()


def test_torn_segment_header_of_new_segment(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    es, last = _write_base(tmp_path)
    nxt = segment_path(tmp_path, int(last.name[8:16]) + 1)
    for content in (b"", records.segment_header(99)[:7]):
        nxt.write_bytes(content)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            j, rec = open_journal(tmp_path)
        assert [r.levelname for r in caplog.records] == ["WARNING"]
        assert not nxt.exists()
        assert len(rec.queues[0].entries) == len(es)
        j.close()


def test_corruption_in_older_segment(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    kw: dict[str, Any] = {"segment_size": 1000, "compact_min_bytes": 1 << 30}
    j, _ = open_journal(tmp_path, **kw)
    j.queue_declared(1, "q", {})
    for s in range(1, 61):
        j.message_added(1, entry(s, f"data-{s}-".encode() * 8))
        if s % 4 == 0:
            commit(j)
    commit(j)
    j.close()
    segs = segments(tmp_path)
    assert len(segs) >= 4
    first = segs[0]
    recs = record_offsets(first)
    adds = [
        (off, records.decode_add(memoryview(p))[1].seq) for off, t, p in recs if t == records.ADD2
    ]
    mid = len(adds) // 2
    bad_off = adds[mid][0]
    data = bytearray(first.read_bytes())
    data[bad_off + 30] ^= 0xFF
    first.write_bytes(data)

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        j, rec = open_journal(tmp_path, **kw)
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and not [r for r in caplog.records if r.levelno == logging.WARNING]
    msg = errors[0].getMessage()
    assert first.name in msg and f"offset {bad_off}" in msg
    lost = {seq for _, seq in adds[mid:]}
    assert [e.seq for e in rec.queues[0].entries] == [s for s in range(1, 61) if s not in lost]
    assert rec.torn_records == 1
    j.close()


def test_damaged_older_segment_is_set_aside_not_deleted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    j, _ = open_journal(tmp_path, segment_size=500, compact_min_bytes=1 << 30)
    j.queue_declared(1, "q", {})
    commit(j)  # the QUEUE record alone in segment 1 ...
    j.message_added(1, entry(1, b"a" * 600))  # ... as this does not fit
    j.message_added(1, entry(2, b"b" * 600))
    commit(j)
    j.close()
    first = segments(tmp_path)[0]
    data = bytearray(first.read_bytes())
    data[0] ^= 0xFF  # bad magic
    first.write_bytes(data)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        j, rec = open_journal(tmp_path)
        # the QUEUE record is gone with the segment: its messages are orphans
        assert [r.levelname for r in caplog.records] == ["ERROR", "WARNING"]
        assert "no QUEUE record" in caplog.records[1].getMessage()
        assert rec.queues == [] and rec.torn_records == 1
        commit(j)  # compaction reaches the damaged segment (no live records)
    assert not first.exists()
    assert first.with_name(first.name + ".corrupt").read_bytes() == data
    assert "kept as" in caplog.records[-1].getMessage()
    j.close()


def test_corruption_in_middle_of_last_segment_keeps_data_and_rolls(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    kw: dict[str, Any] = {"segment_size": 1 << 20, "compact_min_bytes": 1 << 30}
    j, _ = open_journal(tmp_path, **kw)
    j.queue_declared(1, "q", {})
    for s in range(1, 11):
        j.message_added(1, entry(s))
    commit(j)
    j.close()
    (seg,) = segments(tmp_path)
    recs = record_offsets(seg)
    off = recs[5][0]
    data = bytearray(seg.read_bytes())
    data[off + 12] ^= 1
    seg.write_bytes(data)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        j, rec = open_journal(tmp_path, **kw)
    assert [r.levelname for r in caplog.records] == ["ERROR"]
    assert seg.stat().st_size == len(data)  # left for inspection, not truncated
    assert [e.seq for e in rec.queues[0].entries] == [1, 2, 3, 4]
    j.message_added(1, entry(20))
    commit(j)
    j.close()
    assert len(segments(tmp_path)) == 2
    caplog.clear()
    j, rec = open_journal(tmp_path, **kw)
    assert [e.seq for e in rec.queues[0].entries] == [1, 2, 3, 4, 20]
    j.close()


def test_undecodable_payload_with_valid_crc_is_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    j, _ = open_journal(tmp_path)
    j.queue_declared(1, "q", {})
    j.message_added(1, entry(1))
    commit(j)
    j.close()
    (seg,) = segments(tmp_path)
    payload = b"\x01\x02"  # an ACK with a short payload
    bogus = (
        len(payload).to_bytes(4, "little")
        + zlib.crc32(bytes([records.ACK]) + payload).to_bytes(4, "little")
        + bytes([records.ACK])
        + payload
    )
    unknown = (
        (0).to_bytes(4, "little") + zlib.crc32(bytes([77])).to_bytes(4, "little") + bytes([77])
    )
    with seg.open("ab") as f:
        f.write(bogus + unknown + records.encode_ack(1, 1))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        j, rec = open_journal(tmp_path)
    assert [r.levelname for r in caplog.records] == ["ERROR", "ERROR"]
    assert rec.torn_records == 2
    assert rec.queues[0].entries == []  # the ACK after the bad records was applied
    j.close()


# --------------------------------------------------------------------------- compaction


def _workload_step(
    j: Journal,
    model: dict[int, dict[int, Entry]],
    rng: random.Random,
    next_seq: dict[int, int],
    pinned: set[tuple[int, int]],
) -> None:
    qid = rng.choice(list(model))
    seq = next_seq[qid]
    next_seq[qid] += 1
    e = entry(seq, os.urandom(rng.randint(10, 200)), group_id=rng.choice([None, "g"]))
    j.message_added(qid, e)
    model[qid][seq] = e
    if rng.random() < 0.01:
        pinned.add((qid, seq))  # never acked: must survive every relocation
    if rng.random() < 0.2:
        q = rng.choice(list(model))
        if model[q]:
            victim = model[q][rng.choice(list(model[q]))]
            victim.delivery_count += 1
            j.delivery_count_updated(q, victim)
    for _ in range(rng.choice([0, 1, 1, 1, 2])):
        q = rng.choice(list(model))
        candidates = [s for s in model[q] if (q, s) not in pinned]
        if len(candidates) > 5:
            s = rng.choice(candidates)
            j.message_acked(q, model[q].pop(s))


def test_compaction_keeps_disk_bounded_and_recovers_exactly(tmp_path: Path) -> None:
    kw: dict[str, Any] = {
        "segment_size": 4096,
        "compact_min_bytes": 16384,
        "max_batch_bytes": 2048,
    }
    j, _ = open_journal(tmp_path, **kw)
    model: dict[int, dict[int, Entry]] = {1: {}, 2: {}, 3: {}}
    for qid in model:
        j.queue_declared(qid, f"q{qid}", {"i": qid})
    next_seq = dict.fromkeys(model, 1)
    pinned: set[tuple[int, int]] = set()
    rng = random.Random(7)
    peak = 0
    for i in range(6000):
        _workload_step(j, model, rng, next_seq, pinned)
        if i % 5 == 0:
            commit(j)
            live = j.statistics()["live_bytes"]
            size = dir_bytes(tmp_path)
            peak = max(peak, size)
            assert size <= 16384 + 4 * 4096 + 2 * live, (i, size, live)
    commit(j)
    st = j.statistics()
    assert st["segments_deleted"] > 50 and st["records_relocated"] > 100
    assert st["bytes"] == dir_bytes(tmp_path)
    written = st["bytes_written"]
    assert written > 10 * peak  # lots of traffic went through a small directory
    j.close()

    j, rec = open_journal(tmp_path, **kw)
    assert state(rec) == model_state(model)
    assert all(s in {e.seq for e in rec.queues[q - 1].entries} for q, s in pinned)
    assert rec.torn_records == 0
    j.close()


def test_dead_segments_are_deleted_even_below_threshold(tmp_path: Path) -> None:
    j, _ = open_journal(tmp_path, segment_size=1024, compact_min_bytes=1 << 30)
    j.queue_declared(1, "q", {})
    es = [entry(s, b"d" * 100) for s in range(1, 60)]
    for e in es:
        j.message_added(1, e)
    commit(j)
    j.queue_declared(1, "q", {"moved": True})  # QUEUE record moves to the head
    for e in es:
        j.message_acked(1, e)
    commit(j)
    # only the segment holding the QUEUE record and the newer (ACK) ones remain
    assert len(segments(tmp_path)) <= 3 and dir_bytes(tmp_path) < 3 * 1024
    assert j.statistics()["segments_deleted"] >= 8
    j.close()
    j, rec = open_journal(tmp_path)
    assert rec.queues[0].entries == [] and rec.queues[0].attributes == {"moved": True}
    j.close()


def test_long_lived_message_does_not_pin_the_journal(tmp_path: Path) -> None:
    kw: dict[str, Any] = {"segment_size": 2048, "compact_min_bytes": 8192}
    j, _ = open_journal(tmp_path, **kw)
    j.queue_declared(1, "q", {})
    # the oldest segment is mostly live forever
    old = [entry(s, b"o" * 300) for s in range(1, 6)]
    for e in old:
        j.message_added(1, e)
    commit(j)
    for s in range(100, 3000):
        e = entry(s, b"n" * 100)
        j.message_added(1, e)
        j.message_acked(1, e)
        if s % 10 == 0:
            commit(j)
            assert dir_bytes(tmp_path) < 8192 + 4 * 2048 + 4 * 1600
    commit(j)
    j.close()
    j, rec = open_journal(tmp_path, **kw)
    assert [fields(e) for e in rec.queues[0].entries] == [fields(e) for e in old]
    j.close()


def newest_add_segment(directory: Path) -> dict[tuple[int, int], int]:
    """(qid, seq) -> number of the newest segment holding an ADD record for it."""
    out: dict[tuple[int, int], int] = {}
    for p in segments(directory):
        for _, rtype, payload in record_offsets(p):
            if rtype == records.ADD2:
                qid, e = records.decode_add(memoryview(payload))
                out[(qid, e.seq)] = int(p.name[8:16])
    return out


def test_crash_during_compaction_loses_and_resurrects_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # small relocation steps and batches, so that crashes hit a half-relocated segment
    # and relocations whose records are spread over several batches
    monkeypatch.setattr(journal_compaction, "_RELOCATE_RECORDS", 1)
    kw: dict[str, Any] = {"segment_size": 4096, "compact_min_bytes": 12288, "max_batch_bytes": 400}
    live_dir = tmp_path / "live"
    j, _ = open_journal(live_dir, **kw)
    model: dict[int, dict[int, Entry]] = {1: {}, 2: {}}
    for qid in model:
        j.queue_declared(qid, f"q{qid}", {})
    next_seq = dict.fromkeys(model, 1)
    pinned: set[tuple[int, int]] = set()
    rng = random.Random(11)
    snaps: list[tuple[Path, dict[int, list[tuple[Any, ...]]], str]] = []
    for i in range(3000):
        _workload_step(j, model, rng, next_seq, pinned)
        if i % 10:
            continue
        user_batch = j.batch_no
        while (b := j.take_batch()) is not None:
            j.write_batch(b)
            j.batch_done(b)
            if j.synced_batch_no < user_batch:
                continue  # the model is exact only once the user's records are synced
            st = j.statistics()
            phase = (
                "relocating"
                if st["compacting_segment"]
                else "awaiting-delete"
                if st["segments_awaiting_delete"]
                else ""
            )
            if phase and len(snaps) < 60 and rng.random() < 0.3:
                d = snapshot(live_dir, tmp_path / f"snap{len(snaps)}")
                snaps.append((d, model_state(model), phase))
    commit(j)
    j.close()
    phases = {p for _, _, p in snaps}
    assert phases == {"relocating", "awaiting-delete"}

    for d, expected, _ in snaps:
        newest = newest_add_segment(d)
        # (no relocation at open, so that store_ref is what replay decided)
        jj, rec = open_journal(d, **{**kw, "compact_min_bytes": 1 << 30})
        assert state(rec) == expected, d
        assert rec.torn_records == 0
        # a relocated copy supersedes the original
        bad = [
            (q.qid, e.seq, e.store_ref, newest[(q.qid, e.seq)])
            for q in rec.queues
            for e in q.entries
            if e.store_ref != newest[(q.qid, e.seq)]
        ]
        assert not bad, (bad, [p.name for p in segments(d)])
        jj.close()

    # carry on from a snapshot holding both the old segment and the relocated copies
    d, expected, _ = next(s for s in snaps if s[2] == "awaiting-delete")
    oldest = segments(d)[0]
    jj, rec = open_journal(d, **kw)
    commit(jj)
    assert not oldest.exists()  # all its records were superseded: deleted right away
    m2 = {q.qid: {e.seq: e for e in q.entries} for q in rec.queues}
    seqs = {q: max(m, default=0) + 1000 for q, m in m2.items()}
    for _ in range(500):
        _workload_step(jj, m2, rng, seqs, set())
        commit(jj)
    jj.close()
    jj, rec = open_journal(d, **kw)
    assert state(rec) == model_state(m2)
    jj.close()


# --------------------------------------------------------------------------- lock


def test_second_open_is_refused_with_clear_error(tmp_path: Path) -> None:
    j, _ = open_journal(tmp_path)
    with pytest.raises(JournalLockedError) as info:
        Journal(tmp_path).open()
    msg = str(info.value)
    assert str(tmp_path) in msg and f"pid {os.getpid()}" in msg and "stop" in msg
    j.close()
    j2, _ = open_journal(tmp_path)  # released on close
    j2.close()


def test_open_creates_directory(tmp_path: Path) -> None:
    d = tmp_path / "a" / "b"
    j, rec = open_journal(d)
    assert d.is_dir() and rec.queues == []
    j.close()


# --------------------------------------------------------------------------- crash safety


class _Lines:
    """Line reader on a pipe with a deadline per line (select, never sleep)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buf = b""
        self.eof = False

    def readline(self, timeout: float) -> str | None:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            if self.eof:
                return None
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("crash child produced no output in time")
            ready, _, _ = select.select([self.fd], [], [], remaining)
            if ready:
                chunk = os.read(self.fd, 1 << 16)
                if chunk:
                    self.buf += chunk
                else:
                    self.eof = True
        line, _, self.buf = self.buf.partition(b"\n")
        return line.decode()

    def rest(self, timeout: float) -> Iterable[str]:
        while (line := self.readline(timeout)) is not None:
            yield line


def _check_recovered(
    directory: Path,
    base: set[tuple[int, int]],
    lines: list[str],
) -> set[tuple[int, int]]:
    added: set[tuple[int, int]] = set()
    ack_recorded: set[tuple[int, int]] = set()
    ack_synced: set[tuple[int, int]] = set()
    dcounts: dict[tuple[int, int], int] = {}
    for line in lines:
        kind, *rest = line.split()
        if kind == "READY":
            continue
        key = (int(rest[0]), int(rest[1]))
        if kind == "A":
            added.add(key)
        elif kind == "R":
            ack_recorded.add(key)
        elif kind == "K":
            ack_synced.add(key)
        elif kind == "D":
            dcounts[key] = int(rest[2])
        else:
            raise AssertionError(line)
    j, rec = open_journal(directory, sync=True)
    present: dict[tuple[int, int], Entry] = {}
    for q in rec.queues:
        seqs = [e.seq for e in q.entries]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
        for e in q.entries:
            present[(q.qid, e.seq)] = e
    j.close()
    missing = ((base | added) - ack_recorded) - present.keys()
    assert not missing, f"lost synced messages: {sorted(missing)[:10]}"
    resurrected = ack_synced & present.keys()
    assert not resurrected, f"acked messages came back: {sorted(resurrected)[:10]}"
    for (qid, seq), e in present.items():
        exp = expected_fields(qid, seq)
        got = {k: getattr(e, k) for k in exp}
        assert got == exp, (qid, seq)
        assert e.delivery_count >= dcounts.get((qid, seq), 0)
    assert ack_synced <= ack_recorded
    return set(present)


@pytest.mark.slow
def test_kill_9_loses_no_synced_message(tmp_path: Path) -> None:
    seed0 = int.from_bytes(os.urandom(4), "little")
    print(f"random seed {seed0}")  # shown if the test fails
    rng = random.Random(seed0)
    child = HERE / "journal_crash_child.py"
    repo = HERE.parents[1]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    directory = tmp_path / "journal"
    base: set[tuple[int, int]] = set()
    for round_no in range(5):
        kill_after = rng.randint(1, 8000)
        seed = rng.randrange(1 << 30)
        errlog = tmp_path / f"child{round_no}.err"
        with errlog.open("wb") as err:
            proc = subprocess.Popen(
                [sys.executable, str(child), str(directory), str(seed)],
                stdout=subprocess.PIPE,
                stderr=err,
                env=env,
                cwd=repo,
            )
        assert proc.stdout is not None
        try:
            reader = _Lines(proc.stdout.fileno())
            lines: list[str] = []
            while len(lines) < kill_after + 1:  # +1: READY
                line = reader.readline(timeout=60)
                assert line is not None, errlog.read_text()
                lines.append(line)
            assert lines[0] == "READY"
            proc.send_signal(signal.SIGKILL)
            assert proc.wait(timeout=60) == -signal.SIGKILL
            lines.extend(reader.rest(timeout=60))  # whatever it printed before dying
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=60)
            proc.stdout.close()
        base = _check_recovered(directory, base, lines)
