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
    assert "ANONYMOUS-RELAY" in c["offered_capabilities"]
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


# ------------------------------------------ JMS-style features, rhea with itself
#
# What Qpid JMS puts on the wire (docs: /work/shared/docs/JMS.md), sent by rhea: the
# checks follow AMQP 1.0 / JMS semantics.

SELECTOR_DESCRIPTOR = "0x0000468c00000004"
NO_LOCAL_DESCRIPTOR = "0x0000468c00000003"


def subscription_queues(app: BrokerApp, name: str) -> list[str]:
    """Queues whose name mentions a subscription name."""
    return [q for q in app.statistics()["queues"] if name in q]


async def test_rhea_connection_offers_jms_capabilities(
    broker: BrokerApp, port: int, rhea: Rhea
) -> None:
    run = await rhea("send", port, "--address", "rhea.caps")
    caps = run.one("connected")["offered_capabilities"]
    assert {"ANONYMOUS-RELAY", "DELAYED_DELIVERY", "SHARED-SUBS"} <= set(caps)


async def test_rhea_selector(broker: BrokerApp, port: int, rhea: Rhea) -> None:
    """Half of the messages wait in the queue when the filtered receiver attaches, half
    arrive after; the receiver gets exactly the matching ones, in order, and the others
    stay in the queue for a plain receiver."""
    selector = "color = 'red' AND weight > 2"
    msgs = [
        {
            "body": f"s{i}",
            "application_properties": {"color": "red" if i % 2 == 0 else "blue", "weight": i},
        }
        for i in range(8)
    ]
    run = await rhea(
        "selector",
        port,
        "--address",
        "rhea.sel",
        "--selector",
        selector,
        "--messages",
        json.dumps(msgs),
    )
    # the broker's source names the filter actually in place (AMQP 1.0 3.5.3)
    assert run.one("attached")["source"]["filter"] == {
        "jms-selector": {"descriptor": SELECTOR_DESCRIPTOR, "value": selector}
    }
    done = run.one("selector_done")
    assert done["outcomes"] == {"accepted": 8}
    assert done["selected"] == ["s4", "s6"]
    assert done["rest"] == ["s0", "s1", "s2", "s3", "s5", "s7"]
    assert [e["application_properties"]["weight"] for e in messages(run, "sel")] == [4, 6]
    assert queue_messages(broker, "rhea.sel") == 0


async def test_rhea_invalid_selector_is_refused(broker: BrokerApp, port: int, rhea: Rhea) -> None:
    run = await rhea(
        "selector",
        port,
        "--address",
        "rhea.badsel",
        "--selector",
        "color = = 'red'",
        "--expect-refused",
    )
    refused = run.one("refused")
    assert refused["condition"] == "amqp:invalid-field"
    # refusing a consumer: attach with a null source, then detach with the error
    assert refused["source"] is None
    assert broker.registry_sizes()["consumers"] == 0


async def test_rhea_no_local(broker: BrokerApp, port: int, rhea: Rhea) -> None:
    """Topic: connection A's no-local subscriber does not get what A sends; B's plain
    subscriber gets everything."""
    run = await rhea("no-local", port, "--address", "rhea.topic.nl", "--count", "3")
    assert run.one("attached")["source"]["filter"] == {
        "no-local": {"descriptor": NO_LOCAL_DESCRIPTOR, "value": []}
    }
    done = run.one("no_local_done")
    assert done["outcomes"] == {"A": {"accepted": 3}, "B": {"accepted": 3}}
    assert done["nolocal"] == ["b0", "b1", "b2"]
    assert done["plain"] == ["a0", "a1", "a2", "b0", "b1", "b2"]


async def test_rhea_temporary_queue(broker: BrokerApp, port: int, rhea: Rhea) -> None:
    """JMS createTemporaryQueue: a sender link with a dynamic target (temporary-queue,
    delete-on-close); another connection sends to it; closing the creator link deletes
    it, and a later send fails with amqp:not-found."""
    run = await rhea("temp-queue", port, "--count", "3")
    address = run.one("temp_queue")["address"]
    assert isinstance(address, str) and address
    done = run.one("temp_queue_done")
    assert done["outcomes"] == {"accepted": 3}
    assert done["received"] == ["m0", "m1", "m2"]
    run.one("drained")
    assert run.one("creator_closed")["error"] is None
    after = run.one("after_delete")
    assert after["condition"] == "amqp:not-found", after
    assert after["attach"] == "refused" or after["outcome"] == "rejected", after
    assert address not in broker.statistics()["queues"]
    assert broker.registry_sizes()["temporary_queues"] == 0


