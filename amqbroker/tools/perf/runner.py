"""The orchestrator: starts the worker processes of each run (`Fleet`), tells them to
go, waits on the status file (with live progress on stderr when it is a terminal or
--progress is given), measures broker and client CPU (`Window`), collects the
results and prints them (`report`).
"""

from __future__ import annotations

import argparse
import array
import contextlib
import json
import mmap
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from amqbroker.tools.perf.broker import RunError, Target, make_target
from amqbroker.tools.perf.nullbroker import null_broker_main
from amqbroker.tools.perf.options import (
    HOL_FAST_CONSUMERS,
    HOL_GROUPED,
    HOL_STRICT_PREFIX,
    HOL_UNGROUPED,
    RSS_PER_GROUP_MIN,
    SCENARIOS,
    Scenario,
    parse_args,
    producer_segments,
    run_plan,
    variant,
)
from amqbroker.tools.perf.report import (
    Progress,
    _fmt,
    format_row,
    render_report,
    summarize,
    summary_table,
)
from amqbroker.tools.perf.stats import (
    CLK_TCK,
    RssSampler,
    latency_summary,
    machine_busy_seconds,
    machine_steal_seconds,
    parse_stat_cpu_ticks,
    proc_cmdline,
    proc_cpu_seconds,
    proc_rss_kb,
)
from amqbroker.tools.perf.status import (
    F_COUNT,
    F_ERRORS,
    F_STATE,
    SELF,
    SLOT,
    ST_DONE,
    ST_FAILED,
    ST_READY,
)
from amqbroker.tools.perf.workers import worker_main

# -------------------------------------------------------------------------- fleet


@dataclass
class Worker:
    proc: subprocess.Popen[bytes]
    slot: int
    role: str
    result: dict[str, Any] | None = None

    @property
    def name(self) -> str:
        return f"{self.role} #{self.slot}"


