"""The default `max_tokens` of an HTTP request that gives none: what is left of the context (as
vLLM does). The prompt is counted by the frontend's own `Prompts` (the same encoding, its size
check first, the tokenizer off the event loop), so a long prompt never stalls the API server."""
from __future__ import annotations

import asyncio
from typing import Any

from orca_mq.config import Config
from orca_mq.kv.pool import PoolSize
from orca_mq.protocol.client_msgs import Generate
from orca_mq.sampling_params import InvalidRequest
from orca_mq.server.prompts import Prompts
from orca_mq.tokenizer import load_tokenizer


class PromptCounter:
    def __init__(self, cfg: Config, max_model_len: int) -> None:
        self.prompts = Prompts.for_model(load_tokenizer(cfg.model.path, cfg.model.cache_dir), max_model_len)
        self.budget = min(max_model_len, PoolSize.from_config(cfg).device_slots)

    async def remaining(self, prompt: dict[str, Any]) -> int:
        """Context left after the prompt (at least 1: a prompt that cannot be served is the frontend's to refuse)."""
        msg = Generate("count", **prompt)
        try:
            self.prompts.check(msg)
            ids = await asyncio.get_running_loop().run_in_executor(None, self.prompts.token_ids, msg)
        except InvalidRequest:
            return 1
        return max(1, self.budget - len(ids))
