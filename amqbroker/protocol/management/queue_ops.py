"""A queue's custom management operations (type queue, name = the queue).

| operation        | arguments (body map or application properties) | answer body          |
|------------------|------------------------------------------------|----------------------|
| purge            |                                                | {"removed": n}       |
| pause / resume   |                                                | {"paused": bool}     |
| resetAllGroups   |                                                | {"reset": n}         |
| resetGroup       | group (or the older groupId)                   | {"reset": 0 or 1}    |
| listGroups       | top N, orderBy "backlog" or "age" (optional)   | {"groups": [...]}    |
| moveMessages     | toQueue, filter (a JMS selector, optional)     | {"moved": n}         |
| retryMessages    |                                                | {"retried": n}       |
| getGroupCount    | (older name, kept for scripts)                 | int                  |
| getStatistics    | (older name, kept for scripts)                 | map                  |

resetGroup on a bucketed queue resets the group's whole bucket (a bucket can also be
named by its key `_AMQ_GROUP_BUCKET_INT_KEY_<n>`). moveMessages and retryMessages take
the waiting messages (not those in flight, delayed or paged out).
"""

from __future__ import annotations

from typing import Any

import proton

from amqbroker.core.queue import Queue
from amqbroker.core.selector import SelectorError
from amqbroker.protocol.management.base import (
    BAD_REQUEST,
    NOT_FOUND,
    OK,
    Context,
    ManagementError,
    Operation,
    Request,
    as_int,
    ms,
)

ORIG_ADDRESS = "x-opt-ORIG-ADDRESS"


def group_attributes(now: float, r: dict[str, Any]) -> dict[str, Any]:
    """A `Queue.group_details` row as management shows it (listGroups, group READ)."""
    arrived = r["oldest_arrival"]
    return {
        "group": r["group"],
        "consumer": r["consumer"],
        "connection": r["connection"],
        "container": r["container"],
        "backlog": r["backlog"],
        "inFlight": r["in_flight"],
        "oldestMessageAge": ms(now - arrived) if arrived is not None else None,
        "sinceLastSettle": ms(now - r["settled_at"]),
        "bucket": r["bucket"],
        "boundSince": ms(r["bound_since"]),
        "blocked": r["blocked"],
        "stuck": r["stuck"],
    }


def _purge(ctx: Context, req: Request, q: Queue) -> tuple[int, Any]:
    return OK, {"removed": q.purge()}


def _pause(ctx: Context, req: Request, q: Queue) -> tuple[int, Any]:
    q.admin_pause()
    return OK, {"paused": q.paused}


def _resume(ctx: Context, req: Request, q: Queue) -> tuple[int, Any]:
    q.admin_resume()
    return OK, {"paused": q.paused}


def _reset_all(ctx: Context, req: Request, q: Queue) -> tuple[int, Any]:
    return OK, {"reset": q.reset_all_groups()}


def _group_arg(req: Request) -> str:
    gid = req.arg("group")
    if gid is None:
        gid = req.arg("groupId")
    if gid is None and isinstance(req.body, str):
        gid = req.body
    if not isinstance(gid, str) or not gid:
        raise ManagementError(
            BAD_REQUEST,
            "resetGroup needs the group id: the application property 'group' (or "
            "'group' in a map body)",
        )
    return gid


def _reset_group(ctx: Context, req: Request, q: Queue) -> tuple[int, Any]:
    return OK, {"reset": int(q.reset_group(_group_arg(req)))}


def _list_groups(ctx: Context, req: Request, q: Queue) -> tuple[int, Any]:
    top = req.arg("top")
    order = req.arg("orderBy")
    if order is not None and order not in ("backlog", "age"):
        raise ManagementError(BAD_REQUEST, f"orderBy must be 'backlog' or 'age', not {order!r}")
    n = as_int(top, "top") if top is not None else None
    now = ctx.broker.clock()
    rows = [group_attributes(now, r) for r in q.group_details()]
    if order == "backlog":
        rows.sort(key=lambda r: -r["backlog"])
    elif order == "age":
        rows.sort(key=lambda r: -(r["oldestMessageAge"] or -1))
    if n is not None:
        rows = rows[:n]
    return OK, {"groups": rows}


def _move(ctx: Context, req: Request, q: Queue) -> tuple[int, Any]:
    to = req.arg("toQueue")
    if not isinstance(to, str) or not to:
        raise ManagementError(
            BAD_REQUEST, "moveMessages needs 'toQueue': the name of the queue to move to"
        )
    dst = ctx.broker.queues.get(to)
    if dst is None:
        raise ManagementError(NOT_FOUND, f"no queue named '{to}' to move messages to")
    if dst is q:
        raise ManagementError(BAD_REQUEST, f"cannot move messages of queue '{q.name}' to itself")
    selector = req.arg("filter")
    match = None
    if selector is not None:
        if not isinstance(selector, str):
            raise ManagementError(BAD_REQUEST, "filter must be a JMS selector string")
        try:
            match = ctx.broker.codec.selector_filter(selector)
        except SelectorError as exc:
            raise ManagementError(BAD_REQUEST, f"bad filter {selector!r}: {exc}") from None
    return OK, {"moved": ctx.broker.dead_letters.move_messages(q, dst, match)}


def original_address(data: bytes) -> str | None:
    """The x-opt-ORIG-ADDRESS annotation a dead letter carries (None if absent)."""
    m = proton.Message()
    try:
        m.decode(data)
    except Exception:
        return None
    annotations: dict[Any, Any] = dict(m.annotations or {})
    value = annotations.get(ORIG_ADDRESS)
    return str(value) if value is not None else None


def _retry(ctx: Context, req: Request, q: Queue) -> tuple[int, Any]:
    return OK, {"retried": ctx.broker.dead_letters.retry_messages(q, original_address)}


QUEUE_OPERATIONS: dict[str, tuple[tuple[str, ...], Operation]] = {
    "purge": ((), _purge),
    "pause": ((), _pause),
    "resume": ((), _resume),
    "resetAllGroups": ((), _reset_all),
    "resetGroup": (("group",), _reset_group),
    "listGroups": (("top", "orderBy"), _list_groups),
    "moveMessages": (("toQueue", "filter"), _move),
    "retryMessages": ((), _retry),
    "getGroupCount": ((), lambda ctx, req, q: (OK, q.group_count())),
    "getStatistics": ((), lambda ctx, req, q: (OK, q.statistics())),
}
