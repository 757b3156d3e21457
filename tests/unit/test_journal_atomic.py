"""Tests for atomic record groups (TXN records) and scheduled messages (ADD2 records)
in the journal (amqbroker.store.journal / records)."""

from __future__ import annotations

import logging
import os
import random
import signal
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import pytest

from amqbroker.core.entry import Entry
from amqbroker.store import records
from amqbroker.store.journal import Journal, JournalError, segment_path
from tests.unit.journal_crash_child import GROUP_SPAN, expected_fields
from tests.unit.test_journal import (
    LOGGER,
    _Lines,
    commit,
    dir_bytes,
    entry,
    fields,
    model_state,
    open_journal,
    record_offsets,
    segments,
    snapshot,
    state,
)

HERE = Path(__file__).resolve().parent


# --------------------------------------------------------------------------- helpers


def types_on_disk(path: Path) -> list[int]:
    return [t for p in segments(path) for _, t, _ in record_offsets(p)]


def accounting(j: Journal) -> dict[int, tuple[int, int, dict[int, set[int]]]]:
    """Per segment: (live records, live bytes, qid -> live seqs), checked for consistency
    with the entries' store_ref and the journal totals."""
    out: dict[int, tuple[int, int, dict[int, set[int]]]] = {}
    total_records = 0
    total_bytes = 0
    for no, s in j._segs.items():
        nbytes = 0
        nrecords = 0
        for qid, m in s.msgs.items():
            assert m, (no, qid)  # no empty maps left behind
            for seq, e in m.items():
                assert e.seq == seq and e.store_ref == no, (no, qid, seq, e.store_ref)
                nbytes += records.add_record_size(e)
                nrecords += 1
        for info in j._queues.values():
            if info.segno == no:
                nbytes += info.rec_size
                nrecords += 1
        assert (s.live_records, s.live_bytes) == (nrecords, nbytes), no
        total_records += nrecords
        total_bytes += nbytes
        out[no] = (nrecords, nbytes, {q: set(m) for q, m in s.msgs.items()})
    st = j.statistics()
    assert (st["live_records"], st["live_bytes"]) == (total_records, total_bytes)
    return out


def sched(seq: int, deliver_at: int, **kw: Any) -> Entry:
    e = entry(seq, **kw)
    e.deliver_at = deliver_at
    return e


def full_fields(e: Entry) -> tuple[Any, ...]:
    return (*fields(e), e.deliver_at)


def old_add_record(qid: int, e: Entry) -> bytes:
    """An ADD record as journals written before ADD2 hold it."""
    gid = b"" if e.group_id is None else e.group_id.encode()
    payload = (
        struct.pack(
            "<QQBqqIi",
            qid,
            e.seq,
            e.priority,
            e.expiry,
            e.group_seq,
            e.delivery_count,
            -1 if e.group_id is None else len(gid),
        )
        + gid
        + e.data
    )
    crc = zlib.crc32(bytes([records.ADD]) + payload)
    return struct.pack("<IIB", len(payload), crc, records.ADD) + payload


# --------------------------------------------------------------------------- deliver_at


def test_deliver_at_round_trip_and_volatile_slots_not_persisted(tmp_path: Path) -> None:
    j, _ = open_journal(tmp_path)
    j.queue_declared(1, "q", {})
    es = [
        sched(1, 0),
        sched(2, 1_900_000_000_123, group_id="g", priority=7, expiry=1_950_000_000_000),
        sched(3, -5),  # whatever the core put there comes back
        sched(4, 2**62),
    ]
    for e in es:
        e.fields = {"color": "red"}
        e.origin = "conn-1"
        j.message_added(1, e)
    commit(j)
    assert set(types_on_disk(tmp_path)) == {records.QUEUE, records.ADD2}
    assert all(
        len(records.encode_add(1, e)) == records.add_record_size(e) for e in es
    )  # the size does not depend on deliver_at
    j.close()

    j, rec = open_journal(tmp_path)
    got = rec.queues[0].entries
    assert [full_fields(e) for e in got] == [full_fields(e) for e in es]
    assert all(e.fields is None and e.origin is None for e in got)
    j.close()


