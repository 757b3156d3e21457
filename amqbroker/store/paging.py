"""Paging: a queue's backlog held on disk while its address is over its memory limit.

Theory of operation
-------------------
An address whose `address_full_policy` is PAGE never blocks or rejects producers. When
it is full (its `max_size_bytes`, or the broker's `global_max_size`), the core stops
adding messages to its queues' in-memory structures: each queue appends them, in
order, to its own page (`Queue._page_out` calls `PageStore.page`). Once a queue has
anything paged, every later message for it is paged too, so the messages in memory
are always older than the paged ones and reading the page back in order keeps queue
order. The whole `Entry` leaves memory (its fields and bytes are one page record), so
a paged message costs nothing in memory but a share of the write buffer until the
next store cycle writes it.

Files: ``<data_dir>/paging/<qid>/page-<n:08d>.pg``, append-only segments of about
`segment_size` bytes, numbered upwards per queue. A segment starts with
``[8s b"AMQPAGE\\0"][u32 version 1][u64 segment number]``; records follow back to back,
framed like journal records (`amqbroker.store.records`)::

    [u32 length][u32 crc32(type + payload)][u8 type = 1]
    payload: [u64 seq][u8 flags (1 = durable)][u8 priority][i64 expiry][i64 deliver_at]
             [i64 group_seq][u32 delivery_count][i32 group-id length, -1 = absent]
             [i32 origin length, -1 = absent][group-id][origin][message data]

Writing (group commit, shared with the journal): `page` only encodes the record into
an in-memory chunk (event loop). The application's store cycle calls `take` together
with `Journal.take_batch`, runs `write` in the same worker-thread call as the
journal's `write_batch` (writev per segment file, fdatasync when the batch holds a
durable record and sync is on, directory fsync after creating a file), then `done`.
A producer of a durable paged message is settled once the store cycle that took its
record is complete (the application numbers store cycles; see `amqbroker.app`).

Reading back (depaging) happens off the hot path: the application asks `plan` what to
read next for a queue (event loop, no I/O), runs `read` in a worker thread (pread of
at most about `max_bytes` from the oldest segment, only bytes already written), then
`consumed` on the event loop, which advances the read cursor and returns the entries
for `Broker.paging.depage` to enqueue. A read whose queue was dropped meanwhile (purge,
delete) is discarded (`_QueuePages.gen`). A segment read to its end is deleted by a
later store cycle: at once for a non-durable queue; for a durable queue only once the
store cycle that recorded the depage in the journal is complete (see Durability).

Durability (the page is the durable copy while a message is paged)
------------------------------------------------------------------
A durable message on a durable queue that is paged is NOT written to the journal: its
page record is its durable copy, synced before the producer's transfer is settled
(same cycle as the journal). The journal keeps an index entry (with the message
bytes) for every live message it holds, so journaling paged messages would keep them
in memory; this way a paged message costs no memory at all. When the message is read
back, `Broker.paging.depage` enqueues it normally (an ADD record in the journal) and, in the
same atomic journal group (one TXN record), re-declares the queue with the attribute
``paged_through`` = the highest seq read back from the page (`Queue.page_mark`). So
after a crash either the ADDs and the mark are both in the journal, or neither is and
the records are still read from the page: no loss, no duplicate, and an ACK of a
depaged message (always written after its TXN) can never resurrect the page record.
A segment is deleted only after the journal holding its mark is synced. Deleting a
queue drops its pages (`forget`: the next store cycle deletes the files; the journal's
QUEUE_DEL makes them unreachable anyway). On recovery (`open`), the
segments of each durable queue are scanned: records with ``seq > paged_through`` and
the durable flag are the queue's paged backlog (counted, not loaded); the rest is
skipped. Non-durable messages in a page, and the pages of non-durable or deleted
queues, are lost on a restart (removed by `open`), like non-durable messages in
memory. A torn record at the tail of a queue's newest segment is truncated with a
warning; a corrupt record elsewhere is logged as an ERROR and the rest of its segment
is skipped (the messages in it are counted as lost so the queue does not wait for
them).

Limits
------
- A transaction's sends routed at commit to a queue that is paging go to the page,
  outside the commit's atomic journal record: after a crash they may survive while
  the rest of the transaction does not (or the reverse). Artemis handles this with
  page transactions; amqbroker does not (yet).
- `Queue.purge` on a durable queue that is not being deleted would need the new
  `paged_through` in the journal before the files go; today purge is only reached
  through queue deletion.
- Messages already in the journal at start (recovered into memory) are not paged out
  again: a broker restarted with a smaller limit holds them all until consumed, and
  pages what arrives meanwhile.
- Expiry of paged messages is checked when they are read back, not by the reaper.

Invariants
----------
- Per queue, page records are in seq order and every seq is greater than the seq of
  any message of that queue in memory.
- `plan` only reads bytes `write` has completed (`_Seg.written`); bytes still in a
  chunk wait for the next store cycle.
- Only the event-loop thread touches the bookkeeping; `write` and `read` touch only
  their batch / plan and file descriptors.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import struct
import zlib
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from amqbroker.core.entry import Entry
from amqbroker.store.atomic import fsync_dir

log = logging.getLogger(__name__)

PAGE_MAGIC: Final = b"AMQPAGE\x00"
PAGE_VERSION: Final = 1
_SEG_HEADER: Final = struct.Struct("<8sIQ")
SEG_HEADER_SIZE: Final = _SEG_HEADER.size
_REC_HEADER: Final = struct.Struct("<IIB")
REC_HEADER_SIZE: Final = _REC_HEADER.size
PAGE_RECORD: Final = 1
_PAGE: Final = struct.Struct("<QBBqqqIii")
_TYPE_CRC: Final = zlib.crc32(bytes((PAGE_RECORD,)))
_DURABLE: Final = 1
_U32_MAX: Final = 0xFFFFFFFF
_SEG_RE: Final = re.compile(r"^page-(\d{8,})\.pg$")
#: smallest read a depage step makes (a step returns at least one record)
_MIN_READ: Final = 64 << 10

_fdatasync = getattr(os, "fdatasync", os.fsync)


def encode_page_record(e: Entry) -> bytes:
    gid = b"" if e.group_id is None else e.group_id.encode()
    org = b"" if e.origin is None else e.origin.encode()
    fixed = _PAGE.pack(
        e.seq,
        _DURABLE if e.durable else 0,
        e.priority,
        e.expiry,
        e.deliver_at,
        e.group_seq,
        min(e.delivery_count, _U32_MAX),
        -1 if e.group_id is None else len(gid),
        -1 if e.origin is None else len(org),
    )
    data = e.data
    crc = zlib.crc32(data, zlib.crc32(org, zlib.crc32(gid, zlib.crc32(fixed, _TYPE_CRC))))
    head = _REC_HEADER.pack(len(fixed) + len(gid) + len(org) + len(data), crc, PAGE_RECORD)
    return b"".join((head, fixed, gid, org, data))


def _decode_fixed(buf: bytes | bytearray | memoryview, off: int) -> tuple[int, bool, int]:
    """(seq, durable, data length) of the valid record at `off`."""
    length = _REC_HEADER.unpack_from(buf, off)[0]
    seq, flags, _p, _x, _d, _g, _c, glen, olen = _PAGE.unpack_from(buf, off + REC_HEADER_SIZE)
    dlen = length - _PAGE.size - max(glen, 0) - max(olen, 0)
    return seq, bool(flags & _DURABLE), dlen


def decode_page_record(buf: bytes | bytearray | memoryview, off: int) -> Entry:
    """The Entry of the valid record at `off` (seq and every persisted field set)."""
    length = _REC_HEADER.unpack_from(buf, off)[0]
    p = off + REC_HEADER_SIZE
    seq, flags, prio, expiry, deliver_at, gseq, dc, glen, olen = _PAGE.unpack_from(buf, p)
    p += _PAGE.size
    end = off + REC_HEADER_SIZE + length
    gid = None
    if glen >= 0:
        gid = bytes(buf[p : p + glen]).decode()
        p += glen
    origin = None
    if olen >= 0:
        origin = bytes(buf[p : p + olen]).decode()
        p += olen
    e = Entry(bytes(buf[p:end]), bool(flags & _DURABLE), prio, expiry, dc, gid, gseq)
    e.seq = seq
    e.deliver_at = deliver_at
    e.origin = origin
    return e


def _check(buf: bytes | bytearray, off: int) -> str | None:
    """None if a valid page record starts at `off`, else what is wrong."""
    size = len(buf)
    if off + REC_HEADER_SIZE > size:
        return "record header cut short"
    length, crc, rtype = _REC_HEADER.unpack_from(buf, off)
    body = off + REC_HEADER_SIZE
    if body + length > size:
        return f"record length {length} runs past the end of the data"
    if rtype != PAGE_RECORD or length < _PAGE.size:
        return f"bad record type {rtype} or length {length}"
    if zlib.crc32(memoryview(buf)[body : body + length], _TYPE_CRC) != crc:
        return "CRC mismatch"
    return None


class _Seg:
    __slots__ = (
        "count",
        "nbytes",
        "no",
        "read_bytes",
        "read_count",
        "recovered",
        "size",
        "written",
    )

    def __init__(self, no: int, size: int, written: int) -> None:
        self.no = no
        #: logical size, including bytes still in a chunk
        self.size = size
        #: bytes known to be in the file
        self.written = written
        #: messages (and their data bytes) the core counts as paged in this segment
        self.count = 0
        self.nbytes = 0
        self.read_count = 0
        self.read_bytes = 0
        #: from a previous run: skip non-durable records and seq <= skip_through
        self.recovered = False


class _QueuePages:
    __slots__ = ("dir", "gen", "next_segno", "qid", "read_off", "segs", "skip_through")

    def __init__(self, qid: int, directory: Path) -> None:
        self.qid = qid
        self.dir = directory
        self.segs: deque[_Seg] = deque()
        #: offset of the next record to read in segs[0]
        self.read_off = SEG_HEADER_SIZE
        self.next_segno = 1
        #: bumped by drop(): a read planned before it is discarded
        self.gen = 0
        self.skip_through = 0


@dataclass(slots=True)
class PageBatch:
    """What one store cycle writes: (qid, segment, new file?, bytes) and deletions."""

    writes: list[tuple[int, int, bool, bytearray]]
    durable: bool
    #: (qid, segment number or 0 = the queue's whole directory)
    deletes: list[tuple[int, int]] = field(default_factory=list)


@dataclass(slots=True)
class ReadPlan:
    qid: int
    gen: int
    segno: int
    path: Path
    offset: int
    #: bytes readable (already written) from `offset`
    available: int
    max_bytes: int
    recovered: bool
    skip_through: int
    #: the read buffer, allocated on the event-loop thread (see `plan`)
    buf: bytearray = field(default_factory=bytearray)
    #: filled in by `read`: offsets in `buf` of the records to return, and the file
    #: offset after the last whole record read
    offsets: list[int] = field(default_factory=list)
    end: int = 0
    #: filled in by `consumed`
    entries: list[Entry] = field(default_factory=list)
    problem: str | None = None
    #: set by `consumed` after a corrupt record: messages (and data bytes) skipped
    lost: int = 0
    lost_bytes: int = 0


@dataclass(slots=True)
class Backlog:
    """A durable queue's paged messages found by `open`."""

    count: int = 0
    nbytes: int = 0
    max_seq: int = 0


