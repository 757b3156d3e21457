"""The CLI end to end: `python -m amqbroker run` as a real process (settings, signals),
`amqbroker create` instance folders, and every operator command (check, queue,
address, groups, producer/consumer/browser, config show) against a real broker."""

from __future__ import annotations

import errno
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio
from click.testing import CliRunner, Result

from tests.client import Client
from tests.integration import mgmt
from tests.integration.broker_process import BrokerProcess, BrokerProcesses, clean_env
from tests.integration.groups_helpers import msg

REPO = Path(__file__).resolve().parents[2]
EXAMPLE_CONFIG = REPO / "config" / "amqbroker.toml"


@pytest.fixture
async def procs(nursery: trio.Nursery, tmp_path: Path) -> AsyncIterator[BrokerProcesses]:
    p = BrokerProcesses(nursery, cwd=tmp_path)
    try:
        yield p
    finally:
        await p.aclose()


async def _ping(port: int | None, nursery: trio.Nursery) -> None:
    """An AMQP connection opens and closes cleanly (creates nothing in the store, so
    the stop that follows is not about the store; test_durability covers that).

    It also proves the broker's event loop runs, i.e. its signal handler is installed
    (see test_signal_right_after_ready_is_graceful for why that matters)."""
    assert port is not None
    c = await Client.connect(port, nursery=nursery)
    try:
        assert c.conn.remote_container == "amqbroker"
        await c.close()
    finally:
        c.abort()


async def _fails_to_start(procs: BrokerProcesses, args: list[str], **kw: object) -> BrokerProcess:
    """Run `amqbroker <args>`, expecting it to exit non-zero without listening."""
    bp = await procs.spawn(args, **kw)  # type: ignore[arg-type]
    rc = await bp.wait_exit(timeout=20)
    assert rc != 0, f"expected a non-zero exit status\n{bp.describe()}"
    assert rc > 0, f"exited by a signal, not by an error\n{bp.describe()}"
    assert "listening on" not in bp.stderr, bp.describe()
    assert "Traceback" not in bp.stderr, f"a traceback instead of a message\n{bp.describe()}"
    return bp


# ------------------------------------------------------------------- run, defaults


async def test_run_with_defaults_creates_data_dir_and_prints_where(
    procs: BrokerProcesses, tmp_path: Path, nursery: trio.Nursery
) -> None:
    data = tmp_path / "amqbroker-data"
    assert not data.exists()
    bp = await procs.start(None)  # only --port 0: everything else embedded defaults
    assert data.is_dir(), "the default data directory was not created"
    assert f"; data in {data} (" in bp.stderr, bp.describe()
    await _ping(bp.port, nursery)
    assert await bp.stop() == 0, bp.describe()


async def test_run_without_any_option_listens_on_5672(
    procs: BrokerProcesses, tmp_path: Path, nursery: trio.Nursery
) -> None:
    probe = socket.socket()
    try:
        probe.bind(("127.0.0.1", 5672))
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            pytest.skip("port 5672 is in use on this machine")
        raise
    finally:
        probe.close()
    bp = await procs.spawn(["run"])
    port = await bp.wait_ready()
    assert port == 5672
    assert f"; data in {tmp_path / 'amqbroker-data'} (" in bp.stderr
    await _ping(port, nursery)
    assert await bp.stop() == 0, bp.describe()


async def test_nested_data_dir_is_created(
    procs: BrokerProcesses, tmp_path: Path, nursery: trio.Nursery
) -> None:
    data = tmp_path / "a" / "b" / "store"
    bp = await procs.start(data)
    assert data.is_dir()
    assert f"; data in {data} (" in bp.stderr
    await _ping(bp.port, nursery)
    assert await bp.stop() == 0, bp.describe()


async def test_data_dir_that_is_a_file_is_a_clear_error(
    procs: BrokerProcesses, tmp_path: Path
) -> None:
    in_the_way = tmp_path / "not-a-dir"
    in_the_way.write_text("x")
    bp = await _fails_to_start(procs, ["run", "--port", "0", "--data-dir", str(in_the_way)])
    assert str(in_the_way) in bp.stderr, bp.describe()


# ------------------------------------------------------------------- config file


async def test_example_config_file_works(
    procs: BrokerProcesses, tmp_path: Path, nursery: trio.Nursery
) -> None:
    """config/amqbroker.toml as shipped (port 0 from the CLI, since 5672 may be taken);
    its data_dir ("amqbroker-data") is relative to the working directory."""
    bp = await procs.start(None, args=["--config", str(EXAMPLE_CONFIG)])
    assert (tmp_path / "amqbroker-data").is_dir()
    assert f"; data in {tmp_path / 'amqbroker-data'} (" in bp.stderr
    await _ping(bp.port, nursery)
    assert await bp.stop() == 0, bp.describe()


