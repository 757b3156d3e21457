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
   Producer order (`audit_checks._producer_order`): each message's entry ``received`` (an anti-join
   drops the nodes its ``forwarded`` records name) joined by message-id to its first
   dispatch in that queue on any node; a window per (queue, group, entry node, boot,
   producer) ordered by the order key gives each message the earliest first dispatch
   of the later ones (the boot: the ``started`` markers, collected, one per start of a
   node). Producer order across entry nodes
   (`audit_checks._producer_order_across_entry_nodes`): the same messages, a window per
   (queue, group, producer identity) where every message has a group-sequence, a
   range frame over the higher group-sequences. Moves (`audit_checks._moves`): the
   dispatches and ``unbound`` markers of a group in one window ordered like the
   two-owner endpoints.
5. latency percentiles (``percentile_approx``), log-scale histograms, per-consumer
   load, group sizes and the worst groups: aggregations.

It scales with Spark, not with the driver: the driver only receives aggregates (counts,
percentiles, histogram buckets, one row per consumer up to `MAX_CONSUMER_ROWS`, per-node
seq ranges) and at most `samples` example rows per finding; no per-message data is ever
collected.

Modules: this one is the entry point (`run`, `analyse`, the Spark session);
`amqbroker.pipeline.audit_files` finds, checks and loads the log files (step 1) and
holds `AuditError` and the exit codes; `amqbroker.pipeline.audit_checks` the
invariants (steps 2 to 4); `amqbroker.pipeline.audit_summary` the totals and step 5.
Their public names are importable from here too.

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

from amqbroker.pipeline import audit_checks, audit_summary
from amqbroker.pipeline.audit_files import (
    EXIT_BROKEN,
    EXIT_ERROR,
    EXIT_OK,
    PARQUET_MAGIC,
    AuditError,
    _one_line,
    bad_files,
    check_file,
    find_files,
    load_events,
)
from amqbroker.pipeline.audit_summary import (
    BUCKETS_PER_DECADE,
    MAX_CONSUMER_ROWS,
    PERCENTILES,
    WORST_GROUPS,
)
from amqbroker.pipeline.invariants import INVARIANTS

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

__all__ = [
    "BUCKETS_PER_DECADE",
    "EXIT_BROKEN",
    "EXIT_ERROR",
    "EXIT_OK",
    "MAX_CONSUMER_ROWS",
    "PARQUET_MAGIC",
    "PERCENTILES",
    "WORST_GROUPS",
    "AuditError",
    "AuditOptions",
    "analyse",
    "bad_files",
    "check_file",
    "find_files",
    "load_events",
    "run",
    "spark_session",
]

log = logging.getLogger(__name__)


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


def analyse(events: DataFrame, grace_s: float = 0.0, samples: int = 20) -> dict[str, Any]:
    """Run every check and aggregation over `events`; returns the audit result (plain
    JSON-able data: counts, aggregates, at most `samples` rows per finding).

    About ten Spark actions in all (each one costs a job's scheduling overhead): the
    findings of every check are unioned, cached (they are few unless the broker is
    badly broken) and counted and sampled in two actions."""
    t0 = time.monotonic()
    totals = audit_summary.node_totals(events)  # 1 action
    ev = audit_checks.message_events(events)
    slots, copies = audit_checks.slots(ev, totals.nodes, grace_s)
    found = audit_checks.findings(events, ev, slots, copies)
    f = audit_checks.collect_findings(found, samples)  # 2 actions
    counts, result_of = f.counts, f.result_of
    lat_row, latency = audit_summary.latency(copies)  # 2 actions
    consumers = audit_summary.consumers(ev)  # 1 action
    groups = audit_summary.groups(found, copies)  # 2 actions
    found.unpersist()
    slots.unpersist()

    return {
        "ok": not any(counts.get(name) for name in INVARIANTS),
        "generated": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "totals": {
            "events": sum(totals.by_event.values()),
            "by_event": dict(sorted(totals.by_event.items())),
            "by_outcome": dict(sorted(totals.by_outcome.items())),
            "releases": dict(sorted(totals.releases.items())),
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
        "nodes": dict(sorted(totals.nodes.items())),
        "invariants": f.invariants(),
        "info": {
            "unrouted": result_of("unrouted"),
            "still_queued": result_of("still_queued"),
            "moves": f.moves(),
            "late": result_of("late"),
            "seq_gaps": totals.seq_gaps,
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
