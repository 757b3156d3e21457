"""A queue browser: an outgoing link with source distribution-mode `copy` on a queue.

It sees the messages waiting in the queue when it attaches (a snapshot, in queue
order: priority, then arrival), filtered by its selector, without taking them: they
stay for the queue's consumers, and a browser is not a `Consumer` of the core (it never
binds groups, holds credit in a dispatch pass, or settles anything). Deliveries are
sent settled, so there is nothing to acknowledge; a message consumed between the
snapshot and its turn is still shown (JMS allows a browser's view to be stale).

When the snapshot is exhausted, a drain request completes at once (Qpid JMS's
`QueueBrowser.hasMoreElements` drains to learn that the end is reached).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from amqbroker.core.entry import Entry
from amqbroker.core.queue import Queue
from amqbroker.protocol import fastpath as fp
from amqbroker.protocol.scanner import set_delivery_count

if TYPE_CHECKING:
    from amqbroker.core.broker import Broker
    from amqbroker.protocol.host import LinkHost


class BrowserLink:
    __slots__ = ("conn", "link", "match", "pos", "ptr", "queue", "snapshot", "tagger")

    def __init__(
        self,
        conn: LinkHost,
        link: Any,
        queue: Queue,
        match: Callable[[Entry], bool] | None,
    ) -> None:
        self.conn = conn
        self.link = link
        self.ptr = link._impl
        self.queue = queue
        self.match = match
        self.snapshot: list[Entry] | None = None
        self.pos = 0
        self.tagger = fp.Tagger()

    def on_flow(self) -> None:
        ptr = self.ptr
        if self.snapshot is None:
            # taken at the first flow, so messages sent before the browser asked for
            # any are included
            self.snapshot = self.queue.browse()
        snap = self.snapshot
        credit = fp.credit(ptr)
        sent = 0
        while credit > 0 and self.pos < len(snap):
            e = snap[self.pos]
            self.pos += 1
            if self.match is not None and not self.match(e):
                continue
            data = e.data
            if e.delivery_count:
                data = set_delivery_count(data, e.delivery_count)
            d = fp.new_delivery(ptr, self.tagger.next())
            fp.link_send(ptr, data, len(data))
            fp.link_advance(ptr)
            fp.delivery_settle(d)
            credit -= 1
            sent += 1
        if self.pos >= len(snap):
            # nothing more to show: hand back the rest of a drain
            if fp.drain_requested(ptr):
                fp.drained(ptr)
            snap.clear()
            self.pos = 0
            self.snapshot = snap
        if sent or not self.conn.dirty:
            self.conn.mark_dirty()

    def on_delivery(self, d: Any) -> None:
        # deliveries are sent settled; a disposition from the client changes nothing
        fp.settle(d)

    def detach(self, broker: Broker, failed: bool = False) -> None:
        self.snapshot = None
