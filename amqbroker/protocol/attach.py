"""Link attach and detach: what a client's attach asks for, and the handler that serves it.

`open_link` is called by the connection for every remote attach. It reads the
terminus (address, dynamic, capabilities, filters, durability, distribution mode),
asks the core for the queue or address, builds the handler (`ConsumerLink`,
`BrowserLink`, `ProducerLink`, `CoordinatorLink`, the management node's link or a
registered special target such as the cluster's `$cluster.inbound`), registers it in
the host's `links` map (raw pointer -> handler) and answers the attach. `close_link`
and `detach_handler` undo that: the handler detaches from the core (a consumer's
unsettled messages go back to its queue), a temporary topic the link created is
deleted, and a durable subscription is removed when its link is closed rather than
detached.

Every refusal carries an AMQP condition and a description a person can act on.
Links are refused the way Qpid JMS expects: attach with a null source/target, then
detach with the error.

Authorisation (`host.authorize`, when security is enabled): each attach of a named
link is checked once against `core.authz` (consumer: consume; browser: browse;
producer: send; plus create_address when the attach would auto-create the address;
unsubscribe: consume on the topic; `$management`: manage). Dynamic nodes are the
client's own and are not checked; the anonymous relay checks each destination
(links.py). A denial refuses the attach with amqp:unauthorized-access, logged once.

The functions take the connection as an `AttachHost` (a `LinkHost` with its link map,
its management node and its temporary topics), so this module does not import
connection.py.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import proton
from proton import Condition, Link, Terminus, symbol

from amqbroker.core.address import ANYCAST, MULTICAST
from amqbroker.core.broker import Subscription
from amqbroker.core.errors import (
    BrokerError,
    InvalidField,
    NotFound,
    NotImplementedFeature,
    PreconditionFailed,
    ResourceLimitExceeded,
)
from amqbroker.core.selector import SelectorError
from amqbroker.protocol.browser import BrowserLink
from amqbroker.protocol.coordinator import LOCAL_TRANSACTIONS, CoordinatorLink
from amqbroker.protocol.host import LinkHost, authorize
from amqbroker.protocol.links import ConsumerLink, ProducerLink

log = logging.getLogger(__name__)

MANAGEMENT_ADDRESS = "$management"


class AttachHost(LinkHost, Protocol):
    """The connection as attach and detach see it."""

    #: the open links: raw link pointer -> handler
    links: dict[Any, Any]
    #: the `$management` node (None: none), with its registered special `targets`
    management: Any
    #: temporary topics created by a link of this connection (deleted with it)
    _temp_topics: dict[Any, Any]


def _link_kind(h: Any) -> str:
    """What a link handler is, for a log line."""
    if isinstance(h, BrowserLink):
        return "browser"
    if isinstance(h, ConsumerLink):
        return "consumer"
    if isinstance(h, ProducerLink):
        return "producer" if h.address is not None else "producer (anonymous relay)"
    if isinstance(h, CoordinatorLink):
        return "transaction coordinator"
    return "management"


_ROUTING_CAPS = {
    "queue": ANYCAST,
    "temporary-queue": ANYCAST,
    "topic": MULTICAST,
    "temporary-topic": MULTICAST,
}


def _first_object(data: Any) -> Any:
    """The value held by a terminus field (proton.Data), or None when it is empty."""
    if data is None:
        return None
    data.rewind()
    return data.get_object() if data.next() else None


def _symbols(data: Any) -> set[str]:
    """The symbols in a terminus capabilities field (array, list or single)."""
    obj = _first_object(data)
    if obj is None:
        return set()
    if isinstance(obj, str):
        return {str(obj)}
    try:
        return {str(x) for x in obj}
    except TypeError:
        return set()


#: filter descriptors (Apache's registered filter types, what Qpid JMS sends)
SELECTOR_CODE = 0x0000468C00000004
NO_LOCAL_CODE = 0x0000468C00000003
_SELECTOR_NAMES = {"apache.org:selector-filter:string", "jms-selector"}
_NO_LOCAL_NAMES = {"apache.org:no-local-filter:list", "no-local"}


@dataclass(frozen=True)
class SourceFilters:
    selector: str | None = None
    no_local: bool = False


def _source_filters(data: Any) -> SourceFilters:
    """The filters of a source's filter set that the broker applies (a JMS selector
    and no-local); any other filter is refused rather than silently ignored."""
    obj = _first_object(data)
    if obj is None:
        return SourceFilters()
    if not isinstance(obj, dict):
        raise InvalidField("the source's filter set is not a map; send a map of filters")
    selector: str | None = None
    no_local = False
    for key, value in obj.items():
        desc = getattr(value, "descriptor", None)
        inner = getattr(value, "value", value)
        kind = str(desc) if isinstance(desc, str) else desc
        if (
            kind == SELECTOR_CODE
            or kind in _SELECTOR_NAMES
            or (desc is None and str(key) == "jms-selector")
        ):
            if not isinstance(inner, str):
                raise InvalidField(
                    f"selector filter {str(key)!r} must hold a string, not {type(inner).__name__}"
                )
            selector = inner.strip() or None
        elif kind == NO_LOCAL_CODE or kind in _NO_LOCAL_NAMES:
            no_local = True
        else:
            raise NotImplementedFeature(
                f"message filter {str(key)!r} (descriptor {desc!r}) is not supported; "
                "this broker applies JMS selectors (apache.org:selector-filter:string) "
                "and no-local (apache.org:no-local-filter:list)"
            )
    return SourceFilters(selector, no_local)


def _refuse_link(conn: AttachHost, link: Any, err: BrokerError) -> None:
    wanted = link.remote_source.address if link.is_sender else link.remote_target.address
    log.info(
        "%s: refused %s attach: %s %s",
        conn.log_prefix(link.name, address=wanted),
        "consumer" if link.is_sender else "producer",
        err.condition,
        err.description,
    )
    # attach with a null source/target, then detach with the error (Qpid JMS
    # turns this into InvalidDestinationException)
    if link.is_sender:
        link.target.copy(link.remote_target)
        link.source.type = Terminus.UNSPECIFIED
    else:
        link.source.copy(link.remote_source)
        link.target.type = Terminus.UNSPECIFIED
    link.open()
    link.condition = Condition(err.condition, err.description)
    link.close()
    conn.mark_dirty()


def open_link(conn: AttachHost, link: Any) -> None:
    try:
        if len(conn.links) >= conn.limits.max_links:
            raise ResourceLimitExceeded(
                f"too many links on this connection (max_links_per_connection="
                f"{conn.limits.max_links}); close links you no longer use"
            )
        if link.is_sender:
            _attach_consumer(conn, link)
        else:
            _attach_producer(conn, link)
    except BrokerError as err:
        _refuse_link(conn, link, err)
    else:
        h = conn.links.get(link._impl)
        if h is not None and log.isEnabledFor(logging.DEBUG):
            log.debug("%s: %s attached", link_prefix(conn, h), _link_kind(h))
    conn.mark_dirty()


def _attach_consumer(conn: AttachHost, link: Any) -> None:
    src = link.remote_source
    filters = _source_filters(src.filter)
    caps = _symbols(src.capabilities)
    hint = next((_ROUTING_CAPS[c] for c in caps if c in _ROUTING_CAPS), None)
    broker = conn.broker
    temporary = False
    address = src.address
    if not src.dynamic and not address:
        _attach_unsubscribe(conn, link)
        return
    if conn.management is not None and address in getattr(conn.management, "sources", {}):
        # registered special sources (the primary's `$ha.replication`)
        h = conn.management.sources[address](conn, link)
        conn.links[h.ptr] = h
        link.source.copy(src)
        link.target.copy(link.remote_target)
        link.snd_settle_mode = Link.SND_UNSETTLED
        link.rcv_settle_mode = Link.RCV_FIRST
        link.open()
        h.start()
        return
    if address == MANAGEMENT_ADDRESS:
        raise NotFound(
            "'$management' takes requests: attach a sender to it and receive the "
            "replies on a dynamic or named reply address"
        )
    container = conn.remote_container or ""
    if src.dynamic:
        if "temporary-topic" in caps:
            a = broker.create_temporary_topic()
            conn._temp_topics[link._impl] = a
            q = broker.queue_for_consumer(a.name, MULTICAST, subscription=link.name)
        else:
            q = broker.create_temporary_queue()
            temporary = True
    elif src.distribution_mode == Terminus.DIST_MODE_COPY and (
        hint != MULTICAST and "shared" not in caps
    ):
        _attach_browser(conn, link, address, hint, filters)
        return
    elif (
        "shared" in caps
        or src.durability != Terminus.NONDURABLE
        or src.expiry_policy == Terminus.EXPIRE_NEVER
    ) and (hint == MULTICAST or "shared" in caps or broker.is_topic(address)):
        shared = "shared" in caps
        name = link.name.partition("|")[0] if shared else link.name
        authorize(conn, "consume", address)
        sub = Subscription(
            name,
            container="" if (shared and "global" in caps) else container,
            durable=src.durability != Terminus.NONDURABLE
            or src.expiry_policy == Terminus.EXPIRE_NEVER,
            shared=shared,
            selector=filters.selector,
            no_local=filters.no_local,
        )
        old = broker.queues.get(sub.queue_name)
        if old is not None and old.address is not None:
            # re-subscribing on another topic removes the old subscription
            authorize(conn, "consume", old.address.name, create=False)
        q = _guard_selector(lambda: broker.subscription_queue(address, sub, origin=conn.conn_id))
        if not shared and q.consumer_count:
            raise PreconditionFailed(
                f"durable subscription '{name}' already has an active consumer; JMS "
                "allows one per non-shared subscription (use a shared subscription "
                "for several)"
            )
    else:
        authorize(conn, "consume", address)
        q = broker.queue_for_consumer(address, hint, subscription=link.name)
    consumer_filter = None
    if q.address is not None and q.address.routing == MULTICAST:
        if q.subscription and q.subscription_name is None:
            # this consumer's own subscription queue: filter at routing time
            _guard_selector(
                lambda: broker.filter_subscription(
                    q, filters.selector, filters.no_local, origin=conn.conn_id
                )
            )
    elif filters.selector or filters.no_local:
        consumer_filter = _consumer_filter(conn, filters)
    priority = 0
    props = link.remote_properties
    if props:
        p = props.get(symbol("priority"))
        if isinstance(p, int):
            priority = int(p)
    presettled = link.remote_snd_settle_mode == Link.SND_SETTLED
    # the source is answered as the client sent it (address options included:
    # clients such as python-qpid-proton's BlockingConnection check the echo);
    # only a dynamic node gets the name the broker gave it
    link.source.copy(src)
    if src.dynamic:
        link.source.address = q.address.name if q.address is not None else q.name
    link.target.copy(link.remote_target)
    link.snd_settle_mode = Link.SND_SETTLED if presettled else Link.SND_UNSETTLED
    link.rcv_settle_mode = Link.RCV_FIRST
    h = ConsumerLink(
        conn, link, priority=priority, presettled=presettled, temporary_queue=temporary
    )
    h.filter = consumer_filter
    conn.links[h.ptr] = h
    link.open()
    q.add_consumer(h)


def _guard_selector(make: Callable[[], Any]) -> Any:
    try:
        return make()
    except SelectorError as exc:
        raise InvalidField(f"invalid JMS selector: {exc}") from exc


def _consumer_filter(conn: AttachHost, filters: SourceFilters) -> Callable[[Any], bool]:
    """A queue consumer's filter: its selector, and no-local (skip messages this
    connection sent)."""
    sel = None
    if filters.selector:
        sel = _guard_selector(lambda: conn.broker.codec.selector_filter(filters.selector or ""))
    if not filters.no_local:
        assert sel is not None
        return sel  # type: ignore[no-any-return]
    me = conn.conn_id
    if sel is None:
        return lambda e: e.origin != me
    match = sel
    return lambda e: e.origin != me and match(e)


def _attach_browser(
    conn: AttachHost, link: Any, address: str, hint: str | None, filters: SourceFilters
) -> None:
    """A queue browser (source distribution-mode copy): sees the queue's messages
    in order, as they are when it attaches, without consuming them."""
    authorize(conn, "browse", address)
    q = conn.broker.queue_for_consumer(address, hint)
    match = _consumer_filter(conn, filters) if filters.selector or filters.no_local else None
    link.source.copy(link.remote_source)
    link.target.copy(link.remote_target)
    link.snd_settle_mode = Link.SND_SETTLED
    h = BrowserLink(conn, link, q, match)
    conn.links[h.ptr] = h
    link.open()


def _attach_unsubscribe(conn: AttachHost, link: Any) -> None:
    """An attach with no source address names an existing subscription by its link
    name (Qpid JMS unsubscribes this way: attach, then close the link)."""
    q = conn.broker.find_subscription(link.name, conn.remote_container or "")
    if q is None:
        raise NotFound(
            f"no subscription named {link.name!r} (a consumer must name a source "
            "address, ask for a dynamic node, or name an existing subscription)"
        )
    if q.consumer_count:
        raise PreconditionFailed(
            f"subscription {q.subscription_name!r} has active consumers; close them "
            "before unsubscribing"
        )
    # closing this link removes the subscription: that takes 'consume' on its topic
    authorize(conn, "consume", q.address.name if q.address is not None else q.name, create=False)
    src = link.source
    src.address = q.address.name if q.address is not None else q.name
    src.durability = Terminus.DELIVERIES if q.durable else Terminus.NONDURABLE
    src.expiry_policy = Terminus.EXPIRE_NEVER if q.durable else Terminus.EXPIRE_WITH_LINK
    src.distribution_mode = Terminus.DIST_MODE_COPY
    src.capabilities.put_array(False, proton.Data.SYMBOL)
    src.capabilities.enter()
    src.capabilities.put_symbol("topic")
    src.capabilities.exit()
    link.target.copy(link.remote_target)
    h = ConsumerLink(conn, link, priority=0, presettled=False, temporary_queue=False)
    conn.links[h.ptr] = h
    link.open()
    q.add_consumer(h)


def _attach_producer(conn: AttachHost, link: Any) -> None:
    tgt = link.remote_target
    broker = conn.broker
    if tgt.type == Terminus.COORDINATOR:
        _attach_coordinator(conn, link)
        return
    temp = None
    address = None
    if tgt.dynamic and "temporary-topic" in _symbols(tgt.capabilities):
        address = broker.create_temporary_topic()
        conn._temp_topics[link._impl] = address
        name = address.name
    elif tgt.dynamic:
        temp = broker.create_temporary_queue()
        address = temp.address
        name = temp.name
    elif tgt.address is None:
        name = None  # anonymous relay
    elif tgt.address == MANAGEMENT_ADDRESS and conn.management is not None:
        _attach_management(conn, link)
        return
    elif conn.management is not None and tgt.address in getattr(conn.management, "targets", {}):
        # registered special targets (the cluster's `$cluster.inbound`)
        h = conn.management.targets[tgt.address](conn, link)
        conn.links[h.ptr] = h
        link.target.copy(tgt)
        link.source.copy(link.remote_source)
        link.rcv_settle_mode = Link.RCV_FIRST
        link.snd_settle_mode = link.remote_snd_settle_mode
        link.open()
        h.start()
        return
    else:
        caps = _symbols(tgt.capabilities)
        hint = next((_ROUTING_CAPS[c] for c in caps if c in _ROUTING_CAPS), None)
        authorize(conn, "send", tgt.address)
        address = broker.address_for_producer(tgt.address, hint)
        name = tgt.address
    link.target.copy(tgt)
    if name is not None:
        link.target.address = name
    link.source.copy(link.remote_source)
    link.rcv_settle_mode = Link.RCV_FIRST
    link.snd_settle_mode = link.remote_snd_settle_mode
    link.max_message_size = conn.limits.max_message_size
    h = ProducerLink(
        conn,
        link,
        address,
        window=conn.limits.link_credit,
        max_size=conn.limits.max_message_size,
        temporary_queue=temp,
    )
    if address is not None:
        address.producers += 1
    conn.links[h.ptr] = h
    link.open()
    h.start()


def _attach_coordinator(conn: AttachHost, link: Any) -> None:
    caps = _symbols(link.remote_target.capabilities)
    if caps and LOCAL_TRANSACTIONS not in caps:
        raise NotImplementedFeature(
            f"this broker supports local transactions only ({LOCAL_TRANSACTIONS}); "
            f"the coordinator asked for {', '.join(sorted(caps))}"
        )
    link.target.copy(link.remote_target)
    link.source.copy(link.remote_source)
    link.rcv_settle_mode = Link.RCV_FIRST
    link.snd_settle_mode = link.remote_snd_settle_mode
    h = CoordinatorLink(conn, link)
    conn.links[h.ptr] = h
    link.open()
    h.start()


def _attach_management(conn: AttachHost, link: Any) -> None:
    # refused at attach (and every request is checked again by the node)
    authorize(conn, "manage", MANAGEMENT_ADDRESS, create=False)
    h = conn.management.attach(conn, link)
    conn.links[h.ptr] = h
    link.target.copy(link.remote_target)
    link.source.copy(link.remote_source)
    link.open()
    h.start()


def close_link(conn: AttachHost, link: Any, closed: bool) -> None:
    ptr = link._impl
    h = conn.links.get(ptr)
    if h is not None:
        q = h.queue if isinstance(h, ConsumerLink) else None
        where = link_prefix(conn, h)
        detach_handler(conn, ptr, h)
        log.debug("%s: %s by the client", where, "closed" if closed else "detached")
        if (
            closed
            and q is not None
            and q.durable
            and q.subscription_name is not None
            and not q.deleted
            and not q.consumer_count
        ):
            # detach keeps a durable subscription, close removes it (unsubscribe)
            log.info("%s: durable subscription removed (link closed)", where)
            conn.broker.delete_queue(q)
    if closed:
        link.close()
    else:
        link.detach()
    link.free()
    conn.mark_dirty()


def detach_handler(conn: AttachHost, ptr: Any, h: Any, failed: bool = False) -> None:
    del conn.links[ptr]
    h.detach(conn.broker, failed)
    a = conn._temp_topics.pop(ptr, None)
    if a is not None:
        _drop_temporary_topic(conn, a)


def _drop_temporary_topic(conn: AttachHost, a: Any) -> None:
    for c in conn.broker.delete_address(a):
        if isinstance(c, ConsumerLink) and c.conn is not conn:
            c.conn.detach_link(c, "amqp:resource-deleted", "the temporary topic was deleted")
        elif isinstance(c, ConsumerLink):
            conn.detach_link(c, "amqp:resource-deleted", "the temporary topic was deleted")


def link_prefix(conn: AttachHost, h: Any) -> str:
    q = getattr(h, "queue", None)
    a = getattr(h, "address", None)
    return conn.log_prefix(
        h.link.name,
        queue=q.name if q is not None else None,
        address=a.name if a is not None else None,
    )
