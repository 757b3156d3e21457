"""Tests for the JMS selector engine (amqbroker.core.selector) and the field extractor
(amqbroker.protocol.selector_fields), with proton encoding the messages."""

from __future__ import annotations

import contextlib
import math
import sys
import uuid
from collections.abc import Mapping
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from proton import Message, byte, float32, int32, short, symbol, timestamp, uint, ulong

from amqbroker.core.selector import Selector, SelectorError, compile_selector
from amqbroker.protocol.selector_fields import extractor


def truth(text: str, fields: Mapping[str, object] | None = None) -> bool | None:
    """The three-valued result of `text`: TRUE, FALSE or UNKNOWN (None)."""
    fields = fields or {}
    if compile_selector(text).matches(fields):
        return True
    if compile_selector(f"NOT ({text})").matches(fields):
        return False
    return None


# --------------------------------------------------------------------------- literals


@pytest.mark.parametrize(
    ("text", "fields", "expected"),
    [
        ("x = 57", {"x": 57}, True),
        ("x = -957", {"x": -957}, True),
        ("x = +62", {"x": 62}, True),
        ("x = 57L", {"x": 57}, True),
        ("x = 0x1F", {"x": 31}, True),
        ("x = 0X1fL", {"x": 31}, True),
        ("x = 017", {"x": 15}, True),
        ("x = 0", {"x": 0}, True),
        ("x = 7E3", {"x": 7000}, True),
        ("x = -57.9E2", {"x": -5790.0}, True),
        ("x = 7.", {"x": 7}, True),
        ("x = .5", {"x": 0.5}, True),
        ("x = 1.5F", {"x": 1.5}, True),
        ("x = 2D", {"x": 2.0}, True),
        ("x = 1e-2", {"x": 0.01}, True),
        ("x = 'it''s'", {"x": "it's"}, True),
        ("x = ''", {"x": ""}, True),
        ("x = 'caf\u00e9'", {"x": "caf\u00e9"}, True),
        ("x = TRUE", {"x": True}, True),
        ("x = false", {"x": False}, True),
        ("x = 123456789012345678901234567890", {"x": 123456789012345678901234567890}, True),
    ],
)
def test_literals(text: str, fields: dict[str, object], expected: bool) -> None:
    assert compile_selector(text).matches(fields) is expected


def test_keywords_are_case_insensitive_identifiers_are_not() -> None:
    sel = compile_selector("Color = 'red' and not (Size is null) Or FLAG")
    assert sel.identifiers == frozenset({"Color", "Size", "FLAG"})
    assert sel.matches({"Color": "red", "Size": 1})
    assert not sel.matches({"color": "red", "size": 1})
    assert sel.matches({"FLAG": True})
    assert compile_selector("$a_1 = 1 AND _b$ = 2").matches({"$a_1": 1, "_b$": 2})


def test_empty_selector_matches_everything() -> None:
    for text in ("", "   ", "\t\n"):
        sel = compile_selector(text)
        assert sel.matches({}) and sel.identifiers == frozenset()


def test_selector_attributes() -> None:
    sel = compile_selector("a = 1 OR b > 2")
    assert isinstance(sel, Selector)
    assert sel.text == "a = 1 OR b > 2"
    assert sel.identifiers == frozenset({"a", "b"})
    assert "a" in repr(sel)


# --------------------------------------------------------------------------- comparison


@pytest.mark.parametrize(
    ("text", "fields", "expected"),
    [
        ("n = 3", {"n": 3}, True),
        ("n = 3", {"n": 3.0}, True),
        ("n <> 3", {"n": 4}, True),
        ("n <> 3", {"n": 3}, False),
        ("n < 3", {"n": 2.5}, True),
        ("n > 3", {"n": 3}, False),
        ("n >= 3", {"n": 3}, True),
        ("n <= 3", {"n": 3.5}, False),
        ("n = m", {"n": 2, "m": 2.0}, True),
        ("n < m", {"n": 1, "m": 2}, True),
        ("s = 'a'", {"s": "a"}, True),
        ("'a' = s", {"s": "a"}, True),
        ("s <> 'a'", {"s": "b"}, True),
        ("s = t", {"s": "x", "t": "x"}, True),
        ("s <> t", {"s": "x", "t": "y"}, True),
        ("b = TRUE", {"b": True}, True),
        ("b <> TRUE", {"b": False}, True),
        ("b = c", {"b": False, "c": False}, True),
        # type mismatches and NULLs are UNKNOWN
        ("n = 3", {}, None),
        ("n = 3", {"n": "3"}, None),
        ("n <> 3", {"n": "3"}, None),
        ("s = 'a'", {"s": 1}, None),
        ("s = t", {"s": "1", "t": 1}, None),
        ("s <> t", {"s": "1", "t": 1}, None),
        ("b = TRUE", {"b": 1}, None),
        ("n = 1", {"n": True}, None),
        ("n > 0", {"n": True}, None),
        ("n < m", {"n": "a", "m": "b"}, None),
        ("n < m", {"n": True, "m": False}, None),
        ("n = m", {"n": b"x", "m": b"x"}, None),
        ("n = 1", {"n": None}, None),
        ("n = NULL", {"n": 1}, None),
        ("NULL = NULL", {}, None),
        ("'a' = 1", {}, None),
        ("TRUE = 1", {}, None),
        ("(n > 1) = TRUE", {"n": 2}, True),
        ("(n > 1) = (m > 1)", {"n": 2, "m": 0}, False),
        ("(n > 1) = (m > 1)", {"n": 2}, None),
        ("b = (n > 1)", {"b": True}, None),
    ],
)
def test_comparison(text: str, fields: dict[str, object], expected: bool | None) -> None:
    assert truth(text, fields) is expected


