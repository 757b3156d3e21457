"""Instance folders: `amqbroker create DIR` makes one, `amqbroker run DIR` starts it.

Layout::

    DIR/etc/amqbroker.toml   the settings: host, port and data_dir set, every other
                             setting present as a comment with its meaning and default
    DIR/data/                the message store (data_dir = "data")
    DIR/bin/amqbroker        start script: runs `amqbroker run DIR "$@"` with the
                             Python that created the instance

Theory of operation: `amqbroker run DIR` changes into DIR before it loads the settings,
so every relative path of the instance (data_dir, TLS files) is relative to the
instance folder wherever it is started from, and the folder can be moved. Paths given
on the command line with DIR (--config, --data-dir) are made absolute first, so they
keep meaning what they meant in the caller's directory.

The commented settings come from the documented example (config/amqbroker.toml of the
source tree, every line commented out) when it is there, else from the `Settings`
model (each field's description and default). Either way, uncommenting a line without
changing it changes nothing: it is the default.

Invariant: `create` never overwrites an instance: it refuses a DIR that already has
etc/amqbroker.toml, and it writes nothing when it refuses.
"""

from __future__ import annotations

import json
import os
import shlex
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import amqbroker
from amqbroker.settings import Settings

CONFIG = Path("etc") / "amqbroker.toml"
DATA = Path("data")
START_SCRIPT = Path("bin") / "amqbroker"
#: the documented example of a source checkout (absent from an installed wheel)
EXAMPLE = Path(amqbroker.__file__).resolve().parent.parent / "config" / "amqbroker.toml"


class InstanceError(Exception):
    """DIR cannot be created or is not an instance; the text says what to do."""


@dataclass(frozen=True)
class Instance:
    root: Path

    @property
    def config(self) -> Path:
        return self.root / CONFIG

    @property
    def data(self) -> Path:
        return self.root / DATA

    @property
    def start_script(self) -> Path:
        return self.root / START_SCRIPT


def create_instance(directory: Path, *, host: str = "127.0.0.1", port: int = 5672) -> Instance:
    inst = Instance(directory.expanduser().resolve())
    if inst.root.exists() and not inst.root.is_dir():
        raise InstanceError(f"{inst.root} exists and is not a folder; choose another path")
    if inst.config.exists():
        raise InstanceError(
            f"{inst.root} is already an amqbroker instance ({inst.config} exists); start it "
            f"with {inst.start_script} or choose a new folder"
        )
    try:
        inst.config.parent.mkdir(parents=True, exist_ok=True)
        inst.data.mkdir(exist_ok=True)
        inst.start_script.parent.mkdir(exist_ok=True)
        inst.config.write_text(instance_config(inst, host=host, port=port))
        inst.start_script.write_text(start_script(inst))
    except OSError as exc:
        raise InstanceError(f"cannot create the instance in {inst.root}: {exc}") from None
    mode = inst.start_script.stat().st_mode
    inst.start_script.chmod(mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return inst


def enter_instance(directory: Path) -> Path:
    """Check that `directory` is an instance, change into it; returns its config file."""
    inst = Instance(directory.expanduser().resolve())
    if not inst.config.is_file():
        raise InstanceError(
            f"{inst.root} is not an amqbroker instance (no {CONFIG}); create one with "
            f"`amqbroker create {directory}`"
        )
    os.chdir(inst.root)
    return inst.config


def start_script(inst: Instance) -> str:
    python = shlex.quote(sys.executable)
    return f"""#!/bin/sh
# Starts the amqbroker instance in this folder; Ctrl-C or SIGTERM stops it gracefully.
# Settings: etc/amqbroker.toml; AMQBROKER_* environment variables and extra flags
# (e.g. --port 5673) override it. Created by amqbroker {amqbroker.__version__}.
INSTANCE="$(cd "$(dirname "$0")/.." && pwd)"
exec {python} -m amqbroker run "$INSTANCE" "$@"
"""


def instance_config(inst: Instance, *, host: str, port: int) -> str:
    head = f"""# amqbroker instance {inst.root}
#
# Started by bin/amqbroker (or `amqbroker run {inst.root}`), which runs in this
# folder: relative paths below are relative to it. Precedence (highest first):
# command-line flags, AMQBROKER_<NAME> environment variables, this file, defaults.
# `amqbroker config show --config etc/amqbroker.toml` prints the effective settings
# and where each comes from.

host = {_toml(host)}
port = {port}
data_dir = {_toml(str(DATA))}

# Every other setting, commented out at its default: uncomment a line to change it.
"""
    return head + "\n" + commented_defaults() + "\n"


def commented_defaults() -> str:
    """The documented example with every line commented out, or the model's fields."""
    if EXAMPLE.is_file():
        text = EXAMPLE.read_text()
        # its own header (how to use the example) does not apply here
        start = text.find("\n# ---")
        lines = []
        for line in text[start + 1 if start >= 0 else 0 :].splitlines():
            if not line.strip() or line.lstrip().startswith("#"):
                lines.append(line)
            else:
                lines.append("# " + line)
        return "\n".join(lines)
    return defaults_from_model()


def defaults_from_model() -> str:
    """Every field of `Settings` as a commented ``# name = default`` line (tables
    last, as TOML needs), with its description as a ``##`` line."""
    defaults = Settings().model_dump(mode="json")
    plain, tables = [], []
    for name, info in Settings.model_fields.items():
        value = defaults[name]
        doc = [f"## {info.description}"] if info.description else []
        if isinstance(value, dict) and value:
            block = [*doc]
            for key, sub in value.items():
                block.append(f"# [{name}.{_toml_key(key)}]")
                block += [f"# {_toml_key(k)} = {_toml(v)}" for k, v in sub.items() if v is not None]
            tables.append("\n".join(block))
        else:
            plain.append("\n".join([*doc, f"# {name} = {_toml(value)}"]))
    return "\n\n".join(plain + tables)


def _toml_key(key: str) -> str:
    if key and all(c.isalnum() or c in "_-" for c in key):
        return key
    return json.dumps(key)


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        inner = ", ".join(f"{_toml_key(str(k))} = {_toml(v)}" for k, v in value.items())
        return "{ " + inner + " }" if inner else "{}"
    raise TypeError(f"no TOML form for {value!r}")
