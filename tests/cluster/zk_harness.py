"""A real ZooKeeper server on 127.0.0.1 for the cluster tests, and a fixture for it.

Uses Debian's ``zookeeper`` package (jars in /usr/share/java, installed by
``scripts/test`` when it runs as root with apt-get) and the JVM: a standalone
``QuorumPeerMain`` with a temporary dataDir, a free client port on 127.0.0.1, the
admin server and the four-letter-word commands off, and a short tickTime so session
timeouts of a second are allowed. `ZooKeeperServer.start` waits (bounded) until a
kazoo client can open a session; `stop` SIGTERMs then SIGKILLs and removes nothing
but its own process.

Tests use the `zookeeper` fixture (one server per test module: a JVM takes a couple
of seconds to start), each test under its own znode path (`zk_path`). The fixture
skips, with the reason, only when ZooKeeper, java or kazoo is not installed.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

JAVA_DIR = Path(os.environ.get("AMQBROKER_ZOOKEEPER_JARS", "/usr/share/java"))
ZOOKEEPER_JAR = JAVA_DIR / "zookeeper.jar"
LOG_BINDING_JAR = JAVA_DIR / "slf4j-simple.jar"  # ZooKeeper's log to stderr, if present
MAIN_CLASS = "org.apache.zookeeper.server.quorum.QuorumPeerMain"
TICK_MS = 100  # sessions may then last 200 ms .. 20 s
START_TIMEOUT = 30.0
STOP_TIMEOUT = 10.0
NOT_INSTALLED = (
    "ZooKeeper tests skipped: {what} is not installed (Debian: apt-get install zookeeper, "
    "pip install kazoo; scripts/test installs both when run as root)"
)


def missing() -> str | None:
    """Why a ZooKeeper server cannot be run here, or None if it can."""
    if shutil.which("java") is None:
        return NOT_INSTALLED.format(what="java")
    if not ZOOKEEPER_JAR.exists():
        return NOT_INSTALLED.format(what=str(ZOOKEEPER_JAR))
    try:
        import kazoo  # noqa: F401
    except ImportError:
        return NOT_INSTALLED.format(what="the kazoo Python client")
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def zoo_cfg(data_dir: Path, port: int, tick_ms: int = TICK_MS) -> str:
    return "\n".join(
        [
            f"tickTime={tick_ms}",
            f"dataDir={data_dir}",
            f"clientPort={port}",
            "clientPortAddress=127.0.0.1",
            "admin.enableServer=false",
            "4lw.commands.whitelist=",
            f"minSessionTimeout={2 * tick_ms}",
            f"maxSessionTimeout={200 * tick_ms}",
            "",
        ]
    )


class ZooKeeperServer:
    """One standalone ZooKeeper process; `hosts` is its ``host:port``."""

    def __init__(self, workdir: Path, port: int | None = None) -> None:
        self.workdir = workdir
        self.port = port or free_port()
        self.hosts = f"127.0.0.1:{self.port}"
        self.log_path = workdir / "zookeeper.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        data = self.workdir / "data"
        data.mkdir(parents=True, exist_ok=True)
        cfg = self.workdir / "zoo.cfg"
        cfg.write_text(zoo_cfg(data, self.port), encoding="utf-8")
        classpath = [str(ZOOKEEPER_JAR)]
        if LOG_BINDING_JAR.exists():
            classpath.append(str(LOG_BINDING_JAR))
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [
                    "java",
                    "-Xmx128m",
                    "-XX:+UseSerialGC",
                    "-Dzookeeper.admin.enableServer=false",
                    "-cp",
                    os.pathsep.join(classpath),
                    MAIN_CLASS,
                    str(cfg),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.workdir,
            )
        self._wait_ready()

    def _wait_ready(self) -> None:
        from kazoo.client import KazooClient
        from kazoo.handlers.threading import KazooTimeoutError

        deadline = time.monotonic() + START_TIMEOUT
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"ZooKeeper exited with {self.proc.returncode} at start:\n{self.log_tail()}"
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.stop()
                raise RuntimeError(
                    f"ZooKeeper did not accept a session within {START_TIMEOUT} s:\n"
                    f"{self.log_tail()}"
                )
            client = KazooClient(hosts=self.hosts, timeout=2.0)
            try:
                client.start(timeout=min(2.0, remaining))
            except KazooTimeoutError:
                continue
            else:
                client.stop()
                client.close()
                return

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=STOP_TIMEOUT)


def end_session(hosts: str, session: tuple[int, bytes]) -> None:
    """End a client's ZooKeeper session from outside, as an expiry does: a second
    client attaches to the same session (id, password) and closes it. Blocking."""
    from kazoo.client import KazooClient

    thief = KazooClient(hosts=hosts, client_id=session, timeout=2.0)
    thief.start(timeout=5)
    thief.stop()
    thief.close()


@pytest.fixture(scope="module")
def zookeeper() -> Iterator[ZooKeeperServer]:
    reason = missing()
    if reason is not None:
        if os.environ.get("CI"):
            # in CI the cluster tests run or fail: scripts/test installs ZooKeeper there
            pytest.fail(reason.replace("skipped", "cannot run in CI"))
        pytest.skip(reason)
    with tempfile.TemporaryDirectory(prefix="amqbroker-zk-") as tmp:
        server = ZooKeeperServer(Path(tmp))
        server.start()
        try:
            yield server
        finally:
            server.stop()


@pytest.fixture
def zk_path() -> str:
    """A fresh election path per test, so tests sharing a server never meet."""
    return f"/amqbroker-test/{uuid.uuid4().hex[:12]}"


if __name__ == "__main__":  # manual use: python -m tests.cluster.zk_harness
    if (why := missing()) is not None:
        sys.exit(why)
    with tempfile.TemporaryDirectory(prefix="amqbroker-zk-") as tmp:
        zk = ZooKeeperServer(Path(tmp))
        zk.start()
        print(f"ZooKeeper on {zk.hosts}; Ctrl-C stops it", flush=True)
        try:
            zk.proc.wait()  # type: ignore[union-attr]
        except KeyboardInterrupt:
            pass
        finally:
            zk.stop()
