"""The authorisation core: pattern precedence, roles, descriptions, the LRU, settings."""

from __future__ import annotations

import pytest

from amqbroker.core.authz import CACHED_ADDRESS_MAX, PERMISSIONS, Authorizer, SecurityRule
from amqbroker.core.errors import Unauthorized
from amqbroker.settings import Settings, SettingsError, load_settings


def authz(
    rules: dict[str, dict[str, list[str]]],
    roles: dict[str, list[str]],
    *,
    enabled: bool = True,
    cache_size: int = 100,
) -> Authorizer:
    return Authorizer(
        {p: SecurityRule.model_validate(r) for p, r in rules.items()},
        roles,
        enabled,
        cache_size=cache_size,
    )


def denial(a: Authorizer, user: str, permission: str, address: str) -> str:
    with pytest.raises(Unauthorized) as info:
        a.check(user, permission, address)
    assert info.value.condition == "amqp:unauthorized-access"
    return info.value.description


def test_every_permission_is_granted_only_to_the_roles_listed() -> None:
    for perm in PERMISSIONS:
        a = authz({"#": {perm: ["r"]}}, {"yes": ["r"], "no": ["other"]})
        a.check("yes", perm, "x.y")
        assert a.allowed("yes", perm, "x.y")
        assert not a.allowed("no", perm, "x.y")
        for other in PERMISSIONS:
            if other != perm:
                assert not a.allowed("yes", other, "x.y"), (perm, other)


def test_most_specific_pattern_decides_alone() -> None:
    a = authz(
        {
            "#": {"send": ["everyone"]},
            "orders.#": {"send": ["app"]},
            "orders.*": {"send": ["star"]},
            "orders.eu": {"send": ["eu"]},
            "orders.eu.#": {"consume": ["eu"]},
        },
        {"app": ["app"], "eu": ["eu"], "star": ["star"], "all": ["everyone"]},
    )
    assert a.rule_for("orders.eu") == "orders.eu"
    assert a.rule_for("orders.us") == "orders.*"
    assert a.rule_for("orders.us.ny") == "orders.#"
    assert a.rule_for("orders") == "orders.#"
    assert a.rule_for("prices") == "#"
    # exact beats the wildcards; no merging: "orders.#" granting app does not apply
    assert a.allowed("eu", "send", "orders.eu")
    assert not a.allowed("app", "send", "orders.eu")
    assert not a.allowed("star", "send", "orders.eu")
    assert a.allowed("star", "send", "orders.us")
    assert not a.allowed("app", "send", "orders.us")
    assert a.allowed("app", "send", "orders.us.ny")
    assert a.allowed("app", "send", "orders")
    assert not a.allowed("all", "send", "orders.x.y")
    assert a.allowed("all", "send", "prices")
    # "orders.eu.#" (more literal words than "orders.#") decides for orders.eu.paris,
    # and it lists no 'send'
    assert a.rule_for("orders.eu.paris") == "orders.eu.#"
    assert not a.allowed("eu", "send", "orders.eu.paris")
    assert a.allowed("eu", "consume", "orders.eu.paris")


def test_ties_go_to_the_pattern_that_sorts_first() -> None:
    a = authz({"a.*.c": {"send": ["x"]}, "a.b.*": {"send": ["y"]}}, {"u": ["x"]})
    assert a.rule_for("a.b.c") == "a.*.c"
    assert a.allowed("u", "send", "a.b.c")


def test_star_is_one_word_hash_is_any() -> None:
    a = authz({"a.*": {"send": ["r"]}}, {"u": ["r"]})
    assert a.allowed("u", "send", "a.b")
    assert not a.allowed("u", "send", "a")
    assert not a.allowed("u", "send", "a.b.c")


def test_any_of_several_roles_suffices() -> None:
    a = authz({"q": {"consume": ["reader", "admin"]}}, {"u": ["writer", "admin"]})
    assert a.allowed("u", "consume", "q")
    assert not a.allowed("u", "send", "q")


def test_no_matching_pattern_denies_and_says_what_to_add() -> None:
    a = authz({"orders.#": {"send": ["app"]}}, {"bob": ["app"]})
    text = denial(a, "bob", "send", "prices.eu")
    assert "'bob'" in text and "'send'" in text and "'prices.eu'" in text
    assert "no [security] pattern matches" in text
    assert "send = ['app']" in text


def test_denial_names_user_permission_address_pattern_and_fix() -> None:
    a = authz({"orders.#": {"send": ["app"], "consume": []}}, {"bob": ["audit"]})
    text = denial(a, "bob", "consume", "orders.eu")
    assert "user 'bob' may not consume from address 'orders.eu' ('consume')" in text
    assert "'orders.#' grants it to no role" in text
    assert "grant role 'audit' 'consume' on 'orders.#' in [security]" in text
    text = denial(a, "carol", "send", "orders.eu")
    assert "give 'carol' one of the roles app in [roles]" in text


