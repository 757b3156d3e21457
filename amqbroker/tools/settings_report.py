"""`amqbroker config show`: every effective setting, where it came from, secrets masked.

Theory of operation
-------------------
`load_settings` (the broker's own loader, so the answer is exactly what `amqbroker
run` would use) builds the settings from defaults < the TOML file < ``AMQBROKER_*``
environment variables, and reports the source of each value it did not leave at its
default. Values are taken from ``Settings.model_dump(mode="json")``; a table-valued
setting (``address_settings``, ``users``, ``roles``, ``security``...) becomes one row
per leaf (``address_settings."orders.#".max_delivery_attempts``), with the source of
the whole setting (a higher layer replaces a table, it never merges).

Masked (shown as ``<hidden>``): the password hashes of ``users``, and any setting whose
name says it is a password, secret or token; user info in an ``otlp_endpoint`` URL.
File paths (TLS certificate and key files) are shown: they are not secrets.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from amqbroker.settings import ENV_PREFIX, load_settings

HIDDEN = "<hidden>"
_SECRET_NAME = re.compile(r"password|secret|token", re.IGNORECASE)
#: settings whose values (not keys) are secrets
_SECRET_VALUES = frozenset({"users"})
_URL_USERINFO = re.compile(r"^([a-z][a-z0-9+.-]*://)[^@/]*@", re.IGNORECASE)
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


@dataclass(frozen=True)
class SettingRow:
    name: str
    value: Any
    source: str

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "value": self.value, "source": self.source}


def effective_settings(
    config_file: Path | None, environ: Mapping[str, str] | None = None
) -> list[SettingRow]:
    """The settings `amqbroker run --config FILE` would use, one row per value.
    Raises `amqbroker.settings.SettingsError` (its text names key, value and source)."""
    sources: dict[str, str] = {}
    settings = load_settings(config_file, environ=environ, sources_out=sources)
    rows: list[SettingRow] = []
    for name, value in settings.model_dump(mode="json").items():
        source = _describe_source(sources.get(name), config_file)
        _flatten(rows, name, name, _mask(name, value), source)
    return rows


def _describe_source(label: str | None, config_file: Path | None) -> str:
    if label is None:
        return "default"
    if label.upper().startswith(ENV_PREFIX):
        return f"env {label}"
    if label.startswith("--"):
        return label
    return f"file {label}"


def _mask(name: str, value: Any) -> Any:
    if name in _SECRET_VALUES and isinstance(value, dict):
        return {k: HIDDEN for k in value}
    if _SECRET_NAME.search(name) and value not in (None, "", {}, []):
        return HIDDEN
    if isinstance(value, str) and _URL_USERINFO.match(value):
        return _URL_USERINFO.sub(lambda m: m.group(1) + HIDDEN + "@", value)
    return value


def _key(k: str) -> str:
    return k if _BARE_KEY.fullmatch(k) else '"' + k.replace('"', '\\"') + '"'


def _flatten(rows: list[SettingRow], top: str, path: str, value: Any, source: str) -> None:
    if isinstance(value, dict) and value:
        for k, v in value.items():
            _flatten(rows, top, f"{path}.{_key(str(k))}", v, source)
        return
    rows.append(SettingRow(path, value, source))
