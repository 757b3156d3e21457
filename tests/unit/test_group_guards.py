"""Promises of the group dispatcher that hand-made mutations of the grouping core
showed unguarded (issue 21, item 6), and plain unit tests for behaviour that was only
covered by one integration test or by Hypothesis's random search.

Each test here was seen to fail on a mutation of `amqbroker/core` (named in its
docstring) before it was committed. They drive the public `Queue` API through
`core_harness`, like test_queue.py; section numbers refer to GROUPING.md.

Bucket numbers are not computed with the broker's own hash: they were computed with
Java (JDK 17), reproducing Artemis's `BucketMessageGroups.getBucket` and
`SimpleString.hashCode` (each UTF-16 code unit stored as low byte then high byte, the
bytes summed as Java's signed `byte`, h = 31*h + b in 32-bit arithmetic, bucket =
(h & Integer.MAX_VALUE) % N; an `_AMQ_GROUP_BUCKET_INT_KEY_<n>` key uses
`Integer.parseInt(n).hashCode()`, i.e. n itself, under the same mask).
"""

from __future__ import annotations

import pytest

from amqbroker.core.entry import Entry
from amqbroker.core.queue import QueuePolicy
from amqbroker.core.transaction import ACCEPT, RELEASE, Transactions
from tests.unit.core_harness import FakeConsumer, Harness, label

FIRST = "JMSXGroupFirstForConsumer"
BUCKET_KEY = "_AMQ_GROUP_BUCKET_INT_KEY_"


def bucket_names(h: Harness) -> dict[str, str]:
    """Bound buckets as management lists them: key name -> owner."""
    return {g["group"]: g["consumer"] for g in h.queue.list_groups()}


# ------------------------------------------------ group close from the backlog (3.6)


def test_close_dispatched_from_the_backlog_unbinds_and_next_message_binds_afresh() -> None:
    """3.6 steps 2-3 when the close is not the head of an idle queue but waits in the
    main order (here: no consumer had credit when it arrived). Delivering it ends the
    binding; the next message of the group is bound afresh, with the first flag.

    Mutation: drop the `_unbind` after delivering a closing message in the dispatch
    pass (`Queue._dispatch_main`); G stays bound to c1, so G4 waits for c1 unflagged."""
    h = Harness(QueuePolicy(group_first_key=FIRST))
    c1 = h.attach("c1")
    c2 = h.attach("c2")
    h.send("G")
    h.send("G")
    h.send("G", -1)
    h.send("G")
    h.send("G")
    assert c1.labels == c2.labels == []  # all five wait in the main order
    h.credit(c1, 3)
    assert c1.labels == ["G1", "G2", "G3"]
    assert c1.firsts == ["G1"]
    # the close ended the binding: G4 has no owner yet (nobody has credit)
    assert h.queue.group_count() == 0
    assert bucket_names(h) == {}
    h.credit(c2, 10)
    assert c2.labels == ["G4", "G5"]
    assert c2.firsts == ["G4"]
    assert c1.labels == ["G1", "G2", "G3"]
    assert bucket_names(h) == {"G": "c2"}


def test_close_dispatched_from_the_backlog_with_buckets_releases_the_bucket() -> None:
    """Same path with group-buckets: the close of one group releases its whole bucket,
    so another group of that bucket binds afresh (flagged) to the next consumer.
    Buckets (Java): groupA and id1 are both in bucket 2 of 4.

    Mutation: as above (no `_unbind` after a close in `_dispatch_main`)."""
    h = Harness(QueuePolicy(group_buckets=4, group_first_key=FIRST))
    c1 = h.attach("c1")
    c2 = h.attach("c2")
    h.send("groupA")
    h.send("groupA", -1)
    h.send("id1")
    h.credit(c1, 2)
    assert c1.labels == ["groupA1", "groupA2"]
    assert h.queue.group_count() == 0
    h.credit(c2, 1)
    assert (c2.labels, c2.firsts) == (["id11"], ["id11"])
    assert bucket_names(h) == {BUCKET_KEY + "2": "c2"}


# ------------------------------------------- redelivered close of an unbound group


