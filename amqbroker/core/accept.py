"""Accepting an arriving message: the broker's policy between a producer and its queues.

The protocol layer translates: it reads a transfer, scans the routing fields, finds the
destination address (the link's, or each message's `to` on an anonymous relay) and
builds the `Entry` (times from `message_expiry` and `delivery_time`, called only when
the message carries them). The core decides, here, in one synchronous
call per message (`accept`), what becomes of it:

1. duplicate detection (address setting duplicate_detection_window): a duplicate is
   answered `accepted` and dropped (DUPLICATE); a transaction's sends are checked when
   it commits (`core.transaction`), not here;
2. the delivery log's `received` record (the target address in `queue`), held and
   folded with the queue's records when one queue named as the address takes the
   message at once (`amqbroker.core.delivery_log`);
3. a transactional send is held by its transaction (ENLIST: the caller enlists it, as
   only the protocol layer can read the txn-id off the transfer); an anycast address
   whose queue an operator deleted gets it back first, or NotFound; with a router, a
   grouped one may first wait for its group's decision (PENDING, then `done(ENLIST)`),
   and the router routes it at commit (`core.transaction`);
4. the broker's router hook (clustered routing), unless the producer's messages were
   routed already (cluster bridges: no `done` given): it routes, or decides later
   (PENDING: it calls `done` once with the result or a BrokerError);
5. otherwise `Broker.route`: one plain queue takes it at once (Broker.route's fast
   path, taken inline); the FAIL policy raises ResourceLimitExceeded; an anycast
   address without its queue gets it back or raises NotFound.

Outcomes are `Broker.route`'s results (ROUTED, ROUTED_SYNC: settle once the store has
synced, NO_ROUTE: accepted and dropped), PENDING, DUPLICATE and ENLIST. A refusal is a
BrokerError carrying its AMQP condition; the caller rejects the transfer with it.

Times: `message_expiry` is the one place the expiry arithmetic lives (header ttl
relative to arrival, properties.absolute-expiry-time; the earlier wins), and
`delivery_time` the JMS delivery delay's. Time is the broker's injected clock, in epoch
milliseconds.

Invariant: no task switch and no copy of the message bytes on this path; the common
case (no dedup, no log, no router, one plain queue) costs the link one call and a few
attribute tests.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from amqbroker.core.address import ANYCAST
from amqbroker.core.broker import NO_ROUTE, PENDING, ROUTED, ROUTED_SYNC
from amqbroker.core.delivery_log import RECEIVED, RECEIVED_ROUTED
from amqbroker.core.entry import Entry
from amqbroker.core.errors import BrokerError

if TYPE_CHECKING:
    from amqbroker.core.address import Address
    from amqbroker.core.broker import Broker
    from amqbroker.core.delivery_log import DeliveryLog
    from amqbroker.core.queue import Queue

__all__ = [
    "DUPLICATE",
    "ENLIST",
    "NO_ROUTE",
    "PENDING",
    "ROUTED",
    "ROUTED_SYNC",
    "accept",
    "delivery_time",
    "message_expiry",
]

#: accept() outcomes beyond Broker.route's (ROUTED 0, ROUTED_SYNC 1, NO_ROUTE 2) and
#: the router's PENDING 3; everything below PENDING is "routed now"
DUPLICATE = 4  # dropped by duplicate detection: answer accepted
ENLIST = 5  # a transactional send: the caller hands it to its transaction

#: the router's completion: a route() result, or the BrokerError that refuses the message
Done = Callable[[int | BrokerError], None]


def message_expiry(clock: Callable[[], float], ttl: int, absolute: int) -> int:
    """Absolute expiry in epoch ms (0 = never) of a message arriving now: header `ttl`
    (ms) counted from arrival, or properties.absolute-expiry-time when that is earlier."""
    expiry = int(clock() * 1000) + ttl if ttl else 0
    if absolute and (not expiry or absolute < expiry):
        expiry = absolute
    return expiry


def delivery_time(clock: Callable[[], float], at: int, delay: int) -> int:
    """When a message arriving now may be delivered (epoch ms) under JMS delivery delay:
    the relative x-opt-delivery-delay (ms) wins over the absolute x-opt-delivery-time."""
    return int(clock() * 1000) + delay if delay > 0 else at


def accept(
    broker: Broker,
    a: Address,
    e: Entry,
    data: bytes,
    transactional: bool = False,
    done: Done | None = None,
) -> int:
    """Accept message `e` (bytes `data` as received) sent to address `a`: see the module
    docstring for the steps and outcomes. `done`: the completion for a routing decision
    the broker's router hook makes later; None when the router is not to be asked (no
    router, or the message was routed already). Raises BrokerError to refuse."""
    if a.dedup is not None and not transactional and broker.is_duplicate(a, data):
        return DUPLICATE
    dlog = broker.dlog
    if dlog is not None and (transactional or (done is not None and broker.router is not None)):
        dlog.event(RECEIVED, a.name, e)
        dlog = None  # recorded: not held below
    if transactional:
        if not a.queues and a.routing == ANYCAST:
            broker.anycast_queue(a)  # its queue was deleted: back, or NotFound
        if done is not None and e.group_id is not None:
            router = broker.router
            if router is not None:  # its group is decided before it is enlisted
                res = router.prepare(a, e, done)
                if res is not None:
                    return res
        return ENLIST
    if done is not None:
        router = broker.router
        if router is not None:
            res = router.route(a, e, done)
            if res is not None:
                return res
    qs = a.queues
    if (
        len(qs) == 1
        and qs[0].filter is None
        and qs[0].no_local_origin is None
        and not (a.full_policy == "FAIL" and a.full)
    ):
        # Broker.route's single-queue case, taken here so that the common message
        # costs one call from the link, not two (measured: about 2 % of the broker's
        # CPU per message); everything else is Broker.route's
        q = qs[0]
        if dlog is None:
            q.enqueue(e)
        else:
            _enqueue_logged(dlog, a, q, e)
        broker.routed += 1
        return ROUTED_SYNC if q.durable and e.durable else ROUTED
    if dlog is not None:
        dlog.event(RECEIVED, a.name, e)
    return broker.route(a, e)


def _enqueue_logged(dlog: DeliveryLog, a: Address, q: Queue, e: Entry) -> None:
    """`q.enqueue(e)` with the delivery log on: the ``received`` record is held and
    folded with ``routed`` (and ``dispatched``) into one record when `q` is named as
    its address and does not page the message out (see `amqbroker.core.delivery_log`)."""
    if q.name != a.name or (
        q.pager is not None and (q.paged_count or (q.address is not None and q.address.full))
    ):
        dlog.event(RECEIVED, a.name, e)
        q.enqueue(e)
        return
    dlog.held = e
    dlog.held_queue = a.name
    try:
        q.enqueue(e)
    finally:
        if dlog.held is e:  # not dispatched on the way, nor recorded by another event
            dlog.held = None
            dlog.event(RECEIVED_ROUTED, a.name, e)
