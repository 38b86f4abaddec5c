"""Offline API in the style of vLLM, on the same iteration-level scheduler and engine as the server,
its outputs assembled as the server's are (orca_mq.assembly: each step's events as the frontend takes them).
Its start-up says what it does on stderr, a line per step (`log.progress`: LLM(progress=False) is quiet)."""
from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from orca_mq.admission.prompts import check_template_kwargs
from orca_mq.admission.served_model import Prompt, ServedModel
from orca_mq.assembly import Assembler, Assembly, Row
from orca_mq.config import load_config
from orca_mq.engine.model_runner import Launched, ModelRunner
from orca_mq.models.files import resolve_model_path
from orca_mq.models.registry import read_model_info
from orca_mq.errors import InvalidRequest
from orca_mq.logs import tell
from orca_mq.outputs import EmbeddingOutput, RequestOutput
from orca_mq.protocol.client_msgs import Final
from orca_mq.protocol.iteration import IterationResult
from orca_mq.protocol.logprobs import Logprobs
from orca_mq.protocol.sampling import SamplingParams
from orca_mq.sched import Tokens, make_scheduler
from orca_mq.sched.request import Request
from orca_mq.server.scheduler_process import token_batch


@dataclass(slots=True)
class _Gathered:
    """An offline request's rows (orca_mq.assembly, as the server streams them), until its final."""

    out: Assembly
    texts: list[str] = field(default_factory=list)
    logprobs: Logprobs | None = None
    prompt_logprobs: Logprobs | None = None
    final: Final | None = None
    embedding: bytes | None = None

    def add(self, row: Row) -> None:
        self.texts.append(row.text)
        if row.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = row.logprobs
            else:
                self.logprobs.extend(row.logprobs)
        self.prompt_logprobs = row.prompt_logprobs or self.prompt_logprobs
        self.final = row.final or self.final
        self.embedding = row.embedding or self.embedding


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
        self.assembler = Assembler(self.tokenizer, self.info.eos_token_ids)   # the outputs, as the server's frontend makes them
        self._gathered: dict[str, _Gathered] = {}   # by request, until it is returned
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
        return [RequestOutput(r.request_id, "".join(g.texts), list(g.out.detok.ids), f.finish_reason, f.error, f.metrics,
                              f.code, prompt_token_ids=r.prompt_token_ids, logprobs=g.logprobs,
                              prompt_logprobs=g.prompt_logprobs)
                for r, g, f in self._run(reqs)]

    def embed(self, prompts: Prompt | Sequence[Prompt], pooling: str | None = None,
              normalize: bool = True) -> list[EmbeddingOutput]:
        """Each prompt's embedding (text as a completion's prompt, or token ids): its final hidden states
        pooled ("last" token or "mean"; model.pooling by default), L2-normalised unless normalize=False.
        They run as the server runs them: prefill-only requests batched by the same scheduler."""
        reqs = [self.model.admit_embedding(f"offline-{next(self._ids)}", prompt, {"pooling": pooling, "normalize": normalize})
                for prompt in _batch(prompts)]
        return [EmbeddingOutput(r.request_id, g.embedding or b"", len(r.prompt_token_ids), f.finish_reason, f.error, f.code,
                                metrics=f.metrics) for r, g, f in self._run(reqs)]

    def _run(self, reqs: list[Request]) -> list[tuple[Request, _Gathered, Final]]:
        """Admitted requests queued and run to their ends; each one's output gathered as the server streams it."""
        now = time.time()
        for r in reqs:
            self._gathered[r.request_id] = _Gathered(self.assembler.start(r.prompt_token_ids, r.params, now))
            self.scheduler.add(r)
        self.run_until_done()
        done = [(r, self._gathered.pop(r.request_id)) for r in reqs]
        assert all(g.final is not None for _, g in done)   # run_until_done returns once every request has ended
        return [(r, g, g.final) for r, g in done]  # type: ignore[misc]

    def _keep(self, parts: list[Tokens]) -> None:
        """A step's tokens as the server's frontend takes them (a TokenBatch, the finals' metrics as the
        server's scheduler gives them), each request's row gathered."""
        batch = token_batch(0, parts, self.scheduler.final_metrics)
        for iid, _, row in self.assembler.rows(batch, time.time(), self._assembly):
            self._gathered[iid].add(row)

    def _assembly(self, request_id: str) -> Assembly | None:
        g = self._gathered.get(request_id)
        return None if g is None else g.out

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
            if out.tokens:
                self._keep(out.tokens)
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
