"""Child process for the journal crash test (tests/unit/test_journal.py); not a test module.

Usage: ``python journal_crash_child.py <directory> <seed>``

Opens the journal with sync=True, recovers whatever is there, then loops forever
through the real group-commit API (take_batch / write_batch / batch_done, called
inline), doing random durable adds, acks and delivery-count updates on three queues.
Small segments and a low compaction threshold make segment rolls and compaction happen
while it runs. It prints on stdout, flushed line by line:

- ``READY`` once recovery is done;
- ``R <qid> <seq>`` right after recording an ack (before any write of it, so a missing
  line means the ack record was never written);
- ``A <qid> <seq>`` after the batch holding that ADD is synced (what the broker would
  acknowledge to the producer);
- ``K <qid> <seq>`` after the batch holding that ACK is synced;
- ``D <qid> <seq> <count>`` after the batch holding that DCOUNT is synced.

Every message's content is a function of (qid, seq) (see `expected_fields`), so the
test can verify whatever it recovers without knowing the child's random choices.
The parent kills it with SIGKILL at a random point.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

from amqbroker.core.entry import Entry
from amqbroker.store.journal import Journal

QIDS = (1, 2, 3)


def expected_fields(qid: int, seq: int) -> dict[str, Any]:
    """The persisted fields of message (qid, seq), except delivery_count."""
    unit = f"<{qid}:{seq}>".encode()
    size = 40 + (seq * 7919 + qid * 104729) % 300
    data = (unit * (size // len(unit) + 1))[:size]
    return {
        "data": data,
        "priority": seq % 10,
        "expiry": 0 if seq % 3 else 1_700_000_000_000 + seq,
        "group_id": None if seq % 4 == 0 else f"g-{qid}-{seq % 7}",
        "group_seq": seq,
    }


def make_entry(qid: int, seq: int) -> Entry:
    f = expected_fields(qid, seq)
    e = Entry(
        f["data"],
        durable=True,
        priority=f["priority"],
        expiry=f["expiry"],
        group_id=f["group_id"],
        group_seq=f["group_seq"],
    )
    e.seq = seq
    return e


def main() -> None:
    directory = Path(sys.argv[1])
    rng = random.Random(int(sys.argv[2]))
    out = sys.stdout
    j = Journal(
        directory,
        sync=True,
        segment_size=16 << 10,
        max_batch_bytes=8 << 10,
        compact_min_bytes=48 << 10,
    )
    recovered = j.open()
    live: dict[int, dict[int, Entry]] = {
        q.qid: {e.seq: e for e in q.entries} for q in recovered.queues
    }
    next_seq = {qid: max(live.get(qid, {0: None}), default=0) + 1 for qid in QIDS}
    for qid in QIDS:
        if qid not in live:
            j.queue_declared(qid, f"queue-{qid}", {"durable": True, "n": qid})
            live[qid] = {}
    out.write("READY\n")
    out.flush()
    while True:
        added: list[tuple[int, Entry]] = []
        for _ in range(rng.randint(1, 40)):
            qid = rng.choice(QIDS)
            seq = next_seq[qid]
            next_seq[qid] = seq + 1
            e = make_entry(qid, seq)
            j.message_added(qid, e)
            added.append((qid, e))
        acked: list[tuple[int, int]] = []
        counted: list[tuple[int, int, int]] = []
        for _ in range(rng.randint(0, 35)):
            qid = rng.choice(QIDS)
            if not live[qid]:
                continue
            seq = rng.choice(list(live[qid]))
            e = live[qid][seq]
            if rng.random() < 0.2:
                e.delivery_count += 1
                j.delivery_count_updated(qid, e)
                counted.append((qid, seq, e.delivery_count))
                continue
            del live[qid][seq]
            j.message_acked(qid, e)
            out.write(f"R {qid} {seq}\n")
            out.flush()
            acked.append((qid, seq))
        target = j.batch_no
        while j.synced_batch_no < target:
            batch = j.take_batch()
            assert batch is not None
            j.write_batch(batch)
            j.batch_done(batch)
        lines = [f"A {qid} {e.seq}\n" for qid, e in added]
        lines += [f"K {qid} {seq}\n" for qid, seq in acked]
        lines += [f"D {qid} {seq} {dc}\n" for qid, seq, dc in counted]
        for line in lines:
            out.write(line)
            out.flush()
        for qid, e in added:
            live[qid][e.seq] = e


if __name__ == "__main__":
    main()