def test_equality_binds_looser_than_relational() -> None:
    # a = (b > 1), as in ActiveMQ's grammar
    assert truth("a = b > 1", {"a": True, "b": 2}) is True
    assert truth("a = b > 1", {"a": False, "b": 2}) is False


# --------------------------------------------------------------------------- arithmetic


@pytest.mark.parametrize(
    ("text", "fields", "expected"),
    [
        ("a + b = 5", {"a": 2, "b": 3}, True),
        ("a - b = -1", {"a": 2, "b": 3}, True),
        ("a * b = 6.0", {"a": 2, "b": 3}, True),
        ("a / b = 3", {"a": 7, "b": 2}, True),  # integer division
        ("a / b = -3", {"a": -7, "b": 2}, True),  # truncates toward zero, as Java
        ("a / b = -3", {"a": 7, "b": -2}, True),
        ("a / b = 3", {"a": -7, "b": -2}, True),
        ("a / b = 3.5", {"a": 7.0, "b": 2}, True),
        ("a / 2.0 = 3.5", {"a": 7}, True),
        ("a / b = 0", {"a": 1, "b": 0}, None),  # division by zero is UNKNOWN
        ("a / b = 0", {"a": 1.0, "b": 0.0}, None),
        ("1 / 0 = 1", {}, None),
        ("-a = -2", {"a": 2}, True),
        ("+a = 2", {"a": 2}, True),
        ("- -a = 2", {"a": 2}, True),
        ("-a = 0", {"a": "0"}, None),
        ("a + 1 > 0", {"a": "1"}, None),
        ("a + 1 > 0", {"a": True}, None),
        ("a + 1 > 0", {}, None),
        ("a * 2 + 1 = 7", {"a": 3}, True),  # precedence
        ("1 + a * 2 = 7", {"a": 3}, True),
        ("(1 + a) * 2 = 8", {"a": 3}, True),
        ("a - 1 - 1 = 0", {"a": 2}, True),  # left associative
        ("a / 2 / 2 = 2", {"a": 8}, True),
        ("-a * -a = 9", {"a": 3}, True),
        ("2 * 3 = 6", {}, True),
        ("a + 0.5 = 1.5", {"a": 1}, True),
        ("10 / 4 = 2", {}, True),
        ("10 / 4.0 = 2.5", {}, True),
    ],
)
def test_arithmetic(text: str, fields: dict[str, object], expected: bool | None) -> None:
    assert truth(text, fields) is expected


def test_float_overflow_does_not_raise() -> None:
    sel = compile_selector("a * 1.5 > 1")
    assert sel.matches({"a": 10**400}) is False


# --------------------------------------------------------------------------- logic

T, F, U = True, False, None
_VALUES: dict[bool | None, dict[str, object]] = {T: {"v": True}, F: {"v": False}, U: {}}


def _fields(a: bool | None, b: bool | None) -> dict[str, object]:
    out: dict[str, object] = {}
    if a is not None:
        out["a"] = a
    if b is not None:
        out["b"] = b
    return out


_AND = {
    (T, T): T, (T, F): F, (T, U): U,
    (F, T): F, (F, F): F, (F, U): F,
    (U, T): U, (U, F): F, (U, U): U,
}  # fmt: skip
_OR = {
    (T, T): T, (T, F): T, (T, U): T,
    (F, T): T, (F, F): F, (F, U): U,
    (U, T): T, (U, F): U, (U, U): U,
}  # fmt: skip


@pytest.mark.parametrize(("a", "b"), list(_AND))
def test_three_valued_and_or(a: bool | None, b: bool | None) -> None:
    f = _fields(a, b)
    assert truth("a AND b", f) is _AND[a, b]
    assert truth("a OR b", f) is _OR[a, b]
    # the same through comparisons (x > 0 is UNKNOWN when x is missing)
    g = {k: (1 if v else -1) for k, v in f.items()}
    assert truth("a > 0 AND b > 0", g) is _AND[a, b]
    assert truth("a > 0 OR b > 0", g) is _OR[a, b]


@pytest.mark.parametrize("a", [T, F, U])
def test_three_valued_not(a: bool | None) -> None:
    f = _fields(a, None)
    expected = None if a is None else not a
    assert truth("NOT a", f) is expected
    assert truth("NOT NOT a", f) is a
    assert truth("NOT (a AND TRUE)", f) is expected


def test_bare_identifier_truth() -> None:
    assert compile_selector("flag").matches({"flag": True})
    for value in (False, 1, "true", None):
        assert not compile_selector("flag").matches({"flag": value})
    assert truth("flag", {"flag": 1}) is None


def test_logic_precedence() -> None:
    # NOT binds tighter than AND, AND tighter than OR; NOT applies to a comparison
    assert truth("a OR b AND c", {"a": True, "b": False, "c": False}) is True
    assert truth("(a OR b) AND c", {"a": True, "b": False, "c": False}) is False
    assert truth("NOT a AND b", {"a": False, "b": True}) is True
    assert truth("NOT n = 1", {"n": 2}) is True
    assert truth("NOT n = 1 AND m = 1", {"n": 1, "m": 1}) is False