def test_anonymous_and_none_are_the_same_user() -> None:
    a = authz({"#": {"send": ["guest"]}}, {"anonymous": ["guest"]})
    assert a.allowed(None, "send", "x")
    assert a.allowed("anonymous", "send", "x")
    assert not a.allowed("alice", "send", "x")


def test_address_options_are_not_part_of_the_name() -> None:
    a = authz({"orders": {"send": ["app"]}}, {"u": ["app"]})
    assert a.allowed("u", "send", "orders?exclusive=true")
    assert a.rule_for("orders?group-buckets=4") == "orders"


def test_disabled_allows_everything() -> None:
    a = authz({}, {}, enabled=False)
    a.check("nobody", "manage", "$management")
    assert a.allowed("nobody", "delete_address", "x")
    assert a.denial("nobody", "send", "x") is None


def test_enabled_without_rules_denies_everything() -> None:
    a = authz({}, {"u": ["r"]})
    for perm in PERMISSIONS:
        assert not a.allowed("u", perm, "x")


def test_unknown_permission_is_a_programming_error() -> None:
    with pytest.raises(ValueError, match="unknown permission 'write'"):
        authz({}, {}).check("u", "write", "x")


def test_bad_pattern_is_refused() -> None:
    with pytest.raises(ValueError, match="invalid address pattern 'ord\\*'"):
        Authorizer({"ord*": SecurityRule()}, {}, True)


def test_decisions_are_cached_in_a_bounded_lru() -> None:
    a = authz({"#": {"send": ["r"]}}, {"u": ["r"]}, cache_size=2)
    assert a.allowed("u", "send", "a")
    assert a.allowed("u", "send", "a")
    assert a.cache_info()[:2] == (1, 1)
    assert not a.allowed("v", "send", "a")  # denials are cached too
    assert not a.allowed("v", "send", "a")
    assert a.cache_info().hits == 2
    a.allowed("u", "send", "a")  # "a" for u is now the most recently used
    a.allowed("u", "send", "b")  # evicts v's entry
    assert a.cache_info().currsize == 2
    a.allowed("u", "send", "a")
    assert a.cache_info().hits == 4
    a.allowed("v", "send", "a")  # a miss again
    assert a.cache_info().misses == 4


def test_cache_size_zero_disables_the_cache() -> None:
    a = authz({"#": {"send": ["r"]}}, {"u": ["r"]}, cache_size=0)
    assert a.allowed("u", "send", "a") and a.allowed("u", "send", "a")
    assert a.cache_info() == (0, 2, 0, 0)
    with pytest.raises(ValueError):
        authz({}, {}, cache_size=-1)


# ----------------------------------------------------------------------- settings


def test_settings_accept_kebab_case_permissions() -> None:
    s = Settings(
        security_enabled=True,
        roles={"anonymous": ["guest"]},
        security={"orders.#": SecurityRule.model_validate({"create-address": ["guest"]})},
    )
    assert s.security["orders.#"].create_address == ["guest"]
    a = Authorizer(s.security, s.roles, s.security_enabled)
    assert a.allowed(None, "create_address", "orders.eu")


def test_settings_unknown_permission_suggests_the_closest() -> None:
    with pytest.raises(SettingsError) as info:
        load_settings(environ={"AMQBROKER_SECURITY": '{"orders.#": {"consme": ["app"]}}'})
    assert 'security."orders.#".consme' in str(info.value)
    assert "did you mean 'consume'?" in str(info.value)


def test_settings_roles_must_name_known_users() -> None:
    with pytest.raises(SettingsError) as info:
        load_settings(environ={"AMQBROKER_ROLES": '{"anonymus": ["guest"]}'})
    text = str(info.value)
    assert "roles names user 'anonymus'" in text and "did you mean 'anonymous'?" in text


def test_settings_bad_security_pattern_is_named() -> None:
    with pytest.raises(SettingsError) as info:
        load_settings(environ={"AMQBROKER_SECURITY": '{"a..b": {"send": ["x"]}}'})
    assert "invalid address pattern 'a..b'" in str(info.value)


def test_long_addresses_are_not_cached_and_cut_in_descriptions() -> None:
    a = authz({"#": {"send": ["r"]}}, {"u": ["r"]}, cache_size=10)
    long_name = "x" * (CACHED_ADDRESS_MAX + 1)
    assert a.allowed("u", "send", long_name)
    assert a.allowed("u", "send", "x" * CACHED_ADDRESS_MAX)
    assert a.cache_info().currsize == 1
    huge = "y" * 100_000
    text = denial(a, "v", "send", huge)
    assert len(text) < 1000
    assert "(100000 characters)" in text
    assert a.cache_info().currsize == 1
