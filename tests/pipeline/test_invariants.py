"""The plain-Python invariant checks on crafted logs: a clean log has no finding; each
injected fault is found, exactly where it was injected, and nothing else is."""

from __future__ import annotations

import pytest

from amqbroker.pipeline.invariants import check
from tests.pipeline import logs as L


@pytest.fixture(scope="module")
def clean() -> list[dict]:
    return L.clean_log(n_messages=300, n_groups=6, n_consumers=3, seed=3)


def only(findings, name: str, also: tuple[str, ...] = ()) -> None:
    counts = findings.counts()
    others = {k: v for k, v in counts.items() if k not in (name, "unrouted", *also) and v}
    assert not others, f"unexpected findings besides {name}: {others}"
    assert counts[name] >= 1


def test_clean_log_has_no_finding(clean):
    f = check(clean)
    assert f.ok
    assert f.counts() == {
        "lost": 0,
        "duplicate_after_settle": 0,
        "received_twice": 0,
        "order_violations": 0,
        "producer_order": 0,
        "producer_order_across_entry_nodes": 0,
        "two_owners": 0,
        "unrouted": 1,
        "still_queued": 0,
        "moves": 0,
        "late": 0,
        "seq_gaps": 0,
    }
    # the rolled-back transactional send is informational, never a loss
    assert f.unrouted == [("n1", "orders", "tx-rolled-back")]
    # the generator does exercise what must not be flagged
    events = {(r["event"], r["outcome"]) for r in clean}
    assert {("expired", None), ("dead_lettered", None), ("settled", "released")} <= events
    assert (
        len(
            {
                (r["group_id"], r["consumer"])
                for r in clean
                if r["event"] == "dispatched" and r["group_id"] == "g0"
            }
        )
        > 1
    ), "no owner change in the clean log"


@pytest.mark.parametrize("seed", range(4))
def test_lost_message(clean, seed):
    bad, mid = L.inject_lost(clean, seed=seed)
    f = check(bad)
    only(f, "lost")
    assert f.lost == [("n1", "orders", mid)]
    assert not f.ok


@pytest.mark.parametrize("seed", range(4))
def test_dispatched_after_accept(clean, seed):
    bad, mid = L.inject_duplicate_dispatch(clean, seed=seed)
    f = check(bad)
    only(f, "duplicate_after_settle")
    assert f.duplicate_after_settle == [("n1", "orders", mid)]


@pytest.mark.parametrize("seed", range(4))
def test_received_twice(clean, seed):
    bad, mid = L.inject_received_twice(clean, seed=seed)
    f = check(bad)
    only(f, "received_twice")
    assert f.received_twice == [(mid, 2)]


def test_forwarded_message_may_be_received_again(clean):
    """A forwarded message is received again on the next node: not a duplicate."""
    mid = "m5"
    first = next(r for r in clean if r["message_id"] == mid and r["event"] == "received")
    fwd = dict(first, event="forwarded", queue="n2/orders")
    later = max(r["ts_us"] for r in clean) + 1000
    again = dict(first, node="n2", seq=1, ts_us=later)
    routed = dict(again, seq=2, event="routed")
    dispatched = dict(again, seq=3, event="dispatched", consumer="x/1")
    settled = dict(again, seq=4, event="settled", consumer="x/1", outcome="accepted")
    f = check([*L._keep_order([*clean, fwd]), again, routed, dispatched, settled])
    assert f.ok, f.counts()
    assert not f.received_twice and not f.unrouted[1:]


@pytest.mark.parametrize("seed", range(4))
def test_out_of_order_group(clean, seed):
    bad, (gid, mid) = L.inject_out_of_order(clean, seed=seed)
    f = check(bad)
    only(f, "order_violations", also=("producer_order", "producer_order_across_entry_nodes"))
    assert f.order_violations == [("n1", "orders", gid, mid)]
    # the same swap is a producer-order violation when both came from one producer
    (early,) = [r for r in bad if r["message_id"] == mid and r["event"] == "received"]
    overtaken = [x for x in f.producer_order if x[5] == mid]
    assert [x[:4] for x in overtaken] == [("orders", gid, f"n1/{early['producer']}", 0)] * len(
        overtaken
    )
    assert len(f.producer_order) == len(overtaken)
    # on one node, with group-sequences, the check across entry nodes finds the same
    across = f.producer_order_across_entry_nodes
    assert sorted((q, g, m, later) for q, g, _, _, m, later in f.producer_order) == sorted(
        (q, g, m, later) for q, g, _, m, later in across
    )
    assert {p for _, _, p, *_ in across} <= {f"container-{early['producer']}"}


@pytest.mark.parametrize("seed", range(4))
def test_two_owners(clean, seed):
    bad, (gid, consumer) = L.inject_two_owners(clean, seed=seed)
    f = check(bad)
    only(f, "two_owners", also=("two_owner_moments",))
    assert {(q, g) for q, g, *_ in f.two_owners} == {("orders", gid)}
    assert consumer in {c for *_, c in f.two_owner_moments}
    assert sum(n for *_, n in f.two_owners) == len(f.two_owner_moments)


