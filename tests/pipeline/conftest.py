"""Fixtures of the Spark tests: ONE local SparkSession for the whole test session
(starting a JVM costs seconds), and real broker processes run synchronously (Spark
tests are plain functions; the connector talks to the broker from Spark's Python
workers).

Outside CI a machine without pyspark, pyarrow or a working JVM skips these tests; in
CI (the `CI` environment variable set, as CI services do; scripts/test installs
`.[spark]` and Java there) the same condition fails the run, so Spark breakage is
never hidden as a skip (the pattern of tests/cluster/zk_harness.py).
"""

from __future__ import annotations

import importlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import pytest

LISTENING_RE = re.compile(r"listening on amqp://127\.0\.0\.1:(\d+)")


def in_ci() -> bool:
    """True when running under CI (`CI` set to anything but empty/0/false/no)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def skip_unless_ci(reason: str) -> NoReturn:
    """Skip on a developer machine; fail in CI, where the Spark stack must work."""
    if in_ci():
        pytest.fail(f"{reason} (CI is set: the Spark pipeline tests must run in CI)")
    pytest.skip(reason)


def require_module(name: str) -> Any:
    """`pytest.importorskip` that fails instead of skipping in CI."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        skip_unless_ci(f"{name} is not installed ({exc}): pip install '.[spark]'")


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """A local[2] session bound to 127.0.0.1, UI off, 2 shuffle partitions."""
    require_module("pyspark")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    try:
        session = (
            SparkSession.builder.master("local[2]")
            .appName("amqbroker-tests")
            .config("spark.driver.host", "127.0.0.1")
            .config("spark.driver.bindAddress", "127.0.0.1")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.sql.shuffle.partitions", "2")
            # tiny data: compiling whole-stage code costs more than it saves
            .config("spark.sql.codegen.wholeStage", "false")
            .config("spark.sql.adaptive.enabled", "false")
            .getOrCreate()
        )
    except Exception as exc:  # no Java, or the JVM would not start
        skip_unless_ci(f"pyspark cannot start a JVM: {exc}")
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


class SyncBroker:
    """`python -m amqbroker run` as a subprocess, for synchronous tests."""

    def __init__(self, data_dir: Path, env: dict[str, str], config: Path | None = None):
        args = [
            sys.executable,
            "-m",
            "amqbroker",
            "run",
            "--port",
            "0",
            "--data-dir",
            str(data_dir),
        ]
        if config is not None:
            args += ["--config", str(config)]
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("AMQBROKER_")}
        full_env.update(env, PYTHONUNBUFFERED="1")
        self.data_dir = data_dir
        self.proc = subprocess.Popen(
            args, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        deadline = time.monotonic() + 30
        self.output: list[str] = []
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            if not line or time.monotonic() > deadline:
                self.proc.kill()
                raise AssertionError("broker did not start:\n" + "".join(self.output))
            self.output.append(line)
            m = LISTENING_RE.search(line)
            if m:
                self.port = int(m.group(1))
                break
        self.url = f"amqp://127.0.0.1:{self.port}"

    def stop(self) -> int:
        """SIGTERM (graceful: closes the delivery-log files), bounded wait."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.communicate(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.communicate()
        return self.proc.returncode
