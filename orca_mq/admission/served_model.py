"""The model as admission sees it, built once per process: its info, tokenizer and prompts, the KV
pool's size, the grammar compiler and the vocabulary the grammars share.

A request goes in by these steps, each value checked once, where it enters:
1. `params`: its sampling parameters parsed and validated (the wire's dict, or a SamplingParams);
2. `prompts.check` then `prompts.token_ids` (the size in O(1), then the tokenizer or chat template);
3. `fit`: the prompt against the vocabulary, the context and the pool, `max_tokens` resolved (and
   able to hold a constrained request's shortest output);
4. `request`: its grammar compiled (with the vocabulary), the scheduler's Request built.
An embedding request takes the same steps with its pooling parameters in place of sampling ones
(`pooling`, `fit_embedding`). The offline LLM takes all four in its process (`admit`, `admit_embedding`);
the server splits them at its processes:
the frontend 1-3 (its event loop, then its tokenize threads), the scheduler process 4.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Executor, Future
from functools import cached_property
from typing import Any

from orca_mq.admission.limits import fit, fit_embedding
from orca_mq.admission.prompts import Prompts
from orca_mq.config import Config
from orca_mq.models.info import ModelInfo
from orca_mq.models.registry import read_model_info
from orca_mq.kv.pool import PoolSize
from orca_mq.protocol.codec import MAX_FRAME_BYTES
from orca_mq.protocol.pooling import PoolingParams
from orca_mq.protocol.sampling import SamplingParams
from orca_mq.sched.request import Request
from orca_mq.structured.compiler import Compiler
from orca_mq.structured.grammar import Grammar, Vocabulary
from orca_mq.tokenizer import Tokenizer, load_tokenizer

Prompt = str | list[int]
log = logging.getLogger(__name__)
ENTRY_BYTES = 24   # a log probability in a message, its token's text aside: an id, a float, list and string headers


class ServedModel:
    """The tokenizer is loaded when first used (the scheduler process needs it only for the grammars'
    vocabulary); the vocabulary too, by the compiler, or by `warm_grammars` in a server once ready."""

    def __init__(self, cfg: Config, info: ModelInfo | None = None) -> None:
        self.cfg = cfg
        self.info = info or read_model_info(cfg.model.path, cfg.model.cache_dir)
        self.max_model_len = self.info.max_model_len(cfg)
        self.pool = PoolSize.from_config(cfg)
        self.grammars = Compiler(cfg.structured, self._vocabulary)

    @cached_property
    def tokenizer(self) -> Tokenizer:
        return load_tokenizer(self.cfg.model.path, self.cfg.model.cache_dir)

    @cached_property
    def prompt_logprob_bound(self) -> int:
        """The most log probabilities of a prompt one message holds: a frame's bytes over an entry's most
        (its token's text: at most 4 UTF-8 bytes per character of the vocabulary's longest token)."""
        return MAX_FRAME_BYTES // (ENTRY_BYTES + 4 * max(map(len, self.tokenizer.get_vocab())))

    @cached_property
    def prompts(self) -> Prompts:
        return Prompts.for_model(self.tokenizer, self.max_model_len)

    def params(self, sampling: SamplingParams | dict[str, Any] | None) -> SamplingParams:
        """Step 1: a request's sampling parameters, parsed (from the wire) and validated."""
        params = SamplingParams() if sampling is None else (
            sampling if isinstance(sampling, SamplingParams) else SamplingParams.from_dict(sampling))
        params.validate(self.info.vocab_size)
        params.validate_logprobs(self.cfg.model.max_logprobs)
        params.validate_logit_bias(self.cfg.model.max_logit_bias, self.info.vocab_size - 1)
        return params

    def pooling(self, pooling: PoolingParams | dict[str, Any] | None) -> PoolingParams:
        """Step 1 of an embedding request: its pooling parameters parsed and validated, model.pooling by default."""
        given = PoolingParams() if pooling is None else (
            pooling if isinstance(pooling, PoolingParams) else PoolingParams.from_dict(pooling))
        return given.resolved(self.cfg.model.pooling)

    def fit_embedding(self, prompt_token_ids: list[int]) -> SamplingParams:
        """Step 3 of an embedding request: its prompt's checks; the params it is scheduled with (it samples
        nothing: one token past its prompt, the least a SamplingParams holds, never generated)."""
        fit_embedding(prompt_token_ids, self.max_model_len, self.info.vocab_size, self.pool)
        return SamplingParams(max_tokens=1)

    def fit(self, prompt_token_ids: list[int], params: SamplingParams, shortest: int | None = None) -> SamplingParams:
        """Step 3: the tokenized prompt's checks; the params to serve it with. `shortest`: a
        constrained request's shortest output in tokens (`grammars.shortest`), which max_tokens must hold."""
        bound = self.prompt_logprob_bound if params.prompt_logprobs is not None else None
        return fit(prompt_token_ids, params, self.max_model_len, self.info.vocab_size, self.pool, shortest, bound)

    def request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                grammar: Grammar | None = None, client: str = "", pooling: PoolingParams | None = None) -> Request:
        """Step 4: the scheduler's Request; a constrained one's grammar is compiled here unless given
        (the scheduler process compiles on a thread, bounded in time, and passes it), and finishes
        within max_tokens. `client`: who it counts for in the pool's fair shares (orca_mq.fair_share);
        `pooling`: an embedding request's (step 1's)."""
        if grammar is None and params.structured_outputs is not None:
            grammar = self.grammars.compile(params.structured_outputs)
        if grammar is not None and params.max_tokens is not None:
            grammar.limit(params.max_tokens, params.min_tokens)
        return Request(request_id, prompt_token_ids, params, time.monotonic(), grammar=grammar, client=client,
                       pooling=pooling)

    def admit(self, request_id: str, prompt: Prompt, sampling: SamplingParams | None) -> Request:
        """All four steps in this process (the offline API): a text prompt as raw completion text."""
        ids = self.prompts.encode_text(prompt) if isinstance(prompt, str) else list(prompt)
        params = self.params(sampling)
        shortest = None if params.structured_outputs is None else self.grammars.shortest(params.structured_outputs)
        return self.request(request_id, ids, self.fit(ids, params, shortest))

    def admit_embedding(self, request_id: str, prompt: Prompt, pooling: PoolingParams | dict[str, Any] | None) -> Request:
        """An embedding request's steps in this process (the offline API)."""
        ids = self.prompts.encode_text(prompt) if isinstance(prompt, str) else list(prompt)
        resolved = self.pooling(pooling)
        return self.request(request_id, ids, self.fit_embedding(ids), pooling=resolved)

    def warm_grammars(self, pool: Executor) -> None:
        """The grammars' vocabulary built on `pool` (a server's grammar thread, once it is ready):
        building it under the first constrained request held that process's GIL for a few tenths of a
        second, stalling every other request's turn. A failure is logged here and raised again to the
        first constrained request."""
        def built(f: Future[Vocabulary]) -> None:
            if (e := f.exception()) is not None:
                log.warning("structured outputs: the vocabulary did not build (%s: %s)", type(e).__name__, e)
            else:
                log.info("structured outputs: vocabulary ready (built once the process was)")
        pool.submit(self.grammars.vocabulary).add_done_callback(built)

    def _vocabulary(self) -> Vocabulary:
        started = time.perf_counter()
        vocab = Vocabulary.of(self.tokenizer, self.info.vocab_size, self.info.eos_token_ids, self.cfg.structured.mask_threads)
        log.info("structured outputs: vocabulary loaded in %.2f s", time.perf_counter() - started)
        return vocab
