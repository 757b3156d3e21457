"""The receiving end of a cluster bridge: the `$cluster.inbound` link.

A peer's bridge (store-and-forward queue + outbound link, see `amqbroker.cluster`)
attaches a sender to `$cluster.inbound` on this node. Each transfer is an envelope
(`peer.wrap_forward`): the original message bytes, the target queue name and the
bridge duplicate id. This link unwraps it, drops a duplicate (a resend after a lost
acknowledgement: the id is in the peer's window of recently seen ids) with `accepted`,
and otherwise routes the original bytes to the target queue's address exactly like an
ordinary producer link would (the same core `accept`), but without asking the cluster
router again (the entry node already decided: max-hops 1). Durable messages are
accepted only once synced, so the entry node keeps its copy until then.

Invariants: an id is remembered before the message is routed, in a bounded window per
peer (oldest forgotten first, `window` ids); ids carry the sender's boot id, so a
restarted sender never collides with its previous life. The window lives in memory:
after a restart of this node a resend of an already stored message is stored again
(at-least-once, documented).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from amqbroker.core.errors import BrokerError, Unauthorized
from amqbroker.protocol import fastpath as fp
from amqbroker.protocol.links import ProducerLink
from amqbroker.protocol.peer import unwrap_forward

if TYPE_CHECKING:
    from amqbroker.protocol.connection import AmqpConnection
    from amqbroker.protocol.host import LinkHost

log = logging.getLogger(__name__)

INBOUND_ADDRESS = "$cluster.inbound"


class DuplicateWindow:
    """Recently seen bridge ids, per sending node, bounded."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._seen: dict[str, OrderedDict[str, None]] = {}
        self.duplicates = 0

    def seen(self, bridge_id: str) -> bool:
        """True if `bridge_id` was already seen; remembers it otherwise."""
        node = bridge_id.partition(":")[0]
        w = self._seen.get(node)
        if w is None:
            w = self._seen[node] = OrderedDict()
        elif bridge_id in w:
            self.duplicates += 1
            return True
        w[bridge_id] = None
        while len(w) > self.size:
            w.popitem(last=False)
        return False


class BridgeInboundLink(ProducerLink):
    __slots__ = ("dups",)

    def __init__(self, conn: LinkHost, link: Any, window: DuplicateWindow) -> None:
        super().__init__(
            conn,
            link,
            None,
            window=conn.limits.link_credit,
            max_size=conn.limits.max_message_size,
        )
        self.dups = window
        self.bypass_router = True

    def _route(self, d: Any, data: bytes, presettled: bool) -> None:
        try:
            bridge_id, target, inner = unwrap_forward(data)
        except ValueError as exc:
            self._refuse(d, presettled, "amqp:decode-error", str(exc))
            return
        if self.dups.seen(bridge_id):
            log.debug("duplicate forwarded message %s dropped", bridge_id)
            if presettled:
                fp.settle(d)
            else:
                fp.accept(d)
            return
        try:
            # an existing address is what address_for_producer would return for a
            # plain name (no options, no routing hint): the dict lookup first
            a = self.broker.addresses.get(target)
            self.address = a if a is not None else self.broker.address_for_producer(target)
        except BrokerError as exc:
            self._refuse(d, presettled, exc.condition, exc.description)
            return
        try:
            super()._route(d, inner, presettled)
        finally:
            self.address = None


def inbound_factory(
    window: DuplicateWindow, authorize: Callable[[AmqpConnection], str | None]
) -> Callable[[AmqpConnection, Any], Any]:
    """A `ManagementNode.targets` factory; `authorize` returns a refusal reason or None."""

    def make(conn: AmqpConnection, link: Any) -> BridgeInboundLink:
        reason = authorize(conn)
        if reason is not None:
            raise Unauthorized(reason)
        return BridgeInboundLink(conn, link, window)

    return make