async def test_rhea_temporary_topic(broker: BrokerApp, port: int, rhea: Rhea) -> None:
    """JMS createTemporaryTopic: dynamic target with capability temporary-topic; every
    subscriber gets every message; closing the creator link deletes it."""
    run = await rhea("temp-topic", port, "--count", "3")
    address = run.one("temp_topic")["address"]
    assert isinstance(address, str) and address
    done = run.one("temp_topic_done")
    assert done["outcomes"] == {"accepted": 3}
    assert done["received"] == {"s1": ["m0", "m1", "m2"], "s2": ["m0", "m1", "m2"]}
    after = run.one("after_delete")
    assert after["condition"] == "amqp:not-found", after
    assert after["attach"] == "refused" or after["outcome"] == "rejected", after
    assert broker.registry_sizes()["temporary_queues"] == 0


DURABLE_RECEIVED = {
    "first": ["d0", "d1"],
    "reattached": ["d2", "d3"],  # published while the link was detached
    "fresh_before": [],  # d4 was published while no subscription existed
    "fresh": ["d5"],
}


def check_durable_attach(run: RheaRun, topic: str, sub: str) -> None:
    for e in run.of("attached"):
        assert e["link_name"] == sub
        src = e["source"]
        assert src is not None
        assert (src["address"], src["durable"], src["expiry_policy"]) == (topic, 2, "never")
        assert "topic" in src["capabilities"]


async def test_rhea_durable_subscription(broker: BrokerApp, port: int, rhea: Rhea) -> None:
    """Link name = subscription name, fixed container id. Detach (closed=false) keeps
    the subscription: what is published meanwhile is there on re-attach from a new
    connection. Close removes it: the same name then starts empty."""
    topic, sub = "rhea.topic.dur", "rhea-dsub"
    run = await rhea(
        "durable-sub", port, "--address", topic, "--sub", sub, "--container-id", "rhea-durable-1"
    )
    check_durable_attach(run, topic, sub)
    # the broker answers a detach with a detach, not a close
    assert [e["remote_closed"] for e in run.of("detached")] == [False]
    done = run.one("durable_done")
    assert done["outcomes"] == {"accepted": 6}
    assert done["received"] == DURABLE_RECEIVED
    assert all(e["delivery_count"] == 0 for e in messages(run))
    assert [e["remote_closed"] for e in run.of("closed")] == [True, True]
    assert subscription_queues(broker, sub) == []


async def test_rhea_durable_unsubscribe_by_link_name(
    broker: BrokerApp, port: int, rhea: Rhea
) -> None:
    """Qpid JMS unsubscribe: attach with the subscription's link name and no source (the
    broker answers with the subscription's source), then close."""
    topic, sub = "rhea.topic.unsub", "rhea-unsub"
    run = await rhea(
        "durable-sub",
        port,
        "--address",
        topic,
        "--sub",
        sub,
        "--container-id",
        "rhea-durable-2",
        "--unsubscribe-by-name",
    )
    check_durable_attach(run, topic, sub)
    unsub = run.one("unsubscribe_attach")
    assert unsub["refused"] is False
    assert unsub["source"] is not None
    assert unsub["source"]["address"] == topic
    assert run.one("durable_done")["received"] == DURABLE_RECEIVED
    assert subscription_queues(broker, sub) == []


@pytest.mark.parametrize("global_", [False, True], ids=["shared", "shared-global"])
async def test_rhea_shared_subscription(
    broker: BrokerApp, port: int, rhea: Rhea, global_: bool
) -> None:
    """Two receivers of one shared subscription (links sub|volatile1 / sub|volatile2 on
    one connection; global: sub|global-volatile1 on two connections) share the
    messages, each to exactly one of them; a plain subscriber gets all of them."""
    sub = "rhea-gsub" if global_ else "rhea-ssub"
    args = ["--address", f"rhea.topic.{sub}", "--sub", sub, "--count", "10"]
    if global_:
        args.append("--global")
    run = await rhea("shared-sub", port, *args)
    caps = ["topic", "shared", "global"] if global_ else ["topic", "shared"]
    names = [f"{sub}|global-volatile1"] * 2 if global_ else [f"{sub}|volatile1", f"{sub}|volatile2"]
    assert [e["link_name"] for e in run.of("attached")] == names
    for e in run.of("attached"):
        assert e["source"]["address"] == f"rhea.topic.{sub}"
        assert set(caps) <= set(e["source"]["capabilities"])
    done = run.one("shared_done")
    assert done["ok"] is True, done["problems"]
    assert done["outcomes"] == {"accepted": 10}
    got = done["received"]
    assert sorted(got["s1"] + got["s2"], key=lambda b: int(b[1:])) == [f"m{i}" for i in range(10)]
    assert len(got["s1"]) > 0 and len(got["s2"]) > 0
    assert got["plain"] == [f"m{i}" for i in range(10)]
    # volatile: gone with its last receiver
    assert subscription_queues(broker, sub) == []


