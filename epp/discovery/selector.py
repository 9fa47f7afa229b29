"""Kubernetes label selectors (pure): parse the string form and match a label map.

The grammar is the one the API server's `labelSelector` parameter and the reference EPP's
`--endpoint-selector` accept (k8s `labels.Parse`): comma-separated requirements, all of which must
hold -- `key`, `!key`, `key=value`, `key==value`, `key!=value`, `key in (v1,v2)`,
`key notin (v1,v2)`, `key>n`, `key<n`. Keys are qualified names (`[prefix/]name`), values label
values (at most 63 characters, empty allowed). A label missing from the map satisfies `!=` and
`notin` (as in Kubernetes). `str()` gives the canonical form sent to the API server: requirements
sorted by key, set values sorted.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

EXISTS, NOT_EXISTS, EQ, NE, IN, NOT_IN, GT, LT = "exists", "!", "=", "!=", "in", "notin", ">", "<"
_SYMBOLS = ("!=", "==", "!", "=", ">", "<", "(", ")", ",")  # two-character symbols first
_OPERATORS = {"=": EQ, "==": EQ, "!=": NE, "in": IN, "notin": NOT_IN, ">": GT, "<": LT}
_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_INTEGER = re.compile(r"[+-]?[0-9]+")
_END = "end of string"


class SelectorError(ValueError):
    """The text is not a label selector; the message says where and why."""


@dataclass(frozen=True, slots=True, order=True)
class Requirement:
    key: str
    op: str  # EXISTS, NOT_EXISTS, EQ, NE, IN, NOT_IN, GT, LT
    values: tuple[str, ...] = ()  # sorted; one for EQ, NE, GT, LT; at least one for IN, NOT_IN

    def matches(self, labels: Mapping[str, Any]) -> bool:
        present = self.key in labels
        value = labels.get(self.key)
        if self.op == EXISTS:
            return present
        if self.op == NOT_EXISTS:
            return not present
        if self.op in (EQ, IN):
            return isinstance(value, str) and value in self.values
        if self.op in (NE, NOT_IN):
            return not (isinstance(value, str) and value in self.values)
        if not isinstance(value, str) or not _INTEGER.fullmatch(value):
            return False  # GT / LT: only integer label values compare
        limit = int(self.values[0])
        return int(value) > limit if self.op == GT else int(value) < limit

    def __str__(self) -> str:
        if self.op == EXISTS:
            return self.key
        if self.op == NOT_EXISTS:
            return f"!{self.key}"
        if self.op in (IN, NOT_IN):
            return f"{self.key} {self.op} ({','.join(self.values)})"
        return f"{self.key}{self.op}{self.values[0]}"


@dataclass(frozen=True, slots=True)
class LabelSelector:
    requirements: tuple[Requirement, ...]  # sorted; a label map matches when it meets all of them

    @classmethod
    def from_labels(cls, labels: Iterable[tuple[str, str]]) -> LabelSelector:
        """Equality on every (label, value) pair, as an InferencePool's `matchLabels`."""
        return cls(tuple(sorted(Requirement(k, EQ, (v,)) for k, v in labels)))

    def matches(self, labels: Mapping[str, Any]) -> bool:
        return all(r.matches(labels) for r in self.requirements)

    def __str__(self) -> str:
        return ",".join(map(str, self.requirements))


def parse_selector(text: str) -> LabelSelector:
    """The selector `text` describes; SelectorError when it is malformed or empty."""
    tokens = _tokens(text)
    if not tokens:
        raise SelectorError("empty selector (it would select every pod of the namespace)")
    reqs: list[Requirement] = []
    i = 0
    while True:
        req, i = _requirement(tokens, i)
        reqs.append(req)
        if i == len(tokens):
            return LabelSelector(tuple(sorted(reqs)))
        if tokens[i] != ",":
            raise SelectorError(f"found {tokens[i]!r} after {req}, expected ',' or {_END}")
        i += 1
        if i == len(tokens):
            raise SelectorError(f"found {_END} after ',', expected a requirement")


