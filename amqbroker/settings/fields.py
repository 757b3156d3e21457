"""The settings' field types: value parsers and validators, the annotated types and
`AddressConfig`, the model of one ``[[addresses]]`` entry.

Each validator raises ValueError with the text a person reads after
``key = value (from source):`` (`amqbroker.settings.messages`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Final, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field

from amqbroker.core.address_settings import Routing, check_address_name

KIB: Final = 1024
MIB: Final = 1024 * KIB
UINT32_MAX: Final = 2**32 - 1


def parse_listener(text: str) -> tuple[str, int]:
    """Split ``host:port`` (``[v6-address]:port`` for IPv6); ValueError if malformed."""
    usage = "must be host:port, e.g. 0.0.0.0:5673 or [::1]:5673"
    if text.startswith("["):
        host, close, rest = text[1:].partition("]")
        if not close or not rest.startswith(":"):
            raise ValueError(usage)
        port_text = rest[1:]
    else:
        host, colon, port_text = text.rpartition(":")
        if not colon:
            raise ValueError(usage)
        if ":" in host:
            raise ValueError(f"{usage} (put an IPv6 address in brackets)")
    if not host or any(c.isspace() for c in host):
        raise ValueError(f"{usage} (the host is missing or contains spaces)")
    if not (port_text.isascii() and port_text.isdigit()) or int(port_text) > 65535:
        raise ValueError(f"{usage} (the port must be between 0 and 65535)")
    return host, int(port_text)


def _check_listener(text: str) -> str:
    parse_listener(text)
    return text


def check_optional_listener(text: str) -> str:
    """'' or 'host:port'."""
    if text:
        parse_listener(text)
    return text


def _check_host(text: str) -> str:
    if not text or any(c.isspace() for c in text):
        raise ValueError("must be a host name or IP address without spaces, e.g. 127.0.0.1")
    return text


def _check_password_hash(stored: str) -> str:
    from amqbroker.core.auth import check_hash_format

    try:
        check_hash_format(stored)
    except ValueError as exc:
        raise ValueError(f"{exc}; create one with `amqbroker hash-password`") from None
    return stored


def _log_level(value: object) -> object:
    if isinstance(value, str):
        value = value.strip().upper()
        return "WARNING" if value == "WARN" else value
    return value


def parse_data_dir(value: object) -> object:
    if isinstance(value, str | Path):
        if str(value) == "":
            raise ValueError("must not be empty")
        return Path(value).expanduser()
    return value


def unlimited_or_positive(value: int) -> int:
    if value == 0 or value < -1:
        raise ValueError("must be -1 (unlimited) or at least 1")
    return value


def off_or_positive(value: float) -> float:
    if value != -1 and value <= 0:
        raise ValueError("must be -1 (off) or greater than 0")
    return value


def _upper(value: object) -> object:
    return value.strip().upper() if isinstance(value, str) else value


def check_queue_prefix(value: str) -> str:
    if any(c in value for c in "*#?"):
        raise ValueError("must not contain '*', '#' or '?'")
    return value


def check_zookeeper(text: str) -> str:
    """``host:port[,host:port...]`` (empty = no ZooKeeper); whitespace around items ok."""
    if not text.strip():
        return ""
    items = [item.strip() for item in text.split(",")]
    for item in items:
        try:
            parse_listener(item)
        except ValueError:
            raise ValueError(
                f"{item!r} is not host:port; give the ZooKeeper servers as "
                "'host:port,host:port', e.g. 127.0.0.1:2181, or leave it empty for a "
                "static arbiter"
            ) from None
    return ",".join(items)


def check_znode_path(text: str) -> str:
    if text and (not text.startswith("/") or text.endswith("/") or "//" in text):
        raise ValueError(
            "must be an absolute znode path such as /amqbroker/prod (no trailing '/'), "
            "or empty for /amqbroker/default"
        )
    return text


Listener = Annotated[str, AfterValidator(_check_listener)]
Host = Annotated[str, AfterValidator(_check_host)]
UserName = Annotated[str, Field(min_length=1)]
PasswordHash = Annotated[str, AfterValidator(_check_password_hash)]
LogLevel = Annotated[Literal["DEBUG", "INFO", "WARNING", "ERROR"], BeforeValidator(_log_level)]
SlowConsumerPolicy = Annotated[Literal["NOTIFY", "KILL"], BeforeValidator(_upper)]


class AddressConfig(BaseModel):
    """An address created at start-up (one ``[[addresses]]`` entry)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: Annotated[str, AfterValidator(check_address_name)]
    routing: Routing
    durable: bool = True


_PEER_RE: Final = re.compile(r"^([A-Za-z0-9_-]+)=(.+)$")
_PEER_USAGE: Final = (
    "must look like 'node2=127.0.0.1:5673' (id=host:port), or for a node run as a "
    "primary/backup pair 'node2=127.0.0.1:5673|127.0.0.1:6673' (id=host:port|host:port: "
    "the addresses of its members, tried in turn)"
)


def parse_peer(text: str) -> tuple[str, tuple[tuple[str, int], ...]]:
    """`id=host:port[|host:port...]` -> (id, ((host, port), ...)).

    Several addresses name the members of a primary/backup pair (issue 23): only the
    live member listens, so the link tries them in turn until one opens."""
    m = _PEER_RE.match(text.strip())
    if m is None:
        raise ValueError(f"cluster peer {text!r} {_PEER_USAGE}")
    addresses: list[tuple[str, int]] = []
    for item in m.group(2).split("|"):
        try:
            host, port = parse_listener(item.strip())
        except ValueError:
            raise ValueError(f"cluster peer {text!r} {_PEER_USAGE}") from None
        if port == 0:
            raise ValueError(f"cluster peer {text!r}: the port of {item.strip()!r} must not be 0")
        if (host, port) in addresses:
            raise ValueError(f"cluster peer {text!r} names {item.strip()!r} twice")
        addresses.append((host, port))
    return m.group(1), tuple(addresses)


def check_cluster_peer(text: str) -> str:
    parse_peer(text)
    return text


_NODE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def check_node_id(value: str) -> str:
    if value and not _NODE_ID.fullmatch(value):
        raise ValueError(
            "must be 1 to 64 letters, digits, '.', '_' or '-', starting with a letter or "
            "digit (it names a directory), or empty for <hostname>-<port>"
        )
    return value
