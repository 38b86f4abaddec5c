"""The llama3_json tool-call parser (Llama 3.1 / 3.2 / 3.3 with JSON tool calling): the model answers
with `{"name": ..., "parameters": {...}}` (or "arguments"), possibly after `<|python_tag|>`, several
separated by `;`.

Calls come at the start of the output (after whitespace) or after `<|python_tag|>` anywhere; a JSON
value there that is not a call of a given tool is content, like any other text. A call is complete
when its object closes. `<|python_tag|>` is a special token: the text must keep special tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from orca_mq.api.parsers.scan import Scanner, begins, call_of, marks

TAG = "<|python_tag|>"
_TAG = marks(TAG)
KEYS = ("parameters", "arguments")


@dataclass(slots=True)
class Llama3Json(Scanner):
    openers = (TAG,)
    reading = frozenset({"json"})
    state: Literal["start", "text", "json", "next"] = "start"
    lead: bool = True

    @staticmethod
    def renders(template: str) -> bool:
        return TAG in template or ("<|start_header_id|>" in template and '"parameters"' in template)

    def step(self, s: str, i: int) -> int:
        if self.state == "start" or self.state == "next":   # where a call may begin without the tag
            if s.startswith(TAG, i) or s[i] == "{" or (self.state == "next" and s[i] == ";"):
                opener = next((m for m in (TAG, ";") if s.startswith(m, i)), "")
                self.begin(opener)
                self.state = "json"
                return i + len(opener)
            if begins(s, i, TAG):
                return self.hold(s, i)
            self.state = "text"
            return i
        if self.state == "text":
            return self.text_until(s, i, _TAG, "json")
        j = self.read_json(s, i)
        if self.json.state == "done" and (call := call_of(self.decoded(), self.tools, KEYS)):
            self.send(*call)
            self.state = "next"
        elif self.json.state != "open":
            self.give_back()
        return j
