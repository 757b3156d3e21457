"""Address settings: wildcard matching, specificity, merging, the LRU, address options."""

from __future__ import annotations

import re

import pydantic
import pytest
from hypothesis import given
from hypothesis import strategies as st

from amqbroker.core.address_settings import (
    QUEUE_OPTION_KEYS,
    AddressSettings,
    AddressSettingsRepository,
    QueueConfig,
    QueueOptions,
    ResolvedAddressSettings,
    check_pattern,
    parse_address_options,
    pattern_matches,
    queue_config,
)

# ------------------------------------------------------------------------------ models


def test_address_settings_and_resolved_have_the_same_fields() -> None:
    assert set(AddressSettings.model_fields) == set(ResolvedAddressSettings.model_fields)
    assert all(v is None for v in AddressSettings().model_dump().values())


def test_builtin_defaults() -> None:
    d = ResolvedAddressSettings()
    assert d.auto_create_addresses and d.auto_create_queues and d.auto_delete_queues
    assert d.default_routing_type == "anycast"
    assert d.default_queue_durable is True
    assert d.max_delivery_attempts == 10
    assert d.dead_letter_address is None and d.expiry_address is None
    assert d.redelivery_delay == 0
    assert d.max_size_bytes == -1
    assert d.address_full_policy == "BLOCK"
    assert d.default_group_buckets == -1
    assert d.default_group_rebalance is False
    assert d.default_group_rebalance_pause_dispatch is False
    assert d.default_group_first_key is None
    assert d.default_exclusive_queue is False
    assert d.default_consumers_before_dispatch == 0
    assert d.default_delay_before_dispatch == -1
    assert d.group_skip_ahead is True
    assert d.group_id_from_application_properties is True
    assert d.group_owner_policy == "round-robin"
    assert d.group_unbind_on_undeliverable is False
    assert d.group_pause_dispatch_timeout == -1


def test_artemis_kebab_names_and_value_spellings_are_accepted() -> None:
    s = AddressSettings.model_validate(
        {
            "max-delivery-attempts": 3,
            "dead-letter-address": "DLQ",
            "default-address-routing-type": "MULTICAST",
            "address-full-policy": "fail",
            "group_owner_policy": "least_loaded",
            "default-group-buckets": 16,
        }
    )
    assert s.max_delivery_attempts == 3
    assert s.dead_letter_address == "DLQ"
    assert s.default_routing_type == "multicast"
    assert s.address_full_policy == "FAIL"
    assert s.group_owner_policy == "least-loaded"
    assert s.default_group_buckets == 16
    assert AddressSettings.model_validate({"default-routing-type": "anycast"}).default_routing_type


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        ({"max_delivery_attempts": 0}, "-1 (unlimited) or at least 1"),
        ({"max_delivery_attempts": True}, "not true/false"),
        ({"max_size_bytes": -5}, "-1 (unlimited) or at least 1"),
        ({"default_group_buckets": -2}, "-1 or at least 0"),
        ({"address_full_policy": "DROP"}, "not supported"),
        ({"default_routing_type": "broadcast"}, "anycast"),
        ({"dead_letter_address": "dlq.#"}, "no '*', '#' or '?'"),
        ({"redelivery_delay": -1}, "greater than or equal to 0"),
        ({"max-delivary-attempts": 3}, "Extra inputs"),
    ],
)
def test_invalid_address_settings(data: dict[str, object], fragment: str) -> None:
    with pytest.raises(pydantic.ValidationError, match=re.escape(fragment)):
        AddressSettings.model_validate(data)


def test_address_settings_are_frozen() -> None:
    s = AddressSettings(max_delivery_attempts=3)
    with pytest.raises(pydantic.ValidationError):
        s.max_delivery_attempts = 4


# ---------------------------------------------------------------------------- matching


