"""The regular expressions of a request's JSON schema (`pattern`, `patternProperties`) as
xgrammar enforces them: what one costs written out, and what it matches that the grammar reads
its own way (`schema_check` calls `pattern_size` and `for_grammar` on each).

`for_grammar` writes a pattern for xgrammar's regex converter (`pattern_grammar`): every class,
`.` and class escape (`\\d`, `\\W`, ...) as an explicit class of the characters that a JSON
string holds unescaped (not `"`, `\\`, controls or surrogates) and that the class matches in both
dialects a validator may read it in, ECMA-262's with the `u` flag (JSON Schema's) and Python's
(`jsonschema`'s): `\\d` is [0-9] in one and every decimal digit in the other, so `\\d` is [0-9]
and `\\D` is every character but the decimal digits. What either matches, a grammar-accepted
string then matches in both."""

from __future__ import annotations

import array
import functools
import re
import sys

from metrale.runtime.errors import ConfigError

MAX_REPEAT = 1000  # one `pattern` quantifier's count


def pattern_size(pattern: str, where: str) -> int:
    """The number of items (characters, classes) in regular expression `pattern` with every
    quantifier written out (`(ab){3}` is 6, `[a-z]{1,8}` 8), refusing a quantifier past
    MAX_REPEAT or with its bounds out of order (`{3,2}`), and lookaround, which xgrammar does not
    enforce."""
    groups = [0]  # the size of each open group so far; the outermost is the pattern
    last = 0  # the size of the item a quantifier would repeat
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":  # an escape: one item
            i, last = i + 2, 1
            groups[-1] += 1
            continue
        if c == "[":  # a class, up to its unescaped closing bracket: one item
            i, last = _class_end(pattern, i), 1
            groups[-1] += 1
            continue
        if c == "(":
            if pattern.startswith(("(?=", "(?!", "(?<=", "(?<!"), i):
                raise ConfigError(f"{where}: lookahead and lookbehind are not enforced, so they "
                                  "are refused rather than ignored")
            groups.append(0)
            i += 1
            continue
        if c == ")" and len(groups) > 1:
            last = groups.pop()
            groups[-1] += last
            i += 1
            continue
        if c == "{":
            bounds = _bounds(pattern, i)
            if bounds is not None:
                lo, hi, j = bounds
                times = lo if hi is None else max(lo, hi)
                if times > MAX_REPEAT:
                    raise ConfigError(f"{where}: a quantifier repeats {times} times; at most "
                                      f"{MAX_REPEAT} are allowed")
                if hi is not None and hi < lo:
                    raise ConfigError(f"{where}: a quantifier's bounds out of order (`{pattern[i:j]}`)")
                i = j
                groups[-1] += last * (times - 1)
                last *= times
                continue
        if c not in "*+?|^$":
            last = 1
            groups[-1] += 1
        i += 1
    return sum(groups)


MAX_CODEPOINT = 0x10FFFF
# the characters a JSON string holds unescaped: not controls, `"`, `\`, or surrogates
JSON_TEXT = ((0x20, 0x21), (0x23, 0x5B), (0x5D, 0xD7FF), (0xE000, MAX_CODEPOINT))
ECMA_SPACE = ((0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A),
              (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000), (0xFEFF, 0xFEFF))
ECMA_SETS = {"d": ((0x30, 0x39),), "w": ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)),
             "s": ECMA_SPACE}
LINE_ENDS = {"ecma": ((0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029)), "python": ((0x0A, 0x0A),)}
Ranges = tuple[tuple[int, int], ...]
MAX_CLASS_RANGES = 32


