"""The Spark connector: a PySpark 4 Python data source named ``amqbroker``.

::

    from amqbroker.pipeline.connector import register, write_grouped
    register(spark)
    # write: one message per row, to an address, grouped by a column
    write_grouped(df, url="amqp://127.0.0.1:5672", address="orders", group_column="customer",
                  order_by=["ts"])
    # = df.repartition("customer").sortWithinPartitions("customer", "ts")
    #     .write.format("amqbroker").option(...).mode("append").save()
    # read (batch): consume what is there now
    spark.read.format("amqbroker").option("url", ...).option("address", "orders").load()
    # read (stream): acknowledged only once Spark has committed the micro-batch
    spark.readStream.format("amqbroker").option("address", "orders").load()

Writing (`AmqbrokerWriter`, in the executors)
--------------------------------------------
Each task opens one connection (python-qpid-proton's `BlockingConnection`: executors
are separate processes, never the broker's event loop) and sends its rows in order with
up to ``window`` unsettled transfers; the task succeeds only once the broker has
accepted every message (durable by default: the broker has synced them). Per row: body
= ``body_column`` (string or binary), ``group-id`` = ``group_column``, ``group-sequence``
= ``group_seq_column`` or 1, 2, 3... per group in the task's order, application
properties = the other columns (or ``properties``, a comma list).

Order within a group holds when each group is in one partition, sorted: that is what
`write_grouped` does. The driver's `commit` checks it: a group seen by two tasks fails
the write with an error saying to partition by the group column (the messages are sent
by then; the check catches the mistake on the first run).

Retries: the message-id of a row is ``<message_id_prefix>:<partition>:<row index>``
(``message_id_column`` overrides it), and the prefix is made once on the driver, so a
retried task resends the same ids and the broker's duplicate detection (address setting
``duplicate_detection_window`` >= the rows of a task) drops what the failed attempt
already delivered. For streams, write each micro-batch with ``foreachBatch`` and a
prefix naming the batch, so a replayed batch is dropped too::

    def publish(batch_df, batch_id):
        write_grouped(batch_df, url=..., address="orders", group_column="customer",
                      message_id_prefix=f"orders-query-{batch_id}", group_seq_column="seq")
    stream.writeStream.foreachBatch(publish).option("checkpointLocation", ...).start()

Reading
-------
Columns: ``message_id, group_id, group_seq, body, properties (map<string,string>),
creation_time, received_time, delivery_count``. The body is text: a binary body is
decoded as UTF-8 (invalid bytes replaced), any other AMQP value is rendered as JSON.

* Stream (`AmqbrokerStreamReader`, a `SimpleDataSourceStreamReader`: it runs in the
  driver's data-source process, where the one receiver lives): each micro-batch takes up
  to ``max_batch`` messages (waiting at most ``wait`` seconds for the first); the
  deliveries stay unsettled until the batch is committed to the sink: they are
  accepted in ``commit(end)``, or when Spark asks for the next batch (``read(start)``),
  which it does only after the previous batch is committed. If the query dies first, the broker
  gets them back (connection closed) and redelivers them: at least once, in group
  order. A replayed batch after a restart (``readBetweenOffsets``) receives the same
  number of messages on a new connection and accepts them once read. There is no
  prefetch window: each micro-batch grants credit only for the messages it may take
  (``max_batch``, less those already received), so the broker never has more than
  ``max_batch`` messages out to the query unsettled and a crash returns at most that
  many (delivery-count + 1): the sink sees at most ``max_batch`` rows again.
* Batch (`AmqbrokerReader`): one task receives until ``max_messages`` or ``timeout``
  seconds without a message, and accepts them once Spark has read them all.

Options: ``url`` (default amqp://127.0.0.1:5672), ``address`` (required), ``user``,
``password``; write: ``group_column``, ``body_column`` (default body),
``group_seq_column``, ``message_id_column``, ``message_id_prefix``, ``properties``,
``durable`` (true), ``window`` (1000), ``timeout`` (30 s per broker round trip);
read: ``credit`` (500, batch read; a stream's credit is ``max_batch``), ``max_batch``
(1000), ``wait`` (0.5 s), ``max_messages`` (10000), ``timeout`` (2 s idle, batch read).
"""

from __future__ import annotations