@pytest.mark.parametrize(
    ("pattern", "address", "expected"),
    [
        ("orders", "orders", True),
        ("orders", "orders.eu", False),
        ("orders.#", "orders", True),  # '#' matches zero words
        ("orders.#", "orders.eu", True),
        ("orders.#", "orders.eu.paris", True),
        ("orders.#", "ordersx", False),
        ("orders.*", "orders", False),
        ("orders.*", "orders.eu", True),
        ("orders.*", "orders.eu.paris", False),
        ("#", "anything.at.all", True),
        ("#", "x", True),
        ("#.eu", "eu", True),
        ("#.eu", "orders.eu", True),
        ("a.#.c", "a.c", True),
        ("a.#.c", "a.b.b.c", True),
        ("a.#.c", "a.b.d", False),
        ("a.*.c", "a.b.c", True),
        ("a.*.c", "a.c", False),
        ("a.#.#", "a", True),
        ("*", "a", True),
        ("*", "a.b", False),
    ],
)
def test_pattern_matches(pattern: str, address: str, expected: bool) -> None:
    assert pattern_matches(pattern, address) is expected


def _reference_match(pattern: list[str], words: list[str]) -> bool:
    if not pattern:
        return not words
    if pattern[0] == "#":
        return _reference_match(pattern[1:], words) or (
            bool(words) and _reference_match(pattern, words[1:])
        )
    return (
        bool(words) and pattern[0] in ("*", words[0]) and _reference_match(pattern[1:], words[1:])
    )


@given(
    st.lists(st.sampled_from(["a", "b", "*", "#"]), min_size=1, max_size=6),
    st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=6),
)
def test_pattern_matches_agrees_with_reference(pattern: list[str], words: list[str]) -> None:
    assert pattern_matches(".".join(pattern), ".".join(words)) == _reference_match(pattern, words)


@pytest.mark.parametrize("pattern", ["", "a..b", ".a", "a.", "ord*", "a.b#", "a.?", "q?x=1"])
def test_invalid_patterns_are_named(pattern: str) -> None:
    with pytest.raises(ValueError, match="invalid address pattern") as info:
        check_pattern(pattern)
    assert repr(pattern) in str(info.value)
    with pytest.raises(ValueError, match="invalid address pattern"):
        AddressSettingsRepository({pattern: AddressSettings()})


def test_specificity_exact_beats_star_beats_hash_beats_catch_all() -> None:
    repo = AddressSettingsRepository(
        {
            "#": AddressSettings(max_delivery_attempts=1),
            "orders.#": AddressSettings(max_delivery_attempts=2),
            "orders.*": AddressSettings(max_delivery_attempts=3),
            "orders.eu": AddressSettings(max_delivery_attempts=4),
        }
    )
    assert repo.matching("orders.eu") == ["orders.eu", "orders.*", "orders.#", "#"]
    assert repo.resolve("orders.eu").max_delivery_attempts == 4
    assert repo.resolve("orders.us").max_delivery_attempts == 3
    assert repo.resolve("orders.us.ny").max_delivery_attempts == 2
    assert repo.resolve("orders").max_delivery_attempts == 2
    assert repo.resolve("prices").max_delivery_attempts == 1


@pytest.mark.parametrize(
    ("address", "patterns", "expected_order"),
    [
        # more literal words win
        ("a.b.c", ["a.#", "a.*.c"], ["a.*.c", "a.#"]),
        ("a.b.c", ["#", "a.b.#", "a.#"], ["a.b.#", "a.#", "#"]),
        # same literals: fewer '#' win
        ("a.b", ["#.a.#", "a.#"], ["a.#", "#.a.#"]),
        ("a.b", ["a.#", "a.*"], ["a.*", "a.#"]),
        # same literals and '#': fewer '*' win
        ("a.b.c", ["a.*.*.#", "a.*.#"], ["a.*.#", "a.*.*.#"]),
        # then the longer pattern wins
        ("orders.eu", ["#.eu", "orders.#"], ["orders.#", "#.eu"]),
        # then the string order (deterministic)
        ("a.c", ["a.#", "#.c"], ["#.c", "a.#"]),
        # an exact match beats everything
        ("a.b", ["a.b.#", "a.b", "*.*"], ["a.b", "a.b.#", "*.*"]),
    ],
)
def test_specificity_order(address: str, patterns: list[str], expected_order: list[str]) -> None:
    for ordering in (patterns, list(reversed(patterns))):
        repo = AddressSettingsRepository({p: AddressSettings() for p in ordering})
        assert repo.matching(address) == expected_order


