"""Synchronous replication of the arbiter's decisions to the backup arbiter.

Theory of operation
-------------------
With ZooKeeper the arbiter is the leader of an election (`election.ZkElection`) and the
second in line is the **backup**. The leader's `Arbiter` calls its `Replicator` for
every batch of decisions (binds and unbinds; the arbiter's group commit, one batch =
every decision that was waiting) after its own fsync and before it answers them:

* the replicator sends the batch to the current backup as one `groupingReplicate`
  management request over the peer link (body `{"epoch", "decisions": [...]}`; a
  single decision's map is accepted too) and waits for the acknowledgement, which
  the backup sends only once the batch is in its own decision log (fsync);
* a backup that has not been brought up to date at this epoch first receives a
  **snapshot** (every ready binding; the backup replaces its table with it, writing
  an unbind for each key it held that the snapshot lacks). The snapshot is sent again
  after the backup changed, its link dropped or the epoch changed, so a backup that
  missed decisions never stays behind. It is sent **eagerly**, in a task of the
  node's nursery (``spawn``), as soon as the backup is named (`set_target`, also when
  this node starts leading at an epoch) or its link is up again (`link_up`): a
  leader that dies before its next decision leaves a backup, soon the new leader,
  with the current table. A link that is down ends the attempt (its return starts
  another); a 503 is retried after ``retry_delay`` while the backup and the epoch
  stay the same; a change of either ends it (and starts the new backup's). The batch
  path sends the snapshot itself (**lazily**, the fallback) when the backup is not
  in sync yet. Both hold one lock, which a batch holds from start to end: a snapshot
  never overlaps a batch, so every binding is either in it (ready, its batch done)
  or sent after it (its batch not started);
* the wait ends with the acknowledgement, with the link's loss or a change of backup
  (the batch is then sent to the new backup), or with a refusal:
  409 (the backup knows a higher epoch: this node is a fenced old arbiter; it steps
  down and the batch's proposals are not answered) or 503 (the backup does not know this node
  as the arbiter of this epoch yet: retried after ``retry_delay``);
* without a connected backup the batch is not replicated; the replicator logs that
  once (until a backup is in sync again) and confirms in ZooKeeper that this node
  still holds the leadership of its epoch before the answer, so an old arbiter
  resumed after a pause (SIGSTOP) whose link to the backup is gone cannot answer
  either.

`ReplicaStore` is the receiving side (every node with an election runs one): it
accepts a replicated decision only from the node its election names as leader of
exactly that epoch, refuses an epoch below its fence with 409 (the body carries the
current epoch), writes accepted decisions to its decision log in arrival order (one
fsync for everything queued meanwhile), installs them in its arbiter table and only
then acknowledges.

Invariants: the leader answers a proposal only after its own fsync and either the
backup's acknowledgement or a successful ZooKeeper confirmation; a backup never
acknowledges a decision whose epoch is below its fence; decisions are applied on the
backup in the order the leader sent them.
"""

from __future__ import annotations

import functools
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from amqbroker.cluster.arbiter import Arbiter, NotArbiter
from amqbroker.cluster.decisions import BIND, UNBIND, Decision

log = logging.getLogger("amqbroker.cluster")

#: send(peer_id, body, on_answer(status, description, body)) -> False if the link is down
Send = Callable[[str, dict[str, Any], Callable[[int, str, Any], None]], bool]
Respond = Callable[[int, str, Any], None]
#: spawn(async_fn) -> False if it could not be started (the node's nursery, see node.py)
Spawn = Callable[[Callable[[], Awaitable[None]]], bool]

OK, ABORTED, RETRY, FENCED = "ok", "aborted", "retry", "fenced"


@dataclass(eq=False)
class _Wait:
    done: trio.Event = field(default_factory=trio.Event)
    outcome: str = ABORTED
    epoch: int = 0


