#!/usr/bin/env python3
"""Soak test: half the maximum throughput for a long time, with connection churn, and
watch the broker's memory and file descriptors.

    .venv/bin/python scripts/soak.py                      # 10 minutes, starts a broker
    .venv/bin/python scripts/soak.py --duration 3600 --port 5672   # a broker you run

Not a test (nothing in CI runs it); it prints a table and a verdict and exits 1 when
the broker grows.

1. Measure: one `scripts/perf.py` run as fast as possible (PRODUCERS producers,
   CONSUMERS consumers, --groups groups, at-least-once) gives the maximum rate.
2. Load: `--loops` parallel loops each run `perf.py --rate R --count N` lasting
   `--churn` seconds, so every producer and consumer connection is replaced every
   few seconds (new processes, new connections, new links); the loops are staggered
   so the load never stops, and N is sized from the previous run's wall time
   (process start-up included) so the average is half the maximum. Every run must
   end with every message received and no error. The msgs column grows when a run
   ends, so the per-sample rate is lumpy; the average is printed at the end.
3. Sample: every `--sample` seconds, the broker's VmRSS (/proc/<pid>/status) and open
   file descriptors (/proc/<pid>/fd), and the messages moved so far.
4. Verdict: the median of the last third of the samples against the median of the
   middle third (the first third is warm-up: allocator arenas, caches). "flat" when
   RSS grew less than --rss-tolerance (default 5 %) and the descriptor count by at
   most --fd-tolerance (default 4: connections in churn); "growing" otherwise. After
   the load, one more sample once the broker is idle shows the descriptors going back
   to the listener's few.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PERF = ROOT / "scripts" / "perf.py"


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def start_broker(data_dir: Path) -> tuple[subprocess.Popen[bytes], int]:
    out = data_dir / "broker.out"
    with out.open("wb") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "amqbroker", "run", "--port", "0", "--data-dir", str(data_dir)],
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if m := re.search(r"listening on amqp://[^\s;]+:(\d+)", out.read_text(errors="replace")):
            return proc, int(m.group(1))
        if proc.poll() is not None:
            raise SystemExit(f"the broker exited: {out.read_text(errors='replace')}")
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("the broker did not start within 30 s")


def perf(args: argparse.Namespace, *extra: str) -> dict[str, object]:
    cmd = [
        sys.executable,
        str(PERF),
        "--port",
        str(args.port),
        "--broker-pid",
        str(args.pid),
        "--runs",
        "1",
        "--json",
        "--producers",
        str(args.producers),
        "--consumers",
        str(args.consumers),
        "--groups",
        str(args.groups),
        *extra,
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, check=False)
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("{"):
            row: dict[str, object] = json.loads(line)
            return row
    raise RuntimeError(f"perf.py printed no result (rc {p.returncode}): {p.stderr[-2000:]}")


class Load:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.moved = 0
        self.runs = 0
        self.failed: list[str] = []
        self.stop = threading.Event()

    def loop(self, args: argparse.Namespace, rate: float, delay: float) -> None:
        time.sleep(delay)
        wall = args.churn + 2.0  # a run's wall time, process start-up included
        while not self.stop.is_set():
            # each run sends `count` in about `churn` seconds, then the next starts its
            # processes: size it so that count / wall time is this loop's share
            count = max(int(rate * wall), 10)
            t = time.monotonic()
            row = perf(args, "--rate", f"{count / args.churn:.1f}", "--count", str(count))
            wall = time.monotonic() - t
            with self.lock:
                self.runs += 1
                self.moved += int(row.get("received") or 0)  # type: ignore[call-overload]
                if not row.get("ok"):
                    self.failed.append(str(row.get("first_error") or row.get("run_error")))


def verdict(samples: list[tuple[float, int, int, int]], args: argparse.Namespace) -> bool:
    third = len(samples) // 3
    middle = samples[third : 2 * third]
    last = samples[2 * third :]
    rss_mid = statistics.median(s[1] for s in middle)
    rss_last = statistics.median(s[1] for s in last)
    fd_mid = statistics.median(s[2] for s in middle)
    fd_last = statistics.median(s[2] for s in last)
    growth = (rss_last - rss_mid) / rss_mid * 100
    print(
        f"RSS median: middle third {rss_mid / 1024:.1f} MiB, last third "
        f"{rss_last / 1024:.1f} MiB ({growth:+.1f} %); fds median: middle {fd_mid:.0f}, "
        f"last {fd_last:.0f}"
    )
    flat = growth < args.rss_tolerance and fd_last - fd_mid <= args.fd_tolerance
    print(f"verdict: {'flat' if flat else 'growing'}")
    return flat


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--duration", type=float, default=600.0, help="load seconds (600)")
    ap.add_argument("--sample", type=float, default=5.0, help="seconds between samples (5)")
    ap.add_argument("--churn", type=float, default=4.0, help="seconds per connection (4)")
    ap.add_argument("--loops", type=int, default=2, help="staggered load loops (2)")
    ap.add_argument("--producers", type=int, default=2)
    ap.add_argument("--consumers", type=int, default=2)
    ap.add_argument("--groups", type=int, default=100, help="group ids (100)")
    ap.add_argument("--rate", type=float, default=0, help="total msgs/s (default: max / 2)")
    ap.add_argument("--port", type=int, default=0, help="a running broker (default: start one)")
    ap.add_argument("--pid", type=int, default=0, help="its pid (with --port)")
    ap.add_argument("--rss-tolerance", type=float, default=5.0, help="percent (5)")
    ap.add_argument("--fd-tolerance", type=int, default=4, help="descriptors (4)")
    args = ap.parse_args()

    broker = None
    tmp = None
    if not args.port:
        tmp = tempfile.TemporaryDirectory(prefix="amqbroker-soak-")
        broker, args.port = start_broker(Path(tmp.name))
        args.pid = broker.pid
    elif not args.pid:
        ap.error("--port needs --pid (to read /proc/<pid>)")
    try:
        if not args.rate:
            row = perf(args, "--count", "100000")
            top = float(row["msgs_per_s"])  # type: ignore[arg-type]
            args.rate = top / 2
            print(f"maximum: {top:.0f} msgs/s; soak at {args.rate:.0f} msgs/s")
        print(
            f"soak: {args.duration:.0f} s at {args.rate:.0f} msgs/s, {args.loops} loops of "
            f"{args.producers} producers + {args.consumers} consumers reconnecting every "
            f"{args.churn:.0f} s, {args.groups} groups; broker pid {args.pid}"
        )
        load = Load()
        threads = [
            threading.Thread(
                target=load.loop,
                args=(args, args.rate / args.loops, i * args.churn / args.loops),
                daemon=True,
            )
            for i in range(args.loops)
        ]
        for t in threads:
            t.start()
        samples: list[tuple[float, int, int, int]] = []
        t0 = time.monotonic()
        print(f"{'t (s)':>7} {'RSS (MiB)':>10} {'fds':>5} {'msgs':>10} {'msgs/s':>8}")
        last_moved, last_t = 0, t0
        while (now := time.monotonic()) - t0 < args.duration:
            time.sleep(args.sample)
            now = time.monotonic()
            with load.lock:
                moved = load.moved
            s = (now - t0, rss_kb(args.pid), fd_count(args.pid), moved)
            samples.append(s)
            rate = (moved - last_moved) / (now - last_t)
            last_moved, last_t = moved, now
            print(f"{s[0]:7.0f} {s[1] / 1024:10.1f} {s[2]:5d} {s[3]:10d} {rate:8.0f}", flush=True)
        load.stop.set()
        for t in threads:
            t.join()
        time.sleep(2)
        print(
            f"idle after the load: RSS {rss_kb(args.pid) / 1024:.1f} MiB, fds {fd_count(args.pid)}"
        )
        elapsed = time.monotonic() - t0
        print(
            f"{load.runs} perf runs (each one reconnects every producer and consumer), "
            f"{load.moved} messages, {load.moved / elapsed:.0f} msgs/s on average, "
            f"{len(load.failed)} failed runs"
        )
        for f in load.failed[:5]:
            print(f"  failed run: {f}")
        flat = verdict(samples, args)
        return 0 if flat and not load.failed else 1
    finally:
        if broker is not None:
            broker.terminate()
            try:
                broker.wait(30)
            except subprocess.TimeoutExpired:
                broker.kill()
        if tmp is not None:
            tmp.cleanup()


if __name__ == "__main__":
    sys.exit(main())
