"""The delivery audit's summaries (`amqbroker.pipeline.audit`): the totals per node,
event and outcome, the latency percentiles and histograms, the per-consumer load and
the group sizes and worst groups (step 5 of the theory of operation in
`amqbroker.pipeline.audit`). Each is a few Spark aggregations; the driver receives
aggregates only (at most `MAX_CONSUMER_ROWS` consumers and `WORST_GROUPS` groups).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from amqbroker.pipeline.audit_files import AuditError
from amqbroker.pipeline.delivery_log_format import SEQ_LIFE_SHIFT

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame

#: the per-consumer rows sent to the driver (the skew figures cover every consumer)
MAX_CONSUMER_ROWS = 50
#: worst groups in the report
WORST_GROUPS = 10
#: latency histogram: buckets per decade (log scale)
BUCKETS_PER_DECADE = 10
PERCENTILES = (0.5, 0.9, 0.99, 0.999)


def _rows(df: DataFrame, n: int) -> list[dict[str, Any]]:
    return [r.asDict(recursive=True) for r in df.limit(n).collect()]


@dataclass
class NodeTotals:
    """The records per node (seq range, first and last time, count), per event, per
    settle outcome and per release reason, and each node's seq gaps."""

    nodes: dict[str, dict[str, int]]
    by_event: dict[str, int]
    by_outcome: dict[str, int]
    #: the arbiter's releases of group bindings, by reason (``unbound`` markers)
    releases: dict[str, int]
    seq_gaps: dict[str, int]


def node_totals(events: DataFrame) -> NodeTotals:
    """The totals of `events` (1 action: a few rows); `AuditError` when it is empty."""
    from pyspark.sql import functions as F

    # 1 action: per node, event and outcome (a few rows): seq range, times, counts
    nodes: dict[str, dict[str, int]] = {}
    by_event: dict[str, int] = {}
    by_outcome: dict[str, int] = {}
    releases: dict[str, int] = {}
    #: (node, life) -> [events, min seq, max seq]: gaps are counted within a life
    #: (a pair member's log, `SEQ_LIFE_SHIFT`)
    lives: dict[tuple[str, int], list[int]] = {}
    for r in (
        events.groupBy(
            "node", F.shiftright("seq", SEQ_LIFE_SHIFT).alias("life"), "event", "outcome"
        )
        .agg(
            F.count(F.lit(1)).alias("events"),
            F.min("seq").alias("min_seq"),
            F.max("seq").alias("max_seq"),
            F.max("ts_us").alias("last_ts_us"),
            F.min("ts_us").alias("first_ts_us"),
        )
        .collect()
    ):
        by_event[r["event"]] = by_event.get(r["event"], 0) + r["events"]
        if r["event"] == "settled":
            o = r["outcome"] or "none"
            by_outcome[o] = by_outcome.get(o, 0) + r["events"]
        elif r["event"] == "unbound":
            o = r["outcome"] or "unknown"  # logs written before reasons were recorded
            releases[o] = releases.get(o, 0) + r["events"]
        life = lives.setdefault((r["node"], r["life"]), [0, r["min_seq"], r["max_seq"]])
        life[0] += r["events"]
        life[1] = min(life[1], r["min_seq"])
        life[2] = max(life[2], r["max_seq"])
        v = nodes.setdefault(r["node"], {"events": 0})
        v["events"] += r["events"]
        for k, pick in (
            ("min_seq", min),
            ("max_seq", max),
            ("last_ts_us", max),
            ("first_ts_us", min),
        ):
            v[k] = pick(v[k], r[k]) if k in v else r[k]
    if not nodes:
        raise AuditError("the delivery-log files hold no records")
    seq_gaps: dict[str, int] = {}
    for (n, _), (count, lo, hi) in sorted(lives.items()):
        if hi - lo + 1 != count:
            seq_gaps[n] = seq_gaps.get(n, 0) + hi - lo + 1 - count

    return NodeTotals(nodes, by_event, by_outcome, releases, seq_gaps)


def latency(copies: DataFrame) -> tuple[Any, dict[str, Any]]:
    """The totals row of `copies` (copies, parked, pending, redeliveries, messages,
    queues; the latency figures) and the ``latency`` of the audit result: percentiles
    and a log-scale histogram of the dispatch and settle latencies."""
    from pyspark.sql import functions as F

    col = F.col
    # 2 actions: latency percentiles and totals; histograms of both latencies
    pct = F.array(*[F.lit(p) for p in PERCENTILES])
    lat_row = copies.agg(
        F.count(F.lit(1)).alias("copies"),
        F.sum(col("parked").cast("int")).alias("parked"),
        F.sum(col("pending").cast("int")).alias("pending"),
        (F.sum("n_dispatched") - F.count("first_dispatch")).alias("redeliveries"),
        F.approx_count_distinct("message_id").alias("messages"),
        F.countDistinct("queue").alias("queues"),
        *[
            x
            for name in ("dispatch", "settle")
            for x in (
                F.count(col(f"{name}_lat")).alias(f"{name}_count"),
                F.percentile_approx(col(f"{name}_lat"), pct, 10_000).alias(f"{name}_pct"),
                F.max(col(f"{name}_lat")).alias(f"{name}_max"),
                F.avg(col(f"{name}_lat")).alias(f"{name}_mean"),
            )
        ],
    ).collect()[0]
    lat = F.explode(
        F.array(
            *[
                F.struct(F.lit(name).alias("which"), col(f"{name}_lat").alias("us"))
                for name in ("dispatch", "settle")
            ]
        )
    ).alias("l")
    hist: dict[str, list[list[float]]] = {"dispatch": [], "settle": []}
    for r in (
        copies.select(lat)
        .filter(col("l.us").isNotNull())
        .groupBy(
            col("l.which").alias("which"),
            F.floor(F.log10(F.greatest(col("l.us"), F.lit(1))) * BUCKETS_PER_DECADE).alias("b"),
        )
        .count()
        .orderBy("which", "b")
        .collect()
    ):
        b = r["b"]
        hist[r["which"]].append(
            [10 ** (b / BUCKETS_PER_DECADE), 10 ** ((b + 1) / BUCKETS_PER_DECADE), r["count"]]
        )
    latency = {
        name: {
            "count": lat_row[f"{name}_count"],
            "percentiles_us": dict(
                zip([str(p) for p in PERCENTILES], lat_row[f"{name}_pct"] or [], strict=False)
            ),
            "max_us": lat_row[f"{name}_max"],
            "mean_us": lat_row[f"{name}_mean"],
            "histogram": hist[name],
        }
        for name in ("dispatch", "settle")
    }
    return lat_row, latency


