"""Hostile connections over real sockets against one running broker, while a
well-behaved client keeps working.

One broker (in-process, real TCP listener). A trio task runs a good client on its own
connection for the whole test: it sends a message to queue ``good``, receives it and
accepts it, over and over. Meanwhile Hypothesis, in a worker thread, generates hostile
inputs (mutations of a valid client stream recorded by a Proton engine: truncation,
flipped bytes, garbage at a frame boundary, corrupted frame headers, unknown
descriptors, SASL garbage, pure noise) and sends each over 1-4 concurrent blocking
sockets (whole, or paced in the recorded bursts), then half-closes and reads until the
broker closes the socket. The broker runs in the test's trio loop, so it serves the
good client and the hostile sockets at the same time.

What must hold:

* the broker never crashes (an exception escaping a connection's driver would end
  the broker's nursery and this test) and closes every hostile socket within a bound
  once the peer's input ended (no hang);
* the good client never fails and keeps making progress during the hostile phase;
* afterwards, once the good client has closed, every registry of the broker is empty.

Bounded for CI (~10 s). A longer run: ``AMQBROKER_FUZZ_EXAMPLES=1000 pytest
tests/integration/test_fuzz.py`` (the count also applies to tests/engine/test_fuzz.py).
"""

from __future__ import annotations

import errno
import itertools
import select
import socket
import threading
import time

import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from proton import Delivery, Message

from amqbroker.app import BrokerApp
from tests.client import Client
from tests.conftest import BrokerFactory, wait_idle
from tests.engine.test_fuzz import (
    EXAMPLES,
    SASL_HEADER,
    _base,
    amqp_frames,
    base_stream,
    frames,
)

#: the broker must close a hostile socket this soon after the peer's input ended
CLOSE_BOUND = 5.0
#: a paced hostile client waits this long for the broker between its bursts
PACE = 0.003
#: round trips the good client makes before the hostile phase starts
WARMUP = 10


@st.composite
def hostile(draw: st.DrawFn) -> tuple[bytes, list[int]]:
    """A hostile byte stream and where its bursts start."""
    stream = bytearray(base_stream())
    bursts = list(_base()[1])
    kind = draw(
        st.sampled_from(
            ["truncate", "flip", "insert", "header", "descriptor", "sasl", "noise", "valid"]
        )
    )
    if kind == "truncate":
        del stream[draw(st.integers(min_value=0, max_value=len(stream) - 1)) :]
    elif kind == "flip":
        for _ in range(draw(st.integers(min_value=1, max_value=6))):
            i = draw(st.integers(min_value=0, max_value=len(stream) - 1))
            stream[i] = draw(st.integers(min_value=0, max_value=255))
    elif kind == "insert":
        fs = frames(bytes(stream))
        p, _ = fs[draw(st.integers(min_value=0, max_value=len(fs) - 1))]
        garbage = draw(st.binary(min_size=1, max_size=200))
        stream[p:p] = garbage
        bursts = [b + len(garbage) if b >= p else b for b in bursts]
    elif kind == "header":
        fs = amqp_frames(bytes(stream))
        p, _ = fs[draw(st.integers(min_value=0, max_value=len(fs) - 1))]
        stream[p : p + 6] = draw(st.binary(min_size=6, max_size=6))
    elif kind == "descriptor":
        fs = amqp_frames(bytes(stream))
        p, _ = fs[draw(st.integers(min_value=0, max_value=len(fs) - 1))]
        stream[p + stream[p + 4] * 4 + 2] = draw(st.integers(min_value=0, max_value=255))
    elif kind == "sasl":
        stream = bytearray(SASL_HEADER + draw(st.binary(min_size=1, max_size=400)))
        bursts = [0]
    elif kind == "noise":
        stream = bytearray(draw(st.binary(min_size=1, max_size=600)))
        bursts = [0]
    return bytes(stream), bursts