class PageStore:
    """Every queue's page files under one directory (see the module docstring)."""

    def __init__(self, directory: Path, *, segment_size: int = 10 << 20, sync: bool = True):
        if segment_size <= SEG_HEADER_SIZE:
            raise ValueError("page segment size too small")
        self.directory = Path(directory)
        self._segment_size = segment_size
        self._sync = sync
        self._queues: dict[int, _QueuePages] = {}
        #: (qid, segno, new file?, buffer), in append order
        self._chunks: list[tuple[int, int, bool, bytearray]] = []
        self._chunk_durable = False
        self._deletes_ready: list[tuple[int, int]] = []
        #: (cycle, qid, segno): delete once that store cycle is complete
        self._deferred: deque[tuple[int, int, int]] = deque()
        self._outstanding: PageBatch | None = None
        self.pages_written = 0
        self.bytes_written = 0
        self.segments_deleted = 0
        self.lost_messages = 0

    # ------------------------------------------------------------- recovery
    def open(self, keep: dict[int, int]) -> dict[int, Backlog]:
        """Scan the page directory. `keep`: qid -> paged_through of every recovered
        durable queue; other queues' pages are removed. Returns each kept queue's
        paged backlog (messages with seq > paged_through, durable ones only)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        out: dict[int, Backlog] = {}
        for d in sorted(self.directory.iterdir()):
            qid = int(d.name) if d.name.isdigit() else -1
            if qid not in keep:
                log.info("paging: removing the pages of %s (no such durable queue)", d)
                if d.is_dir():
                    shutil.rmtree(d, ignore_errors=True)
                else:
                    d.unlink(missing_ok=True)
                continue
            back = self._recover_queue(qid, d, keep[qid])
            if back.count:
                out[qid] = back
        return out

    def _recover_queue(self, qid: int, d: Path, through: int) -> Backlog:
        qp = self._queue(qid)
        qp.skip_through = through
        numbers = sorted(int(m.group(1)) for p in d.iterdir() if (m := _SEG_RE.match(p.name)))
        back = Backlog()
        for i, no in enumerate(numbers):
            last = i == len(numbers) - 1
            path = d / f"page-{no:08d}.pg"
            buf = path.read_bytes()
            qp.next_segno = no + 1
            seg = _Seg(no, len(buf), len(buf))
            seg.recovered = True
            bad = _check_header(buf, no)
            off = SEG_HEADER_SIZE
            while bad is None and off < len(buf):
                problem = _check(buf, off)
                if problem is not None:
                    if last:
                        log.warning(
                            "paging %s: torn write at offset %d (%s); truncating",
                            path,
                            off,
                            problem,
                        )
                        with open(path, "r+b") as f:
                            f.truncate(off)
                        seg.size = seg.written = off
                    else:
                        log.error(
                            "paging %s at offset %d: %s; the rest of this segment is lost",
                            path,
                            off,
                            problem,
                        )
                        seg.size = seg.written = off
                    break
                seq, durable, dlen = _decode_fixed(buf, off)
                if durable and seq > through:
                    seg.count += 1
                    seg.nbytes += dlen
                    back.max_seq = max(back.max_seq, seq)
                off += REC_HEADER_SIZE + _REC_HEADER.unpack_from(buf, off)[0]
            if bad is not None:
                log.error("paging %s: %s; segment skipped", path, bad)
            if not seg.count:
                path.unlink(missing_ok=True)
                continue
            back.count += seg.count
            back.nbytes += seg.nbytes
            qp.segs.append(seg)
        qp.read_off = SEG_HEADER_SIZE
        return back

    # ------------------------------------------------------ core: page / drop
    def _queue(self, qid: int) -> _QueuePages:
        qp = self._queues.get(qid)
        if qp is None:
            qp = self._queues[qid] = _QueuePages(qid, self.directory / str(qid))
        return qp

    def page(self, qid: int, e: Entry) -> None:
        """Buffer `e` (seq set) at the end of queue `qid`'s page."""
        record = encode_page_record(e)
        n = len(record)
        qp = self._queue(qid)
        segs = qp.segs
        seg = segs[-1] if segs else None
        new = seg is None or seg.recovered or seg.size + n > self._segment_size
        if new:
            if not segs:
                qp.read_off = SEG_HEADER_SIZE
            seg = _Seg(qp.next_segno, SEG_HEADER_SIZE, 0)
            qp.next_segno += 1
            segs.append(seg)
        assert seg is not None
        chunks = self._chunks
        if new:
            buf = bytearray(_SEG_HEADER.pack(PAGE_MAGIC, PAGE_VERSION, seg.no))
            buf += record
            chunks.append((qid, seg.no, True, buf))
        else:
            last = chunks[-1] if chunks else None
            if last is not None and last[0] == qid and last[1] == seg.no:
                last[3].extend(record)
            else:
                chunks.append((qid, seg.no, False, bytearray(record)))
        seg.size += n
        seg.count += 1
        seg.nbytes += len(e.data)
        if e.durable:
            self._chunk_durable = True

    def drop(self, qid: int) -> None:
        """Discard every paged message of a queue (purge, queue deleted)."""
        qp = self._queues.get(qid)
        if qp is None:
            return
        qp.gen += 1
        self._chunks = [c for c in self._chunks if c[0] != qid]
        for seg in qp.segs:
            self._deletes_ready.append((qid, seg.no))
        qp.segs.clear()
        qp.read_off = SEG_HEADER_SIZE

    def forget(self, qid: int) -> None:
        """The queue is deleted: drop its pages and its directory."""
        self.drop(qid)
        if self._queues.pop(qid, None) is not None:
            self._deletes_ready.append((qid, 0))

    # ---------------------------------------------------------- store cycle
    @property
    def pending(self) -> bool:
        return bool(self._chunks or self._deletes_ready)

    @property
    def unsynced(self) -> bool:
        """A durable page record was appended since the last `take`."""
        return self._chunk_durable

    def take(self) -> PageBatch | None:
        if not self._chunks and not self._deletes_ready:
            return None
        b = PageBatch(self._chunks, self._chunk_durable, self._deletes_ready)
        self._chunks = []
        self._chunk_durable = False
        self._deletes_ready = []
        self._outstanding = b
        return b

    def write(self, b: PageBatch) -> None:
        """WORKER THREAD: append the chunks to their files, sync, delete. Blocking."""
        sync = self._sync and b.durable
        dirs: set[Path] = set()
        i = 0
        w = b.writes
        while i < len(w):
            qid, segno, new, _ = w[i]
            bufs = []
            while i < len(w) and w[i][0] == qid and w[i][1] == segno:
                bufs.append(w[i][3])
                i += 1
            d = self.directory / str(qid)
            if new:
                if not d.exists():
                    d.mkdir(parents=True, exist_ok=True)
                    dirs.add(self.directory)
                dirs.add(d)
            flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC
            fd = os.open(d / f"page-{segno:08d}.pg", flags, 0o644)
            try:
                for buf in bufs:
                    view = memoryview(buf)
                    while view:
                        view = view[os.write(fd, view) :]
                if sync:
                    _fdatasync(fd)
            finally:
                os.close(fd)
        if self._sync:
            for d in dirs:
                fsync_dir(d)
        for qid, segno in b.deletes:
            d = self.directory / str(qid)
            if segno == 0:
                with contextlib.suppress(OSError):
                    d.rmdir()
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(d / f"page-{segno:08d}.pg")

    def done(self, b: PageBatch) -> None:
        """After `write` returned: the written bytes become readable."""
        self._outstanding = None
        for qid, segno, _, buf in b.writes:
            qp = self._queues.get(qid)
            if qp is None:
                continue
            for seg in qp.segs:
                if seg.no == segno:
                    seg.written += len(buf)
                    break
            self.bytes_written += len(buf)
        self.pages_written += len(b.writes)
        self.segments_deleted += sum(1 for _, s in b.deletes if s)

    def cycle_done(self, cycle: int) -> None:
        """Store cycles up to `cycle` are complete: segments waiting for them may go."""
        d = self._deferred
        while d and d[0][0] <= cycle:
            _, qid, segno = d.popleft()
            self._deletes_ready.append((qid, segno))

    # -------------------------------------------------------------- reading
    def plan(self, qid: int, max_bytes: int) -> ReadPlan | None:
        """What to read next for queue `qid` (None: nothing written to read yet).

        The read buffer is allocated here, and the entries are built in `consumed`,
        both on the event-loop thread: objects malloc'ed by a worker thread would come
        from that thread's malloc arena, which does not give memory back to the
        process as readily, and RSS would creep up while depaging."""
        qp = self._queues.get(qid)
        if qp is None or not qp.segs:
            return None
        seg = qp.segs[0]
        avail = seg.written - qp.read_off
        if avail <= 0:
            return None
        return ReadPlan(
            qid,
            qp.gen,
            seg.no,
            qp.dir / f"page-{seg.no:08d}.pg",
            qp.read_off,
            avail,
            max_bytes,
            seg.recovered,
            qp.skip_through,
            bytearray(min(avail, max(max_bytes, _MIN_READ))),
        )

    @staticmethod
    def read(p: ReadPlan) -> ReadPlan:
        """WORKER THREAD (or inline): read and check whole records of the plan's
        segment into `p.buf`; note the offsets of the ones to return."""
        with open(p.path, "rb") as f:
            while True:
                f.seek(p.offset)
                buf = p.buf
                got = f.readinto(buf)
                if got < len(buf):
                    del buf[got:]
                size = len(buf)
                off = 0
                out = p.offsets
                n = 0
                while off < size:
                    if off + REC_HEADER_SIZE <= size:
                        length = _REC_HEADER.unpack_from(buf, off)[0]
                        if off + REC_HEADER_SIZE + length > size and size < p.available:
                            break  # the record continues past what was read
                    problem = _check(buf, off)
                    if problem is not None:
                        p.problem = problem
                        break
                    if not p.recovered:
                        out.append(off)
                    else:
                        seq, durable, _ = _decode_fixed(buf, off)
                        if durable and seq > p.skip_through:
                            out.append(off)
                    off += REC_HEADER_SIZE + _REC_HEADER.unpack_from(buf, off)[0]
                    n += 1
                    if off >= p.max_bytes:
                        break
                if n or p.problem is not None or size >= p.available:
                    p.end = p.offset + off
                    return p
                # the first record is larger than the buffer: read all of it (rare)
                length = _REC_HEADER.unpack_from(buf, 0)[0]
                p.buf = bytearray(min(p.available, REC_HEADER_SIZE + length))

    def consumed(self, p: ReadPlan, ticket: int) -> list[Entry] | None:
        """Apply a completed read: advance the cursor, retire finished segments (deleted
        once store cycle `ticket` is complete: 0 = at once). Returns the entries for the
        core, or None if the queue's pages were dropped meanwhile (discard the read).
        Records skipped after a corrupt one are reported in `p.lost`."""
        qp = self._queues.get(p.qid)
        if qp is None or qp.gen != p.gen or not qp.segs or qp.segs[0].no != p.segno:
            return None
        seg = qp.segs[0]
        qp.read_off = p.end
        with memoryview(p.buf) as mv:
            p.entries = [decode_page_record(mv, off) for off in p.offsets]
        p.buf = bytearray()
        seg.read_count += len(p.entries)
        seg.read_bytes += sum(len(e.data) for e in p.entries)
        if p.problem is not None:
            log.error(
                "paging %s at offset %d: %s; the rest of this segment (%d message(s)) is lost",
                p.path,
                p.end,
                p.problem,
                seg.count - seg.read_count,
            )
            p.lost = seg.count - seg.read_count
            p.lost_bytes = seg.nbytes - seg.read_bytes
            self.lost_messages += p.lost
            qp.read_off = seg.size = seg.written
        finished = qp.read_off >= seg.size and (len(qp.segs) > 1 or seg.size == seg.written)
        if finished:
            qp.segs.popleft()
            qp.read_off = SEG_HEADER_SIZE
            if ticket:
                self._deferred.append((ticket, p.qid, seg.no))
            else:
                self._deletes_ready.append((p.qid, seg.no))
        return p.entries

    def statistics(self) -> dict[str, int]:
        return {
            "paging_queues": sum(1 for q in self._queues.values() if q.segs),
            "page_segments": sum(len(q.segs) for q in self._queues.values()),
            "page_bytes_written": self.bytes_written,
            "page_segments_deleted": self.segments_deleted,
        }


def _check_header(buf: bytes, segno: int) -> str | None:
    if len(buf) < SEG_HEADER_SIZE:
        return f"short segment header ({len(buf)} bytes)"
    magic, version, no = _SEG_HEADER.unpack_from(buf, 0)
    if magic != PAGE_MAGIC or version != PAGE_VERSION or no != segno:
        return f"bad segment header ({bytes(magic)!r}, version {version}, number {no})"
    return None
