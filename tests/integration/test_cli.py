"""The CLI and the settings end to end: `python -m amqbroker run` as a real process."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import signal
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from tests.client import Client
from tests.integration.broker_process import BrokerProcess, BrokerProcesses, clean_env

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
    assert "listening on" not in bp.stdout, bp.describe()
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
    assert f"data directory: {data}" in bp.stdout, bp.describe()
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
    assert f"data directory: {tmp_path / 'amqbroker-data'}" in bp.stdout
    await _ping(port, nursery)
    assert await bp.stop() == 0, bp.describe()


async def test_nested_data_dir_is_created(
    procs: BrokerProcesses, tmp_path: Path, nursery: trio.Nursery
) -> None:
    data = tmp_path / "a" / "b" / "store"
    bp = await procs.start(data)
    assert data.is_dir()
    assert f"data directory: {data}" in bp.stdout
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
    assert f"data directory: {tmp_path / 'amqbroker-data'}" in bp.stdout
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
    assert f"data directory: {tmp_path / 'from-file'}" in bp.stdout, bp.describe()
    await _ping(bp.port, nursery)
    assert " DEBUG " in bp.stderr, f"log_level from the file was not applied\n{bp.describe()}"
    assert await bp.stop() == 0, bp.describe()

    bp = await procs.spawn(
        ["run", "--config", str(cfg)], env={"AMQBROKER_DATA_DIR": str(tmp_path / "from-env")}
    )
    await bp.wait_ready()
    assert f"data directory: {tmp_path / 'from-env'}" in bp.stdout, bp.describe()
    await _ping(bp.port, nursery)
    assert await bp.stop() == 0, bp.describe()

    bp = await procs.spawn(
        ["run", "--config", str(cfg), "--data-dir", str(tmp_path / "from-cli")],
        env={"AMQBROKER_DATA_DIR": str(tmp_path / "from-env")},
    )
    await bp.wait_ready()
    assert f"data directory: {tmp_path / 'from-cli'}" in bp.stdout, bp.describe()
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
    """A supervisor may stop the broker as soon as it reported ready. Made deterministic
    by giving the broker a full pipe as stdout: it logs "listening on" (stderr), then
    blocks printing its ready lines; the signal arrives exactly there. A broker that
    handles signals from the moment it reports ready stops gracefully (exit 0) once
    the pipe is drained."""
    r, w = os.pipe()
    try:
        os.set_blocking(w, False)
        with contextlib.suppress(BlockingIOError):
            while True:
                os.write(w, b"." * 4096)
        with contextlib.suppress(BlockingIOError):
            while True:
                os.write(w, b".")
        os.set_blocking(w, True)
        bp = await procs.spawn(["run", "--port", "0", "--data-dir", str(tmp_path / "d")], stdout=w)
    finally:
        os.close(w)
    reader = trio.lowlevel.FdStream(r)
    try:
        await bp.wait_for_line(r"INFO amqbroker: amqbroker \S+ listening on", timeout=20)
        bp.send_signal(sig)
        out = b""
        with trio.fail_after(20):
            while chunk := await reader.receive_some(65536):
                out += chunk
    finally:
        await reader.aclose()
    rc = await bp.wait_exit()
    assert rc == 0, f"exit status {rc} after {sig.name} right after start-up\n{bp.describe()}"
    assert f"received {sig.name}" in bp.stderr, bp.describe()
    assert b"listening on" in out