def _tokens(text: str) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(text):
        if text[i].isspace():
            i += 1
            continue
        symbol = next((s for s in _SYMBOLS if text.startswith(s, i)), None)
        if symbol is not None:
            out.append(symbol)
            i += len(symbol)
            continue
        start = i
        while i < len(text) and not text[i].isspace() and not any(text.startswith(s, i) for s in _SYMBOLS):
            i += 1
        out.append(text[start:i])
    return out


def _at(tokens: list[str], i: int) -> str:
    return tokens[i] if i < len(tokens) else _END


def _requirement(tokens: list[str], i: int) -> tuple[Requirement, int]:
    negated = tokens[i] == "!"
    i += negated
    key = _at(tokens, i)
    if key in _SYMBOLS or key in (_END, IN, NOT_IN):
        raise SelectorError(f"found {key!r}, expected a label key")
    _check_key(key)
    i += 1
    nxt = _at(tokens, i)
    if negated:
        return Requirement(key, NOT_EXISTS), i
    if nxt in (",", _END):
        return Requirement(key, EXISTS), i
    op = _OPERATORS.get(nxt)
    if op is None:
        raise SelectorError(f"found {nxt!r} after {key!r}, expected one of =, ==, !=, in, notin, >, <")
    i += 1
    if op in (IN, NOT_IN):
        values, i = _value_set(tokens, i, key, op)
    else:
        value = _at(tokens, i)
        if value in (",", _END):
            value = ""  # `key=` selects an empty value (the API server reads it so)
        elif value in _SYMBOLS:
            raise SelectorError(f"found {value!r} after '{key}{nxt}', expected a value")
        else:
            i += 1
        values = (value,)
    for value in values:
        _check_value(key, value)
    if op in (GT, LT) and not _INTEGER.fullmatch(values[0]):
        raise SelectorError(f"'{key}{op}{values[0]}': '{op}' needs an integer value")
    return Requirement(key, op, tuple(sorted(set(values)))), i


def _value_set(tokens: list[str], i: int, key: str, op: str) -> tuple[tuple[str, ...], int]:
    if _at(tokens, i) != "(":
        raise SelectorError(f"found {_at(tokens, i)!r} after '{key} {op}', expected '('")
    i += 1
    values: list[str] = []
    expect_value = True
    while True:
        tok = _at(tokens, i)
        if tok == ")":
            if expect_value and values:
                values.append("")  # `(a,)`: the empty value, as the API server reads it
            break
        if tok == _END:
            raise SelectorError(f"found {_END} in '{key} {op} (...', expected ')'")
        if tok == ",":
            if expect_value:
                values.append("")
            expect_value = True
        elif tok in _SYMBOLS or not expect_value:
            raise SelectorError(f"found {tok!r} in '{key} {op} (...)', expected a value, ',' or ')'")
        else:
            values.append(tok)
            expect_value = False
        i += 1
    if not values:
        raise SelectorError(f"'{key} {op} ()': the set of values must not be empty")
    return tuple(values), i + 1


def _check_key(key: str) -> None:
    prefix, slash, name = key.rpartition("/")
    problem = None
    if len(name) > 63 or not _NAME.fullmatch(name):
        problem = (
            "the name part must be 1-63 characters: alphanumerics, '-', '_' or '.', alphanumeric at both ends"
        )
    elif slash and (not prefix or len(prefix) > 253 or not _DNS_SUBDOMAIN.fullmatch(prefix)):
        problem = "the prefix must be a DNS subdomain (lower-case alphanumerics, '-' and '.')"
    if problem is not None:
        raise SelectorError(f"label key {key!r} is not valid: {problem}")


def _check_value(key: str, value: str) -> None:
    if value and (len(value) > 63 or not _NAME.fullmatch(value)):
        raise SelectorError(
            f"value {value!r} of label {key!r} is not valid: at most 63 characters, alphanumerics, "
            "'-', '_' or '.', alphanumeric at both ends"
        )
