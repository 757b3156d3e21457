"""A primary/backup pair whose live member a real ZooKeeper decides, as real processes
(`amqbroker run` with ha_role and cluster_zookeeper) on 127.0.0.1.

* SIGKILL the live primary under durable grouped load: the backup is live within the
  ZooKeeper session timeout plus 2 s, serves every message the primary answered
  `accepted` once and in order, and the old primary, restarted on its own data dir,
  becomes the new live member's backup (a full resync) instead of serving its old copy.
* SIGSTOP the live primary past its session: the backup takes over; once resumed
  (SIGCONT) the old primary answers nothing more (its pending send is never accepted,
  its connection closes), then rejoins as the backup.
* A pause far shorter than the session (SIGSTOP, SIGCONT): sends are refused only
  until ZooKeeper confirms the lease, then answered again.
* The live member advertises the pair in the open's failover-server-list.
"""

from __future__ import annotations

import contextlib
import json
import signal
import time
from pathlib import Path

import pytest
import trio
from proton import Delivery, Message

from amqbroker.core.auth import hash_password
from tests.client import Client, ClientError
from tests.cluster.cluster_helpers import free_port
from tests.cluster.zk_harness import ZooKeeperServer, zk_path, zookeeper  # noqa: F401
from tests.ha.test_ha_processes import consume_all, produce
from tests.integration.broker_process import BrokerProcess, BrokerProcesses

pytestmark = pytest.mark.timeout(180)

USER = "cluster"
PASSWORD = "cluster-pw"
WAIT = 30.0
SESSION_MS = 2000
NODE = "node1"


def member_env(role: str, zk: ZooKeeperServer, path: str) -> dict[str, str]:
    return {
        "AMQBROKER_HA_ROLE": role,
        "AMQBROKER_NODE_ID": NODE,
        "AMQBROKER_CLUSTER_ZOOKEEPER": zk.hosts,
        "AMQBROKER_CLUSTER_ZOOKEEPER_PATH": path,
        "AMQBROKER_CLUSTER_ZOOKEEPER_SESSION_TIMEOUT": str(SESSION_MS),
        "AMQBROKER_CLUSTER_USER": USER,
        "AMQBROKER_CLUSTER_PASSWORD": PASSWORD,
        "AMQBROKER_USERS": json.dumps({USER: hash_password(PASSWORD, iterations=1000)}),
        "AMQBROKER_CLUSTER_RECONNECT_INITIAL": "0.05",
        "AMQBROKER_CLUSTER_RECONNECT_MAX": "0.3",
        "AMQBROKER_SHUTDOWN_TIMEOUT": "2",
        "AMQBROKER_STORE_SYNC": "false",  # a SIGKILL keeps the page cache
        "AMQBROKER_HA_ACK_TIMEOUT": "3",
        "AMQBROKER_IDLE_TIMEOUT": "4",
    }


@pytest.fixture
async def procs(nursery: trio.Nursery, tmp_path: Path) -> BrokerProcesses:
    p = BrokerProcesses(nursery, cwd=tmp_path)
    try:
        yield p  # type: ignore[misc]
    finally:
        await p.aclose()


async def member(
    procs: BrokerProcesses,
    role: str,
    data_dir: Path,
    port: int,
    zk: ZooKeeperServer,
    path: str,
    **extra: str,
) -> BrokerProcess:
    """A pair member; `extra`: more environment (``AMQBROKER_...``)."""
    return await procs.spawn(
        ["run", "--port", str(port), "--data-dir", str(data_dir)],
        env=member_env(role, zk, path) | extra,
    )


async def live(m: BrokerProcess, port: int, epoch: int) -> None:
    await m.wait_for_line(rf"is LIVE at epoch {epoch} ", timeout=WAIT)
    await m.wait_for_line(rf"listening on amqp://127\.0\.0\.1:{port}", timeout=WAIT)


async def start_pair(
    procs: BrokerProcesses, tmp_path: Path, zk: ZooKeeperServer, path: str, **backup_env: str
) -> tuple[BrokerProcess, BrokerProcess, int, int]:
    """A primary live at epoch 1 (data dir a) and its backup in sync (data dir b)."""
    p_port, b_port = free_port(), free_port()
    primary = await member(procs, "primary", tmp_path / "a", p_port, zk, path)
    await live(primary, p_port, 1)
    backup = await member(procs, "backup", tmp_path / "b", b_port, zk, path, **backup_env)
    await backup_in_sync(backup, 1)
    await primary.wait_for_line(r"HA primary: backup at .* is in sync", timeout=WAIT)
    return primary, backup, p_port, b_port