def test_redelivered_close_of_an_unbound_group_neither_binds_nor_flags() -> None:
    """3.6 step 4 for a returned close: a closing message that comes back (released)
    while its group is unbound goes to the normal choice without binding the group and
    without the first flag; the next message of the group then binds, flagged.

    Mutation: in the dispatch pass treat only a fresh close (`group_seq == -1`) as a
    close, not a spent one (`SPENT_CLOSE`); the redelivered close then binds G to c2
    with the first flag, and G2 follows it there unflagged."""
    h = Harness(QueuePolicy(group_first_key=FIRST))
    c1 = h.attach("c1", 10)
    c2 = h.attach("c2", 10)
    h.send("G", -1)  # unbound: c1 by round robin, no binding, no flag
    assert (c1.labels, c1.firsts, h.queue.group_count()) == (["G1"], [], 0)
    h.release(c1, "G1")  # back to the main order; round robin now points at c2
    assert (c2.labels, c2.firsts) == (["G1"], [])
    assert h.queue.group_count() == 0
    h.send("G")  # binds afresh by round robin (c1), flagged
    assert (c1.labels, c1.firsts) == (["G1", "G2"], ["G2"])
    assert bucket_names(h) == {"G": "c1"}


def test_redelivered_close_after_its_close_took_effect_neither_binds_nor_flags() -> None:
    """The close was delivered to the owner (ending the binding), then released: the
    group is unbound, so the returned close must not bind it again.

    Mutation: as above (`gs == -1` instead of `gs in (-1, SPENT_CLOSE)`)."""
    h = Harness(QueuePolicy(group_first_key=FIRST))
    c1 = h.attach("c1", 10)
    c2 = h.attach("c2", 0)
    h.send("G")
    h.send("G", -1)
    assert (c1.labels, h.queue.group_count()) == (["G1", "G2"], 0)
    h.credit(c1, 0)
    h.credit(c2, 10)
    h.release(c1, "G2")  # only c2 has credit
    assert (c2.labels, c2.firsts) == (["G2"], [])
    assert h.queue.group_count() == 0
    h.send("G")  # round robin after c2 -> c1 busy -> c2; a new binding, flagged
    assert (c2.labels, c2.firsts) == (["G2", "G3"], ["G3"])
    assert bucket_names(h) == {"G": "c2"}


# -------------------------------------- bucket hashing of non-ASCII group ids (3.2)

# (group id, {N: bucket}) computed with Java as described in the module docstring.
# The ids contain UTF-16 code units whose low or high byte is >= 0x80 (negative as a
# Java byte), code units above 0xFF (UTF-8 and UTF-16 differ) and a surrogate pair.
NON_ASCII = [
    ("é", -713, {3: 0, 5: 0, 7: 3, 1024: 311}),  # U+00E9: bytes E9 00
    ("ÿ", -31, {3: 1, 5: 2, 7: 6, 1024: 993}),  # U+00FF: bytes FF 00
    ("€", -2572, {3: 1, 5: 1, 7: 6, 1024: 500}),  # U+20AC: bytes AC 20
    ("組", 2233, {3: 1, 5: 3, 7: 0, 1024: 185}),  # U+7D44: bytes 44 7D
    ("😀", 1778777, {3: 2, 5: 2, 7: 0, 1024: 89}),  # D83D DE00: 3D D8 00 DE
    ("Grüße", -71170969, {3: 1, 5: 4, 7: 0, 1024: 103}),
    ("groupé", -1280686806, {3: 2, 5: 2, 7: 2, 1024: 298}),
    ("Zürich", -655474492, {3: 1, 5: 1, 7: 1, 1024: 196}),
]


@pytest.mark.parametrize(("gid", "java_hash", "buckets"), NON_ASCII)
def test_bucket_of_non_ascii_group_ids_matches_artemis(
    gid: str, java_hash: int, buckets: dict[int, int]
) -> None:
    """A message of group `gid` binds the same bucket as on Artemis.

    Mutations: hash the bytes unsigned (`b` instead of `b - 256 if b > 127`), or hash
    the UTF-8 encoding instead of UTF-16LE (`groups.artemis_hash`): other buckets."""
    for n, expected in buckets.items():
        h = Harness(QueuePolicy(group_buckets=n))
        c = h.attach("c", 10)
        h.send(gid)
        assert c.labels == [f"{gid}1"]
        assert bucket_names(h) == {f"{BUCKET_KEY}{expected}": "c"}, (gid, java_hash, n)


