"""What a request's JSON schema may hold before it is compiled into a grammar.

xgrammar drops keywords it does not enforce (with a warning in the server's log, or none: a
keyword of one type in a subschema without `type`), so a schema using them would be answered
with documents that break it; this refuses them instead, by name and place. It also bounds what a grammar costs to compile (its time grows faster than the
schema: a few thousand properties take minutes),
refuses what says outright that no document satisfies it (`anyOf: []`, an empty `enum`, a
property required to hold the schema itself again on every branch), and
checks the counts xgrammar would otherwise fail on deep in its compiler. Pure Python over the
parsed schema, without recursion and in time linear in its size, so it may run wherever the
request is parsed. `format` is an annotation (JSON Schema's default): the formats xgrammar
knows it enforces (`FORMATS`), the others it lets pass.
"""

from __future__ import annotations

import json
import math
import re
import sys
from typing import Any

from metrale.runtime.errors import ConfigError
from metrale.runtime.spec.schema_patterns import for_grammar, pattern_size

MAX_DEPTH = 32  # subschemas within subschemas (each `properties`, `items`, `anyOf` entry: one)
MAX_PROPERTIES = 500  # object properties over the whole schema
MAX_ENUM = 1000  # `enum` values over the whole schema
MAX_EXPANSION = 4096  # the patterns' size with every quantifier written out, summed

# keywords xgrammar drops: a document breaking them passes its grammar
# (`tests/test_schema_check.py` checks each). `then`/`else` without `if`, `uniqueItems: false`
# and OpenAPI's `nullable: false` say nothing, and are let through.
IGNORED = ("not", "if", "dependentSchemas", "dependentRequired", "dependencies", "contains",
           "minContains", "maxContains")
# the string formats xgrammar enforces (the others are annotations to it); beside one of these
# it drops a string's length bounds and pattern
FORMATS = ("date", "date-time", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uri",
           "uri-reference", "uri-template", "uuid", "json-pointer", "relative-json-pointer")
# keywords beside which xgrammar keeps that keyword alone and drops every other one (checked in
# this order: beside `$ref`, an `enum` is dropped too, and beside `enum`, an `anyOf`)
ALONE = ("$ref", "enum", "const", "anyOf", "oneOf", "allOf")
# JSON Schema's keywords that narrow the documents a subschema allows (the others, and keywords
# it does not know, `discriminator` or `x-...`, annotate: dropping them loses nothing)
CONSTRAINTS = ("type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum",
               "exclusiveMinimum", "maxLength", "minLength", "pattern", "format", "maxItems", "minItems",
               "uniqueItems", "maxProperties", "minProperties", "required", "properties",
               "patternProperties", "additionalProperties", "propertyNames", "items", "prefixItems",
               "additionalItems", "unevaluatedItems", "unevaluatedProperties", "allOf", "anyOf", "oneOf",
               "$ref", "nullable", *IGNORED)
# keywords whose values are subschemas: one, a list of them, or a name -> subschema map
ONE = ("additionalProperties", "items", "unevaluatedProperties", "unevaluatedItems", "propertyNames")
LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
MAPS = ("properties", "$defs", "definitions", "patternProperties")
COUNTS = (("minLength", "maxLength"), ("minItems", "maxItems"), ("minProperties", "maxProperties"))
MAX_BOUND = 2**63 - 1  # an integer's bounds lie in [-MAX_BOUND - 1, MAX_BOUND]
# keywords of one type, which xgrammar drops in a subschema it reads as any value (one without
# `type`, object keywords, array keywords or a keyword it keeps alone)
TYPED = ("minLength", "maxLength", "pattern", "minimum", "maximum", "exclusiveMinimum",
         "exclusiveMaximum", "multipleOf", "minItems", "maxItems", "minProperties", "maxProperties",
         "patternProperties", "propertyNames")


