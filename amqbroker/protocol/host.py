"""What a link needs of its connection: the `LinkHost` protocol, and the pieces it names.

Link handlers (links.py, browser.py, coordinator.py, cluster_links.py, and the attach
code in attach.py) are written against `LinkHost`, not `AmqpConnection`: the
connection imports them, they never import it, so the protocol layer has no circle.
`AmqpConnection` is the one implementation; tests may give a smaller one.

Also here, because both sides name them: `ConnectionLimits` (the bounds and hooks of a
connection, from the settings), `SyncTracker` (producers and coordinators waiting for
the store to sync a batch), and `authorize` (the per-attach permission check).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from amqbroker.protocol import fastpath as fp

if TYPE_CHECKING:
    from amqbroker.core.authz import Authorizer
    from amqbroker.core.broker import Broker
    from amqbroker.core.transaction import Transactions


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
    #: the servers a client may fail over to (host, port), advertised in the open's
    #: ``failover-server-list`` property (read by Qpid JMS); None = not advertised
    failover_servers: Callable[[], list[tuple[str, int]]] | None = None


class LinkHost(Protocol):
    """The connection as its links see it."""

    broker: Broker
    limits: ConnectionLimits
    conn_id: str
    #: the client's container id (None before its open)
    remote_container: str | None
    #: the authenticated user (None = anonymous)
    user: str | None
    #: None = security off (no check anywhere)
    authz: Authorizer | None
    #: None = no store to wait for (every transfer is accepted at once)
    sync: SyncTracker | None
    #: the connection's receive buffer, shared by its incoming links
    rbuf: fp.RecvBuffer
    #: open transactions of the connection, by txn-id
    txns: Transactions
    #: output flow: flush pending / bytes written since the last flush / bound
    dirty: bool
    out_pending: int
    high_water: int
    output_blocked: bool

    def mark_dirty(self) -> None:
        """Ask the net layer to flush this connection at the end of the batch."""
        ...

    def block_output(self) -> None:
        """Output passed the high-water mark: consumers stop until it drains."""
        ...

    def log_prefix(
        self, link: str | None = None, *, queue: str | None = None, address: str | None = None
    ) -> str: ...

    def detach_link(self, h: Any, condition: str, description: str) -> None:
        """Close link handler `h` from the broker's side with this error."""
        ...


def authorize(host: LinkHost, permission: str, address: str, *, create: bool = True) -> None:
    """Raise Unauthorized unless the host's user holds `permission` on `address`, and
    also 'create_address' when the attach would auto-create it (`create`). Called once
    per attach of a named link (and per new destination of an anonymous relay);
    dynamic nodes (temporary queues and topics) are the client's own and never checked."""
    authz = host.authz
    if authz is None:
        return
    authz.check(host.user, permission, address)
    if create:
        name = address.partition("?")[0]
        broker = host.broker
        if name not in broker.addresses and broker.resolve(name).auto_create_addresses:
            authz.check(host.user, "create_address", name)


class SyncWaiter(Protocol):
    """A link waiting for store batches (producers; the coordinator's commits)."""

    #: (delivery, number of the store batch that must sync before it is accepted)
    waiting: deque[tuple[Any, int]]
    #: detached: deliveries whose batch synced are dropped, not accepted
    closed: bool
    conn: LinkHost


class SyncTracker:
    """Producers waiting for the store to sync the batch holding their messages."""

    def __init__(self, ticket: Callable[[], int]) -> None:
        #: number of the store batch that will hold records appended now
        self.ticket = ticket
        self.waiters: set[SyncWaiter] = set()
        #: the last store batch on disk
        self.synced_no = -1

    def synced(self, batch_no: int) -> None:
        """Store batch `batch_no` is on disk: accept every waiter's deliveries up to it
        (a closed link's are only dropped); a waiter with none left stops waiting."""
        self.synced_no = batch_no
        for w in list(self.waiters):
            waiting = w.waiting
            n = 0
            while waiting and waiting[0][1] <= batch_no:
                d, _ = waiting.popleft()
                if not w.closed:
                    fp.accept(d)
                n += 1
            if not waiting:
                self.waiters.discard(w)
            if n and not w.conn.dirty:
                w.conn.mark_dirty()