import datetime
import json
import uuid
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceWriter,
    InputPartition,
    SimpleDataSourceStreamReader,
    WriterCommitMessage,
)
from pyspark.sql.types import StructType

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, Row, SparkSession

NAME = "amqbroker"
READ_SCHEMA = (
    "message_id STRING, group_id STRING, group_seq INT, body STRING, "
    "properties MAP<STRING, STRING>, creation_time TIMESTAMP, received_time TIMESTAMP, "
    "delivery_count INT"
)
#: a task reports its group ids to the driver (for the split-group check) up to this many
MAX_REPORTED_GROUPS = 100_000


class ConnectorError(Exception):
    """A connector failure; the message says what happened and what to do."""


def register(spark: SparkSession) -> None:
    """Make ``format("amqbroker")`` available in `spark`."""
    spark.dataSource.register(AmqbrokerDataSource)


def write_grouped(
    df: DataFrame,
    *,
    url: str,
    address: str,
    group_column: str,
    order_by: Sequence[str] = (),
    **options: str,
) -> None:
    """Publish `df` with each group in one task, in `order_by` order within it."""
    (
        df.repartition(group_column)
        .sortWithinPartitions(group_column, *order_by)
        .write.format(NAME)
        .option("url", url)
        .option("address", address)
        .option("group_column", group_column)
        .options(**options)
        .mode("append")
        .save()
    )


# ------------------------------------------------------------------------ connection
def _connect(opts: dict[str, str]) -> Any:
    from proton.utils import BlockingConnection

    url = opts.get("url", "amqp://127.0.0.1:5672")
    kw: dict[str, Any] = {"timeout": float(opts.get("timeout", "30"))}
    if opts.get("user"):
        kw.update(user=opts["user"], password=opts.get("password", ""), allow_insecure_mechs=True)
    try:
        return BlockingConnection(url, **kw)
    except Exception as exc:
        raise ConnectorError(
            f"amqbroker connector: cannot connect to {url}: {exc}; check the url option "
            "and that the broker is running"
        ) from exc


def _address(opts: dict[str, str]) -> str:
    a = opts.get("address")
    if not a:
        raise ConnectorError('amqbroker connector: option "address" is required')
    return a


def _flush(conn: Any) -> None:
    """Send pending frames (dispositions) now, without waiting for an answer. (One
    `container.process()` only dispatches events: the socket is written on a later
    pass, so the frames waited for the next receive.)"""
    transport = conn.conn.transport
    conn.wait(lambda: transport.pending() <= 0, msg="sending dispositions to the broker")


# --------------------------------------------------------------------------- writing
@dataclass
class _Written(WriterCommitMessage):
    partition: int
    rows: int
    groups: frozenset[str] | None  # None: too many to report