@pytest.mark.parametrize("n", [2, 9, 40, 500])
def test_long_chains(n: int) -> None:
    """Long AND/OR chains are flattened; deep generated code is hoisted into helpers."""
    sel = compile_selector(" OR ".join(f"x = {i}" for i in range(n)))
    assert sel.matches({"x": n - 1}) and sel.matches({"x": 0})
    assert not sel.matches({"x": n}) and not sel.matches({})
    sel = compile_selector(" AND ".join(f"x{i} = {i}" for i in range(n)))
    fields: dict[str, object] = {f"x{i}": i for i in range(n)}
    assert sel.matches(fields)
    fields["x1"] = 0
    assert not sel.matches(fields)
    assert truth(" AND ".join(f"x{i} = {i}" for i in range(n)), {"x0": 0}) is (
        None if n > 1 else True
    )


def test_constant_folding() -> None:
    assert compile_selector("1 = 1").matches({})
    assert not compile_selector("1 = 2").matches({})
    assert compile_selector("2 * 3 + 1 = 7 AND 'a' LIKE 'a%'").matches({})
    assert compile_selector("FALSE OR x = 1").matches({"x": 1})
    assert compile_selector("TRUE OR x = 1").matches({})
    assert not compile_selector("FALSE AND x = 1").matches({"x": 1})


# --------------------------------------------------------------------------- BETWEEN, IN, IS NULL


@pytest.mark.parametrize(
    ("text", "fields", "expected"),
    [
        ("age BETWEEN 15 AND 19", {"age": 15}, True),
        ("age BETWEEN 15 AND 19", {"age": 19}, True),
        ("age BETWEEN 15 AND 19", {"age": 20}, False),
        ("age BETWEEN 15 AND 19", {"age": 14.99}, False),
        ("age BETWEEN 15 AND 19", {"age": 15.5}, True),
        ("age BETWEEN 15.5 AND 19", {"age": 15}, False),
        ("age BETWEEN 1.5 AND 2.5", {"age": 2}, True),
        ("age BETWEEN 15 AND 19", {}, None),
        ("age BETWEEN 15 AND 19", {"age": "16"}, None),
        ("age BETWEEN 15 AND 19", {"age": True}, None),
        ("age NOT BETWEEN 15 AND 19", {"age": 20}, True),
        ("age NOT BETWEEN 15 AND 19", {"age": 17}, False),
        ("age NOT BETWEEN 15 AND 19", {}, None),
        ("age BETWEEN lo AND hi", {"age": 2, "lo": 1, "hi": 3}, True),
        ("age BETWEEN lo AND hi", {"age": 2, "lo": 3, "hi": 1}, False),
        # x BETWEEN a AND b is x >= a AND x <= b: FALSE beats UNKNOWN
        ("age BETWEEN lo AND hi", {"age": 5, "hi": 3}, False),
        ("age BETWEEN lo AND hi", {"age": 2, "hi": 3}, None),
        ("age NOT BETWEEN lo AND hi", {"age": 5, "hi": 3}, True),
        ("age BETWEEN 1 + 1 AND 2 * 2", {"age": 4}, True),
        ("age + 1 BETWEEN 2 AND 3", {"age": 1}, True),
        ("2 BETWEEN 1 AND 3", {}, True),
        ("5 BETWEEN NULL AND 3", {}, False),
        ("age BETWEEN 1 AND 3 AND x = 1", {"age": 2, "x": 1}, True),
        ("country IN ('UK', 'US', 'France')", {"country": "UK"}, True),
        ("country IN ('UK', 'US', 'France')", {"country": "Peru"}, False),
        ("country IN ('UK')", {"country": "UK"}, True),
        ("country IN ('UK', 'US')", {}, None),
        ("country IN ('1')", {"country": 1}, None),
        ("country NOT IN ('UK', 'US', 'France')", {"country": "UK"}, False),
        ("country NOT IN ('UK', 'US', 'France')", {"country": "Peru"}, True),
        ("country NOT IN ('UK', 'US')", {}, None),
        ("c IN ('a','b','c','d','e','f','g','h','i','j')", {"c": "j"}, True),
        ("c NOT IN ('a','b','c','d','e','f','g','h','i','j')", {"c": "j"}, False),
        ("c IN ('it''s')", {"c": "it's"}, True),
        ("x IS NULL", {}, True),
        ("x IS NULL", {"x": None}, True),
        ("x IS NULL", {"x": 0}, False),
        ("x IS NULL", {"x": b"raw"}, False),
        ("x IS NOT NULL", {"x": ""}, True),
        ("x IS NOT NULL", {}, False),
        ("x + 1 IS NULL", {"x": "a"}, True),
        ("x Is Not Null", {"x": 1}, True),
        ("NULL IS NULL", {}, True),
    ],
)
def test_between_in_is_null(text: str, fields: dict[str, object], expected: bool | None) -> None:
    assert truth(text, fields) is expected


# --------------------------------------------------------------------------- LIKE


