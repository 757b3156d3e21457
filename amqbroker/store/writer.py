"""The store's two writer loops: the group commit of the journal and page store, and
the delivery log. The store's one trio module (the rest of `store` is synchronous).

Store cycles (`StoreWriter`): the writer takes the journal's batch and the page
store's buffered page records together (`commit_one`), writes both in one
worker-thread call (pages first) and numbers the cycle. A producer waiting for
durability waits for a cycle number (`ticket`: the cycle that will take what is
buffered now), complete once the journal batch it needs is synced and its pages are
written, so a durable message that went to a page is settled exactly like one that
went to the journal. After each cycle the writer settles the waiting producers
(`settled`, the app's `SyncTracker.synced`), wakes the depager and flushes the
connections. A write that fails (OSError) is fatal: `on_failure` stops the broker, so
that no message is accepted without being stored.

Replication (issue 23): `replicator`, when set (a primary with `ha_role = primary`),
is awaited in the same nursery as the local write of every cycle
(`replicate(cycle, batch, pages)`), so the cycle completes only once both the local
fsync and the backup's acknowledgement are done. It returns at once while no backup is
in sync. Both halves are shielded from cancellation (the replicator bounds its waits
by `ha_ack_timeout`, after which it drops the backup). Unset (None), the cycle is
exactly the path without replication: no nursery, no extra await. The replicator
also takes `lock` between cycles to snapshot the files for a full sync. A replicator
that answers False fences the store (`fenced`: a primary whose lease is gone): that
cycle and every later one are never answered, and `on_failure` stops the broker.

Delivery log (`DeliveryLogLoop`): the buffer is written in a worker thread every
`delivery_log_flush_interval`, or at once when it is a quarter full. A write that
fails loses its batch (counted in `dropped`, logged) and the broker goes on.

Deadlines (a hung disk must not hang shutdown): every write runs in a worker thread
under a shielded cancel scope, so a batch taken from a buffer is written even when
its loop is cancelled at shutdown. The scope has no deadline while the broker runs
(a slow disk is waited for: abandoning a write half done and writing the next batch
would interleave two writes in one file). Shutdown bounds them (`bound_writes`: the
app passes `shutdown_timeout` when the shutdown starts): from then on a write, the
one running included, may take that long. A write still running at its deadline is
abandoned: its worker thread is left
to finish or hang on its own, the loop writes nothing more to that store (and the
journal is not closed under it), and the log says what was abandoned: the journal
batch (its producers never got `accepted`; recovery on the next start reads whatever
reached the disk) or the delivery-log records (counted as dropped).
"""

from __future__ import annotations

import collections
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import trio

from amqbroker.store.delivery_log import DeliveryLogWriter
from amqbroker.store.journal import Journal
from amqbroker.store.journal_segments import Batch
from amqbroker.store.paging import PageBatch, PageStore

log = logging.getLogger("amqbroker")


class Replicator(Protocol):
    """What the store cycle awaits next to its local write (see the module docstring)."""

    async def replicate(self, cycle: int, batch: Batch | None, pages: PageBatch | None) -> bool:
        """Return once the backup in sync (if any) has this cycle durably: True, or
        False when this store is fenced (a primary that lost its lease): the cycle
        must never be answered."""


class _Deadline:
    """The time a shielded write may take: unbounded until `bound`."""

    def __init__(self) -> None:
        self.timeout = math.inf
        self._scope: trio.CancelScope | None = None

    def bound(self, timeout: float) -> None:
        """From now on a write may take `timeout` seconds (the one running: from now)."""
        self.timeout = timeout
        if self._scope is not None:
            self._scope.deadline = min(self._scope.deadline, trio.current_time() + timeout)

    async def run_sync(self, fn: Callable[[], object]) -> bool:
        """`fn()` in a worker thread, shielded until the deadline; False if abandoned."""
        with trio.CancelScope(shield=True, deadline=trio.current_time() + self.timeout) as scope:
            self._scope = scope
            try:
                await trio.to_thread.run_sync(fn, abandon_on_cancel=True)
            finally:
                self._scope = None
        return not scope.cancelled_caught


