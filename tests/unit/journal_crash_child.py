"""Child process for the journal crash test (tests/unit/test_journal.py); not a test module.

Usage: ``python journal_crash_child.py <directory> <seed>`` or
``python journal_crash_child.py <directory> <seed> atomic <first group>`` (see
`main_atomic`, used by tests/unit/test_journal_atomic.py).

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
        "deliver_at": 0 if seq % 5 else 1_800_000_000_000 + seq,
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
    e.deliver_at = f["deliver_at"]
    return e


#: messages of atomic group g have seq ``g * GROUP_SPAN + i`` (i < GROUP_SPAN)
GROUP_SPAN = 16


def main_atomic(directory: Path, rng: random.Random, first_group: int) -> None:
    """Atomic groups in a loop; the parent checks every group is all there or not at all.

    Group g (numbers from `first_group` up, never reused: the parent passes one above
    every number it has seen) adds n messages spread over the queues, with seq
    ``g * GROUP_SPAN + i``, and may also ack every message of one earlier live group
    ("consume" it) and set the delivery count of every message of another live group
    to g ("bump" it) - all in one atomic group. Several groups go into one batch. Lines:

    - ``READY`` once recovery is done;
    - ``B <g> <n> <consumed group or -1> <bumped group or -1>`` before the group's
      records are even buffered;
    - ``C <g>`` once the batch holding the group is synced.
    """
    out = sys.stdout
    j = Journal(
        directory,
        sync=True,
        segment_size=16 << 10,
        max_batch_bytes=8 << 10,
        compact_min_bytes=48 << 10,
    )
    recovered = j.open()
    live: dict[int, list[tuple[int, Entry]]] = {}
    for q in recovered.queues:
        for e in q.entries:
            live.setdefault(e.seq // GROUP_SPAN, []).append((q.qid, e))
    known = {q.qid for q in recovered.queues}
    for qid in QIDS:
        if qid not in known:
            j.queue_declared(qid, f"queue-{qid}", {"durable": True, "n": qid})
    out.write("READY\n")
    out.flush()
    g = first_group
    while True:
        pending: list[int] = []
        for _ in range(rng.randint(1, 4)):
            n = rng.randint(2, 8)
            candidates = list(live)
            # consume about as much as is added, so that compaction deletes segments
            p_consume = 0.95 if len(candidates) > 40 else 0.4
            consumed = rng.choice(candidates) if candidates and rng.random() < p_consume else -1
            others = [c for c in candidates if c != consumed]
            bumped = rng.choice(others) if others and rng.random() < 0.4 else -1
            out.write(f"B {g} {n} {consumed} {bumped}\n")
            out.flush()
            j.begin_atomic()
            added: list[tuple[int, Entry]] = []
            for i in range(n):
                qid = QIDS[(g + i) % len(QIDS)]
                e = make_entry(qid, g * GROUP_SPAN + i)
                j.message_added(qid, e)
                added.append((qid, e))
            if consumed >= 0:
                for qid, e in live.pop(consumed):
                    j.message_acked(qid, e)
            if bumped >= 0:
                for qid, e in live[bumped]:
                    e.delivery_count = g
                    j.delivery_count_updated(qid, e)
            j.end_atomic()
            live[g] = added
            pending.append(g)
            g += 1
        target = j.batch_no
        while j.synced_batch_no < target:
            batch = j.take_batch()
            assert batch is not None
            j.write_batch(batch)
            j.batch_done(batch)
        for done in pending:
            out.write(f"C {done}\n")
            out.flush()


def main() -> None:
    directory = Path(sys.argv[1])
    rng = random.Random(int(sys.argv[2]))
    if len(sys.argv) > 3 and sys.argv[3] == "atomic":
        main_atomic(directory, rng, int(sys.argv[4]))
        return
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
