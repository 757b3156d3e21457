"""The operator's side of the `$management` node: a small blocking client for the CLI.

Theory of operation
-------------------
It runs in the CLI process (never inside the broker's event loop), so Proton's
`BlockingConnection` is fine here. The connection (`connect`) is Proton's own for
plain ``amqp://`` with PLAIN or ANONYMOUS; ``amqps://`` (CA file, client certificate,
SASL EXTERNAL) and SCRAM-SHA-256 are set up by `client_auth` (TLS by `ssl`, SASL by
hand) and handed to Proton authenticated. Those options come from a `ClientSecurity`,
given or the context's (`use_security`, set by the CLI for each command).

`ManagementClient` opens one connection with one
sender to `$management` and one dynamic receiver (the broker gives it a temporary
queue, whose address is every request's reply-to), then sends requests one at a time:
a request is a message with application properties `operation`, `type`, `name` and the
operation's arguments (the AMQP Management draft; see `amqbroker.protocol.management`),
and its answer is the next message on the receiver with the same correlation-id.

Errors come in two kinds, and the CLI maps them to exit codes:

- `ConnectError` (exit 2): the broker could not be reached or refused the login; its
  text says where, why, and what to do ("is the broker running? (amqbroker run)");
- `RequestFailed` (exit 1): the broker answered with a status other than 2xx, or
  refused the management link (security: the user lacks `manage`); it carries the
  operation, the status code and the broker's description. It is a
  `amqbroker.protocol.errors.ManagementError`, the error the node raises to answer.

Besides the transport, the module holds the few pure helpers the CLI needs to turn
answers into what it prints (QUERY rows as dicts, `check` thresholds), so that the CLI
itself only parses options, calls and prints.

Invariants: a request gets exactly one answer (matched by correlation-id; a stray
answer is skipped) or raises; the connection is closed on `close()` / leaving the
`with` block whatever happened.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from proton import ConnectionException, Message, ProtonException, Timeout, Url
from proton.reactor import Container
from proton.utils import BlockingConnection, LinkDetached

from amqbroker.protocol.client_auth import (
    AdoptingIOHandler,
    ClientAuthError,
    ClientSecurity,
    open_authenticated,
)
from amqbroker.protocol.errors import ManagementError
from amqbroker.protocol.sasl import SCRAM_SHA_256

DEFAULT_URL = "amqp://127.0.0.1:5672"
DEFAULT_TIMEOUT = 10.0
NODE_TYPE = "org.amqp.management"
TYPE_PREFIX = "org.amqbroker."


class ManagementRequestError(Exception):
    """Base of the errors of this module (kept under its older name)."""


class ConnectError(ManagementRequestError):
    """The broker could not be reached, or refused the connection or the login."""

    def __init__(self, url: str, reason: str, hint: str | None = None) -> None:
        self.url = url
        self.reason = reason
        self.hint = hint or "is the broker running? (amqbroker run)"
        super().__init__(f"cannot connect to {url}: {reason}; {self.hint}")


class RequestFailed(ManagementRequestError, ManagementError):
    """The broker answered a request with a status other than 2xx (None: no answer,
    or a statusCode that is not a number)."""

    #: wider than the node's: a client may get no answer, or a malformed one
    status: int | None  # type: ignore[assignment]

    def __init__(self, operation: str, status: int | None, description: str) -> None:
        code = status if status is not None else "no status"
        Exception.__init__(self, f"{operation} failed ({code}): {description}")
        self.operation = operation
        self.status = status
        self.description = description


def _condition_text(exc: BaseException) -> str:
    """The reason inside a Proton exception, without its wrapping."""
    text = str(exc)
    for cond_start in ("Condition('", 'Condition("'):
        i = text.find(cond_start)
        if i >= 0:
            inner = text[i + len(cond_start) :]
            name, _, rest = inner.partition("', '")
            desc = rest.rstrip("')\"") if rest else ""
            return f"{desc} ({name})" if desc else name
    return text or type(exc).__name__


#: the TLS files and mechanism of every connection made in this context that names
#: none itself: the CLI sets it once per command (`use_security`), so the client tools
#: (`amqbroker.tools.messaging`) honour --ca-file, --mechanism... without passing them
_SECURITY: ContextVar[ClientSecurity] = ContextVar("amqbroker_client_security")


def use_security(security: ClientSecurity) -> None:
    """The default `ClientSecurity` of `connect` in the current context."""
    _SECURITY.set(security)


def current_security() -> ClientSecurity:
    return _SECURITY.get(ClientSecurity())


def connect(
    url: str,
    *,
    user: str | None = None,
    password: str | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    container: str | None = None,
    security: ClientSecurity | None = None,
) -> BlockingConnection:
    """A `BlockingConnection`, authenticated with `security.choose_mechanism(user)`
    (PLAIN when `user` is given, EXTERNAL with a client certificate, ANONYMOUS
    otherwise); raises `ConnectError` with a reason a person can act on.

    ``amqps://`` URLs and SCRAM-SHA-256 go through `client_auth` (TLS by `ssl`, SASL
    by hand, then Proton on the authenticated socket); plain PLAIN/ANONYMOUS
    connections are Proton's own."""
    sec = security if security is not None else current_security()
    try:
        parsed = Url(url).defaults()
        host, port, scheme = parsed.host, int(parsed.port), parsed.scheme
    except (ValueError, TypeError, ProtonException) as exc:
        raise ConnectError(url, f"not a broker URL ({exc})", "use amqp://host:port") from None
    user = user or parsed.username or None
    password = password if password is not None else parsed.password
    mechanism = sec.choose_mechanism(user)
    if mechanism in ("PLAIN", SCRAM_SHA_256) and not user:
        raise ConnectError(url, f"{mechanism} needs a user", "give --user and --password")
    tls = scheme == "amqps"
    if not tls and (sec.uses_tls_files or mechanism == "EXTERNAL"):
        what = "EXTERNAL" if mechanism == "EXTERNAL" else "--ca-file/--cert-file/--key-file"
        raise ConnectError(url, f"{what} needs TLS", "use an amqps:// URL (a TLS listener)")
    c = Container()
    if container:
        c.container_id = container
    kw: dict[str, Any] = {"container": c}
    target: Any = url
    if tls or mechanism == SCRAM_SHA_256:
        try:
            sock = open_authenticated(
                host,
                port,
                tls=tls,
                security=sec,
                mechanism=mechanism,
                user=user,
                password=password,
                timeout=timeout,
            )
        except ClientAuthError as exc:
            raise ConnectError(url, exc.reason, exc.hint or "") from None
        except TimeoutError:
            raise ConnectError(url, f"no answer within {timeout:g} s") from None
        except OSError as exc:
            raise ConnectError(url, exc.strerror or str(exc)) from None
        c.global_handler = AdoptingIOHandler(sock)
        target = Url(url).defaults()
        target.scheme, target.username, target.password = "amqp", None, None
        kw["sasl_enabled"] = False
    else:
        kw.update(
            user=user,
            password=password or "",
            allowed_mechs=mechanism,
            sasl_enabled=True,
            allow_insecure_mechs=True,
        )
    try:
        return BlockingConnection(target, timeout=timeout, **kw)
    except Timeout:
        raise ConnectError(url, f"no answer within {timeout:g} s") from None
    except ConnectionException as exc:
        reason = _condition_text(exc)
        if "unauthorized" in reason or "auth" in reason.lower():
            who = f"user {user!r}" if user else "an anonymous login"
            raise ConnectError(
                url,
                f"the broker refused {who}: {reason}",
                "check --user/--password (AMQBROKER_USER, AMQBROKER_PASSWORD)",
            ) from None
        raise ConnectError(url, reason) from None
    except (OSError, ProtonException) as exc:
        raise ConnectError(url, _condition_text(exc)) from None


