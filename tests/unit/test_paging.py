"""Paging (address_full_policy PAGE): the core and the page store, driven synchronously.

`Rig` does what the application does (amqbroker.app): a store cycle takes the journal
batch and the page records together and writes them; the depage step reads a queue's
oldest page records and hands them to `Broker.paging.depage`. Real files under tmp_path.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from amqbroker.core.accept import accept
from amqbroker.core.address import ANYCAST, MULTICAST
from amqbroker.core.address_settings import AddressSettings, AddressSettingsRepository
from amqbroker.core.delivery_log import RECEIVED, RECEIVED_ROUTED, ROUTED
from amqbroker.core.entry import Entry
from amqbroker.core.queue import Queue
from amqbroker.core.queue_records import restore_queue
from amqbroker.core.timers import Timers
from amqbroker.store.delivery_log import FIELDS, DeliveryLogWriter
from amqbroker.store.journal import Journal
from amqbroker.store.paging import PageStore, decode_page_record, encode_page_record
from tests.unit.core_harness import FakeClock, FakeConsumer, RecordingBroker, label


class Rig:
    def __init__(
        self,
        root: Path,
        *,
        max_size: int = 2000,
        read_ahead: int = 1000,
        segment_size: int = 4096,
        durable: bool = False,
    ) -> None:
        self.root = root
        self.clock = FakeClock()
        self.journal = Journal(root / "journal", sync=False)
        recovered = self.journal.open()
        self.pager = PageStore(root / "paging", segment_size=segment_size, sync=False)
        self.wakes = 0
        settings = AddressSettings(max_size_bytes=max_size, address_full_policy="PAGE")
        self.broker = RecordingBroker(
            clock=self.clock,
            timers=Timers(),
            address_settings=AddressSettingsRepository({"#": settings}),
            persistence=self.journal,
            pager=self.pager,
            page_read_ahead=read_ahead,
            depage_wake=self._wake,
        )
        for rq in recovered.queues:
            restore_queue(self.broker, rq.qid, rq.name, rq.attributes, rq.entries)
        keep = {q.qid: q.page_mark for q in self.broker.queues.values() if q.durable}
        for qid, back in self.pager.open(keep).items():
            q = next(q for q in self.broker.queues.values() if q.qid == qid)
            q.restore_paged(back.count, back.nbytes, back.max_seq, q.page_mark)
        self.durable = durable
        self.cycles = 0

    def _wake(self) -> None:
        self.wakes += 1

    def queue(self, name: str = "q") -> Queue:
        if name not in self.broker.queues:
            self.broker.create_address(name, ANYCAST, durable=self.durable)
        return self.broker.queues[name]

    def cycle(self) -> None:
        """One store cycle (what app._commit_one does, without threads)."""
        while True:
            batch = self.journal.take_batch()
            pages = self.pager.take()
            if batch is None and pages is None:
                return
            self.cycles += 1
            if pages is not None:
                self.pager.write(pages)
            if batch is not None:
                self.journal.write_batch(batch)
                self.journal.batch_done(batch)
            if pages is not None:
                self.pager.done(pages)
            self.pager.cycle_done(self.cycles)

    def depage(self) -> int:
        """Store cycle, then one depage step per candidate queue (app._depage_loop)."""
        self.cycle()
        n = 0
        for q in self.broker.paging.candidates():
            room = self.broker.paging.room(q)
            plan = self.pager.plan(q.qid, room) if room > 0 else None
            if plan is None:
                continue
            self.pager.read(plan)
            entries = self.pager.consumed(plan, self.cycles + 1 if q.durable else 0)
            if entries is None:
                continue
            if plan.lost:
                q.page_lost(plan.lost, plan.lost_bytes)
            self.broker.paging.depage(q, entries)
            n += len(entries)
        return n

    def drain(self, q: Queue, consumers: list[FakeConsumer]) -> None:
        """Consumers with credit take and ack everything, depaging as room appears."""
        self.drain_all([(q, c) for c in consumers])

    def drain_all(self, pairs: list[tuple[Queue, FakeConsumer]]) -> None:
        for _ in range(10_000):
            for q, c in pairs:
                for e in list(c.unsettled):
                    del c.unsettled[e]
                    q.ack(c, e)
                c.credit = 1000
                q.credit_changed(c)
            if not any(q.count for q, _ in pairs):
                break
            self.depage()
        self.cycle()
        assert [q.count for q, _ in pairs] == [0] * len(pairs)

    def close(self) -> None:
        self.cycle()
        self.journal.close()

    def page_files(self) -> list[Path]:
        d = self.root / "paging"
        return sorted(p for p in d.rglob("*.pg")) if d.exists() else []


def msg(tag: str, group: str | None = None, *, durable: bool = False, size: int = 100) -> Entry:
    data = tag.encode().ljust(size, b".")
    return Entry(data, durable, 4, 0, 0, group, 0)


def tags(c: FakeConsumer) -> list[str]:
    return [label(d.entry).rstrip(".") for d in c.deliveries]


def test_page_record_round_trip() -> None:
    e = Entry(b"\x00data", True, 7, 123, 2, "g\u00e9", -1)
    e.seq = 42
    e.deliver_at = 99
    e.origin = "c1"
    back = decode_page_record(encode_page_record(e), 0)
    assert (back.seq, back.durable, back.priority, back.expiry, back.delivery_count) == (
        42,
        True,
        7,
        123,
        2,
    )
    assert (back.group_id, back.group_seq, back.deliver_at, back.origin, back.data) == (
        "g\u00e9",
        -1,
        99,
        "c1",
        b"\x00data",
    )


def test_over_the_limit_messages_are_paged_and_come_back_in_order(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    q = rig.queue()
    for i in range(200):
        rig.broker.route(q.address, msg(f"m{i}"))  # type: ignore[arg-type]
    # memory holds what fits (2000 bytes = 20 messages), the rest is paged
    assert q.bytes == 2000
    assert q.paged_count == 180
    assert q.count == 200
    st = q.statistics()
    assert (st["paged_messages"], st["paged_bytes"]) == (180, 18000)
    rig.cycle()
    assert rig.page_files(), "the page is on disk"
    c = FakeConsumer("c", rig.clock)
    q.add_consumer(c)
    rig.drain(q, [c])
    assert tags(c) == [f"m{i}" for i in range(200)]
    assert q.paged_count == 0 and q.paged_bytes == 0
    # memory never went over the limit while reading back
    assert rig.broker.budget.paging == set()
    rig.cycle()
    assert rig.page_files() == [], "consumed page segments are deleted"


def test_memory_stays_within_the_limit_while_depaging(tmp_path: Path) -> None:
    rig = Rig(tmp_path, max_size=1000, read_ahead=10_000)
    q = rig.queue()
    for i in range(100):
        q.enqueue(msg(f"m{i}"))
    c = FakeConsumer("c", rig.clock)
    q.add_consumer(c)
    peak = 0
    for _ in range(1000):
        for e in list(c.unsettled):
            del c.unsettled[e]
            q.ack(c, e)
        c.credit = 3
        q.credit_changed(c)
        rig.depage()
        peak = max(peak, q.bytes)
        if not q.count:
            break
    assert tags(c) == [f"m{i}" for i in range(100)]
    assert peak <= 1000


def test_groups_across_the_page_boundary_keep_order_and_one_owner(tmp_path: Path) -> None:
    rig = Rig(tmp_path, max_size=1500)
    q = rig.queue()
    a = FakeConsumer("a", rig.clock)
    b = FakeConsumer("b", rig.clock)
    q.add_consumer(a)
    q.add_consumer(b)
    groups = ["A", "B", "C", "D"]
    for i in range(120):
        g = groups[i % 4]
        q.enqueue(msg(f"{g}{i}", g))
    assert q.paged_count > 0
    rig.drain(q, [a, b])
    got = {g: [] for g in groups}  # type: dict[str, list[str]]
    owner: dict[str, set[str]] = {g: set() for g in groups}
    for c in (a, b):
        for d in c.deliveries:
            g = d.entry.group_id
            assert g is not None
            owner[g].add(c.name)
    for d in sorted(a.deliveries + b.deliveries, key=lambda d: d.entry.seq):
        got[d.entry.group_id or ""].append(label(d.entry).rstrip("."))
    for g in groups:
        assert got[g] == [f"{g}{i}" for i in range(120) if groups[i % 4] == g]
        assert len(owner[g]) == 1, f"group {g} had owners {owner[g]}"
    # and each consumer saw each of its groups in order
    for c in (a, b):
        for g in groups:
            mine = [t for t in tags(c) if t.startswith(g)]
            assert mine == [t for t in got[g] if t in mine]


def test_multicast_queues_page_separately(tmp_path: Path) -> None:
    rig = Rig(tmp_path, max_size=3000)
    a = rig.broker.create_address("topic", MULTICAST)
    q1 = rig.broker.queue_for_consumer("topic")
    q2 = rig.broker.queue_for_consumer("topic")
    for i in range(50):
        rig.broker.route(a, msg(f"t{i}"))
    # both queues count against the one address: 15 copies fit in memory
    assert q1.paged_count + q2.paged_count == 100 - 30
    c1 = FakeConsumer("c1", rig.clock)
    c2 = FakeConsumer("c2", rig.clock)
    q1.add_consumer(c1)
    q2.add_consumer(c2)
    # the address's memory is shared: both queues are read back as both drain
    rig.drain_all([(q1, c1), (q2, c2)])
    assert tags(c1) == tags(c2) == [f"t{i}" for i in range(50)]


def test_purge_and_delete_remove_the_pages(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    q = rig.queue("p")
    for i in range(100):
        q.enqueue(msg(f"p{i}"))
    rig.cycle()
    assert rig.page_files()
    assert q.purge() == 100
    assert (q.count, q.paged_count, q.paged_bytes) == (0, 0, 0)
    rig.cycle()
    assert rig.page_files() == []
    # the queue pages again from scratch (new segments), then is deleted
    for i in range(100):
        q.enqueue(msg(f"r{i}"))
    rig.cycle()
    assert rig.page_files()
    rig.broker.delete_queue(q)
    rig.cycle()
    assert rig.page_files() == []
    assert not (tmp_path / "paging" / str(q.qid)).exists()
    assert rig.broker.budget.paging == set()


def test_a_read_planned_before_a_purge_is_discarded(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    q = rig.queue()
    for i in range(100):
        q.enqueue(msg(f"m{i}"))
    rig.cycle()
    q.purge()
    plan = rig.pager.plan(q.qid, 1000)
    assert plan is None
    for i in range(100):
        q.enqueue(msg(f"n{i}"))
    rig.cycle()
    plan = rig.pager.plan(q.qid, 1000)
    assert plan is not None
    rig.pager.read(plan)
    q.purge()
    assert rig.pager.consumed(plan, 0) is None


def test_durable_paged_messages_survive_a_restart_in_order(tmp_path: Path) -> None:
    rig = Rig(tmp_path, durable=True)
    q = rig.queue()
    for i in range(100):
        q.enqueue(msg(f"d{i}", "G" if i % 3 == 0 else None, durable=True))
    assert q.paged_count == 80
    rig.cycle()
    # consume and ack 30: 10 of them were depaged (journaled on the way back)
    c = FakeConsumer("c", rig.clock)
    q.add_consumer(c)
    while len(c.deliveries) < 30:
        for e in list(c.unsettled):
            del c.unsettled[e]
            q.ack(c, e)
        c.credit = 30 - len(c.deliveries)
        q.credit_changed(c)
        rig.depage()
    for e in list(c.unsettled):
        del c.unsettled[e]
        q.ack(c, e)
    first = tags(c)
    rig.close()  # the journal and the pages are written: as after kill -9

    rig2 = Rig(tmp_path, durable=True)
    q2 = rig2.broker.queues["q"]
    assert q2.count == 70
    c2 = FakeConsumer("c2", rig2.clock)
    q2.add_consumer(c2)
    rig2.drain(q2, [c2])
    assert first + tags(c2) == [f"d{i}" for i in range(100)]
    rig2.close()
    rig3 = Rig(tmp_path, durable=True)
    assert rig3.broker.queues["q"].count == 0
    rig3.close()
    assert rig3.page_files() == []


def test_crash_between_read_back_and_journal_write_loses_nothing(tmp_path: Path) -> None:
    rig = Rig(tmp_path, durable=True)
    q = rig.queue()
    for i in range(60):
        q.enqueue(msg(f"d{i}", durable=True))
    rig.cycle()
    c = FakeConsumer("c", rig.clock)
    q.add_consumer(c)
    c.credit = 100
    q.credit_changed(c)
    for e in list(c.unsettled):
        del c.unsettled[e]
        q.ack(c, e)
    q.remove_consumer(c, [])
    rig.cycle()
    # read back a step, but "crash" before its journal record is written
    (cand,) = rig.broker.paging.candidates()
    plan = rig.pager.plan(cand.qid, rig.broker.paging.room(cand))
    assert plan is not None
    rig.pager.read(plan)
    entries = rig.pager.consumed(plan, rig.cycles + 1)
    assert entries
    rig.broker.paging.depage(q, entries)
    rig.journal.close()  # buffered records (the TXN) are lost

    rig2 = Rig(tmp_path, durable=True)
    q2 = rig2.broker.queues["q"]
    c2 = FakeConsumer("c2", rig2.clock)
    q2.add_consumer(c2)
    rig2.drain(q2, [c2])
    assert tags(c) == [f"d{i}" for i in range(20)]
    assert tags(c2) == [f"d{i}" for i in range(20, 60)]
    rig2.close()


def test_non_durable_paged_messages_are_dropped_on_restart(tmp_path: Path) -> None:
    rig = Rig(tmp_path, durable=True)
    q = rig.queue()
    for i in range(50):
        q.enqueue(msg(f"m{i}", durable=i % 2 == 0))
    assert q.paged_count == 30
    rig.close()
    rig2 = Rig(tmp_path, durable=True)
    q2 = rig2.broker.queues["q"]
    c = FakeConsumer("c", rig2.clock)
    q2.add_consumer(c)
    rig2.drain(q2, [c])
    # in memory: 20 messages (only the durable ones were journaled); paged: durable ones
    assert tags(c) == [f"m{i}" for i in range(0, 50, 2)]
    rig2.close()


def test_pages_of_a_non_durable_queue_are_removed_on_start(tmp_path: Path) -> None:
    rig = Rig(tmp_path, durable=False)
    q = rig.queue()
    for i in range(50):
        q.enqueue(msg(f"m{i}"))
    rig.close()
    assert rig.page_files()
    rig2 = Rig(tmp_path)
    assert rig2.page_files() == []
    rig2.close()


def test_torn_page_tail_is_truncated(tmp_path: Path) -> None:
    rig = Rig(tmp_path, durable=True)
    q = rig.queue()
    for i in range(40):
        q.enqueue(msg(f"d{i}", durable=True))
    rig.close()
    (last,) = rig.page_files()[-1:]
    size = last.stat().st_size
    os.truncate(last, size - 7)  # the last record is cut short
    rig2 = Rig(tmp_path, durable=True)
    q2 = rig2.broker.queues["q"]
    assert q2.paged_count == 19
    c = FakeConsumer("c", rig2.clock)
    q2.add_consumer(c)
    rig2.drain(q2, [c])
    assert tags(c) == [f"d{i}" for i in range(39)]
    rig2.close()


@pytest.mark.parametrize("segment_size", [4096, 1 << 20])
def test_a_record_larger_than_the_read_ahead_is_read_whole(
    tmp_path: Path, segment_size: int
) -> None:
    rig = Rig(tmp_path, max_size=1000, read_ahead=100, segment_size=segment_size)
    q = rig.queue()
    q.enqueue(msg("big0", size=5000))  # fills memory
    for i in range(1, 5):
        q.enqueue(msg(f"big{i}", size=70_000))
    c = FakeConsumer("c", rig.clock)
    q.add_consumer(c)
    rig.drain(q, [c])
    assert tags(c) == [f"big{i}" for i in range(5)]


def test_the_delivery_log_of_a_paged_arrival_is_its_received_record_alone(
    tmp_path: Path,
) -> None:
    """`accept` folds received + routed into one buffered record only for a message
    that stays in memory: a paged-out arrival keeps its own received record and, as
    before folding, no routed one."""
    rig = Rig(tmp_path)
    w = DeliveryLogWriter(
        tmp_path / "log", file_format="jsonl", clock=rig.clock, message_id=lambda d: d[:3].decode()
    )
    rig.broker.dlog = w
    q = rig.queue()
    assert q.dlog is w
    for i in range(22):
        e = msg(f"m{i:02d}")
        accept(rig.broker, q.address, e, e.data)  # type: ignore[arg-type]
    assert q.paged_count == 2
    batch = w.take_batch()
    assert batch is not None
    assert batch.values[1::FIELDS] == [RECEIVED_ROUTED] * 20 + [RECEIVED] * 2
    rows, seqs = batch.expand()
    assert [(r[1], r[3]) for r in rows[-4:]] == [
        (RECEIVED, "m19"),
        (ROUTED, "m19"),
        (RECEIVED, "m20"),
        (RECEIVED, "m21"),
    ]
    assert seqs == list(range(1, 43))
    rig.close()
