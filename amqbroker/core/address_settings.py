"""Per-address policy: the settings model, wildcard matching, and address-string options.

What this module owns
---------------------
- `AddressSettings`: one entry of the ``address_settings`` table, keyed by an address
  *pattern*. Every field is optional: ``None`` means "not set here, inherit from a less
  specific matching pattern". Input accepts the snake_case field names and the Artemis
  kebab-case names (``max-delivery-attempts``; ``default-address-routing-type`` is also
  accepted for ``default_routing_type``). For ``dead_letter_address``,
  ``expiry_address`` and ``default_group_first_key`` an empty string means "explicitly
  none" (it stops a less specific pattern's value from applying).
- `ResolvedAddressSettings`: every field has a value; its defaults are the broker's
  built-in defaults.
- `AddressSettingsRepository`: resolves an address to its `ResolvedAddressSettings` by
  merging every matching pattern, with a bounded LRU cache.
- `parse_address_options`: splits Artemis-style queue options off an address string
  (``orders?group-buckets=1024&group-rebalance=true``) into `QueueOptions`
  (`parse_client_address`: the same, a bad option being the client's InvalidField);
  `queue_config` combines them with the resolved address settings into a `QueueConfig`.

Where the fields come from
--------------------------
The queue settings (grouping, dispatch, delivery attempts) are declared once, in
`amqbroker.core.queue_settings.QUEUE_SETTINGS`; the fields of
`ResolvedAddressSettings` for them, `QueueOptions` (the rows that are queue options)
and `QueueConfig` (every row) are generated from that table, and `_VALUE_TYPES` gives
each value type its pydantic type. `ResolvedAddressSettings` declares the address's
own settings (auto-creation, routing, dead letters, capacity, duplicate detection);
`AddressSettings` has the same fields, each optional, derived from it. Static code
reads queue settings from `QueuePolicy` (typed), not from these models.

Wildcards (Artemis syntax)
--------------------------
An address is a sequence of words separated by ``.``. In a pattern, the word ``*``
matches exactly one word and the word ``#`` matches zero or more words, so
``orders.#`` matches ``orders``, ``orders.eu`` and ``orders.eu.paris``, and ``#``
matches every address. Wildcards must be whole words (``ord*`` is rejected), words
must not be empty (``a..b``), and ``?`` is not allowed in a pattern.

Specificity and merging
-----------------------
All patterns matching an address are ordered from most to least specific:

1. an exact (wildcard-free) pattern beats every wildcard pattern;
2. then more literal (non-wildcard) words win;
3. then fewer ``#`` words win;
4. then fewer ``*`` words win;
5. then the longer pattern string wins;
6. remaining ties go to the pattern string that sorts first (deterministic).

So for ``orders.eu``: ``orders.eu`` > ``orders.*`` > ``orders.#`` > ``#``, and
``a.*.c`` beats ``a.#`` for ``a.b.c``. Each field takes its value from the most specific
matching pattern that sets it; fields no matching pattern sets get the built-in
default (`ResolvedAddressSettings`).

Address options
---------------
Recognised keys (kebab-case or snake_case, case-insensitive): the ``option`` of each
queue option in `QUEUE_SETTINGS` (group-buckets, group-rebalance,
group-rebalance-pause-dispatch, group-first-key, exclusive, consumers-before-dispatch,
delay-before-dispatch), plus its ActiveMQ Classic aliases consumersBeforeDispatchStarts
(= consumers-before-dispatch) and timeBeforeDispatchStarts (= delay-before-dispatch).
Keys and values are percent-decoded. Booleans are true/false/1/0 (case-insensitive).
Decision D10: when the Classic alias consumersBeforeDispatchStarts is given a value > 0
and no delay is given, Classic's implicit delay of 1000 ms applies. Options given in the
address override the address-setting defaults (``default_group_buckets`` and so on).

Only pydantic, the stdlib and the queue settings table are imported here.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Annotated, Any, Final, Literal, NamedTuple
from urllib.parse import unquote

from pydantic import (
    AfterValidator,
    AliasChoices,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    create_model,
)

from amqbroker.core.errors import InvalidField
from amqbroker.core.queue_settings import (
    BOOL,
    COUNT,
    GROUP_BUCKETS,
    MAX_DELIVERY_ATTEMPTS,
    MILLIS,
    MILLIS_OR_FOREVER,
    OPTIONS,
    OWNER_POLICY,
    PROPERTY_NAME,
    QUEUE_SETTINGS,
    SETTINGS_BY_NAME,
    ValueType,
)

if TYPE_CHECKING:
    from collections.abc import Mapping

    from pydantic.fields import FieldInfo

__all__ = [
    "DEFAULT_CACHE_SIZE",
    "QUEUE_OPTION_KEYS",
    "TABLE_ENTRY_CONFIG",
    "AddressName",
    "AddressPattern",
    "AddressSettings",
    "AddressSettingsRepository",
    "CacheInfo",
    "ConfigFloat",
    "ConfigInt",
    "QueueConfig",
    "QueueOptions",
    "ResolvedAddressSettings",
    "Routing",
    "check_address_name",
    "check_pattern",
    "ordered_patterns",
    "parse_address_options",
    "parse_client_address",
    "pattern_matches",
    "queue_config",
    "specificity",
]

DEFAULT_CACHE_SIZE: Final = 4096
INT32_MAX: Final = 2**31 - 1
CLASSIC_IMPLICIT_DELAY_MS: Final = 1000  # decision D10

RoutingType = Literal["anycast", "multicast"]
AddressFullPolicy = Literal["BLOCK", "FAIL", "PAGE"]
GroupOwnerPolicy = Literal["round-robin", "least-loaded"]


# --------------------------------------------------------------------------- validators


def _not_bool(value: object) -> object:
    """Pydantic's lax mode takes true/false as 1/0 for numbers; a config file should not."""
    if isinstance(value, bool):
        raise ValueError("must be a number, not true/false")
    return value