@pytest.mark.parametrize(
    ("pattern", "value", "expected"),
    [
        ("12%3", "123", True),
        ("12%3", "12993", True),
        ("12%3", "1234", False),
        ("l_se", "lose", True),
        ("l_se", "loose", False),
        ("abc", "abc", True),
        ("abc", "abcd", False),
        ("", "", True),
        ("", "a", False),
        ("%", "", True),
        ("%", "anything", True),
        ("%%", "x", True),
        ("a%", "abc", True),
        ("a%", "bac", False),
        ("%c", "abc", True),
        ("%c", "cab", False),
        ("%b%", "abc", True),
        ("%b%", "acd", False),
        ("a%c", "abbc", True),
        ("a%c", "ab", False),
        ("_", "x", True),
        ("_", "", False),
        ("_", "xy", False),
        ("__", "xy", True),
        ("%_%", "", False),
        ("%_%", "q", True),
        ("A%", "abc", False),  # case-sensitive
        # regular expression metacharacters are literal
        ("a.c", "abc", False),
        ("a.c", "a.c", True),
        ("a*", "aaa", False),
        ("a*", "a*", True),
        ("(a)%", "(a)b", True),
        ("(a)%", "ab", False),
        ("[ab]", "a", False),
        ("[ab]", "[ab]", True),
        ("a+b?", "a+b?", True),
        ("^a$", "^a$", True),
        ("\\d%", "\\dx", True),
        ("\\d%", "1x", False),
        ("{1}|x", "{1}|x", True),
        # newlines are ordinary characters
        ("a%b", "a\nb", True),
        ("a_b", "a\nb", True),
    ],
)
def test_like(pattern: str, value: str, expected: bool) -> None:
    lit = pattern.replace("'", "''")
    assert truth(f"s LIKE '{lit}'", {"s": value}) is expected
    assert truth(f"s NOT LIKE '{lit}'", {"s": value}) is (not expected)


@pytest.mark.parametrize(
    ("text", "value", "expected"),
    [
        ("s LIKE '\\_%' ESCAPE '\\'", "_foo", True),
        ("s LIKE '\\_%' ESCAPE '\\'", "bar", False),
        ("s LIKE '100!%' ESCAPE '!'", "100%", True),
        ("s LIKE '100!%' ESCAPE '!'", "1000", False),
        ("s LIKE 'a!!b' ESCAPE '!'", "a!b", True),
        ("s LIKE 'a!xb' ESCAPE '!'", "axb", True),
        ("s LIKE '%!_%' escape '!'", "a_b", True),
        ("s LIKE '%!_%' escape '!'", "ab", False),
        ("s LIKE '!%%' ESCAPE '!'", "%abc", True),
        ("s LIKE '!%%' ESCAPE '!'", "abc", False),
        ("s LIKE '%.!%' ESCAPE '!'", "x.%", True),
        ("s LIKE 'a''%' ESCAPE ''''", "a%", True),
        ("s LIKE 'a''%' ESCAPE ''''", "ab", False),
        ("s LIKE 'x_%' ESCAPE '_'", "x%", True),
    ],
)
def test_like_escape(text: str, value: str, expected: bool) -> None:
    assert truth(text, {"s": value}) is expected


def test_like_unknown() -> None:
    assert truth("s LIKE 'a%'", {}) is None
    assert truth("s LIKE 'a%'", {"s": 1}) is None
    assert truth("s NOT LIKE 'a%'", {"s": True}) is None
    assert truth("'abc' LIKE 'a_c'") is True


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("text", "position", "fragment"),
    [
        ("a = ", 4, "expected an expression"),
        ("a = 1 AND", 9, "expected an expression"),
        ("a = 1 AND AND b = 2", 10, "expected an expression"),
        ("a = 1 b = 2", 6, "expected an operator or the end"),
        ("(a = 1", 6, "expected ')'"),
        ("a = 1)", 5, "unbalanced ')'"),
        ("a = 'abc", 4, "unterminated string"),
        ("a # 1", 2, "unexpected character '#'"),
        ("a = 0x", 4, "hexadecimal"),
        ("a = 09", 4, "octal"),
        ("a = 1 AND 'x' > b", 10, "only be compared with = and <>"),
        ("a < TRUE", 4, "only be compared with = and <>"),
        ("a + 'x' = 1", 4, "needs a number"),
        ("-'x' = 1", 1, "needs a number"),
        ("1 + 2", 0, "must be a boolean expression"),
        ("'x'", 0, "must be a boolean expression"),
        ("a = 1 AND 2", 10, "expected a boolean expression"),
        ("NOT 5", 4, "expected a boolean expression"),
        ("a LIKE b", 7, "expected a string literal"),
        ("a LIKE 'x' ESCAPE 'ab'", 18, "single character"),
        ("a LIKE 'x' ESCAPE ''", 18, "single character"),
        ("a LIKE 'x!' ESCAPE '!'", 7, "ends with the escape character"),
        ("5 LIKE 'x'", 0, "LIKE needs a string"),
        ("a IN ()", 6, "expected a string literal"),
        ("a IN ('x', 1)", 11, "expected a string literal"),
        ("a IN ('x' 'y')", 10, "expected ',' or ')'"),
        ("a IN 'x'", 5, "expected '(' after IN"),
        ("5 IN ('x')", 0, "IN needs a string"),
        ("a BETWEEN 'x' AND 3", 10, "BETWEEN needs numbers"),
        ("a BETWEEN 1 OR 3", 12, "expected AND"),
        ("a IS 5", 5, "expected NULL"),
        ("a = NOT b", 4, "NOT is not allowed here"),
        ("a NOT = 1", 2, "expected an operator or the end"),
        ("NOT", 3, "expected an expression"),
        ("a > 1 > 2", 0, "only be compared with = and <>"),
        ("AND", 0, "expected an expression"),
        ("a = -TRUE", 5, "needs a number"),
    ],
)
def test_errors(text: str, position: int, fragment: str) -> None:
    with pytest.raises(SelectorError) as info:
        compile_selector(text)
    err = info.value
    assert err.position == position, str(err)
    assert fragment in err.reason, str(err)
    assert str(err).startswith(("syntax error at position", "type error at position"))
    assert f"position {position} " in str(err)