def consumers(ev: DataFrame) -> dict[str, Any]:
    """The ``consumers`` of the audit result: the skew of the dispatches over every
    consumer, and the `MAX_CONSUMER_ROWS` busiest ones."""
    from pyspark.sql import functions as F

    col = F.col
    ev_name = col("event")

    def is_(name: str) -> Column:
        return ev_name == name

    # 1 action: consumers (the skew figures over all of them ride on every row)
    cons = (
        ev.filter(col("consumer").isNotNull())
        .groupBy("consumer")
        .agg(
            F.sum(is_("dispatched").cast("long")).alias("dispatches"),
            F.sum((is_("settled") & (col("outcome") == "accepted")).cast("long")).alias("accepted"),
            F.approx_count_distinct(F.when(is_("dispatched"), col("group_id"))).alias("groups"),
        )
        .cache()
    )
    skew = cons.agg(
        F.count(F.lit(1)).alias("_n"),
        F.max("dispatches").alias("_max"),
        F.min("dispatches").alias("_min"),
        F.avg("dispatches").alias("_mean"),
        F.stddev_pop("dispatches").alias("_sd"),
    )
    cons_rows = (
        cons.crossJoin(skew)
        .orderBy(col("dispatches").desc(), "consumer")
        .limit(MAX_CONSUMER_ROWS)
        .collect()
    )
    cons.unpersist()
    mean = cons_rows[0]["_mean"] if cons_rows else 0.0
    consumers = {
        "count": cons_rows[0]["_n"] if cons_rows else 0,
        "max_over_mean": (cons_rows[0]["_max"] / mean) if mean else None,
        "min_over_mean": (cons_rows[0]["_min"] / mean) if mean else None,
        "cv": (cons_rows[0]["_sd"] / mean) if mean else None,
        "rows": [{k: v for k, v in r.asDict().items() if not k.startswith("_")} for r in cons_rows],
    }
    return consumers


def groups(found: DataFrame, copies: DataFrame) -> dict[str, Any]:
    """The ``groups`` of the audit result: the group-size histogram and the
    `WORST_GROUPS` worst groups (by the findings of `found` against them, then p99
    settle latency)."""
    from pyspark.sql import functions as F

    col = F.col
    # 2 actions: group sizes, worst groups
    bad = (
        found.filter(
            col("kind").isin(
                "order_violations",
                "producer_order",
                "producer_order_across_entry_nodes",
                "two_owners",
                "two_owner_moments",
            )
        )
        .groupBy("queue", "group_id")
        .agg(
            F.sum((col("kind") == "order_violations").cast("long")).alias("order_violations"),
            # both producer-order checks (one message can be in both)
            F.sum(
                col("kind").isin("producer_order", "producer_order_across_entry_nodes").cast("long")
            ).alias("producer_order"),
            F.sum((col("kind") == "two_owners").cast("long")).alias("two_owner_episodes"),
            F.sum((col("kind") == "two_owner_moments").cast("long")).alias("two_owner_moments"),
        )
    )
    per_group = (
        copies.filter(col("group_id").isNotNull())
        .groupBy("queue", "group_id")
        .agg(
            F.count(F.lit(1)).alias("messages"),
            F.percentile_approx("settle_lat", 0.99, 1000).alias("p99_settle_us"),
            F.max("settle_lat").alias("max_settle_us"),
            (F.sum("n_dispatched") - F.count("first_dispatch")).alias("redeliveries"),
        )
        .join(bad, ["queue", "group_id"], "left")
        .fillna(
            0, ["order_violations", "producer_order", "two_owner_episodes", "two_owner_moments"]
        )
        .cache()
    )
    size_hist = (
        per_group.groupBy(F.floor(F.log2(col("messages"))).alias("b"))
        .count()
        .orderBy("b")
        .collect()
    )
    groups = {
        "count": sum(r["count"] for r in size_hist),
        "size_histogram": [[2 ** r["b"], 2 ** (r["b"] + 1), r["count"]] for r in size_hist],
        "worst": _rows(
            per_group.orderBy(
                (col("order_violations") + col("producer_order") + col("two_owner_moments")).desc(),
                col("p99_settle_us").desc_nulls_last(),
                "queue",
                "group_id",
            ),
            WORST_GROUPS,
        ),
    }
    per_group.unpersist()
    return groups
