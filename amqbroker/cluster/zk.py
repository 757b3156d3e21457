"""What every ZooKeeper participant of amqbroker shares: the worker thread, the fence,
the epoch znode and its compare-and-set.

Two things are decided in ZooKeeper: the cluster's grouping arbiter
(`amqbroker.cluster.election`) and, per node id, which process of a primary/backup pair
is live (`amqbroker.ha.lease`). Both follow one pattern, implemented here once:

* `ZkWorker` owns one kazoo client and one worker thread that does every kazoo call.
  kazoo's callbacks (watches, the connection-state listener) only put a wake-up on the
  worker's queue; the worker coalesces a burst of wake-ups into one evaluation (the
  subclass's ``_evaluate``, which re-arms its one-shot watches) and publishes views.
  `ZkWorker.run` (a trio task) hands each view to the trio thread through a memory
  channel of `VIEW_CHANNEL_SIZE` views (the worker waits for room: nothing is dropped,
  order is kept) and calls the subclass's ``_dispatch`` for every change, on the trio
  thread. Cancelling `run` leaves: the worker deletes its own znode (so the next in line
  takes over at once), closes the client and ends. If it has not ended within
  `LEAVE_GRACE` (blocked in a call queued while disconnected, which kazoo answers only
  after a reconnection that may never come), `run` closes the client under it, which
  fails that call: no kazoo client outlives `run` to retry a gone ZooKeeper forever.
  The thread is waited for within the session timeout plus 5 s in all, then abandoned
  (a daemon thread). An evaluation ZooKeeper refuses (a znode deleted between two of
  its steps, say) publishes the lost view and runs again after `RECONNECT_FIRST_DELAY`,
  doubling up to the reconnection's largest delay, or at the next wake-up if sooner:
  the change that would wake the worker may never come.
* every kazoo state change starts a new *connection generation*; each view carries the
  generation its evaluation started in. With ``fast_lost`` (the HA lease), a change to
  SUSPENDED or LOST also goes from kazoo's listener straight to the trio thread
  (``run_sync_soon``, which never blocks), which applies the lost view at once: the
  worker may be blocked meanwhile in a call it queued just after the connection
  dropped (kazoo answers such a call only after a reconnection). A connected view of an
  older generation that arrives after that is stale and dropped.
* an *epoch znode* holds a JSON document with at least ``{"epoch": n, "znode": name}``:
  the epoch and the ephemeral znode of the participant that took it. It is only ever
  rewritten by `commit_epoch`: one transaction that checks that the writer's own
  ephemeral znode still exists and that the epoch znode's version is the one the writer
  read. An epoch is therefore given to at most one participant, only while its session
  lives, and epochs only grow.
* a `Fence` is the highest epoch a process knows of.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import math
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Generic, TypeVar

import trio

__all__ = [
    "RECONNECT_FIRST_DELAY",
    "VIEW_CHANNEL_SIZE",
    "EpochDoc",
    "Fence",
    "ZkWorker",
    "commit_epoch",
    "kazoo_installed",
    "read_epoch",
    "seq",
]

#: views waiting for the trio thread (`ZkWorker.run`); when full, the worker thread
#: waits for room instead of dropping one
VIEW_CHANNEL_SIZE: Final = 64
#: seconds the worker gets to leave on its own (delete its znode, close the client)
#: before `ZkWorker.run` closes the client under it
LEAVE_GRACE: Final = 1.0
#: first and largest delay between reconnection attempts to ZooKeeper, seconds
RECONNECT_FIRST_DELAY: Final = 0.05


def kazoo_installed() -> bool:
    """Whether the kazoo client can be imported (a broken or blocked install counts as
    missing)."""
    try:
        return importlib.util.find_spec("kazoo") is not None
    except (ImportError, ValueError):
        return False


def seq(name: str) -> int:
    """The sequence number of an ephemeral sequential znode's name (``x_0000000012``)."""
    try:
        return int(name.rsplit("_", 1)[1])
    except (IndexError, ValueError):
        return -1  # foreign child: sorts first, never ours; leaders are ours only