def check_shape(schema: Any) -> None:
    """Refuse (ConfigError, naming the place: `$.properties.name.pattern`) a schema that uses a
    keyword the grammar would drop, is larger or deeper than the bounds above, holds a
    non-finite number, a negative or crossed count, a reference outside itself, a `required`
    property it does not define, or says outright that no document satisfies it, or that none
    can end (`_finite`)."""
    if not isinstance(schema, dict):
        raise ConfigError(f"$: a schema is a JSON object, got {_kind(schema)}")
    properties = enums = expansion = 0
    nodes: dict[int, tuple[dict, str]] = {}  # every subschema object, by identity, and its place
    stack: list[tuple[Any, str, int]] = [(schema, "$", 0)]
    while stack:
        node, path, depth = stack.pop()
        if isinstance(node, bool):  # `true` / `false` stand for any document / none
            continue
        if not isinstance(node, dict):
            raise ConfigError(f"{path}: a subschema is a JSON object or a boolean, got {_kind(node)}")
        if depth > MAX_DEPTH:
            raise ConfigError(f"{path}: subschemas nest {depth} deep; at most {MAX_DEPTH} levels are allowed")
        subs = _subschemas(node, path, depth)
        _check_keywords(node, path)
        nodes.setdefault(id(node), (node, path))
        properties += len(node["properties"]) if "properties" in node else 0
        if properties > MAX_PROPERTIES:
            raise ConfigError(f"{path}.properties: the schema defines more than {MAX_PROPERTIES} "
                              "properties in all, the most allowed")
        enums += len(node["enum"]) if "enum" in node else 0
        if enums > MAX_ENUM:
            raise ConfigError(f"{path}.enum: the schema lists more than {MAX_ENUM} enum values in "
                              "all, the most allowed")
        patterns = [(f"{path}.pattern", node["pattern"])] if "pattern" in node else []
        patterns += [(f"{path}.patternProperties", key) for key in node.get("patternProperties", ())]
        for where, pattern in patterns:
            expansion += pattern_size(pattern, where)
            for_grammar(pattern, where)
            if expansion > MAX_EXPANSION:
                raise ConfigError(f"{where}: the schema's patterns, their quantifiers written out, "
                                  f"come to more than {MAX_EXPANSION} items in all, the most allowed")
        stack.extend(subs)
    try:
        json.dumps(schema, allow_nan=False)
    except ValueError:
        raise ConfigError("$: holds NaN or Infinity, which JSON does not allow") from None
    except RecursionError:  # nesting in values no subschema walk reaches (`default`, `const`)
        raise ConfigError("$: nests JSON too deeply") from None
    _finite(schema, nodes)


def subschema_objects(schema: dict) -> list[dict]:
    """Every subschema object of `schema` (one `check_shape` passed), definitions included."""
    out, stack = [], [(schema, "$", 0)]
    while stack:
        node, path, depth = stack.pop()
        if isinstance(node, dict):
            out.append(node)
            stack.extend(_subschemas(node, path, depth))
    return out


def _subschemas(node: dict, path: str, depth: int) -> list[tuple[Any, str, int]]:
    """The subschemas in `node` (after checking each holder's type), one level deeper;
    definitions are reached through references, so their depth starts again."""
    out: list[tuple[Any, str, int]] = []
    for key in ONE:
        if isinstance(node.get(key), (dict, bool)):
            out.append((node[key], f"{path}.{key}", depth + 1))
    for key in LISTS:
        if key in node:
            subs = node[key]
            if not isinstance(subs, list):
                raise ConfigError(f"{path}.{key}: a list of subschemas, got {_kind(subs)}")
            if key in ("anyOf", "oneOf") and not subs:
                raise ConfigError(f"{path}.{key}: an empty list, which no document satisfies")
            if key == "allOf" and len(subs) > 1:
                raise ConfigError(f"{path}.allOf: {len(subs)} subschemas; only one is enforced here")
            out.extend((s, f"{path}.{key}[{i}]", depth + 1) for i, s in enumerate(subs))
    for key in MAPS:
        if key in node:
            subs = node[key]
            if not isinstance(subs, dict):
                raise ConfigError(f"{path}.{key}: an object of subschemas, got {_kind(subs)}")
            inner = 1 if key in ("$defs", "definitions") else depth + 1
            out.extend((s, f"{path}.{key}.{name}", inner) for name, s in subs.items())
    return out