@pytest.mark.slow
async def test_config_from_environment_variable_and_precedence(
    procs: BrokerProcesses, tmp_path: Path, nursery: trio.Nursery
) -> None:
    """file < AMQBROKER_* < CLI flags, and AMQBROKER_CONFIG names the file."""
    cfg = tmp_path / "b.toml"
    cfg.write_text(f'data_dir = "{tmp_path / "from-file"}"\nport = 0\nlog_level = "debug"\n')

    bp = await procs.spawn(["run"], env={"AMQBROKER_CONFIG": str(cfg)})
    await bp.wait_ready()
    assert f"; data in {tmp_path / 'from-file'} (" in bp.stderr, bp.describe()
    await _ping(bp.port, nursery)
    assert " DEBUG " in bp.stderr, f"log_level from the file was not applied\n{bp.describe()}"
    assert await bp.stop() == 0, bp.describe()

    bp = await procs.spawn(
        ["run", "--config", str(cfg)], env={"AMQBROKER_DATA_DIR": str(tmp_path / "from-env")}
    )
    await bp.wait_ready()
    assert f"; data in {tmp_path / 'from-env'} (" in bp.stderr, bp.describe()
    await _ping(bp.port, nursery)
    assert await bp.stop() == 0, bp.describe()

    bp = await procs.spawn(
        ["run", "--config", str(cfg), "--data-dir", str(tmp_path / "from-cli")],
        env={"AMQBROKER_DATA_DIR": str(tmp_path / "from-env")},
    )
    await bp.wait_ready()
    assert f"; data in {tmp_path / 'from-cli'} (" in bp.stderr, bp.describe()
    await _ping(bp.port, nursery)
    assert await bp.stop() == 0, bp.describe()


# ---------------------------------------------------------------- invalid settings


async def test_invalid_port_in_environment_names_key_value_and_source(
    procs: BrokerProcesses, tmp_path: Path
) -> None:
    bp = await _fails_to_start(
        procs, ["run", "--data-dir", str(tmp_path / "d")], env={"AMQBROKER_PORT": "99999"}
    )
    err = bp.stderr
    assert "port" in err and "99999" in err and "AMQBROKER_PORT" in err, bp.describe()


async def test_typo_key_in_toml_names_the_key_and_file(
    procs: BrokerProcesses, tmp_path: Path
) -> None:
    cfg = tmp_path / "typo.toml"
    cfg.write_text("port = 0\nmax_frame_sise = 65536\n")
    bp = await _fails_to_start(procs, ["run", "--config", str(cfg)])
    err = bp.stderr
    assert "max_frame_sise" in err and str(cfg) in err, bp.describe()
    assert "max_frame_size" in err, f"no 'did you mean' suggestion\n{bp.describe()}"
    assert not (tmp_path / "amqbroker-data").exists(), "data dir created despite bad settings"


async def test_bad_value_in_toml_names_key_value_and_file(
    procs: BrokerProcesses, tmp_path: Path
) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text("port = 0\nmax_frame_size = 100\n")
    bp = await _fails_to_start(procs, ["run", "--config", str(cfg)])
    err = bp.stderr
    assert "max_frame_size" in err and "100" in err and str(cfg) in err, bp.describe()


async def test_bad_value_types_in_environment(procs: BrokerProcesses, tmp_path: Path) -> None:
    bp = await _fails_to_start(
        procs,
        ["run", "--port", "0", "--data-dir", str(tmp_path / "d")],
        env={"AMQBROKER_STORE_SYNC": "maybe", "AMQBROKER_LINK_CREDIT": "lots"},
    )
    err = bp.stderr
    for needle in ("store_sync", "maybe", "link_credit", "lots"):
        assert needle in err, f"{needle!r} not named\n{bp.describe()}"


async def test_invalid_cli_flag_value(procs: BrokerProcesses, tmp_path: Path) -> None:
    bp = await _fails_to_start(procs, ["run", "--port", "70000", "--data-dir", str(tmp_path)])
    assert "70000" in bp.stderr and "port" in bp.stderr, bp.describe()