def test_old_add_records_are_still_read(tmp_path: Path) -> None:
    old = [entry(1, b"old one", priority=2, group_id="g", group_seq=4), entry(2, b"old two")]
    old[1].delivery_count = 3
    seg = segment_path(tmp_path, 1)
    seg.write_bytes(
        records.segment_header(1)
        + records.encode_queue(1, "q", {"v": 1})
        + b"".join(old_add_record(1, e) for e in old)
        + records.encode_ack(1, 2)
    )
    j, rec = open_journal(tmp_path)
    assert rec.torn_records == 0
    (e1,) = rec.queues[0].entries
    assert full_fields(e1) == (*fields(old[0]), 0)
    accounting(j)  # consistent, with the ADD counted at add_record_size
    # the recovered entry works like any other: new records are ADD2
    e3 = sched(3, 1_900_000_000_000)
    j.message_added(1, e3)
    e1.delivery_count = 9
    j.delivery_count_updated(1, e1)
    commit(j)
    j.close()
    j, rec = open_journal(tmp_path)
    assert [full_fields(e) for e in rec.queues[0].entries] == [
        (*fields(old[0])[:-1], 9, 0),
        full_fields(e3),
    ]
    j.message_acked(1, rec.queues[0].entries[0])
    commit(j)
    accounting(j)
    j.close()


# --------------------------------------------------------------------------- atomic groups


def test_atomic_group_is_one_txn_record_and_replays_in_order(tmp_path: Path) -> None:
    j, _ = open_journal(tmp_path)
    j.queue_declared(1, "a", {})
    j.queue_declared(2, "b", {})
    before = [entry(s) for s in range(1, 4)]
    for e in before:
        j.message_added(1, e)
    commit(j)
    n_before = len(types_on_disk(tmp_path))

    j.begin_atomic()
    tx = [sched(10, 1_900_000_000_000, group_id="g"), entry(11)]
    j.message_added(1, tx[0])
    j.message_added(2, tx[1])
    j.message_acked(1, before[0])
    before[1].delivery_count = 2
    j.delivery_count_updated(1, before[1])
    assert j.statistics()["buffered_records"] == 0  # nothing buffered before end_atomic
    first = j.batch_no
    j.end_atomic()
    assert j.batch_no == first + 1 and j.statistics()["buffered_records"] == 1
    assert all(e.store_ref == j._append_seg for e in tx)
    commit(j)
    assert j.synced_batch_no >= first
    st = j.statistics()
    assert st["atomic_groups"] == 1
    types = types_on_disk(tmp_path)
    assert types[n_before:] == [records.TXN]
    (seg,) = segments(tmp_path)
    _, _, payload = record_offsets(seg)[-1]
    subs = records.decode_txn(memoryview(payload))
    assert [t for t, _ in subs] == [records.ADD2, records.ADD2, records.ACK, records.DCOUNT]
    live = accounting(j)
    j.close()

    j, rec = open_journal(tmp_path)
    assert rec.torn_records == 0
    assert [full_fields(e) for e in rec.queues[0].entries] == [
        full_fields(e) for e in (before[1], before[2], tx[0])
    ]
    assert [full_fields(e) for e in rec.queues[1].entries] == [full_fields(tx[1])]
    assert accounting(j) == live  # what recovery computes is what the journal kept
    j.close()


def test_empty_and_single_record_groups(tmp_path: Path) -> None:
    j, _ = open_journal(tmp_path)
    j.queue_declared(1, "q", {})
    commit(j)
    synced = j.synced_batch_no
    j.begin_atomic()
    j.end_atomic()
    j.begin_atomic()
    j.message_added(1, entry(1, durable=False))  # writes nothing
    j.message_acked(1, entry(99))  # unknown: writes nothing
    j.end_atomic()
    assert j.take_batch() is None and j.batch_no == synced
    assert j.statistics()["atomic_groups"] == 0

    j.begin_atomic()
    e = entry(2)
    j.message_added(1, e)
    j.end_atomic()
    commit(j)
    assert types_on_disk(tmp_path) == [records.QUEUE, records.ADD2]  # no TXN frame needed
    j.close()
    j, rec = open_journal(tmp_path)
    assert [fields(x) for x in rec.queues[0].entries] == [fields(e)]
    j.close()


