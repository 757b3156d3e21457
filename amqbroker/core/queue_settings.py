"""Every queue setting, declared once: the table the other shapes are derived from.

A queue setting is a value a `Queue` behaves by (`QueuePolicy`) that an operator sets
per address pattern in ``address_settings``. Some are also *queue options*: given per
queue in an address string (``orders?group-buckets=1024``), as a management attribute
(``groupBuckets`` in CREATE/UPDATE/READ of a queue) and as a CLI flag
(``amqbroker queue create --group-buckets``); for those the address setting is the
default (``default_group_buckets``) and the option overrides it for one queue.

One row of `QUEUE_SETTINGS` declares all of that. Derived from it:

- `amqbroker.core.address_settings`: the fields of `ResolvedAddressSettings` (and so
  of `AddressSettings`), `QueueOptions` and `QueueConfig`, the address-string parser's
  keys and checks, and `queue_config` (options over address defaults);
- `Broker._policy`: the `QueuePolicy` of a queue (``QueueConfig`` field by field);
- the management queue entity (`QUEUE_OPTIONS`, the attributes READ returns);
- the CLI's ``queue create``/``queue update`` flags;
- the comments of ``config/amqbroker.toml`` (`example_config_block`;
  ``scripts/sync_queue_settings.py`` rewrites them, a unit test checks them).

Adding a queue setting: one row here, a field of the same name on `QueuePolicy`
(``core/queue.py``; a unit test checks that they agree), the code that reads it, then
run ``scripts/sync_queue_settings.py`` (the example config) and, for a queue option,
add its row to the README's option table (a unit test checks that too).

Only the stdlib is imported here: the CLI imports this table at start-up.
"""

from __future__ import annotations

import json
import re
import textwrap
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Literal

if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = [
    "BOOL",
    "COUNT",
    "GROUP_BUCKETS",
    "GROUP_OWNER_POLICIES",
    "MAX_DELIVERY_ATTEMPTS",
    "MILLIS",
    "MILLIS_OR_FOREVER",
    "OPTIONS",
    "OWNER_POLICY",
    "PROPERTY_NAME",
    "QUEUE_SETTINGS",
    "SETTINGS_BY_NAME",
    "QueueSetting",
    "ValueType",
    "example_config_block",
    "sync_example_config",
    "toml_value",
]

Value = bool | int | str | None


@dataclass(frozen=True)
class ValueType:
    """How a setting's value is written and checked. `amqbroker.core.address_settings`
    maps each one to its pydantic type (the validation of the config file and of the
    models); the address-string parser uses `kind`, `minimum` and `allowed`."""

    kind: Literal["bool", "int", "str", "choice"]
    #: what the value must be, as the address-string parser's errors say it
    allowed: str
    #: smallest value the address-string parser accepts (kind "int")
    minimum: int = 0
    #: the accepted values (kind "choice")
    choices: tuple[str, ...] = ()
    #: None is a value (unset); in ``address_settings`` "" means "explicitly none"
    nullable: bool = False


GROUP_OWNER_POLICIES: Final = ("round-robin", "least-loaded")

BOOL: Final = ValueType("bool", "true, false, 1 or 0")
COUNT: Final = ValueType("int", "a whole number >= 0")
MILLIS: Final = ValueType("int", "milliseconds >= 0")
MILLIS_OR_FOREVER: Final = ValueType("int", "milliseconds >= 0, or -1 to wait forever", -1)
GROUP_BUCKETS: Final = ValueType(
    "int", "-1 (one entry per group), 0 (grouping off) or N >= 1 buckets", -1
)
MAX_DELIVERY_ATTEMPTS: Final = ValueType("int", "-1 (unlimited) or at least 1", -1)
PROPERTY_NAME: Final = ValueType("str", "a non-empty message property name", nullable=True)
OWNER_POLICY: Final = ValueType(
    "choice", " or ".join(json.dumps(c) for c in GROUP_OWNER_POLICIES), choices=GROUP_OWNER_POLICIES
)