def test_non_ascii_ids_in_one_bucket_share_the_owner() -> None:
    """Buckets (Java, N=7): "ÿ" and "€" share bucket 6, "組" and "😀" share bucket 0,
    "é" is in bucket 3. Sharing a bucket means sharing the owner and the first flag
    (3.2 consequences).

    Mutation: unsigned bytes in `artemis_hash` put "😀" in bucket 5 and "é" in 6: the
    owners differ from the ones below."""
    h = Harness(QueuePolicy(group_buckets=7, group_first_key=FIRST))
    c1, c2, c3 = (h.attach(n, 10) for n in ("c1", "c2", "c3"))
    h.send("ÿ")  # bucket 6 -> c1
    h.send("組")  # bucket 0 -> c2
    h.send("€")  # bucket 6: c1's already, not flagged
    h.send("😀")  # bucket 0: c2's already, not flagged
    h.send("é")  # bucket 3 -> c3
    assert (c1.labels, c1.firsts) == (["ÿ1", "€1"], ["ÿ1"])
    assert (c2.labels, c2.firsts) == (["組1", "😀1"], ["組1"])
    assert (c3.labels, c3.firsts) == (["é1"], ["é1"])
    assert bucket_names(h) == {
        BUCKET_KEY + "6": "c1",
        BUCKET_KEY + "0": "c2",
        BUCKET_KEY + "3": "c3",
    }


# ----------------------------------------- bucket number keys with a negative number

# (n, {N: bucket}) = (n & 0x7FFFFFFF) % N, computed with Java (Integer.hashCode is n)
NEGATIVE_KEYS = [
    (-1, {3: 1, 5: 2, 7: 1}),
    (-2, {3: 0, 5: 1, 7: 0}),
    (-7, {3: 1, 5: 1, 7: 2}),
    (-2147483648, {3: 0, 5: 0, 7: 0}),
]


@pytest.mark.parametrize(("n", "buckets"), NEGATIVE_KEYS)
def test_negative_bucket_number_key_names_the_masked_bucket(
    n: int, buckets: dict[int, int]
) -> None:
    """`_AMQ_GROUP_BUCKET_INT_KEY_<n>` with a negative n addresses bucket
    (n & 0x7FFFFFFF) % N, as a message group id and as a management key (3.2).

    Mutation: drop the `& 0x7FFFFFFF` for number keys in `groups.bucket_of`
    (Python's % of a negative number gives another, non-negative, bucket)."""
    for size, expected in buckets.items():
        h = Harness(QueuePolicy(group_buckets=size))
        c1 = h.attach("c1", 10)
        c2 = h.attach("c2", 10)
        h.send(f"{BUCKET_KEY}{n}", tag="k1")  # c1 owns the masked bucket
        assert bucket_names(h) == {f"{BUCKET_KEY}{expected}": "c1"}, (n, size)
        h.send(f"{BUCKET_KEY}{expected}", tag="k2")  # the same bucket: c1 again
        assert (c1.labels, c2.labels) == (["k1", "k2"], [])
        # management resets exactly that bucket by the negative key
        assert h.queue.reset_group(f"{BUCKET_KEY}{n}")
        assert h.queue.group_count() == 0


def test_negative_bucket_key_reset_leaves_other_buckets_bound() -> None:
    """With 3 buckets, key -1 is bucket 1 (Java); Python's unmasked -1 % 3 would be 2.

    Mutation: no `& 0x7FFFFFFF` for number keys: the reset hits bucket 2 instead."""
    h = Harness(QueuePolicy(group_buckets=3))
    c1, c2 = h.attach("c1", 10), h.attach("c2", 10)
    h.send(f"{BUCKET_KEY}1", tag="b1")  # bucket 1 -> c1
    h.send(f"{BUCKET_KEY}2", tag="b2")  # bucket 2 -> c2
    assert bucket_names(h) == {BUCKET_KEY + "1": "c1", BUCKET_KEY + "2": "c2"}
    assert h.queue.reset_group(f"{BUCKET_KEY}-1")
    assert bucket_names(h) == {BUCKET_KEY + "2": "c2"}
    assert (c1.labels, c2.labels) == (["b1"], ["b2"])


# ------------------------------------------- a released message returns to its place


def test_released_ungrouped_message_returns_to_its_original_position() -> None:
    """3.9: `released` puts the message back at its original queue position (by its
    enqueue sequence within its priority), not at the tail; several released in any
    order come back in their original order.

    Mutation: `Queue.release` appends to the tail of the main order instead of
    inserting at the message's position."""
    h = Harness()
    c = h.attach("c", 3)
    h.send_many(None, None, None, None, None)
    assert c.labels == ["u1", "u2", "u3"]
    h.release(c, "u3")
    h.release(c, "u1")
    assert [label(e) for e in h.queue.browse()] == ["u1", "u3", "u4", "u5"]
    c.take()
    h.credit(c, 10)
    assert c.take() == ["u1", "u3", "u4", "u5"]
    assert [e.delivery_count for e in c.unsettled] == [0, 0, 0, 0, 0]  # u2..u5, u1, u3