class Replicator:
    """The leader's side; registered with `Arbiter.add_replica`."""

    def __init__(
        self,
        arbiter: Arbiter,
        send: Send,
        *,
        epoch: Callable[[], int],
        confirm: Callable[[int], Awaitable[bool]] | None,
        on_fenced: Callable[[int], None],
        retry_delay: float,
        spawn: Spawn | None = None,
    ) -> None:
        self.arbiter = arbiter
        self.send = send
        self.epoch = epoch
        self.confirm = confirm
        self.on_fenced = on_fenced
        self.retry_delay = retry_delay
        self.spawn = spawn
        self.target: str | None = None
        self.synced: tuple[str, int] | None = None
        #: (target, epoch) of the eager snapshot task started and not ended yet
        self._eager: tuple[str, int] | None = None
        self._waits: dict[str, set[_Wait]] = {}
        self._lock = trio.Lock()
        self._warned = False
        self.replicated = 0
        #: batches of decisions the backup acknowledged (one request each; snapshots apart)
        self.messages = 0
        self.unreplicated = 0

    # ----------------------------------------------------------- state changes
    def set_target(self, backup: str | None) -> None:
        """The election's backup changed (or this node stopped leading: None); called
        again with the same backup when the role changes (a new epoch): the snapshot
        is sent now if the backup is not in sync at the current epoch."""
        if backup != self.target:
            old, self.target = self.target, backup
            self.synced = None
            if old is not None:
                self._abort(old)
        self._start_snapshot()

    def link_down(self, peer: str) -> None:
        if self.synced is not None and self.synced[0] == peer:
            self.synced = None
        self._abort(peer)

    def link_up(self, peer: str) -> None:
        """The link to `peer` is up: if it is the backup and not in sync, the snapshot
        is sent now (nothing if one is under way already)."""
        if peer == self.target:
            self._start_snapshot()

    def _abort(self, peer: str) -> None:
        for w in self._waits.pop(peer, set()):
            w.outcome = ABORTED
            w.done.set()

    # ------------------------------------------------------------- snapshots
    def _wanted(self, target: str, epoch: int) -> bool:
        """Whether a snapshot for (target, epoch) is still to be sent."""
        return (
            self.arbiter.leading
            and self.target == target
            and self.epoch() == epoch
            and self.synced != (target, epoch)
        )

    def _start_snapshot(self) -> None:
        """The eager snapshot (see the module docstring), in the node's nursery."""
        target, epoch = self.target, self.epoch()
        if self.spawn is None or target is None or not self._wanted(target, epoch):
            return
        if self._eager == (target, epoch):
            return  # under way (or waiting for the lock)
        self._eager = (target, epoch)
        if not self.spawn(functools.partial(self._eager_snapshot, target, epoch)):
            self._eager = None  # not running yet: the batch path sends it

    async def _eager_snapshot(self, target: str, epoch: int) -> None:
        try:
            while self._wanted(target, epoch):
                async with self._lock:
                    if not self._wanted(target, epoch):
                        return  # the batch path sent it meanwhile
                    outcome = await self._snapshot(target, epoch, "further proposals")
                if outcome != RETRY:
                    return  # in sync, the link is down (link_up starts another) or aborted
        except NotArbiter:
            return  # fenced: on_fenced was called
        except Exception:  # not the node's end: the batch path sends it instead
            log.exception("sending the snapshot to backup arbiter %s failed", target)
        finally:
            if self._eager == (target, epoch):
                self._eager = None

    async def _snapshot(self, target: str, epoch: int, d: str) -> str:
        """Send the snapshot once (the caller holds the lock): `_exchange`'s outcome."""
        snap = [b.to_dict() for b in self.arbiter.snapshot()]
        outcome = await self._exchange(target, {"epoch": epoch, "snapshot": snap}, epoch, d)
        if outcome == OK:
            self.synced = (target, epoch)
            self._warned = False
            log.info(
                "backup arbiter %s is in sync (%d group binding(s), epoch %d); "
                "decisions are replicated to it before every answer",
                target,
                len(snap),
                epoch,
            )
        return outcome

    # ------------------------------------------------------------- replicating
    async def __call__(self, batch: list[Decision]) -> None:
        # named in logs and exceptions
        d = repr(batch[0].key) + (f" and {len(batch) - 1} more" if len(batch) > 1 else "")
        # held for the whole batch: an eager snapshot never overlaps it (its bindings
        # become ready only once it returns, so a snapshot taken meanwhile would lack
        # them while the batch itself went to the previous backup, or nowhere)
        async with self._lock:
            while True:
                if not self.arbiter.leading:
                    raise NotArbiter(d)  # stepped down meanwhile: the new arbiter decides
                target, epoch = self.target, self.epoch()
                if target is None:
                    await self._unreplicated(d, "no backup arbiter is elected")
                    return
                if self.synced != (target, epoch):
                    # not sent eagerly yet (or that failed): sent here, the fallback
                    if await self._snapshot(target, epoch, d) == "down":
                        await self._unreplicated(d, f"the link to backup {target} is down")
                        return
                    continue
                body = {"epoch": epoch, "decisions": [x.to_dict() for x in batch]}
                outcome = await self._exchange(target, body, epoch, d)
                if outcome == OK:
                    self.replicated += len(batch)
                    self.messages += 1
                    return
                if outcome == "down":
                    await self._unreplicated(d, f"the link to backup {target} is down")
                    return

    async def _exchange(self, target: str, body: dict[str, Any], epoch: int, d: str) -> str:
        """One request to the backup: OK, "down" (link not up), or after ABORTED/RETRY
        (the caller loops); raises NotArbiter when fenced."""
        w = _Wait()

        def on_answer(status: int, desc: str, answer: Any) -> None:
            if status == 200:
                w.outcome = OK
            elif status == 409:
                w.outcome = FENCED
                ans = answer if isinstance(answer, dict) else {}
                w.epoch = int(ans.get("epoch", epoch + 1))
            else:
                w.outcome = RETRY
                log.debug("backup %s: %s %s", target, status, desc)
            self._waits.get(target, set()).discard(w)
            w.done.set()

        self._waits.setdefault(target, set()).add(w)
        if not self.send(target, body, on_answer):
            self._waits.get(target, set()).discard(w)
            return "down"
        await w.done.wait()
        if w.outcome == FENCED:
            log.warning(
                "backup %s refused a grouping decision of epoch %d: it knows epoch %d, so "
                "this node is no longer the arbiter; it steps down and does not answer %s",
                target,
                epoch,
                w.epoch,
                d,
            )
            self.on_fenced(w.epoch)
            raise NotArbiter(d)
        if w.outcome == RETRY:
            await trio.sleep(self.retry_delay)
        return w.outcome

    async def _unreplicated(self, d: str, why: str) -> None:
        epoch = self.epoch()
        if self.confirm is not None and not await self.confirm(epoch):
            log.warning(
                "grouping decision for %s not answered: ZooKeeper no longer confirms this "
                "node as the arbiter of epoch %d; it steps down",
                d,
                epoch,
            )
            self.on_fenced(epoch)
            raise NotArbiter(d)
        self.unreplicated += 1  # per batch
        if not self._warned:
            self._warned = True
            log.warning(
                "grouping decisions are not replicated (%s): until a backup arbiter is "
                "connected, losing this node loses the group bindings decided meanwhile; "
                "start another cluster node with cluster_zookeeper set",
                why,
            )