def _check_keywords(node: dict, path: str) -> None:
    for key in IGNORED:
        if key in node:
            raise ConfigError(f"{path}.{key}: this keyword is not enforced by the grammar, so it "
                              "is refused rather than ignored")
    if node.get("nullable") not in (None, False):
        raise ConfigError(f"{path}.nullable: OpenAPI's keyword is not enforced; write "
                          "`\"type\": [..., \"null\"]` instead")
    if node.get("uniqueItems") not in (None, False):
        raise ConfigError(f"{path}.uniqueItems: only false (the default) can be enforced, got "
                          f"{_shown(node['uniqueItems'])}")
    types = node.get("type")
    types = types if isinstance(types, list) else [types]
    if "type" in node and not (types and all(isinstance(t, str) and t in JSON_TYPES for t in types)):
        raise ConfigError(f"{path}.type: one of {', '.join(JSON_TYPES)}, or a non-empty list of "
                          f"them, got {_shown(node['type'])}")
    if "type" not in node and not any(k in node for k in (*ALONE, *OBJECT_KEYWORDS, *ARRAY_KEYWORDS)):
        key = next((k for k in TYPED if k in node), None)
        if key is not None:  # xgrammar reads such a subschema as any value and drops the keyword
            raise ConfigError(f"{path}.{key}: not enforced in a subschema without `type`; give "
                              "the subschema its `type`")
    if "format" in node and not isinstance(node["format"], str):
        raise ConfigError(f"{path}.format: a format's name as a string, got {_shown(node['format'])}")
    if "multipleOf" in node and ("integer" not in types or "number" in types):
        raise ConfigError(f"{path}.multipleOf: enforced for integers only (`\"type\": \"integer\"`)")
    lower, upper = ({k for k in node if k.endswith(side)} for side in ("inimum", "aximum"))
    if "multipleOf" in node and bool(lower) != bool(upper):
        raise ConfigError(f"{path}.multipleOf: not enforced beside a bound on one side only; give "
                          "a lower and an upper bound, or neither")
    # what xgrammar writes its own way: property names and big integers in values
    names = [*(node.get("properties") or ()), *(r for r in node.get("required") or () if isinstance(r, str))]
    if any(isinstance(k, str) and any(c in '"\\' or c < " " for c in k) for k in names):
        raise ConfigError(f"{path}.properties: a name holding `\"`, `\\` or a control character "
                          "is not enforced")
    if _big_int(node.get("enum")) or _big_int(node.get("const")):
        raise ConfigError(f"{path}: an integer past 2^53 in `enum` or `const` is not enforced "
                          "(it is matched as a double)")
    # beside a pattern or a format it enforces, xgrammar drops a string's length bounds; beside
    # such a format, the pattern
    stringy = types == [None] or "string" in types
    shaped = [k for k in ("pattern", "format") if stringy and k in node
              and (k == "pattern" or node["format"] in FORMATS)]
    for key in ("minLength", "maxLength") if shaped else ():
        if key in node:
            raise ConfigError(f"{path}.{key}: not enforced beside `{shaped[0]}`; write the length "
                              "into the pattern instead (e.g. ^[a-z]{2,8}$)")
    if shaped == ["pattern", "format"]:
        raise ConfigError(f"{path}.pattern: not enforced beside `format`; give one of the two")
    ref = node.get("$ref")
    if ref is not None and not (isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))):
        raise ConfigError(f"{path}.$ref: only JSON pointers inside the schema (\"#\", \"#/...\") "
                          f"are resolved, not anchors or other documents, got {_shown(ref)}")
    for low, high in COUNTS:
        for key in (low, high):
            v = node.get(key)
            if v is not None and not (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
                raise ConfigError(f"{path}.{key}: a whole number of at least 0, got {_shown(v)}")
        if isinstance(node.get(low), int) and isinstance(node.get(high), int) and node[low] > node[high]:
            raise ConfigError(f"{path}: {low} {node[low]} is greater than {high} {node[high]}")
    for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"):
        v = node.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not abs(v) <= sys.float_info.max:
            raise ConfigError(f"{path}.{key}: a finite number, got {_shown(v)}")
        if "integer" in types and not -MAX_BOUND - 1 <= v <= MAX_BOUND:  # (xgrammar: 64 bits)
            raise ConfigError(f"{path}.{key}: from {-MAX_BOUND - 1} to {MAX_BOUND} on an integer, got {_shown(v)}")
        if key == "multipleOf" and v <= 0:
            raise ConfigError(f"{path}.multipleOf: a number greater than 0, got {_shown(v)}")
        if "integer" in types and "number" not in types and not float(v).is_integer():
            raise ConfigError(f"{path}.{key}: a whole number on an integer, got {_shown(v)}")
    if "enum" in node and not (isinstance(node["enum"], list) and node["enum"]):
        raise ConfigError(f"{path}.enum: a non-empty list of values, got {_shown(node['enum'])}")
    if "pattern" in node and not isinstance(node["pattern"], str):
        raise ConfigError(f"{path}.pattern: a regular expression as a string, got {_kind(node['pattern'])}")
    free = "propertyNames" in node or any(node.get(k, False) is not False for k in (
        "additionalProperties", "unevaluatedProperties", "patternProperties"))
    if "propertyNames" in node and ("properties" in node or any(
            node.get(k) is False for k in ("additionalProperties", "unevaluatedProperties"))):
        raise ConfigError(f"{path}.propertyNames: not enforced beside `properties` or beside "
                          "additional properties set to false")
    if free and isinstance(node.get("minProperties"), int) and node["minProperties"] > len(node.get("required") or ()):
        raise ConfigError(f"{path}.minProperties: not enforced past the required properties where "
                          "others are allowed (the grammar may repeat a key); require them instead")
    both = [(n, k) for n in node.get("properties") or {} for k in node.get("patternProperties") or {}
            if isinstance(k, str) and _matches(k, n)]
    if both:
        raise ConfigError(f"{path}.patternProperties: {both[0][1]!r} matches property "
                          f"{both[0][0]!r}, and the grammar applies only one of the two")
    patterns = node.get("patternProperties") or {}
    if isinstance(patterns, dict) and len({json.dumps(v, sort_keys=True) for v in patterns.values()}) > 1:
        raise ConfigError(f"{path}.patternProperties: patterns with different subschemas are not "
                          "enforced (the grammar applies one of them to a key that several match)")
    if patterns and "properties" in node and any(node.get(k, False) is not False for k in
                                                 ("additionalProperties", "unevaluatedProperties")):
        raise ConfigError(f"{path}.patternProperties: not enforced beside `properties` where other "
                          "properties are allowed (the grammar gives a matching key their subschema)")
    required = node.get("required")
    if required is not None:
        if not (isinstance(required, list) and all(isinstance(r, str) for r in required)):
            raise ConfigError(f"{path}.required: a list of property names, got {_shown(required)}")
        missing = [r for r in required if r not in node.get("properties", {})]
        if missing:  # the grammar would drop the name and not require it
            raise ConfigError(f"{path}.required: names {_shown(missing[0])}, which `properties` "
                              "does not define; a required property must be defined there")
    _check_alone(node, path)


def _finite(schema: dict, nodes: dict[int, tuple[dict, str]]) -> None:
    """Refuse a schema whose grammar lets a document start and never finish: every branch
    requires the same subschema again inside itself, through required properties, a minimum of
    items or of properties, or references (`{"properties": {"a": {"$ref": "#"}}, "required": ["a"]}`). It is read
    as xgrammar compiles it (`_clauses`), where that reading is plain (`_plain`: any other
    subschema counts as finite, so what is refused is a loop of plain subschemas). A subschema
    is finite where some document of its grammar is; the finite ones are found from those that
    need nothing, each telling the subschemas that hold it when it becomes finite (every
    subschema once, so linear in the schema's size), and the refusal names the subschema where
    the walk from the root through what keeps each unfinished comes back to one it passed.
    `nodes`: every subschema object of `schema`, by identity, and its place (`check_shape`'s
    walk)."""
    clauses = {key: _clauses(node, schema) for key, (node, _) in nodes.items()}
    finite: set[int] = set()
    # per subschema: its clauses still open, which are met, and per clause and alternative how
    # many subschemas it still waits for; per subschema, the (holder, clause, alternative) that
    # wait for it
    open_clauses: dict[int, int] = {}
    met: dict[int, list[bool]] = {}
    waiting: dict[int, list[list[float]]] = {}
    holders: dict[int, list[tuple[int, int, int]]] = {}
    ready: list[int] = []
    for key, node_clauses in clauses.items():
        waiting[key], met[key] = [], []
        for c, alternatives in enumerate(node_clauses):
            counts: list[float] = []
            for a, subs in enumerate(alternatives):
                pending = {id(s) for s in subs if isinstance(s, dict) and id(s) in nodes}
                counts.append(math.inf if any(s is False for s in subs) else len(pending))
                for sub in pending:
                    holders.setdefault(sub, []).append((key, c, a))
            waiting[key].append(counts)
            met[key].append(0 in counts)
        open_clauses[key] = met[key].count(False)
        if not open_clauses[key]:
            ready.append(key)
    while ready:
        key = ready.pop()
        finite.add(key)
        for holder, c, a in holders.get(key, ()):
            waiting[holder][c][a] -= 1
            if waiting[holder][c][a] == 0 and not met[holder][c]:
                met[holder][c] = True
                open_clauses[holder] -= 1
                if not open_clauses[holder]:
                    ready.append(holder)

    def holds(sub: Any) -> bool:  # (a reference to what is no subschema: compiling says)
        return not (sub is False or (isinstance(sub, dict) and id(sub) in nodes and id(sub) not in finite))

    node, path, passed = schema, "$", set()
    while not holds(node) and id(node) not in passed:
        passed.add(id(node))
        alternatives = next(alts for alts in clauses[id(node)] if not any(all(map(holds, subs)) for subs in alts))
        unfinished = [s for subs in alternatives for s in subs if not holds(s)]
        sub = next((s for s in unfinished if s is not False), False)
        if sub is False:
            raise ConfigError(f"{path}: requires a subschema `false`, which no document satisfies")
        node, path = sub, nodes[id(sub)][1]
    if not holds(node):
        raise ConfigError(f"{path}: every document the schema's grammar allows holds this subschema "
                          "again inside it (through required properties, a minimum of items or "
                          "properties, or references), so none can be finished; make one of them optional")


# keywords that make xgrammar read a subschema without `type` as an object, or as an array
OBJECT_KEYWORDS = ("properties", "required", "additionalProperties")
ARRAY_KEYWORDS = ("items", "prefixItems")
# on another type than its own (or untyped, beside the other kind's), xgrammar reads these its
# own way, so such a subschema is taken to be finite and only plain recursions are refused
OBJECT_SHAPING = (*OBJECT_KEYWORDS, "patternProperties", "minProperties", "maxProperties")
ARRAY_SHAPING = (*ARRAY_KEYWORDS, "minItems", "maxItems", "additionalItems")
JSON_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")


def _clauses(node: dict, schema: dict) -> list[list[list[Any]]]:
    """What `node` needs to be finite, as xgrammar compiles it: every clause met, a clause by
    one of its alternatives, an alternative by all of its subschemas being finite. A reference
    is its target (xgrammar drops the keywords beside it); `anyOf`/`oneOf`, one branch (beside
    them it drops `type`); each `allOf` part; and one of its types: an object, its required
    properties (and one property more where `minProperties` asks for more), an array, the items its `minItems` needs, anything else, nothing (values of
    `enum` and `const` need nothing either). Without `type`, a subschema with object keywords is
    an object and one with array keywords an array, as xgrammar reads them. (Beside a
    reference, a union or an `allOf`, `_check_alone` has let nothing else that narrows the
    documents through, and an `allOf` holds one part.)"""
    if "enum" in node or "const" in node or not _plain(node):
        return []
    ref = node.get("$ref")
    if isinstance(ref, str):
        target = _resolve(schema, ref)
        return [[[target]]] if target is not None else []
    for key in ("anyOf", "oneOf", "allOf"):
        if isinstance(node.get(key), list):
            return [[[b] for b in node[key]]]
    types = node.get("type")
    if types is None:
        types = "object" if any(k in node for k in OBJECT_KEYWORDS) else (
            "array" if any(k in node for k in ARRAY_KEYWORDS) else None)
    alternatives = []
    for t in types if isinstance(types, list) else [types]:
        if t == "object":
            properties, required = node.get("properties") or {}, node.get("required") or []
            needs = [properties[name] for name in required if name in properties]
            # `minProperties` past the required ones: one more property besides them, any
            # optional one's or one of `additionalProperties`, `unevaluatedProperties` or
            # `patternProperties` (with none, xgrammar refuses the schema itself)
            extra = [p for name, p in properties.items() if name not in required]
            extra += list((node.get("patternProperties") or {}).values())
            extra += [node[k] for k in ("additionalProperties", "unevaluatedProperties")
                      if node.get(k, False) is not False]
            more = isinstance(node.get("minProperties"), int) and node["minProperties"] > len(needs)
            alternatives += [needs + [p] for p in extra] if more and extra else [needs]
        elif t == "array":
            prefix, least = node.get("prefixItems") or [], node.get("minItems") or 0
            items = node.get("items", True)
            alternatives.append(prefix[:least] + [items] * (least > len(prefix)))
        else:  # a scalar, or anything
            alternatives.append([])
    return [alternatives] if alternatives else []


def _plain(node: dict) -> bool:
    """Whether `node`'s types are JSON's, with only their own keywords (object keywords on an
    object, array keywords on an array; untyped, one kind of them)."""
    types = node.get("type")
    types = types if isinstance(types, list) else [types] if types is not None else []
    if not all(isinstance(t, str) and t in JSON_TYPES for t in types):
        return False
    objects, arrays = any(k in node for k in OBJECT_SHAPING), any(k in node for k in ARRAY_SHAPING)
    if not types:  # untyped: read as an object or an array by its keywords, not both
        return not (objects and arrays)
    return (not objects or "object" in types) and (not arrays or "array" in types)


def _resolve(schema: dict, ref: str) -> Any:
    """The subschema a local reference (`#`, `#/$defs/name`, any JSON pointer) names, or None."""
    if ref != "#" and not ref.startswith("#/"):
        return None
    node: Any = schema
    for part in ref[2:].split("/") if ref != "#" else ():
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif (isinstance(node, list) and part.isascii() and part.isdigit() and len(part) < 10
              and (part == "0" or part[0] != "0") and int(part) < len(node)):
            node = node[int(part)]
        else:
            return None
    return node


def _check_alone(node: dict, path: str) -> None:
    """Beside a reference, a union, an `allOf` or values (`enum`, `const`), xgrammar enforces
    that keyword alone (`ALONE`): refuse, by name, any other keyword that narrows the documents
    (`CONSTRAINTS`; a `type` that every listed value already has says nothing more, nor do an
    annotation `format`, `nullable: false` or `uniqueItems: false`)."""
    kept = next((k for k in ALONE if k in node), None)
    if kept is None:
        return
    values = node["enum"] if kept == "enum" else [node["const"]] if kept == "const" else None
    for key in node:
        if (key == kept or key not in CONSTRAINTS or (key == "format" and node[key] not in FORMATS)
                or (key in ("nullable", "uniqueItems") and node[key] is False)
                or (key == "type" and values is not None and _all_typed(values, node["type"]))):
            continue
        where = {"$ref": "the subschema it names", "anyOf": "each branch", "oneOf": "each branch",
                 "allOf": "its subschema"}.get(kept)
        raise ConfigError(f"{path}.{key}: not enforced beside `{kept}`, which the grammar keeps alone; "
                          + (f"move it into {where}" if where else "list only values that satisfy it, "
                             "and drop it"))


def _all_typed(values: list, types: Any) -> bool:
    """Whether every value is of one of JSON Schema's `types` (a name or a list of names)."""
    kinds = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
             "null": (type(None),), "object": (dict,), "array": (list,)}
    names = types if isinstance(types, list) else [types]

    def typed(v: Any, name: Any) -> bool:
        if not isinstance(name, str) or name not in kinds:
            return False
        if isinstance(v, bool) and name != "boolean":
            return False
        return isinstance(v, kinds[name]) or (name == "integer" and isinstance(v, float) and v.is_integer())

    return isinstance(values, list) and all(any(typed(v, n) for n in names) for v in values)


def _big_int(value: Any) -> bool:
    """Whether JSON value `value` holds an integer past 2^53 anywhere."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > 2**53:
            return True
        stack.extend(v.values() if isinstance(v, dict) else v if isinstance(v, list) else ())
    return False


def _matches(pattern: str, name: str) -> bool:
    """Whether `pattern` finds a match in `name` (ECMA-262's named groups read as Python's); a
    pattern Python cannot read counts as matching, so its overlap is refused rather than missed."""
    try:
        return re.search(re.sub(r"\(\?<(?![=!])", "(?P<", pattern), name) is not None
    except re.error:
        return True


def _kind(v: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
            float: "a number", type(None): "null"}.get(type(v), type(v).__name__)


def _shown(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."
