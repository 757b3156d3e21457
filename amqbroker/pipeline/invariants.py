"""The delivery-log invariants in plain Python: the reference the PySpark audit
(`amqbroker.pipeline.audit`) is tested against, and a checker for small logs.

The records are those of `amqbroker.pipeline.delivery_log_format` (dicts with its
`FIELDS`). Both implementations follow exactly these definitions; change them together.

Vocabulary
----------
slot
    ``(node, queue, message_id)``: the life of one message in one queue instance of one
    node. Events without a message-id are ignored (they cannot be correlated), except
    the markers ``started`` and ``unbound``.
copy
    a slot that a message arrived in: it has a ``routed`` event, or it is the
    ``received`` slot (queue = the target address) of a message with no ``routed``
    event on that node. Its *arrival* is the first ``routed`` event (else the first
    ``received``); its *receive time* is the first ``received`` ``ts_us`` of that
    message-id on that node.
resolved
    a copy with a terminal event: ``settled`` with outcome accepted or rejected,
    ``expired``, ``dead_lettered``, ``forwarded`` or ``late``; or a received copy of a
    message this node forwarded (it left for another node's queue instance).
parked
    a copy routed after the message was dead-lettered or expired on the same node
    (the copy in the dead-letter or expiry queue): it may rest there, never lost.
pending
    a copy that arrived within `grace_us` of its node's last event (still in flight
    when the log was taken).
held
    a copy whose last ``dispatched`` has no later ``settled`` or ``released`` (by
    ``seq``): a consumer holds it and its outcome is missing.
skipped
    a grouped copy such that a copy of its group in the same queue instance that
    arrived later (by arrival, then message-id) was dispatched (its last dispatch)
    after this one arrived and after its last settle/release: the group's messages go
    out in order, so this one was passed over.
K (cross-node order)
    events of different nodes are ordered by ``(owner_epoch, ts_us, node, seq)``. An
    owner change through an arbiter failover bumps the epoch, so the events of the new
    owner sort after those of the old one whatever the clocks say. Within one epoch the
    nodes' clocks decide: clock skew ``s`` between two nodes can invent a cross-node
    finding between events less than ``s`` apart, or hide one. The cross-node findings
    a node loss causes are seconds apart (``cluster_node_timeout``, a restart), far
    above the skew of NTP-synchronised clocks (milliseconds); on one node (epoch 0,
    one clock) ``ts_us`` follows ``seq`` unless the wall clock steps back.
producer
    the identity of a message's sender across nodes: ``(entry node, boot, producer)``
    of its *entry* ``received`` event: the first (by ``ts_us``, node, seq) ``received``
    of its message-id on a node it was not forwarded to (a ``forwarded`` record's
    queue ``"<node>/<queue>"`` names the node; forwarded copies keep the original
    message-id, so the target node's events join back). ``producer`` is the
    ``"<connection id>/<link name>"`` of that record; *boot* is the number of
    ``started`` markers of the entry node at or before its ``seq`` (connection ids
    start again at each boot). Shown as ``"<entry node>/<producer>"`` with the boot.
producer identity
    the ``producer_identity`` of the entry ``received``: ``"<container-id>/<link
    name>"`` of the sender, the same across its reconnects, restarts of the broker and
    failover to another entry node (Qpid JMS keeps its container-id and link names
    through ``failover:``). Null in logs written before the field existed. It
    assumes one sender per (container-id, link name) at a time: two live connections
    with one container-id (a client given a fixed container-id without the
    sole-connection capability) sending the same group on links of the same name
    would read as one producer.
order key
    per (queue, group, producer): ``group_seq`` of the entry ``received`` when every
    message of that (queue, group, producer) has one (> 0: 0 is "not set", -1 closes
    the group), then the entry ``seq``; otherwise the entry ``seq`` alone (the order in
    which the entry node received them from that link).
resend
    a message received again with the same message-id (a producer that resends what
    it had no answer for after a failover): one message, its entry ``received`` the
    first, its first dispatch the first dispatch of either copy.
late
    a message with a ``late`` event (policy ``move``: a stranded message forwarded
    after a node loss, delivered after newer ones on purpose).

Checks (the first seven are invariants: any finding fails the audit)
------------------------------------------------------------------
lost
    routed copies, neither resolved, parked, pending nor still queued.
duplicate_after_settle
    slots with a ``dispatched`` event after (per-node ``seq``) their first ``settled``
    accepted: a message delivered again after the consumer accepted it.
received_twice
    message-ids with more ``received`` events than ``forwarded`` events + 1, over all
    nodes (the duplicate-detection window drops a resent message before ``received``).
order_violations
    per queue instance ``(node, queue)`` and group: copies ordered by arrival; a copy
    whose first ``dispatched`` comes (by ``seq``) before the first dispatch of a copy of
    the group that arrived earlier. Copies never dispatched are not compared.
producer_order
    per (queue, group, producer) across all nodes: the messages ordered by their order
    key; a message whose first ``dispatched`` in that queue (on whichever node, by K)
    comes after the first dispatch of a message later in that order is a violation
    (reported with the earliest-dispatched such later message: the two messages, the
    nodes and times of their first dispatches). Only dispatches in the queue named by
    the entry ``received`` (the anycast queue of the target address) count: topic
    subscriptions, dead-letter and expiry queues are left to ``order_violations``.
    Messages never dispatched there, without a producer or a group, and late messages
    are not compared.
producer_order_across_entry_nodes
    per (queue, group, producer identity), whatever the entry node, its boot and the
    connection: the messages ordered by the ``group_seq`` of their entry ``received``;
    a message whose first ``dispatched`` in that queue (on whichever node, by K) comes
    after the first dispatch of a message with a higher group-sequence is a violation
    (reported with the earliest-dispatched such message, as ``producer_order``). A
    producer that fails over from one entry node to another, or reconnects, is one
    producer here: its newer messages sent through the new entry node must not
    overtake older ones still on their way from the old one. Only partitions where
    every message has a group-sequence (> 0) are checked: the entry ``seq`` of
    different nodes (and of different boots) is not comparable, so without
    group-sequences the order of a producer's messages across entry nodes is unknown
    and such partitions are left out (``producer_order`` still checks each entry
    node's share). Messages with equal group-sequences are not ordered between them.
    A resend counts once; messages never dispatched in that queue, without an
    identity or a group, and late messages are not compared.
two_owners
    per ``(queue, group)`` over all nodes: each ``dispatched`` opens a delivery that
    the next ``settled`` or ``released`` of its slot in the same boot closes, or else
    the node's next ``started`` marker (a process that died took its consumers and
    their deliveries with it: the next boot delivers them afresh); the deliveries' endpoints
    (+1 at the dispatch, -1 at the close) are ordered by (K, dispatch seq). A
    *moment*: a dispatch while deliveries of the group to other consumers are open.
    The *owners* at an endpoint: the consumers holding an open delivery. An *episode*
    runs from the endpoint where the owners reach 2 until they drop below 2; every
    moment falls in one. The invariant counts episodes, each with its moments and
    first and last moment.
unrouted (informational)
    received copies never routed on that node and not resolved: a rolled-back
    transactional send, a topic without subscribers, or a loss before routing.
still_queued (informational)
    routed copies, not resolved, parked, pending, held nor skipped: the backlog the
    log ended with.
moves (informational)
    per (queue, group): its ``dispatched`` events and the arbiter's ``unbound``
    markers of the group (``queue`` ``"<node>/<queue>"``), ordered by K; a dispatch on
    another node than the group's previous dispatch, with no ``unbound`` of the group
    between the two, is a move without a release. Counted per (queue, group, from
    node, to node), with the number of such moves. Informational, not an invariant:
    logs written before the marker existed have none, a record dropped by the log
    (seq gaps) can hide one, ``grouping_timeout_policy = "ungrouped"`` routes a
    group's message anywhere on purpose, and the harm a move does (messages consumed
    out of order) is what ``producer_order`` and ``two_owners`` fail on; a move
    without those is a warning worth reading (a returning node serving a group bound
    elsewhere). A node restart (``started``) does not explain a move: under the
    default node-loss policy ``wait`` a lost node keeps its groups.
late (informational)
    slots with a ``late`` event: delivered late after a node loss (policy ``move``).
seq_gaps (informational)
    per node, ``max(seq) - min(seq) + 1 - count``: records dropped by the log
    (``delivery_log_overflow = drop``) or lost in a crash; the findings may then
    contain false positives.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from amqbroker.pipeline.delivery_log_format import SEQ_LIFE_SHIFT

#: outcomes of a ``settled`` event that end a message's life in its queue
TERMINAL_OUTCOMES = frozenset({"accepted", "rejected"})
#: events that end a message's life in its queue (with `TERMINAL_OUTCOMES` settles)
TERMINAL_EVENTS = frozenset({"expired", "dead_lettered", "forwarded", "late"})
#: events that close a delivery (for the two-owners check)
CLOSING_EVENTS = frozenset({"settled", "released"})

#: the checks whose findings fail the audit
INVARIANTS = (
    "lost",
    "duplicate_after_settle",
    "received_twice",
    "order_violations",
    "producer_order",
    "producer_order_across_entry_nodes",
    "two_owners",
)
#: the informational findings (listed, counted, never a failure)
INFO = ("unrouted", "still_queued", "moves", "late")

Slot = tuple[str, str, str]
#: cross-node order: (owner_epoch, ts_us, node, seq)
Key = tuple[int, int, str, int]


def order_key(r: Mapping[str, Any]) -> Key:
    return (r["owner_epoch"], r["ts_us"], r["node"], r["seq"])


def target_node(forwarded_queue: str | None) -> str:
    """The node a ``forwarded`` record's queue ``"<node>/<queue>"`` names."""
    return (forwarded_queue or "").split("/", 1)[0]