@dataclass
class _Item:
    decisions: list[Decision]
    snapshot: bool
    epoch: int
    respond: Respond


class ReplicaStore:
    """The backup's side of `groupingReplicate` (see the module docstring)."""

    def __init__(
        self,
        arbiter: Arbiter,
        check: Callable[[str, int], tuple[int, str, Any] | None],
        on_applied: Callable[[], None],
        *,
        in_thread: bool = True,
    ) -> None:
        self.arbiter = arbiter
        self.check = check
        self.on_applied = on_applied
        self.in_thread = in_thread
        self._queue: deque[_Item] = deque()
        self._wake = trio.Event()
        self.received = 0

    def submit(self, sender: str, body: Any, respond: Respond) -> None:
        if not isinstance(body, dict):
            why = "groupingReplicate needs a map body (decisions, a decision or a snapshot)"
            respond(400, why, None)
            return
        try:
            epoch = int(body["epoch"])
            if "snapshot" in body:
                decisions = [Decision.from_dict(x) for x in body["snapshot"]]
                snapshot = True
            elif "decisions" in body:
                decisions = [Decision.from_dict(x) for x in body["decisions"]]
                snapshot = False
            else:
                decisions = [Decision.from_dict(body)]
                snapshot = False
        except (KeyError, TypeError, ValueError):
            respond(400, "groupingReplicate: malformed decision", None)
            return
        refused = self.check(sender, epoch)
        if refused is not None:
            respond(*refused)
            return
        self._queue.append(_Item(decisions, snapshot, epoch, respond))
        self._wake.set()

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            items = list(self._queue)
            self._queue.clear()
            # a snapshot replaces the table as it stands after the items before it
            table = {k: (b.node, b.queue) for k, b in self.arbiter.bindings.items()}
            batch: list[Decision] = []
            for it in items:
                if it.snapshot:
                    keep = {d.key for d in it.decisions if d.kind == BIND}
                    batch += [
                        Decision(UNBIND, k, node, queue, it.epoch)
                        for k, (node, queue) in table.items()
                        if k not in keep
                    ]
                    table = {}
                for d in it.decisions:
                    if d.kind == BIND:
                        table[d.key] = (d.node, d.queue)
                    else:
                        table.pop(d.key, None)
                batch += it.decisions
            lg = self.arbiter.log
            if lg is not None and batch:
                if self.in_thread:
                    await trio.to_thread.run_sync(lg.append, batch)
                else:
                    lg.append(batch)
            for d in batch:
                self.arbiter.install(d)
            self.received += len(batch)
            for it in items:
                it.respond(200, "OK", True)
            self.on_applied()