def test_groups_do_not_nest_and_must_be_opened(tmp_path: Path) -> None:
    j, _ = open_journal(tmp_path)
    with pytest.raises(JournalError, match="without begin_atomic"):
        j.end_atomic()
    j.begin_atomic()
    with pytest.raises(JournalError, match="do not nest"):
        j.begin_atomic()
    j.end_atomic()
    j.close()
    with pytest.raises(JournalError, match="not open"):
        j.begin_atomic()


def test_calls_within_a_group_see_each_other(tmp_path: Path) -> None:
    j, _ = open_journal(tmp_path)
    j.begin_atomic()
    j.queue_declared(1, "q", {})  # declared and used in the same group
    a, b, c = entry(1), entry(2), entry(3)
    for e in (a, b, c):
        j.message_added(1, e)
    j.message_added(1, a)  # already there: no second record
    j.message_acked(1, b)  # added in this group, acked in this group
    c.delivery_count = 4
    j.delivery_count_updated(1, c)
    j.queue_declared(2, "gone", {})
    j.message_added(2, entry(1))
    j.queue_deleted(2)
    j.end_atomic()
    commit(j)
    (seg,) = segments(tmp_path)
    ((_, t, payload),) = record_offsets(seg)
    assert t == records.TXN
    assert [t for t, _ in records.decode_txn(memoryview(payload))] == [
        records.QUEUE,
        records.ADD2,
        records.ADD2,
        records.ADD2,
        records.ACK,
        records.DCOUNT,
        records.QUEUE,
        records.ADD2,
        records.QUEUE_DEL,
    ]
    live = accounting(j)
    j.close()
    j, rec = open_journal(tmp_path)
    assert [q.qid for q in rec.queues] == [1] and rec.max_qid == 2
    assert [(e.seq, e.delivery_count) for e in rec.queues[0].entries] == [(1, 0), (3, 4)]
    assert accounting(j) == live
    j.close()


def test_txn_rolling_to_a_new_segment_moves_the_accounting(tmp_path: Path) -> None:
    kw: dict[str, Any] = {"segment_size": 1024, "compact_min_bytes": 1 << 30}
    j, _ = open_journal(tmp_path, **kw)
    j.queue_declared(1, "q", {})
    olds = [entry(s, b"o" * 200) for s in range(1, 4)]
    for e in olds:
        j.message_added(1, e)
    commit(j)
    start = j._append_seg
    j.begin_atomic()
    j.queue_declared(2, "new", {})
    tx = [entry(s, b"t" * 150) for s in range(10, 14)]
    for e in tx:
        j.message_added(1, e)
    j.message_acked(1, olds[0])
    j.message_acked(1, tx[3])
    j.queue_declared(1, "q", {"v": 2})
    # provisionally accounted in the segment that was the append segment
    assert all(e.store_ref == start for e in tx[:3])
    j.end_atomic()  # the TXN (about 650 bytes) does not fit behind the 3 old messages
    assert j._append_seg == start + 1
    assert all(e.store_ref == start + 1 for e in tx[:3])
    assert j._queues[1].segno == j._queues[2].segno == start + 1
    live = accounting(j)
    assert live[start][0] == 2  # olds[1], olds[2]
    commit(j)
    assert segments(tmp_path)[-1] == segment_path(tmp_path, start + 1)
    j.close()
    j, rec = open_journal(tmp_path, **kw)
    assert accounting(j) == live
    assert [e.seq for e in rec.queues[0].entries] == [2, 3, 10, 11, 12]
    assert rec.queues[0].attributes == {"v": 2}
    j.close()


