"""The role of one process of a primary/backup pair, as a pure state machine.

Theory of operation
-------------------
A node id (``cluster_node_id``) may run as a *pair*: two processes on their own data
dirs, one **live** (it serves clients and peers and streams every store cycle to the
other) and one **standby** (it mirrors the live's store, `amqbroker.ha.mirror`). Who is
live is decided by the lease in ZooKeeper (`amqbroker.ha.lease`); what this process
runs follows from what the lease and the mirror report, through one table,
`TRANSITIONS`: (state, event) -> (the actions the caller performs, in order, and the
next state), in the style of `amqbroker.cluster.proposals`. A pair missing from the
table is an illegal input (`IllegalRoleTransition`).

A process is a **candidate** (it may become live) only while its store is a complete
copy at some epoch: the epoch it last served under, or the one its mirror is in sync
with; the lease lets it take over only when that is ZooKeeper's current epoch, so a
copy that missed anything can never serve. The states::

    WAITING --live--> LIVE --lost--> STOPPING --stopped--> WAITING (requeued)
       |                 ^  |
       |                 |  +--hand-over--> HANDING_OVER --stopped--> WAITING (requeued)
       | standby(addr)   | live (the lease took over at synced epoch + 1)
       v                 |
    MIRRORING --synced--> SYNCED
       ^                    |
       +------unsynced------+

WAITING: nothing runs; a candidate when its store is complete (the caller knows: a
stored epoch), else only waiting to learn whom to mirror. MIRRORING: the mirror runs
against the live's address and is not (yet) a complete copy: not a candidate. SYNCED:
the mirror is in sync at the live's epoch: a candidate at that epoch. LIVE: the broker
serves at the lease's epoch. STOPPING: the lease was lost while live; the broker is
being stopped at once (connections closed, nothing more answered) and the process is
a candidate again only once it has stopped. HANDING_OVER (fail back, ``ha_failback``):
the live broker closes its clients' connections, flushes its last store cycle to the
member in sync (over the replication link, still open) and stops; it then stays a
candidate at the end of the order, so the member in sync ahead of it takes over, and
it mirrors that member from then on (or, if that member died meanwhile, takes over
again itself). A loss of the lease while handing over stops it at once, as when live.

Invariants
----------
- SERVE is performed only on a LIVE event (the lease's takeover committed), never with
  a mirror running (STOP_MIRROR comes first).
- A LOST event while live is answered by STOP_SERVING before anything else; the store
  becomes a candidate again only after STOPPED (no overlap of serving and candidacy).
- REQUEUE comes only after STOPPED (a hand-over's, or a stop after a lost lease):
  the live member znode goes only once the broker answers nothing more.
- START_MIRROR always comes after WITHDRAW: a process whose store is being replaced
  is never a candidate.
- This module does no I/O and imports neither trio nor the broker.
"""

from __future__ import annotations

import enum
from typing import Final, NamedTuple

from amqbroker.core.errors import LocalError

__all__ = [
    "TRANSITIONS",
    "Action",
    "Event",
    "IllegalRoleTransition",
    "State",
    "Transition",
    "step",
]


class State(enum.Enum):
    WAITING = "waiting"
    MIRRORING = "mirroring"
    SYNCED = "synced"
    LIVE = "live"
    STOPPING = "stopping"
    HANDING_OVER = "handing-over"


class Event(enum.Enum):
    #: the lease made this process live (its takeover committed)
    LIVE = "live"
    #: another process is live, at a known address
    STANDBY = "standby"
    #: nobody is live right now
    NO_LIVE = "no-live"
    #: the live moved to another address (a takeover between two other processes)
    LIVE_MOVED = "live-moved"
    #: the lease was lost (ZooKeeper session suspended or expired)
    LOST = "lost"
    #: the mirror's copy is complete at the live's epoch
    SYNCED = "synced"
    #: the mirror's copy stopped being complete (link lost, disk error, resync)
    UNSYNCED = "unsynced"
    #: the broker stopped serving
    STOPPED = "stopped"
    #: fail back is due (``ha_failback``): the configured primary's copy is in sync
    HAND_OVER = "hand-over"


class Action(enum.Enum):
    START_MIRROR = "start-mirror"
    STOP_MIRROR = "stop-mirror"
    CANDIDATE = "candidate"
    WITHDRAW = "withdraw"
    SERVE = "serve"
    STOP_SERVING = "stop-serving"
    #: close the clients' connections, flush the last store cycle to the backup over
    #: the replication link, then stop the broker
    HAND_OVER = "hand-over"
    #: stay a candidate, at the end of the order (the member in sync ahead takes over)
    REQUEUE = "requeue"


class Transition(NamedTuple):
    actions: tuple[Action, ...]
    next: State


S, E, A = State, Event, Action

