"""The load client's options and scenarios (argparse), and how work is split.

`parse_args` validates everything before a process is started: a bad combination is
an argparse error naming the options. `producer_segments` gives each producer its
share of the messages and its own block of group ids, so every group has exactly one
sender and a well-defined order.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from typing import Any

from amqbroker.tools.perf.encoding import DEFAULT_SELECTOR, MIN_SIZE, NO_GROUP
from amqbroker.tools.perf.stats import split_evenly

#: hol-strict.# gets group_skip_ahead=false when --start-broker starts amqbroker
HOL_STRICT_PREFIX = "hol-strict."
#: producers prebuild the properties of up to this many groups (~60 B each)
GROUP_HEAD_CACHE = 200_000
#: below this many bound groups, RSS growth per group is noise (not reported)
RSS_PER_GROUP_MIN = 100_000
HOL_GROUPED = 100
HOL_UNGROUPED = 1000
HOL_FAST_CONSUMERS = 3


@dataclass(frozen=True)
class Scenario:
    name: str
    what: str
    kind: str = "flow"  # flow | hol | mem
    count: int = 200_000
    size: int = 100
    producers: int = 1
    consumers: int = 1
    groups: int = 0
    durable: bool = False
    presettled: bool = False
    rate: float = 0.0


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("A", "1 producer -> 1 consumer, 100 B, at-least-once"),
        Scenario("C", "1 producer -> 4 consumers", consumers=4),
        Scenario("D", "presettled sends", presettled=True),
        Scenario("E", "durable messages", durable=True),
        Scenario("L", "fixed 1,000 msgs/s, latency", rate=1000.0, count=10_000),
        Scenario("G1K", "1 -> 4 consumers, 1,000 groups", consumers=4, groups=1000),
        Scenario("G100K", "1 -> 4 consumers, 100,000 groups", consumers=4, groups=100_000),
        Scenario(
            "G1M",
            "1 -> 4 consumers, 1,000,000 groups",
            consumers=4,
            groups=1_000_000,
            count=1_000_000,
        ),
        Scenario("HOL", "head-of-line: slow group owner at the head", kind="hol", consumers=4),
        Scenario("MEM", "1,000,000 queued messages, no consumer", kind="mem", count=1_000_000),
    )
}

#: --order: how the runs of several scenarios follow each other (`run_plan`)
ORDERS = ("interleaved", "by-scenario")


def run_plan(scenarios: list[Scenario], runs: int, order: str) -> list[tuple[Scenario, int]]:
    """The (scenario, run number) pairs in the order they run: round by round
    (``interleaved``), or every run of one scenario before the next (``by-scenario``)."""
    if order == "by-scenario":
        return [(sc, run) for sc in scenarios for run in range(1, runs + 1)]
    return [(sc, run) for run in range(1, runs + 1) for sc in scenarios]


#: options that, given explicitly, override a scenario's value
_OVERRIDABLE = (
    "count",
    "size",
    "producers",
    "consumers",
    "groups",
    "durable",
    "presettled",
    "rate",
)


def build_parser(prog: str = "perf.py") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=prog,
        description="amqbroker's benchmark: a fast multi-process AMQP 1.0 load client "
        "(Proton's cffi layer) printing msgs/s, latency, broker CPU and RSS.",
        epilog="Scenarios: "
        + "; ".join(f"{s.name}: {s.what}" for s in SCENARIOS.values())
        + ". See the module docstring for details.",
    )
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=5672)
    ap.add_argument(
        "--address", default="perf", help="queue name base (a unique suffix is added per run)"
    )
    ap.add_argument("--address-prefix", default="", help="e.g. /queue/ for RabbitMQ 3.x")
    ap.add_argument("--scenario", default=None, help="comma-separated: " + ",".join(SCENARIOS))
    ap.add_argument("--count", type=int, default=None, help="messages per run (default 200000)")
    ap.add_argument(
        "--size", type=int, default=None, help=f"body bytes (>= {MIN_SIZE}; default 100)"
    )
    ap.add_argument("--producers", type=int, default=None, help="producer processes (default 1)")
    ap.add_argument("--consumers", type=int, default=None, help="consumer processes (default 1)")
    ap.add_argument(
        "--groups", type=int, default=None, help="group ids to cycle over (0 = ungrouped)"
    )
    ap.add_argument("--durable", action="store_true", default=None, help="header durable=true")
    ap.add_argument("--presettled", action="store_true", default=None, help="presettled sends")
    ap.add_argument(
        "--rate", type=float, default=None, help="fixed total msgs/s (0 = as fast as possible)"
    )
    ap.add_argument(
        "--selector",
        nargs="?",
        const=DEFAULT_SELECTOR,
        default=None,
        metavar="TEXT",
        help="every consumer attaches with this JMS selector (jms-selector filter); producers "
        f"add application properties kind='load', n=<index> (default {DEFAULT_SELECTOR!r}, "
        "which matches every message)",
    )
    ap.add_argument(
        "--app-props",
        action="store_true",
        help="producers add the --selector application properties, consumers no selector "
        "(the baseline that isolates the filter's cost)",
    )
    ap.add_argument(
        "--txn-batch",
        type=int,
        default=0,
        metavar="N",
        help="producers send in local transactions of N messages (declare, N transfers, "
        "discharge, wait for its outcome; 0 = none)",
    )
    ap.add_argument("--window", type=int, default=1000, help="producer max unsettled (1000)")
    ap.add_argument("--credit", type=int, default=1000, help="consumer credit (1000)")
    ap.add_argument("--runs", type=int, default=3, help="runs per scenario (3)")
    ap.add_argument(
        "--order",
        choices=ORDERS,
        default="interleaved",
        help="interleaved (default): run 1 of every scenario, then run 2 of every "
        "scenario, ...: scenarios compared within one invocation see the same drift of "
        "a shared machine; by-scenario: all runs of the first scenario, then the next",
    )
    ap.add_argument(
        "--warmup",
        type=int,
        default=10_000,
        help="messages of a discarded first run of A (10000; 0 = none)",
    )
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per run phase (300)")
    ap.add_argument("--json", action="store_true", help="one JSON line per run on stdout")
    ap.add_argument("--label", default=None, help="name of the broker in the output")
    ap.add_argument(
        "--broker-pid", type=int, default=None, help="default: the local listener on --port"
    )
    ap.add_argument(
        "--start-broker", action="store_true", help="start amqbroker (--port 0, temp data dir)"
    )
    ap.add_argument(
        "--broker-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="with --start-broker: a setting for the broker as an environment variable "
        "(e.g. AMQBROKER_TRACING=true); repeatable",
    )
    ap.add_argument(
        "--ceiling", action="store_true", help="measure the client against an in-script null broker"
    )
    ap.add_argument(
        "--hol-hold-ms", type=float, default=10.0, help="HOL: slow consumer's time per message"
    )
    ap.add_argument("--user", default=None, help="SASL PLAIN user (default ANONYMOUS)")
    ap.add_argument("--password", default=None)
    ap.add_argument("--no-sasl", action="store_true", help="no SASL layer")
    ap.add_argument(
        "--report", nargs="+", metavar="NAME=FILE", help="combine --json files into a table"
    )
    ap.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a live line on stderr while a run is under way (default: when stderr is a terminal)",
    )
    ap.add_argument(
        "--summary", action="store_true", help="print the summary table even after one run"
    )
    return ap


def url_defaults(url: str) -> dict[str, Any]:
    """--host, --port (and --user, --password) from an amqp:// URL; ValueError if bad."""
    from urllib.parse import unquote, urlsplit

    parts = urlsplit(url if "://" in url else "amqp://" + url)
    if parts.scheme != "amqp":
        raise ValueError(
            f"the load client speaks plain AMQP (amqp://host:port), not {parts.scheme}://; "
            "give a plain listener"
        )
    try:
        port = parts.port or 5672
    except ValueError:
        raise ValueError(f"bad port in {url!r}") from None
    out: dict[str, Any] = {"host": parts.hostname or "127.0.0.1", "port": port}
    if parts.username:
        out["user"] = unquote(parts.username)
    if parts.password:
        out["password"] = unquote(parts.password)
    return out


