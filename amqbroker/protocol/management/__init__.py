"""The `$management` node: AMQP Management (OASIS working draft) over request/response.

Theory of operation
-------------------
A request is an ordinary AMQP message sent on a link attached to `$management`, with
application properties `operation`, `type` and `name` or `identity` (and any
operation arguments), and a `reply-to` address. The answer is routed to that address
like any message (a dynamic receiver's temporary queue, usually) with application
properties `statusCode` / `statusDescription` and `correlation-id` = the request's
message-id (its correlation-id when it has no message-id). Requests are rare, so
this package uses Proton's object API (`proton.Message`) freely: it is not on the hot
path, and the core does the work (`Queue.take_waiting`, `DeadLetters.move_messages`...).

Modules:

- `entities`: the table of entity types (`org.amqbroker.broker`, `.address`,
  `.queue`, `.connection`, `.consumer`, `.group`): per type its attributes (READ and
  QUERY), how an identity finds an entity, and CREATE / UPDATE / DELETE when the type
  has them;
- `queue_ops`: the queue's custom operations (purge, pause, resume, resetAllGroups,
  resetGroup, listGroups, moveMessages, retryMessages, and the older getGroupCount /
  getStatistics);
- `node`: request parsing, the node operations (QUERY, GET-TYPES, GET-ATTRIBUTES,
  GET-OPERATIONS, GET-ANNOTATIONS, GET-MGMT-NODES), status codes, the link.

Status codes: 200 OK, 201 created, 204 deleted; 400 a missing or invalid property or
attribute (the description says which), 401/403 not allowed (security on and the
user lacks `manage`, or `create_address` / `delete_address` on the address), 404 no
such entity or type (named), 405 the operation is not supported on that type (the
supported ones are listed), 409 a conflict (exists, has consumers), 500 an internal
error (logged with its traceback).

Invariants: every request gets exactly one answer when it has a reply-to (a request
without one is rejected); an answer never carries a partial change: an operation
validates its arguments before it changes anything.
"""

from amqbroker.protocol.management.node import (
    ExtensionHandler,
    ManagementError,
    ManagementLink,
    ManagementNode,
    ManagementRequest,
    Responder,
)

__all__ = [
    "ExtensionHandler",
    "ManagementError",
    "ManagementLink",
    "ManagementNode",
    "ManagementRequest",
    "Responder",
]
