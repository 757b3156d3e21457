"""The audit across cluster nodes (issue 20): group order per producer over every node,
groups that move without a release, late deliveries after a node loss.

Fixtures (`tests/pipeline/fixtures/cluster_run.py` made them from three real broker
processes): ``cluster-move-old`` is the OLD behaviour of ``cluster_node_loss_policy =
"move"`` (node3 SIGKILLed mid-traffic, its groups g1 and g3 moved to node2; when node3
came back it served the messages it had stored and those the bridges kept for it, after
node2 had served newer ones); ``cluster-wait`` is the default policy ``wait`` (the lost
node keeps its groups: nothing to find); ``cluster-move-late`` is ``move`` as it is now
(the returning node forwards its stranded messages to the new owner, marked ``late``).
The PySpark results must equal the plain-Python reference (`invariants.check`) on the
same records."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from amqbroker.pipeline import audit
from amqbroker.pipeline import delivery_log_format as fmt
from amqbroker.pipeline.invariants import INVARIANTS, check
from amqbroker.pipeline.report import LATE, MOVES, TITLES
from tests.pipeline import logs as L

FIXTURES = Path(__file__).parent / "fixtures"
MOVED = {"g1", "g3"}  # the groups bound to node3 when it was killed


def load(name: str) -> list[dict[str, Any]]:
    return [
        json.loads(line)
        for p in sorted((FIXTURES / name).glob("*/part-*.jsonl"))
        for line in p.read_text().splitlines()
    ]


@pytest.fixture(scope="module")
def move_old() -> list[dict[str, Any]]:
    return load("cluster-move-old")


def _rec(node: str, seq: int, ts: int, event: str, mid: str | None, **kw: Any) -> dict[str, Any]:
    r = L._rec(node, event, kw.pop("queue", "orders"), mid or "", kw.pop("group_id", "lg"), None)
    r.update(seq=seq, ts_us=L.T0_US + ts * 1000, message_id=mid, **kw)
    return r


def late_log(marked: bool = True) -> list[dict[str, Any]]:
    """Policy move with the stranded message forwarded to the new owner (what the
    cluster will do): producer p on n1 sends m1, m2, m3 of group lg (group-sequence 1,
    2, 3); m1 was forwarded to n3 (stored there) when n3 was lost; the arbiter (n1)
    released lg; m2 and m3 went to n2 and were consumed; n3 came back and forwarded m1
    to n2, `late` (`marked`; else only `forwarded`), consumed there last."""
    p, c = "c1/send", "c7/recv"
    out = []
    for i, mid in enumerate(("m1", "m2", "m3")):
        out.append(_rec("n1", 2 * i + 2, 10 * i, "received", mid, group_seq=i + 1, producer=p))
        target = "n3/orders" if mid == "m1" else "n2/orders"
        out.append(
            _rec("n1", 2 * i + 3, 10 * i + 1, "forwarded", mid, queue=target, group_seq=i + 1)
        )
    out.append(_rec("n1", 1, 0, "started", None, queue=None, group_id=None))
    out.append(_rec("n1", 8, 2000, "unbound", None, queue="n3/orders", outcome="node-lost"))
    n2 = [("received", "m2"), ("routed", "m2"), ("received", "m3"), ("routed", "m3")]
    n2 += [("dispatched", "m2"), ("settled", "m2"), ("dispatched", "m3"), ("settled", "m3")]
    for i, (ev, mid) in enumerate(n2):
        kw = {"consumer": c, "outcome": "accepted" if ev == "settled" else None}
        out.append(
            _rec("n2", i + 1, 2100 + i, ev, mid, **(kw if ev in ("dispatched", "settled") else {}))
        )
    out.append(_rec("n3", 1, 5, "received", "m1", producer="c2/n1->n3.bridge"))
    out.append(_rec("n3", 2, 6, "routed", "m1"))
    out.append(_rec("n3", 3, 9000, "started", None, queue=None, group_id=None))
    if marked:
        out.append(_rec("n3", 4, 9100, "late", "m1"))
    out.append(_rec("n3", 5, 9101, "forwarded", "m1", queue="n2/orders"))
    for i, ev in enumerate(("received", "routed", "dispatched", "settled")):
        kw = {"consumer": c, "outcome": "accepted" if ev == "settled" else None}
        out.append(
            _rec(
                "n2", 20 + i, 9200 + i, ev, "m1", **(kw if ev in ("dispatched", "settled") else {})
            )
        )
    return out


# ------------------------------------------------------------------ plain Python
def test_old_move_behaviour_breaks_order_per_producer_across_nodes(move_old):
    f = check(move_old)
    # the per-queue-instance check alone saw nothing wrong: the report
    assert f.order_violations == [] and not f.two_owners and not f.lost
    assert not f.ok
    assert {g for _, g, *_ in f.producer_order} == MOVED
    producers = {p for _, _, p, *_ in f.producer_order}
    assert producers == {"node1/c5/sender-1", "node2/c5/sender-1"}
    # every violation: an old message (consumed on node3 after its restart) first
    # dispatched after a newer one of the same group and producer (consumed on node2)
    first = {}
    for r in move_old:
        if r["event"] == "dispatched":
            first.setdefault(r["message_id"], r)
    for _, _, p, boot, mid, later in f.producer_order:
        assert boot == 1
        k_old, k_new = (int(x.split(":")[1]) for x in (mid, later))
        assert k_old < k_new and mid.split(":")[2] == later.split(":")[2] == p.split("/")[0]
        assert (first[mid]["node"], first[later]["node"]) == ("node3", "node2")
        assert first[mid]["ts_us"] > first[later]["ts_us"] + 1_000_000
    # the moves to node3 and back: node3 -> node2 followed the arbiter's release
    # (an unbound marker), node2 -> node3 (the returning node) did not
    assert f.moves == [("orders", g, "node2", "node3", 1) for g in sorted(MOVED)]
    without = [r for r in move_old if r["event"] != "unbound"]
    assert {m[:4] for m in check(without).moves} == {
        ("orders", g, a, b) for g in MOVED for a, b in (("node3", "node2"), ("node2", "node3"))
    }


def test_wait_policy_log_is_clean():
    f = check(load("cluster-wait"))
    assert f.ok
    assert not any(f.counts().values()), f.counts()


def test_late_delivery_is_reported_not_an_order_violation():
    f = check(late_log())
    assert f.ok, f.counts()
    assert f.late == [("n3", "orders", "m1")]
    assert not f.lost and not f.still_queued and not f.moves
    # unmarked, the same log is an order violation (m1 consumed after m2 and m3)
    g = check(late_log(marked=False))
    assert g.producer_order == [("orders", "lg", "n1/c1/send", 1, "m1", "m2")]
    assert not g.late


def test_producer_identity_includes_the_boot():
    """Connection ids start again at c1 after a restart: the same "c1/send" before and
    after a `started` marker are two producers (no order between them)."""
    log = [
        _rec("n1", 1, 0, "started", None, queue=None, group_id=None),
        _rec("n1", 2, 1, "received", "a", producer="c1/send"),
        _rec("n1", 3, 2, "routed", "a"),
        _rec("n1", 4, 10, "started", None, queue=None, group_id=None),
        _rec("n1", 5, 11, "received", "b", producer="c1/send"),
        _rec("n1", 6, 12, "routed", "b"),
        _rec("n1", 7, 13, "dispatched", "b", consumer="c2/recv"),
        _rec("n1", 8, 14, "settled", "b", consumer="c2/recv", outcome="accepted"),
        _rec("n1", 9, 15, "dispatched", "a", consumer="c2/recv"),
        _rec("n1", 10, 16, "settled", "a", consumer="c2/recv", outcome="accepted"),
    ]
    assert check(log).producer_order == []
    one_boot = [r for r in log if r["seq"] != 4]
    assert check(one_boot).producer_order == [("orders", "lg", "n1/c1/send", 1, "a", "b")]


def test_group_seq_is_the_order_key_when_the_producer_sets_it():
    def log(gseqs: tuple[int, int]) -> list[dict[str, Any]]:
        out = []
        for i, (mid, gs) in enumerate(zip(("x", "y"), gseqs, strict=True)):
            out.append(_rec("n1", 2 * i + 1, i, "received", mid, producer="c1/s", group_seq=gs))
            out.append(_rec("n1", 2 * i + 2, i, "routed", mid, group_seq=gs))
        out.append(_rec("n1", 5, 5, "dispatched", "x", consumer="c2/r"))
        out.append(_rec("n1", 6, 6, "dispatched", "y", consumer="c2/r"))
        return out

    assert check(log((1, 2))).producer_order == []
    # y was received second but says it comes first: dispatching x first breaks order
    assert check(log((2, 1))).producer_order == [("orders", "lg", "n1/c1/s", 0, "y", "x")]
    # without a group-sequence the entry node's receive order decides
    assert check(log((0, 0))).producer_order == []


# ------------------------------------------------------------------------- Spark
pytestmark_spark = pytest.mark.timeout(600)


@pytestmark_spark
def test_spark_audit_agrees_on_cluster_logs(spark, move_old, tmp_path):
    """One audit (`audit.run`: audit.json, report.md, report.html) over the old move
    fixture and the constructed late-delivery logs (distinct nodes and ids): the same
    findings as the reference, reported."""
    late = [dict(r, node="l" + r["node"]) for r in late_log()]
    late = [
        dict(r, queue="l" + r["queue"]) if r["event"] in ("forwarded", "unbound") else r
        for r in late
    ]
    unmarked = [
        dict(
            r,
            node="u" + r["node"],
            message_id=r["message_id"] and "u" + r["message_id"],
            group_id="ulg",
        )
        for r in late_log(marked=False)
    ]
    unmarked = [
        dict(r, queue="u" + r["queue"]) if r["event"] in ("forwarded", "unbound") else r
        for r in unmarked
    ]
    records = move_old + late + unmarked
    ref = check(records)
    assert len(ref.producer_order) == 30 + 1 and ref.late == [("ln3", "orders", "m1")]
    assert len(ref.moves) == 2
    root = L.write_log(late + unmarked, tmp_path / "logs" / fmt.DIRECTORY, "jsonl")
    for node in (FIXTURES / "cluster-move-old").iterdir():
        (root / node.name).mkdir()
        for p in node.iterdir():
            (root / node.name / p.name).write_bytes(p.read_bytes())
    out = tmp_path / "report"
    code = audit.run(audit.AuditOptions(paths=[str(root)], out=out, samples=50), echo=_quiet)
    assert code == audit.EXIT_BROKEN
    r = json.loads((out / "audit.json").read_text())
    assert {n: r["invariants"][n]["count"] for n in INVARIANTS} == {
        n: len(getattr(ref, n)) for n in INVARIANTS
    }
    po = r["invariants"]["producer_order"]
    assert (
        sorted(
            (
                s["queue"],
                s["group_id"],
                s["producer"],
                s["boot"],
                s["message"]["message_id"],
                s["later"]["message_id"],
            )
            for s in po["samples"]
        )
        == ref.producer_order
    )
    s0 = next(s for s in po["samples"] if s["group_id"] in MOVED)
    assert (s0["message"]["node"], s0["later"]["node"]) == ("node3", "node2")
    assert s0["message"]["ts_us"] > s0["later"]["ts_us"]
    moves = r["info"]["moves"]
    assert (
        sorted(
            (s["queue"], s["group_id"], s["from"], s["to"], s["moves"]) for s in moves["samples"]
        )
        == ref.moves
    )
    assert moves["moves"] == sum(n for *_, n in ref.moves)
    late_found = r["info"]["late"]
    assert [(s["node"], s["queue"], s["message_id"]) for s in late_found["samples"]] == ref.late
    assert r["totals"]["late"] == 1
    # releases by reason: the old fixture was written before reasons were recorded
    assert r["totals"]["releases"] == {"node-lost": 2, "unknown": 2}
    # unmarked, n3's copy of m1 has no terminal event: it reads as still queued there
    assert r["info"]["still_queued"]["count"] == len(ref.still_queued) == 1
    md = (out / "report.md").read_text()
    html = (out / "report.html").read_text()
    title = TITLES["producer_order"]
    for text in (md, html):
        assert title in text and MOVES in text and LATE in text
        assert "producer=node1/c5/sender-1" in text or "producer=node2/c5/sender-1" in text
        assert "after the later " in text
    assert f"| {title} | 31 |" in md
    assert "| group bindings released (node-lost) | 2 |" in md


@pytestmark_spark
def test_spark_audit_of_wait_policy_log_finds_nothing(spark):
    events = audit.load_events(spark, [str(FIXTURES / "cluster-wait")])
    r = audit.analyse(events)
    assert r["ok"]
    assert all(v["count"] == 0 for v in r["invariants"].values())
    info = r["info"]
    assert (info["moves"]["count"], info["late"]["count"], info["still_queued"]["count"]) == (
        0,
        0,
        0,
    )
    assert info["unrouted"]["count"] == 0 and not info["seq_gaps"]


def _quiet(msg: str, err: bool = False) -> None:
    pass


def test_move_policy_with_late_forwarding_is_clean():
    """``cluster-move-late``: the same run on the tree whose returning node forwards its
    stranded messages to the group's new owner, each marked ``late``: no order
    violation, the late deliveries reported."""
    f = check(load("cluster-move-late"))
    assert f.ok, f.counts()
    assert f.late and {(n, q) for n, q, _ in f.late} == {("node3", "orders")}
    assert {mid.split(":")[0] for *_, mid in f.late} <= MOVED
    assert not f.moves and not f.still_queued
    # without the marker the same log breaks the order per producer
    unmarked = check(r for r in load("cluster-move-late") if r["event"] != "late")
    assert unmarked.producer_order


# ------------------------------------------- producer order across entry nodes
#: the producer's identity: a Qpid JMS connection's container-id and its sender's link
#: name, both kept through `failover:`
IDENT = "ID:app-1:1/qpid-jms:sender:ID:app-1:1:1:1:orders"
BRIDGED = {"producer": "c2/n2->n1.bridge", "producer_identity": "n2/n2->n1.bridge"}


def failover_log(
    order_kept: bool = False, resend: bool = False, group_seq: bool = True
) -> list[dict[str, Any]]:
    """A producer that moves from entry node n2 to n1 (group fg, owned by n1, where its
    consumer is): via n2 (connection c3) it sends m3 and m4 (group-sequence 3 and 4);
    n2 forwards both to n1, m3 arrives, m4 waits in n2's bridge when n2 dies; the
    producer fails over to n1 (connection c9, the same identity) and sends m5
    (group-sequence 5). n2's bridge delivers m4 to n1: before m5 (`order_kept`: what
    the broker does now, m4 was not answered accepted before n1 had it) or, after a
    restart of n2, once m5 was dispatched (m5 overtook m4). `resend`: the producer, which
    had no answer for m4, sends it again via n1 (same message-id) before m5, so m4's
    first dispatch comes first; the bridged copy is still delivered after m5.
    `group_seq`: the messages carry their group-sequence (else none)."""
    gs = {f"m{i}": i if group_seq else None for i in (3, 4, 5)}
    c = "c4/recv"
    via_n2 = {"producer": "c3/sender", "producer_identity": IDENT}
    via_n1 = {"producer": "c9/sender", "producer_identity": IDENT}
    out = [
        _rec("n1", 1, 0, "started", None, queue=None, group_id=None),
        _rec("n2", 1, 0, "started", None, queue=None, group_id=None),
    ]
    for i, mid in enumerate(("m3", "m4")):
        kw = {"group_id": "fg", "group_seq": gs[mid]}
        out.append(_rec("n2", 2 + 2 * i, 10 + 10 * i, "received", mid, **kw, **via_n2))
        out.append(_rec("n2", 3 + 2 * i, 11 + 10 * i, "forwarded", mid, queue="n1/orders", **kw))

    n1: list[tuple[str, str, dict[str, Any]]] = []

    def deliver(mid: str, sender: dict[str, Any]) -> None:
        n1.extend([("received", mid, sender), ("routed", mid, {})])
        n1.extend([("dispatched", mid, {"consumer": c})])
        n1.append(("settled", mid, {"consumer": c, "outcome": "accepted"}))

    deliver("m3", BRIDGED)
    if resend:
        deliver("m4", via_n1)
    if order_kept:
        deliver("m4", BRIDGED)
    n1 += [("received", "m5", via_n1), ("routed", "m5", {})]
    n1 += [("dispatched", "m5", {"consumer": c})]
    n1 += [("settled", "m5", {"consumer": c, "outcome": "accepted"})]
    if not order_kept:
        deliver("m4", BRIDGED)
    for i, (ev, mid, kw) in enumerate(n1):
        out.append(
            _rec("n1", 2 + i, 1000 + 10 * i, ev, mid, group_id="fg", group_seq=gs[mid], **kw)
        )
    return out


def test_producer_overtaking_itself_across_entry_nodes_is_flagged():
    """m5 (group-sequence 5, via n1) is first dispatched before m4 (group-sequence 4,
    held in n2's bridge): the producer overtook itself. The check per entry node does
    not see it: m4 and m5 entered by two nodes and connections."""
    f = check(failover_log())
    assert f.producer_order_across_entry_nodes == [("orders", "fg", IDENT, "m4", "m5")]
    assert f.producer_order == []
    assert not f.ok
    assert {k: v for k, v in f.counts().items() if v} == {"producer_order_across_entry_nodes": 1}


def test_producer_across_entry_nodes_in_order_is_clean():
    f = check(failover_log(order_kept=True))
    assert f.ok, f.counts()
    assert not any(f.counts().values()), f.counts()


def test_resend_with_the_same_message_id_counts_once():
    """The producer resent m4 via n1 before m5: m4's first dispatch (the resend's)
    comes before m5's; the bridged copy delivered after m5 is the same message."""
    f = check(failover_log(resend=True))
    assert f.producer_order_across_entry_nodes == []
    assert f.producer_order == []