def test_error_message_format() -> None:
    with pytest.raises(SelectorError) as info:
        compile_selector("color = 'red' AND AND")
    assert str(info.value) == ("syntax error at position 18 (near 'AND'): expected an expression")
    with pytest.raises(SelectorError) as info:
        compile_selector("color =")
    assert str(info.value) == (
        "syntax error at position 7 (at the end of the selector): expected an expression"
    )
    assert isinstance(info.value, ValueError)


def test_nesting_limits() -> None:
    depth = 200
    assert compile_selector("(" * (depth - 1) + "x" + ")" * (depth - 1)).matches({"x": True})
    assert compile_selector("NOT " * (depth - 1) + "x").matches({"x": (depth - 1) % 2 == 0})
    assert compile_selector("1" + " + 1" * (depth - 2) + " = x").matches({"x": depth - 1})
    # not constant: the generated code is split into helper functions
    sel = compile_selector("x" + " + x" * (depth - 2) + " > 0")
    assert sel.source.count("def ") > 2
    assert sel.matches({"x": 1}) and not sel.matches({"x": -1}) and not sel.matches({})
    with pytest.raises(SelectorError, match="nested too deeply") as info:
        compile_selector("(" * 1000 + "x" + ")" * 1000)
    assert info.value.position == depth + 1
    with pytest.raises(SelectorError, match="nested too deeply"):
        compile_selector("NOT " * 5000 + "x")
    with pytest.raises(SelectorError, match="nested too deeply"):
        compile_selector("1" + " + 1" * 5000 + " = x")
    with pytest.raises(SelectorError, match="nested too deeply"):
        compile_selector("- " * 5000 + "1 = x")
    assert compile_selector("a = 1 AND " * 100 + "(" * 199 + "x" + ")" * 199).matches(
        {"a": 1, "x": True}
    )
    with pytest.raises(SelectorError, match="nested too deeply"):
        compile_selector("a = 1 AND " * 100 + "(" * 200 + "x" + ")" * 200)
    with pytest.raises(SelectorError, match="nested too deeply"):
        compile_selector("(x = 1 OR y = 2) AND " * 2 + "x", max_depth=2)


def test_deep_selector_under_a_small_recursion_budget() -> None:
    """A maximally nested selector compiles and runs with little stack to spare."""
    text = "(" * 100 + "a + (b * (c - " * 15 + "x" + "))" * 15 + " > 0" + ")" * 100
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(len(_stack()) + 250)
    try:
        sel = compile_selector(text)
    finally:
        sys.setrecursionlimit(old)
    assert sel.matches({"a": 1, "b": 1, "c": 1, "x": 1})


def _stack() -> list[object]:
    import inspect

    return list(inspect.stack(0))


def test_max_length() -> None:
    compile_selector("a = 'x'", max_length=7)
    with pytest.raises(SelectorError, match="longer than 6") as info:
        compile_selector("a = 'x'", max_length=6)
    assert info.value.position == 6
    with pytest.raises(SelectorError):
        compile_selector("a = '" + "x" * 70000 + "'")


def test_big_literals() -> None:
    with pytest.raises(SelectorError, match="too long"):
        compile_selector("a = " + "9" * 5000)
    assert compile_selector("a = 0x" + "f" * 100).matches({"a": int("f" * 100, 16)})
    assert compile_selector("a < 1e999").matches({"a": 1})
    assert compile_selector("a > -1e999").matches({"a": 1})
    assert compile_selector("9" * 30 + " * " + "9" * 30 + " > 1").matches({})


# --------------------------------------------------------------------------- properties

_IDENT_NAMES = ["a", "b", "c"]
_field_values = st.one_of(
    st.none(),
    st.integers(-4, 4),
    st.floats(-4, 4, allow_nan=False).map(lambda f: round(f, 1)),
    st.text(alphabet="ab%_", max_size=3),
    st.booleans(),
    st.just(b"\x00"),
)


