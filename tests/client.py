"""A trio-native AMQP 1.0 test client: Proton's engine (object API) over a real socket.

Why not BlockingConnection: it runs its own reactor and needs a thread, and a thread
makes trio's autojump clock jump while the client works in real time. This client
runs as ordinary trio tasks in the test's own loop, so tests can use the autojump
clock (timers, delays, idle timeouts) and still talk to the broker over a real TCP
socket with a real AMQP implementation (Proton's engine, as used by every Proton
client).

Usage:
    async with await Client.connect(port) as c:
        s = await c.sender("q")
        await s.send(Message(body="x"))
        r = await c.receiver("q", credit=10)
        d = await r.receive()
        r.accept(d)
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Callable
from typing import Any

import trio
from proton import (
    SASL,
    SSL,
    Collector,
    Connection,
    Data,
    Delivery,
    Described,
    Disposition,
    Endpoint,
    Event,
    Link,
    Message,
    ProtonException,
    SSLDomain,
    SymbolList,
    Terminus,
    Transport,
    symbol,
    ulong,
)

DEFAULT_TIMEOUT = 10.0


class ClientError(Exception):
    #: the peer's error condition, when it sent one
    condition: Any = None


class Received:
    """One received delivery."""

    def __init__(self, delivery: Delivery, message: Message, raw: bytes) -> None:
        self.delivery = delivery
        self.message = message
        self.raw = raw

    @property
    def body(self) -> Any:
        return self.message.body

    @property
    def group_id(self) -> str | None:
        return self.message.group_id

    @property
    def properties(self) -> dict[str, Any]:
        return dict(self.message.properties or {})

    def __repr__(self) -> str:
        return f"<Received {self.message.body!r} group={self.message.group_id!r}>"


class _Link:
    def __init__(self, client: Client, link: Link) -> None:
        self.client = client
        self.link = link

    @property
    def remote_condition(self) -> Any:
        return self.link.remote_condition

    @property
    def address(self) -> str | None:
        t = self.link.remote_source if self.link.is_receiver else self.link.remote_target
        return t.address if t is not None else None

    async def wait_open(self, timeout: float = DEFAULT_TIMEOUT) -> None:
        await self.client._wait(
            lambda: (
                self.link.state & Endpoint.REMOTE_ACTIVE or self.link.state & Endpoint.REMOTE_CLOSED
            ),
            timeout,
        )
        if self.link.state & Endpoint.REMOTE_CLOSED:
            c = self.link.remote_condition
            raise ClientError(
                f"link refused: {c.name if c else None}: {c.description if c else ''}"
            )

    async def close(self, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.link.close()
        await self.client._flush()
        await self.client._wait(lambda: self.link.state & Endpoint.REMOTE_CLOSED, timeout)

    async def detach(self, timeout: float = DEFAULT_TIMEOUT) -> None:
        """Detach without closing (a durable subscription stays). Proton keeps a
        remotely detached link REMOTE_ACTIVE, so wait for the broker to have handled
        it instead."""
        self.link.detach()
        await roundtrip(self.client, timeout)

    @property
    def closed_by_peer(self) -> bool:
        return bool(self.link.state & Endpoint.REMOTE_CLOSED)


class Sender(_Link):
    def __init__(self, client: Client, link: Link) -> None:
        super().__init__(client, link)
        self._tags = itertools.count(1)

    @property
    def credit(self) -> int:
        return int(self.link.credit)

    def send_nowait(self, msg: Message) -> Delivery:
        d = self.link.delivery(str(next(self._tags)))
        self.link.send(msg.encode())
        self.link.advance()
        if self.link.snd_settle_mode == Link.SND_SETTLED:
            d.settle()
        return d

    async def send(self, msg: Message, *, timeout: float = DEFAULT_TIMEOUT) -> Delivery:
        """Send when credit allows; waits for the broker's outcome unless presettled."""
        await self.client._wait(lambda: self.link.credit > 0 or self.closed_by_peer, timeout)
        if self.closed_by_peer:
            raise ClientError("sender closed by the broker")
        d = self.send_nowait(msg)
        await self.client._flush()
        if self.link.snd_settle_mode != Link.SND_SETTLED:
            await self.client._wait(lambda: d.remote_state or d.settled, timeout)
        return d

    async def send_many(
        self, msgs: list[Message], *, timeout: float = DEFAULT_TIMEOUT
    ) -> list[Delivery]:
        out = []
        presettled = self.link.snd_settle_mode == Link.SND_SETTLED
        for m in msgs:
            await self.client._wait(lambda: self.link.credit > 0 or self.closed_by_peer, timeout)
            out.append(self.send_nowait(m))
        await self.client._flush()
        if not presettled:
            await self.client._wait(lambda: all(d.settled or d.remote_state for d in out), timeout)
        return out


