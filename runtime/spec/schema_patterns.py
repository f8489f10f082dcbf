"""The regular expressions of a request's JSON schema (`pattern`, `patternProperties`) as
xgrammar enforces them: what one costs written out, and what it matches that the grammar reads
its own way (`schema_check` calls `pattern_size` on each)."""

from __future__ import annotations

from metrale.runtime.errors import ConfigError

MAX_REPEAT = 1000  # one `pattern` quantifier's count


def pattern_size(pattern: str, where: str) -> int:
    """The number of items (characters, classes) in regular expression `pattern` with every
    quantifier written out (`(ab){3}` is 6, `[a-z]{1,8}` 8), refusing a quantifier past
    MAX_REPEAT and lookaround, which xgrammar does not enforce."""
    k = 0
    while k < len(pattern):  # the escapes, a pair of characters each
        escaped = pattern[k + 1:k + 2] if pattern[k] == "\\" else ""
        if pattern[k] == '"' or (escaped and escaped in '\\"nrtfv0xuc'):
            raise ConfigError(f"{where}: a pattern matching `\"`, `\\` or a control character is not "
                              "enforced (the grammar matches it against the JSON text, escapes included)")
        k += 2 if escaped else 1
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
            j = i + 1 + (pattern[i + 1:i + 2] == "^")
            j += pattern[j:j + 1] == "]"
            while j < n and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            i, last = j + 1, 1
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
            count = _braces(pattern, i)
            if count is not None:
                times, i = count
                if times > MAX_REPEAT:
                    raise ConfigError(f"{where}: a quantifier repeats {times} times; at most "
                                      f"{MAX_REPEAT} are allowed")
                groups[-1] += last * (times - 1)
                last *= times
                continue
        if c not in "*+?|^$":
            last = 1
            groups[-1] += 1
        i += 1
    return sum(groups)


def _braces(pattern: str, i: int) -> tuple[int, int] | None:
    """The count of the quantifier `{m}`, `{m,}` or `{m,n}` at `i` (its larger bound) and the
    index after it; None where the brace is a literal."""
    j = pattern.find("}", i)
    if j < 0:
        return None
    body = pattern[i + 1:j].split(",")
    if len(body) > 2 or not body[0].isdigit() or not all(b.isdigit() for b in body[1:] if b):
        return None
    return max(int(b) for b in body if b), j + 1