def _minus_one_or_at_least_one(value: int) -> int:
    if value == 0 or value < -1:
        raise ValueError("must be -1 (unlimited) or at least 1")
    return value


def _at_least_minus_one(value: int) -> int:
    if value < -1:
        raise ValueError("must be -1 or at least 0")
    return value


def _lower(value: object) -> object:
    return value.strip().lower() if isinstance(value, str) else value


def _owner_policy(value: object) -> object:
    return value.strip().lower().replace("_", "-") if isinstance(value, str) else value


def _full_policy(value: object) -> object:
    if isinstance(value, str):
        value = value.strip().upper()
        if value == "DROP":
            raise ValueError("DROP is not supported by amqbroker; use BLOCK, FAIL or PAGE")
    return value


def _address_name(value: str | None) -> str | None:
    if value is not None and any(c in value for c in "*#?"):
        raise ValueError("must be a plain address name (no '*', '#' or '?')")
    return value


def check_address_name(name: str) -> str:
    """Return `name` if it can name a concrete address (non-empty, no wildcards or '?')."""
    if not name:
        raise ValueError("must not be empty")
    _address_name(name)
    return name


#: an int that refuses true/false (shared with amqbroker.settings)
ConfigInt = Annotated[int, BeforeValidator(_not_bool)]
#: a finite float that refuses true/false (shared with amqbroker.settings)
ConfigFloat = Annotated[float, BeforeValidator(_not_bool), Field(allow_inf_nan=False)]
MaxDeliveryAttempts = Annotated[ConfigInt, AfterValidator(_minus_one_or_at_least_one)]
SizeBytes = Annotated[ConfigInt, AfterValidator(_minus_one_or_at_least_one)]
Millis = Annotated[ConfigInt, Field(ge=0, le=INT32_MAX)]
MillisOrForever = Annotated[ConfigInt, Field(le=INT32_MAX), AfterValidator(_at_least_minus_one)]
GroupBuckets = Annotated[ConfigInt, Field(le=INT32_MAX), AfterValidator(_at_least_minus_one)]
Count = Annotated[ConfigInt, Field(ge=0, le=INT32_MAX)]
Routing = Annotated[RoutingType, BeforeValidator(_lower)]
FullPolicy = Annotated[AddressFullPolicy, BeforeValidator(_full_policy)]
OwnerPolicy = Annotated[GroupOwnerPolicy, BeforeValidator(_owner_policy)]
#: a concrete address name: no wildcards, no "?options"
AddressName = Annotated[str, AfterValidator(_address_name)]

