"""Request validation shared by the frontend and the offline API: a clear message naming the problem."""
from __future__ import annotations

from typing import TYPE_CHECKING

from orca_mq.sampling_params import InvalidRequest, SamplingParams

if TYPE_CHECKING:
    from orca_mq.config import Config
    from orca_mq.engine.model_info import ModelInfo


def validate_request(prompt_token_ids: list[int], params: SamplingParams, info: "ModelInfo", cfg: "Config") -> None:
    if not isinstance(prompt_token_ids, list) or not prompt_token_ids:
        raise InvalidRequest("empty prompt: at least one token is required")
    bad = [t for t in prompt_token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < info.vocab_size]
    if bad:
        raise InvalidRequest(f"prompt token ids outside the vocabulary [0, {info.vocab_size}): {bad[:5]}")
    params.validate(info.vocab_size)
    total = len(prompt_token_ids) + params.max_tokens
    max_len = info.max_model_len(cfg)
    if total > max_len:
        raise InvalidRequest(
            f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} "
            f"exceeds the context length {max_len}"
        )
    bs = cfg.engine.block_size
    pool = cfg.engine.n_slots // bs * bs
    if -(-total // bs) * bs > pool:
        raise InvalidRequest(
            f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} "
            f"exceeds the KV pool of {pool} slots (engine.n_slots)"
        )
