"""A JSON schema's grammar with its patterns compiled by xgrammar's regex converter.

xgrammar writes a schema as a grammar in its EBNF, and a string `pattern` (or a
`patternProperties` key) there as a `Regex("...", json_string=true)` rule, which its compiler
builds into an automaton. That builder mistranslates quantifiers and alternatives over groups:
`(ab*)?` accepts `"b"`, `(0|[1-9][0-9]*)(\\.[0-9]+)?` accepts `"01"`, `(ab{0,2}|a)` accepts
`"abbb"`, so the grammar lets a model write strings the schema refuses. Its regex converter
(`Grammar.from_regex`, which writes a pattern as EBNF rules) reads the same patterns right.
`schema_grammar` therefore writes every pattern with `schema_patterns.for_grammar` first (its
classes hold only what a JSON string holds unescaped, as the automaton's `json_string` made
them; the converter's rules do not), then replaces each such rule with the converter's rules for
its pattern.
"""

from __future__ import annotations

import functools
import json
import re

from metrale.runtime.errors import ConfigError
from metrale.runtime.spec.schema_check import subschema_objects
from metrale.runtime.spec.schema_patterns import for_grammar

# a rule xgrammar writes for a pattern: `name ::= Regex("<pattern, EBNF-escaped>", json_string=true)`
REGEX_RULE = re.compile(r'(?P<name>[A-Za-z_][A-Za-z0-9_]*) ::= Regex\("(?P<text>(?:[^"\\]|\\.)*)", '
                        r'json_string=true\)')
ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "f": "\f", "v": "\v", "b": "\b", "0": "\0", "a": "\a", "e": "\x1b"}
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@functools.lru_cache(maxsize=256)
def schema_grammar(schema: str) -> str | None:
    """The EBNF grammar of JSON schema `schema` (text, `schema_check.check_shape` passed) as
    xgrammar writes it without free whitespace, with every pattern written by
    `schema_patterns.for_grammar` first and each pattern's automaton rule replaced by the regex
    converter's rules (the module docstring); None where the schema has no pattern (it compiles
    as it is). ConfigError where a pattern cannot be written so."""
    import xgrammar

    tree = json.loads(schema)
    patterns: set[str] = set()
    for node in subschema_objects(tree):
        if isinstance(node.get("pattern"), str):
            node["pattern"] = for_grammar(node["pattern"], "pattern")
            patterns.add(node["pattern"])
        if isinstance(node.get("patternProperties"), dict):
            keyed = {for_grammar(k, "patternProperties"): v for k, v in node["patternProperties"].items()}
            node["patternProperties"] = keyed
            patterns.update(keyed)
    if not patterns:
        return None
    text = str(xgrammar.Grammar.from_json_schema(json.dumps(tree), any_whitespace=False))
    names = set(re.findall(r"^([A-Za-z_][A-Za-z0-9_]*) ::=", text, re.M))
    lines = []
    for line in text.splitlines():
        m = REGEX_RULE.fullmatch(line)
        if m is None:
            lines.append(line)
            continue
        pattern = _unescaped(m["text"])
        if pattern not in patterns:  # the rule's text read back wrong: never enforce another pattern
            raise ConfigError(f"pattern {pattern!r}: could not be compiled")
        lines.extend(_pattern_rules(m["name"], pattern, names))
    return _four_digit_escapes("\n".join(lines) + "\n")


def _pattern_rules(name: str, pattern: str, taken: set[str]) -> list[str]:
    """Rule `name` (and the rules it refers to) matching `pattern` (`for_grammar`'s) in a JSON
    string's text: the regex converter's grammar for it, its rules renamed into `name`'s own."""
    import xgrammar

    rules = str(xgrammar.Grammar.from_regex(pattern)).strip().splitlines()  # (its refusals: `compile_schema`'s)
    prefix = f"{name}_re"
    while any(t.startswith(prefix) for t in taken):
        prefix += "_"
    return [_renamed(rule, name, prefix) for rule in rules]


def _renamed(rule: str, root: str, prefix: str) -> str:
    """EBNF `rule` with the regex converter's rule names (`root`, `root_1`, ...) made `root` and
    `prefix_1`, ...: every name outside its strings and classes."""
    out, i = [], 0
    while i < len(rule):
        c = rule[i]
        if c in '"[':  # a string or a class, up to its unescaped end
            end = '"' if c == '"' else "]"
            j = i + 1
            while j < len(rule) and rule[j] != end:
                j += 2 if rule[j] == "\\" else 1
            out.append(rule[i:j + 1])
            i = j + 1
            continue
        m = NAME.match(rule, i)
        if m is None:
            out.append(c)
            i += 1
            continue
        word = m.group()
        if word == "root":
            word = root
        elif re.fullmatch(r"root(_\d+)+", word):
            word = prefix + word[4:]
        out.append(word)
        i = m.end()
    return "".join(out)


def _four_digit_escapes(text: str) -> str:
    """EBNF `text` (as xgrammar prints a grammar) with each `\\xHH` escape written `\\u00HH`:
    xgrammar prints U+0080..U+00FF as `\\xHH` even where a hex digit follows, and reads a `\\x`
    escape to the last hex digit after it (`"\\xe91"`, printed for "é1", reads as "\\u0e91")."""
    return re.sub(r"\\(x([0-9a-fA-F]{2})|.)",
                  lambda m: "\\u00" + m.group(2) if m.group(2) else m.group(0), text, flags=re.S)


def _unescaped(text: str) -> str:
    """An EBNF string's text as the characters it stands for."""
    def one(m: re.Match) -> str:
        e = m.group(1)
        if e[0] in "xuU":
            return chr(int(e[1:], 16))
        return ESCAPES.get(e, e)
    return re.sub(r"\\(x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|.)", one, text)