async def failover_list(port: int, nursery: trio.Nursery) -> set[tuple[str, int]]:
    c = await Client.connect(port, nursery=nursery)
    props = dict(c.conn.remote_properties or {})
    c.abort()
    return {(s["network-host"], s["port"]) for s in props.get("failover-server-list", [])}


async def backup_in_sync(m: BrokerProcess, epoch: int) -> None:
    await m.wait_for_line(rf"HA backup: in sync with the primary .*\(epoch {epoch},", timeout=WAIT)
    await m.wait_for_line(rf"is eligible, its store complete for epoch {epoch}", timeout=WAIT)


async def test_sigkill_live_primary_backup_takes_over_and_the_old_primary_resyncs(
    procs: BrokerProcesses,
    tmp_path: Path,
    nursery: trio.Nursery,
    zookeeper: ZooKeeperServer,  # noqa: F811
    zk_path: str,  # noqa: F811
) -> None:
    primary, backup, p_port, b_port = await start_pair(procs, tmp_path, zookeeper, zk_path)

    # the live member names both members to clients (once its lease saw the backup)
    want = {("127.0.0.1", p_port), ("127.0.0.1", b_port)}
    with trio.fail_after(WAIT):
        # another process's state, seen only by connecting: polled, bounded
        while (seen := await failover_list(p_port, nursery)) != want:  # noqa: ASYNC110
            await trio.sleep(0.1)
    assert seen == want

    accepted: list[int] = []
    half = trio.Event()
    done = trio.Event()

    async def producer() -> None:
        try:
            await produce(p_port, nursery, 0, 2000, accepted, progress=half)
        finally:
            done.set()

    nursery.start_soon(producer)
    with trio.fail_after(WAIT):
        await half.wait()
    await primary.crash()  # SIGKILL mid-stream
    killed = time.monotonic()
    with trio.fail_after(WAIT):
        await done.wait()
    assert len(accepted) >= 1000
    await live(backup, b_port, 2)
    takeover = time.monotonic() - killed
    # the spec's bound: live within the session timeout plus 2 s (the line can only
    # be read after the fact, so this measures at most the real time)
    assert takeover <= SESSION_MS / 1000 + 2.0, f"takeover took {takeover:.1f} s"

    # the old primary comes back on its own data dir: its copy is of epoch 1, the
    # lease is at 2: it mirrors the new live member instead of serving
    again = await member(procs, "primary", tmp_path / "a", p_port, zookeeper, zk_path)
    await again.wait_for_line(r"is standby \(live node1@127\.0\.0\.1:\d+ .*epoch 2\)", timeout=WAIT)
    await backup_in_sync(again, 2)
    assert not any("is LIVE" in line for line in again.stderr_lines)

    got = await consume_all(b_port, nursery)
    assert len(got) == len(set(got))
    assert got == sorted(got)  # one queue, one consumer: send order, groups included
    assert set(accepted) <= set(got)
    assert got[: len(accepted)] == accepted
    assert await backup.stop() == 0
    # the live member stopped cleanly: the old primary, in sync, takes over at 3
    await live(again, p_port, 3)
    assert await consume_all(p_port, nursery) == []
    assert await again.stop() == 0


