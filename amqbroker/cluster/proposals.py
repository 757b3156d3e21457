"""The lifecycle of one group key on its entry node, as a pure state machine.

Theory of operation
-------------------
A grouped message a client sends to a clustered anycast address belongs to the group
key ``group_id + "." + queue``. What the entry node does with it depends on what it
knows about the key (`State`); what it learns changes that (`Event`). `step` applies
one event to one state through one table, `TRANSITIONS`: (state, event) -> (the next
state, the actions the caller performs, in order), in the style of
`amqbroker.protocol.sasl`. A pair missing from the table is an illegal input
(`IllegalTransition`, which names the state and the event).

The machine keeps no per-key memory of its own: the routing module (`routing.Routing`)
derives a key's state from what it already holds (a decision under way: PROPOSING;
else the arbiter's binding on the leader or the cached answer elsewhere: BOUND or
STALE, by whether this node can route to that instance; else UNKNOWN), so the hot path
(a bound group: a dict lookup, one table lookup and a forward) stores nothing more.
A key that was released (un-proposed) is UNKNOWN again: its next
message proposes it anew.

The entry node's view of one key::

    UNKNOWN --route--> PROPOSING --decided--> BOUND --route--> (deliver)
       ^                 |  ^  \\--timeout / give-up--> UNKNOWN
       |                 |  |
       |                 +--+ route (wait behind the proposal), force-removal
       |                      (the answer named an instance this node cannot reach:
       |                      propose again carrying it as stale)
       +-- un-proposal -- BOUND, STALE
    STALE --route--> PROPOSING (the proposal carries the stale binding: force-removal)

Invariants
----------
- At most one decision per key is under way on a node; every message of a key that
  arrives while it is waits behind it, in order (QUEUE), and is delivered or failed
  only when it ends (DELIVER_WAITING, FAIL_WAITING).
- DECIDED, TIMEOUT, GIVE_UP and FORCE_REMOVAL only end or continue a decision under
  way: in any other state they are illegal.
- A message is delivered straight away (DELIVER) only in BOUND.
- This module does no I/O and imports neither trio nor the broker.
"""

from __future__ import annotations

import enum
from typing import Final, NamedTuple

from amqbroker.core.errors import LocalError

__all__ = [
    "ON_ROUTE",
    "TRANSITIONS",
    "Action",
    "Event",
    "IllegalTransition",
    "State",
    "Transition",
    "step",
]


class State(enum.Enum):
    UNKNOWN = "unknown"  # no binding known here, no decision under way (or released)
    PROPOSING = "proposing"  # a decision under way; the key's messages wait behind it
    BOUND = "bound"  # bound to a queue instance this node can route to
    STALE = "stale"  # bound to an instance this node cannot route to (force-remove it)

    # members are singletons: identity hashing keeps the table lookup in C
    __hash__ = object.__hash__


class Event(enum.Enum):
    ROUTE = "route a message"
    DECIDED = "answer"  # the decision names an instance this node can route to
    FORCE_REMOVAL = "force-removal"  # the answer names one it cannot: propose again
    TIMEOUT = "timeout"  # no answer within grouping_timeout
    GIVE_UP = "give up"  # still unroutable after grouping_retries force-removals
    UNPROPOSE = "un-proposal"  # the arbiter released the binding (the one known here)
    UNPROPOSE_LATE = "late un-proposal"  # it names another node than the one known here
    RESCUE = "released from a lost node"  # policy move: decide again, bridge first

    __hash__ = object.__hash__


class Action(enum.Enum):
    DELIVER = "deliver"  # the message goes to the bound node
    QUEUE = "queue"  # the message waits behind the decision under way
    PROPOSE = "propose"  # start a decision (proposal) for the key
    PROPOSE_FORCE_REMOVE = "propose, force-removing"  # ... carrying the stale binding
    TAKE_FROM_BRIDGE = "take from bridge"  # messages held for a lost node go first
    DELIVER_WAITING = "deliver waiting"  # the waiting messages go to the decided node
    COUNT_TIMEOUT = "count timeout"
    FAIL_WAITING = "fail waiting"  # rejected (or routed ungrouped, by policy)
    DROP_BINDING = "drop binding"  # forget the answer, unpin the group locally
    DROP_CACHE = "drop cached answer"

    __hash__ = object.__hash__


class Transition(NamedTuple):
    next: State
    actions: tuple[Action, ...]


class IllegalTransition(LocalError):
    """An event that cannot happen in the key's state (not in TRANSITIONS)."""

    def __init__(self, state: State, event: Event) -> None:
        super().__init__(f"illegal grouping event {event.value!r} in state {state.value!r}")
        self.state = state
        self.event = event


_U, _P, _B, _S = State.UNKNOWN, State.PROPOSING, State.BOUND, State.STALE
_A = Action

# (state, event) -> (next state, actions in order). Anything not listed is illegal.
TRANSITIONS: Final[dict[tuple[State, Event], Transition]] = {
    (_U, Event.ROUTE): Transition(_P, (_A.QUEUE, _A.PROPOSE)),
    (_P, Event.ROUTE): Transition(_P, (_A.QUEUE,)),
    (_B, Event.ROUTE): Transition(_B, (_A.DELIVER,)),
    (_S, Event.ROUTE): Transition(_P, (_A.QUEUE, _A.PROPOSE_FORCE_REMOVE)),
    (_P, Event.DECIDED): Transition(_B, (_A.TAKE_FROM_BRIDGE, _A.DELIVER_WAITING)),
    (_P, Event.FORCE_REMOVAL): Transition(_P, (_A.DROP_CACHE, _A.PROPOSE_FORCE_REMOVE)),
    (_P, Event.TIMEOUT): Transition(_U, (_A.COUNT_TIMEOUT, _A.FAIL_WAITING)),
    (_P, Event.GIVE_UP): Transition(_U, (_A.FAIL_WAITING,)),
    (_U, Event.UNPROPOSE): Transition(_U, (_A.DROP_BINDING,)),
    (_P, Event.UNPROPOSE): Transition(_P, (_A.DROP_BINDING,)),
    (_B, Event.UNPROPOSE): Transition(_U, (_A.DROP_BINDING,)),
    (_S, Event.UNPROPOSE): Transition(_U, (_A.DROP_BINDING,)),
    (_P, Event.UNPROPOSE_LATE): Transition(_P, ()),
    (_B, Event.UNPROPOSE_LATE): Transition(_B, ()),
    (_S, Event.UNPROPOSE_LATE): Transition(_S, ()),
    (_U, Event.RESCUE): Transition(_P, (_A.PROPOSE,)),
    (_P, Event.RESCUE): Transition(_P, ()),
    (_B, Event.RESCUE): Transition(_P, (_A.PROPOSE,)),
    (_S, Event.RESCUE): Transition(_P, (_A.PROPOSE,)),
}


#: the ROUTE column of the table, for the hot path (every message of a grouped key):
#: one dict lookup by state. ROUTE is legal in every state.
ON_ROUTE: Final[dict[State, Transition]] = {s: TRANSITIONS[s, Event.ROUTE] for s in State}


def step(state: State, event: Event) -> Transition:
    """The next state and the actions to perform; IllegalTransition if not allowed."""
    try:
        return TRANSITIONS[state, event]
    except KeyError:
        raise IllegalTransition(state, event) from None
