"""Fail back (``ha_failback``) on a real pair: real processes, a real ZooKeeper.

The member configured as the backup took over (the primary stopped); the primary
comes back, mirrors it, and once its copy is in sync the live backup hands the node id
back: it disconnects its clients, sends its last store cycle to the primary over the
replication link, stops its broker and goes to the end of the lease's order, so the
primary takes over with the next epoch while the backup's process (and ZooKeeper
session) stays up. Under durable load: nothing accepted is lost, order is kept, and the
epochs show that no cycle was answered alone during the hand-over (an epoch taken for
answering alone would make the primary's copy stale: it could not take over at 3).
"""

from __future__ import annotations

import contextlib
import re
from datetime import datetime
from pathlib import Path

import pytest
import trio

from tests.client import Client, ClientError
from tests.cluster.zk_harness import ZooKeeperServer, zk_path, zookeeper  # noqa: F401
from tests.ha.test_ha_processes import consume_all, produce
from tests.ha.test_pair_takeover import (
    WAIT,
    backup_in_sync,
    live,
    member,
    procs,  # noqa: F401
    start_pair,
)
from tests.integration.broker_process import BrokerProcesses

pytestmark = pytest.mark.timeout(180)


def stamp(text: str) -> float:
    """Seconds of a log line's timestamp (``2026-11-26 09:57:14,451``)."""
    return datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


async def test_the_live_backup_hands_the_node_id_back_to_the_primary_under_load(
    procs: BrokerProcesses,  # noqa: F811
    tmp_path: Path,
    nursery: trio.Nursery,
    zookeeper: ZooKeeperServer,  # noqa: F811
    zk_path: str,  # noqa: F811
) -> None:
    primary, backup, p_port, b_port = await start_pair(
        procs, tmp_path, zookeeper, zk_path, AMQBROKER_HA_FAILBACK="true"
    )
    accepted: list[int] = []
    await produce(p_port, nursery, 0, 200, accepted)
    assert accepted == list(range(200))

    # a graceful stop of the live member: its last cycle reaches the backup, which
    # takes over with the next epoch (a cycle answered alone would have taken 2 first)
    assert await primary.stop() == 0
    await live(backup, b_port, 2)
    await produce(b_port, nursery, 200, 400, accepted)
    assert accepted == list(range(400))
    # alone, the backup answered under a new epoch: the primary's old copy is stale
    await backup.wait_for_line(r"answers without a backup in sync; took epoch 3", timeout=WAIT)

    # load runs across the fail back, following whichever member is live
    loaded = trio.Event()

    async def load() -> None:
        nxt, end, ports = 400, 1400, [b_port, p_port]
        try:
            with trio.fail_after(4 * WAIT):
                while nxt < end:
                    with contextlib.suppress(OSError):
                        await produce(ports[0], nursery, nxt, end, accepted, batch=20)
                    nxt = max(nxt, accepted[-1] + 1)
                    if nxt < end:
                        ports.reverse()  # lost (or refused): the other member
                        await trio.sleep(0.05)
        finally:
            loaded.set()

    # a consumer holds unsettled deliveries when the hand-over closes its connection:
    # their delivery counts are written then, and must reach the primary too
    holder = await Client.connect(b_port, nursery=nursery)
    r = await holder.receiver("orders", credit=50)
    held = [await r.receive(timeout=WAIT) for _ in range(50)]
    assert [int(m.properties["i"]) for m in held] == list(range(50))
    closed = trio.Event()

    async def answer_close() -> None:  # as a client library does, at once
        with contextlib.suppress(ClientError):  # closed by the hand-over (the point)
            await holder._wait(lambda: holder.closed_by_peer, 4 * WAIT)
        closed.set()
        holder.abort()

    nursery.start_soon(answer_close)

    nursery.start_soon(load)
    again = await member(procs, "primary", tmp_path / "a", p_port, zookeeper, zk_path)
    await again.wait_for_line(r"is standby \(live node1@127\.0\.0\.1:\d+ .*epoch 3\)", timeout=WAIT)
    asked = await backup.wait_for_line(
        r"^(\S+ \S+) .*hands the node id back to the primary node1@", timeout=WAIT
    )
    # the epoch of the copy handed over to: its last sync (3, or later if the live
    # member answered alone again and the primary resynced)
    in_sync = re.compile(r"HA backup: in sync with the primary .*\(epoch (\d+),")
    epoch = [int(m[1]) for line in again.stderr_lines if (m := in_sync.search(line))][-1]
    await backup.wait_for_line(r"is now HANDING_OVER", timeout=WAIT)
    # the primary takes over at once with the very next epoch: no cycle of the
    # hand-over was answered alone (that would have taken an epoch and made the
    # primary's copy stale), and the backup's process (and ZooKeeper session) stays up:
    # it only left the order
    await live(again, p_port, epoch + 1)
    serving = await again.wait_for_line(
        rf"^(\S+ \S+) .*listening on amqp://127\.0\.0\.1:{p_port}", timeout=WAIT
    )
    took = stamp(serving[1]) - stamp(asked[1])
    print(f"fail back: {took:.3f} s from the hand-over's start to the primary listening")
    assert backup.running
    assert closed.is_set() and holder.closed_by_peer
    await backup.wait_for_line(r"goes to the end of the order", timeout=WAIT)
    later = "|".join(str(e) for e in range(epoch + 1, epoch + 20))
    await backup.wait_for_line(rf"in sync with the primary .*\(epoch ({later}),", timeout=WAIT)
    with trio.fail_after(4 * WAIT):
        await loaded.wait()

    got = await consume_all(p_port, nursery)
    first = list(dict.fromkeys(got))  # a send in flight at a hand-over may come twice
    assert set(accepted) <= set(first)
    assert first == sorted(first)  # one queue, one consumer: send order, groups included
    assert first[: len(accepted)] == sorted(set(accepted))
    assert await again.stop() == 0
    # and the backup, in sync, takes over again when the primary stops
    await backup.wait_for_line(rf"is LIVE at epoch ({later}) ", timeout=WAIT)
    assert await backup.stop() == 0


async def test_without_failback_the_live_backup_stays_live(
    procs: BrokerProcesses,  # noqa: F811
    tmp_path: Path,
    nursery: trio.Nursery,
    zookeeper: ZooKeeperServer,  # noqa: F811
    zk_path: str,  # noqa: F811
) -> None:
    primary, backup, p_port, b_port = await start_pair(procs, tmp_path, zookeeper, zk_path)
    assert await primary.stop() == 0
    await live(backup, b_port, 2)
    again = await member(procs, "primary", tmp_path / "a", p_port, zookeeper, zk_path)
    await backup_in_sync(again, 2)
    accepted: list[int] = []
    await produce(b_port, nursery, 0, 100, accepted)
    assert accepted == list(range(100))
    assert not any("hands the node id back" in line for line in backup.stderr_lines)
    assert not any("is LIVE" in line for line in again.stderr_lines)
    assert await again.stop() == 0
    assert await backup.stop() == 0
