"""Synthetic delivery logs (the format of `amqbroker.pipeline.delivery_log_format`).

* `clean_log` simulates one broker node record by record: messages arrive in batches,
  each group has one owner at a time, a batch is dispatched in arrival order then
  settled; some deliveries are released and redelivered to the same owner, some
  messages are rejected (dead-lettered into a DLQ copy that nobody consumes: parked),
  some expire, one transactional send is rolled back (received, never routed), and
  groups change owner between batches, once the old owner has settled everything.
  Every invariant of `amqbroker.pipeline.invariants` holds on it.
* `inject_*` return a copy of a log with one fault of one kind, and what they broke.
* `write_log` writes records as the broker does (``<dir>/<node>/part-*.jsonl|parquet``).
* `write_bulk` generates a large clean log in chunks, vectorised (numpy + pyarrow),
  for the scale measurement: ``python scripts/gen_delivery_log.py --events 10000000``.
"""

from __future__ import annotations

import copy
import itertools
import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from amqbroker.pipeline import delivery_log_format as fmt

Record = dict[str, Any]

T0_US = 1_780_000_000_000_000


def _rec(
    node: str, event: str, queue: str | None, mid: str, gid: str | None, gseq: int | None, **kw: Any
) -> Record:
    r: Record = dict.fromkeys(fmt.FIELD_NAMES)
    r.update(
        node=node,
        event=event,
        queue=queue,
        message_id=mid,
        group_id=gid,
        group_seq=gseq,
        owner_epoch=0,
        delivery_count=0,
    )
    r.update(kw)
    return r


def clean_log(
    n_messages: int = 240,
    n_groups: int = 8,
    n_consumers: int = 3,
    node: str = "n1",
    queue: str = "orders",
    batch: int = 12,
    seed: int = 1,
    start_seq: int = 1,
    mid_prefix: str = "",
    group_prefix: str = "",
) -> list[Record]:
    """A valid log of one node (see the module docstring). Give each node of a
    multi-node log its own prefixes (a group on two nodes at once has two owners)."""
    rnd = random.Random(seed)
    out: list[Record] = []
    consumers = [f"c{i}/recv" for i in range(n_consumers)]
    owner = {f"{group_prefix}g{g}": consumers[g % n_consumers] for g in range(n_groups)}
    gseq: dict[str, int] = dict.fromkeys(owner, 0)
    dlq = "DLQ"
    i = 0
    while i < n_messages:
        msgs = []
        for _ in range(min(batch, n_messages - i)):
            gid: str | None = (
                f"{group_prefix}g{rnd.randrange(n_groups)}" if rnd.random() < 0.9 else None
            )
            gs = None
            if gid is not None:
                gseq[gid] += 1
                gs = gseq[gid]
            mid = f"{mid_prefix}m{i}"
            prod = f"p{i % 2}/send"
            msgs.append((mid, gid, gs, prod))
            out.append(_rec(node, "received", queue, mid, gid, gs, producer=prod))
            out.append(_rec(node, "routed", queue, mid, gid, gs, producer=prod))
            i += 1
        if i == batch:  # one rolled-back transactional send: received, never routed
            out.append(
                _rec(
                    node,
                    "received",
                    queue,
                    f"{mid_prefix}tx-rolled-back",
                    None,
                    None,
                    producer="p0/send",
                )
            )
        delivered = []
        for mid, gid, gs, prod in msgs:
            if rnd.random() < 0.03:  # expires before anybody gets it
                out.append(_rec(node, "expired", queue, mid, gid, gs, producer=prod))
                continue
            c = owner[gid] if gid is not None else rnd.choice(consumers)
            out.append(_rec(node, "dispatched", queue, mid, gid, gs, producer=prod, consumer=c))
            delivered.append((mid, gid, gs, prod, c))
        for mid, gid, gs, prod, c in delivered:
            roll = rnd.random()
            if roll < 0.05:  # released, then redelivered to the same owner
                out.append(
                    _rec(
                        node,
                        "settled",
                        queue,
                        mid,
                        gid,
                        gs,
                        producer=prod,
                        consumer=c,
                        outcome="released",
                    )
                )
                out.append(_rec(node, "dispatched", queue, mid, gid, gs, producer=prod, consumer=c))
                out.append(
                    _rec(
                        node,
                        "settled",
                        queue,
                        mid,
                        gid,
                        gs,
                        producer=prod,
                        consumer=c,
                        outcome="accepted",
                    )
                )
            elif roll < 0.08:  # rejected: dead-lettered, parked in the DLQ
                out.append(
                    _rec(
                        node,
                        "settled",
                        queue,
                        mid,
                        gid,
                        gs,
                        producer=prod,
                        consumer=c,
                        outcome="rejected",
                    )
                )
                out.append(_rec(node, "dead_lettered", queue, mid, gid, gs, producer=prod))
                out.append(_rec(node, "routed", dlq, mid, gid, gs, producer=prod))
            else:
                out.append(
                    _rec(
                        node,
                        "settled",
                        queue,
                        mid,
                        gid,
                        gs,
                        producer=prod,
                        consumer=c,
                        outcome="accepted",
                    )
                )
        # between batches every delivery is settled: a group may change owner
        for gid in owner:
            if rnd.random() < 0.15:
                owner[gid] = rnd.choice(consumers)
    for r in out:  # the producers' container-ids (one link each, "send")
        if r["producer"] is not None:
            r["producer_identity"] = f"container-{r['producer']}"
    return renumber(out, start_seq=start_seq, seed=seed)