TRANSITIONS: Final[dict[tuple[State, Event], Transition]] = {
    (S.WAITING, E.LIVE): Transition((A.SERVE,), S.LIVE),
    (S.WAITING, E.STANDBY): Transition((A.WITHDRAW, A.START_MIRROR), S.MIRRORING),
    (S.WAITING, E.LIVE_MOVED): Transition((A.WITHDRAW, A.START_MIRROR), S.MIRRORING),
    (S.WAITING, E.NO_LIVE): Transition((), S.WAITING),
    (S.WAITING, E.LOST): Transition((), S.WAITING),
    (S.MIRRORING, E.SYNCED): Transition((A.CANDIDATE,), S.SYNCED),
    (S.MIRRORING, E.UNSYNCED): Transition((), S.MIRRORING),
    (S.MIRRORING, E.STANDBY): Transition((), S.MIRRORING),
    (S.MIRRORING, E.NO_LIVE): Transition((), S.MIRRORING),
    (S.MIRRORING, E.LOST): Transition((), S.MIRRORING),
    (S.MIRRORING, E.LIVE_MOVED): Transition((A.STOP_MIRROR, A.START_MIRROR), S.MIRRORING),
    (S.SYNCED, E.UNSYNCED): Transition((A.WITHDRAW,), S.MIRRORING),
    (S.SYNCED, E.LIVE): Transition((A.STOP_MIRROR, A.SERVE), S.LIVE),
    (S.SYNCED, E.STANDBY): Transition((), S.SYNCED),
    (S.SYNCED, E.NO_LIVE): Transition((), S.SYNCED),
    (S.SYNCED, E.LOST): Transition((), S.SYNCED),
    (S.SYNCED, E.SYNCED): Transition((A.CANDIDATE,), S.SYNCED),
    (
        S.SYNCED,
        E.LIVE_MOVED,
    ): Transition((A.WITHDRAW, A.STOP_MIRROR, A.START_MIRROR), S.MIRRORING),
    (S.LIVE, E.LOST): Transition((A.STOP_SERVING,), S.STOPPING),
    # another process live while this one believes it serves: its lease is gone
    (S.LIVE, E.STANDBY): Transition((A.STOP_SERVING,), S.STOPPING),
    (S.LIVE, E.LIVE_MOVED): Transition((A.STOP_SERVING,), S.STOPPING),
    (S.LIVE, E.NO_LIVE): Transition((A.STOP_SERVING,), S.STOPPING),
    (S.LIVE, E.LIVE): Transition((), S.LIVE),
    # requeued, not only a candidate: a member that stopped while ZooKeeper still
    # names its znode live (a LOST it reported to itself, a same-session reconnect)
    # must let the lease evaluate again, and its copy may be of a later epoch
    (S.STOPPING, E.STOPPED): Transition((A.REQUEUE,), S.WAITING),
    # the lease took over again while the broker is stopping (the session survived a
    # SUSPENDED): it stops all the same; REQUEUE then claims that epoch
    (S.STOPPING, E.LIVE): Transition((), S.STOPPING),
    # the broker stopped on its own while live (a store failure): the lease goes
    (S.LIVE, E.STOPPED): Transition((A.WITHDRAW,), S.WAITING),
    (S.STOPPING, E.LOST): Transition((), S.STOPPING),
    (S.STOPPING, E.STANDBY): Transition((), S.STOPPING),
    (S.STOPPING, E.LIVE_MOVED): Transition((), S.STOPPING),
    (S.STOPPING, E.NO_LIVE): Transition((), S.STOPPING),
    # fail back: hand the node id to the member in sync ahead, once stopped cleanly
    (S.LIVE, E.HAND_OVER): Transition((A.HAND_OVER,), S.HANDING_OVER),
    (S.HANDING_OVER, E.STOPPED): Transition((A.REQUEUE,), S.WAITING),
    (S.HANDING_OVER, E.LIVE): Transition((), S.HANDING_OVER),
    (S.HANDING_OVER, E.HAND_OVER): Transition((), S.HANDING_OVER),
    # the lease went meanwhile: stop at once, as when live
    (S.HANDING_OVER, E.LOST): Transition((A.STOP_SERVING,), S.STOPPING),
    (S.HANDING_OVER, E.STANDBY): Transition((A.STOP_SERVING,), S.STOPPING),
    (S.HANDING_OVER, E.LIVE_MOVED): Transition((A.STOP_SERVING,), S.STOPPING),
    (S.HANDING_OVER, E.NO_LIVE): Transition((A.STOP_SERVING,), S.STOPPING),
}


class IllegalRoleTransition(LocalError):
    """An event the table has no entry for in the current state."""

    def __init__(self, state: State, event: Event) -> None:
        super().__init__(f"HA role: event {event.value!r} is not expected in state {state.value!r}")
        self.state = state
        self.event = event


def step(state: State, event: Event) -> Transition:
    """The actions and the next state for `event` in `state`."""
    try:
        return TRANSITIONS[state, event]
    except KeyError:
        raise IllegalRoleTransition(state, event) from None
