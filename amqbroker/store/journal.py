"""The durable store: an append-only, segmented journal with group commit and compaction.

Theory of operation
-------------------
Every change to durable state (queue declared/deleted, durable message added, acked,
delivery count changed) becomes one record (see `amqbroker.store.records` for the byte
layout; a message is written as an ADD2 record, which carries `Entry.deliver_at`, and
ADD records of earlier versions are still read, with ``deliver_at = 0``). The core calls
the `Persistence` methods on the event-loop thread; they only encode the record and
append it to an in-memory buffer, never touching the disk. The application's committer
then runs the group-commit cycle::

    while (batch := journal.take_batch()) is not None:     # event loop: grab the buffer
        await to_thread(journal.write_batch, batch)         # worker: write + fsync
        journal.batch_done(batch)                          # event loop: mark synced
        # now release every producer whose record is in a batch <= synced_batch_no

Whoever appended records reads `batch_no` right after appending; the records are
durable once `synced_batch_no >= that number` (if the append produced no record -
non-durable entry, unknown message - `batch_no` is already covered). All records
appended between two `take_batch` calls form one numbered batch and share one fsync,
which is what keeps throughput up. A batch larger than `max_batch_bytes` is written in
several pieces; its number counts as synced when the piece holding its last record is.
`batch_done` may append compaction records, so the committer keeps calling `take_batch`
until it returns None (`pending` says whether anything is waiting). `open` may already
buffer compaction work too, so the committer should run once after `open`.

Placement of records into segments is decided when a record is appended (event loop):
the journal keeps the logical size of the newest ("append") segment including buffered
bytes and rolls to a new segment number when a record would overflow `segment_size`.
So the event loop always knows which segment holds every record, and `write_batch` is
pure I/O: it writes the pieces, opening a new segment file when the segment number
changes, and fsyncs. All bookkeeping stays on the event-loop thread; the worker touches
only the batch it was given and the file descriptors.

Atomic groups (transactions)
----------------------------
`begin_atomic` opens a group; until `end_atomic` the records of the `Persistence` calls
(ADD, ACK, DCOUNT, also QUEUE/QUEUE_DEL, any number of queues) go to the group instead
of the buffer. `end_atomic` appends them as ONE TXN record (a record whose payload is
the sub-records, see `records`), so the whole group has one CRC and one frame: after a
crash it is either entirely there or it is a torn/corrupt record and entirely dropped.
An empty group writes nothing; a group of one record writes that plain record. Groups
do not nest (JournalError). Read `batch_no` after `end_atomic` to wait for the group.

The accounting is done at each call as usual, against the segment that is the append
segment when the group starts (``_AtomicGroup.segno``): message_added inserts the Entry
there and sets `store_ref`, message_acked removes it from its segment, so calls within
the group see each other (an ack of a message added in the same group finds it). If at
`end_atomic` the TXN record does not fit and rolls to a new segment, the live state of
the group (entries it added, QUEUE records it placed, if still live) moves to that
segment. While a group is open compaction does nothing new (no relocation step, no
segment is retired): a retirement mark taken then would not cover the group's ACKs,
which are not in the buffer yet, and relocation could roll the append segment under
the group's accounting. Segments already retired may still be deleted (nothing in a
group can refer to them). The group is expected to open and close within one
event-loop step; a journal closed with a group open discards it (with a warning).

Memory: the journal keeps, per segment, ``qid -> seq -> Entry`` for the live durable
messages whose ADD record is in that segment. The Entry is the object the queue holds
(no copy of the bytes). Entries are removed on ack and queue delete, so the maps are
bounded by the live messages. The Entry passed to `message_acked` and
`delivery_count_updated` must be the object given to `message_added` or returned by
`open` (its `store_ref` names the segment to look in).

Threading: everything except `write_batch` runs on the event-loop thread. At most one
batch is outstanding (taken but not yet done). `write_batch` touches only the batch and
the writer's file descriptors; `batch_done` must be called after it returned.

Modules
-------
One module per part, each with its own theory and invariants: this one (`Journal`: the
`Persistence` calls, atomic groups, group commit and the per-segment accounting);
`journal_segments` (the files in the directory, the lock, the writer, and when a record
counts as durable); `journal_recovery` (replay at `open`, torn tails, corruption);
`journal_compaction` (relocating and deleting old segments: bounded disk). They share
the logger ``amqbroker.store.journal``; this module re-exports the public names.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any

from amqbroker.store.journal_compaction import Compactor
from amqbroker.store.journal_recovery import PROGRESS_EVERY, Recovered, RecoveredQueue, recover
from amqbroker.store.journal_segments import (
    LOCK_FILE,
    Batch,
    JournalError,
    JournalLockedError,
    QueueInfo,
    Segment,
    SegmentFiles,
    segment_path,
)
from amqbroker.store.records import (
    SEGMENT_HEADER_SIZE,
    add_record_size,
    encode_ack,
    encode_add,
    encode_dcount,
    encode_queue,
    encode_queue_del,
    encode_txn,
    record_length_at,
)

if TYPE_CHECKING:
    from amqbroker.core.entry import Entry

log = logging.getLogger(__name__)

__all__ = [
    "LOCK_FILE",
    "PROGRESS_EVERY",
    "Batch",
    "Journal",
    "JournalError",
    "JournalLockedError",
    "Recovered",
    "RecoveredQueue",
    "segment_path",
]


class _AtomicGroup:
    """Records buffered between `begin_atomic` and `end_atomic`."""

    __slots__ = ("added", "queues", "records", "segno")

    def __init__(self, segno: int) -> None:
        #: the segment the group's live records are accounted in until `end_atomic`
        self.segno = segno
        #: encoded records, in order
        self.records: list[bytes] = []
        #: entries added in the group (their accounting may move at `end_atomic`)
        self.added: list[tuple[int, Entry]] = []
        #: QUEUE records placed in the group
        self.queues: list[tuple[int, QueueInfo]] = []


class _Chunk:
    """Buffered records destined for one segment, in log order."""

    __slots__ = ("buf", "closes", "records", "segno")

    def __init__(self, segno: int) -> None:
        self.segno = segno
        self.buf = bytearray()
        self.records = 0
        #: batch number whose last record ends this chunk (0 = chunk still open)
        self.closes = 0


class Journal:
    """Durable store for queues and durable messages; implements `Persistence`."""

    def __init__(
        self,
        directory: Path,
        *,
        sync: bool = True,
        segment_size: int = 64 << 20,
        max_batch_bytes: int = 4 << 20,
        compact_min_bytes: int = 16 << 20,
        compact_live_ratio: float = 0.5,
        count_before_delivery: bool = False,
    ) -> None:
        if segment_size <= SEGMENT_HEADER_SIZE:
            raise ValueError("segment_size too small")
        if max_batch_bytes <= 0:
            raise ValueError("max_batch_bytes must be positive")
        if not 0.0 <= compact_live_ratio <= 1.0:
            raise ValueError("compact_live_ratio must be within 0..1")
        self.directory = Path(directory)
        self._segment_size = segment_size
        self._max_batch_bytes = max_batch_bytes
        #: store_delivery_count_before_delivery: a DCOUNT of count + 1 is buffered when
        #: a durable message goes out unsettled (`message_delivered`), and the true
        #: count again when it comes back uncounted (`message_returned`)
        self._count_before_delivery = count_before_delivery

        self._opened = False
        self._closed = False
        #: open and not closed (one attribute read on the per-message paths)
        self._usable = False
        self._failed: BaseException | None = None
        #: the lock, the directory and the writer's file (worker thread)
        self._files = SegmentFiles(self.directory, sync)

        # -- event-loop state
        self._segs: dict[int, Segment] = {}  # ascending segment numbers
        self._append_seg = 0
        self._total_bytes = 0
        self._live_bytes = 0
        self._live_records = 0
        self._queues: dict[int, QueueInfo] = {}
        self._chunks: deque[_Chunk] = deque()
        self._buffered_bytes = 0
        self._buffered_records = 0
        self._batch_no = 1
        self._open_records = 0
        self._synced_batch_no = 0
        self._outstanding: Batch | None = None
        self._atomic: _AtomicGroup | None = None

        self._compaction = Compactor(self, compact_min_bytes, compact_live_ratio)

        # -- statistics
        self._st_batches = 0
        self._st_records_written = 0
        self._st_bytes_written = 0
        self._st_last_records = 0
        self._st_last_bytes = 0
        self._st_last_sync_ms = 0.0
        self._st_max_sync_ms = 0.0
        self._st_last_write_ms = 0.0
        self._st_recovery_ms = 0.0
        self._st_atomic_groups = 0

    # ================================================================= open / close

    def open(self) -> Recovered:
        """Lock the directory, replay the journal, truncate a torn tail."""
        if self._opened:
            raise JournalError("journal already opened")
        t0 = time.perf_counter()
        self.directory.mkdir(parents=True, exist_ok=True)
        files = self._files
        files.lock()
        try:
            files.dir_fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
            recovered, self._append_seg = recover(files, self._segs, self._queues)
        except BaseException:
            files.release()
            raise
        for s in self._segs.values():
            self._total_bytes += s.size
            self._live_bytes += s.live_bytes
            self._live_records += s.live_records
        self._opened = True
        self._usable = True
        self._st_recovery_ms = (time.perf_counter() - t0) * 1000.0
        nmsgs = sum(len(q.entries) for q in recovered.queues)
        log.info(
            "journal %s: recovered %d queues, %d messages from %d segments (%d bytes) in %.1f ms",
            self.directory,
            len(recovered.queues),
            nmsgs,
            len(self._segs),
            self._total_bytes,
            self._st_recovery_ms,
        )
        self._compaction.bookkeeping()
        return recovered

    def close(self) -> None:
        """Release files and the lock. Call after the final batch was written and done."""
        if self._closed:
            return
        self._closed = True
        self._usable = False
        if self._atomic is not None:
            log.warning(
                "journal %s closed inside an atomic group; its %d records are discarded",
                self.directory,
                len(self._atomic.records),
            )
            self._atomic = None
        if self._buffered_records or self._outstanding is not None:
            log.warning(
                "journal %s closed with %d buffered records not written",
                self.directory,
                self._buffered_records,
            )
        self._files.release()

    # ================================================================= Persistence

    def _append(self, record: bytes) -> Segment:
        """Buffer one encoded record; returns the segment it will be written to."""
        n = len(record)
        seg = self._segs[self._append_seg]
        chunks = self._chunks
        if chunks and seg.size + n <= self._segment_size:
            chunk = chunks[-1]
            if not chunk.closes and chunk.segno == seg.no:
                # the usual case: same segment, same open chunk
                seg.size += n
                self._total_bytes += n
                chunk.buf += record
                chunk.records += 1
                self._buffered_bytes += n
                self._buffered_records += 1
                self._open_records += 1
                return seg
        if seg.size + n > self._segment_size and seg.size > SEGMENT_HEADER_SIZE:
            no = self._append_seg + 1
            seg = self._segs[no] = Segment(no, SEGMENT_HEADER_SIZE)
            self._append_seg = no
            self._total_bytes += SEGMENT_HEADER_SIZE
        seg.size += n
        self._total_bytes += n
        last = chunks[-1] if chunks else None
        if last is None or last.closes or last.segno != seg.no:
            last = _Chunk(seg.no)
            chunks.append(last)
        chunk = last
        chunk.buf += record
        chunk.records += 1
        self._buffered_bytes += n
        self._buffered_records += 1
        self._open_records += 1
        return seg

    def _put(self, record: bytes) -> Segment:
        """Buffer a record of a `Persistence` call: into the atomic group if one is open.

        Returns the segment to account the record's live state in (for a group, the
        segment the group started in, see `end_atomic`).
        """
        g = self._atomic
        if g is None:
            return self._append(record)
        g.records.append(record)
        return self._segs[g.segno]

    def _check_open(self) -> None:
        if not self._opened or self._closed:
            raise JournalError("journal is not open")

    def queue_declared(self, qid: int, name: str, attributes: dict[str, Any]) -> None:
        self._check_open()
        record = encode_queue(qid, name, attributes)
        self._place_queue(qid, QueueInfo(name, dict(attributes), 0, len(record)), record)

    def _place_queue(self, qid: int, info: QueueInfo, record: bytes) -> None:
        old = self._queues.get(qid)
        if old is not None:
            s = self._segs[old.segno]
            s.live_bytes -= old.rec_size
            s.live_records -= 1
            self._live_bytes -= old.rec_size
            self._live_records -= 1
        seg = self._put(record)
        if self._atomic is not None:
            self._atomic.queues.append((qid, info))
        info.segno = seg.no
        self._queues[qid] = info
        seg.live_bytes += info.rec_size
        seg.live_records += 1
        self._live_bytes += info.rec_size
        self._live_records += 1

    def queue_deleted(self, qid: int) -> None:
        self._check_open()
        info = self._queues.pop(qid, None)
        if info is None:
            return
        s = self._segs[info.segno]
        s.live_bytes -= info.rec_size
        s.live_records -= 1
        dropped_bytes = info.rec_size
        dropped = 1
        for s in self._segs.values():
            m = s.msgs.pop(qid, None)
            if m:
                nbytes = sum(add_record_size(e) for e in m.values())
                s.live_bytes -= nbytes
                s.live_records -= len(m)
                dropped_bytes += nbytes
                dropped += len(m)
        self._live_bytes -= dropped_bytes
        self._live_records -= dropped
        self._put(encode_queue_del(qid))

    def message_added(self, qid: int, entry: Entry) -> None:
        if not entry.durable:
            return
        if not self._usable:
            self._check_open()
        seq = entry.seq
        ref = entry.store_ref
        if ref:
            s = self._segs.get(ref)
            if s is not None:
                m = s.msgs.get(qid)
                if m is not None and m.get(seq) is entry:
                    return  # already in the journal (e.g. a recovered entry re-enqueued)
        if qid not in self._queues:
            raise JournalError(f"message_added for queue {qid}, which was never declared")
        record = encode_add(qid, entry)
        g = self._atomic
        if g is None:
            seg = self._append(record)
        else:
            g.records.append(record)
            g.added.append((qid, entry))
            seg = self._segs[g.segno]
        m = seg.msgs.get(qid)
        if m is None:
            m = seg.msgs[qid] = {}
        m[seq] = entry
        entry.store_ref = seg.no
        n = len(record)
        seg.live_bytes += n
        seg.live_records += 1
        self._live_bytes += n
        self._live_records += 1

    def message_acked(self, qid: int, entry: Entry) -> None:
        if not self._usable:
            self._check_open()
        s = self._segs.get(entry.store_ref)
        if s is None:
            return
        m = s.msgs.get(qid)
        if m is None:
            return
        seq = entry.seq
        e = m.pop(seq, None)
        if e is None:
            return
        if not m:
            del s.msgs[qid]
        n = add_record_size(e)
        s.live_bytes -= n
        s.live_records -= 1
        self._live_bytes -= n
        self._live_records -= 1
        self._put(encode_ack(qid, seq))

    def delivery_count_updated(self, qid: int, entry: Entry) -> None:
        self._check_open()
        s = self._segs.get(entry.store_ref)
        if s is None:
            return
        m = s.msgs.get(qid)
        if m is None or entry.seq not in m:
            return
        self._put(encode_dcount(qid, entry.seq, entry.delivery_count))

    def message_delivered(self, qid: int, entry: Entry) -> None:
        if not self._count_before_delivery:
            return
        s = self._segs.get(entry.store_ref)
        if s is None or not self._usable:
            return
        m = s.msgs.get(qid)
        if m is None or entry.seq not in m:
            return
        self._put(encode_dcount(qid, entry.seq, entry.delivery_count + 1))

    def message_returned(self, qid: int, entry: Entry) -> None:
        if self._count_before_delivery:
            self.delivery_count_updated(qid, entry)

    # ================================================================= atomic groups

    def begin_atomic(self) -> None:
        """Start an atomic group: the records of the `Persistence` calls up to
        `end_atomic` are written as one TXN record (all or nothing after a crash)."""
        self._check_open()
        if self._atomic is not None:
            raise JournalError("begin_atomic inside an atomic group (groups do not nest)")
        self._atomic = _AtomicGroup(self._append_seg)

    def end_atomic(self) -> None:
        """Close the atomic group: append its records as one TXN record.

        Read `batch_no` after this call to know when the group is durable. An empty
        group writes nothing; a group of one record writes that record as it is.
        """
        g = self._atomic
        if g is None:
            raise JournalError("end_atomic without begin_atomic")
        self._atomic = None
        records = g.records
        if not records:
            return
        record = records[0] if len(records) == 1 else encode_txn(records)
        seg = self._append(record)
        self._st_atomic_groups += 1
        if seg.no != g.segno:
            self._move_group(g, self._segs[g.segno], seg)

    def _move_group(self, g: _AtomicGroup, old: Segment, seg: Segment) -> None:
        """The group's record went to `seg` (a roll): move its live state from `old`."""
        for qid, e in g.added:
            m = old.msgs.get(qid)
            seq = e.seq
            if m is None or m.get(seq) is not e:
                continue  # acked or its queue deleted within the group
            del m[seq]
            if not m:
                del old.msgs[qid]
            tm = seg.msgs.get(qid)
            if tm is None:
                tm = seg.msgs[qid] = {}
            tm[seq] = e
            e.store_ref = seg.no
            n = add_record_size(e)
            old.live_bytes -= n
            old.live_records -= 1
            seg.live_bytes += n
            seg.live_records += 1
        for qid, info in g.queues:
            if self._queues.get(qid) is info and info.segno == old.no:
                info.segno = seg.no
                old.live_bytes -= info.rec_size
                old.live_records -= 1
                seg.live_bytes += info.rec_size
                seg.live_records += 1

    # ================================================================= group commit

    @property
    def batch_no(self) -> int:
        """The batch that will contain records appended now.

        Read it after appending: if nothing was appended since the last `take_batch`,
        this is the last batch taken (so waiting for it never waits for an empty batch).
        """
        return self._batch_no if self._open_records else self._batch_no - 1

    @property
    def synced_batch_no(self) -> int:
        return self._synced_batch_no

    @property
    def pending(self) -> bool:
        """Something is waiting for `take_batch` (records or segment deletions)."""
        return bool(self._chunks or self._compaction.deletes_ready)

    def take_batch(self) -> Batch | None:
        """Everything buffered (up to `max_batch_bytes`), or None if nothing is."""
        self._check_open()
        if self._failed is not None:
            raise JournalError("an earlier journal write failed") from self._failed
        if self._outstanding is not None:
            raise JournalError("take_batch while the previous batch is not done")
        chunks = self._chunks
        compaction = self._compaction
        if not chunks and not compaction.deletes_ready:
            return None
        if self._open_records:
            chunks[-1].closes = self._batch_no
            self._batch_no += 1
            self._open_records = 0
        writes: list[tuple[int, bytes | bytearray]] = []
        budget = self._max_batch_bytes
        nrecs = 0
        nbytes = 0
        closes = 0
        while chunks and budget > 0:
            c = chunks[0]
            size = len(c.buf)
            if size <= budget:
                chunks.popleft()
                writes.append((c.segno, c.buf))
                nrecs += c.records
                nbytes += size
                budget -= size
                closes = max(closes, c.closes)
                continue
            # split at a record boundary, taking at least one record
            cut = 0
            taken = 0
            buf = c.buf
            while cut < size:
                rl = record_length_at(buf, cut)
                if cut + rl > budget and (cut or writes):
                    break
                cut += rl
                taken += 1
            if cut:
                writes.append((c.segno, bytes(buf[:cut])))
                del buf[:cut]
                c.records -= taken
                nrecs += taken
                nbytes += cut
            break
        self._buffered_bytes -= nbytes
        self._buffered_records -= nrecs
        batch = Batch(writes, nrecs, nbytes, closes, compaction.deletes_ready)
        compaction.deletes_ready = []
        self._outstanding = batch
        return batch

    def write_batch(self, batch: Batch) -> None:
        """WORKER THREAD: write the batch, roll segment files, fsync. Blocking.

        Raises OSError on I/O failure; the journal is unusable afterwards (records may
        be half written) and the broker should stop.
        """
        try:
            self._files.write(batch)
        except BaseException as e:
            self._failed = e
            raise

    def batch_done(self, batch: Batch) -> int:
        """After `write_batch` returned: mark the batch synced, run compaction bookkeeping."""
        if batch is not self._outstanding:
            raise JournalError("batch_done for a batch that is not outstanding")
        self._outstanding = None
        if batch.closes:
            self._synced_batch_no = batch.closes
        compaction = self._compaction
        for segno in batch.deletes:
            s = self._segs.pop(segno)
            self._total_bytes -= s.size
            compaction.retired_bytes -= s.size
            del compaction.retired[segno]
            self._files.damaged.discard(segno)
            compaction.st_deleted += 1
        if batch.writes or batch.deletes:
            self._st_batches += 1
            self._st_records_written += batch.records
            self._st_bytes_written += batch.nbytes
            self._st_last_records = batch.records
            self._st_last_bytes = batch.nbytes
            self._st_last_write_ms = batch.write_ms
            self._st_last_sync_ms = batch.sync_ms
            self._st_max_sync_ms = max(self._st_max_sync_ms, batch.sync_ms)
        self._compaction.bookkeeping()
        return self._synced_batch_no

    # ================================================================= statistics

    def statistics(self) -> dict[str, int | float]:
        return {
            "segments": len(self._segs),
            "bytes": self._total_bytes,
            "live_records": self._live_records,
            "live_bytes": self._live_bytes,
            "queues": len(self._queues),
            "buffered_records": self._buffered_records,
            "buffered_bytes": self._buffered_bytes,
            "batch_no": self.batch_no,
            "synced_batch_no": self._synced_batch_no,
            "batches_written": self._st_batches,
            "records_written": self._st_records_written,
            "bytes_written": self._st_bytes_written,
            "last_batch_records": self._st_last_records,
            "last_batch_bytes": self._st_last_bytes,
            "last_write_ms": self._st_last_write_ms,
            "last_sync_ms": self._st_last_sync_ms,
            "max_sync_ms": self._st_max_sync_ms,
            "compacting_segment": self._compaction.reloc_seg,
            "segments_awaiting_delete": len(self._compaction.retired),
            "records_relocated": self._compaction.st_relocated,
            "segments_deleted": self._compaction.st_deleted,
            "recovery_ms": self._st_recovery_ms,
            "atomic_groups": self._st_atomic_groups,
        }
