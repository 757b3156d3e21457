"""Measuring: percentiles, latency summaries, and the /proc readers (CPU seconds and
RSS of a process, machine load, the process listening on a port).

Linux only (/proc). Nothing here blocks for long: `RssSampler` samples in a thread.
"""

from __future__ import annotations

import math
import os
import statistics
import threading
from typing import Any

# --------------------------------------------------------------------------- statistics


def percentile(sorted_values: Any, p: float) -> Any:
    """Nearest-rank percentile of an ascending sequence (None when empty)."""
    n = len(sorted_values)
    if n == 0:
        return None
    k = math.ceil(p / 100.0 * n) - 1
    return sorted_values[min(max(k, 0), n - 1)]


def latency_summary(latencies_ns: Any) -> dict[str, float | None]:
    """p50/p90/p99/max in microseconds of a sequence of latencies in ns."""
    values = sorted(latencies_ns)
    out: dict[str, float | None] = {}
    for name, p in (("p50", 50), ("p90", 90), ("p99", 99), ("max", 100)):
        v = percentile(values, p)
        out[f"lat_{name}_us"] = None if v is None else round(v / 1000.0, 1)
    return out


def split_evenly(total: int, parts: int) -> list[int]:
    """`total` split into `parts` integers differing by at most one, larger first."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def median_or_none(values: list[Any]) -> Any:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


# ----------------------------------------------------------------------- /proc helpers

CLK_TCK = os.sysconf("SC_CLK_TCK")


def parse_stat_cpu_ticks(stat_text: str) -> int:
    """utime + stime (clock ticks, all threads) from the text of /proc/PID/stat."""
    rest = stat_text[stat_text.rindex(")") + 2 :].split()
    # rest[0] is field 3 (state); utime and stime are fields 14 and 15
    return int(rest[11]) + int(rest[12])


def proc_cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        return parse_stat_cpu_ticks(f.read()) / CLK_TCK


def parse_status_kb(status_text: str, key: str = "VmRSS") -> int | None:
    """A kB field (VmRSS, VmHWM, ...) of the text of /proc/PID/status."""
    for line in status_text.splitlines():
        name, _, value = line.partition(":")
        if name == key:
            return int(value.split()[0])
    return None


def proc_rss_kb(pid: int, key: str = "VmRSS") -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            return parse_status_kb(f.read(), key)
    except OSError:
        return None


def proc_cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def parse_listen_inodes(proc_net_tcp_text: str, port: int) -> set[str]:
    """Socket inodes in LISTEN state (0A) on `port` in the text of /proc/net/tcp[6]."""
    inodes = set()
    for line in proc_net_tcp_text.splitlines()[1:]:
        parts = line.split()
        if len(parts) < 10:
            continue
        local, state, inode = parts[1], parts[3], parts[9]
        if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
            inodes.add(inode)
    return inodes


def find_pid_by_port(port: int) -> int | None:
    """The local process listening on TCP `port` (None if not found or not visible)."""
    inodes: set[str] = set()
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as f:
                inodes |= parse_listen_inodes(f.read(), port)
        except OSError:
            continue
    if not inodes:
        return None
    targets = {f"socket:[{i}]" for i in inodes}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fd_dir = f"/proc/{entry}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"{fd_dir}/{fd}") in targets:
                    return int(entry)
            except OSError:
                continue
    return None


def machine_cpu_ticks() -> list[int]:
    """The whole machine's CPU time since boot, all cores, in clock ticks: the first
    eight fields of /proc/stat's "cpu" line (user, nice, system, idle, iowait, irq,
    softirq, steal; steal is 0 where the kernel does not report it)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    return v + [0] * (8 - len(v))


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine spent busy (all cores) since boot."""
    v = machine_cpu_ticks()
    return (sum(v) - v[3] - v[4]) / CLK_TCK


def machine_steal_seconds() -> float:
    """CPU seconds the hypervisor gave to other guests while this machine's cores
    wanted to run (all cores, since boot; 0 on bare metal). A run with steal measures
    less than the broker's own cost: its CPU per message rises with it."""
    return machine_cpu_ticks()[7] / CLK_TCK


class RssSampler:
    """Samples a process's VmRSS every `period` seconds in a thread; keeps the max."""

    def __init__(self, pid: int | None, period: float = 0.1) -> None:
        self.pid = pid
        self.period = period
        self.max_kb = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> RssSampler:
        if self.pid:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while True:
            kb = proc_rss_kb(self.pid) if self.pid else None
            if kb is None:
                return
            self.max_kb = max(self.max_kb, kb)
            if self._stop.wait(self.period):
                return

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.pid:
            kb = proc_rss_kb(self.pid)
            if kb:
                self.max_kb = max(self.max_kb, kb)