def test_no_compaction_decision_while_a_group_is_open(tmp_path: Path) -> None:
    """An ack inside an open group must not let its segment be deleted before the ack
    itself is durable."""
    kw: dict[str, Any] = {"segment_size": 1024, "compact_min_bytes": 1 << 30}
    live_dir = tmp_path / "live"
    j, _ = open_journal(live_dir, **kw)
    j.queue_declared(1, "q", {})
    pinned = entry(1, b"p" * 600)  # segment 1, with the QUEUE record
    j.message_added(1, pinned)
    j.message_added(1, entry(2, b"x" * 600))  # segment 2
    j.queue_declared(1, "q", {"v": 2})  # segment 2: segment 1 holds only `pinned` now
    commit(j)
    assert j.statistics()["segments"] == 2
    j.message_added(1, entry(4))
    b = j.take_batch()  # being written while ...
    assert b is not None
    j.begin_atomic()  # ... a group is open
    j.message_acked(1, pinned)  # segment 1 has no live record now
    j.message_added(1, entry(3))
    j.write_batch(b)
    j.batch_done(b)  # no compaction decision now ...
    commit(j)  # ... so nothing to do here (else: segment 1 deleted, ack not written)
    assert segment_path(live_dir, 1).exists()
    st = j.statistics()
    assert st["segments_awaiting_delete"] == 0 and st["segments_deleted"] == 0
    crash = snapshot(live_dir, tmp_path / "crash")
    j.end_atomic()
    commit(j)
    assert j.statistics()["segments_deleted"] == 1
    assert not segment_path(live_dir, 1).exists()
    accounting(j)
    j.close()

    jj, rec = open_journal(crash, **kw)
    assert [e.seq for e in rec.queues[0].entries] == [1, 2, 4]  # the group never happened
    jj.close()
    jj, rec = open_journal(live_dir, **kw)
    assert [e.seq for e in rec.queues[0].entries] == [2, 3, 4]
    jj.close()


def test_close_inside_group_discards_it_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    j, _ = open_journal(tmp_path)
    j.queue_declared(1, "q", {})
    commit(j)
    j.begin_atomic()
    j.message_added(1, entry(1))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        j.close()
    assert "atomic group" in caplog.records[0].getMessage()
    j, rec = open_journal(tmp_path)
    assert rec.queues[0].entries == []
    j.close()


# --------------------------------------------------------------------------- torn / corrupt


def _base_with_txn_tail(path: Path) -> tuple[list[Entry], list[Entry], Path]:
    """A journal whose newest segment ends with a TXN: (kept, in the TXN, segment)."""
    j, _ = open_journal(path, compact_min_bytes=1 << 30)
    j.queue_declared(1, "a", {})
    j.queue_declared(2, "b", {})
    kept = [entry(s, f"kept-{s}".encode() * 3) for s in range(1, 5)]
    for e in kept:
        j.message_added(1, e)
    commit(j)
    j.begin_atomic()
    tx = [sched(10 + i, 1_900_000_000_000 + i, group_id="g") for i in range(3)]
    for i, e in enumerate(tx):
        j.message_added(1 + i % 2, e)
    j.message_acked(1, kept[0])
    kept[1].delivery_count = 7
    j.delivery_count_updated(1, kept[1])
    j.end_atomic()
    commit(j)
    kept[1].delivery_count = 0  # as it was before the group
    j.close()
    (seg,) = segments(path)
    assert record_offsets(seg)[-1][1] == records.TXN
    return kept, tx, seg