def attack(port: int, stream: bytes, bursts: list[int], paced: bool) -> None:
    """Send `stream` on a blocking socket, half-close, read until the broker closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=CLOSE_BOUND) as s:
        cuts = [*sorted(set(bursts)), len(stream)] if paced else [0, len(stream)]
        try:
            for a, b in itertools.pairwise(cuts):
                if a < b:
                    s.sendall(stream[a:b])
                if paced and select.select([s], [], [], PACE)[0] and not s.recv(65536):
                    return  # the broker closed already
            s.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            return  # the broker closed the connection first: fine
        except OSError as exc:
            if exc.errno != errno.ENOTCONN:
                raise
            return  # closed so fast that the half-close finds no connection: fine
        deadline = time.monotonic() + CLOSE_BOUND
        while True:
            left = deadline - time.monotonic()
            assert left > 0, "the broker did not close a hostile connection"
            s.settimeout(left)
            try:
                if not s.recv(65536):
                    return
            except ConnectionResetError:
                return
            except TimeoutError:
                raise AssertionError("the broker did not close a hostile connection") from None


def run_hostile(port: int) -> int:
    """The Hypothesis run (in a worker thread); returns how many sockets it used."""
    used = 0

    @settings(
        max_examples=EXAMPLES or 60,
        deadline=None,
        derandomize=not EXAMPLES,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(streams=st.lists(hostile(), min_size=1, max_size=4), paced=st.booleans())
    def fuzz(streams: list[tuple[bytes, list[int]]], paced: bool) -> None:
        nonlocal used
        errors: list[BaseException] = []

        def one(s: tuple[bytes, list[int]]) -> None:
            try:
                attack(port, s[0], s[1], paced)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=one, args=(s,)) for s in streams]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        used += len(streams)
        if errors:
            raise errors[0]

    fuzz()
    return used


class GoodClient:
    """Sends, receives and accepts on its own connection until told to stop."""

    def __init__(self) -> None:
        self.roundtrips = 0
        self.error: BaseException | None = None
        self.stop = trio.Event()
        #: set after the first WARMUP round trips
        self.warm = trio.Event()

    async def run(self, app: BrokerApp, nursery: trio.Nursery) -> None:
        try:
            c = await Client.connect(app.listening[0][1], nursery=nursery)
            snd = await c.sender("good")
            rcv = await c.receiver("good", credit=10)
            n = 0
            while not self.stop.is_set():
                n += 1
                d = await snd.send(Message(body=f"m{n}", group_id=f"g{n % 3}"))
                assert d.remote_state == Delivery.ACCEPTED, d.remote_state
                r = await rcv.receive()
                assert r.body == f"m{n}", (r.body, n)
                rcv.accept(r)
                if rcv.credit < 5:
                    rcv.flow(10)
                self.roundtrips += 1
                if self.roundtrips == WARMUP:
                    self.warm.set()
            await c.close()
        except BaseException as exc:  # recorded; the test fails on it
            self.error = exc
            self.warm.set()
            raise


async def test_hostile_connections_do_not_hurt_the_broker_or_a_good_client(
    make_broker: BrokerFactory, nursery: trio.Nursery
) -> None:
    app = await make_broker(handshake_timeout=2.0)
    port = app.listening[0][1]
    good = GoodClient()
    done = trio.Event()

    async def good_task() -> None:
        try:
            await good.run(app, nursery)
        finally:
            done.set()

    nursery.start_soon(good_task)
    with trio.fail_after(10):
        await good.warm.wait()
    assert good.error is None, good.error
    before = good.roundtrips
    used = await trio.to_thread.run_sync(run_hostile, port)
    during = good.roundtrips - before
    good.stop.set()
    with trio.fail_after(10):
        await done.wait()
    assert good.error is None, repr(good.error)
    assert used >= 60
    # the good client kept working while the hostile connections hammered the broker
    assert during >= 20, during
    sizes = await wait_idle(app)
    assert not any(sizes.values()), sizes
    # still serving: a fresh client works
    with trio.fail_after(10):
        c = await Client.connect(port, nursery=nursery)
        await (await c.sender("after")).send(Message(body="x"))
        await c.close()
