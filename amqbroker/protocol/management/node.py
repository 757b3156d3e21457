"""Request parsing and dispatch of the `$management` node, and its link.

A request names its operation and target in application properties:

- entity operations (`type` = an entity type, full `org.amqbroker.queue` or short
  `queue`; `name` or `identity` = the entity): CREATE (body: attribute map; 201 with
  the entity's attributes), READ (200, attributes), UPDATE (body: changed attributes;
  200, attributes), DELETE (204, empty map body), and the type's custom operations;
- node operations (`type` = `org.amqp.management`, `name` = `self`, or the type
  omitted): QUERY (`entityType`, `offset`, `count` properties; body
  {"attributeNames": [...]}; 200 with {"attributeNames", "results"} and a `count`
  property), GET-TYPES, GET-ATTRIBUTES, GET-OPERATIONS, GET-ANNOTATIONS (each
  optionally narrowed by `entityType`) and GET-MGMT-NODES.

The operation is checked against the type before the entity is looked up, so an
unsupported operation is a 405 whether or not the entity exists. With security on,
every request needs `manage` on `$management` (as the attach does), CREATE needs
`create_address` on a new address and DELETE of a queue or address `delete_address`;
the answer is a send to the request's `reply-to` for the requester, so that takes
`send` there (and `create_address` if it would create it) unless it is a dynamic node
of the requester's own connection: if not, the request is rejected with
amqp:unauthorized-access and no answer is sent.

Extensions: a higher layer registers a handler per request `type`
(`register(type, handler)`, e.g. the cluster's `org.amqbroker.grouping` and
`org.amqbroker.cluster`). A handler gets a plain `ManagementRequest` (no proton object)
and a `respond(status, description, body)` callable it may call later (an answer
that waits for a disk sync or another node); the request transfer itself is accepted
at once. `targets` maps extra link target addresses (`$cluster.inbound`) to a link
handler factory `(connection, link) -> handler`; `sources` does the same for extra
link source addresses a peer receives from (the primary's `$ha.replication`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import proton

from amqbroker.core.broker import Broker
from amqbroker.core.entry import Entry
from amqbroker.core.errors import BrokerError
from amqbroker.protocol import amqp_message
from amqbroker.protocol import fastpath as fp
from amqbroker.protocol.links import ConsumerLink, ProducerLink
from amqbroker.protocol.management.base import (
    BAD_REQUEST,
    CREATED,
    INTERNAL,
    NO_CONTENT,
    NOT_ALLOWED,
    NOT_FOUND,
    OK,
    Context,
    ManagementError,
    Request,
    as_int,
)
from amqbroker.protocol.management.entities import (
    BY_NAME,
    TYPES,
    EntityType,
    core_error,
    lookup_type,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from amqbroker.protocol.connection import AmqpConnection

__all__ = ["ManagementError", "ManagementLink", "ManagementNode"]

log = logging.getLogger(__name__)

NODE_TYPE = "org.amqp.management"
MANAGEMENT_ADDRESS = "$management"
NODE_OPERATIONS = (
    "QUERY",
    "GET-TYPES",
    "GET-ATTRIBUTES",
    "GET-OPERATIONS",
    "GET-ANNOTATIONS",
    "GET-MGMT-NODES",
)
_DESCRIPTIONS = {OK: "OK", CREATED: "Created", NO_CONTENT: "No Content"}


@dataclass
class ManagementRequest:
    """One management request, decoded into plain values for extension handlers."""

    operation: str
    type: str
    name: str
    properties: dict[str, Any]
    body: Any
    message_id: Any
    #: the authenticated user of the requesting connection (None: anonymous)
    user: str | None
    connection_id: str


#: respond(statusCode, statusDescription, body)
Responder = Callable[[int, str, Any], None]
ExtensionHandler = Callable[[ManagementRequest, Responder], None]


class ManagementNode:
    def __init__(
        self,
        broker: Broker,
        *,
        connections: Callable[[], Iterable[Any]] | None = None,
        store_statistics: Callable[[], dict[str, Any]] | None = None,
        ha_status: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.broker = broker
        self.ctx = Context(
            broker,
            connections=connections or (lambda: ()),
            store_statistics=store_statistics,
            started=broker.clock(),
            ha_status=ha_status,
        )
        self.requests = 0
        #: request type -> handler (registered by higher layers, e.g. the cluster)
        self.extensions: dict[str, ExtensionHandler] = {}
        #: extra link target address -> handler factory (conn, link) -> link handler
        self.targets: dict[str, Callable[[AmqpConnection, Any], Any]] = {}
        #: extra link source address -> handler factory (conn, link) -> link handler
        self.sources: dict[str, Callable[[AmqpConnection, Any], Any]] = {}

    def register(self, type_name: str, handler: ExtensionHandler) -> None:
        self.extensions[type_name] = handler

    def attach(self, conn: AmqpConnection, link: Any) -> ManagementLink:
        return ManagementLink(self, conn, link)

    # ---------------------------------------------------------------- requests
    def handle(
        self, request: amqp_message.Message | proton.Message, conn: Any = None
    ) -> proton.Message:
        """Answer one request (never raises: every failure is a status code)."""
        self.requests += 1
        raw: dict[Any, Any] = dict(request.properties or {})
        props: dict[str, Any] = {str(k): v for k, v in raw.items()}
        answer_props: dict[str, Any] = {}
        body: Any = None
        what = f"{props.get('operation')!r} on {props.get('type')!r} {props.get('name')!r}"
        try:
            req = _parse(request, props, conn)
            answer_props = req.answer_props
            self.ctx.authorize(req, "manage", MANAGEMENT_ADDRESS)
            status, body = self._dispatch(req)
            desc = _DESCRIPTIONS.get(status, "OK")
        except ManagementError as exc:
            status, desc, body = exc.status, exc.description, None
        except BrokerError as exc:
            err = core_error(exc)
            status, desc, body = err.status, err.description, None
        except Exception as exc:
            log.exception(
                "%smanagement request %s failed",
                f"{conn.log_prefix()}: " if conn is not None else "",
                what,
            )
            status, body = INTERNAL, None
            desc = (
                f"internal error handling {what}: {type(exc).__name__}: {exc}; the broker "
                "log has the details (please report it)"
            )
        reply = proton.Message(body=body)
        reply.correlation_id = request.id if request.id is not None else request.correlation_id
        reply.properties = {"statusCode": status, "statusDescription": desc, **answer_props}  # type: ignore[assignment]
        return reply

    def _dispatch(self, req: Request) -> tuple[int, Any]:
        op, typ = req.operation, req.type
        if op in NODE_OPERATIONS and (not typ or typ == NODE_TYPE or typ in BY_NAME):
            return self._node_operation(req)
        if not typ:
            raise ManagementError(
                BAD_REQUEST,
                f"{op} needs the application property 'type': an entity type ("
                + ", ".join(TYPES)
                + f"), or {NODE_TYPE} for the node operations ({', '.join(NODE_OPERATIONS)})",
            )
        if typ == NODE_TYPE:
            raise ManagementError(
                NOT_ALLOWED,
                f"{op!r} is not an operation of the management node itself; its "
                f"operations: {', '.join(NODE_OPERATIONS)}",
            )
        t = lookup_type(typ)
        ctx = self.ctx
        if op == "CREATE" and t.create is not None:
            return CREATED, t.attributes_of(ctx, t.create(ctx, req, req.map_body()))
        supported = (
            (op == "READ")
            or (op == "UPDATE" and t.update is not None)
            or (op == "DELETE" and t.delete is not None)
            or op in t.operations
        )
        if not supported:
            ops = [*t.standard_operations(), *t.operations, "QUERY"]
            raise ManagementError(
                NOT_ALLOWED,
                f"operation {op!r} is not supported on {t.name}; supported: {', '.join(ops)}",
            )
        obj = self._find(t, req)
        if op == "READ":
            return OK, t.attributes_of(ctx, obj)
        if op == "UPDATE":
            assert t.update is not None
            t.update(ctx, req, obj, req.map_body())
            return OK, t.attributes_of(ctx, obj)
        if op == "DELETE":
            assert t.delete is not None
            t.delete(ctx, req, obj)
            return NO_CONTENT, {}
        return t.operations[op][1](ctx, req, obj)

    def _find(self, t: EntityType, req: Request) -> Any:
        name = req.name
        if name is None and t is not TYPES["org.amqbroker.broker"]:
            raise ManagementError(
                BAD_REQUEST,
                f"{req.operation} on {t.name} needs the application property 'name' (or "
                f"'identity'): {_IDENTITY_HINT[t.short]}",
            )
        obj = t.find(self.ctx, name or "")
        if obj is None:
            raise ManagementError(
                NOT_FOUND, f"no {t.short} {name!r} ({_IDENTITY_HINT[t.short]}); QUERY lists them"
            )
        return obj

    # ----------------------------------------------------------- node operations
    def _types_asked(self, req: Request) -> list[EntityType]:
        et = req.props.get("entityType")
        if et is None and req.type in BY_NAME:
            et = req.type
        return [lookup_type(et)] if et is not None else list(TYPES.values())

    def _node_operation(self, req: Request) -> tuple[int, Any]:
        op = req.operation
        if op == "GET-MGMT-NODES":
            return OK, []
        types = self._types_asked(req)
        if op == "QUERY":
            return OK, self._query(req, types)
        if op == "GET-TYPES":
            return OK, {t.name: [] for t in types}
        if op == "GET-ATTRIBUTES":
            return OK, {t.name: list(t.attributes) for t in types}
        if op == "GET-ANNOTATIONS":
            return OK, {t.name: [] for t in types}
        # GET-OPERATIONS: type -> {operation: [argument names]}
        out: dict[str, Any] = {}
        for t in types:
            ops: dict[str, list[str]] = {o: [] for o in t.standard_operations()}
            if "DELETE" in ops and t.short in ("queue", "address"):
                ops["DELETE"] = ["force"]
            ops.update({name: list(args) for name, (args, _) in t.operations.items()})
            out[t.name] = ops
        return OK, out

    def _query(self, req: Request, types: list[EntityType]) -> dict[str, Any]:
        body = req.map_body()
        names = body.get("attributeNames") or []
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ManagementError(BAD_REQUEST, "attributeNames must be a list of attribute names")
        if not names:
            seen: dict[str, None] = {}
            for t in types:
                seen.update(dict.fromkeys(t.attributes))
            names = list(seen)
        offset = as_int(req.props.get("offset", 0), "offset")
        count = req.props.get("count")
        rows: list[list[Any]] = []
        for t in types:
            for obj in t.all(self.ctx):
                attrs = t.attributes_of(self.ctx, obj)
                rows.append([attrs.get(n) for n in names])
        rows = rows[offset:]
        if count is not None:
            rows = rows[: as_int(count, "count")]
        req.answer_props["count"] = len(rows)
        return {"attributeNames": names, "results": rows}


_IDENTITY_HINT = {
    "broker": "the broker is 'amqbroker'",
    "address": "an address by its name",
    "queue": "a queue by its name",
    "connection": "a connection by its id, e.g. c12",
    "consumer": "a consumer by <connection id>/<link name>",
    "group": "a group by <queue>/<group id>",
}


def _parse(
    request: amqp_message.Message | proton.Message, props: dict[str, Any], conn: Any
) -> Request:
    op = props.get("operation")
    if not isinstance(op, str) or not op:
        raise ManagementError(
            BAD_REQUEST,
            "the request has no 'operation' application property (READ, QUERY, CREATE, "
            "... or a custom operation such as listGroups)",
        )
    typ = props.get("type")
    name = props.get("identity")
    if name is None:
        name = props.get("name")
    if name == "self" and (typ in (None, NODE_TYPE)):
        name = None
    return Request(
        operation=op,
        type=str(typ) if typ is not None else None,
        name=str(name) if name not in (None, "") else None,
        props=props,
        body=request.body,
        conn=conn,
    )


class ManagementLink:
    """Receives requests on `$management`; answers are routed to their reply-to."""

    __slots__ = ("conn", "link", "node", "ptr")

    def __init__(self, node: ManagementNode, conn: AmqpConnection, link: Any) -> None:
        self.node = node
        self.conn = conn
        self.link = link
        self.ptr = link._impl

    def start(self) -> None:
        fp.flow(self.ptr, 1000)

    def on_flow(self) -> None:
        pass

    def on_delivery(self, d: Any) -> None:
        data = self.conn.rbuf.receive(self.ptr, d)
        if data is None:
            return
        fp.flow(self.ptr, 1)
        try:
            request = amqp_message.decode_any(data)
        except Exception as exc:
            fp.reject(d, "amqp:decode-error", f"malformed management request: {exc}")
            return
        if not request.reply_to:
            fp.reject(
                d,
                "amqp:precondition-failed",
                "management requests need a reply-to address for the answer",
            )
            return
        broker = self.node.broker
        reply_to = request.reply_to
        authz = self.conn.authz
        denial = self._reply_denial(reply_to)
        if denial is not None:
            fp.reject(d, "amqp:unauthorized-access", denial)
            return
        raw: dict[Any, Any] = dict(request.properties or {})
        props: dict[str, Any] = {str(k): v for k, v in raw.items()}
        ext = self.node.extensions.get(str(props.get("type")))
        if ext is not None:
            if authz is not None:
                denial = authz.denial(self.conn.user, "manage", "$management")
                if denial is not None:
                    fp.reject(d, "amqp:unauthorized-access", denial)
                    return
            fp.accept(d)
            self.conn.mark_dirty()
            self._extension(ext, request, props)
            return
        reply = self.node.handle(request, self.conn)
        reply.address = reply_to
        try:
            a = broker.address_for_relay(reply_to)
            broker.route(a, Entry(bytes(reply.encode())))
        except BrokerError as exc:
            fp.reject(d, exc.condition, f"cannot deliver the answer: {exc.description}")
            return
        fp.accept(d)
        self.conn.mark_dirty()

    def _reply_denial(self, reply_to: str) -> str | None:
        """Why the answer may not go to `reply_to` (None: it may). Routing the answer
        sends to that address for the requester: that takes 'send' there (and
        'create_address' when it would create the address), as a producer would,
        unless the address is a dynamic node of the requester's own connection."""
        conn = self.conn
        authz = conn.authz
        if authz is None:
            return None
        broker = self.node.broker
        denial = None
        if reply_to not in broker.addresses and broker.resolve(reply_to).auto_create_addresses:
            denial = authz.denial(conn.user, "create_address", reply_to)
        if denial is None:
            denial = authz.denial(conn.user, "send", reply_to)
        if denial is None or self._own_dynamic_node(reply_to):
            return None
        return f"the answer cannot go to the reply-to address {reply_to!r}: {denial}"

    def _own_dynamic_node(self, address: str) -> bool:
        """`address` is a temporary queue or topic that a link of this connection
        created (asked for as a dynamic node) and that still exists."""
        a = self.node.broker.addresses.get(address)
        if a is None:
            return False
        conn = self.conn
        for h in conn.links.values():
            if isinstance(h, ConsumerLink):
                q = h.queue
                if h.temporary_queue and q is not None and q.address is a:
                    return True
            elif isinstance(h, ProducerLink):
                t = h.temporary_queue
                if t is not None and t.address is a:
                    return True
        return any(t is a for t in conn._temp_topics.values())

    def _extension(self, handler: ExtensionHandler, request: Any, props: dict[str, Any]) -> None:
        self.node.requests += 1
        reply_to = str(request.reply_to)
        corr = request.id if request.id is not None else request.correlation_id
        broker = self.node.broker
        answered = False

        def respond(status: int, description: str, body: Any) -> None:
            nonlocal answered
            if answered:
                return
            answered = True
            props = {"statusCode": status, "statusDescription": description}
            data = amqp_message.encode(
                to=reply_to, correlation_id=corr, properties=props, body=body, proton_fallback=True
            )
            try:
                broker.route(broker.address_for_relay(reply_to), Entry(data))
            except BrokerError as exc:
                log.info("management answer to %s not delivered: %s", reply_to, exc.description)

        req = ManagementRequest(
            operation=str(props.get("operation", "")),
            type=str(props.get("type", "")),
            name=str(props.get("name", "") or ""),
            properties=props,
            body=request.body,
            message_id=request.id,
            user=self.conn.user,
            connection_id=self.conn.conn_id,
        )
        try:
            handler(req, respond)
        except ManagementError as exc:
            respond(exc.status, exc.description, None)
        except Exception:
            log.exception("management extension %s failed", req.type)
            respond(500, "internal error handling the request; see the broker log", None)

    def detach(self, broker: Broker, failed: bool = False) -> None:
        pass
