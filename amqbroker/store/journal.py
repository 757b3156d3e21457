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

Files in the directory: ``segment-<n:08d>.log`` (numbers increase, never reused),
``LOCK`` (fcntl.flock'ed for the life of the open journal, holds the owner's pid) and,
only after corruption, ``segment-<n:08d>.log.corrupt`` (see Recovery).

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

When a record counts as durable
-------------------------------
A record is durable when `write_batch` returned for the batch containing it: its bytes
were written and (with sync=True) fdatasync'ed. On rolling to a new segment the writer
first fdatasyncs the old file, then creates the new one and fsyncs the directory, so a
newer segment never exists on disk unless every older one is complete. Therefore a torn
write can only be at the tail of the newest segment, and the producer's transfer is
settled only after `synced_batch_no` covers its ADD.

Recovery (`open`)
-----------------
Segments are replayed in number order; each queue's messages are rebuilt as a map ``seq
-> Entry``: ADD inserts (a later ADD for the same (qid, seq) - a compaction copy -
replaces the earlier one), ACK removes, DCOUNT sets the delivery count of a live
message, QUEUE_DEL drops the queue and all its messages, and anything referring to a
message or queue not live is ignored. A TXN record is decoded completely first (any bad
sub-record makes the whole TXN an ERROR-logged skipped record) and its sub-records are
then applied in order, exactly as if they were records at the TXN's place (an Entry from
an ADD inside a TXN has the TXN's segment as `store_ref`). Messages of queues without a
QUEUE record at the end are dropped (with a warning) - that only happens after
corruption.

A problem at the tail of the newest segment (header or payload running past the end of
the file, or a CRC failure with nothing valid after it) is a torn write - for a TXN
record, the whole group is dropped (sub-records do not pass for records, so the partial
payload of a torn TXN does not look like valid data after the tear): one WARNING
line, the file is truncated there and appending continues after it. Any other bad
record (corruption of already-synced data) is logged as an ERROR with file and offset
and the rest of that segment is skipped; if that is the newest segment the file is left
as it is and appending continues in a fresh segment. A segment with an unreadable part
is never deleted by compaction: when its turn comes it is renamed to ``*.corrupt`` for
inspection. Corrupt data never raises; only I/O errors and a held lock do.

Compaction (bounded disk)
-------------------------
Per segment the journal tracks its size and its live bytes: ADD records of messages not
yet acked or deleted, and the current QUEUE record of each live queue, whether
stand-alone or inside a TXN record (a sub-record counts with the size of the stand-alone
record; the TXN frame itself is never live). ACK, DCOUNT and QUEUE_DEL records are dead
once written: they only cancel or amend records in the same or OLDER segments. That is
why segments are only ever deleted oldest first: deleting a newer segment while an older
one survives could drop the ACK of a message whose ADD survives, i.e. resurrect an acked
message.

