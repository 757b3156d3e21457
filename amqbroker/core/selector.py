"""JMS message selectors (the ``jms-selector`` source filter), compiled to Python.

Theory of operation
===================

A selector is compiled once per consumer and evaluated on every message offered to
that consumer, so all the work that does not depend on the message happens at compile
time: `compile_selector` tokenizes the text, parses it with a Pratt (precedence
climbing) parser, type-checks it and generates the source of one Python function,
which it compiles with the builtin `compile` (the type checks and the code generation
are `amqbroker.core.selector_codegen`). Evaluating a message is one call of that
function: a ``fields.get`` per identifier, then plain Python comparisons with inline
type tests. There is no tree walking and no dispatch per node at run time.

Grammar (Jakarta Messaging 3.1, section 3.8.1), loosest binding first::

    OR  <  AND  <  NOT  <  = <> IS [NOT] NULL  <  < > <= >= [NOT] LIKE / BETWEEN / IN
        <  + -  <  * /  <  unary + -

Equality binds looser than the relational operators (as in ActiveMQ's grammar), so
``a = b > 1`` reads ``a = (b > 1)``. Keywords (NULL TRUE FALSE NOT AND OR BETWEEN LIKE
IN IS ESCAPE) are case-insensitive; identifiers are case-sensitive Java identifiers.
Literals: strings ``'it''s'``; exact numerics ``57``, ``0x1F``, ``017`` (octal), with an
optional ``L``; approximate numerics ``7.``, ``.5``, ``1e3``, ``-57.9E2``, ``1.5F``,
``2D``. ``NULL`` is accepted as a literal (as ActiveMQ does): every comparison with it is
UNKNOWN.

Values and three-valued logic
-----------------------------
A boolean sub-expression evaluates to True, False or None (UNKNOWN). A field that is
missing from the mapping is NULL (None). Numbers are Python ``int`` (exact) and
``float`` (approximate); ``bool`` is *not* a number here even though Python says it is.
Any operation whose operand is NULL or of the wrong type yields NULL/UNKNOWN: comparing
a string with a number, ordering strings or booleans held in fields, arithmetic on a
string, a value of an unsupported type (bytes, uuid ...). Integer division truncates
toward zero as in Java; division by zero (integer or float) is UNKNOWN. ``x BETWEEN a
AND b`` is exactly ``x >= a AND x <= b``; NOT/AND/OR follow the SQL truth tables.
`Selector.matches` is True only when the whole expression is TRUE.

Static type errors are compile errors: strings and booleans may only be compared with
``=`` and ``<>``; arithmetic needs numbers; AND/OR/NOT need booleans; LIKE and IN need a
string operand; LIKE's pattern and IN's list are string literals. A bare identifier is
allowed wherever a boolean, number or string is (its type is only known at run time),
and the whole selector may be a bare identifier (TRUE only when the field is boolean
true).

Generated code
--------------
Every sub-expression becomes a Python *atom* (a name, a literal, a call or a
parenthesised expression). Identifiers are read once into locals (``i0 = f.get('x')``)
at the top of the function. Temporaries use assignment expressions, e.g. AND is::

    (False if (t1 := A) is False else False if (t2 := B) is False else (t1 and t2))

AND/OR chains are flattened into one n-ary node and generated in chunks of 8, so a
selector with thousands of ``OR`` terms stays shallow. Python's own parser has nesting
limits, so a sub-expression whose generated code is nested deeper than ~24 levels is
hoisted into a helper function (``def h3(f): ...``) called from its parent. Constant
sub-expressions are folded at compile time.

Limits
------
The text may be at most ``max_length`` characters and the expression tree at most
``max_depth`` levels deep (parentheses count too); both raise `SelectorError`, as does
every syntax or type error. The error carries the 0-based character ``position`` where
the problem was detected. Integer arithmetic is unbounded (Java would wrap longs at 64
bits); an arithmetic overflow while evaluating (a huge integer mixed with a float)
makes the selector not match.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from amqbroker.core.selector_codegen import (
    _ANY,
    _BOOL,
    _KIND_NAMES,
    _NUM,
    _STR,
    FieldsFunction,
    _CodeGen,
    _Frag,
)

__all__ = ["MAX_DEPTH", "MAX_LENGTH", "Selector", "SelectorError", "compile_selector"]

MAX_LENGTH: Final = 65536
MAX_DEPTH: Final = 200


class SelectorError(ValueError):
    """An invalid selector. ``position`` is the 0-based character offset of the error,
    ``reason`` says what is wrong, ``near`` is the text found there (None at the end)."""

    def __init__(
        self, position: int, reason: str, near: str | None = None, kind: str = "syntax error"
    ) -> None:
        self.position = position
        self.reason = reason
        self.near = near
        where = f"near {near!r}" if near is not None else "at the end of the selector"
        super().__init__(f"{kind} at position {position} ({where}): {reason}")


class Selector:
    """A compiled selector. ``matches(fields)`` is the generated function itself (an
    instance attribute, so calling it costs no extra Python frame)."""

    __slots__ = ("identifiers", "matches", "source", "text")

    text: str
    identifiers: frozenset[str]
    source: str
    matches: FieldsFunction

    def __init__(
        self, text: str, identifiers: frozenset[str], matches: FieldsFunction, source: str
    ) -> None:
        self.text = text
        self.identifiers = identifiers
        self.matches = matches
        self.source = source

    def __repr__(self) -> str:
        return f"Selector({self.text!r})"


def _match_all(fields: Mapping[str, object]) -> bool:
    return True


def _match_none(fields: Mapping[str, object]) -> bool:
    return False


# --------------------------------------------------------------------------- tokens

_KEYWORDS = frozenset(
    ("NULL", "TRUE", "FALSE", "NOT", "AND", "OR", "BETWEEN", "LIKE", "IN", "IS", "ESCAPE")
)
_SPACE = frozenset(" \t\n\r\f")
_DIGITS = frozenset("0123456789")
_HEX = frozenset("0123456789abcdefABCDEF")

# token: (kind, value, position, source text); kinds: num str id kw op end
_Tok = tuple[str, object, int, str]


def _ident_part(c: str) -> bool:
    return c.isalnum() or c in "_$"


def _tokenize(text: str) -> list[_Tok]:
    toks: list[_Tok] = []
    n = len(text)
    i = 0
    while i < n:
        c = text[i]
        if c in _SPACE:
            i += 1
            continue
        start = i
        if c == "'":
            parts: list[str] = []
            j = i + 1
            while True:
                k = text.find("'", j)
                if k < 0:
                    raise SelectorError(
                        start, "unterminated string literal", text[start : start + 20]
                    )
                parts.append(text[j:k])
                if k + 1 < n and text[k + 1] == "'":
                    parts.append("'")
                    j = k + 2
                    continue
                i = k + 1
                break
            toks.append(("str", "".join(parts), start, text[start:i]))
        elif c in _DIGITS or (c == "." and i + 1 < n and text[i + 1] in _DIGITS):
            i, value = _number(text, i)
            toks.append(("num", value, start, text[start:i]))
        elif c.isalpha() or c in "_$":
            i += 1
            while i < n and _ident_part(text[i]):
                i += 1
            word = text[start:i]
            up = word.upper()
            if up in _KEYWORDS:
                toks.append(("kw", up, start, word))
            else:
                toks.append(("id", word, start, word))
        elif c in "<>":
            two = text[i : i + 2]
            if two in {"<>", "<=", ">="}:
                i += 2
                toks.append(("op", two, start, two))
            else:
                i += 1
                toks.append(("op", c, start, c))
        elif c in "=+-*/(),":
            i += 1
            toks.append(("op", c, start, c))
        else:
            raise SelectorError(start, f"unexpected character {c!r}", c)
    toks.append(("end", None, n, ""))
    return toks


def _number(text: str, i: int) -> tuple[int, int | float]:
    """Scan the numeric literal at `i`; (end offset, value)."""
    n = len(text)
    start = i
    j = i
    while j < n and text[j] in _DIGITS:
        j += 1
    if text[i] == "0" and j == i + 1 and j < n and text[j] in "xX":
        k = j + 1
        while k < n and text[k] in _HEX:
            k += 1
        if k == j + 1:
            raise SelectorError(start, "invalid hexadecimal literal", text[start : k + 1])
        value = int(text[j + 1 : k], 16)
        if k < n and text[k] in "lL":
            k += 1
        return k, value
    is_float = False
    if j < n and text[j] == ".":
        is_float = True
        j += 1
        while j < n and text[j] in _DIGITS:
            j += 1
    if j < n and text[j] in "eE":
        k = j + 1
        if k < n and text[k] in "+-":
            k += 1
        if k < n and text[k] in _DIGITS:
            is_float = True
            j = k
            while j < n and text[j] in _DIGITS:
                j += 1
    lit = text[start:j]
    if j < n and text[j] in "fFdD":
        is_float = True
        j += 1
    elif not is_float and j < n and text[j] in "lL":
        j += 1
    if is_float:
        return j, float(lit)
    octal = len(lit) > 1 and lit[0] == "0"
    if octal and ("8" in lit or "9" in lit):
        raise SelectorError(start, "invalid octal literal", text[start:j])
    try:
        return j, int(lit, 8 if octal else 10)
    except ValueError:  # more digits than int() accepts
        raise SelectorError(start, "numeric literal too long", text[start : start + 20]) from None


_NEGATABLE = frozenset((("kw", "LIKE"), ("kw", "BETWEEN"), ("kw", "IN")))

# binding powers
_BP_OR = 1
_BP_AND = 2
_BP_NOT = 3
_BP_EQ = 4
_BP_REL = 5
_BP_ADD = 6
_BP_MUL = 7
_BP_UNARY = 8


class _Parser:
    """The parser of one selector: a Pratt parser over its tokens that hands every
    sub-expression to its code generator (`gen`)."""

    def __init__(self, text: str, max_depth: int) -> None:
        self.text = text
        self.max_depth = max_depth
        self.toks = _tokenize(text)
        self.i = 0
        self.gen = _CodeGen(max_depth, self.err)

    # ---------------------------------------------------------------- errors and tokens

    def _near(self, pos: int) -> str | None:
        for t in self.toks:
            if t[2] == pos:
                return t[3][:40] if t[0] != "end" else None
        return self.text[pos : pos + 20] or None

    def err(self, pos: int, reason: str, kind: str = "syntax error") -> SelectorError:
        return SelectorError(pos, reason, self._near(pos), kind)

    def next(self) -> _Tok:
        t = self.toks[self.i]
        if t[0] != "end":
            self.i += 1
        return t

    def peek(self, k: int = 0) -> _Tok:
        return self.toks[min(self.i + k, len(self.toks) - 1)]

    def expect_op(self, op: str, what: str) -> _Tok:
        t = self.next()
        if t[0] != "op" or t[1] != op:
            raise self.err(t[2], f"expected {what}")
        return t

    def expect_kw(self, kw: str) -> _Tok:
        t = self.next()
        if t[0] != "kw" or t[1] != kw:
            raise self.err(t[2], f"expected {kw}")
        return t

    def expect_str(self, what: str) -> _Tok:
        t = self.next()
        if t[0] != "str":
            raise self.err(t[2], f"expected a string literal ({what})")
        return t

    # ---------------------------------------------------------------- parser

    def compile(self) -> tuple[FieldsFunction, str]:
        g = self.gen
        fr = self.expr(0, 0)
        t = self.peek()
        if t[0] != "end":
            if t[0] == "op" and t[1] == ")":
                raise self.err(t[2], "unbalanced ')'")
            raise self.err(t[2], "expected an operator or the end of the selector")
        if fr.kind in {_NUM, _STR}:
            raise g.type_err(
                fr, f"the selector must be a boolean expression, not {_KIND_NAMES[fr.kind]}"
            )
        fr = g.use(g.as_bool(fr))
        if fr.is_const:
            return (_match_all if fr.const is True else _match_none), f"# constant {fr.const!r}\n"
        return g.function(fr)

    def expr(self, min_bp: int, depth: int) -> _Frag:
        if depth > self.max_depth:
            t = self.peek()
            raise self.err(
                t[2], f"expression nested too deeply (more than {self.max_depth} levels)"
            )
        g = self.gen
        t = self.next()
        kind, value, pos, _ = t
        lhs: _Frag
        if kind == "op" and value == "(":
            lhs = self.expr(0, depth + 1)
            self.expect_op(")", "')'")
        elif kind == "kw" and value == "NOT":
            if min_bp > _BP_NOT:
                raise self.err(pos, "NOT is not allowed here (use parentheses)")
            lhs = g.not_(self.expr(_BP_NOT, depth + 1), pos)
        elif kind == "op" and value in {"+", "-"}:
            lhs = g.negate(self.expr(_BP_UNARY, depth + 1), pos, value == "-")
        elif kind == "num":
            assert isinstance(value, (int, float))
            lhs = g.const(value, _NUM, pos)
        elif kind == "str":
            lhs = g.const(value, _STR, pos)
        elif kind == "kw" and value in {"TRUE", "FALSE"}:
            lhs = g.const(value == "TRUE", _BOOL, pos)
        elif kind == "kw" and value == "NULL":
            lhs = _Frag("None", _ANY, pos, is_const=True)
        elif kind == "id":
            assert isinstance(value, str)
            lhs = g.field(value, pos)
        else:
            raise self.err(pos, "expected an expression")

        while True:
            t = self.peek()
            kind, value, pos, _ = t
            if kind == "kw":
                if value == "OR":
                    bp = _BP_OR
                elif value == "AND":
                    bp = _BP_AND
                elif value == "IS":
                    bp = _BP_EQ
                elif value in {"LIKE", "BETWEEN", "IN"} or (
                    value == "NOT" and self.peek(1)[:2] in _NEGATABLE
                ):
                    bp = _BP_REL
                else:
                    break
            elif kind == "op":
                if value in {"=", "<>"}:
                    bp = _BP_EQ
                elif value in {"<", ">", "<=", ">="}:
                    bp = _BP_REL
                elif value in {"+", "-"}:
                    bp = _BP_ADD
                elif value in {"*", "/"}:
                    bp = _BP_MUL
                else:
                    break
            else:
                break
            if bp < min_bp:
                break
            self.next()
            if value in {"OR", "AND"}:
                rhs = self.expr(bp + 1, depth + 1)
                lhs = g.logical(str(value), lhs, rhs, pos)
            elif value == "IS":
                neg = False
                if self.peek()[:2] == ("kw", "NOT"):
                    self.next()
                    neg = True
                self.expect_kw("NULL")
                lhs = g.is_null(lhs, neg, pos)
            elif kind == "kw":  # [NOT] LIKE / BETWEEN / IN
                neg = value == "NOT"
                if neg:
                    value = self.next()[1]
                if value == "LIKE":
                    fr = g.string_operand(lhs, "LIKE")
                    pattern, pattern_pos, escape = self.like_pattern()
                    lhs = g.like(fr, pattern, pattern_pos, escape, neg, pos)
                elif value == "BETWEEN":
                    lo = self.expr(_BP_ADD, depth + 1)
                    self.expect_kw("AND")
                    hi = self.expr(_BP_ADD, depth + 1)
                    lhs = g.between(lhs, lo, hi, neg, pos)
                else:
                    fr = g.string_operand(lhs, "IN")
                    lhs = g.in_(fr, self.in_list(), neg, pos)
            else:
                rhs = self.expr(bp + 1, depth + 1)
                assert isinstance(value, str)
                if bp == _BP_EQ:
                    lhs = g.equality(value, lhs, rhs, pos)
                elif bp == _BP_REL:
                    lhs = g.ordering(value, lhs, rhs, pos)
                else:
                    lhs = g.arith(value, lhs, rhs, pos)
        return lhs

    def in_list(self) -> list[str]:
        """The string literals of an IN list, from its '('."""
        self.expect_op("(", "'(' after IN")
        items: list[str] = []
        while True:
            t = self.expect_str("an element of the IN list")
            assert isinstance(t[1], str)
            items.append(t[1])
            t = self.next()
            if t[0] == "op" and t[1] == ")":
                break
            if t[0] != "op" or t[1] != ",":
                raise self.err(t[2], "expected ',' or ')' in the IN list")
        return items

    def like_pattern(self) -> tuple[str, int, str | None]:
        """A LIKE pattern and its optional ESCAPE: (pattern, its position, escape)."""
        pt = self.expect_str("the LIKE pattern")
        pattern = pt[1]
        assert isinstance(pattern, str)
        escape: str | None = None
        if self.peek()[:2] == ("kw", "ESCAPE"):
            self.next()
            et = self.expect_str("the ESCAPE character")
            assert isinstance(et[1], str)
            if len(et[1]) != 1:
                raise self.err(et[2], "the ESCAPE character must be a single character")
            escape = et[1]
        return pattern, pt[2], escape


def compile_selector(
    text: str, *, max_length: int = MAX_LENGTH, max_depth: int = MAX_DEPTH
) -> Selector:
    """Compile a JMS selector; raise SelectorError when it is invalid or too big.

    An empty or blank text gives a selector that matches every message."""
    if len(text) > max_length:
        raise SelectorError(
            max_length,
            f"the selector is longer than {max_length} characters",
            text[max_length:][:20],
        )
    if not text.strip():
        return Selector(text, frozenset(), _match_all, "# empty selector\n")
    c = _Parser(text, max_depth)
    fn, src = c.compile()
    return Selector(text, frozenset(c.gen.idents), fn, src)