# ------------------------------------------------------------------------------- fence


class Fence:
    """The highest epoch this process knows of; refuses anything older.

    Call `check` with the epoch of every answer or replicated record that arrives, and
    before persisting or answering with one's own epoch: False means a newer epoch
    exists and the message must be ignored (or the work abandoned). A higher epoch seen
    in a message raises the fence too, since epochs only come from ZooKeeper.
    Thread-safe (a ZooKeeper worker thread raises it).
    """

    __slots__ = ("_current", "_lock")

    def __init__(self, epoch: int = 0) -> None:
        self._current = epoch
        self._lock = threading.Lock()

    @property
    def current(self) -> int:
        return self._current

    def check(self, epoch: int) -> bool:
        """True if `epoch` is current (raising the fence to it); False if it is fenced."""
        with self._lock:
            if epoch < self._current:
                return False
            self._current = epoch
            return True

    def raise_to(self, epoch: int) -> None:
        """Learn of `epoch` (never lowers the fence)."""
        with self._lock:
            if epoch > self._current:
                self._current = epoch

    def __repr__(self) -> str:
        return f"Fence(current={self._current})"


# -------------------------------------------------------------------------- the epoch


@dataclass(frozen=True)
class EpochDoc:
    """An epoch znode as read: its epoch, the ephemeral znode (name) that took it, the
    znode's version (for `commit_epoch`) and the whole JSON document."""

    epoch: int
    znode: str | None
    version: int
    doc: dict[str, Any]


def read_epoch(client: Any, path: str, watch: Callable[[Any], None] | None, hint: str) -> EpochDoc:
    """Read the epoch znode at `path` (setting `watch` on it if given).

    Raises kazoo's NoNodeError if it does not exist, RuntimeError naming `hint` (what
    to check) if it does not hold an amqbroker epoch.
    """
    data, stat = client.get(path, watch=watch)
    try:
        doc = json.loads(data.decode("utf-8"))
        return EpochDoc(int(doc["epoch"]), doc.get("znode"), stat.version, doc)
    except (ValueError, KeyError, TypeError, UnicodeDecodeError, AttributeError):
        raise RuntimeError(
            f"znode {path} does not hold an amqbroker epoch ({data[:60]!r}); {hint}"
        ) from None


def commit_epoch(client: Any, own_node: str, path: str, doc: bytes, version: int) -> bool:
    """Rewrite the epoch znode `path` with `doc` if it still has `version` and `own_node`
    (the writer's ephemeral znode; its data may have been rewritten: any version) still
    exists, in one transaction.

    False when either check failed (the epoch moved, or the session lost its znode: look
    again); other failures raise.
    """
    from kazoo.exceptions import BadVersionError, NoNodeError, RolledBackError

    tx = client.transaction()
    tx.check(own_node, -1)  # -1: exists, whatever its version
    tx.set_data(path, doc, version=version)
    results = tx.commit()
    if any(isinstance(r, BadVersionError | NoNodeError | RolledBackError) for r in results):
        return False
    failures = [r for r in results if isinstance(r, Exception)]
    if failures:
        raise failures[0]
    return True


# ------------------------------------------------------------------------- the worker


class _Stop:
    pass


_STOP: Final = _Stop()

V = TypeVar("V")