async def test_a_paused_primary_answers_nothing_after_the_takeover_and_rejoins_as_backup(
    procs: BrokerProcesses,
    tmp_path: Path,
    nursery: trio.Nursery,
    zookeeper: ZooKeeperServer,  # noqa: F811
    zk_path: str,  # noqa: F811
) -> None:
    primary, backup, p_port, b_port = await start_pair(procs, tmp_path, zookeeper, zk_path)
    accepted: list[int] = []
    await produce(p_port, nursery, 0, 100, accepted)
    assert accepted == list(range(100))

    c = await Client.connect(p_port, nursery=nursery)
    s = await c.sender("orders")
    primary.send_signal(signal.SIGSTOP)
    try:
        await live(backup, b_port, 2)
        # sends queued to the paused primary: it reads them only once resumed. The
        # non-durable one needs no store cycle: the pause itself must fence it
        loose = s.send_nowait(Message(body="late", durable=False, properties={"i": 101}))
        pending = s.send_nowait(Message(body="late", durable=True, properties={"i": 100}))
        await c._flush()
    finally:
        primary.send_signal(signal.SIGCONT)
    with contextlib.suppress(ClientError):  # the connection lost: a fenced primary may
        await c._wait(
            lambda: (bool(pending.remote_state) and bool(loose.remote_state)) or c.closed_by_peer,
            WAIT,
        )
    assert pending.remote_state != Delivery.ACCEPTED
    assert loose.remote_state != Delivery.ACCEPTED
    await primary.wait_for_line(r"lost its lease|answers nothing more", timeout=WAIT)
    c.abort()
    # it rejoins as the backup of the new live member
    await backup_in_sync(primary, 2)
    got = await consume_all(b_port, nursery)
    assert got == list(range(100))
    assert await backup.stop() == 0
    assert await primary.stop() == 0


async def test_a_short_pause_refuses_sends_only_until_zookeeper_confirms_the_lease(
    procs: BrokerProcesses,
    tmp_path: Path,
    nursery: trio.Nursery,
    zookeeper: ZooKeeperServer,  # noqa: F811
    zk_path: str,  # noqa: F811
) -> None:
    primary, backup, p_port, _ = await start_pair(procs, tmp_path, zookeeper, zk_path)
    c = await Client.connect(p_port, nursery=nursery)
    s = await c.sender("orders")
    primary.send_signal(signal.SIGSTOP)
    try:  # a pause far shorter than the session, with a send queued meanwhile
        queued = s.send_nowait(Message(body="queued", durable=False, properties={"i": -1}))
        await c._flush()
    finally:
        primary.send_signal(signal.SIGCONT)
    await c._wait(lambda: bool(queued.remote_state), WAIT)
    # read after the resume: refused until ZooKeeper confirmed the lease
    assert queued.remote_state == Delivery.REJECTED
    assert "was paused and is checking in ZooKeeper" in str(queued.remote.condition)
    c.abort()
    await primary.wait_for_line(
        r"resumed after a pause; ZooKeeper confirms it is live at epoch 1", timeout=WAIT
    )
    accepted: list[int] = []
    await produce(p_port, nursery, 0, 50, accepted)
    assert accepted == list(range(50))
    assert not any("is LIVE" in line for line in backup.stderr_lines)
    assert await backup.stop() == 0
    assert await primary.stop() == 0


async def test_a_killed_backup_leaves_the_primary_alone_under_a_new_epoch_then_catches_up(
    procs: BrokerProcesses,
    tmp_path: Path,
    nursery: trio.Nursery,
    zookeeper: ZooKeeperServer,  # noqa: F811
    zk_path: str,  # noqa: F811
) -> None:
    primary, backup, p_port, b_port = await start_pair(procs, tmp_path, zookeeper, zk_path)

    accepted: list[int] = []
    loaded = trio.Event()

    async def load(lo: int, hi: int) -> None:
        try:
            await produce(p_port, nursery, lo, hi, accepted, batch=20)
        finally:
            loaded.set()

    nursery.start_soon(load, 0, 1500)
    await backup.crash()  # the backup dies under load
    # the primary answers alone only under a new epoch: the dead backup's copy (epoch
    # 1) can never become live, whatever it holds
    await primary.wait_for_line(r"answers without a backup in sync; took epoch 2", timeout=WAIT)
    with trio.fail_after(WAIT):
        await loaded.wait()
    assert len(accepted) == 1500

    # restarted, it claims epoch 1 (stale), mirrors the live member and is a
    # candidate again only with a full copy of epoch 2, caught up while load runs
    loaded = trio.Event()
    nursery.start_soon(load, 1500, 2500)
    backup = await member(procs, "backup", tmp_path / "b", b_port, zookeeper, zk_path)
    await backup_in_sync(backup, 2)
    with trio.fail_after(WAIT):
        await loaded.wait()
    assert len(accepted) == 2500
    await primary.crash()
    await live(backup, b_port, 3)
    got = await consume_all(b_port, nursery)
    assert got == list(range(2500))
    assert await backup.stop() == 0