def test_released_message_returns_before_newer_ones_of_its_priority_only() -> None:
    """Within its own priority level: a released priority-4 message goes back ahead of
    newer priority-4 messages, but behind queued higher-priority ones."""
    h = Harness()
    c = h.attach("c", 1)
    h.send(None, tag="a")
    h.send(None, tag="b")
    h.send(None, tag="hi", priority=9)
    assert c.take() == ["a"]
    h.release(c, "a")
    h.credit(c, 10)
    assert c.take() == ["hi", "a", "b"]


def test_released_grouped_message_returns_among_its_groups_parked_messages() -> None:
    """A released message of a group that has parked messages (owner busy) goes back
    into the parked messages at its original position, ahead of newer ones.

    Mutation: `_insert_parked` appends instead of inserting by sequence."""
    h = Harness()
    c1 = h.attach("c1", 2)
    c2 = h.attach("c2", 10)
    h.send_many("G", "G", "G", "G")  # G1, G2 -> c1; G3, G4 parked for c1
    assert (c1.labels, c2.labels) == (["G1", "G2"], [])
    h.release(c1, "G2")
    h.release(c1, "G1")
    c1.take()
    h.credit(c1, 10)
    assert c1.take() == ["G1", "G2", "G3", "G4"]
    assert c2.labels == []


# ------------------------------------------------ transaction rollback (3.9, D13)


def hold(c: FakeConsumer, lbl: str) -> Entry:
    """The link hands a transactional disposition to the transaction: the delivery is
    no longer the consumer's to settle (it stays in flight for the queue)."""
    e = next(x for x in c.unsettled if label(x) == lbl)
    del c.unsettled[e]
    return e


def test_rollback_returns_messages_to_the_owner_with_delivery_count_plus_one() -> None:
    """Rollback of transactional acks: the messages go back to their positions for the
    same owner, delivery-count + 1 each time (JMS redelivered), no first flag again.

    Mutation: `Transaction.rollback` returns them with `delivery_failed=False`."""
    h = Harness(QueuePolicy(group_first_key=FIRST))
    c1 = h.attach("c1", 2)
    c2 = h.attach("c2", 10)
    h.send_many("G", "G", "G")  # G1, G2 -> c1; G3 parked for c1
    txs = Transactions(limit=100)
    t = txs.declare()
    held = [hold(c1, "G1"), hold(c1, "G2")]
    for e in held:
        t.add_ack(h.queue, c1, e, ACCEPT)
    assert h.queue.inflight == 2  # held by the transaction, still in flight
    t.rollback(h.broker)
    assert [e.delivery_count for e in held] == [1, 1]
    assert h.queue.inflight == 0
    c1.take()
    h.credit(c1, 3)
    assert [(d.label, d.first) for d in c1.deliveries] == [
        ("G1", False),
        ("G2", False),
        ("G3", False),
    ]
    assert c2.labels == []
    # a second transaction rolled back counts again
    t2 = txs.declare()
    e1 = hold(c1, "G1")
    t2.add_ack(h.queue, c1, e1, ACCEPT)
    t2.rollback(h.broker)
    assert e1.delivery_count == 2
    t2.rollback(h.broker)  # a transaction is applied at most once
    assert e1.delivery_count == 2


def test_rollback_counts_towards_max_delivery_attempts() -> None:
    h = Harness(QueuePolicy(max_delivery_attempts=2))
    c = h.attach("c", 10)
    h.send("G")
    txs = Transactions(limit=100)
    for attempt in (1, 2):
        t = txs.declare()
        e = hold(c, "G1")
        t.add_ack(h.queue, c, e, ACCEPT)
        t.rollback(h.broker)
        assert e.delivery_count == attempt
    assert [(q, label(e)) for q, e, _ in h.broker.dead] == [("q", "G1")]
    h.assert_empty()


def test_rollback_after_the_consumer_detached_counts_once() -> None:
    """The consumer detached (connection lost) while the transaction held its ack: the
    held message was not among its unsettled ones, so only the rollback counts it. The
    held message is still in flight, which keeps dispatch off for the next consumer
    (3.12: the gate opens only with nothing in flight), so the rollback puts it back
    first and the new owner receives the group in order."""
    h = Harness(QueuePolicy(group_first_key=FIRST))
    c1 = h.attach("c1", 10)
    h.send_many("G", "G")
    t = Transactions(limit=100).declare()
    e1 = hold(c1, "G1")
    t.add_ack(h.queue, c1, e1, ACCEPT)
    h.detach(c1)  # G2 returns counted (failed), G is released
    c2 = h.attach("c2", 10)
    assert c2.labels == []
    t.rollback(h.broker)
    assert e1.delivery_count == 1
    assert [(d.label, d.first) for d in c2.deliveries] == [("G1", True), ("G2", False)]
    assert [e.delivery_count for e in c2.unsettled] == [1, 1]
    assert h.queue.inflight == 2


