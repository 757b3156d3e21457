"""The delivery log writer: implements the core's `DeliveryLog` and writes the files
described in `amqbroker.pipeline.delivery_log_format`.

Theory of operation
-------------------
Two sides, like the journal's group commit:

* event loop (`event`, `take_batch`): each event appends one record to an in-memory
  buffer, flat (`Batch`: `FIELDS` values per record, no tuple kept): the clock, the
  event code and the entry's fields read at that moment (references, no formatting;
  only atomic values); the common arrival is one folded record
  (`amqbroker.core.delivery_log.FOLDED`, held by `held`). The sequence number is
  implicit (`Batch`: the first record's, plus the records each folded one stands
  for, plus the few markers buffered after dropped records). When the buffer reaches
  a quarter of `buffer_records` the writer loop (`store.writer`) is woken (`wake`); it
  also takes the buffer every `flush_interval`.
* worker thread (`write_batch`, `close`): turns a batch into columns (slices of the
  flat batch, pyarrow arrays, folded records expanded with `take`; JSON lines: rows
  expanded in Python) and appends them to the current file as one Parquet
  row group (or JSON lines); rotates at `rotate_bytes`; deletes the oldest closed
  files beyond `max_bytes`. One batch at a time; only this side touches files.
  With Parquet (issue 22) that work runs in a child process
  (`amqbroker.store.delivery_log_worker`): the thread serialises the batch with
  `marshal` and waits for the child's reply (GIL released), so the column building
  and the encoding leave the broker's process; one batch in flight, so a slow child
  holds the thread and the overflow policy applies as before. A child that dies
  loses its batch and its unfinished file (an ERROR line, records counted as
  dropped) and is restarted for the next batch; after `child_failures`
  (``delivery_log_child_failures``) failures in a row the delivery log is switched
  off (one ERROR line, records counted as dropped). At shutdown the child is given
  `child_exit_timeout` (``delivery_log_child_exit_timeout``) to publish its file and
  exit, then killed.

Overflow (`delivery_log_overflow`): at `buffer_records` buffered records, ``drop``
discards new records (they still take a sequence number, so the audit sees the gap;
counted in `statistics()["dropped"]` and logged once per episode); ``block`` keeps
every record and stops granting credit to producers (`ProducerLink._top_up` asks
`full`), which resume when the writer has taken the buffer. Records already in flight
(credit granted before, dispatches, settlements) are still appended, so the buffer
may pass its bound by what the producers' windows allow.

Markers: `open` buffers a ``started`` record (each boot of the node), `marker` an
``unbound`` one from the cluster arbiter (`amqbroker.pipeline.delivery_log_format`).

Invariants: `seq` strictly increases per node, across files and restarts (`open`
continues after the newest closed file); a file is renamed from ``.inprogress`` only
once complete; a crash loses the ``.inprogress`` Parquet file (no footer) and keeps
the complete lines of a JSON lines one (`open` repairs both). With the child process:
a broker crash loses its buffer and the batch being sent (the child sees the end of
its input, publishes its file and exits); a child crash loses the batch in flight and
the current ``.inprogress`` file (deleted by the restarted child).
"""

from __future__ import annotations

import bisect
import contextlib
import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from amqbroker.core.delivery_log import (
    DISPATCHED,
    FOLDED,
    RECEIVED_DISPATCHED,
    RECEIVED_ROUTED,
    STARTED,
    BlockedProducer,
    records_of,
)
from amqbroker.pipeline import delivery_log_format as fmt
from amqbroker.store.delivery_log_batch import FIELDS, Batch, Row, arange
from amqbroker.store.delivery_log_worker import ChildWriter

if TYPE_CHECKING:
    from amqbroker.core.consumer import Consumer
    from amqbroker.core.entry import Entry

log = logging.getLogger(__name__)