def test_owner_epoch_orders_events_across_nodes(clean):
    """An owner change between nodes bumps the epoch: the new owner's dispatch is
    after the old owner's settle even when the new node's clock is behind."""
    base = L.T0_US
    rec = lambda node, seq, ts, ev, c, epoch, mid, outcome=None: {  # noqa: E731
        "node": node,
        "seq": seq,
        "ts_us": ts,
        "event": ev,
        "queue": "q",
        "message_id": mid,
        "group_id": "g",
        "group_seq": None,
        "producer": None,
        "consumer": c,
        "outcome": outcome,
        "owner_epoch": epoch,
        "delivery_count": 0,
    }
    log = [
        rec("a", 1, base + 100, "routed", None, 1, "m1"),
        rec("a", 2, base + 200, "dispatched", "A/1", 1, "m1"),
        rec("a", 3, base + 900, "settled", "A/1", 1, "m1", "accepted"),
        # node b's clock is 500 µs behind: by ts_us this looks like an overlap
        rec("b", 1, base + 400, "routed", None, 2, "m2"),
        rec("b", 2, base + 500, "dispatched", "B/1", 2, "m2"),
        rec("b", 3, base + 600, "settled", "B/1", 2, "m2", "accepted"),
    ]
    assert check(log).ok
    # the same dispatch in the old epoch, while A still holds m1: two owners
    log[4] = dict(log[4], owner_epoch=1)
    f = check(log)
    assert f.two_owner_moments == [("q", "g", "b", 2, "B/1")]
    assert f.two_owners == [("q", "g", "b", 2, "B/1", 1)]


def test_grace_keeps_in_flight_messages_out_of_lost(clean):
    tail = max(r["seq"] for r in clean) + 1
    ts = max(r["ts_us"] for r in clean) + 10
    new = {**clean[0], "seq": tail, "ts_us": ts, "event": "routed", "message_id": "new"}
    # never dispatched, nothing of its group after it: still queued, not lost
    assert check([*clean, new]).still_queued == [("n1", "orders", "new")]
    assert check([*clean, new], grace_us=1_000).still_queued == []
    # dispatched and never settled: lost, unless it arrived within the grace
    disp = {**new, "seq": tail + 1, "event": "dispatched", "consumer": "c0/recv"}
    assert check([*clean, new, disp]).lost == [("n1", "orders", "new")]
    assert check([*clean, new, disp], grace_us=1_000).lost == []


def test_a_delivery_ends_with_the_boot_of_its_node():
    """node3 delivers m1 of group g to c1 and dies before the outcome; its next boot
    delivers m1 again, to another consumer, and then m2: one owner at a time. Without
    the ``started`` marker of the new boot the first delivery would still be open."""

    def rec(seq: int, ts: int, event: str, mid: str | None, **kw: object) -> dict:
        r = L._rec("n3", event, "orders" if mid else None, mid or "", "g" if mid else None, 1)
        r.update(seq=seq, ts_us=L.T0_US + ts, message_id=mid, **kw)
        return r

    log = [
        rec(1, 0, "started", None),
        rec(2, 1, "routed", "m1"),
        rec(3, 2, "dispatched", "m1", consumer="c1/recv"),
        rec(4, 10, "started", None),
        rec(5, 11, "dispatched", "m1", consumer="c2/recv"),
        rec(6, 12, "settled", "m1", consumer="c2/recv", outcome="accepted"),
        rec(7, 13, "routed", "m2"),
        rec(8, 14, "dispatched", "m2", consumer="c2/recv"),
        rec(9, 15, "settled", "m2", consumer="c2/recv", outcome="accepted"),
    ]
    for r in log:
        if r["event"] == "started":
            r.update(group_id=None, group_seq=None, queue=None)
    assert check(log).two_owners == []
    no_restart = [r for r in log if not (r["event"] == "started" and r["seq"] == 4)]
    assert len(check(no_restart).two_owners) == 1


def test_seq_gaps_are_counted_within_a_pair_members_life(clean):
    """A pair member live at HA epoch E numbers its records from E << SEQ_LIFE_SHIFT
    (issue 23): the jump between the members' logs of one node id is no gap, a record
    missing within a life is."""
    from amqbroker.pipeline.delivery_log_format import SEQ_LIFE_SHIFT, seq_floor

    node = clean[0]["node"]
    mine = sorted((r for r in clean if r["node"] == node), key=lambda r: r["seq"])
    half = mine[len(mine) // 2]["seq"]
    moved = [
        dict(r, seq=r["seq"] - half + seq_floor(3)) if r["node"] == node and r["seq"] >= half else r
        for r in clean
    ]
    assert seq_floor(0) == 0 and seq_floor(3) == 3 << SEQ_LIFE_SHIFT
    assert check(moved).counts()["seq_gaps"] == 0
    dropped = [r for r in moved if not (r["node"] == node and r["seq"] == seq_floor(3) + 5)]
    assert check(dropped).counts()["seq_gaps"] == 1
