"""The delivery-log invariants in plain Python: the reference the PySpark audit
(`amqbroker.pipeline.audit`) is tested against, and a checker for small logs.

The records are those of `amqbroker.pipeline.delivery_log_format` (dicts with its
`FIELDS`). Both implementations follow exactly these definitions; change them together.

Vocabulary
----------
slot
    ``(node, queue, message_id)``: the life of one message in one queue instance of one
    node. Events without a message-id are ignored (they cannot be correlated).
copy
    a slot that a message arrived in: it has a ``routed`` event, or it is the
    ``received`` slot (queue = the target address) of a message with no ``routed``
    event on that node. Its *arrival* is the first ``routed`` event (else the first
    ``received``); its *receive time* is the first ``received`` ``ts_us`` of that
    message-id on that node.
resolved
    a copy with a terminal event: ``settled`` with outcome accepted or rejected,
    ``expired``, ``dead_lettered`` or ``forwarded``.
parked
    a copy routed after the message was dead-lettered or expired on the same node
    (the copy in the dead-letter or expiry queue): it may rest there, never lost.
pending
    a copy that arrived within `grace_us` of its node's last event (still in flight
    when the log was taken).

Checks (the first five are invariants: any finding fails the audit)
-------------------------------------------------------------------
lost
    routed copies, neither resolved, parked nor pending.
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
two_owners
    per ``(queue, group)`` over all nodes: each ``dispatched`` opens a delivery that
    the next ``settled`` or ``released`` of its slot closes. A dispatch to consumer B
    while a delivery of the group to another consumer A is open is a moment with two
    owners. Events are ordered by ``(owner_epoch, ts_us, node, seq)``: an owner change
    between nodes bumps the epoch, so clock skew between nodes cannot hide or invent an
    overlap; on one node (epoch 0) this is time, then ``seq``.
unrouted (informational)
    received copies never routed on that node: a rolled-back transactional send, a
    topic without subscribers, or a loss before routing.
seq_gaps (informational)
    per node, ``max(seq) - min(seq) + 1 - count``: records dropped by the log
    (``delivery_log_overflow = drop``) or lost in a crash; the findings may then
    contain false positives.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

#: outcomes of a ``settled`` event that end a message's life in its queue
TERMINAL_OUTCOMES = frozenset({"accepted", "rejected"})
#: events that end a message's life in its queue (with `TERMINAL_OUTCOMES` settles)
TERMINAL_EVENTS = frozenset({"expired", "dead_lettered", "forwarded"})
#: events that close a delivery (for the two-owners check)
CLOSING_EVENTS = frozenset({"settled", "released"})

#: the checks whose findings fail the audit
INVARIANTS = ("lost", "duplicate_after_settle", "received_twice", "order_violations", "two_owners")

Slot = tuple[str, str, str]


@dataclass
class Findings:
    """Every finding, as sorted lists of tuples (see the module docstring)."""

    lost: list[Slot] = field(default_factory=list)
    duplicate_after_settle: list[Slot] = field(default_factory=list)
    #: (message_id, received events)
    received_twice: list[tuple[str, int]] = field(default_factory=list)
    #: (node, queue, group_id, message_id) of the copy dispatched too early
    order_violations: list[tuple[str, str, str, str]] = field(default_factory=list)
    #: (queue, group_id, node, seq, consumer) of the dispatch to the second owner
    two_owners: list[tuple[str, str, str, int, str]] = field(default_factory=list)
    unrouted: list[Slot] = field(default_factory=list)
    #: node -> missing sequence numbers
    seq_gaps: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not any(getattr(self, name) for name in INVARIANTS)

    def counts(self) -> dict[str, int]:
        return {name: len(getattr(self, name)) for name in (*INVARIANTS, "unrouted")} | {
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
    first_accept: int | None = None
    resolved: bool = False
    group_id: str | None = None


def check(records: Iterable[Mapping[str, Any]], grace_us: int = 0) -> Findings:
    """Run every check over `records` (any order) and return the findings."""
    recs = sorted(records, key=lambda r: (r["node"], r["seq"]))
    f = Findings()

    # seq gaps per node
    by_node: dict[str, list[int]] = defaultdict(list)
    last_ts: dict[str, int] = {}
    for r in recs:
        by_node[r["node"]].append(r["seq"])
        last_ts[r["node"]] = max(last_ts.get(r["node"], r["ts_us"]), r["ts_us"])
    for node, seqs in by_node.items():
        gap = max(seqs) - min(seqs) + 1 - len(seqs)
        if gap:
            f.seq_gaps[node] = gap

    slots: dict[Slot, _Slot] = defaultdict(_Slot)
    # (node, mid) -> first received ts, first dead-letter/expiry seq, routed anywhere
    recv_ts: dict[tuple[str, str], int] = {}
    dl_seq: dict[tuple[str, str], int] = {}
    routed_on: set[tuple[str, str]] = set()
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
            recv_ts.setdefault((node, mid), r["ts_us"])
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
        if ev in TERMINAL_EVENTS:
            s.resolved = True
        if ev == "forwarded":
            forwarded[mid] += 1
        if ev in ("dead_lettered", "expired"):
            dl_seq.setdefault((node, mid), seq)

    copies: dict[Slot, _Slot] = {}
    for key, s in slots.items():
        node, queue, mid = key
        accepted, last = s.first_accept, s.max_dispatch
        if accepted is not None and last is not None and last > accepted:
            f.duplicate_after_settle.append(key)
        if s.n_routed or (s.first_received is not None and (node, mid) not in routed_on):
            copies[key] = s
            arrival = s.first_routed if s.first_routed is not None else s.first_received
            assert arrival is not None
            pending = grace_us > 0 and (s.arrival_ts or 0) > last_ts[node] - grace_us
            d = dl_seq.get((node, mid))
            parked = s.n_routed > 0 and d is not None and arrival > d
            if not (s.resolved or parked or pending):
                (f.lost if s.n_routed else f.unrouted).append(key)

    for mid, n in received.items():
        if n > forwarded[mid] + 1:
            f.received_twice.append((mid, n))

    # order: per (node, queue, group), copies by arrival
    groups: dict[tuple[str, str, str], list[tuple[int, str, int]]] = defaultdict(list)
    for (node, queue, mid), s in copies.items():
        if s.group_id is not None and s.first_dispatch is not None:
            arrival = s.first_routed if s.first_routed is not None else s.first_received
            assert arrival is not None
            groups[(node, queue, s.group_id)].append((arrival, mid, s.first_dispatch))
    for (node, queue, gid), items in groups.items():
        items.sort()
        high: int | None = None
        for _, mid, first in items:
            if high is not None and first < high:
                f.order_violations.append((node, queue, gid, mid))
            high = first if high is None else max(high, first)

    f.two_owners = _two_owners(recs)
    for name in (*INVARIANTS, "unrouted"):
        getattr(f, name).sort()
    return f


def _two_owners(recs: list[Mapping[str, Any]]) -> list[tuple[str, str, str, int, str]]:
    def key(r: Mapping[str, Any]) -> tuple[int, int, str, int]:
        return (r["owner_epoch"], r["ts_us"], r["node"], r["seq"])

    # pair each dispatch with the next closing event of its slot (recs: node, seq order)
    open_by_slot: dict[Slot, list[Mapping[str, Any]]] = defaultdict(list)
    intervals: dict[tuple[str, str], list[tuple[Any, Any, str, Mapping[str, Any]]]] = defaultdict(
        list
    )
    for r in recs:
        if r["group_id"] is None or r["message_id"] is None:
            continue
        slot = (r["node"], r["queue"] or "", r["message_id"])
        if r["event"] == "dispatched":
            open_by_slot[slot].append(r)
        elif r["event"] in CLOSING_EVENTS:
            for d in open_by_slot.pop(slot, []):
                intervals[(d["queue"] or "", d["group_id"])].append(
                    (key(d), key(r), d["consumer"] or "", d)
                )
    for opened in open_by_slot.values():
        for d in opened:
            intervals[(d["queue"] or "", d["group_id"])].append(
                (key(d), None, d["consumer"] or "", d)
            )
    found = []
    for (queue, gid), ivs in intervals.items():
        for start, _, consumer, d in ivs:
            for s2, e2, c2, _ in ivs:
                if c2 != consumer and s2 < start and (e2 is None or e2 > start):
                    found.append((queue, gid, d["node"], d["seq"], consumer))
                    break
    return found