#: the pydantic type of each value type of the queue settings table
_VALUE_TYPES: Final[dict[ValueType, Any]] = {
    BOOL: bool,
    COUNT: Count,
    MILLIS: Millis,
    MILLIS_OR_FOREVER: MillisOrForever,
    GROUP_BUCKETS: GroupBuckets,
    MAX_DELIVERY_ATTEMPTS: MaxDeliveryAttempts,
    PROPERTY_NAME: str,
    OWNER_POLICY: OwnerPolicy,
}


def _kebab(name: str) -> str:
    return name.replace("_", "-")


#: the model config of a config-file table entry (`AddressSettings`, the authorizer's
#: `SecurityRule`): immutable, unknown keys an error, snake_case or kebab-case keys
TABLE_ENTRY_CONFIG: Final = ConfigDict(
    frozen=True,
    extra="forbid",
    alias_generator=_kebab,
    validate_by_name=True,
    validate_by_alias=True,
)


# ----------------------------------------------------------------------------- models


def _annotation(value_type: ValueType) -> Any:
    """The pydantic type of a queue setting's value (`QUEUE_SETTINGS`)."""
    annotation = _VALUE_TYPES[value_type]
    return annotation | None if value_type.nullable else annotation


_FROZEN: Final = ConfigDict(frozen=True, extra="forbid")


class _AddressOwnSettings(BaseModel):
    """The settings of an address that are not queue settings, with their defaults."""

    model_config = _FROZEN

    auto_create_addresses: bool = True
    auto_create_queues: bool = True
    #: delete an auto-created queue once it has no consumers and no messages
    auto_delete_queues: bool = True
    default_routing_type: Routing = "anycast"
    default_queue_durable: bool = True
    dead_letter_address: AddressName | None = None
    expiry_address: AddressName | None = None
    #: bytes of messages the address may hold; -1 = unlimited
    max_size_bytes: SizeBytes = -1
    #: BLOCK: no producer credit while full; FAIL: reject; PAGE: page to disk
    address_full_policy: FullPolicy = "BLOCK"
    #: recent duplicate ids (message-id, or _AMQ_DUPL_ID) remembered per address;
    #: a message whose id is among them is accepted and dropped. 0 = off
    duplicate_detection_window: Count = 0


if TYPE_CHECKING:
    # the queue settings' fields are generated: static code reads them through
    # QueuePolicy (or getattr with a table row), not through these models
    _ResolvedFields = _AddressOwnSettings
else:
    _ResolvedFields = create_model(
        "_ResolvedFields",
        __base__=_AddressOwnSettings,
        __module__=__name__,
        **{
            s.address_setting: (_annotation(s.type), Field(default=s.default, description=s.doc))
            for s in QUEUE_SETTINGS
        },
    )


class ResolvedAddressSettings(_ResolvedFields):
    """The policy for one address with every field decided (built-in defaults here):
    the address's own settings (`_AddressOwnSettings`), then one field per queue
    setting (`amqbroker.core.queue_settings.QUEUE_SETTINGS`: grouping, dispatch,
    max_delivery_attempts, redelivery_delay) under its ``address_setting`` key, with
    the table's default."""

    model_config = _FROZEN


#: fields where "" on input means "explicitly none" (resolved to None)
_CLEARABLE: Final = frozenset(
    {"dead_letter_address", "expiry_address"}
    | {s.address_setting for s in QUEUE_SETTINGS if s.type.nullable}
)
#: input names accepted besides the field name and its kebab-case form
_MORE_ALIASES: Final = {"default_routing_type": ("default-address-routing-type",)}


