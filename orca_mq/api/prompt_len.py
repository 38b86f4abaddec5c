"""The default `max_tokens` of an HTTP request that gives none: what is left of the context (as
vLLM does), so the API server counts the prompt's tokens the way the frontend will encode it."""
from __future__ import annotations

from typing import Any

from orca_mq.config import Config
from orca_mq.engine.model_info import read_model_info
from orca_mq.tokenizer import load_tokenizer


class PromptCounter:
    def __init__(self, cfg: Config) -> None:
        self.tokenizer = load_tokenizer(cfg.model.path, cfg.model.cache_dir)
        bs = cfg.engine.block_size
        self.budget = min(read_model_info(cfg.model.path, cfg.model.cache_dir).max_model_len(cfg), cfg.engine.n_slots // bs * bs)

    def remaining(self, prompt: dict[str, Any]) -> int:
        """Context left after the prompt (at least 1: a prompt too long is the frontend's to refuse)."""
        if "prompt_token_ids" in prompt:
            n = len(prompt["prompt_token_ids"])
        elif "messages" in prompt:
            try:
                text = self.tokenizer.apply_chat_template(prompt["messages"], tokenize=False, add_generation_prompt=True)
            except Exception:  # the frontend refuses it with the template's message
                return 1
            n = len(self.tokenizer.encode(text, add_special_tokens=False))
        else:
            n = len(self.tokenizer.encode(prompt["prompt"]))
        return max(1, self.budget - n)