@dataclass
class Findings:
    """Every finding, as sorted lists of tuples (see the module docstring)."""

    lost: list[Slot] = field(default_factory=list)
    duplicate_after_settle: list[Slot] = field(default_factory=list)
    #: (message_id, received events)
    received_twice: list[tuple[str, int]] = field(default_factory=list)
    #: (node, queue, group_id, message_id) of the copy dispatched too early
    order_violations: list[tuple[str, str, str, str]] = field(default_factory=list)
    #: (queue, group_id, "<entry node>/<producer>", boot, message_id dispatched too
    #: late, the later message_id first dispatched before it)
    producer_order: list[tuple[str, str, str, int, str, str]] = field(default_factory=list)
    #: (queue, group_id, producer identity, message_id dispatched too late, the later
    #: message_id (higher group-sequence) first dispatched before it)
    producer_order_across_entry_nodes: list[tuple[str, str, str, str, str]] = field(
        default_factory=list
    )
    #: episodes: (queue, group_id, node, seq, consumer, moments) of the first moment
    two_owners: list[tuple[str, str, str, int, str, int]] = field(default_factory=list)
    #: (queue, group_id, node, seq, consumer) of each dispatch to a second owner
    two_owner_moments: list[tuple[str, str, str, int, str]] = field(default_factory=list)
    unrouted: list[Slot] = field(default_factory=list)
    still_queued: list[Slot] = field(default_factory=list)
    #: (queue, group_id, from node, to node, moves) without an ``unbound`` between
    moves: list[tuple[str, str, str, str, int]] = field(default_factory=list)
    #: slots with a ``late`` event
    late: list[Slot] = field(default_factory=list)
    #: node -> missing sequence numbers
    seq_gaps: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not any(getattr(self, name) for name in INVARIANTS)

    def counts(self) -> dict[str, int]:
        return {name: len(getattr(self, name)) for name in (*INVARIANTS, *INFO)} | {
            "seq_gaps": sum(self.seq_gaps.values())
        }