def _lit_str(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


_num_leaf = st.one_of(
    st.integers(-5, 5).map(lambda n: ("num", n)),
    st.sampled_from([0.5, 1.5, -2.0, 0.0]).map(lambda f: ("num", f)),
    st.sampled_from(_IDENT_NAMES).map(lambda n: ("id", n)),
)
_str_leaf = st.one_of(
    st.text(alphabet="ab'", max_size=2).map(lambda s: ("str", s)),
    st.sampled_from(_IDENT_NAMES).map(lambda n: ("id", n)),
)

_num_expr = st.recursive(
    _num_leaf,
    lambda inner: st.one_of(
        st.tuples(st.just("arith"), st.sampled_from("+-*/"), inner, inner),
        st.tuples(st.just("neg"), inner),
    ),
    max_leaves=4,
)


def _bool_expr() -> st.SearchStrategy[Any]:
    leaf = st.one_of(
        st.sampled_from(_IDENT_NAMES).map(lambda n: ("id", n)),
        st.booleans().map(lambda b: ("bool", b)),
        st.tuples(
            st.just("cmp"), st.sampled_from(["=", "<>", "<", ">", "<=", ">="]), _num_expr, _num_expr
        ),
        st.tuples(st.just("eq"), st.sampled_from(["=", "<>"]), _str_leaf, _str_leaf),
        st.tuples(st.just("eq"), st.sampled_from(["=", "<>"]), _str_leaf, _num_expr),
        st.tuples(st.just("isnull"), st.one_of(_num_expr, _str_leaf), st.booleans()),
        st.tuples(st.just("between"), _num_expr, _num_expr, _num_expr, st.booleans()),
        st.tuples(
            st.just("in"),
            _str_leaf,
            st.lists(st.text(alphabet="ab", max_size=2), min_size=1, max_size=3),
            st.booleans(),
        ),
        st.tuples(st.just("like"), _str_leaf, st.text(alphabet="ab%_", max_size=4), st.booleans()),
    )
    return st.recursive(
        leaf,
        lambda inner: st.one_of(
            st.tuples(st.just("and"), inner, inner),
            st.tuples(st.just("or"), inner, inner),
            st.tuples(st.just("not"), inner),
            st.tuples(st.just("eq"), st.sampled_from(["=", "<>"]), inner, inner),
        ),
        max_leaves=8,
    )


def _render(e: Any) -> str:
    tag = e[0]
    if tag == "num":
        return repr(e[1])
    if tag == "str":
        return _lit_str(e[1])
    if tag == "id":
        return str(e[1])
    if tag == "bool":
        return "TRUE" if e[1] else "FALSE"
    if tag == "arith" or tag in {"cmp", "eq"}:
        return f"({_render(e[2])} {e[1]} {_render(e[3])})"
    if tag == "neg":
        return f"(-{_render(e[1])})"
    if tag == "isnull":
        return f"({_render(e[1])} IS {'NOT ' if e[2] else ''}NULL)"
    if tag == "between":
        neg = "NOT " if e[4] else ""
        return f"({_render(e[1])} {neg}BETWEEN {_render(e[2])} AND {_render(e[3])})"
    if tag == "in":
        neg = "NOT " if e[3] else ""
        return f"({_render(e[1])} {neg}IN ({', '.join(_lit_str(s) for s in e[2])}))"
    if tag == "like":
        return f"({_render(e[1])} {'NOT ' if e[3] else ''}LIKE {_lit_str(e[2])})"
    if tag in {"and", "or"}:
        return f"({_render(e[1])} {tag.upper()} {_render(e[2])})"
    assert tag == "not"
    return f"(NOT {_render(e[1])})"


def _is_num(v: object) -> bool:
    return type(v) in {int, float}


def _like_ref(s: str, p: str) -> bool:
    """Wildcard matching by dynamic programming (independent of the regex code)."""
    m = [[False] * (len(s) + 1) for _ in range(len(p) + 1)]
    m[0][0] = True
    for i, pc in enumerate(p, 1):
        for j in range(len(s) + 1):
            if pc == "%":
                m[i][j] = m[i - 1][j] or (j > 0 and m[i][j - 1])
            elif j > 0:
                m[i][j] = m[i - 1][j - 1] and (pc == "_" or pc == s[j - 1])
    return m[len(p)][len(s)]


def _ref(e: Any, f: Mapping[str, object]) -> object:
    """Reference interpreter: returns the raw value (numbers, strings, 3VL booleans)."""
    tag = e[0]
    if tag in {"num", "str", "bool"}:
        return e[1]
    if tag == "id":
        return f.get(e[1])
    if tag == "neg":
        v = _ref(e[1], f)
        return -v if _is_num(v) else None  # type: ignore[operator]
    if tag == "arith":
        a, b = _ref(e[2], f), _ref(e[3], f)
        if not (_is_num(a) and _is_num(b)):
            return None
        op = e[1]
        if op == "+":
            return a + b  # type: ignore[operator]
        if op == "-":
            return a - b  # type: ignore[operator]
        if op == "*":
            return a * b  # type: ignore[operator]
        if b == 0:
            return None
        if type(a) is int and type(b) is int:
            return math.trunc(a / b)
        return a / b  # type: ignore[operator]
    if tag == "cmp":
        a, b = _ref(e[2], f), _ref(e[3], f)
        op = e[1]
        if op in {"=", "<>"}:
            return _ref_eq(op, a, b)
        if not (_is_num(a) and _is_num(b)):
            return None
        return {"<": a < b, ">": a > b, "<=": a <= b, ">=": a >= b}[op]  # type: ignore[operator]
    if tag == "eq":
        a, b = _bool_or_raw(e[2], f), _bool_or_raw(e[3], f)
        return _ref_eq(e[1], a, b)
    if tag == "isnull":
        v = _ref(e[1], f)
        if e[1][0] not in {"id", "num", "str"} and not _is_num(v):
            v = None
        return (v is not None) if e[2] else (v is None)
    if tag == "between":
        x, lo, hi = (_ref(e[i], f) for i in (1, 2, 3))
        ge = (x >= lo) if _is_num(x) and _is_num(lo) else None  # type: ignore[operator]
        le = (x <= hi) if _is_num(x) and _is_num(hi) else None  # type: ignore[operator]
        r = _and3(ge, le)
        return _not3(r) if e[4] else r
    if tag == "in":
        v = _ref(e[1], f)
        if type(v) is not str:
            return None
        return (v not in e[2]) if e[3] else (v in e[2])
    if tag == "like":
        v = _ref(e[1], f)
        if type(v) is not str:
            return None
        r = _like_ref(v, e[2])
        return (not r) if e[3] else r
    if tag == "and":
        return _and3(_as_bool(e[1], f), _as_bool(e[2], f))
    if tag == "or":
        return _not3(_and3(_not3(_as_bool(e[1], f)), _not3(_as_bool(e[2], f))))
    assert tag == "not"
    return _not3(_as_bool(e[1], f))


def _bool_or_raw(e: Any, f: Mapping[str, object]) -> object:
    v = _ref(e, f)
    if e[0] == "neg" or e[0] == "arith":
        return v if _is_num(v) else None
    return v


def _as_bool(e: Any, f: Mapping[str, object]) -> bool | None:
    v = _ref(e, f)
    return v if type(v) is bool else None


def _ref_eq(op: str, a: object, b: object) -> bool | None:
    if a is None or b is None:
        return None
    if not (_is_num(a) and _is_num(b)) and not (type(a) is type(b) and type(a) in {str, bool}):
        return None
    r = a == b
    return r if op == "=" else not r


def _and3(a: bool | None, b: bool | None) -> bool | None:
    if a is False or b is False:
        return False
    if a is None or b is None:
        return None
    return True


def _not3(a: bool | None) -> bool | None:
    return None if a is None else not a


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    _bool_expr(),
    st.fixed_dictionaries({n: _field_values for n in _IDENT_NAMES}),
)
def test_against_reference_interpreter(expr: Any, values: dict[str, object]) -> None:
    fields = {k: v for k, v in values.items() if v is not None}
    text = _render(expr)
    expected = _ref(expr, fields)
    if type(expected) is not bool:
        expected = None
    assert truth(text, fields) is expected, text