When the oldest sealed segment has no live records, or the journal exceeds
`compact_min_bytes` and that segment's live ratio (or the whole journal's) is below
`compact_live_ratio`, its live records are re-appended at the head through the normal
buffer - QUEUE records first, then ADD records with the current delivery count and the
same seq, always as individual records (a live ADD of a TXN is re-appended alone: its
group is committed already, so it no longer needs the group's frame) - at most
`_RELOCATE_RECORDS` records / `_RELOCATE_BYTES` bytes per `batch_done`, so a step never
stalls the event loop. Each relocated Entry's `store_ref` moves to its new segment. Once
the segment is empty, the journal notes the current `batch_no` (which covers the last
relocated record and every ACK that killed a record of the segment); after that batch is
synced, the next batch carries the unlink (plus a directory fsync), and the segment
leaves the accounting when that batch is done. A crash at any point leaves either the
old records or both copies, and replay treats a second ADD of the same (qid, seq) as a
replacement, so nothing is lost or resurrected.

Using the whole-journal ratio as a second trigger keeps a long-lived message in the
oldest segment from pinning every newer (dead) segment behind it: the oldest segment is
then relocated even though it is mostly live, which moves its live records to the head.
The disk footprint therefore stays around ``max(compact_min_bytes, live bytes /
compact_live_ratio)`` plus a couple of segments.

Memory: the journal keeps, per segment, ``qid -> seq -> Entry`` for the live durable
messages whose ADD record is in that segment. The Entry is the object the queue holds
(no copy of the bytes). Entries are removed on ack and queue delete, so the maps are
bounded by the live messages. The Entry passed to `message_acked` and
`delivery_count_updated` must be the object given to `message_added` or returned by
`open` (its `store_ref` names the segment to look in).

Threading: everything except `write_batch` runs on the event-loop thread. At most one
batch is outstanding (taken but not yet done). `write_batch` touches only the batch and
the writer's file descriptors; `batch_done` must be called after it returned.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from amqbroker.core.errors import LocalError
from amqbroker.store import records as rec
from amqbroker.store.records import (
    RECORD_HEADER_SIZE,
    SEGMENT_HEADER_SIZE,
    CorruptRecord,
    SegmentReader,
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

LOCK_FILE: Final = "LOCK"
_SEGMENT_RE: Final = re.compile(r"^segment-(\d{8,})\.log$")
#: one compaction step (per batch_done) relocates at most this many records ...
_RELOCATE_RECORDS: Final = 4096
#: ... or about this many bytes (at least one record)
_RELOCATE_BYTES: Final = 4 << 20
_IOV_MAX: Final = 512

_fdatasync = getattr(os, "fdatasync", os.fsync)


#: seconds between progress lines while a large journal is recovered
PROGRESS_EVERY = 5.0


class JournalError(LocalError):
    """The journal cannot be used (see the message)."""


class JournalLockedError(JournalError):
    """Another process (or another Journal object) holds the journal directory."""


def segment_path(directory: Path, segno: int) -> Path:
    return directory / f"segment-{segno:08d}.log"


@dataclass
class RecoveredQueue:
    qid: int
    name: str
    attributes: dict[str, Any]
    #: sorted by seq; durable=True, store_ref set
    entries: list[Entry]


@dataclass
class Recovered:
    #: in qid order
    queues: list[RecoveredQueue]
    #: highest qid found in any record (0 if none); allocate new qids above it
    max_qid: int
    #: torn or corrupt records skipped (each was logged)
    torn_records: int


@dataclass(slots=True)
class Batch:
    """One piece of group commit, produced by `take_batch` and written by `write_batch`."""

    #: (segment number, bytes) in log order; consecutive pieces may share a segment
    writes: list[tuple[int, bytes | bytearray]]
    records: int
    nbytes: int
    #: the batch number that is fully synced once this piece is (0: none completes)
    closes: int
    #: segments to unlink after the writes (oldest first)
    deletes: list[int] = field(default_factory=list)
    #: filled in by write_batch
    write_ms: float = 0.0
    sync_ms: float = 0.0


class _Segment:
    __slots__ = ("live_bytes", "live_records", "msgs", "no", "size")

    def __init__(self, no: int, size: int) -> None:
        self.no = no
        #: bytes in the file, including records still buffered
        self.size = size
        self.live_bytes = 0
        self.live_records = 0
        #: qid -> seq -> Entry for live messages whose ADD record is in this segment
        self.msgs: dict[int, dict[int, Entry]] = {}


class _QueueInfo:
    __slots__ = ("attributes", "name", "rec_size", "segno")

    def __init__(self, name: str, attributes: dict[str, Any], segno: int, rec_size: int) -> None:
        self.name = name
        self.attributes = attributes
        self.segno = segno
        self.rec_size = rec_size


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
        self.queues: list[tuple[int, _QueueInfo]] = []


class _Replay:
    """Recovery state: the live queues and messages after the records replayed so far."""

    __slots__ = ("max_qid", "msgs", "queues")

    def __init__(self) -> None:
        #: qid -> (name, attributes, segment number, QUEUE record size)
        self.queues: dict[int, tuple[str, dict[str, Any], int, int]] = {}
        self.msgs: dict[int, dict[int, Entry]] = {}
        self.max_qid = 0

    @staticmethod
    def decode(rtype: int, payload: memoryview) -> Any:
        """The decoded record (raises CorruptRecord; TXN is handled by the caller)."""
        if rtype in (rec.ADD2, rec.ADD):
            return rec.decode_add(payload, rtype)
        if rtype == rec.ACK:
            return rec.decode_ack(payload)
        if rtype == rec.DCOUNT:
            return rec.decode_dcount(payload)
        if rtype == rec.QUEUE:
            return (*rec.decode_queue(payload), RECORD_HEADER_SIZE + len(payload))
        if rtype == rec.QUEUE_DEL:
            return rec.decode_qid(payload)
        raise CorruptRecord(f"unknown record type {rtype}")

    def apply(self, rtype: int, value: Any, segno: int) -> None:
        """Apply one record decoded by `decode`, found in segment `segno`."""
        qid: int
        if rtype in (rec.ADD2, rec.ADD):
            qid, entry = value
            entry.store_ref = segno
            m = self.msgs.get(qid)
            if m is None:
                m = self.msgs[qid] = {}
            m[entry.seq] = entry
        elif rtype == rec.ACK:
            qid, seq = value
            m = self.msgs.get(qid)
            if m is not None:
                m.pop(seq, None)
        elif rtype == rec.DCOUNT:
            qid, seq, dc = value
            m = self.msgs.get(qid)
            if m is not None and (e := m.get(seq)) is not None:
                e.delivery_count = dc
        elif rtype == rec.QUEUE:
            qid, name, attrs, size = value
            self.queues[qid] = (name, attrs, segno, size)
        else:  # QUEUE_DEL
            qid = value
            self.queues.pop(qid, None)
            self.msgs.pop(qid, None)
        if qid > self.max_qid:
            self.max_qid = qid


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
        self._sync = sync
        self._segment_size = segment_size
        self._max_batch_bytes = max_batch_bytes
        self._compact_min_bytes = compact_min_bytes
        self._compact_live_ratio = compact_live_ratio
        #: store_delivery_count_before_delivery: a DCOUNT of count + 1 is buffered when
        #: a durable message goes out unsettled (`message_delivered`), and the true
        #: count again when it comes back uncounted (`message_returned`)
        self._count_before_delivery = count_before_delivery

        self._opened = False
        self._closed = False
        #: open and not closed (one attribute read on the per-message paths)
        self._usable = False
        self._failed: BaseException | None = None
        self._lock_fd: int | None = None
        self._dir_fd: int | None = None

        # -- event-loop state
        self._segs: dict[int, _Segment] = {}  # ascending segment numbers
        self._append_seg = 0
        self._total_bytes = 0
        self._live_bytes = 0
        self._live_records = 0
        self._queues: dict[int, _QueueInfo] = {}
        self._chunks: deque[_Chunk] = deque()
        self._buffered_bytes = 0
        self._buffered_records = 0
        self._batch_no = 1
        self._open_records = 0
        self._synced_batch_no = 0
        self._outstanding: Batch | None = None
        self._atomic: _AtomicGroup | None = None

        # -- compaction
        self._reloc_seg = 0  # segment being relocated (0 = none)
        self._reloc_queues_done = False
        self._retired: dict[int, int] = {}  # relocated segments awaiting deletion -> mark
        self._retired_bytes = 0
        self._deletes_ready: list[int] = []
        #: segments with unreadable parts: renamed to *.corrupt instead of deleted
        self._damaged: set[int] = set()

        # -- writer (worker thread) state
        self._wfd: int | None = None
        self._wsegno = 0

        # -- statistics
        self._st_batches = 0
        self._st_records_written = 0
        self._st_bytes_written = 0
        self._st_last_records = 0
        self._st_last_bytes = 0
        self._st_last_sync_ms = 0.0
        self._st_max_sync_ms = 0.0
        self._st_last_write_ms = 0.0
        self._st_relocated = 0
        self._st_deleted = 0
        self._st_recovery_ms = 0.0
        self._st_atomic_groups = 0

    # ================================================================= open / close

    def open(self) -> Recovered:
        """Lock the directory, replay the journal, truncate a torn tail."""
        if self._opened:
            raise JournalError("journal already opened")
        t0 = time.perf_counter()
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock()
        try:
            self._dir_fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
            recovered = self._recover()
        except BaseException:
            self._release()
            raise
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
        self._compaction_bookkeeping()
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
        self._release()

    def _release(self) -> None:
        for name in ("_wfd", "_dir_fd", "_lock_fd"):
            fd = getattr(self, name)
            if fd is not None:
                setattr(self, name, None)
                with contextlib.suppress(OSError):
                    os.close(fd)

    def _lock(self) -> None:
        path = self.directory / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            owner = ""
            with contextlib.suppress(OSError):
                pid = os.pread(fd, 32, 0).decode(errors="replace").strip()
                if pid:
                    owner = f" (pid {pid})"
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise JournalLockedError(
                    f"journal directory {self.directory} is locked by another broker"
                    f"{owner}; stop that broker, or configure a different store directory "
                    f"for this one"
                ) from None
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    # ================================================================= recovery

    def _recover(self) -> Recovered:
        numbers = sorted(
            int(match.group(1))
            for p in self.directory.iterdir()
            if (match := _SEGMENT_RE.match(p.name)) is not None
        )
        replay = _Replay()
        queues = replay.queues
        msgs = replay.msgs
        torn = 0
        max_qid = 0  # of the records not applied through `replay`
        append_ok = False  # may we keep appending to the newest segment?

        next_report = time.perf_counter() + PROGRESS_EVERY
        for i, segno in enumerate(numbers):
            last = i == len(numbers) - 1
            if time.perf_counter() >= next_report:
                # a large journal takes a while: say where we are
                next_report += PROGRESS_EVERY
                log.info(
                    "journal %s: recovering, segment %d of %d, %d messages so far",
                    self.directory,
                    i + 1,
                    len(numbers),
                    sum(len(m) for m in msgs.values()),
                )
            path = segment_path(self.directory, segno)
            with open(path, "rb") as f:
                buf = f.read()
            header_problem = rec.check_segment_header(buf, segno)
            if header_problem is not None:
                torn += 1
                reader = SegmentReader(buf)
                if last and reader.valid_record_after(-1) is None:
                    log.warning(
                        "journal %s: torn segment header (%s); removing the file",
                        path,
                        header_problem,
                    )
                    os.unlink(path)
                    self._fsync_dir()
                    continue
                log.error(
                    "journal %s at offset 0: %s; skipping this segment (%d bytes)",
                    path,
                    header_problem,
                    len(buf),
                )
                self._segs[segno] = _Segment(segno, len(buf))
                self._damaged.add(segno)
                continue

            seg = _Segment(segno, len(buf))
            self._segs[segno] = seg
            reader = SegmentReader(buf)
            decode = replay.decode
            apply = replay.apply
            for off, rtype, payload in reader.records():
                try:
                    # the frequent records inline (as `_Replay.apply` does them)
                    if rtype == rec.ADD2:
                        qid, entry = rec.decode_add(payload, rtype)
                        entry.store_ref = segno
                        m = msgs.get(qid)
                        if m is None:
                            m = msgs[qid] = {}
                        m[entry.seq] = entry
                    elif rtype == rec.ACK:
                        qid, seq = rec.decode_ack(payload)
                        m = msgs.get(qid)
                        if m is not None:
                            m.pop(seq, None)
                    elif rtype == rec.TXN:
                        # decode every sub-record before applying any: all or nothing
                        ops = [(t, decode(t, p)) for t, p in rec.decode_txn(payload)]
                        for t, value in ops:
                            apply(t, value, segno)
                        continue
                    else:
                        apply(rtype, decode(rtype, payload), segno)
                        continue
                except CorruptRecord as exc:
                    torn += 1
                    log.error("journal %s at offset %d: %s; record skipped", path, off, exc)
                    continue
                if qid > max_qid:
                    max_qid = qid

            if reader.problem is None:
                append_ok = last
                continue
            torn += 1
            off = reader.end
            if last and reader.valid_record_after(off) is None:
                log.warning(
                    "journal %s: torn write at offset %d (%s); truncating %d bytes",
                    path,
                    off,
                    reader.problem,
                    len(buf) - off,
                )
                with open(path, "r+b") as f:
                    f.truncate(off)
                    if self._sync:
                        os.fsync(f.fileno())
                seg.size = off
                append_ok = True
            else:
                log.error(
                    "journal %s at offset %d: %s; skipping the rest of this segment (%d bytes)",
                    path,
                    off,
                    reader.problem,
                    len(buf) - off,
                )
                self._damaged.add(segno)

        # live state -> accounting
        for qid, (name, attrs, segno, size) in queues.items():
            self._queues[qid] = _QueueInfo(name, attrs, segno, size)
            s = self._segs[segno]
            s.live_bytes += size
            s.live_records += 1
        out: list[RecoveredQueue] = []
        orphans = sum(len(m) for qid, m in msgs.items() if qid not in queues)
        for qid in sorted(queues):
            name, attrs, _, _ = queues[qid]
            m = msgs.get(qid, {})
            entries = [m[seq] for seq in sorted(m)]
            for e in entries:
                s = self._segs[e.store_ref]
                sm = s.msgs.get(qid)
                if sm is None:
                    sm = s.msgs[qid] = {}
                sm[e.seq] = e
                size = add_record_size(e)
                s.live_bytes += size
                s.live_records += 1
            out.append(RecoveredQueue(qid, name, attrs, entries))
        if orphans:
            log.warning(
                "journal %s: dropped %d messages of queues that have no QUEUE record",
                self.directory,
                orphans,
            )
        for s in self._segs.values():
            self._total_bytes += s.size
            self._live_bytes += s.live_bytes
            self._live_records += s.live_records

        # where to append
        if numbers and append_ok and numbers[-1] in self._segs:
            self._append_seg = numbers[-1]
            self._wfd = os.open(
                segment_path(self.directory, self._append_seg),
                os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC,
            )
            self._wsegno = self._append_seg
        else:
            nxt = numbers[-1] + 1 if numbers else 1
            self._append_seg = nxt
            self._segs[nxt] = _Segment(nxt, SEGMENT_HEADER_SIZE)
            self._total_bytes += SEGMENT_HEADER_SIZE
            self._wsegno = nxt - 1  # the writer creates segment nxt on first write
        return Recovered(out, max(max_qid, replay.max_qid), torn)

    def _fsync_dir(self) -> None:
        if self._sync and self._dir_fd is not None:
            os.fsync(self._dir_fd)

    # ================================================================= Persistence

    def _append(self, record: bytes) -> _Segment:
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
            seg = self._segs[no] = _Segment(no, SEGMENT_HEADER_SIZE)
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

    def _put(self, record: bytes) -> _Segment:
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
        self._place_queue(qid, _QueueInfo(name, dict(attributes), 0, len(record)), record)

    def _place_queue(self, qid: int, info: _QueueInfo, record: bytes) -> None:
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

    def _move_group(self, g: _AtomicGroup, old: _Segment, seg: _Segment) -> None:
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
        return bool(self._chunks or self._deletes_ready)

    def take_batch(self) -> Batch | None:
        """Everything buffered (up to `max_batch_bytes`), or None if nothing is."""
        self._check_open()
        if self._failed is not None:
            raise JournalError("an earlier journal write failed") from self._failed
        if self._outstanding is not None:
            raise JournalError("take_batch while the previous batch is not done")
        chunks = self._chunks
        if not chunks and not self._deletes_ready:
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
        batch = Batch(writes, nrecs, nbytes, closes, self._deletes_ready)
        self._deletes_ready = []
        self._outstanding = batch
        return batch

    def write_batch(self, batch: Batch) -> None:
        """WORKER THREAD: write the batch, roll segment files, fsync. Blocking.

        Raises OSError on I/O failure; the journal is unusable afterwards (records may
        be half written) and the broker should stop.
        """
        try:
            self._write(batch)
        except BaseException as e:
            self._failed = e
            raise

    def _write(self, batch: Batch) -> None:
        t0 = time.perf_counter()
        writes = batch.writes
        i = 0
        n = len(writes)
        while i < n:
            segno = writes[i][0]
            bufs: list[bytes | bytearray] = []
            while i < n and writes[i][0] == segno:
                bufs.append(writes[i][1])
                i += 1
            if segno != self._wsegno:
                self._roll(segno)
            assert self._wfd is not None
            _write_all(self._wfd, bufs)
        t1 = time.perf_counter()
        if self._sync and writes and self._wfd is not None:
            _fdatasync(self._wfd)
        if batch.deletes:
            for segno in batch.deletes:
                path = segment_path(self.directory, segno)
                if segno in self._damaged:
                    aside = path.with_name(path.name + ".corrupt")
                    os.replace(path, aside)
                    log.warning("journal: compacted damaged segment kept as %s", aside)
                    continue
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            if self._sync and self._dir_fd is not None:
                os.fsync(self._dir_fd)
        t2 = time.perf_counter()
        batch.write_ms = (t1 - t0) * 1000.0
        batch.sync_ms = (t2 - t1) * 1000.0

    def _roll(self, segno: int) -> None:
        if segno <= self._wsegno:
            raise JournalError(f"segment {segno} written after segment {self._wsegno}")
        if self._wfd is not None:
            # the old segment is complete on disk before the new one exists
            if self._sync:
                _fdatasync(self._wfd)
            os.close(self._wfd)
            self._wfd = None
        fd = os.open(
            segment_path(self.directory, segno),
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC,
            0o644,
        )
        self._wfd = fd
        self._wsegno = segno
        _write_all(fd, [rec.segment_header(segno)])
        if self._sync and self._dir_fd is not None:
            os.fsync(self._dir_fd)

    def batch_done(self, batch: Batch) -> int:
        """After `write_batch` returned: mark the batch synced, run compaction bookkeeping."""
        if batch is not self._outstanding:
            raise JournalError("batch_done for a batch that is not outstanding")
        self._outstanding = None
        if batch.closes:
            self._synced_batch_no = batch.closes
        for segno in batch.deletes:
            s = self._segs.pop(segno)
            self._total_bytes -= s.size
            self._retired_bytes -= s.size
            del self._retired[segno]
            self._damaged.discard(segno)
            self._st_deleted += 1
        if batch.writes or batch.deletes:
            self._st_batches += 1
            self._st_records_written += batch.records
            self._st_bytes_written += batch.nbytes
            self._st_last_records = batch.records
            self._st_last_bytes = batch.nbytes
            self._st_last_write_ms = batch.write_ms
            self._st_last_sync_ms = batch.sync_ms
            self._st_max_sync_ms = max(self._st_max_sync_ms, batch.sync_ms)
        self._compaction_bookkeeping()
        return self._synced_batch_no

    # ================================================================= compaction

    def _compaction_bookkeeping(self) -> None:
        if self._atomic is not None:
            pass  # relocation waits: the group's live state sits in the append segment
        elif self._reloc_seg:
            self._relocate_step()
        else:
            # segments without live records need no relocation: retire a run of them at once
            for _ in range(64):
                cand = self._candidate()
                if cand is None:
                    break
                self._reloc_seg = cand
                self._reloc_queues_done = False
                self._relocate_step()
                if self._reloc_seg:
                    break  # relocation continues in later steps
        synced = self._synced_batch_no
        for segno, mark in self._retired.items():
            if mark < 0:
                continue
            if mark > synced:
                break
            # its relocation (and every ACK that emptied it) is durable: delete it
            self._retired[segno] = -1
            self._deletes_ready.append(segno)

    def _candidate(self) -> int | None:
        """The oldest sealed segment, if it should be compacted now."""
        for segno, s in self._segs.items():
            if segno in self._retired:
                continue
            if segno >= self._append_seg:
                return None
            if s.live_records == 0:
                return segno
            remaining = self._total_bytes - self._retired_bytes
            if remaining <= self._compact_min_bytes:
                return None
            ratio = self._compact_live_ratio
            if s.live_bytes < ratio * s.size or self._live_bytes < ratio * remaining:
                return segno
            return None
        return None

    def _relocate_step(self) -> None:
        segno = self._reloc_seg
        seg = self._segs[segno]
        if not self._reloc_queues_done:
            for qid, info in list(self._queues.items()):
                if info.segno == segno:
                    record = encode_queue(qid, info.name, info.attributes)
                    self._place_queue(
                        qid, _QueueInfo(info.name, info.attributes, 0, len(record)), record
                    )
                    self._st_relocated += 1
            self._reloc_queues_done = True
        budget_records = _RELOCATE_RECORDS
        budget_bytes = min(_RELOCATE_BYTES, self._max_batch_bytes)
        msgs = seg.msgs
        while msgs and budget_records > 0 and budget_bytes > 0:
            qid = next(iter(msgs))
            m = msgs[qid]
            while m and budget_records > 0 and budget_bytes > 0:
                seq, e = m.popitem()
                record = encode_add(qid, e)
                n = len(record)
                target = self._append(record)
                tm = target.msgs.get(qid)
                if tm is None:
                    tm = target.msgs[qid] = {}
                tm[seq] = e
                e.store_ref = target.no
                seg.live_bytes -= n
                seg.live_records -= 1
                target.live_bytes += n
                target.live_records += 1
                budget_records -= 1
                budget_bytes -= n
                self._st_relocated += 1
            if not m:
                del msgs[qid]
        if msgs:
            return  # more next time
        # segment empty: delete once everything up to now is durable
        self._reloc_seg = 0
        self._retired[segno] = self.batch_no
        self._retired_bytes += seg.size

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
            "compacting_segment": self._reloc_seg,
            "segments_awaiting_delete": len(self._retired),
            "records_relocated": self._st_relocated,
            "segments_deleted": self._st_deleted,
            "recovery_ms": self._st_recovery_ms,
            "atomic_groups": self._st_atomic_groups,
        }


def _write_all(fd: int, bufs: list[bytes | bytearray]) -> None:
    views = [memoryview(b) for b in bufs if len(b)]
    while views:
        n = os.writev(fd, views[:_IOV_MAX])
        while n and views:
            first = views[0]
            if n >= len(first):
                n -= len(first)
                views.pop(0)
            else:
                views[0] = first[n:]
                n = 0
