"""A minimal AMQP management node at `$management` (request/response).

Requests are ordinary AMQP messages sent to `$management` with application properties
`operation`, `type` and `name`, and a `reply-to` address; the answer goes to that
address with `statusCode` / `statusDescription` application properties and
`correlation-id` = the request's message-id (the AMQP Management draft's shape, which
the cluster and the operator CLI will reuse). Requests are rare, so this module uses
the object API (`proton.Message`) freely: it is not on the hot path.

Operations so far (issue: group operations reachable by operators):

| type    | operation        | name   | extra                        | body of the answer        |
|---------|------------------|--------|------------------------------|---------------------------|
| queue   | getGroupCount    | queue  |                              | int                       |
| queue   | listGroups       | queue  |                              | list of maps              |
| queue   | resetGroup       | queue  | `groupId` app. property      | bool (a binding existed)  |
| queue   | resetAllGroups   | queue  |                              | int (bindings removed)    |
| queue   | getStatistics    | queue  |                              | map                       |
| broker  | listQueues       | (any)  |                              | list of maps              |

Extensions: a higher layer registers a handler per request `type`
(`register(type, handler)`, e.g. the cluster's `org.amqbroker.grouping` and
`org.amqbroker.cluster`). A handler gets a plain `ManagementRequest` (no proton object)
and a `respond(status, description, body)` callable it may call later (an answer
that waits for a disk sync or another node); the request transfer itself is accepted
at once. `targets` maps extra link target addresses (`$cluster.inbound`) to a link
handler factory `(connection, link) -> handler`.
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
from amqbroker.core.queue import Queue
from amqbroker.protocol import fastpath as fp

if TYPE_CHECKING:
    from amqbroker.protocol.connection import AmqpConnection

log = logging.getLogger(__name__)


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


class ManagementError(Exception):
    def __init__(self, status: int, description: str) -> None:
        super().__init__(description)
        self.status = status
        self.description = description


class ManagementNode:
    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self._queue_ops: dict[str, Callable[[Queue, proton.Message], Any]] = {
            "getGroupCount": lambda q, m: q.group_count(),
            "listGroups": lambda q, m: q.list_groups(),
            "resetGroup": self._reset_group,
            "resetAllGroups": lambda q, m: q.reset_all_groups(),
            "getStatistics": lambda q, m: q.statistics(),
        }
        self.requests = 0
        #: request type -> handler (registered by higher layers, e.g. the cluster)
        self.extensions: dict[str, ExtensionHandler] = {}
        #: extra link target address -> handler factory (conn, link) -> link handler
        self.targets: dict[str, Callable[[AmqpConnection, Any], Any]] = {}

    def register(self, type_name: str, handler: ExtensionHandler) -> None:
        self.extensions[type_name] = handler

    def attach(self, conn: AmqpConnection, link: Any) -> ManagementLink:
        return ManagementLink(self, conn, link)

    @staticmethod
    def _reset_group(q: Queue, m: proton.Message) -> bool:
        props: dict[str, Any] = dict(m.properties or {})
        gid = props.get("groupId")
        if gid is None and isinstance(m.body, str):
            gid = m.body
        if not isinstance(gid, str):
            raise ManagementError(
                400, "resetGroup needs the group id in the application property 'groupId'"
            )
        return q.reset_group(gid)

    def handle(self, request: proton.Message) -> proton.Message:
        self.requests += 1
        props: dict[str, Any] = dict(request.properties or {})
        op = props.get("operation")
        typ = props.get("type")
        name = props.get("name")
        body: Any
        try:
            if typ == "queue":
                fn = self._queue_ops.get(str(op))
                if fn is None:
                    raise ManagementError(
                        501,
                        f"unknown queue operation {op!r}; known: {', '.join(self._queue_ops)}",
                    )
                q = self.broker.queues.get(str(name))
                if q is None:
                    raise ManagementError(404, f"no queue named {name!r}")
                body = fn(q, request)
            elif typ == "broker" and op == "listQueues":
                body = [
                    {
                        "name": q.name,
                        "address": q.address.name if q.address else q.name,
                        **q.statistics(),
                    }
                    for q in self.broker.queues.values()
                ]
            else:
                raise ManagementError(
                    501, f"unknown management request type={typ!r} operation={op!r}"
                )
            status, desc = 200, "OK"
        except ManagementError as exc:
            status, desc, body = exc.status, exc.description, None
        reply = proton.Message(body=body)
        reply.correlation_id = request.id if request.id is not None else request.correlation_id
        reply.properties = {"statusCode": status, "statusDescription": desc}  # type: ignore[assignment]
        return reply


class ManagementLink:
    """Receives requests on `$management`; answers are routed to their reply-to."""

    __slots__ = ("conn", "link", "node", "ptr")

    def __init__(self, node: ManagementNode, conn: AmqpConnection, link: Any) -> None:
        self.node = node
        self.conn = conn
        self.link = link
        self.ptr = link._impl

    def start(self) -> None:
        fp.flow(self.ptr, 100)

    def on_flow(self) -> None:
        pass

    def on_delivery(self, d: Any) -> None:
        data = self.conn.rbuf.receive(self.ptr, d)
        if data is None:
            return
        fp.flow(self.ptr, 1)
        request = proton.Message()
        try:
            request.decode(data)
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
        props: dict[str, Any] = dict(request.properties or {})
        ext = self.node.extensions.get(str(props.get("type")))
        if ext is not None:
            fp.accept(d)
            self.conn.mark_dirty()
            self._extension(ext, request, props)
            return
        reply = self.node.handle(request)
        reply.address = request.reply_to
        try:
            a = self.node.broker.address_for_relay(request.reply_to)
            self.node.broker.route(a, Entry(bytes(reply.encode())))
        except BrokerError as exc:
            fp.reject(d, exc.condition, f"cannot deliver the answer: {exc.description}")
            return
        fp.accept(d)
        self.conn.mark_dirty()

    def _extension(
        self, handler: ExtensionHandler, request: proton.Message, props: dict[str, Any]
    ) -> None:
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
            reply = proton.Message(body=body)
            reply.address = reply_to
            reply.correlation_id = corr
            reply.properties = {"statusCode": status, "statusDescription": description}  # type: ignore[assignment]
            try:
                broker.route(broker.address_for_relay(reply_to), Entry(bytes(reply.encode())))
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