async def test_rhea_queue_browser(broker: BrokerApp, port: int, rhea: Rhea) -> None:
    """distribution-mode copy: a browser sees every message in order and consumes
    none; a second browser sees them again; a normal receiver then consumes them."""
    run = await rhea("browse", port, "--address", "rhea.browse", "--count", "5")
    for e in run.of("attached"):
        assert e["source"]["distribution_mode"] == "copy"
    done = run.one("browse_done")
    expected = [f"m{i}" for i in range(5)]
    assert done["outcomes"] == {"accepted": 5}
    assert done["browse1"] == expected
    assert done["browse2"] == expected
    assert done["consumed"] == expected
    assert done["after"] == []
    assert all(e["delivery_count"] == 0 for e in messages(run))
    assert queue_messages(broker, "rhea.browse") == 0


async def test_rhea_drain(broker: BrokerApp, port: int, rhea: Rhea) -> None:
    """A drain on an empty queue completes at once (Qpid JMS receiveNoWait / receive
    with a timeout wait for it): the broker uses up the credit and says so."""
    run = await rhea("drain", port, "--address", "rhea.drain")
    results = {e["phase"]: e for e in run.of("drain_result")}
    empty = results["empty"]
    assert empty["messages"] == []
    assert empty["elapsed_ms"] < 2000
    assert (empty["credit"], empty["delivery_count"]) == (0, 5)
    two = results["two_messages"]
    assert two["messages"] == ["m0", "m1"]
    assert (two["credit"], two["delivery_count"]) == (0, 10)
    again = results["empty_again"]
    assert again["messages"] == []
    assert again["elapsed_ms"] < 2000
    assert (again["credit"], again["delivery_count"]) == (0, 11)
    assert queue_messages(broker, "rhea.drain") == 0


async def test_rhea_prefetch_zero(broker: BrokerApp, port: int, rhea: Rhea) -> None:
    """Two receivers granting one credit at a time, alternately: the broker never sends
    beyond the credit, so each message goes to whichever receiver asked for it."""
    run = await rhea("prefetch0", port, "--address", "rhea.pf0", "--count", "6")
    done = run.one("prefetch0_done")
    assert done["ok"] is True, done["problems"]
    assert done["received"] == {"A": ["m0", "m2", "m4"], "B": ["m1", "m3", "m5"]}
    assert queue_messages(broker, "rhea.pf0") == 0


async def test_rhea_transactions(broker: BrokerApp, port: int, rhea: Rhea) -> None:
    """Local transactions through a Coordinator (rhea has no transaction API: the
    client encodes the coordinator target, Declare / Discharge and the
    transactional-state by hand)."""
    run = await rhea("txn", port, "--address", "rhea.txn")
    assert run.one("attached")["refused"] is False
    declares = run.of("declare")
    assert [e["outcome"] for e in declares] == ["declared"] * 4
    txn_ids = [e["txn_id"]["$binary"] for e in declares]
    assert len(set(txn_ids)) == 4
    done = run.one("txn_done")
    for key, txn in (("sent_t1", txn_ids[0]), ("sent_t2", txn_ids[1])):
        assert [(s["outcome"], s["txn_id"]["$binary"], s["inner"]) for s in done[key]] == [
            ("transactional_state", txn, "accepted")
        ] * 2
    assert [done[f"discharge_t{i}"] for i in range(1, 5)] == ["accepted"] * 4
    assert done["after_rollback"] == []  # rolled-back sends never arrive
    assert done["before_commit"] == []  # uncommitted sends are invisible
    assert done["after_commit"] == ["t2", "t3"]
    assert done["after_ack_rollback"] == ["t2", "t3"]  # rolled-back acks: redelivered
    assert done["redelivered_counts"] == [1, 1]  # JMSRedelivered
    assert done["after_ack_commit"] == []
    assert (done["unknown"]["outcome"], done["unknown"]["condition"]) == (
        "rejected",
        "amqp:transaction:unknown-id",
    )
    assert queue_messages(broker, "rhea.txn") == 0


async def test_rhea_source_address_echo(broker: BrokerApp, port: int, rhea: Rhea) -> None:
    """The broker's attach names the source address exactly as the client sent it,
    query options included."""
    address = "orders?group-first-key=JMSXGroupFirstForConsumer"
    run = await rhea("echo", port, "--address", address)
    assert run.one("attached")["source"]["address"] == address
