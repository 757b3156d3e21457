"""The broker's metrics: observable instruments fed from one snapshot per collection.

Instrument names are OpenTelemetry names; on the Prometheus endpoint the dots become
underscores, the unit becomes a suffix (`By` -> `_bytes`, `s` -> `_seconds`) and
counters get `_total`. `EXPORTED` lists the Prometheus names (the Grafana dashboard
test checks its panels against it). Labels: `queue`, `address`, `group`.

A snapshot (`Metrics.refresh`) reads `statistics()` of the broker, each queue and the
journal, plus `Queue.largest_groups` (O(waiting messages) per queue) and
`Queue.oldest_waiting_seq` (O(groups)); it runs once per collection, on the trio
thread (see the package docstring), never per message.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from opentelemetry.metrics import CallbackOptions, Meter, Observation

if TYPE_CHECKING:
    from amqbroker.core.broker import Broker
    from amqbroker.core.queue import Queue
    from amqbroker.store.journal import Journal

SYNC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

Points = list[tuple[float, dict[str, str]]]

# (OpenTelemetry name, kind, unit, description, Prometheus name)
_GAUGE = "gauge"
_COUNTER = "counter"
INSTRUMENTS: tuple[tuple[str, str, str, str, str], ...] = (
    (
        "amqbroker.connections",
        _GAUGE,
        "{connection}",
        "open AMQP connections",
        "amqbroker_connections",
    ),
    (
        "amqbroker.memory.resident",
        _GAUGE,
        "By",
        "resident memory of the broker process",
        "amqbroker_memory_resident_bytes",
    ),
    (
        "amqbroker.store.size",
        _GAUGE,
        "By",
        "bytes in the journal's segment files",
        "amqbroker_store_size_bytes",
    ),
    (
        "amqbroker.store.live",
        _GAUGE,
        "By",
        "bytes of live records in the journal",
        "amqbroker_store_live_bytes",
    ),
    (
        "amqbroker.messages.routed",
        _COUNTER,
        "{message}",
        "messages routed to an address",
        "amqbroker_messages_routed_total",
    ),
    (
        "amqbroker.address.messages",
        _GAUGE,
        "{message}",
        "messages held by the address's queues",
        "amqbroker_address_messages",
    ),
    (
        "amqbroker.address.size",
        _GAUGE,
        "By",
        "bytes in memory for the address",
        "amqbroker_address_size_bytes",
    ),
    (
        "amqbroker.address.producers",
        _GAUGE,
        "{producer}",
        "producer links on the address",
        "amqbroker_address_producers",
    ),
    (
        "amqbroker.queue.messages",
        _GAUGE,
        "{message}",
        "messages held (waiting, in flight, scheduled, paged)",
        "amqbroker_queue_messages",
    ),
    (
        "amqbroker.queue.size",
        _GAUGE,
        "By",
        "bytes of the queue's messages in memory",
        "amqbroker_queue_size_bytes",
    ),
    (
        "amqbroker.queue.messages.added",
        _COUNTER,
        "{message}",
        "messages added",
        "amqbroker_queue_messages_added_total",
    ),
    (
        "amqbroker.queue.messages.acknowledged",
        _COUNTER,
        "{message}",
        "messages acknowledged (accepted, or sent presettled)",
        "amqbroker_queue_messages_acknowledged_total",
    ),
    (
        "amqbroker.queue.messages.expired",
        _COUNTER,
        "{message}",
        "messages expired",
        "amqbroker_queue_messages_expired_total",
    ),
    (
        "amqbroker.queue.messages.killed",
        _COUNTER,
        "{message}",
        "messages dead-lettered (rejected, or past max-delivery-attempts)",
        "amqbroker_queue_messages_killed_total",
    ),
    (
        "amqbroker.queue.messages.delivering",
        _GAUGE,
        "{message}",
        "messages in flight (delivered, not settled)",
        "amqbroker_queue_messages_delivering",
    ),
    (
        "amqbroker.queue.consumers",
        _GAUGE,
        "{consumer}",
        "consumers attached",
        "amqbroker_queue_consumers",
    ),
    (
        "amqbroker.queue.oldest_message.age",
        _GAUGE,
        "s",
        "age of the oldest waiting message (0 when none)",
        "amqbroker_queue_oldest_message_age_seconds",
    ),
    (
        "amqbroker.queue.groups",
        _GAUGE,
        "{group}",
        "groups bound to a consumer",
        "amqbroker_queue_groups",
    ),
    (
        "amqbroker.queue.groups.blocked",
        _GAUGE,
        "{group}",
        "groups with messages waiting for their owner",
        "amqbroker_queue_groups_blocked",
    ),
    (
        "amqbroker.queue.group.owner_changes",
        _COUNTER,
        "{binding}",
        "times a group got an owner (first binding, or a new owner after detach, reset, "
        "rebalance or close)",
        "amqbroker_queue_group_owner_changes_total",
    ),
    (
        "amqbroker.queue.group.blocked",
        _COUNTER,
        "s",
        "seconds groups spent blocked (messages waiting for a busy or missing owner)",
        "amqbroker_queue_group_blocked_seconds_total",
    ),
    (
        "amqbroker.group.backlog.messages",
        _GAUGE,
        "{message}",
        "waiting messages of the queue's largest groups (metrics_top_groups per queue)",
        "amqbroker_group_backlog_messages",
    ),
    (
        "amqbroker.group.oldest_message.age",
        _GAUGE,
        "s",
        "age of the oldest waiting message of the queue's largest groups",
        "amqbroker_group_oldest_message_age_seconds",
    ),
)
SYNC_LATENCY = "amqbroker.store.sync.latency"

#: cluster node loss (issue 20): exported only by a cluster node while a peer is lost
CLUSTER_INSTRUMENTS: tuple[tuple[str, str, str, str, str], ...] = (
    (
        "amqbroker.cluster.waiting.groups",
        _GAUGE,
        "{group}",
        "groups bound to a lost node that wait for it (cluster_node_loss_policy = wait)",
        "amqbroker_cluster_waiting_groups",
    ),
    (
        "amqbroker.cluster.waiting.messages",
        _GAUGE,
        "{message}",
        "messages held in order in this node's bridge to a lost node",
        "amqbroker_cluster_waiting_messages",
    ),
    (
        "amqbroker.cluster.waiting.duration",
        _GAUGE,
        "s",
        "how long the groups of a lost node have waited for it",
        "amqbroker_cluster_waiting_duration_seconds",
    ),
)
#: primary/backup pairs (issue 23): exported only by a process with ha_role set,
#: labelled `node` (the node id) and `member` (this member's id); values from
#: `amqbroker.ha.status.report`
HA_INSTRUMENTS: tuple[tuple[str, str, str, str, str], ...] = (
    (
        "amqbroker.ha.role",
        _GAUGE,
        "1",
        "1 for this process's HA role (label role: primary = live, backup = standby)",
        "amqbroker_ha_role",
    ),
    (
        "amqbroker.ha.epoch",
        _GAUGE,
        "1",
        "the pair's lease epoch as this member sees it (0 without ZooKeeper)",
        "amqbroker_ha_epoch",
    ),
    (
        "amqbroker.ha.in_sync",
        _GAUGE,
        "1",
        "1 while the backup's copy is in sync (on the primary: a backup acknowledges "
        "every store cycle; on the backup: its copy is complete)",
        "amqbroker_ha_in_sync",
    ),
    (
        "amqbroker.ha.unreplicated",
        _GAUGE,
        "1",
        "1 while the live primary answers with no backup in sync",
        "amqbroker_ha_unreplicated",
    ),
    (
        "amqbroker.ha.lag.records",
        _GAUGE,
        "{record}",
        "journal records the backup does not have yet (primary: queued or not yet "
        "acknowledged; backup: received, not yet applied)",
        "amqbroker_ha_lag_records",
    ),
    (
        "amqbroker.ha.lag",
        _GAUGE,
        "By",
        "replication bytes the backup does not have yet (as amqbroker.ha.lag.records)",
        "amqbroker_ha_lag_bytes",
    ),
    (
        "amqbroker.ha.full_syncs",
        _COUNTER,
        "{sync}",
        "full syncs started (primary: to a backup; backup: streams restarted from scratch)",
        "amqbroker_ha_full_syncs_total",
    ),
    (
        "amqbroker.ha.drops",
        _COUNTER,
        "{backup}",
        "backups the primary dropped (ack timeout, refused frame, queue over ha_max_queued_bytes)",
        "amqbroker_ha_drops_total",
    ),
)
INSTRUMENTS = INSTRUMENTS + CLUSTER_INSTRUMENTS + HA_INSTRUMENTS
#: the Prometheus names only a cluster node with a lost peer exports
CLUSTER_EXPORTED: frozenset[str] = frozenset(row[4] for row in CLUSTER_INSTRUMENTS)
#: the Prometheus names only a process with ha_role set exports
HA_EXPORTED: frozenset[str] = frozenset(row[4] for row in HA_INSTRUMENTS)

#: every metric family the Prometheus endpoint exports (histograms: the base name,
#: exported as _bucket, _sum and _count)
EXPORTED: frozenset[str] = frozenset(
    {row[4] for row in INSTRUMENTS} | {"amqbroker_store_sync_latency_seconds"}
)


def resident_bytes() -> int:
    """The process's resident set (Linux /proc), else its peak (getrusage)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Metrics:
    """The instruments of one broker and the snapshot their callbacks read."""

    def __init__(
        self,
        meter: Meter,
        *,
        broker: Callable[[], Broker | None],
        journal: Callable[[], Journal | None],
        connections: Callable[[], int],
        clock: Callable[[], float],
        top_groups: int,
        cluster_waiting: Callable[[], list[dict[str, Any]]] = list,
        ha: Callable[[], dict[str, Any] | None] = lambda: None,
    ) -> None:
        self._broker = broker
        self._journal = journal
        self._connections = connections
        self._clock = clock
        self._cluster_waiting = cluster_waiting
        self._ha = ha
        self.top_groups = top_groups
        self._snap: dict[str, Points] = {}
        for name, kind, unit, description, _ in INSTRUMENTS:
            cb = self._callback(name)
            if kind == _COUNTER:
                meter.create_observable_counter(name, [cb], unit=unit, description=description)
            else:
                meter.create_observable_gauge(name, [cb], unit=unit, description=description)
        self.sync_latency = meter.create_histogram(
            SYNC_LATENCY,
            unit="s",
            description="time to fsync one journal batch (durable producers wait for it)",
            explicit_bucket_boundaries_advisory=SYNC_BUCKETS,
        )

    def _callback(self, name: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(options: CallbackOptions) -> Iterable[Observation]:
            return [Observation(v, attrs) for v, attrs in self._snap.get(name, ())]

        return observe

    # ------------------------------------------------------------ snapshot
    def refresh(self) -> None:
        """Take the snapshot the next collection reports (trio thread only)."""
        snap: dict[str, Points] = {}

        def put(name: str, value: float, attrs: dict[str, str] | None = None) -> None:
            snap.setdefault(name, []).append((value, attrs or {}))

        b = self._broker()
        put("amqbroker.connections", self._connections())
        put("amqbroker.memory.resident", resident_bytes())
        j = self._journal()
        if j is not None:
            js = j.statistics()
            put("amqbroker.store.size", js["bytes"])
            put("amqbroker.store.live", js["live_bytes"])
        if b is not None:
            put("amqbroker.messages.routed", b.statistics()["routed"])
            for a in b.addresses.values():
                attrs = {"address": a.name}
                put("amqbroker.address.messages", sum(q.count for q in a.queues), attrs)
                put("amqbroker.address.size", a.size, attrs)
                put("amqbroker.address.producers", a.producers, attrs)
            now = self._clock()
            for q in b.queues.values():
                self._queue(put, q, now)
        for w in self._cluster_waiting():
            attrs = {"node": str(w["node"])}
            put("amqbroker.cluster.waiting.groups", w["groups"], attrs)
            put("amqbroker.cluster.waiting.messages", w["bridgeDepth"], attrs)
            put("amqbroker.cluster.waiting.duration", w["sinceMillis"] / 1000.0, attrs)
        ha = self._ha()
        if ha is not None and ha.get("role"):
            _ha(put, ha)
        self._snap = snap

    def _queue(self, put: Callable[..., None], q: Queue, now: float) -> None:
        st: dict[str, Any] = q.statistics()
        attrs = {"queue": q.name, "address": q.address.name if q.address is not None else ""}
        put("amqbroker.queue.messages", st["messages"], attrs)
        put("amqbroker.queue.size", st["bytes"], attrs)
        put("amqbroker.queue.messages.added", st["enqueued"], attrs)
        put("amqbroker.queue.messages.acknowledged", st["acknowledged"], attrs)
        put("amqbroker.queue.messages.expired", st["expired"], attrs)
        put("amqbroker.queue.messages.killed", st["dead_lettered"], attrs)
        put("amqbroker.queue.messages.delivering", st["in_flight"], attrs)
        put("amqbroker.queue.consumers", st["consumers"], attrs)
        put("amqbroker.queue.groups", st["groups"], attrs)
        put("amqbroker.queue.groups.blocked", st["blocked_groups"], attrs)
        put("amqbroker.queue.group.owner_changes", st["group_owner_changes"], attrs)
        put("amqbroker.queue.group.blocked", st["group_blocked_seconds"], attrs)
        oldest = q.oldest_waiting_seq()
        put("amqbroker.queue.oldest_message.age", _age(q, oldest, now), attrs)
        for group, backlog, seq in q.largest_groups(self.top_groups):
            gattrs = {"queue": q.name, "group": group}
            put("amqbroker.group.backlog.messages", backlog, gattrs)
            put("amqbroker.group.oldest_message.age", _age(q, seq, now), gattrs)


def _ha(put: Callable[..., None], ha: dict[str, Any]) -> None:
    """The HA points of one `amqbroker.ha.status.report`."""
    attrs = {"node": str(ha.get("node") or ""), "member": str(ha.get("member") or "")}
    put("amqbroker.ha.role", 1, {**attrs, "role": str(ha["role"])})
    put("amqbroker.ha.epoch", int(ha.get("epoch") or 0), attrs)
    put("amqbroker.ha.in_sync", 1 if ha.get("inSync") else 0, attrs)
    put("amqbroker.ha.unreplicated", 1 if ha.get("unreplicated") else 0, attrs)
    put("amqbroker.ha.lag.records", int(ha.get("lagRecords") or 0), attrs)
    put("amqbroker.ha.lag", int(ha.get("lagBytes") or 0), attrs)
    put("amqbroker.ha.full_syncs", int(ha.get("fullSyncs") or 0), attrs)
    put("amqbroker.ha.drops", int(ha.get("drops") or 0), attrs)


def _age(q: Queue, seq: int | None, now: float) -> float:
    """Age of message `seq` from the queue's arrival marks (core `Queue.arrival_time`:
    an upper bound within `message_age_resolution`); 0 when there is none."""
    if seq is None:
        return 0.0
    t = q.arrival_time(seq)
    return max(0.0, now - t) if t is not None else 0.0
