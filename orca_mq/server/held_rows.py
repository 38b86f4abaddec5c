"""A request that does not stream (`generate.stream` False, protocol v11): the frontend holds its rows
and sends them together, so its tokens cost no frame through the broker and its client each iteration
(SGLang sends such a request's output at its end). Its first row goes at once: it tells the client the
prompt is in (an HTTP request's other choices of that prompt start then, on its prefix cache). After
it, what is held goes with the final, or once it holds HOLD_ENTRIES tokens and log probabilities: a
client's decoding stays spread over the request (16 choices' top-20 log probabilities finishing together
were otherwise one burst of 262,080 entries at the end, which the HTTP process decoded while the other
clients' answers waited), and a row stays far within a frame's FRAME_ENTRIES. A row with
nothing in it goes HOLD_S after the last send: the broker finds a vanished client only when a send to it
fails, and ends its requests then (a held request would otherwise run to its max_tokens for nobody). Not
the held tokens: n choices started together would flush together every HOLD_S, a burst the client's
loop decodes at once."""
from __future__ import annotations

from dataclasses import dataclass, field

from orca_mq.assembly import Row
from orca_mq.protocol.logprobs import Logprobs, entries

HOLD_ENTRIES = 1 << 11   # tokens and log probabilities a hold keeps at most (~100 positions at top-20)
HOLD_S = 1.0   # seconds between a held request's sends at most (an empty row when nothing else is due)


@dataclass(slots=True)
class HeldRows:
    token_ids: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    logprobs: Logprobs | None = None
    prompt_logprobs: Logprobs | None = None
    weight: int = 0
    sent: float | None = None   # when the last row went (None: none yet)

    def add(self, row: Row, now: float) -> Row | None:
        """The row to send now (`now`: time.time()): the first at once; then what is held, `row` included,
        at the final or the bound; else an empty row HOLD_S after the last send, else None."""
        self.token_ids += row.token_ids
        self.texts.append(row.text)
        if row.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = Logprobs()
            self.logprobs.extend(row.logprobs)
        self.prompt_logprobs = row.prompt_logprobs or self.prompt_logprobs
        self.weight += len(row.token_ids) + entries(row.logprobs) + entries(row.prompt_logprobs)
        if row.final is None and self.sent is not None and self.weight < HOLD_ENTRIES:
            if now - self.sent < HOLD_S:
                return None
            self.sent = now
            return Row([], "", None, None, None, None)
        out = Row(self.token_ids, "".join(self.texts), row.final, self.logprobs, self.prompt_logprobs, row.embedding)
        self.token_ids, self.texts, self.logprobs, self.prompt_logprobs, self.weight, self.sent = [], [], None, None, 0, now
        return out
