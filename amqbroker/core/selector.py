"""JMS message selectors (the ``jms-selector`` source filter), compiled to Python.

Theory of operation
===================

A selector is compiled once per consumer and evaluated on every message offered to
that consumer, so all the work that does not depend on the message happens at compile
time: `compile_selector` tokenizes the text, parses it with a Pratt (precedence
climbing) parser, type-checks it and generates the source of one Python function,
which it compiles with the builtin `compile`. Evaluating a message is one call of that
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

import math
import re
from collections.abc import Callable, Mapping
from typing import Final, cast

__all__ = ["MAX_DEPTH", "MAX_LENGTH", "Selector", "SelectorError", "compile_selector"]

MAX_LENGTH: Final = 65536
MAX_DEPTH: Final = 200

_HOIST_DEPTH = 24  # generated-code nesting above which a sub-expression gets its own def
_CHUNK = 8  # AND/OR terms per generated conditional chain


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


FieldsFunction = Callable[[Mapping[str, object]], bool]


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


# --------------------------------------------------------------------------- run-time helpers

_N = frozenset((int, float))
_COMPARABLE = frozenset((int, float, str, bool))


def _eq(a: object, b: object) -> bool | None:
    ta = type(a)
    tb = type(b)
    if ta is tb:
        return a == b if ta in _COMPARABLE else None
    if ta in _N and tb in _N:
        return a == b
    return None


def _ne(a: object, b: object) -> bool | None:
    r = _eq(a, b)
    return None if r is None else not r


def _div(a: float, b: float) -> float | None:
    if not b:
        return None
    if type(a) is int and type(b) is int:
        q = abs(a) // abs(b)
        return q if (a < 0) == (b < 0) else -q
    return a / b


def _between(e: object, lo: object, hi: object) -> bool | None:
    if type(e) not in _N:
        return None
    a = (e >= lo) if type(lo) in _N else None  # type: ignore[operator]
    b = (e <= hi) if type(hi) in _N else None  # type: ignore[operator]
    if a is False or b is False:
        return False
    if a is None or b is None:
        return None
    return True


_RUNTIME: dict[str, object] = {
    "_N": _N,
    "_eq": _eq,
    "_ne": _ne,
    "_div": _div,
    "_between": _between,
    "__builtins__": {"type": type, "str": str, "bool": bool, "OverflowError": OverflowError},
}

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


# --------------------------------------------------------------------------- code fragments

_BOOL = "b"  # True / False / None
_NUM = "n"  # int / float / None
_STR = "s"  # str (literals only)
_ANY = "a"  # an identifier (any value) or NULL; the code is always a simple name/None

_KIND_NAMES = {_BOOL: "a boolean", _NUM: "a number", _STR: "a string", _ANY: "a field"}


class _Frag:
    """Generated code for one sub-expression. `code` is always a Python atom."""

    __slots__ = (
        "code",
        "const",
        "depth",
        "is_const",
        "kind",
        "level",
        "names",
        "nary",
        "parts",
        "pos",
    )

    def __init__(
        self,
        code: str,
        kind: str,
        pos: int,
        *,
        depth: int = 0,
        level: int = 1,
        names: frozenset[str] = frozenset(),
        const: object = None,
        is_const: bool = False,
    ) -> None:
        self.code = code
        self.kind = kind
        self.pos = pos
        self.depth = depth  # nesting of the generated Python code
        self.level = level  # depth of the selector's expression tree
        self.names = names  # identifier locals the code reads
        self.const = const
        self.is_const = is_const
        self.nary: str | None = None  # "AND" / "OR" while the chain is still open
        self.parts: list[_Frag] = []


def _lit(value: object) -> str | None:
    """Python source for a constant, or None when it needs a global slot."""
    if value is None or isinstance(value, (bool, str)):
        return repr(value)
    if isinstance(value, int):
        if abs(value) >= 1 << 63:
            return None
        return f"({value})" if value < 0 else repr(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return None
        r = repr(value)
        return f"({r})" if value < 0 or r.startswith("-") else r
    return None


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


class _Compiler:
    def __init__(self, text: str, max_depth: int) -> None:
        self.text = text
        self.max_depth = max_depth
        self.toks = _tokenize(text)
        self.i = 0
        self.glob: dict[str, object] = dict(_RUNTIME)
        self.idents: dict[str, str] = {}  # identifier -> local name
        self.helpers: list[str] = []
        self.ntemp = 0

    # ---------------------------------------------------------------- errors and tokens

    def _near(self, pos: int) -> str | None:
        for t in self.toks:
            if t[2] == pos:
                return t[3][:40] if t[0] != "end" else None
        return self.text[pos : pos + 20] or None

    def err(self, pos: int, reason: str, kind: str = "syntax error") -> SelectorError:
        return SelectorError(pos, reason, self._near(pos), kind)

    def type_err(self, fr: _Frag, reason: str) -> SelectorError:
        return self.err(fr.pos, reason, "type error")

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
        fr = self.expr(0, 0)
        t = self.peek()
        if t[0] != "end":
            if t[0] == "op" and t[1] == ")":
                raise self.err(t[2], "unbalanced ')'")
            raise self.err(t[2], "expected an operator or the end of the selector")
        if fr.kind in {_NUM, _STR}:
            raise self.type_err(
                fr, f"the selector must be a boolean expression, not {_KIND_NAMES[fr.kind]}"
            )
        fr = self.use(self.as_bool(fr))
        if fr.is_const:
            return (_match_all if fr.const is True else _match_none), f"# constant {fr.const!r}\n"
        body = self.prelude(fr.names)
        src = "".join(self.helpers)
        src += (
            "def sel(f):\n    try:\n"
            + "".join("    " + line for line in body)
            + f"        return {fr.code} is True\n"
            + "    except OverflowError:\n        return False\n"
        )
        ns = self.glob
        exec(compile(src, "<selector>", "exec"), ns)
        return cast(FieldsFunction, ns["sel"]), src

    def expr(self, min_bp: int, depth: int) -> _Frag:
        if depth > self.max_depth:
            t = self.peek()
            raise self.err(
                t[2], f"expression nested too deeply (more than {self.max_depth} levels)"
            )
        t = self.next()
        kind, value, pos, _ = t
        lhs: _Frag
        if kind == "op" and value == "(":
            lhs = self.expr(0, depth + 1)
            self.expect_op(")", "')'")
        elif kind == "kw" and value == "NOT":
            if min_bp > _BP_NOT:
                raise self.err(pos, "NOT is not allowed here (use parentheses)")
            lhs = self.not_(self.expr(_BP_NOT, depth + 1), pos)
        elif kind == "op" and value in {"+", "-"}:
            lhs = self.negate(self.expr(_BP_UNARY, depth + 1), pos, value == "-")
        elif kind == "num":
            assert isinstance(value, (int, float))
            lhs = self.const(value, _NUM, pos)
        elif kind == "str":
            lhs = self.const(value, _STR, pos)
        elif kind == "kw" and value in {"TRUE", "FALSE"}:
            lhs = self.const(value == "TRUE", _BOOL, pos)
        elif kind == "kw" and value == "NULL":
            lhs = _Frag("None", _ANY, pos, is_const=True)
        elif kind == "id":
            assert isinstance(value, str)
            local = self.idents.get(value)
            if local is None:
                local = self.idents[value] = f"i{len(self.idents)}"
            lhs = _Frag(local, _ANY, pos, names=frozenset((local,)))
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
                lhs = self.logical(str(value), lhs, rhs, pos)
            elif value == "IS":
                neg = False
                if self.peek()[:2] == ("kw", "NOT"):
                    self.next()
                    neg = True
                self.expect_kw("NULL")
                lhs = self.is_null(lhs, neg, pos)
            elif kind == "kw":  # [NOT] LIKE / BETWEEN / IN
                neg = value == "NOT"
                if neg:
                    value = self.next()[1]
                if value == "LIKE":
                    lhs = self.like(lhs, neg, pos)
                elif value == "BETWEEN":
                    lo = self.expr(_BP_ADD, depth + 1)
                    self.expect_kw("AND")
                    hi = self.expr(_BP_ADD, depth + 1)
                    lhs = self.between(lhs, lo, hi, neg, pos)
                else:
                    lhs = self.in_(lhs, neg, pos)
            else:
                rhs = self.expr(bp + 1, depth + 1)
                assert isinstance(value, str)
                if bp == _BP_EQ:
                    lhs = self.equality(value, lhs, rhs, pos)
                elif bp == _BP_REL:
                    lhs = self.ordering(value, lhs, rhs, pos)
                else:
                    lhs = self.arith(value, lhs, rhs, pos)
        return lhs

    # ---------------------------------------------------------------- code generation

    def temp(self) -> str:
        self.ntemp += 1
        return f"t{self.ntemp}"

    def const(self, value: object, kind: str, pos: int, level: int = 1) -> _Frag:
        if value is None:
            return _Frag("None", _ANY, pos, is_const=True, level=level)
        code = _lit(value)
        if code is None:
            code = f"c{len(self.glob)}"
            self.glob[code] = value
        return _Frag(code, kind, pos, const=value, is_const=True, level=level)

    def prelude(self, names: frozenset[str]) -> list[str]:
        rev = {local: name for name, local in self.idents.items()}
        return [f"    {n} = f.get({rev[n]!r})\n" for n in sorted(names, key=lambda s: int(s[1:]))]

    def use(self, fr: _Frag) -> _Frag:
        """Close an open AND/OR chain and hoist code nested too deeply."""
        if fr.nary is not None:
            fr = self.render_nary(fr)
        if fr.depth > _HOIST_DEPTH:
            name = f"h{len(self.helpers)}"
            body = "".join(self.prelude(fr.names))
            self.helpers.append(f"def {name}(f):\n{body}    return {fr.code}\n")
            fr = _Frag(f"{name}(f)", fr.kind, fr.pos, depth=1, level=fr.level)
        return fr

    def make(
        self, code: str, kind: str, pos: int, parts: tuple[_Frag, ...], extra: int = 2
    ) -> _Frag:
        """A new fragment over `parts`; folded to a constant when they all are."""
        level = 1 + max(p.level for p in parts)
        if level > self.max_depth:
            raise self.err(pos, f"expression nested too deeply (more than {self.max_depth} levels)")
        pos = min(pos, *(p.pos for p in parts))  # where the expression starts
        if all(p.is_const for p in parts):
            try:
                value = eval(code, dict(self.glob), {})
            except OverflowError:
                value = None
            return self.const(value, kind, pos, level)
        fr = _Frag(
            code,
            kind,
            pos,
            depth=extra + max(p.depth for p in parts),
            level=level,
            names=frozenset().union(*(p.names for p in parts)),
        )
        return fr

    def as_bool(self, fr: _Frag) -> _Frag:
        if fr.kind == _BOOL:
            return fr
        if fr.kind == _ANY:
            x = fr.code
            return self.make(f"({x} if type({x}) is bool else None)", _BOOL, fr.pos, (fr,))
        raise self.type_err(fr, f"expected a boolean expression, found {_KIND_NAMES[fr.kind]}")

    def num_operand(self, fr: _Frag, what: str) -> tuple[str | None, str]:
        """(run-time condition that the value is a number, or None; the value's code)."""
        if fr.kind == _NUM:
            if fr.is_const:
                return None, fr.code
            t = self.temp()
            return f"({t} := {fr.code}) is not None", t
        if fr.kind == _ANY:
            return f"type({fr.code}) in _N", fr.code
        raise self.type_err(fr, f"{what} needs a number, found {_KIND_NAMES[fr.kind]}")

    def numeric(self, pyop: str, lhs: _Frag, rhs: _Frag, kind: str, pos: int, what: str) -> _Frag:
        lhs = self.use(lhs)
        rhs = self.use(rhs)
        cl, vl = self.num_operand(lhs, what)
        cr, vr = self.num_operand(rhs, what)
        expr = f"_div({vl}, {vr})" if pyop == "/" else f"({vl} {pyop} {vr})"
        conds = [c for c in (cl, cr) if c is not None]
        code = f"({expr} if {' and '.join(conds)} else None)" if conds else expr
        return self.make(code, kind, pos, (lhs, rhs))

    def arith(self, op: str, lhs: _Frag, rhs: _Frag, pos: int) -> _Frag:
        return self.numeric(op, lhs, rhs, _NUM, pos, f"'{op}'")

    def negate(self, fr: _Frag, pos: int, minus: bool) -> _Frag:
        fr = self.use(fr)
        cond, v = self.num_operand(fr, "unary " + ("'-'" if minus else "'+'"))
        expr = f"(-{v})" if minus else v
        code = f"({expr} if {cond} else None)" if cond else expr
        return self.make(code, _NUM, pos, (fr,))

    def ordering(self, op: str, lhs: _Frag, rhs: _Frag, pos: int) -> _Frag:
        for fr in (lhs, rhs):
            if fr.kind in {_STR, _BOOL}:
                raise self.type_err(
                    fr, f"strings and booleans can only be compared with = and <>, not {op}"
                )
        return self.numeric(op, lhs, rhs, _BOOL, pos, f"'{op}'")

    def equality(self, op: str, lhs: _Frag, rhs: _Frag, pos: int) -> _Frag:
        lhs = self.use(lhs)
        rhs = self.use(rhs)
        pyop = "==" if op == "=" else "!="
        kl, kr = lhs.kind, rhs.kind
        if kl == _ANY and kr == _ANY:
            fn = "_eq" if op == "=" else "_ne"
            return self.make(f"{fn}({lhs.code}, {rhs.code})", _BOOL, pos, (lhs, rhs))
        if _NUM in {kl, kr} and kl in {_NUM, _ANY} and kr in {_NUM, _ANY}:
            return self.numeric(pyop, lhs, rhs, _BOOL, pos, f"'{op}'")
        conds: list[str] = []
        vals: list[str] = []
        if _ANY in {kl, kr} or kl == kr:
            other = kr if kl == _ANY else kl
            for fr in (lhs, rhs):
                if fr.kind == _ANY:
                    conds.append(f"type({fr.code}) is {'str' if other == _STR else 'bool'}")
                    vals.append(fr.code)
                elif fr.is_const:
                    vals.append(fr.code)
                else:  # a boolean expression: may be UNKNOWN
                    t = self.temp()
                    conds.append(f"({t} := {fr.code}) is not None")
                    vals.append(t)
            expr = f"({vals[0]} {pyop} {vals[1]})"
            code = f"({expr} if {' and '.join(conds)} else None)" if conds else expr
            return self.make(code, _BOOL, pos, (lhs, rhs))
        # a string, number or boolean compared with another type: always UNKNOWN
        return self.make("None", _BOOL, pos, (lhs, rhs))

    def not_(self, fr: _Frag, pos: int) -> _Frag:
        fr = self.use(fr)
        if fr.kind == _ANY:
            x = fr.code
            return self.make(f"((not {x}) if type({x}) is bool else None)", _BOOL, pos, (fr,))
        fr = self.as_bool(fr)
        t = self.temp()
        return self.make(f"(None if ({t} := {fr.code}) is None else (not {t}))", _BOOL, pos, (fr,))

    def logical(self, op: str, lhs: _Frag, rhs: _Frag, pos: int) -> _Frag:
        """Append to (or open) an n-ary AND/OR chain; its `level` is that of its deepest
        term until it is rendered."""
        if lhs.nary == op:
            fr = lhs
        else:
            lhs = self.as_bool(self.use(lhs))
            fr = _Frag("", _BOOL, lhs.pos, level=lhs.level)
            fr.nary = op
            fr.parts.append(lhs)
        if rhs.nary == op:
            fr.parts.extend(rhs.parts)
        else:
            rhs = self.as_bool(self.use(rhs))
            fr.parts.append(rhs)
        fr.level = max(fr.level, rhs.level)
        if fr.level + 1 > self.max_depth:
            raise self.err(pos, f"expression nested too deeply (more than {self.max_depth} levels)")
        return fr

    def render_nary(self, fr: _Frag) -> _Frag:
        op = fr.nary
        stop = op == "OR"  # the value that decides the result
        parts: list[_Frag] = []
        for p in fr.parts:
            if p.is_const:
                if p.const is stop:
                    return self.const(stop, _BOOL, fr.pos, fr.level + 1)
                if p.const is (not stop):
                    continue
            parts.append(p)
        if not parts:
            return self.const(not stop, _BOOL, fr.pos, fr.level + 1)
        while len(parts) > 1:
            grouped: list[_Frag] = []
            for k in range(0, len(parts), _CHUNK):
                chunk = [self.use(p) for p in parts[k : k + _CHUNK]]
                if len(chunk) == 1:
                    grouped.append(chunk[0])
                    continue
                temps = [self.temp() for _ in chunk]
                tests = " ".join(
                    f"{stop} if ({t} := {p.code}) is {stop} else"
                    for t, p in zip(temps, chunk, strict=True)
                )
                if stop:
                    tail = f"(None if {' or '.join(f'{t} is None' for t in temps)} else False)"
                else:
                    tail = f"({' and '.join(temps)})"
                grouped.append(
                    _Frag(
                        f"({tests} {tail})",
                        _BOOL,
                        chunk[0].pos,
                        depth=2 + len(chunk) + max(p.depth for p in chunk),
                        level=fr.level + 1,
                        names=frozenset().union(*(p.names for p in chunk)),
                    )
                )
            parts = grouped
        return parts[0]

    def is_null(self, fr: _Frag, neg: bool, pos: int) -> _Frag:
        fr = self.use(fr)
        if fr.is_const:  # folded here: `5 is None` would be a SyntaxWarning
            return self.const((fr.const is None) != neg, _BOOL, pos, fr.level + 1)
        return self.make(f"({fr.code} is {'not ' if neg else ''}None)", _BOOL, pos, (fr,))

    def string_operand(self, fr: _Frag, what: str) -> _Frag:
        fr = self.use(fr)
        if fr.kind not in {_STR, _ANY}:
            raise self.type_err(fr, f"{what} needs a string, found {_KIND_NAMES[fr.kind]}")
        return fr

    def in_(self, fr: _Frag, neg: bool, pos: int) -> _Frag:
        fr = self.string_operand(fr, "IN")
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
        x = fr.code
        lit = "{" + ", ".join(repr(s) for s in dict.fromkeys(items)) + "}"
        if len(items) > 8:  # a global frozenset rather than a huge literal
            lit = f"c{len(self.glob)}"
            self.glob[lit] = frozenset(items)
        test = f"({x} {'not in' if neg else 'in'} {lit})"
        return self.make(f"({test} if type({x}) is str else None)", _BOOL, pos, (fr,))

    def like(self, fr: _Frag, neg: bool, pos: int) -> _Frag:
        fr = self.string_operand(fr, "LIKE")
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
        # pattern -> items: a str (literal run), "%" marker None, "_" marker 1
        items: list[str | int | None] = []
        lit: list[str] = []
        k = 0
        while k < len(pattern):
            ch = pattern[k]
            if ch == escape:
                k += 1
                if k >= len(pattern):
                    raise self.err(pt[2], "the LIKE pattern ends with the escape character")
                lit.append(pattern[k])
            elif ch in "%_":
                if lit:
                    items.append("".join(lit))
                    lit = []
                if ch == "%":
                    if not items or items[-1] is not None:
                        items.append(None)
                else:
                    items.append(1)
            else:
                lit.append(ch)
            k += 1
        if lit:
            items.append("".join(lit))
        x = fr.code
        shape = tuple("s" if isinstance(i, str) else "%" if i is None else "_" for i in items)
        if shape == ():
            test = f"({x} == '')"
        elif shape == ("%",):
            test = "True"
        elif shape == ("s",):
            test = f"({x} == {items[0]!r})"
        elif shape == ("s", "%"):
            test = f"{x}.startswith({items[0]!r})"
        elif shape == ("%", "s"):
            test = f"{x}.endswith({items[1]!r})"
        elif shape == ("%", "s", "%"):
            test = f"({items[1]!r} in {x})"
        else:
            regex = "".join(
                re.escape(i) if isinstance(i, str) else ".*" if i is None else "." for i in items
            )
            name = f"c{len(self.glob)}"
            self.glob[name] = re.compile(regex, re.DOTALL).fullmatch
            test = f"({name}({x}) is not None)"
        if neg:
            test = f"(not {test})"
        return self.make(f"({test} if type({x}) is str else None)", _BOOL, pos, (fr,))

    def between(self, e: _Frag, lo: _Frag, hi: _Frag, neg: bool, pos: int) -> _Frag:
        e, lo, hi = self.use(e), self.use(lo), self.use(hi)
        for fr in (e, lo, hi):
            if fr.kind not in {_NUM, _ANY}:
                raise self.type_err(fr, f"BETWEEN needs numbers, found {_KIND_NAMES[fr.kind]}")
        if lo.is_const and hi.is_const and lo.kind == _NUM and hi.kind == _NUM and not e.is_const:
            cond, v = self.num_operand(e, "BETWEEN")
            test = f"({lo.code} <= {v} <= {hi.code})"
            if neg:
                test = f"(not {test})"
            code = f"({test} if {cond} else None)"
            return self.make(code, _BOOL, pos, (e, lo, hi))
        code = f"_between({e.code}, {lo.code}, {hi.code})"
        fr = self.make(code, _BOOL, pos, (e, lo, hi))
        return self.not_(fr, pos) if neg else fr


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
    c = _Compiler(text, max_depth)
    fn, src = c.compile()
    return Selector(text, frozenset(c.idents), fn, src)
