"""Printing: one line per run, the summary table (medians of the runs), and --report
(several brokers' --json files as one markdown table with ratios).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from amqbroker.tools.perf.stats import median_or_none

# ----------------------------------------------------------------------- printing


def _fmt(v: Any, unit: str = "", digits: int = 0) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and digits:
        return f"{v:,.{digits}f}{unit}"
    return f"{round(v):,}{unit}" if isinstance(v, (int, float)) else f"{v}{unit}"


def _lat(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v / 1000:.2f} ms" if v >= 1000 else f"{v:.0f} us"


def format_row(r: dict[str, Any]) -> str:
    parts = [f"{r['broker']} {r['scenario']} run {r['run']}:"]
    if r["scenario"].startswith("HOL"):
        parts.append(
            f"ungrouped consumed after {_fmt(r.get('hol_ungrouped_ms'), ' ms', 1)}, "
            f"everything after {_fmt(r.get('hol_all_ms'), ' ms', 1)}"
        )
    else:
        parts.append(f"{_fmt(r.get('msgs_per_s'))} msgs/s")
        if r.get("producer_msgs_per_s"):
            parts.append(f"(producers {_fmt(r['producer_msgs_per_s'])} msgs/s)")
    if r.get("lat_p50_us") is not None:
        parts.append(
            f"lat p50 {_lat(r['lat_p50_us'])} p90 {_lat(r.get('lat_p90_us'))} "
            f"p99 {_lat(r.get('lat_p99_us'))} max {_lat(r.get('lat_max_us'))}"
        )
    if r.get("broker_cpu_pct") is not None:
        parts.append(
            f"broker {_fmt(r['broker_cpu_pct'])}% CPU "
            f"{_fmt(r.get('broker_cpu_us_per_msg'), ' us/msg', 1)}"
        )
        if r.get("broker_children_cpu_us_per_msg"):
            parts.append(f"(children {_fmt(r['broker_children_cpu_us_per_msg'], ' us/msg', 1)})")
    if r.get("broker_rss_max_kb"):
        parts.append(f"RSS max {r['broker_rss_max_kb'] / 1024:.0f} MiB")
    if r.get("client_cpu_us_per_msg") is not None:
        parts.append(
            f"client {_fmt(r['client_cpu_us_per_msg'], ' us/msg', 1)}"
            f" (ceiling ~{_fmt(r.get('client_ceiling_est_msgs_per_s'))} msgs/s)"
        )
    if r.get("other_cores") is not None:
        parts.append(f"other {r['other_cores']} cores")
    if r.get("host_steal_pct"):
        parts.append(f"host steal {r['host_steal_pct']}%")
    if r.get("rss_per_group_bytes") is not None:
        parts.append(f"RSS/bound group {_fmt(r['rss_per_group_bytes'], ' B', 1)}")
    if r.get("rss_per_msg_bytes") is not None:
        parts.append(
            f"RSS/queued msg {_fmt(r['rss_per_msg_bytes'], ' B', 1)} "
            f"({_fmt(r.get('rss_per_msg_beyond_payload'), ' B', 1)} beyond payload), "
            f"drain {_fmt(r.get('drain_msgs_per_s'))} msgs/s"
        )
    if "group_check" in r:
        parts.append(
            f"groups {r['group_check']}"
            + (
                f" ({r.get('group_split', 0)} split, {r.get('order_violations', 0)} out of order)"
                if r["group_check"] == "FAILED"
                else ""
            )
        )
    parts.append(f"errors {r['errors']}")
    detail = [
        f"{r[k]} {k.replace('_', ' ')}"
        for k in ("not_accepted", "missing", "extra", "bad_payload")
        if r.get(k)
    ]
    if detail:
        parts.append(f"({', '.join(detail)})")
    if r.get("first_error"):
        parts.append(f"[{r['first_error']}]")
    if r.get("note"):
        parts.append(f"({r['note']})")
    return "  ".join(parts)


SUMMARY_KEYS = (
    "msgs_per_s",
    "producer_msgs_per_s",
    "lat_p50_us",
    "lat_p99_us",
    "broker_cpu_us_per_msg",
    "broker_children_cpu_us_per_msg",
    "client_cpu_us_per_msg",
    "hol_ungrouped_ms",
    "rss_per_group_bytes",
    "rss_per_msg_beyond_payload",
    "other_cores",
    "host_steal_pct",
)


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (broker, scenario): medians of the runs, max RSS, total errors."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["broker"], r["scenario"]), []).append(r)
    out = []
    for (broker, scen), rs in groups.items():
        s: dict[str, Any] = {"broker": broker, "scenario": scen, "runs": len(rs)}
        for k in SUMMARY_KEYS:
            s[k] = median_or_none([r.get(k) for r in rs])
        rates = [r["msgs_per_s"] for r in rs if r.get("msgs_per_s")]
        s["msgs_per_s_min"] = min(rates) if rates else None
        s["msgs_per_s_max"] = max(rates) if rates else None
        rss = [r["broker_rss_max_kb"] for r in rs if r.get("broker_rss_max_kb")]
        s["broker_rss_max_kb"] = max(rss) if rss else None
        s["errors"] = sum(int(r.get("errors", 0)) for r in rs)
        checks = {r.get("group_check") for r in rs if r.get("group_check")}
        s["group_check"] = "FAILED" if "FAILED" in checks else (checks.pop() if checks else None)
        out.append(s)
    return out


def summary_table(summary: list[dict[str, Any]]) -> str:
    head = (
        "| broker | scenario | runs | msgs/s (median) | min-max | p50 | p99 | broker CPU us/msg "
        "| client CPU us/msg | RSS max MiB | errors | groups |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for s in summary:
        rate = (
            f"HOL {s['hol_ungrouped_ms']:.1f} ms"
            if s.get("hol_ungrouped_ms") is not None
            else _fmt(s.get("msgs_per_s"))
        )
        rng = (
            f"{_fmt(s['msgs_per_s_min'])}-{_fmt(s['msgs_per_s_max'])}"
            if s.get("msgs_per_s_min") and s.get("hol_ungrouped_ms") is None
            else "-"
        )
        lines.append(
            f"| {s['broker']} | {s['scenario']} | {s['runs']} | {rate} "
            f"| {rng} "
            f"| {_lat(s.get('lat_p50_us'))} | {_lat(s.get('lat_p99_us'))} "
            f"| {_fmt(s.get('broker_cpu_us_per_msg'), '', 1)} "
            f"| {_fmt(s.get('client_cpu_us_per_msg'), '', 1)} "
            f"| {_fmt((s.get('broker_rss_max_kb') or 0) / 1024 or None)} | {s['errors']} "
            f"| {s.get('group_check') or '-'} |"
        )
    return "\n".join(lines)


def load_rows(path: str) -> list[dict[str, Any]]:
    rows = []
    with open(path) as f:
        for raw in f:
            line = raw.strip()
            if line.startswith("{"):
                rows.append(json.loads(line))
    return rows


def render_report(specs: list[str]) -> str:
    """Markdown table of several brokers' --json results, with first/other ratios."""
    named: list[tuple[str, dict[str, dict[str, Any]]]] = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep:
            raise ValueError(f"--report wants NAME=FILE, got {spec!r}")
        rows = load_rows(path)
        for r in rows:
            r["broker"] = name
        named.append((name, {s["scenario"]: s for s in summarize(rows)}))
    if not named:
        return ""
    first, first_rows = named[0]
    scenarios: list[str] = []
    for _, rs in named:
        scenarios += [s for s in rs if s not in scenarios]
    cols = ["scenario", f"{first} msgs/s"]
    for name, _ in named[1:]:
        cols += [f"{name} msgs/s", f"{first}/{name}"]
    cols += [f"{n} p99" for n, _ in named] + [f"{n} CPU us/msg" for n, _ in named]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for sc in scenarios:
        base = first_rows.get(sc, {})
        cells = [sc, _rate_cell(base)]
        for _, rs in named[1:]:
            other = rs.get(sc, {})
            cells += [_rate_cell(other), _ratio(base, other, sc)]
        cells += [_lat(rs.get(sc, {}).get("lat_p99_us")) for _, rs in named]
        cells += [_fmt(rs.get(sc, {}).get("broker_cpu_us_per_msg"), "", 1) for _, rs in named]
        lines.append("| " + " | ".join(cells) + " |")
    notes = [
        "msgs/s: median of the runs (first send -> last receive); ratio "
        f"{first}/peer (for L, fixed rate: ratio of p99 latencies, peer/{first}; "
        f"for HOL, times peer/{first}; > 1 = {first} better)."
    ]
    bad = [f"{n} {sc}" for n, rs in named for sc, s in rs.items() if s.get("errors")]
    if bad:
        notes.append("runs with errors: " + ", ".join(bad))
    return "\n".join(lines) + "\n\n" + "\n".join(notes)


