"""Interop with a second AMQP 1.0 implementation: rhea (Node.js), over real sockets.

Each test starts a broker in-process (`broker` / `make_broker` of tests/conftest.py) and
runs `interop/node/rhea_client.js` as a subprocess (`trio.run_process`); the client prints
one JSON object per event, which the tests parse and check exactly. Cross-client tests
pair rhea with the trio Proton client of tests/client.py in both directions and compare
the message bytes: the broker must pass a message through unchanged (it rewrites the
header only to change the delivery-count, and adds an application property only for
group-first-key).

Needs `node` on PATH and rhea installed: `cd interop/node && npm ci` (scripts/test does
it when npm exists). Without them these tests fail; they are never skipped.
"""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio
from proton import Message, int32, symbol, uint

from amqbroker.app import BrokerApp
from amqbroker.core.auth import hash_password
from tests.client import Received
from tests.conftest import BrokerFactory, ConnectFactory

pytestmark = pytest.mark.interop

NODE_DIR = Path(__file__).resolve().parents[2] / "interop" / "node"
CLIENT = NODE_DIR / "rhea_client.js"
#: bound on one run of the node client (its own waits are bounded by --timeout)
RUN_TIMEOUT = 60.0
CLIENT_TIMEOUT = "10"

Event = dict[str, Any]


# --------------------------------------------------------------------------- helpers


@dataclass
class RheaRun:
    argv: list[str]
    returncode: int
    events: list[Event]
    stderr: str

    def of(self, kind: str) -> list[Event]:
        return [e for e in self.events if e["event"] == kind]

    def one(self, kind: str) -> Event:
        found = self.of(kind)
        assert len(found) == 1, f"expected one {kind!r} event, got {found}\n{self}"
        return found[0]

    def __str__(self) -> str:
        lines = "\n".join(json.dumps(e) for e in self.events)
        return (
            f"$ {' '.join(self.argv)}\nexit status {self.returncode}\n"
            f"stderr:\n{self.stderr}\nstdout:\n{lines}"
        )


def _parse(argv: list[str], returncode: int, stdout: bytes, stderr: bytes) -> RheaRun:
    events = []
    for line in stdout.decode().splitlines():
        if line.strip():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                pytest.fail(f"rhea_client printed a line that is not JSON: {line!r}")
    return RheaRun(argv, returncode, events, stderr.decode())


def _node() -> str:
    node = shutil.which("node")
    rhea = NODE_DIR / "node_modules" / "rhea" / "package.json"
    if node is None or not rhea.is_file():
        missing = "node is not on PATH" if node is None else f"{rhea} is missing"
        pytest.fail(
            f"the rhea interop tests need Node.js and rhea ({missing}): "
            "run `cd interop/node && npm ci` (scripts/test does it when npm is installed)",
            pytrace=False,
        )
    return node


Rhea = Callable[..., Awaitable[RheaRun]]


@pytest.fixture
def rhea_argv() -> Callable[..., list[str]]:
    """Command line of one scenario; checks for node and rhea (failing the test, not
    erroring its setup, when they are missing)."""

    def argv(scenario: str, port: int, *args: str) -> list[str]:
        return [
            _node(),
            str(CLIENT),
            scenario,
            "--port",
            str(port),
            "--timeout",
            CLIENT_TIMEOUT,
            *args,
        ]

    return argv


@pytest.fixture
def rhea(rhea_argv: Callable[..., list[str]]) -> Rhea:
    """Run one scenario to completion; fails the test unless it exits with `status`."""

    async def run(scenario: str, port: int, *args: str, status: int = 0) -> RheaRun:
        argv = rhea_argv(scenario, port, *args)
        with trio.fail_after(RUN_TIMEOUT):
            proc = await trio.run_process(
                argv, capture_stdout=True, capture_stderr=True, check=False
            )
        result = _parse(argv, proc.returncode, proc.stdout, proc.stderr)
        if proc.returncode != status:
            pytest.fail(f"rhea_client exited {proc.returncode}, expected {status}\n{result}")
        return result

    return run


def port_of(app: BrokerApp) -> int:
    return app.listening[0][1]


def queue_messages(app: BrokerApp, name: str) -> int:
    """Messages a queue holds (in flight included); 0 once it was auto-deleted."""
    q = app.statistics()["queues"].get(name)
    return 0 if q is None else int(q["messages"])