def parse_args(
    argv: list[str] | None = None,
    *,
    prog: str = "perf.py",
    defaults: dict[str, Any] | None = None,
) -> argparse.Namespace:
    """Parse and check the options; `defaults` (e.g. from --url / AMQBROKER_URL) apply
    where an option is not given."""
    ap = build_parser(prog)
    if defaults:
        ap.set_defaults(**defaults)
    args = ap.parse_args(argv)
    if args.report:
        return args
    if args.start_broker and args.ceiling:
        ap.error("--start-broker and --ceiling exclude each other")
    try:
        args.scenarios = resolve_scenarios(args)
    except ValueError as exc:
        ap.error(str(exc))
    if args.ceiling:
        bad = [s.name for s in args.scenarios if s.kind != "flow"]
        if bad:
            ap.error(f"--ceiling does not apply to {','.join(bad)} (needs a real queue)")
    if args.window < 1 or args.credit < 1 or args.runs < 1:
        ap.error("--window, --credit and --runs must be >= 1")
    if args.txn_batch < 0:
        ap.error("--txn-batch must be >= 0")
    if args.selector is not None and not args.selector.strip():
        ap.error("--selector must not be empty")
    if args.ceiling and args.txn_batch:
        ap.error("--txn-batch needs a real broker (the null broker has no coordinator)")
    return args


