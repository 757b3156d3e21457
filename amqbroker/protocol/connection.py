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

Link attach and detach (terminus parsing, authorisation, refusals, building the
handler) live in attach.py; the handlers see this object only as a `host.LinkHost`.

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
from typing import Any

import proton
from proton import Condition, Link, symbol

from amqbroker import __version__
from amqbroker.core.auth import Authenticator
from amqbroker.core.authz import Authorizer
from amqbroker.core.broker import Broker
from amqbroker.core.transaction import Transactions
from amqbroker.protocol import attach
from amqbroker.protocol import fastpath as fp
from amqbroker.protocol.coordinator import CoordinatorLink
from amqbroker.protocol.host import ConnectionLimits
from amqbroker.protocol.links import ConsumerLink, ProducerLink, SyncTracker
from amqbroker.protocol.sasl import SaslServer

#: ConnectionLimits is defined in host.py (links name it too) and imported from here
__all__ = ["AmqpConnection", "ConnectionLimits"]

log = logging.getLogger(__name__)


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

SOLE_CONNECTION = "sole-connection-for-container"
#: the open property naming where a client may reconnect (Qpid JMS, Artemis):
#: a list of maps {network-host, port}; the client keeps its own scheme
FAILOVER_SERVER_LIST = symbol("failover-server-list")


def failover_list(servers: list[tuple[str, int]]) -> list[dict[Any, Any]]:
    """The ``failover-server-list`` value for (host, port) pairs."""
    return [{symbol("network-host"): h, symbol("port"): p} for h, p in servers]


_OFFERED = ("ANONYMOUS-RELAY", "DELAYED_DELIVERY", "SHARED-SUBS", SOLE_CONNECTION)


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
                attach.open_link(self, Link.wrap(fp.event_link(ev)))
            elif t in (EV_LINK_REMOTE_CLOSE, EV_LINK_REMOTE_DETACH):
                attach.close_link(self, Link.wrap(fp.event_link(ev)), t == EV_LINK_REMOTE_CLOSE)
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
        if self.limits.failover_servers is not None:
            servers = self.limits.failover_servers()
            if servers:
                props[FAILOVER_SERVER_LIST] = failover_list(servers)
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
                attach.detach_handler(self, lptr, h)
                link = h.link
                if link.state & proton.Endpoint.LOCAL_ACTIVE:
                    link.close()
        self._sessions.discard(ptr)
        ssn.close()
        ssn.free()
        self.mark_dirty()

    def detach_link(
        self, h: ConsumerLink | ProducerLink | CoordinatorLink, condition: str, description: str
    ) -> None:
        """Close a link from our side (its queue was deleted, message too large...)."""
        if self.links.get(h.ptr) is h:
            attach.detach_handler(self, h.ptr, h)
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
            attach.detach_handler(self, ptr, h, failed)
        self._sessions.clear()

    @property
    def open_links(self) -> int:
        return len(self.links)

    @property
    def open_sessions(self) -> int:
        return len(self._sessions)
