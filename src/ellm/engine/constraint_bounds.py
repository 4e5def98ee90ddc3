"""Limits a constraint must meet before llguidance compiles it.

llguidance compiles a grammar recursively in native code: a chain of a few thousand rules
that each name the next overflows the thread's stack (SIGSEGV, the whole process gone),
and some shapes cost time that grows with the square of their size (one rule of 50,000
alternatives: ~20 s). So every constraint is measured here first, by a cheap scan in
Python without recursion, and one past a limit is a ValueError that names the limit and
the value found. The limits sit far above what real grammars, schemas and choice lists
use (a JSON grammar is ~30 rules, ~10 deep).
"""
from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

# The request fields that carry a constraint, in SamplingParams order. (Here, not in
# structured.py, so that checking a request that sets none loads no llguidance.)
CONSTRAINT_FIELDS = ("json_schema", "regex", "choice", "grammar")

MAX_GRAMMAR_BYTES = 128 * 1024      # grammar text (Lark or GBNF), UTF-8
MAX_GRAMMAR_RULES = 2000            # rules and terminals defined
MAX_GRAMMAR_RULE_DEPTH = 200        # longest chain of rules each naming the next
MAX_GRAMMAR_NESTING = 100           # ( [ { groups inside one another
MAX_GRAMMAR_ALTERNATIVES = 10_000   # '|' in the whole grammar
MAX_REGEX_BYTES = 16 * 1024
MAX_REGEX_ALTERNATIVES = 10_000
MAX_CHOICES = 10_000                # options of a choice constraint
MAX_CHOICE_BYTES = 256 * 1024       # all options together, UTF-8
MAX_SCHEMA_BYTES = 256 * 1024       # a JSON schema as compact JSON
MAX_SCHEMA_DEPTH = 64               # objects and arrays inside one another
MAX_SCHEMA_NODES = 20_000           # objects, arrays and values in the schema

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_\-]*")


def _limit(what: str, found: int, limit: int, unit: str = "") -> None:
    if found > limit:
        raise ValueError(f"{what} is {found:,}{unit}, over the limit of {limit:,}{unit}")


def check_constraint(kind: str, value: Any) -> None:
    """Raises ValueError when a normalised constraint value is past a limit."""
    if kind == "grammar":
        check_grammar(value)
    elif kind == "regex":
        _limit("the regex's size", len(value.encode("utf-8", "surrogatepass")), MAX_REGEX_BYTES, " bytes")
        _limit("the regex's alternatives ('|')", value.count("|"), MAX_REGEX_ALTERNATIVES)
    elif kind == "choice":
        _limit("the number of choices", len(value), MAX_CHOICES)
        total = sum(len(c.encode("utf-8", "surrogatepass")) for c in value)
        _limit("the choices' total size", total, MAX_CHOICE_BYTES, " bytes")
    elif kind == "json_schema":
        check_schema(value)


