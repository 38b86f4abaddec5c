"""The mistral tool-call parser: `[TOOL_CALLS]` then, by the tokenizer's version,
  - a JSON array of {"name", "arguments"} (v3: Mistral-7B-Instruct-v0.3, Mixtral 8x22B, Nemo), or
  - `name[ARGS]{...}` (v11+: Devstral, Magistral), or `name[CALL_ID]id[ARGS]{...}` (Mistral Small 3.2),
    each call after its own `[TOOL_CALLS]`.
An array's elements are sent as each closes (a later element that is malformed is given back as text
from its own start). The markers are special tokens: the text must keep special tokens. Call ids are
9 letters or digits, the only ids Mistral's templates take back.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from orca_mq.api.parsers.scan import Scanner, arguments, begins, call_of, marks, mistral_id

TAG, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_TAG = marks(TAG)
_NAME = re.compile(r"[A-Za-z0-9_.\-]*")
MAX_NAME = 64     # a function name's longest (the chat API's own bound); an id is held to it too


@dataclass(slots=True)
class Mistral(Scanner):
    openers = (TAG,)
    reading = frozenset({"head", "item", "name", "call_id", "args"})
    state: Literal["text", "head", "item", "sep", "name", "call_id", "args"] = "text"
    array: bool = False             # reading the elements of a [TOOL_CALLS] [...] array
    name: list[str] = field(default_factory=list)
    spelled: int = 0                # characters of the name (or id) being read

    @staticmethod
    def renders(template: str) -> bool:
        return TAG in template

    def step(self, s: str, i: int) -> int:
        match self.state:
            case "text":
                j = self.text_until(s, i, _TAG, "head")
                self.lead = self.state == "head"
                return j
            case "head":                # the form is told by the first character after the tag
                self.array = s[i] == "["
                if s[i] in "[{":
                    self.region.append(s[i:i + self.array])
                    self.begin("")
                    self.state = "item"
                    return i + self.array
                self.state, self.name, self.spelled = "name", [], 0
                return i
            case "item" | "args":
                return self.value_step(s, i)
            case "sep":                 # after an array element: `,` and the next, or `]`
                if s[i] == "," and self.array:
                    self.begin(",")
                    self.state = "item"
                    return i + 1
                self.state = "text"
                return i + (s[i] == "]" and self.array)
            case _:                     # a name (or a call id) up to [CALL_ID] / [ARGS]
                j = _NAME.match(s, i).end()
                self.region.append(s[i:j])
                if self.state == "name":
                    self.name.append(s[i:j])
                self.spelled += j - i
                if self.spelled > MAX_NAME or (self.state == "name" and j < len(s) and not self.spelled):
                    self.give_back()
                    return j
                for mark, after in ((ARGS, "args"), (CALL_ID, "call_id")):
                    if s.startswith(mark, j) and (after == "args" or self.state == "name"):
                        self.region.append(mark)
                        self.state, self.spelled = after, 0
                        if after == "args":
                            self.begin("")
                        return j + len(mark)
                if begins(s, j, ARGS, CALL_ID):
                    return self.hold(s, j)
                if j < len(s):
                    self.give_back()
                return j

    def value_step(self, s: str, i: int) -> int:
        j = self.read_json(s, i)
        if self.json.state == "bad":
            self.give_back()
            return j
        if self.json.state == "done":
            if self.state == "item":
                call = call_of(self.decoded(), self.tools)
            else:
                name, args = "".join(self.name), arguments(self.decoded())
                call = (name, args) if name in self.tools and args is not None else None
            if call is None:
                self.give_back()
                return j
            self.send(*call, new_id=mistral_id)
            self.state = "sep" if self.state == "item" else "text"
        return j