def _unset(name: str, info: FieldInfo) -> tuple[Any, Any]:
    """`AddressSettings`'s field for `ResolvedAddressSettings`'s `name`: optional."""
    extra = _MORE_ALIASES.get(name, ())
    alias = AliasChoices(name, _kebab(name), *extra) if extra else None
    field = Field(default=None, validation_alias=alias, description=info.description)
    return (info.rebuild_annotation() | None, field)


if TYPE_CHECKING:
    _AddressSettingFields = BaseModel
else:
    _AddressSettingFields = create_model(
        "_AddressSettingFields",
        __config__=TABLE_ENTRY_CONFIG,
        __module__=__name__,
        **{n: _unset(n, i) for n, i in ResolvedAddressSettings.model_fields.items()},
    )


class AddressSettings(_AddressSettingFields):
    """One ``address_settings`` entry; ``None`` = inherit from a less specific pattern.

    Its fields are those of `ResolvedAddressSettings`, each optional (derived, not
    declared again). Accepts snake_case and Artemis kebab-case keys
    (``default-address-routing-type`` too); unknown keys are an error.
    """

    model_config = TABLE_ENTRY_CONFIG

    def set_fields(self) -> dict[str, object]:
        """The fields this entry sets (not None), by field name."""
        return self.model_dump(exclude_none=True)


# ---------------------------------------------------------------------------- matching


def check_pattern(pattern: str) -> str:
    """Return `pattern` if it is a valid address pattern, else raise ValueError naming it."""

    def bad(problem: str) -> ValueError:
        return ValueError(f"invalid address pattern {pattern!r}: {problem}")

    if not isinstance(pattern, str):
        raise TypeError(f"address pattern must be a string, got {type(pattern).__name__}")
    if not pattern:
        raise bad("it is empty (use '#' to match every address)")
    if "?" in pattern:
        raise bad("'?' is not allowed (queue options belong in an address, not a pattern)")
    for word in pattern.split("."):
        if not word:
            raise bad("empty word (check for '..' or a leading/trailing '.')")
        if word not in ("*", "#") and ("*" in word or "#" in word):
            raise bad(
                f"wildcards must be whole words, got {word!r} "
                "('*' matches one word, '#' zero or more, words separated by '.')"
            )
    return pattern


#: a key of the address_settings table (validated by check_pattern)
AddressPattern = Annotated[str, AfterValidator(check_pattern)]


def _match_words(pattern: tuple[str, ...], words: tuple[str, ...]) -> bool:
    # reachable[j]: the first i pattern words can match the first j address words
    reachable = [True] + [False] * len(words)
    for pword in pattern:
        if pword == "#":
            for j in range(1, len(reachable)):
                reachable[j] = reachable[j] or reachable[j - 1]
        else:
            for j in range(len(reachable) - 1, 0, -1):
                reachable[j] = reachable[j - 1] and (pword in ("*", words[j - 1]))
            reachable[0] = False
    return reachable[-1]


def pattern_matches(pattern: str, address: str) -> bool:
    """True when `pattern` (Artemis wildcard syntax) matches `address`."""
    return _match_words(tuple(pattern.split(".")), tuple(address.split(".")))


def specificity(pattern: str) -> tuple[int, int, int, int, int]:
    """(exact, literal words, -#, -*, length): a greater tuple is a more specific pattern."""
    words = pattern.split(".")
    hashes = words.count("#")
    stars = words.count("*")
    literal = len(words) - hashes - stars
    exact = 1 if hashes == 0 and stars == 0 else 0
    return (exact, literal, -hashes, -stars, len(pattern))


def _precedence(pattern: str) -> tuple[int, int, int, int, int, str]:
    """Ascending sort key: most specific first; equal specificity: smaller string first."""
    exact, literal, neg_hashes, neg_stars, length = specificity(pattern)
    return (-exact, -literal, -neg_hashes, -neg_stars, -length, pattern)


def ordered_patterns(table: Mapping[str, object], entry_type: type, kind: str) -> list[str]:
    """The patterns of `table`, most specific first (equal specificity: smaller string
    first), after checking each (ValueError) and that its entry is an `entry_type`
    (TypeError naming the `kind` of pattern)."""
    for pattern, entry in table.items():
        check_pattern(pattern)
        if not isinstance(entry, entry_type):
            raise TypeError(
                f"{kind} pattern {pattern!r}: expected {entry_type.__name__}, "
                f"got {type(entry).__name__}"
            )
    return sorted(table, key=_precedence)


