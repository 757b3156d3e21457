"""The group lifecycle table (`amqbroker.core.groups.TRANSITIONS`, applied by
`GroupDispatcher.step`) and the owner-policy registry (`amqbroker.core.owner_policies`)."""

from __future__ import annotations

import pytest

from amqbroker.core import owner_policies
from amqbroker.core.entry import Entry
from amqbroker.core.groups import (
    BIND,
    BLOCKED,
    BOUND,
    DRAIN,
    FREE,
    HELD,
    HOLD,
    ORPHAN,
    PARK,
    RESUME,
    STICK,
    STUCK,
    TRANSITIONS,
    UNBIND,
    UNHOLD,
    UNSTICK,
    WAIT,
    IllegalGroupTransition,
    state_of,
)
from amqbroker.core.queue import QueuePolicy
from tests.unit.core_harness import FakeConsumer, Harness, label

STATES = (FREE, BOUND, BLOCKED, STUCK, HELD, ORPHAN)
EVENTS = (BIND, WAIT, PARK, STICK, DRAIN, HOLD, UNHOLD, RESUME, UNSTICK, UNBIND)


def test_table_names_only_known_states_and_events() -> None:
    for (state, event), targets in TRANSITIONS.items():
        assert state in STATES and event in EVENTS
        assert targets and all(t in STATES for t in targets)
    # a free group can only be created; an owned one never binds again
    assert {e for (s, e) in TRANSITIONS if s == FREE} == {BIND, WAIT, HOLD}
    assert not any((s, BIND) in TRANSITIONS for s in STATES if s != FREE)


def test_illegal_event_is_an_error_with_a_name() -> None:
    h = Harness()
    d = h.queue.dispatcher
    with pytest.raises(IllegalGroupTransition, match="'unbind' in state 'free'"):
        d.step(UNBIND, "G")
    c = h.attach("c1", 5)
    h.send("G")
    with pytest.raises(IllegalGroupTransition):
        d.step(BIND, "G", c=c)


def test_walk_bind_park_drain_hold_unbind() -> None:
    h = Harness()
    q = h.queue
    d = q.dispatcher
    c = h.attach("c1", 1)
    h.send("G")
    assert state_of(d.table["G"]) == BOUND
    h.attach("c2", 5)  # the pass runs while someone has credit
    h.send("G")  # owner has no credit left: parked
    assert state_of(d.table["G"]) == BLOCKED
    h.add_credit(c, 5)
    assert state_of(d.table["G"]) == BOUND
    assert c.labels == ["G1", "G2"]
    assert q.hold_group("G")
    assert state_of(d.table["G"]) == HELD
    h.send("G")
    assert c.labels == ["G1", "G2"]  # held: nothing moves
    q.unhold_group("G")
    assert c.labels == ["G1", "G2", "G3"]
    assert q.reset_group("G")
    assert state_of(d.table.get("G")) == FREE


def test_orphan_group_waits_then_binds() -> None:
    h = Harness()
    d = h.queue.dispatcher
    picky = h.attach("picky", 5, filter=lambda e: e.group_id != "G")
    h.send("G")
    assert state_of(d.table["G"]) == ORPHAN
    other = h.attach("other", 5)
    assert [label(x.entry) for x in h.journal if x.consumer is other] == ["G1"]
    assert d.table["G"].owner is other and not picky.labels


def test_stuck_owner_is_reported_once() -> None:
    h = Harness(policy=QueuePolicy())
    d = h.queue.dispatcher
    ok = {"G1"}
    c = h.attach("c1", 5, filter=lambda e: label(e) in ok)
    h.send("G")
    h.send("G")
    g = d.table["G"]
    assert state_of(g) == STUCK and d.stuck_groups == 1
    h.send("G")
    assert d.stuck_groups == 1 and h.queue.stuck_messages == 1
    assert isinstance(c, FakeConsumer)


def test_owner_policy_registry() -> None:
    assert owner_policies.OWNER_POLICIES["round-robin"] is owner_policies.round_robin
    assert owner_policies.OWNER_POLICIES["least-loaded"] is owner_policies.least_loaded
    assert owner_policies.owner_policy("no-such-policy") is owner_policies.round_robin


def test_a_new_policy_is_one_function_and_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast path and the dispatch pass both ask the queue's policy."""

    def last_attached(
        tiers: list[owner_policies.Tier], e: Entry, marks: owner_policies.Marks
    ) -> FakeConsumer | None:
        for tier in tiers:
            for c in reversed(tier.consumers):
                if c.credit > 0 and not c.blocked and owner_policies.accepts(c, e, marks):
                    assert isinstance(c, FakeConsumer)
                    return c
        return None

    monkeypatch.setitem(owner_policies.OWNER_POLICIES, "last-attached", last_attached)
    h = Harness(policy=QueuePolicy(group_owner_policy="last-attached"))
    a = h.attach("a", 5)
    b = h.attach("b", 5)
    h.send("G")  # fast path
    assert b.labels == ["G1"] and not a.labels
    h.credit(a, 0)
    h.credit(b, 0)
    h.send("H")  # queued: the dispatch pass binds it when credit comes
    h.credit(b, 5)
    h.credit(a, 5)
    assert b.labels == ["G1", "H1"] and not a.labels


def _fresh(s: str) -> str:
    """An equal string that is another object, as the scanner decodes one per message."""
    out = "".join(list(s))
    assert out == s and out is not s
    return out


def test_messages_of_a_bound_group_carry_the_groups_own_key_string() -> None:
    """Once a group is bound, each of its messages the dispatcher looks at carries the
    group's key object instead of its own equal copy (delivered at once, or parked for
    a busy owner). A backlog, and each delivery-log batch, then holds one string per
    group, not one per message."""
    h = Harness()
    c = h.attach("c", 2)
    first = h.send(_fresh("grp"))
    direct = h.send(_fresh("grp"))
    parked = h.send(_fresh("grp"))  # c has no credit left: parked for its owner
    key = first.group_id
    assert key is not None and h.queue.list_groups()[0]["group"] == "grp"
    assert direct.group_id is key and direct.gkey is key
    assert parked.group_id is key and parked.gkey is key
    h.credit(c, 5)
    assert c.labels == ["grp1", "grp2", "grp3"]


def test_a_bucketed_group_keeps_its_own_string() -> None:
    """With buckets the key is the bucket number: the message's group id is left as
    it came (its value is what the delivery log and management report)."""
    h = Harness(QueuePolicy(group_buckets=4))
    h.attach("c", 5)
    h.send(_fresh("grp"))
    e = h.send(_fresh("grp"))
    assert e.group_id == "grp" and isinstance(e.gkey, int)