def _rate_cell(s: dict[str, Any]) -> str:
    if not s:
        return "-"
    if s.get("hol_ungrouped_ms") is not None:
        return f"{s['hol_ungrouped_ms']:.1f} ms"
    cell = _fmt(s.get("msgs_per_s"))
    return cell + (" (errors)" if s.get("errors") else "")


def _ratio(base: dict[str, Any], other: dict[str, Any], scenario: str) -> str:
    if scenario.upper().startswith("L"):
        a, b = other.get("lat_p99_us"), base.get("lat_p99_us")
    elif base.get("hol_ungrouped_ms") is not None:
        a, b = other.get("hol_ungrouped_ms"), base.get("hol_ungrouped_ms")
    else:
        a, b = base.get("msgs_per_s"), other.get("msgs_per_s")
    if not a or not b:
        return "-"
    return f"{a / b:.2f}"


# --------------------------------------------------------------------------- main


class Progress:
    """One live line on stderr while a run is under way ("A run 1: 61% 122,000/200,000
    messages, 48,210 msgs/s"), redrawn at most every `period` seconds and erased when
    the run ends, so the per-run lines stay clean. Disabled: does nothing."""

    def __init__(self, enabled: bool, stream: Any = None, period: float = 0.25) -> None:
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.period = period
        self._shown = 0
        self._t_last = 0.0
        self._first: tuple[float, int] | None = None

    def update(self, label: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if self._first is None:
            self._first = (now, done)
        if now - self._t_last < self.period:
            return
        self._t_last = now
        t0, d0 = self._first
        rate = (done - d0) / (now - t0) if now > t0 else 0.0
        pct = f"{100 * done / total:3.0f}% " if total else ""
        line = f"{label}: {pct}{done:,}/{total:,} messages, {rate:,.0f} msgs/s"
        self.stream.write("\r" + line.ljust(self._shown))
        self.stream.flush()
        self._shown = len(line)

    def clear(self) -> None:
        if self._shown:
            self.stream.write("\r" + " " * self._shown + "\r")
            self.stream.flush()
        self._shown = 0
        self._first = None
        self._t_last = 0.0