def check_json_depth(value: Any, limit: int, what: str) -> int:
    """The nesting depth of a JSON-like value (dicts and lists), walked without recursion;
    a ValueError naming `what` and the limit once it is passed. -> the number of nodes."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    nodes = 0
    while stack:
        node, depth = stack.pop()
        nodes += 1
        if isinstance(node, Mapping):
            children: Any = node.values()
        elif isinstance(node, (list, tuple)):
            children = node
        else:
            continue
        if depth > limit:
            raise ValueError(f"{what} is nested more than {limit} levels deep (the limit)")
        stack.extend((c, depth + 1) for c in children)
    return nodes


def check_schema(schema: Mapping[str, Any]) -> None:
    nodes = check_json_depth(schema, MAX_SCHEMA_DEPTH, "the json_schema")
    _limit("the json_schema's node count", nodes, MAX_SCHEMA_NODES)
    try:
        size = len(json.dumps(schema, separators=(",", ":")).encode("utf-8", "surrogatepass"))
    except (TypeError, ValueError) as e:
        raise ValueError(f"the json_schema is not plain JSON: {e}") from None
    _limit("the json_schema's size", size, MAX_SCHEMA_BYTES, " bytes")
    _check_ref_cycles(schema)


def _resolve(schema: Mapping[str, Any], ref: str) -> Any:
    """The subschema a local '#...' JSON pointer names, or None (remote or missing)."""
    if not ref.startswith("#"):
        return None
    node: Any = schema
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _check_ref_cycles(schema: Mapping[str, Any]) -> None:
    """A schema that is nothing but a $ref leading back to itself ({"$ref": "#"}, or two
    definitions naming each other) matches no value: refused here rather than failing
    when the first token is due. (A $ref under properties/items is real recursion and
    fine: the value is finite.)"""
    plain = {"$ref", "$defs", "definitions", "$schema", "$id", "title", "description",
             "$comment", "examples", "default"}
    todo = [schema]
    for defs_key in ("$defs", "definitions"):
        defs = schema.get(defs_key)
        if isinstance(defs, Mapping):
            todo.extend(d for d in defs.values() if isinstance(d, Mapping))
    for start in todo:
        node: Any = start
        seen: list[Mapping[str, Any]] = []
        while isinstance(node, Mapping) and isinstance(node.get("$ref"), str) and set(node) <= plain:
            if any(node is s for s in seen):
                chain = " -> ".join(s["$ref"] for s in seen)
                raise ValueError(f"its $ref cycle {chain} refers only to itself, so it matches no value")
            seen.append(node)
            node = _resolve(schema, node["$ref"])


def check_grammar(text: str) -> None:
    """Size, rule count, rule-reference depth, group nesting and alternatives of a Lark or
    GBNF grammar, from one pass over its text (strings, regexes, character classes and
    comments skipped)."""
    _limit("the grammar's size", len(text.encode("utf-8", "surrogatepass")), MAX_GRAMMAR_BYTES, " bytes")
    gbnf = "::=" in text
    refs: dict[str, list[str]] = {}
    current: str | None = None
    nesting = alternatives = 0
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in "\"'":
            i = _skip_quoted(text, i, c)
        elif c == "#" or text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif c == "/" and not gbnf:
            i = _skip_quoted(text, i, "/")
        elif c == "[" and gbnf:
            i = _skip_quoted(text, i, "]")
        elif c in "([{":
            nesting += 1
            _limit("the grammar's nesting of groups", nesting, MAX_GRAMMAR_NESTING)
            i += 1
        elif c in ")]}":
            nesting = max(0, nesting - 1)
            i += 1
        elif c == "|":
            alternatives += 1
            i += 1
        elif c == "%" and not gbnf:   # a Lark directive (%import, %ignore, %llguidance): its line
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif c.isalpha() or c == "_":
            m = _IDENT.match(text, i)
            assert m is not None
            name, i = m.group(), m.end()
            if not gbnf:
                name = name.rstrip("-")
            if _is_definition(text, i, gbnf):
                current = name
                refs.setdefault(name, [])
                _limit("the grammar's number of rules", len(refs), MAX_GRAMMAR_RULES)
            elif current is not None:
                refs[current].append(name)
        else:
            i += 1
    _limit("the grammar's alternatives ('|')", alternatives, MAX_GRAMMAR_ALTERNATIVES)
    depth = _reference_depth(refs)
    _limit("the grammar's rule depth (rules each naming the next)", depth, MAX_GRAMMAR_RULE_DEPTH)


def _skip_quoted(text: str, i: int, close: str) -> int:
    """The index just past a string / regex / class opened at i and closed by `close`
    (backslash escapes honoured), or the end of the line when it is never closed."""
    j = i + 1
    while j < len(text):
        ch = text[j]
        if ch == "\\":
            j += 2
            continue
        if ch == close:
            return j + 1
        if ch == "\n" and close != "]":
            return j
        j += 1
    return j


def _is_definition(text: str, i: int, gbnf: bool) -> bool:
    """Whether the name that ends at i is defined there ('name ::=' in GBNF; 'name:' or
    'name.2:' in Lark)."""
    j = i
    while j < len(text) and text[j] in " \t":
        j += 1
    if gbnf:
        return text.startswith("::=", j)
    if j < len(text) and text[j] == ".":   # a priority: name.2:
        j += 1
        while j < len(text) and (text[j].isdigit() or text[j] == "-"):
            j += 1
        while j < len(text) and text[j] in " \t":
            j += 1
    return j < len(text) and text[j] == ":" and not text.startswith("::", j)


def _reference_depth(refs: dict[str, list[str]]) -> int:
    """The deepest path of a depth-first walk over rule references (each rule entered
    once), walked with an explicit stack: a chain r0 -> r1 -> ... -> rN gives N + 1,
    in whatever order its rules are written (the walk starts at the start rule, then at
    rules nothing names, as the compiler does)."""
    named = {child for children in refs.values() for child in children}
    roots: list[str] = [r for r in ("start", "root") if r in refs]
    roots += [r for r in refs if r not in named] + list(refs)
    entered: set[str] = set()
    deepest = 0
    for root in roots:
        if root in entered:
            continue
        entered.add(root)
        stack = [(root, iter(refs[root]))]
        while stack:
            deepest = max(deepest, len(stack))
            _, children = stack[-1]
            for child in children:
                if child in refs and child not in entered:
                    entered.add(child)
                    stack.append((child, iter(refs[child])))
                    break
            else:
                stack.pop()
    return deepest
