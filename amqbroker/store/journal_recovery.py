"""Recovery: replaying the journal's segments when it is opened (`Journal.open`).

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
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from amqbroker.store import records as rec
from amqbroker.store.journal_segments import (
    SEGMENT_RE,
    QueueInfo,
    Segment,
    SegmentFiles,
    segment_path,
)
from amqbroker.store.records import (
    RECORD_HEADER_SIZE,
    SEGMENT_HEADER_SIZE,
    CorruptRecord,
    SegmentReader,
    add_record_size,
)

if TYPE_CHECKING:
    from amqbroker.core.entry import Entry

log = logging.getLogger("amqbroker.store.journal")

#: seconds between progress lines while a large journal is recovered
PROGRESS_EVERY = 5.0


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


def recover(
    files: SegmentFiles, segs: dict[int, Segment], queue_infos: dict[int, QueueInfo]
) -> tuple[Recovered, int]:
    """Replay the segments in `files.directory` into `segs` and `queue_infos` (empty).

    Truncates a torn tail and marks damaged segments in `files.damaged`. Returns what
    was recovered and the number of the append segment; `files` is then ready to append
    to it (its file open, or the writer set to create it on the first write).
    """
    numbers = sorted(
        int(match.group(1))
        for p in files.directory.iterdir()
        if (match := SEGMENT_RE.match(p.name)) is not None
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
                files.directory,
                i + 1,
                len(numbers),
                sum(len(m) for m in msgs.values()),
            )
        path = segment_path(files.directory, segno)
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
                files.fsync_dir()
                continue
            log.error(
                "journal %s at offset 0: %s; skipping this segment (%d bytes)",
                path,
                header_problem,
                len(buf),
            )
            segs[segno] = Segment(segno, len(buf))
            files.damaged.add(segno)
            continue

        seg = Segment(segno, len(buf))
        segs[segno] = seg
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
                if files.sync:
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
            files.damaged.add(segno)

    # live state -> accounting
    for qid, (name, attrs, segno, size) in queues.items():
        queue_infos[qid] = QueueInfo(name, attrs, segno, size)
        s = segs[segno]
        s.live_bytes += size
        s.live_records += 1
    out: list[RecoveredQueue] = []
    orphans = sum(len(m) for qid, m in msgs.items() if qid not in queues)
    for qid in sorted(queues):
        name, attrs, _, _ = queues[qid]
        m = msgs.get(qid, {})
        entries = [m[seq] for seq in sorted(m)]
        for e in entries:
            s = segs[e.store_ref]
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
            files.directory,
            orphans,
        )
    # where to append (the caller sums the byte totals of `segs`, this one included)
    if numbers and append_ok and numbers[-1] in segs:
        append_seg = numbers[-1]
        files.wfd = os.open(
            segment_path(files.directory, append_seg),
            os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC,
        )
        files.wsegno = append_seg
    else:
        nxt = numbers[-1] + 1 if numbers else 1
        append_seg = nxt
        segs[nxt] = Segment(nxt, SEGMENT_HEADER_SIZE)
        files.wsegno = nxt - 1  # the writer creates segment nxt on first write
    return Recovered(out, max(max_qid, replay.max_qid), torn), append_seg
