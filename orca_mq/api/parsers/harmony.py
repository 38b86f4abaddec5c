"""gpt-oss's harmony format, reasoning and tool calls in one parser.

The prompt ends `<|start|>assistant`; the model writes messages, each a header, `<|message|>`, a
body and an end (`<|end|>`, or `<|call|>` / `<|return|>`, the EOS tokens the detokenizer hides):

    <|channel|>analysis<|message|>thinking…<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{…}<|call|>
    <|start|>assistant<|channel|>final<|message|>the answer<|return|>

The recipient may also stand before the channel (`<|start|>assistant to=functions.x<|channel|>commentary
json`, as the template renders past calls). The analysis channel is reasoning; final and commentary
without a recipient (a preamble) are content; a message to `functions.NAME` is a call, held until its
end and given back raw as content if NAME is not a given tool or its body is not a JSON object. A
header is held (at most MAX_HEADER characters: text with no harmony markers, e.g. decoded without its
special tokens, then reads as content). All the markers are special tokens: the text must keep them.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from orca_mq.api.parsers.scan import Scanner, arguments, marks

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
_MESSAGE = marks(MESSAGE)
_BODY_END = marks(END, CALL, RETURN, START, CHANNEL)     # a new header also ends a body left open
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")
_RECIPIENT = re.compile(r"to=([^\s<]+)")
MAX_HEADER = 256
FUNCTIONS = "functions."


@dataclass(slots=True)
class Harmony(Scanner):
    openers = ()
    state: Literal["header", "reasoning", "content", "call"] = "header"
    header: list[str] = field(default_factory=list)
    function: str = ""

    @staticmethod
    def renders(template: str) -> bool:
        return CHANNEL in template

    def step(self, s: str, i: int) -> int:
        if self.state == "header":
            j, mark = self.upto(s, i, _MESSAGE, self.header.append)
            if mark is not None:
                self.route("".join(self.header))
            elif sum(map(len, self.header)) + len(self.carry) > MAX_HEADER:
                self.out.content.append("".join(self.header))
                self.state = "content"
            return j
        sink = {"reasoning": self.out.reasoning, "content": self.out.content}.get(self.state)
        j, mark = self.upto(s, i, _BODY_END, self.body if sink is None else sink.append)
        if mark is not None:
            new_header = mark in (START, CHANNEL)
            if sink is None:
                self.settle("" if new_header else mark)
            self.state, self.header = "header", [mark] if new_header else []
        return j

    def route(self, header: str) -> None:
        channel = m.group(1) if (m := _CHANNEL.search(header)) else ""
        if to := _RECIPIENT.search(header):
            self.state, self.function = "call", to.group(1)
            self.begin(header + MESSAGE)
        else:
            self.state = "reasoning" if channel == "analysis" else "content"
        self.header = []

    def body(self, text: str) -> None:
        self.region.append(text)
        self.value.append(text)

    def settle(self, end: str) -> None:
        """A call's message ended (with `end`, kept in its raw text)."""
        self.region.append(end)
        name = self.function.removeprefix(FUNCTIONS)
        args = arguments(self.decoded())
        if self.function.startswith(FUNCTIONS) and name in self.tools and args is not None:
            self.send(name, args)
        else:
            self.give_back()

    def end(self, held: str, cut: bool) -> None:
        if cut:
            self.region.clear()
        elif self.state == "call":
            self.body(held)
            self.settle("")
        elif self.state == "reasoning":
            self.out.reasoning.append(held)
        else:
            self.out.content.append("".join(self.header) + held)