def test_merge_per_field_falls_through_to_less_specific_then_defaults() -> None:
    repo = AddressSettingsRepository(
        {
            "#": AddressSettings(dead_letter_address="DLQ", redelivery_delay=100),
            "orders.#": AddressSettings(max_delivery_attempts=5, default_group_buckets=64),
            "orders.eu": AddressSettings(max_delivery_attempts=-1),
        }
    )
    r = repo.resolve("orders.eu")
    assert r.max_delivery_attempts == -1  # from orders.eu
    assert r.default_group_buckets == 64  # from orders.#
    assert r.dead_letter_address == "DLQ"  # from #
    assert r.redelivery_delay == 100  # from #
    assert r.address_full_policy == "BLOCK"  # built-in default
    assert repo.resolve("prices") == ResolvedAddressSettings(
        dead_letter_address="DLQ", redelivery_delay=100
    )


def test_empty_string_clears_an_inherited_address() -> None:
    repo = AddressSettingsRepository(
        {
            "#": AddressSettings(dead_letter_address="DLQ", default_group_first_key="first"),
            "tmp.#": AddressSettings(dead_letter_address="", default_group_first_key=""),
        }
    )
    assert repo.resolve("tmp.x").dead_letter_address is None
    assert repo.resolve("tmp.x").default_group_first_key is None
    assert repo.resolve("orders").dead_letter_address == "DLQ"


def test_no_patterns_gives_builtin_defaults() -> None:
    assert AddressSettingsRepository({}).resolve("x") == ResolvedAddressSettings()


def test_lru_cache_is_bounded_and_evicts_least_recently_used() -> None:
    repo = AddressSettingsRepository({"#": AddressSettings(max_delivery_attempts=3)}, 2)
    first = repo.resolve("a")
    repo.resolve("b")
    assert repo.resolve("a") is first  # hit; "a" is now most recent
    repo.resolve("c")  # evicts "b"
    info = repo.cache_info()
    assert (info.hits, info.misses, info.maxsize, info.currsize) == (1, 3, 2, 2)
    repo.resolve("a")
    assert repo.cache_info().hits == 2
    repo.resolve("b")
    assert repo.cache_info().misses == 4
    for i in range(100):
        repo.resolve(f"q{i}")
    assert repo.cache_info().currsize == 2


def test_cache_size_zero_disables_caching() -> None:
    repo = AddressSettingsRepository({}, cache_size=0)
    repo.resolve("a")
    repo.resolve("a")
    assert repo.cache_info().currsize == 0
    assert repo.cache_info().misses == 2
    with pytest.raises(ValueError, match="cache_size"):
        AddressSettingsRepository({}, cache_size=-1)


# ----------------------------------------------------------------------- address options


def test_address_without_options() -> None:
    assert parse_address_options("orders.eu") == ("orders.eu", QueueOptions())
    assert parse_address_options("orders?") == ("orders", QueueOptions())


def test_all_options_kebab_and_snake() -> None:
    name, opts = parse_address_options(
        "orders?group-buckets=1024&group-rebalance=TRUE&group_rebalance_pause_dispatch=1"
        "&group-first-key=first%20key&exclusive=False&consumers-before-dispatch=2"
        "&delay_before_dispatch=250"
    )
    assert name == "orders"
    assert opts == QueueOptions(
        group_buckets=1024,
        group_rebalance=True,
        group_rebalance_pause_dispatch=True,
        group_first_key="first key",
        exclusive=False,
        consumers_before_dispatch=2,
        delay_before_dispatch=250,
    )


