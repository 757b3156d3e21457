"""The delivery log's file format: the single source for the broker's writer
(`amqbroker.store.delivery_log`) and the audit job that reads it.

Files
-----
``<data_dir>/delivery-log/<node>/part-<seq of the first record, 20 digits>.<ext>``,
``ext`` = ``parquet`` or ``jsonl``. A file being written is named with the suffix
``.inprogress`` (``part-….parquet.inprogress``) and renamed when it is closed, so a
reader that skips ``*.inprogress`` only ever sees complete files. A file is closed at
``delivery_log_rotate_bytes`` and when the broker stops; closed files beyond
``delivery_log_max_bytes`` are deleted oldest first. Spark reads a node's directory
(or ``delivery-log/*``) with ``spark.read.parquet`` / ``spark.read.json`` and
``pathGlobFilter="part-*.parquet"`` (or ``*.jsonl``).

Parquet: one row group per write batch, zstd-compressed, schema `arrow_schema()`.
JSON lines: one object per line with exactly the `FIELDS` keys (null for none).

Records
-------
One record per delivery event (see `EVENTS`; where each is emitted:
`amqbroker.core.delivery_log`):

=================  =========  ===========================================================
field              type       meaning
=================  =========  ===========================================================
node               str        the broker's `node_id`
seq                int64      per node, strictly increasing across files and restarts;
                              a gap means records were dropped (overflow ``drop``) or a
                              file was lost in a crash. A member of a primary/backup
                              pair that becomes live at HA epoch E starts at least at
                              ``E << SEQ_LIFE_SHIFT`` (the members keep separate logs
                              of one node id): gaps are counted per ``seq >>
                              SEQ_LIFE_SHIFT`` (a *life*)
ts_us              int64      event time, epoch microseconds (broker clock)
event              str        one of `EVENTS`
queue              str|null   the queue; for ``received``, the target address
message_id         str|null   properties.message-id as text (binary ids in hex)
group_id           str|null   the message's group id
group_seq          int32|null group sequence (null when ungrouped)
producer           str|null   "<connection id>/<link name>" of the sender (received,
                              routed, and later events of messages sent since start)
consumer           str|null   "<connection id>/<link name>" (dispatched, settled,
                              released)
outcome            str|null   settled only: accepted, rejected, released, modified
                              (``unbound``: the reason of the release)
owner_epoch        int64      epoch of the group's owner (0 on a single node)
delivery_count     int32|null failed delivery attempts before this event
producer_identity  str|null   "<container-id>/<link name>" of the sender (the records
                              that have ``producer``): the AMQP connection's
                              container-id, which a client keeps across reconnects and
                              failover to another node (a Qpid JMS connection keeps one
                              through ``failover:``, with stable link names), so a
                              producer is the same one on every node and connection;
                              null without a container-id
=================  =========  ===========================================================

Fields are added at the end of `FIELDS`, nullable, and never removed or renamed, so
files written before a field existed stay readable: readers use the format's schema
(`SPARK_DDL`, `arrow_schema`), a column missing from a Parquet file or a key missing
from a JSON line reads as null, and a check that needs the field skips the records
without it. ``producer_identity`` was added after the others: older logs have none
(the audit's ``producer_order_across_entry_nodes`` finds nothing in them).

Markers (``started``, ``unbound``: no message-id, about a node or a group) and ``late``:

* ``started``: the first record of each boot of the node (the writer's `open`): the
  node restarted here. Connection ids (``c1``, ``c2``...) start again at each boot, so
  a producer is identified by (node, boot, ``producer``), the boot being the number of
  ``started`` records at or before the record's ``seq``. Logs written before this
  marker existed have none: everything is boot 0.
* ``unbound``: the grouping arbiter released a group's binding (`Routing.unbind`:
  its node was lost under ``cluster_node_loss_policy = "move"``, the group expired,
  its queue instance was deleted or had no consumer for
  ``grouping_consumerless_timeout``, or the binding was force-removed): ``queue`` =
  "<node>/<queue>" of the released instance, ``group_id`` the group, ``outcome`` the
  reason (``node-lost``, ``idle``, ``consumerless``, ``queue-deleted``,
  ``force-removed``; null in logs written before reasons were recorded), on the
  arbiter's log. The group may then move to another queue instance; a move without one is
  reported by the audit.
* ``late``: under the ``move`` node-loss policy a node that comes back forwards the
  stranded messages of groups that moved while it was lost to the group's current
  owner; each such message gets ``late`` in the queue it leaves (``queue`` = that
  queue, with its message-id and group: terminal for that copy), followed by its
  ``forwarded`` record (`Routing.deliver_to`). The audit reports those messages
  as delivered late after a node loss, not as order violations.

Per message and queue: ``routed``, then any number of (``dispatched`` then
``settled`` released/modified, or ``released``), then one terminal event:
``settled`` accepted or rejected (followed by ``dead_lettered``), ``expired``, or
``dead_lettered`` (out of delivery attempts), or ``late``. A presettled consumer's delivery is
``dispatched`` + ``settled`` accepted. Not logged: messages removed by a purge or a
queue deletion, and duplicates dropped by duplicate detection (no ``received``).

Only the standard library is imported at module level; `arrow_schema` imports pyarrow.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    import pyarrow as pa

#: event names, indexed by the event codes of `amqbroker.core.delivery_log`
EVENTS: Final = (
    "received",
    "routed",
    "forwarded",
    "dispatched",
    "settled",
    "released",
    "expired",
    "dead_lettered",
    "started",
    "unbound",
    "late",
)

#: the events that mark what happened to a node or a group rather than to a message
#: (no message-id): the audit reads them as context, never as a message's life
MARKERS: Final = ("started", "unbound")

#: settled outcomes
OUTCOMES: Final = ("accepted", "rejected", "released", "modified")

#: (field name, type) in file order; types: str, int64, int32 ("?" = nullable)
FIELDS: Final = (
    ("node", "str"),
    ("seq", "int64"),
    ("ts_us", "int64"),
    ("event", "str"),
    ("queue", "str?"),
    ("message_id", "str?"),
    ("group_id", "str?"),
    ("group_seq", "int32?"),
    ("producer", "str?"),
    ("consumer", "str?"),
    ("outcome", "str?"),
    ("owner_epoch", "int64"),
    ("delivery_count", "int32?"),
    ("producer_identity", "str?"),
)
FIELD_NAMES: Final = tuple(name for name, _ in FIELDS)

#: directory under the data directory, and the file name parts
DIRECTORY: Final = "delivery-log"
PREFIX: Final = "part-"
SEQ_DIGITS: Final = 20
INPROGRESS: Final = ".inprogress"
EXTENSIONS: Final = {"parquet": ".parquet", "jsonl": ".jsonl"}

#: the Spark SQL schema (DDL), for readers that must not infer it
SPARK_DDL: Final = (
    "node STRING NOT NULL, seq BIGINT NOT NULL, ts_us BIGINT NOT NULL, "
    "event STRING NOT NULL, queue STRING, message_id STRING, group_id STRING, "
    "group_seq INT, producer STRING, consumer STRING, outcome STRING, "
    "owner_epoch BIGINT NOT NULL, delivery_count INT, producer_identity STRING"
)


#: a pair member live at HA epoch E numbers its records from E << SEQ_LIFE_SHIFT on, so
#: that the node id's records stay ordered by seq across a takeover (the new live
#: member does not have the old one's log); seq gaps are counted within a life
SEQ_LIFE_SHIFT = 40


def seq_floor(ha_epoch: int) -> int:
    """The first seq a pair member live at `ha_epoch` may use (0 without HA)."""
    return ha_epoch << SEQ_LIFE_SHIFT if ha_epoch > 0 else 0


def file_name(first_seq: int, fmt: str) -> str:
    """The closed file's name for a file whose first record has `first_seq`."""
    return f"{PREFIX}{first_seq:0{SEQ_DIGITS}d}{EXTENSIONS[fmt]}"


def arrow_schema() -> pa.Schema:
    """The Parquet schema (needs pyarrow: ``pip install 'amqbroker[spark]'``)."""
    import pyarrow as pa

    types = {"str": pa.string(), "int64": pa.int64(), "int32": pa.int32()}
    return pa.schema(
        [pa.field(name, types[t.rstrip("?")], nullable=t.endswith("?")) for name, t in FIELDS]
    )