def renumber(log: list[Record], start_seq: int = 1, seed: int = 0) -> list[Record]:
    """Assign per-node `seq` in list order and increasing timestamps (10-500 µs apart)."""
    rnd = random.Random(seed)
    seqs: dict[str, int] = {}
    ts: dict[str, int] = {}
    for r in log:
        n = r["node"]
        seqs[n] = seqs.get(n, start_seq - 1) + 1
        ts[n] = ts.get(n, T0_US) + rnd.randint(10, 500)
        r["seq"], r["ts_us"] = seqs[n], ts[n]
    return log


def _find(log: Sequence[Record], **match: Any) -> list[int]:
    return [i for i, r in enumerate(log) if all(r.get(k) == v for k, v in match.items())]


def _accepted_mid(log: Sequence[Record], rnd: random.Random, grouped: bool = True) -> str:
    cands = [
        r["message_id"]
        for r in log
        if r["event"] == "settled"
        and r["outcome"] == "accepted"
        and (r["group_id"] is not None) == grouped
    ]
    return rnd.choice(sorted(set(cands)))


def inject_lost(log: list[Record], seed: int = 0) -> tuple[list[Record], str]:
    """Drop the accepted settle of one message: it was received and never settled."""
    rnd = random.Random(seed)
    out = copy.deepcopy(log)
    mid = _accepted_mid(out, rnd, grouped=False)
    del out[_find(out, message_id=mid, event="settled", outcome="accepted")[-1]]
    return _keep_order(out), mid


def inject_duplicate_dispatch(log: list[Record], seed: int = 0) -> tuple[list[Record], str]:
    """Dispatch one message again after its accepted settle."""
    rnd = random.Random(seed)
    out = copy.deepcopy(log)
    mid = _accepted_mid(out, rnd, grouped=False)
    i = _find(out, message_id=mid, event="settled", outcome="accepted")[-1]
    again = dict(out[i], event="dispatched", outcome=None)
    out.insert(i + 1, again)
    return _keep_order(out), mid


def inject_received_twice(log: list[Record], seed: int = 0) -> tuple[list[Record], str]:
    """A second `received` of an existing message-id (a duplicate the broker let in)."""
    rnd = random.Random(seed)
    out = copy.deepcopy(log)
    mid = _accepted_mid(out, rnd)
    i = _find(out, message_id=mid, event="received")[0]
    out.insert(i + 1, dict(out[i]))
    return _keep_order(out), mid


def _plain(log: Sequence[Record], mid: str) -> bool:
    """Dispatched once, settled once, accepted."""
    mine = [r for r in log if r["message_id"] == mid]
    disp = [r for r in mine if r["event"] == "dispatched"]
    settles = [r for r in mine if r["event"] == "settled"]
    return len(disp) == 1 and len(settles) == 1 and settles[0]["outcome"] == "accepted"


