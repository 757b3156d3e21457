"""The PySpark audit on the log of a real broker run (subprocess, real sockets, Proton
clients): clean, then with each fault injected by editing the broker's own records.
The Spark results must equal the plain-Python reference (`invariants.check`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from amqbroker.cli import main
from amqbroker.pipeline import audit
from amqbroker.pipeline import delivery_log_format as fmt
from amqbroker.pipeline.invariants import INVARIANTS, check
from tests.pipeline import logs as L
from tests.pipeline.conftest import SyncBroker

pytestmark = pytest.mark.timeout(600)  # a JVM on a shared 2-core machine

N_GROUPED = 40
N_PLAIN = 8


def broker_run(tmp: Path) -> list[dict[str, Any]]:
    """Producer, two consumers; consumer A leaves with unsettled messages (they go back,
    its groups move to B). Returns the broker's delivery-log records."""
    from proton import Message, Timeout
    from proton.utils import BlockingConnection

    b = SyncBroker(
        tmp / "data",
        {
            "AMQBROKER_DELIVERY_LOG": "true",
            "AMQBROKER_DELIVERY_LOG_FORMAT": "jsonl",
            "AMQBROKER_DELIVERY_LOG_FLUSH_INTERVAL": "0.05",
            "AMQBROKER_NODE_ID": "n1",
            "AMQBROKER_STORE_SYNC": "false",
        },
    )
    try:
        ca = BlockingConnection(b.url, timeout=10)
        cb = BlockingConnection(b.url, timeout=10)
        ra = ca.create_receiver("audit.q", credit=4)
        rb = cb.create_receiver("audit.q", credit=4)
        prod = BlockingConnection(b.url, timeout=10)
        snd = prod.create_sender("audit.q")
        for i in range(N_GROUPED + N_PLAIN):
            m = Message(body=f"m{i}", id=f"id-{i}")
            if i < N_GROUPED:
                m.group_id, m.group_sequence = f"g{i % 4}", i // 4 + 1
            snd.send(m)
        prod.close()
        got = 0
        for _ in range(3):  # A takes a few, then leaves holding one unsettled
            ra.receive(timeout=5)
            ra.accept()
            got += 1
        ra.receive(timeout=5)
        ca.close()
        for r in (rb,):
            while True:
                try:
                    r.receive(timeout=1.0)
                except Timeout:
                    break
                r.accept()
                got += 1
        cb.close()
        assert got == N_GROUPED + N_PLAIN
    finally:
        assert b.stop() == 0, "".join(b.output)
    records = []
    for f in sorted((tmp / "data" / fmt.DIRECTORY / "n1").glob("part-*.jsonl")):
        records += [json.loads(line) for line in f.read_text().splitlines()]
    return records


@pytest.fixture(scope="module")
def real_log(tmp_path_factory) -> list[dict[str, Any]]:
    return broker_run(tmp_path_factory.mktemp("run"))


def test_real_broker_log_is_clean(real_log):
    f = check(real_log)
    assert f.ok, f.counts()
    events = {r["event"] for r in real_log}
    assert {"received", "routed", "dispatched", "settled", "released"} <= events
    owners = {r["consumer"] for r in real_log if r["event"] == "dispatched"}
    assert len(owners) == 2


def spark_counts(result: dict[str, Any]) -> dict[str, int]:
    return {name: result["invariants"][name]["count"] for name in INVARIANTS}


