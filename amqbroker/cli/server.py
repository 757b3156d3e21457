"""Commands about the broker process itself: create, run, hash-password, config show."""

from __future__ import annotations

import gc
import logging
import os
import sys
from pathlib import Path
from typing import Any

import click

from amqbroker.cli.common import echo_json, json_option, table


class OneLineFormatter(logging.Formatter):
    """Every event is one line: line breaks inside a message (a peer's description, a
    traceback) become ' | ', so a log line can neither be split nor forged by a client."""

    def format(self, record: logging.LogRecord) -> str:
        return super().format(record).replace("\r", "").replace("\n", " | ")


def _tune_gc(young: int) -> None:
    """The process's cyclic garbage collector: what is loaded so far (modules, classes,
    settings) is frozen, never scanned again, and a young collection runs every
    `young` net allocations of tracked objects (``gc_young_threshold``) instead of
    Python's 700, at which every message in flight is scanned and promoted."""
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(young, middle, old)


def _setup_logging(level: str) -> None:
    """One handler (stderr) on the root logger: every event is one line there."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(OneLineFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), handlers=[handler])


@click.command()
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True, help="address to listen on")
@click.option("--port", type=click.IntRange(0, 65535), default=5672, show_default=True)
def create(directory: Path, host: str, port: int) -> None:
    """Create an instance folder: etc/amqbroker.toml (every setting, commented), data/,
    and bin/amqbroker, a start script."""
    from amqbroker.tools.instance import InstanceError, create_instance

    try:
        inst = create_instance(directory, host=host, port=port)
    except InstanceError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"created amqbroker instance {inst.root}")
    click.echo(f"  settings:  {inst.config}")
    click.echo(f"  data:      {inst.data}")
    click.echo(f"  start it:  {inst.start_script}   (or: amqbroker run {inst.root})")


@click.command()
@click.argument("directory", required=False, type=click.Path(file_okay=False, path_type=Path))
@click.option("--host", help="address to listen on (default 127.0.0.1; AMQBROKER_HOST)")
@click.option("--port", type=int, help="AMQP port (default 5672; 0 = any; AMQBROKER_PORT)")
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="where messages are stored (default ./amqbroker-data; AMQBROKER_DATA_DIR)",
)
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="TOML settings file (see config/amqbroker.toml; AMQBROKER_CONFIG)",
)
def run(
    directory: Path | None,
    host: str | None,
    port: int | None,
    data_dir: Path | None,
    config_file: Path | None,
) -> None:
    """Start the broker; stops gracefully on SIGINT/SIGTERM.

    With DIRECTORY (an instance made by `amqbroker create`): its etc/amqbroker.toml,
    relative paths relative to it (data_dir = "data")."""
    import trio

    from amqbroker.app import BrokerApp, StartupError
    from amqbroker.pair import uses_lease
    from amqbroker.settings import SettingsError, load_settings
    from amqbroker.store.journal import JournalError
    from amqbroker.tools.instance import InstanceError, enter_instance

    if config_file is None and os.environ.get("AMQBROKER_CONFIG"):
        config_file = Path(os.environ["AMQBROKER_CONFIG"])
    if directory is not None:
        config_file = config_file.resolve() if config_file is not None else None
        data_dir = data_dir.resolve() if data_dir is not None else None
        try:
            instance_config = enter_instance(directory)
        except InstanceError as exc:
            raise click.ClickException(str(exc)) from None
        config_file = config_file or instance_config
    overrides: dict[str, Any] = {"host": host, "port": port, "data_dir": data_dir}
    try:
        settings = load_settings(config_file, {k: v for k, v in overrides.items() if v is not None})
    except SettingsError as exc:
        raise click.ClickException(str(exc)) from exc
    _setup_logging(settings.log_level)
    _tune_gc(settings.gc_young_threshold)
    if uses_lease(settings):
        _run_pair(settings)
    app = BrokerApp(settings)
    try:
        # the start banner is the app's log line ("amqbroker V listening on URL, ...;
        # data in DIR (...)"), once, on stderr: nothing is echoed besides it
        trio.run(lambda: app.run(handle_signals=True))
    except (StartupError, JournalError) as exc:
        raise click.ClickException(str(exc)) from exc
    except KeyboardInterrupt:
        sys.exit(130)
    sys.exit(app.exit_code)


def _run_pair(settings: Any) -> None:
    """A member of a primary/backup pair whose live member ZooKeeper decides."""
    import trio

    from amqbroker.app import StartupError
    from amqbroker.ha.lease import LeaseUnavailable
    from amqbroker.pair import PairMember
    from amqbroker.store.journal import JournalError

    member = PairMember(settings)
    try:
        trio.run(lambda: member.run(handle_signals=True))
    except (StartupError, JournalError, LeaseUnavailable) as exc:
        raise click.ClickException(str(exc)) from exc
    except KeyboardInterrupt:
        sys.exit(130)
    sys.exit(member.exit_code)


@click.command("hash-password")
@click.option("--password", prompt=True, hide_input=True, confirmation_prompt=True)
@click.option(
    "--scram",
    is_flag=True,
    help="SCRAM-SHA-256 credentials (login with SCRAM-SHA-256 or PLAIN) instead of a "
    "pbkdf2-sha256 hash (PLAIN only)",
)
@click.option(
    "--iterations",
    type=int,
    default=None,
    help="PBKDF2 iterations (default 200000; at least 4096 with --scram)",
)
def hash_password_cmd(password: str, scram: bool, iterations: int | None) -> None:
    """Print a password hash for the `users` setting."""
    from amqbroker.core.auth import DEFAULT_ITERATIONS, hash_password, hash_password_scram

    make = hash_password_scram if scram else hash_password
    try:
        click.echo(
            make(password, iterations=DEFAULT_ITERATIONS if iterations is None else iterations)
        )
    except ValueError as exc:
        raise click.ClickException(f"cannot hash this password: {exc}") from exc


@click.group()
def config() -> None:
    """Inspect the broker's settings."""


@config.command("show")
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False, path_type=Path),
    envvar="AMQBROKER_CONFIG",
    show_envvar=True,
    help="TOML settings file, as given to `amqbroker run --config`",
)
@json_option
def config_show(config_file: Path | None, as_json: bool) -> None:
    """Every effective setting (file < AMQBROKER_* environment < defaults) and where it
    comes from; password hashes are masked."""
    from amqbroker.settings import SettingsError
    from amqbroker.tools.settings_report import effective_settings

    try:
        rows = effective_settings(config_file)
    except SettingsError as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        echo_json([r.as_dict() for r in rows])
        return
    click.echo(
        table(
            ["SETTING", "VALUE", "SOURCE"],
            [[r.name, _value(r.value), r.source] for r in rows],
        )
    )


def _value(v: Any) -> str:
    import json

    if isinstance(v, str):
        return json.dumps(v)
    return json.dumps(v, default=str)
