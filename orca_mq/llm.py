"""Offline API in the style of vLLM, on the same iteration-level scheduler and engine as the server."""
from __future__ import annotations

import itertools
import time
from collections import deque
from pathlib import Path
from typing import Any, Sequence

from orca_mq.config import load_config
from orca_mq.outputs import RequestOutput
from orca_mq.engine.model_runner import Launched, ModelRunner
from orca_mq.protocol.iteration import IterationResult
from orca_mq.sampling_params import InvalidRequest, SamplingParams
from orca_mq.sched import make_scheduler
from orca_mq.sched.request import Request
from orca_mq.structured.compiler import Compiler
from orca_mq.structured.grammar import Vocabulary
from orca_mq.tokenizer import load_tokenizer
from orca_mq.server.prompts import Prompts
from orca_mq.validation import admit
from orca_mq.engine.model_info import read_model_info

Prompt = str | list[int]


class LLM:
    """LLM(model=path, max_bs=4, n_slots=...) overrides config.toml keys (bare or `section.key`).
    All layers run in this process (one stage), one iteration at a time."""

    def __init__(self, model: str | None = None, config: str | Path | None = None, **overrides: Any) -> None:
        self.cfg = load_config(config, {k.replace("__", "."): v for k, v in overrides.items()})
        if model is not None:
            self.cfg.model.path = model
        self.cfg.engine.n_workers = self.cfg.engine.tp_size = 1
        self.info = read_model_info(self.cfg.model.path, self.cfg.model.cache_dir)
        self.tokenizer = load_tokenizer(self.cfg.model.path, self.cfg.model.cache_dir)
        self.prompts = Prompts.for_model(self.tokenizer, self.info.max_model_len(self.cfg))
        self.runner = ModelRunner(self.cfg, info=self.info)
        self.scheduler = make_scheduler(self.cfg, self.info)
        self.run_until_done()   # a policy that needs this engine's iteration profile times its probes now
        self._ids = itertools.count()
        self.grammars = Compiler(self.cfg.structured, lambda: Vocabulary.of(
            self.tokenizer, self.info.vocab_size, self.info.eos_token_ids, self.cfg.structured.mask_threads))

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params_list = list(params) if isinstance(params, Sequence) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise InvalidRequest(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        reqs = []
        for prompt, p in zip(prompts, params_list):
            ids = self.prompts.encode_text(prompt) if isinstance(prompt, str) else list(prompt)
            p.validate(self.info.vocab_size)
            p = admit(ids, p, self.info, self.cfg)  # all checked (and compiled) before any is queued
            grammar = None if p.structured_outputs is None else self.grammars.compile(p.structured_outputs)
            reqs.append(Request(f"offline-{next(self._ids)}", ids, p, grammar=grammar))
        for r in reqs:
            self.scheduler.add(r)
        self.run_until_done()
        return [
            RequestOutput(r.request_id, self.tokenizer.decode(r.output_token_ids, skip_special_tokens=True),
                          r.output_token_ids, r.finish_reason, prompt_token_ids=r.prompt_token_ids,
                          metrics=None if r.grammar is None else {"structured_output": r.grammar.report()})
            for r in reqs
        ]

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [self.prompts.encode_chat(c) for c in conversations]  # type: ignore[arg-type]
        return self.generate(prompts, params)

    def run_until_done(self) -> None:
        """The scheduler's iteration loop (`Scheduler.step`), offline: each plan is launched here, in
        order, and collected oldest first; with async scheduling the next one is launched before the
        last is collected, so the device computes while the host plans."""
        results: list[IterationResult] = []
        launched: deque[Launched] = deque()
        while True:
            out = self.scheduler.step(time.monotonic(), results)
            launched.extend(self.runner.launch(plan) for plan in out.plans)
            if not launched:
                if self.scheduler.has_work():
                    raise RuntimeError("scheduler has requests but cannot schedule any (KV pool too small?)")
                return
            results = [self.runner.collect(launched.popleft())]  # type: ignore[list-item]
