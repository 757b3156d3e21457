"""Named topic subscriptions (JMS durable and shared subscriptions).

A consumer link that asks for a named subscription (`Subscription`) reads from a queue
on the topic (multicast address) named after the subscription and the client's
container id; the queue is created on first use and outlives its consumers when the
subscription is durable (a volatile shared one goes with its last consumer). A queue
of a subscription may filter at routing time (`Queue.filter`: the selector, and
no-local: skip messages from the subscriber's own connection).

`Subscriptions` (`Broker.subscriptions`) finds, creates, replaces and filters these
queues; the broker itself keeps thin `subscription_queue` / `filter_subscription` /
`find_subscription` methods for the protocol layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from amqbroker.core.address import MULTICAST
from amqbroker.core.address_settings import parse_client_address
from amqbroker.core.errors import NotFound, PreconditionFailed

if TYPE_CHECKING:
    from amqbroker.core.broker import Broker
    from amqbroker.core.queue import Queue


@dataclass(frozen=True)
class Subscription:
    """A topic subscription a consumer link asks for (JMS durable / shared
    subscriptions). `container` is the client's container id (JMS clientID), empty for
    a global subscription; the queue is named from both."""

    name: str
    container: str = ""
    durable: bool = False
    shared: bool = False
    selector: str | None = None
    no_local: bool = False

    @property
    def queue_name(self) -> str:
        base = f"{self.container}.{self.name}" if self.container else self.name
        if self.durable:
            return base
        return f"{base}:shared-volatile" if self.container else f"{base}:global-volatile"


class Subscriptions:
    """The named subscriptions of a broker (`Broker.subscriptions`)."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker

    def queue(self, address: str, sub: Subscription, *, origin: str | None = None) -> Queue:
        """The queue of a named (durable or shared) topic subscription, created on
        first use. An existing subscription whose topic or selector differs is
        replaced when nobody consumes from it (JMS: changing a durable subscription is
        an unsubscribe and a new subscribe); with consumers attached that is an error.
        `origin`: the connection whose own messages a no-local subscription skips."""
        b = self.broker
        name, options = parse_client_address(address)
        if b.addresses.get(name) is None:
            r = b.resolve(name)
            if not r.auto_create_addresses:
                raise NotFound(
                    f"topic '{name}' does not exist and auto-create is off for it; create "
                    "it in the broker configuration or enable auto_create_addresses"
                )
            b.create_address(name, MULTICAST, auto_created=True)
        a = b.addresses[name]
        if a.routing != MULTICAST:
            raise PreconditionFailed(
                f"address '{name}' is a queue (anycast); subscriptions (durable or shared) "
                "need a topic: attach with the 'topic' capability to a multicast address"
            )
        qname = sub.queue_name
        q = b.queues.get(qname)
        if q is not None:
            same = q.address is a and q.selector == sub.selector and q.no_local == sub.no_local
            if not same:
                if q.consumer_count:
                    raise PreconditionFailed(
                        f"subscription '{sub.name}' exists on topic "
                        f"'{q.address.name if q.address else '?'}' with selector "
                        f"{q.selector!r} and has active consumers; close them before "
                        "subscribing with another topic or selector"
                    )
                b.delete_queue(q)
                q = None
        if q is None:
            q = b._create_queue(
                qname,
                a,
                durable=sub.durable,
                options=options,
                subscription=not sub.durable,
                subscription_of=sub,
            )
        if sub.no_local and origin is not None:
            q.no_local_origin = origin  # a re-attach: the new connection's own messages
        return q

    def set_filter(
        self, q: Queue, selector: str | None, no_local: bool, origin: str | None = None
    ) -> None:
        """Set a subscription queue's routing-time filter: its selector (raises
        SelectorError when invalid) and no-local (skip messages from `origin`)."""
        if selector:
            q.filter = self.broker.codec.selector_filter(selector)
            q.selector = selector
        q.no_local = no_local
        if no_local and origin is not None:
            q.no_local_origin = origin

    def find(self, link_name: str, container: str) -> Queue | None:
        """The queue of an existing subscription named by a link (Qpid JMS
        unsubscribes by attaching with the subscription's link name and no source)."""
        base, _, suffix = link_name.partition("|")
        names = []
        if suffix.startswith("global"):
            names.append(base)
        else:
            names.append(f"{container}.{base}" if container else base)
            names.append(base)
        queues = self.broker.queues
        for n in names:
            for qn in (n, f"{n}:shared-volatile", f"{n}:global-volatile"):
                q = queues.get(qn)
                if q is not None and q.subscription_name is not None:
                    return q
        return None