def for_grammar(pattern: str, where: str) -> str:
    """`pattern` with its classes written out for xgrammar's regex converter (the module
    docstring); groups are made plain (the converter knows no names, and no backreference is
    allowed). Refuses, naming `where`: an anchor inside the pattern (the converter ignores it), a
    possessive quantifier, an escape of a letter or digit other than a class escape (a
    backreference, a word boundary, `\\p{...}`), a control character, a class opening with `]`,
    a range from or to a class escape, and a class no character of a JSON string matches."""
    out: list[str] = []
    i, n, depth, start = 0, len(pattern), 0, True  # start: nothing matched since the pattern began
    while i < n:
        c = pattern[i]
        if c == "\\" and pattern[i + 1:i + 2].lower() in ECMA_SETS:
            out.append(_written(_class_set(pattern[i + 1], positive=True), where))
            i, start = i + 2, False
        elif c == "\\":
            code, i = _escaped(pattern, i, where)
            out.append(_literal(code, where))
            start = False
        elif c == "[":
            j, chars = _class(pattern, i, where)
            out.append(_written(chars, where))
            i, start = j, False
        elif c == ".":
            out.append(_written(_dot(), where))
            i, start = i + 1, False
        elif c == "(":
            if pattern.startswith("(?", i) and not pattern.startswith("(?:", i):
                raise ConfigError(f"{where}: `{pattern[i:i + 3]}` is not enforced: a group is `(...)` or "
                                  "`(?:...)` (a named group is read by only one of ECMA-262 and Python)")
            out.append("(")
            i, depth = i + 1 + 2 * pattern.startswith("(?:", i), depth + 1
        elif c in "^$":
            ends = i + 1 == n or (pattern[i + 1] == "|" and depth == 0)
            if not (start and depth == 0) if c == "^" else not ends:
                raise ConfigError(f"{where}: an anchor (`{c}`) inside the pattern is not enforced; "
                                  "anchor at its start and end only")
            out.append(c)
            i += 1
        elif not c.isascii() or c < " " or c == '"':
            out.append(_literal(ord(c), where))
            i, start = i + 1, False
        elif c == "{" and (bounds := _bounds(pattern, i)) is not None:  # a quantifier
            j = bounds[2]
            if pattern[j:j + 1] == "+":
                raise ConfigError(f"{where}: a possessive quantifier (`}}+`) is not a JSON Schema "
                                  "regular expression")
            out.append(pattern[i:j])
            i = j
        elif c in "{}]" or (c == ")" and depth == 0):
            raise ConfigError(f"{where}: a lone `{c}` is not enforced; write `\\{c}` for the character")
        else:
            if c in "*+?" and pattern[i + 1:i + 2] == "+":
                raise ConfigError(f"{where}: a possessive quantifier (`{c}+`) is not a JSON Schema "
                                  "regular expression")
            depth -= c == ")"
            start = c == "|" and depth == 0
            out.append(c)
            i += 1
    return "".join(out)


def _class(pattern: str, i: int, where: str) -> tuple[int, Ranges]:
    """The class at `i` (`[...]`): the index after it and the characters it matches in both
    dialects (a negated class: those neither reads in it)."""
    negated = pattern[i + 1:i + 2] == "^"
    j = i + 1 + negated
    if pattern[j:j + 1] == "]":
        raise ConfigError(f"{where}: a class opening with `]` is read differently by JSON Schema's "
                          "regular expressions and Python's; write `\\]`")
    items: list[tuple[int, int]] = []
    sets: list[Ranges] = []
    while j < len(pattern) and pattern[j] != "]":
        if pattern[j] == "\\" and pattern[j + 1:j + 2].lower() in ECMA_SETS:
            sets.append(_class_set(pattern[j + 1], positive=not negated))
            if pattern[j + 2:j + 3] == "-" and pattern[j + 3:j + 4] not in ("]", ""):
                raise ConfigError(f"{where}: a range from a class escape (`{pattern[j:j + 4]}`); "
                                  "a dash written first or last is itself")
            j += 2
            continue
        lo, j = _class_char(pattern, j, where)
        hi = lo
        if pattern[j:j + 1] == "-" and pattern[j + 1:j + 2] not in ("]", ""):
            if pattern[j + 1] == "\\" and pattern[j + 2:j + 3].lower() in ECMA_SETS:
                raise ConfigError(f"{where}: a range to a class escape (`{pattern[j - 1:j + 3]}`)")
            hi, j = _class_char(pattern, j + 1, where)
            if hi < lo:
                raise ConfigError(f"{where}: a range out of order (`{chr(lo)}-{chr(hi)}`)")
        items.append((lo, hi))
    if j >= len(pattern):
        raise ConfigError(f"{where}: a class that is not closed")
    chars = _union(_merged(items), *sets)
    return j + 1, _complement(chars) if negated else chars


