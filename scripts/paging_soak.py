#!/usr/bin/env python3
"""Paging soak (not a test): many queued messages behind a small memory limit.

    .venv/bin/python scripts/paging_soak.py                       # 1,000,000 x 1 KiB, 64 MiB
    .venv/bin/python scripts/paging_soak.py --count 100000 --limit-mib 16

Starts a broker subprocess (a fresh data directory) whose addresses all have
``max_size_bytes = --limit-mib`` and ``address_full_policy = "PAGE"``, produces
``--count`` messages of ``--size`` bytes to one queue with no consumer attached, then
attaches one consumer and drains it. Broker RSS (VmRSS) is sampled every 100 ms from
/proc throughout; what is printed: produce and drain rates, the peak RSS during each
phase and the broker's own high-water mark (VmHWM), and the consumer's order check.

All messages carry one group id with consecutive group sequences, so the consumer
(scripts/perf.py's load client) counts every message that arrives out of order. The
load client, broker start-up and RSS sampling are those of scripts/perf.py
(amqbroker/tools/perf/). Exits 1 if
anything was lost, out of order or rejected, or if the peak RSS exceeded
``limit + --margin-mib``.
"""

from __future__ import annotations

import argparse
import sys
import time
from types import SimpleNamespace
from typing import Any


def _perf() -> Any:
    """The pieces of the load client (amqbroker.tools.perf) this script uses."""
    from amqbroker.tools.perf import broker, options, runner, stats, status

    return SimpleNamespace(
        parse_args=options.parse_args,
        producer_segments=options.producer_segments,
        start_broker=broker.start_broker,
        Fleet=runner.Fleet,
        _sum_producers=runner._sum_producers,
        _consumer_results=runner._consumer_results,
        RssSampler=stats.RssSampler,
        proc_rss_kb=stats.proc_rss_kb,
        F_STATE=status.F_STATE,
        F_COUNT=status.F_COUNT,
        ST_DONE=status.ST_DONE,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=1_000_000)
    ap.add_argument("--size", type=int, default=1024, help="body bytes (default 1024)")
    ap.add_argument("--limit-mib", type=int, default=64, help="max_size_bytes in MiB")
    ap.add_argument(
        "--margin-mib",
        type=int,
        default=112,
        help="RSS allowed beyond the limit, the idle process included (112)",
    )
    ap.add_argument("--durable", action="store_true", help="durable messages")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per phase")
    a = ap.parse_args(argv)
    perf = _perf()
    limit = a.limit_mib << 20
    settings = f'{{"#": {{"max_size_bytes": {limit}, "address_full_policy": "PAGE"}}}}'
    pargs = perf.parse_args(
        [
            "--start-broker",
            "--broker-env",
            f"AMQBROKER_ADDRESS_SETTINGS={settings}",
            "--broker-env",
            f"AMQBROKER_GLOBAL_MAX_SIZE={limit}",
            "--count",
            str(a.count),
            "--size",
            str(a.size),
            "--groups",
            "1",
            "--timeout",
            str(a.timeout),
        ]
    )
    target = perf.start_broker(pargs)
    try:
        return run(perf, pargs, target, a, limit)
    finally:
        target.stop()


def run(perf: Any, pargs: Any, target: Any, a: Any, limit: int) -> int:
    pid = target.pid
    rss0 = perf.proc_rss_kb(pid)
    with perf.Fleet(pargs, target, "soak", 2) as fleet:
        producer = fleet.spawn(
            "producer",
            producer_id=0,
            size=a.size,
            durable=a.durable,
            segments=perf.producer_segments(a.count, 1, 1)[0],
        )
        fleet.wait_ready([producer])
        with perf.RssSampler(pid) as rss_in:
            t0 = time.monotonic()
            fleet.send([producer], "go")
            fleet.wait(
                f"{a.count} messages to be queued",
                lambda: fleet.slot(producer)[perf.F_STATE] == perf.ST_DONE,
                a.timeout,
            )
            t1 = time.monotonic()
        queued_rss = perf.proc_rss_kb(pid)
        with perf.RssSampler(pid) as rss_out:
            t2 = time.monotonic()
            consumer = fleet.spawn("consumer", size=a.size)
            fleet.wait(
                "the queue to drain",
                lambda: fleet.slot(consumer)[perf.F_COUNT] >= a.count,
                a.timeout,
            )
            t3 = time.monotonic()
        fleet.stop()
        sent = perf._sum_producers([producer])
        got = perf._consumer_results(fleet, [consumer], check_groups=True)
    hwm = perf.proc_rss_kb(pid, "VmHWM")
    peak = max(rss_in.max_kb, rss_out.max_kb, hwm or 0)
    mib = 1024.0
    print(
        f"paging soak: {a.count:,} x {a.size} B, limit {limit >> 20} MiB (PAGE), "
        f"{'durable' if a.durable else 'non-durable'} messages"
    )
    print(f"  broker RSS at start      {rss0 / mib:8.1f} MiB")
    print(
        f"  produce                  {a.count / (t1 - t0):10,.0f} msgs/s "
        f"({t1 - t0:.1f} s), peak RSS {rss_in.max_kb / mib:.1f} MiB"
    )
    print(f"  RSS with all queued      {(queued_rss or 0) / mib:8.1f} MiB")
    print(
        f"  drain                    {a.count / (t3 - t2):10,.0f} msgs/s "
        f"({t3 - t2:.1f} s), peak RSS {rss_out.max_kb / mib:.1f} MiB"
    )
    print(f"  broker VmHWM             {(hwm or 0) / mib:8.1f} MiB")
    print(
        f"  sent {sent['sent']}, accepted {sent['acked']}, not accepted "
        f"{sent['not_accepted']}, errors {sent['producer_errors']}; "
        f"received {got['received']}, out of order {got['order_violations']}, "
        f"group check {got.get('group_check')}"
    )
    bound = (limit >> 10) + (a.margin_mib << 10)
    ok = (
        got["received"] == a.count
        and got["order_violations"] == 0
        and sent["acked"] == a.count
        and not sent["not_accepted"]
        and not sent["producer_errors"]
        and peak <= bound
    )
    print(
        f"  peak RSS {peak / mib:.1f} MiB vs limit + margin {bound / mib:.0f} MiB: "
        f"{'ok' if ok else 'FAILED'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
