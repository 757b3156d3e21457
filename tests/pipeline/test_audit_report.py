"""`amqbroker audit` on bad input files (exit 2, one line; ``--skip-bad-files``) and
what its reports tell an operator: event counts, outcomes and redeliveries, copies
still queued at the end of the log (not lost), two-owner episodes (not moments)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from amqbroker.cli import main
from amqbroker.pipeline import delivery_log_format as fmt
from amqbroker.pipeline.invariants import check
from tests.pipeline import logs as L

pytestmark = pytest.mark.timeout(600)  # a JVM on a shared 2-core machine


def audit(*args: str) -> Any:
    return CliRunner().invoke(main, ["audit", *args])


def report(out: Path) -> tuple[dict[str, Any], str, str]:
    return (
        json.loads((out / "audit.json").read_text()),
        (out / "report.md").read_text(),
        (out / "report.html").read_text(),
    )


# ------------------------------------------------------------------------ bad input
@pytest.fixture(scope="module")
def clean() -> list[dict[str, Any]]:
    return L.clean_log(n_messages=120, n_groups=4, n_consumers=2, seed=5)


def _bad_files(d: Path, good: Path) -> dict[str, tuple[Path, str]]:
    """One bad file of each kind in `d` (truncated: a copy of `good`, a Parquet log
    file, cut in half), and words the error must name."""
    d.mkdir(parents=True, exist_ok=True)
    garbage = d / fmt.file_name(10_000, "parquet")
    garbage.write_bytes(b"this is not a parquet file at all\n" * 20)
    truncated = d / fmt.file_name(20_000, "parquet")
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    empty = d / fmt.file_name(30_000, "parquet")
    empty.write_bytes(b"")
    torn = d / fmt.file_name(40_000, "jsonl")
    torn.write_text(json.dumps(dict.fromkeys(fmt.FIELD_NAMES, 1))[:40])
    return {
        "garbage": (garbage, "not a Parquet file"),
        "truncated": (truncated, "truncated"),
        "empty": (empty, "empty file (0 bytes)"),
        "torn-jsonl": (torn, "truncated"),
    }


@pytest.mark.parametrize("kind", ["garbage", "truncated", "empty", "torn-jsonl"])
def test_bad_file_exits_2_with_one_line(spark, clean, tmp_path, kind):
    root = L.write_log(clean, tmp_path / fmt.DIRECTORY, "parquet", per_file=200)
    good = sorted(str(p) for p in (root / "n1").iterdir())
    bad = _bad_files(tmp_path / "bad", Path(good[0]))[kind]
    r = audit(*good, str(bad[0]), "--out", str(tmp_path / "report"))
    assert r.exit_code == 2, r.output
    assert len(r.output.splitlines()) == 1, r.output
    assert r.stderr.startswith(f"Error: bad delivery-log file {bad[0].resolve()}: "), r.stderr
    assert bad[1] in r.stderr
    assert not (tmp_path / "report").exists()


def test_skip_bad_files_audits_the_good_ones(spark, clean, tmp_path):
    root = L.write_log(clean, tmp_path / fmt.DIRECTORY, "parquet", per_file=200)
    bad = _bad_files(root / "n1", root / "n1" / fmt.file_name(1, "parquet"))
    out = tmp_path / "report"
    r = audit(str(tmp_path), "--out", str(out), "--skip-bad-files")
    assert r.exit_code == 0, r.output
    skipped = [line for line in r.stderr.splitlines() if line.startswith("skipped ")]
    assert sorted(skipped) == sorted(
        f"skipped bad delivery-log file {p.resolve()}: {why}"
        for p, why in (_why(path) for path, _ in bad.values())
    )
    assert "every invariant holds" in r.stdout
    result, md, html = report(out)
    assert result["totals"]["events"] == len(clean)
    assert sorted(f["path"] for f in result["skipped_files"]) == sorted(
        str(p.resolve()) for p, _ in bad.values()
    )
    for p, _ in bad.values():
        assert str(p.resolve()) in md and str(p.resolve()) in html

    # an invariant broken in the good files still fails the audit
    broken, _ = L.inject_lost(clean)
    root = L.write_log(broken, tmp_path / "broken" / fmt.DIRECTORY, "parquet", per_file=200)
    _bad_files(root / "n1", root / "n1" / fmt.file_name(1, "parquet"))
    r = audit(str(tmp_path / "broken"), "--out", str(out), "--skip-bad-files", "--format", "md")
    assert r.exit_code == 1, r.output


def _why(path: Path) -> tuple[Path, str]:
    from amqbroker.pipeline.audit import check_file

    why = check_file(str(path.resolve()))
    assert why is not None
    return path, why


# --------------------------------------------------------------------- what is shown
def test_reports_show_event_counts_outcomes_and_redeliveries(spark, clean, tmp_path):
    root = L.write_log(clean, tmp_path / fmt.DIRECTORY, "jsonl", per_file=200)
    out = tmp_path / "report"
    r = audit(str(root), "--out", str(out))
    assert r.exit_code == 0, r.output
    result, md, html = report(out)
    events = Counter(x["event"] for x in clean)
    outcomes = Counter(x["outcome"] for x in clean if x["event"] == "settled")
    slots = Counter(
        (x["node"], x["queue"], x["message_id"]) for x in clean if x["event"] == "dispatched"
    )
    redeliveries = sum(n - 1 for n in slots.values())
    assert redeliveries > 0 and outcomes["rejected"] and events["expired"]
    assert events["dead_lettered"] and outcomes["released"]
    assert result["totals"]["redeliveries"] == redeliveries
    assert result["totals"]["by_outcome"] == dict(outcomes)
    expected = [(e.replace("_", "-"), events[e]) for e in fmt.EVENTS] + [
        (f"settled {o}", outcomes[o]) for o in fmt.OUTCOMES
    ]
    expected.append(("redeliveries (dispatches after a copy's first)", redeliveries))
    for name, n in expected:
        assert f"| {name} | {n:,} |" in md, name
        assert f'<td>{name}</td><td class="num">{n}</td>' in html.replace("&#x27;", "'"), name


def _backlog(log: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], set[str], str]:
    """`log` plus, at its end, a backlog nobody consumed: an ungrouped message and a
    group's two messages never dispatched, and a message dispatched then released (back
    in the queue); and one message of a group that a later message of its group
    overtook (skipped: lost). Returns (log, the still-queued ids, the skipped id)."""
    out = [dict(x) for x in log]

    def rec(event: str, mid: str, gid: str | None, **kw: Any) -> None:
        out.append(L._rec("n1", event, "orders", mid, gid, None, producer="p0/send", **kw))

    for mid, gid in (("q1", None), ("q2", "gq"), ("q3", "gq"), ("q4", None)):
        rec("received", mid, gid)
        rec("routed", mid, gid)
    rec("dispatched", "q4", None, consumer="c0/recv")
    rec("released", "q4", None, consumer="c0/recv")
    for mid in ("s1", "s2"):
        rec("received", mid, "gs")
        rec("routed", mid, "gs")
    rec("dispatched", "s2", "gs", consumer="c0/recv")
    rec("settled", "s2", "gs", consumer="c0/recv", outcome="accepted")
    return L.renumber(out, seed=2), {"q1", "q2", "q3", "q4"}, "s1"


def test_still_queued_at_end_of_log_is_not_lost(spark, clean, tmp_path):
    log, queued, skipped = _backlog(clean)
    root = L.write_log(log, tmp_path / fmt.DIRECTORY, "jsonl", per_file=200)
    out = tmp_path / "report"
    r = audit(str(root), "--out", str(out))
    assert r.exit_code == 1, r.output  # the skipped message is lost
    result, md, html = report(out)
    lost = result["invariants"]["lost"]
    assert [x["message_id"] for x in lost["samples"]] == [skipped]
    still = result["info"]["still_queued"]
    assert still["count"] == result["totals"]["still_queued"] == len(queued)
    assert {x["message_id"] for x in still["samples"]} == queued
    line = "still queued at end of log (a backlog, not lost)"
    assert f"  info {line}: 4" in r.stdout
    assert "FAIL messages lost (routed, never settled, expired or dead-lettered): 1" in r.stdout
    assert f"| {line} | 4 |" in md and "| lost (fails the audit) | 1 |" in md
    assert f'<td>{line}</td><td class="num">4</td>' in html

    # without the skipped message: a backlog alone passes
    log = [x for x in log if x["message_id"] != skipped]
    root = L.write_log(log, tmp_path / "ok" / fmt.DIRECTORY, "jsonl", per_file=200)
    r = audit(str(root), "--out", str(out), "--format", "md")
    assert r.exit_code == 0, r.output
    assert json.loads((out / "audit.json").read_text())["totals"]["still_queued"] == 4

    # a delivery whose outcome never came (the consumer holds it) is still lost
    bad, mid = L.inject_lost(log)
    root = L.write_log(bad, tmp_path / "lost" / fmt.DIRECTORY, "jsonl", per_file=200)
    r = audit(str(root), "--out", str(out), "--format", "md")
    assert r.exit_code == 1, r.output
    result = json.loads((out / "audit.json").read_text())
    assert [x["message_id"] for x in result["invariants"]["lost"]["samples"]] == [mid]
    assert result["totals"]["still_queued"] == 4


def _two_owner_log() -> tuple[list[dict[str, Any]], list[str]]:
    """Group g: consumer A owns it; ONE message goes to B while A holds one, and A gets
    18 more while B holds it (19 moments, one episode); later one more overlap (a
    second episode of 1 moment). Returns the log and the messages whose dispatches are
    the episodes' first and last moments."""
    out: list[dict[str, Any]] = []
    a, b = "a/recv", "b/recv"

    def rec(event: str, mid: str, **kw: Any) -> None:
        out.append(L._rec("n1", event, "orders", mid, "g", None, producer="p0/send", **kw))

    mids = [f"m{i}" for i in range(1, 24)]
    for mid in mids:
        rec("received", mid)
        rec("routed", mid)
    rec("dispatched", "m1", consumer=a)
    rec("dispatched", "m2", consumer=b)  # the wrong owner
    for i in range(3, 21):
        rec("dispatched", f"m{i}", consumer=a)
    rec("settled", "m2", consumer=b, outcome="accepted")
    for i in (1, *range(3, 22)):
        if i == 21:
            rec("dispatched", "m21", consumer=a)
        rec("settled", f"m{i}", consumer=a, outcome="accepted")
    rec("dispatched", "m22", consumer=a)
    rec("dispatched", "m23", consumer=b)  # again, later
    rec("settled", "m22", consumer=a, outcome="accepted")
    rec("settled", "m23", consumer=b, outcome="accepted")
    return L.renumber(out, seed=3), ["m2", "m20", "m23", "m23"]


