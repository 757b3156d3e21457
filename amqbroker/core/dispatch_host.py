"""What the group dispatcher (`core/group_dispatch.py`) sees of its queue and host:
small Protocols, so that the dispatcher, the views and paging do not import
`core/queue.py` (the queue implements them)."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any, Protocol

from amqbroker.core.dispatch_gate import GatedQueue, GatePolicy

if TYPE_CHECKING:
    from amqbroker.core.delivery_log import DeliveryLog
    from amqbroker.core.entry import Entry
    from amqbroker.core.persistence import Persistence

__all__ = ["DispatchHost", "DispatchPolicy", "QueueStore"]


class DispatchPolicy(GatePolicy, Protocol):
    """The queue policy fields the dispatcher reads (`QueuePolicy`)."""

    @property
    def dispatch_batch(self) -> int: ...

    @property
    def group_skip_ahead(self) -> bool: ...

    @property
    def group_owner_policy(self) -> str: ...

    @property
    def group_rebalance(self) -> bool: ...

    @property
    def group_rebalance_pause_dispatch(self) -> bool: ...

    @property
    def group_unbind_on_undeliverable(self) -> bool: ...


class DispatchHost(Protocol):
    def schedule_dispatch(self, queue: Any) -> None: ...

    def queue_idle(self, queue: Any) -> None: ...


class QueueStore(GatedQueue, Protocol):
    """The queue's storage as the dispatcher sees it (`amqbroker.core.queue.Queue`):
    the main order, the counters, and the calls that put a message back or make the
    queue forget it. A Protocol, so this module does not import the queue."""

    qid: int
    durable: bool
    first_key: str | None
    levels: list[deque[Entry]]
    top: int
    n_main: int
    acked: int
    scheduled: int
    stuck_messages: int
    dlog: DeliveryLog | None
    store: Persistence

    @property
    def host(self) -> DispatchHost: ...

    @property
    def policy(self) -> DispatchPolicy: ...

    def key_of(self, group_id: str | None) -> Any: ...

    def insert_main(self, e: Entry) -> None: ...

    def merge_main(self, entries: list[Entry]) -> None: ...

    def remove(self, e: Entry) -> None: ...

    def expire(self, e: Entry) -> None: ...

    def count_failure(self, e: Entry) -> bool: ...
