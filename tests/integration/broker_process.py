"""Run the real broker (`python -m amqbroker run`) as a subprocess from trio tests.

Usage (inside a trio test, with a `BrokerProcesses` from the `procs` fixture of the test
module)::

    bp = await procs.start(data_dir, env={"AMQBROKER_SHUTDOWN_TIMEOUT": "5"})
    port = bp.port                      # learnt from the "listening on" line
    bp.kill()                           # SIGKILL (a crash)
    rc = await bp.stop()                # SIGTERM, bounded wait, then SIGKILL

Every wait is bounded (`trio.fail_after`); nothing sleeps for a fixed time. Output is
read continuously by background tasks (so the broker never blocks on a full pipe) and
kept in `stdout_lines` / `stderr_lines`; `wait_for_line` waits for a line matching a
pattern. `BrokerProcesses.aclose` SIGKILLs whatever a test left running; a test module
gets one from a small fixture::

    @pytest.fixture
    async def procs(nursery, tmp_path):
        p = BrokerProcesses(nursery, cwd=tmp_path)
        try:
            yield p
        finally:
            await p.aclose()

Caveat (broker bug at the time of writing, see test_cli
test_signal_right_after_ready_is_graceful): the broker prints its ready lines before
its signal handler is installed, so a signal sent the instant they appear can kill it
with the default action. Tests that stop a broker gracefully first talk to it (any
AMQP round trip proves its event loop, and so its signal handler, is running).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import trio

START_TIMEOUT = 20.0
STOP_TIMEOUT = 15.0
#: the start banner: one log line on stderr ("... INFO amqbroker: amqbroker V listening
#: on amqp://H:P[, ...]; data in DIR (N queue(s), M message(s) recovered)")
LISTENING_RE = re.compile(
    r"INFO amqbroker: amqbroker \S+ listening on amqp://127\.0\.0\.1:(\d+)[,;]"
)
DATA_DIR_RE = re.compile(
    r"INFO amqbroker: amqbroker \S+ listening on .*?; data in (.+) \(\d+ queue\(s\), \d+ message"
)


class BrokerProcessError(AssertionError):
    """The broker process did not behave as expected (message has its output)."""


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The test's environment without any AMQBROKER_* variable, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("AMQBROKER_")}
    env["PYTHONUNBUFFERED"] = "1"
    if extra:
        env.update(extra)
    return env


class BrokerProcess:
    """One broker subprocess and everything it printed."""

    def __init__(self, proc: trio.Process, args: Sequence[str]) -> None:
        self.proc = proc
        self.args = list(args)
        self.stdout_lines: list[str] = []
        self.stderr_lines: list[str] = []
        self.port: int | None = None
        self.data_dir: Path | None = None
        self._changed = trio.Event()
        self._streams_done = 0

    # ------------------------------------------------------------------ output
    async def _pump(self, stream: trio.abc.ReceiveStream, lines: list[str]) -> None:
        buf = b""
        try:
            async for chunk in stream:
                buf += chunk
                *complete, buf = buf.split(b"\n")
                for raw in complete:
                    lines.append(raw.decode(errors="replace").rstrip("\r"))
                if complete:
                    self._signal()
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass
        finally:
            if buf:
                lines.append(buf.decode(errors="replace"))
            self._streams_done += 1
            self._signal()

    def _signal(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    @property
    def stdout(self) -> str:
        return "\n".join(self.stdout_lines)

    @property
    def stderr(self) -> str:
        return "\n".join(self.stderr_lines)

    @property
    def output_done(self) -> bool:
        return self._streams_done >= 2

    def describe(self) -> str:
        return (
            f"broker {self.args} (pid {self.proc.pid}, returncode {self.proc.returncode})\n"
            f"--- stdout ---\n{self.stdout}\n--- stderr ---\n{self.stderr}"
        )

    async def wait_for_line(
        self, pattern: str | re.Pattern[str], *, stream: str = "stderr", timeout: float = 10.0
    ) -> re.Match[str]:
        """Wait until a line of `stream` ("stdout"/"stderr") matches `pattern` (re.search)."""
        rx = re.compile(pattern) if isinstance(pattern, str) else pattern
        lines = self.stdout_lines if stream == "stdout" else self.stderr_lines
        seen = 0
        try:
            with trio.fail_after(timeout):
                while True:
                    for line in lines[seen:]:
                        if m := rx.search(line):
                            return m
                    seen = len(lines)
                    if self.output_done:
                        raise BrokerProcessError(
                            f"no {stream} line matching {rx.pattern!r}; the process closed "
                            f"its output\n{self.describe()}"
                        )
                    await self._changed.wait()
        except trio.TooSlowError:
            raise BrokerProcessError(
                f"no {stream} line matching {rx.pattern!r} within {timeout} s\n{self.describe()}"
            ) from None

    # ----------------------------------------------------------------- control
    @property
    def running(self) -> bool:
        return self.proc.returncode is None

    async def wait_ready(self, timeout: float = START_TIMEOUT) -> int:
        """Wait for the start banner (port and data directory); returns the port.
        Fails with the output if the process exits first."""
        with trio.move_on_after(timeout) as scope:
            m = await self.wait_for_line(LISTENING_RE, timeout=timeout)
            self.port = int(m.group(1))
            m = await self.wait_for_line(DATA_DIR_RE, timeout=timeout)
            self.data_dir = Path(m.group(1))
        if scope.cancelled_caught:
            raise BrokerProcessError(f"not ready within {timeout} s\n{self.describe()}")
        assert self.port is not None
        return self.port

    async def wait_exit(self, timeout: float = STOP_TIMEOUT) -> int:
        """Wait (bounded) for the process to exit and its output to end; returns the status."""
        try:
            with trio.fail_after(timeout):
                await self.proc.wait()
                while not self.output_done:
                    await self._changed.wait()
        except trio.TooSlowError:
            raise BrokerProcessError(
                f"the broker did not exit within {timeout} s\n{self.describe()}"
            ) from None
        assert self.proc.returncode is not None
        return self.proc.returncode

    def send_signal(self, sig: int) -> None:
        if self.running:
            self.proc.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL: a crash, nothing flushed."""
        if self.running:
            self.proc.kill()

    async def crash(self) -> int:
        """SIGKILL and wait for the process to be gone."""
        self.kill()
        return await self.wait_exit()

    async def stop(self, sig: int = signal.SIGTERM, timeout: float = STOP_TIMEOUT) -> int:
        """Send `sig`, wait up to `timeout`, then SIGKILL; returns the exit status (a
        negative status means a signal killed it). See the module caveat about
        signalling right after start-up."""
        if self.running:
            self.proc.send_signal(sig)
            with trio.move_on_after(timeout):
                await self.proc.wait()
            if self.running:
                self.proc.kill()
        return await self.wait_exit()


