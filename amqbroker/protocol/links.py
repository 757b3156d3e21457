"""Link adapters: an outgoing link is a core `Consumer`; an incoming link feeds an
address. Both are driven per message from `fastpath.pump`.

ConsumerLink (broker -> client): `deliver` writes the message bytes as received,
splicing a new header when the delivery-count changed and the group-first property
when asked. Unsettled deliveries are kept in one map (raw delivery pointer -> entry),
the only per-delivery state; a disposition pops it and calls the queue's settlement
(ack / release / modified / reject). On detach every unsettled entry goes back to the
queue (`Queue.remove_consumer`).

ProducerLink (client -> broker) translates: each complete transfer is scanned (routing
fields only), its destination found (the link's address, or each message's `to` on an
anonymous relay) and wrapped in an `Entry`; the core's `accept`
(`amqbroker.core.accept`: duplicate detection, the delivery log, transactions, the
cluster router hook, `Broker.route`) decides in the same call, and the link settles
the transfer as the outcome says. A transfer routed to a durable queue is settled only
after the store has synced the batch holding it (`SyncTracker`); every other one is
accepted at once. Credit is the backpressure: a window is granted and topped up at
half, except while the target address is full under the BLOCK policy, when the link
waits on the address until space returns.

Links see their connection through `host.LinkHost`, never `AmqpConnection` itself.

Authorisation: a named producer was checked once at attach (attach.py), so its
transfers are never checked. An anonymous-relay link under security checks 'send' on
each message's `to` (and 'create_address' when that address would be auto-created);
the destinations it was allowed are remembered in a per-link set bounded by
`ConnectionLimits.relay_authz_cache`, so the steady state costs one set lookup. A
denied transfer alone is rejected with amqp:unauthorized-access (the link stays
open); the first denial per link is logged.

Tracing: while it is off both links hold `tracer = None`, so a message pays one
attribute test on each side. When on, the app's hooks (`ConnectionLimits.route_tracer`
and `dispatch_tracer`, built by `amqbroker.telemetry`) are called with the link and
the `Entry`: the route hook (before the message is queued or enlisted) may replace
`entry.data` with a copy carrying the broker's trace context in its
message-annotations; the dispatch hook runs before the bytes go on the wire.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from amqbroker.core.accept import (
    DUPLICATE,
    ENLIST,
    PENDING,
    ROUTED_SYNC,
    accept,
    delivery_time,
    message_expiry,
)
from amqbroker.core.address import Address
from amqbroker.core.authz import CACHED_ADDRESS_MAX
from amqbroker.core.broker import Broker
from amqbroker.core.consumer import Consumer
from amqbroker.core.entry import Entry
from amqbroker.core.errors import BrokerError, Unauthorized
from amqbroker.core.queue import Queue
from amqbroker.core.transaction import (
    ACCEPT,
    MODIFIED,
    REJECT,
    RELEASE,
    MalformedTransactionalState,
    Outcome,
    UnknownTransaction,
)
from amqbroker.protocol import fastpath as fp
from amqbroker.protocol.fastpath import (
    PN_ACCEPTED,
    PN_TRANSACTIONAL,
    delivery_partial,
    delivery_pending,
    delivery_remote_state,
    delivery_settle,
    delivery_settled,
    delivery_update,
    link_advance,
    link_recv,
    link_send,
    new_delivery,
    unpack,
)
from amqbroker.protocol.host import LinkHost, SyncTracker, authorize
from amqbroker.protocol.scanner import (
    ScanError,
    add_application_property,
    log_message_id,
    scan,
    set_delivery_count,
)

#: SyncTracker is defined in host.py and imported from here too
__all__ = ["ConsumerLink", "ProducerLink", "SyncTracker"]

log = logging.getLogger(__name__)


class ConsumerLink(Consumer):
    __slots__ = ("conn", "link", "ptr", "tagger", "temporary_queue", "tracer", "unsettled")

    def __init__(
        self,
        conn: LinkHost,
        link: Any,
        *,
        priority: int,
        presettled: bool,
        temporary_queue: bool,
    ) -> None:
        super().__init__(
            link.name,
            priority=priority,
            presettled=presettled,
            connection_id=conn.conn_id,
            container_id=conn.remote_container or "",
        )
        self.conn = conn
        self.link = link
        self.ptr = link._impl
        self.tagger = fp.Tagger()
        self.unsettled: dict[Any, Entry] = {}
        #: the queue is a dynamic node owned by this link (deleted on close)
        self.temporary_queue = temporary_queue
        self.tracer = conn.limits.dispatch_tracer

    # core -> wire
    def deliver(self, entry: Entry, first: bool) -> None:
        if self.tracer is not None:
            self.tracer(self, entry)
        data = entry.data
        if entry.delivery_count:
            data = set_delivery_count(data, entry.delivery_count)
        if first:
            q = self.queue
            if q is not None and q.first_key:
                try:
                    data = add_application_property(data, q.first_key, True)
                except ScanError as exc:
                    # scan() does not read application-properties unless it needs the
                    # group fallback: a malformed map shows up only here. Deliver the
                    # message as received rather than fail the connection.
                    log.warning(
                        "%s: cannot add %s to message seq %d (%s); delivered as is",
                        self.conn.log_prefix(self.name, queue=q.name),
                        q.first_key,
                        entry.seq,
                        exc,
                    )
        ptr = self.ptr
        d = new_delivery(ptr, self.tagger.next())
        n = len(data)
        link_send(ptr, data, n)
        link_advance(ptr)
        if self.presettled:
            delivery_settle(d)
        else:
            self.unsettled[d] = entry
        conn = self.conn
        conn.out_pending += n
        if not conn.dirty:
            conn.mark_dirty()
        if conn.out_pending > conn.high_water and not conn.output_blocked:
            conn.block_output()

    def unsettled_entries(self) -> Iterable[Entry]:
        return self.unsettled.values()

    # wire -> core
    def on_delivery(self, d: Any) -> None:
        e = self.unsettled.pop(d, None)
        if e is None:
            if delivery_settled(d):
                delivery_settle(d)
            return
        q = self.queue
        if q is None:
            delivery_settle(d)
            return
        if delivery_remote_state(d) == PN_ACCEPTED:  # the usual case, first
            q.ack(self, e)
            delivery_settle(d)
            if not self.conn.dirty:
                self.conn.mark_dirty()
            return
        state, failed, undeliverable = fp.outcome(d)
        if state == fp.PN_RELEASED:
            q.release(self, e)
        elif state == fp.PN_MODIFIED:
            q.release(self, e, delivery_failed=failed, undeliverable_here=undeliverable)
        elif state == fp.PN_REJECTED:
            q.reject(self, e)
        elif state == 0 and fp.remotely_settled(d):
            q.ack(self, e)  # settled without an outcome: taken as accepted
        elif state != PN_TRANSACTIONAL or not self._enlist(d, q, e):
            self.unsettled[d] = e  # received / no terminal outcome yet
            return
        fp.settle(d)
        if not self.conn.dirty:
            self.conn.mark_dirty()

    def _enlist(self, d: Any, q: Queue, e: Entry) -> bool:
        """A transactional outcome: the transaction holds it until discharge and the
        message stays in flight. False when the state carries no terminal outcome yet
        (the delivery stays unsettled). A message the transaction cannot hold (unknown
        txn-id, bound reached) goes back to its queue as a rollback would return it."""
        st = fp.transactional_state(d)
        if st is None:
            log.warning(
                "%s: the consumer sent a malformed transactional state; the message is "
                "returned to the queue",
                self.conn.log_prefix(self.name, queue=q.name),
            )
            q.release(self, e, delivery_failed=True)
            return True
        txn_id, code, failed, undeliverable = st
        if code == PN_ACCEPTED or (code == 0 and fp.remotely_settled(d)):
            outcome = ACCEPT
        elif code == fp.PN_REJECTED:
            outcome = REJECT
        elif code == fp.PN_RELEASED:
            outcome = RELEASE
        elif code == fp.PN_MODIFIED:
            outcome = Outcome(MODIFIED, failed, undeliverable)
        else:
            return False
        t = self.conn.txns.get(txn_id)
        try:
            if t is None:
                raise UnknownTransaction(
                    f"acknowledgement in unknown transaction {txn_id.hex() or '(empty)'}"
                )
            t.add_ack(q, self, e, outcome)
        except BrokerError as exc:
            log.warning(
                "%s: %s; the message is returned to the queue",
                self.conn.log_prefix(self.name, queue=q.name),
                exc.description,
            )
            q.release(self, e, delivery_failed=True)
        return True

    def on_flow(self) -> None:
        ptr = self.ptr
        self.credit = fp.credit(ptr)
        q = self.queue
        if q is not None and self.credit > 0:
            q.credit_changed(self)
        if fp.drain_requested(ptr) and self.credit > 0:
            fp.drained(ptr)
            self.credit = 0
        if not self.conn.dirty:
            self.conn.mark_dirty()

    def detach(self, broker: Broker, failed: bool = False) -> None:
        """Return unsettled messages (counted as failed attempts when the connection
        was lost), leave the queue, drop a dynamic queue."""
        q = self.queue
        unsettled = list(self.unsettled.values())
        self.unsettled.clear()
        if q is not None:
            q.remove_consumer(self, unsettled, failed=failed)
            if self.temporary_queue and not q.deleted:
                broker.delete_queue(q)


class ProducerLink:
    __slots__ = (
        "address",
        "blocked",
        "broker",
        "bypass_router",
        "closed",
        "conn",
        "credit",
        "denied",
        "dlog",
        "fallback",
        "fallback_per_destination",
        "link",
        "max_size",
        "origin",
        "producer_id",
        "producer_identity",
        "ptr",
        "rbuf",
        "relay_ok",
        "sync",
        "temporary_queue",
        "tracer",
        "waiting",
        "window",
    )

    def __init__(
        self,
        conn: LinkHost,
        link: Any,
        address: Address | None,
        *,
        window: int,
        max_size: int,
        temporary_queue: Queue | None = None,
    ) -> None:
        self.conn = conn
        self.broker = conn.broker
        self.link = link
        self.ptr = link._impl
        #: None = anonymous relay (per-message `to`)
        self.address = address
        self.window = window
        self.credit = 0
        self.max_size = max_size
        self.blocked = False
        self.closed = False
        self.rbuf = conn.rbuf
        #: stamped on every message (no-local filters compare it)
        self.origin = conn.conn_id
        self.sync = conn.sync
        self.waiting: deque[tuple[Any, int]] = deque()
        self.temporary_queue = temporary_queue
        #: True for links whose messages are already routed (cluster bridges):
        #: the broker's `router` hook (clustered routing) is not asked
        self.bypass_router = False
        self.tracer = conn.limits.route_tracer
        #: anonymous relay under security: destinations this link may send to (bounded
        #: by limits.relay_authz_cache); None = no per-message check
        self.relay_ok: set[str] | None = (
            set() if address is None and conn.authz is not None else None
        )
        #: a relay transfer was refused for lack of permission (logged once per link)
        self.denied = False
        #: the delivery log (None = off) and this producer's ids in it (built once
        #: here, never per message): per connection (the connection ids start again
        #: at each boot), and across reconnects and failover (the client's
        #: container-id: a Qpid JMS connection keeps it through `failover:`; None
        #: without one)
        self.dlog = conn.broker.dlog
        self.producer_id = f"{conn.conn_id}/{link.name}"
        container = conn.remote_container
        self.producer_identity = f"{container}/{link.name}" if container else None
        self.fallback = True
        #: no address at attach (anonymous relay, cluster inbound): the fallback is
        #: scanned on and then settled by each message's destination (`_route`)
        self.fallback_per_destination = address is None
        if address is not None and address.settings is not None:
            self.fallback = bool(address.settings.group_id_from_application_properties)

    def start(self) -> None:
        self._top_up()

    def _top_up(self) -> None:
        a = self.address
        if a is not None and a.full_policy == "BLOCK" and a.full:
            if not self.blocked:
                self.blocked = True
                a.block(self)
            return
        dlog = self.dlog
        if dlog is not None and dlog.full:
            # delivery_log_overflow = block: no credit until the writer catches up
            if not self.blocked:
                self.blocked = True
                dlog.block(self)
            return
        want = self.window - self.credit
        if want > 0:
            fp.flow(self.ptr, want)
            self.credit = self.window
            if not self.conn.dirty:
                self.conn.mark_dirty()

    def resume(self) -> None:
        """Called by the address when it has room again."""
        self.blocked = False
        if not self.closed:
            self._top_up()

    def on_flow(self) -> None:
        pass

    def on_delivery(self, d: Any) -> None:
        """One transfer from the producer (the hot path: keep it lean)."""
        ptr = self.ptr
        n = delivery_pending(d)
        if delivery_partial(d):
            if n > self.max_size:
                self.conn.detach_link(
                    self,
                    "amqp:link:message-size-exceeded",
                    f"message larger than max_message_size ({self.max_size} bytes): "
                    f"{n} bytes received so far; send smaller messages",
                )
            elif fp.aborted(d):
                delivery_settle(d)
            return
        rb = self.rbuf
        if n > rb.size:
            rb.grow(n)
        got = link_recv(ptr, rb.buf, n)
        link_advance(ptr)
        self.credit -= 1
        if got < 0 and fp.aborted(d):
            delivery_settle(d)
        elif got < 0:  # a transfer without payload: no message (rejected, decode-error)
            self._route(d, b"", bool(delivery_settled(d)))
        else:
            self._route(d, unpack(rb.buf, got), bool(delivery_settled(d)))
        if self.credit <= self.window >> 1 and not self.blocked:
            self._top_up()

    def _route(self, d: Any, data: bytes, presettled: bool) -> None:
        """Translate one complete transfer and hand it to the core (`accept`): the
        size bound, the scan, the destination (the link's address, or the message's
        `to` on an anonymous relay), the `Entry`; then settle the transfer as the
        outcome says."""
        if len(data) > self.max_size:
            self._refuse(
                d,
                presettled,
                "amqp:link:message-size-exceeded",
                f"message of {len(data)} bytes is larger than max_message_size "
                f"({self.max_size} bytes); send smaller messages",
            )
            return
        try:
            durable, prio, ttl, abs_exp, dc, gid, gseq, to, dtime, ddelay = scan(
                data, self.fallback
            )
        except ScanError as exc:
            self._refuse(d, presettled, "amqp:decode-error", f"malformed message: {exc}")
            return
        a = self.address
        broker = self.broker
        # an HA live member resumed after a pause (its lease in doubt: every send), or
        # a primary with no backup in sync under ha_unreplicated = "refuse" (durable
        # sends); never a peer's forwarded message (durable: fenced by its store
        # cycle; a refusal would dead-letter it at the peer)
        refused = broker.sends_refused
        if refused is None and durable:
            refused = broker.durable_refused
        if refused is not None and not self.bypass_router:
            self._refuse(d, presettled, "amqp:resource-limit-exceeded", refused)
            return
        try:
            if a is None:
                if not to:
                    self._refuse(
                        d,
                        presettled,
                        "amqp:precondition-failed",
                        "message sent on an anonymous (null target) link has no "
                        "properties.to; set the destination address on the message",
                    )
                    return
                ok = self.relay_ok
                if (
                    ok is not None
                    and (to not in ok or to not in broker.addresses)
                    and not self._relay_allowed(d, presettled, to)
                ):
                    return
                a = broker.address_for_relay(to, data)
            if gid is not None and self.fallback_per_destination:
                st = a.settings
                if st is not None and not st.group_id_from_application_properties:
                    # this destination takes the group from properties.group-id only:
                    # scan again without the application-property fallback
                    gid, gseq = scan(data, False)[5:7]
            e = Entry(
                data,
                durable,
                prio if prio < 10 else 9,  # AMQP 0..255 -> JMS 0..9
                message_expiry(broker.clock, ttl, abs_exp) if ttl or abs_exp else 0,
                dc,
                gid,
                gseq,
            )
            if dtime or ddelay:
                e.deliver_at = delivery_time(broker.clock, dtime, ddelay)
            e.origin = self.origin
            if self.tracer is not None:
                self.tracer(self, e, a)
            if self.dlog is not None:
                e.trace = (log_message_id(data), self.producer_id, self.producer_identity)
            transactional = delivery_remote_state(d) == PN_TRANSACTIONAL
            res = accept(
                broker,
                a,
                e,
                data,
                transactional,
                None
                if broker.router is None or self.bypass_router
                else self._routed_later(d, presettled, a, e),
            )
            if res < PENDING:
                self._settle_routed(d, presettled, res == ROUTED_SYNC, a)
            elif res == PENDING:
                if presettled:
                    delivery_settle(d)
            elif res == DUPLICATE:
                if not presettled:
                    delivery_update(d, PN_ACCEPTED)
                delivery_settle(d)
            else:  # ENLIST
                self._enlist(d, a, e, presettled)
        except BrokerError as exc:
            self._refuse(d, presettled, exc.condition, exc.description)

    def _routed_later(
        self, d: Any, presettled: bool, a: Address, e: Entry
    ) -> Callable[[int | BrokerError], None]:
        """The completion the cluster router calls once a PENDING message is routed
        (or refused), or a transactional one may be enlisted (ENLIST); a no-op once
        the link has gone, and for presettled transfers but to enlist them."""

        def done(res: int | BrokerError) -> None:
            if self.closed:
                return
            if res == ENLIST:
                try:
                    self._enlist(d, a, e, presettled)
                except BrokerError as exc:
                    self._refuse(d, presettled, exc.condition, exc.description)
                if not self.conn.dirty:
                    self.conn.mark_dirty()
                return
            if presettled:
                return
            if isinstance(res, BrokerError):
                fp.reject(d, res.condition, res.description)
                if not self.conn.dirty:
                    self.conn.mark_dirty()
                return
            sync = self.sync
            # answered late (e.g. a forwarded message whose link dropped): its batch
            # may be on disk already, and no later batch may come to say so
            self._settle_routed(
                d, False, res == ROUTED_SYNC and (sync is None or sync.ticket() > sync.synced_no)
            )
            if not self.conn.dirty:
                self.conn.mark_dirty()

        return done

    def _settle_routed(
        self, d: Any, presettled: bool, sync: bool, a: Address | None = None
    ) -> None:
        if presettled:
            delivery_settle(d)
        elif sync and self.sync is not None:
            self.waiting.append((d, self.sync.ticket()))
            self.sync.waiters.add(self)
        else:
            delivery_update(d, PN_ACCEPTED)
            delivery_settle(d)
        # anonymous relay: block the link on a full target until it drains
        if (
            a is not None
            and self.address is None
            and a.full
            and a.full_policy == "BLOCK"
            and not self.blocked
        ):
            self.blocked = True
            a.block(self)

    def _relay_allowed(self, d: Any, presettled: bool, to: str) -> bool:
        """Anonymous relay under security: the user needs 'send' on the message's `to`
        (and 'create_address' when it would be auto-created). A denial rejects this
        transfer only, with amqp:unauthorized-access; the first one is logged."""
        conn = self.conn
        try:
            authorize(conn, "send", to)
        except Unauthorized as err:
            if presettled:
                fp.settle(d)
            else:
                fp.reject(d, err.condition, err.description)
            if not self.denied:
                self.denied = True
                log.info(
                    "%s (anonymous relay): %s %s (%s; further denials on this link are not logged)",
                    conn.log_prefix(self.link.name),
                    err.condition,
                    err.description,
                    "dropped: presettled" if presettled else "transfer rejected",
                )
            return False
        ok = self.relay_ok
        bound = conn.limits.relay_authz_cache
        if ok is not None and bound and len(to) <= CACHED_ADDRESS_MAX:
            if len(ok) >= bound:
                ok.clear()
            ok.add(to)
        return True

    def _enlist(self, d: Any, a: Address, e: Entry, presettled: bool) -> None:
        """A transactional transfer: held by its transaction, routed at commit, and
        answered with transactional-state {txn-id, accepted}. Raises BrokerError
        (unknown txn-id, bound, full address) for the caller to reject."""
        st = fp.transactional_state(d)
        if st is None:
            raise MalformedTransactionalState(
                "malformed transactional state on the transfer: expected [txn-id binary, outcome?]"
            )
        txn_id = st[0]
        t = self.conn.txns.require(txn_id)
        t.add_send(a, e)
        if presettled:
            delivery_settle(d)
        else:
            fp.transactional_accept(d, txn_id)

    def _refuse(self, d: Any, presettled: bool, condition: str, description: str) -> None:
        if presettled:
            fp.settle(d)
            a = self.address
            log.info(
                "%s: dropped a presettled message: %s",
                self.conn.log_prefix(self.link.name, address=a.name if a is not None else None),
                description,
            )
        else:
            fp.reject(d, condition, description)

    def detach(self, broker: Broker, failed: bool = False) -> None:
        self.closed = True
        if self.sync is not None:
            self.sync.waiters.discard(self)
        self.waiting.clear()
        if self.dlog is not None:
            self.dlog.forget(self)
        a = self.address
        if a is not None:
            a.forget(self)
            broker.producer_detached(a)
        if self.temporary_queue is not None and not self.temporary_queue.deleted:
            for c in broker.delete_queue(self.temporary_queue):
                if isinstance(c, ConsumerLink):
                    c.conn.detach_link(
                        c, "amqp:resource-deleted", "the temporary queue was deleted"
                    )