@dataclass(frozen=True)
class QueueSetting:
    """One queue setting. `name` is its field on `QueuePolicy`, `QueueConfig` and (for
    an option) `QueueOptions`, and the key queue options are persisted under."""

    name: str
    type: ValueType
    #: the built-in default (what `ResolvedAddressSettings` has when nothing sets it)
    default: Value
    #: what it does, for the example config and the CLI's help
    doc: str
    #: its key in ``address_settings`` (snake_case; the kebab-case form is accepted too)
    address_setting: str
    #: a queue option: its address-string key (kebab-case; snake_case accepted too)
    option: str | None = None
    #: more address-string keys for the option (the ActiveMQ Classic spellings)
    option_aliases: tuple[str, ...] = ()
    #: a queue option: its management attribute (camelCase)
    attribute: str | None = None
    #: a queue option: its ``amqbroker queue create|update`` flag (a bool gets --no-)
    cli_flag: str | None = None
    #: the example config shows this value when the default is None
    example: Value = None


QUEUE_SETTINGS: Final[tuple[QueueSetting, ...]] = (
    # -- queue options: set per queue in an address string, management or the CLI
    QueueSetting(
        "group_buckets",
        GROUP_BUCKETS,
        -1,
        "Group table size: -1 = one entry per group id, 0 = grouping off, N >= 1 = group "
        "ids are hashed into N buckets (Artemis-compatible hashing).",
        address_setting="default_group_buckets",
        option="group-buckets",
        attribute="groupBuckets",
        cli_flag="--group-buckets",
    ),
    QueueSetting(
        "group_rebalance",
        BOOL,
        False,
        "Rebalance groups across consumers when a consumer is added.",
        address_setting="default_group_rebalance",
        option="group-rebalance",
        attribute="groupRebalance",
        cli_flag="--group-rebalance",
    ),
    QueueSetting(
        "group_rebalance_pause_dispatch",
        BOOL,
        False,
        "Pause dispatch while a rebalance waits for in-flight messages.",
        address_setting="default_group_rebalance_pause_dispatch",
        option="group-rebalance-pause-dispatch",
        attribute="groupRebalancePauseDispatch",
        cli_flag="--group-rebalance-pause-dispatch",
    ),
    QueueSetting(
        "group_first_key",
        PROPERTY_NAME,
        None,
        "Message property set to true on the first message of a group sent to a consumer.",
        address_setting="default_group_first_key",
        option="group-first-key",
        attribute="groupFirstKey",
        cli_flag="--group-first-key",
        example="JMSXGroupFirstForConsumer",
    ),
    QueueSetting(
        "exclusive",
        BOOL,
        False,
        "Exclusive queues: every message goes to one consumer at a time.",
        address_setting="default_exclusive_queue",
        option="exclusive",
        attribute="exclusive",
        cli_flag="--exclusive",
    ),
    QueueSetting(
        "consumers_before_dispatch",
        COUNT,
        0,
        "Consumers a queue waits for before it starts dispatching (0 = do not wait). >= 0.",
        address_setting="default_consumers_before_dispatch",
        option="consumers-before-dispatch",
        option_aliases=("consumersBeforeDispatchStarts",),
        attribute="consumersBeforeDispatch",
        cli_flag="--consumers-before-dispatch",
    ),
    QueueSetting(
        "delay_before_dispatch",
        MILLIS_OR_FOREVER,
        -1,
        "Milliseconds a queue waits for its consumers_before_dispatch consumers before it "
        "dispatches anyway; -1 = wait forever.",
        address_setting="default_delay_before_dispatch",
        option="delay-before-dispatch",
        option_aliases=("timeBeforeDispatchStarts",),
        attribute="delayBeforeDispatch",
        cli_flag="--delay-before-dispatch",
    ),
    # -- set per address pattern only
    QueueSetting(
        "group_skip_ahead",
        BOOL,
        True,
        "Let messages of other groups overtake a group whose owner cannot take more right "
        "now; false reproduces Artemis's strict head-of-line behaviour.",
        address_setting="group_skip_ahead",
    ),
    QueueSetting(
        "group_id_from_application_properties",
        BOOL,
        True,
        "Also take the group id from the JMSXGroupID application property when the "
        "properties.group-id field is not set.",
        address_setting="group_id_from_application_properties",
    ),
    QueueSetting(
        "group_owner_policy",
        OWNER_POLICY,
        "round-robin",
        'How a new group picks its consumer: "round-robin" or "least-loaded" (the '
        "consumer owning the fewest groups).",
        address_setting="group_owner_policy",
    ),
    QueueSetting(
        "group_unbind_on_undeliverable",
        BOOL,
        False,
        "Unbind a group from its consumer when a message of the group cannot be "
        "delivered to that consumer, so another consumer may take the group over.",
        address_setting="group_unbind_on_undeliverable",
    ),
    QueueSetting(
        "group_pause_dispatch_timeout",
        MILLIS_OR_FOREVER,
        -1,
        "Milliseconds dispatch may stay paused for a rebalance before it resumes anyway; "
        "-1 = no limit.",
        address_setting="group_pause_dispatch_timeout",
    ),
    QueueSetting(
        "max_delivery_attempts",
        MAX_DELIVERY_ATTEMPTS,
        10,
        "Deliveries of a message before it is moved to dead_letter_address (or dropped "
        "if there is none). -1 = unlimited, else >= 1.",
        address_setting="max_delivery_attempts",
    ),
    QueueSetting(
        "redelivery_delay",
        MILLIS,
        0,
        "Milliseconds a released or modified message waits before it is redelivered. "
        "0..2147483647.",
        address_setting="redelivery_delay",
    ),
)

