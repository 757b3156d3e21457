"""The group key state machine of an entry node (`amqbroker.cluster.proposals`)."""

from __future__ import annotations

import itertools

import pytest

from amqbroker.cluster.proposals import (
    ON_ROUTE,
    TRANSITIONS,
    Action,
    Event,
    IllegalTransition,
    State,
    Transition,
    step,
)

U, P, B, S = State.UNKNOWN, State.PROPOSING, State.BOUND, State.STALE
A = Action

EXPECTED: dict[tuple[State, Event], Transition] = {
    # a message for the key
    (U, Event.ROUTE): Transition(P, (A.QUEUE, A.PROPOSE)),
    (P, Event.ROUTE): Transition(P, (A.QUEUE,)),
    (B, Event.ROUTE): Transition(B, (A.DELIVER,)),
    (S, Event.ROUTE): Transition(P, (A.QUEUE, A.PROPOSE_FORCE_REMOVE)),
    # the end (or continuation) of the decision under way
    (P, Event.DECIDED): Transition(B, (A.TAKE_FROM_BRIDGE, A.DELIVER_WAITING)),
    (P, Event.FORCE_REMOVAL): Transition(P, (A.DROP_CACHE, A.PROPOSE_FORCE_REMOVE)),
    (P, Event.TIMEOUT): Transition(U, (A.COUNT_TIMEOUT, A.FAIL_WAITING)),
    (P, Event.GIVE_UP): Transition(U, (A.FAIL_WAITING,)),
    # the arbiter's un-proposals
    (U, Event.UNPROPOSE): Transition(U, (A.DROP_BINDING,)),
    (P, Event.UNPROPOSE): Transition(P, (A.DROP_BINDING,)),
    (B, Event.UNPROPOSE): Transition(U, (A.DROP_BINDING,)),
    (S, Event.UNPROPOSE): Transition(U, (A.DROP_BINDING,)),
    (P, Event.UNPROPOSE_LATE): Transition(P, ()),
    (B, Event.UNPROPOSE_LATE): Transition(B, ()),
    (S, Event.UNPROPOSE_LATE): Transition(S, ()),
    # node loss
    (U, Event.RESCUE): Transition(P, (A.PROPOSE,)),
    (P, Event.RESCUE): Transition(P, ()),
    (B, Event.RESCUE): Transition(P, (A.PROPOSE,)),
    (S, Event.RESCUE): Transition(P, (A.PROPOSE,)),
}

ILLEGAL = [pair for pair in itertools.product(State, Event) if pair not in EXPECTED]


def test_the_table_is_exactly_the_documented_one() -> None:
    assert TRANSITIONS == EXPECTED


def test_the_hot_path_column_is_the_tables_route_column() -> None:
    assert {s: EXPECTED[s, Event.ROUTE] for s in State} == ON_ROUTE


@pytest.mark.parametrize(("state", "event"), list(EXPECTED))
def test_legal_transition(state: State, event: Event) -> None:
    assert step(state, event) == EXPECTED[state, event]


@pytest.mark.parametrize(("state", "event"), ILLEGAL)
def test_illegal_transition_raises_a_named_error(state: State, event: Event) -> None:
    with pytest.raises(IllegalTransition) as info:
        step(state, event)
    assert info.value.state is state and info.value.event is event
    assert state.value in str(info.value) and event.value in str(info.value)


def test_the_illegal_inputs() -> None:
    # outside a decision nothing can end or continue one; an unknown key has no
    # cached answer for a late un-proposal or a lost node to name
    assert sorted((s.name, e.name) for s, e in ILLEGAL) == sorted(
        [(s.name, e) for s in (U, B, S) for e in ("DECIDED", "FORCE_REMOVAL", "TIMEOUT", "GIVE_UP")]
        + [("UNKNOWN", "UNPROPOSE_LATE")]
    )


def test_only_a_bound_key_delivers_at_once_and_at_most_one_decision_per_key() -> None:
    for (state, event), t in TRANSITIONS.items():
        if A.DELIVER in t.actions:
            assert (state, event) == (B, Event.ROUTE)
        if A.PROPOSE in t.actions or A.PROPOSE_FORCE_REMOVE in t.actions:
            # a decision starts only where none is under way, or continues one
            assert state is not P or event is Event.FORCE_REMOVAL
            assert t.next is P
        if A.DELIVER_WAITING in t.actions or A.FAIL_WAITING in t.actions:
            assert state is P and t.next is not P


def test_every_state_is_reachable_from_unknown() -> None:
    seen, todo = {U}, [U]
    while todo:
        s = todo.pop()
        for (state, _), t in TRANSITIONS.items():
            if state is s and t.next not in seen:
                seen.add(t.next)
                todo.append(t.next)
    # STALE comes from a cached answer this node cannot route to, not from a transition
    assert seen == {U, P, B}
