"""Dead-lettering, expiry routing and the operator's message moves.

A queue hands a message it gives up on to its host (`Broker.dead_letter`: rejected,
or out of delivery attempts; `Broker.expired`: past its expiry time), which passes it
here. The resolved address settings of the queue's address name where it goes
(`dead_letter_address`, `expiry_address`); it is routed there as a copy annotated with
where it came from (x-opt-ORIG-ADDRESS, x-opt-ORIG-QUEUE, and the reason or the
actual expiry time). Without such an address, or when it is the queue's own address,
a dead letter is dropped (counted in `Broker.dropped_dead_letters`, with a warning)
and an expired message just goes.

The management operations `moveMessages` and `retryMessages` (e.g. out of a
dead-letter queue) and the periodic expiry scan live here too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from amqbroker.core import delivery_log as dl
from amqbroker.core.address import ANYCAST, Address
from amqbroker.core.entry import Entry
from amqbroker.core.errors import InvalidField, NotFound

if TYPE_CHECKING:
    from amqbroker.core.broker import Broker
    from amqbroker.core.queue import Queue

log = logging.getLogger(__name__)


class DeadLetters:
    """Where messages a queue gives up on go (`Broker.dead_letters`)."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker

    def _target(self, queue: Queue, entry: Entry, event: int, expiry: bool) -> str | None:
        """Log `event` for `entry` leaving `queue`; the address its copy goes to (the
        queue's dead_letter_address, or expiry_address), None when there is none (or it
        is the queue's own address)."""
        b = self.broker
        if b.dlog is not None:
            b.dlog.event(event, queue.name, entry)
        a = queue.address
        r = a.settings if a is not None and a.settings is not None else b.resolve(queue.name)
        target = r.expiry_address if expiry else r.dead_letter_address
        if not target or (a is not None and target == a.name):
            return None
        return target

    def dead_letter(self, queue: Queue, entry: Entry, reason: str) -> None:
        b = self.broker
        a = queue.address
        dla = self._target(queue, entry, dl.DEAD_LETTERED, expiry=False)
        if dla is None:
            b.dropped_dead_letters += 1
            log.warning(
                "queue %r: message seq %d dropped (%s) - no dead_letter_address is set "
                "for this address; set one in its address settings to keep such messages",
                queue.name,
                entry.seq,
                reason,
            )
            return
        mid = b.codec.message_id(entry.data)
        annotations: dict[str, str | int | bool | None] = {
            "x-opt-ORIG-ADDRESS": a.name if a else queue.name,
            "x-opt-ORIG-QUEUE": queue.name,
            "x-opt-DLQ-REASON": reason,
        }
        if mid is not None:
            annotations["x-opt-ORIG-MESSAGE-ID"] = str(mid)
        self._reroute(dla, entry, annotations, keep_expiry=True)

    def expired(self, queue: Queue, entry: Entry) -> None:
        b = self.broker
        a = queue.address
        ea = self._target(queue, entry, dl.EXPIRED, expiry=True)
        if ea is None:
            return
        annotations: dict[str, str | int | bool | None] = {
            "x-opt-ORIG-ADDRESS": a.name if a else queue.name,
            "x-opt-ORIG-QUEUE": queue.name,
            "x-opt-ACTUAL-EXPIRY": int(b.clock() * 1000),
        }
        self._reroute(ea, entry, annotations, keep_expiry=False)

    def _reroute(
        self,
        target: str,
        entry: Entry,
        annotations: dict[str, str | int | bool | None],
        *,
        keep_expiry: bool,
    ) -> None:
        b = self.broker
        try:
            a = b.address_for_producer(target)
        except NotFound as exc:
            b.dropped_dead_letters += 1
            log.warning("cannot move message to %r: %s", target, exc.description)
            return
        data = b.codec.annotate(entry.data, annotations)
        copy = Entry(
            data,
            entry.durable,
            entry.priority,
            entry.expiry if keep_expiry else 0,
            0,
            entry.group_id,
            entry.group_seq,
        )
        copy.trace = entry.trace
        if a.queues or a.routing == ANYCAST:
            try:
                b.route(a, copy)
            except NotFound as exc:  # an anycast address whose queue is gone for good
                b.dropped_dead_letters += 1
                log.warning("cannot move message to %r: %s", target, exc.description)

    def move_messages(
        self, src: Queue, dst: Queue, match: Callable[[Entry], bool] | None = None
    ) -> int:
        """Move the waiting messages of `src` that `match` accepts (all by default) to
        the tail of `dst`, in queue order (management `moveMessages`, e.g. out of a
        dead-letter queue). In-flight, delayed and paged messages stay. The copy in
        `dst` is recorded before the removal from `src`: a crash in between
        duplicates, never loses. Address limits are not applied (an operator's act)."""
        if dst is src:
            raise InvalidField(f"cannot move messages of queue '{src.name}' to itself")

        def sink(e: Entry) -> None:
            dst.enqueue(e.copy())

        return src.take_waiting(match or _everything, sink)

    def retry_messages(self, dlq: Queue, original_address: Callable[[bytes], str | None]) -> int:
        """Send dead letters back where they came from (management `retryMessages`):
        each waiting message of `dlq` whose `original_address` (the protocol layer
        reads the x-opt-ORIG-ADDRESS annotation) names an address other than the
        dead-letter queue's own is routed there again with delivery-count 0 and
        removed from `dlq`. Messages without it, whose address is gone and cannot be
        auto-created, or whose topic has no subscriber, stay. Returns how many were sent back."""
        b = self.broker
        own = dlq.address.name if dlq.address is not None else dlq.name
        targets: dict[Entry, Address] = {}

        def match(e: Entry) -> bool:
            name = original_address(e.data)
            if not name or name == own:
                return False
            a = b.addresses.get(name)
            if a is None:
                try:
                    a = b.address_for_producer(name)
                except (NotFound, InvalidField):
                    return False
            if not a.queues:
                return False  # a topic without subscribers would drop it: it stays
            targets[e] = a
            return True

        def sink(e: Entry) -> None:
            copy = Entry(e.data, e.durable, e.priority, e.expiry, 0, e.group_id, e.group_seq)
            b.route(targets.pop(e), copy, check_full=False)

        return dlq.take_waiting(match, sink)

    def expire_scan(self) -> int:
        """Periodic reaper: every queue drops its expired messages (each goes through
        `Broker.expired`); a queue left empty may be auto-deleted. Returns how many."""
        b = self.broker
        n = 0
        for q in list(b.queues.values()):
            n += q.expire_scan()
            if not q.count:
                b.queue_idle(q)
        return n


def _everything(e: Entry) -> bool:
    return True
