"""The entity types of the `$management` node, as a table.

Each `EntityType` says which attributes READ and QUERY report (`read` builds them,
`attributes` lists them in order), how an identity finds one entity (`find`), how to
list them all (`all`), and, when the type has them, CREATE / UPDATE / DELETE and its
custom operations (`queue_ops` for queues). Identities: a queue or address by its
name, a connection by its id (`c12`), a consumer by `<connection id>/<link name>`, a
group by `<queue>/<group id>` (the longest queue name that exists wins, so names may
contain '/'). Every entity also has the draft's `name`, `identity` and `type`.

Times are milliseconds: ages and durations as numbers of ms, instants (`boundSince`,
`attachedAt`) as epoch milliseconds.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from amqbroker import __version__
from amqbroker.core.address import ANYCAST, MULTICAST, Address
from amqbroker.core.address_settings import QueueOptions, parse_address_options
from amqbroker.core.errors import BrokerError
from amqbroker.core.queue import Queue
from amqbroker.core.queue_settings import OPTIONS, SETTINGS_BY_NAME
from amqbroker.protocol.links import ConsumerLink
from amqbroker.protocol.management.base import (
    BAD_REQUEST,
    CONFLICT,
    NOT_FOUND,
    OK,
    Context,
    ManagementError,
    Operation,
    Request,
    as_bool,
    ms,
)
from amqbroker.protocol.management.queue_ops import QUEUE_OPERATIONS, group_attributes

log = logging.getLogger(__name__)

PREFIX = "org.amqbroker."


@dataclass(frozen=True)
class EntityType:
    short: str
    attributes: tuple[str, ...]
    all: Callable[[Context], Iterable[Any]]
    find: Callable[[Context, str], Any]
    identity: Callable[[Any], str]
    read: Callable[[Context, Any], dict[str, Any]]
    create: Callable[[Context, Request, dict[str, Any]], Any] | None = None
    update: Callable[[Context, Request, Any, dict[str, Any]], None] | None = None
    delete: Callable[[Context, Request, Any], None] | None = None
    #: custom operations: name -> (argument names, function)
    operations: Mapping[str, tuple[tuple[str, ...], Operation]] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return PREFIX + self.short

    def standard_operations(self) -> list[str]:
        ops = ["READ"]
        if self.create is not None:
            ops.insert(0, "CREATE")
        if self.update is not None:
            ops.append("UPDATE")
        if self.delete is not None:
            ops.append("DELETE")
        return ops

    def attributes_of(self, ctx: Context, obj: Any) -> dict[str, Any]:
        ident = self.identity(obj)
        return {"name": ident, "identity": ident, "type": self.name, **self.read(ctx, obj)}


_COMMON = ("name", "identity", "type")


def _force(req: Request) -> bool:
    return as_bool(req.arg("force", False), "force")


def _detach(consumers: Iterable[Any], why: str) -> None:
    for c in consumers:
        if isinstance(c, ConsumerLink):
            c.conn.detach_link(c, "amqp:resource-deleted", why)


# ------------------------------------------------------------------------ broker
def _broker_read(ctx: Context, _: Any) -> dict[str, Any]:
    b = ctx.broker
    st = b.statistics()
    out: dict[str, Any] = {
        "version": __version__,
        "uptime": ms(b.clock() - ctx.started),
        "connections": sum(1 for _ in ctx.connections()),
        "addresses": st["addresses"],
        "queues": st["queues"],
        "messages": st["messages"],
        "routed": st["routed"],
        "droppedNoRoute": st["dropped_no_route"],
        "droppedDeadLetters": st["dropped_dead_letters"],
        "memoryUsed": b.budget.used,
        "memoryLimit": b.budget.limit,
        "storeSize": None,
        "storeSyncLatency": None,
        "storeMaxSyncLatency": None,
    }
    if ctx.store_statistics is not None:
        js = ctx.store_statistics()
        out["storeSize"] = js.get("bytes")
        out["storeSyncLatency"] = js.get("last_sync_ms")
        out["storeMaxSyncLatency"] = js.get("max_sync_ms")
    out["ha"] = ctx.ha_status() if ctx.ha_status is not None else None
    return out


def _ha_status(ctx: Context) -> dict[str, Any]:
    """`haStatus`: the pair's state as this broker sees it (`amqbroker.ha.status`);
    {"role": ""} on a broker without HA."""
    return ctx.ha_status() if ctx.ha_status is not None else {"role": ""}


BROKER_NAME = "amqbroker"

BROKER = EntityType(
    "broker",
    (
        *_COMMON,
        "version",
        "uptime",
        "connections",
        "addresses",
        "queues",
        "messages",
        "routed",
        "droppedNoRoute",
        "droppedDeadLetters",
        "memoryUsed",
        "memoryLimit",
        "storeSize",
        "storeSyncLatency",
        "storeMaxSyncLatency",
        "ha",
    ),
    all=lambda ctx: (ctx.broker,),
    find=lambda ctx, name: ctx.broker if name in ("", BROKER_NAME, "self") else None,
    identity=lambda _: BROKER_NAME,
    read=_broker_read,
    operations={
        "listQueues": ((), lambda ctx, req, _: (OK, _list_queues(ctx))),
        "haStatus": ((), lambda ctx, req, _: (OK, _ha_status(ctx))),
    },
)


def _list_queues(ctx: Context) -> list[dict[str, Any]]:
    """The older `listQueues` (kept for scripts): name, address and statistics."""
    return [
        {"name": q.name, "address": q.address.name if q.address else q.name, **q.statistics()}
        for q in ctx.broker.queues.values()
    ]


# ----------------------------------------------------------------------- address
def _routing(value: Any, what: str = "routingType") -> str:
    r = str(value).lower() if value is not None else ""
    if r not in (ANYCAST, MULTICAST):
        raise ManagementError(BAD_REQUEST, f"{what} must be ANYCAST or MULTICAST, not {value!r}")
    return r  # the core's spelling (lower case); shown upper case


def _address_read(ctx: Context, a: Address) -> dict[str, Any]:
    return {
        "routingType": a.routing.upper(),
        "autoCreated": a.auto_created,
        "queueNames": [q.name for q in a.queues],
        "queueCount": len(a.queues),
        "producerCount": a.producers,
        "messageCount": sum(q.count for q in a.queues),
        "addressSize": a.size,
        "maxSizeBytes": a.max_size,
        "addressFullPolicy": a.full_policy,
        "full": a.full,
    }


def _address_create(ctx: Context, req: Request, body: dict[str, Any]) -> Address:
    name = _required_name(req, body)
    routing = _routing(body.get("routingType", ANYCAST))
    _only(body, {"name", "identity", "type", "routingType", "durable"}, "CREATE address")
    ctx.authorize(req, "create_address", name)
    if name in ctx.broker.addresses:
        raise ManagementError(CONFLICT, f"address '{name}' exists already")
    durable = as_bool(body.get("durable", True), "durable")
    return ctx.broker.create_address(name, routing, durable=durable)


def _address_delete(ctx: Context, req: Request, a: Address) -> None:
    ctx.authorize(req, "delete_address", a.name)
    busy = [q.name for q in a.queues if q.consumer_count]
    if busy and not _force(req):
        raise ManagementError(
            CONFLICT,
            f"address '{a.name}' has consumers on queue(s) {', '.join(busy)}; close them "
            "first or delete with force=true (their links are detached)",
        )
    _detach(ctx.broker.delete_address(a), f"address '{a.name}' was deleted by an operator")


ADDRESS = EntityType(
    "address",
    (
        *_COMMON,
        "routingType",
        "autoCreated",
        "queueNames",
        "queueCount",
        "producerCount",
        "messageCount",
        "addressSize",
        "maxSizeBytes",
        "addressFullPolicy",
        "full",
    ),
    all=lambda ctx: list(ctx.broker.addresses.values()),
    find=lambda ctx, name: ctx.broker.addresses.get(name),
    identity=lambda a: a.name,
    read=_address_read,
    create=_address_create,
    delete=_address_delete,
)


# ------------------------------------------------------------------------- queue
#: queue attribute (camelCase) -> QueueOptions field, from the table of queue settings
#: (`amqbroker.core.queue_settings`); also accepted as the address-string keys
#: (group-buckets) and snake_case
QUEUE_OPTIONS = {s.attribute: s.name for s in OPTIONS if s.attribute}
_OPTION_FIELD = {
    **{k.lower(): v for k, v in QUEUE_OPTIONS.items()},
    **{s.option: s.name for s in OPTIONS if s.option},
    **{v: v for v in QUEUE_OPTIONS.values()},
}


def _options_in(body: dict[str, Any], base: dict[str, Any]) -> tuple[QueueOptions, set[str]]:
    """Queue options given in `body` over `base` (a queue's current options), checked
    by the address-string parser (same rules, same messages). Returns the options and
    the body keys used."""
    values = dict(base)
    used: set[str] = set()
    for key, value in body.items():
        f = _OPTION_FIELD.get(key.lower()) or _OPTION_FIELD.get(key)
        if f is None:
            continue
        used.add(key)
        if value is None:
            values.pop(f, None)
        else:
            values[f] = value
    query = "&".join(
        f"{SETTINGS_BY_NAME[f].option}={str(v).lower() if isinstance(v, bool) else v}"
        for f, v in values.items()
    )
    try:
        _, options = parse_address_options(f"q?{query}" if query else "q")
    except ValueError as exc:
        raise ManagementError(BAD_REQUEST, str(exc).replace("address 'q?", "options '")) from None
    return options, used


def _queue_read(ctx: Context, q: Queue) -> dict[str, Any]:
    p = q.policy
    a = q.address
    oldest = q.oldest_waiting_seq()
    arrived = q.arrival_time(oldest) if oldest is not None else None
    return {
        "address": a.name if a is not None else q.name,
        "routingType": (a.routing if a is not None else ANYCAST).upper(),
        "durable": q.durable,
        "temporary": q.temporary,
        "autoCreated": q.auto_created,
        "paused": q.paused,
        "messageCount": q.count,
        "persistentSize": q.bytes,
        "messagesAdded": q.enqueued,
        "messagesAcknowledged": q.acked,
        "deliveringCount": q.inflight,
        "scheduledCount": q.scheduled,
        "messagesExpired": q.expired_count,
        "messagesKilled": q.dead_lettered,
        "consumerCount": q.consumer_count,
        "groupCount": q.group_count(),
        **{attribute: getattr(p, name) for attribute, name in QUEUE_OPTIONS.items()},
        "dispatching": q.dispatching,
        "firstMessageAge": ms(ctx.broker.clock() - arrived) if arrived is not None else None,
        "stuckGroups": q.statistics()["stuck_groups"],
        "stuckMessages": q.stuck_messages,
        "subscription": q.subscription_name,
        "filter": q.selector,
    }


_QUEUE_CREATE_KEYS = {"name", "identity", "type", "address", "routingType", "durable"}


def _queue_create(ctx: Context, req: Request, body: dict[str, Any]) -> Queue:
    name = _required_name(req, body)
    address = str(body.get("address") or name)
    b = ctx.broker
    existing = b.addresses.get(address)
    default_routing = existing.routing if existing is not None else ANYCAST
    routing = _routing(body.get("routingType", default_routing))
    durable = as_bool(body.get("durable", True), "durable")
    options, used = _options_in(body, {})
    _only(body, _QUEUE_CREATE_KEYS | used, "CREATE queue")
    if name in b.queues:
        raise ManagementError(CONFLICT, f"queue '{name}' exists already")
    if existing is None:
        ctx.authorize(req, "create_address", address)
    return b.create_queue(name, address, routing, durable=durable, options=options)


def _queue_update(ctx: Context, req: Request, q: Queue, body: dict[str, Any]) -> None:
    options, used = _options_in(body, q.options)
    paused = as_bool(body["paused"], "paused") if "paused" in body else None
    _only(body, {"name", "identity", "type", "paused"} | used, "UPDATE queue")
    if used:
        ctx.broker.set_queue_options(q, options)
    if paused is True:
        q.admin_pause()
    elif paused is False:
        q.admin_resume()


def _queue_delete(ctx: Context, req: Request, q: Queue) -> None:
    a = q.address
    ctx.authorize(req, "delete_address", a.name if a is not None else q.name)
    if q.consumer_count and not _force(req):
        raise ManagementError(
            CONFLICT,
            f"queue '{q.name}' has {q.consumer_count} consumer(s); close them first or "
            "delete with force=true (their links are detached)",
        )
    b = ctx.broker
    _detach(b.delete_queue(q), f"queue '{q.name}' was deleted by an operator")
    if a is not None and a.routing == ANYCAST and not a.queues and not a.producers:
        b.addresses.pop(a.name, None)  # an anycast address is its queue


def _queue_type() -> EntityType:
    return EntityType(
        "queue",
        (
            *_COMMON,
            "address",
            "routingType",
            "durable",
            "temporary",
            "autoCreated",
            "paused",
            "messageCount",
            "persistentSize",
            "messagesAdded",
            "messagesAcknowledged",
            "deliveringCount",
            "scheduledCount",
            "messagesExpired",
            "messagesKilled",
            "consumerCount",
            "groupCount",
            *QUEUE_OPTIONS,
            "dispatching",
            "firstMessageAge",
            "stuckGroups",
            "stuckMessages",
            "subscription",
            "filter",
        ),
        all=lambda ctx: list(ctx.broker.queues.values()),
        find=lambda ctx, name: ctx.broker.queues.get(name),
        identity=lambda q: q.name,
        read=_queue_read,
        create=_queue_create,
        update=_queue_update,
        delete=_queue_delete,
        operations=QUEUE_OPERATIONS,
    )


QUEUE = _queue_type()


# -------------------------------------------------------------------- connection
def _consumers_of(conn: Any) -> list[ConsumerLink]:
    return [h for h in conn.links.values() if isinstance(h, ConsumerLink)]


def _connection_read(ctx: Context, conn: Any) -> dict[str, Any]:
    consumers = _consumers_of(conn)
    return {
        "remoteAddress": conn.peer,
        "container": conn.remote_container,
        "user": conn.user,
        "sessions": conn.open_sessions,
        "links": conn.open_links,
        "consumers": len(consumers),
        "producers": conn.open_links - len(consumers),
    }


def _connection_delete(ctx: Context, req: Request, conn: Any) -> None:
    conn.close(
        "amqp:connection:forced",
        "the connection was closed by an operator through the management node",
    )


CONNECTION = EntityType(
    "connection",
    (*_COMMON, "remoteAddress", "container", "user", "sessions", "links", "consumers", "producers"),
    all=lambda ctx: list(ctx.connections()),
    find=lambda ctx, name: next((c for c in ctx.connections() if c.conn_id == name), None),
    identity=lambda c: c.conn_id,
    read=_connection_read,
    delete=_connection_delete,
)


# ---------------------------------------------------------------------- consumer
def _all_consumers(ctx: Context) -> list[ConsumerLink]:
    return [c for conn in ctx.connections() for c in _consumers_of(conn)]


def _find_consumer(ctx: Context, ident: str) -> ConsumerLink | None:
    conn_id, sep, link = ident.partition("/")
    if not sep:
        return None
    for conn in ctx.connections():
        if conn.conn_id == conn_id:
            return next((c for c in _consumers_of(conn) if c.name == link), None)
    return None


def _consumer_read(ctx: Context, c: ConsumerLink) -> dict[str, Any]:
    q = c.queue
    return {
        "connection": c.connection_id,
        "container": c.container_id,
        "linkName": c.name,
        "queue": q.name if q is not None else None,
        "address": q.address.name if q is not None and q.address is not None else None,
        "priority": c.priority,
        "credit": c.credit,
        "inFlight": c.inflight,
        "settled": c.settled,
        "groups": len(c.bound),
        "presettled": c.presettled,
        "blocked": c.blocked,
        "slow": c.slow,
        "attachedAt": ms(c.attached_at),
    }


def _consumer_delete(ctx: Context, req: Request, c: ConsumerLink) -> None:
    c.conn.detach_link(
        c, "amqp:resource-deleted", "the consumer was detached by an operator (management)"
    )


CONSUMER = EntityType(
    "consumer",
    (
        *_COMMON,
        "connection",
        "container",
        "linkName",
        "queue",
        "address",
        "priority",
        "credit",
        "inFlight",
        "settled",
        "groups",
        "presettled",
        "blocked",
        "slow",
        "attachedAt",
    ),
    all=_all_consumers,
    find=_find_consumer,
    identity=lambda c: f"{c.connection_id}/{c.name}",
    read=_consumer_read,
    delete=_consumer_delete,
)


# ------------------------------------------------------------------------- group
@dataclass
class GroupRef:
    queue: Queue
    row: dict[str, Any]


def _all_groups(ctx: Context) -> list[GroupRef]:
    return [GroupRef(q, r) for q in list(ctx.broker.queues.values()) for r in q.group_details()]


def split_group_identity(ctx: Context, ident: str) -> tuple[Queue, str] | None:
    """`<queue>/<group id>`: the longest existing queue name before a '/' wins."""
    cut = len(ident)
    while True:
        cut = ident.rfind("/", 0, cut)
        if cut < 0:
            return None
        q = ctx.broker.queues.get(ident[:cut])
        if q is not None:
            return q, ident[cut + 1 :]


def _find_group(ctx: Context, ident: str) -> GroupRef | None:
    found = split_group_identity(ctx, ident)
    if found is None:
        return None
    q, gid = found
    return next((GroupRef(q, r) for r in q.group_details() if r["group"] == gid), None)


def _group_read(ctx: Context, g: GroupRef) -> dict[str, Any]:
    return {"queue": g.queue.name, **group_attributes(ctx.broker.clock(), g.row)}


def _group_delete(ctx: Context, req: Request, g: GroupRef) -> None:
    g.queue.reset_group(g.row["group"])


GROUP = EntityType(
    "group",
    (
        *_COMMON,
        "queue",
        "group",
        "consumer",
        "connection",
        "container",
        "backlog",
        "inFlight",
        "oldestMessageAge",
        "sinceLastSettle",
        "bucket",
        "boundSince",
        "blocked",
        "stuck",
    ),
    all=_all_groups,
    find=_find_group,
    identity=lambda g: f"{g.queue.name}/{g.row['group']}",
    read=_group_read,
    delete=_group_delete,
)


# ------------------------------------------------------------------------- table
TYPES: dict[str, EntityType] = {
    t.name: t for t in (BROKER, ADDRESS, QUEUE, CONNECTION, CONSUMER, GROUP)
}
#: full and short names
BY_NAME: dict[str, EntityType] = {**TYPES, **{t.short: t for t in TYPES.values()}}


def lookup_type(name: Any) -> EntityType:
    t = BY_NAME.get(str(name)) if name is not None else None
    if t is None:
        raise ManagementError(
            NOT_FOUND,
            f"no entity type {name!r}; known types: {', '.join(TYPES)} (or their short "
            "names: " + ", ".join(t.short for t in TYPES.values()) + ")",
        )
    return t


# ----------------------------------------------------------------------- helpers
def _required_name(req: Request, body: dict[str, Any]) -> str:
    name = req.name or body.get("name")
    if not isinstance(name, str) or not name:
        raise ManagementError(
            BAD_REQUEST,
            f"{req.operation} needs the entity's name: the application property 'name' "
            "(or 'name' in the body)",
        )
    if "?" in name or "/" in name:
        raise ManagementError(BAD_REQUEST, f"name {name!r} may not contain '?' or '/'")
    return name


def _only(body: dict[str, Any], allowed: set[str], what: str) -> None:
    extra = sorted(set(body) - allowed)
    if extra:
        raise ManagementError(
            BAD_REQUEST,
            f"{what}: attribute(s) {', '.join(extra)} cannot be set here; settable: "
            + ", ".join(sorted(allowed - {"name", "identity", "type"})),
        )


def core_error(exc: BrokerError) -> ManagementError:
    """A core error as a status: not-found 404, conflicts 409, the rest 400."""
    status = {
        "amqp:not-found": NOT_FOUND,
        "amqp:precondition-failed": CONFLICT,
        "amqp:resource-locked": CONFLICT,
    }.get(exc.condition, BAD_REQUEST)
    return ManagementError(status, exc.description)
