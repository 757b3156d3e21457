"""Qpid JMS across a takeover of a primary/backup pair (real processes, a real ZooKeeper
on 127.0.0.1; the pair as in tests/ha/test_pair_takeover.py).

``interop/jms/src/main/java/amqbroker/interop/HaFailover.java`` is compiled with javac
and run in a JVM, as tests/integration/test_jms_interop.py does:

* two producer connections in one JVM send persistent grouped messages synchronously
  (a send returns once the broker answered `accepted`): ``a`` with
  ``failover:(amqp://primary,amqp://backup)``, ``b`` with ``failover:(amqp://primary)``
  only, so that it can reach the backup only through the primary's
  ``failover-server-list``;
* the test SIGKILLs the live primary once both have had sends acknowledged; the backup
  takes over; both connections reconnect by themselves (to the backup's port) and
  finish;
* a JMS consumer (failover URI of both members) then receives everything: no
  acknowledged message is lost, and per group the first deliveries come in send order
  (JMSXGroupSeq 1, 2, 3...). Duplicates (a send in flight at the kill, stored and
  replicated but not answered, is sent again by Qpid JMS after reconnecting) are
  allowed and counted.

Without ``QPID_JMS_CLASSPATH`` the module skips, except in CI (``CI`` set), where it
fails: scripts/test builds the class path from ../shared/qpid-jms there.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import pytest
import trio

from tests.cluster.cluster_helpers import free_port
from tests.cluster.zk_harness import ZooKeeperServer, zk_path, zookeeper  # noqa: F401
from tests.ha.test_pair_takeover import backup_in_sync, failover_list, live, member
from tests.integration.broker_process import BrokerProcesses

pytestmark = [pytest.mark.timeout(300), pytest.mark.interop]

CLASSPATH = os.environ.get("QPID_JMS_CLASSPATH", "")
ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "interop/jms/src/main/java/amqbroker/interop/HaFailover.java"
MAIN_CLASS = "amqbroker.interop.HaFailover"
# small, quick JVMs: the machines that run this have 2 cores
JVM_FLAGS = ["-Xmx256m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1", "-Xss512k"]
# Qpid JMS's failover provider at debug: it logs the URIs the open's failover-server-list
# gave it ("Replacing uris:... with new set: ...")
JVM_LOG = ["-Dorg.slf4j.simpleLogger.log.org.apache.qpid.jms.provider.failover=debug"]
WAIT = 30.0
QUEUE = "ha.jms.orders"
COUNT = 1000  # per producer connection
GROUPS = 4  # per producer connection
KILL_AFTER = 150  # acknowledged sends per producer before the SIGKILL
# reconnect at once, then every 50..500 ms: the backup listens once it is live
# (session timeout, 2 s here, plus its recovery); 200 attempts is well over a minute
FAILOVER_OPTIONS = (
    "failover.initialReconnectDelay=0&failover.reconnectDelay=50"
    "&failover.maxReconnectDelay=500&failover.useReconnectBackOff=true"
    "&failover.maxReconnectAttempts=200&failover.startupMaxReconnectAttempts=20"
)
ACK_RE = re.compile(r"^ACK (\S+) (\S+) (\d+) (\d+)$")
MSG_RE = re.compile(r"^MSG (\S+) (\d+) (\S+) (\d+) (true|false)$")
EVENT_RE = re.compile(r"^EVENT (\S+) (\S+) (.*)$")


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def failover_uri(*ports: int) -> str:
    urls = ",".join(f"amqp://127.0.0.1:{p}" for p in ports)
    return f"failover:({urls})?{FAILOVER_OPTIONS}"


@pytest.fixture(scope="module")
def jms_classpath(tmp_path_factory: pytest.TempPathFactory) -> str:
    """HaFailover.java compiled once; the class path to run it with."""
    if not CLASSPATH:
        why = (
            "the Qpid JMS failover test needs QPID_JMS_CLASSPATH (the qpid-jms-client jar "
            "and its dependencies, ':'-separated; scripts/test sets it from "
            "../shared/qpid-jms); it is not set"
        )
        if in_ci():
            pytest.fail(f"{why} (CI is set: this test must run in CI)")
        pytest.skip(why)
    for tool in ("javac", "java"):
        if shutil.which(tool) is None:
            pytest.fail(f"QPID_JMS_CLASSPATH is set but {tool!r} is not on PATH (need JDK 11+)")
    missing = [p for p in CLASSPATH.split(os.pathsep) if p and not Path(p).exists()]
    if missing:
        pytest.fail(f"QPID_JMS_CLASSPATH names files that do not exist: {missing}")
    out = tmp_path_factory.mktemp("ha-jms-classes")
    cmd = ["javac", "--release", "11", "-encoding", "UTF-8", "-d", str(out)]
    proc = subprocess.run(
        [*cmd, "-cp", CLASSPATH, str(SOURCE)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if proc.returncode != 0:
        pytest.fail(f"javac failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
    return f"{out}{os.pathsep}{CLASSPATH}"


class Jvm:
    """A HaFailover JVM whose stdout lines are read as they come (stderr to a file)."""

    def __init__(self, proc: trio.Process, stderr_path: Path) -> None:
        self.proc = proc
        self.stderr_path = stderr_path
        self.lines: list[str] = []
        self.changed = trio.Event()
        self.eof = False

    @classmethod
    async def start(
        cls, nursery: trio.Nursery, classpath: str, stderr_path: Path, *args: str
    ) -> Jvm:
        with stderr_path.open("wb") as err:
            proc = await trio.lowlevel.open_process(
                ["java", *JVM_FLAGS, *JVM_LOG, "-cp", classpath, MAIN_CLASS, *args],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=err,
            )
        jvm = cls(proc, stderr_path)
        nursery.start_soon(jvm._pump)
        return jvm

    async def _pump(self) -> None:
        assert self.proc.stdout is not None
        buf = b""
        try:
            async for chunk in self.proc.stdout:
                buf += chunk
                *complete, buf = buf.split(b"\n")
                self.lines += [raw.decode(errors="replace") for raw in complete]
                self.changed.set()
                self.changed = trio.Event()
        finally:
            self.eof = True
            self.changed.set()

    def count(self, prefix: str) -> Counter[str]:
        """Lines starting with `prefix`, counted by their second word."""
        return Counter(ln.split()[1] for ln in self.lines if ln.startswith(prefix + " "))

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def describe(self) -> str:
        return (
            f"JVM exit {self.proc.returncode}\nstdout (tail):\n"
            + "\n".join(self.lines[-40:])
            + f"\nstderr (tail):\n{self.stderr()[-4000:]}"
        )

    async def wait(self, timeout: float) -> int:
        with trio.move_on_after(timeout):
            await self.proc.wait()
            while not self.eof:
                await self.changed.wait()
        if self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()
            pytest.fail(f"the JVM did not finish within {timeout} s\n{self.describe()}")
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()


@pytest.fixture
async def procs(nursery: trio.Nursery, tmp_path: Path) -> BrokerProcesses:
    p = BrokerProcesses(nursery, cwd=tmp_path)
    try:
        yield p  # type: ignore[misc]
    finally:
        await p.aclose()


async def test_qpid_jms_sends_and_receives_grouped_messages_across_a_takeover(
    procs: BrokerProcesses,
    tmp_path: Path,
    nursery: trio.Nursery,
    zookeeper: ZooKeeperServer,  # noqa: F811
    zk_path: str,  # noqa: F811
    jms_classpath: str,
) -> None:
    p_port, b_port = free_port(), free_port()
    primary = await member(procs, "primary", tmp_path / "a", p_port, zookeeper, zk_path)
    await live(primary, p_port, 1)
    backup = await member(procs, "backup", tmp_path / "b", b_port, zookeeper, zk_path)
    await backup_in_sync(backup, 1)
    await primary.wait_for_line(r"HA primary: backup at .* is in sync", timeout=WAIT)
    want = {("127.0.0.1", p_port), ("127.0.0.1", b_port)}
    with trio.fail_after(WAIT):
        # another process's state, seen only by connecting: polled, bounded
        while await failover_list(p_port, nursery) != want:  # noqa: ASYNC110
            await trio.sleep(0.1)

    producer = await Jvm.start(
        nursery,
        jms_classpath,
        tmp_path / "producer.err",
        "produce",
        QUEUE,
        str(COUNT),
        str(GROUPS),
        f"a={failover_uri(p_port, b_port)}",
        f"b={failover_uri(p_port)}",  # only the primary: the backup is learnt
    )
    try:
        with trio.fail_after(60):
            while True:
                acks = producer.count("ACK")
                if acks["a"] >= KILL_AFTER and acks["b"] >= KILL_AFTER:
                    break
                if producer.eof:
                    pytest.fail(f"the producers stopped early\n{producer.describe()}")
                await producer.changed.wait()
        assert not producer.count("DONE"), "a producer finished before the kill"
        before = producer.count("ACK")
        await primary.crash()  # SIGKILL mid-stream
        killed = time.monotonic()
        await live(backup, b_port, 2)
        takeover = time.monotonic() - killed
        rc = await producer.wait(120)
    finally:
        producer.kill()
    finished = time.monotonic() - killed
    assert rc == 0, producer.describe()
    assert producer.count("DONE") == {"a": 1, "b": 1}, producer.describe()

    # both connections were interrupted and restored on the backup's port, by themselves;
    # b was configured with the primary's URL only
    events: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for line in producer.lines:
        if m := EVENT_RE.match(line):
            events[m[1]].append((m[2], m[3]))
    for name in ("a", "b"):
        kinds = [k for k, _ in events[name]]
        assert kinds[0] == "established", (name, events[name])
        assert f":{p_port}" in events[name][0][1], (name, events[name])
        assert "interrupted" in kinds, (name, events[name])
        restored = [uri for k, uri in events[name] if k == "restored"]
        assert restored, (name, events[name], producer.describe())
        assert restored[-1].endswith(f":{b_port}"), (name, events[name])
    replaced = [ln for ln in producer.stderr().splitlines() if "Replacing uris" in ln]

    acked: dict[tuple[str, int], tuple[str, int]] = {}
    for line in producer.lines:
        if m := ACK_RE.match(line):
            acked[m[1], int(m[4])] = (m[2], int(m[3]))
    assert len(acked) == 2 * COUNT

    consumer = await Jvm.start(
        nursery,
        jms_classpath,
        tmp_path / "consumer.err",
        "consume",
        QUEUE,
        "3000",
        failover_uri(p_port, b_port),
    )
    try:
        assert await consumer.wait(120) == 0, consumer.describe()
    finally:
        consumer.kill()
    got: list[tuple[str, int, str, int, bool]] = []
    for line in consumer.lines:
        if m := MSG_RE.match(line):
            got.append((m[1], int(m[2]), m[3], int(m[4]), m[5] == "true"))
    assert consumer.lines[-1] == f"DONE {len(got)}", consumer.describe()

    # no acknowledged message lost
    received = {(producer_name, n) for _, _, producer_name, n, _ in got}
    lost = sorted(set(acked) - received)
    assert not lost, f"{len(lost)} acknowledged message(s) lost: {lost[:20]}"
    # per group, first deliveries in send order: JMSXGroupSeq 1, 2, 3... without a gap
    first: dict[str, list[int]] = defaultdict(list)
    seen: set[tuple[str, int]] = set()
    for group, seq, _, _, _ in got:
        if (group, seq) not in seen:
            seen.add((group, seq))
            first[group].append(seq)
    assert sorted(first) == sorted(f"{p}-g{g}" for p in ("a", "b") for g in range(GROUPS))
    for group, seqs in first.items():
        assert seqs == list(range(1, COUNT // GROUPS + 1)), (group, seqs[:50])
    duplicates = len(got) - len(seen)
    redelivered = sum(1 for *_, r in got if r)
    print(
        f"\nJMS across a takeover: {len(acked)} sent and acknowledged, "
        f"{before['a']}+{before['b']} before the SIGKILL; takeover {takeover:.1f} s; "
        f"producers done {finished:.1f} s after the kill; {len(got)} received, "
        f"{duplicates} duplicate(s), {redelivered} flagged redelivered; "
        f"restored: a -> {events['a'][-1][1]}, b -> {events['b'][-1][1]}; "
        f"failover-server-list log lines: {replaced[:2]}",
        file=sys.stderr,
    )
    assert await backup.stop() == 0