def inject_out_of_order(log: list[Record], seed: int = 0) -> tuple[list[Record], tuple[str, str]]:
    """Swap the first dispatches of two consecutive messages of one group (and what
    follows them on those positions): the later one reaches the consumer first.
    Returns (group, message dispatched too early)."""
    rnd = random.Random(seed)
    out = copy.deepcopy(log)
    disp = [i for i, r in enumerate(out) if r["event"] == "dispatched" and r["group_id"]]
    pairs = []
    for a, b in itertools.pairwise(disp):
        ra, rb = out[a], out[b]
        if (
            ra["group_id"] == rb["group_id"]
            and ra["message_id"] != rb["message_id"]
            and _plain(out, ra["message_id"])
            and _plain(out, rb["message_id"])
        ):
            pairs.append((a, b))
    a, b = rnd.choice(pairs)
    ma, mb = out[a]["message_id"], out[b]["message_id"]
    # exchange which message each later event (dispatch, settle, ...) is about
    for r in out[a:]:
        if r["event"] in ("received", "routed"):
            continue
        if r["message_id"] == ma:
            r["message_id"], r["group_seq"] = mb, None
        elif r["message_id"] == mb:
            r["message_id"], r["group_seq"] = ma, None
    return out, (out[a]["group_id"], mb)


def inject_two_owners(log: list[Record], seed: int = 0) -> tuple[list[Record], tuple[str, str]]:
    """Give one dispatch (and its settle) of a group to another consumer while the
    owner still holds an earlier message of the group. Returns (group, new consumer)."""
    rnd = random.Random(seed)
    out = copy.deepcopy(log)
    consumers = sorted({r["consumer"] for r in out if r["consumer"]})
    cands = []
    for i, r in enumerate(out):
        if r["event"] != "dispatched" or not r["group_id"]:
            continue
        prev = out[i - 1]
        if prev["event"] == "dispatched" and prev["group_id"] == r["group_id"]:
            cands.append(i)
    i = rnd.choice(cands)
    gid, mid, old = out[i]["group_id"], out[i]["message_id"], out[i]["consumer"]
    new = next(c for c in consumers if c != old)
    for r in out[i:]:
        if r["message_id"] == mid and r["consumer"] == old:
            r["consumer"] = new
    return out, (gid, new)


def _keep_order(log: list[Record]) -> list[Record]:
    """After an insertion: seq in list order, timestamps kept non-decreasing."""
    seqs: dict[str, int] = {}
    ts: dict[str, int] = {}
    for r in log:
        n = r["node"]
        seqs[n] = r["seq"] if n not in seqs else seqs[n] + 1
        ts[n] = max(ts.get(n, r["ts_us"]), r["ts_us"])
        r["seq"], r["ts_us"] = seqs[n], ts[n]
    return log


# ---------------------------------------------------------------------------- files
def write_log(
    records: Sequence[Record], root: Path, fmt_name: str = "jsonl", per_file: int = 1000
) -> Path:
    """Write `records` under ``root/<node>/part-*.<ext>`` (several files per node)."""
    by_node: dict[str, list[Record]] = {}
    for r in sorted(records, key=lambda r: (r["node"], r["seq"])):
        by_node.setdefault(r["node"], []).append(r)
    for node, recs in by_node.items():
        d = root / node
        d.mkdir(parents=True, exist_ok=True)
        for k in range(0, len(recs), per_file):
            part = recs[k : k + per_file]
            path = d / fmt.file_name(part[0]["seq"], fmt_name)
            if fmt_name == "jsonl":
                with path.open("w") as fh:
                    for r in part:
                        fh.write(json.dumps({n: r[n] for n in fmt.FIELD_NAMES}) + "\n")
            else:
                import pyarrow as pa
                import pyarrow.parquet as pq

                table = pa.Table.from_pylist(
                    [{n: r[n] for n in fmt.FIELD_NAMES} for r in part], fmt.arrow_schema()
                )
                pq.write_table(table, path, compression="zstd")
    return root