def messages(run: RheaRun, receiver: str | None = None) -> list[Event]:
    return [e for e in run.of("message") if receiver is None or e["receiver"] == receiver]


def received_fields(e: Event) -> tuple[Any, ...]:
    return (e["body"], e["group_id"], e["group_sequence"], e["application_properties"])


# ------------------------------------------------------------- rhea with itself


async def test_rhea_send_then_receive_byte_for_byte(
    broker: BrokerApp, port: int, rhea: Rhea
) -> None:
    sent = await rhea(
        "send", port, "--address", "rhea.q1", "--count", "6", "--groups", "2", "--durable", "--raw"
    )
    settled = sent.of("settled")
    assert [(e["index"], e["outcome"]) for e in settled] == [(i, "accepted") for i in range(6)]
    assert sent.one("send_done")["outcomes"] == {"accepted": 6}
    assert queue_messages(broker, "rhea.q1") == 6

    got = await rhea(
        "receive", port, "--address", "rhea.q1", "--count", "6", "--raw", "--expect-empty"
    )
    msgs = messages(got)
    assert [received_fields(e) for e in msgs] == [
        (f"m{i}", f"g{i % 2}", i // 2, {"index": i, "client": "rhea"}) for i in range(6)
    ]
    assert all(e["durable"] is True and e["delivery_count"] == 0 for e in msgs)
    # the broker hands over exactly the bytes rhea sent
    assert [e["raw"] for e in msgs] == [e["raw"] for e in settled]
    got.one("drained")
    assert got.one("receive_done")["count"] == 6
    assert queue_messages(broker, "rhea.q1") == 0


async def test_rhea_connection_properties(broker: BrokerApp, port: int, rhea: Rhea) -> None:
    run = await rhea("send", port, "--address", "rhea.props")
    c = run.one("connected")
    assert c["offered_capabilities"] == ["ANONYMOUS-RELAY"]
    assert c["properties"]["product"] == "amqbroker"
    assert c["container_id"] == "amqbroker"


async def test_rhea_roundtrip_one_connection(broker: BrokerApp, port: int, rhea: Rhea) -> None:
    run = await rhea("roundtrip", port, "--address", "rhea.rt", "--count", "25")
    done = run.one("roundtrip_done")
    assert done["outcomes"] == {"accepted": 25}
    assert done["in_order"] is True
    assert [e["body"] for e in messages(run)] == [f"m{i}" for i in range(25)]
    assert queue_messages(broker, "rhea.rt") == 0


async def test_rhea_groups_two_receivers(broker: BrokerApp, port: int, rhea: Rhea) -> None:
    run = await rhea("groups", port, "--address", "rhea.groups", "--count", "20", "--groups", "4")
    done = run.one("groups_done")
    assert done["ok"] is True, done["problems"]
    assert done["outcomes"] == {"accepted": 20}
    # a new group goes round robin in attach order: r1, r2, r1, r2
    assert done["assignment"] == {"g0": "r1", "g1": "r2", "g2": "r1", "g3": "r2"}
    assert done["counts"] == {"r1": 10, "r2": 10}
    assert [e["body"] for e in messages(run, "r1")] == [
        f"m{i}" for i in range(20) if i % 4 in (0, 2)
    ]
    assert [e["body"] for e in messages(run, "r2")] == [
        f"m{i}" for i in range(20) if i % 4 in (1, 3)
    ]
    assert queue_messages(broker, "rhea.groups") == 0


async def test_rhea_dynamic_receiver(broker: BrokerApp, port: int, rhea: Rhea) -> None:
    run = await rhea("dynamic", port, "--count", "3")
    address = run.one("dynamic")["address"]
    assert isinstance(address, str)
    assert address.startswith("tmp.")
    done = run.one("dynamic_done")
    assert done["outcomes"] == {"accepted": 3}
    assert done["in_order"] is True
    assert [e["body"] for e in messages(run)] == ["m0", "m1", "m2"]
    # the broker closed the connection after its cleanup: the temporary queue is gone
    sizes = broker.registry_sizes()
    assert sizes["temporary_queues"] == 0
    assert sizes["consumers"] == 0
    assert address not in broker.statistics()["queues"]


async def test_rhea_anonymous_relay(broker: BrokerApp, port: int, rhea: Rhea) -> None:
    run = await rhea(
        "anonymous", port, "--to", "rhea.anon.a,rhea.anon.b", "--count", "6", "--missing-to"
    )
    assert "ANONYMOUS-RELAY" in run.one("connected")["offered_capabilities"]
    settled = run.of("settled")
    assert [(e["index"], e["outcome"], e.get("to")) for e in settled] == [
        (0, "accepted", "rhea.anon.a"),
        (1, "accepted", "rhea.anon.b"),
        (2, "accepted", "rhea.anon.a"),
        (3, "accepted", "rhea.anon.b"),
        (4, "accepted", "rhea.anon.a"),
        (5, "accepted", "rhea.anon.b"),
        (6, "rejected", None),
    ]
    assert settled[-1]["condition"] == "amqp:precondition-failed"
    done = run.one("anonymous_done")
    assert done["outcomes"] == {"accepted": 6, "rejected": 1}
    assert done["received"] == {
        "rhea.anon.a": ["m0", "m2", "m4"],
        "rhea.anon.b": ["m1", "m3", "m5"],
    }
    assert [e["to"] for e in messages(run)] == ["rhea.anon.a"] * 3 + ["rhea.anon.b"] * 3
    assert queue_messages(broker, "rhea.anon.a") == queue_messages(broker, "rhea.anon.b") == 0


async def test_rhea_release_and_modified_delivery_count(
    broker: BrokerApp, port: int, rhea: Rhea
) -> None:
    run = await rhea("release", port, "--address", "rhea.rel", "--body-prefix", "r")
    steps = [(e["step"], e["body"], e["delivery_count"]) for e in messages(run)]
    assert steps == [
        ("first", "r0", 0),
        ("after_release", "r0", 0),  # released: delivery-count unchanged
        ("after_modified", "r0", 1),  # modified, delivery-failed: + 1
        ("after_second_modified", "r0", 2),
    ]
    run.one("drained")
    assert run.one("release_done")["ok"] is True
    assert queue_messages(broker, "rhea.rel") == 0


async def test_rhea_group_first_key_is_spliced(make_broker: BrokerFactory, rhea: Rhea) -> None:
    """The broker adds the group-first property to rhea's (map32) application-properties;
    rhea must decode it and every other property must be intact."""
    app = await make_broker(
        address_settings={"#": {"default_group_first_key": "JMSXGroupFirstForConsumer"}}
    )
    port = port_of(app)
    await rhea("send", port, "--address", "rhea.first", "--count", "4", "--groups", "2")
    run = await rhea("receive", port, "--address", "rhea.first", "--count", "4", "--expect-empty")
    assert [(e["body"], e["application_properties"]) for e in messages(run)] == [
        ("m0", {"index": 0, "client": "rhea", "JMSXGroupFirstForConsumer": True}),
        ("m1", {"index": 1, "client": "rhea", "JMSXGroupFirstForConsumer": True}),
        ("m2", {"index": 2, "client": "rhea"}),
        ("m3", {"index": 3, "client": "rhea"}),
    ]


async def test_rhea_sasl_plain(make_broker: BrokerFactory, rhea: Rhea) -> None:
    app = await make_broker(
        users={"alice": hash_password("s3cret", iterations=1000)}, require_auth=True
    )
    port = port_of(app)
    ok = await rhea(
        "roundtrip", port, "--address", "rhea.auth", "--username", "alice", "--password", "s3cret"
    )
    assert ok.one("roundtrip_done")["in_order"] is True
    refused = await rhea(
        "send",
        port,
        "--address",
        "rhea.auth",
        "--username",
        "alice",
        "--password",
        "wrong",
        status=3,
    )
    assert refused.of("connected") == []
    assert "amqp:unauthorized-access" in refused.stderr
    # no SASL layer at all: the broker answers with its SASL header, rhea gives up
    no_sasl = await rhea("send", port, "--address", "rhea.auth", status=3)
    assert no_sasl.of("connected") == []
    assert "SASL" in no_sasl.stderr
    assert queue_messages(app, "rhea.auth") == 0


async def test_rhea_refused_link_is_reported(broker: BrokerApp, port: int, rhea: Rhea) -> None:
    run = await rhea("receive", port, "--address", "$management", status=3)
    assert "amqp:not-found" in run.stderr


# ------------------------------------------------------- rhea <-> Proton (Python)

RHEA_MESSAGES: list[dict[str, Any]] = [
    {
        "body": "hello-0",
        "group_id": "grp-a",
        "group_sequence": 0,
        "subject": "subj",
        "message_id": "rhea-id-0",
        "durable": True,
        "application_properties": {
            "str": "v",
            "long": {"$long": 5},
            "int": {"$int": -7},
            "uint": {"$uint": 7},
            "bool": True,
            "double": {"$double": 1.5},
        },
        "message_annotations": {"x-opt-tag": "t0", "x-opt-num": {"$long": 42}},
    },
    {
        "body": {"$data": "00ff10"},
        "group_id": "grp-a",
        "group_sequence": 1,
        "application_properties": {"str": "w"},
        "message_annotations": {"x-opt-tag": "t1"},
    },
    {
        "body": {"k": "v", "n": {"$long": 1}},
        "group_id": "grp-b",
        "group_sequence": 0,
    },
]


def typed(d: dict[Any, Any] | None) -> dict[str, tuple[str, Any]]:
    return {str(k): (type(v).__name__, v) for k, v in (d or {}).items()}


async def test_rhea_sends_python_receives(
    broker: BrokerApp, port: int, rhea: Rhea, connect: ConnectFactory
) -> None:
    sent = await rhea(
        "send", port, "--address", "x.r2p", "--messages", json.dumps(RHEA_MESSAGES), "--raw"
    )
    assert sent.one("send_done")["outcomes"] == {"accepted": 3}
    c = await connect()
    r = await c.receiver("x.r2p", credit=10)
    got: list[Received] = await r.receive_n(3)
    for g in got:
        r.accept(g)
    # byte for byte what rhea encoded
    assert [g.raw.hex() for g in got] == [e["raw"] for e in sent.of("settled")]
    m0, m1, m2 = (g.message for g in got)
    assert (m0.body, m0.group_id, m0.group_sequence, m0.subject, m0.id, m0.durable) == (
        "hello-0",
        "grp-a",
        0,
        "subj",
        "rhea-id-0",
        True,
    )
    assert typed(m0.properties) == {
        "str": ("str", "v"),
        "long": ("int", 5),
        "int": ("int32", -7),
        "uint": ("uint", 7),
        "bool": ("bool", True),
        "double": ("float", 1.5),
    }
    assert typed(m0.annotations) == {"x-opt-tag": ("str", "t0"), "x-opt-num": ("int", 42)}
    assert bytes(m1.body) == b"\x00\xff\x10"
    assert (m1.group_id, m1.group_sequence, m1.properties) == ("grp-a", 1, {"str": "w"})
    assert typed(m1.annotations) == {"x-opt-tag": ("str", "t1")}
    assert (m2.body, m2.group_id, m2.group_sequence) == ({"k": "v", "n": 1}, "grp-b", 0)
    await r.drain()
    assert not r.queue
    await c.close()
    assert queue_messages(broker, "x.r2p") == 0


def python_messages() -> list[Message]:
    return [
        Message(
            body="py-0",
            id="py-id-0",
            subject="subj",
            group_id="pg",
            group_sequence=0,
            durable=True,
            properties={"s": "x", "n": 7, "i": int32(-3), "u": uint(9), "b": False},
            annotations={symbol("x-opt-py"): "yes", symbol("x-opt-n"): 12},
        ),
        Message(body=b"\x00\x01\xfe", group_id="pg", group_sequence=1, properties={"s": "y"}),
        Message(body={"k": "v"}, group_id="ph", group_sequence=0),
    ]


async def test_python_sends_rhea_receives(
    broker: BrokerApp, port: int, rhea: Rhea, connect: ConnectFactory
) -> None:
    c = await connect()
    s = await c.sender("x.p2r")
    msgs = python_messages()
    await s.send_many(msgs)
    await c.close()
    run = await rhea(
        "receive", port, "--address", "x.p2r", "--count", "3", "--raw", "--expect-empty"
    )
    got = messages(run)
    # byte for byte what Proton encoded
    assert [e["raw"] for e in got] == [m.encode().hex() for m in msgs]
    e0, e1, e2 = got
    assert {k: e0[k] for k in ("body", "message_id", "subject", "group_id", "durable")} == {
        "body": "py-0",
        "message_id": "py-id-0",
        "subject": "subj",
        "group_id": "pg",
        "durable": True,
    }
    assert e0["group_sequence"] == 0
    assert e0["application_properties"] == {"s": "x", "n": 7, "i": -3, "u": 9, "b": False}
    assert e0["message_annotations"] == {"x-opt-py": "yes", "x-opt-n": 12}
    assert (e1["body"], e1["group_id"], e1["group_sequence"]) == ({"$binary": "0001fe"}, "pg", 1)
    assert e1["application_properties"] == {"s": "y"}
    assert (e2["body"], e2["group_id"], e2["group_sequence"]) == ({"k": "v"}, "ph", 0)
    assert all(e["delivery_count"] == 0 for e in got)
    assert queue_messages(broker, "x.p2r") == 0


async def read_all(stream: trio.abc.ReceiveStream) -> bytes:
    out = b""
    while chunk := await stream.receive_some():
        out += chunk
    return out


class LineReader:
    """JSON events from a running rhea_client's stdout, one line at a time."""

    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self.stream = stream
        self.buf = b""
        self.events: list[Event] = []

    async def next_event(self) -> Event | None:
        """The next event; None at the end of the output."""
        while b"\n" not in self.buf:
            chunk = await self.stream.receive_some()
            if not chunk:
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        event: Event = json.loads(line)
        self.events.append(event)
        return event

    async def until(self, kind: str) -> Event | None:
        while (e := await self.next_event()) is not None:
            if e["event"] == kind:
                return e
        return None

    async def all(self) -> list[Event]:
        while await self.next_event() is not None:
            pass
        return self.events


async def test_groups_shared_by_python_and_rhea_receivers(
    broker: BrokerApp,
    port: int,
    connect: ConnectFactory,
    rhea_argv: Callable[..., list[str]],
    nursery: trio.Nursery,
) -> None:
    """One queue, a Proton receiver (attached first) and a rhea receiver; a Proton
    sender sends 4 interleaved groups. Round robin binds g0, g2 to Proton and g1, g3 to
    rhea; each side gets its groups complete and in order."""
    address = "x.shared"
    argv = rhea_argv(
        "receive", port, "--address", address, "--count", "10", "--ready", "--expect-empty"
    )
    c = await connect()
    r = await c.receiver(address, credit=20)
    with trio.fail_after(RUN_TIMEOUT):
        proc: trio.Process = await nursery.start(
            functools.partial(
                trio.run_process,
                argv,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                check=False,
            )
        )
        assert proc.stdout is not None
        assert proc.stderr is not None
        out = LineReader(proc.stdout)
        ready = await out.until("ready")
        if ready is None:
            await proc.wait()
            pytest.fail(
                f"rhea_client ended before it was ready (exit status {proc.returncode})\n"
                f"stderr: {(await read_all(proc.stderr)).decode()}\nstdout: {out.events}"
            )
        assert ready["address"] == address

        s = await c.sender(address)
        msgs = [
            Message(body=f"m{i}", group_id=f"g{i % 4}", group_sequence=i // 4, properties={"i": i})
            for i in range(20)
        ]
        await s.send_many(msgs)
        mine = await r.receive_n(10)
        for g in mine:
            r.accept(g)
        theirs = await out.all()
        status = await proc.wait()
        stderr = (await read_all(proc.stderr)).decode()
    assert status == 0, f"rhea_client exited {status}\nstderr: {stderr}\nstdout: {theirs}"
    assert [(g.body, g.group_id) for g in mine] == [
        (f"m{i}", f"g{i % 4}") for i in range(20) if i % 4 in (0, 2)
    ]
    rhea_msgs = [e for e in theirs if e["event"] == "message"]
    assert [(e["body"], e["group_id"], e["application_properties"]) for e in rhea_msgs] == [
        (f"m{i}", f"g{i % 4}", {"i": i}) for i in range(20) if i % 4 in (1, 3)
    ]
    assert [e["event"] for e in theirs][-2:] == ["drained", "receive_done"]
    await r.drain()
    assert not r.queue
    await c.close()
    assert queue_messages(broker, address) == 0