def entity_type(short_or_full: str) -> str:
    """`queue` -> `org.amqbroker.queue` (full names and the node type unchanged)."""
    if "." in short_or_full:
        return short_or_full
    return TYPE_PREFIX + short_or_full


class ManagementClient:
    """One connection to a broker's `$management` node; use as a context manager."""

    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        user: str | None = None,
        password: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        security: ClientSecurity | None = None,
    ) -> None:
        self.url = url
        self.timeout = timeout
        self.conn = connect(url, user=user, password=password, timeout=timeout, security=security)
        try:
            self.receiver = self.conn.create_receiver(None, dynamic=True, credit=10)
            self.reply_to = self.receiver.remote_source.address
            self.sender = self.conn.create_sender("$management")
        except LinkDetached as exc:
            self.close()
            raise RequestFailed("attach", 403, _condition_text(exc)) from None
        except Timeout:
            self.close()
            raise ConnectError(
                url, f"the management node did not answer in {timeout:g} s"
            ) from None
        except ConnectionException as exc:
            self.close()
            raise ConnectError(url, _condition_text(exc)) from None

    def __enter__(self) -> ManagementClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.close()

    # --------------------------------------------------------------- requests
    def call(
        self,
        operation: str,
        type: str,
        name: str | None = None,
        *,
        body: Any = None,
        **properties: Any,
    ) -> Any:
        """Send one request; return the answer's body or raise `RequestFailed`."""
        rid = str(uuid.uuid4())
        props: dict[str, Any] = {"operation": operation, "type": entity_type(type)}
        if name is not None:
            props["name"] = name
        props.update({k: v for k, v in properties.items() if v is not None})
        req = Message(id=rid, reply_to=self.reply_to, properties=props, body=body)
        try:
            self.sender.send(req, timeout=self.timeout)
            while True:
                reply = self.receiver.receive(timeout=self.timeout)
                self.receiver.accept()
                if reply.correlation_id == rid:
                    break
        except Timeout:
            raise RequestFailed(
                operation, None, f"no answer within {self.timeout:g} s; the broker may be busy"
            ) from None
        except LinkDetached as exc:
            raise RequestFailed(operation, None, _condition_text(exc)) from None
        except ConnectionException as exc:
            raise ConnectError(
                self.url, f"the connection was lost: {_condition_text(exc)}"
            ) from None
        raw: dict[Any, Any] = dict(reply.properties or {})
        answer = {str(k): v for k, v in raw.items()}
        status = answer.get("statusCode")
        if not isinstance(status, int) or not 200 <= status < 300:
            raise RequestFailed(operation, status, str(answer.get("statusDescription")))
        return reply.body

    def read(self, type: str, name: str) -> dict[str, Any]:
        return dict(self.call("READ", type, name))

    def query(self, type: str, attributes: Iterable[str] = ()) -> list[dict[str, Any]]:
        """Every entity of `type` as {attribute: value} (all attributes when none given)."""
        body = self.call(
            "QUERY",
            NODE_TYPE,
            entityType=entity_type(type),
            body={"attributeNames": list(attributes)},
        )
        names = list(body["attributeNames"])
        return [dict(zip(names, row, strict=True)) for row in body["results"]]