class StoreWriter:
    """The journal + page store group commit (see the module docstring)."""

    def __init__(
        self,
        journal: Journal,
        pager: PageStore,
        *,
        data_dir: Path,
        sync: bool,
        flush: Callable[[], object],
        wake_depage: Callable[[], object],
        on_failure: Callable[[], object],
        batch_synced: Callable[[float], None] | None = None,
    ) -> None:
        self.journal = journal
        self.pager = pager
        self.data_dir = data_dir
        self.sync = sync
        self._flush = flush
        self._wake_depage = wake_depage
        self._on_failure = on_failure
        self._batch_synced = batch_synced
        #: settles the producers of every cycle up to the number given (set by the app
        #: once its SyncTracker exists: the tracker takes `ticket`)
        self.settled: Callable[[int], None] = lambda cycle: None
        self._lot = trio.lowlevel.ParkingLot()
        #: one batch at a time: the writer loop and the final flush both commit
        self._lock = trio.Lock()
        #: the primary's replication (None: no HA, the cycle path is unchanged)
        self.replicator: Replicator | None = None
        self._deadline = _Deadline()
        #: store cycles taken / complete; journal batch_no right after the last take;
        #: (cycle, journal batch it needs synced) for cycles not yet complete
        self.cycle = 0
        self.cycle_done = 0
        self._jb_taken = journal.synced_batch_no
        self._cycle_waits: collections.deque[tuple[int, int]] = collections.deque()
        #: a write ran past the shutdown deadline: nothing more is written or closed
        self.abandoned = False
        #: a write failed (OSError): the broker stops with exit code 3
        self.failed = False
        #: the replicator fenced this store (a primary without its lease): no cycle
        #: completes any more
        self.fenced = False

    def wake(self) -> None:
        """Something may be buffered (the hub calls it after every flush)."""
        self._lot.unpark_all()

    def bound_writes(self, timeout: float) -> None:
        """Shutdown: abandon a write that takes longer than `timeout` seconds."""
        self._deadline.bound(timeout)

    def ticket(self) -> int:
        """The store cycle that will take what is buffered now (journal records or
        durable page records); the last cycle taken if nothing is."""
        if self.journal.batch_no != self._jb_taken or self.pager.unsynced:
            return self.cycle + 1
        return self.cycle

    async def run(self) -> None:
        j = self.journal
        pager = self.pager
        while not (self.abandoned or self.fenced):
            if not (j.pending or pager.pending):
                await self._lot.park()
                continue
            try:
                async with self._lock:
                    await self.commit_one()
            except OSError as exc:
                log.critical(
                    "cannot write the journal in %s: %s; stopping the broker so that no "
                    "message is accepted without being stored (free disk space or fix "
                    "the directory, then start again)",
                    self.data_dir,
                    exc,
                )
                self.failed = True
                self._on_failure()
                return

    async def commit_one(self) -> bool:
        """One store cycle: take the journal batch and the buffered page records,
        write (+ fsync in a worker thread) both, complete them; settle the producers
        whose cycle is complete. False when nothing was buffered (or the store was
        abandoned)."""
        if self.abandoned or self.fenced:
            return False
        j = self.journal
        pager = self.pager
        batch = j.take_batch()
        pages = pager.take()
        if batch is None and pages is None:
            return False
        self.cycle += 1
        self._jb_taken = j.batch_no
        self._cycle_waits.append((self.cycle, self._jb_taken))

        def write() -> None:
            if pages is not None:
                pager.write(pages)
            if batch is not None:
                j.write_batch(batch)

        rep = self.replicator
        if rep is not None:
            written = True
            cycle = self.cycle

            async def local() -> None:
                nonlocal written
                if self.sync:
                    written = await self._deadline.run_sync(write)
                else:
                    write()

            # shielded like the local write: a cycle taken is completed even when the
            # loop is cancelled (the replicator bounds its own waits: ha_ack_timeout)
            allowed = True

            async def remote() -> None:
                nonlocal allowed
                allowed = await rep.replicate(cycle, batch, pages)

            with trio.CancelScope(shield=True):
                async with trio.open_nursery() as n:
                    n.start_soon(local)
                    n.start_soon(remote)
            if not written:
                self._abandon(batch, pages)
                return False
            if not allowed:
                self._fence(cycle)
                return False
        elif self.sync:
            if not await self._deadline.run_sync(write):
                self._abandon(batch, pages)
                return False
        else:
            write()  # no fsync: cheap enough for the event loop
        if batch is not None:
            j.batch_done(batch)
            if self._batch_synced is not None and self.sync:
                self._batch_synced(batch.sync_ms)
        if pages is not None:
            pager.done(pages)
        self._wake_depage()  # pages written / journal backlog shrank
        synced = j.synced_batch_no
        waits = self._cycle_waits
        done = self.cycle_done
        while waits and waits[0][1] <= synced:
            done = waits.popleft()[0]
        self.cycle_done = done
        pager.cycle_done(done)
        self.settled(done)
        self._flush()
        return True

    def _fence(self, cycle: int) -> None:
        """The replicator says this primary lost its lease: nothing more is answered."""
        self.fenced = True
        log.critical(
            "HA: this primary lost its lease (another member may be live); store cycle "
            "%d and every later one are never answered, and the broker stops serving",
            cycle,
        )
        self._on_failure()

    def _abandon(self, batch: Batch | None, pages: PageBatch | None) -> None:
        self.abandoned = True
        log.critical(
            "the store in %s did not finish writing within shutdown_timeout; "
            "abandoned store cycle %d (%s%s); producers waiting for it were not "
            "settled, and the journal is recovered from what reached the disk on "
            "the next start",
            self.data_dir,
            self.cycle,
            f"{batch.records} journal record(s)" if batch is not None else "",
            ", page records" if pages is not None else "",
        )

    @property
    def lock(self) -> trio.Lock:
        """Held for a whole store cycle: whoever holds it sees no cycle in progress."""
        return self._lock

    async def final_flush(self) -> None:
        """Write everything buffered (shutdown); a failure sets `failed`."""
        try:
            async with self._lock:
                while await self.commit_one():
                    pass
        except OSError as exc:
            log.critical("cannot write the final journal batch: %s", exc)
            self.failed = True