class Receiver(_Link):
    def __init__(self, client: Client, link: Link) -> None:
        super().__init__(client, link)
        self.queue: deque[Received] = deque()

    def flow(self, n: int) -> None:
        self.link.flow(n)
        self.client._kick()

    @property
    def credit(self) -> int:
        return int(self.link.credit)

    async def receive(self, timeout: float = DEFAULT_TIMEOUT) -> Received:
        await self.client._flush()
        await self.client._wait(lambda: self.queue or self.closed_by_peer, timeout)
        if not self.queue:
            raise ClientError("receiver closed by the broker")
        return self.queue.popleft()

    async def receive_n(self, n: int, timeout: float = DEFAULT_TIMEOUT) -> list[Received]:
        return [await self.receive(timeout) for _ in range(n)]

    async def expect_none(self, wait: float = 1.0) -> None:
        """Assert that nothing arrives within `wait` seconds (trio time)."""
        await self.client._flush()
        with trio.move_on_after(wait):
            await self.client._wait(lambda: self.queue, math.inf)
        if self.queue:
            raise AssertionError(f"unexpected delivery: {self.queue[0]!r}")

    async def drain(self, timeout: float = DEFAULT_TIMEOUT) -> None:
        """Ask the broker to use or return all credit; waits until credit is 0."""
        self.link.drain(0)
        await self.client._flush()
        await self.client._wait(lambda: self.link.credit == 0 and not self.link.draining(), timeout)

    def _settle(self, r: Received, state: int) -> None:
        r.delivery.update(state)
        r.delivery.settle()
        self.client._kick()

    def accept(self, r: Received) -> None:
        self._settle(r, Delivery.ACCEPTED)

    def release(self, r: Received) -> None:
        self._settle(r, Delivery.RELEASED)

    def reject(self, r: Received) -> None:
        self._settle(r, Delivery.REJECTED)

    def modify(self, r: Received, *, failed: bool = True, undeliverable: bool = False) -> None:
        r.delivery.local.failed = failed
        r.delivery.local.undeliverable = undeliverable
        self._settle(r, Disposition.MODIFIED)