class ZkWorker(Generic[V]):
    """One ZooKeeper participant: a kazoo client driven by one worker thread, whose
    views reach the trio thread in order (see the module docstring).

    Subclasses implement ``_evaluate`` (worker thread: read ZooKeeper, re-arm watches
    with ``self._watch``, call ``_publish``), ``_lost_view`` (the view while not
    connected), ``_dispatch`` (trio thread: call the events for a changed view) and
    may implement ``_log_change`` (worker thread: log a published change). ``_my_node`` is the
    participant's own ephemeral znode (full path), deleted on leaving.
    """

    def __init__(
        self,
        hosts: str,
        *,
        view: V,
        thread_name: str,
        what: str,
        session_timeout_ms: int,
        reconnect_max_delay_ms: int,
        connect_timeout: float | None = None,
        fast_lost: bool = False,
    ) -> None:
        self.hosts = hosts
        self.view = view
        self._thread_name = thread_name
        self._what = what  # "an election step": for the log
        self._session_timeout = session_timeout_ms / 1000
        self._reconnect_max_delay = max(reconnect_max_delay_ms / 1000, RECONNECT_FIRST_DELAY)
        self._connect_timeout = connect_timeout
        self._wake: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._client: Any = None
        self._my_node: str | None = None
        self._deliver: Callable[[tuple[V, int]], None] | None = None
        self._last: V = view  # published last (worker thread)
        # connection generation: +1 at every kazoo state change (kazoo's thread)
        self._gen = 0
        self._gen_lock = threading.Lock()
        self._eval_gen = 0  # the generation the worker's evaluation started in
        self._last_gen = 0  # the generation of the view published last
        self._fast_lost = fast_lost
        self._token: trio.lowlevel.TrioToken | None = None
        self._lost_gen = 0  # trio side: views of older generations are stale
        self._leaving = False  # run() has ended: a failing kazoo call is expected
        self._close_lock = threading.Lock()  # the worker and run() may both close
        self._closed = False

    # --------------------------------------------------------------- subclass API

    def _evaluate(self) -> None:
        raise NotImplementedError

    def _lost_view(self) -> V:
        raise NotImplementedError

    def _dispatch(self, view: V, old: V) -> None:
        raise NotImplementedError

    def _log_change(self, view: V, old: V) -> None:
        """Worker thread: log a published view that differs from the previous one."""

    def _publish(self, view: V) -> None:
        """Worker thread: hand `view` to trio unless it is the one published last in
        this connection generation."""
        gen = self._eval_gen
        if view == self._last and gen == self._last_gen:
            return
        if view != self._last:
            self._log_change(view, self._last)
        self._last, self._last_gen = view, gen
        if self._deliver is not None:
            self._deliver((view, gen))

    def _session_or_lost(self) -> int | None:
        """Worker thread: the session id while CONNECTED; otherwise publish the lost
        view (None: evaluate nothing, the listener wakes us on reconnection)."""
        from kazoo.protocol.states import KazooState

        with self._gen_lock:
            self._eval_gen = self._gen  # before the state: a change after it is newer
        client = self._client
        if client.state != KazooState.CONNECTED:
            self._publish(self._lost_view())
            return None
        client_id = client.client_id
        return None if client_id is None else int(client_id[0])

    def _children(
        self, path: str, *, watch_data: bool = False
    ) -> tuple[list[str], list[bytes]] | None:
        """Worker thread: the children of `path` in sequence order (watched) and their
        data (watched too with `watch_data`: a child's new data wakes an evaluation);
        None if one vanished meanwhile (a wake-up to evaluate again is queued)."""
        from kazoo.exceptions import NoNodeError

        names = sorted(self._client.get_children(path, watch=self._watch), key=seq)
        data: list[bytes] = []
        data_watch = self._watch if watch_data else None
        for name in names:
            try:
                data.append(self._client.get(f"{path}/{name}", watch=data_watch)[0])
            except NoNodeError:
                self._wake.put("vanished")
                return None
        return names, data

    def _commit_epoch(self, epoch_path: str, doc: dict[str, Any], version: int) -> bool:
        """Worker thread: `commit_epoch` of `doc` with our own znode; on failure a
        wake-up to look again is queued."""
        assert self._my_node is not None
        if commit_epoch(self._client, self._my_node, epoch_path, json.dumps(doc).encode(), version):
            return True
        self._wake.put("retry")  # the epoch moved or our znode is gone: look again
        return False

    def _connected(self, view: V) -> bool:
        """Whether `view` shows a connected participant (ends `run`'s start wait)."""
        return view != self._lost_view()

    def _unreachable(self) -> Exception:
        """The error `run` raises when ZooKeeper is not reached within the connect
        timeout."""
        return TimeoutError(f"cannot reach ZooKeeper at {self.hosts}")

    # ------------------------------------------------------------------ trio side

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Participate until cancelled. With a connect timeout, ``started`` waits until
        the first evaluation on a connected client, and `run` raises ``_unreachable()``
        if that does not come in time."""
        send, receive = trio.open_memory_channel[tuple[V, int]](VIEW_CHANNEL_SIZE)
        token = self._token = trio.lowlevel.current_trio_token()

        def deliver(view: tuple[V, int]) -> None:  # on the worker thread
            # waits while the channel is full (no change is dropped, order is kept);
            # once run() has ended nobody listens any more: the view is dropped
            with contextlib.suppress(
                trio.BrokenResourceError,
                trio.ClosedResourceError,
                trio.RunFinishedError,
                trio.Cancelled,
            ):
                trio.from_thread.run(send.send, view, trio_token=token)

        self._deliver = deliver
        self._leaving = self._closed = False
        self._thread = threading.Thread(
            target=self._thread_main, name=self._thread_name, daemon=True
        )
        self._thread.start()
        try:
            async with receive:
                if self._connect_timeout is None:
                    task_status.started()
                else:
                    with trio.move_on_after(self._connect_timeout):
                        async for view, gen in receive:
                            self._apply(view, gen)
                            if self._connected(self.view):
                                break
                    if not self._connected(self.view):
                        raise self._unreachable()
                    task_status.started()
                async for view, gen in receive:
                    self._apply(view, gen)
        finally:
            self._token = None
            self._leaving = True
            self._wake.put(_STOP)
            with trio.CancelScope(shield=True), trio.move_on_after(self._session_timeout + 5):
                # abandoned when the bound runs out (a daemon thread stuck in kazoo)
                await self._join(LEAVE_GRACE)
                if self._thread.is_alive() and self._client is not None:
                    # blocked in a kazoo call: closing the client fails that call
                    await trio.to_thread.run_sync(
                        self._close_client, self._client, abandon_on_cancel=True
                    )
                await self._join()

    async def _join(self, bound: float = math.inf) -> None:
        """Wait for the worker thread to end, at most `bound` seconds."""
        assert self._thread is not None
        with trio.move_on_after(bound):
            await trio.to_thread.run_sync(self._thread.join, abandon_on_cancel=True)

    def _apply(self, view: V, gen: int) -> None:
        if gen < self._lost_gen and self._connected(view):
            return  # evaluated before a connection loss trio already applied: stale
        old, self.view = self.view, view
        if view != old:
            self._dispatch(view, old)

    async def _check_in_worker(self, check: Callable[[], bool]) -> bool:
        """Run `check` in a thread, bounded by the session timeout (False then)."""
        with trio.move_on_after(self._session_timeout):
            return await trio.to_thread.run_sync(check, abandon_on_cancel=True)
        return False

    def _confirm_epoch(self, epoch_path: str, epoch: int, hint: str) -> bool:
        """True if ZooKeeper (after a sync) names our own znode as the owner of `epoch`
        and that znode still exists. Blocking: call through `_check_in_worker`."""
        from kazoo.protocol.states import KazooState

        client, my_node = self._client, self._my_node
        if client is None or my_node is None or client.state != KazooState.CONNECTED:
            return False
        try:
            client.sync(epoch_path)
            got = read_epoch(client, epoch_path, None, hint)
            client.get(my_node)  # our own znode (our session) still exists
        except Exception:
            return False
        return got.epoch == epoch and got.znode == my_node.rsplit("/", 1)[1]

    def session(self) -> tuple[int, bytes] | None:
        """The ZooKeeper (session id, password) while connected, else None."""
        client = self._client
        return None if client is None else client.client_id

    # ---------------------------------------------------------------- worker side

    def _thread_main(self) -> None:
        from kazoo.client import KazooClient
        from kazoo.retry import KazooRetry

        client = KazooClient(
            hosts=self.hosts,
            timeout=self._session_timeout,
            connection_retry=KazooRetry(
                max_tries=-1,
                delay=RECONNECT_FIRST_DELAY,
                backoff=2,
                max_jitter=0.1,
                max_delay=self._reconnect_max_delay,
            ),
            command_retry=KazooRetry(max_tries=0),
            logger=logging.getLogger("amqbroker.cluster.kazoo"),
        )
        self._client = client
        client.add_listener(self._on_state)
        client.start_async()
        retry: float | None = None  # after a refused step: evaluate again this soon
        try:
            while True:
                try:
                    item = self._wake.get(timeout=retry)
                except queue.Empty:
                    item = "retry after a refused step"
                stop = item is _STOP
                while not stop:  # coalesce a burst of wake-ups into one evaluation
                    try:
                        stop = self._wake.get_nowait() is _STOP
                    except queue.Empty:
                        break
                if stop:
                    break
                try:
                    self._evaluate()
                    retry = None
                except Exception as exc:
                    if self._leaving:
                        break  # run() closed the client under a blocked call
                    retry = self._on_zk_error(exc, retry)
        finally:
            self._leave(client)

    def _watch(self, _event: object) -> None:  # kazoo's event thread: never block
        self._wake.put("watch")

    def _on_state(self, state: object) -> None:  # kazoo's thread: never block
        from kazoo.protocol.states import KazooState

        with self._gen_lock:
            self._gen += 1
            gen = self._gen
        self._wake.put(state)  # the new state, as a wake-up
        token = self._token
        if self._fast_lost and state != KazooState.CONNECTED and token is not None:
            # the worker may be blocked in a kazoo call queued while disconnected:
            # trio hears of the loss now, not when that call returns
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(self._lost_now, gen)

    def _lost_now(self, gen: int) -> None:  # trio thread
        self._lost_gen = max(self._lost_gen, gen)
        self._apply(self._lost_view(), gen)

    def _on_zk_error(self, exc: Exception, retry: float | None) -> float | None:
        """Worker thread: publish the lost view after a failed evaluation; the delay
        before evaluating again unprompted (None: the listener wakes us). A refused step
        is retried after `RECONNECT_FIRST_DELAY`, doubling up to the reconnection's
        largest delay: the change that would wake us (a watch) may have come already, or
        never come (a watch not yet set when the step failed). Only the first failure
        in a row is logged as a warning; the ones after it, at debug level."""
        from kazoo.exceptions import ConnectionLoss, SessionExpiredError, ZookeeperError

        delay: float | None
        if isinstance(exc, ConnectionLoss | SessionExpiredError):
            delay = None  # the listener reports SUSPENDED / LOST and wakes us on reconnection
        else:
            delay = (
                RECONNECT_FIRST_DELAY
                if retry is None
                else min(2 * retry, self._reconnect_max_delay)
            )
            log = logging.getLogger(type(self).__module__)
            level = logging.WARNING if retry is None else logging.DEBUG
            if isinstance(exc, ZookeeperError):
                log.log(
                    level,
                    "ZooKeeper refused %s (%s: %s); retrying in %g s or on the next change",
                    self._what,
                    type(exc).__name__,
                    exc,
                    delay,
                )
            else:
                log.log(
                    level,
                    "%s failed; retrying in %g s or on the next change",
                    self._what,
                    delay,
                    exc_info=exc,
                )
        self._publish(self._lost_view())
        return delay

    def _leave(self, client: Any) -> None:
        from kazoo.exceptions import KazooException

        try:
            if self._my_node is not None and client.connected:
                client.delete(self._my_node)
        except KazooException:
            pass  # the session's end deletes it anyway
        finally:
            self._my_node = None
            self._close_client(client)

    def _close_client(self, client: Any) -> None:
        """Stop and close `client` once (the worker on leaving, or `run` when the
        worker is blocked in a call; blocking: a thread's call)."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            try:
                client.stop()
                client.close()
            except Exception:
                logging.getLogger(type(self).__module__).exception(
                    "closing the ZooKeeper client failed"
                )