@dataclass
class _Slot:
    n_routed: int = 0
    first_routed: int | None = None
    first_received: int | None = None
    arrival_ts: int | None = None
    first_dispatch: int | None = None
    max_dispatch: int | None = None
    max_close: int | None = None
    first_accept: int | None = None
    resolved: bool = False
    late: bool = False
    group_id: str | None = None

    @property
    def arrival(self) -> int:
        a = self.first_routed if self.first_routed is not None else self.first_received
        assert a is not None
        return a


def check(records: Iterable[Mapping[str, Any]], grace_us: int = 0) -> Findings:
    """Run every check over `records` (any order) and return the findings."""
    recs = sorted(records, key=lambda r: (r["node"], r["seq"]))
    f = Findings()

    # seq gaps per node, counted within each life (a pair member's, SEQ_LIFE_SHIFT)
    by_life: dict[tuple[str, int], list[int]] = defaultdict(list)
    last_ts: dict[str, int] = {}
    for r in recs:
        by_life[(r["node"], r["seq"] >> SEQ_LIFE_SHIFT)].append(r["seq"])
        last_ts[r["node"]] = max(last_ts.get(r["node"], r["ts_us"]), r["ts_us"])
    for (node, _), seqs in by_life.items():
        gap = max(seqs) - min(seqs) + 1 - len(seqs)
        if gap:
            f.seq_gaps[node] = f.seq_gaps.get(node, 0) + gap

    slots: dict[Slot, _Slot] = defaultdict(_Slot)
    # (node, mid) -> first dead-letter/expiry seq; routed there; forwarded from there
    dl_seq: dict[tuple[str, str], int] = {}
    routed_on: set[tuple[str, str]] = set()
    forwarded_from: set[tuple[str, str]] = set()
    received: dict[str, int] = defaultdict(int)
    forwarded: dict[str, int] = defaultdict(int)
    for r in recs:
        mid = r["message_id"]
        if mid is None:
            continue
        node, seq, ev = r["node"], r["seq"], r["event"]
        s = slots[(node, r["queue"] or "", mid)]
        if s.group_id is None and r["group_id"] is not None:
            s.group_id = r["group_id"]
        if ev == "received":
            received[mid] += 1
            if s.first_received is None:
                s.first_received = seq
                if s.first_routed is None:
                    s.arrival_ts = r["ts_us"]
        elif ev == "routed":
            s.n_routed += 1
            routed_on.add((node, mid))
            if s.first_routed is None:
                s.first_routed = seq
                s.arrival_ts = r["ts_us"]
        elif ev == "dispatched":
            if s.first_dispatch is None:
                s.first_dispatch = seq
            s.max_dispatch = seq
        elif ev == "settled":
            if r["outcome"] in TERMINAL_OUTCOMES:
                s.resolved = True
            if r["outcome"] == "accepted" and s.first_accept is None:
                s.first_accept = seq
        if ev in CLOSING_EVENTS:
            s.max_close = seq
        if ev in TERMINAL_EVENTS:
            s.resolved = True
        if ev == "late":
            s.late = True
        if ev == "forwarded":
            forwarded[mid] += 1
            forwarded_from.add((node, mid))
        if ev in ("dead_lettered", "expired"):
            dl_seq.setdefault((node, mid), seq)

    copies: dict[Slot, _Slot] = {}
    for key, s in slots.items():
        node, queue, mid = key
        accepted, last = s.first_accept, s.max_dispatch
        if accepted is not None and last is not None and last > accepted:
            f.duplicate_after_settle.append(key)
        if s.late:
            f.late.append(key)
        if s.n_routed or (s.first_received is not None and (node, mid) not in routed_on):
            copies[key] = s

    # later copies of a group in a queue instance: the highest last dispatch after each
    later_dispatch: dict[Slot, int | None] = {}
    instance: dict[tuple[str, str, str], list[tuple[int, str, Slot]]] = defaultdict(list)
    for key, s in copies.items():
        if s.group_id is not None:
            instance[(key[0], key[1], s.group_id)].append((s.arrival, key[2], key))
    for members in instance.values():
        members.sort()
        high: int | None = None
        for _, _, key in reversed(members):
            later_dispatch[key] = high
            d = copies[key].max_dispatch
            if d is not None:
                high = d if high is None else max(high, d)

    for key, s in copies.items():
        node, queue, mid = key
        resolved = s.resolved or (s.n_routed == 0 and (node, mid) in forwarded_from)
        pending = grace_us > 0 and (s.arrival_ts or 0) > last_ts[node] - grace_us
        d = dl_seq.get((node, mid))
        parked = s.n_routed > 0 and d is not None and s.arrival > d
        if resolved or parked or pending:
            continue
        if not s.n_routed:
            f.unrouted.append(key)
            continue
        held = s.max_dispatch is not None and (s.max_close is None or s.max_close < s.max_dispatch)
        later = later_dispatch.get(key)
        since = s.arrival if s.max_close is None else max(s.arrival, s.max_close)
        skipped = later is not None and later > since
        (f.lost if held or skipped else f.still_queued).append(key)

    for mid, n in received.items():
        if n > forwarded[mid] + 1:
            f.received_twice.append((mid, n))

    # order: per (node, queue, group), copies by arrival
    groups: dict[tuple[str, str, str], list[tuple[int, str, int]]] = defaultdict(list)
    for (node, queue, mid), s in copies.items():
        if s.group_id is not None and s.first_dispatch is not None:
            groups[(node, queue, s.group_id)].append((s.arrival, mid, s.first_dispatch))
    for (node, queue, gid), items in groups.items():
        items.sort()
        top: int | None = None
        for _, mid, first in items:
            if top is not None and first < top:
                f.order_violations.append((node, queue, gid, mid))
            top = first if top is None else max(top, first)

    late = {k[2] for k in f.late}
    entry, first_dispatch = _entries_and_first_dispatches(recs)
    f.producer_order = _producer_order(recs, late, entry, first_dispatch)
    f.producer_order_across_entry_nodes = _producer_order_across_entry_nodes(
        late, entry, first_dispatch
    )
    f.two_owners, f.two_owner_moments = _two_owners(recs)
    f.moves = _moves(recs)
    for name in (*INVARIANTS, *INFO, "two_owner_moments"):
        getattr(f, name).sort()
    return f