def test_two_owners_counted_as_episodes(spark, tmp_path):
    log, (first1, last1, first2, last2) = _two_owner_log()
    ref = check(log)
    assert len(ref.two_owner_moments) == 20 and not ref.order_violations and not ref.lost
    assert [(g, n) for _, g, *_, n in ref.two_owners] == [("g", 19), ("g", 1)]
    root = L.write_log(log, tmp_path / fmt.DIRECTORY, "jsonl")
    out = tmp_path / "report"
    r = audit(str(root), "--out", str(out))
    assert r.exit_code == 1, r.output
    assert "FAIL episodes a group had two owners: 2 (20 moments)" in r.stdout
    result, md, html = report(out)
    inv = result["invariants"]["two_owners"]
    assert inv["count"] == 2 and inv["moments"]["count"] == 20
    seq = {x["message_id"]: x["seq"] for x in log if x["event"] == "dispatched"}
    ts = {x["message_id"]: x["ts_us"] for x in log if x["event"] == "dispatched"}
    got = [
        (e["moments"], e["first"]["seq"], e["last"]["seq"], e["first"]["ts_us"], e["last"]["ts_us"])
        for e in sorted(inv["samples"], key=lambda e: e["first"]["seq"])
    ]
    assert got == [
        (19, seq[first1], seq[last1], ts[first1], ts[last1]),
        (1, seq[first2], seq[last2], ts[first2], ts[last2]),
    ]
    assert inv["samples"][0]["first"]["consumer"] in ("a/recv", "b/recv")
    first_time = min(inv["samples"], key=lambda e: e["first"]["seq"])["first"]["time"]
    title = "episodes a group had two owners"
    assert f"| {title} | 2 (20 moments) | " in md
    assert "19 moment(s) from " in md and first_time in md
    assert f"<td>{title}</td><td>2 (20 moments)</td>" in html
    assert "19 moment(s) from " in html and first_time in html
    worst = result["groups"]["worst"][0]
    assert (worst["two_owner_episodes"], worst["two_owner_moments"]) == (2, 20)