_INT32_MIN = -(1 << 31)
#: epoch changes remembered (older ones are only needed for records not yet written)
_EPOCH_HISTORY = 64
_INT32_MAX = (1 << 31) - 1
#: Parquet columns written with a dictionary, and with statistics
_DICTIONARY_COLUMNS = ["node", "event", "queue", "producer", "consumer", "outcome"]
_STATISTICS_COLUMNS = ["seq", "ts_us"]


def pyarrow_available() -> bool:
    try:
        import pyarrow
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        return False
    return True


class DeliveryLogWriter:
    def __init__(
        self,
        root: Path,
        *,
        file_format: str = "parquet",
        rotate_bytes: int = 64 << 20,
        max_bytes: int = 1 << 30,
        buffer_records: int = 200_000,
        overflow: str = "block",
        clock: Callable[[], float],
        message_id: Callable[[bytes], str | None],
        wake: Callable[[], object] | None = None,
        child: bool | None = None,
        child_failures: int = 3,
        child_exit_timeout: float = 10.0,
    ) -> None:
        #: <data_dir>/delivery-log
        self.root = root
        self.format = file_format
        self.rotate_bytes = rotate_bytes
        self.max_bytes = max_bytes
        self.limit = buffer_records
        self.take_at = max(1, buffer_records // 4)
        self.drop = overflow == "drop"
        #: buffer length (values, `FIELDS` per record) at which the writer is woken
        self._take_len = self.take_at * FIELDS
        #: buffer length at which producers wait (overflow "block")
        self._full_len = buffer_records * FIELDS
        #: buffer length kept before dropping (no bound under "block": producers wait)
        self._cap = buffer_records * FIELDS if self.drop else sys.maxsize
        self._clock = clock
        self._mid = message_id
        #: woken at a quarter full (the writer loop, `store.writer.DeliveryLogLoop`,
        #: sets it when none was given)
        self.wake = wake
        self.node = ""
        self.directory: Path | None = None
        #: the event loop's buffer, flat (`Batch.values`: `FIELDS` values per record)
        self._buf: list[Any] = []
        #: the seq of the buffer's first record, the records dropped since the
        #: last take (each took a seq), the rows buffered after a drop (index, seq)
        self._first = 1
        self._gap = 0
        #: seqs the buffered folded records take beyond one each
        self._extra = 0
        #: the message whose received record accept() holds, and its queue (the
        #: core's `DeliveryLog.held`)
        self.held: Entry | None = None
        self.held_queue = ""
        self._explicit: list[tuple[int, int]] = []
        #: (first seq, owner epoch) from that seq on: the cluster's arbiter epoch
        #: (`set_owner_epoch`), 0 on a single node; changes are rare (failovers)
        self._epochs: list[tuple[int, int]] = [(0, 0)]
        self._blocked: set[BlockedProducer] = set()
        self._dropping = 0
        self.dropped = 0
        self.written = 0
        # thread side
        self._ext = fmt.EXTENSIONS[file_format]
        self._cur: Path | None = None
        self._cur_first = 0
        self._cur_writer: Any = None
        self._cur_file: Any = None
        self._closed: list[tuple[Path, int]] = []
        self._schema: Any = None
        self._events: Any = None
        #: records per write (adapted to the bytes per record; see write_batch)
        self._chunk = max(16, rotate_bytes // (8 * 256))
        #: Parquet is written by a child process (None: in this process)
        self._child: ChildWriter | None = None
        self._use_child = file_format == "parquet" if child is None else child
        self._child_failures = 0
        #: failures of the child in a row before the log is switched off
        self.child_failures = child_failures
        #: seconds the child has to exit once its input is closed (then killed)
        self.child_exit_timeout = child_exit_timeout
        self.off = False

    # ------------------------------------------------------------ start-up
    def open(self, node: str, seq_floor: int = 0) -> None:
        """Create the node's directory, repair what a crash left, and continue the
        sequence after the newest closed file, at `seq_floor` at least (a pair member
        that becomes live: `fmt.seq_floor` of its epoch)."""
        closed = self.attach(node, warm=not self._use_child)
        d = self.directory
        assert d is not None
        last = 0
        others = [p for p in d.glob(f"{fmt.PREFIX}*") if p.suffix != self._ext]
        for p in closed[-1:] + sorted(others)[-1:]:
            last = max(last, _last_seq(p))
        self._first = max(last + 1, seq_floor)
        # the boot marker: the audit tells a restarted node's producers (connection ids
        # start again at c1) from those of its previous life
        self._buf += (self._clock(), STARTED, None, None, None, None, None, None, None, None, None)
        if self._use_child:
            self._child = ChildWriter(self)

    def attach(self, node: str, *, warm: bool = True) -> list[Path]:
        """The file side's start-up: create the node's directory, repair what a crash
        left, list the closed files (also run by the child process)."""
        self.node = node
        d = self.root / node
        d.mkdir(parents=True, exist_ok=True)
        self.directory = d
        for p in sorted(d.glob(f"{fmt.PREFIX}*{fmt.INPROGRESS}")):
            self._repair(p)
        closed = sorted(d.glob(f"{fmt.PREFIX}*{self._ext}"))
        self._closed = [(p, p.stat().st_size) for p in closed]
        if self.format == "parquet" and warm:
            import pyarrow as pa

            self._schema = fmt.arrow_schema()
            self._events = pa.array(fmt.EVENTS, type=pa.string())
            # pyarrow imports pandas (when installed) on its first conversion: pay that
            # here at start-up, not in the writer thread while the GIL is contended
            pa.array([0])
        return closed

    def _repair(self, p: Path) -> None:
        final = p.with_name(p.name[: -len(fmt.INPROGRESS)])
        try:
            if final.suffix == ".jsonl":
                data = p.read_bytes()
                keep = data[: data.rfind(b"\n") + 1]
                if keep:
                    p.write_bytes(keep)
                    p.rename(final)
                    log.warning("delivery log: kept the complete lines of %s", final.name)
                    return
            elif final.suffix == ".parquet":
                import pyarrow.parquet as pq

                try:
                    pq.ParquetFile(p).close()
                except Exception:
                    pass
                else:
                    p.rename(final)
                    return
            p.unlink()
            log.warning(
                "delivery log: %s was left unfinished by a crash and cannot be read; "
                "deleted (the audit will see a gap in seq)",
                p.name,
            )
        except OSError as exc:
            log.warning("delivery log: cannot repair %s: %s", p, exc)

    # ---------------------------------------------------- event loop side
    def event(
        self,
        event: int,
        queue: str | None,
        entry: Entry,
        consumer: Consumer | None = None,
        outcome: str | None = None,
    ) -> None:
        held = self.held
        if held is not None:
            self.held = None
            if held is entry and event == DISPATCHED:
                event = RECEIVED_DISPATCHED  # one record for the three
            else:  # another event: the held one is recorded first
                self.event(RECEIVED_ROUTED, self.held_queue, held)
        buf = self._buf
        n = len(buf)
        if n >= self._cap:
            width = records_of(event)
            self._gap += width
            self.dropped += width
            self._dropping += 1
            if self._dropping == 1:
                log.warning(
                    "delivery log: the buffer holds delivery_log_buffer_records (%d) "
                    "records; dropping records until the writer catches up (raise "
                    "delivery_log_buffer_records, or set delivery_log_overflow = block "
                    "to slow producers down instead)",
                    self.limit,
                )
            return
        tr = entry.trace
        if tr is None:
            tr = entry.trace = (self._mid(entry.data), None, None)
        # flat (`Batch`): the tuple is freed at once
        buf += (
            self._clock(),
            event,
            queue,
            tr[0],
            tr[1],
            entry.group_id,
            entry.group_seq,
            None if consumer is None else consumer.log_id,
            outcome,
            entry.delivery_count,
            tr[2],
        )
        if event >= FOLDED:
            self._extra += records_of(event) - 1
        if n == self._take_len and self.wake is not None:
            self.wake()

    def _record_held(self) -> None:
        held = self.held
        if held is not None:
            self.held = None
            self.event(RECEIVED_ROUTED, self.held_queue, held)

    def marker(self, event: int, queue: str, group_id: str, reason: str | None = None) -> None:
        """A marker about a group (`amqbroker.core.delivery_log.UNBOUND`, with its
        `reason` in the outcome column); rare, so never dropped for a full buffer."""
        self._record_held()
        buf = self._buf
        if self._gap:
            n = self.pending
            self._explicit.append((n, self._first + n + self._extra + self._gap))
        buf += (self._clock(), event, queue, None, None, group_id, None, None, reason, None, None)

    @property
    def _seq(self) -> int:
        """The last seq given (records buffered, dropped, taken)."""
        return self._first + self.pending + self._extra + self._gap - 1

    def set_owner_epoch(self, epoch: int) -> None:
        """Records from the next event on carry this owner epoch (the cluster calls
        this when the grouping arbiter's epoch changes)."""
        self._record_held()
        if epoch != self._epochs[-1][1]:
            self._epochs.append((self._seq + 1, epoch))
            if len(self._epochs) > _EPOCH_HISTORY:
                del self._epochs[1]

    def _epochs_of(self, seqs: list[int]) -> list[int]:
        """The owner epoch of each record (worker thread: reads a snapshot)."""
        marks = list(self._epochs)
        if len(marks) == 1:
            return [marks[0][1]] * len(seqs)
        starts = [m[0] for m in marks]
        return [marks[bisect.bisect_right(starts, q) - 1][1] for q in seqs]

    @property
    def full(self) -> bool:
        """Producers must wait (overflow "block" only: "drop" never holds credit)."""
        return len(self._buf) >= self._full_len and not self.drop

    @property
    def pending(self) -> int:
        return len(self._buf) // FIELDS

    def block(self, producer: BlockedProducer) -> None:
        self._blocked.add(producer)

    def forget(self, producer: BlockedProducer) -> None:
        self._blocked.discard(producer)

    def take_batch(self) -> Batch | None:
        """Everything buffered (None when empty); resumes blocked producers."""
        if self._dropping > 0:
            log.warning(
                "delivery log: %d record(s) dropped while the buffer was full", self._dropping
            )
            self._dropping = 0
        self._record_held()
        buf = self._buf
        batch = None
        if buf:
            batch = Batch(buf, self._first, self._explicit)
            self._explicit = []
            self._buf = []
        self._first += len(buf) // FIELDS + self._extra + self._gap
        self._gap = self._extra = 0
        if self._blocked:
            blocked = list(self._blocked)
            self._blocked.clear()
            for p in blocked:
                p.resume()
        return batch

    def statistics(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "format": self.format,
            "seq": self._seq,
            "written": self.written,
            "pending": self.pending,
            "dropped": self.dropped,
            "blocked_producers": len(self._blocked),
            "files": len(self._closed)
            + (self._cur is not None or (self._child is not None and self._child.file_open)),
            "bytes": sum(n for _, n in self._closed),
        }

    # ------------------------------------------------------- thread side
    def write_batch(self, batch: Batch | list[Row]) -> None:
        """Append a batch to the current file (worker thread); rotate and bound. A
        plain list of `Row` tuples (tests: an empty one, or rows numbered from 1) is
        taken too.

        The batch is written in chunks sized from the bytes per record seen so far
        (about an eighth of `rotate_bytes` each), so a file passes `rotate_bytes` by
        at most one chunk whatever the batch size."""
        if not isinstance(batch, Batch):
            batch = Batch([v for r in batch for v in r])
        if self._use_child:
            self._write_child(batch)
            return
        if self.format == "parquet":
            table = self._table(batch)
            n = table.num_rows
            seq_col = table.column("seq")
        else:
            rows, seqs = batch.expand()
            n = len(rows)
        i = 0
        while i < n:
            k = min(self._chunk, n - i)
            first = seq_col[i].as_py() if self.format == "parquet" else seqs[i]
            if self._cur is None:
                self._start(first)
            f = self._cur_file
            before = f.tell()
            if self.format == "parquet":
                self._cur_writer.write_table(table.slice(i, k))
            else:
                f.write(self._lines(rows[i : i + k], seqs[i : i + k]))
                f.flush()
            i += k
            self.written += k
            size = f.tell()
            per_record = max(1, (size - before) // k)
            self._chunk = max(16, self.rotate_bytes // (8 * per_record))
            if size >= self.rotate_bytes:
                self._finish()

    def close(self) -> None:
        """Close and publish the current file (worker thread or shutdown); stops the
        child process."""
        if self._child is not None:
            child, self._child = self._child, None
            try:
                child.close()
            except (OSError, EOFError) as exc:
                raise OSError(f"the delivery log's child process: {exc}") from exc
            return
        if self._cur is not None:
            self._finish()

    def _write_child(self, batch: Batch) -> None:
        if self.off:
            self.dropped += batch.records()
            return
        child = self._child
        if child is not None and not child.alive:
            # died between two batches: its unfinished file is lost
            exc: BaseException = OSError(f"exit code {child.returncode}")
            child.kill()
            self._child = child = None
            if self._child_failed(batch.records(), exc):
                return
            log.error(
                "delivery log: the child process writing %s died (%s); restarted (its "
                "unfinished file is lost: the audit sees a gap in seq)",
                self.directory,
                exc,
            )
        if child is None:
            child = self._child = ChildWriter(self)
        try:
            child.write(list(self._epochs), batch)
        except (OSError, EOFError, ValueError) as e:
            if isinstance(e, ValueError) and child.alive:
                raise  # a value marshal cannot serialise: this batch only
            child.kill()
            self._child = None
            if self._child_failed(batch.records(), e):
                return
            raise OSError(
                f"the delivery log's child process died ({e!r}); restarted for the next "
                "batch (its unfinished file is lost)"
            ) from e
        self._child_failures = 0

    def _child_failed(self, lost: int, exc: BaseException) -> bool:
        """Count a failure; True when the log was switched off (then `lost` records
        are counted as dropped here)."""
        self._child_failures += 1
        if self._child_failures < self.child_failures:
            return False
        self._switch_off(lost, exc)
        return True

    def _switch_off(self, lost: int, exc: BaseException) -> None:
        """The child failed `child_failures` times in a row: stop logging (worker
        thread; every later record is counted as dropped)."""
        self.off = True
        self.dropped += lost
        self.drop = True
        self._cap = 0
        self._dropping = -(1 << 62)  # never warn per record: the ERROR below says it
        self._child = None
        log.error(
            "delivery log: the child process writing %s failed %d times in a row (%s); "
            "the delivery log is switched off until the broker restarts (%d record(s) "
            "lost, every later one counted as dropped)",
            self.directory,
            self.child_failures,
            exc,
            lost,
        )

    def abandon_file(self) -> None:
        """After a failed write: publish the current file if it still closes cleanly,
        else delete it (a later write starts a new one); the audit sees the gap in
        seq."""
        if self._use_child:
            return  # the child abandoned its file itself
        cur = self._cur
        if cur is None:
            return
        ok = True
        try:
            if self._cur_writer is not None:
                self._cur_writer.close()
        except Exception:
            ok = False
        try:
            self._cur_file.close()
        except Exception:
            ok = False
        self._cur_writer = None
        self._cur_file = None
        self._cur = None
        final = cur.with_name(cur.name[: -len(fmt.INPROGRESS)])
        try:
            if ok:
                os.replace(cur, final)
                self._closed.append((final, final.stat().st_size))
            else:
                cur.unlink()
        except OSError as exc:
            log.warning("delivery log: cannot clean up %s: %s", cur, exc)

    def _start(self, first_seq: int) -> None:
        assert self.directory is not None
        name = fmt.file_name(first_seq, self.format) + fmt.INPROGRESS
        self._cur = self.directory / name
        self._cur_first = first_seq
        if self.format == "parquet":
            import pyarrow.parquet as pq

            self._cur_file = open(self._cur, "wb")  # noqa: SIM115 - closed in _finish
            # dictionaries only for the few-valued text columns (a message-id or
            # group-id dictionary costs time and makes the file larger: 12 bytes per
            # record against 5), statistics only for the columns a reader prunes by
            # (issue 22: 0.8 -> 0.3 us per record)
            self._cur_writer = pq.ParquetWriter(
                self._cur_file,
                self._schema,
                compression="zstd",
                use_dictionary=_DICTIONARY_COLUMNS,
                write_statistics=_STATISTICS_COLUMNS,
            )
        else:
            self._cur_file = open(self._cur, "w", encoding="utf-8")  # noqa: SIM115

    def _finish(self) -> None:
        cur = self._cur
        assert cur is not None
        if self._cur_writer is not None:
            self._cur_writer.close()
            self._cur_writer = None
        self._cur_file.close()
        self._cur_file = None
        self._cur = None
        final = cur.with_name(cur.name[: -len(fmt.INPROGRESS)])
        os.replace(cur, final)
        self._closed.append((final, final.stat().st_size))
        self._bound()

    def _bound(self) -> None:
        if self.max_bytes < 0:
            return
        total = sum(n for _, n in self._closed)
        while self._closed and total > self.max_bytes:
            p, n = self._closed.pop(0)
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
            total -= n

    def _table(self, batch: Batch) -> Any:
        """The batch as one Arrow table, folded records expanded: the columns are
        sliced from the flat batch and converted once per buffered record (C speed),
        then repeated per record each stands for with `take`; only the event and
        consumer of the copies differ (received, routed: no consumer; dispatched)."""
        import pyarrow as pa
        import pyarrow.compute as pc

        ts, ev, queues, mids, producers, gids, gseqs, cons, outcomes, dcs, idents = (
            batch.values[k::FIELDS] for k in range(FIELDS)
        )
        gid = pa.array(gids, type=pa.string())
        gseq = pa.array(gseqs, type=pa.int64())
        # a spent group close (outside int32) reads as -1; ungrouped as null
        gseq = pc.if_else(pc.or_(pc.less(gseq, _INT32_MIN), pc.greater(gseq, _INT32_MAX)), -1, gseq)
        gseq = pc.if_else(pc.is_null(gid), pa.scalar(None, pa.int64()), gseq)
        events = pa.array(ev, type=pa.int8())
        cols = {
            "ts_us": pc.cast(
                pc.multiply(pa.array(ts, type=pa.float64()), 1_000_000.0),
                pa.int64(),
                safe=False,
            ),
            "event": events,
            "queue": pa.array(queues, type=pa.string()),
            "message_id": pa.array(mids, type=pa.string()),
            "group_id": gid,
            "group_seq": pc.cast(gseq, pa.int32()),
            "producer": pa.array(producers, type=pa.string()),
            "consumer": pa.array(cons, type=pa.string()),
            "outcome": pa.array(outcomes, type=pa.string()),
            "delivery_count": pa.array(dcs, type=pa.int32()),
            "producer_identity": pa.array(idents, type=pa.string()),
        }
        n = len(events)
        folded = pc.greater_equal(events, FOLDED)
        if pc.any(folded).as_py():
            # offsets of each buffered record's first expanded one; idx: the buffered
            # record of each expanded one; pos: its place among its copies; width:
            # `records_of`, column-wise
            width = pc.if_else(folded, pc.subtract(events.cast(pa.int32()), FOLDED - 2), 1)
            offsets = pa.concat_arrays(
                [pa.array([0], pa.int32()), pc.cumulative_sum(width.cast(pa.int32()))]
            )
            n = offsets[-1].as_py()
            idx = pc.list_parent_indices(pa.ListArray.from_arrays(offsets, pa.nulls(n)))
            cols = {k: pc.take(v, idx) for k, v in cols.items()}
            pos = pc.subtract(arange(n), pc.take(offsets, idx)).cast(pa.int8())
            copy = pc.take(folded, idx)
            # received 0, routed 1, dispatched 3 (forwarded, 2, is never folded)
            code = pc.if_else(pc.equal(pos, 2), pa.scalar(DISPATCHED, pa.int8()), pos)
            cols["event"] = pc.if_else(copy, code, cols["event"])
            cols["consumer"] = pc.if_else(
                pc.and_(copy, pc.less(pos, 2)), pa.scalar(None, pa.string()), cols["consumer"]
            )
            starts = offsets.to_pylist() if batch.explicit else []
        else:
            starts = list(range(n + 1)) if batch.explicit else []
        seq = pc.add(arange(n), batch.first_seq)
        if batch.explicit:  # markers after dropped records (rare)
            seqs = seq.to_pylist()
            for i, x in batch.explicit:
                seqs[starts[i]] = x
            seq = pa.array(seqs, type=pa.int64())
        marks = list(self._epochs)
        epochs = (
            pa.repeat(pa.scalar(marks[0][1], pa.int64()), n)
            if len(marks) == 1
            else pa.array(self._epochs_of(seq.to_pylist()), type=pa.int64())
        )
        cols["event"] = pc.take(self._events, cols["event"])
        cols["node"] = pa.repeat(pa.scalar(self.node, pa.string()), n)
        cols["seq"] = seq
        cols["owner_epoch"] = epochs
        return pa.Table.from_arrays([cols[f] for f in fmt.FIELD_NAMES], schema=self._schema)

    def _lines(self, batch: list[Row], seqs: list[int]) -> str:
        node = self.node
        events = fmt.EVENTS
        dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
        out = []
        epochs = self._epochs_of(seqs)
        for i, (t, ev, queue, mid, producer, gid, gseq, consumer, outcome, dc, ident) in enumerate(
            batch
        ):
            seq = seqs[i]
            out.append(
                dumps(
                    {
                        "node": node,
                        "seq": seq,
                        "ts_us": int(t * 1_000_000),
                        "event": events[ev],
                        "queue": queue,
                        "message_id": mid,
                        "group_id": gid,
                        "group_seq": None
                        if gid is None or gseq is None
                        else (gseq if _INT32_MIN <= gseq <= _INT32_MAX else -1),
                        "producer": producer,
                        "consumer": consumer,
                        "outcome": outcome,
                        "owner_epoch": epochs[i],
                        "delivery_count": dc,
                        "producer_identity": ident,
                    }
                )
            )
        out.append("")
        return "\n".join(out)


def _last_seq(p: Path) -> int:
    """The highest seq in a closed file (0 when it cannot be read)."""
    try:
        if p.suffix == ".parquet":
            import pyarrow.compute as pc
            import pyarrow.parquet as pq

            col = pq.read_table(p, columns=["seq"]).column("seq")
            m = pc.max(col).as_py()
            return int(m) if m is not None else 0
        with open(p, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 65536))
            lines = f.read().splitlines()
        for line in reversed(lines):
            try:
                return int(json.loads(line)["seq"])
            except (ValueError, KeyError, TypeError):
                continue
    except (OSError, ImportError) as exc:
        log.warning("delivery log: cannot read the last seq of %s: %s", p, exc)
    except Exception as exc:
        log.warning("delivery log: cannot read the last seq of %s: %s", p, exc)
    return 0