def _class_char(pattern: str, j: int, where: str) -> tuple[int, int]:
    """The code point of the class member at `j` (a character or an escape; `\\b` is a
    backspace there) and the index after it."""
    if pattern[j] != "\\":
        return ord(pattern[j]), j + 1
    if pattern[j + 1:j + 2] == "b":
        return 0x08, j + 2
    return _escaped(pattern, j, where)


CODE_ESCAPES = {"n": 0x0A, "r": 0x0D, "t": 0x09, "f": 0x0C, "v": 0x0B, "0": 0x00}


def _escaped(pattern: str, i: int, where: str) -> tuple[int, int]:
    """The code point of the escape at `i` (`\\n`, `\\x41`, `\\u00e9`, an escaped punctuation
    character) and the index after it; refuses a letter or digit escape that stands for no
    character (a backreference, a word boundary, a property escape) or that one dialect lacks
    (`\\cJ`)."""
    e = pattern[i + 1:i + 2]
    digits = {"x": 2, "u": 4}.get(e, 0)
    hexa = pattern[i + 2:i + 2 + digits]
    if digits and len(hexa) == digits and all(h in "0123456789abcdefABCDEF" for h in hexa):
        return int(hexa, 16), i + 2 + digits
    if e in CODE_ESCAPES and not (e == "0" and pattern[i + 2:i + 3].isdigit()):
        return CODE_ESCAPES[e], i + 2
    if not e or e.isalnum():
        raise ConfigError(f"{where}: `\\{e}` is not enforced in a pattern here (a backreference, "
                          "a word boundary or a property escape)")
    return ord(e), i + 2


def _literal(code: int, where: str) -> str:
    """Character `code` as the converter reads it (`\\u` written), if a JSON string holds it
    unescaped."""
    if not _intersect(((code, code),), JSON_TEXT):
        raise ConfigError(f"{where}: a pattern matching `\"`, `\\` or a control character (here "
                          f"U+{code:04X}) is not enforced (a JSON string holds them escaped)")
    if code < 0x80:  # an ASCII character as itself, a regex's own characters escaped
        return "\\" + chr(code) if chr(code) in "^$\\.|?*+()[]{}" else chr(code)
    return _u(code)


def _class_set(letter: str, positive: bool) -> Ranges:
    """What `\\<letter>` matches in both dialects (`positive`), or in either (a member of a
    negated class, which then matches only what neither dialect reads in it)."""
    base = letter.lower()
    python, ecma = _python_set(base), _merged(ECMA_SETS[base])
    agreed, either = _intersect(python, ecma), _union(python, ecma)
    if letter.islower():
        return agreed if positive else either
    return _complement(either if positive else agreed)  # \D, \W, \S


@functools.lru_cache(maxsize=1)
def _dot() -> Ranges:
    """`.`: every character but a line end, in both dialects."""
    return _complement(_union(_merged(LINE_ENDS["ecma"]), _merged(LINE_ENDS["python"])))


def _python_set(base: str) -> Ranges:
    """What Python's `\\d`, `\\w` or `\\s` matches, as ranges of code points."""
    return _python_sets()[base]


