"""What a request's JSON schema may hold before it is compiled into a grammar.

xgrammar drops keywords it does not enforce (with a warning in the server's log), so a schema
using them would be answered with documents that break it; this refuses them instead, by name
and place. It also bounds what a grammar costs to compile (its time grows faster than the
schema: a few thousand properties take minutes), refuses what says outright that no document
satisfies it (`anyOf: []`, an empty `enum`), and checks the counts xgrammar would otherwise fail
on deep in its compiler. Pure Python over the parsed schema, in time linear in its size, so it
may run wherever the request is parsed.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from metrale.runtime.errors import ConfigError

MAX_DEPTH = 10  # nested subschemas (OpenAI's structured outputs allow 10 levels of nesting)
MAX_PROPERTIES = 500  # object properties over the whole schema
MAX_ENUM = 1000  # values of one `enum`
MAX_REPEAT = 128  # a `pattern` quantifier's count: xgrammar's regex compiler goes no further
MAX_REPEATS = 16384  # the counts of every `pattern` quantifier, summed over the schema

# keywords xgrammar drops (a document breaking them passes its grammar; `tests/test_schema_check.py`
# checks each); `allOf` of one subschema is that subschema and `multipleOf` of an integer is kept,
# and are allowed
IGNORED = ("not", "if", "then", "else", "dependentSchemas", "dependentRequired", "dependencies",
           "contains", "minContains", "maxContains", "uniqueItems")
# the string formats xgrammar enforces
FORMATS = ("date", "date-time", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uri",
           "uri-reference", "uri-template", "uuid", "json-pointer", "relative-json-pointer")
# keywords whose values are subschemas: one, a list of them, or a name -> subschema map
ONE = ("additionalProperties", "items", "unevaluatedProperties", "unevaluatedItems", "propertyNames")
LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
MAPS = ("properties", "$defs", "definitions", "patternProperties")
COUNTS = (("minLength", "maxLength"), ("minItems", "maxItems"), ("minProperties", "maxProperties"))
_QUANTIFIER = re.compile(r"(?<!\\)\{(\d+)(?:,(\d*))?\}")
_LOOKAROUND = re.compile(r"(?<!\\)\(\?<?[=!]")


def check_shape(schema: Any) -> None:
    """Refuse (ConfigError, naming the place: `$.properties.name.pattern`) a schema that uses a
    keyword the grammar would drop, is larger or deeper than the bounds above, holds a
    non-finite number, a negative or crossed count, a reference outside itself, a `required`
    property it does not define, or says outright that no document satisfies it."""
    if not isinstance(schema, dict):
        raise ConfigError(f"$: a schema is a JSON object, got {_kind(schema)}")
    try:
        json.dumps(schema, allow_nan=False)
    except ValueError:
        raise ConfigError("$: holds NaN or Infinity, which JSON does not allow") from None
    properties, repeats = 0, 0
    stack: list[tuple[Any, str, int]] = [(schema, "$", 0)]
    while stack:
        node, path, depth = stack.pop()
        if isinstance(node, bool):  # `true` / `false` stand for any document / none
            continue
        if not isinstance(node, dict):
            raise ConfigError(f"{path}: a subschema is a JSON object or a boolean, got {_kind(node)}")
        if depth > MAX_DEPTH:
            raise ConfigError(f"{path}: subschemas nest {depth} deep; at most {MAX_DEPTH} levels are allowed")
        repeats += _check_keywords(node, path)
        if repeats > MAX_REPEATS:
            raise ConfigError(f"{path}.pattern: the schema's pattern quantifiers repeat more than "
                              f"{MAX_REPEATS} times in all, the most allowed")
        for key in ONE:
            if isinstance(node.get(key), (dict, bool)):
                stack.append((node[key], f"{path}.{key}", depth + 1))
            elif key == "items" and isinstance(node.get(key), list):
                stack.extend((s, f"{path}.items[{i}]", depth + 1) for i, s in enumerate(node[key]))
        for key in LISTS:
            if key in node:
                subs = node[key]
                if not isinstance(subs, list):
                    raise ConfigError(f"{path}.{key}: a list of subschemas, got {_kind(subs)}")
                if key in ("anyOf", "oneOf") and not subs:
                    raise ConfigError(f"{path}.{key}: an empty list, which no document satisfies")
                if key == "allOf" and len(subs) > 1:
                    raise ConfigError(f"{path}.allOf: {len(subs)} subschemas; only one is enforced here")
                stack.extend((s, f"{path}.{key}[{i}]", depth + 1) for i, s in enumerate(subs))
        for key in MAPS:
            if key in node:
                subs = node[key]
                if not isinstance(subs, dict):
                    raise ConfigError(f"{path}.{key}: an object of subschemas, got {_kind(subs)}")
                if key == "properties":
                    properties += len(subs)
                    if properties > MAX_PROPERTIES:
                        raise ConfigError(f"{path}.properties: the schema defines more than "
                                          f"{MAX_PROPERTIES} properties in all, the most allowed")
                # definitions are reached through references: their depth starts again
                inner = 1 if key in ("$defs", "definitions") else depth + 1
                stack.extend((s, f"{path}.{key}.{name}", inner) for name, s in subs.items())


def _check_keywords(node: dict, path: str) -> int:
    """-> the repetitions its `pattern`'s quantifiers count."""
    for key in IGNORED:
        if key in node:
            raise ConfigError(f"{path}.{key}: this keyword is not enforced by the grammar, so it "
                              "is refused rather than ignored")
    repeats = 0
    if "multipleOf" in node and node.get("type") != "integer":
        raise ConfigError(f"{path}.multipleOf: enforced for `\"type\": \"integer\"` only")
    if "format" in node and node["format"] not in FORMATS:
        raise ConfigError(f"{path}.format: {_shown(node['format'])} is not enforced; the formats "
                          f"enforced are {', '.join(FORMATS)}")
    ref = node.get("$ref")
    if ref is not None and not (isinstance(ref, str) and ref.startswith("#")):
        raise ConfigError(f"{path}.$ref: only references inside the schema (\"#...\") are "
                          f"resolved, got {_shown(ref)}")
    for low, high in COUNTS:
        for key in (low, high):
            v = node.get(key)
            if v is not None and not (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
                raise ConfigError(f"{path}.{key}: a whole number of at least 0, got {_shown(v)}")
        if isinstance(node.get(low), int) and isinstance(node.get(high), int) and node[low] > node[high]:
            raise ConfigError(f"{path}: {low} {node[low]} is greater than {high} {node[high]}")
    for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        v = node.get(key)
        if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)):
            raise ConfigError(f"{path}.{key}: a finite number, got {_shown(v)}")
    if "enum" in node:
        values = node["enum"]
        if not isinstance(values, list) or not values:
            raise ConfigError(f"{path}.enum: a non-empty list of values, got {_shown(values)}")
        if len(values) > MAX_ENUM:
            raise ConfigError(f"{path}.enum: {len(values)} values; at most {MAX_ENUM} are allowed")
    pattern = node.get("pattern")
    if pattern is not None:
        if not isinstance(pattern, str):
            raise ConfigError(f"{path}.pattern: a regular expression as a string, got {_kind(pattern)}")
        if _LOOKAROUND.search(pattern):
            raise ConfigError(f"{path}.pattern: lookahead and lookbehind are not enforced, so they "
                              "are refused rather than ignored")
        for m in _QUANTIFIER.finditer(pattern):
            count = max(int(m.group(1)), int(m.group(2) or 0))
            if count > MAX_REPEAT:
                raise ConfigError(f"{path}.pattern: the quantifier {m.group(0)} repeats {count} "
                                  f"times; at most {MAX_REPEAT} are allowed")
            repeats += count
    required = node.get("required")
    if required is not None:
        if not (isinstance(required, list) and all(isinstance(r, str) for r in required)):
            raise ConfigError(f"{path}.required: a list of property names, got {_shown(required)}")
        defined = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        missing = [r for r in required if r not in defined]
        if missing:  # the grammar would drop the name and not require it
            raise ConfigError(f"{path}.required: names {_shown(missing[0])}, which `properties` "
                              "does not define; a required property must be defined there")
    return repeats


def _kind(v: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
            float: "a number", type(None): "null"}.get(type(v), type(v).__name__)


def _shown(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."
