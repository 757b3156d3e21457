"""One AMQP connection: bytes in, events handled, bytes out. It never touches a socket.

The net layer feeds received bytes to `feed`, sends what `output` returns and reports
it with `consumed`, calls `tick` for idle-timeout/heartbeats, and `input_closed` /
`abort` when the socket ends. Other connections' dispatch writes into this
connection's engine directly (a consumer link's `deliver`); `mark_dirty` then asks the
net layer to flush it at the end of the current batch, so there is no task switch per
message.

Layering of one connection: our SASL layer (`sasl.SaslServer`) sees the first bytes;
after a successful outcome the rest goes to a Proton server transport configured
without SASL. Control events (open, begin, attach, detach, end, close) are handled
here through the object API; transfers, dispositions and flow go through `fastpath`.

Every refusal carries an AMQP condition and a description a person can act on.
Links are refused the way Qpid JMS expects: attach with a null source/target, then
detach with the error.

Authorisation (`authorize`, when security is enabled): each attach of a named link is
checked once against `core.authz` (consumer: consume; browser: browse; producer:
send; plus create_address when the attach would auto-create the address;
unsubscribe: consume on the topic; `$management`: manage). Dynamic nodes are the
client's own and are not checked; the anonymous relay checks each destination
(links.py). A denial refuses the attach with amqp:unauthorized-access, logged once.

Invariants: `links` holds exactly the open links of this connection (raw pointer ->
handler); `cleanup` (on close, transport error or abort) detaches every handler, so
consumers' unsettled messages return to their queues and temporary queues go away.

Logging: one line per event, each starting with `log_prefix`: `connection c12 from
127.0.0.1:5555`, and for a link event `...: link 'x' on queue 'orders'` (consumers,
browsers) or `on address 'orders'` (producers, refused attaches), then `: what
happened`. Open, attach, detach and close are DEBUG; refusals and failures INFO.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import proton
from proton import Condition, Link, Terminus, symbol

from amqbroker import __version__
from amqbroker.core.address import ANYCAST, MULTICAST
from amqbroker.core.auth import Authenticator
from amqbroker.core.authz import Authorizer
from amqbroker.core.broker import Broker, Subscription
from amqbroker.core.errors import (
    BrokerError,
    InvalidField,
    NotFound,
    NotImplementedFeature,
    PreconditionFailed,
    ResourceLimitExceeded,
)
from amqbroker.core.selector import SelectorError
from amqbroker.core.transaction import Transactions
from amqbroker.protocol import fastpath as fp
from amqbroker.protocol.browser import BrowserLink
from amqbroker.protocol.coordinator import LOCAL_TRANSACTIONS, CoordinatorLink
from amqbroker.protocol.links import ConsumerLink, ProducerLink, SyncTracker
from amqbroker.protocol.sasl import SaslServer

log = logging.getLogger(__name__)


def _link_kind(h: Any) -> str:
    """What a link handler is, for a log line."""
    if isinstance(h, BrowserLink):
        return "browser"
    if isinstance(h, ConsumerLink):
        return "consumer"
    if isinstance(h, ProducerLink):
        return "producer" if h.address is not None else "producer (anonymous relay)"
    if isinstance(h, CoordinatorLink):
        return "transaction coordinator"
    return "management"


MANAGEMENT_ADDRESS = "$management"

_EV = proton.Event
EV_CONN_REMOTE_OPEN = _EV.CONNECTION_REMOTE_OPEN.number
EV_CONN_REMOTE_CLOSE = _EV.CONNECTION_REMOTE_CLOSE.number
EV_SSN_REMOTE_OPEN = _EV.SESSION_REMOTE_OPEN.number
EV_SSN_REMOTE_CLOSE = _EV.SESSION_REMOTE_CLOSE.number
EV_LINK_REMOTE_OPEN = _EV.LINK_REMOTE_OPEN.number
EV_LINK_REMOTE_CLOSE = _EV.LINK_REMOTE_CLOSE.number
EV_LINK_REMOTE_DETACH = _EV.LINK_REMOTE_DETACH.number
EV_TRANSPORT_ERROR = _EV.TRANSPORT_ERROR.number
EV_TRANSPORT_CLOSED = _EV.TRANSPORT_CLOSED.number

_ROUTING_CAPS = {
    "queue": ANYCAST,
    "temporary-queue": ANYCAST,
    "topic": MULTICAST,
    "temporary-topic": MULTICAST,
}


@dataclass(frozen=True)
class ConnectionLimits:
    container_id: str = "amqbroker"
    max_frame_size: int = 65536
    channel_max: int = 255
    max_sessions: int = 64
    max_links: int = 1000
    idle_timeout: float = 60.0
    max_message_size: int = 100 * 1024 * 1024
    link_credit: int = 1000
    output_high_water: int = 1 << 20
    output_low_water: int = 256 << 10
    refuse_reason: str = ""  # non-empty: close the connection right after open
    #: most messages (sends + acknowledgements) one transaction may hold
    max_transaction_messages: int = 100_000
    #: destinations whose 'send' permission an anonymous-relay link remembers
    relay_authz_cache: int = 256
    #: tracing hooks (amqbroker.telemetry), None while tracing is off; see links.py
    route_tracer: Callable[..., None] | None = None
    dispatch_tracer: Callable[..., None] | None = None


def _first_object(data: Any) -> Any:
    """The value held by a terminus field (proton.Data), or None when it is empty."""
    if data is None:
        return None
    data.rewind()
    return data.get_object() if data.next() else None


def _symbols(data: Any) -> set[str]:
    """The symbols in a terminus capabilities field (array, list or single)."""
    obj = _first_object(data)
    if obj is None:
        return set()
    if isinstance(obj, str):
        return {str(obj)}
    try:
        return {str(x) for x in obj}
    except TypeError:
        return set()


#: filter descriptors (Apache's registered filter types, what Qpid JMS sends)
SELECTOR_CODE = 0x0000468C00000004
NO_LOCAL_CODE = 0x0000468C00000003
_SELECTOR_NAMES = {"apache.org:selector-filter:string", "jms-selector"}
_NO_LOCAL_NAMES = {"apache.org:no-local-filter:list", "no-local"}

SOLE_CONNECTION = "sole-connection-for-container"
_OFFERED = ("ANONYMOUS-RELAY", "DELAYED_DELIVERY", "SHARED-SUBS", SOLE_CONNECTION)


@dataclass(frozen=True)
class SourceFilters:
    selector: str | None = None
    no_local: bool = False


def _source_filters(data: Any) -> SourceFilters:
    """The filters of a source's filter set that the broker applies (a JMS selector
    and no-local); any other filter is refused rather than silently ignored."""
    obj = _first_object(data)
    if obj is None:
        return SourceFilters()
    if not isinstance(obj, dict):
        raise InvalidField("the source's filter set is not a map; send a map of filters")
    selector: str | None = None
    no_local = False
    for key, value in obj.items():
        desc = getattr(value, "descriptor", None)
        inner = getattr(value, "value", value)
        kind = str(desc) if isinstance(desc, str) else desc
        if (
            kind == SELECTOR_CODE
            or kind in _SELECTOR_NAMES
            or (desc is None and str(key) == "jms-selector")
        ):
            if not isinstance(inner, str):
                raise InvalidField(
                    f"selector filter {str(key)!r} must hold a string, not {type(inner).__name__}"
                )
            selector = inner.strip() or None
        elif kind == NO_LOCAL_CODE or kind in _NO_LOCAL_NAMES:
            no_local = True
        else:
            raise NotImplementedFeature(
                f"message filter {str(key)!r} (descriptor {desc!r}) is not supported; "
                "this broker applies JMS selectors (apache.org:selector-filter:string) "
                "and no-local (apache.org:no-local-filter:list)"
            )
    return SourceFilters(selector, no_local)


class AmqpConnection:
    def __init__(
        self,
        broker: Broker,
        *,
        limits: ConnectionLimits,
        auth: Authenticator,
        conn_id: str,
        peer: str = "",
        sync: SyncTracker | None = None,
        management: Any = None,
        on_dirty: Callable[[AmqpConnection], None] | None = None,
        authz: Authorizer | None = None,
        tls_identity: str | None = None,
    ) -> None:
        self.broker = broker
        #: subject (RFC 4514) of the client certificate verified by the TLS handshake;
        #: None on a plain connection or without a client certificate
        self.tls_identity = tls_identity
        #: None = security off: no check anywhere (links test this, not authz.enabled)
        self.authz = authz if authz is not None and authz.enabled else None
        self.limits = limits
        self.conn_id = conn_id
        self.peer = peer
        self.sync = sync
        self.management = management
        self._on_dirty = on_dirty
        self.dirty = False
        self.out_pending = 0
        self.high_water = limits.output_high_water
        self.output_blocked = False
        self.user: str | None = None
        self.remote_container: str | None = None
        self.links: dict[Any, Any] = {}
        #: open transactions of this connection, by txn-id (coordinator.py)
        self.txns = Transactions(limits.max_transaction_messages)
        #: temporary topics created by a link of this connection (deleted with it)
        self._temp_topics: dict[Any, Any] = {}
        self._sole_container: str | None = None
        self._sessions: set[Any] = set()
        self._closed = False
        self._opened = False
        self._cleaned = False
        self._sasl: SaslServer | None = SaslServer(
            auth, max_frame=max(limits.max_frame_size, 512), tls_identity=tls_identity
        )
        self._pre_output = b""
        self._sasl_failed = False
        #: Proton closed its input without a condition (see `_input_ended`)
        self._input_failed = False
        self.rbuf = fp.RecvBuffer()
        self._obuf = fp.OutputBuffer()

        t = proton.Transport(proton.Transport.SERVER)
        t.max_frame_size = limits.max_frame_size
        t.channel_max = limits.channel_max
        if limits.idle_timeout > 0:
            t.idle_timeout = limits.idle_timeout
        c = proton.Connection()
        coll = proton.Collector()
        c.collect(coll)
        t.bind(c)
        self._transport = t
        self._pconn = c
        self._collector = coll
        self._t = t._impl
        self._coll = coll._impl

    # --------------------------------------------------------------- I/O API
    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Bytes received from the peer."""
        if self._sasl is not None:
            s = self._sasl
            if data:
                s.feed(bytes(data))
            self._pre_output += s.take_output()
            if s.failed:
                self._sasl_failed = True
                log.info("%s: %s", self.log_prefix(), s.error)
                self.mark_dirty()
                return
            if not s.done:
                self.mark_dirty()
                return
            self.user = s.user
            data = s.take_passthrough()
            self._sasl = None
            self.mark_dirty()
            if not data:
                return
        fp.push_input(self._t, data)
        self.process()
        if not fp.input_open(self._t):
            self._input_ended()
        # input almost always produces output (dispositions, flow): flush this batch
        self.mark_dirty()

    @property
    def in_sasl(self) -> bool:
        """The SASL exchange is still running."""
        return self._sasl is not None and not self._sasl_failed

    @property
    def sasl_may_block(self) -> bool:
        """Feeding the SASL layer may verify a password (PBKDF2, tens of ms; PLAIN or
        SCRAM-SHA-256 offered): the net layer then runs `sasl_feed` in a worker thread."""
        return self.in_sasl and self._sasl is not None and self._sasl.may_block

    def sasl_feed(self, data: bytes) -> None:
        """Feed the SASL layer only; touches nothing else, so it may run in a thread.
        Call `feed(b"")` afterwards on the event loop to carry on."""
        if self._sasl is not None:
            self._sasl.feed(data)

    @property
    def opened(self) -> bool:
        return self._opened

    @property
    def transport_failed(self) -> bool:
        """Proton ended the transport with an error (idle timeout, framing error, a
        frame it could not dispatch)."""
        return self._input_failed or (self._sasl is None and self._transport.condition is not None)

    def _input_ended(self) -> None:
        """Proton closed its input side. After the peer's close, or with a condition
        of its own (a framing error it answers itself), there is nothing to add. But a
        frame it cannot dispatch (an unknown performative descriptor, a SASL frame after
        the AMQP open, an encoding nested too deeply) ends its input silently: the peer
        would get no answer and the connection would hold its slots until the idle
        timeout, so the broker closes it here with amqp:decode-error."""
        if self._input_failed or self._transport.condition is not None:
            return
        if self._pconn.state & proton.Endpoint.REMOTE_CLOSED:
            return
        self._input_failed = True
        log.info(
            "%s: a frame could not be decoded (unknown performative, SASL frame after "
            "the open, or nested too deeply); connection closed with amqp:decode-error",
            self.log_prefix(),
        )
        self.cleanup(failed=True)
        self.close(
            "amqp:decode-error",
            "the broker could not decode a frame you sent: an unknown performative "
            "descriptor, a SASL frame after the AMQP open, or an encoding nested too "
            "deeply; send only AMQP 1.0 performatives after the open",
        )
        self.mark_dirty()

    def process(self) -> None:
        """Handle pending engine events."""
        fp.pump(self._coll, self.links, self._control)

    def output(self) -> memoryview | bytes | None:
        """Bytes to send; empty when none; None when the connection is finished
        (all output written and the transport closed)."""
        if self._pre_output:
            return self._pre_output
        if self._sasl_failed:
            return None
        if self._sasl is not None:
            return b""
        out = self._obuf.peek(self._t)
        if self._input_failed and out is not None and not out:
            # nothing more can come (Proton holds a close back until the peer's open)
            return None
        return out

    def consumed(self, n: int) -> None:
        if self._pre_output:
            self._pre_output = self._pre_output[n:]
        else:
            fp.pop_output(self._t, n)

    def flushed(self) -> None:
        """The net layer wrote what it could; `out_pending` is recomputed."""
        self.dirty = False
        self.out_pending = 0 if self._sasl is not None else max(fp.pending_output(self._t), 0)
        if self.output_blocked and self.out_pending <= self.limits.output_low_water:
            self.unblock_output()

    def input_closed(self) -> None:
        """The peer closed its side of the socket (after an AMQP close, or not)."""
        if self._sasl is None:
            fp.close_input(self._t)
            self.process()
        self.cleanup(failed=True)
        self.mark_dirty()

    def abort(self) -> None:
        """The socket failed: nothing more will be sent or received."""
        if self._sasl is None:
            fp.close_input(self._t)
            fp.close_output(self._t)
            self.process()
        self.cleanup(failed=True)

    def tick(self, now_ms: int) -> int:
        """Heartbeats and idle timeout; returns the next deadline in ms (0 = none)."""
        if self._sasl is not None:
            return 0
        deadline = fp.tick(self._t, now_ms)
        self.process()
        return deadline

    def close(self, condition: str, description: str) -> None:
        """Close the connection from our side (shutdown, limits)."""
        if self._closed:
            return
        self._closed = True
        if self._sasl is not None:
            self._sasl_failed = True
            return
        self.cleanup(failed=False)
        self._pconn.condition = Condition(condition, description)
        self._pconn.close()
        self.mark_dirty()

    @property
    def unsettled_count(self) -> int:
        return sum(len(h.unsettled) for h in self.links.values() if isinstance(h, ConsumerLink))

    # ----------------------------------------------------------- output flow
    def mark_dirty(self) -> None:
        if not self.dirty:
            self.dirty = True
            if self._on_dirty is not None:
                self._on_dirty(self)

    def block_output(self) -> None:
        self.output_blocked = True
        for h in self.links.values():
            if isinstance(h, ConsumerLink):
                h.blocked = True

    def unblock_output(self) -> None:
        self.output_blocked = False
        for h in list(self.links.values()):
            if isinstance(h, ConsumerLink):
                h.blocked = False
                if h.queue is not None and h.credit > 0:
                    h.queue.credit_changed(h)

    # -------------------------------------------------------- control events
    def _control(self, ev: Any) -> None:
        t = fp.event_type(ev)
        if self._cleaned and t in (EV_LINK_REMOTE_OPEN, EV_SSN_REMOTE_OPEN):
            # the connection is closing (refused, errored): a session or link the peer
            # begins after that would be registered after `cleanup` and never freed
            return
        try:
            if t == EV_LINK_REMOTE_OPEN:
                self._on_link_open(Link.wrap(fp.event_link(ev)))
            elif t in (EV_LINK_REMOTE_CLOSE, EV_LINK_REMOTE_DETACH):
                self._on_link_close(Link.wrap(fp.event_link(ev)), t == EV_LINK_REMOTE_CLOSE)
            elif t == EV_SSN_REMOTE_OPEN:
                self._on_session_open(proton.Session.wrap(fp.event_session(ev)))
            elif t == EV_SSN_REMOTE_CLOSE:
                self._on_session_close(proton.Session.wrap(fp.event_session(ev)))
            elif t == EV_CONN_REMOTE_OPEN:
                self._on_open()
            elif t == EV_CONN_REMOTE_CLOSE:
                self._on_remote_close()
            elif t == EV_TRANSPORT_ERROR:
                cond = self._transport.condition
                # Proton reports an abort once per direction: log the first only
                if cond is not None and not self._cleaned:
                    log.info(
                        "%s: transport error %s: %s",
                        self.log_prefix(),
                        cond.name,
                        cond.description,
                    )
                self.cleanup(failed=True)
            elif t == EV_TRANSPORT_CLOSED:
                self.cleanup(failed=True)
        except UnicodeDecodeError as exc:
            # Proton decodes string fields (container-id, link name, address...) only
            # when they are read: a peer's bad UTF-8 is its error, not ours
            log.info("%s: invalid UTF-8: %s", self.log_prefix(), exc)
            self.close(
                "amqp:decode-error",
                f"a string field of your frame is not valid UTF-8 ({exc.reason} at byte "
                f"{exc.start}); AMQP strings must be UTF-8",
            )
        except Exception:
            log.exception(
                "%s: internal error handling %s; connection closed",
                self.log_prefix(),
                proton.Event.TYPES.get(t, t) if hasattr(proton.Event, "TYPES") else t,
            )
            self.close("amqp:internal-error", "the broker hit an internal error on this connection")

    def _on_open(self) -> None:
        c = self._pconn
        self.remote_container = c.remote_container
        c.container = self.limits.container_id
        c.offered_capabilities = proton.SymbolList([symbol(x) for x in _OFFERED])
        props: dict[Any, Any] = {symbol("product"): "amqbroker", symbol("version"): __version__}
        c.properties = props
        container = self.remote_container or ""
        desired = {str(x) for x in (c.remote_desired_capabilities or ())}
        if SOLE_CONNECTION in desired and container:
            holder = self.broker.containers.get(container)
            if holder is not None:
                props[symbol("amqp:connection-establishment-failed")] = True
                c.properties = props
                c.open()
                self._opened = True
                log.info(
                    "%s: refused: container-id %r is in use by connection %s",
                    self.log_prefix(),
                    container,
                    holder,
                )
                self._closed = True
                self.cleanup(failed=False)
                c.condition = Condition(
                    "amqp:invalid-field",
                    f"container-id (JMS clientID) {container!r} is already in use by "
                    "another connection; close it or use another clientID",
                    {symbol("invalid-field"): symbol("container-id")},
                )
                c.close()
                self.mark_dirty()
                return
            self.broker.containers[container] = self.conn_id
            self._sole_container = container
        c.open()
        self._opened = True
        log.debug(
            "%s: open, container-id %r, user %r",
            self.log_prefix(),
            self.remote_container,
            self.user,
        )
        if self.limits.refuse_reason:
            self.close("amqp:resource-limit-exceeded", self.limits.refuse_reason)

    def _on_remote_close(self) -> None:
        self.cleanup(failed=False)
        if not self._closed:
            self._closed = True
            self._pconn.close()
        self.mark_dirty()

    def _on_session_open(self, ssn: Any) -> None:
        if len(self._sessions) >= self.limits.max_sessions:
            ssn.open()
            ssn.condition = Condition(
                "amqp:resource-limit-exceeded",
                f"too many sessions on this connection (max_sessions_per_connection="
                f"{self.limits.max_sessions}); close sessions you no longer use",
            )
            ssn.close()
            return
        self._sessions.add(ssn._impl)
        ssn.open()

    def _on_session_close(self, ssn: Any) -> None:
        ptr = ssn._impl
        for lptr, h in list(self.links.items()):
            if fp.link_session(lptr) == ptr:
                self._detach_handler(lptr, h)
                link = h.link
                if link.state & proton.Endpoint.LOCAL_ACTIVE:
                    link.close()
        self._sessions.discard(ptr)
        ssn.close()
        ssn.free()
        self.mark_dirty()

    def _refuse_link(self, link: Any, err: BrokerError) -> None:
        wanted = link.remote_source.address if link.is_sender else link.remote_target.address
        log.info(
            "%s: refused %s attach: %s %s",
            self.log_prefix(link.name, address=wanted),
            "consumer" if link.is_sender else "producer",
            err.condition,
            err.description,
        )
        # attach with a null source/target, then detach with the error (Qpid JMS
        # turns this into InvalidDestinationException)
        if link.is_sender:
            link.target.copy(link.remote_target)
            link.source.type = Terminus.UNSPECIFIED
        else:
            link.source.copy(link.remote_source)
            link.target.type = Terminus.UNSPECIFIED
        link.open()
        link.condition = Condition(err.condition, err.description)
        link.close()
        self.mark_dirty()

    def _on_link_open(self, link: Any) -> None:
        try:
            if len(self.links) >= self.limits.max_links:
                raise ResourceLimitExceeded(
                    f"too many links on this connection (max_links_per_connection="
                    f"{self.limits.max_links}); close links you no longer use"
                )
            if link.is_sender:
                self._attach_consumer(link)
            else:
                self._attach_producer(link)
        except BrokerError as err:
            self._refuse_link(link, err)
        else:
            h = self.links.get(link._impl)
            if h is not None and log.isEnabledFor(logging.DEBUG):
                log.debug("%s: %s attached", self._link_prefix(h), _link_kind(h))
        self.mark_dirty()

    def authorize(self, permission: str, address: str, *, create: bool = True) -> None:
        """Raise Unauthorized unless this connection's user holds `permission` on
        `address`, and also 'create_address' when the attach would auto-create it
        (`create`). Called once per attach of a named link; dynamic nodes (temporary
        queues and topics) are the client's own and are never checked."""
        authz = self.authz
        if authz is None:
            return
        authz.check(self.user, permission, address)
        if create:
            name = address.partition("?")[0]
            broker = self.broker
            if name not in broker.addresses and broker.resolve(name).auto_create_addresses:
                authz.check(self.user, "create_address", name)

    def _attach_consumer(self, link: Any) -> None:
        src = link.remote_source
        filters = _source_filters(src.filter)
        caps = _symbols(src.capabilities)
        hint = next((_ROUTING_CAPS[c] for c in caps if c in _ROUTING_CAPS), None)
        broker = self.broker
        temporary = False
        address = src.address
        if not src.dynamic and not address:
            self._attach_unsubscribe(link)
            return
        if address == MANAGEMENT_ADDRESS:
            raise NotFound(
                "'$management' takes requests: attach a sender to it and receive the "
                "replies on a dynamic or named reply address"
            )
        container = self.remote_container or ""
        if src.dynamic:
            if "temporary-topic" in caps:
                a = broker.create_temporary_topic()
                self._temp_topics[link._impl] = a
                q = broker.queue_for_consumer(a.name, MULTICAST, subscription=link.name)
            else:
                q = broker.create_temporary_queue()
                temporary = True
        elif src.distribution_mode == Terminus.DIST_MODE_COPY and (
            hint != MULTICAST and "shared" not in caps
        ):
            self._attach_browser(link, address, hint, filters)
            return
        elif (
            "shared" in caps
            or src.durability != Terminus.NONDURABLE
            or src.expiry_policy == Terminus.EXPIRE_NEVER
        ) and (hint == MULTICAST or "shared" in caps or broker.is_topic(address)):
            shared = "shared" in caps
            name = link.name.partition("|")[0] if shared else link.name
            self.authorize("consume", address)
            sub = Subscription(
                name,
                container="" if (shared and "global" in caps) else container,
                durable=src.durability != Terminus.NONDURABLE
                or src.expiry_policy == Terminus.EXPIRE_NEVER,
                shared=shared,
                selector=filters.selector,
                no_local=filters.no_local,
            )
            old = broker.queues.get(sub.queue_name)
            if old is not None and old.address is not None:
                # re-subscribing on another topic removes the old subscription
                self.authorize("consume", old.address.name, create=False)
            q = self._guard_selector(
                lambda: broker.subscription_queue(address, sub, origin=self.conn_id)
            )
            if not shared and q.consumer_count:
                raise PreconditionFailed(
                    f"durable subscription '{name}' already has an active consumer; JMS "
                    "allows one per non-shared subscription (use a shared subscription "
                    "for several)"
                )
        else:
            self.authorize("consume", address)
            q = broker.queue_for_consumer(address, hint, subscription=link.name)
        consumer_filter = None
        if q.address is not None and q.address.routing == MULTICAST:
            if q.subscription and q.subscription_name is None:
                # this consumer's own subscription queue: filter at routing time
                self._guard_selector(
                    lambda: broker.filter_subscription(
                        q, filters.selector, filters.no_local, origin=self.conn_id
                    )
                )
        elif filters.selector or filters.no_local:
            consumer_filter = self._consumer_filter(filters)
        priority = 0
        props = link.remote_properties
        if props:
            p = props.get(symbol("priority"))
            if isinstance(p, int):
                priority = int(p)
        presettled = link.remote_snd_settle_mode == Link.SND_SETTLED
        # the source is answered as the client sent it (address options included:
        # clients such as python-qpid-proton's BlockingConnection check the echo);
        # only a dynamic node gets the name the broker gave it
        link.source.copy(src)
        if src.dynamic:
            link.source.address = q.address.name if q.address is not None else q.name
        link.target.copy(link.remote_target)
        link.snd_settle_mode = Link.SND_SETTLED if presettled else Link.SND_UNSETTLED
        link.rcv_settle_mode = Link.RCV_FIRST
        h = ConsumerLink(
            self, link, priority=priority, presettled=presettled, temporary_queue=temporary
        )
        h.filter = consumer_filter
        self.links[h.ptr] = h
        link.open()
        q.add_consumer(h)

    def _guard_selector(self, make: Callable[[], Any]) -> Any:
        try:
            return make()
        except SelectorError as exc:
            raise InvalidField(f"invalid JMS selector: {exc}") from exc

    def _consumer_filter(self, filters: SourceFilters) -> Callable[[Any], bool]:
        """A queue consumer's filter: its selector, and no-local (skip messages this
        connection sent)."""
        sel = None
        if filters.selector:
            sel = self._guard_selector(
                lambda: self.broker.codec.selector_filter(filters.selector or "")
            )
        if not filters.no_local:
            assert sel is not None
            return sel  # type: ignore[no-any-return]
        me = self.conn_id
        if sel is None:
            return lambda e: e.origin != me
        match = sel
        return lambda e: e.origin != me and match(e)

    def _attach_browser(
        self, link: Any, address: str, hint: str | None, filters: SourceFilters
    ) -> None:
        """A queue browser (source distribution-mode copy): sees the queue's messages
        in order, as they are when it attaches, without consuming them."""
        self.authorize("browse", address)
        q = self.broker.queue_for_consumer(address, hint)
        match = self._consumer_filter(filters) if filters.selector or filters.no_local else None
        link.source.copy(link.remote_source)
        link.target.copy(link.remote_target)
        link.snd_settle_mode = Link.SND_SETTLED
        h = BrowserLink(self, link, q, match)
        self.links[h.ptr] = h
        link.open()

    def _attach_unsubscribe(self, link: Any) -> None:
        """An attach with no source address names an existing subscription by its link
        name (Qpid JMS unsubscribes this way: attach, then close the link)."""
        q = self.broker.find_subscription(link.name, self.remote_container or "")
        if q is None:
            raise NotFound(
                f"no subscription named {link.name!r} (a consumer must name a source "
                "address, ask for a dynamic node, or name an existing subscription)"
            )
        if q.consumer_count:
            raise PreconditionFailed(
                f"subscription {q.subscription_name!r} has active consumers; close them "
                "before unsubscribing"
            )
        # closing this link removes the subscription: that takes 'consume' on its topic
        self.authorize("consume", q.address.name if q.address is not None else q.name, create=False)
        src = link.source
        src.address = q.address.name if q.address is not None else q.name
        src.durability = Terminus.DELIVERIES if q.durable else Terminus.NONDURABLE
        src.expiry_policy = Terminus.EXPIRE_NEVER if q.durable else Terminus.EXPIRE_WITH_LINK
        src.distribution_mode = Terminus.DIST_MODE_COPY
        src.capabilities.put_array(False, proton.Data.SYMBOL)
        src.capabilities.enter()
        src.capabilities.put_symbol("topic")
        src.capabilities.exit()
        link.target.copy(link.remote_target)
        h = ConsumerLink(self, link, priority=0, presettled=False, temporary_queue=False)
        self.links[h.ptr] = h
        link.open()
        q.add_consumer(h)

    def _attach_producer(self, link: Any) -> None:
        tgt = link.remote_target
        broker = self.broker
        if tgt.type == Terminus.COORDINATOR:
            self._attach_coordinator(link)
            return
        temp = None
        address = None
        if tgt.dynamic and "temporary-topic" in _symbols(tgt.capabilities):
            address = broker.create_temporary_topic()
            self._temp_topics[link._impl] = address
            name = address.name
        elif tgt.dynamic:
            temp = broker.create_temporary_queue()
            address = temp.address
            name = temp.name
        elif tgt.address is None:
            name = None  # anonymous relay
        elif tgt.address == MANAGEMENT_ADDRESS and self.management is not None:
            self._attach_management(link)
            return
        elif self.management is not None and tgt.address in getattr(self.management, "targets", {}):
            # registered special targets (the cluster's `$cluster.inbound`)
            h = self.management.targets[tgt.address](self, link)
            self.links[h.ptr] = h
            link.target.copy(tgt)
            link.source.copy(link.remote_source)
            link.rcv_settle_mode = Link.RCV_FIRST
            link.snd_settle_mode = link.remote_snd_settle_mode
            link.open()
            h.start()
            return
        else:
            caps = _symbols(tgt.capabilities)
            hint = next((_ROUTING_CAPS[c] for c in caps if c in _ROUTING_CAPS), None)
            self.authorize("send", tgt.address)
            address = broker.address_for_producer(tgt.address, hint)
            name = tgt.address
        link.target.copy(tgt)
        if name is not None:
            link.target.address = name
        link.source.copy(link.remote_source)
        link.rcv_settle_mode = Link.RCV_FIRST
        link.snd_settle_mode = link.remote_snd_settle_mode
        link.max_message_size = self.limits.max_message_size
        h = ProducerLink(
            self,
            link,
            address,
            window=self.limits.link_credit,
            max_size=self.limits.max_message_size,
            temporary_queue=temp,
        )
        if address is not None:
            address.producers += 1
        self.links[h.ptr] = h
        link.open()
        h.start()

    def _attach_coordinator(self, link: Any) -> None:
        caps = _symbols(link.remote_target.capabilities)
        if caps and LOCAL_TRANSACTIONS not in caps:
            raise NotImplementedFeature(
                f"this broker supports local transactions only ({LOCAL_TRANSACTIONS}); "
                f"the coordinator asked for {', '.join(sorted(caps))}"
            )
        link.target.copy(link.remote_target)
        link.source.copy(link.remote_source)
        link.rcv_settle_mode = Link.RCV_FIRST
        link.snd_settle_mode = link.remote_snd_settle_mode
        h = CoordinatorLink(self, link)
        self.links[h.ptr] = h
        link.open()
        h.start()

    def _attach_management(self, link: Any) -> None:
        # refused at attach (and every request is checked again by the node)
        self.authorize("manage", MANAGEMENT_ADDRESS, create=False)
        h = self.management.attach(self, link)
        self.links[h.ptr] = h
        link.target.copy(link.remote_target)
        link.source.copy(link.remote_source)
        link.open()
        h.start()

    def _on_link_close(self, link: Any, closed: bool) -> None:
        ptr = link._impl
        h = self.links.get(ptr)
        if h is not None:
            q = h.queue if isinstance(h, ConsumerLink) else None
            where = self._link_prefix(h)
            self._detach_handler(ptr, h)
            log.debug("%s: %s by the client", where, "closed" if closed else "detached")
            if (
                closed
                and q is not None
                and q.durable
                and q.subscription_name is not None
                and not q.deleted
                and not q.consumer_count
            ):
                # detach keeps a durable subscription, close removes it (unsubscribe)
                log.info("%s: durable subscription removed (link closed)", where)
                self.broker.delete_queue(q)
        if closed:
            link.close()
        else:
            link.detach()
        link.free()
        self.mark_dirty()

    def _detach_handler(self, ptr: Any, h: Any, failed: bool = False) -> None:
        del self.links[ptr]
        h.detach(self.broker, failed)
        a = self._temp_topics.pop(ptr, None)
        if a is not None:
            self._drop_temporary_topic(a)

    def _drop_temporary_topic(self, a: Any) -> None:
        for c in self.broker.delete_address(a):
            if isinstance(c, ConsumerLink) and c.conn is not self:
                c.conn.detach_link(c, "amqp:resource-deleted", "the temporary topic was deleted")
            elif isinstance(c, ConsumerLink):
                self.detach_link(c, "amqp:resource-deleted", "the temporary topic was deleted")

    def detach_link(
        self, h: ConsumerLink | ProducerLink | CoordinatorLink, condition: str, description: str
    ) -> None:
        """Close a link from our side (its queue was deleted, message too large...)."""
        if self.links.get(h.ptr) is h:
            self._detach_handler(h.ptr, h)
            h.link.condition = Condition(condition, description)
            h.link.close()
            self.mark_dirty()

    def log_prefix(
        self, link: str | None = None, *, queue: str | None = None, address: str | None = None
    ) -> str:
        """How every log line about this connection (or one of its links) starts:
        `connection c12 from 127.0.0.1:5555: link 'x' on queue 'orders'`."""
        where = f"connection {self.conn_id} from {self.peer or '?'}"
        if link is None:
            return where
        where += f": link {link!r}"
        if queue is not None:
            return f"{where} on queue {queue!r}"
        if address is not None:
            return f"{where} on address {address!r}"
        return where

    def _link_prefix(self, h: Any) -> str:
        q = getattr(h, "queue", None)
        a = getattr(h, "address", None)
        return self.log_prefix(
            h.link.name,
            queue=q.name if q is not None else None,
            address=a.name if a is not None else None,
        )

    def cleanup(self, *, failed: bool) -> None:
        """Detach every link handler (idempotent). `failed`: the connection was lost
        rather than closed, so unsettled messages count a failed delivery attempt."""
        if self._cleaned:
            return
        self._cleaned = True
        log.debug(
            "%s: %s (%d link(s) open)",
            self.log_prefix(),
            "lost" if failed else "closed",
            len(self.links),
        )
        if self.txns:
            # roll back first: returned messages go back to their places before the
            # consumers detach and release their groups; no credit, so none of them is
            # handed again to a consumer of this connection on its way out
            for h in self.links.values():
                if isinstance(h, ConsumerLink):
                    h.credit = 0
            self.txns.rollback_all(self.broker)
        if self._sole_container is not None:
            if self.broker.containers.get(self._sole_container) == self.conn_id:
                del self.broker.containers[self._sole_container]
            self._sole_container = None
        for ptr, h in list(self.links.items()):
            self._detach_handler(ptr, h, failed)
        self._sessions.clear()

    @property
    def open_links(self) -> int:
        return len(self.links)

    @property
    def open_sessions(self) -> int:
        return len(self._sessions)