def variant(args: argparse.Namespace) -> str:
    """Suffix of the scenario name for the JMS feature options ('' for a plain run)."""
    out = ""
    if args.selector:
        out += "+sel"
    elif args.app_props:
        out += "+props"
    if args.txn_batch:
        out += f"+txn{args.txn_batch}"
    return out


def resolve_scenarios(args: argparse.Namespace) -> list[Scenario]:
    """The scenarios to run, with explicitly given options applied; ValueError if bad."""
    overrides = {k: getattr(args, k) for k in _OVERRIDABLE if getattr(args, k) is not None}
    if args.scenario:
        names = [n.strip().upper() for n in args.scenario.split(",") if n.strip()]
        unknown = [n for n in names if n not in SCENARIOS]
        if unknown:
            raise ValueError(
                f"unknown scenario(s) {','.join(unknown)}; known: {','.join(SCENARIOS)}"
            )
        chosen = [replace(SCENARIOS[n], **overrides) for n in names]
    else:
        chosen = [replace(Scenario("custom", "from the options"), **overrides)]
    for s in chosen:
        if s.size < MIN_SIZE:
            raise ValueError(f"--size must be at least {MIN_SIZE} (the body carries the timestamp)")
        if s.count < 1 or s.producers < 1 or s.consumers < 1 or s.groups < 0 or s.rate < 0:
            raise ValueError(
                "--count, --producers, --consumers must be >= 1; --groups, --rate >= 0"
            )
        if 0 < s.groups < s.producers:
            raise ValueError(
                "--groups must be 0 or at least --producers (each producer owns its groups)"
            )
        if s.groups >= NO_GROUP:
            raise ValueError("--groups is too large")
    return chosen


def producer_segments(count: int, groups: int, producers: int) -> list[list[dict[str, int]]]:
    """Per producer, the segments it sends: its share of the messages, cycling over its
    own block of group ids (so each group has one sender and a well-defined order)."""
    counts = split_evenly(count, producers)
    if groups == 0:
        return [[{"n": n}] for n in counts]
    gcounts = split_evenly(groups, producers)
    out, base = [], 0
    for n, g in zip(counts, gcounts, strict=True):
        out.append([{"n": n, "groups": g, "gbase": base, "gseq0": 0}])
        base += g
    return out