def write_bulk(
    root: Path,
    events: int,
    nodes: int = 2,
    groups: int = 10_000,
    consumers: int = 8,
    chunk_messages: int = 250_000,
    fmt_name: str = "parquet",
    seed: int = 7,
    lost: int = 0,
) -> dict[str, int]:
    """A clean log of about `events` records (4 per message: received, routed,
    dispatched, settled accepted), spread over `nodes` nodes, written in chunks of
    `chunk_messages` messages per file. Batches of 64 messages are received and routed,
    then dispatched in arrival order to their group's fixed owner, then settled.
    Group sizes are skewed (Zipf-like); each group is on one node (when `groups` is a
    multiple of `nodes`). `lost` drops that many accepted settles
    (every ``(n // lost)``-th message) so the audit must find exactly that many."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    per_node = events // 4 // nodes
    batch = 64
    written = 0
    dropped = 0
    stride = (per_node * nodes) // lost if lost else 0
    names = np.array(["received", "routed", "dispatched", "settled"])
    for n in range(nodes):
        node = f"node{n}"
        d = root / node
        d.mkdir(parents=True, exist_ok=True)
        seq0, ts0 = 1, T0_US
        for c0 in range(0, per_node, chunk_messages):
            m = min(chunk_messages, per_node - c0)
            idx = np.arange(c0, c0 + m)
            # each group lives on one node (as the cluster's grouping arbiter makes it):
            # node n's groups are those with gid % nodes == n
            gid = (rng.zipf(1.3, m) - 1) % groups
            gid = (gid - gid % nodes + n) % groups if groups % nodes == 0 else gid
            # event order inside a batch of 64: 2 per message (recv, routed), then
            # dispatches, then settles
            b = idx - c0
            bstart = (b // batch) * batch
            bsize = np.minimum(batch, m - bstart)
            pos_recv = bstart * 4 + (b - bstart) * 2
            pos_routed = pos_recv + 1
            pos_disp = bstart * 4 + 2 * bsize + (b - bstart)
            pos_settle = pos_disp + bsize
            pos = np.concatenate([pos_recv, pos_routed, pos_disp, pos_settle])
            kind = np.repeat(np.arange(4), m)
            msg = np.tile(np.arange(m), 4)
            order = np.argsort(pos, kind="stable")
            kind, msg = kind[order], msg[order]
            keep = np.ones(len(kind), dtype=bool)
            if stride:
                global_i = n * per_node + c0 + msg
                drop = (kind == 3) & (global_i % stride == 0)
                keep &= ~drop
                dropped += int(drop.sum())
            kind, msg = kind[keep], msg[keep]
            k = len(kind)
            seq = np.arange(seq0, seq0 + k, dtype=np.int64)
            ts = ts0 + np.cumsum(rng.exponential(8.0, k)).astype(np.int64)
            seq0, ts0 = seq0 + k, int(ts[-1])
            gids = gid[msg]
            mids = np.char.add(f"{node}-", (c0 + msg).astype(str))
            cons = np.char.add("c", (gids % consumers).astype(str))
            cons = np.char.add(cons, "/recv")
            is_c = kind >= 2
            table = pa.table(
                {
                    "node": pa.array(np.full(k, node)),
                    "seq": pa.array(seq),
                    "ts_us": pa.array(ts),
                    "event": pa.array(names[kind]),
                    "queue": pa.array(np.full(k, "orders")),
                    "message_id": pa.array(mids),
                    "group_id": pa.array(np.char.add("g", gids.astype(str))),
                    "group_seq": pa.array(np.zeros(k, dtype=np.int32)),
                    "producer": pa.array(np.full(k, "p0/send")),
                    "consumer": pa.array(np.where(is_c, cons, None)),
                    "outcome": pa.array(np.where(kind == 3, "accepted", None)),
                    "owner_epoch": pa.array(np.zeros(k, dtype=np.int64)),
                    "delivery_count": pa.array(np.zeros(k, dtype=np.int32)),
                    "producer_identity": pa.nulls(k, pa.string()),
                },
                schema=fmt.arrow_schema(),
            )
            path = d / fmt.file_name(int(seq[0]), fmt_name)
            if fmt_name == "parquet":
                pq.write_table(table, path, compression="zstd")
            else:
                with path.open("w") as fh:
                    for row in table.to_pylist():
                        fh.write(json.dumps(row) + "\n")
            written += k
    return {"events": written, "messages": per_node * nodes, "lost": dropped}
