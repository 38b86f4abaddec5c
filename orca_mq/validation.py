"""Request admission shared by the frontend and the offline API: a clear message naming the problem.

Sizes are checked before any work proportional to them (tokenizing, scanning token ids), with
bounds derived from the context length: a prompt that cannot fit is refused in O(1).
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from orca_mq.kv.pool import PoolSize
from orca_mq.sampling_params import InvalidRequest, SamplingParams

if TYPE_CHECKING:
    from orca_mq.config import Config
    from orca_mq.engine.model_info import ModelInfo

MAX_REQUEST_ID_CHARS = 256


def check_request_id(request_id: str) -> None:
    if not 0 < len(request_id) <= MAX_REQUEST_ID_CHARS:
        raise InvalidRequest(f"request_id must have 1 to {MAX_REQUEST_ID_CHARS} characters, got {len(request_id)}")


def check_prompt_size(prompt: str | None, prompt_token_ids: list[int] | None, messages: list[Any] | None,
                      max_model_len: int, max_chars: int) -> None:
    """Refuse, before tokenizing, what cannot fit `max_model_len` tokens: a token covers at most
    `max_chars // max_model_len` characters (the vocabulary's longest token) and a message at least one token."""
    if prompt_token_ids is not None and len(prompt_token_ids) > max_model_len:
        raise InvalidRequest(f"prompt has {len(prompt_token_ids)} tokens; the context length is {max_model_len}")
    if prompt is not None and len(prompt) > max_chars:
        raise InvalidRequest(f"prompt of {len(prompt)} characters cannot fit the context length "
                             f"of {max_model_len} tokens (at most {max_chars} characters)")
    if messages is not None:
        if len(messages) > max_model_len:
            raise InvalidRequest(f"{len(messages)} messages cannot fit the context length of {max_model_len} tokens")
        chars = sum(len(v) for m in messages if isinstance(m, dict) for v in m.values() if isinstance(v, str))
        if chars > max_chars:
            raise InvalidRequest(f"messages of {chars} characters cannot fit the context length "
                                 f"of {max_model_len} tokens (at most {max_chars} characters)")


def admit(prompt_token_ids: list[int], params: SamplingParams, info: "ModelInfo", cfg: "Config") -> SamplingParams:
    """The prompt's checks, once it is tokenized, for params already validated (SamplingParams.validate):
    the params to serve it with, `max_tokens=None` resolved to what is left of the context and the KV pool."""
    max_len = info.max_model_len(cfg)
    if not isinstance(prompt_token_ids, list) or not prompt_token_ids:
        raise InvalidRequest("empty prompt: at least one token is required")
    if len(prompt_token_ids) > max_len:
        raise InvalidRequest(f"prompt has {len(prompt_token_ids)} tokens; the context length is {max_len}")
    bad = [t for t in prompt_token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < info.vocab_size]
    if bad:
        raise InvalidRequest(f"prompt token ids outside the vocabulary [0, {info.vocab_size}): {bad[:5]}")
    pool = PoolSize.from_config(cfg)
    n = len(prompt_token_ids)
    if params.max_tokens is None:
        room = min(max_len, pool.device_slots) - n
        if room < 1:
            raise InvalidRequest(f"prompt ({n} tokens) leaves no room to generate within the context length "
                                 f"{max_len} and the KV pool of {pool.device_slots} slots")
        return dataclasses.replace(params, max_tokens=room)
    total = n + params.max_tokens
    if total > max_len:
        raise InvalidRequest(f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) = {total} "
                             f"exceeds the context length {max_len}")
    if not pool.fits(total):
        raise InvalidRequest(f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) = {total} "
                             f"exceeds the KV pool of {pool.device_slots} slots (engine.n_slots)")
    return params
