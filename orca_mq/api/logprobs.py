"""Log probabilities in OpenAI's two shapes, built from what the client gets (orca_mq.protocol.logprobs).

Chat (`logprobs: true`, `top_logprobs: k`): `choices[i].logprobs.content` is one entry per token,
`{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}, ...k]}`. Completions (`logprobs: k`,
the legacy shape): `tokens`, `token_logprobs`, `top_logprobs` (a dict per token: the token itself
and the k most likely, as vLLM gives it; null with k = 0 and at a prompt's first token) and
`text_offset` (each token's start in the choice's text, counting the tokens' texts from `offset`).
With `echo`, the prompt's tokens come first, the first one's log probability null.

A token's text is its id decoded alone, as vLLM shows it; `bytes` are that text's UTF-8. A log
probability below -9999 (or not finite) is written as -9999.0, as vLLM and OpenAI do (JSON has no -inf).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from orca_mq.protocol.logprobs import Logprobs, entries

if TYPE_CHECKING:
    from orca_mq.api.stream import Generation

FLOOR = -9999.0
_FLOOR_JSON = repr(FLOOR)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None
    refusal: None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


# The shapes are written as JSON text, in ChatLogprobs' and CompletionLogprobs' form, and spliced into
# the response as they are (orca_mq.api.offload.dump): strings only, no dict or list per entry, so a
# response of a million log probabilities leaves the garbage collector nothing to walk (its full
# collections, over the objects they would have been, stalled every thread about a second here).

def _str(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _num(v: float) -> str:
    return repr(v) if FLOOR < v < math.inf else _FLOOR_JSON   # not NaN, not infinite, above the floor


_PIECES: dict[str, tuple[str, str]] = {}   # a token's text: its entry's JSON before and after the logprob
_MAX_PIECES = 1 << 16                       # texts kept (~10 MB at most); past it, start again


def _pieces(token: str) -> tuple[str, str]:
    """A {token, logprob, bytes} object's JSON around its logprob (the object left open): the same
    for every entry of a token, so made once per text (a response of 16 x 780 positions with 20
    alternatives each is 262,080 entries over a few thousand texts)."""
    if (p := _PIECES.get(token)) is None:
        if len(_PIECES) >= _MAX_PIECES:
            _PIECES.clear()
        p = _PIECES[token] = ('{"token":' + _str(token) + ',"logprob":',
                              ',"bytes":[' + ",".join(map(str, token.encode("utf-8", errors="replace"))) + "]")
    return p


def _entry(token: str, value: float) -> str:
    """A {token, logprob, bytes} object, open (its caller closes it)."""
    before, after = _pieces(token)
    return before + _num(value) + after


def chat_logprobs(lp: Logprobs | None) -> str | None:
    """ChatLogprobs of `lp`'s tokens, as JSON."""
    if lp is None:
        return None
    content = ",".join(_entry(token, FLOOR if value is None else value) + ',"top_logprobs":['
                       + ",".join([_entry(t, v) + "}" for t, v in zip(tops, values)]) + "]}"
                       for token, value, tops, values in zip(lp.tokens, lp.logprobs, lp.top_tokens, lp.top_logprobs))
    return '{"content":[' + content + '],"refusal":null}'


def completion_logprobs(lp: Logprobs | None, offset: int) -> str | None:
    """CompletionLogprobs of `lp`'s tokens, as JSON, their text offsets counted from `offset`."""
    if lp is None:
        return None
    offsets, at = [], offset
    for token in lp.tokens:
        offsets.append(str(at))
        at += len(token)
    top: list[str] = []
    for i, value in enumerate(lp.logprobs):
        if value is None or not lp.top_ids[i]:   # a prompt's first token; or k = 0 asks for no alternatives
            top.append("null")
            continue
        seen = {lp.tokens[i]}
        items = [_str(lp.tokens[i]) + ":" + _num(value)]
        for t, v in zip(lp.top_tokens[i], lp.top_logprobs[i]):
            if t not in seen:
                seen.add(t)
                items.append(_str(t) + ":" + _num(v))
        top.append("{" + ",".join(items) + "}")
    values = ",".join("null" if v is None else _num(v) for v in lp.logprobs)
    return ('{"tokens":[' + ",".join(map(_str, lp.tokens)) + '],"token_logprobs":[' + values + '],"top_logprobs":['
            + ",".join(top) + '],"text_offset":[' + ",".join(offsets) + "]}")


def text_length(lp: Logprobs | None) -> int:
    """How far its tokens' texts reach (the next chunk's text offset)."""
    return 0 if lp is None else sum(map(len, lp.tokens))


def joined(*parts: Logprobs | None) -> Logprobs | None:
    """The positions of several in order (echo: the prompt's, then the generated ones)."""
    out = None
    for p in parts:
        if p is None:
            continue
        if out is None:
            out = Logprobs()
        out.extend(p)
    return out


@dataclass(slots=True)
class Shaper:
    """One choice's log probabilities (and completions' echo) put onto its responses: the whole
    answer, or each streamed chunk its tokens' (what arrived since the last chunk). The prompt's
    log probabilities are its `lead`'s: the first choice of its prompt, the one that asks for them
    (a prompt's are computed once, for all its choices: orca_mq.api.fanout)."""

    chat: bool
    lead: "Generation"
    echo: bool = False
    echo_text: str | None = None   # a text prompt as given; None: the prompt tokens' texts (a prompt of ids)
    offset: int = 0                # completions: the text offset the next chunk's tokens start at
    echoed: bool = False

    @property
    def prompt(self) -> Logprobs | None:
        return self.lead.prompt_logprobs

    def weight(self, fresh: Logprobs | None) -> int:
        """The log probabilities a chunk carrying `fresh` holds (its echoed prompt's included)."""
        return entries(fresh) + (entries(self.prompt) if self.echo and not self.echoed else 0)

    def whole(self, resp: Any, gen: "Generation") -> Any:
        choice = resp.choices[0]
        if self.chat:
            choice.logprobs = chat_logprobs(gen.logprobs)
            return resp
        prompt = self.prompt if self.echo else None
        choice.logprobs = completion_logprobs(joined(prompt, gen.logprobs), 0) if gen.sampling.get("logprobs") is not None else None
        if self.echo:
            choice.text = self._echo_text() + choice.text
        return resp

    def chunk(self, resp: Any, gen: "Generation", fresh: Logprobs | None) -> Any:
        """A streamed chunk with `fresh`, the log probabilities taken from `gen` for it (`Generation.take`)."""
        if not resp.choices:   # the usage chunk
            return resp
        choice = resp.choices[0]
        if self.chat:
            choice.logprobs = chat_logprobs(fresh)
            return resp
        prompt = None
        if self.echo and not self.echoed:
            self.echoed = True
            prompt = self.prompt
            choice.text = self._echo_text() + choice.text
        lp = joined(prompt, fresh)
        if gen.sampling.get("logprobs") is not None:
            choice.logprobs = completion_logprobs(lp or Logprobs(), self.offset)
            self.offset += text_length(lp)
        return resp

    def _echo_text(self) -> str:
        if self.echo_text is not None:
            return self.echo_text
        return "".join(self.prompt.tokens) if self.prompt is not None else ""
