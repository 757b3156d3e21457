"""Local transactions (AMQP 1.0 part 4): work held until discharge, then applied.

A `Transaction` buffers two kinds of work, each in arrival order:

* sends: messages a producer transferred with a transactional state, as
  (address, Entry) pairs. They are routed only at commit, in order; a rollback drops
  them.
* acks: outcomes a consumer gave with a transactional state, as
  (queue, consumer, entry, outcome). The message stays in flight meanwhile (counted in
  `Queue.inflight`, never redelivered, never acknowledged). Commit applies the outcome
  through the queue's settlement (`ack` / `reject` / `release`); rollback returns the
  message to its position for the same group owner with delivery-count + 1 (JMS
  redelivered), as Artemis does. When the consumer has detached meanwhile the queue's
  `*_detached` variants do the same without a consumer.

Commit writes its store records between `Persistence.begin_atomic` and `end_atomic`,
so a crash leaves all of them or none; `commit` says whether anything durable was
written (the protocol layer then answers the discharge only once the store synced).

`Transactions` is one connection's table of open transactions (txn-ids are never
reused on a connection, so a discharged id is unknown from then on).

Invariants: a transaction is applied at most once (`done`); every entry it holds is
accounted in exactly one place (its queue's in-flight count for acks, nowhere for
sends) until it is applied or dropped; an address with held sends counts one producer
so it is not auto-deleted under the transaction.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from amqbroker.core.broker import ROUTED_SYNC, Broker
from amqbroker.core.errors import BrokerError, ResourceLimitExceeded

if TYPE_CHECKING:
    from amqbroker.core.address import Address
    from amqbroker.core.consumer import Consumer
    from amqbroker.core.entry import Entry
    from amqbroker.core.queue import Queue

log = logging.getLogger(__name__)

ACCEPTED = "accepted"
REJECTED = "rejected"
RELEASED = "released"
MODIFIED = "modified"


class UnknownTransaction(BrokerError):
    condition = "amqp:transaction:unknown-id"


class TransactionRolledBack(BrokerError):
    condition = "amqp:transaction:rollback"


class MalformedTransactionalState(BrokerError):
    condition = "amqp:decode-error"


@dataclass(frozen=True, slots=True)
class Outcome:
    """A consumer's terminal outcome, held by a transaction."""

    kind: str
    delivery_failed: bool = False
    undeliverable_here: bool = False


ACCEPT = Outcome(ACCEPTED)
REJECT = Outcome(REJECTED)
RELEASE = Outcome(RELEASED)


