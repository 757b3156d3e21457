"""The audit report: a one-screen text summary, a Markdown summary and an HTML page
with plots (matplotlib, rendered to PNG and embedded as data URIs, so the page is one
self-contained file).

Input: the result of `amqbroker.pipeline.audit.analyse` (aggregates only). Nothing
here talks to Spark.
"""

from __future__ import annotations

import base64
import html as html_mod
import io
from typing import Any

from amqbroker.pipeline.delivery_log_format import EVENTS, OUTCOMES
from amqbroker.pipeline.invariants import INVARIANTS

TITLES = {
    "lost": "messages lost (routed, never settled, expired or dead-lettered)",
    "duplicate_after_settle": "dispatched again after an accepted settle",
    "received_twice": "received twice with the same message-id",
    "order_violations": "group order violations (first dispatch out of arrival order)",
    "producer_order": "group order violations per producer across nodes "
    "(first dispatched after a later message)",
    "producer_order_across_entry_nodes": "group order violations per producer across "
    "entry nodes and reconnects (by container-id and group-sequence: first dispatched "
    "after a message with a higher group-sequence)",
    "two_owners": "episodes a group had two owners",
}
#: the state of an unresolved copy at the end of the log that is not a finding
STILL_QUEUED = "still queued at end of log (a backlog, not lost)"
#: informational: messages forwarded late on purpose, groups moved without a release
LATE = "delivered late after a node loss (policy move)"
MOVES = "groups moved to another node without a release (no node loss or unbind logged)"


def _count(r: dict[str, Any], name: str) -> str:
    """An invariant's count as text; two owners: episodes and their moments."""
    f = r["invariants"][name]
    text = f"{f['count']:,}"
    if name == "two_owners" and f["count"]:
        text += f" ({f['moments']['count']:,} moments)"
    return text


def _examples(r: dict[str, Any], name: str) -> str:
    f = r["invariants"][name]
    show = {
        "two_owners": _episode,
        "producer_order": _overtaken,
        "producer_order_across_entry_nodes": _overtaken_across,
    }.get(name, _sample)
    return "; ".join(show(x) for x in f["samples"][:3]) or "-"


def _at(d: dict[str, Any]) -> str:
    return f"{d['message_id']} on {d['node']} at {d['time']}"


def _overtaken(x: dict[str, Any]) -> str:
    """A producer-order violation: the message first dispatched after a later one."""
    boot = f" (boot {x['boot']})" if x.get("boot") else ""
    return (
        f"queue={x['queue']}, group={x['group_id']}, producer={x['producer']}{boot}: "
        f"{_at(x['message'])}, after the later {_at(x['later'])}"
    )


def _overtaken_across(x: dict[str, Any]) -> str:
    """A producer-order violation across entry nodes: the message first dispatched
    after one with a higher group-sequence, each with the node it entered by."""

    def at(d: dict[str, Any]) -> str:
        return f"{_at(d)} (group-seq {d.get('group_seq')} via {d.get('entry_node')})"

    return (
        f"queue={x['queue']}, group={x['group_id']}, producer={x['producer']}: "
        f"{at(x['message'])}, after the later {at(x['later'])}"
    )


def _move(x: dict[str, Any]) -> str:
    return (
        f"queue={x['queue']}, group={x['group_id']}: {x['from']} -> {x['to']} "
        f"{x['moves']:,} time(s), first {_at(x['first'])}"
    )


def _info(r: dict[str, Any]) -> list[list[Any]]:
    """(what, count, examples) of the informational findings that have a title."""
    info = r["info"]
    rows = []
    if "moves" in info:
        m = info["moves"]
        count = f"{m['count']:,}" + (f" ({m['moves']:,} moves)" if m["count"] else "")
        rows.append([MOVES, count, "; ".join(_move(x) for x in m["samples"][:3]) or "-"])
    if "late" in info:
        f = info["late"]
        rows.append(
            [LATE, f"{f['count']:,}", "; ".join(_sample(x) for x in f["samples"][:3]) or "-"]
        )
    return rows


