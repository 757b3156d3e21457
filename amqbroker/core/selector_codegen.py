"""Code generation for JMS selectors: the back half of `amqbroker.core.selector`.

`amqbroker.core.selector` tokenizes and parses the text (its docstring is the theory of
operation: the grammar, the values, the shape of the generated code); for every
sub-expression its parser calls a `_CodeGen` method, which type-checks the operands,
folds constants and returns the Python code that evaluates it (a `_Frag`).
`_CodeGen.function` compiles the code of the whole selector into one function. The
run-time helpers that code calls (`_eq`, `_div` ...) are here: they are that function's
globals.

Nothing here reads tokens: errors are made by the `err` function the parser gives (it
knows the text near a position).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import cast

FieldsFunction = Callable[[Mapping[str, object]], bool]
#: makes the error to raise: (position, reason, kind: "syntax error" or "type error")
ErrorFunction = Callable[[int, str, str], Exception]

_HOIST_DEPTH = 24  # generated-code nesting above which a sub-expression gets its own def
_CHUNK = 8  # AND/OR terms per generated conditional chain

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


class _CodeGen:
    """The code of one selector: its constants and helpers (`glob`), the locals of its
    identifiers (`idents`), its hoisted helper functions and temporaries."""

    def __init__(self, max_depth: int, err: ErrorFunction) -> None:
        self.max_depth = max_depth
        self._err = err
        self.glob: dict[str, object] = dict(_RUNTIME)
        self.idents: dict[str, str] = {}  # identifier -> local name
        self.helpers: list[str] = []
        self.ntemp = 0

    def err(self, pos: int, reason: str, kind: str = "syntax error") -> Exception:
        return self._err(pos, reason, kind)

    def type_err(self, fr: _Frag, reason: str) -> Exception:
        return self.err(fr.pos, reason, "type error")

    def function(self, fr: _Frag) -> tuple[FieldsFunction, str]:
        """The selector whose code is `fr` (rendered by `use`, not a constant) as a
        Python function, and its source."""
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

    def field(self, name: str, pos: int) -> _Frag:
        """Identifier `name`: a local read once at the top of the function."""
        local = self.idents.get(name)
        if local is None:
            local = self.idents[name] = f"i{len(self.idents)}"
        return _Frag(local, _ANY, pos, names=frozenset((local,)))

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

    def in_(self, fr: _Frag, items: list[str], neg: bool, pos: int) -> _Frag:
        """`fr` [NOT] IN `items`; `fr` is checked by `string_operand`."""
        x = fr.code
        lit = "{" + ", ".join(repr(s) for s in dict.fromkeys(items)) + "}"
        if len(items) > 8:  # a global frozenset rather than a huge literal
            lit = f"c{len(self.glob)}"
            self.glob[lit] = frozenset(items)
        test = f"({x} {'not in' if neg else 'in'} {lit})"
        return self.make(f"({test} if type({x}) is str else None)", _BOOL, pos, (fr,))

    def like(
        self, fr: _Frag, pattern: str, pattern_pos: int, escape: str | None, neg: bool, pos: int
    ) -> _Frag:
        """`fr` [NOT] LIKE `pattern` [ESCAPE `escape`]; `fr` is checked by
        `string_operand`, the pattern literal is at `pattern_pos`."""
        # pattern -> items: a str (literal run), "%" marker None, "_" marker 1
        items: list[str | int | None] = []
        lit: list[str] = []
        k = 0
        while k < len(pattern):
            ch = pattern[k]
            if ch == escape:
                k += 1
                if k >= len(pattern):
                    raise self.err(pattern_pos, "the LIKE pattern ends with the escape character")
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