@functools.lru_cache(maxsize=1)
def _python_sets() -> dict[str, Ranges]:
    """Python's `\\d`, `\\w` and `\\s`, read once over every code point (the text of all of them,
    4 MB, is let go after)."""
    codes = array.array("I", range(MAX_CODEPOINT + 1))  # 4-byte words in this machine's order
    text = codes.tobytes().decode(f"utf-32-{sys.byteorder[0]}e", "surrogatepass")  # index = code point
    return {base: tuple((m.start(), m.end() - 1) for m in re.finditer(f"\\{base}+", text)) for base in ECMA_SETS}


def _written(chars: Ranges, where: str) -> str:
    """`chars` narrowed to a JSON string's unescaped characters, as a class of ranges (`_u`);
    a class of more than MAX_CLASS_RANGES ranges (`\\W` is some 700, one per gap between
    the scripts' letters) keeps those below U+0100 and the widest others, since the grammar's
    compile time grows with the ranges times the class's repetitions (a string it allows still
    matches the class)."""
    chars = _intersect(chars, JSON_TEXT)
    if not chars:
        raise ConfigError(f"{where}: a class no character of a JSON string matches unescaped")
    if len(chars) > MAX_CLASS_RANGES:  # the ranges below U+0100 and the widest others
        low = [r for r in chars if r[0] < 0x100]
        wide = sorted((r for r in chars if r[0] >= 0x100), key=lambda r: r[0] - r[1])
        chars = tuple(sorted(low + wide[:max(0, MAX_CLASS_RANGES - len(low))]))
    if chars[0][0] == ord("^"):  # the converter reads a class opening with `^`, escaped or not, as negated
        lo, hi = chars[0]
        chars = (*chars[1:], *([(lo + 1, hi)] if hi > lo else []), (lo, lo))
        if len(chars) == 1:
            return "\\^"
    return class_text(chars)


def class_text(chars: Ranges) -> str:
    """`chars` as a class of ranges (`_u`), as regular expressions and xgrammar's EBNF read it."""
    return "[" + "".join(_u(lo) if lo == hi else f"{_u(lo)}-{_u(hi)}" for lo, hi in chars) + "]"


def _u(c: int) -> str:
    """Code point `c` in a class: `\\u` and its four digits, or itself past U+FFFF (the regex
    converter reads `\\U` escapes, but xgrammar's own reading of a schema's patterns, which
    `schema_grammar` replaces, warns at each of them)."""
    return f"\\u{c:04x}" if c <= 0xFFFF else chr(c)


def _merged(ranges) -> Ranges:
    out: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return tuple((lo, hi) for lo, hi in out)


def _union(*sets: Ranges) -> Ranges:
    return _merged(r for s in sets for r in s)


def _complement(chars: Ranges) -> Ranges:
    out, nxt = [], 0
    for lo, hi in chars:
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = hi + 1
    if nxt <= MAX_CODEPOINT:
        out.append((nxt, MAX_CODEPOINT))
    return tuple(out)


def _intersect(a: Ranges, b: Ranges) -> Ranges:
    return _complement(_union(_complement(a), _complement(b)))


def _bounds(pattern: str, i: int) -> tuple[int, int | None, int] | None:
    """The quantifier `{m}`, `{m,}` or `{m,n}` at `i`: (m, n or None, the index after it); None
    where the brace is a literal."""
    j = pattern.find("}", i)
    body = pattern[i + 1:j].split(",") if j > 0 else []
    if not (1 <= len(body) <= 2 and _digits(body[0]) and all(_digits(b) for b in body[1:] if b)):
        return None
    lo = int(body[0])
    return lo, (lo if len(body) == 1 else int(body[1]) if body[1] else None), j + 1


def _digits(text: str) -> bool:
    """ASCII digits only (`str.isdigit` also takes `²` and `١`, which no regex counts with)."""
    return text.isascii() and text.isdigit()


def _class_end(pattern: str, i: int) -> int:
    """The index after the class that opens at `i`."""
    j = i + 1 + (pattern[i + 1:i + 2] == "^")
    j += pattern[j:j + 1] == "]"
    while j < len(pattern) and pattern[j] != "]":
        j += 2 if pattern[j] == "\\" else 1
    return j + 1
