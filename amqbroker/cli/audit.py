"""`amqbroker audit PATH...`: the PySpark delivery audit (README "Delivery audit").
Parse, call, print; the job is `amqbroker.pipeline.audit`, imported only when the
command runs, so the broker never loads pyspark."""

from __future__ import annotations

import sys
from pathlib import Path

import click


@click.command()
@click.argument("paths", nargs=-1, required=True)
@click.option("--master", default=None, help="Spark master URL (default local[*])")
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("audit-report"),
    show_default=True,
    help="directory for report.html, report.md and audit.json",
)
@click.option("--format", "formats", default="html,md", show_default=True, help="html,md")
@click.option(
    "--grace",
    type=float,
    default=0.0,
    show_default=True,
    help="seconds: messages that arrived this close to a node's last event are in flight",
)
@click.option("--samples", type=int, default=20, show_default=True, help="examples per finding")
@click.option("--driver-memory", default="2g", show_default=True, help="local Spark memory")
@click.option("--shuffle-partitions", type=int, default=None, help="spark.sql.shuffle.partitions")
@click.option(
    "--skip-bad-files",
    is_flag=True,
    help="leave out unreadable log files (each named on stderr and in the report) "
    "instead of exiting 2",
)
def audit(
    paths: tuple[str, ...],
    master: str | None,
    out: Path,
    formats: str,
    grace: float,
    samples: int,
    driver_memory: str,
    shuffle_partitions: int | None,
    skip_bad_files: bool,
) -> None:
    """Audit delivery logs (data dirs, delivery-log dirs or files) with PySpark.

    Exit code 0: every invariant holds; 1: an invariant is broken; 2: could not run.
    """
    from amqbroker.pipeline.audit import AuditOptions, run

    opts = AuditOptions(
        paths=paths,
        master=master,
        out=out,
        formats=[f.strip() for f in formats.split(",") if f.strip()],
        grace_s=grace,
        samples=samples,
        driver_memory=driver_memory,
        shuffle_partitions=shuffle_partitions,
        skip_bad_files=skip_bad_files,
    )
    sys.exit(run(opts, echo=click.echo))