class Fleet:
    """The worker processes of one run and their shared status file."""

    def __init__(self, args: argparse.Namespace, target: Target, address: str, nslots: int) -> None:
        self.args = args
        self.target = target
        self.address = address
        self.dir = Path(tempfile.mkdtemp(prefix="amqbroker-perf-run-"))
        self.status_path = self.dir / "status.bin"
        self.status_path.write_bytes(bytes(SLOT.size * nslots))
        self._f = open(self.status_path, "r+b")  # noqa: SIM115 - closed in close()
        self.mm = mmap.mmap(self._f.fileno(), 0)
        self.workers: list[Worker] = []
        self.nslots = nslots
        self.progress: Progress = getattr(args, "live", None) or Progress(False)

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def spawn(self, role: str, **extra: Any) -> Worker:
        slot = len(self.workers)
        if slot >= self.nslots:
            raise RunError("internal: too many workers for the status file")
        a = self.args
        spec = {
            "role": role,
            "slot": slot,
            "status": str(self.status_path),
            "out": str(self.dir),
            "host": self.target.host,
            "port": self.target.port,
            "address": self.address,
            "user": a.user,
            "password": a.password,
            "no_sasl": a.no_sasl,
            "window": a.window,
            "credit": a.credit,
            "selector": a.selector,
            "app_props": bool(a.selector or a.app_props),
            "txn_batch": a.txn_batch,
        }
        spec.update(extra)
        proc = subprocess.Popen(
            [*SELF, "--_worker", json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        w = Worker(proc, slot, role)
        self.workers.append(w)
        return w

    def slot(self, w: Worker) -> tuple[int, ...]:
        return SLOT.unpack_from(self.mm, w.slot * SLOT.size)

    def send(self, workers: list[Worker], cmd: str) -> None:
        for w in workers:
            if w.proc.poll() is None and w.proc.stdin is not None:
                with contextlib.suppress(OSError):
                    w.proc.stdin.write(cmd.encode() + b"\n")
                    w.proc.stdin.flush()

    def wait(
        self,
        what: str,
        cond: Any,
        timeout: float,
        done: Callable[[], int] | None = None,
        total: int = 0,
    ) -> None:
        """Poll the status file until `cond()`; `done()` (out of `total`) feeds the live
        progress line when there is one."""
        deadline = time.monotonic() + timeout
        try:
            while True:
                if cond():
                    return
                if done is not None:
                    self.progress.update(what, done(), total)
                self._check(what, deadline, timeout)
                time.sleep(0.005)
        finally:
            self.progress.clear()

    def _check(self, what: str, deadline: float, timeout: float) -> None:
        for w in self.workers:
            st = self.slot(w)
            if st[F_STATE] == ST_FAILED or st[F_ERRORS] > 0:
                raise RunError(f"{w.name} failed while waiting for {what}")
            if w.proc.poll() is not None and w.result is None:
                raise RunError(f"{w.name} exited (rc={w.proc.returncode}) while waiting for {what}")
        if time.monotonic() > deadline:
            raise RunError(f"timed out after {timeout:.0f} s waiting for {what}")

    def wait_ready(self, workers: list[Worker]) -> None:
        self.wait(
            "the links to open",
            lambda: all(self.slot(w)[F_STATE] >= ST_READY for w in workers),
            min(self.args.timeout, 60),
        )

    def cpu_seconds(self) -> dict[int, float]:
        """CPU seconds used so far by each live worker process, by pid."""
        out = {}
        for w in self.workers:
            with contextlib.suppress(OSError, ValueError):
                out[w.proc.pid] = proc_cpu_seconds(w.proc.pid)
        return out

    def stop(self, workers: list[Worker] | None = None) -> None:
        ws = [w for w in (workers or self.workers) if w.result is None]
        self.send(ws, "stop")
        for w in ws:
            try:
                out, _ = w.proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                w.proc.kill()
                out, _ = w.proc.communicate()
            lines = [ln for ln in out.decode(errors="replace").splitlines() if ln.startswith("{")]
            try:
                w.result = json.loads(lines[-1]) if lines else {}
            except ValueError:
                w.result = {}
            if not w.result:
                w.result = {
                    "errors": 1,
                    "first_error": f"{w.name} gave no result (rc={w.proc.returncode})",
                }

    def close(self) -> None:
        for w in self.workers:
            if w.proc.poll() is None:
                w.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired, ValueError, OSError):
                w.proc.communicate(timeout=10)
        self.mm.close()
        self._f.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def first_error(self) -> str | None:
        for w in self.workers:
            if w.result and w.result.get("first_error"):
                return f"{w.name}: {w.result['first_error']}"
        return None


# ---------------------------------------------------------------------- measuring


class Window:
    """Broker CPU, client CPU and machine load between `start` and `end`."""

    def __init__(self, pid: int | None, fleet: Fleet) -> None:
        self.pid = pid
        self.fleet = fleet

    def _broker_cpu(self) -> float | None:
        if not self.pid:
            return None
        try:
            return proc_cpu_seconds(self.pid)
        except OSError:
            return None

    def _children_cpu(self) -> dict[int, float]:
        """CPU seconds of the broker's live child processes (the delivery log's
        Parquet writer, issue 22), by pid: reported on their own, not in the broker's
        CPU (which counts the threads of the broker's process)."""
        out: dict[int, float] = {}
        if not self.pid:
            return out
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat") as f:
                    text = f.read()
            except OSError:
                continue
            rest = text[text.rindex(")") + 2 :].split()
            if int(rest[1]) == self.pid:
                out[int(name)] = parse_stat_cpu_ticks(text) / CLK_TCK
        return out

    def start(self) -> None:
        self.t0 = time.monotonic()
        self.b0 = self._broker_cpu()
        self.k0 = self._children_cpu()
        self.c0 = self.fleet.cpu_seconds()
        self.m0 = machine_busy_seconds()
        self.s0 = machine_steal_seconds()
        self.rss0 = proc_rss_kb(self.pid) if self.pid else None

    def end(self) -> None:
        self.t1 = time.monotonic()
        self.b1 = self._broker_cpu()
        self.k1 = self._children_cpu()
        self.c1 = self.fleet.cpu_seconds()
        self.m1 = machine_busy_seconds()
        self.s1 = machine_steal_seconds()
        self.rss1 = proc_rss_kb(self.pid) if self.pid else None

    def metrics(self, messages: int) -> dict[str, Any]:
        wall = max(self.t1 - self.t0, 1e-9)
        bcpu = None if self.b0 is None or self.b1 is None else self.b1 - self.b0
        kcpu = sum(t - self.k0.get(pid, 0.0) for pid, t in self.k1.items())
        per_proc = [t - self.c0.get(pid, 0.0) for pid, t in self.c1.items()]
        ccpu = sum(per_proc)
        busiest = max(per_proc, default=0.0)
        other = (self.m1 - self.m0) - (bcpu or 0.0) - ccpu
        n = max(messages, 1)
        return {
            "wall_s": round(wall, 3),
            "broker_cpu_pct": None if bcpu is None else round(100 * bcpu / wall, 1),
            "broker_cpu_us_per_msg": None if bcpu is None else round(1e6 * bcpu / n, 2),
            # the broker's child processes (not in broker_cpu_us_per_msg)
            "broker_children_cpu_us_per_msg": round(1e6 * kcpu / n, 2),
            "client_cpu_pct": round(100 * ccpu / wall, 1),
            "client_cpu_us_per_msg": round(1e6 * ccpu / n, 2),
            # each client process on its own core could not go faster than this
            "client_ceiling_est_msgs_per_s": round(n / busiest) if busiest > 0 else None,
            "other_cores": round(max(0.0, other) / wall, 2),
            # the hypervisor's steal, in % of all cores (runs with steal read high)
            "host_steal_pct": round(100 * (self.s1 - self.s0) / (wall * (os.cpu_count() or 1)), 1),
            "broker_rss_before_kb": self.rss0,
            "broker_rss_after_kb": self.rss1,
        }


def _consumer_results(fleet: Fleet, consumers: list[Worker], check_groups: bool) -> dict[str, Any]:
    lat = array.array("q")
    groups = array.array("I")
    out: dict[str, Any] = {"received": 0, "bad_payload": 0, "order_violations": 0, "errors": 0}
    for w in consumers:
        r = w.result or {}
        out["received"] += int(r.get("received", 0))
        out["bad_payload"] += int(r.get("bad_payload", 0))
        out["order_violations"] += int(r.get("order_violations", 0))
        out["errors"] += int(r.get("errors", 0))
        for key, arr in (("lat_file", lat), ("groups_file", groups)):
            path = r.get(key)
            if path and os.path.exists(path):
                with open(path, "rb") as f:
                    arr.frombytes(f.read())
    out.update(latency_summary(lat))
    if check_groups:
        split = len(groups) - len(set(groups))
        out["groups_seen"] = len(groups) - split
        out["group_split"] = split
        ok = split == 0 and out["order_violations"] == 0
        out["group_check"] = "ok" if ok else "FAILED"
    return out


def _sum_producers(producers: list[Worker]) -> dict[str, int]:
    res = [w.result or {} for w in producers]
    return {
        "sent": sum(int(r.get("sent", 0)) for r in res),
        "acked": sum(int(r.get("acked", 0)) for r in res),
        "not_accepted": sum(int(r.get("not_accepted", 0)) for r in res),
        "producer_errors": sum(int(r.get("errors", 0)) for r in res),
    }


def _run_failed(row: dict[str, Any], exc: RunError) -> None:
    """Record in `row` a run that stopped early: why, and whether it timed out."""
    row["timed_out"] = "timed out" in str(exc)
    row["run_error"] = str(exc)


def _first_error(row: dict[str, Any], fleet: Fleet) -> str | None:
    """The run's own error and the first worker's, joined; None when neither."""
    return "; ".join(e for e in (row.get("run_error"), fleet.first_error()) if e) or None


def _finish(row: dict[str, Any], expected: int) -> dict[str, Any]:
    received = int(row.get("received", 0))
    missing = max(0, expected - received)
    # nothing is ever released or redelivered in these scenarios: more is a duplicate
    extra = max(0, received - expected)
    row["missing"] = missing
    row["extra"] = extra
    row["errors"] = (
        int(row.get("errors", 0))
        + int(row.pop("producer_errors", 0))
        + int(row.get("not_accepted", 0))
        + int(row.get("bad_payload", 0))
        + missing
        + extra
    )
    row["ok"] = row["errors"] == 0 and row.get("group_check", "ok") in ("ok", "skipped")
    return row


def base_row(
    args: argparse.Namespace, target: Target, sc: Scenario, run: int, address: str
) -> dict[str, Any]:
    return {
        "broker": target.label,
        "scenario": sc.name + variant(args),
        "run": run,
        "address": address,
        "count": sc.count,
        "size": sc.size,
        "producers": sc.producers,
        "consumers": sc.consumers,
        "groups": sc.groups,
        "durable": sc.durable,
        "presettled": sc.presettled,
        "rate": sc.rate,
        "window": args.window,
        "credit": args.credit,
        "selector": args.selector,
        "app_props": bool(args.selector or args.app_props),
        "txn_batch": args.txn_batch,
        "broker_pid": target.pid,
        "ts": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def unique_address(args: argparse.Namespace, base: str, tag: str) -> str:
    """`base` with a unique suffix on its name (before any '?options')."""
    name, sep, query = base.partition("?")
    suffix = f"{tag}-{os.getpid()}-{time.monotonic_ns() % 10**9}"
    return f"{args.address_prefix}{name}-{suffix}{sep}{query}"


def run_flow(args: argparse.Namespace, target: Target, sc: Scenario, run: int) -> dict[str, Any]:
    address = unique_address(args, args.address, f"{sc.name.lower()}{run}")
    row = base_row(args, target, sc, run, address)
    check_groups = sc.groups > 0 and not args.ceiling
    with Fleet(args, target, address, sc.producers + sc.consumers) as fleet:
        consumers = [
            fleet.spawn("consumer", size=sc.size, durable=sc.durable) for _ in range(sc.consumers)
        ]
        try:
            fleet.wait_ready(consumers)
            producers = [
                fleet.spawn(
                    "producer",
                    producer_id=i,
                    size=sc.size,
                    durable=sc.durable,
                    presettled=sc.presettled,
                    rate=sc.rate / sc.producers,
                    segments=segs,
                )
                for i, segs in enumerate(producer_segments(sc.count, sc.groups, sc.producers))
            ]
            fleet.wait_ready(producers)
            win = Window(target.pid, fleet)
            with RssSampler(target.pid) as rss:
                win.start()
                fleet.send(producers, "go")
                fleet.wait(
                    f"{sc.name}{variant(args)} run {run}",
                    lambda: (
                        sum(fleet.slot(w)[F_COUNT] for w in consumers) >= sc.count
                        and all(fleet.slot(w)[F_STATE] == ST_DONE for w in producers)
                    ),
                    args.timeout,
                    done=lambda: sum(fleet.slot(w)[F_COUNT] for w in consumers),
                    total=sc.count,
                )
                win.end()
            row["timed_out"] = False
        except RunError as exc:
            _run_failed(row, exc)
            win = None
            rss = None
        fleet.stop()
        row.update(_sum_producers(fleet.workers[sc.consumers :]))
        row.update(_consumer_results(fleet, consumers, check_groups))
        if sc.groups > 0 and args.ceiling:
            row["group_check"] = "skipped"
        firsts = [w.result.get("t_first", 0) for w in fleet.workers[sc.consumers :] if w.result]
        lasts = [w.result.get("t_last", 0) for w in consumers if w.result]
        t_first = min((t for t in firsts if t), default=0)
        t_last = max(lasts, default=0)
        elapsed = (t_last - t_first) / 1e9 if t_first and t_last > t_first else 0.0
        row["elapsed_s"] = round(elapsed, 4)
        row["msgs_per_s"] = round(row["received"] / elapsed, 1) if elapsed else None
        # the producers' own rate: first send -> last outcome (last commit with --txn-batch)
        p_lasts = [w.result.get("t_last", 0) for w in fleet.workers[sc.consumers :] if w.result]
        p_last = max(p_lasts, default=0)
        p_elapsed = (p_last - t_first) / 1e9 if t_first and p_last > t_first else 0.0
        row["producer_msgs_per_s"] = (
            round(row["acked"] / p_elapsed, 1) if p_elapsed and not sc.presettled else None
        )
        if win is not None and rss is not None:
            row.update(win.metrics(sc.count))
            row["broker_rss_max_kb"] = rss.max_kb or None
            bound = min(sc.groups, sc.count)
            if bound >= RSS_PER_GROUP_MIN and not args.ceiling and win.rss0 and win.rss1:
                # RSS with every group bound (consumers still attached) minus before
                row["groups_bound"] = bound
                row["rss_per_group_bytes"] = round((win.rss1 - win.rss0) * 1024 / bound, 1)
        row["first_error"] = _first_error(row, fleet)
    return _finish(row, sc.count)


def run_hol(
    args: argparse.Namespace, target: Target, sc: Scenario, run: int, strict: bool
) -> dict[str, Any]:
    base = HOL_STRICT_PREFIX + args.address if strict else args.address
    address = unique_address(args, base, f"hol{run}")
    sc = replace(sc, name="HOL-strict" if strict else "HOL", count=HOL_GROUPED + HOL_UNGROUPED)
    row = base_row(args, target, sc, run, address)
    row.update(consumers=1 + HOL_FAST_CONSUMERS, groups=1, hol_hold_ms=args.hol_hold_ms)
    with Fleet(args, target, address, 3 + HOL_FAST_CONSUMERS) as fleet:
        slow = fleet.spawn("consumer", size=sc.size, credit=1, hold_ms=args.hol_hold_ms)
        fast = [
            fleet.spawn("consumer", size=sc.size, wait_go=True) for _ in range(HOL_FAST_CONSUMERS)
        ]
        consumers = [slow, *fast]
        try:
            fleet.wait_ready(consumers)
            # 1. the slow consumer takes the group's first message: the group is bound to it
            p1 = fleet.spawn(
                "producer", producer_id=0, size=sc.size, segments=[{"n": 1, "groups": 1}]
            )
            fleet.wait_ready([p1])
            fleet.send([p1], "go")
            fleet.wait(
                "the group to bind to the slow consumer",
                lambda: fleet.slot(p1)[F_STATE] == ST_DONE and fleet.slot(slow)[F_COUNT] >= 1,
                args.timeout,
            )
            # 2. the rest of the group, then the ungrouped messages, queue behind it
            segs = [
                {"n": HOL_GROUPED - 1, "groups": 1, "gbase": 0, "gseq0": 1},
                {"n": HOL_UNGROUPED},
            ]
            p2 = fleet.spawn("producer", producer_id=1, size=sc.size, segments=segs)
            fleet.wait_ready([p2])
            fleet.send([p2], "go")
            fleet.wait(
                "the messages to be queued",
                lambda: fleet.slot(p2)[F_STATE] == ST_DONE,
                args.timeout,
            )
            # 3. three consumers with normal credit start
            win = Window(target.pid, fleet)
            win.start()
            t0 = time.monotonic_ns()
            fleet.send(fast, "go")
            fleet.wait(
                "every message",
                lambda: sum(fleet.slot(w)[F_COUNT] for w in consumers) >= sc.count,
                args.timeout,
            )
            win.end()
            row["timed_out"] = False
        except RunError as exc:
            _run_failed(row, exc)
            win = None
            t0 = 0
        fleet.stop()
        row.update(_sum_producers([w for w in fleet.workers if w.role == "producer"]))
        row.update(_consumer_results(fleet, consumers, check_groups=True))
        if win is not None:
            row.update(win.metrics(sc.count))
            t_ung = max(int((w.result or {}).get("t_last_ungrouped", 0)) for w in consumers)
            t_all = max(int((w.result or {}).get("t_last", 0)) for w in consumers)
            row["hol_ungrouped_ms"] = round((t_ung - t0) / 1e6, 1) if t_ung > t0 else None
            row["hol_all_ms"] = round((t_all - t0) / 1e6, 1) if t_all > t0 else None
            row["strict"] = strict
            if strict and not target.strict_configured:
                row["note"] = "strict needs group_skip_ahead=false for hol-strict.# on the broker"
        row["first_error"] = _first_error(row, fleet)
    return _finish(row, sc.count)


def run_mem(args: argparse.Namespace, target: Target, sc: Scenario, run: int) -> dict[str, Any]:
    address = unique_address(args, args.address, f"mem{run}")
    row = base_row(args, target, sc, run, address)
    with Fleet(args, target, address, sc.producers + sc.consumers) as fleet:
        producers = [
            fleet.spawn("producer", producer_id=i, size=sc.size, durable=sc.durable, segments=segs)
            for i, segs in enumerate(producer_segments(sc.count, 0, sc.producers))
        ]
        consumers: list[Worker] = []
        try:
            fleet.wait_ready(producers)
            win = Window(target.pid, fleet)
            with RssSampler(target.pid) as rss:
                win.start()
                fleet.send(producers, "go")
                fleet.wait(
                    f"MEM run {run}: queueing",
                    lambda: all(fleet.slot(w)[F_STATE] == ST_DONE for w in producers),
                    args.timeout,
                    done=lambda: sum(fleet.slot(w)[F_COUNT] for w in producers),
                    total=sc.count,
                )
                win.end()
                queued_rss = proc_rss_kb(target.pid) if target.pid else None
                consumers = [fleet.spawn("consumer", size=sc.size) for _ in range(sc.consumers)]
                fleet.wait(
                    f"MEM run {run}: draining",
                    lambda: sum(fleet.slot(w)[F_COUNT] for w in consumers) >= sc.count,
                    args.timeout,
                    done=lambda: sum(fleet.slot(w)[F_COUNT] for w in consumers),
                    total=sc.count,
                )
            row["timed_out"] = False
        except RunError as exc:
            _run_failed(row, exc)
            win = None
            rss = None
            queued_rss = None
        fleet.stop()
        row.update(_sum_producers(producers))
        row.update(_consumer_results(fleet, consumers, check_groups=False))
        for k in ("lat_p50_us", "lat_p90_us", "lat_p99_us", "lat_max_us"):
            row[k] = None  # queueing time by construction: not a latency figure
        if win is not None and rss is not None:
            row.update(win.metrics(sc.count))
            pf = [w.result.get("t_first", 0) for w in producers if w.result]
            pl = [w.result.get("t_last", 0) for w in producers if w.result]
            if pf and min(pf) and max(pl) > min(pf):
                row["msgs_per_s"] = round(sc.count / ((max(pl) - min(pf)) / 1e9), 1)
            cf = [
                w.result.get("t_first", 0)
                for w in consumers
                if w.result and w.result.get("t_first")
            ]
            cl = [w.result.get("t_last", 0) for w in consumers if w.result]
            if cf and max(cl) > min(cf):
                row["drain_msgs_per_s"] = round(row["received"] / ((max(cl) - min(cf)) / 1e9), 1)
            row["broker_rss_max_kb"] = rss.max_kb or None
            if win.rss0 and queued_rss:
                growth = (queued_rss - win.rss0) * 1024 / sc.count
                row["broker_rss_queued_kb"] = queued_rss
                row["rss_per_msg_bytes"] = round(growth, 1)
                row["rss_per_msg_beyond_payload"] = round(growth - sc.size, 1)
        row["first_error"] = _first_error(row, fleet)
    return _finish(row, sc.count)


def run_scenario(
    args: argparse.Namespace, target: Target, sc: Scenario, run: int
) -> list[dict[str, Any]]:
    if sc.kind == "hol":
        return [
            run_hol(args, target, sc, run, strict=False),
            run_hol(args, target, sc, run, strict=True),
        ]
    if sc.kind == "mem":
        return [run_mem(args, target, sc, run)]
    return [run_flow(args, target, sc, run)]


def main(
    argv: list[str] | None = None,
    *,
    prog: str = "perf.py",
    summary: bool = False,
    defaults: dict[str, Any] | None = None,
) -> int:
    """The load client: `argv` as perf.py takes it. `prog` names it in messages;
    `summary` prints the summary table even after one run (`amqbroker perf` does);
    `defaults` apply where an option is not given (`amqbroker perf` passes --url and
    AMQBROKER_URL / _USER / _PASSWORD there). Returns the exit status: 0 every run
    was clean, 1 a run had errors, 2 the broker could not be reached or started."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--_worker"]:
        return worker_main(argv[1])
    if argv[:1] == ["--_null-broker"]:
        return null_broker_main(argv[1:])
    args = parse_args(argv, prog=prog, defaults=defaults)
    if args.report:
        try:
            print(render_report(args.report))
        except (OSError, ValueError) as exc:
            print(f"{prog}: {exc}", file=sys.stderr)
            return 2
        return 0
    info = sys.stderr if args.json else sys.stdout
    live = args.progress if args.progress is not None else sys.stderr.isatty()
    args.live = Progress(live)
    if threading.current_thread() is not threading.main_thread():
        return _run(args, prog, info, summary)  # signals reach the main thread only
    # SIGTERM ends the run like ^C does: the broker it started and the load processes
    # are stopped (`_run`'s `finally`), not left behind
    old_term = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        return _run(args, prog, info, summary)
    finally:
        signal.signal(signal.SIGTERM, old_term)


def _exit_on_sigterm(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def _run(args: argparse.Namespace, prog: str, info: Any, summary: bool) -> int:
    rows: list[dict[str, Any]] = []
    try:
        target = make_target(args)
    except RunError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    try:
        cmd = proc_cmdline(target.pid)[:120] if target.pid else "not found: no CPU/RSS figures"
        with open("/proc/loadavg") as f:
            load = f.read().split()[:3]
        print(
            f"# {target.label} at {target.host}:{target.port} broker pid {target.pid} ({cmd}); "
            f"{os.cpu_count()} cores, load {' '.join(load)}",
            file=info,
            flush=True,
        )
        if args.warmup > 0:
            warm = replace(SCENARIOS["A"], name="warmup", count=args.warmup)
            r = run_flow(args, target, warm, 0)
            print(
                f"# warm-up: {_fmt(r.get('msgs_per_s'))} msgs/s, errors {r['errors']}",
                file=info,
                flush=True,
            )
        for sc, run in run_plan(args.scenarios, args.runs, args.order):
            for r in run_scenario(args, target, sc, run):
                rows.append(r)
                if args.json:
                    print(json.dumps(r), flush=True)
                print(format_row(r), file=info, flush=True)
        if target.pid and not args.ceiling:
            hwm = proc_rss_kb(target.pid, "VmHWM")
            if hwm:
                print(f"# broker peak RSS since start (VmHWM): {hwm / 1024:.0f} MiB", file=info)
        if rows and (len(rows) > 1 or args.runs > 1 or summary or args.summary):
            print(summary_table(summarize(rows)), file=info)
        if args.ceiling:
            print(
                "# ceiling: the client against a null broker (relay, no queue logic); compare "
                "msgs/s and client CPU us/msg with a real broker's run",
                file=info,
            )
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    finally:
        target.stop()
    return 0 if rows and all(r["ok"] for r in rows) else 1
