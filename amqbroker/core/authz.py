"""Authorisation: which user may do what on which address.

Model
-----
Users have *roles* (the ``roles`` setting: user name -> list of role names; the user
of a connection without credentials is ``anonymous``, see `ANONYMOUS_USER`). The
``security`` setting maps an address *pattern* to a `SecurityRule`: for each
permission, the roles that hold it. The permissions (`PERMISSIONS`):

- ``send``: attach a producer to the address, or send to it through the anonymous
  relay (checked per destination);
- ``consume``: attach a consumer (queue, topic subscription, durable or shared
  subscription), and remove a durable subscription (unsubscribe);
- ``browse``: attach a queue browser (distribution-mode copy on a queue);
- ``create_address``: any of the above when the address does not exist yet and would
  be auto-created;
- ``delete_address``: delete an address through management;
- ``manage``: attach to the management node (checked on the address ``$management``).

Matching
--------
Patterns use the address-settings wildcard syntax (`amqbroker.core.address_settings`):
``.`` separates words, ``*`` matches one word, ``#`` zero or more. Unlike address
settings, security rules are **not merged**: the single most specific matching pattern
decides alone, as in Artemis's security-settings (order: an exact name, then more
literal words, then fewer ``#``, then fewer ``*``, then the longer pattern, then the
pattern that sorts first). A permission the deciding rule does not list is held by no
role. When no pattern matches, access is denied. An address given with queue options
(``orders?exclusive=true``) is checked by its name (``orders``).

`Authorizer` with ``enabled=False`` allows everything (the broker's behaviour without
``security_enabled``). Temporary queues and topics (dynamic nodes) need no permission:
they belong to the client that created them; the protocol layer does not ask.

Invariants
----------
- Decisions depend only on (user, permission, address name) and on the rules and
  roles, which never change after construction; so they are cached in an LRU of at
  most `cache_size` entries (0 = no cache) keyed by (user, permission, address).
  Addresses longer than `CACHED_ADDRESS_MAX` characters are decided every time and
  never cached (here or in a relay link's set), and descriptions show at most
  `SHOWN_ADDRESS_MAX` characters of a name: whatever names clients send, a cache
  entry stays small and an error fits in a frame.
- Every denial is an `Unauthorized` (``amqp:unauthorized-access``) whose description
  names the user, the permission, the address, the deciding pattern (or that none
  matched) and what to change in the configuration.

Only pydantic and the stdlib are imported here.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Annotated, Final

from pydantic import BaseModel, Field

from amqbroker.core.address_settings import (
    TABLE_ENTRY_CONFIG,
    CacheInfo,
    ordered_patterns,
    pattern_matches,
)
from amqbroker.core.errors import Unauthorized

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

__all__ = [
    "ANONYMOUS_USER",
    "CACHED_ADDRESS_MAX",
    "DEFAULT_CACHE_SIZE",
    "PERMISSIONS",
    "Authorizer",
    "RoleName",
    "SecurityRule",
]

#: the user of a connection that authenticated with SASL ANONYMOUS (or skipped SASL)
ANONYMOUS_USER: Final = "anonymous"
DEFAULT_CACHE_SIZE: Final = 10_000
#: longer addresses are not cached (see Invariants)
CACHED_ADDRESS_MAX: Final = 255
#: longer names are cut in descriptions
SHOWN_ADDRESS_MAX: Final = 200
PERMISSIONS: Final = ("send", "consume", "browse", "create_address", "delete_address", "manage")

_VERBS: Final = {
    "send": "send to",
    "consume": "consume from",
    "browse": "browse",
    "create_address": "create",
    "delete_address": "delete",
    "manage": "manage",
}

RoleName = Annotated[str, Field(min_length=1)]


class SecurityRule(BaseModel):
    """One ``security`` entry: per permission, the roles that hold it (default: none).

    Keys are snake_case or kebab-case (``create-address``); unknown keys are an error.
    """

    model_config = TABLE_ENTRY_CONFIG

    send: list[RoleName] = Field(default_factory=list)
    consume: list[RoleName] = Field(default_factory=list)
    browse: list[RoleName] = Field(default_factory=list)
    create_address: list[RoleName] = Field(default_factory=list)
    delete_address: list[RoleName] = Field(default_factory=list)
    manage: list[RoleName] = Field(default_factory=list)

    def grants(self) -> dict[str, frozenset[str]]:
        """Permission -> the roles holding it."""
        return {p: frozenset(getattr(self, p)) for p in PERMISSIONS}


def _names(items: Iterable[str]) -> str:
    return ", ".join(sorted(items))


class Authorizer:
    """Decides (user, permission, address) against immutable rules and roles."""

    def __init__(
        self,
        rules: Mapping[str, SecurityRule],
        roles: Mapping[str, Iterable[str]],
        enabled: bool,
        *,
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        if cache_size < 0:
            raise ValueError(f"cache_size must be >= 0, got {cache_size}")
        ordered = ordered_patterns(rules, SecurityRule, "security")
        self.enabled = enabled
        self._rules: tuple[tuple[str, dict[str, frozenset[str]]], ...] = tuple(
            (p, rules[p].grants()) for p in ordered
        )
        self._roles: dict[str, frozenset[str]] = {u: frozenset(r) for u, r in roles.items()}
        self._cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str, str], str | None] = OrderedDict()
        self._hits = 0
        self._misses = 0

    @property
    def patterns(self) -> list[str]:
        """All patterns, most specific first."""
        return [p for p, _ in self._rules]

    def rule_for(self, address: str) -> str | None:
        """The pattern that decides for `address` (the most specific match), or None."""
        name = address.partition("?")[0]
        for pattern, _ in self._rules:
            if pattern_matches(pattern, name):
                return pattern
        return None

    def roles_of(self, user: str) -> frozenset[str]:
        return self._roles.get(user, frozenset())

    def check(self, user: str | None, permission: str, address: str) -> None:
        """Return if `user` holds `permission` on `address`; raise `Unauthorized`
        (amqp:unauthorized-access) with a description saying what to change if not."""
        if not self.enabled:
            return
        denial = self.denial(user, permission, address)
        if denial is not None:
            raise Unauthorized(denial)

    def allowed(self, user: str | None, permission: str, address: str) -> bool:
        return not self.enabled or self.denial(user, permission, address) is None

    def denial(self, user: str | None, permission: str, address: str) -> str | None:
        """None when allowed (or security is off), else the description of the denial."""
        if not self.enabled:
            return None
        if permission not in _VERBS:
            raise ValueError(f"unknown permission {permission!r}; known: {', '.join(PERMISSIONS)}")
        who = user if user is not None else ANONYMOUS_USER
        key = (who, permission, address)
        cache = self._cache
        if key in cache:
            self._hits += 1
            cache.move_to_end(key)
            return cache[key]
        self._misses += 1
        result = self._decide(who, permission, address.partition("?")[0])
        if self._cache_size and len(address) <= CACHED_ADDRESS_MAX:
            cache[key] = result
            if len(cache) > self._cache_size:
                cache.popitem(last=False)
        return result

    def _decide(self, user: str, permission: str, name: str) -> str | None:
        roles = self.roles_of(user)
        for pattern, grants in self._rules:
            if pattern_matches(pattern, name):
                holders = grants[permission]
                if roles & holders:
                    return None
                return self._explain(user, roles, permission, name, pattern, holders)
        return self._explain(user, roles, permission, name, None, frozenset())

    @staticmethod
    def _explain(
        user: str,
        roles: frozenset[str],
        permission: str,
        name: str,
        pattern: str | None,
        holders: frozenset[str],
    ) -> str:
        name = _shown(name)
        user = _shown(user)
        head = f"user {user!r} may not {_VERBS[permission]} address {name!r} ('{permission}')"
        if pattern is None:
            role = sorted(roles)[0] if roles else "<role>"
            fix = (
                f"add a [security] rule matching it that grants '{permission}' to a role "
                f"of {user!r}, e.g. [security.{_toml_key(name)}] {permission} = [{role!r}]"
            )
            if not roles:
                fix += f", and give {user!r} that role in [roles]"
            return f"{head}: security is enabled and no [security] pattern matches it; {fix}"
        granted = f"to roles {_names(holders)}" if holders else "to no role"
        decided = f"the most specific matching [security] pattern {pattern!r} grants it {granted}"
        if roles:
            role = sorted(roles)[0]
            fix = (
                f"grant role {role!r} '{permission}' on {pattern!r} in [security] "
                f"(user {user!r} has roles {_names(roles)})"
            )
        elif holders:
            fix = (
                f"give {user!r} one of the roles {_names(holders)} in [roles] "
                f"({user!r} has no roles)"
            )
        else:
            fix = (
                f"give {user!r} a role in [roles] and grant it '{permission}' on "
                f"{pattern!r} in [security] ({user!r} has no roles)"
            )
        return f"{head}: {decided}; {fix}"

    def cache_info(self) -> CacheInfo:
        return CacheInfo(self._hits, self._misses, self._cache_size, len(self._cache))


def _shown(name: str) -> str:
    if len(name) <= SHOWN_ADDRESS_MAX:
        return name
    return f"{name[:SHOWN_ADDRESS_MAX]}...({len(name)} characters)"


def _toml_key(name: str) -> str:
    """`name` as a TOML key: bare when it can be, else quoted."""
    if name and all(c.isalnum() or c in "-_" for c in name):
        return name
    return '"' + name.replace("\\", "\\\\").replace('"', '\\"') + '"'