def test_classic_aliases_and_implicit_delay() -> None:
    # D10: consumersBeforeDispatchStarts > 0 without a delay implies 1000 ms
    _, opts = parse_address_options("q?consumersBeforeDispatchStarts=2")
    assert (opts.consumers_before_dispatch, opts.delay_before_dispatch) == (2, 1000)
    _, opts = parse_address_options("q?consumersBeforeDispatchStarts=2&timeBeforeDispatchStarts=50")
    assert (opts.consumers_before_dispatch, opts.delay_before_dispatch) == (2, 50)
    _, opts = parse_address_options("q?consumersBeforeDispatchStarts=2&delay-before-dispatch=-1")
    assert opts.delay_before_dispatch == -1
    _, opts = parse_address_options("q?consumersBeforeDispatchStarts=0")
    assert opts.delay_before_dispatch is None
    # the Artemis spelling has no implicit delay
    _, opts = parse_address_options("q?consumers-before-dispatch=2")
    assert opts.delay_before_dispatch is None
    _, opts = parse_address_options("q?timeBeforeDispatchStarts=7")
    assert opts == QueueOptions(delay_before_dispatch=7)


@pytest.mark.parametrize(
    ("address", "fragments"),
    [
        ("q?foo=bar", ["'foo'", "'bar'", "valid keys", "group-buckets"]),
        ("q?exclusive=yes", ["exclusive", "'yes'", "true, false, 1 or 0", "valid keys"]),
        ("q?group-buckets=abc", ["group-buckets", "'abc'", "valid keys"]),
        ("q?group-buckets=-2", ["group-buckets", "'-2'", "-1"]),
        ("q?consumers-before-dispatch=-1", ["consumers-before-dispatch", "'-1'"]),
        ("q?delay-before-dispatch=1.5", ["delay-before-dispatch", "'1.5'"]),
        ("q?group-first-key=", ["group-first-key", "non-empty"]),
        ("q?exclusive", ["'exclusive'", "no value"]),
        ("q?exclusive=1&exclusive=0", ["exclusive", "once"]),
        ("q?consumersBeforeDispatchStarts=1&consumers-before-dispatch=2", ["once"]),
        ("?exclusive=1", ["no name"]),
    ],
)
def test_bad_address_options(address: str, fragments: list[str]) -> None:
    with pytest.raises(ValueError, match=re.escape(fragments[0])) as info:
        parse_address_options(address)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_valid_keys_listed_in_errors_cover_every_key() -> None:
    with pytest.raises(ValueError, match="valid keys") as info:
        parse_address_options("q?nope=1")
    for key in QUEUE_OPTION_KEYS:
        assert key in str(info.value)
        # and every listed key is accepted
        value = "k" if key == "group-first-key" else "1"
        parse_address_options(f"q?{key}={value}")


def test_queue_config_options_override_address_defaults() -> None:
    resolved = ResolvedAddressSettings(
        default_group_buckets=16,
        default_group_rebalance=True,
        default_exclusive_queue=True,
        default_consumers_before_dispatch=3,
        default_delay_before_dispatch=500,
        default_group_first_key="first",
    )
    assert queue_config(resolved, QueueOptions()) == QueueConfig(
        group_buckets=16,
        group_rebalance=True,
        group_rebalance_pause_dispatch=False,
        group_first_key="first",
        exclusive=True,
        consumers_before_dispatch=3,
        delay_before_dispatch=500,
    )
    _, opts = parse_address_options("q?group-buckets=0&exclusive=false&delay-before-dispatch=0")
    cfg = queue_config(resolved, opts)
    assert (cfg.group_buckets, cfg.exclusive, cfg.delay_before_dispatch) == (0, False, 0)
    assert cfg.group_rebalance is True and cfg.consumers_before_dispatch == 3