def test_committed_release_does_not_count_a_delivery() -> None:
    """The contrast: a `released` outcome committed in a transaction returns the
    message uncounted (only rollback and delivery-failed count)."""
    h = Harness()
    c = h.attach("c", 10)
    h.send("G")
    t = Transactions(limit=100).declare()
    e = hold(c, "G1")
    t.add_ack(h.queue, c, e, RELEASE)
    t.commit(h.broker)
    assert e.delivery_count == 0
    assert c.labels == ["G1", "G1"]


# -------------------------------------------------- a close on an exclusive queue


def test_exclusive_queue_ignores_a_close_from_the_backlog_and_from_parked() -> None:
    """3.11: group ids (and so closes) are ignored on an exclusive queue, also when
    the close is delivered from the main order or from the exclusive consumer's parked
    messages (test_queue covers only the idle-queue path).

    Mutations: drop `key is not EXCLUSIVE` from the close check in `_dispatch_main` or
    `g.key is not EXCLUSIVE` in `_serve`: the exclusive role then moves to c2."""
    h = Harness(QueuePolicy(exclusive=True, group_first_key=FIRST))
    c1 = h.attach("c1")
    c2 = h.attach("c2")
    h.send("G")
    h.send("G", -1)
    h.send(None)
    h.credit(c1, 2)  # from the main order: G1 binds c1 exclusive, the close goes to c1
    assert (c1.labels, c1.firsts) == (["G1", "G2"], ["G1"])
    h.credit(c2, 10)  # the rest waits for c1, parked
    assert c2.labels == []
    h.send("H", -1)
    h.send(None)
    h.credit(c1, 1)  # from parked: u1
    h.credit(c1, 1)  # H1 (a close, ignored)
    assert c1.labels == ["G1", "G2", "u1", "H1"]
    h.credit(c1, 10)
    assert c1.labels == ["G1", "G2", "u1", "H1", "u2"]
    assert c2.labels == []
    assert c1.firsts == ["G1"]


# ------------------------------------ parked messages go before newer ones on credit


def test_parked_messages_are_served_before_newer_ones_when_credit_returns() -> None:
    """3.5.1 / D4: messages parked for a busy owner are older than anything still in
    the main order, so when the owner gets credit back it receives them first, then
    newer messages (ungrouped ones, new groups).

    Mutation: `Queue.credit_changed` runs the dispatch pass before serving the
    consumer's parked groups."""
    h = Harness()
    c1 = h.attach("c1", 1)
    c2 = h.attach("c2", 1)
    h.send("G")  # binds c1, which is now out of credit
    h.send("G")  # G2, G3 parked for c1 (c2 has credit, so a pass runs)
    h.send("G")
    assert (c1.labels, c2.labels) == (["G1"], [])
    h.credit(c2, 0)
    h.send(None)  # u1, H1: newer, waiting in the main order
    h.send("H")
    h.credit(c1, 3)
    assert c1.labels == ["G1", "G2", "G3", "u1"]
    h.credit(c1, 10)
    assert c1.labels == ["G1", "G2", "G3", "u1", "H1"]
    assert c2.labels == []


@pytest.mark.parametrize("digits", [" 5", "5 ", "1_0", "5\n", "", "+", "2147483648"])
def test_bucket_number_keys_are_read_as_java_parses_them(digits: str) -> None:
    """Artemis reads `_AMQ_GROUP_BUCKET_INT_KEY_<n>` with Integer.parseInt: whitespace,
    underscores, a bare sign or an int32 overflow make it an ordinary id, hashed as
    a whole (Python's int() accepted " 5" and "1_0": 5 where Java gives 275 of 1024)."""
    from amqbroker.core.groups import artemis_hash, bucket_of

    gid = BUCKET_KEY + digits
    assert bucket_of(gid, 1024) == (artemis_hash(gid) & 0x7FFFFFFF) % 1024


@pytest.mark.parametrize(("digits", "n"), [("+7", 7), ("0012", 12), ("-1", 0x7FFFFFFF)])
def test_bucket_number_keys_java_accepts(digits: str, n: int) -> None:
    from amqbroker.core.groups import bucket_of

    assert bucket_of(BUCKET_KEY + digits, 1024) == n % 1024