_selector_chars = st.sampled_from(
    [
        *"abxyz019'()=<>+-*/,.%_ eE$!\\\n\u00e9",
        *["AND", "OR", "NOT", "LIKE", "ESCAPE", "IN", "IS", "NULL", "BETWEEN", "TRUE", "0x", "L"],
        *[" AND ", " OR ", " = ", " IS NULL", " IN ('a')", "'a'", "1.5e3", "(", ")"],
    ]
)


@settings(max_examples=1000, deadline=None)
@given(st.lists(_selector_chars, max_size=30).map("".join))
def test_random_text_only_raises_selector_error(text: str) -> None:
    try:
        sel = compile_selector(text)
    except SelectorError as exc:
        assert 0 <= exc.position <= len(text)
        return
    fields: dict[str, object] = {"a": 1, "b": "x", "x": True, "y": 2.5}
    if not text.strip():
        assert sel.matches(fields) is True  # a blank selector matches everything
        return
    negated = compile_selector(f"NOT ({text})")  # a valid selector can be negated
    again = compile_selector(text)
    for f in (fields, {}):
        result = sel.matches(f)
        # exactly a bool (a filter's answer), the same every time it is compiled
        assert type(result) is bool, (text, f, result)
        assert again.matches(f) is result, (text, f)
        # TRUE and FALSE exclude each other: a message never matches both a
        # selector and its negation (UNKNOWN matches neither)
        assert not (result and negated.matches(f)), (text, f)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=40))
def test_arbitrary_unicode_only_raises_selector_error(text: str) -> None:
    with contextlib.suppress(SelectorError):
        assert type(compile_selector(text).matches({"a": 1})) is bool, text


# --------------------------------------------------------------------------- selector_fields

ALL_HEADERS = frozenset(
    {
        "JMSMessageID",
        "JMSCorrelationID",
        "JMSType",
        "JMSPriority",
        "JMSDeliveryMode",
        "JMSTimestamp",
        "JMSExpiration",
        "JMSXGroupID",
        "JMSXGroupSeq",
        "JMSXDeliveryCount",
        "JMSXUserID",
    }
)


def _enc(**kw: Any) -> bytes:
    return bytes(Message(**kw).encode())


def test_fields_of_a_full_message() -> None:
    data = _enc(
        id="ID:abc:1:1:1-1",
        correlation_id="corr-1",
        subject="order",
        priority=7,
        durable=True,
        creation_time=1700000000.123,
        expiry_time=1700000100.5,
        group_id="g1",
        group_sequence=uint(7),
        delivery_count=2,
        user_id=b"bob",
        annotations={symbol("x-opt-jms-msg-type"): byte(5)},
        properties={"color": "red", "weight": 12.5, "n": int32(-3), "flag": False},
        body="hello",
    )
    fields = extractor(ALL_HEADERS | {"color", "weight", "n", "flag", "missing"})(data)
    assert fields == {
        "JMSMessageID": "ID:abc:1:1:1-1",
        "JMSCorrelationID": "corr-1",
        "JMSType": "order",
        "JMSPriority": 7,
        "JMSDeliveryMode": "PERSISTENT",
        "JMSTimestamp": 1700000000123,
        "JMSExpiration": 1700000100500,
        "JMSXGroupID": "g1",
        "JMSXGroupSeq": 7,
        "JMSXDeliveryCount": 3,
        "JMSXUserID": "bob",
        "color": "red",
        "weight": 12.5,
        "n": -3,
        "flag": False,
    }


def test_defaults_without_header_and_properties() -> None:
    fields = extractor(ALL_HEADERS | {"x"})(_enc(body="hello"))
    assert fields == {
        "JMSPriority": 4,
        "JMSDeliveryMode": "NON_PERSISTENT",
        "JMSXDeliveryCount": 1,
        "JMSTimestamp": 0,
        "JMSExpiration": 0,
    }
    # a header-less message as non-proton clients send it: only a data section
    assert extractor(frozenset({"JMSPriority", "JMSDeliveryMode"}))(
        bytes.fromhex("0053750a03616263".replace("0a", "a0"))
    ) == {"JMSPriority": 4, "JMSDeliveryMode": "NON_PERSISTENT"}