class AmqbrokerWriter(DataSourceWriter):
    def __init__(self, options: dict[str, str], schema: StructType) -> None:
        self.opts = options
        self.fields = [f.name for f in schema.fields]
        # made once on the driver: a retried task reuses it (same message-ids)
        self.prefix = options.get("message_id_prefix") or f"spark-{uuid.uuid4().hex[:12]}"
        self.address = _address(options)
        body = options.get("body_column", "body")
        if body not in self.fields:
            raise ConnectorError(
                f"amqbroker connector: no body column {body!r} in {self.fields}; set the "
                "body_column option"
            )
        for opt in ("group_column", "group_seq_column", "message_id_column"):
            c = options.get(opt)
            if c and c not in self.fields:
                raise ConnectorError(
                    f"amqbroker connector: {opt} {c!r} is not a column of {self.fields}"
                )

    def write(self, iterator: Iterator[Row]) -> _Written:
        from proton import Delivery, Message
        from pyspark import TaskContext

        ctx = TaskContext.get()
        pid = ctx.partitionId() if ctx is not None else 0
        o = self.opts
        body_col = o.get("body_column", "body")
        gcol, scol, icol = (
            o.get("group_column"),
            o.get("group_seq_column"),
            o.get("message_id_column"),
        )
        used = {body_col, gcol, scol, icol}
        props_cols = (
            [c.strip() for c in o["properties"].split(",") if c.strip()]
            if o.get("properties")
            else [f for f in self.fields if f not in used]
        )
        durable = o.get("durable", "true").lower() == "true"
        window = int(o.get("window", "1000"))
        timeout = float(o.get("timeout", "30"))
        seqs: dict[str, int] = {}
        conn = _connect(o)
        try:
            snd = conn.create_sender(self.address)
            link = snd.link
            pending: deque[Any] = deque()

            def settle_first() -> None:
                d = pending.popleft()
                conn.wait(
                    lambda: d.remote_state != 0 or d.settled,
                    timeout=timeout,
                    msg="waiting for the broker to accept a message",
                )
                if d.remote_state != Delivery.ACCEPTED:
                    raise ConnectorError(
                        f"amqbroker connector: the broker did not accept a message for "
                        f"{self.address!r} (state {d.remote_state}, "
                        f"{d.remote.condition}); see the broker log"
                    )
                d.settle()

            n = 0
            for n, row in enumerate(iterator, 1):
                r = row.asDict()
                raw = r.get(gcol) if gcol else None
                gid = None if raw is None else str(raw)
                gseq: int | None = None
                if gid is not None:
                    gseq = int(r[scol]) if scol else seqs.get(gid, 0) + 1
                    seqs[gid] = gseq
                mid = str(r[icol]) if icol else f"{self.prefix}:{pid}:{n - 1}"
                props = {c: _prop(r[c]) for c in props_cols if r.get(c) is not None}
                msg = Message(body=r[body_col], id=mid, durable=durable, properties=props or None)
                if gid is not None and gseq is not None:
                    msg.group_id = gid
                    msg.group_sequence = gseq
                pending.append(link.send(msg))
                while len(pending) >= window:
                    settle_first()
            while pending:
                settle_first()
        finally:
            conn.close()
        groups = frozenset(seqs) if len(seqs) <= MAX_REPORTED_GROUPS else None
        return _Written(pid, n, groups)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        seen: dict[str, int] = {}
        for m in messages:
            if not isinstance(m, _Written) or m.groups is None:
                continue
            for g in m.groups:
                if g in seen and seen[g] != m.partition:
                    raise ConnectorError(
                        f"amqbroker connector: group {g!r} was written by partitions "
                        f"{seen[g]} and {m.partition}, so its order and sequence numbers "
                        "are not guaranteed; partition by the group column "
                        "(df.repartition(col).sortWithinPartitions(col, ...), or "
                        "write_grouped)"
                    )
                seen[g] = m.partition


def _prop(v: Any) -> Any:
    if isinstance(v, bool | int | float | str | bytes):
        return v
    if isinstance(v, datetime.datetime | datetime.date):
        return v.isoformat()
    return str(v)


# --------------------------------------------------------------------------- reading
def _row(msg: Any) -> tuple[Any, ...]:
    body = msg.body
    text: str | None
    if isinstance(body, bytes | bytearray | memoryview):
        text = bytes(body).decode("utf-8", "replace")
    elif isinstance(body, str) or body is None:
        text = body
    else:
        text = json.dumps(body, default=str)
    gseq = msg.group_sequence
    if gseq is not None and gseq >= 1 << 31:  # wire uint, JMS signed
        gseq -= 1 << 32
    created = None
    if msg.creation_time:
        created = datetime.datetime.fromtimestamp(msg.creation_time, datetime.UTC)
    props = {str(k): str(v) for k, v in (msg.properties or {}).items()}
    return (
        None if msg.id is None else str(msg.id),
        msg.group_id,
        gseq if msg.group_id is not None else None,
        text,
        props,
        created,
        datetime.datetime.now(datetime.UTC),
        msg.delivery_count,
    )


class AmqbrokerReader(DataSourceReader):
    def __init__(self, options: dict[str, str]) -> None:
        self.opts = options
        _address(options)

    def partitions(self) -> Sequence[InputPartition]:
        return [InputPartition(0)]

    def read(self, partition: InputPartition) -> Iterator[tuple[Any, ...]]:
        from proton import Timeout

        o = self.opts
        limit = int(o.get("max_messages", "10000"))
        idle = float(o.get("timeout", "2"))
        conn = _connect(o)
        try:
            rcv = conn.create_receiver(_address(o), credit=min(limit, int(o.get("credit", "500"))))
            n = 0
            while n < limit:
                try:
                    msg = rcv.receive(timeout=idle)
                except Timeout:
                    break
                n += 1
                yield _row(msg)
            for _ in range(n):
                rcv.accept()
            _flush(conn)
        finally:
            conn.close()