class CacheInfo(NamedTuple):
    hits: int
    misses: int
    maxsize: int
    currsize: int


class AddressSettingsRepository:
    """Resolves addresses against an immutable table of pattern -> AddressSettings.

    Results are cached in an LRU of at most `cache_size` addresses (0 disables the
    cache). The table never changes after construction; build a new repository to
    apply new settings.
    """

    def __init__(
        self, patterns: Mapping[str, AddressSettings], cache_size: int = DEFAULT_CACHE_SIZE
    ) -> None:
        if cache_size < 0:
            raise ValueError(f"cache_size must be >= 0, got {cache_size}")
        ordered = ordered_patterns(patterns, AddressSettings, "address")
        self._patterns: tuple[tuple[str, tuple[str, ...], dict[str, object]], ...] = tuple(
            (p, tuple(p.split(".")), patterns[p].set_fields()) for p in ordered
        )
        self._cache_size = cache_size
        self._cache: OrderedDict[str, ResolvedAddressSettings] = OrderedDict()
        self._hits = 0
        self._misses = 0

    @property
    def patterns(self) -> list[str]:
        """All patterns, most specific first."""
        return [p for p, _, _ in self._patterns]

    def matching(self, address: str) -> list[str]:
        """The patterns matching `address`, most specific (highest precedence) first."""
        words = tuple(address.split("."))
        return [p for p, pwords, _ in self._patterns if _match_words(pwords, words)]

    def resolve(self, address: str) -> ResolvedAddressSettings:
        """The merged settings for `address` (a name without "?options").

        See the module docstring for the matching and merging rules.
        """
        cached = self._cache.get(address)
        if cached is not None:
            self._hits += 1
            self._cache.move_to_end(address)
            return cached
        self._misses += 1
        words = tuple(address.split("."))
        merged: dict[str, object] = {}
        for _, pwords, values in self._patterns:
            if _match_words(pwords, words):
                for name, value in values.items():
                    merged.setdefault(name, value)
        for name in _CLEARABLE:
            if merged.get(name) == "":
                merged[name] = None
        resolved = ResolvedAddressSettings.model_validate(merged)
        if self._cache_size:
            self._cache[address] = resolved
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return resolved

    def cache_info(self) -> CacheInfo:
        return CacheInfo(self._hits, self._misses, self._cache_size, len(self._cache))


# ----------------------------------------------------------------------- address options


if TYPE_CHECKING:
    _QueueOptionFields = BaseModel
    _QueueConfigFields = BaseModel
else:
    _QueueOptionFields = create_model(
        "_QueueOptionFields",
        __config__=_FROZEN,
        __module__=__name__,
        **{s.name: (_annotation(s.type) | None, None) for s in OPTIONS},
    )
    _QueueConfigFields = create_model(
        "_QueueConfigFields",
        __config__=_FROZEN,
        __module__=__name__,
        **{s.name: (_annotation(s.type), s.default) for s in QUEUE_SETTINGS},
    )


class QueueOptions(_QueueOptionFields):
    """Queue options given in an address string; None = not given. One field per
    queue option of `QUEUE_SETTINGS` (``group_buckets``, ``exclusive``, ...)."""

    model_config = _FROZEN


class QueueConfig(_QueueConfigFields):
    """A queue's settings with every field decided (`queue_config`): one field per
    row of `QUEUE_SETTINGS`, by its name, what `QueuePolicy` is built from."""

    model_config = _FROZEN


_CLASSIC_CONSUMERS: Final = "consumersBeforeDispatchStarts"
#: every key parse_address_options accepts, as documented (case-insensitive on input)
QUEUE_OPTION_KEYS: Final = (
    *(s.option for s in OPTIONS if s.option),
    *(alias for s in OPTIONS for alias in s.option_aliases),
)

