"""The `<think>…</think>` reasoning parser (Qwen3, QwQ, the DeepSeek-R1 distills).

An output is [whitespace] [`<think>`] thinking `</think>` answer. Whether it begins inside the
thinking is known before the first token, from the prompt: the R1 distills' templates (and the
Qwen3 thinking-only ones) end the generation prompt with `<think>\\n`, so the model writes only
`</think>`; Qwen3 with enable_thinking=false renders an empty `<think>\\n\\n</think>` block, so the
output is all answer (`starts_inside`). Otherwise the thinking is there only if the output opens
with `<think>`. A tool parser's opening marker (e.g. `<tool_call>`) also ends the thinking, and goes
on to the tool parser: a call the model writes without closing its thinking is not swallowed.

Whitespace right after `<think>` and after `</think>` is dropped (the templates' own newlines).
A stream cut inside the thinking leaves it all reasoning and the answer empty.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from orca_mq.api.parsers.scan import Marks, Scanner, begins, marks

OPEN, CLOSE = "<think>", "</think>"


def starts_inside(prompt: str) -> bool:
    """Whether the output begins inside the thinking: the prompt's last `<think>` is not closed."""
    return prompt.rfind(OPEN) > prompt.rfind(CLOSE)


@dataclass(slots=True)
class Think(Scanner):
    inside: bool = False                  # the output begins inside the thinking (starts_inside)
    also_ends: tuple[str, ...] = ()       # the tool parser's opening markers
    state: Literal["start", "reasoning", "answer"] = "start"
    lead: bool = True                     # the output's leading whitespace is dropped
    ends: Marks = field(init=False)

    def __post_init__(self) -> None:
        self.ends = marks(CLOSE, *self.also_ends)

    @staticmethod
    def renders(template: str) -> bool:
        return CLOSE in template

    def step(self, s: str, i: int) -> int:
        if self.state == "start":
            if s.startswith(OPEN, i):
                self.state, self.lead = "reasoning", True
                return i + len(OPEN)
            if begins(s, i, OPEN):
                return self.hold(s, i)
            self.state = "reasoning" if self.inside else "answer"
            return i
        if self.state == "reasoning":
            j, mark = self.upto(s, i, self.ends, self.out.reasoning.append)
            if mark is not None:
                self.state, self.lead = "answer", mark == CLOSE
                if mark != CLOSE:
                    self.out.content.append(mark)
            return j
        self.out.content.append(s[i:])
        return len(s)

    def end(self, held: str, cut: bool) -> None:
        if cut or not held:
            return
        reasoning = self.state == "reasoning" or (self.state == "start" and self.inside)
        (self.out.reasoning if reasoning else self.out.content).append(held)
