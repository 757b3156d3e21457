"""The delivery audit's inputs (`amqbroker.pipeline.audit`): finding the log files,
checking each one before Spark reads it, loading them as one DataFrame; and the errors
that stop the audit (`AuditError`, the exit codes).

`find_files` and `check_file` need no Spark (``amqbroker audit`` rejects a bad path or
a torn file with one line, before it starts a JVM); `load_events` imports PySpark.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from amqbroker.pipeline import delivery_log_format as fmt

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

#: exit codes of `amqbroker.pipeline.audit.run`
EXIT_OK = 0
EXIT_BROKEN = 1
EXIT_ERROR = 2


class AuditError(Exception):
    """The audit could not run; the message says why and what to do."""


def find_files(paths: Sequence[str]) -> dict[str, list[str]]:
    """The closed log files under `paths` by format: each path is a data directory,
    a ``delivery-log`` directory, a node's directory or a file. A URL (``scheme://``)
    is passed to Spark as is (read recursively with the format's glob)."""
    found: dict[str, list[str]] = {"parquet": [], "jsonl": []}
    for p in paths:
        if "://" in p:
            for names in found.values():
                names.append(p)
            continue
        path = Path(p)
        if not path.exists():
            raise AuditError(
                f"{p}: no such file or directory; give a broker data directory, "
                f"its {fmt.DIRECTORY}/ directory, a node's directory or log files"
            )
        files = [path] if path.is_file() else sorted(path.rglob(f"{fmt.PREFIX}*"))
        for f in files:
            if f.name.endswith(fmt.INPROGRESS):
                continue
            for kind, ext in fmt.EXTENSIONS.items():
                if f.name.endswith(ext):
                    found[kind].append(str(f.resolve()))
    if not any(found.values()):
        raise AuditError(
            f"no delivery-log files ({fmt.PREFIX}*.parquet or *.jsonl) under "
            f"{', '.join(paths)}; is delivery_log = true on the broker?"
        )
    return found


#: Parquet's magic number, at both ends of a complete file
PARQUET_MAGIC = b"PAR1"
#: columns a delivery-log Parquet file must have (the others may be missing: nulls)
_REQUIRED_COLUMNS = ("node", "seq", "ts_us", "event")


def check_file(path: str) -> str | None:
    """What is wrong with the log file at `path`, or None when it looks readable.

    Cheap (a few bytes, the Parquet footer, a JSON line's first line), so a torn or
    foreign file stops the audit with one line before Spark reads it: Spark fails on
    such a file with a long stack trace, or silently skips an empty one. URLs are not
    checked."""
    if "://" in path:
        return None
    try:
        size = os.path.getsize(path)
        if size == 0:
            return "empty file (0 bytes)"
        with open(path, "rb") as fh:
            if path.endswith(fmt.EXTENSIONS["parquet"]):
                return _check_parquet(path, fh, size)
            first = fh.readline(1 << 20)
            fh.seek(-1, os.SEEK_END)
            if fh.read(1) != b"\n":
                return "truncated: the last line is incomplete"
    except OSError as exc:
        return f"cannot read it: {exc.strerror or exc}"
    try:
        rec = json.loads(first)
    except ValueError:
        return "not a JSON-lines delivery log: the first line is not JSON"
    missing = [c for c in _REQUIRED_COLUMNS if not isinstance(rec, dict) or c not in rec]
    if missing:
        return f"not a delivery-log file: the first record has no {', '.join(missing)}"
    return None


def _check_parquet(path: str, fh: Any, size: int) -> str | None:
    if size < 12:
        return f"truncated: {size} bytes, too short for a Parquet file"
    head = fh.read(4)
    fh.seek(-8, os.SEEK_END)
    tail = fh.read(8)
    if head != PARQUET_MAGIC:
        return "not a Parquet file (no PAR1 magic at the start)"
    if tail[4:] != PARQUET_MAGIC:
        return "truncated Parquet file (no PAR1 magic at the end: the footer is missing)"
    footer = int.from_bytes(tail[:4], "little")
    if not 0 < footer <= size - 12:
        return f"corrupt Parquet footer (length {footer} in a {size}-byte file)"
    try:
        import pyarrow.parquet as pq
    except ImportError:  # the magic numbers and the footer length are all we can check
        return None
    try:
        names = set(pq.read_metadata(path).schema.names)
    except Exception as exc:
        return f"unreadable Parquet footer: {_one_line(exc)}"
    missing = [c for c in _REQUIRED_COLUMNS if c not in names]
    if missing:
        return f"not a delivery-log file: no column {', '.join(missing)}"
    return None


def _one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def bad_files(files: dict[str, list[str]]) -> list[tuple[str, str]]:
    """(path, what is wrong) for each file of `files` (`find_files`) that fails
    `check_file`."""
    return [
        (name, problem)
        for names in files.values()
        for name in names
        if (problem := check_file(name)) is not None
    ]


def load_events(
    spark: SparkSession, paths: Sequence[str], files: dict[str, list[str]] | None = None
) -> DataFrame:
    """Every event under `paths` (or in `files`, by format, as `find_files` returns),
    with the format's column types."""
    from pyspark.sql import functions as F

    if files is None:
        files = find_files(paths)
    frames = []
    schema = fmt.SPARK_DDL.replace(" NOT NULL", "")
    for kind, names in files.items():
        if not names:
            continue
        urls = [n for n in names if "://" in n]
        local = [n for n in names if "://" not in n]
        reader = spark.read.schema(schema)
        if kind == "jsonl":
            if local:
                frames.append(reader.json(local))
            if urls:
                frames.append(
                    reader.option("recursiveFileLookup", "true")
                    .option("pathGlobFilter", f"{fmt.PREFIX}*.jsonl")
                    .json(urls)
                )
        else:
            if local:
                frames.append(reader.parquet(*local))
            if urls:
                frames.append(
                    reader.option("recursiveFileLookup", "true")
                    .option("pathGlobFilter", f"{fmt.PREFIX}*.parquet")
                    .parquet(*urls)
                )
    df = frames[0]
    for other in frames[1:]:
        df = df.unionByName(other)
    return df.select(
        *[
            F.col(n)
            .cast(
                t.rstrip("?")
                .replace("str", "string")
                .replace("int64", "bigint")
                .replace("int32", "int")
            )
            .alias(n)
            for n, t in fmt.FIELDS
        ]
    )
