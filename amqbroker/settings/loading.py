"""`load_settings`: defaults < the TOML file < the environment < command-line flags
(see `amqbroker.settings`), and `SettingsError`, which reports every problem found.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from pydantic import ValidationError

from amqbroker.settings.checks import CrossFieldError
from amqbroker.settings.messages import Source, describe_error, did_you_mean, problem_line
from amqbroker.settings.model import Settings

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence


ENV_PREFIX: Final = "AMQBROKER_"


class SettingsError(Exception):
    """The settings could not be loaded; ``str()`` is the complete message for a person.

    `problems` holds one line per problem (a single entry for file-level errors).
    """

    def __init__(self, message: str, problems: Sequence[str] | None = None) -> None:
        super().__init__(message)
        self.problems: list[str] = list(problems) if problems is not None else [message]

    @classmethod
    def from_problems(cls, problems: Sequence[str]) -> SettingsError:
        if len(problems) == 1:
            return cls(f"invalid setting: {problems[0]}", problems)
        lines = "\n".join(f"  - {p}" for p in problems)
        return cls(f"{len(problems)} problems with the settings:\n{lines}", problems)


FIELD_NAMES: Final = frozenset(Settings.model_fields)
#: settings given as JSON in environment variables
_JSON_FIELDS: Final = frozenset(
    {"users", "address_settings", "addresses", "roles", "security", "tls_identity_users"}
)
_JSON_EXAMPLES: Final = {
    "users": '{"alice": "scram-sha-256$..."}',
    "tls_identity_users": '{"CN=app1,O=Example": "app1"}',
    "address_settings": '{"orders.#": {"max_delivery_attempts": 5}}',
    "addresses": '[{"name": "orders", "routing": "anycast"}]',
    "roles": '{"alice": ["app"]}',
    "security": '{"orders.#": {"send": ["app"], "consume": ["app"]}}',
    "extra_listeners": '["0.0.0.0:5673"] or 0.0.0.0:5673,[::1]:5674',
    "cluster_peers": '["node2=127.0.0.1:5673"] or node2=127.0.0.1:5673,node3=127.0.0.1:5674',
    "tls_listeners": '["0.0.0.0:5671"] or 0.0.0.0:5671,[::1]:5671',
    "ws_listeners": '["0.0.0.0:5680"] or 0.0.0.0:5680,[::1]:5680',
    "wss_listeners": '["0.0.0.0:5681"] or 0.0.0.0:5681,[::1]:5681',
}
#: listener lists: JSON or a comma-separated list in environment variables
_LISTENER_FIELDS: Final = frozenset(
    {"extra_listeners", "tls_listeners", "ws_listeners", "wss_listeners"}
)


def load_settings(
    config_file: Path | None = None,
    overrides: Mapping[str, object] | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    sources_out: dict[str, str] | None = None,
) -> Settings:
    """Build `Settings` from defaults < `config_file` < `environ` < `overrides`.

    `environ` defaults to ``os.environ``; `overrides` holds CLI flags by setting name
    (snake or kebab case), None meaning "not given". Raises `SettingsError`.
    `sources_out`, when given, receives where each setting not left at its default came
    from (name -> the file path, ``AMQBROKER_<NAME>`` or ``--flag``), for
    ``amqbroker config show``.
    """
    values: dict[str, object] = {}
    sources: dict[str, Source] = {}
    problems: list[str] = []

    if config_file is not None:
        data = _read_toml(Path(config_file))
        label = str(config_file)
        for key, value in data.items():
            name = key.replace("-", "_")
            if name not in FIELD_NAMES:
                problems.append(f"unknown key {key!r} in {label}{did_you_mean(key, FIELD_NAMES)}")
            elif name in sources:
                problems.append(
                    f"{key!r} in {label} sets {name} again (already set as "
                    f"{sources[name].key!r}); keep one of them"
                )
            else:
                values[name] = value
                sources[name] = Source(label, key)

    env = os.environ if environ is None else environ
    seen_env: set[str] = set()
    undecodable: set[str] = set()
    for var in sorted(env):  # upper-case spellings sort first and win
        if not var.upper().startswith(ENV_PREFIX):
            continue
        name = var[len(ENV_PREFIX) :].lower()
        if name not in FIELD_NAMES or name in seen_env:
            continue
        seen_env.add(name)
        source = Source(var, name, whole_string=True)
        try:
            values[name] = _decode_env(name, env[var])
        except ValueError as exc:
            values.pop(name, None)
            undecodable.add(name)
            problems.append(problem_line(name, env[var], source, str(exc), whole=True))
        sources[name] = source

    for key, value in (overrides or {}).items():
        if value is None:
            continue
        name = key.replace("-", "_")
        if name not in FIELD_NAMES:
            problems.append(
                f"unknown setting {key!r} given on the command line{did_you_mean(key, FIELD_NAMES)}"
            )
            continue
        values[name] = value
        sources[name] = Source("--" + name.replace("_", "-"), name)

    try:
        settings = Settings.model_validate(values)
    except ValidationError as exc:
        for err in exc.errors():
            cross = (err.get("ctx") or {}).get("error")
            if isinstance(cross, CrossFieldError) and undecodable & cross.fields.keys():
                continue  # a consequence of a value already reported as unreadable
            problems.append(describe_error(err, sources))
    else:
        if not problems:
            if sources_out is not None:
                sources_out.update({name: src.label for name, src in sources.items()})
            return settings
    raise SettingsError.from_problems(problems)


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise SettingsError(
            f"config file {path} does not exist; check the --config path "
            "(config/amqbroker.toml is an example with every setting)"
        ) from None
    except IsADirectoryError:
        raise SettingsError(f"config file {path} is a directory, not a TOML file") from None
    except OSError as exc:
        raise SettingsError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise SettingsError(
            f"config file {path} is not UTF-8 text (bad byte at line {line}); save it as UTF-8"
        ) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        line, col, msg = _toml_position(exc, text)
        raise SettingsError(f"invalid TOML in {path} at line {line}, column {col}: {msg}") from None


_POSITION = re.compile(r"\s*\(at line (\d+), column (\d+)\)$")
_AT_END = re.compile(r"\s*\(at end of document\)$")


def _toml_position(exc: tomllib.TOMLDecodeError, text: str) -> tuple[int, int, str]:
    message = str(exc)
    lineno, colno = getattr(exc, "lineno", None), getattr(exc, "colno", None)
    if isinstance(lineno, int) and isinstance(colno, int):  # Python >= 3.14
        return lineno, colno, getattr(exc, "msg", message)
    if m := _POSITION.search(message):
        return int(m[1]), int(m[2]), message[: m.start()]
    last = text.split("\n")
    end_msg = _AT_END.sub("", message)
    return len(last), len(last[-1]) + 1, f"{end_msg} (at the end of the file)"


def _decode_env(name: str, text: str) -> object:
    """Turn an environment variable's text into the value to validate."""
    if name in _JSON_FIELDS or (
        (name in _LISTENER_FIELDS or name == "cluster_peers") and text.lstrip().startswith("[")
    ):
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"not valid JSON ({exc.msg} at column {exc.colno}); expected e.g. "
                f"{_JSON_EXAMPLES[name]}"
            ) from None
    if name in _LISTENER_FIELDS or name == "cluster_peers":
        return [part.strip() for part in text.split(",") if part.strip()]
    return text