def test_torn_txn_at_every_offset_drops_the_whole_group(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    base = tmp_path / "base"
    kept, _, seg = _base_with_txn_tail(base)
    data = seg.read_bytes()
    start = record_offsets(seg)[-1][0]
    expected = {1: [fields(e) for e in kept], 2: []}
    for cut in range(start + 1, len(data)):
        d = tmp_path / f"cut{cut}"
        snapshot(base, d)
        (d / seg.name).write_bytes(data[:cut])
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            j, rec = open_journal(d)
        assert [r.levelname for r in caplog.records] == ["WARNING"], cut
        assert f"offset {start}" in caplog.records[0].getMessage()
        assert rec.torn_records == 1
        assert state(rec) == expected, cut
        assert (d / seg.name).stat().st_size == start
        j.close()
        for p in d.iterdir():
            p.unlink()
        d.rmdir()


def test_bit_flip_inside_txn_at_tail_drops_the_whole_group(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    kept, _, seg = _base_with_txn_tail(tmp_path)
    data = seg.read_bytes()
    start = record_offsets(seg)[-1][0]
    rng = random.Random(5)
    for pos in [
        start + 4,
        start + 8,
        start + 9,
        start + 13,
        *rng.sample(range(start, len(data)), 20),
    ]:
        if pos < start + 4:
            continue  # (a changed length is covered by the cut test)
        bad = bytearray(data)
        bad[pos] ^= 0x10
        seg.write_bytes(bad)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            j, rec = open_journal(tmp_path)
        assert [r.levelname for r in caplog.records] == ["WARNING"], pos
        assert state(rec) == {1: [fields(e) for e in kept], 2: []}, pos
        j.close()
        seg.write_bytes(data)


def test_bad_sub_record_with_valid_outer_crc_skips_the_whole_txn(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    j, _ = open_journal(tmp_path)
    j.queue_declared(1, "q", {})
    j.message_added(1, entry(1))
    commit(j)
    j.close()
    (seg,) = segments(tmp_path)
    good = [records.encode_add(1, entry(2)), records.encode_ack(1, 1)]

    def txn(payload: bytes) -> bytes:
        crc = zlib.crc32(bytes([records.TXN]) + payload)
        return struct.pack("<IIB", len(payload), crc, records.TXN) + payload

    inner = records.encode_txn(good)[records.RECORD_HEADER_SIZE :]
    not_xored = b"".join(good)  # sub-records framed as plain records: CRC mismatch
    bad_type = bytearray(inner)
    bad_type[8] = 99
    nested = records.encode_txn(good)
    cut = inner[:-3]
    with seg.open("ab") as f:
        for payload in (not_xored, bytes(bad_type), nested, cut):
            f.write(txn(bytes(payload)))
        f.write(records.encode_add(1, entry(5)))  # applied: the file goes on
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        j, rec = open_journal(tmp_path)
    assert [r.levelname for r in caplog.records] == ["ERROR"] * 4
    assert all("TXN sub-record" in r.getMessage() for r in caplog.records)
    assert rec.torn_records == 4
    assert [e.seq for e in rec.queues[0].entries] == [1, 5]  # none of the 4 applied
    j.close()
    with pytest.raises(ValueError, match="cannot go into a TXN"):
        records.encode_txn([records.encode_txn(good)])


# --------------------------------------------------------------------------- compaction


def _atomic_workload(
    j: Journal,
    model: dict[int, dict[int, Entry]],
    rng: random.Random,
    next_seq: dict[int, int],
) -> None:
    """One atomic group: a few adds over the queues, some acks and delivery counts."""
    j.begin_atomic()
    for _ in range(rng.randint(0, 4)):
        qid = rng.choice(list(model))
        seq = next_seq[qid]
        next_seq[qid] += 1
        e = sched(
            seq, rng.choice([0, 1_900_000_000_000 + seq]), data=os.urandom(rng.randint(10, 150))
        )
        j.message_added(qid, e)
        model[qid][seq] = e
    for _ in range(rng.randint(0, 4)):
        qid = rng.choice(list(model))
        if len(model[qid]) > 5:
            s = rng.choice(list(model[qid]))
            if rng.random() < 0.3:
                model[qid][s].delivery_count += 1
                j.delivery_count_updated(qid, model[qid][s])
            else:
                j.message_acked(qid, model[qid].pop(s))
    j.end_atomic()


def test_compaction_with_txn_records(tmp_path: Path) -> None:
    kw: dict[str, Any] = {"segment_size": 4096, "compact_min_bytes": 16384, "max_batch_bytes": 2048}
    j, _ = open_journal(tmp_path, **kw)
    model: dict[int, dict[int, Entry]] = {1: {}, 2: {}, 3: {}}
    for qid in model:
        j.queue_declared(qid, f"q{qid}", {})
    next_seq = dict.fromkeys(model, 1)
    rng = random.Random(17)
    # long-lived messages added in groups: they must survive many relocations
    j.begin_atomic()
    pinned = [sched(s, 1_900_000_000_000 + s) for s in range(1, 4)]
    for e in pinned:
        j.message_added(2, e)
    j.end_atomic()
    next_seq[2] = 10
    for i in range(3000):
        _atomic_workload(j, model, rng, next_seq)
        if i % 4 == 0:
            commit(j)
            assert dir_bytes(tmp_path) <= 16384 + 4 * 4096 + 2 * j.statistics()["live_bytes"]
        if i % 500 == 0:
            accounting(j)
    commit(j)
    st = j.statistics()
    assert st["segments_deleted"] > 20 and st["records_relocated"] > 50
    assert st["bytes"] == dir_bytes(tmp_path)
    live = accounting(j)
    j.close()
    model[2].update({e.seq: e for e in pinned})

    j, rec = open_journal(tmp_path, **{**kw, "compact_min_bytes": 1 << 30})
    assert state(rec) == model_state(model)
    got = {(q.qid, e.seq): e.deliver_at for q in rec.queues for e in q.entries}
    assert got == {(q, s): e.deliver_at for q, m in model.items() for s, e in m.items()}
    assert accounting(j) == live
    assert rec.torn_records == 0
    j.close()


# --------------------------------------------------------------------------- crash safety


def _check_groups(directory: Path, lines: list[str], size: dict[int, int]) -> int:
    """Every group all there or not at all; committed groups there unless consumed by a
    committed group; returns the highest group number seen. `size` (group -> number of
    messages) is kept across rounds."""
    consumer: dict[int, int] = {}  # consumed group -> the group that consumed it
    committed: set[int] = set()
    high = 0
    for line in lines:
        kind, *rest = line.split()
        if kind == "READY":
            continue
        if kind == "B":
            g, n, consumed, _ = map(int, rest)
            size[g] = n
            high = max(high, g)
            if consumed >= 0:
                consumer[consumed] = g
        elif kind == "C":
            committed.add(int(rest[0]))
        else:
            raise AssertionError(line)
    j, rec = open_journal(directory, sync=True)
    groups: dict[int, list[Entry]] = {}
    for q in rec.queues:
        for e in q.entries:
            exp = expected_fields(q.qid, e.seq)
            assert {k: getattr(e, k) for k in exp} == exp, (q.qid, e.seq)
            groups.setdefault(e.seq // GROUP_SPAN, []).append(e)
    j.close()
    for g, es in groups.items():
        assert len(es) == size[g], f"group {g}: {len(es)} of {size[g]} messages"
        assert len({e.delivery_count for e in es}) == 1, f"group {g}: torn delivery counts"
    for g in committed:
        c = consumer.get(g)
        if c is None:
            assert g in groups, f"committed group {g} lost"
        elif c in committed:
            assert g not in groups, f"group {g} consumed by committed group {c} came back"
        # else: consumed by a group that may or may not have made it (all or nothing)
    return high


@pytest.mark.slow
def test_kill_9_atomic_groups_all_or_nothing(tmp_path: Path) -> None:
    seed0 = int.from_bytes(os.urandom(4), "little")
    print(f"random seed {seed0}")  # shown if the test fails
    rng = random.Random(seed0)
    child = HERE / "journal_crash_child.py"
    repo = HERE.parents[1]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    directory = tmp_path / "journal"
    next_group = 1
    total_groups = 0
    sizes: dict[int, int] = {}
    for round_no in range(10):
        seed = rng.randrange(1 << 30)
        errlog = tmp_path / f"child{round_no}.err"
        with errlog.open("wb") as err:
            proc = subprocess.Popen(
                [sys.executable, str(child), str(directory), str(seed), "atomic", str(next_group)],
                stdout=subprocess.PIPE,
                stderr=err,
                env=env,
                cwd=repo,
            )
        assert proc.stdout is not None
        try:
            reader = _Lines(proc.stdout.fileno())
            first = reader.readline(timeout=60)
            assert first == "READY", errlog.read_text()
            lines = [first]
            kill_at = time.monotonic() + rng.uniform(0.0, 0.5)
            while (remaining := kill_at - time.monotonic()) > 0:
                try:
                    line = reader.readline(timeout=remaining)
                except TimeoutError:
                    break
                assert line is not None, errlog.read_text()
                lines.append(line)
            proc.send_signal(signal.SIGKILL)
            assert proc.wait(timeout=60) == -signal.SIGKILL
            lines.extend(reader.rest(timeout=60))  # whatever it printed before dying
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=60)
            proc.stdout.close()
        high = _check_groups(directory, lines, sizes)
        total_groups += max(0, high - next_group + 1)
        next_group = max(next_group, high + 1)
    assert total_groups > 10  # the child did get going
