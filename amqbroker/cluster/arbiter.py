"""The grouping arbiter (LOCAL handler, GROUPING 7.5) and the role interface for election.

`Arbiter` holds the cluster-wide table `full group key -> Binding(node, queue)`. A
proposal for an unbound key creates the binding and queues the decision for the
committer (`run`); concurrent proposals for the same key wait for that first decision
and get it as the answer, so one key is never bound twice. A proposal for a bound key
answers the existing binding (and counts as a use for the reaper).

Group commit: `run` takes every decision queued at that moment as one batch, writes
it to the decision log with one append and one fsync (in a worker thread), hands the
whole batch to every replica at once (`add_replica`: the backup arbiter receives it
as one `groupingReplicate` message and acknowledges it after its own fsync), and only
then marks each binding ready, which releases its answer. Decisions queued while a
batch is being committed form the next batch, so a burst of new groups costs a few
fsyncs and round trips instead of one per group. A batch that cannot be committed
(fenced, not leading any more, a decision of an older epoch) fails as a whole: its
bindings are dropped, never answered, and their proposers retry with the arbiter of
the moment. The committer owns a queued decision: a proposer that gives up waiting
(its own timeout) does not withdraw it, so table and decision log stay alike.

`ArbiterRole` is what a leader election plugs into: `become_leader(epoch)` makes this
node's arbiter answer proposals, stamping `epoch` on every decision;
`become_follower(leader_node_id, epoch)` makes it refuse them (the cluster node then
sends its proposals to the leader; None: no leader known, proposals wait) and fences
answers of an older epoch (`fence`, shared with the election); `backup_changed` tells
the leader which node to replicate to (`replication.Replicator`). Without
ZooKeeper the statically configured LOCAL node calls `become_leader(0)` at start and
says the arbiter is a single point of failure; REMOTE nodes learn the leader from the
peers' announcements.

Invariants: at most one binding per key; `Binding.ready` is set only once the batch
holding its decision is durable (and replicated), and never for a binding whose batch
failed; a decision of epoch e is never committed while the node is not leader of epoch
e (`NotArbiter`); batches are committed, and replicated, in the order decided.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio

from amqbroker.cluster.decisions import BIND, UNBIND, Decision, DecisionLog
from amqbroker.cluster.election import Fence
from amqbroker.core.errors import LocalError

log = logging.getLogger(__name__)

SPOF_WARNING = "the grouping arbiter is a single point of failure (no ZooKeeper configured)"


class NotArbiter(LocalError):
    """This node is not the arbiter (any more)."""


@dataclass
class Binding:
    key: str
    node: str
    queue: str
    epoch: int
    last_used: float
    ready: trio.Event = field(default_factory=trio.Event)
    #: set with `ready` when the decision could not be made (fenced): waiters retry
    failed: bool = False
    #: why the batch failed, when it was not a lost leadership (re-raised to waiters)
    error: BaseException | None = None
    #: called by the committer, in its own step, when `ready` is set (`propose_soon`)
    on_ready: list[Callable[[Binding], None]] = field(default_factory=list, repr=False)


@dataclass(eq=False)
class _Queued:
    decision: Decision
    binding: Binding | None
    done: trio.Event = field(default_factory=trio.Event)
    error: BaseException | None = None


class Arbiter:
    def __init__(
        self,
        decision_log: DecisionLog | None,
        clock: Callable[[], float],
        *,
        in_thread: bool = True,
    ) -> None:
        self.log = decision_log
        self.clock = clock
        self.in_thread = in_thread
        self.bindings: dict[str, Binding] = {}
        self.replicas: list[Callable[[list[Decision]], Awaitable[None]]] = []
        self.leading = False
        self.epoch = 0
        self.decisions = 0
        #: batches committed (one decision-log append + fsync, one replication each)
        self.batches = 0
        self.largest_batch = 0
        self._queue: list[_Queued] = []
        self._wake = trio.Event()

    def load(self) -> int:
        if self.log is None:
            return 0
        now = self.clock()
        for d in self.log.load().values():
            b = Binding(d.key, d.node, d.queue, d.epoch, now)
            b.ready.set()
            self.bindings[d.key] = b
        return len(self.bindings)

    def add_replica(self, send: Callable[[list[Decision]], Awaitable[None]]) -> None:
        """Every later batch of decisions is awaited on `send` before its answers."""
        self.replicas.append(send)

    def remove_replica(self, send: Callable[[list[Decision]], Awaitable[None]]) -> None:
        if send in self.replicas:
            self.replicas.remove(send)

    def _enqueue(self, d: Decision, b: Binding | None) -> _Queued:
        q = _Queued(d, b)
        self._queue.append(q)
        self._wake.set()
        return q

    async def run(self) -> None:
        """The committer (group commit, see the module docstring); runs for good."""
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            batch, self._queue = self._queue, []
            if batch:
                await self._commit(batch)

    async def _commit(self, batch: list[_Queued]) -> None:
        error: BaseException | None = None
        try:
            if not self.leading or any(q.decision.epoch != self.epoch for q in batch):
                raise NotArbiter(batch[0].decision.key)
            decisions = [q.decision for q in batch]
            if self.log is not None:
                if self.in_thread:
                    await trio.to_thread.run_sync(self.log.append, decisions)
                else:
                    self.log.append(decisions)
            for send in list(self.replicas):
                await send(decisions)
        except Exception as exc:  # the whole batch fails; the committer goes on
            error = exc
        except BaseException as exc:  # cancelled (shutdown): nobody is answered
            error = NotArbiter(str(exc))
            raise
        finally:
            for q in batch:
                b = q.binding
                if b is not None:
                    if error is not None:
                        if self.bindings.get(b.key) is b:
                            del self.bindings[b.key]
                        b.failed = True
                        b.error = None if isinstance(error, NotArbiter) else error
                    b.ready.set()
                    callbacks, b.on_ready = b.on_ready, []
                    for cb in callbacks:
                        try:
                            cb(b)
                        except Exception:
                            log.exception("answering the grouping decision for %r failed", b.key)
                q.error = error
                q.done.set()
        self.decisions += len(batch)
        self.batches += 1
        self.largest_batch = max(self.largest_batch, len(batch))

    def lookup(self, key: str, *, touch: bool = True) -> Binding | None:
        b = self.bindings.get(key)
        if b is not None and touch:
            b.last_used = self.clock()
        return b

    async def propose(self, key: str, node: str, queue: str) -> tuple[Binding, bool]:
        """(binding, accepted). Raises NotArbiter when not leading."""
        if not self.leading:
            raise NotArbiter(key)
        b, created = self._binding_for(key, node, queue)
        await b.ready.wait()
        if created and b.error is not None:
            raise b.error
        if b.failed:
            raise NotArbiter(key)
        return b, created

    def propose_soon(
        self, key: str, node: str, queue: str, answer: Callable[[Binding, bool], None]
    ) -> bool:
        """`propose` without a task: `answer(binding, accepted)` is called at once when `key` is
        decided, else by the committer when the batch holding its decision is done (no
        task to resume in between: one event-loop pass less per proposal in a burst).
        The binding tells the outcome: `failed` (not leading any more; `error` set when
        the batch failed otherwise), else decided, `node`/`queue` the answer. False
        when not leading (nothing is called)."""
        if not self.leading:
            return False
        b, created = self._binding_for(key, node, queue)
        if b.ready.is_set():
            answer(b, created)
        else:
            b.on_ready.append(lambda b: answer(b, created))
        return True

    def _binding_for(self, key: str, node: str, queue: str) -> tuple[Binding, bool]:
        """`key`'s binding and whether this call made it: a standing one (decided or
        not) is touched (`last_used`); else (node, queue) becomes a new one, whose BIND
        decision is enqueued for the committer."""
        b = self.bindings.get(key)
        if b is not None:
            b.last_used = self.clock()
            return b, False
        epoch = self.epoch
        b = Binding(key, node, queue, epoch, self.clock())
        self.bindings[key] = b
        self._enqueue(Decision(BIND, key, node, queue, epoch), b)
        return b, True

    async def remove(self, key: str) -> Binding | None:
        """Unbind (reaper, node loss, operator); persisted like a bind."""
        b = self.bindings.pop(key, None)
        if b is None:
            return None
        q = self._enqueue(Decision(UNBIND, key, b.node, b.queue, self.epoch), None)
        await q.done.wait()
        if q.error is not None:
            raise q.error if not isinstance(q.error, NotArbiter) else NotArbiter(key)
        return b

    def install(self, d: Decision) -> None:
        """Apply a decision received as a replica (the backup's copy of the table)."""
        if d.kind == BIND:
            b = Binding(d.key, d.node, d.queue, d.epoch, self.clock())
            b.ready.set()
            self.bindings[d.key] = b
        else:
            self.bindings.pop(d.key, None)

    def snapshot(self) -> list[Decision]:
        """Every decided binding, as decisions (what a new backup starts from)."""
        return [
            Decision(BIND, b.key, b.node, b.queue, b.epoch)
            for b in self.bindings.values()
            if b.ready.is_set() and not b.failed
        ]

    def bound_to(self, node: str) -> list[str]:
        return [k for k, b in self.bindings.items() if b.node == node]

    def idle(self, older_than: float) -> list[str]:
        return [
            k for k, b in self.bindings.items() if b.last_used < older_than and b.ready.is_set()
        ]

    def close(self) -> None:
        if self.log is not None:
            self.log.close()


class ArbiterRole:
    """Who arbitrates grouping, at which epoch. Called by the election (ZooKeeper) or,
    without it, by the static configuration."""

    def __init__(
        self,
        node_id: str,
        arbiter: Arbiter,
        on_change: Callable[[], None] | None = None,
        fence: Fence | None = None,
    ) -> None:
        self.node_id = node_id
        self.arbiter = arbiter
        self.on_change = on_change
        #: the highest epoch known; the election's own fence when there is one
        self.fence = fence if fence is not None else Fence()
        self.leader_id: str | None = None
        self.epoch = 0
        #: with an election: the second in line (the leader replicates to it)
        self.backup_id: str | None = None

    @property
    def is_leader(self) -> bool:
        return self.arbiter.leading

    def become_leader(self, epoch: int) -> None:
        if epoch < self.epoch:
            log.warning("ignoring leadership of stale epoch %d (current %d)", epoch, self.epoch)
            return
        self.fence.raise_to(epoch)
        self.epoch = epoch
        self.leader_id = self.node_id
        self.arbiter.epoch = epoch
        self.arbiter.leading = True
        log.info("this node is the grouping arbiter (epoch %d)", epoch)
        if self.on_change is not None:
            self.on_change()

    def become_follower(self, leader_node_id: str | None, epoch: int) -> None:
        """`leader_node_id` None: no arbiter known right now (takeover in progress, or
        this node lost ZooKeeper); proposals wait and are re-sent once one is known."""
        if epoch < self.epoch:
            return
        self.fence.raise_to(epoch)
        was_leading = self.arbiter.leading
        self.arbiter.leading = False
        changed = was_leading or leader_node_id != self.leader_id or epoch != self.epoch
        self.leader_id = leader_node_id
        self.epoch = epoch
        if changed:
            if leader_node_id is None:
                log.info("no grouping arbiter known (epoch %d): new groups wait", epoch)
            else:
                log.info("the grouping arbiter is %s (epoch %d)", leader_node_id, epoch)
            if self.on_change is not None:
                self.on_change()

    def become_backup(self, leader_node_id: str | None, epoch: int) -> None:
        """Second in line: a follower that also receives every decision (ReplicaStore)."""
        self.become_follower(leader_node_id, epoch)

    def backup_changed(self, backup_node_id: str | None) -> None:
        if backup_node_id != self.backup_id:
            self.backup_id = backup_node_id
            if self.on_change is not None:
                self.on_change()
