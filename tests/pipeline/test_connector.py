"""The Spark connector against a real broker process: a grouped write round trip
(order and sequence per group kept across partitions), duplicates of a retried write
dropped by the broker's duplicate-detection window, a streaming read that acknowledges
only what Spark committed, a batch read, and a stream reader killed mid-query that
returns (delivery-count + 1) no more messages than a micro-batch takes."""

from __future__ import annotations

import json
import select
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.pipeline.conftest import SyncBroker, require_module

pytestmark = pytest.mark.timeout(600)  # a JVM on a shared 2-core machine

GROUPS = 4
PER_GROUP = 15


@pytest.fixture(scope="module")
def broker(tmp_path_factory) -> Iterator[SyncBroker]:
    tmp: Path = tmp_path_factory.mktemp("connector")
    cfg = tmp / "amqbroker.toml"
    cfg.write_text('[address_settings."spark.#"]\nduplicate_detection_window = 10000\n')
    b = SyncBroker(tmp / "data", {"AMQBROKER_STORE_SYNC": "false"}, config=cfg)
    yield b
    b.stop()


def drain(url: str, address: str, timeout: float = 1.0) -> list[Any]:
    from proton import Timeout
    from proton.utils import BlockingConnection

    c = BlockingConnection(url, timeout=10)
    try:
        r = c.create_receiver(address, credit=100)
        out = []
        while True:
            try:
                out.append(r.receive(timeout=timeout))
            except Timeout:
                return out
            r.accept()
    finally:
        c.close()


def source(spark):
    from pyspark.sql import functions as F

    rows = [(f"cust-{g}", i, f"order {g}/{i}") for g in range(GROUPS) for i in range(PER_GROUP)]
    # shuffled across 3 partitions: write_grouped must regroup and sort
    return (
        spark.createDataFrame(rows, "customer string, n int, body string")
        .orderBy(F.rand(seed=3))
        .repartition(3)
    )


def test_write_stream_read_round_trip(spark, broker):
    from amqbroker.pipeline.connector import register, write_grouped

    register(spark)
    address = "spark.orders"
    df = source(spark)
    write_grouped(
        df,
        url=broker.url,
        address=address,
        group_column="customer",
        order_by=["n"],
        message_id_prefix="run-1",
    )
    # a retried write (same message-ids): the broker drops every duplicate
    write_grouped(
        df,
        url=broker.url,
        address=address,
        group_column="customer",
        order_by=["n"],
        message_id_prefix="run-1",
    )

    # stream: the first micro-batch fails in the sink -> nothing was acknowledged
    batches: list[list[Any]] = []
    fail = {"first": True}

    def sink(batch_df, batch_id):
        rows = batch_df.collect()
        if rows and fail["first"]:
            fail["first"] = False
            raise RuntimeError("sink failure (injected)")
        batches.append(rows)

    def run_stream(ckpt: str) -> None:
        stream = (
            spark.readStream.format("amqbroker")
            .option("url", broker.url)
            .option("address", address)
            .option("max_batch", "25")
            .option("wait", "1.0")
            .load()
        )
        q = stream.writeStream.foreachBatch(sink).option("checkpointLocation", ckpt).start()
        try:
            q.processAllAvailable()
        finally:
            q.stop()

    from pyspark.errors import StreamingQueryException

    with pytest.raises(StreamingQueryException, match="sink failure"):
        run_stream(str(Path(broker.data_dir).parent / "ckpt-fail"))
    assert batches == []
    run_stream(str(Path(broker.data_dir).parent / "ckpt"))

    rows = [r for b in batches for r in b]
    assert len(rows) == GROUPS * PER_GROUP, "lost or duplicated messages"
    assert len(batches) >= 2
    by_group: dict[str, list[Any]] = {}
    for r in rows:
        by_group.setdefault(r["group_id"], []).append(r)
    assert sorted(by_group) == [f"cust-{g}" for g in range(GROUPS)]
    for gid, msgs in by_group.items():
        assert [m["group_seq"] for m in msgs] == list(range(1, PER_GROUP + 1)), gid
        assert [m["properties"]["n"] for m in msgs] == [str(i) for i in range(PER_GROUP)]
        assert all(m["body"].startswith(f"order {gid[5:]}/") for m in msgs)
        assert all(m["message_id"].startswith("run-1:") for m in msgs)
        assert all(m["received_time"] is not None for m in msgs)
    # every delivery Spark committed was accepted: nothing left on the queue
    assert drain(broker.url, address) == []


