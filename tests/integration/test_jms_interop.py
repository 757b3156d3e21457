"""Interoperability with the Qpid JMS client (AMQP 1.0, Jakarta Messaging).

Compiles ``interop/jms/src/main/java/amqbroker/interop/JmsInterop.java`` once with
``javac -cp $QPID_JMS_CLASSPATH`` and runs each of its scenarios in a JVM against a broker
started in-process with the ``make_broker`` fixture; the program prints one JSON object per
check, and the assertions below compare what it observed with the exact expected values.

``QPID_JMS_CLASSPATH`` lists the Qpid JMS client jar and its dependencies (proton-j,
jakarta.jms-api, netty, slf4j-api); see interop/jms/README.md for how to get them. CI has no
Maven Central, so without that variable this module is skipped as a whole.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import trio

from amqbroker.app import BrokerApp
from amqbroker.settings import Settings
from tests.conftest import BrokerFactory

CLASSPATH = os.environ.get("QPID_JMS_CLASSPATH", "")

if not CLASSPATH:
    pytest.skip(
        "Qpid JMS interop tests need QPID_JMS_CLASSPATH (the qpid-jms-client jar and its "
        "dependencies, ':'-separated); it is not set, and CI cannot fetch them (no Maven "
        "Central). See interop/jms/README.md.",
        allow_module_level=True,
    )

pytestmark = pytest.mark.interop

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "interop/jms/src/main/java/amqbroker/interop/JmsInterop.java"
MAIN_CLASS = "amqbroker.interop.JmsInterop"
GROUP_FIRST = "JMSXGroupFirstForConsumer"
# small, quick JVMs: the machines that run this have 2 cores
JVM_FLAGS = ["-Xmx256m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1", "-Xss512k"]
JVM_TIMEOUT = 90.0

Results = dict[tuple[str, str], dict[str, Any]]


@pytest.fixture(scope="module")
def jms_classpath(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Compile JmsInterop.java once for the module; the classpath to run it with."""
    for tool in ("javac", "java"):
        if shutil.which(tool) is None:
            pytest.fail(f"QPID_JMS_CLASSPATH is set but {tool!r} is not on PATH (need JDK 11+)")
    missing = [p for p in CLASSPATH.split(os.pathsep) if p and not Path(p).exists()]
    if missing:
        pytest.fail(f"QPID_JMS_CLASSPATH names files that do not exist: {missing}")
    out = tmp_path_factory.mktemp("jms-classes")
    proc = subprocess.run(
        [
            "javac",
            "--release",
            "11",
            "-encoding",
            "UTF-8",
            "-d",
            str(out),
            "-cp",
            CLASSPATH,
            str(SOURCE),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if proc.returncode != 0:
        pytest.fail(f"javac failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
    return f"{out}{os.pathsep}{CLASSPATH}"


async def run_jms(
    jms_classpath: str, broker: BrokerApp, *scenarios: str, run_id: str = "t"
) -> Results:
    """Run JmsInterop against `broker` (127.0.0.1 only); its checks keyed (scenario, check)."""
    port = broker.listening[0][1]
    cmd = [
        "java",
        *JVM_FLAGS,
        "-cp",
        jms_classpath,
        MAIN_CLASS,
        "--url",
        f"amqp://127.0.0.1:{port}",
        "--id",
        run_id,
        *scenarios,
    ]
    with trio.fail_after(JVM_TIMEOUT):
        proc = await trio.run_process(cmd, capture_stdout=True, capture_stderr=True, check=False)
    stdout = proc.stdout.decode(errors="replace")
    stderr = proc.stderr.decode(errors="replace")
    results: Results = {}
    for line in stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            results[(r["scenario"], r["check"])] = r
    if proc.returncode not in (0, 1) or not results:
        pytest.fail(
            f"JmsInterop {' '.join(scenarios)} exited {proc.returncode}\n"
            f"stdout:\n{stdout}\nstderr (tail):\n{stderr[-4000:]}"
        )
    await assert_idle(broker)
    return results


async def assert_idle(broker: BrokerApp) -> None:
    """Once the JVM is gone every connection, link and temporary queue is gone too."""
    sizes: dict[str, int] = {}
    with trio.move_on_after(5):
        while True:
            sizes = broker.registry_sizes()
            if not any(sizes.values()):
                return
            await trio.sleep(0.05)
    assert sizes == dict.fromkeys(sizes, 0), sizes


def check(results: Results, scenario: str, name: str) -> dict[str, Any]:
    """One check's observations, minus the bookkeeping fields."""
    assert (scenario, name) in results, f"no result for {scenario}/{name}: {list(results)}"
    r = dict(results[(scenario, name)])
    del r["scenario"], r["check"]
    return r


def group_first_settings() -> dict[str, Any]:
    return {"address_settings": {"#": {"default_group_first_key": GROUP_FIRST}}}


# --------------------------------------------------------------------------------- tests


async def test_queue_text_messages_with_properties(
    make_broker: BrokerFactory, jms_classpath: str
) -> None:
    broker = await make_broker()
    results = await run_jms(jms_classpath, broker, "queue")
    text = check(results, "queue", "text")
    q = "interop.queue.t"
    assert text["bodies"] == [f"text-{i}" for i in range(5)], text
    assert text["properties"] == [
        {
            "b": f"Boolean:{'true' if i % 2 == 0 else 'false'}",
            "by": f"Byte:{i}",
            "d": f"Double:{i}.5",
            "f": "Float:1.25",
            "i": f"Integer:{i}",
            "l": f"Long:{10000000000 + i}",
            "s": f"String:str-{i}",
            "sh": f"Short:{i}",
        }
        for i in range(5)
    ], text
    # correlation-id | JMSType | destination | PERSISTENT (2) | redelivered | delivery count
    assert text["headers"] == [f"corr-{i}|type-{i}|{q}|2|false|1" for i in range(5)], text
    assert text["messageIds"] is True
    assert text["extra"] is None
    assert text["ok"] is True, text
    types = check(results, "queue", "types")
    assert types == {
        "ok": True,
        "received": ["bytes:[1, 2, 3]", "map:v,42", "message:JmsMessage"],
    }


async def test_groups_three_consumers(make_broker: BrokerFactory, jms_classpath: str) -> None:
    broker = await make_broker(**group_first_settings())
    results = await run_jms(jms_classpath, broker, "groups")
    a = check(results, "groups", "assignment")
    assert a["received"] == a["expected"] == 48, a
    assert a["complete"] is True
    assert a["split"] == [], a  # every group (and every re-opened group) on one consumer
    assert a["misordered"] == [], a  # in send order
    assert a["listenerErrors"] == []
    # round-robin owner policy: six new groups over three consumers, two each
    assert a["round1GroupsPerConsumer"] == [2, 2, 2], a
    assert sorted(a["owners"]) == [f"grp-{g}/{r}" for g in range(6) for r in ("r1", "r2")]
    assert all(len(v) == 1 for v in a["owners"].values()), a
    assert a["ok"] is True
    f = check(results, "groups", "fields")
    # JMSXGroupSeq -1 travels as group-sequence 4294967295 and reads back as -1
    assert f == {
        "ok": True,
        "groupIds": [f"grp-{g}" for g in range(6)],
        "closeSeqs": [-1],
    }
    first = check(results, "groups", "firstForConsumer")
    assert first["present"] is True, first
    assert first["values"] == ["Boolean:true"], first
    # exactly the first message of each binding (also after the -1 close) is flagged
    assert first["flaggedPositions"] == {
        f"grp-{g}/{r}": [0] for g in range(6) for r in ("r1", "r2")
    }, first
    assert first["ok"] is True


async def test_groups_without_group_first_key(
    make_broker: BrokerFactory, jms_classpath: str
) -> None:
    broker = await make_broker()
    results = await run_jms(jms_classpath, broker, "groups")
    a = check(results, "groups", "assignment")
    assert (a["received"], a["split"], a["misordered"]) == (48, [], []), a
    first = check(results, "groups", "firstForConsumer")
    assert first["present"] is False, first
    assert first["values"] == []


async def test_durable_delivery_mode(make_broker: BrokerFactory, jms_classpath: str) -> None:
    broker = await make_broker()
    results = await run_jms(jms_classpath, broker, "durable")
    assert check(results, "durable", "deliveryMode") == {
        "ok": True,
        "received": ["persistent-0|2", "persistent-1|2", "persistent-2|2", "non-persistent|1"],
    }


async def test_durable_survives_restart(
    make_broker: BrokerFactory, jms_classpath: str, tmp_path: Path
) -> None:
    data_dir = tmp_path / "restart-data"
    settings = Settings(port=0, data_dir=data_dir, store_sync=False, expiry_scan_period=0)
    async with trio.open_nursery() as n:
        first: BrokerApp = await n.start(BrokerApp(settings).run)
        sent = await run_jms(jms_classpath, first, "durable-send", run_id="restart")
        assert check(sent, "durable-send", "sent")["ok"] is True, sent
        first.request_shutdown()
    second = await make_broker(data_dir=data_dir)
    results = await run_jms(jms_classpath, second, "durable-receive", run_id="restart")
    # body | PERSISTENT | priority 7 | properties; the non-persistent message is gone
    assert check(results, "durable-receive", "afterRestart") == {
        "ok": True,
        "received": [
            "persistent-0|2|7|before-restart|0",
            "persistent-1|2|7|before-restart|1",
            "persistent-2|2|7|before-restart|2",
        ],
    }


async def test_temporary_queue_request_reply(
    make_broker: BrokerFactory, jms_classpath: str
) -> None:
    broker = await make_broker()
    results = await run_jms(jms_classpath, broker, "temporary")
    r = check(results, "temporary", "requestReply")
    tmp = r.pop("temporaryQueue")
    assert tmp.startswith(broker.settings.temporary_queue_prefix), tmp
    assert r == {
        "ok": True,
        "request": "request",
        "replyToIsTemporaryQueue": True,
        "replyToName": tmp,
        "reply": "reply",
        "correlationMatches": True,
        "deleted": True,
    }


async def test_transactions(make_broker: BrokerFactory, jms_classpath: str) -> None:
    broker = await make_broker()
    results = await run_jms(jms_classpath, broker, "transacted")
    got = {
        name: check(results, "transacted", name)
        for name in (
            "sendCommit",
            "sendRollback",
            "receiveRollback",
            "closeRollsBack",
            "consumeProduce",
            "groupsRollback",
        )
    }
    assert got == {
        # sends in a transaction are invisible until the commit
        "sendCommit": {"ok": True, "beforeCommit": [], "afterCommit": ["t1", "t2"]},
        # rolled-back sends never arrive
        "sendRollback": {"ok": True, "received": ["r3"]},
        # body | JMSRedelivered | JMSXDeliveryCount: a rolled-back receive is a redelivery
        "receiveRollback": {
            "ok": True,
            "first": ["a1|false|1", "a2|false|1"],
            "afterRollback": ["a1|true|2", "a2|true|2"],
            "leftAfterCommit": [],
        },
        # closing a transacted session rolls back its transaction
        "closeRollsBack": {"ok": True, "received": ["c1|false|1", "c1|true|2"]},
        # receive + send in one transaction: both or neither
        "consumeProduce": {
            "ok": True,
            "received": ["work|false|1", "work|true|2"],
            "outAfterRollback": [],
            "outAfterCommit": ["result"],
            "inAfterCommit": [],
        },
        # two transacted consumers on a grouped queue; seq 3 of each group rolled back once:
        # the group stays on its consumer and in order
        "groupsRollback": {
            "ok": True,
            "deliveries": {
                g: [f"{g}-1", f"{g}-2", f"{g}-3", f"{g}-3(r2)", f"{g}-4", f"{g}-5", f"{g}-6"]
                for g in ("g-a", "g-b")
            },
            "split": [],
            "extra": [],
        },
    }


async def test_receive_on_empty_queue_returns_promptly(
    make_broker: BrokerFactory, jms_classpath: str
) -> None:
    broker = await make_broker()
    results = await run_jms(jms_classpath, broker, "drain")
    for prefetch in ("default", "0"):
        r = check(results, "drain", f"prefetch-{prefetch}")
        assert r["emptyResults"] == [None, None, None], r
        assert r["prompt"] is True, r  # each drain completed in well under 2 s
        assert r["afterDrain"] == "after-drain", r
        assert r["extra"] is None, r
        assert r["ok"] is True, r


async def test_redelivery(make_broker: BrokerFactory, jms_classpath: str) -> None:
    broker = await make_broker()
    results = await run_jms(jms_classpath, broker, "redelivery")
    # body | JMSRedelivered | JMSXDeliveryCount, compared all at once for one full diff
    got = {
        name: check(results, "redelivery", name)
        for name in ("recover", "modifiedFailed", "closeWithoutAck", "prefetchedOnClose")
    }
    assert got == {
        "recover": {
            "ok": True,
            "first": ["m1|false|1", "m2|false|1"],
            "afterRecover": ["m1|true|2", "m2|true|2"],
            "leftAfterAck": None,
        },
        # acknowledge() with JMS_AMQP_ACK_TYPE=MODIFIED_FAILED: the broker counts the attempt
        "modifiedFailed": {"ok": True, "received": ["m3|false|1", "m3|true|2"]},
        # Received but not acknowledged when the connection closed: Qpid JMS settles it as
        # modified(delivery-failed) just before its Close; that is the one failed attempt.
        "closeWithoutAck": {"ok": True, "received": ["m4|false|1", "m4|true|2"]},
        # Only prefetched (never given to the application) when the connection closed
        # cleanly: not a delivery attempt (Artemis decrements the count on a clean close).
        "prefetchedOnClose": {
            "ok": True,
            "received": ["p0|false|1", "p1|false|1", "p2|false|1", "p3|false|1", "p4|false|1"],
        },
    }


def without(r: dict[str, Any], *keys: str) -> dict[str, Any]:
    """`r` minus fields that vary from run to run (exception texts, timings)."""
    return {k: v for k, v in r.items() if k not in keys}


async def test_duplicate_client_id(make_broker: BrokerFactory, jms_classpath: str) -> None:
    broker = await make_broker()
    results = await run_jms(jms_classpath, broker, "clientid")
    dup = check(results, "clientid", "duplicate")
    # a second connection with the same clientID (AMQP container-id) is refused with
    # InvalidClientIDException; the first one keeps working
    assert without(dup, "detail") == {
        "ok": True,
        "exception": "jakarta.jms.InvalidClientIDException",
        "firstStillWorks": "ping",
    }, dup
    # once the first connection is closed its clientID is free again
    assert check(results, "clientid", "reuseAfterClose") == {"ok": True, "afterReuse": "ping"}


# selector check -> (selector, messages it selects, the rest, for a plain consumer)
SELECTOR_CHECKS: dict[str, tuple[str, list[str], list[str]]] = {
    "andCompare": ("color = 'red' AND weight > 10", ["m0", "m3"], ["m1", "m2", "m4"]),
    "likeEscape": ("name LIKE 'a\\_%' ESCAPE '\\'", ["m0", "m2"], ["m1", "m3", "m4"]),
    "in": ("color IN ('red', 'green')", ["m0", "m2"], ["m1", "m3", "m4"]),
    "between": ("weight BETWEEN 10 AND 20", ["m1", "m2", "m3"], ["m0", "m4", "m5"]),
    "isNull": ("color IS NULL", ["m1", "m3"], ["m0", "m2"]),
    "isNotNull": ("color IS NOT NULL AND NOT (color = 'blue')", ["m0", "m3"], ["m1", "m2"]),
    "priority": ("JMSPriority > 6", ["m1", "m2"], ["m0", "m3"]),
    "type": ("JMSType = 'order'", ["m0", "m2"], ["m1", "m3"]),
    "correlationId": ("JMSCorrelationID IN ('c-1', 'c-3')", ["m0", "m2"], ["m1", "m3"]),
    "groupId": ("JMSXGroupID = 'g-a'", ["a1", "a2"], ["b1", "b2", "u1"]),
    "groupSeq": ("JMSXGroupSeq <= 3", ["a1", "a2", "a3"], ["b5", "b6"]),
}


async def test_selectors_on_queue_consumers(make_broker: BrokerFactory, jms_classpath: str) -> None:
    broker = await make_broker()
    results = await run_jms(jms_classpath, broker, "selectors")
    got = {name: check(results, "selectors", name) for name in SELECTOR_CHECKS}
    # a consumer with the selector gets exactly the matching messages in order; a plain
    # consumer opened next to it gets the rest (nothing is stuck on the selecting consumer)
    assert got == {
        name: {"ok": True, "selector": selector, "matched": matched, "rest": rest}
        for name, (selector, matched, rest) in SELECTOR_CHECKS.items()
    }
    assert check(results, "selectors", "liveConsumers") == {
        "ok": True,
        "red": ["red0", "red2", "red4"],
        "blue": ["blue1", "blue3", "blue5"],
        "rest": ["green6"],
    }
    client = check(results, "selectors", "invalidClientSide")
    assert without(client, "detail") == {
        "ok": True,
        "exception": "jakarta.jms.InvalidSelectorException",
        "connectionStillWorks": "ping",
    }, client
    # jms.validateSelector=false: the broker itself refuses the consumer (a JMSException
    # or InvalidSelectorException) and the connection keeps working
    brokerside = check(results, "selectors", "invalidBrokerSide")
    assert brokerside["exception"] in (
        "jakarta.jms.JMSException",
        "jakarta.jms.InvalidSelectorException",
    ), brokerside
    assert brokerside["connectionStillWorks"] == "ping", brokerside
    assert brokerside["ok"] is True, brokerside


async def test_topics(make_broker: BrokerFactory, jms_classpath: str) -> None:
    broker = await make_broker()
    results = await run_jms(jms_classpath, broker, "topics")
    every = ["t0", "t1", "t2"]
    # every subscriber gets its own copy; nothing published before it subscribed
    assert check(results, "topics", "subscribers") == {
        "ok": True,
        "subscriber1": every,
        "subscriber2SameSession": every,
        "subscriber3OtherConnection": every,
    }
    # the no-local subscriber does not get its own connection's messages
    mixed = ["local-1", "remote-1", "local-2"]
    assert check(results, "topics", "noLocal") == {
        "ok": True,
        "noLocal": ["remote-1"],
        "sameConnection": mixed,
        "otherConnection": mixed,
    }
    assert check(results, "topics", "temporaryTopic") == {
        "ok": True,
        "request": "request",
        "replyToIsTemporaryTopic": True,
        "replyToNameMatches": True,
        "reply": "reply",
        "correlationMatches": True,
        "deleted": True,
    }


async def test_durable_subscriptions(make_broker: BrokerFactory, jms_classpath: str) -> None:
    broker = await make_broker()
    results = await run_jms(jms_classpath, broker, "durable-subs")
    got = {
        name: check(results, "durable-subs", name)
        for name in ("detached", "reconnect", "selector", "unsubscribe")
    }
    assert got == {
        # messages published while the consumer is closed wait for it
        "detached": {"ok": True, "attached": ["d0"], "afterReattach": ["d1", "d2"]},
        # ... also when its connection is gone (same clientID on the next one)
        "reconnect": {"ok": True, "afterReconnect": ["e0", "e1"]},
        # only messages matching the subscription's selector are kept
        "selector": {"ok": True, "attached": ["red-0", "red-1"], "afterReattach": ["red-2"]},
        # unsubscribe drops the subscription with its messages; re-subscribing starts afresh
        "unsubscribe": {"ok": True, "afterResubscribe": [], "newMessages": ["u2"]},
    }
    unknown = check(results, "durable-subs", "unsubscribeUnknown")
    assert without(unknown, "detail") == {
        "ok": True,
        "exception": "jakarta.jms.InvalidDestinationException",
        "connectionStillWorks": "ping",
    }, unknown
    # unsubscribe while a consumer is open fails; the subscription stays
    active = check(results, "durable-subs", "unsubscribeWhileActive")
    assert active["exception"] is not None, active
    assert active["afterwards"] == ["still-subscribed"], active
    assert active["ok"] is True, active


async def test_durable_subscription_survives_restart(
    make_broker: BrokerFactory, jms_classpath: str, tmp_path: Path
) -> None:
    data_dir = tmp_path / "restart-data"
    settings = Settings(port=0, data_dir=data_dir, store_sync=False, expiry_scan_period=0)
    async with trio.open_nursery() as n:
        first: BrokerApp = await n.start(BrokerApp(settings).run)
        sent = await run_jms(jms_classpath, first, "durable-sub-send", run_id="restart")
        assert check(sent, "durable-sub-send", "sent")["ok"] is True, sent
        first.request_shutdown()
    second = await make_broker(data_dir=data_dir)
    results = await run_jms(jms_classpath, second, "durable-sub-receive", run_id="restart")
    # body | PERSISTENT | priority 7 | properties; the non-persistent message is gone, the
    # subscription with selector "n >= 1" kept only its matches, both subscriptions remain
    persistent = [f"persistent-{i}|2|7|before-restart|{i}" for i in range(3)]
    assert check(results, "durable-sub-receive", "afterRestart") == {
        "ok": True,
        "received": {"restart-all": persistent, "restart-sel": persistent[1:]},
        "newMessage": ["after-restart"],
    }


async def test_shared_subscriptions(make_broker: BrokerFactory, jms_classpath: str) -> None:
    broker = await make_broker()
    results = await run_jms(jms_classpath, broker, "shared-subs")
    every = [f"s{i}" for i in range(10)]
    for suffix in ("Global", "ClientId"):
        # two consumers of one shared subscription: each message to exactly one of them;
        # a plain subscriber of the topic still gets its own copy of each
        v = check(results, "shared-subs", f"volatile{suffix}")
        assert without(v, "perConsumer") == {
            "ok": True,
            "exactlyOnce": True,
            "plainSubscriber": every,
        }, v
        assert sum(v["perConsumer"]) == 10, v
        d = check(results, "shared-subs", f"durable{suffix}")
        assert without(d, "perConsumer") == {
            "ok": True,
            "exactlyOnce": True,
            "afterReattach": ["detached-0", "detached-1"],
            "afterUnsubscribe": [],
        }, d
        assert sum(d["perConsumer"]) == 10, d
    # a shared non-durable subscription ends with its last consumer
    assert check(results, "shared-subs", "volatileRemoved") == {
        "ok": True,
        "whileOpen": ["while-open"],
        "afterReopen": [],
    }


async def test_queue_browser(make_broker: BrokerFactory, jms_classpath: str) -> None:
    broker = await make_broker()
    results = await run_jms(jms_classpath, broker, "browser")
    five = [f"b{i}" for i in range(5)]
    # browsing twice sees the same messages in order; a consumer then still gets them all
    assert check(results, "browser", "browse") == {
        "ok": True,
        "firstBrowse": five,
        "secondBrowse": five,
        "consumed": five,
        "browseAfterConsume": [],
    }
    assert check(results, "browser", "selector") == {
        "ok": True,
        "browsed": ["b0", "b2", "b4"],
        "consumed": [f"b{i}" for i in range(6)],
    }
    with_consumer = check(results, "browser", "withConsumer")
    # the consumer may have prefetched b1..b3 already: the browser sees them or nothing
    assert with_consumer["browsed"] in ([], ["b1", "b2", "b3"]), with_consumer
    assert without(with_consumer, "browsed") == {
        "ok": True,
        "first": "b0",
        "rest": ["b1", "b2", "b3"],
    }


async def test_delayed_delivery(make_broker: BrokerFactory, jms_classpath: str) -> None:
    broker = await make_broker()
    results = await run_jms(jms_classpath, broker, "delay")
    # delay 2 s: a later message without delay comes first; the delayed one not before
    # 2 s, and not much later; JMSDeliveryTime is set
    d = check(results, "delay", "deliveryDelay")
    assert without(d, "millis") == {
        "ok": True,
        "order": ["immediate", "delayed"],
        "immediateNotHeldBack": True,
        "delayedNotBeforeDelay": True,
        "delayedSoonAfterDelay": True,
        "deliveryTimeHeader": True,
        "extra": [],
    }, d
    # g1-1 delayed: g1-2 waits for it, g2 is not held back
    g = check(results, "delay", "groupNotOvertaken")
    assert without(g, "millis") == {
        "ok": True,
        "order": ["g2-1", "g1-1", "g1-2"],
        "extra": [],
        "timing": True,
    }, g


async def test_message_types(make_broker: BrokerFactory, jms_classpath: str) -> None:
    broker = await make_broker()
    results = await run_jms(jms_classpath, broker, "message-types")
    expected: dict[str, tuple[str, Any]] = {
        "text": ("JmsTextMessage", "h\u00e9llo, w\u00f6rld \u2713 \U0001d11e"),
        "textNull": ("JmsTextMessage", "null"),
        "bytes": (
            "JmsBytesMessage",
            [
                "true",
                "-1",
                "-2",
                "Z",
                "123456789",
                "-9876543210",
                "1.5",
                "-2.25",
                "utf \u2713",
                "[0, 1, -1]",
                "len=42",
            ],
        ),
        "map": (
            "JmsMapMessage",
            {
                "b": "Boolean:true",
                "by": "Byte:-3",
                "bytes": "byte[]:[1, 2, 3]",
                "c": "Character:x",
                "d": "Double:2.5",
                "f": "Float:0.25",
                "i": "Integer:42",
                "l": "Long:10000000000",
                "s": "String:v \u2713",
                "sh": "Short:-7",
            },
        ),
        "stream": (
            "JmsStreamMessage",
            [
                "String:s \u2713",
                "Integer:7",
                "Long:-10000000000",
                "Boolean:false",
                "Double:3.75",
                "byte[]:[9, 8]",
                "Character:q",
                "Short:5",
                "null",
                "EOF",
            ],
        ),
        "object": ("JmsObjectMessage", "Payload(p \u2713,17,[a, b])"),
        "message": ("JmsMessage", "plain"),
    }
    got = {name: check(results, "message-types", name) for name in expected}
    assert got == {
        name: {"ok": True, "type": type_, "content": content, "kind": name}
        for name, (type_, content) in expected.items()
    }


async def test_groups_with_selectors(make_broker: BrokerFactory, jms_classpath: str) -> None:
    broker = await make_broker()
    results = await run_jms(jms_classpath, broker, "group-selectors")
    # consumer 0: region = 'east' (g0, g2); consumer 1: region = 'west' (g1, g3)
    assert check(results, "group-selectors", "disjoint") == {
        "ok": True,
        "received": 20,
        "complete": True,
        "owners": {"g0": [0], "g1": [1], "g2": [0], "g3": [1]},
        "problems": [],
        "listenerErrors": [],
    }
    # consumer 1 has no selector: the west groups must go to it, each group to one consumer
    mixed = check(results, "group-selectors", "withPlainConsumer")
    assert mixed["owners"]["g1"] == mixed["owners"]["g3"] == [1], mixed
    assert without(mixed, "owners") == {
        "ok": True,
        "received": 20,
        "complete": True,
        "problems": [],
        "listenerErrors": [],
    }