def test_without_group_sequence_order_across_entry_nodes_is_not_checked():
    """Entry-node sequence numbers are not comparable across nodes: without
    group-sequences the overtaking in `failover_log` cannot be seen."""
    assert check(failover_log(group_seq=False)).producer_order_across_entry_nodes == []
    # one message without one is enough to leave the partition out
    log = failover_log()
    for r in log:
        if r["message_id"] == "m3":
            r["group_seq"] = 0
    assert check(log).producer_order_across_entry_nodes == []


def test_producer_identity_missing_from_older_logs():
    """Logs written before the field existed: nothing to compare."""
    log = [{k: v for k, v in r.items() if k != "producer_identity"} for r in failover_log()]
    assert check(log).producer_order_across_entry_nodes == []


def _renamed(log: list[dict[str, Any]], p: str) -> list[dict[str, Any]]:
    """`log` with its nodes, message-ids and groups prefixed by `p` (distinct logs in
    one audit)."""
    out = []
    for r in log:
        r = dict(r, node=p + r["node"])
        if r["message_id"] is not None:
            r["message_id"] = p + r["message_id"]
        if r["group_id"] is not None:
            r["group_id"] = p + r["group_id"]
        if r["event"] in ("forwarded", "unbound"):
            r["queue"] = p + r["queue"]
        out.append(r)
    return out


