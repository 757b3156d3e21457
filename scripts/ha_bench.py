#!/usr/bin/env python3
"""Primary/backup pairs (issue 23): what replication costs, and how long a takeover takes.

    .venv/bin/python scripts/ha_bench.py throughput [--runs 3] [--count 50000]
    .venv/bin/python scripts/ha_bench.py takeover [--kills 10]

throughput: a primary (`ha_role = primary`, store_sync on) alone, then with a backup
process in sync, each measured with `amqbroker perf` (scenario E: durable, and G1K with
--durable: grouped durable) against the primary's port; the primary's CPU per message
is the perf client's "broker CPU" (the listener's process). Prints one JSON line per
perf run with a "setup" field, then a summary table (medians).

takeover: a pair with a real ZooKeeper (tests/cluster/zk_harness.py: ZooKeeper from
Debian's package) and the given session timeout; each round SIGKILLs the live member
while a probe sends one durable message every 20 ms to whichever member answers, and
measures kill -> first `accepted` send on the other member; the killed member is then
restarted (it becomes the backup and resyncs) before the next round. Prints each
takeover and the distribution.

Servers listen on 127.0.0.1 only; everything started is stopped at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from proton import Message
from proton.utils import BlockingConnection

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from amqbroker.core.auth import hash_password  # noqa: E402

USER, PASSWORD = "cluster", "cluster-pw"


def kv(pairs: list[str]) -> dict[str, str]:
    return dict(p.split("=", 1) for p in pairs)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def base_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AMQBROKER_")}
    env.update(
        {
            "AMQBROKER_CLUSTER_USER": USER,
            "AMQBROKER_CLUSTER_PASSWORD": PASSWORD,
            "AMQBROKER_USERS": json.dumps({USER: hash_password(PASSWORD, iterations=1000)}),
            "AMQBROKER_CLUSTER_RECONNECT_INITIAL": "0.05",
            "AMQBROKER_CLUSTER_RECONNECT_MAX": "0.3",
            "AMQBROKER_LOG_LEVEL": "WARNING",
        }
    )
    env.update(extra)
    return env


class Proc:
    def __init__(self, port: int, data: Path, env: dict[str, str], log: Path) -> None:
        self.port, self.data, self.env, self.log = port, data, env, log
        self.p: subprocess.Popen[bytes] | None = None
        #: the log's length when it was last started
        self.mark = 0

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.p = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "amqbroker",
                    "run",
                    "--port",
                    str(self.port),
                    "--data-dir",
                    str(self.data),
                ],
                env=self.env,
                stdout=out,
                stderr=out,
                cwd=ROOT,
            )

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.p is not None and self.p.poll() is None:
            self.p.send_signal(sig)
            self.p.wait(30)

    def text(self) -> str:
        return self.log.read_text(errors="replace")


def wait_for(pred: Any, what: str, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise SystemExit(f"ha_bench: {what} did not happen within {timeout:g} s")
        time.sleep(0.05)


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


# ------------------------------------------------------------------ throughput
def perf(port: int, scenario: list[str], args: argparse.Namespace, setup: str) -> list[dict]:
    cmd = [sys.executable, "-m", "amqbroker", "perf", "--port", str(port), "--json"]
    cmd += ["--no-progress", "--runs", str(args.runs), "--count", str(args.count)]
    cmd += ["--user", USER, "--password", PASSWORD, "--label", setup, *scenario]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False)
    if out.returncode != 0:
        raise SystemExit(f"ha_bench: perf failed:\n{out.stderr[-3000:]}")
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    for r in rows:
        r["setup"] = setup
        print(json.dumps(r), flush=True)
    return rows


def throughput(args: argparse.Namespace) -> None:
    known = {"E": ["--scenario", "E"], "G1K": ["--scenario", "G1K", "--durable"]}
    scenarios = [known[x] for x in args.scenarios.split(",")]
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="ha-bench-") as tmp:
        t = Path(tmp)
        for setup in args.setups.split(","):
            for sc in scenarios:
                p_port, b_port = free_port(), free_port()
                tag = f"{setup}-{sc[1]}"
                primary = Proc(
                    p_port,
                    t / f"{tag}-p",
                    base_env({"AMQBROKER_HA_ROLE": "primary", **kv(args.primary_env)}),
                    t / f"{tag}-p.log",
                )
                backup = Proc(
                    b_port,
                    t / f"{tag}-b",
                    base_env(
                        {
                            "AMQBROKER_HA_ROLE": "backup",
                            "AMQBROKER_HA_PRIMARY": f"127.0.0.1:{p_port}",
                            "AMQBROKER_LOG_LEVEL": "INFO",
                            **kv(args.backup_env),
                        }
                    ),
                    t / f"{tag}-b.log",
                )
                primary.start()
                try:
                    wait_for(lambda p=p_port: port_open(p), "the primary listening")
                    if setup == "backup":
                        backup.start()
                        wait_for(lambda b=backup: "in sync" in b.text(), "the backup in sync")
                    rows += perf(p_port, sc, args, f"{setup} {sc[1]}")
                finally:
                    backup.kill(signal.SIGTERM)
                    primary.kill(signal.SIGTERM)
    print()
    print("| setup | scenario | msgs/s median (min-max) | primary CPU µs/msg median |")
    print("|---|---|---|---|")
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r["setup"], []).append(r)
    for setup, rs in groups.items():
        rates = [r["msgs_per_s"] for r in rs]
        cpu = [r["broker_cpu_us_per_msg"] for r in rs if r.get("broker_cpu_us_per_msg")]
        name, sc = setup.split(" ", 1)
        print(
            f"| {name} | {sc} | {statistics.median(rates):,.0f} ({min(rates):,.0f}-"
            f"{max(rates):,.0f}) | {statistics.median(cpu) if cpu else float('nan'):.1f} |"
        )


# ------------------------------------------------------------------ takeover
def probe_send(port: int, timeout: float) -> bool:
    """One durable message accepted by the broker on `port` within `timeout`."""
    try:
        conn = BlockingConnection(
            f"amqp://127.0.0.1:{port}",
            timeout=timeout,
            user=USER,
            password=PASSWORD,
            allowed_mechs="PLAIN",
        )
    except Exception:
        return False
    try:
        snd = conn.create_sender("probe")
        snd.send(Message(body="probe", durable=True), timeout=timeout)
        return True
    except Exception:
        return False
    finally:
        with contextlib.suppress(Exception):
            conn.close()


def synced_since(m: Proc) -> bool:
    """Since its last start, `m` mirrored a full copy and became a candidate."""
    text = m.text()[m.mark :]
    i = text.find("HA backup: in sync with the primary")
    return i >= 0 and "is eligible, its store complete" in text[i:]


def takeover(args: argparse.Namespace) -> None:
    from tests.cluster.zk_harness import ZooKeeperServer, missing

    if (why := missing()) is not None:
        raise SystemExit(f"ha_bench: {why}")
    times: list[float] = []
    with tempfile.TemporaryDirectory(prefix="ha-bench-") as tmp:
        t = Path(tmp)
        zk = ZooKeeperServer(t / "zk")
        zk.start()
        members: list[Proc] = []
        try:
            for i, role in enumerate(("primary", "backup")):
                port = free_port()
                env = base_env(
                    {
                        "AMQBROKER_HA_ROLE": role,
                        "AMQBROKER_NODE_ID": "node1",
                        "AMQBROKER_CLUSTER_ZOOKEEPER": zk.hosts,
                        "AMQBROKER_CLUSTER_ZOOKEEPER_PATH": "/ha-bench",
                        "AMQBROKER_CLUSTER_ZOOKEEPER_SESSION_TIMEOUT": str(args.session_ms),
                        "AMQBROKER_LOG_LEVEL": "INFO",
                    }
                )
                members.append(Proc(port, t / f"m{i}", env, t / f"m{i}.log"))
            members[0].start()
            wait_for(lambda: port_open(members[0].port), "the first member live")
            members[1].start()
            for k in range(args.kills):
                live = next(m for m in members if port_open(m.port))
                other = members[1 - members.index(live)]
                wait_for(lambda o=other: synced_since(o), "the backup in sync")
                assert probe_send(live.port, 5.0), "the live member does not accept"
                live.kill()
                t0 = time.monotonic()
                while not probe_send(other.port, 1.0):
                    if time.monotonic() - t0 > 60:
                        raise SystemExit("ha_bench: no takeover within 60 s")
                    time.sleep(0.02)
                took = time.monotonic() - t0
                times.append(took)
                print(f"kill {k + 1}: first accepted send on the other member after {took:.2f} s")
                live.mark = len(live.text())
                live.start()  # it comes back as the backup
        finally:
            for m in members:
                m.kill(signal.SIGTERM)
            zk.stop()
    ordered = sorted(times)
    p90 = ordered[round(0.9 * (len(ordered) - 1))]
    print(
        f"takeover over {len(times)} kills (session timeout {args.session_ms} ms): "
        f"min {min(times):.2f} s, median {statistics.median(times):.2f} s, "
        f"p90 {p90:.2f} s, max {max(times):.2f} s"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)
    tp = sub.add_parser("throughput")
    tp.add_argument("--runs", type=int, default=3)
    tp.add_argument("--count", type=int, default=50_000)
    tp.add_argument("--setups", default="alone,backup", help="alone, backup (comma-separated)")
    tp.add_argument("--scenarios", default="E,G1K", help="E, G1K (grouped durable)")
    tp.add_argument("--primary-env", action="append", default=[], metavar="NAME=VALUE")
    tp.add_argument("--backup-env", action="append", default=[], metavar="NAME=VALUE")
    tk = sub.add_parser("takeover")
    tk.add_argument("--kills", type=int, default=10)
    tk.add_argument("--session-ms", type=int, default=4000)
    args = ap.parse_args()
    throughput(args) if args.mode == "throughput" else takeover(args)


if __name__ == "__main__":
    main()