def test_batch_read_and_split_group_is_refused(spark, broker):
    from amqbroker.pipeline.connector import register

    register(spark)
    address = "spark.batch"
    df = source(spark)  # NOT partitioned by group: the commit check refuses it
    with pytest.raises(Exception, match="partition by the group column"):
        (
            df.write.format("amqbroker")
            .option("url", broker.url)
            .option("address", address)
            .option("group_column", "customer")
            .mode("append")
            .save()
        )
    got = (
        spark.read.format("amqbroker")
        .option("url", broker.url)
        .option("address", address)
        .option("timeout", "1")
        .load()
        .collect()
    )
    assert len(got) == GROUPS * PER_GROUP
    assert {r["group_id"] for r in got} == {f"cust-{g}" for g in range(GROUPS)}
    assert drain(broker.url, address) == []


def queue_state(url: str, name: str) -> dict[str, Any]:
    """The queue's management attributes (READ through `$management`)."""
    from proton import Message
    from proton.utils import BlockingConnection, SyncRequestResponse

    c = BlockingConnection(url, timeout=10)
    try:
        answer = SyncRequestResponse(c, "$management").call(
            Message(properties={"operation": "READ", "type": "queue", "name": name}, body={})
        )
    finally:
        c.close()
    assert answer.properties["statusCode"] == 200, answer.properties
    body: dict[str, Any] = answer.body
    return body


def send_bodies(url: str, address: str, n: int) -> None:
    from proton import Message
    from proton.utils import BlockingConnection

    c = BlockingConnection(url, timeout=10)
    try:
        snd = c.create_sender(address)
        for i in range(n):
            snd.send(Message(body=f"m{i}", id=f"{address}-{i}"))
    finally:
        c.close()


def test_committed_micro_batch_is_accepted_at_once(broker):
    """commit(end) sends the accepts right away, not with the next receive (a quiet
    stream would otherwise keep a committed batch unsettled, to be redelivered by a
    crash)."""
    require_module("pyspark")
    from amqbroker.pipeline.connector import AmqbrokerStreamReader

    address = "spark.commit"
    send_bodies(broker.url, address, 4)
    r = AmqbrokerStreamReader(
        {"url": broker.url, "address": address, "max_batch": "3", "wait": "10"}
    )
    try:
        rows, end = r.read({"received": 0})
        assert [row[3] for row in rows] == ["m0", "m1", "m2"]
        r.commit(end)
        st = queue_state(broker.url, address)
        assert (st["messageCount"], st["deliveringCount"]) == (1, 0), st
    finally:
        r.stop()


# the stream reader in a process of its own (Spark runs it in the driver's data-source
# process): two micro-batches, then it waits to be killed
STREAM_READER = """
import json, sys
from amqbroker.pipeline.connector import AmqbrokerStreamReader
r = AmqbrokerStreamReader({"url": sys.argv[1], "address": sys.argv[2],
                           "max_batch": sys.argv[3], "wait": "10"})
rows1, end1 = r.read({"received": 0})
rows2, end2 = r.read(end1)
print(json.dumps([len(list(rows1)), len(list(rows2))]), flush=True)
sys.stdin.read()
"""


def test_killed_stream_reader_returns_at_most_a_micro_batch(broker):
    """The reader's credit is bounded by max_batch: the broker never has more than
    that out to it unsettled, so killing it redelivers (delivery-count + 1) only the
    uncommitted micro-batch, not a whole prefetch window."""
    require_module("pyspark")
    from proton.utils import BlockingConnection

    address, total, batch = "spark.killed", 60, 10
    send_bodies(broker.url, address, total)
    reader = subprocess.Popen(
        [sys.executable, "-c", STREAM_READER, broker.url, address, str(batch)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert reader.stdout is not None
        ready, _, _ = select.select([reader.stdout], [], [], 60)
        assert ready, "the stream reader did not read its two micro-batches in 60 s"
        assert json.loads(reader.stdout.readline()) == [batch, batch]
        # the first batch was accepted when the second was read; only the second is
        # out to the reader
        st = queue_state(broker.url, address)
        assert (st["messageCount"], st["deliveringCount"]) == (total - batch, batch), st
    finally:
        reader.kill()
        reader.communicate(timeout=30)
    c = BlockingConnection(broker.url, timeout=10)
    try:
        rcv = c.create_receiver(address, credit=total)
        got = [rcv.receive(timeout=10) for _ in range(total - batch)]
        rcv.accept()
    finally:
        c.close()
    counts = {m.body: m.delivery_count for m in got}
    assert sorted(counts) == sorted(f"m{i}" for i in range(batch, total))
    redelivered = sorted((b for b, n in counts.items() if n), key=lambda b: int(b[1:]))
    assert redelivered == [f"m{i}" for i in range(batch, 2 * batch)], redelivered
    assert all(n == 1 for n in counts.values() if n)