def _episode(x: dict[str, Any]) -> str:
    """A two-owner episode: its group, its moments, its first and last moment."""

    def at(m: dict[str, Any]) -> str:
        return f"{m['time']} ({m['node']} seq {m['seq']}, to {m['consumer'] or '?'})"

    return (
        f"queue={x['queue']}, group={x['group_id']}: {x['moments']:,} moment(s) "
        f"from {at(x['first'])} to {at(x['last'])}"
    )


def _event_rows(r: dict[str, Any]) -> list[list[Any]]:
    """(event, count) rows: every event of the log format, settles by outcome, the
    redeliveries."""
    t = r["totals"]
    by_event, by_outcome = t["by_event"], t.get("by_outcome", {})
    rows: list[list[Any]] = []
    for name in EVENTS:
        rows.append([name.replace("_", "-"), by_event.get(name, 0)])
        if name == "dispatched":
            rows.append(["redeliveries (dispatches after a copy's first)", t["redeliveries"]])
        if name == "settled":
            for o in (*OUTCOMES, *sorted(set(by_outcome) - set(OUTCOMES))):
                rows.append([f"settled {o}", by_outcome.get(o, 0)])
    for reason, n in t.get("releases", {}).items():
        rows.append([f"group bindings released ({reason})", n])
    return rows


def _state_rows(r: dict[str, Any]) -> list[list[Any]]:
    """The unresolved copies at the end of the log, by state."""
    t = r["totals"]
    return [
        ["lost (fails the audit)", r["invariants"]["lost"]["count"]],
        [STILL_QUEUED, t["still_queued"]],
        [f"in flight (arrived in a node's last {r['grace_s']} s, --grace)", t["pending"]],
        ["parked in a dead-letter/expiry queue", t["parked"]],
        [f"{LATE}: forwarded to the group's owner", t.get("late", 0)],
    ]


def _us(v: float | None) -> str:
    if v is None:
        return "-"
    if v >= 1_000_000:
        return f"{v / 1_000_000:.2f} s"
    if v >= 1_000:
        return f"{v / 1_000:.2f} ms"
    return f"{v:.0f} µs"


def _n(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f}" if float(v).is_integer() else f"{v:,.2f}"


def summary(r: dict[str, Any]) -> str:
    """A few lines for the terminal."""
    t = r["totals"]
    lines = [
        f"delivery audit: {t['events']:,} events, {len(r['nodes'])} node(s), "
        f"{t['copies']:,} message copies, {t['groups']:,} groups, {t['consumers']:,} consumers",
    ]
    for name in INVARIANTS:
        c = r["invariants"][name]["count"]
        lines.append(f"  {'FAIL' if c else 'ok  '} {TITLES[name]}: {_count(r, name)}")
    lines.append(f"  info {STILL_QUEUED}: {t['still_queued']:,}")
    for what, count, _ in _info(r):
        lines.append(f"  info {what}: {count}")
    for name, lat in r["latency"].items():
        p = lat["percentiles_us"]
        lines.append(
            f"  receive -> {name}: p50 {_us(p.get('0.5'))}, p99 {_us(p.get('0.99'))}, "
            f"max {_us(lat['max_us'])}"
        )
    if r["info"]["seq_gaps"]:
        lines.append(f"  warning: records missing from the log (seq gaps): {r['info']['seq_gaps']}")
    if r.get("skipped_files"):
        lines.append(f"  warning: {len(r['skipped_files'])} bad file(s) skipped (--skip-bad-files)")
    lines.append("result: " + ("every invariant holds" if r["ok"] else "INVARIANT BROKEN"))
    return "\n".join(lines)


#: the columns of the worst-groups table (Markdown and HTML)
_WORST_HEADER = [
    "queue",
    "group",
    "messages",
    "p99 receive->settle",
    "max",
    "redeliveries",
    "order violations",
    "producer order",
    "two-owner episodes",
    "two-owner moments",
]


