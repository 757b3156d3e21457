"""What every management module shares: the error with its status code (the one
`ManagementError`, defined in `amqbroker.protocol.errors` and re-exported here), the
parsed request, and the node's context (the broker, the live connections, the store)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from amqbroker.core.authz import ANONYMOUS_USER
from amqbroker.core.broker import Broker
from amqbroker.core.errors import Unauthorized
from amqbroker.protocol.errors import ManagementError

OK, CREATED, NO_CONTENT = 200, 201, 204
BAD_REQUEST, UNAUTHORIZED, FORBIDDEN, NOT_FOUND = 400, 401, 403, 404
NOT_ALLOWED, CONFLICT, INTERNAL = 405, 409, 500

__all__ = ["ManagementError"]  # re-exported: defined in amqbroker.protocol.errors

_TRUE = frozenset({"true", "1", "yes"})
_FALSE = frozenset({"false", "0", "no"})


@dataclass
class Request:
    operation: str
    #: the type as sent (None when absent)
    type: str | None
    #: `identity`, else `name` (None when neither)
    name: str | None
    props: dict[str, Any]
    body: Any
    #: the requesting connection (None in unit use)
    conn: Any = None
    answer_props: dict[str, Any] = field(default_factory=dict)

    def arg(self, key: str, default: Any = None) -> Any:
        """An operation argument: from the body map, else the application properties."""
        body = self.body
        if isinstance(body, dict) and key in body:
            return body[key]
        return self.props.get(key, default)

    def map_body(self) -> dict[str, Any]:
        body = self.body
        if body is None:
            return {}
        if not isinstance(body, dict):
            raise ManagementError(
                BAD_REQUEST,
                f"{self.operation} takes a map in the body (an AMQP value section holding "
                f"a map of attribute names to values), not {type(body).__name__}",
            )
        return {str(k): v for k, v in body.items()}


def as_bool(value: Any, what: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
        return value.lower() in _TRUE
    raise ManagementError(BAD_REQUEST, f"{what} must be true or false, not {value!r}")


def as_int(value: Any, what: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ManagementError(BAD_REQUEST, f"{what} must be a whole number, not {value!r}")
    try:
        n = int(value)
    except ValueError:
        raise ManagementError(
            BAD_REQUEST, f"{what} must be a whole number, not {value!r}"
        ) from None
    if n < minimum:
        raise ManagementError(BAD_REQUEST, f"{what} must be >= {minimum}, not {n}")
    return n


Operation = Callable[["Context", "Request", Any], tuple[int, Any]]


def ms(seconds: float) -> int:
    return round(seconds * 1000)


@dataclass
class Context:
    """What the node knows about the broker around it."""

    broker: Broker
    #: the live connections (AmqpConnection objects)
    connections: Callable[[], Iterable[Any]] = lambda: ()
    #: the journal's statistics, when there is a journal
    store_statistics: Callable[[], dict[str, Any]] | None = None
    #: broker clock at start (uptime)
    started: float = 0.0
    #: the HA report (`amqbroker.ha.status.report`) of a pair member; None without HA
    ha_status: Callable[[], dict[str, Any]] | None = None

    def authorize(self, req: Request, permission: str, address: str) -> None:
        """403 (401 for an anonymous user) unless the requester holds `permission`."""
        conn = req.conn
        authz = getattr(conn, "authz", None)
        if authz is None:
            return
        try:
            authz.check(conn.user, permission, address)
        except Unauthorized as exc:
            anonymous = conn.user in (None, ANONYMOUS_USER)
            raise ManagementError(
                UNAUTHORIZED if anonymous else FORBIDDEN, exc.description
            ) from None