def boots(recs: Iterable[Mapping[str, Any]]) -> dict[str, list[int]]:
    """Per node, the sorted seqs of its ``started`` markers."""
    out: dict[str, list[int]] = defaultdict(list)
    for r in recs:
        if r["event"] == "started":
            out[r["node"]].append(r["seq"])
    for seqs in out.values():
        seqs.sort()
    return out


#: message-id -> its entry received: ((ts_us, node, seq), the record)
Entries = dict[str, tuple[tuple[int, str, int], Mapping[str, Any]]]
#: (queue, message-id) -> K of its first dispatch in that queue, on any node
FirstDispatches = dict[tuple[str, str], Key]


def _entries_and_first_dispatches(
    recs: list[Mapping[str, Any]],
) -> tuple[Entries, FirstDispatches]:
    """Each message's entry ``received`` and its first dispatch per queue (the
    ``producer`` definitions of the module docstring)."""
    inbound: dict[str, set[str]] = defaultdict(set)
    for r in recs:
        if r["event"] == "forwarded" and r["message_id"] is not None:
            inbound[r["message_id"]].add(target_node(r["queue"]))
    entry: Entries = {}
    first: FirstDispatches = {}
    for r in recs:
        mid = r["message_id"]
        if mid is None:
            continue
        if r["event"] == "received" and r["node"] not in inbound.get(mid, ()):
            at = (r["ts_us"], r["node"], r["seq"])
            if mid not in entry or at < entry[mid][0]:
                entry[mid] = (at, r)
        elif r["event"] == "dispatched":
            k, q = order_key(r), (r["queue"] or "", mid)
            if q not in first or k < first[q]:
                first[q] = k
    return entry, first