class DeliveryLogLoop:
    """Writes the delivery log buffer (see the module docstring)."""

    def __init__(
        self, writer: DeliveryLogWriter, *, flush_interval: float, flush: Callable[[], object]
    ) -> None:
        self.writer = writer
        self.flush_interval = flush_interval
        self._flush = flush
        self._lot = trio.lowlevel.ParkingLot()
        if writer.wake is None:
            writer.wake = self._lot.unpark_all
        self._lock = trio.Lock()
        self._deadline = _Deadline()
        #: a write ran past the shutdown deadline: the file is left alone
        self.abandoned = False

    def wake(self) -> None:
        """The buffer reached its take mark (the writer calls it)."""
        self._lot.unpark_all()

    def bound_writes(self, timeout: float) -> None:
        """Shutdown: abandon a write that takes longer than `timeout` seconds."""
        self._deadline.bound(timeout)

    async def run(self) -> None:
        """Every delivery_log_flush_interval, or at once when a quarter full."""
        w = self.writer
        while not self.abandoned:
            if w.pending < w.take_at:
                with trio.move_on_after(self.flush_interval):
                    await self._lot.park()
            async with self._lock:
                await self._write(w)
            self._flush()  # producers resumed by take_batch get their credit

    async def _write(self, w: DeliveryLogWriter) -> bool:
        if self.abandoned:
            return False
        batch = w.take_batch()
        if batch is None:
            return False
        try:
            # shielded (until the shutdown deadline): a batch taken from the buffer
            # is written even when the loop is cancelled at shutdown
            done = await self._deadline.run_sync(lambda: w.write_batch(batch))
        except Exception as exc:  # an OSError, or a bug: never stop the broker for it
            lost = batch.records()
            w.dropped += lost
            log.error(
                "cannot write the delivery log in %s: %s; %d record(s) lost (free disk "
                "space or fix the directory; the broker goes on)",
                w.directory,
                exc,
                lost,
            )
            w.abandon_file()
            return True
        if not done:
            self.abandoned = True
            lost = batch.records()
            w.dropped += lost
            log.error(
                "the delivery log in %s did not finish writing within shutdown_timeout; "
                "abandoned %d record(s) being written and %d still buffered; the file "
                "being written is left as it is",
                w.directory,
                lost,
                w.pending,
            )
            return False
        return True

    async def final_flush(self) -> None:
        """Write what is buffered and close the file (shutdown)."""
        w = self.writer
        async with self._lock:
            while await self._write(w):
                pass
            if self.abandoned:
                return
            try:
                if not await self._deadline.run_sync(w.close):
                    log.error(
                        "the delivery log file in %s did not close within "
                        "shutdown_timeout; abandoned",
                        w.directory,
                    )
            except OSError as exc:
                log.error("cannot close the delivery log file: %s", exc)
