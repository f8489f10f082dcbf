"""A JSON schema's grammar with its patterns as metrale writes them.

xgrammar writes a schema as a grammar in its EBNF, and a string `pattern` (or a
`patternProperties` key) there as a `Regex("...", json_string=true)` rule, which its compiler
builds into an automaton, or, for some patterns (those holding characters past U+FFFF), as its
regex converter's rules inlined. The automaton builder mistranslates quantifiers and
alternatives over groups: `(ab*)?` accepts `"b"`, `(0|[1-9][0-9]*)(\\.[0-9]+)?` accepts `"01"`,
`(ab{0,2}|a)` accepts `"abbb"`, so the grammar lets a model write strings the schema refuses.
The converter (`Grammar.from_regex`) reads them right, but writes groups, alternatives and
repeats as rules as they stand, and under some patterns (`(a|\\S+.)+`, `(.{1,8}){1,100}`) its
parser tracks so many ways through a text that one token's mask takes from milliseconds to
seconds; its mask can also allow a token its matcher then refuses.

`schema_grammar` therefore gives xgrammar each pattern as a stand-in of plain letters (which it
always writes as a `Regex` rule), and replaces that rule with the pattern's own: the pattern
written by `schema_patterns.for_grammar` (its classes hold only what a JSON string holds
unescaped, as the automaton's `json_string` made them), as its smallest deterministic automaton
(`pattern_dfa`, which refuses a pattern past its limits). Only a pattern no regular expression
reads (`a**`) goes to the converter, which refuses it.
"""

from __future__ import annotations

import functools
import json
import re

from metrale.runtime.errors import ConfigError
from metrale.runtime.spec.pattern_dfa import dfa_rules
from metrale.runtime.spec.schema_check import subschema_objects
from metrale.runtime.spec.schema_patterns import for_grammar

# a rule xgrammar writes for a pattern: `name ::= Regex("<pattern, EBNF-escaped>", json_string=true)`
REGEX_RULE = re.compile(r'(?P<name>[A-Za-z_][A-Za-z0-9_]*) ::= Regex\("(?P<text>(?:[^"\\]|\\.)*)", '
                        r'json_string=true\)')
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
PLACEHOLDER = "metralepattern"  # a pattern's stand-in in the schema xgrammar writes: letters and an index


@functools.lru_cache(maxsize=32)
def schema_grammar(schema: str) -> str | None:
    """The EBNF grammar of JSON schema `schema` (text, `schema_check.check_shape` passed) as
    xgrammar writes it without free whitespace, each pattern's rule replaced by the pattern's own
    (the module docstring); None where the schema has no pattern (it compiles as it is).
    ConfigError, naming the pattern, where one cannot be written so."""
    import xgrammar

    tree = json.loads(schema)
    placeholders: dict[str, str] = {}  # pattern (`for_grammar`'s) -> the name xgrammar is given
    places: dict[str, str] = {}  # pattern (`for_grammar`'s) -> its place, as the schema writes it

    def placed(pattern: str, where: str) -> str:
        written = for_grammar(pattern, where)
        places.setdefault(written, f"{where} {pattern!r}")
        return placeholders.setdefault(written, f"{PLACEHOLDER}{len(placeholders)}")

    for node in subschema_objects(tree):
        if isinstance(node.get("pattern"), str):
            node["pattern"] = placed(node["pattern"], "pattern")
        if isinstance(node.get("patternProperties"), dict):
            node["patternProperties"] = {placed(k, "patternProperties"): v for k, v in node["patternProperties"].items()}
    if not placeholders:
        return None
    patterns = {name: pattern for pattern, name in placeholders.items()}
    text = str(xgrammar.Grammar.from_json_schema(json.dumps(tree), any_whitespace=False))
    names = set(re.findall(r"^([A-Za-z_][A-Za-z0-9_]*) ::=", text, re.M))
    lines = []
    written: dict[str, str] = {}  # pattern -> the rule its rules were first written as
    for line in text.splitlines():
        m = REGEX_RULE.fullmatch(line)
        if m is None:
            lines.append(line)
            continue
        if m["text"] not in patterns:  # (never another pattern than the schema's)
            raise ConfigError(f"pattern {m['text']!r}: could not be compiled")
        pattern = patterns[m["text"]]
        if pattern in written:  # a pattern met again: its rules once (an automaton's may be many)
            lines.append(f"{m['name']} ::= {written[pattern]}")
            continue
        written[pattern] = m["name"]
        lines.extend(_pattern_rules(m["name"], pattern, names, places[pattern]))
    return _four_digit_escapes("\n".join(lines) + "\n")


def _pattern_rules(name: str, pattern: str, taken: set[str], where: str) -> list[str]:
    """Rule `name` (and the rules it refers to) matching `pattern` (`for_grammar`'s, at `where`)
    in a JSON string's text: its deterministic automaton (`pattern_dfa.dfa_rules`), else the
    regex converter's grammar for it (its refusal, for a form no regex reads), its rules renamed
    into `name`'s own."""
    import xgrammar

    prefix = f"{name}_re"
    while any(t.startswith(prefix) for t in taken):
        prefix += "_"
    rules = dfa_rules(name, pattern, prefix, where)
    if rules is not None:
        return rules
    rules = str(xgrammar.Grammar.from_regex(pattern)).strip().splitlines()  # (its refusals: `compile_schema`'s)
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
