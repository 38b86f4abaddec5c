"""The hermes tool-call parser (Qwen2.5, Qwen3, QwQ, Hermes 2/3): each call is
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, with text around the calls as content.

A call is complete at `</tool_call>`; also where the model began the next `<tool_call>` or ended the
output without writing the closing tag (small models do both). The JSON is delimited by JsonScan,
so a `</tool_call>` inside a string is text and a call that leaves JSON (`<tool_call>oops`) is given
back as content at once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from orca_mq.api.parsers.scan import WS, Scanner, begins, call_of, marks

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_OPEN = marks(OPEN)


@dataclass(slots=True)
class Hermes(Scanner):
    openers = (OPEN,)     # what also ends a reasoning block
    reading = frozenset({"json", "after"})
    state: Literal["text", "json", "after"] = "text"

    @staticmethod
    def renders(template: str) -> bool:
        return OPEN in template

    def step(self, s: str, i: int) -> int:
        if self.state == "text":
            return self.text_until(s, i, _OPEN, "json")
        if self.state == "json":
            j = self.read_json(s, i)
            if self.json.state == "bad":
                self.give_back()
            elif self.json.state == "done":
                self.state = "after"
            return j
        j = WS.match(s, i).end()          # after the JSON: whitespace, then the closing tag
        self.region.append(s[i:j])
        if j == len(s):
            return j
        if s.startswith(CLOSE, j):
            self.region.append(CLOSE)
            self.accept()
            return j + len(CLOSE)
        if s.startswith(OPEN, j):
            self.accept()
            return j
        if begins(s, j, CLOSE, OPEN):
            return self.hold(s, j)
        self.give_back()
        return j

    def accept(self) -> None:
        if call := call_of(self.decoded(), self.tools):
            self.send(*call)
            self.state = "text"
        else:
            self.give_back()

    def end(self, held: str, cut: bool) -> None:
        if self.state == "after" and not cut:   # the JSON is whole: the output ended before the closing tag
            self.accept()
        else:
            Scanner.end(self, held, cut)
