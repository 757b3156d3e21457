"""The transaction coordinator link (AMQP 1.0 part 4, local transactions).

A client (Qpid JMS: link `qpid-jms:coordinator:<id>`, one per transacted session)
attaches a sender whose target is a Coordinator with capability
`amqp:local-transactions` and sends control messages whose amqp-value body is

* Declare (0x31, [global-id?]): a new transaction; answered with the `declared` state
  (0x33, [txn-id]), settled.
* Discharge (0x32, [txn-id, fail]): fail=false commits, fail=true rolls back; answered
  `accepted`, settled. An unknown or already discharged txn-id is `rejected` with
  `amqp:transaction:unknown-id`; a commit of a transaction that could not hold some of
  its work (bound, full address) rolls back and is `rejected` with
  `amqp:transaction:rollback` (Qpid JMS: TransactionRolledBackException).

Anything else is rejected with `amqp:decode-error`. Control messages are rare, so they
are decoded with proton's Message (never on the data hot path).

Transactions belong to the connection (`LinkHost.txns`): transfers and
dispositions on any of its links name them by txn-id (see links.py). A commit that
wrote durable records is answered only once the store has synced them (the same
`SyncTracker` the producers use). Detaching the coordinator rolls back the
transactions it declared that are still open.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING, Any

from proton import Described, Message

from amqbroker.core.errors import BrokerError
from amqbroker.core.transaction import TransactionRolledBack
from amqbroker.protocol import fastpath as fp

if TYPE_CHECKING:
    from amqbroker.core.broker import Broker
    from amqbroker.protocol.host import LinkHost

log = logging.getLogger(__name__)

LOCAL_TRANSACTIONS = "amqp:local-transactions"

_DECLARE = {0x31, "amqp:declare:list"}
_DISCHARGE = {0x32, "amqp:discharge:list"}
#: a control message is a few dozen bytes; anything this large is not one
MAX_CONTROL_SIZE = 64 * 1024


def _kind(descriptor: Any) -> str:
    key: Any = int(descriptor) if isinstance(descriptor, int) else str(descriptor)
    if key in _DECLARE:
        return "declare"
    if key in _DISCHARGE:
        return "discharge"
    return ""


class CoordinatorLink:
    """Incoming link to the coordinator; same duck-typed interface as ProducerLink."""

    __slots__ = ("broker", "closed", "conn", "credit", "link", "ptr", "sync", "waiting", "window")

    def __init__(self, conn: LinkHost, link: Any, *, window: int = 100) -> None:
        self.conn = conn
        self.broker = conn.broker
        self.link = link
        self.ptr = link._impl
        self.window = window
        self.credit = 0
        self.closed = False
        self.sync = conn.sync
        #: discharges waiting for the store: (delivery, batch number)
        self.waiting: deque[tuple[Any, int]] = deque()

    def start(self) -> None:
        self._top_up()

    def _top_up(self) -> None:
        want = self.window - self.credit
        if want > 0:
            fp.flow(self.ptr, want)
            self.credit = self.window
            if not self.conn.dirty:
                self.conn.mark_dirty()

    def on_flow(self) -> None:
        pass

    def on_delivery(self, d: Any) -> None:
        if fp.delivery_partial(d):
            if fp.delivery_pending(d) > MAX_CONTROL_SIZE:
                self.conn.detach_link(
                    self,
                    "amqp:decode-error",
                    f"coordinator message larger than {MAX_CONTROL_SIZE} bytes; only "
                    "Declare and Discharge are accepted here",
                )
            elif fp.aborted(d):
                fp.settle(d)
            return
        data = self.conn.rbuf.receive(self.ptr, d)
        if data is None:
            return
        self.credit -= 1
        presettled = fp.remotely_settled(d)
        try:
            self._control(d, data, presettled)
        except BrokerError as exc:
            self._answer_reject(d, presettled, exc.condition, exc.description)
        if self.credit <= self.window >> 1:
            self._top_up()
        if not self.conn.dirty:
            self.conn.mark_dirty()

    def _answer_reject(self, d: Any, presettled: bool, condition: str, description: str) -> None:
        log.info(
            "%s (transaction coordinator): %s %s",
            self.conn.log_prefix(self.link.name),
            condition,
            description,
        )
        if presettled:
            fp.settle(d)
        else:
            fp.reject(d, condition, description)

    def _control(self, d: Any, data: bytes, presettled: bool) -> None:
        body: Any = None
        try:
            m = Message()
            m.decode(data)
            body = m.body
        except Exception as exc:  # proton raises several types here
            self._answer_reject(
                d, presettled, "amqp:decode-error", f"undecodable coordinator message: {exc}"
            )
            return
        kind = _kind(body.descriptor) if isinstance(body, Described) else ""
        fields = body.value if isinstance(body, Described) else None
        if not kind or not isinstance(fields, list):
            self._answer_reject(
                d,
                presettled,
                "amqp:decode-error",
                "a coordinator takes only Declare or Discharge messages (an amqp-value "
                f"body holding a described list); got {type(body).__name__}",
            )
            return
        if kind == "declare":
            self._declare(d, fields, presettled)
        else:
            self._discharge(d, fields, presettled)

    def _declare(self, d: Any, fields: list[Any], presettled: bool) -> None:
        if fields and fields[0] is not None:
            self._answer_reject(
                d,
                presettled,
                "amqp:not-implemented",
                "distributed transactions (Declare with a global-id) are not supported; "
                "declare a local transaction",
            )
            return
        t = self.conn.txns.declare(owner=self)
        log.debug(
            "%s: declared transaction %s", self.conn.log_prefix(self.link.name), t.txn_id.hex()
        )
        if presettled:
            fp.settle(d)
        else:
            fp.declared(d, t.txn_id)

    def _discharge(self, d: Any, fields: list[Any], presettled: bool) -> None:
        raw = fields[0] if fields else None
        if not isinstance(raw, (bytes, bytearray, memoryview)):
            self._answer_reject(
                d, presettled, "amqp:decode-error", "Discharge without a binary txn-id"
            )
            return
        fail = bool(fields[1]) if len(fields) > 1 and fields[1] is not None else False
        t = self.conn.txns.discharge(bytes(raw))  # UnknownTransaction -> rejected
        broker = self.broker
        if fail:
            t.rollback(broker)
            log.debug(
                "%s: rolled back transaction %s",
                self.conn.log_prefix(self.link.name),
                t.txn_id.hex(),
            )
            self._accept(d, presettled, False)
            return
        if t.rollback_only is not None:
            cause = t.rollback_only
            t.rollback(broker)
            raise TransactionRolledBack(
                f"the transaction was rolled back: part of its work was refused "
                f"({cause.condition}: {cause.description})"
            )
        try:
            durable = t.commit(broker)
        except BrokerError:
            raise
        except Exception:
            log.exception(
                "%s: commit of transaction %s failed",
                self.conn.log_prefix(self.link.name),
                t.txn_id.hex(),
            )
            raise TransactionRolledBack(
                "the broker hit an internal error while committing; the transaction may "
                "be partly applied"
            ) from None
        log.debug(
            "%s: committed transaction %s", self.conn.log_prefix(self.link.name), t.txn_id.hex()
        )
        self._accept(d, presettled, durable)

    def _accept(self, d: Any, presettled: bool, durable: bool) -> None:
        if presettled:
            fp.settle(d)
        elif durable and self.sync is not None:
            self.waiting.append((d, self.sync.ticket()))
            self.sync.waiters.add(self)
        else:
            fp.accept(d)

    def detach(self, broker: Broker, failed: bool = False) -> None:
        """Roll back the transactions this coordinator declared that are still open."""
        self.closed = True
        if self.sync is not None:
            self.sync.waiters.discard(self)
        self.waiting.clear()
        n = self.conn.txns.rollback_all(broker, owner=self)
        if n:
            log.info(
                "%s: transaction coordinator detached; rolled back %d open transaction(s)",
                self.conn.log_prefix(self.link.name),
                n,
            )
