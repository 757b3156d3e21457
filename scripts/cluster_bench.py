#!/usr/bin/env python3
"""Clustered grouping benchmark (issue 15; docs/PERFORMANCE.md "Cluster"). Not a test.

Starts broker processes on 127.0.0.1 (fresh data directories under a temp dir) and
drives them with the load client of `amqbroker perf` (amqbroker/tools/perf: one OS
process per producer / consumer, hand-encoded messages, latency and group checks in
the consumers). Every group has one producer (its own block of group ids), so order
per group is defined and checked; a group reaching two consumers counts as a split.

Setups, each run --runs times with the same total of producers and consumers:

  single        one plain broker (no cluster); all producers and consumers on it
  cluster-local three nodes (node1 = LOCAL arbiter); one producer and one consumer per
                node: every new group is proposed (node1 decides locally, node2/node3
                ask node1) and, local consumers first, lands on its entry node
  cluster-fwd   three nodes; producers on every node, all consumers on node1: the
                groups entering node2/node3 are bound to node1 and every message of
                them is forwarded over the bridges (store-and-forward)

Measured: msgs/s (first send -> last receive, all nodes), latency p50/p99, CPU of all
broker processes per message (and of each node), and the proposal latency every node
recorded (time from proposing a new group to the arbiter's answer, `clusterStatus`
"proposals": on node1 a local decision including the decision log's fsync, on
node2/node3 the round trip to node1). Usage::

    .venv/bin/python scripts/cluster_bench.py                 # all setups, defaults
    .venv/bin/python scripts/cluster_bench.py --count 30000 --groups 1000 --runs 2
    .venv/bin/python scripts/cluster_bench.py --setups cluster-local --groups 20000
    .venv/bin/python scripts/cluster_bench.py --setups cluster-local --groups 3000 \
        --count 3000 --rate 300                   # proposals spread out, no burst
    .venv/bin/python scripts/cluster_bench.py --setups cluster-fwd --runs 1 \
        --profile /tmp/prof                       # py-spy samples of every broker

`--profile DIR` attaches `py-spy record --format raw` (pip install py-spy) to every
broker while the messages flow: collapsed stacks, one file per node, a line per stack
with its sample count.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from amqbroker.tools.management_client import request
from amqbroker.tools.perf.broker import LISTENING_RE, RunError, Target
from amqbroker.tools.perf.options import parse_args, producer_segments
from amqbroker.tools.perf.runner import Fleet, _consumer_results, _finish, _sum_producers
from amqbroker.tools.perf.stats import machine_busy_seconds, proc_cpu_seconds
from amqbroker.tools.perf.status import F_AUX, F_COUNT, F_STATE, ST_DONE

NODES = ("node1", "node2", "node3")
SETUPS = ("single", "cluster-local", "cluster-fwd")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Brokers:
    """Broker processes of one setup: {name: (proc, port)}; stopped on exit."""

    def __init__(self, root: Path, cluster: bool, env_extra: dict[str, str]) -> None:
        self.root = root
        self.cluster = cluster
        self.env_extra = env_extra
        self.names = NODES if cluster else ("single",)
        self.ports = {n: free_port() for n in self.names}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def _env(self, n: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("AMQBROKER_")}
        env["PYTHONUNBUFFERED"] = "1"
        if self.cluster:
            env["AMQBROKER_CLUSTER_NODE_ID"] = n
            env["AMQBROKER_CLUSTER_PEERS"] = ",".join(
                f"{p}=127.0.0.1:{self.ports[p]}" for p in self.names if p != n
            )
            env["AMQBROKER_CLUSTER_GROUPING"] = "LOCAL" if n == "node1" else "REMOTE"
        env.update(self.env_extra)
        return env

    def __enter__(self) -> Brokers:
        for n in self.names:
            d = self.root / n
            d.mkdir(parents=True)
            cmd = [sys.executable, "-m", "amqbroker", "run", "--host", "127.0.0.1"]
            cmd += ["--port", str(self.ports[n]), "--data-dir", str(d / "data")]
            with open(d / "broker.log", "wb") as fe:
                self.procs[n] = subprocess.Popen(
                    cmd,
                    stdout=subprocess.DEVNULL,
                    stderr=fe,
                    stdin=subprocess.DEVNULL,
                    env=self._env(n),
                    cwd=d,
                )
        deadline = time.monotonic() + 60
        for n in self.names:
            log = self.root / n / "broker.log"
            while not LISTENING_RE.search(log.read_text(errors="replace")):
                if self.procs[n].poll() is not None or time.monotonic() > deadline:
                    raise RunError(f"{n} did not start:\n{log.read_text(errors='replace')}")
                time.sleep(0.05)
        if self.cluster:
            self.wait_linked(deadline)
        return self

    def url(self, n: str) -> str:
        return f"amqp://127.0.0.1:{self.ports[n]}"

    def status(self, n: str) -> dict[str, Any]:
        return dict(request(self.url(n), "clusterStatus", type="org.amqbroker.cluster"))

    def wait_linked(self, deadline: float) -> None:
        for n in self.names:
            while True:
                st = self.status(n)
                if all(p["link"] == "up" for p in st["peers"]) and st["arbiter"] == "node1":
                    break
                if time.monotonic() > deadline:
                    raise RunError(f"{n} is not linked: {st}")
                time.sleep(0.05)

    def cpu(self) -> float:
        return sum(self.cpu_by_node().values())

    def cpu_by_node(self) -> dict[str, float]:
        return {n: proc_cpu_seconds(p.pid) for n, p in self.procs.items()}

    def profile(self, out: str, tag: str) -> list[subprocess.Popen[bytes]]:
        """py-spy samplers attached to every broker (collapsed stacks, one file each)."""
        Path(out).mkdir(parents=True, exist_ok=True)
        spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or "py-spy"
        spies = []
        for n, p in self.procs.items():
            cmd = [spy, "record", "--pid", str(p.pid), "--format", "raw", "--rate", "500"]
            cmd += ["--nonblocking", "-o", str(Path(out) / f"{tag}-{n}.txt")]
            spies.append(
                subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            )
        time.sleep(1.0)  # py-spy attaches
        return spies

    def __exit__(self, *exc: object) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()


def stop_profiles(spies: list[subprocess.Popen[bytes]]) -> None:
    for s in spies:
        s.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
    for s in spies:
        try:
            s.wait(timeout=30)
        except subprocess.TimeoutExpired:
            s.kill()


def placement(setup: str, producers: int, consumers: int) -> tuple[list[str], list[str]]:
    """The node of each producer and of each consumer."""
    if setup == "single":
        return ["single"] * producers, ["single"] * consumers
    pnodes = [NODES[i % 3] for i in range(producers)]
    if setup == "cluster-fwd":
        return pnodes, ["node1"] * consumers
    return pnodes, [NODES[i % 3] for i in range(consumers)]


def run_once(
    args: argparse.Namespace, perf: argparse.Namespace, b: Brokers, setup: str, run: int
) -> dict[str, Any]:
    address = f"bench-{setup}-{run}-{os.getpid()}"
    pnodes, cnodes = placement(setup, args.producers, args.consumers)
    target = Target("127.0.0.1", b.ports[b.names[0]], None, setup)
    row: dict[str, Any] = {"setup": setup, "run": run, "count": args.count, "rate": args.rate}
    row |= {"groups": args.groups, "producers": args.producers, "consumers": args.consumers}
    with Fleet(perf, target, address, len(pnodes) + len(cnodes)) as fleet:
        consumers = [
            fleet.spawn("consumer", port=b.ports[n], size=args.size, durable=args.durable)
            for n in cnodes
        ]
        fleet.wait_ready(consumers)
        time.sleep(0.5)  # the consumers are announced to the peers (topology)
        segs = producer_segments(args.count, args.groups, args.producers)
        producers = [
            fleet.spawn(
                "producer",
                port=b.ports[n],
                producer_id=i,
                size=args.size,
                durable=args.durable,
                presettled=False,
                rate=args.rate / args.producers,
                segments=segs[i],
            )
            for i, n in enumerate(pnodes)
        ]
        fleet.wait_ready(producers)
        spies = b.profile(args.profile, f"{setup}-{run}") if args.profile else []
        cpu0, busy0, t0 = b.cpu_by_node(), machine_busy_seconds(), time.monotonic()
        fleet.send(producers, "go")
        # done: every producer has its outcomes and every accepted message arrived (a
        # proposal that times out rejects its messages: counted, never waited for)
        fleet.wait(
            f"{setup} run {run}",
            lambda: (
                all(fleet.slot(w)[F_STATE] == ST_DONE for w in producers)
                and sum(fleet.slot(w)[F_COUNT] for w in consumers)
                >= sum(fleet.slot(w)[F_AUX] for w in producers)
            ),
            args.timeout,
        )
        cpu1, busy1, t1 = b.cpu_by_node(), machine_busy_seconds(), time.monotonic()
        stop_profiles(spies)
        fleet.stop()
        row.update(_sum_producers(producers))
        row.update(_consumer_results(fleet, consumers, check_groups=args.groups > 0))
        firsts = [w.result.get("t_first", 0) for w in producers if w.result]
        lasts = [w.result.get("t_last", 0) for w in consumers if w.result]
        t_first = min((t for t in firsts if t), default=0)
        t_last = max(lasts, default=0)
        elapsed = (t_last - t_first) / 1e9 if t_first and t_last > t_first else 0.0
        row["msgs_per_s"] = round(row["received"] / elapsed) if elapsed else None
        cpu = {n: cpu1[n] - cpu0[n] for n in cpu0}
        row["broker_cpu_us_per_msg"] = round(1e6 * sum(cpu.values()) / max(args.count, 1), 1)
        if b.cluster:
            row["node_cpu_us_per_msg"] = {
                n: round(1e6 * c / max(args.count, 1), 1) for n, c in cpu.items()
            }
        row["broker_cpu_pct"] = round(100 * sum(cpu.values()) / (t1 - t0), 1)
        row["machine_busy_cores"] = round((busy1 - busy0) / (t1 - t0), 2)
        row["first_error"] = fleet.first_error()
    if b.cluster:
        row["proposals"] = {n: b.status(n)["proposals"] for n in b.names}
        row["forwarded"] = sum(p["forwarded"] for n in b.names for p in b.status(n)["peers"])
    return _finish(row, args.count)


def fmt_us(v: Any) -> str:
    return "-" if v is None else f"{v / 1000:.1f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--setups", default=",".join(SETUPS), help="comma separated: " + ",".join(SETUPS)
    )
    ap.add_argument("--count", type=int, default=30000, help="messages per run (30000)")
    ap.add_argument("--groups", type=int, default=1000, help="group ids (1000)")
    ap.add_argument("--producers", type=int, default=3, help="producer processes (3)")
    ap.add_argument("--consumers", type=int, default=3, help="consumer processes (3)")
    ap.add_argument("--size", type=int, default=100, help="body bytes (100)")
    ap.add_argument("--durable", action="store_true", help="durable messages")
    ap.add_argument(
        "--rate",
        type=float,
        default=0.0,
        help="total msgs/s over all producers (0 = as fast as possible); with many "
        "groups, a low rate spreads the proposals out (latency without a burst)",
    )
    ap.add_argument("--runs", type=int, default=2, help="runs per setup, fresh brokers each (2)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per run (300)")
    ap.add_argument("--broker-env", action="append", default=[], help="NAME=VALUE for every broker")
    ap.add_argument("--json", action="store_true", help="print one JSON line per run")
    ap.add_argument(
        "--profile",
        metavar="DIR",
        help="sample every broker with py-spy (pip install py-spy) while the messages "
        "flow; collapsed stacks in DIR/<setup>-<run>-<node>.txt",
    )
    ap.add_argument(
        "--keep",
        action="store_true",
        help="keep each run's data directories and broker logs (the path is printed)",
    )
    args = ap.parse_args(argv)
    setups = [s for s in args.setups.split(",") if s]
    for s in setups:
        if s not in SETUPS:
            ap.error(f"unknown setup {s!r}; known: {', '.join(SETUPS)}")
    perf = parse_args([])  # the load client's defaults (window, credit, no SASL options)
    perf.timeout = args.timeout
    env_extra = {}
    for item in args.broker_env:
        name, sep, value = item.partition("=")
        if not sep:
            ap.error(f"--broker-env {item!r}: expected NAME=VALUE")
        env_extra[name] = value
    rows = []
    for setup in setups:
        for run in range(1, args.runs + 1):
            root = Path(tempfile.mkdtemp(prefix="amqbroker-cluster-bench-"))
            try:
                with Brokers(root, setup != "single", env_extra) as b:
                    row = run_once(args, perf, b, setup, run)
            except RunError as exc:
                row = {"setup": setup, "run": run, "ok": False, "first_error": str(exc)}
            finally:
                if args.keep:
                    print(f"{setup} run {run}: brokers' data and logs kept in {root}")
                else:
                    shutil.rmtree(root, ignore_errors=True)
            rows.append(row)
            if args.json:
                print(json.dumps(row), flush=True)
            else:
                line = (
                    f"{setup:14} run {run}: {row.get('msgs_per_s')} msgs/s, latency p50 "
                    f"{fmt_us(row.get('lat_p50_us'))} ms p99 {fmt_us(row.get('lat_p99_us'))} ms, "
                    f"broker CPU {row.get('broker_cpu_us_per_msg')} us/msg"
                    + (
                        " ("
                        + ", ".join(f"{n} {v}" for n, v in row["node_cpu_us_per_msg"].items())
                        + ")"
                        if "node_cpu_us_per_msg" in row
                        else ""
                    )
                    + ", "
                    f"groups {row.get('group_check', '-')}, "
                    f"rejected {row.get('not_accepted', '-')}, ok={row.get('ok')}"
                )
                if "proposals" in row:
                    line += "; proposals " + ", ".join(
                        f"{n} n={p['count']} p50 {p['p50Ms']} ms p99 {p['p99Ms']} ms"
                        for n, p in row["proposals"].items()
                    )
                    line += f"; forwarded {row['forwarded']}"
                if row.get("first_error"):
                    line += f"; error: {row['first_error']}"
                print(line, flush=True)
    with contextlib.suppress(BrokenPipeError):
        sys.stdout.flush()
    return 0 if all(r.get("ok") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