class Client:
    def __init__(
        self, sock: trio.socket.SocketType, transport: Transport, conn: Connection
    ) -> None:
        self.sock = sock
        self.transport = transport
        self.conn = conn
        self.collector = Collector()
        conn.collect(self.collector)
        self._changed = trio.Event()
        self._names = itertools.count(1)
        self._receivers: dict[Link, Receiver] = {}
        self._nursery: trio.Nursery | None = None
        self._dead = False
        self._session: Any = None
        self._send_lock = trio.Lock()
        self._tick_lot = trio.lowlevel.ParkingLot()

    @classmethod
    async def connect(
        cls,
        port: int,
        host: str = "127.0.0.1",
        *,
        user: str | None = None,
        password: str | None = None,
        mechs: str | None = None,
        container: str | None = None,
        desired: list[str] | None = None,
        idle_timeout: float | None = None,
        sasl: bool = True,
        ssl_domain: SSLDomain | None = None,
        nursery: trio.Nursery,
        timeout: float = DEFAULT_TIMEOUT,
        source: str | None = None,
    ) -> Client:
        sock = trio.socket.socket()
        sock.setsockopt(trio.socket.IPPROTO_TCP, trio.socket.TCP_NODELAY, 1)
        try:
            if source is not None:  # connect from this local address (e.g. 127.0.0.2)
                await sock.bind((source, 0))
            await sock.connect((host, port))
        except BaseException:
            sock.close()  # refused (e.g. a standby pair member): no socket left behind
            raise
        conn = Connection()
        if container:
            conn.container = container
        if desired:
            conn.desired_capabilities = SymbolList([symbol(x) for x in desired])
        if user is not None:
            conn.user = user
            conn.password = password
        t = Transport()
        if idle_timeout is not None:
            t.idle_timeout = idle_timeout
        if sasl:
            s: SASL = t.sasl()
            s.allowed_mechs(mechs or ("PLAIN" if user is not None else "ANONYMOUS"))
            s.allow_insecure_mechs = True
        if ssl_domain is not None:  # TLS by Proton's SSL layer; the name checked is `host`
            SSL(t, ssl_domain).peer_hostname = host
        t.bind(conn)
        c = cls(sock, t, conn)
        c._nursery = nursery
        conn.open()
        c._session = conn.session()
        c._session.open()
        nursery.start_soon(c._reader)
        nursery.start_soon(c._ticker)
        await c._flush()
        await c._wait(
            lambda: (
                conn.state & Endpoint.REMOTE_ACTIVE
                or conn.state & Endpoint.REMOTE_CLOSED
                or c._dead
            ),
            timeout,
        )
        if not conn.state & Endpoint.REMOTE_ACTIVE:
            cond = conn.remote_condition or t.condition
            c.abort()
            err = ClientError(
                f"connection refused: {cond.name if cond else None}: "
                f"{cond.description if cond else ''}"
            )
            err.condition = cond
            raise err
        return c

    # ------------------------------------------------------------------ links
    def _new_name(self, prefix: str) -> str:
        return f"{prefix}-{next(self._names)}"

    async def sender(
        self,
        address: str | None,
        *,
        presettled: bool = False,
        dynamic: bool = False,
        capabilities: list[str] | None = None,
        name: str | None = None,
        wait: bool = True,
    ) -> Sender:
        link = self._session.sender(name or self._new_name("sender"))
        if address is not None:
            link.target.address = address
        link.target.dynamic = dynamic
        if capabilities:
            _put_symbols(link.target.capabilities, capabilities)
        if presettled:
            link.snd_settle_mode = Link.SND_SETTLED
        link.open()
        s = Sender(self, link)
        await self._flush()
        if wait:
            await s.wait_open()
        return s

    async def receiver(
        self,
        address: str | None,
        *,
        credit: int = 0,
        presettled: bool = False,
        dynamic: bool = False,
        capabilities: list[str] | None = None,
        priority: int | None = None,
        name: str | None = None,
        wait: bool = True,
        configure: Callable[[Link], None] | None = None,
    ) -> Receiver:
        """`configure` may set anything else on the link before it is opened
        (filters, durability, distribution mode...)."""
        link = self._session.receiver(name or self._new_name("receiver"))
        if address is not None:
            link.source.address = address
        link.source.dynamic = dynamic
        if capabilities:
            _put_symbols(link.source.capabilities, capabilities)
        if priority is not None:
            link.properties = {symbol("priority"): priority}
        if configure is not None:
            configure(link)
        if presettled:
            link.snd_settle_mode = Link.SND_SETTLED
        link.open()
        r = Receiver(self, link)
        self._receivers[link] = r
        if credit:
            link.flow(credit)
        await self._flush()
        if wait:
            await r.wait_open()
        return r

    # ---------------------------------------------------------------- running
    def _kick(self) -> None:
        if self._nursery is not None and not self._dead:
            self._nursery.start_soon(self._flush)

    async def _flush(self) -> None:
        """Write all pending output; serialised so concurrent callers never send the
        same bytes twice or out of order."""
        self._process()
        async with self._send_lock:
            while not self._dead:
                try:
                    p = self.transport.pending()
                except ProtonException:  # output closed (EOS)
                    break
                if p <= 0:
                    break
                data = self.transport.peek(p)
                self.transport.pop(p)
                try:
                    while data:
                        n = await self.sock.send(data)
                        data = data[n:]
                except (OSError, trio.ClosedResourceError):
                    self._dead = True
                    break
        self._signal()

    def _signal(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def _process(self) -> None:
        while True:
            ev = self.collector.peek()
            if ev is None:
                break
            if ev.type == Event.DELIVERY:
                link = ev.link
                d = ev.delivery
                if link.is_receiver and d.readable and not d.partial:
                    raw = link.recv(d.pending)
                    link.advance()
                    m = Message()
                    m.decode(raw)
                    r = self._receivers.get(link)
                    if r is not None:
                        r.queue.append(Received(d, m, raw))
            self.collector.pop()

    async def _reader(self) -> None:
        try:
            while True:
                try:
                    data = await self.sock.recv(65536)
                except (OSError, trio.ClosedResourceError):
                    data = b""
                if not data:
                    self.transport.close_tail()
                    self._dead = True
                    self._process()
                    self._signal()
                    return
                while data:
                    cap = self.transport.capacity()
                    if cap <= 0:
                        break
                    self.transport.push(data[:cap])
                    data = data[cap:]
                    self._process()
                self._tick_lot.unpark_all()  # input can move the idle deadline
                await self._flush()
        finally:
            self._dead = True

    async def _ticker(self) -> None:
        # proton's Python Transport.tick takes and returns seconds
        while not self._dead:
            nxt = self.transport.tick(trio.current_time())
            await self._flush()
            with trio.move_on_at(nxt if nxt else math.inf):
                await self._tick_lot.park()

    async def _wait(self, cond: Any, timeout: float) -> None:
        with trio.fail_after(timeout):
            while not cond():
                if self._dead and not cond():
                    self._process()
                    if cond():
                        return
                    raise ClientError("connection lost")
                await self._changed.wait()

    @property
    def closed_by_peer(self) -> bool:
        return bool(self.conn.state & Endpoint.REMOTE_CLOSED)

    @property
    def remote_condition(self) -> Any:
        return self.conn.remote_condition

    @property
    def offered_capabilities(self) -> list[str]:
        caps = self.conn.remote_offered_capabilities
        return [str(c) for c in caps] if caps else []

    async def close(self, timeout: float = DEFAULT_TIMEOUT) -> None:
        if not self._dead:
            self.conn.close()
            await self._flush()
            with trio.move_on_after(timeout):
                await self._wait(
                    lambda: self.conn.state & Endpoint.REMOTE_CLOSED or self._dead, timeout
                )
        self.abort()

    def abort(self) -> None:
        """Drop the socket without an AMQP close (a crashed client)."""
        self._dead = True
        self.sock.close()
        self._signal()

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _put_symbols(data: Data, names: list[str]) -> None:
    data.put_array(False, Data.SYMBOL)
    data.enter()
    for n in names:
        data.put_symbol(n)
    data.exit()


async def roundtrip(c: Client, timeout: float = DEFAULT_TIMEOUT) -> None:
    """Flush what the client has queued, then wait for an answer the broker sends only
    after processing it (a session begin/end): everything sent before is handled, and
    everything the broker sent in reaction is already in this client."""
    await c._flush()
    ssn = c.conn.session()
    ssn.open()
    await c._flush()
    await c._wait(lambda: ssn.state & (Endpoint.REMOTE_ACTIVE | Endpoint.REMOTE_CLOSED), timeout)
    ssn.close()
    await c._flush()
    await c._wait(lambda: ssn.state & Endpoint.REMOTE_CLOSED, timeout)


async def wait_until(pred: Any, timeout: float = DEFAULT_TIMEOUT) -> None:
    """Poll a broker-side condition (bounded; meant for the autojump clock)."""
    with trio.fail_after(timeout):
        while True:
            if pred():
                return
            await trio.sleep(0.01)


async def wait_ended(c: Client, timeout: float = DEFAULT_TIMEOUT) -> None:
    """Until the broker closed the connection or the socket ended."""
    with trio.fail_after(timeout):
        while not (c._dead or c.closed_by_peer):
            await c._changed.wait()


# ------------------------------------------------------ transactions (AMQP part 4)
# Helpers that speak to a transaction coordinator the way Qpid JMS does: a sender link
# with a Coordinator target, Declare / Discharge as amqp-value bodies (described lists
# with ulong descriptors), transactional-state on transfers and dispositions.

DECLARE = 0x31
DISCHARGE = 0x32
DECLARED = 0x33
TRANSACTIONAL = 0x34


async def coordinator(
    c: Client,
    *,
    name: str | None = None,
    capabilities: list[str] | None = None,
    wait: bool = True,
) -> Sender:
    """Attach a sender to the transaction coordinator (Qpid JMS's coordinator link)."""
    link = c._session.sender(name or c._new_name("qpid-jms:coordinator"))
    link.target.type = Terminus.COORDINATOR
    _put_symbols(
        link.target.capabilities,
        capabilities if capabilities is not None else ["amqp:local-transactions"],
    )
    link.open()
    s = Sender(c, link)
    await c._flush()
    if wait:
        await s.wait_open()
    return s


async def control(s: Sender, body: Any, *, timeout: float = DEFAULT_TIMEOUT) -> Delivery:
    """Send one coordinator message and wait until the coordinator settled it."""
    c = s.client
    await c._wait(lambda: s.link.credit > 0 or s.closed_by_peer, timeout)
    d = s.send_nowait(Message(body=body))
    await c._flush()
    await c._wait(lambda: d.settled or s.closed_by_peer, timeout)
    return d


async def declare(s: Sender, *, timeout: float = DEFAULT_TIMEOUT) -> bytes:
    """Declare a transaction; returns its txn-id."""
    d = await control(s, Described(ulong(DECLARE), []), timeout=timeout)
    if d.remote_state != DECLARED:
        cond = d.remote.condition
        raise ClientError(f"declare answered {d.remote_state}: {cond}")
    data = d.remote.data
    assert data, "declared without a txn-id"
    return bytes(data[0])


async def discharge(
    s: Sender, txn_id: bytes, *, fail: bool = False, timeout: float = DEFAULT_TIMEOUT
) -> Delivery:
    """Commit (fail=False) or roll back; returns the settled delivery (accepted or
    rejected with a condition)."""
    return await control(s, Described(ulong(DISCHARGE), [txn_id, fail]), timeout=timeout)


def enlist(
    d: Delivery,
    txn_id: bytes,
    outcome: int | None = None,
    *,
    failed: bool = False,
    undeliverable: bool = False,
) -> None:
    """Set a transactional-state {txn-id, outcome} as the delivery's local state."""
    fields: list[Any] = [txn_id]
    if outcome is not None:
        value: list[Any] = [failed, undeliverable] if outcome == Disposition.MODIFIED else []
        fields.append(Described(ulong(int(outcome)), value))
    d.local.data = fields
    d.update(TRANSACTIONAL)


def txn_send_nowait(s: Sender, msg: Message, txn_id: bytes) -> Delivery:
    """A transfer carrying transactional-state {txn-id} (as Qpid JMS sends it)."""
    d = s.link.delivery(f"tx{next(s._tags)}")
    enlist(d, txn_id)
    s.link.send(msg.encode())
    s.link.advance()
    if s.link.snd_settle_mode == Link.SND_SETTLED:
        d.settle()
    return d


async def txn_send_many(
    s: Sender, msgs: list[Message], txn_id: bytes, *, timeout: float = DEFAULT_TIMEOUT
) -> list[Delivery]:
    """Send in the transaction; waits for every outcome unless presettled."""
    c = s.client
    out = []
    for m in msgs:
        await c._wait(lambda: s.link.credit > 0 or s.closed_by_peer, timeout)
        out.append(txn_send_nowait(s, m, txn_id))
    await c._flush()
    if s.link.snd_settle_mode != Link.SND_SETTLED:
        await c._wait(lambda: all(d.settled or d.remote_state for d in out), timeout)
    return out


def txn_settle(
    r: Receiver,
    rec: Received,
    txn_id: bytes,
    outcome: int = Delivery.ACCEPTED,
    *,
    failed: bool = False,
    undeliverable: bool = False,
) -> None:
    """Acknowledge in a transaction, settled (as Qpid JMS does)."""
    enlist(rec.delivery, txn_id, outcome, failed=failed, undeliverable=undeliverable)
    rec.delivery.settle()
    r.client._kick()
