"""Compaction (bounded disk): relocating the live records of the oldest segments and
deleting those segments once the relocation is durable (see `amqbroker.store.journal`).

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

While an atomic group is open compaction does nothing new (see the journal's "Atomic
groups"); segments already retired may still be deleted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from amqbroker.store.journal_segments import QueueInfo
from amqbroker.store.records import encode_add, encode_queue

if TYPE_CHECKING:
    from amqbroker.store.journal import Journal

#: one compaction step (per batch_done) relocates at most this many records ...
_RELOCATE_RECORDS: Final = 4096
#: ... or about this many bytes (at least one record)
_RELOCATE_BYTES: Final = 4 << 20


class Compactor:
    """The journal's compaction state and steps (event-loop thread).

    A part of `Journal`: it reads the journal's accounting (`_segs`, `_queues`, the byte
    totals) and re-appends live records through `Journal._append` / `_place_queue`, so a
    relocated record is buffered and accounted like any other.
    """

    def __init__(self, journal: Journal, min_bytes: int, live_ratio: float) -> None:
        self._journal = journal
        self._compact_min_bytes = min_bytes
        self._compact_live_ratio = live_ratio
        self.reloc_seg = 0  # segment being relocated (0 = none)
        self._reloc_queues_done = False
        self.retired: dict[int, int] = {}  # relocated segments awaiting deletion -> mark
        self.retired_bytes = 0
        self.deletes_ready: list[int] = []
        # -- statistics
        self.st_relocated = 0
        self.st_deleted = 0

    def bookkeeping(self) -> None:
        """After `open` and every `batch_done`: one relocation step, deletions that are due."""
        j = self._journal
        if j._atomic is not None:
            pass  # relocation waits: the group's live state sits in the append segment
        elif self.reloc_seg:
            self._relocate_step()
        else:
            # segments without live records need no relocation: retire a run of them at once
            for _ in range(64):
                cand = self._candidate()
                if cand is None:
                    break
                self.reloc_seg = cand
                self._reloc_queues_done = False
                self._relocate_step()
                if self.reloc_seg:
                    break  # relocation continues in later steps
        synced = j._synced_batch_no
        for segno, mark in self.retired.items():
            if mark < 0:
                continue
            if mark > synced:
                break
            # its relocation (and every ACK that emptied it) is durable: delete it
            self.retired[segno] = -1
            self.deletes_ready.append(segno)

    def _candidate(self) -> int | None:
        """The oldest sealed segment, if it should be compacted now."""
        j = self._journal
        for segno, s in j._segs.items():
            if segno in self.retired:
                continue
            if segno >= j._append_seg:
                return None
            if s.live_records == 0:
                return segno
            remaining = j._total_bytes - self.retired_bytes
            if remaining <= self._compact_min_bytes:
                return None
            ratio = self._compact_live_ratio
            if s.live_bytes < ratio * s.size or j._live_bytes < ratio * remaining:
                return segno
            return None
        return None

    def _relocate_step(self) -> None:
        j = self._journal
        segno = self.reloc_seg
        seg = j._segs[segno]
        if not self._reloc_queues_done:
            for qid, info in list(j._queues.items()):
                if info.segno == segno:
                    record = encode_queue(qid, info.name, info.attributes)
                    j._place_queue(
                        qid, QueueInfo(info.name, info.attributes, 0, len(record)), record
                    )
                    self.st_relocated += 1
            self._reloc_queues_done = True
        budget_records = _RELOCATE_RECORDS
        budget_bytes = min(_RELOCATE_BYTES, j._max_batch_bytes)
        msgs = seg.msgs
        while msgs and budget_records > 0 and budget_bytes > 0:
            qid = next(iter(msgs))
            m = msgs[qid]
            while m and budget_records > 0 and budget_bytes > 0:
                seq, e = m.popitem()
                record = encode_add(qid, e)
                n = len(record)
                target = j._append(record)
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
                self.st_relocated += 1
            if not m:
                del msgs[qid]
        if msgs:
            return  # more next time
        # segment empty: delete once everything up to now is durable
        self.reloc_seg = 0
        self.retired[segno] = j.batch_no
        self.retired_bytes += seg.size