def _producer_order(
    recs: list[Mapping[str, Any]], late: set[str], entry: Entries, first: FirstDispatches
) -> list[tuple[str, str, str, int, str, str]]:
    starts = boots(recs)
    parts: dict[tuple[str, str, str, int, str], list[tuple[int, int, str, Key]]] = defaultdict(list)
    for (queue, mid), k in first.items():
        e = entry.get(mid)
        if e is None or mid in late:
            continue
        r = e[1]
        if r["producer"] is None or r["group_id"] is None or (r["queue"] or "") != queue:
            continue
        boot = bisect.bisect_right(starts.get(r["node"], []), r["seq"])
        gseq = r["group_seq"] if r["group_seq"] is not None else 0
        parts[(queue, r["group_id"], r["node"], boot, r["producer"])].append(
            (gseq, r["seq"], mid, k)
        )
    found = []
    for (queue, gid, node, boot, producer), items in parts.items():
        every = all(g > 0 for g, *_ in items)
        items.sort(key=lambda x: (x[0] if every else 0, x[1], x[2]))
        best: tuple[Key, str] | None = None  # earliest first dispatch of a later message
        for _, _, mid, k in reversed(items):
            if best is not None and best[0] < k:
                found.append((queue, gid, f"{node}/{producer}", boot, mid, best[1]))
            if best is None or k < best[0]:
                best = (k, mid)
    return found


def _producer_order_across_entry_nodes(
    late: set[str], entry: Entries, first: FirstDispatches
) -> list[tuple[str, str, str, str, str]]:
    parts: dict[tuple[str, str, str], list[tuple[int, str, Key]]] = defaultdict(list)
    for (queue, mid), k in first.items():
        e = entry.get(mid)
        if e is None or mid in late:
            continue
        r = e[1]
        ident = r.get("producer_identity")
        if ident is None or r["group_id"] is None or (r["queue"] or "") != queue:
            continue
        gseq = r["group_seq"] if r["group_seq"] is not None else 0
        parts[(queue, r["group_id"], ident)].append((gseq, mid, k))
    found = []
    for (queue, gid, ident), items in parts.items():
        if not all(g > 0 for g, *_ in items):
            continue  # no order across entry nodes without group-sequences
        items.sort(reverse=True)
        # the earliest first dispatch of a message with a higher group-sequence
        best: tuple[Key, str] | None = None
        i = 0
        while i < len(items):
            j = i
            while j < len(items) and items[j][0] == items[i][0]:
                j += 1
            same = items[i:j]  # equal group-sequences: not ordered between them
            for _, mid, k in same:
                if best is not None and best[0] < k:
                    found.append((queue, gid, ident, mid, best[1]))
            for _, mid, k in same:
                if best is None or k < best[0]:
                    best = (k, mid)
            i = j
    return found


