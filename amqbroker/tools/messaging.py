"""`amqbroker producer | consumer | browser`: send, take or look at messages.

Theory of operation
-------------------
One `BlockingConnection` (`tools.management_client.connect`, so connection errors
read the same as the management commands') and one link:

- `send`: a sender on the address; up to `window` unsettled deliveries, each
  settled on the broker's outcome (accepted counts as sent; rejected / released /
  modified are counted apart, with the first reason). Bodies are text with ``{n}``
  replaced by the message's index (0-based); `group` sets the group-id and
  `group_seq` the first group-sequence (incremented per message);
- `receive`: a receiver with `credit` (at most `count`), accepting each message, until
  `count` messages arrived or none came for `idle_timeout` seconds; `browse=True`
  attaches with distribution-mode copy (a queue browser: messages are shown and stay
  in the queue; the broker sends them settled). A group filter is the JMS selector
  ``JMSXGroupID = '<group>'`` (ANDed with a given selector).

Every message handed to the caller is a plain dict (`describe`) so the CLI can print
it as text or JSON without knowing Proton.

Invariants: nothing is left unsettled when a function returns (the connection is
closed, so the broker releases whatever a failed run had not settled); `on_progress`
gets the running count after every message.
"""

from __future__ import annotations

import base64
import json
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, cast

from proton import ConnectionException, Delivery, Message, Timeout
from proton.reactor import Copy, Selector
from proton.utils import BlockingConnection, LinkDetached

from amqbroker.tools.management_client import ConnectError, connect

CONTAINER = "amqbroker-cli"
DEFAULT_WINDOW = 100


class MessagingError(Exception):
    """The broker refused the link or a message; the text says why and what to do."""


@dataclass(frozen=True)
class Connection:
    url: str
    user: str | None = None
    password: str | None = None
    timeout: float = 10.0


@dataclass(frozen=True)
class SendSpec:
    address: str
    count: int = 1
    text: str = "message {n}"
    group: str | None = None
    group_seq: int | None = None
    properties: Mapping[str, Any] = field(default_factory=dict)
    durable: bool = False
    ttl_ms: int | None = None
    window: int = DEFAULT_WINDOW


@dataclass
class SendResult:
    accepted: int = 0
    refused: int = 0
    first_refusal: str | None = None


