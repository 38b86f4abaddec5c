"""Offline API in the style of vLLM, on the same iteration-level scheduler and engine as the server.
Its start-up says what it does on stderr, a line per step (`log.progress`: LLM(progress=False) is quiet)."""
from __future__ import annotations

import itertools
import time
from collections import deque
from pathlib import Path
from typing import Any, Sequence

from orca_mq.admission.prompts import check_template_kwargs
from orca_mq.admission.served_model import Prompt, ServedModel
from orca_mq.config import load_config
from orca_mq.detokenizer import ends_on_eos
from orca_mq.engine.model_runner import Launched, ModelRunner
from orca_mq.models.files import resolve_model_path
from orca_mq.models.registry import read_model_info
from orca_mq.errors import InvalidRequest
from orca_mq.logs import tell
from orca_mq.outputs import EmbeddingOutput, RequestOutput, output_metrics
from orca_mq.protocol.iteration import IterationResult
from orca_mq.protocol.logprobs import Logprobs, TokenLogprobs
from orca_mq.protocol.sampling import SamplingParams
from orca_mq.sched import make_scheduler
from orca_mq.sched.request import Request


class LLM:
    """LLM(model=path, max_bs=4, n_slots=...) overrides config.toml keys (bare or `section.key`).
    All layers run in this process (one stage), one iteration at a time."""

    def __init__(self, model: str | None = None, config: str | Path | None = None, **overrides: Any) -> None:
        started = time.monotonic()
        self.cfg = load_config(config, {k.replace("__", "."): v for k, v in overrides.items()})
        if model is not None:
            self.cfg.model.path = model
        self.cfg.engine.n_workers = self.cfg.engine.tp_size = 1
        self._progress(started, f"loading the model {resolve_model_path(self.cfg.model.path).name}")
        self.runner = ModelRunner(self.cfg, info=read_model_info(self.cfg.model.path, self.cfg.model.cache_dir))
        self._progress(started, f"model loaded in {time.monotonic() - started:.1f} s "
                                f"({str(self.runner.dtype).removeprefix('torch.')} on {self.runner.device})")
        if (sizing := self.runner.kv_sizing) is not None:   # admission and the scheduler take the measured pool
            self.cfg.engine.n_slots = self.runner.pool.device_slots
            self._progress(started, f"KV pool from the device's memory: {sizing.describe()}")
        self.model = ServedModel(self.cfg, self.runner.info)   # admission: this process is the whole server
        self.info, self.tokenizer = self.model.info, self.model.tokenizer
        self.scheduler = make_scheduler(self.cfg, self.info)
        self._logprobs: dict[str, list[TokenLogprobs | None]] = {}   # the events' (sampled, prompt), by request
        self._finals: dict[str, dict[str, Any]] = {}   # the scheduler's metrics of each final event, by request
        self._texts: dict[int, str] = {}
        self.run_until_done()   # a policy that needs this engine's iteration profile times its probes now
        self._ids = itertools.count()
        self._progress(started, f"ready in {time.monotonic() - started:.1f} s")

    def _progress(self, started: float, text: str) -> None:
        if self.cfg.log.progress:
            tell(started, f"LLM: {text}")

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        prompts = _batch(prompts)
        params_list = list(params) if isinstance(params, Sequence) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise InvalidRequest(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        # all admitted (checked, grammars compiled) before any is queued
        reqs = [self.model.admit(f"offline-{next(self._ids)}", prompt, p) for prompt, p in zip(prompts, params_list)]
        for r in reqs:
            self.scheduler.add(r)
        self.run_until_done()
        return [
            RequestOutput(r.request_id, self._decode(r.output_token_ids, r.finish_reason, r.params.skip_special_tokens),
                          r.output_token_ids, r.finish_reason, prompt_token_ids=r.prompt_token_ids, metrics=self._metrics(r),
                          **self._outputs_logprobs(r.request_id, r.params, r.prompt_token_ids))
            for r in reqs
        ]

    def embed(self, prompts: Prompt | Sequence[Prompt], pooling: str | None = None,
              normalize: bool = True) -> list[EmbeddingOutput]:
        """Each prompt's embedding (text as a completion's prompt, or token ids): its final hidden states
        pooled ("last" token or "mean"; model.pooling by default), L2-normalised unless normalize=False.
        They run as the server runs them: prefill-only requests batched by the same scheduler."""
        reqs = [self.model.admit_embedding(f"offline-{next(self._ids)}", prompt, {"pooling": pooling, "normalize": normalize})
                for prompt in _batch(prompts)]
        for r in reqs:
            self.scheduler.add(r)
        self.run_until_done()
        return [EmbeddingOutput(r.request_id, r.embedding or b"", len(r.prompt_token_ids), r.finish_reason,
                                metrics=self._metrics(r)) for r in reqs]

    def _metrics(self, r: Request) -> dict[str, Any]:
        """A finished request's metrics, as the server's final message gives them (its times on the wall
        clock: the scheduler's is monotonic)."""
        wall = time.time() - time.monotonic()
        first = None if r.first_token_time is None else r.first_token_time + wall
        finish = (r.finish_time or time.monotonic()) + wall
        return output_metrics(len(r.prompt_token_ids), len(r.output_token_ids), r.arrival + wall, first, finish,
                              self._finals.pop(r.request_id, None))

    def _decode(self, ids: list[int], finish_reason: str | None, skip_special_tokens: bool) -> str:
        """A finished request's text, as the server's detokenizer makes it (without the EOS that ended it)."""
        shown = ids[:-1] if ends_on_eos(ids, finish_reason, self.info.eos_token_ids) else ids
        return self.tokenizer.decode(shown, skip_special_tokens=skip_special_tokens)

    def _outputs_logprobs(self, rid: str, params: SamplingParams, prompt: list[int]) -> dict[str, Logprobs | None]:
        """A finished request's log probabilities, as the server's client gets them."""
        sampled, prompt_lp = self._logprobs.pop(rid, [None, None])
        return {"logprobs": None if params.logprobs is None else Logprobs.decoded(sampled or TokenLogprobs(), self._text),
                "prompt_logprobs": None if params.prompt_logprobs is None or not prompt
                else Logprobs.prompt(prompt[0], prompt_lp, self._text)}

    def _text(self, token_id: int) -> str:
        if (text := self._texts.get(token_id)) is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False) or ""
        return text

    def _keep(self, events: list[Any]) -> None:
        """What the events carry that the outputs give: the finals' metrics (as the server's scheduler
        takes them) and the log probabilities."""
        for e in events:
            if e.finish_reason:
                self._finals[e.request_id] = self.scheduler.final_metrics(e)
            if e.logprobs is None and e.prompt_logprobs is None:
                continue
            kept = self._logprobs.setdefault(e.request_id, [None, None])
            if e.logprobs is not None:
                if kept[0] is None:
                    kept[0] = TokenLogprobs()
                kept[0].extend(e.logprobs)
            if e.prompt_logprobs is not None:
                kept[1] = e.prompt_logprobs

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             params: SamplingParams | Sequence[SamplingParams] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """`chat_template_kwargs`: more variables for the chat template (vLLM's), e.g. {"enable_thinking": False}."""
        if chat_template_kwargs is not None:
            check_template_kwargs(chat_template_kwargs)
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [self.model.prompts.encode_chat(c, template_kwargs=chat_template_kwargs)  # type: ignore[arg-type]
                   for c in conversations]
        return self.generate(prompts, params)

    def run_until_done(self) -> None:
        """The scheduler's iteration loop (`Scheduler.step`), offline: each plan is launched here, in
        order, and collected oldest first; with async scheduling the next one is launched before the
        last is collected, so the device computes while the host plans."""
        results: list[IterationResult] = []
        launched: deque[Launched] = deque()
        while True:
            out = self.scheduler.step(time.monotonic(), results)
            if out.events:
                self._keep(out.events)
            launched.extend(self.runner.launch(plan) for plan in out.plans)
            if not launched:
                if self.scheduler.has_work():
                    raise RuntimeError("scheduler has requests but cannot schedule any (KV pool too small?)")
                return
            results = [self.runner.collect(launched.popleft())]  # type: ignore[list-item]


def _batch(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt (text or token ids) or a list of them, as a list."""
    if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]  # type: ignore[list-item]
    return list(prompts)  # type: ignore[arg-type]