def _worst_row(g: dict[str, Any], *, thousands: bool) -> list[Any]:
    """One row of the worst-groups table; `thousands`: the message count as text with
    separators (Markdown) rather than the number (HTML right-aligns numbers)."""
    return [
        g["queue"],
        g["group_id"],
        f"{g['messages']:,}" if thousands else g["messages"],
        _us(g["p99_settle_us"]),
        _us(g["max_settle_us"]),
        g["redeliveries"],
        g["order_violations"],
        g.get("producer_order", 0),
        g.get("two_owner_episodes", 0),
        g["two_owner_moments"],
    ]


def _table(header: list[str], rows: list[list[Any]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def markdown(r: dict[str, Any]) -> str:
    t = r["totals"]
    parts = [
        "# Delivery audit",
        "",
        f"**{'PASS: every invariant holds' if r['ok'] else 'FAIL: invariant broken'}** "
        f"({r['generated']}, {r.get('elapsed_s', r['analysis_s'])} s)",
        "",
        f"{t['events']:,} events from {len(r['nodes'])} node(s) "
        f"({', '.join(r['nodes'])}); {t['copies']:,} message copies in {t['queues']} "
        f"queue(s), {t['groups']:,} groups, {t['consumers']:,} consumers; "
        f"{t['parked']:,} parked in dead-letter/expiry queues, {t['pending']:,} in flight "
        f"at the end of the log (grace {r['grace_s']} s), {t['still_queued']:,} still queued.",
        "",
        *_md_skipped(r),
        "## Invariants",
        "",
        _table(
            ["check", "count", "examples"],
            [[TITLES[name], _count(r, name), _examples(r, name)] for name in INVARIANTS],
        ),
        "",
        f"Informational: {r['info']['unrouted']['count']:,} received but never routed "
        "(rolled-back transactions, topics without subscribers); seq gaps "
        f"{r['info']['seq_gaps'] or 'none'}.",
        "",
        *([_table(["informational", "count", "examples"], _info(r)), ""] if _info(r) else []),
        "## Events",
        "",
        _table(["event", "count"], [[name, f"{n:,}"] for name, n in _event_rows(r)]),
        "",
        "## Messages not resolved at the end of the log",
        "",
        _table(["state", "copies"], [[name, f"{n:,}"] for name, n in _state_rows(r)]),
        "",
        "Still queued, examples: "
        + ("; ".join(_sample(x) for x in r["info"]["still_queued"]["samples"][:3]) or "-"),
        "",
        "## Latency",
        "",
        _table(
            ["from receive to", "count", "p50", "p90", "p99", "p99.9", "max", "mean"],
            [
                [f"first {name}", f"{lat['count']:,}"]
                + [_us(lat["percentiles_us"].get(p)) for p in ("0.5", "0.9", "0.99", "0.999")]
                + [_us(lat["max_us"]), _us(lat["mean_us"])]
                for name, lat in r["latency"].items()
            ],
        ),
        "",
        "## Consumers",
        "",
        f"{r['consumers']['count']} consumers; dispatches max/mean "
        f"{_n(r['consumers']['max_over_mean'])}, min/mean {_n(r['consumers']['min_over_mean'])}, "
        f"coefficient of variation {_n(r['consumers']['cv'])}.",
        "",
        _table(
            ["consumer", "dispatches", "accepted", "groups (approx.)"],
            [
                [c["consumer"], f"{c['dispatches']:,}", f"{c['accepted']:,}", f"{c['groups']:,}"]
                for c in r["consumers"]["rows"]
            ],
        ),
        "",
        "## Worst groups",
        "",
        _table(
            _WORST_HEADER,
            [_worst_row(g, thousands=True) for g in r["groups"]["worst"]],
        ),
        "",
    ]
    return "\n".join(parts)


def _md_skipped(r: dict[str, Any]) -> list[str]:
    skipped = r.get("skipped_files") or []
    if not skipped:
        return []
    return [
        "## Skipped files (--skip-bad-files)",
        "",
        *[f"- `{f['path']}`: {f['problem']}" for f in skipped],
        "",
    ]


def _sample(s: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in s.items() if k not in ("arrival_ts",))


# ----------------------------------------------------------------------------- plots
def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def plots(r: dict[str, Any]) -> dict[str, str]:
    """The three plots as data URIs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = {}
    fig, ax = plt.subplots(figsize=(7, 3.2))
    for name, color in (("dispatch", "#1f77b4"), ("settle", "#ff7f0e")):
        h = r["latency"][name]["histogram"]
        if h:
            edges, counts = _dense(h)
            ax.stairs(counts, edges, label=f"receive -> {name}", color=color, linewidth=1.5)
    ax.set_xscale("log")
    ax.set_xlabel("latency (µs, log scale)")
    ax.set_ylabel("messages")
    ax.set_title("Latency distribution")
    ax.legend()
    out["latency"] = _png(fig)

    rows = r["consumers"]["rows"]
    fig, ax = plt.subplots(figsize=(7, max(2.0, 0.28 * len(rows) + 1)))
    ax.barh(
        [c["consumer"] for c in rows][::-1], [c["dispatches"] for c in rows][::-1], color="#2ca02c"
    )
    ax.set_xlabel("dispatches")
    ax.set_title(f"Load per consumer (max/mean {_n(r['consumers']['max_over_mean'])})")
    out["consumers"] = _png(fig)

    h = r["groups"]["size_histogram"]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.bar(
        [f"{lo:,}-{hi - 1:,}" if hi - lo > 1 else f"{lo:,}" for lo, hi, _ in h],
        [c for _, _, c in h],
        color="#9467bd",
    )
    ax.set_yscale("log")
    ax.set_xlabel("messages per group")
    ax.set_ylabel("groups")
    ax.set_title("Group size distribution")
    ax.tick_params(axis="x", labelrotation=45)
    out["groups"] = _png(fig)
    return out


def _dense(h: list[list[float]]) -> tuple[list[float], list[float]]:
    """Contiguous bin edges and counts (empty buckets between as 0)."""
    edges = [h[0][0]]
    counts: list[float] = []
    for lo, hi, c in h:
        if abs(lo - edges[-1]) > 1e-9 * lo:
            counts.append(0)
            edges.append(lo)
        counts.append(c)
        edges.append(hi)
    return edges, counts


_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
h1 { margin-bottom: 0.2em; }
.badge { display: inline-block; padding: 0.3em 0.8em; border-radius: 4px; color: white;
         font-weight: bold; }
.pass { background: #2e7d32; } .fail { background: #c62828; }
table { border-collapse: collapse; margin: 0.8em 0; font-size: 0.92em; }
td, th { border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: left; }
th { background: #f3f3f3; }
td.num { text-align: right; } tr.bad td { background: #fdecea; }
.plots { display: flex; flex-wrap: wrap; gap: 1em; }
.muted { color: #666; font-size: 0.9em; }
"""


def html(r: dict[str, Any]) -> str:
    e = html_mod.escape
    t = r["totals"]
    p = plots(r)

    def table(header: list[str], rows: list[list[Any]], bad: list[bool] | None = None) -> str:
        head = "".join(f"<th>{e(h)}</th>" for h in header)
        body = []
        for i, row in enumerate(rows):
            cls = ' class="bad"' if bad and bad[i] else ""
            cells = "".join(
                f'<td class="num">{e(str(c))}</td>'
                if isinstance(c, int | float)
                else f"<td>{e(str(c))}</td>"
                for c in row
            )
            body.append(f"<tr{cls}>{cells}</tr>")
        return f"<table><tr>{head}</tr>{''.join(body)}</table>"

    inv_rows, inv_bad = [], []
    for name in INVARIANTS:
        f = r["invariants"][name]
        inv_rows.append([TITLES[name], _count(r, name), _examples(r, name)])
        inv_bad.append(f["count"] > 0)
    lat_rows = [
        [f"first {name}", lat["count"]]
        + [_us(lat["percentiles_us"].get(q)) for q in ("0.5", "0.9", "0.99", "0.999")]
        + [_us(lat["max_us"]), _us(lat["mean_us"])]
        for name, lat in r["latency"].items()
    ]
    worst = r["groups"]["worst"]
    c = r["consumers"]
    still = "; ".join(_sample(x) for x in r["info"]["still_queued"]["samples"][:3]) or "-"
    skipped = ""
    if r.get("skipped_files"):
        items = "".join(
            f"<li><code>{e(f['path'])}</code>: {e(f['problem'])}</li>" for f in r["skipped_files"]
        )
        skipped = f"<h2>Skipped files (--skip-bad-files)</h2><ul>{items}</ul>"
    badge = (
        '<span class="badge pass">PASS: every invariant holds</span>'
        if r["ok"]
        else '<span class="badge fail">FAIL: invariant broken</span>'
    )
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>amqbroker delivery audit</title>
<style>{_CSS}</style></head><body>
<h1>Delivery audit</h1>
<p>{badge} <span class="muted">{e(r["generated"])} &middot; {r.get("elapsed_s", r["analysis_s"])} s
&middot; inputs: {e(", ".join(r.get("inputs", [])))}</span></p>
<p>{t["events"]:,} events from {len(r["nodes"])} node(s) ({e(", ".join(r["nodes"]))});
{t["copies"]:,} message copies in {t["queues"]} queue(s), {t["groups"]:,} groups,
{t["consumers"]:,} consumers; {t["parked"]:,} parked in dead-letter/expiry queues,
{t["pending"]:,} in flight at the end of the log (grace {r["grace_s"]} s),
{t["still_queued"]:,} still queued.</p>
{skipped}
<h2>Invariants</h2>
{table(["check", "count", "examples"], inv_rows, inv_bad)}
<p class="muted">Informational: {r["info"]["unrouted"]["count"]:,} received but never routed
(rolled-back transactions, topics without subscribers); seq gaps
{e(str(r["info"]["seq_gaps"] or "none"))}.</p>
{table(["informational", "count", "examples"], _info(r)) if _info(r) else ""}
<h2>Events</h2>
{table(["event", "count"], _event_rows(r))}
<h2>Messages not resolved at the end of the log</h2>
{
        table(
            ["state", "copies"],
            _state_rows(r),
            [r["invariants"]["lost"]["count"] > 0, False, False, False, False],
        )
    }
<p class="muted">Still queued, examples: {e(still)}</p>
<h2>Latency</h2>
{table(["from receive to", "count", "p50", "p90", "p99", "p99.9", "max", "mean"], lat_rows)}
<div class="plots"><img alt="latency distribution" src="{p["latency"]}">
<img alt="group size distribution" src="{p["groups"]}"></div>
<h2>Consumers</h2>
<p>{c["count"]} consumers; dispatches max/mean {_n(c["max_over_mean"])}, min/mean
{_n(c["min_over_mean"])}, coefficient of variation {_n(c["cv"])}.</p>
<div class="plots"><img alt="load per consumer" src="{p["consumers"]}">
{
        table(
            ["consumer", "dispatches", "accepted", "groups"],
            [[x["consumer"], x["dispatches"], x["accepted"], x["groups"]] for x in c["rows"][:15]],
        )
    }
</div>
<h2>Worst groups</h2>
{
        table(
            _WORST_HEADER,
            [_worst_row(g, thousands=False) for g in worst],
            [
                bool(g["order_violations"] or g.get("producer_order") or g["two_owner_moments"])
                for g in worst
            ],
        )
    }
</body></html>
"""