def _two_owners(
    recs: list[Mapping[str, Any]],
) -> tuple[list[tuple[str, str, str, int, str, int]], list[tuple[str, str, str, int, str]]]:
    # pair each dispatch with the next closing event of its slot (recs: node, seq order)
    open_by_slot: dict[Slot, list[Mapping[str, Any]]] = defaultdict(list)
    # (queue, group) -> endpoints ((K, dispatch seq), delta, consumer, dispatch)
    ends: dict[tuple[str, str], list[tuple[tuple[Key, int], int, str, Mapping[str, Any]]]] = (
        defaultdict(list)
    )
    for r in recs:
        if r["event"] == "started":
            # a new boot: what the node's previous process had delivered and never
            # settled ends here (its consumers went with it)
            for slot in [s for s in open_by_slot if s[0] == r["node"]]:
                for d in open_by_slot.pop(slot):
                    ends[(slot[1], d["group_id"])].append(
                        ((order_key(r), d["seq"]), -1, d["consumer"] or "", d)
                    )
            continue
        if r["group_id"] is None or r["message_id"] is None:
            continue
        slot = (r["node"], r["queue"] or "", r["message_id"])
        if r["event"] == "dispatched":
            open_by_slot[slot].append(r)
            ends[(slot[1], r["group_id"])].append(
                ((order_key(r), r["seq"]), 1, r["consumer"] or "", r)
            )
        elif r["event"] in CLOSING_EVENTS:
            for d in open_by_slot.pop(slot, []):
                ends[(slot[1], d["group_id"])].append(
                    ((order_key(r), d["seq"]), -1, d["consumer"] or "", d)
                )
    episodes = []
    moments = []
    for (queue, gid), items in ends.items():
        items.sort(key=lambda x: x[0])
        open_all = 0
        mine: dict[str, int] = defaultdict(int)
        owners = 0
        episode: list[tuple[Key, Mapping[str, Any]]] = []
        for k, delta, consumer, d in items:
            before = owners
            if delta == 1 and open_all - mine[consumer] > 0:
                moments.append((queue, gid, d["node"], d["seq"], consumer))
                episode.append((k[0], d))
            if delta == 1 and mine[consumer] == 0:
                owners += 1
            elif delta == -1 and mine[consumer] == 1:
                owners -= 1
            open_all += delta
            mine[consumer] += delta
            if before >= 2 and owners < 2 and episode:
                episodes.append(_episode(queue, gid, episode))
                episode = []
        if episode:
            episodes.append(_episode(queue, gid, episode))
    return episodes, moments


def _episode(
    queue: str, gid: str, moments: list[tuple[Key, Mapping[str, Any]]]
) -> tuple[str, str, str, int, str, int]:
    d = min(moments, key=lambda m: m[0])[1]
    return (queue, gid, d["node"], d["seq"], d["consumer"] or "", len(moments))


def _moves(recs: list[Mapping[str, Any]]) -> list[tuple[str, str, str, str, int]]:
    # (queue, group) -> (K, is dispatch, node)
    events: dict[tuple[str, str], list[tuple[Key, bool, str]]] = defaultdict(list)
    for r in recs:
        gid = r["group_id"]
        if gid is None:
            continue
        if r["event"] == "dispatched" and r["message_id"] is not None:
            events[(r["queue"] or "", gid)].append((order_key(r), True, r["node"]))
        elif r["event"] == "unbound":
            queue = (r["queue"] or "").split("/", 1)[-1]
            events[(queue, gid)].append((order_key(r), False, r["node"]))
    moves: dict[tuple[str, str, str, str], int] = defaultdict(int)
    for (queue, gid), items in events.items():
        items.sort()
        prev: str | None = None
        released = False
        for _, dispatch, node in items:
            if not dispatch:
                released = True
                continue
            if prev is not None and prev != node and not released:
                moves[(queue, gid, prev, node)] += 1
            prev, released = node, False
    return [(*k, n) for k, n in moves.items()]
