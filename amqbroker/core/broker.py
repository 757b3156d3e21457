"""The broker core: the registry of addresses and queues, and routing between them.

Everything the protocol layer does with messages goes through here: finding or
auto-creating the queue a consumer attaches to or the address a producer sends to,
routing an arriving message, temporary queues, and deferred dispatch (a queue that
used up its dispatch batch asks to be continued after other work has run:
`run_deferred`). Dead-lettering, expiry routing and the operator's message moves are
the `dead_letters` it owns (`amqbroker.core.dead_letters`).

Paging (address_full_policy PAGE): with a page store (`pager`), the queues of a PAGE
address page messages while it is full; the `paging` it owns (`Depager`,
`amqbroker.core.broker_paging`) is how the application's depage task reads them back
(see `amqbroker.store.paging`). Without a page store PAGE acts as BLOCK. Durable
queues are declared in the store with `amqbroker.core.queue_records.queue_attributes`
and recreated from them by its `restore_queue`.

Address settings are resolved by wildcard match when an address or queue is created
and kept on the object; queue options from the address string (`orders?group-
buckets=1024`) apply when the queue is created and are persisted with it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any, Protocol

from amqbroker.core.address import ANYCAST, MULTICAST, Address, MemoryBudget
from amqbroker.core.address_settings import (
    AddressSettingsRepository,
    QueueOptions,
    ResolvedAddressSettings,
    parse_client_address,
    queue_config,
)
from amqbroker.core.broker_paging import Depager
from amqbroker.core.codec import MessageCodec, PlainCodec
from amqbroker.core.dead_letters import DeadLetters
from amqbroker.core.delivery_log import DeliveryLog
from amqbroker.core.entry import Entry
from amqbroker.core.errors import (
    BrokerError,
    NotFound,
    PreconditionFailed,
    ResourceLimitExceeded,
)
from amqbroker.core.persistence import NoPersistence, Persistence
from amqbroker.core.queue import Pager, Queue, QueuePolicy
from amqbroker.core.queue_records import queue_attributes
from amqbroker.core.subscriptions import Subscription, Subscriptions
from amqbroker.core.timers import Timers

__all__ = [
    "NO_ROUTE",
    "PENDING",
    "ROUTED",
    "ROUTED_SYNC",
    "Broker",
    "Router",
    "Subscription",  # re-exported from amqbroker.core.subscriptions
]

#: route() results
ROUTED = 0
ROUTED_SYNC = 1  # at least one durable copy: settle the producer after the store syncs
NO_ROUTE = 2  # multicast address without subscribers: accepted and dropped
PENDING = 3  # (router hook only) decided later: the router calls `done` with the result


class Router(Protocol):
    """A hook asked first for every message a producer link routes (the cluster layer:
    which node's queue instance takes it). `route` returns None to let the broker route
    locally as usual, a route() result when it routed the message itself, or PENDING
    when the decision comes later: it then calls `done` once with the result or a
    BrokerError (the producer's transfer is rejected with it)."""

    def route(
        self, a: Address, e: Entry, done: Callable[[int | BrokerError], None]
    ) -> int | None: ...

    def prepare(
        self, a: Address, e: Entry, done: Callable[[int | BrokerError], None]
    ) -> int | None:
        """A transactional send before it is enlisted: None to enlist it now, or
        PENDING, then `done(ENLIST)` or `done(BrokerError)` once (its group decided)."""
        ...

    def route_committed(self, a: Address, e: Entry) -> int | None:
        """A transactional send taking effect at commit: like `route`, with no one left
        to answer (a later refusal is logged)."""
        ...


class Broker:
    def __init__(
        self,
        *,
        address_settings: AddressSettingsRepository | None = None,
        persistence: Persistence | None = None,
        clock: Callable[[], float],
        timers: Timers | None = None,
        codec: MessageCodec | None = None,
        dispatch_batch: int = 10_000,
        temporary_queue_prefix: str = "tmp.",
        wake: Callable[[], object] | None = None,
        global_max_size: int = -1,
        pager: Pager | None = None,
        page_low_water: float = 0.5,
        page_read_ahead: int = 4 << 20,
        depage_wake: Callable[[], object] | None = None,
        age_resolution: float = 1.0,
        age_marks: int = 1024,
        delivery_log: DeliveryLog | None = None,
    ) -> None:
        self.settings_repo = address_settings or AddressSettingsRepository({})
        self.store: Persistence = persistence or NoPersistence()
        #: the delivery log (None = off); queues read it when they are created
        self.dlog = delivery_log
        self.clock = clock
        self.timers = timers if timers is not None else Timers()
        self.codec: MessageCodec = codec or PlainCodec()
        self.dispatch_batch = dispatch_batch
        #: management: message-age resolution (seconds) and arrival marks per queue
        self.age_resolution = age_resolution
        self.age_marks = age_marks
        self.temporary_queue_prefix = temporary_queue_prefix
        #: called when deferred work is pending (the event loop runs `run_deferred`)
        self.wake = wake
        #: broker-wide bound on queued message bytes (-1 = unlimited)
        self.budget = MemoryBudget(global_max_size)
        #: page store for PAGE addresses; read back below `page_low_water` (a fraction
        #: of the limit), at most `page_read_ahead` bytes per step (`paging`)
        self.pager = pager
        self.paging = Depager(self.budget, self.store, page_low_water, page_read_ahead)
        self.budget.on_room = depage_wake
        self.addresses: dict[str, Address] = {}
        self.queues: dict[str, Queue] = {}
        #: container ids held by connections that asked to be the only one
        #: (sole-connection-for-container; the JMS clientID) -> connection id
        self.containers: dict[str, str] = {}
        self._pending: dict[Queue, None] = {}
        self._next_qid = 1
        self._tmp_counter = itertools.count(1)
        self.routed = 0
        self.dropped_no_route = 0
        self.dropped_dead_letters = 0
        #: clustered routing hook (None: single node)
        self.router: Router | None = None
        #: set (the reason) while durable sends from clients are rejected with
        #: amqp:resource-limit-exceeded: an HA primary with no backup in sync under
        #: ha_unreplicated = "refuse" (amqbroker.ha.primary); None: accepted
        self.durable_refused: str | None = None
        #: set (the reason) while every send is rejected with amqp:resource-limit-exceeded:
        #: an HA live member resumed after a pause (SIGCONT) until ZooKeeper confirms
        #: its lease (amqbroker.pair); None: accepted
        self.sends_refused: str | None = None
        self.duplicates_dropped = 0
        #: dead-lettering, expiry routing, moveMessages/retryMessages, the expiry scan
        self.dead_letters = DeadLetters(self)
        #: named (durable / shared) topic subscriptions
        self.subscriptions = Subscriptions(self)

    # ------------------------------------------------------------- settings
    def resolve(self, address: str) -> ResolvedAddressSettings:
        return self.settings_repo.resolve(address)

    def _policy(self, address: str, options: QueueOptions | None) -> QueuePolicy:
        """The queue settings (`queue_config`, one field per row of QUEUE_SETTINGS)
        plus the broker-wide dispatch tuning."""
        qc = queue_config(self.resolve(address), options or QueueOptions())
        return QueuePolicy(
            **qc.model_dump(),
            dispatch_batch=self.dispatch_batch,
            age_resolution=self.age_resolution,
            age_marks=self.age_marks,
        )

    # ------------------------------------------------------------ addresses
    def create_address(
        self, name: str, routing: str, *, auto_created: bool = False, durable: bool = True
    ) -> Address:
        """Create an address (and, for anycast, its queue of the same name)."""
        if name in self.addresses:
            return self.addresses[name]
        a = self._new_address(name, routing, auto_created=auto_created)
        if routing == ANYCAST:
            durable = durable and a.settings.default_queue_durable
            self._create_queue(name, a, durable=durable, auto_created=auto_created)
        return a

    def _new_address(self, name: str, routing: str, *, auto_created: bool = False) -> Address:
        """Create and register address `name` with its resolved settings (the caller
        has checked that it does not exist)."""
        r = self.resolve(name)
        full_policy = r.address_full_policy
        if full_policy == "PAGE" and self.pager is None:
            full_policy = "BLOCK"  # PAGE without a page store acts as BLOCK
        a = Address(
            name,
            routing,
            settings=r,
            max_size=r.max_size_bytes,
            full_policy=full_policy,
            budget=self.budget,
            auto_created=auto_created,
        )
        self.addresses[name] = a
        return a

    def _temporary_name(self) -> str:
        """An unused name for a dynamic node: the temporary prefix and a counter."""
        name = f"{self.temporary_queue_prefix}{next(self._tmp_counter)}"
        while name in self.addresses:
            name = f"{self.temporary_queue_prefix}{next(self._tmp_counter)}"
        return name

    def address_for_producer(self, address: str, routing_hint: str | None = None) -> Address:
        """The address a producer link targets, auto-created when settings allow."""
        name, options = parse_client_address(address)
        a = self.addresses.get(name)
        if a is None:
            if name.startswith(self.temporary_queue_prefix):
                raise NotFound(
                    f"temporary queue '{name}' does not exist (it was deleted with the "
                    "link that created it); names with the temporary prefix are never "
                    "auto-created"
                )
            r = self.resolve(name)
            if not r.auto_create_addresses:
                raise NotFound(
                    f"address '{name}' does not exist and auto-create is off for it; "
                    "create it in the broker configuration ('addresses') or enable "
                    "auto_create_addresses in its address settings"
                )
            routing = routing_hint or r.default_routing_type
            a = self.create_address(name, routing, auto_created=True)
            if options != QueueOptions() and a.queues:
                self.set_queue_options(a.queues[0], options)
        else:
            _check_routing(a, routing_hint)
        return a

    def queue_for_consumer(
        self,
        address: str,
        routing_hint: str | None = None,
        subscription: str = "",
    ) -> Queue:
        """The queue a consumer link reads from. For a multicast address this is a new
        subscription queue, deleted when the consumer goes."""
        name, options = parse_client_address(address)
        a = self.addresses.get(name)
        if a is None:
            r = self.resolve(name)
            routing = routing_hint or r.default_routing_type
            if not (r.auto_create_addresses and (routing == MULTICAST or r.auto_create_queues)):
                raise NotFound(
                    f"address '{name}' does not exist and auto-create is off for it; "
                    "create it in the broker configuration ('addresses') or enable "
                    "auto_create_addresses/auto_create_queues in its address settings"
                )
            a = self.create_address(name, routing, auto_created=True)
            if options != QueueOptions() and a.queues:
                self.set_queue_options(a.queues[0], options)
        else:
            _check_routing(a, routing_hint)
        if a.routing == ANYCAST:
            if not a.queues:
                return self.anycast_queue(a, options)
            return a.queues[0]
        sub = subscription or "sub"
        qname = f"{name}::{sub}.{next(self._tmp_counter)}"
        return self._create_queue(
            qname, a, durable=False, temporary=True, options=options, subscription=True
        )

    def anycast_queue(self, a: Address, options: QueueOptions | None = None) -> Queue:
        """The queue of anycast address `a`, which has none (an operator deleted it
        while a producer held the address): created again as for an address that never
        existed when its settings auto-create addresses and queues, else NotFound
        naming the address (a send is rejected, a consumer attach refused; never
        a message accepted into nothing). The rare case: the routing paths call this
        only once they found no queue."""
        if a.queues:
            return a.queues[0]
        name = a.name
        if name.startswith(self.temporary_queue_prefix):
            raise NotFound(
                f"temporary queue '{name}' does not exist (it was deleted with the "
                "link that created it); names with the temporary prefix are never "
                "auto-created"
            )
        r = a.settings if a.settings is not None else self.resolve(name)
        if not (r.auto_create_addresses and r.auto_create_queues):
            raise NotFound(
                f"address '{name}' has no queue and auto-create is off for it; create "
                "the queue (management CREATE queue) or enable auto_create_addresses/"
                "auto_create_queues in its address settings"
            )
        cur = self.addresses.get(name)
        other = self.queues.get(name)
        if (cur is not None and cur is not a) or other is not None:
            raise NotFound(
                f"address '{name}' has no queue and cannot get one back: the address or "
                "a queue of that name was created again since; attach again"
            )
        if cur is None:
            self.addresses[name] = a  # the address itself was deleted meanwhile
        return self._create_queue(
            name, a, durable=r.default_queue_durable, auto_created=True, options=options
        )

    # -------------------------------------------------------- subscriptions
    # (the protocol layer's names for `Subscriptions`, amqbroker.core.subscriptions)
    def subscription_queue(
        self, address: str, sub: Subscription, *, origin: str | None = None
    ) -> Queue:
        return self.subscriptions.queue(address, sub, origin=origin)

    def filter_subscription(
        self, q: Queue, selector: str | None, no_local: bool, origin: str | None = None
    ) -> None:
        self.subscriptions.set_filter(q, selector, no_local, origin)

    def find_subscription(self, link_name: str, container: str) -> Queue | None:
        return self.subscriptions.find(link_name, container)

    def is_topic(self, address: str) -> bool:
        """Whether an address exists as, or would be auto-created as, a topic."""
        name = address.partition("?")[0]
        a = self.addresses.get(name)
        if a is not None:
            return a.routing == MULTICAST
        return self.resolve(name).default_routing_type == MULTICAST

    def create_temporary_topic(self) -> Address:
        """A dynamic topic (JMS TemporaryTopic): a multicast address with a unique
        name; its subscribers' queues come and go with them."""
        return self._new_address(self._temporary_name(), MULTICAST)

    def delete_address(self, a: Address) -> list[Any]:
        """Remove an address and its queues; returns the consumers to detach."""
        consumers: list[Any] = []
        for q in list(a.queues):
            consumers.extend(self.delete_queue(q))
        if self.addresses.get(a.name) is a:
            del self.addresses[a.name]
        return consumers

    def create_temporary_queue(self, hint: str | None = None) -> Queue:
        """A dynamic node: an anycast address+queue with a unique name."""
        a = self._new_address(self._temporary_name(), ANYCAST)
        return self._create_queue(a.name, a, durable=False, temporary=True)

    def _create_queue(
        self,
        name: str,
        address: Address,
        *,
        durable: bool,
        temporary: bool = False,
        auto_created: bool = False,
        options: QueueOptions | None = None,
        subscription: bool = False,
        qid: int | None = None,
        declare: bool = True,
        subscription_of: Subscription | None = None,
    ) -> Queue:
        if qid is None:
            qid = self._next_qid
            self._next_qid += 1
        else:
            self._next_qid = max(self._next_qid, qid + 1)
        q = Queue(
            name,
            self,
            qid=qid,
            address=address,
            policy=self._policy(address.name, options),
            durable=durable,
            temporary=temporary,
            auto_created=auto_created or subscription,
            subscription=subscription,
            persistence=self.store,
            options=options.model_dump(exclude_none=True) if options else {},
        )
        if address.full_policy == "PAGE":
            q.pager = self.pager
        if subscription_of is not None:
            q.subscription_name = subscription_of.name
            self.subscriptions.set_filter(q, subscription_of.selector, subscription_of.no_local)
        address.queues.append(q)
        self.queues[name] = q
        if durable and declare:
            self.store.queue_declared(qid, name, queue_attributes(q))
        return q

    def delete_queue(self, q: Queue) -> list[Any]:
        """Remove a queue (its messages are dropped). Returns the consumers that were
        attached, for the protocol layer to detach."""
        if q.deleted:
            return []
        consumers = q.close()
        q.purge()
        if self.pager is not None:
            self.pager.forget(q.qid)
        self.queues.pop(q.name, None)
        self._pending.pop(q, None)
        a = q.address
        if a is not None:
            if q in a.queues:
                a.queues.remove(q)
            if not a.queues and (a.auto_created or q.temporary) and a.producers == 0:
                self.addresses.pop(a.name, None)
        if q.durable:
            self.store.queue_deleted(q.qid)
        return consumers

    # -------------------------------------------------------------- routing
    def route(self, a: Address, e: Entry, *, check_full: bool = True) -> int:
        """Route one arriving message. Raises ResourceLimitExceeded (FAIL policy)
        unless `check_full` is off (a transaction's commit: checked when enlisted), and
        NotFound for an anycast address without queue that may not get one back
        (`anycast_queue`)."""
        if check_full and a.full_policy == "FAIL" and a.full:
            raise ResourceLimitExceeded(
                f"{a.full_reason()} (address_full_policy FAIL): the message was not accepted"
            )
        qs = a.queues
        if len(qs) == 1 and qs[0].filter is None and qs[0].no_local_origin is None:
            self.routed += 1
            q = qs[0]
            q.enqueue(e)
            return ROUTED_SYNC if (q.durable and e.durable) else ROUTED
        if not qs and a.routing == ANYCAST:
            qs = [self.anycast_queue(a)]  # its queue was deleted: back, or NotFound
        self.routed += 1
        sync = False
        first = True
        for q in list(qs):
            if not q.admits(e):
                continue
            x = e if first else e.copy()
            first = False
            q.enqueue(x)
            sync = sync or (q.durable and x.durable)
        if first:
            self.dropped_no_route += 1
            return NO_ROUTE
        return ROUTED_SYNC if sync else ROUTED

    def is_duplicate(self, a: Address, data: bytes) -> bool:
        """Duplicate detection (address setting duplicate_detection_window): True when
        the message's duplicate id (application property _AMQ_DUPL_ID, else the
        message-id) is in the address's window; the caller accepts and drops it.
        Otherwise the id joins the window. A message without either is never one."""
        w = a.dedup
        if w is None:
            return False
        key = self.codec.duplicate_id(data)
        if key is None or not w.seen(key):
            return False
        self.duplicates_dropped += 1
        return True

    def address_for_relay(self, to: str, data: bytes | None = None) -> Address:
        """Anonymous relay: the per-message `to` address. A new address gets the
        routing type the message names (Qpid JMS's `x-opt-jms-dest`: queue or topic)."""
        a = self.addresses.get(to)
        if a is not None:
            return a
        hint = self.codec.destination_routing(data) if data is not None else None
        return self.address_for_producer(to, hint)

    # --------------------------------------------------- QueueHost callbacks
    def schedule_dispatch(self, queue: Queue) -> None:
        self._pending[queue] = None
        if self.wake is not None:
            self.wake()

    def run_deferred(self) -> bool:
        """Continue queues that used up their dispatch batch. True if more is pending."""
        pending = list(self._pending)
        self._pending.clear()
        for q in pending:
            if not q.deleted:
                q.dispatch()
        return bool(self._pending)

    def dead_letter(self, queue: Queue, entry: Entry, reason: str) -> None:
        """QueueHost: `queue` gives `entry` up (see `amqbroker.core.dead_letters`)."""
        self.dead_letters.dead_letter(queue, entry, reason)

    def expired(self, queue: Queue, entry: Entry) -> None:
        """QueueHost: `entry` of `queue` expired (see `amqbroker.core.dead_letters`)."""
        self.dead_letters.expired(queue, entry)

    def queue_idle(self, queue: Queue) -> None:
        """A queue lost its last consumer: delete it if it is a subscription queue, or
        an auto-created, empty queue whose settings say auto-delete."""
        if queue.deleted or queue.consumer_count:
            return
        if queue.subscription:
            self.delete_queue(queue)
            return
        if queue.temporary or not queue.auto_created or queue.count:
            return
        a = queue.address
        if a is not None and a.producers:
            return
        r = a.settings if a is not None and a.settings is not None else self.resolve(queue.name)
        if r.auto_delete_queues:
            self.delete_queue(queue)

    def producer_detached(self, a: Address) -> None:
        a.producers -= 1
        if a.producers == 0:
            for q in list(a.queues):
                self.queue_idle(q)
            if not a.queues and a.auto_created and a.name in self.addresses:
                self.addresses.pop(a.name, None)

    # ----------------------------------------------------------- management
    def create_queue(
        self,
        name: str,
        address: str,
        routing: str,
        *,
        durable: bool,
        options: QueueOptions | None = None,
    ) -> Queue:
        """An operator's queue (management CREATE). On an anycast address it is the
        address's one queue; on a multicast address it gets a copy of every message
        sent there and is a global subscription named like the queue (a JMS shared
        durable subscription of that name consumes from it). The address is created
        when missing."""
        if name in self.queues:
            raise PreconditionFailed(f"queue '{name}' exists already; delete it first")
        a = self.addresses.get(address)
        if a is not None and a.routing != routing:
            raise PreconditionFailed(
                f"address '{address}' exists with routing type {a.routing}; give "
                f"routingType {a.routing} or another address"
            )
        if a is not None and routing == ANYCAST and a.queues:
            raise PreconditionFailed(
                f"anycast address '{address}' already has its queue '{a.queues[0].name}' "
                "(an anycast address holds one queue); use another address"
            )
        if a is None:
            a = self._new_address(address, routing)
        sub = Subscription(name, durable=durable) if routing == MULTICAST else None
        return self._create_queue(name, a, durable=durable, options=options, subscription_of=sub)

    def set_queue_options(self, q: Queue, options: QueueOptions) -> None:
        """Replace a queue's options (management UPDATE, or the options in the address
        string that auto-created it); persisted with a durable queue. A change of
        grouping mode clears its group bindings."""
        q.options = options.model_dump(exclude_none=True)
        q.policy = self._policy(q.address.name if q.address else q.name, options)
        if q.durable:
            self.store.queue_declared(q.qid, q.name, queue_attributes(q))

    def statistics(self) -> dict[str, Any]:
        return {
            "addresses": len(self.addresses),
            "queues": len(self.queues),
            "messages": sum(q.count for q in self.queues.values()),
            "routed": self.routed,
            "dropped_no_route": self.dropped_no_route,
            "dropped_dead_letters": self.dropped_dead_letters,
            "duplicates_dropped": self.duplicates_dropped,
            "pending_dispatch": len(self._pending),
        }


def _check_routing(a: Address, hint: str | None) -> None:
    if hint is not None and hint != a.routing:
        kind = "a queue (anycast)" if a.routing == ANYCAST else "a topic (multicast)"
        raise PreconditionFailed(
            f"address '{a.name}' exists as {kind}; attach with the matching "
            "capability ('queue' or 'topic') or use another address"
        )
