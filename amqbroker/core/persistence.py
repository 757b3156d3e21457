"""What the core asks of durable storage (implemented by `amqbroker.store`).

The core calls these synchronously from the event loop; an implementation only
buffers records here and writes/syncs them elsewhere (group commit). The core never
waits: whether a producer's transfer must wait for a sync is decided by the protocol
layer from `Queue.durable and entry.durable`.
"""

from __future__ import annotations

from typing import Any, Protocol

from amqbroker.core.entry import Entry


class Persistence(Protocol):
    def queue_declared(self, qid: int, name: str, attributes: dict[str, Any]) -> None: ...

    def queue_deleted(self, qid: int) -> None: ...

    def message_added(self, qid: int, entry: Entry) -> None: ...

    def message_acked(self, qid: int, entry: Entry) -> None: ...

    def delivery_count_updated(self, qid: int, entry: Entry) -> None: ...

    def message_delivered(self, qid: int, entry: Entry) -> None:
        """`entry` goes to a consumer unsettled: a store that counts before delivery
        records delivery-count + 1 now, so that a crash before the outcome counts the
        attempt as a lost connection does."""

    def message_returned(self, qid: int, entry: Entry) -> None:
        """`entry` came back uncounted (released, clean detach): undo
        `message_delivered`'s count."""

    def begin_atomic(self) -> None:
        """Records buffered from here to `end_atomic` survive a crash all together or
        not at all (a transaction's commit). Not nested."""

    def end_atomic(self) -> None: ...


class NoPersistence:
    """Used for non-durable queues and in core tests."""

    def queue_declared(self, qid: int, name: str, attributes: dict[str, Any]) -> None:
        pass

    def queue_deleted(self, qid: int) -> None:
        pass

    def message_added(self, qid: int, entry: Entry) -> None:
        pass

    def message_acked(self, qid: int, entry: Entry) -> None:
        pass

    def delivery_count_updated(self, qid: int, entry: Entry) -> None:
        pass

    def message_delivered(self, qid: int, entry: Entry) -> None:
        pass

    def message_returned(self, qid: int, entry: Entry) -> None:
        pass

    def begin_atomic(self) -> None:
        pass

    def end_atomic(self) -> None:
        pass