class BrokerProcesses:
    """Starts broker subprocesses in a nursery; `aclose` kills the ones still running."""

    def __init__(self, nursery: trio.Nursery, cwd: Path | None = None) -> None:
        self.nursery = nursery
        self.cwd = cwd
        self.started: list[BrokerProcess] = []

    async def spawn(
        self,
        args: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        stdout: int | None = None,
    ) -> BrokerProcess:
        """Start `python -m amqbroker <args>` without waiting for anything.

        `stdout`: a file descriptor to give the child as its stdout instead of a pipe
        read by this helper (then `stdout_lines` stays empty)."""
        cmd = [sys.executable, "-m", "amqbroker", *args]
        proc = await trio.lowlevel.open_process(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if stdout is None else stdout,
            stderr=subprocess.PIPE,
            env=clean_env(env),
            cwd=str(cwd or self.cwd or Path.cwd()),
        )
        bp = BrokerProcess(proc, cmd)
        self.started.append(bp)
        assert proc.stderr is not None
        if proc.stdout is not None:
            self.nursery.start_soon(bp._pump, proc.stdout, bp.stdout_lines)
        else:
            bp._streams_done += 1
        self.nursery.start_soon(bp._pump, proc.stderr, bp.stderr_lines)
        return bp

    async def start(
        self,
        data_dir: Path | None,
        *,
        env: Mapping[str, str] | None = None,
        args: Sequence[str] = (),
        port: int = 0,
        cwd: Path | None = None,
        timeout: float = START_TIMEOUT,
    ) -> BrokerProcess:
        """`amqbroker run --port <port> [--data-dir D] <args>`; waits until it listens."""
        run_args = ["run", "--port", str(port)]
        if data_dir is not None:
            run_args += ["--data-dir", str(data_dir)]
        bp = await self.spawn([*run_args, *args], env=env, cwd=cwd)
        await bp.wait_ready(timeout)
        return bp

    async def aclose(self) -> None:
        for bp in self.started:
            if bp.running:
                bp.kill()
                with trio.CancelScope(shield=True), trio.move_on_after(STOP_TIMEOUT):
                    await bp.proc.wait()