SETTINGS_BY_NAME: Final[Mapping[str, QueueSetting]] = {s.name: s for s in QUEUE_SETTINGS}
#: the queue options (address string, management attribute, CLI flag), in table order
OPTIONS: Final[tuple[QueueSetting, ...]] = tuple(s for s in QUEUE_SETTINGS if s.option)


def toml_value(value: Value) -> str:
    """`value` as TOML writes it (a None value has no TOML form: "none")."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return str(value)


def example_config_block(setting: QueueSetting, width: int = 87) -> list[str]:
    """The lines that document `setting` in ``config/amqbroker.toml``: its doc and
    default as comments, then the key commented out at its default (or example)."""
    default = toml_value(setting.default)
    if setting.default is None and setting.example is not None:
        text, shown = f"{setting.doc} Default: none. Example:", toml_value(setting.example)
    else:
        text, shown = f"{setting.doc} Default: {default}", default
    # "-1 = no limit" stays on one line: textwrap does not break at a no-break space
    text = text.replace(" = ", _NBSP + "=" + _NBSP)
    lines = textwrap.wrap(text, width - 2, break_on_hyphens=False, break_long_words=False)
    return [
        *(f"# {line}".replace(_NBSP, " ") for line in lines),
        f"# {setting.address_setting} = {shown}",
    ]


_NBSP: Final = "\N{NO-BREAK SPACE}"


def _block_span(lines: list[str], key: str) -> tuple[int, int] | None:
    """Where the block documenting `key` is in `lines` (start, end), or None: the
    ``# key = value`` line and the prose comment lines right above it."""
    found = [i for i, line in enumerate(lines) if re.match(rf"# {re.escape(key)} = ", line)]
    if len(found) > 1:
        raise ValueError(f"the example config documents {key} {len(found)} times")
    if not found:
        return None
    start = found[0]
    while start > 0 and _prose(lines[start - 1]):
        start -= 1
    return start, found[0] + 1


def _prose(line: str) -> bool:
    # not a section heading ("# -- ..."), an indented example or another key
    return (
        line.startswith("# ")
        and not line.startswith(("# --", "#  "))
        and not re.match(r"# [a-z_]+ = ", line)
    )


def sync_example_config(text: str) -> str:
    """`text` (``config/amqbroker.toml``) with each queue setting's block as
    `example_config_block` writes it; a setting it lacks is added after the block of
    the setting before it in `QUEUE_SETTINGS` (``scripts/sync_queue_settings.py``)."""
    lines = text.split("\n")
    for i, setting in enumerate(QUEUE_SETTINGS):
        span = _block_span(lines, setting.address_setting)
        if span is None:
            before = _block_span(lines, QUEUE_SETTINGS[i - 1].address_setting) if i else None
            if before is None:
                raise ValueError(f"no place for {setting.address_setting} in the example")
            span = (before[1], before[1])
        lines[span[0] : span[1]] = example_config_block(setting)
    return "\n".join(lines)
