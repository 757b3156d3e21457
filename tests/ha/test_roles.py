"""The pair member's role machine (`amqbroker.ha.roles`): the sequences a primary and a
backup go through, and the invariants the table promises."""

from __future__ import annotations

import pytest

from amqbroker.ha.roles import TRANSITIONS, Action, Event, IllegalRoleTransition, State, step

A, E, S = Action, Event, State


def run(state: State, *events: Event) -> tuple[State, list[Action]]:
    done: list[Action] = []
    for ev in events:
        t = step(state, ev)
        done.extend(t.actions)
        state = t.next
    return state, done


def test_backup_mirrors_then_takes_over() -> None:
    state, actions = run(S.WAITING, E.STANDBY, E.SYNCED, E.NO_LIVE, E.LIVE)
    assert state is S.LIVE
    assert actions == [A.WITHDRAW, A.START_MIRROR, A.CANDIDATE, A.STOP_MIRROR, A.SERVE]


def test_primary_that_loses_its_lease_stops_before_it_is_a_candidate_again() -> None:
    state, actions = run(S.WAITING, E.LIVE, E.LOST, E.STANDBY, E.STOPPED)
    assert state is S.WAITING
    assert actions == [A.SERVE, A.STOP_SERVING, A.REQUEUE]
    # someone else is live now: the old primary becomes the backup and resyncs
    state, actions = run(state, E.STANDBY)
    assert (state, actions) == (S.MIRRORING, [A.WITHDRAW, A.START_MIRROR])


def test_a_copy_that_falls_out_of_sync_is_no_candidate() -> None:
    state, actions = run(S.MIRRORING, E.SYNCED, E.UNSYNCED)
    assert (state, actions) == (S.MIRRORING, [A.CANDIDATE, A.WITHDRAW])
    with pytest.raises(IllegalRoleTransition, match="'live' is not expected in state 'mirroring'"):
        step(state, E.LIVE)


def test_a_live_that_sees_another_live_stops_serving() -> None:
    for ev in (E.STANDBY, E.LIVE_MOVED, E.NO_LIVE, E.LOST):
        assert step(S.LIVE, ev) == ((A.STOP_SERVING,), S.STOPPING)


def test_fail_back_hands_over_then_mirrors_the_primary() -> None:
    state, actions = run(S.LIVE, E.HAND_OVER, E.LIVE, E.HAND_OVER, E.STOPPED)
    assert (state, actions) == (S.WAITING, [A.HAND_OVER, A.REQUEUE])
    # the primary took over: this member becomes its backup
    state, actions = run(state, E.NO_LIVE, E.STANDBY)
    assert (state, actions) == (S.MIRRORING, [A.WITHDRAW, A.START_MIRROR])


def test_a_hand_over_that_loses_the_lease_stops_at_once() -> None:
    state, actions = run(S.LIVE, E.HAND_OVER, E.LOST, E.STOPPED)
    assert (state, actions) == (S.WAITING, [A.HAND_OVER, A.STOP_SERVING, A.REQUEUE])


def test_a_lease_taken_again_while_stopping_is_no_crash() -> None:
    # a SUSPENDED session that survived: the lease takes the next epoch while the
    # broker still stops; once stopped it is requeued (with that epoch's claim)
    state, actions = run(S.LIVE, E.LOST, E.LIVE, E.STOPPED)
    assert (state, actions) == (S.WAITING, [A.STOP_SERVING, A.REQUEUE])


@pytest.mark.parametrize("key", sorted(TRANSITIONS, key=lambda k: (k[0].value, k[1].value)))
def test_table_invariants(key: tuple[State, Event]) -> None:
    state, event = key
    t = TRANSITIONS[key]
    acts = list(t.actions)
    if A.SERVE in acts:
        assert event is E.LIVE
        assert A.START_MIRROR not in acts[acts.index(A.SERVE) :]
        if state is not S.WAITING:
            assert acts.index(A.STOP_MIRROR) < acts.index(A.SERVE)
    if A.START_MIRROR in acts:
        assert A.WITHDRAW in acts or state is S.MIRRORING
    if A.CANDIDATE in acts:
        assert state is not S.LIVE and t.next is not S.LIVE
    if state is S.LIVE and event not in (E.LIVE, E.STOPPED, E.HAND_OVER):
        assert acts[0] is A.STOP_SERVING
    if state is S.HANDING_OVER and event in (E.LOST, E.STANDBY, E.LIVE_MOVED, E.NO_LIVE):
        assert acts[0] is A.STOP_SERVING
    if A.REQUEUE in acts:
        # the live znode goes only once the broker stopped
        assert event is E.STOPPED and state in (S.HANDING_OVER, S.STOPPING)
    if A.HAND_OVER in acts:
        assert (state, event) == (S.LIVE, E.HAND_OVER)
