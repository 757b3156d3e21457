"""The broker under test: one given by --host/--port (its pid found through /proc), an
amqbroker started for the run (--start-broker: ``python -m amqbroker run --port 0`` on
a temporary data directory, stopped at the end), or the null broker (--ceiling).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from amqbroker.tools.perf.options import HOL_STRICT_PREFIX
from amqbroker.tools.perf.stats import find_pid_by_port
from amqbroker.tools.perf.status import SELF


class RunError(Exception):
    pass


# ------------------------------------------------------------------------- targets


@dataclass
class Target:
    host: str
    port: int
    pid: int | None
    label: str
    proc: subprocess.Popen[bytes] | None = None
    tmpdir: str | None = None
    strict_configured: bool = False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.tmpdir:
            shutil.rmtree(self.tmpdir, ignore_errors=True)


LISTENING_RE = re.compile(r"listening on (?:amqp://)?([\w.:\[\]-]+):(\d+)")


def strict_address_settings(existing: str | None) -> str:
    """AMQBROKER_ADDRESS_SETTINGS with hol-strict.# -> group_skip_ahead=false added."""
    table = json.loads(existing) if existing else {}
    table.setdefault(HOL_STRICT_PREFIX + "#", {}).setdefault("group_skip_ahead", False)
    return json.dumps(table)


def _wait_listening(proc: subprocess.Popen[bytes], out_path: Path, what: str) -> int:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        text = out_path.read_text(errors="replace") if out_path.exists() else ""
        m = LISTENING_RE.search(text)
        if m:
            return int(m.group(2))
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    raise RunError(
        f"{what} did not start; its output:\n{out_path.read_text(errors='replace')[-3000:]}"
    )


def start_broker(args: argparse.Namespace) -> Target:
    tmp = tempfile.mkdtemp(prefix="amqbroker-perf-")
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    for item in args.broker_env:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise RunError(f"--broker-env {item!r}: expected NAME=VALUE")
        env[name] = value
    env["AMQBROKER_ADDRESS_SETTINGS"] = strict_address_settings(
        env.get("AMQBROKER_ADDRESS_SETTINGS")
    )
    out = Path(tmp) / "broker.out"
    cmd = [sys.executable, "-m", "amqbroker", "run", "--host", "127.0.0.1", "--port", "0"]
    cmd += ["--data-dir", str(Path(tmp) / "data")]
    with open(out, "wb") as fo, open(Path(tmp) / "broker.log", "wb") as fe:
        proc = subprocess.Popen(
            cmd, stdout=fo, stderr=fe, stdin=subprocess.DEVNULL, env=env, cwd=tmp
        )
    target = Target("127.0.0.1", 0, proc.pid, args.label or "amqbroker", proc, tmp, True)
    try:
        # the start banner is a log line (stderr)
        target.port = _wait_listening(proc, Path(tmp) / "broker.log", "amqbroker")
    except BaseException:
        with contextlib.suppress(OSError):
            print((Path(tmp) / "broker.log").read_text(errors="replace")[-3000:], file=sys.stderr)
        target.stop()
        raise
    return target


def start_null_broker(args: argparse.Namespace) -> Target:
    tmp = tempfile.mkdtemp(prefix="amqbroker-perf-null-")
    out = Path(tmp) / "null.out"
    cmd = [*SELF, "--_null-broker", "--credit", str(args.window)]
    with open(out, "wb") as fo:
        proc = subprocess.Popen(cmd, stdout=fo, stderr=None, stdin=subprocess.DEVNULL)
    target = Target("127.0.0.1", 0, proc.pid, args.label or "null-broker", proc, tmp)
    try:
        target.port = _wait_listening(proc, out, "the null broker")
    except BaseException:
        target.stop()
        raise
    return target


def make_target(args: argparse.Namespace) -> Target:
    if args.start_broker:
        return start_broker(args)
    if args.ceiling:
        return start_null_broker(args)
    try:
        socket.create_connection((args.host, args.port), timeout=5).close()
    except OSError as exc:
        raise RunError(f"cannot connect to {args.host}:{args.port}: {exc}") from None
    pid = args.broker_pid
    if pid is None and args.host in ("127.0.0.1", "localhost", "::1"):
        pid = find_pid_by_port(args.port)
    return Target(args.host, args.port, pid, args.label or f"{args.host}:{args.port}")
