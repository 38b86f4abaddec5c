"""A request's output as its client sees it, made in one place for the server's frontend (a row per
iteration, streamed: orca_mq.server.outbox) and the offline LLM (the rows gathered into a RequestOutput):
each step's tokens detokenized incrementally (without the EOS that ended the request), its final
(metrics, a stable code), its log probabilities with each token's text beside its id (the prompt's
with its first row, the first position without one) and an embedding request's vector.
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from orca_mq.detokenizer import IncrementalDetokenizer, alone_texts, ends_on_eos, plain_texts
from orca_mq.outputs import output_metrics
from orca_mq.protocol.client_msgs import Final
from orca_mq.protocol.common_msgs import ABORTED, INTERNAL
from orca_mq.protocol.engine_msgs import TokenBatch
from orca_mq.protocol.logprobs import Logprobs, TokenLogprobs
from orca_mq.protocol.sampling import SamplingParams

if TYPE_CHECKING:
    from orca_mq.tokenizer import Tokenizer

FINAL_CODES = {"abort": ABORTED, "error": INTERNAL}
INTERNAL_TEXT = "internal error: the server failed on this request"


@dataclass(slots=True)
class Assembly:
    """One request's output so far: its detokenizer (which holds its tokens) and the times its final reports."""

    detok: IncrementalDetokenizer
    prompt_tokens: int
    arrival: float                   # wall clock, as every time its metrics report
    first_token: float | None = None
    prompt_head: int | None = None   # prompt logprobs asked: its prompt's first token, until they are sent


@dataclass(slots=True)
class Row:
    """What one step gives a request's client."""

    token_ids: list[int]
    text: str
    final: Final | None
    logprobs: Logprobs | None
    prompt_logprobs: Logprobs | None
    embedding: bytes | None


class Assembler:
    def __init__(self, tokenizer: Tokenizer, eos_token_ids: Collection[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)   # the one that ends a request is not shown
        self.token_texts = alone_texts(tokenizer)        # each id decoded alone (log probabilities' tokens), by id
        self.plain = plain_texts(tokenizer, self.token_texts)   # what the detokenizers look up instead of streaming

    def start(self, prompt_ids: list[int], params: SamplingParams, arrival: float) -> Assembly:
        """An admitted request's output, before its first token."""
        head = prompt_ids[0] if params.prompt_logprobs is not None and prompt_ids else None
        return Assembly(IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens, self.plain), len(prompt_ids), arrival,
                        prompt_head=head)

    def rows(self, batch: TokenBatch, now: float,
             assembly: Callable[[str], Assembly | None]) -> Iterator[tuple[str, Assembly, Row]]:
        """One step's rows, a request's tokens grouped (each detokenized once), for the requests
        `assembly` knows (the others' clients are gone); `now`: when the step arrived (wall clock)."""
        new: dict[str, list[int]] = {}
        for iid, token_id in zip(batch.request_ids, batch.token_ids):
            if (ids := new.get(iid)) is None:
                new[iid] = [token_id]
            else:
                ids.append(token_id)
        for iid in batch.finals:
            new.setdefault(iid, [])
        logprobs = _per_request(batch) if batch.logprobs else {}
        for iid, ids in new.items():
            a = assembly(iid)
            if a is None:
                continue
            reason = batch.finals.get(iid)
            if ids and a.first_token is None:
                a.first_token = now
            text = a.detok.step(ids, ends_on_eos(ids, reason, self.eos_token_ids))
            final = None
            if reason is not None:
                text += a.detok.finish()
                metrics = output_metrics(a.prompt_tokens, len(a.detok.ids), a.arrival, a.first_token, now,
                                         batch.metrics.get(iid))
                final = Final(reason, INTERNAL_TEXT if reason == "error" else None, metrics, FINAL_CODES.get(reason))
            lps = (self._logprobs(a, logprobs.get(iid), batch.prompt_logprobs.get(iid))
                   if iid in logprobs or a.prompt_head is not None else (None, None))
            yield iid, a, Row(ids, text, final, *lps, batch.embeddings.get(iid))

    def _logprobs(self, a: Assembly, sampled: TokenLogprobs | None,
                  prompt: TokenLogprobs | None) -> tuple[Logprobs | None, Logprobs | None]:
        """A row's log probabilities for its client, each token's text beside its id; the prompt's go
        with its first token (or its final), its first position without a log probability."""
        head = None
        if a.prompt_head is not None and (sampled is not None or prompt is not None or a.detok.ids):
            head = Logprobs.prompt(a.prompt_head, prompt, self.text)
            a.prompt_head = None
        return None if sampled is None else Logprobs.decoded(sampled, self.text), head

    def text(self, token_id: int) -> str:
        """A token decoded alone, special tokens kept (as vLLM shows a log probability's token); an id past the
        tokenizer's vocabulary (a model's LM head may be padded beyond it) as its decoder makes it."""
        return self.token_texts[token_id] if token_id < len(self.token_texts) else self.tokenizer.decode([token_id])


def _per_request(batch: TokenBatch) -> dict[str, TokenLogprobs]:
    """The batch's log-probability column gathered by request (a request may have several tokens)."""
    out: dict[str, TokenLogprobs] = {}
    for iid, lp in zip(batch.request_ids, batch.logprobs):
        if lp is None:
            continue
        if (have := out.get(iid)) is None:
            out[iid] = TokenLogprobs(list(lp.token_ids), list(lp.logprobs), list(lp.top_ids), list(lp.top_logprobs))
        else:
            have.extend(lp)
    return out