def request(
    url: str,
    operation: str,
    *,
    type: str,
    name: str = "",
    properties: dict[str, Any] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    user: str | None = None,
    password: str | None = None,
    security: ClientSecurity | None = None,
) -> Any:
    """One request on its own connection; returns the answer's body (raises on failure)."""
    with ManagementClient(
        url, user=user, password=password, timeout=timeout, security=security
    ) as c:
        return c.call(operation, type, name or None, **(properties or {}))


# ------------------------------------------------------------------- presentation


def user_queues(rows: Iterable[Mapping[str, Any]], *, include_temporary: bool) -> list[Any]:
    """QUERY rows of queues by name, without temporary (reply) queues unless asked."""
    return sorted(
        (r for r in rows if include_temporary or not r.get("temporary")),
        key=lambda r: str(r.get("name")),
    )


@dataclass(frozen=True)
class CheckResult:
    ok: bool
    line: str


def check_node(attrs: Mapping[str, Any], *, max_memory_percent: float | None) -> CheckResult:
    """The broker's READ answer against the thresholds: one line for a probe."""
    used, limit = attrs.get("memoryUsed") or 0, attrs.get("memoryLimit") or 0
    pct = 100.0 * used / limit if limit and limit > 0 else None
    summary = (
        f"amqbroker {attrs.get('version')} up {duration(attrs.get('uptime'))}: "
        f"{attrs.get('queues')} queue(s), {attrs.get('messages')} message(s), "
        f"{attrs.get('connections')} connection(s)"
        + (f", memory {pct:.0f}% of the limit" if pct is not None else "")
    )
    problems = []
    if max_memory_percent is not None and pct is not None and pct > max_memory_percent:
        problems.append(f"memory {pct:.0f}% > {max_memory_percent:g}% (--max-memory-percent)")
    if problems:
        return CheckResult(False, "FAIL: " + "; ".join(problems) + f" ({summary})")
    return CheckResult(True, "OK: " + summary)


def check_queue(
    attrs: Mapping[str, Any],
    *,
    max_messages: int | None = None,
    min_consumers: int | None = None,
    max_age: float | None = None,
    max_stuck_groups: int | None = None,
) -> CheckResult:
    """A queue's READ answer against the thresholds (`max_age` in seconds)."""
    name = attrs.get("name")
    n, consumers = int(attrs.get("messageCount") or 0), int(attrs.get("consumerCount") or 0)
    age_ms = attrs.get("firstMessageAge")
    stuck = int(attrs.get("stuckGroups") or 0)
    summary = (
        f"queue {name!r}: {n} message(s), {consumers} consumer(s)"
        + (f", oldest {duration(age_ms)}" if age_ms is not None else "")
        + (", paused" if attrs.get("paused") else "")
    )
    problems = []
    if max_messages is not None and n > max_messages:
        problems.append(f"{n} messages > {max_messages} (--max-messages)")
    if min_consumers is not None and consumers < min_consumers:
        problems.append(f"{consumers} consumers < {min_consumers} (--min-consumers)")
    if max_age is not None and age_ms is not None and age_ms > max_age * 1000:
        problems.append(f"oldest message {duration(age_ms)} > {max_age:g} s (--max-age)")
    if max_stuck_groups is not None and stuck > max_stuck_groups:
        problems.append(f"{stuck} stuck groups > {max_stuck_groups} (--max-stuck-groups)")
    if problems:
        return CheckResult(False, f"FAIL: queue {name!r}: " + "; ".join(problems))
    return CheckResult(True, "OK: " + summary)


def duration(ms: Any) -> str:
    """Milliseconds as a short human duration: 850ms, 12.5s, 3m05s, 2h01m, 3d04h."""
    if ms is None:
        return "-"
    ms = float(ms)
    if ms < 1000:
        return f"{ms:.0f}ms"
    s = ms / 1000
    if s < 60:
        return f"{s:.1f}s"
    m, s = divmod(int(s), 60)
    if m < 60:
        return f"{m}m{s:02d}s"
    h, m = divmod(m, 60)
    if h < 24:
        return f"{h}h{m:02d}m"
    d, h = divmod(h, 24)
    return f"{d}d{h:02d}h"