def test_only_requested_fields() -> None:
    data = _enc(id="x", priority=9, properties={"a": 1, "b": 2}, body="x")
    assert extractor(frozenset({"a"}))(data) == {"a": 1}
    assert extractor(frozenset({"JMSPriority"}))(data) == {"JMSPriority": 9}
    assert extractor(frozenset())(data) == {}
    assert extractor(frozenset({"zzz"}))(data) == {}


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("ID:plain", "ID:plain"),
        ("no-prefix", "no-prefix"),
        (ulong(42), "ID:AMQP_ULONG:42"),
        (ulong(2**64 - 1), f"ID:AMQP_ULONG:{2**64 - 1}"),
        (ulong(0), "ID:AMQP_ULONG:0"),
        (
            uuid.UUID("9c1e8a4e-2d3b-4a57-8f25-0123456789ab"),
            "ID:AMQP_UUID:9c1e8a4e-2d3b-4a57-8f25-0123456789ab",
        ),
        (b"\x01\xab\xff", "ID:AMQP_BINARY:01ABFF"),
    ],
)
def test_message_id_kinds(value: object, expected: str) -> None:
    ex = extractor(frozenset({"JMSMessageID", "JMSCorrelationID"}))
    assert ex(_enc(id=value, correlation_id=value, body="x")) == {
        "JMSMessageID": expected,
        "JMSCorrelationID": expected,
    }


def test_group_fields() -> None:
    ex = extractor(frozenset({"JMSXGroupID", "JMSXGroupSeq"}))
    assert ex(_enc(group_id="g", group_sequence=uint(0xFFFFFFFF), body="x")) == {
        "JMSXGroupID": "g",
        "JMSXGroupSeq": -1,
    }
    assert ex(_enc(group_id="g", group_sequence=uint(2**31), body="x"))["JMSXGroupSeq"] == -(2**31)
    # fallback to the application properties
    data = _enc(properties={"JMSXGroupID": "fb", "JMSXGroupSeq": 5, "other": 1}, body="x")
    assert ex(data) == {"JMSXGroupID": "fb", "JMSXGroupSeq": 5}
    # the properties win over the application properties
    data = _enc(
        group_id="p", group_sequence=uint(1), properties={"JMSXGroupID": "fb", "JMSXGroupSeq": 5}
    )
    assert ex(data) == {"JMSXGroupID": "p", "JMSXGroupSeq": 1}
    # proton writes group-sequence 0 after a group-id: that 0 wins
    data = _enc(group_id="p", properties={"JMSXGroupSeq": short(9)})
    assert ex(data) == {"JMSXGroupID": "p", "JMSXGroupSeq": 0}
    data = _enc(subject="s", properties={"JMSXGroupSeq": short(9)})
    assert ex(data) == {"JMSXGroupSeq": 9}
    assert ex(_enc(body="x")) == {}


def test_application_property_types() -> None:
    props = {
        "s": "str",
        "sym": symbol("sym"),
        "i": int32(2**31 - 1),
        "neg": -(2**40),
        "small": byte(-5),
        "sh": short(-300),
        "u": uint(4000000000),
        "f": float32(1.5),
        "d": 2.25,
        "t": True,
        "ts": timestamp(1700000000123),
        "bin": b"\x00\x01",
        "none": None,
        "list": [1, 2],
    }
    ex = extractor(frozenset(props))
    fields = ex(_enc(properties=props, body="x"))
    assert fields["s"] == "str" and fields["sym"] == "sym"
    assert fields["i"] == 2**31 - 1 and fields["neg"] == -(2**40)
    assert fields["small"] == -5 and fields["sh"] == -300 and fields["u"] == 4000000000
    assert fields["f"] == 1.5 and fields["d"] == 2.25 and fields["t"] is True
    assert fields["ts"] == 1700000000123
    assert fields["bin"] == b"\x00\x01"
    assert "none" not in fields
    # values the selector cannot compare are UNKNOWN, not errors
    assert truth("bin = 'x' OR list = 1 OR list IS NULL", fields) is None
    assert truth("bin IS NULL OR list IS NULL OR none IS NOT NULL", fields) is False


def test_end_to_end() -> None:
    data = _enc(
        durable=True,
        priority=6,
        group_id="order-12",
        subject="Invoice",
        properties={"color": "red", "weight": 42},
        body="x",
    )

    def check(text: str) -> bool:
        sel = compile_selector(text)
        return sel.matches(extractor(sel.identifiers)(data))

    assert check("color = 'red' AND weight > 10")
    assert not check("color = 'red' AND weight > 100")
    assert check("JMSXGroupID LIKE 'order-1%'")
    assert check("JMSPriority > 5 AND JMSDeliveryMode = 'PERSISTENT'")
    assert check("JMSType = 'Invoice' AND JMSXDeliveryCount = 1")
    assert check("missing IS NULL") and not check("missing = 'x'")
    assert check("JMSCorrelationID IS NULL AND JMSTimestamp = 0")


def test_bytearray_input() -> None:
    data = Message(properties={"a": 1}, body="x").encode()
    assert extractor(frozenset({"a"}))(bytearray(data)) == {"a": 1}


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_malformed_input_never_raises(data: st.DataObject) -> None:
    base = _enc(
        id=ulong(5),
        durable=True,
        group_id="g",
        user_id=b"\xff\xfe",
        properties={"color": "red", "JMSXGroupSeq": 3, "w": 1.5},
        body="x",
    )
    cut = data.draw(st.integers(0, len(base)))
    flips = data.draw(st.lists(st.tuples(st.integers(0, len(base) - 1), st.integers(0, 255))))
    raw = bytearray(base[:cut])
    for i, b in flips:
        if i < len(raw):
            raw[i] = b
    ex = extractor(ALL_HEADERS | {"color", "w"})
    fields = ex(bytes(raw))
    assert isinstance(fields, dict)


def test_invalid_user_id_is_absent() -> None:
    data = _enc(user_id=b"\xff\xfe", body="x")
    assert extractor(frozenset({"JMSXUserID"}))(data) == {}
