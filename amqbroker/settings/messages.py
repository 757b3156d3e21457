"""The problem messages of `load_settings`: ``key = value (from source): problem``.

`Source` is where a value came from (the file, an ``AMQBROKER_<NAME>`` variable, a
``--flag`` or the default); `describe_error` turns one pydantic error into a line
that names the key as written there, the bad value (never a secret one), the source
and what is allowed, with a "did you mean" for unknown keys.
"""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from pydantic import BaseModel

from amqbroker.core.address_settings import AddressSettings
from amqbroker.core.authz import SecurityRule
from amqbroker.settings.checks import CrossFieldError
from amqbroker.settings.fields import AddressConfig
from amqbroker.settings.model import Settings

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence

    from pydantic.fields import FieldInfo
    from pydantic_core import ErrorDetails


#: values never repeated in messages
_SECRET_FIELDS: Final = frozenset({"users", "cluster_password"})


@dataclass(frozen=True)
class Source:
    """Where a value came from, as a message names it."""

    label: str  # "config/amqbroker.toml", "AMQBROKER_PORT", "--port", "default"
    key: str  # the key as written there (snake_case for environment and defaults)
    whole_string: bool = False  # the value is an environment variable's raw text

    def describe(self) -> str:
        return "default" if self.label == "default" else f"from {self.label}"


def did_you_mean(key: str, candidates: Iterable[str]) -> str:
    pool = {c: c for c in candidates}
    if "-" in key:
        pool = {c.replace("_", "-"): c for c in pool}
    close = difflib.get_close_matches(key, list(pool), n=1, cutoff=0.6)
    if close:
        return f"; did you mean {close[0]!r}?"
    return "; see config/amqbroker.toml for every setting"


def _path_text(top: str, rest: Sequence[int | str]) -> str:
    text = top
    for part in rest:
        if isinstance(part, int):
            text += f"[{part}]"
        elif re.fullmatch(r"[A-Za-z0-9_-]+", part):
            text += f".{part}"
        else:
            text += "." + json.dumps(part, ensure_ascii=False)
    return text


def _value_text(value: object, source: Source, whole: bool) -> str:
    if whole and source.whole_string and isinstance(value, str):
        text = value if value and value.strip() == value else json.dumps(value)
    elif isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, int | float):
        text = repr(value)
    elif isinstance(value, Path):
        text = json.dumps(str(value), ensure_ascii=False)
    else:
        text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


def _assignment(field: str, key: str, value: object, source: Source, whole: bool) -> str:
    """``key = value (from source)``; values of secret fields are not repeated."""
    if field in _SECRET_FIELDS and value not in ({}, ""):
        shown = "<hidden>"
    else:
        shown = _value_text(value, source, whole)
    return f"{key} = {shown} ({source.describe()})"


def problem_line(field: str, value: object, source: Source, problem: str, *, whole: bool) -> str:
    return f"{_assignment(field, source.key, value, source, whole)}: {problem}"


def _field_info(top: str, rest: Sequence[int | str]) -> FieldInfo | None:
    if not rest:
        return Settings.model_fields.get(top)
    nested: type[BaseModel] | None = None
    if top == "address_settings" and len(rest) == 2:
        nested = AddressSettings
    elif top == "addresses" and len(rest) == 2:
        nested = AddressConfig
    elif top == "security" and len(rest) == 2:
        nested = SecurityRule
    if nested is None or not isinstance(rest[-1], str):
        return None
    name = rest[-1]
    for field_name, info in nested.model_fields.items():
        if name in (field_name, info.alias):
            return info
    return None


def _nested_candidates(top: str, rest: Sequence[int | str]) -> list[str]:
    if top == "address_settings" and len(rest) == 2:
        return [n for f, i in AddressSettings.model_fields.items() for n in (f, i.alias) if n]
    if top == "addresses" and len(rest) == 2:
        return list(AddressConfig.model_fields)
    if top == "security" and len(rest) == 2:
        return [n for f, i in SecurityRule.model_fields.items() for n in (f, i.alias) if n]
    return []


def _range_text(info: FieldInfo | None, ctx: Mapping[str, Any]) -> str:
    bounds: dict[str, Any] = dict(ctx)
    if info is not None:
        for item in info.metadata:
            for attr in ("ge", "gt", "le", "lt"):
                if getattr(item, attr, None) is not None:
                    bounds[attr] = getattr(item, attr)
    if "ge" in bounds and "le" in bounds:
        return f"must be between {bounds['ge']} and {bounds['le']}"
    parts = []
    if "ge" in bounds:
        parts.append(f"at least {bounds['ge']}")
    if "gt" in bounds:
        parts.append(f"greater than {bounds['gt']}")
    if "le" in bounds:
        parts.append(f"at most {bounds['le']}")
    if "lt" in bounds:
        parts.append(f"less than {bounds['lt']}")
    return "must be " + " and ".join(parts)


_SIMPLE_MESSAGES: Final = {
    "int_parsing": "must be a whole number",
    "int_type": "must be a whole number",
    "int_from_float": "must be a whole number",
    "float_parsing": "must be a number",
    "float_type": "must be a number",
    "finite_number": "must be a finite number",
    "bool_parsing": "must be true or false",
    "bool_type": "must be true or false",
    "string_type": "must be a string",
    "string_too_short": "must not be empty",
    "too_short": "must not be empty",
    "dict_type": "must be a table (a JSON object in an environment variable)",
    "list_type": "must be a list",
    "model_type": "must be a table (a JSON object in an environment variable)",
    "model_attributes_type": "must be a table (a JSON object in an environment variable)",
    "path_type": "must be a path",
    "missing": "is required",
}


def describe_error(err: ErrorDetails, sources: Mapping[str, Source]) -> str:
    loc = err["loc"]
    ctx: Mapping[str, Any] = err.get("ctx") or {}
    kind = err["type"]
    if not loc:
        exc = ctx.get("error")
        if not isinstance(exc, CrossFieldError):
            return str(exc) if exc is not None else err["msg"]
        named = []
        for name, value in exc.fields.items():
            source = sources.get(name, Source("default", name))
            named.append(_assignment(name, source.key, value, source, whole=False))
        return ", ".join(named) + f": {exc}"

    top = str(loc[0])
    rest = list(loc[1:])
    is_key = bool(rest) and rest[-1] == "[key]"
    if is_key:
        rest = rest[:-1]
    source = sources.get(top, Source("default", top))
    path = _path_text(source.key, rest)

    if kind == "extra_forbidden":
        problem = "unknown key" + did_you_mean(str(rest[-1]), _nested_candidates(top, rest))
    elif kind == "value_error":
        problem = str(ctx.get("error", err["msg"]))
    elif kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
        problem = _range_text(_field_info(top, rest), ctx)
    elif kind == "literal_error":
        problem = f"must be {ctx.get('expected', '')}"
    elif kind in _SIMPLE_MESSAGES:
        problem = _SIMPLE_MESSAGES[kind]
    else:
        msg = err["msg"]
        problem = msg[:1].lower() + msg[1:]

    if is_key or kind == "missing":
        return f"{path} ({source.describe()}): {problem}"
    key_value = _assignment(top, path, err["input"], source, whole=not rest)
    return f"{key_value}: {problem}"
