"""The delivery audit's checks (`amqbroker.pipeline.audit`): the invariants of
`amqbroker.pipeline.invariants` as DataFrame operations (steps 2 to 4 of the theory of
operation in `amqbroker.pipeline.audit`).

`slots` builds the per-copy table every check reads; `findings` unions the rows every
check finds (`_FINDING_COLS`, one ``kind`` per check); `collect_findings` counts and
samples them in two Spark actions and shapes the samples for the report (`Findings`).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from amqbroker.pipeline.invariants import (
    CLOSING_EVENTS,
    INVARIANTS,
    TERMINAL_EVENTS,
    TERMINAL_OUTCOMES,
)

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame


#: the columns of a finding row (null where a check has no such column)
_FINDING_COLS = (
    ("node", "string"),
    ("queue", "string"),
    ("group_id", "string"),
    ("message_id", "string"),
    ("seq", "bigint"),
    ("consumer", "string"),
    ("n", "bigint"),
    # two-owner episodes: the first moment is (node, seq, consumer), the last these
    ("first_ts_us", "bigint"),
    ("last_node", "string"),
    ("last_seq", "bigint"),
    ("last_consumer", "string"),
    ("last_ts_us", "bigint"),
    # producer order: the producer, its boot and the later message (its first dispatch:
    # last_node, last_ts_us; the message's own: node, first_ts_us); moves: from
    # last_node to node
    ("producer", "string"),
    ("boot", "bigint"),
    ("later_message_id", "string"),
    # producer order across entry nodes: the entry node and group-sequence of the
    # message and of the later one
    ("entry_node", "string"),
    ("group_seq", "bigint"),
    ("later_entry_node", "string"),
    ("later_group_seq", "bigint"),
)


def _finding(kind: str, df: DataFrame, **cols: Column) -> DataFrame:
    """`df` as finding rows of `kind` (`_FINDING_COLS`, null where it has none)."""
    from pyspark.sql import functions as F

    have = set(df.columns)
    return df.select(
        F.lit(kind).alias("kind"),
        *[
            (cols[c] if c in cols else F.col(c) if c in have else F.lit(None)).cast(t).alias(c)
            for c, t in _FINDING_COLS
        ],
    )


def _first_dispatch(mid: Any, node: Any, ts_us: Any) -> dict[str, Any]:
    when = datetime.datetime.fromtimestamp(ts_us / 1e6, datetime.UTC)
    return {
        "message_id": mid,
        "node": node,
        "ts_us": ts_us,
        "time": when.isoformat(timespec="microseconds"),
    }


def _boot(events: DataFrame, node: Column, seq: Column) -> Column:
    """The boot of a record of `node` at `seq`: the ``started`` markers of that node
    at or before it (1 action: the markers are few, one per start of a node)."""
    from pyspark.sql import functions as F

    starts = events.filter(F.col("event") == "started").select("node", "seq").collect()
    boot: Column = F.lit(0)
    for r in starts:
        boot = boot + ((node == F.lit(r["node"])) & (seq >= F.lit(r["seq"]))).cast("long")
    return boot


def _next_start(events: DataFrame, node: Column, seq: Column) -> Column:
    """The order key (owner_epoch, ts_us, node, seq) of the first ``started`` marker of
    `node` after `seq` (the end of that record's boot), or null (1 action, as `_boot`)."""
    from pyspark.sql import functions as F

    starts = (
        events.filter(F.col("event") == "started")
        .select("node", "seq", "owner_epoch", "ts_us")
        .collect()
    )
    nxt: Column = F.lit(None).cast("struct<owner_epoch:bigint,ts_us:bigint,node:string,seq:bigint>")
    for r in sorted(starts, key=lambda r: -int(r["seq"])):  # the smallest is tested first
        k = F.struct(
            F.lit(r["owner_epoch"]).cast("bigint").alias("owner_epoch"),
            F.lit(r["ts_us"]).cast("bigint").alias("ts_us"),
            F.lit(r["node"]).cast("string").alias("node"),
            F.lit(r["seq"]).cast("bigint").alias("seq"),
        )
        nxt = F.when((node == F.lit(r["node"])) & (seq < F.lit(r["seq"])), k).otherwise(nxt)
    return nxt


def _producer_messages(ev: DataFrame, slots: DataFrame) -> DataFrame:
    """The messages the producer-order checks compare (`amqbroker.pipeline.invariants`):
    each grouped message joined by message-id from its entry ``received`` (not on a
    node a ``forwarded`` record names; a resend's first) to its first dispatch in that
    queue on any node (``k``), late messages left out; ``e`` is the entry record."""
    from pyspark.sql import functions as F

    col = F.col
    inbound = (
        ev.filter(col("event") == "forwarded")
        .select("message_id", F.substring_index(col("queue"), "/", 1).alias("node"))
        .distinct()
    )
    entry = (
        ev.filter(col("event") == "received")
        .join(inbound, ["message_id", "node"], "left_anti")
        .groupBy("message_id")
        .agg(
            F.min(
                F.struct(
                    "ts_us",
                    "node",
                    "seq",
                    "queue",
                    "group_id",
                    "group_seq",
                    "producer",
                    "producer_identity",
                )
            ).alias("e")
        )
        .filter(
            col("e.group_id").isNotNull()
            & (col("e.producer").isNotNull() | col("e.producer_identity").isNotNull())
        )
    )
    k = F.struct("owner_epoch", "ts_us", "node", "seq")
    first = (
        ev.filter(col("event") == "dispatched")
        .groupBy("queue", "message_id")
        .agg(F.min(k).alias("k"))
    )
    late = slots.filter(col("late") == 1).select("message_id").distinct()
    return (
        first.join(entry, "message_id")
        .filter(col("queue") == col("e.queue"))
        .join(late, "message_id", "left_anti")
        .select("queue", "message_id", "k", "e")
    )


def _producer_order(events: DataFrame, msgs: DataFrame) -> DataFrame:
    """Producer order (`amqbroker.pipeline.invariants`) over `_producer_messages`: a
    window per (queue, group, entry node, boot, producer) ordered by the order key
    gives each message the earliest first dispatch of the messages after it."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    col = F.col
    msgs = msgs.filter(col("e.producer").isNotNull()).select(
        "queue",
        "message_id",
        "k",
        col("e.group_id").alias("group_id"),
        col("e.node").alias("entry_node"),
        _boot(events, col("e.node"), col("e.seq")).alias("boot"),
        col("e.producer").alias("producer"),
        F.coalesce(col("e.group_seq"), F.lit(0)).alias("gseq"),
        col("e.seq").alias("entry_seq"),
    )
    w_p = Window.partitionBy("queue", "group_id", "entry_node", "boot", "producer")
    every = F.min((col("gseq") > 0).cast("int")).over(w_p) == 1
    ordered = msgs.withColumn("ord", F.when(every, col("gseq")).otherwise(F.lit(0)))
    # the later messages, as the rows before in descending order: a frame that grows
    # (Spark computes it incrementally; one that shrinks to the end of a big group's
    # partition is recomputed for every row)
    w_later = w_p.orderBy(
        col("ord").desc(), col("entry_seq").desc(), col("message_id").desc()
    ).rowsBetween(Window.unboundedPreceding, -1)
    found = ordered.withColumn(
        "later", F.min(F.struct(col("k"), col("message_id").alias("mid"))).over(w_later)
    ).filter(col("later.k") < col("k"))
    return _finding(
        "producer_order",
        found,
        node=col("k.node"),
        first_ts_us=col("k.ts_us"),
        seq=col("k.seq"),
        producer=F.concat(col("entry_node"), F.lit("/"), col("producer")),
        later_message_id=col("later.mid"),
        last_node=col("later.k.node"),
        last_seq=col("later.k.seq"),
        last_ts_us=col("later.k.ts_us"),
    )


def _producer_order_across_entry_nodes(msgs: DataFrame) -> DataFrame:
    """Producer order across entry nodes (`amqbroker.pipeline.invariants`) over
    `_producer_messages`: per (queue, group, producer identity), only where every
    message has a group-sequence; a window ordered by the group-sequence gives each
    message the earliest first dispatch of the messages with a higher one (a range
    frame: equal group-sequences are not ordered between them)."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    col = F.col
    msgs = msgs.filter(col("e.producer_identity").isNotNull()).select(
        "queue",
        "message_id",
        "k",
        col("e.group_id").alias("group_id"),
        col("e.producer_identity").alias("producer"),
        col("e.node").alias("entry_node"),
        F.coalesce(col("e.group_seq"), F.lit(0)).cast("bigint").alias("gseq"),
    )
    w_p = Window.partitionBy("queue", "group_id", "producer")
    every = F.min((col("gseq") > 0).cast("int")).over(w_p) == 1
    # the messages with a higher group-sequence, as the rows before in ascending order
    # of its negation: a growing frame (see `_producer_order`)
    w_later = w_p.orderBy(-col("gseq")).rangeBetween(Window.unboundedPreceding, -1)
    later = F.struct(
        col("k"),
        col("message_id").alias("mid"),
        col("entry_node").alias("entry_node"),
        col("gseq").alias("gseq"),
    )
    found = (
        msgs.withColumn("every", every)
        .filter(col("every"))
        .withColumn("later", F.min(later).over(w_later))
        .filter(col("later.k") < col("k"))
    )
    return _finding(
        "producer_order_across_entry_nodes",
        found,
        node=col("k.node"),
        first_ts_us=col("k.ts_us"),
        seq=col("k.seq"),
        group_seq=col("gseq"),
        later_message_id=col("later.mid"),
        later_entry_node=col("later.entry_node"),
        later_group_seq=col("later.gseq"),
        last_node=col("later.k.node"),
        last_seq=col("later.k.seq"),
        last_ts_us=col("later.k.ts_us"),
    )


def _moves(events: DataFrame, ev: DataFrame) -> list[DataFrame]:
    """Moves without a release (`amqbroker.pipeline.invariants`): a group's dispatches
    and its ``unbound`` markers in one window per (queue, group) ordered by
    (owner_epoch, ts_us, node, seq). Two findings: ``move_events`` (each move) and
    ``moves`` (per queue, group, from node, to node)."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    col = F.col
    k = F.struct("owner_epoch", "ts_us", "node", "seq").alias("k")
    both = (
        ev.filter((col("event") == "dispatched") & col("group_id").isNotNull())
        .select("queue", "group_id", "node", "message_id", k, F.lit(1).alias("is_d"))
        .unionByName(
            events.filter((col("event") == "unbound") & col("group_id").isNotNull()).select(
                F.expr("substring(coalesce(queue, ''), instr(coalesce(queue, ''), '/') + 1)").alias(
                    "queue"
                ),
                "group_id",
                "node",
                "message_id",
                k,
                F.lit(0).alias("is_d"),
            )
        )
    )
    w = Window.partitionBy("queue", "group_id").orderBy("k")
    before = w.rowsBetween(Window.unboundedPreceding, -1)
    moved = (
        both.withColumn(
            "u", F.sum(1 - col("is_d")).over(w.rowsBetween(Window.unboundedPreceding, 0))
        )
        .withColumn("from_node", F.last(F.when(col("is_d") == 1, col("node")), True).over(before))
        .withColumn("from_u", F.last(F.when(col("is_d") == 1, col("u")), True).over(before))
        .filter(
            (col("is_d") == 1)
            & col("from_node").isNotNull()
            & (col("from_node") != col("node"))
            & (col("u") == col("from_u"))
        )
    )
    per_pair = moved.groupBy("queue", "group_id", "from_node", "node").agg(
        F.count(F.lit(1)).alias("n"), F.min(F.struct("k", "message_id")).alias("first")
    )
    return [
        _finding("move_events", moved, last_node=col("from_node"), seq=col("k.seq")),
        _finding(
            "moves",
            per_pair,
            last_node=col("from_node"),
            message_id=col("first.message_id"),
            seq=col("first.k.seq"),
            first_ts_us=col("first.k.ts_us"),
        ),
    ]


def message_events(events: DataFrame) -> DataFrame:
    """The records of `events` about a message (a message-id), queue null as ""."""
    from pyspark.sql import functions as F

    col = F.col
    return events.filter(col("message_id").isNotNull()).withColumn(
        "queue", F.coalesce(col("queue"), F.lit(""))
    )


def slots(
    ev: DataFrame, nodes: dict[str, dict[str, int]], grace_s: float
) -> tuple[DataFrame, DataFrame]:
    """The slots (one row per node, queue and message-id of `ev`, `message_events`:
    first seqs and times, counts, resolved, ...; cached: the caller unpersists it) and
    the copies among them. `nodes` (`node_totals`) gives each node's last event time."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    col = F.col
    ev_name = col("event")

    def is_(name: str) -> Column:
        return ev_name == name

    terminal_settle = is_("settled") & col("outcome").isin(*TERMINAL_OUTCOMES)

    def first(cond: Column, what: str) -> Column:
        return F.min(F.when(cond, col(what)))

    slots = ev.groupBy("node", "queue", "message_id").agg(
        F.max("group_id").alias("group_id"),
        F.sum(is_("received").cast("int")).alias("n_received"),
        F.sum(is_("routed").cast("int")).alias("n_routed"),
        F.sum(is_("forwarded").cast("int")).alias("n_forwarded"),
        F.sum(is_("dispatched").cast("int")).alias("n_dispatched"),
        first(is_("received"), "seq").alias("first_received"),
        first(is_("received"), "ts_us").alias("received_ts"),
        first(is_("routed"), "seq").alias("first_routed"),
        first(is_("routed"), "ts_us").alias("routed_ts"),
        first(is_("dispatched"), "seq").alias("first_dispatch"),
        first(is_("dispatched"), "ts_us").alias("first_dispatch_ts"),
        F.max(F.when(is_("dispatched"), col("seq"))).alias("max_dispatch"),
        F.max(F.when(ev_name.isin(*CLOSING_EVENTS), col("seq"))).alias("max_close"),
        first(is_("settled") & (col("outcome") == "accepted"), "seq").alias("first_accept"),
        first(terminal_settle, "ts_us").alias("settle_ts"),
        F.max((terminal_settle | ev_name.isin(*TERMINAL_EVENTS)).cast("int")).alias("resolved"),
        first(ev_name.isin("dead_lettered", "expired"), "seq").alias("dl_seq_slot"),
        F.max(is_("late").cast("int")).alias("late"),
    )
    w_msg = Window.partitionBy("node", "message_id")
    last_ts = F.create_map(
        *[x for n, v in nodes.items() for x in (F.lit(n), F.lit(v["last_ts_us"]))]
    )
    grace_us = int(grace_s * 1_000_000)
    slots = (
        slots.withColumn("routed_on_node", F.max("n_routed").over(w_msg) > 0)
        .withColumn("forwarded_here", F.max("n_forwarded").over(w_msg) > 0)
        .withColumn("recv_ts", F.min("received_ts").over(w_msg))
        .withColumn("dl_seq", F.min("dl_seq_slot").over(w_msg))
        .withColumn("arrival", F.coalesce(col("first_routed"), col("first_received")))
        .withColumn("arrival_ts", F.coalesce(col("routed_ts"), col("received_ts")))
        .withColumn(
            "is_copy",
            (col("n_routed") > 0) | ((col("n_received") > 0) & ~col("routed_on_node")),
        )
        .withColumn(
            "parked",
            (col("n_routed") > 0) & col("dl_seq").isNotNull() & (col("arrival") > col("dl_seq")),
        )
        .withColumn(
            "pending",
            F.lit(grace_us > 0) & (col("arrival_ts") > last_ts[col("node")] - F.lit(grace_us)),
        )
        .withColumn("dispatch_lat", col("first_dispatch_ts") - col("recv_ts"))
        .withColumn("settle_lat", col("settle_ts") - col("recv_ts"))
        .cache()
    )
    copies = slots.filter(col("is_copy"))
    return slots, copies


def findings(events: DataFrame, ev: DataFrame, slots: DataFrame, copies: DataFrame) -> DataFrame:
    """The rows every check finds (`_finding`), unioned and cached (they are few unless
    the broker is badly broken; the caller unpersists them)."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    col = F.col
    ev_name = col("event")

    def is_(name: str) -> Column:
        return ev_name == name

    # an unresolved routed copy is still queued at the end of the log (a backlog: not a
    # finding) unless a consumer holds it (its last dispatch never settled or released:
    # the delivery's outcome is missing) or a later copy of its group in its queue was
    # dispatched after it was (back) in the queue (it was skipped: a group's messages
    # go out in order): those are lost
    w_later = (
        Window.partitionBy(
            "node", "queue", "group_id", F.when(col("group_id").isNull(), col("message_id"))
        )
        # the later copies as the rows before in descending order: a growing frame
        # (a shrinking one, (1, unboundedFollowing), costs O(n²) in a big group)
        .orderBy(col("arrival").desc(), col("message_id").desc())
        .rowsBetween(Window.unboundedPreceding, -1)
    )
    held = col("max_dispatch").isNotNull() & (
        col("max_close").isNull() | (col("max_close") < col("max_dispatch"))
    )
    skipped = F.coalesce(
        col("later_dispatch") > F.greatest(col("arrival"), col("max_close")), F.lit(False)
    )
    open_copies = (
        copies.withColumn(
            "later_dispatch",
            F.when(col("group_id").isNotNull(), F.max("max_dispatch").over(w_later)),
        )
        .filter(
            (col("resolved") == 0)
            & ~((col("n_routed") == 0) & col("forwarded_here"))
            & ~col("parked")
            & ~col("pending")
        )
        .withColumn("queued", (col("n_routed") > 0) & ~held & ~skipped)
    )

    finding = _finding

    parts = [
        finding(
            "lost", open_copies.filter((col("n_routed") > 0) & ~col("queued")), seq=col("arrival")
        ),
        finding("still_queued", open_copies.filter(col("queued")), seq=col("arrival")),
        finding("unrouted", open_copies.filter(col("n_routed") == 0), seq=col("arrival")),
        finding(
            "duplicate_after_settle",
            slots.filter(
                col("first_accept").isNotNull() & (col("max_dispatch") > col("first_accept"))
            ),
            seq=col("max_dispatch"),
            n=col("n_dispatched"),
        ),
        finding(
            "received_twice",
            slots.groupBy("message_id")
            .agg(F.sum("n_received").alias("n"), F.sum("n_forwarded").alias("fwd"))
            .filter(col("n") > col("fwd") + 1),
        ),
    ]

    # order: per queue instance and group, copies by arrival
    w_order = (
        Window.partitionBy("node", "queue", "group_id")
        .orderBy("arrival", "message_id")
        .rowsBetween(Window.unboundedPreceding, -1)
    )
    parts.append(
        finding(
            "order_violations",
            copies.filter(col("group_id").isNotNull() & col("first_dispatch").isNotNull())
            .withColumn("earlier_max", F.max("first_dispatch").over(w_order))
            .filter(col("first_dispatch") < col("earlier_max")),
            seq=col("first_dispatch"),
        )
    )

    # two owners: deliveries as +1/-1 endpoints ordered by (epoch, time, node, seq); a
    # delivery its node's boot never closed (the node died) ends where the next boot
    # starts: its consumers went with the process
    key = F.struct("owner_epoch", "ts_us", "node", "seq")
    w_slot = (
        Window.partitionBy("node", "queue", "message_id", "boot")
        .orderBy("seq")
        .rowsBetween(1, Window.unboundedFollowing)
    )
    d = (
        ev.filter(col("group_id").isNotNull() & ev_name.isin("dispatched", *CLOSING_EVENTS))
        .withColumn("boot", _boot(events, col("node"), col("seq")))
        .withColumn(
            "close",
            F.first(F.when(ev_name.isin(*CLOSING_EVENTS), key), ignorenulls=True).over(w_slot),
        )
        .filter(is_("dispatched"))
        .withColumn("close", F.coalesce(col("close"), _next_start(events, col("node"), col("seq"))))
        .withColumn("consumer", F.coalesce(col("consumer"), F.lit("")))
    )
    common = ["queue", "group_id", "consumer", "node", "seq", "message_id"]
    endpoints = d.select(*common, key.alias("k"), F.lit(1).alias("delta")).unionByName(
        d.filter(col("close").isNotNull()).select(
            *common, col("close").alias("k"), F.lit(-1).alias("delta")
        )
    )
    # (k, seq) is unique: deliveries closed by one event share k, never a dispatch's seq
    w_g = Window.partitionBy("queue", "group_id").orderBy("k", "seq")
    w_gc = Window.partitionBy("queue", "group_id", "consumer").orderBy("k", "seq")
    before = Window.unboundedPreceding, -1
    upto = Window.unboundedPreceding, Window.currentRow
    # owners: consumers holding an open delivery of the group; an episode with two
    # owners runs from the endpoint that makes them 2 until they are 1 again; every
    # moment (a dispatch while another consumer holds one) falls in an episode
    ends = (
        endpoints.withColumn(
            "open_all", F.coalesce(F.sum("delta").over(w_g.rowsBetween(*before)), F.lit(0))
        )
        .withColumn(
            "open_mine", F.coalesce(F.sum("delta").over(w_gc.rowsBetween(*before)), F.lit(0))
        )
        .withColumn(
            "owners_delta",
            F.when((col("delta") == 1) & (col("open_mine") == 0), 1)
            .when((col("delta") == -1) & (col("open_mine") == 1), -1)
            .otherwise(0),
        )
        .withColumn("owners", F.sum("owners_delta").over(w_g.rowsBetween(*upto)))
        .withColumn(
            "episode",
            F.sum(
                ((col("owners") >= 2) & (col("owners") - col("owners_delta") < 2)).cast("long")
            ).over(w_g.rowsBetween(*upto)),
        )
    )
    moments = ends.filter((col("delta") == 1) & (col("open_all") - col("open_mine") > 0))
    parts.append(finding("two_owner_moments", moments, n=col("open_all") - col("open_mine")))
    m_key = F.struct(
        col("k"), col("node").alias("m_node"), col("seq").alias("m_seq"), col("consumer")
    )
    episodes = (
        moments.groupBy("queue", "group_id", "episode")
        .agg(
            F.count(F.lit(1)).alias("n"),
            F.min(m_key).alias("first"),
            F.max(m_key).alias("last"),
        )
        .select(
            "queue",
            "group_id",
            "n",
            col("first.m_node").alias("node"),
            col("first.m_seq").alias("seq"),
            col("first.consumer").alias("consumer"),
            col("first.k.ts_us").alias("first_ts_us"),
            col("last.m_node").alias("last_node"),
            col("last.m_seq").alias("last_seq"),
            col("last.consumer").alias("last_consumer"),
            col("last.k.ts_us").alias("last_ts_us"),
        )
    )
    parts.append(finding("two_owners", episodes))
    parts.append(finding("late", slots.filter(col("late") == 1), seq=col("arrival")))
    msgs = _producer_messages(ev, slots)
    parts.append(_producer_order(events, msgs))
    parts.append(_producer_order_across_entry_nodes(msgs))
    parts += _moves(events, ev)

    found = parts[0]
    for p in parts[1:]:
        found = found.unionByName(p)
    return found.cache()


def _moment(node: Any, seq: Any, consumer: Any, ts_us: Any) -> dict[str, Any]:
    when = datetime.datetime.fromtimestamp(ts_us / 1e6, datetime.UTC)
    return {
        "node": node,
        "seq": seq,
        "consumer": consumer,
        "ts_us": ts_us,
        "time": when.isoformat(timespec="microseconds"),
    }


@dataclass
class Findings:
    """What the driver receives of the findings: a count per kind, at most `samples`
    rows per kind (`collect_findings`)."""

    counts: dict[str, int]
    sample_rows: dict[str, list[dict[str, Any]]]

    def result_of(self, kind: str) -> dict[str, Any]:
        return {"count": self.counts.get(kind, 0), "samples": self.sample_rows.get(kind, [])}

    def invariants(self) -> dict[str, Any]:
        """The ``invariants`` of the audit result: a count and samples per invariant
        (two owners: episodes with their first and last moments, and the moments;
        producer order: the message and the later one dispatched before it)."""
        result_of = self.result_of
        two_owners = result_of("two_owners")
        two_owners["samples"] = [
            {
                "queue": x.get("queue"),
                "group_id": x.get("group_id"),
                "moments": x["n"],
                "first": _moment(x["node"], x["seq"], x.get("consumer"), x["first_ts_us"]),
                "last": _moment(
                    x["last_node"], x["last_seq"], x.get("last_consumer"), x["last_ts_us"]
                ),
            }
            for x in two_owners["samples"]
        ]
        two_owners["moments"] = result_of("two_owner_moments")

        producer_order = result_of("producer_order")
        producer_order["samples"] = [
            {
                "queue": x.get("queue"),
                "group_id": x.get("group_id"),
                "producer": x.get("producer"),
                "boot": x.get("boot"),
                # the message dispatched too late, and the later one dispatched before it
                "message": _first_dispatch(x["message_id"], x["node"], x["first_ts_us"]),
                "later": _first_dispatch(x["later_message_id"], x["last_node"], x["last_ts_us"]),
            }
            for x in producer_order["samples"]
        ]
        across = result_of("producer_order_across_entry_nodes")
        across["samples"] = [
            {
                "queue": x.get("queue"),
                "group_id": x.get("group_id"),
                "producer": x.get("producer"),
                # the message dispatched too late, and the one with a higher
                # group-sequence dispatched before it; each with its entry node
                "message": _first_dispatch(x["message_id"], x["node"], x["first_ts_us"])
                | {"group_seq": x.get("group_seq"), "entry_node": x.get("entry_node")},
                "later": _first_dispatch(x["later_message_id"], x["last_node"], x["last_ts_us"])
                | {"group_seq": x.get("later_group_seq"), "entry_node": x.get("later_entry_node")},
            }
            for x in across["samples"]
        ]
        shaped = {
            "two_owners": two_owners,
            "producer_order": producer_order,
            "producer_order_across_entry_nodes": across,
        }
        return {name: shaped[name] if name in shaped else result_of(name) for name in INVARIANTS}

    def moves(self) -> dict[str, Any]:
        """Moves without a release: per (queue, group, from node, to node), and the
        number of moves (``moves``)."""
        moves = self.result_of("moves")
        moves["moves"] = self.counts.get("move_events", 0)
        moves["samples"] = [
            {
                "queue": x.get("queue"),
                "group_id": x.get("group_id"),
                "from": x.get("last_node"),
                "to": x.get("node"),
                "moves": x["n"],
                "first": _first_dispatch(x.get("message_id"), x["node"], x["first_ts_us"]),
            }
            for x in moves["samples"]
        ]
        return moves


def collect_findings(found: DataFrame, samples: int) -> Findings:
    """The counts and at most `samples` rows per kind of `found` (`findings`)."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    col = F.col
    # 2 actions: counts, samples
    counts = {r["kind"]: r["count"] for r in found.groupBy("kind").count().collect()}
    w_kind = Window.partitionBy("kind").orderBy(*[c for c, _ in _FINDING_COLS])
    sample_rows: dict[str, list[dict[str, Any]]] = {}
    for r in (
        found.withColumn("i", F.row_number().over(w_kind)).filter(col("i") <= samples).collect()
    ):
        row = {k: v for k, v in r.asDict().items() if v is not None and k not in ("kind", "i")}
        sample_rows.setdefault(r["kind"], []).append(row)
    for rows in sample_rows.values():
        rows.sort(key=lambda x: tuple(str(x.get(c, "")) for c, _ in _FINDING_COLS))
    return Findings(counts, sample_rows)
