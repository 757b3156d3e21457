"""A primary and its backup as real broker processes (`amqbroker run` with
ha_role = primary / backup) on 127.0.0.1, another port and data dir each.

* SIGKILL the primary while a producer sends 2,000 durable messages (grouped and
  not): the backup, promoted (SIGUSR1: `BrokerApp.promote` in the backup process),
  serves every message the primary answered `accepted`, exactly once, in order.
* A backup started after the primary already holds messages catches up by full sync
  while a producer keeps sending; killing it lets the primary go on (its log says it
  runs unreplicated) and a restarted backup catches up again.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import trio
from proton import Delivery, Message

from amqbroker.core.auth import hash_password
from tests.client import Client, ClientError
from tests.cluster.cluster_helpers import free_port
from tests.integration.broker_process import BrokerProcess, BrokerProcesses

pytestmark = pytest.mark.timeout(120)

USER = "cluster"
PASSWORD = "cluster-pw"
WAIT = 30.0
IN_SYNC = r"HA backup: in sync with the primary .* stream (\w+)\)"


async def wait_synced(primary: BrokerProcess, backup: BrokerProcess) -> None:
    """Until the primary waits for this backup: the backup has the snapshot and the
    primary sent it every queued batch (its line names the stream)."""
    m = await backup.wait_for_line(IN_SYNC, timeout=WAIT)
    await primary.wait_for_line(rf"HA primary: backup at .* is in sync \(stream {m.group(1)}\)")


def env(role: str, primary_port: int | None = None) -> dict[str, str]:
    e = {
        "AMQBROKER_HA_ROLE": role,
        "AMQBROKER_CLUSTER_USER": USER,
        "AMQBROKER_CLUSTER_PASSWORD": PASSWORD,
        "AMQBROKER_USERS": json.dumps({USER: hash_password(PASSWORD, iterations=1000)}),
        "AMQBROKER_CLUSTER_RECONNECT_INITIAL": "0.05",
        "AMQBROKER_CLUSTER_RECONNECT_MAX": "0.3",
        "AMQBROKER_SHUTDOWN_TIMEOUT": "2",
        "AMQBROKER_STORE_SYNC": "false",  # a SIGKILL keeps the page cache
        "AMQBROKER_HA_ACK_TIMEOUT": "5",
    }
    if primary_port is not None:
        e["AMQBROKER_HA_PRIMARY"] = f"127.0.0.1:{primary_port}"
    return e


@pytest.fixture
async def procs(nursery: trio.Nursery, tmp_path: Path) -> BrokerProcesses:
    p = BrokerProcesses(nursery, cwd=tmp_path)
    try:
        yield p  # type: ignore[misc]
    finally:
        await p.aclose()


async def start_backup(
    procs: BrokerProcesses, data_dir: Path, port: int, primary_port: int
) -> BrokerProcess:
    bp = await procs.spawn(
        ["run", "--port", str(port), "--data-dir", str(data_dir)],
        env=env("backup", primary_port),
    )
    await bp.wait_for_line(r"HA backup of 127\.0\.0\.1:\d+; data in", timeout=WAIT)
    return bp


def body(i: int) -> Message:
    return Message(
        body=f"m{i}", durable=True, group_id=f"g{i % 7}" if i % 2 else None, properties={"i": i}
    )


async def produce(
    port: int,
    nursery: trio.Nursery,
    start: int,
    stop: int,
    accepted: list[int],
    *,
    batch: int = 50,
    progress: trio.Event | None = None,
) -> None:
    """Send start..stop-1 in pipelined batches; `accepted` gets the indexes the broker
    answered accepted (in order). Returns when done or the connection is lost."""
    c = await Client.connect(port, nursery=nursery)
    try:
        s = await c.sender("orders")
        for lo in range(start, stop, batch):
            idx = list(range(lo, min(lo + batch, stop)))
            try:
                ds = await s.send_many([body(i) for i in idx], timeout=WAIT)
            except (ClientError, trio.TooSlowError):
                return
            for i, d in zip(idx, ds, strict=True):
                if d.remote_state == Delivery.ACCEPTED:
                    accepted.append(i)
            if progress is not None and len(accepted) >= (stop - start) // 2:
                progress.set()
    finally:
        c.abort()


async def consume_all(port: int, nursery: trio.Nursery) -> list[int]:
    """Everything on 'orders', until it stays empty for a second."""
    got: list[int] = []
    c = await Client.connect(port, nursery=nursery)
    try:
        r = await c.receiver("orders", credit=5000)
        while True:
            try:
                m = await r.receive(timeout=1.0)
            except trio.TooSlowError:
                return got
            got.append(int(m.properties["i"]))
            r.accept(m)
    finally:
        c.abort()


async def test_sigkill_primary_then_promote_backup_keeps_every_accepted_message(
    procs: BrokerProcesses, tmp_path: Path, nursery: trio.Nursery
) -> None:
    p_port, b_port = free_port(), free_port()
    primary = await procs.start(tmp_path / "primary", env=env("primary"), port=p_port)
    backup = await start_backup(procs, tmp_path / "backup", b_port, p_port)
    await wait_synced(primary, backup)

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
    with trio.fail_after(WAIT):
        await done.wait()
    assert len(accepted) >= 1000

    backup.send_signal(signal.SIGUSR1)  # promote: the same process serves its copy
    await backup.wait_for_line(r"HA backup: promoted", timeout=WAIT)
    await backup.wait_for_line(rf"listening on amqp://127\.0\.0\.1:{b_port}", timeout=WAIT)
    backup.send_signal(signal.SIGUSR1)  # a second promote: ignored by the live broker
    await backup.wait_for_line(r"received SIGUSR1 \(promote\): this broker is already live")
    got = await consume_all(b_port, nursery)
    # every accepted message, once, in send order; at most the unanswered tail more
    assert len(got) == len(set(got))
    assert got == sorted(got)
    assert set(accepted) <= set(got)
    assert got[: len(accepted)] == accepted
    assert await backup.stop() == 0


async def test_late_backup_catches_up_under_load_and_after_a_restart(
    procs: BrokerProcesses, tmp_path: Path, nursery: trio.Nursery
) -> None:
    p_port, b_port = free_port(), free_port()
    primary = await procs.start(tmp_path / "primary", env=env("primary"), port=p_port)
    accepted: list[int] = []
    await produce(p_port, nursery, 0, 500, accepted)
    assert len(accepted) == 500

    # a backup started now gets the 500 by full sync while a producer keeps sending
    loaded = trio.Event()

    async def load(lo: int, hi: int) -> None:
        try:
            await produce(p_port, nursery, lo, hi, accepted, batch=20)
        finally:
            loaded.set()

    nursery.start_soon(load, 500, 1500)
    backup = await start_backup(procs, tmp_path / "backup", b_port, p_port)
    await backup.wait_for_line(IN_SYNC, timeout=WAIT)
    with trio.fail_after(WAIT):
        await loaded.wait()

    # killing the backup: the primary goes on, and says it is unreplicated
    await backup.crash()
    await primary.wait_for_line(r"WARNING .*running unreplicated \(the backup went away\)")
    more: list[int] = []
    await produce(p_port, nursery, 1500, 1700, more)
    assert len(more) == 200
    accepted += more

    # a restarted backup catches up again (a new full sync), then holds every message
    backup = await start_backup(procs, tmp_path / "backup", b_port, p_port)
    await wait_synced(primary, backup)
    await produce(p_port, nursery, 1700, 1800, accepted)
    await primary.crash()
    backup.send_signal(signal.SIGUSR1)
    await backup.wait_for_line(rf"listening on amqp://127\.0\.0\.1:{b_port}", timeout=WAIT)
    got = await consume_all(b_port, nursery)
    assert sorted(accepted) == list(range(1800))
    assert got == list(range(1800))
    assert await backup.stop() == 0
