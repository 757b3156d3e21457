"""Owner policies: which consumer takes a message that no group owner claims yet.

A policy is one function `(tiers, entry, marks) -> Consumer | None`. `tiers` are the
queue's consumers grouped by priority, highest first (`Tier`); `marks` are the
queue's undeliverable-here marks (entry -> consumers that refused it). The function
returns the consumer that takes `entry` now, or None when no ready consumer (credit,
not blocked) accepts it. It never changes anything but a tier's round-robin pointer.

The group dispatcher (`amqbroker.core.group_dispatch`) calls the queue's policy for the
first message of an unbound group, from the dispatch pass and from the enqueue fast
path alike (`GroupDispatcher.offer`, the one decision function); ungrouped messages
always go round robin (GROUPING 3.4, decision D3).

Adding a policy is one function here and one line in `OWNER_POLICIES` (the setting's
accepted values are declared with the address settings).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from amqbroker.core.consumer import Consumer
    from amqbroker.core.entry import Entry

#: undeliverable-here marks: entry -> consumers that must not get it again
Marks = dict["Entry", set["Consumer"]]


class Tier:
    """Consumers of one priority level, in attach order, with the round-robin pointer."""

    __slots__ = ("consumers", "priority", "rr")

    def __init__(self, priority: int) -> None:
        self.priority = priority
        self.consumers: list[Consumer] = []
        self.rr = 0


def accepts(c: Consumer, e: Entry, marks: Marks) -> bool:
    """`c` would take `e` (its filter matches, and it did not refuse `e` before)."""
    if c.filter is not None and not c.filter(e):
        return False
    if marks:
        m = marks.get(e)
        return m is None or c not in m
    return True


def any_ready(tiers: list[Tier]) -> bool:
    """Some consumer has credit and is not blocked."""
    for tier in tiers:
        for c in tier.consumers:
            if c.credit > 0 and not c.blocked:
                return True
    return False


def round_robin(tiers: list[Tier], e: Entry, marks: Marks) -> Consumer | None:
    """Round robin within the highest priority tier that has a taker (Artemis)."""
    for tier in tiers:
        cs = tier.consumers
        n = len(cs)
        start = tier.rr
        for i in range(n):
            idx = start + i
            if idx >= n:
                idx -= n
            c = cs[idx]
            if (
                c.credit > 0
                and not c.blocked
                and ((c.filter is None and not marks) or accepts(c, e, marks))
            ):
                tier.rr = idx + 1 if idx + 1 < n else 0
                return c
    return None


def least_loaded(tiers: list[Tier], e: Entry, marks: Marks) -> Consumer | None:
    """Fewest bound groups, then least recently served (Classic, AMQ-2106)."""
    for tier in tiers:
        best: Consumer | None = None
        for c in tier.consumers:
            if (
                c.credit > 0
                and not c.blocked
                and accepts(c, e, marks)
                and (
                    best is None
                    or (len(c.bound), c.last_delivery) < (len(best.bound), best.last_delivery)
                )
            ):
                best = c
        if best is not None:
            return best
    return None


OwnerPolicy = Callable[[list[Tier], "Entry", Marks], "Consumer | None"]

#: `group_owner_policy` value -> policy; an unknown value means round robin
OWNER_POLICIES: dict[str, OwnerPolicy] = {
    "round-robin": round_robin,
    "least-loaded": least_loaded,
}


def owner_policy(name: str) -> OwnerPolicy:
    return OWNER_POLICIES.get(name, round_robin)
