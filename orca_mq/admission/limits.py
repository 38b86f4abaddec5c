"""A request's limits, each checked once where it enters: its id (the broker), and, once its prompt is
tokenized, the prompt against the vocabulary, the context length and the KV pool, with `max_tokens`
resolved and, for a structured output, able to hold its shortest (`fit`; an embedding's: `fit_embedding`),
and its prompt's log probabilities within what one message carries. A clear message names the problem.
"""
from __future__ import annotations

import dataclasses

from orca_mq.errors import InvalidRequest
from orca_mq.kv.pool import PoolSize
from orca_mq.protocol.sampling import SamplingParams

MAX_REQUEST_ID_CHARS = 256


def check_request_id(request_id: str) -> None:
    if not 0 < len(request_id) <= MAX_REQUEST_ID_CHARS:
        raise InvalidRequest(f"request_id must have 1 to {MAX_REQUEST_ID_CHARS} characters, got {len(request_id)}")


def fit(prompt_token_ids: list[int], params: SamplingParams, max_len: int, vocab_size: int, pool: PoolSize,
        shortest: int | None = None, max_prompt_logprobs: int | None = None) -> SamplingParams:
    """The prompt's checks, once it is tokenized, for params already validated (SamplingParams.validate):
    the params to serve it with, `max_tokens=None` resolved to what is left of the context and the KV pool.
    `shortest`: the tokens of the shortest output a structured_outputs constraint allows (its grammar
    with the vocabulary: orca_mq.structured.budget.shortest), which max_tokens must hold.
    `max_prompt_logprobs`: the most log probabilities (positions x (1 + alternatives)) of a prompt that
    one message holds (ServedModel.prompt_logprob_bound): a prompt's travel in one row."""
    fitted = _fit(prompt_token_ids, params, max_len, vocab_size, pool)
    k = params.prompt_logprobs
    if k is not None and max_prompt_logprobs is not None and len(prompt_token_ids) * (1 + k) > max_prompt_logprobs:
        raise InvalidRequest(f"prompt_logprobs: {len(prompt_token_ids)} prompt positions with {k} alternatives each "
                             f"exceed the {max_prompt_logprobs} log probabilities one message carries: ask fewer")
    if shortest is not None and fitted.max_tokens < shortest:   # type: ignore[operator]
        given = (f"max_tokens ({params.max_tokens})" if params.max_tokens is not None else
                 f"the {fitted.max_tokens} tokens the prompt leaves within the context length and the KV pool")
        kind = params.structured_outputs.kind   # type: ignore[union-attr]
        raise InvalidRequest(f"{given} cannot hold any output the structured_outputs.{kind} constraint allows: "
                             f"its shortest takes {shortest} tokens", "max_tokens")
    return fitted


def fit_embedding(prompt_token_ids: list[int], max_len: int, vocab_size: int, pool: PoolSize) -> None:
    """An embedding request's prompt, once tokenized: within the context and the KV pool (it generates nothing)."""
    check_prompt(prompt_token_ids, max_len, vocab_size)
    if not pool.fits(n := len(prompt_token_ids)):
        raise InvalidRequest(f"prompt ({n} tokens) exceeds the KV pool of {pool.device_slots} slots (engine.n_slots)",
                             "prompt")


def check_prompt(prompt_token_ids: list[int], max_len: int, vocab_size: int) -> None:
    """Any prompt: at least one token, at most the context, every one in the vocabulary."""
    if not isinstance(prompt_token_ids, list) or not prompt_token_ids:
        raise InvalidRequest("empty prompt: at least one token is required", "prompt")
    if len(prompt_token_ids) > max_len:
        raise InvalidRequest(f"prompt has {len(prompt_token_ids)} tokens; the context length is {max_len}", "prompt")
    bad = [t for t in prompt_token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequest(f"prompt token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}", "prompt")


def _fit(prompt_token_ids: list[int], params: SamplingParams, max_len: int, vocab_size: int, pool: PoolSize) -> SamplingParams:
    check_prompt(prompt_token_ids, max_len, vocab_size)
    n = len(prompt_token_ids)
    if params.max_tokens is None:
        room = min(max_len, pool.device_slots) - n
        if room < 1:
            raise InvalidRequest(f"prompt ({n} tokens) leaves no room to generate within the context length "
                                 f"{max_len} and the KV pool of {pool.device_slots} slots", "prompt")
        if params.min_tokens > room:
            raise InvalidRequest(f"min_tokens ({params.min_tokens}) exceeds the {room} tokens the prompt ({n} tokens) "
                                 f"leaves within the context length {max_len} and the KV pool", "min_tokens")
        return dataclasses.replace(params, max_tokens=room)
    total = n + params.max_tokens
    if total > max_len:
        raise InvalidRequest(f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) = {total} "
                             f"exceeds the context length {max_len}", "max_tokens")
    if not pool.fits(total):
        raise InvalidRequest(f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) = {total} "
                             f"exceeds the KV pool of {pool.device_slots} slots (engine.n_slots)", "max_tokens")
    return params