async def test_missing_config_file(procs: BrokerProcesses, tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    bp = await _fails_to_start(procs, ["run", "--config", str(missing)])
    assert str(missing) in bp.stderr, bp.describe()


async def test_port_in_use_is_a_clear_error(
    procs: BrokerProcesses, tmp_path: Path, nursery: trio.Nursery
) -> None:
    holder = socket.socket()
    try:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        busy = holder.getsockname()[1]
        bp = await _fails_to_start(
            procs, ["run", "--port", str(busy), "--data-dir", str(tmp_path / "d")]
        )
    finally:
        holder.close()
    err = bp.stderr
    assert str(busy) in err, bp.describe()
    assert re.search(r"in use|already", err, re.IGNORECASE), bp.describe()
    # the store was released: a broker can start on the same data dir right away
    ok = await procs.start(tmp_path / "d")
    await _ping(ok.port, nursery)
    assert await ok.stop() == 0, ok.describe()


# ------------------------------------------------------------------- help, signals


async def test_module_help() -> None:
    with trio.fail_after(30):
        done = await trio.run_process(
            [sys.executable, "-m", "amqbroker", "--help"],
            capture_stdout=True,
            capture_stderr=True,
            env=clean_env(),
        )
    assert done.returncode == 0, done.stderr.decode()
    out = done.stdout.decode()
    for cmd in ("run", "hash-password"):
        assert cmd in out, out
    with trio.fail_after(30):
        done = await trio.run_process(
            [sys.executable, "-m", "amqbroker", "run", "--help"],
            capture_stdout=True,
            capture_stderr=True,
            env=clean_env(),
        )
    assert done.returncode == 0, done.stderr.decode()
    out = done.stdout.decode()
    for opt in ("--port", "--data-dir", "--config", "--host"):
        assert opt in out, out


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
async def test_signal_stops_with_exit_0(
    procs: BrokerProcesses, tmp_path: Path, nursery: trio.Nursery, sig: signal.Signals
) -> None:
    bp = await procs.start(tmp_path / "d")
    c = await Client.connect(bp.port or 0, nursery=nursery)
    try:
        bp.send_signal(sig)
        # the client is told why (and answers the close, as a real client would)
        with trio.fail_after(10):
            while not c.closed_by_peer:
                await c._changed.wait()
        assert c.remote_condition is not None
        assert c.remote_condition.name == "amqp:connection:forced"
        await c.close()
    finally:
        c.abort()
    rc = await bp.wait_exit(timeout=15)
    assert rc == 0, bp.describe()
    assert re.search(rf"received {sig.name}", bp.stderr), bp.describe()
    assert "amqbroker stopped" in bp.stderr, bp.describe()
    assert "Traceback" not in bp.stderr, bp.describe()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
async def test_signal_right_after_ready_is_graceful(
    procs: BrokerProcesses, tmp_path: Path, sig: signal.Signals
) -> None:
    """A supervisor may stop the broker as soon as it reported ready: its start banner
    is logged after the signal handler is installed, so a signal sent the instant the
    banner appears stops it gracefully (exit 0)."""
    bp = await procs.spawn(["run", "--port", "0", "--data-dir", str(tmp_path / "d")])
    await bp.wait_for_line(r"INFO amqbroker: amqbroker \S+ listening on", timeout=20)
    bp.send_signal(sig)
    rc = await bp.wait_exit()
    assert rc == 0, f"exit status {rc} after {sig.name} right after start-up\n{bp.describe()}"
    assert f"received {sig.name}" in bp.stderr, bp.describe()


async def test_start_banner_once(procs: BrokerProcesses, tmp_path: Path) -> None:
    """The start banner is one log line (stderr), not repeated as plain output: every
    event is one line, and stdout stays empty."""
    bp = await procs.start(tmp_path / "d")
    await bp.stop()
    banners = [line for line in bp.stderr_lines if "listening on" in line]
    assert len(banners) == 1, bp.describe()
    assert " INFO amqbroker: amqbroker " in banners[0], bp.describe()
    assert f"; data in {tmp_path / 'd'} (" in banners[0], bp.describe()
    assert not [line for line in bp.stdout_lines if line.strip()], bp.describe()


# ============================================================ operating a running broker
#
# One real broker process (`python -m amqbroker run`, tests/integration/broker_process)
# serves every operator command of this module: it is started once, on a trio loop of
# its own in a helper thread (pytest-trio gives each test its own loop, and a process
# must outlive them), and stopped with SIGTERM at the end, which must exit 0. The CLI
# runs in-process (click's CliRunner, for its output and exit code) on a worker thread
# against that process's port, and every check of the broker's state goes through the
# management node too: nothing here reads the broker's memory. Each test uses its own
# queue names, so the tests do not depend on one another's order.


@dataclass
class RealBroker:
    port: int
    bp: BrokerProcess

    @property
    def url(self) -> str:
        return f"amqp://127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def real_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealBroker]:
    data = tmp_path_factory.mktemp("cli-broker") / "data"
    started: queue.Queue[RealBroker | BaseException] = queue.Queue()
    stopped: list[int] = []
    stop = threading.Event()

    async def host() -> None:
        async with trio.open_nursery() as n:
            procs = BrokerProcesses(n, cwd=data.parent)
            try:
                bp = await procs.start(data, env={"AMQBROKER_STORE_SYNC": "false"})
                # one AMQP round trip: the signal handler is installed (module caveat)
                async with trio.open_nursery() as cn:
                    c = await Client.connect(bp.port or 0, nursery=cn)
                    await c.close()
                    cn.cancel_scope.cancel()  # the client's reader and ticker
                started.put(RealBroker(bp.port or 0, bp))
                await trio.to_thread.run_sync(stop.wait)
                stopped.append(await bp.stop())
                if stopped[0] != 0:
                    stopped.append(-1)
                    print(bp.describe(), file=sys.stderr)
            except BaseException as exc:
                started.put(exc)
                raise
            finally:
                await procs.aclose()

    thread = threading.Thread(target=trio.run, args=(host,), name="cli-broker", daemon=True)
    thread.start()
    got = started.get(timeout=60)
    if isinstance(got, BaseException):
        thread.join(10)
        raise got
    try:
        yield got
    finally:
        stop.set()
        thread.join(30)
    assert not thread.is_alive(), "the broker's helper thread did not finish"
    assert stopped == [0], "the broker did not stop cleanly on SIGTERM"


async def _cli(*args: str, env: dict[str, str | None] | None = None) -> Result:
    from amqbroker.cli import main

    unset: dict[str, str | None] = {k: None for k in os.environ if k.startswith("AMQBROKER_")}
    runner = CliRunner()
    return await trio.to_thread.run_sync(
        lambda: runner.invoke(main, list(args), env={**unset, **(env or {})})
    )


def _ok(r: Result) -> str:
    assert r.exit_code == 0, (r.exit_code, r.output, r.exception)
    return r.stdout


async def _queue(rb: RealBroker, name: str) -> dict[str, Any] | None:
    """The queue's attributes (READ through `queue show --json`); None if there is none."""
    r = await _cli("queue", "show", name, "--json", "--url", rb.url)
    if r.exit_code == 1 and "(404)" in r.stderr:
        return None
    found: dict[str, Any] = json.loads(_ok(r))
    return found


async def _until(rb: RealBroker, name: str, attr: str, value: Any) -> dict[str, Any]:
    """Poll the queue's attributes (bounded) until `attr` == `value`: a settlement or
    attach travels on another connection than the CLI's request."""
    seen: dict[str, Any] | None = None
    with trio.move_on_after(10):
        while True:
            seen = await _queue(rb, name)
            if seen is not None and seen.get(attr) == value:
                return seen
            await trio.sleep(0.01)
    raise AssertionError(f"queue {name!r}: {attr} never became {value!r}: {seen}")


async def test_queue_and_address_commands(real_broker: RealBroker) -> None:
    url = real_broker.url
    out = _ok(await _cli("queue", "create", "orders", "--group-buckets", "4", "--url", url))
    assert out == "created queue 'orders' on address 'orders' (ANYCAST, durable)\n"
    shown = await _queue(real_broker, "orders")
    assert shown is not None and shown["groupBuckets"] == 4
    again = await _cli("queue", "create", "orders", "--url", url)
    assert again.exit_code == 1
    assert "the broker refused CREATE (409): queue 'orders' exists already" in again.stderr

    # the URL from the environment, like every connection option
    env = {"AMQBROKER_URL": url}
    _ok(await _cli("producer", "orders", "--count", "30", "--group", "A", env=env))
    _ok(await _cli("producer", "orders", "--count", "5", "--durable", env=env))
    table = _ok(await _cli("queue", "stat", "--name", "orders", env=env)).splitlines()
    assert table[0].split() == [
        "NAME", "ADDRESS", "CONSUMERS", "MESSAGES", "ADDED", "DELIVERING", "ACKED",
        "SCHEDULED", "GROUPS",
    ]  # fmt: skip
    assert table[1].split() == ["orders", "orders", "0", "35", "35", "0", "0", "0", "0"]
    assert len(table) == 2
    listed = _ok(await _cli("queue", "stat", "--json", env=env))
    assert not [r for r in json.loads(listed) if r["name"].startswith("tmp.")], (
        "the CLI's own reply queue (temporary) is listed without --all"
    )
    rows = json.loads(_ok(await _cli("queue", "stat", "--json", "--all", env=env)))
    mine = [r for r in rows if r["name"] == "orders"]
    assert mine == [
        {
            "name": "orders",
            "address": "orders",
            "consumerCount": 0,
            "messageCount": 35,
            "messagesAdded": 35,
            "deliveringCount": 0,
            "messagesAcknowledged": 0,
            "scheduledCount": 0,
            "groupCount": 0,
        }
    ]
    assert any(r["name"].startswith("tmp.") for r in rows)  # --all shows reply queues
    loop = ("--name", "orders", "--loop", "0.1", "--iterations", "2")
    looped = _ok(await _cli("queue", "stat", *loop, env=env))
    assert looped.count("NAME  ") == 2 and looped.count(url) == 2
    lines = _ok(await _cli("queue", "stat", "--json", *loop, env=env))
    assert [len(json.loads(ln)) for ln in lines.splitlines()] == [1, 1]  # JSON lines

    assert _ok(await _cli("queue", "pause", "orders", env=env)) == "queue 'orders' paused\n"
    assert (await _until(real_broker, "orders", "paused", True))["paused"]
    _ok(await _cli("queue", "resume", "orders", env=env))
    await _until(real_broker, "orders", "paused", False)
    upd = _ok(
        await _cli("queue", "update", "orders", "--exclusive", "--group-buckets", "-1", env=env)
    )
    assert upd == "queue 'orders' updated: exclusive=true, groupBuckets=-1\n"
    show = json.loads(_ok(await _cli("queue", "show", "orders", "--json", env=env)))
    assert (show["messageCount"], show["exclusive"], show["groupBuckets"]) == (35, True, -1)
    shown_text = _ok(await _cli("queue", "show", "orders", env=env)).splitlines()
    assert ["messageCount", "35"] in [line.split() for line in shown_text]
    assert _ok(await _cli("queue", "purge", "orders", env=env)) == (
        "queue 'orders': 35 message(s) removed\n"
    )
    assert _ok(await _cli("queue", "delete", "orders", env=env)) == "deleted queue 'orders'\n"
    assert await _queue(real_broker, "orders") is None
    missing = await _cli("queue", "purge", "orders", env=env)
    assert missing.exit_code == 1 and "(404): no queue 'orders'" in missing.stderr

    _ok(await _cli("address", "create", "news", "--routing", "multicast", env=env))
    _ok(await _cli("queue", "create", "audit", "--address", "news", env=env))
    addrs = _ok(await _cli("address", "show", env=env)).splitlines()
    assert addrs[0].split() == [
        "NAME",
        "ROUTING",
        "QUEUES",
        "PRODUCERS",
        "MESSAGES",
        "SIZE",
        "FULL",
    ]
    news = [line.split() for line in addrs[1:] if line.split()[0] == "news"]
    assert news == [["news", "MULTICAST", "1", "0", "0", "0", "no"]]
    one = json.loads(_ok(await _cli("address", "show", "news", "--json", env=env)))
    assert (one["routingType"], one["queueNames"]) == ("MULTICAST", ["audit"])
    _ok(await _cli("address", "delete", "news", env=env))
    gone = await _cli("address", "show", "news", env=env)
    assert gone.exit_code == 1 and "(404)" in gone.stderr, gone.output
    assert await _queue(real_broker, "audit") is None
    usage = await _cli("queue", "update", "x", env=env)
    assert usage.exit_code == 2 and "give at least one option" in usage.stderr


async def test_check_exit_codes(real_broker: RealBroker, nursery: trio.Nursery) -> None:
    url = real_broker.url
    node = await _cli("check", "node", "--url", url)
    assert node.exit_code == 0 and node.stdout.startswith("OK: amqbroker "), node.output
    assert len(node.stdout.splitlines()) == 1
    c = await Client.connect(real_broker.port, nursery=nursery)
    try:
        s = await c.sender("jobs")
        await s.send_many([msg(f"j{i}") for i in range(3)])
        ok = await _cli("check", "queue", "jobs", "--max-messages", "3", "--url", url)
        assert ok.exit_code == 0, ok.output
        assert ok.stdout.startswith("OK: queue 'jobs': 3 message(s), 0 consumer(s), oldest ")
        bad = await _cli(
            "check", "queue", "jobs", "--max-messages", "2", "--min-consumers", "1", "--url", url
        )
        assert bad.exit_code == 1
        assert bad.stdout == (
            "FAIL: queue 'jobs': 3 messages > 2 (--max-messages); 0 consumers < 1 "
            "(--min-consumers)\n"
        )
        r = await c.receiver("jobs", credit=0)
        await _until(real_broker, "jobs", "consumerCount", 1)
        assert (
            await _cli("check", "queue", "jobs", "--min-consumers", "1", "--url", url)
        ).exit_code == 0
        none = await _cli("check", "queue", "nope", "--url", url)
        assert none.exit_code == 1
        assert none.stdout.startswith("FAIL: queue 'nope': no queue 'nope'")
        await r.close()
    finally:
        c.abort()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    down = await _cli("check", "node", env={"AMQBROKER_URL": f"amqp://127.0.0.1:{free}"})
    assert down.exit_code == 2, down.output
    assert down.stderr.startswith(f"Error: cannot connect to amqp://127.0.0.1:{free}: ")
    assert down.stderr.rstrip().endswith("is the broker running? (amqbroker run)")
    assert len(down.stderr.splitlines()) == 1


async def test_groups_list_top_and_reset(real_broker: RealBroker, nursery: trio.Nursery) -> None:
    url = real_broker.url
    c = await Client.connect(real_broker.port, nursery=nursery, container="app")
    try:
        r1 = await c.receiver("tickets", credit=1, name="w1")
        await c.receiver("tickets", credit=10, name="w2")
        s = await c.sender("tickets")
        await s.send_many([msg("A1", "A"), msg("B1", "B"), msg("A2", "A"), msg("A3", "A")])
        a1 = await r1.receive()
        await _until(real_broker, "tickets", "deliveringCount", 2)
        out = _ok(await _cli("groups", "list", "tickets", "--url", url)).splitlines()
        assert out[0].split() == [
            "GROUP", "OWNER", "CONNECTION", "BACKLOG", "IN", "FLIGHT", "OLDEST", "BOUND",
            "SINCE", "STATE",
        ]  # fmt: skip
        by = {line.split()[0]: line.split() for line in out[1:]}
        conn_id = by["A"][2]
        assert re.fullmatch(r"c\d+", conn_id), out
        assert by["A"][1:5] == ["w1", conn_id, "2", "1"] and by["A"][-1] == "blocked"
        assert by["B"][1:5] == ["w2", conn_id, "0", "1"]
        top = json.loads(
            _ok(await _cli("groups", "list", "tickets", "--top", "1", "--json", "--url", url))
        )
        assert [(g["group"], g["backlog"], g["inFlight"]) for g in top] == [("A", 2, 1)]
        # the table's OWNER column has the same name in the JSON
        assert top[0]["owner"] == "w1" and "consumer" not in top[0]
        assert isinstance(top[0]["oldestMessageAge"], int)
        assert _ok(await _cli("groups", "count", "tickets", "--url", url)) == "2\n"
        one = _ok(await _cli("groups", "reset", "tickets", "B", "--url", url))
        assert one == "queue 'tickets': group 'B' unbound\n"
        old_form = _ok(
            await _cli("groups", "reset", "--queue", "tickets", "--group", "Z", "--url", url)
        )
        assert old_form == "queue 'tickets': group 'Z' was not bound\n"
        left = json.loads(_ok(await _cli("groups", "list", "tickets", "--json", "--url", url)))
        assert [g["group"] for g in left] == ["A"]
        everything = _ok(await _cli("groups", "reset", "tickets", "--url", url))
        assert everything == "queue 'tickets': 1 group binding(s) removed\n"
        no_queue = await _cli("groups", "list", "--url", url)
        assert no_queue.exit_code == 2 and "name the queue" in no_queue.stderr
        r1.accept(a1)
    finally:
        c.abort()


async def test_producer_browser_consumer(real_broker: RealBroker) -> None:
    env = {"AMQBROKER_URL": real_broker.url}
    sent = await _cli(
        "producer", "work", "--count", "4", "--group", "G", "--group-seq", "10",
        "--properties", '{"region": "eu", "n": 3}', "--message", "job {n}", "--durable",
        "--progress", env=env,
    )  # fmt: skip
    assert _ok(sent) == "sent 4 message(s) to 'work'\n"
    assert "sending to work" in sent.stderr and "4/4" in sent.stderr  # the progress bar
    _ok(await _cli("producer", "work", "--count", "2", env=env))
    assert "sending" not in (await _cli("producer", "work", env=env)).stderr  # no TTY: no bar

    browsed = _ok(await _cli("browser", "work", "--json", "--timeout", "0.5", env=env))
    got = [json.loads(line) for line in browsed.splitlines()]
    assert [m["body"] for m in got] == [
        "job 0", "job 1", "job 2", "job 3", "message 0", "message 1", "message 0",
    ]  # fmt: skip
    assert (got[0]["group"], got[0]["groupSeq"], got[0]["durable"]) == ("G", 10, True)
    assert got[3]["groupSeq"] == 13 and got[0]["properties"] == {"region": "eu", "n": 3}
    work = await _queue(real_broker, "work")
    assert work is not None and work["messageCount"] == 7  # browsing takes nothing

    text = _ok(await _cli("consumer", "work", "--group", "G", "--count", "2", env=env))
    assert text.splitlines() == [
        '[G#10] job 0 {"region": "eu", "n": 3}',
        '[G#11] job 1 {"region": "eu", "n": 3}',
    ]
    rest = await _cli("consumer", "work", "--quiet", "--timeout", "0.5", env=env)
    assert _ok(rest) == "received 5 message(s) from 'work'\n"
    left = await _queue(real_broker, "work")  # an auto-created queue goes once empty
    assert left is None or left["messageCount"] == 0

    bad = await _cli("producer", "work", "--properties", "[1]", env=env)
    assert bad.exit_code == 2 and "--properties must be a JSON object" in bad.stderr


async def test_config_show_names_sources_and_masks_secrets(tmp_path: Path) -> None:
    from amqbroker.core.auth import hash_password

    secret = hash_password("pw", iterations=1000)
    cfg = tmp_path / "b.toml"
    cfg.write_text(f'port = 5673\ntls_key_file = "/etc/k.pem"\n[users]\nalice = "{secret}"\n')
    r = await _cli("config", "show", "--config", str(cfg), env={"AMQBROKER_LOG_LEVEL": "debug"})
    out = _ok(r)
    assert secret not in out
    lines = {ln.split()[0]: ln.split() for ln in out.splitlines()[1:]}
    assert out.splitlines()[0].split() == ["SETTING", "VALUE", "SOURCE"]
    assert lines["port"] == ["port", "5673", "file", str(cfg)]
    assert lines["log_level"] == ["log_level", '"DEBUG"', "env", "AMQBROKER_LOG_LEVEL"]
    assert lines["host"] == ["host", '"127.0.0.1"', "default"]
    assert lines["users.alice"] == ["users.alice", '"<hidden>"', "file", str(cfg)]
    assert lines["tls_key_file"][1] == '"/etc/k.pem"'  # a path is not a secret
    rows = json.loads(_ok(await _cli("config", "show", "--config", str(cfg), "--json")))
    by = {row["name"]: row for row in rows}
    assert by["users.alice"] == {
        "name": "users.alice",
        "value": "<hidden>",
        "source": f"file {cfg}",
    }
    assert by["max_frame_size"] == {"name": "max_frame_size", "value": 65536, "source": "default"}
    assert secret not in json.dumps(rows)
    broken = await _cli("config", "show", "--config", str(cfg), env={"AMQBROKER_PORT": "x"})
    assert broken.exit_code == 1 and "AMQBROKER_PORT" in broken.stderr


async def test_create_makes_an_instance_whose_start_script_runs_the_broker(
    procs: BrokerProcesses, tmp_path: Path, nursery: trio.Nursery
) -> None:
    inst = tmp_path / "broker1"
    out = _ok(await _cli("create", str(inst), "--port", "0"))
    assert f"created amqbroker instance {inst}" in out
    config = (inst / "etc" / "amqbroker.toml").read_text()
    assert 'data_dir = "data"' in config and "# max_frame_size = 65536" in config
    script = inst / "bin" / "amqbroker"
    assert os.access(script, os.X_OK) and (inst / "data").is_dir()
    again = await _cli("create", str(inst))
    assert again.exit_code == 1 and "already an amqbroker instance" in again.stderr

    # started from elsewhere: the data directory is the instance's
    proc = await trio.lowlevel.open_process(
        [str(script)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=clean_env(),
        cwd=str(tmp_path),
    )
    bp = BrokerProcess(proc, [str(script)])
    procs.started.append(bp)
    assert proc.stdout is not None and proc.stderr is not None
    nursery.start_soon(bp._pump, proc.stdout, bp.stdout_lines)
    nursery.start_soon(bp._pump, proc.stderr, bp.stderr_lines)
    port = await bp.wait_ready()
    assert bp.data_dir is not None and bp.data_dir.resolve() == (inst / "data").resolve()
    await _ping(port, nursery)
    check = await _cli("check", "node", "--url", f"amqp://127.0.0.1:{port}")
    assert check.exit_code == 0, check.output
    assert await bp.stop() == 0, bp.describe()
    assert (inst / "data" / "journal").exists()
    assert not (tmp_path / "amqbroker-data").exists()

    not_instance = await _cli("run", str(tmp_path))
    assert not_instance.exit_code == 1
    assert "is not an amqbroker instance (no etc/amqbroker.toml); create one with" in (
        not_instance.stderr
    )


async def test_every_management_operation_type_against_the_process(
    real_broker: RealBroker, nursery: trio.Nursery
) -> None:
    """One request of each kind the `$management` node answers (CRUD on every entity
    type, QUERY, the GET-* node operations, each queue operation), sent to the real
    process over AMQP; test_management covers their details in-process."""
    node = "org.amqp.management"
    admin = await Client.connect(real_broker.port, nursery=nursery)
    worker = await Client.connect(real_broker.port, nursery=nursery, container="ops-worker")
    try:

        async def req(op: str, type: str, name: str = "", **kw: Any) -> mgmt.Answer:
            return await mgmt.request(admin, op, name, type=type, **kw)

        made = await req("CREATE", "address", "ops.news", body={"routingType": "MULTICAST"})
        assert made.status == 201, made.description
        assert (await req("READ", "address", "ops.news")).body["routingType"] == "MULTICAST"
        assert (await req("CREATE", "queue", "ops.src", body={"durable": False})).status == 201
        assert (await req("CREATE", "queue", "ops.dst", body={"durable": False})).status == 201
        upd = await req("UPDATE", "queue", "ops.src", body={"groupBuckets": -1})
        assert (upd.status, upd.body["groupBuckets"]) == (200, -1)
        assert (await req("READ", "broker", "self")).body["queues"] >= 2

        s = await worker.sender("ops.src")
        await s.send_many([msg("A1", "A"), msg("B1", "B"), msg("U1"), msg("U2", n=1)])
        r = await worker.receiver("ops.src", credit=1, name="ops-in")
        first = await r.receive()
        assert first.group_id == "A"
        groups = (await mgmt.call(admin, "listGroups", "ops.src"))["groups"]
        assert [(g["group"], g["consumer"]) for g in groups] == [("A", "ops-in")]
        assert await mgmt.call(admin, "getGroupCount", "ops.src") == 1
        stats = await mgmt.call(admin, "getStatistics", "ops.src")
        assert stats["messages"] == 4 and stats["in_flight"] == 1
        assert (await req("READ", "group", "ops.src/A")).body["backlog"] == 0
        assert await mgmt.call(admin, "resetGroup", "ops.src", body={"group": "Z"}) == {"reset": 0}
        assert await mgmt.call(admin, "resetAllGroups", "ops.src") == {"reset": 1}

        rows = await req(
            "QUERY",
            node,
            entityType="connection",
            body={"attributeNames": ["identity", "container"]},
        )
        conn_id = next(row[0] for row in rows.body["results"] if row[1] == "ops-worker")
        assert (await req("READ", "connection", conn_id)).body["container"] == "ops-worker"
        cons = await req("READ", "consumer", f"{conn_id}/ops-in")
        assert (cons.status, cons.body["queue"]) == (200, "ops.src")
        assert (await req("DELETE", "consumer", f"{conn_id}/ops-in")).status == 204
        with trio.fail_after(10):
            await worker._wait(lambda: r.closed_by_peer, 10)

        assert await mgmt.call(admin, "pause", "ops.src") == {"paused": True}
        assert await mgmt.call(admin, "resume", "ops.src") == {"paused": False}
        moved = await mgmt.call(
            admin, "moveMessages", "ops.src", body={"toQueue": "ops.dst", "filter": "n = 1"}
        )
        assert moved == {"moved": 1}
        # only dead letters (with x-opt-ORIG-ADDRESS) are retried: a moved one is not
        assert await mgmt.call(admin, "retryMessages", "ops.dst") == {"retried": 0}
        assert await mgmt.call(admin, "purge", "ops.src") == {"removed": 3}
        assert await mgmt.call(admin, "purge", "ops.dst") == {"removed": 1}

        assert set((await req("GET-TYPES", node)).body) >= {
            f"org.amqbroker.{t}"
            for t in ("broker", "address", "queue", "connection", "consumer", "group")
        }
        attrs = await req("GET-ATTRIBUTES", node, entityType="group")
        assert "oldestMessageAge" in attrs.body["org.amqbroker.group"]
        ops = await req("GET-OPERATIONS", node, entityType="org.amqbroker.queue")
        assert {"purge", "moveMessages", "retryMessages"} <= set(ops.body["org.amqbroker.queue"])

        assert (await req("DELETE", "connection", conn_id)).status == 204
        with trio.fail_after(10):
            await worker._wait(lambda: worker.closed_by_peer, 10)
        for q in ("ops.src", "ops.dst"):
            assert (await req("DELETE", "queue", q)).status == 204
        assert (await req("DELETE", "address", "ops.news")).status == 204
        missing = await req("READ", "queue", "ops.src")
        assert missing.status == 404 and "ops.src" in (missing.description or "")
    finally:
        admin.abort()
        worker.abort()
