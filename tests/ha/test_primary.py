"""The primary's replicator (`amqbroker.ha.primary.Primary`) against a fake link:
what a store cycle waits for in each state of the backup, and when the backup is
dropped. Runs on trio's autojump clock (the timeouts are virtual)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from amqbroker.ha import stream as st
from amqbroker.ha.primary import CATCHUP, DROPPED, IN_SYNC, BackupStream, Primary
from amqbroker.store.journal_segments import Batch


class FakeLink:
    peer = "127.0.0.1:1"

    def __init__(self, credit: int = 10) -> None:
        self.credit = credit
        self.in_flight = 0
        self.sent: list[tuple[bytes, Callable[[str], None]]] = []
        self.closed: tuple[str, str] | None = None

    def send(self, data: bytes, on_outcome: Callable[[str], None]) -> None:
        self.sent.append((data, on_outcome))

    def close(self, condition: str, description: str) -> None:
        self.closed = (condition, description)


def primary(**kw: Any) -> Primary:
    return Primary(None, Path("/nowhere"), flush=lambda: None, **kw)  # type: ignore[arg-type]


def batch(n: int = 100) -> Batch:
    return Batch([(1, b"x" * n)], records=1, nbytes=n, closes=1)


def attach(p: Primary, state: str, link: FakeLink) -> BackupStream:
    b = BackupStream(link, b"s" * 16, state=state)  # type: ignore[arg-type]
    p.backup = b
    return b


async def test_without_a_backup_a_cycle_does_not_wait_and_says_so_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    p = primary()
    for cycle in (1, 2, 3):
        await p.replicate(cycle, batch(), None)
    assert caplog.text.count("running unreplicated") == 1


async def test_in_sync_a_cycle_waits_for_the_acknowledgement(autojump_clock: Any) -> None:
    p = primary(ack_timeout=5)
    link = FakeLink()
    attach(p, IN_SYNC, link)
    done = trio.Event()

    async def cycle() -> None:
        await p.replicate(7, batch(), None)
        done.set()

    async with trio.open_nursery() as n:
        n.start_soon(cycle)
        await trio.sleep(1)
        assert len(link.sent) == 1 and not done.is_set()
        _, f = st.decode(link.sent[0][0])
        assert isinstance(f, st.CycleBatch) and f.cycle == 7
        link.sent[0][1]("accepted")
    assert done.is_set() and p.in_sync


async def test_a_backup_that_does_not_acknowledge_in_time_is_dropped(
    autojump_clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    p = primary(ack_timeout=5)
    link = FakeLink()
    b = attach(p, IN_SYNC, link)
    t0 = trio.current_time()
    await p.replicate(1, batch(), None)
    assert trio.current_time() - t0 == pytest.approx(5)
    assert b.state == DROPPED and p.backup is None and link.closed is not None
    assert "not acknowledged within ha_ack_timeout" in caplog.text
    assert "running unreplicated" in caplog.text
    # the next cycle does not wait
    t0 = trio.current_time()
    await p.replicate(2, batch(), None)
    assert trio.current_time() == t0


async def test_a_rejected_batch_drops_the_backup() -> None:
    p = primary()
    link = FakeLink()
    b = attach(p, IN_SYNC, link)

    async with trio.open_nursery() as n:
        n.start_soon(p.replicate, 1, batch(), None)
        await trio.testing.wait_all_tasks_blocked()
        link.sent[0][1]("rejected")
    assert b.state == DROPPED and link.closed is not None


async def test_without_ha_sync_a_cycle_does_not_wait_for_the_ack() -> None:
    p = primary(sync=False)
    link = FakeLink()
    attach(p, IN_SYNC, link)
    await p.replicate(1, batch(), None)
    assert len(link.sent) == 1


async def test_catching_up_queues_batches_up_to_the_bound_then_drops(
    caplog: pytest.LogCaptureFixture,
) -> None:
    p = primary(max_queued_bytes=1000)
    link = FakeLink()
    b = attach(p, CATCHUP, link)
    await p.replicate(1, batch(300), None)
    await p.replicate(2, batch(300), None)
    assert b.state == CATCHUP and len(b.queued) == 2 and b.queued_records == 2
    assert link.sent == []  # queued, sent after the snapshot
    await p.replicate(3, batch(300), None)
    await p.replicate(4, batch(300), None)
    assert b.state == DROPPED and link.closed is not None
    assert "exceed ha_max_queued_bytes (1000)" in caplog.text


async def test_a_detached_backup_is_reported_as_gone_not_as_a_bad_answer(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from amqbroker.protocol.ha_links import ReplicationLink

    p = primary()

    class Conn:
        peer = "127.0.0.1:2"

        def mark_dirty(self) -> None:
            pass

    class Link:
        _impl = object()

    link = ReplicationLink(Conn(), Link(), p)  # type: ignore[arg-type]
    b = attach(p, IN_SYNC, link)  # type: ignore[arg-type]
    lost: list[str] = []
    link._outcomes[object()] = lost.append
    link.detach(None)  # type: ignore[arg-type]
    assert lost == ["lost"] and b.state == DROPPED and p.backup is None
    assert "running unreplicated (the backup went away)" in caplog.text
    assert "answered lost" not in caplog.text