@pytestmark_spark
def test_spark_audit_agrees_on_producer_order_across_entry_nodes(spark, tmp_path):
    """One audit (`audit.run`) over the failover logs (overtaken, in order, resend,
    without group-sequences; distinct nodes and ids) and the wait-policy fixture as
    Parquet files written before ``producer_identity`` existed (the column missing):
    the same findings as the reference, reported."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = (
        _renamed(failover_log(), "x")
        + _renamed(failover_log(order_kept=True), "k")
        + _renamed(failover_log(resend=True), "r")
        + _renamed(failover_log(group_seq=False), "z")
    )
    ref = check(records)
    assert ref.producer_order_across_entry_nodes == [("orders", "xfg", IDENT, "xm4", "xm5")]
    root = tmp_path / "logs" / fmt.DIRECTORY
    L.write_log(records[: len(records) // 2], root, "jsonl")
    L.write_log(records[len(records) // 2 :], root, "parquet")
    old_fields = [(n, t) for n, t in fmt.FIELDS if n != "producer_identity"]
    old_schema = pa.schema([f for f in fmt.arrow_schema() if f.name in dict(old_fields)])
    wait = load("cluster-wait")
    for node in {r["node"] for r in wait}:
        rows = sorted((r for r in wait if r["node"] == node), key=lambda r: r["seq"])
        (root / node).mkdir()
        table = pa.Table.from_pylist([{n: r[n] for n, _ in old_fields} for r in rows], old_schema)
        pq.write_table(table, root / node / fmt.file_name(rows[0]["seq"], "parquet"))
    ref_all = check(records + wait)
    assert ref_all.producer_order_across_entry_nodes == ref.producer_order_across_entry_nodes
    out = tmp_path / "report"
    code = audit.run(audit.AuditOptions(paths=[str(root)], out=out), echo=_quiet)
    assert code == audit.EXIT_BROKEN
    r = json.loads((out / "audit.json").read_text())
    assert {n: r["invariants"][n]["count"] for n in INVARIANTS} == {
        n: len(getattr(ref_all, n)) for n in INVARIANTS
    }
    across = r["invariants"]["producer_order_across_entry_nodes"]
    (s,) = across["samples"]
    assert (
        s["queue"],
        s["group_id"],
        s["producer"],
        s["message"]["message_id"],
        s["later"]["message_id"],
    ) == ref.producer_order_across_entry_nodes[0]
    assert (s["message"]["entry_node"], s["message"]["group_seq"]) == ("xn2", 4)
    assert (s["later"]["entry_node"], s["later"]["group_seq"]) == ("xn1", 5)
    assert s["message"]["node"] == s["later"]["node"] == "xn1"
    assert s["message"]["ts_us"] > s["later"]["ts_us"]
    worst = {(g["queue"], g["group_id"]): g for g in r["groups"]["worst"]}
    assert worst[("orders", "xfg")]["producer_order"] == 1
    title = TITLES["producer_order_across_entry_nodes"]
    md = (out / "report.md").read_text()
    html = (out / "report.html").read_text()
    assert f"| {title} | 1 |" in md
    for text in (md, html):
        assert title in text
        assert "group-seq 4 via xn2" in text and "group-seq 5 via xn1" in text