class Transaction:
    __slots__ = ("_addresses", "acks", "done", "limit", "owner", "rollback_only", "sends", "txn_id")

    def __init__(self, txn_id: bytes, *, limit: int, owner: object = None) -> None:
        self.txn_id = txn_id
        #: most sends + acks this transaction may hold (max_transaction_messages)
        self.limit = limit
        #: who declared it (the coordinator link); opaque to the core
        self.owner = owner
        self.sends: list[tuple[Address, Entry]] = []
        self.acks: list[tuple[Queue, Consumer, Entry, Outcome]] = []
        #: set when work could not be enlisted: a commit then rolls back and fails
        self.rollback_only: BrokerError | None = None
        self.done = False
        self._addresses: dict[Address, None] = {}

    def __len__(self) -> int:
        return len(self.sends) + len(self.acks)

    def __repr__(self) -> str:
        return f"<Transaction {self.txn_id.hex()} sends={len(self.sends)} acks={len(self.acks)}>"

    # ---------------------------------------------------------------- enlisting
    def _check_room(self) -> None:
        if len(self.sends) + len(self.acks) >= self.limit:
            err = ResourceLimitExceeded(
                f"the transaction already holds {self.limit} messages (sends and "
                f"acknowledgements), the maximum (max_transaction_messages); commit "
                "more often or raise max_transaction_messages"
            )
            self.mark_rollback_only(err)
            raise err

    def mark_rollback_only(self, err: BrokerError) -> None:
        if self.rollback_only is None:
            self.rollback_only = err

    def add_send(self, a: Address, e: Entry) -> None:
        """Hold a message for `a` until commit. Raises ResourceLimitExceeded when the
        transaction is at its bound or the address is full under the FAIL policy
        (checked here, once: a commit is never refused halfway)."""
        self._check_room()
        if a.full_policy == "FAIL" and a.full:
            raise ResourceLimitExceeded(
                f"{a.full_reason()} (address_full_policy FAIL): the message was not accepted"
            )
        self.sends.append((a, e))
        if a not in self._addresses:
            self._addresses[a] = None
            a.producers += 1  # keeps an auto-created address (and its queue) alive

    def add_ack(self, q: Queue, c: Consumer, e: Entry, outcome: Outcome) -> None:
        """Hold a consumer's outcome until discharge (the message stays in flight).
        Raises ResourceLimitExceeded at the bound; the caller returns the message."""
        self._check_room()
        self.acks.append((q, c, e, outcome))

    # --------------------------------------------------------------- discharge
    def commit(self, broker: Broker) -> bool:
        """Apply the held work, acknowledgements first, then the sends in order, as
        one atomic group of store records. True when a durable record was written."""
        if self.done:
            raise UnknownTransaction(f"transaction {self.txn_id.hex()} was already discharged")
        self.done = True
        durable = False
        store = broker.store
        store.begin_atomic()
        try:
            for q, c, e, o in self.acks:
                if q.deleted:
                    continue
                durable = durable or (q.durable and e.durable)
                attached = c.queue is q
                kind = o.kind
                if kind == ACCEPTED:
                    if attached:
                        q.ack(c, e)
                    else:
                        q.ack_detached(e)
                elif kind == REJECTED:
                    if attached:
                        q.reject(c, e)
                    else:
                        q.reject_detached(e)
                elif attached:
                    q.release(
                        c,
                        e,
                        delivery_failed=o.delivery_failed,
                        undeliverable_here=o.undeliverable_here,
                    )
                else:
                    q.return_detached(e, delivery_failed=o.delivery_failed)
            for a, e in self.sends:
                durable = self._route(broker, a, e) or durable
        finally:
            store.end_atomic()
            self.acks.clear()
            self.sends.clear()
            self._release_addresses(broker)
        return durable

    @staticmethod
    def _route(broker: Broker, a: Address, e: Entry) -> bool:
        cur = broker.addresses.get(a.name)
        if cur is None:
            try:
                cur = broker.address_for_producer(a.name)
            except BrokerError as exc:
                broker.dropped_no_route += 1
                log.warning(
                    "transaction commit: message for %r dropped: %s", a.name, exc.description
                )
                return False
        # duplicate detection applies when the send takes effect (a rolled-back send
        # leaves no id behind, so its retry is not taken for a duplicate)
        if cur.dedup is not None and broker.is_duplicate(cur, e.data):
            return False
        # the FAIL check was made when the message was enlisted: the commit routes all;
        # the router first (clustered grouping: the group's owner node takes it)
        try:
            router = broker.router
            res = router.route_committed(cur, e) if router is not None else None
            if res is None:
                res = broker.route(cur, e, check_full=False)
            return res == ROUTED_SYNC
        except BrokerError as exc:  # its queue was deleted since and may not come back
            broker.dropped_no_route += 1
            log.warning("transaction commit: message for %r dropped: %s", a.name, exc.description)
            return False

    def rollback(self, broker: Broker) -> None:
        """Drop the held sends; return the held messages to their queues (same owner,
        delivery-count + 1)."""
        if self.done:
            return
        self.done = True
        acks = self.acks
        self.acks = []
        self.sends.clear()
        for q, c, e, _ in acks:
            if q.deleted:
                continue
            if c.queue is q:
                q.release(c, e, delivery_failed=True)
            else:
                q.return_detached(e, delivery_failed=True)
        self._release_addresses(broker)

    def _release_addresses(self, broker: Broker) -> None:
        addrs = list(self._addresses)
        self._addresses.clear()
        for a in addrs:
            broker.producer_detached(a)


class Transactions:
    """The open transactions of one connection, by txn-id."""

    __slots__ = ("_by_id", "_next", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._by_id: dict[bytes, Transaction] = {}
        self._next = 0

    def __len__(self) -> int:
        return len(self._by_id)

    def declare(self, owner: object = None) -> Transaction:
        self._next += 1
        t = Transaction(self._next.to_bytes(8, "big"), limit=self.limit, owner=owner)
        self._by_id[t.txn_id] = t
        return t

    def get(self, txn_id: bytes) -> Transaction | None:
        return self._by_id.get(txn_id)

    def require(self, txn_id: bytes) -> Transaction:
        t = self._by_id.get(txn_id)
        if t is None:
            raise UnknownTransaction(
                f"unknown transaction id {txn_id.hex() or '(empty)'}: it was never declared "
                "on this connection or is already discharged; declare a new transaction"
            )
        return t

    def discharge(self, txn_id: bytes) -> Transaction:
        """Remove and return an open transaction (UnknownTransaction otherwise)."""
        t = self.require(txn_id)
        del self._by_id[txn_id]
        return t

    def rollback_all(self, broker: Broker, owner: object = None) -> int:
        """Roll back every open transaction (or those of `owner`); returns how many."""
        n = 0
        for t in list(self._by_id.values()):
            if owner is not None and t.owner is not owner:
                continue
            del self._by_id[t.txn_id]
            t.rollback(broker)
            n += 1
        return n
