"""The delivery log's buffer as the writer takes it (`Batch`): flat, `FIELDS` values
per record, seqs implicit, folded records (`amqbroker.core.delivery_log.FOLDED`)
expanded by the writer, in Python (`Batch.expand`, JSON lines) or in Arrow
(`DeliveryLogWriter._table`, with `arange`)."""

from __future__ import annotations

from typing import Any

from amqbroker.core.delivery_log import (
    DISPATCHED,
    FOLDED,
    RECEIVED,
    RECEIVED_DISPATCHED,
    ROUTED,
    records_of,
)

__all__ = ["FIELDS", "Batch", "Row", "arange"]

#: one buffered event: time (epoch s), event code, queue, message-id, producer,
#: group id, group seq, consumer, outcome, delivery count, producer identity (markers: group
#: seq and delivery count None); its seq is implicit (`Batch`)
Row = tuple[
    float,
    int,
    str | None,
    str | None,
    str | None,
    str | None,
    int | None,
    str | None,
    str | None,
    int | None,
    str | None,
]


#: values per record in the buffer (`Row`)
FIELDS = 11


class Batch:
    """The records taken from the buffer, flat: `values` holds `FIELDS` values per
    record, in `Row` order (a record is no object of its own: appending one creates a
    tuple that is freed at once, so buffered records add nothing to the cyclic garbage
    collector's count; a tuple per record made the log triple the broker's collections,
    about 1.7 µs per message). `values` is the event loop's buffer itself, a plain
    list: `marshal` takes it without a copy, and a value only the buffer refers to (the
    time of each record) is then written without an entry in `marshal`'s table of
    shared objects (a copy made every value shared: about a third of `marshal`'s time).
    Their seqs are implicit: `first_seq` for the first, one more for each record the
    previous one stands for (a folded one, `amqbroker.core.delivery_log.FOLDED`, stands
    for two or three), except the rows in `explicit` ((index, seq): markers buffered
    after records were dropped for a full buffer)."""

    __slots__ = ("explicit", "first_seq", "values")

    def __init__(
        self,
        values: list[Any] | None = None,
        first_seq: int = 1,
        explicit: list[tuple[int, int]] | None = None,
    ) -> None:
        self.values: list[Any] = [] if values is None else values
        self.first_seq = first_seq
        self.explicit: list[tuple[int, int]] = [] if explicit is None else explicit

    @property
    def n_rows(self) -> int:
        """Records buffered (a folded one counts one)."""
        return len(self.values) // FIELDS

    def rows(self) -> list[Row]:
        """The records as tuples."""
        v = self.values
        return list(zip(*(v[k::FIELDS] for k in range(FIELDS)), strict=True))

    def records(self) -> int:
        """How many records the batch stands for (folded ones count two or three)."""
        return sum(map(records_of, self.values[1::FIELDS]))

    def expand(self) -> tuple[list[Row], list[int]]:
        """The records to write and their seqs: each folded record becomes the
        ``received``, ``routed`` (and ``dispatched``) records it stands for, with its
        time, in consecutive seqs."""
        q = self.first_seq
        explicit = dict(self.explicit)
        rows: list[Row] = []
        out: list[int] = []
        add, add_seq = rows.append, out.append
        for i, r in enumerate(self.rows()):
            ev = r[1]
            if ev < FOLDED:
                add(r)
                add_seq(explicit.get(i, q))
                q += 1
                continue
            t, _, queue, mid, producer, gid, gseq, consumer, _, dc, ident = r
            add((t, RECEIVED, queue, mid, producer, gid, gseq, None, None, dc, ident))
            add((t, ROUTED, queue, mid, producer, gid, gseq, None, None, dc, ident))
            add_seq(q)
            add_seq(q + 1)
            q += 2
            if ev == RECEIVED_DISPATCHED:
                add((t, DISPATCHED, queue, mid, producer, gid, gseq, consumer, None, dc, ident))
                add_seq(q)
                q += 1
        return rows, out


def arange(n: int) -> Any:
    """0, 1, ... n - 1 as an Arrow int64 array (C speed)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    return pc.subtract(pc.cumulative_sum(pa.repeat(pa.scalar(1, pa.int64()), n)), 1)