class AmqbrokerStreamReader(SimpleDataSourceStreamReader):
    """Offsets: ``{"received": n}``, messages received by this query so far. Lives in
    the driver's data-source process for the whole query (one receiver)."""

    def __init__(self, options: dict[str, str]) -> None:
        self.opts = options
        _address(options)
        self._conn: Any = None
        self._rcv: Any = None
        self._next: int | None = None
        self._unacked: deque[tuple[int, Any]] = deque()

    def initialOffset(self) -> dict[str, int]:
        return {"received": 0}

    def _receiver(self) -> Any:
        if self._rcv is None:
            self._conn = _connect(self.opts)
            # no prefetch window: read() grants the credit of each micro-batch
            self._rcv = self._conn.create_receiver(_address(self.opts), credit=0)
        return self._rcv

    def read(self, start: dict[str, int]) -> tuple[Iterator[tuple[Any, ...]], dict[str, int]]:
        from proton import Timeout

        if self._next is None:
            self._next = int(start["received"])
        # Spark plans the next batch only once the previous one is committed: what is
        # before `start` is committed (Spark calls commit() itself only later, when it
        # has new data, so a quiet stream would otherwise hold the last batch)
        self.commit(start)
        rcv = self._receiver()
        conn, link, fetcher = self._conn, rcv.link, rcv.fetcher
        limit = int(self.opts.get("max_batch", "1000"))
        # credit for what this micro-batch takes, less what is received or still
        # granted: the broker never has more than `limit` messages out to this
        # receiver unsettled (the previous batch was accepted just above, and the
        # disposition goes out before the flow), so a crash returns at most that
        # many. (BlockingReceiver.receive is not used: it grants one more credit
        # whenever the link has none, even with messages buffered.)
        more = limit - fetcher.has_message - link.credit
        if more > 0:
            link.drain_mode = False
            link.flow(more)
        rows: list[tuple[Any, ...]] = []
        try:
            conn.wait(
                lambda: fetcher.has_message,
                timeout=float(self.opts.get("wait", "0.5")),
                msg="waiting for a message",
            )
        except Timeout:
            return iter(rows), {"received": self._next}  # the credit stays for the next
        # the batch: what the broker has now, up to the credit (a drain: it sends
        # that or gives the rest of the credit back)
        link.drain(0)
        conn.wait(
            lambda: link.credit == 0 and not link.draining(),
            msg="waiting for the broker to drain the receiver's credit",
        )
        while fetcher.has_message and len(rows) < limit:
            msg = fetcher.pop()
            # the delivery pop() moved to the fetcher's unsettled queue: ours now
            self._unacked.append((self._next, fetcher.unsettled.pop()))
            self._next += 1
            rows.append(_row(msg))
        return iter(rows), {"received": self._next}

    def readBetweenOffsets(
        self, start: dict[str, int], end: dict[str, int]
    ) -> Iterator[tuple[Any, ...]]:
        """Replay of a batch that was never committed (its messages went back to the
        broker with the old connection): receive as many again, accept once read."""
        opts = dict(self.opts, max_messages=str(end["received"] - start["received"]))
        opts.setdefault("timeout", "5")
        return AmqbrokerReader(opts).read(InputPartition(0))

    def commit(self, end: dict[str, int]) -> None:
        from proton import Delivery

        upto = int(end["received"])
        done = 0
        while self._unacked and self._unacked[0][0] < upto:
            _, d = self._unacked.popleft()
            d.update(Delivery.ACCEPTED)
            d.settle()
            done += 1
        if done and self._conn is not None:
            _flush(self._conn)

    def stop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = self._rcv = None


class AmqbrokerDataSource(DataSource):
    """``format("amqbroker")``: see the module docstring."""

    @classmethod
    def name(cls) -> str:
        return NAME

    def schema(self) -> str:
        return READ_SCHEMA

    def reader(self, schema: StructType) -> DataSourceReader:
        return AmqbrokerReader(dict(self.options))

    def simpleStreamReader(self, schema: StructType) -> SimpleDataSourceStreamReader:
        return AmqbrokerStreamReader(dict(self.options))

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        return AmqbrokerWriter(dict(self.options), schema)
