"""A durable queue's record in the store: the attributes it is declared with
(`queue_attributes`, written by `Persistence.queue_declared` whenever they change) and
the queue recreated from them at start-up (`restore_queue`).

The attributes: its address and routing type, whether it was auto-created, its queue
options, for a subscription queue the subscription's name, selector and no-local,
and for a paging queue `paged_through` (the page mark: messages up to it were read
back into the journal; see `amqbroker.store.paging`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from amqbroker.core.address import ANYCAST
from amqbroker.core.address_settings import QueueOptions
from amqbroker.core.entry import Entry
from amqbroker.core.subscriptions import Subscription

if TYPE_CHECKING:
    from amqbroker.core.broker import Broker
    from amqbroker.core.queue import Queue


def queue_attributes(q: Queue) -> dict[str, Any]:
    """The attributes durable queue `q` is declared with in the store."""
    a = q.address
    attrs: dict[str, Any] = {
        "address": a.name if a else q.name,
        "routing": a.routing if a else ANYCAST,
        "auto_created": q.auto_created,
        "options": q.options,
    }
    if q.subscription_name is not None:
        attrs["subscription"] = q.subscription_name
        attrs["selector"] = q.selector
        attrs["no_local"] = q.no_local
    if q.page_mark:
        attrs["paged_through"] = q.page_mark
    return attrs


def restore_queue(
    broker: Broker, qid: int, name: str, attributes: dict[str, Any], entries: Iterable[Entry]
) -> Queue:
    """Recreate a durable queue from the store in `broker`, with its messages in order."""
    aname = attributes.get("address", name)
    routing = attributes.get("routing", ANYCAST)
    a = broker.addresses.get(aname)
    if a is None:
        a = broker._new_address(aname, routing, auto_created=bool(attributes.get("auto_created")))
    opts = QueueOptions(**attributes.get("options", {}))
    sub = None
    if attributes.get("subscription") is not None:
        sub = Subscription(
            str(attributes["subscription"]),
            durable=True,
            selector=attributes.get("selector"),
            no_local=bool(attributes.get("no_local")),
        )
    # already declared in the store: recreate it without a new record
    q = broker._create_queue(
        name,
        a,
        durable=True,
        auto_created=bool(attributes.get("auto_created")),
        options=opts,
        qid=qid,
        declare=False,
        subscription_of=sub,
    )
    q.restore(entries)
    q.restore_paged(0, 0, 0, int(attributes.get("paged_through", 0)))
    w = a.dedup
    if w is not None:
        # the window is not journaled: after a restart it holds the ids of the
        # messages recovered (still queued); ids of consumed messages are forgotten
        for e in q.browse():
            key = broker.codec.duplicate_id(e.data)
            if key is not None:
                w.seen(key)
    return q