def test_audit_of_real_run_with_injected_faults(spark, real_log, tmp_path):
    bad, lost = L.inject_lost(real_log, seed=1)
    bad, dup = L.inject_duplicate_dispatch(bad, seed=2)
    bad, twice = L.inject_received_twice(bad, seed=3)
    bad, (ooo_group, early) = L.inject_out_of_order(bad, seed=4)
    bad, (two_group, _) = L.inject_two_owners(bad, seed=5)
    # a clean second node in Parquet, and an unfinished file that must be skipped
    n2 = L.clean_log(node="n2", mid_prefix="n2-", group_prefix="n2-")
    ref = check(bad + n2)
    root = L.write_log(bad, tmp_path / "bad" / fmt.DIRECTORY, "jsonl", per_file=50)
    L.write_log(n2, root, "parquet", per_file=400)
    (root / "n2" / "part-99999999999999999999.parquet.inprogress").write_bytes(b"torn")

    result = audit.analyse(audit.load_events(spark, [str(tmp_path / "bad")]), samples=50)
    inv = result["invariants"]

    assert spark_counts(result) == {
        "lost": 1,
        "duplicate_after_settle": 1,
        "received_twice": 1,
        "order_violations": 1,
        # the swapped pair came from the run's one producer: its order is broken too
        "producer_order": len(ref.producer_order),
        # and across entry nodes: the client has a container-id and sets group-sequences
        "producer_order_across_entry_nodes": len(ref.producer_order_across_entry_nodes),
        "two_owners": 1,  # one episode, of one or more moments
    }
    assert sorted((q, g, m, later) for q, g, _, _, m, later in ref.producer_order) == sorted(
        (q, g, m, later) for q, g, _, m, later in ref.producer_order_across_entry_nodes
    )
    assert (
        sorted(
            (
                *(s[k] for k in ("queue", "group_id", "producer")),
                s["message"]["message_id"],
                s["later"]["message_id"],
            )
            for s in inv["producer_order_across_entry_nodes"]["samples"]
        )
        == ref.producer_order_across_entry_nodes
    )
    assert ref.producer_order and {g for _, g, *_ in ref.producer_order} == {ooo_group}
    assert (
        sorted(
            (
                *(s[k] for k in ("queue", "group_id", "producer", "boot")),
                s["message"]["message_id"],
                s["later"]["message_id"],
            )
            for s in inv["producer_order"]["samples"]
        )
        == ref.producer_order
    )
    assert [(s["node"], s["queue"], s["message_id"]) for s in inv["lost"]["samples"]] == ref.lost
    assert inv["lost"]["samples"][0]["message_id"] == lost
    assert inv["duplicate_after_settle"]["samples"][0]["message_id"] == dup
    assert inv["received_twice"]["samples"] == [{"message_id": twice, "n": 2}]
    assert [(s["group_id"], s["message_id"]) for s in inv["order_violations"]["samples"]] == [
        (ooo_group, early)
    ]
    assert (
        sorted(
            (s["queue"], s["group_id"], s["node"], s["seq"], s["consumer"])
            for s in inv["two_owners"]["moments"]["samples"]
        )
        == ref.two_owner_moments
    )
    assert inv["two_owners"]["moments"]["count"] == len(ref.two_owner_moments)
    assert [
        (s["queue"], s["group_id"], s["first"]["node"], s["first"]["seq"], s["moments"])
        for s in inv["two_owners"]["samples"]
    ] == [(q, g, n, seq, m) for q, g, n, seq, _, m in ref.two_owners]
    assert {s["group_id"] for s in inv["two_owners"]["samples"]} == {two_group}
    assert not result["ok"]
    assert result["info"]["unrouted"]["count"] == len(ref.unrouted)
    assert set(result["nodes"]) == {"n1", "n2"}
    assert result["totals"]["events"] == len(bad) + len(n2)
    lat = result["latency"]["settle"]
    assert lat["count"] > 0 and lat["percentiles_us"]["0.5"] <= lat["max_us"]
    assert sum(c for *_, c in lat["histogram"]) == lat["count"]
    assert result["consumers"]["count"] == len({r["consumer"] for r in bad + n2 if r["consumer"]})
    # the broken groups head the worst-groups table
    worst = result["groups"]["worst"]
    assert {g["group_id"] for g in worst[: len({ooo_group, two_group})]} == {ooo_group, two_group}


def test_cli_exit_code_and_reports(spark, real_log, tmp_path):
    """`amqbroker audit` (in-process: it reuses the active session): 0 and a report
    for the clean log, 1 once a message is lost, 2 for a path with no log."""
    clean = L.write_log(real_log, tmp_path / "clean" / fmt.DIRECTORY, "jsonl")
    out = tmp_path / "report"
    r = CliRunner().invoke(main, ["audit", str(clean), "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "every invariant holds" in r.output
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 3
    assert "PASS" in (out / "report.md").read_text()
    assert json.loads((out / "audit.json").read_text())["ok"] is True

    bad, _ = L.inject_lost(real_log)
    broken = L.write_log(bad, tmp_path / "broken" / fmt.DIRECTORY, "jsonl")
    r = CliRunner().invoke(main, ["audit", str(broken), "--out", str(out), "--format", "md"])
    assert r.exit_code == 1, r.output
    assert "FAIL messages lost" in r.output
    assert "FAIL" in (out / "report.md").read_text()

    r = CliRunner().invoke(main, ["audit", str(tmp_path / "nothing-here")])
    assert r.exit_code == 2
    assert "no such file or directory" in r.output