_KEY_TO_FIELD: Final[dict[str, str]] = {
    key.lower(): s.name for s in OPTIONS for key in (s.option or s.name, s.name, *s.option_aliases)
}
_BOOLS: Final = {"true": True, "1": True, "false": False, "0": False}


def _valid_keys_text() -> str:
    aliases = [alias for s in OPTIONS for alias in s.option_aliases]
    return (
        "valid keys: "
        + ", ".join(s.option for s in OPTIONS if s.option)
        + " (snake_case also accepted), and the ActiveMQ Classic aliases "
        + " and ".join(aliases)
    )


def parse_client_address(address: str) -> tuple[str, QueueOptions]:
    """`parse_address_options` for an address a client gave: a bad option is the
    client's error (InvalidField)."""
    try:
        return parse_address_options(address)
    except ValueError as exc:
        raise InvalidField(f"bad address {address!r}: {exc}") from exc


def parse_address_options(address: str) -> tuple[str, QueueOptions]:
    """Split ``name?key=value&...`` into the address name and its `QueueOptions`.

    An address without ``?`` is returned unchanged with empty options. Raises
    ValueError naming the offending key and value (and listing the valid keys) for an
    unknown key, a malformed or repeated option, or a bad value.
    """
    name, sep, query = address.partition("?")
    if not sep:
        return address, QueueOptions()
    if not name:
        raise ValueError(f"address {address!r} has no name before '?'")
    values: dict[str, object] = {}
    given_as: dict[str, str] = {}
    for part in query.split("&"):
        if not part:
            continue
        raw_key, eq, raw_value = part.partition("=")
        key, value = unquote(raw_key).strip(), unquote(raw_value).strip()
        if not eq:
            raise ValueError(
                f"queue option {key!r} in address {address!r} has no value "
                f"(expected key=value); {_valid_keys_text()}"
            )
        field = _KEY_TO_FIELD.get(key.lower())
        if field is None:
            raise ValueError(
                f"unknown queue option {key!r} (= {value!r}) in address {address!r}; "
                f"{_valid_keys_text()}"
            )
        if field in values:
            raise ValueError(
                f"queue option {key!r} (= {value!r}) in address {address!r} repeats "
                f"{given_as[field]!r}; give each option once"
            )
        values[field] = _option_value(address, key, field, value)
        given_as[field] = key
    if (
        given_as.get("consumers_before_dispatch", "").lower() == _CLASSIC_CONSUMERS.lower()
        and "delay_before_dispatch" not in values
        and isinstance(values["consumers_before_dispatch"], int)
        and values["consumers_before_dispatch"] > 0
    ):
        values["delay_before_dispatch"] = CLASSIC_IMPLICIT_DELAY_MS  # decision D10
    return name, QueueOptions.model_validate(values)


def _option_value(address: str, key: str, field: str, value: str) -> object:
    value_type = SETTINGS_BY_NAME[field].type

    def bad(allowed: str) -> ValueError:
        return ValueError(
            f"queue option {key}={value!r} in address {address!r}: must be {allowed}; "
            f"{_valid_keys_text()}"
        )

    if value_type.kind == "bool":
        parsed = _BOOLS.get(value.lower())
        if parsed is None:
            raise bad(value_type.allowed)
        return parsed
    if value_type.kind == "int":
        try:
            number = int(value, 10)
        except ValueError:
            raise bad(value_type.allowed) from None
        if not value_type.minimum <= number <= INT32_MAX:
            raise bad(value_type.allowed + f" (at most {INT32_MAX})")
        return number
    if value_type.kind == "choice":
        choice = value.lower().replace("_", "-")
        if choice not in value_type.choices:
            raise bad(value_type.allowed)
        return choice
    if not value:
        raise bad(value_type.allowed)
    return value


def queue_config(resolved: ResolvedAddressSettings, options: QueueOptions) -> QueueConfig:
    """A queue's settings: address-string `options` override the address defaults,
    the other queue settings are the address's."""
    values: dict[str, object] = {}
    for s in QUEUE_SETTINGS:
        given = getattr(options, s.name) if s.option else None
        values[s.name] = getattr(resolved, s.address_setting) if given is None else given
    return QueueConfig.model_validate(values)
