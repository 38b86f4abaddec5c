"""A request that does not stream (`generate.stream` False, protocol v11): the frontend holds its rows
and sends them with its final, one row with every token, text and log probability, so its tokens cost
no frame through the broker and its client each iteration (SGLang sends such a request's output once,
at its end). A hold that reaches a frame's worth of tokens and log probabilities (FRAME_ENTRIES) goes
at once: a row stays a frame a receiver decodes in one short turn, however long the request runs."""
from __future__ import annotations

from dataclasses import dataclass, field

from orca_mq.assembly import Row
from orca_mq.protocol.frames import FRAME_ENTRIES
from orca_mq.protocol.logprobs import Logprobs, entries


@dataclass(slots=True)
class HeldRows:
    token_ids: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    logprobs: Logprobs | None = None
    prompt_logprobs: Logprobs | None = None   # with the first row (its prompt's)
    weight: int = 0

    def add(self, row: Row) -> Row | None:
        """The row to send now: None while held; what is held, `row` included, at the final or the bound."""
        self.token_ids += row.token_ids
        self.texts.append(row.text)
        if row.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = Logprobs()
            self.logprobs.extend(row.logprobs)
        self.prompt_logprobs = row.prompt_logprobs or self.prompt_logprobs
        self.weight += len(row.token_ids) + entries(row.logprobs) + entries(row.prompt_logprobs)
        if row.final is None and self.weight < FRAME_ENTRIES:
            return None
        out = Row(self.token_ids, "".join(self.texts), row.final, self.logprobs, self.prompt_logprobs, row.embedding)
        self.token_ids, self.texts, self.logprobs, self.prompt_logprobs, self.weight = [], [], None, None, 0
        return out
