"""When a queue may dispatch at all: the start gate, the rebalance pause, the admin pause.

* The *start gate* (GROUPING 3.12): closed until `consumers-before-dispatch` consumers
  are attached and nothing is in flight, or `delay-before-dispatch` ms after a consumer
  attached; it closes again when the last consumer leaves.
* The *rebalance pause* (`group-rebalance-pause-dispatch`): after a rebalance,
  nothing is dispatched until every in-flight message is settled, or until
  `group-pause-dispatch-timeout` ms have passed (then a warning is logged).
* The *admin pause* (management `pause` / `resume`): stops delivery until resumed;
  messages still arrive, settle, expire and can be purged or moved. Not persisted.

`flowing` (on the dispatcher) is True when none of the three stops dispatch: the
enqueue fast path tests that one flag.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from amqbroker.core.timers import Timer, Timers

log = logging.getLogger("amqbroker.core.queue")


class GatePolicy(Protocol):
    @property
    def consumers_before_dispatch(self) -> int: ...

    @property
    def delay_before_dispatch(self) -> int: ...

    @property
    def group_pause_dispatch_timeout(self) -> int: ...


class GatedQueue(Protocol):
    """The queue as its gate sees it (`amqbroker.core.queue.Queue`)."""

    name: str
    inflight: int
    deleted: bool
    timers: Timers
    clock: Callable[[], float]

    @property
    def policy(self) -> GatePolicy: ...


class Gated(Protocol):
    """The dispatcher as its gate sees it (`GroupDispatcher`)."""

    flowing: bool
    consumers_n: int

    @property
    def q(self) -> GatedQueue: ...

    def dispatch(self) -> None: ...

    def serve_parked(self) -> None:
        """Serve every consumer that has parked groups and credit."""


class DispatchGate:
    __slots__ = ("admin_paused", "d", "gate_timer", "open", "pause_timer", "paused")

    def __init__(self, d: Gated) -> None:
        self.d = d
        self.open = False
        self.paused = False
        self.admin_paused = False
        self.gate_timer: Timer | None = None
        self.pause_timer: Timer | None = None

    def _sync(self) -> None:
        self.d.flowing = self.open and not self.paused and not self.admin_paused

    @property
    def dispatching(self) -> bool:
        return self.open and not self.paused and not self.admin_paused

    # ------------------------------------------------------------ start gate
    def check(self) -> bool:
        """Open the gate if its conditions hold now; True when open."""
        q = self.d.q
        if q.inflight:
            return False
        if self.d.consumers_n >= q.policy.consumers_before_dispatch:
            self._open()
            return True
        return False

    def _open(self) -> None:
        self.open = True
        self._sync()
        if self.gate_timer is not None:
            self.gate_timer.cancel()
            self.gate_timer = None

    def consumer_added(self) -> None:
        if not self.open:
            q = self.d.q
            delay = q.policy.delay_before_dispatch
            if delay >= 0 and self.gate_timer is None:
                self.gate_timer = q.timers.call_at(q.clock() + delay / 1000.0, self._deadline)

    def last_consumer_gone(self) -> None:
        self.open = False
        self._sync()
        if self.gate_timer is not None:
            self.gate_timer.cancel()
            self.gate_timer = None

    def _deadline(self) -> None:
        self.gate_timer = None
        d = self.d
        if d.consumers_n and not self.open and not d.q.deleted:
            self._open()
            d.dispatch()

    # ------------------------------------------------------- rebalance pause
    def pause(self) -> None:
        self.paused = True
        self._sync()
        q = self.d.q
        t = q.policy.group_pause_dispatch_timeout
        if t >= 0 and self.pause_timer is None:
            self.pause_timer = q.timers.call_at(q.clock() + t / 1000.0, self._pause_deadline)

    def _pause_deadline(self) -> None:
        self.pause_timer = None
        if self.paused:
            q = self.d.q
            log.warning(
                "queue %r: dispatch was paused for a group rebalance and %d message(s) are "
                "still unsettled after group_pause_dispatch_timeout; resuming dispatch",
                q.name,
                q.inflight,
            )
            self._unpause()

    def check_pause(self) -> None:
        if self.paused and not self.d.q.inflight:
            self._unpause()

    def _unpause(self) -> None:
        self.paused = False
        self._sync()
        if self.pause_timer is not None:
            self.pause_timer.cancel()
            self.pause_timer = None
        self.d.serve_parked()
        self.d.dispatch()

    # ----------------------------------------------------------- admin pause
    def admin_pause(self) -> bool:
        """Stop delivering (management `pause`); False when already paused."""
        if self.admin_paused:
            return False
        self.admin_paused = True
        self._sync()
        return True

    def admin_resume(self) -> bool:
        """Deliver again (management `resume`); False when not paused."""
        if not self.admin_paused:
            return False
        self.admin_paused = False
        self._sync()
        self.d.serve_parked()
        self.d.dispatch()
        return True

    def close(self) -> None:
        for timer in (self.gate_timer, self.pause_timer):
            if timer is not None:
                timer.cancel()
