"""The delivery audit: a PySpark job over the delivery logs of every node.

``amqbroker audit PATH...`` (`run`) finds the log files, runs `analyse` and writes the
report (`amqbroker.pipeline.report`): ``report.html`` (plots), ``report.md`` and
``audit.json`` in ``--out``. The exit code gates a deployment: 0 every invariant holds,
1 at least one is broken, 2 the audit could not run (no files, bad path, a bad file:
see `check_file` and ``--skip-bad-files``, Spark error).

Theory of operation
-------------------
The checks are those of `amqbroker.pipeline.invariants` (the plain-Python reference;
its docstring defines every term), expressed as DataFrame operations:

1. events: every ``part-*.parquet`` / ``part-*.jsonl`` under the paths (``*.inprogress``
   skipped), read with the format's schema and unioned.
2. slots: one ``groupBy(node, queue, message_id)`` with conditional aggregates (first
   routed / received / dispatch seq and time, first accepted seq, resolved, ...), then a
   window over ``(node, message_id)`` for what a slot needs from its siblings (receive
   time, routed on this node, dead-letter seq). Cached: every other step reads it.
3. lost / still queued / unrouted / duplicate-after-settle / late: filters on slots
   (still queued: unresolved, not held by a consumer, not overtaken by a later copy of
   its group: a window per ``(node, queue, group)``; reported, not a finding that
   fails the audit); received-twice: a ``groupBy(message_id)`` over slots; order: a
   window per ``(node, queue, group)`` ordered by arrival (running max of earlier
   copies' first dispatch).
4. two owners: a window per slot pairs each dispatch with its next settle/release; the
   deliveries become +1/-1 endpoints ordered by ``(owner_epoch, ts_us, node, seq)``;
   running sums per group and per (group, consumer) give, at each dispatch, the
   deliveries other consumers still hold (a moment), and the number of consumers
   holding one: an episode runs from where it reaches 2 until it drops below; the
   invariant counts episodes (each with its moments, first and last moment).
   Producer order (`_producer_order`): each message's entry ``received`` (an anti-join
   drops the nodes its ``forwarded`` records name) joined by message-id to its first
   dispatch in that queue on any node; a window per (queue, group, entry node, boot,
   producer) ordered by the order key gives each message the earliest first dispatch
   of the later ones (the boot: the ``started`` markers, collected, one per start of a
   node). Moves (`_moves`): the dispatches and ``unbound`` markers of a group in one
   window ordered like the two-owner endpoints.
5. latency percentiles (``percentile_approx``), log-scale histograms, per-consumer
   load, group sizes and the worst groups: aggregations.

It scales with Spark, not with the driver: the driver only receives aggregates (counts,
percentiles, histogram buckets, one row per consumer up to `MAX_CONSUMER_ROWS`, per-node
seq ranges) and at most `samples` example rows per finding; no per-message data is ever
collected.

Spark: ``local[*]`` by default (driver bound to 127.0.0.1, UI off), any master through
``--master``; under ``spark-submit`` (the JVM already exists) the submitted
configuration is used as is. An existing active session (tests) is reused, never
stopped.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from amqbroker.pipeline import delivery_log_format as fmt
from amqbroker.pipeline.invariants import (
    CLOSING_EVENTS,
    INVARIANTS,
    TERMINAL_EVENTS,
    TERMINAL_OUTCOMES,
)

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

log = logging.getLogger(__name__)

#: exit codes of `run`
EXIT_OK = 0
EXIT_BROKEN = 1
EXIT_ERROR = 2

#: the per-consumer rows sent to the driver (the skew figures cover every consumer)
MAX_CONSUMER_ROWS = 50
#: worst groups in the report
WORST_GROUPS = 10
#: latency histogram: buckets per decade (log scale)
BUCKETS_PER_DECADE = 10
PERCENTILES = (0.5, 0.9, 0.99, 0.999)


class AuditError(Exception):
    """The audit could not run; the message says why and what to do."""


@dataclass
class AuditOptions:
    paths: Sequence[str]
    master: str | None = None
    out: Path = Path("audit-report")
    formats: Sequence[str] = ("html", "md")
    #: copies that arrived within this many seconds of their node's last event are
    #: in flight, not lost
    grace_s: float = 0.0
    samples: int = 20
    driver_memory: str = "2g"
    shuffle_partitions: int | None = None
    extra_conf: dict[str, str] = field(default_factory=dict)
    #: leave out log files that fail `check_file` (named on stderr and in the report)
    #: instead of stopping with `EXIT_ERROR`
    skip_bad_files: bool = False


# ----------------------------------------------------------------------------- inputs
def find_files(paths: Sequence[str]) -> dict[str, list[str]]:
    """The closed log files under `paths` by format: each path is a data directory,
    a ``delivery-log`` directory, a node's directory or a file. A URL (``scheme://``)
    is passed to Spark as is (read recursively with the format's glob)."""
    found: dict[str, list[str]] = {"parquet": [], "jsonl": []}
    for p in paths:
        if "://" in p:
            for names in found.values():
                names.append(p)
            continue
        path = Path(p)
        if not path.exists():
            raise AuditError(
                f"{p}: no such file or directory; give a broker data directory, "
                f"its {fmt.DIRECTORY}/ directory, a node's directory or log files"
            )
        files = [path] if path.is_file() else sorted(path.rglob(f"{fmt.PREFIX}*"))
        for f in files:
            if f.name.endswith(fmt.INPROGRESS):
                continue
            for kind, ext in fmt.EXTENSIONS.items():
                if f.name.endswith(ext):
                    found[kind].append(str(f.resolve()))
    if not any(found.values()):
        raise AuditError(
            f"no delivery-log files ({fmt.PREFIX}*.parquet or *.jsonl) under "
            f"{', '.join(paths)}; is delivery_log = true on the broker?"
        )
    return found


#: Parquet's magic number, at both ends of a complete file
PARQUET_MAGIC = b"PAR1"
#: columns a delivery-log Parquet file must have (the others may be missing: nulls)
_REQUIRED_COLUMNS = ("node", "seq", "ts_us", "event")


def check_file(path: str) -> str | None:
    """What is wrong with the log file at `path`, or None when it looks readable.

    Cheap (a few bytes, the Parquet footer, a JSON line's first line), so a torn or
    foreign file stops the audit with one line before Spark reads it: Spark fails on
    such a file with a long stack trace, or silently skips an empty one. URLs are not
    checked."""
    if "://" in path:
        return None
    try:
        size = os.path.getsize(path)
        if size == 0:
            return "empty file (0 bytes)"
        with open(path, "rb") as fh:
            if path.endswith(fmt.EXTENSIONS["parquet"]):
                return _check_parquet(path, fh, size)
            first = fh.readline(1 << 20)
            fh.seek(-1, os.SEEK_END)
            if fh.read(1) != b"\n":
                return "truncated: the last line is incomplete"
    except OSError as exc:
        return f"cannot read it: {exc.strerror or exc}"
    try:
        rec = json.loads(first)
    except ValueError:
        return "not a JSON-lines delivery log: the first line is not JSON"
    missing = [c for c in _REQUIRED_COLUMNS if not isinstance(rec, dict) or c not in rec]
    if missing:
        return f"not a delivery-log file: the first record has no {', '.join(missing)}"
    return None


def _check_parquet(path: str, fh: Any, size: int) -> str | None:
    if size < 12:
        return f"truncated: {size} bytes, too short for a Parquet file"
    head = fh.read(4)
    fh.seek(-8, os.SEEK_END)
    tail = fh.read(8)
    if head != PARQUET_MAGIC:
        return "not a Parquet file (no PAR1 magic at the start)"
    if tail[4:] != PARQUET_MAGIC:
        return "truncated Parquet file (no PAR1 magic at the end: the footer is missing)"
    footer = int.from_bytes(tail[:4], "little")
    if not 0 < footer <= size - 12:
        return f"corrupt Parquet footer (length {footer} in a {size}-byte file)"
    try:
        import pyarrow.parquet as pq
    except ImportError:  # the magic numbers and the footer length are all we can check
        return None
    try:
        names = set(pq.read_metadata(path).schema.names)
    except Exception as exc:
        return f"unreadable Parquet footer: {_one_line(exc)}"
    missing = [c for c in _REQUIRED_COLUMNS if c not in names]
    if missing:
        return f"not a delivery-log file: no column {', '.join(missing)}"
    return None


def _one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def bad_files(files: dict[str, list[str]]) -> list[tuple[str, str]]:
    """(path, what is wrong) for each file of `files` (`find_files`) that fails
    `check_file`."""
    return [
        (name, problem)
        for names in files.values()
        for name in names
        if (problem := check_file(name)) is not None
    ]


def load_events(
    spark: SparkSession, paths: Sequence[str], files: dict[str, list[str]] | None = None
) -> DataFrame:
    """Every event under `paths` (or in `files`, by format, as `find_files` returns),
    with the format's column types."""
    from pyspark.sql import functions as F

    if files is None:
        files = find_files(paths)
    frames = []
    schema = fmt.SPARK_DDL.replace(" NOT NULL", "")
    for kind, names in files.items():
        if not names:
            continue
        urls = [n for n in names if "://" in n]
        local = [n for n in names if "://" not in n]
        reader = spark.read.schema(schema)
        if kind == "jsonl":
            if local:
                frames.append(reader.json(local))
            if urls:
                frames.append(
                    reader.option("recursiveFileLookup", "true")
                    .option("pathGlobFilter", f"{fmt.PREFIX}*.jsonl")
                    .json(urls)
                )
        else:
            if local:
                frames.append(reader.parquet(*local))
            if urls:
                frames.append(
                    reader.option("recursiveFileLookup", "true")
                    .option("pathGlobFilter", f"{fmt.PREFIX}*.parquet")
                    .parquet(*urls)
                )
    df = frames[0]
    for other in frames[1:]:
        df = df.unionByName(other)
    return df.select(
        *[
            F.col(n)
            .cast(
                t.rstrip("?")
                .replace("str", "string")
                .replace("int64", "bigint")
                .replace("int32", "int")
            )
            .alias(n)
            for n, t in fmt.FIELDS
        ]
    )


# ------------------------------------------------------------------------------ spark
def spark_session(opts: AuditOptions) -> tuple[SparkSession, bool]:
    """The session to use and whether this audit created it (and must stop it)."""
    try:
        from pyspark.sql import SparkSession
    except ImportError as exc:
        raise AuditError(
            "the audit needs PySpark: pip install 'amqbroker[spark]' (and Java 17+)"
        ) from exc
    active = SparkSession.getActiveSession()
    if active is not None:
        return active, False
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    b = SparkSession.builder.appName("amqbroker-audit").config("spark.ui.enabled", "false")
    submitted = "PYSPARK_GATEWAY_PORT" in os.environ  # spark-submit started the JVM
    master = opts.master or ("" if submitted else "local[*]")
    if master:
        b = b.master(master)
    if master.startswith("local"):
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        b = (
            b.config("spark.driver.host", "127.0.0.1")
            .config("spark.driver.bindAddress", "127.0.0.1")
            .config("spark.driver.memory", opts.driver_memory)
            .config("spark.sql.shuffle.partitions", str(opts.shuffle_partitions or 8))
        )
    elif opts.shuffle_partitions:
        b = b.config("spark.sql.shuffle.partitions", str(opts.shuffle_partitions))
    for k, v in opts.extra_conf.items():
        b = b.config(k, v)
    try:
        spark = b.getOrCreate()
    except Exception as exc:
        raise AuditError(
            f"could not start Spark ({master or 'spark-submit'}): {exc}; "
            "check JAVA_HOME (Java 17+) and --master"
        ) from exc
    spark.sparkContext.setLogLevel("WARN")
    return spark, True


# --------------------------------------------------------------------------- analysis
def _rows(df: DataFrame, n: int) -> list[dict[str, Any]]:
    return [r.asDict(recursive=True) for r in df.limit(n).collect()]


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


def _producer_order(events: DataFrame, ev: DataFrame, slots: DataFrame) -> DataFrame:
    """Producer order (`amqbroker.pipeline.invariants`): messages joined by message-id
    from their entry ``received`` (not on a node a ``forwarded`` record names) to their
    first dispatch in that queue on any node; a window per (queue, group, producer)
    ordered by the order key gives each message the earliest first dispatch of the
    messages after it."""
    from pyspark.sql import Window
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
                F.struct("ts_us", "node", "seq", "queue", "group_id", "group_seq", "producer")
            ).alias("e")
        )
        .filter(col("e.producer").isNotNull() & col("e.group_id").isNotNull())
    )
    k = F.struct("owner_epoch", "ts_us", "node", "seq")
    first = (
        ev.filter(col("event") == "dispatched")
        .groupBy("queue", "message_id")
        .agg(F.min(k).alias("k"))
    )
    late = slots.filter(col("late") == 1).select("message_id").distinct()
    msgs = (
        first.join(entry, "message_id")
        .filter(col("queue") == col("e.queue"))
        .join(late, "message_id", "left_anti")
        .select(
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


def analyse(events: DataFrame, grace_s: float = 0.0, samples: int = 20) -> dict[str, Any]:
    """Run every check and aggregation over `events`; returns the audit result (plain
    JSON-able data: counts, aggregates, at most `samples` rows per finding).

    About ten Spark actions in all (each one costs a job's scheduling overhead): the
    findings of every check are unioned, cached (they are few unless the broker is
    badly broken) and counted and sampled in two actions."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    t0 = time.monotonic()
    col = F.col
    ev_name = col("event")

    def is_(name: str) -> Column:
        return ev_name == name

    terminal_settle = is_("settled") & col("outcome").isin(*TERMINAL_OUTCOMES)

    # 1 action: per node, event and outcome (a few rows): seq range, times, counts
    nodes: dict[str, dict[str, int]] = {}
    by_event: dict[str, int] = {}
    by_outcome: dict[str, int] = {}
    #: the arbiter's releases of group bindings, by reason (``unbound`` markers)
    releases: dict[str, int] = {}
    for r in (
        events.groupBy("node", "event", "outcome")
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
    seq_gaps = {
        n: v["max_seq"] - v["min_seq"] + 1 - v["events"]
        for n, v in sorted(nodes.items())
        if v["max_seq"] - v["min_seq"] + 1 != v["events"]
    }

    ev = events.filter(col("message_id").isNotNull()).withColumn(
        "queue", F.coalesce(col("queue"), F.lit(""))
    )

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

    # two owners: deliveries as +1/-1 endpoints ordered by (epoch, time, node, seq)
    key = F.struct("owner_epoch", "ts_us", "node", "seq")
    w_slot = (
        Window.partitionBy("node", "queue", "message_id")
        .orderBy("seq")
        .rowsBetween(1, Window.unboundedFollowing)
    )
    d = (
        ev.filter(col("group_id").isNotNull() & ev_name.isin("dispatched", *CLOSING_EVENTS))
        .withColumn(
            "close",
            F.first(F.when(ev_name.isin(*CLOSING_EVENTS), key), ignorenulls=True).over(w_slot),
        )
        .filter(is_("dispatched"))
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
    parts.append(_producer_order(events, ev, slots))
    parts += _moves(events, ev)

    found = parts[0]
    for p in parts[1:]:
        found = found.unionByName(p)
    found = found.cache()
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

    def result_of(kind: str) -> dict[str, Any]:
        return {"count": counts.get(kind, 0), "samples": sample_rows.get(kind, [])}

    def moment(node: Any, seq: Any, consumer: Any, ts_us: Any) -> dict[str, Any]:
        when = datetime.datetime.fromtimestamp(ts_us / 1e6, datetime.UTC)
        return {
            "node": node,
            "seq": seq,
            "consumer": consumer,
            "ts_us": ts_us,
            "time": when.isoformat(timespec="microseconds"),
        }

    two_owners = result_of("two_owners")
    two_owners["samples"] = [
        {
            "queue": x.get("queue"),
            "group_id": x.get("group_id"),
            "moments": x["n"],
            "first": moment(x["node"], x["seq"], x.get("consumer"), x["first_ts_us"]),
            "last": moment(x["last_node"], x["last_seq"], x.get("last_consumer"), x["last_ts_us"]),
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
    moves = result_of("moves")
    moves["moves"] = counts.get("move_events", 0)
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

    # 2 actions: group sizes, worst groups
    bad = (
        found.filter(
            col("kind").isin(
                "order_violations", "producer_order", "two_owners", "two_owner_moments"
            )
        )
        .groupBy("queue", "group_id")
        .agg(
            F.sum((col("kind") == "order_violations").cast("long")).alias("order_violations"),
            F.sum((col("kind") == "producer_order").cast("long")).alias("producer_order"),
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
    found.unpersist()
    slots.unpersist()

    return {
        "ok": not any(counts.get(name) for name in INVARIANTS),
        "generated": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "totals": {
            "events": sum(by_event.values()),
            "by_event": dict(sorted(by_event.items())),
            "by_outcome": dict(sorted(by_outcome.items())),
            "releases": dict(sorted(releases.items())),
            "redeliveries": lat_row["redeliveries"] or 0,
            "copies": lat_row["copies"],
            "messages_approx": lat_row["messages"],
            "queues": lat_row["queues"],
            "groups": groups["count"],
            "consumers": consumers["count"],
            "parked": lat_row["parked"] or 0,
            "pending": lat_row["pending"] or 0,
            "still_queued": counts.get("still_queued", 0),
            "late": counts.get("late", 0),
        },
        "nodes": dict(sorted(nodes.items())),
        "invariants": {
            name: two_owners
            if name == "two_owners"
            else producer_order
            if name == "producer_order"
            else result_of(name)
            for name in INVARIANTS
        },
        "info": {
            "unrouted": result_of("unrouted"),
            "still_queued": result_of("still_queued"),
            "moves": moves,
            "late": result_of("late"),
            "seq_gaps": seq_gaps,
        },
        "latency": latency,
        "consumers": consumers,
        "groups": groups,
        "grace_s": grace_s,
        "analysis_s": round(time.monotonic() - t0, 3),
    }


# --------------------------------------------------------------------------------- run
def _is_spark_error(exc: BaseException) -> bool:
    """A failure of the Spark job (JVM side), as opposed to a bug here."""
    try:
        from py4j.protocol import Py4JError
        from pyspark.errors import PySparkException
    except ImportError:
        return False
    return isinstance(exc, PySparkException | Py4JError)


def _echo(msg: str, err: bool = False) -> None:
    print(msg, file=sys.stderr if err else sys.stdout)


def run(opts: AuditOptions, echo: Callable[..., None] = _echo) -> int:
    """The ``amqbroker audit`` command: returns the exit code (`EXIT_OK`,
    `EXIT_BROKEN`, `EXIT_ERROR`). `echo(text, err=False)` prints."""
    t0 = time.monotonic()
    skipped: list[tuple[str, str]] = []
    try:
        bad = [f for f in opts.formats if f not in ("html", "md", "json")]
        if bad:
            raise AuditError(f"unknown report format(s) {', '.join(bad)}; use html, md, json")
        files = find_files(opts.paths)
        skipped = bad_files(files)
        if skipped and not opts.skip_bad_files:
            name, problem = skipped[0]
            more = f" (and {len(skipped) - 1} more bad file(s))" if len(skipped) > 1 else ""
            raise AuditError(
                f"bad delivery-log file {name}: {problem}{more}; "
                "move it away or give --skip-bad-files to audit the others"
            )
        for name, problem in skipped:
            echo(f"skipped bad delivery-log file {name}: {problem}", err=True)
        leave_out = {name for name, _ in skipped}
        files = {k: [n for n in names if n not in leave_out] for k, names in files.items()}
        if not any(files.values()):
            raise AuditError("every delivery-log file is bad: nothing left to audit")
        spark, own = spark_session(opts)
        try:
            events = load_events(spark, opts.paths, files)
            result = analyse(events, grace_s=opts.grace_s, samples=opts.samples)
        except Exception as exc:
            if not _is_spark_error(exc):
                raise
            log.debug("the Spark job failed", exc_info=True)
            raise AuditError(f"the Spark job failed: {_one_line(exc)}") from exc
        finally:
            if own:
                spark.stop()
    except AuditError as exc:
        echo(f"Error: {exc}", err=True)
        return EXIT_ERROR
    result["inputs"] = [str(p) for p in opts.paths]
    result["skipped_files"] = [{"path": n, "problem": p} for n, p in skipped]
    result["elapsed_s"] = round(time.monotonic() - t0, 3)
    from amqbroker.pipeline import report

    opts.out.mkdir(parents=True, exist_ok=True)
    written = [opts.out / "audit.json"]
    written[0].write_text(json.dumps(result, indent=2, default=str))
    if "md" in opts.formats:
        written.append(opts.out / "report.md")
        written[-1].write_text(report.markdown(result))
    if "html" in opts.formats:
        written.append(opts.out / "report.html")
        written[-1].write_text(report.html(result))
    echo(report.summary(result))
    echo("report: " + ", ".join(str(p) for p in written))
    return EXIT_OK if result["ok"] else EXIT_BROKEN
