"""A queue's paging (address_full_policy PAGE, see `amqbroker.store.paging`).

While the address is full, or as long as anything is paged, `Queue.enqueue` hands the
message (seq assigned) to the page store instead of the in-memory structures, so every
paged message is newer than every message in memory. `depage` takes the oldest paged
messages back (in seq order, read by the store layer off the event loop) and puts them
at the tail of the main order, where grouping applies to them exactly as to any
arriving message. Each function takes the queue first; `Queue` exposes the public ones
under the same names.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

from amqbroker.core.dispatch_host import QueueStore

if TYPE_CHECKING:
    from amqbroker.core.entry import Entry


class PageStore(Protocol):
    def page(self, qid: int, entry: Entry) -> None: ...

    def drop(self, qid: int) -> None: ...


class PagingBudget(Protocol):
    paging: set[Any]


class PagingAddress(Protocol):
    @property
    def budget(self) -> PagingBudget: ...


class PagingQueue(QueueStore, Protocol):
    """The queue as its paging sees it (`amqbroker.core.queue.Queue`)."""

    count: int
    enqueued: int
    paged_count: int
    paged_bytes: int
    page_mark: int
    last_paged: int
    last_seq: int

    @property
    def pager(self) -> PageStore | None: ...

    @property
    def address(self) -> PagingAddress | None: ...

    def account(self, e: Entry) -> None: ...

    def schedule(self, e: Entry) -> bool: ...

    def dispatch(self) -> None: ...


def page_out(q: PagingQueue, e: Entry) -> None:
    """`e` (seq set) goes to the page instead of memory. A durable message is not
    journaled while paged: the page record is its durable copy."""
    assert q.pager is not None
    q.count += 1
    q.enqueued += 1
    n = len(e.data)
    if not q.paged_count and q.address is not None:
        q.address.budget.paging.add(q)
    q.paged_count += 1
    q.paged_bytes += n
    q.last_paged = e.seq
    q.pager.page(q.qid, e)


def depage(q: PagingQueue, entries: Iterable[Entry]) -> None:
    """Take back the oldest paged messages (in seq order, seq kept): they join the
    tail of the main order and are dispatched like arriving messages. A durable
    one on a durable queue is journaled now (the broker wraps this call and the
    new `page_mark` in one atomic journal record)."""
    for e in entries:
        n = len(e.data)
        q.paged_count -= 1
        q.paged_bytes -= n
        q.count -= 1
        q.page_mark = e.seq
        e.gkey = q.key_of(e.group_id)
        q.account(e)
        if q.durable and e.durable:
            q.store.message_added(q.qid, e)
        if e.deliver_at and q.schedule(e):
            continue
        q.insert_main(e)
    paging_ended(q)
    q.dispatch()


def page_lost(q: PagingQueue, n: int, nbytes: int) -> None:
    """Paged messages the store could not read back (corrupt page, logged)."""
    q.paged_count -= n
    q.paged_bytes -= nbytes
    q.count -= n
    paging_ended(q)


def restore_paged(q: PagingQueue, n: int, nbytes: int, max_seq: int, mark: int) -> None:
    """Recovery: `n` durable messages are in the page (seq up to `max_seq`);
    `mark` is the persisted `paged_through`."""
    q.page_mark = mark
    q.last_seq = max(q.last_seq, max_seq, mark)
    if n:
        q.count += n
        q.paged_count += n
        q.paged_bytes += nbytes
        q.last_paged = max_seq
        if q.address is not None:
            q.address.budget.paging.add(q)


def drop_paged(q: PagingQueue) -> int:
    n = q.paged_count
    if n and q.pager is not None:
        q.pager.drop(q.qid)
        q.count -= n
        q.paged_count = 0
        q.paged_bytes = 0
        q.page_mark = q.last_paged
        paging_ended(q)
    return n


def paging_ended(q: PagingQueue) -> None:
    if not q.paged_count and q.address is not None:
        q.address.budget.paging.discard(q)
