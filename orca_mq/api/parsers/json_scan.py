"""Where a JSON object or array written by a model ends, found as the text streams in.

The scanner reads each character once, across pieces (its state is the nesting depth and whether it
is inside a string or an escape), skipping runs with single-class regexes that cannot backtrack; it
stops at the value's closing bracket, or at the first character that no JSON value could hold there
(a `<` outside a string: the model left the JSON). It checks brackets and strings only: the value it
delimits is then decoded once by `loads`, which judges the rest.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

_WS = re.compile(r"[ \t\r\n]*")
_IN_STRING = re.compile(r'[^"\\]*')
_OPENS, _CLOSES = re.compile(r"[\[{]+"), re.compile(r"[\]}]+")
_BARE = re.compile(r"[ \t\r\n,:0-9.eE+\-truefalsn]*")   # outside strings: separators, numbers, true/false/null

State = Literal["open", "done", "bad"]


@dataclass(slots=True)
class JsonScan:
    depth: int = 0
    string: bool = False
    escape: bool = False
    state: State = "open"

    def scan(self, s: str, i: int) -> int:
        """Reads s[i:]: the index past the value's last character (state done), of the character that
        cannot be JSON (state bad), or len(s) (still open)."""
        n = len(s)
        while i < n:
            if self.escape:
                self.escape, i = False, i + 1
            elif self.string:
                i = _IN_STRING.match(s, i).end()
                if i < n:   # a quote ends the string, a backslash escapes what follows
                    self.string, self.escape, i = s[i] == "\\", s[i] == "\\", i + 1
            else:
                i = (_BARE if self.depth else _WS).match(s, i).end()
                if i == n:
                    break
                if m := _OPENS.match(s, i):         # a run of brackets at once (a deep nesting is one step)
                    self.depth, i = self.depth + m.end() - i, m.end()
                elif self.depth and (m := _CLOSES.match(s, i)):
                    if m.end() - i >= self.depth:
                        self.state = "done"
                        return i + self.depth
                    self.depth, i = self.depth - (m.end() - i), m.end()
                elif s[i] == '"' and self.depth:
                    self.string, i = True, i + 1
                else:
                    self.state = "bad"
                    return i
        return n


def loads(text: str) -> Any:
    """The value, or None where it is not JSON (raw control characters inside strings are let through:
    models write newlines in code arguments)."""
    try:
        return json.loads(text, strict=False)
    except (ValueError, RecursionError):
        return None