def parse_properties(text: str | None) -> dict[str, Any]:
    """`--properties` JSON: an object of names to strings, numbers, booleans or null."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"--properties is not valid JSON ({exc.msg} at column {exc.colno}); "
            'expected an object, e.g. \'{"region": "eu", "priority": 3}\''
        ) from None
    if not isinstance(value, dict):
        raise ValueError("--properties must be a JSON object of names to values")
    bad = [k for k, v in value.items() if isinstance(v, dict | list)]
    if bad:
        raise ValueError(
            f"--properties: {', '.join(bad)} must be a string, number, boolean or null "
            "(application properties are simple values)"
        )
    return value


def _link_error(exc: BaseException, what: str) -> MessagingError:
    text = str(exc)
    return MessagingError(f"the broker refused {what}: {text}")


@contextmanager
def _session(conn_args: Connection, what: str) -> Iterator[BlockingConnection]:
    """A connection for one command, closed at the end; a link the broker detaches
    becomes MessagingError ("the broker refused `what`"), a lost connection
    ConnectError."""
    conn = connect(
        conn_args.url,
        user=conn_args.user,
        password=conn_args.password,
        timeout=conn_args.timeout,
        container=CONTAINER,
    )
    try:
        yield conn
    except LinkDetached as exc:
        raise _link_error(exc, what) from None
    except ConnectionException as exc:
        raise ConnectError(conn_args.url, f"the connection was lost: {exc}") from None
    finally:
        conn.close()


def send(
    conn_args: Connection,
    spec: SendSpec,
    on_progress: Callable[[int], None] | None = None,
) -> SendResult:
    result = SendResult()
    try:
        with _session(conn_args, f"messages to {spec.address!r}") as conn:
            try:
                sender = conn.create_sender(spec.address)
            except LinkDetached as exc:
                raise _link_error(exc, f"a sender on {spec.address!r}") from None
            link = sender.link
            pending: deque[Delivery] = deque()

            def settle_head() -> None:
                d = pending.popleft()
                if d.remote_state == Delivery.ACCEPTED:
                    result.accepted += 1
                else:
                    result.refused += 1
                    if result.first_refusal is None:
                        cond = getattr(d.remote, "condition", None)
                        why = f": {cond.description}" if cond is not None else ""
                        result.first_refusal = f"{_outcome(d.remote_state)}{why}"
                d.settle()
                if on_progress is not None:
                    on_progress(result.accepted + result.refused)

            def wait_head() -> None:
                conn.wait(
                    lambda: pending[0].settled,
                    timeout=conn_args.timeout,
                    msg=f"the broker's outcome for message {result.accepted + result.refused}",
                )
                settle_head()

            for i in range(spec.count):
                fields: dict[str, Any] = {}
                if spec.group is not None:
                    fields["group_id"] = spec.group
                if spec.group_seq is not None:
                    fields["group_sequence"] = spec.group_seq + i
                if spec.properties:
                    fields["properties"] = dict(spec.properties)
                if spec.ttl_ms is not None:
                    fields["ttl"] = spec.ttl_ms / 1000
                msg = Message(body=spec.text.replace("{n}", str(i)), durable=spec.durable, **fields)
                pending.append(cast(Delivery, link.send(msg)))
                while len(pending) >= spec.window:
                    wait_head()
            while pending:
                wait_head()
    except Timeout as exc:
        raise MessagingError(f"{exc}; the broker may be blocked (address full?)") from None
    return result


def _outcome(state: Any) -> str:
    return {
        Delivery.REJECTED: "rejected",
        Delivery.RELEASED: "released",
        Delivery.MODIFIED: "modified",
    }.get(state, f"outcome {state}")


def receive(
    conn_args: Connection,
    address: str,
    *,
    count: int | None,
    idle_timeout: float,
    selector: str | None = None,
    group: str | None = None,
    browse: bool = False,
    credit: int = 100,
    on_message: Callable[[dict[str, Any]], None] | None = None,
) -> int:
    """Take (or, with `browse`, look at) messages; returns how many arrived."""
    parts = [f"({selector})"] if selector else []
    if group is not None:
        parts.append("JMSXGroupID = '" + group.replace("'", "''") + "'")
    options: list[Any] = []
    if parts:
        options.append(Selector(" AND ".join(parts)))
    if browse:
        options.append(Copy())
    n = 0
    with _session(conn_args, f"the link on {address!r}") as conn:
        try:
            rcv = conn.create_receiver(
                address, credit=min(credit, count or credit), options=options or None
            )
        except LinkDetached as exc:
            what = "a browser" if browse else "a consumer"
            raise _link_error(exc, f"{what} on {address!r}") from None
        while count is None or n < count:
            try:
                msg = rcv.receive(timeout=idle_timeout)
            except Timeout:
                break
            if not browse:
                rcv.accept()
            n += 1
            if on_message is not None:
                on_message(describe(msg))
    return n


def describe(msg: Message) -> dict[str, Any]:
    """A message as a JSON-friendly dict (binary bodies as base64)."""
    body = msg.body
    if isinstance(body, memoryview | bytes | bytearray):
        raw = bytes(body)
        try:
            body = raw.decode("utf-8")
        except UnicodeDecodeError:
            body = {"base64": base64.b64encode(raw).decode()}
    out: dict[str, Any] = {
        "id": _plain(msg.id),
        "body": _plain(body),
        "group": msg.group_id,
        "groupSeq": msg.group_sequence if msg.group_id is not None else None,
        "durable": msg.durable,
        "properties": {str(k): _plain(v) for k, v in _items(msg.properties)},
    }
    if msg.delivery_count:
        out["deliveryCount"] = msg.delivery_count
    return out


def _plain(v: Any) -> Any:
    if v is None or isinstance(v, str | int | float | bool):
        return v if not isinstance(v, str) else str(v)
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_plain(x) for x in v]
    return str(v)


def _items(d: Any) -> list[tuple[Any, Any]]:
    return list(dict(d or {}).items())
