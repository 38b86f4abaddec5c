"""Executes one iteration plan on one pipeline stage: its layers, its KV pool, and (last stage) sampling.

An iteration is launched (inputs staged in one copy, the forward replayed from a CUDA graph or run
eagerly, tokens sampled on the device and their copy back started) and later collected (the tokens
read): between the two the host may launch the next plan, whose placeholders read these tokens on
the device (async scheduling). The KV pool is the config's, or sized at start from the device's
memory (engine/kv_budget.py) after a profiled iteration on a small one.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from orca_mq.engine import fp8, gemm
from orca_mq.engine.attention import AttentionMetadata, resolve
from orca_mq.runtime.device import resolve_device, use_device
from orca_mq.engine.dtype import native_bf16_flags, resolve_dtype
from orca_mq.engine.graphs import Graphs, fill
from orca_mq.engine.staging import Stager
from orca_mq.engine.step_inputs import Geometry, build, metadata
from orca_mq.protocol.iteration import IterationPlan, IterationResult, PackedPlan, PlanArrays, SeqWork, pack
from orca_mq.kv.cache import KVCache
from orca_mq.kv.pool import PoolSize
from orca_mq.kv.sizing import KVSizing, memory_source
from orca_mq.engine.kv_budget import Agree, size_pool
from orca_mq.kv.swapper import KVSwapper
from orca_mq.models.decoder import StageModel
from orca_mq.engine.parallel import TensorParallel, TPGroup
from orca_mq.engine.sampler import SamplingRows, failed_rows, greedy, sample
from orca_mq.engine.history import TokenHistory
from orca_mq.engine.logprobs import LogprobsOut, fill_result, prompt_logprobs, prompt_positions, sampled_logprobs
from orca_mq.engine.pooling import Pooled, pool, pool_positions
from orca_mq.runtime.threads import use_threads
from orca_mq.models.info import ModelInfo
from orca_mq.models.registry import read_model_info
from orca_mq.models.weights import MATRICES, StageWeights, load_stage_weights

if TYPE_CHECKING:
    from orca_mq.config import Config

Tensor = torch.Tensor
log = logging.getLogger(__name__)
# one query per attention row, reduced over its keys in a fixed order (the torch path pads a batch's
# rows to its longest: a row's reduction then depends on the others)
DETERMINISTIC_BACKENDS = ("cpu", "triton")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelRunner:
    def __init__(self, cfg: "Config", stage: int = 0, n_stages: int = 1, info: ModelInfo | None = None,
                 tp: TPGroup | None = None, device: torch.device | None = None, agree: Agree | None = None) -> None:
        self.device = device or resolve_device(cfg.engine.device)
        use_device(self.device)   # the thread that builds a runner is the one that runs it
        dtype = resolve_dtype(cfg.model.dtype, self.device.type)
        if cfg.model.dtype == "auto":
            log.info("model.dtype auto: %s (%s, native bfloat16 flags: %s)", dtype, self.device.type,
                     ", ".join(native_bf16_flags()) or "none")
        self.dtype = DTYPES[dtype]
        use_threads(cfg.engine.threads_per_worker)
        self.info = info or read_model_info(cfg.model.path, cfg.model.cache_dir)
        self.stage, self.n_stages = stage, n_stages
        self.first, self.last = stage == 0, stage == n_stages - 1
        layers = self.info.stage_layers(stage, n_stages)
        self.tp = TensorParallel(self.info, tp)
        weights = self.tp.shard(load_stage_weights(self.info, layers, self.first, self.last, self.dtype,
                                                    cfg.model.cache_dir, self.device))
        for w in [*weights.layers, weights.final_norm or {}]:
            for k, t in w.items():
                w[k] = t.to(self.device)
        for name in ("embed", "pos_embed", "lm_head"):
            t = getattr(weights, name)
            if t is not None:
                setattr(weights, name, t.to(self.device))
        if weights.lm_head is not None and weights.embed is not None and self.info.tie_embeddings:
            weights.lm_head = weights.embed  # one copy of a tied head (a second one when the GEMM reorders it)
        self.gemm = gemm.resolve_method(cfg.engine.gemm, self.device, self.dtype, cfg.engine.deterministic,
                                        cfg.model.quantization)
        if cfg.engine.kv_cache_dtype == "fp8":
            fp8.refuse_kv(self.device)
        for w in weights.layers:
            for k in MATRICES:
                if k in w:
                    w[k] = gemm.prepare(w[k], self.gemm)
        if weights.lm_head is not None:   # in the compute dtype with FP8 too: the sampled logits (as vLLM)
            weights.lm_head = gemm.prepare(weights.lm_head, "torch" if self.gemm == "fp8" else self.gemm)
        attention = resolve(cfg.engine.attention_backend, self.device, self.dtype)
        self.deterministic = cfg.engine.deterministic
        if self.deterministic and attention.name not in DETERMINISTIC_BACKENDS:
            raise ValueError(f"engine.deterministic needs an attention backend whose rows are batch-invariant "
                             f"({' | '.join(DETERMINISTIC_BACKENDS)}); {attention.name} runs for {self.device} {self.dtype}")
        if attention.name == "triton" and (self.deterministic or cfg.engine.split_kv == "off"):
            attention.split_kv = False   # type: ignore[attr-defined]  # deterministic: a row's splits would follow its batch
        self.rows = self._gemm_rows(cfg, weights) if self.deterministic else gemm.Rows()
        self.max_len = self.info.max_model_len(cfg)
        self.model = StageModel(self.info, weights, layers, self.max_len, self.device, attention, self.tp, self.rows,
                                gemm.Rows(cfg.engine.deterministic_rows) if self.deterministic else gemm.Rows())
        # FastServe's copies: a worker starts its copy thread (start_swap_thread); offline, an inline
        # swapper (and its host pool) is made at the first plan that swaps
        self.swapper: KVSwapper | None = None
        self._prev: tuple[int, Tensor] | None = None   # the last iteration sampled here: (number, its tokens on the device)
        # the penalized requests' token histories, where this stage samples (engine/history.py)
        self.history = TokenHistory(self.info.vocab_size, self.device) if self.last and self.tp.where.rank == 0 else None
        self.graph_error = ""   # why the CUDA graphs asked for could not be captured (the stage runs eagerly)
        self.graphs: Graphs | None = None
        self.n_layers = len(layers)
        memory = memory_source(cfg, self.device, stage)
        self.kv_sizing: KVSizing | None = None   # the terms, where the pool is sized from the device's memory
        if memory is None:
            self.use_pool(PoolSize.from_config(cfg))
        else:
            self.kv_sizing = size_pool(self, cfg, layers, memory, agree or (lambda n: n))
        self.graphs = self.build_graphs(cfg, layers)
        if self.device.type == "cuda":
            self._warm_up()

    def use_pool(self, pool: PoolSize | None) -> None:
        """The stage's KV pool (one block past `pool`'s: the scratch block padding rows write to) and
        what it shapes, the old pool freed first; None: no pool (while it is being sized)."""
        if hasattr(self, "kv"):
            del self.kv
        if pool is None:
            return
        self.pool, self.block_size = pool, pool.block_size
        self.kv = KVCache.allocate(self.n_layers, pool.device_blocks + 1, pool.block_size, self.tp.n_kv_heads,
                                   self.info.head_dim, self.dtype, self.device)
        self.geometry = Geometry(pool.block_size, pool.device_blocks, self.info.vocab_size, self.max_len,
                                 self.deterministic, self.model.attention.split_decode)
        self.stager = Stager(self.device, scratch_block=pool.device_blocks)

    @staticmethod
    def _gemm_rows(cfg: "Config", weights: StageWeights) -> gemm.Rows:
        """Deterministic mode's GEMM calls: tiles of deterministic_rows, unless every GEMM of this
        stage is found row-invariant up to the most rows an iteration gives it (the token budget;
        the LM head: max_bs, or the budget with speculation), when calls are cut only above that."""
        budget, max_bs = cfg.scheduler.max_num_batched_tokens, cfg.scheduler.max_bs
        tiles = gemm.Rows(cfg.engine.deterministic_rows)
        if not budget:   # whole prompts: no bound on an iteration's rows to try up to
            return tiles
        max_rows = max(budget, max_bs)
        shapes = {(tuple(w[k].shape), k + "_b" in w): (w[k], w.get(k + "_b"), max_rows)
                  for w in weights.layers for k in MATRICES if k in w}
        if weights.lm_head is not None:   # a row per sampling request; with speculation, per verified token too
            shapes["lm_head"] = (weights.lm_head, None, max_bs if cfg.speculative.method == "off" else max_rows)
        ok = all(gemm.row_invariant(*probe) for probe in shapes.values())
        log.info("deterministic GEMMs: %s", f"row-invariant up to {max_rows} rows" if ok else f"tiles of {tiles.n} rows")
        return gemm.Rows(max_rows, pad=False) if ok else tiles

    def start_swap_thread(self) -> None:
        """Apply the plans' swaps on a copy thread (a worker whose policy swaps KV), up to
        n_stages plans in flight."""
        self.swapper = KVSwapper(self.kv, self.pool.host_blocks, depth=self.n_stages)

    @property
    def hidden_size(self) -> int:
        return self.info.hidden_size

    def execute(self, plan: IterationPlan | PackedPlan, hidden_in: Tensor | None = None) -> Tensor | IterationResult | None:
        """Stage 0 takes the plan's tokens, later stages the previous stage's hidden states.
        Returns hidden states [T, hidden] to pass on, or on the last stage the sampled tokens
        (tensor-parallel rank 0 only: the other ranks hold the same logits and return None)."""
        return self.collect(self.launch(plan, hidden_in))

    def launch(self, plan: IterationPlan | PackedPlan, hidden_in: Tensor | None = None) -> Launched:
        """Issue the iteration's work; on CUDA nothing here waits for the device on a greedy
        iteration, so the next plan can be launched behind it before this one is collected."""
        packed = plan if isinstance(plan, PackedPlan) else pack(plan)
        a = packed.arrays()
        lost = [] if self.history is None else self.history.begin(a)   # first: a failed forward keeps its releases
        swapper = self.swap(packed)
        try:
            out, first, unfilled, pooled = self._forward(a, hidden_in)
        finally:
            if swapper is not None:
                swapper.computed(packed)
        if lost:   # a row whose token history is lost fails: its penalties would be wrong
            unfilled = sorted(set(unfilled) | set(lost))
        if not self.last or self.tp.where.rank != 0:
            return Launched(a, out if not self.last else None)
        rows = SamplingRows.of(a)
        logits, extra = (out, None) if out.shape[0] == len(rows) else (out[:len(rows)], out[len(rows):])
        drawn = sample(logits, rows, first, self.history)
        self._prev = (packed.iteration, drawn.tokens)
        logprobs = self._logprobs(a, logits, drawn.tokens, extra, rows.plan_rows)
        back, event = drawn.back, None
        if back.is_cuda:
            host = torch.empty(back.shape, dtype=back.dtype, pin_memory=True)   # the caching host allocator's
            back = host.copy_(back, non_blocking=True)
            logprobs = [None if x is None else x.copy() for x in logprobs]
            pooled = None if pooled is None else pooled.copy()
            event = torch.cuda.Event()
            event.record()
        return Launched(a, back, event, drawn.failed, unfilled, logprobs, pooled)

    @staticmethod
    def _logprobs(a: PlanArrays, logits: Tensor, tokens: Tensor, extra: Tensor | None,
                  logit_rows: np.ndarray) -> list[LogprobsOut | None]:
        """The rows' log probabilities where asked (sampled tokens', prompt positions'), issued on the device."""
        if a.logprobs is None:
            return []
        positions = prompt_positions(a)
        prompt = None if positions is None or extra is None else prompt_logprobs(extra, positions)
        return [sampled_logprobs(logits, tokens, a, logit_rows), prompt]

    def collect(self, launched: Launched) -> Tensor | IterationResult | None:
        """The launched iteration's hidden states or tokens (waits for the device)."""
        a, out = launched.arrays, launched.out
        if not self.last or out is None:
            return out
        if launched.event is not None:
            launched.event.synchronize()
        rids = a.plan.request_ids
        rows, at = a.sampled_positions()
        sampling = rows.tolist()   # the plan row of each sampled position
        tokens, ok = (row[:len(sampling)] for row in out.tolist())
        ids = [-1] * len(rids)
        for k in np.flatnonzero(at == 0).tolist():   # a verify row's first position: its first token
            ids[sampling[k]] = tokens[k]
        failed = sorted({sampling[k] for k in failed_rows(ok, launched.failed)} | set(launched.unfilled))
        result = IterationResult(a.plan.iteration, ids, [rids[r] for r in failed])
        if a.drafts is not None:
            verify(result, a, tokens, sampling)
        if launched.logprobs:
            fill_result(result, *launched.logprobs)
        if launched.pooled is not None:
            result.pool_rows, result.pooled = launched.pooled.rows, launched.pooled.as_bytes()
        return result

    def prepare(self, plan: PackedPlan) -> None:
        """Start the plan's KV copies ahead of its compute (the controller calls it on frame arrival)."""
        if self.swapper is not None:
            self.swapper.submit(plan)

    def swap(self, plan: PackedPlan) -> KVSwapper | None:
        """FastServe offload (swap_out) then upload (swap_in), landed before this iteration reads the KV."""
        if self.swapper is None and (plan.swap_out or plan.swap_in):
            self.swapper = KVSwapper(self.kv, self.pool.host_blocks, depth=1, threaded=False)
        if self.swapper is not None:
            self.swapper.wait(plan)
        return self.swapper

    def forward(self, plan: IterationPlan | PackedPlan, hidden_in: Tensor | None = None) -> Tensor:
        """Hidden states [T, hidden], or on the last stage logits [S, vocab] of each sampling request's last token."""
        out, first, _, _ = self._forward((plan if isinstance(plan, PackedPlan) else pack(plan)).arrays(), hidden_in)
        return out.clone() if first is not None else out

    @torch.inference_mode()
    def _forward(self, a: PlanArrays, hidden_in: Tensor | None) -> tuple[Tensor, Tensor | None, list[int], Pooled | None]:
        """The stage's output; from a CUDA graph its greedy step too (else None); the rows whose
        token could not be filled (the iteration they follow is not the last one this stage sampled:
        they fail, the others run); and on the last stage the pooling rows' sums (embeddings), if any."""
        step = build(a, self.geometry)
        prev, unfilled = self._filler(a)
        if unfilled:
            step.fields["fill_dst"] = step.fields["fill_src"] = np.zeros(0, np.int64)
        positions = prompt_positions(a) if self.last else None   # prompt logprobs: extra LM-head rows, eagerly
        pooling = pool_positions(a) if self.last else None       # embeddings: final-norm rows, eagerly too
        if (positions is None and pooling is None and self.first and hidden_in is None and self.graphs is not None
                and (bucket := self.graphs.fits(step)) is not None):
            logits, first = self.graphs.run(step, bucket, prev)
            return logits[: len(step.fields["logit_rows"])], first, unfilled, None
        lay = step.layout()
        dev = metadata(step, lay, self.stager.stage(step, lay))
        if positions is not None:
            dev.meta.prompt_rows = torch.from_numpy(positions.token_rows).to(self.device)
        if pooling is not None:
            dev.meta.pool_rows = torch.from_numpy(pooling.token_rows).to(self.device)
        fill(dev.token_ids, dev.fill_dst, dev.fill_src, prev)
        if self.first:
            inputs = dev.token_ids
        elif hidden_in is None:
            raise ValueError(f"stage {self.stage} needs the previous stage's hidden states")
        else:
            inputs = hidden_in
        out, normed = self.model.forward_pooled(inputs, dev.meta, self.kv)
        return out, None, unfilled, None if pooling is None or normed is None else pool(normed, pooling)

    def _filler(self, a: PlanArrays) -> tuple[Tensor | None, list[int]]:
        """The sampled tokens the plan's placeholders read, or the rows that cannot be filled."""
        rows = np.flatnonzero(a.prev_rows >= 0)
        if not len(rows):
            return None, []
        if self._prev is not None and self._prev[0] == a.plan.follows and int(a.prev_rows.max()) < len(self._prev[1]):
            return self._prev[1], []
        return None, rows.tolist()

    def _warm_up(self) -> None:
        """One eager iteration, a prompt chunk beside a decode, on the pool's first blocks (no request
        holds any yet): the Triton kernels of mixed iterations compile now, not under the first requests."""
        n = max(min(3 * self.block_size + 1, self.geometry.max_len - 1, self.geometry.num_blocks * self.block_size), 4)
        plan = IterationPlan(0, [SeqWork("warm-up", [0] * n, 0, list(range(-(-n // self.block_size)))),
                                 SeqWork("warm-up-decode", [0], 0, [0])])
        hidden = None if self.first else torch.zeros(n + 1, self.hidden_size, dtype=self.dtype, device=self.device)
        self.forward(plan, hidden)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def build_graphs(self, cfg: "Config", layers: range) -> Graphs | None:
        """CUDA graphs where the whole model runs here (first and last stage, one TP rank)."""
        mode = cfg.engine.cuda_graphs
        if mode == "off" or (mode == "auto" and self.device.type != "cuda"):
            return None
        if not (self.first and self.last and self.tp.where.size == 1):
            if mode == "on":
                log.info("cuda graphs: off on a stage of a pipeline or tensor-parallel group (eager)")
            return None
        if self.model.by_length:
            log.info("cuda graphs: off for a rotary whose tables follow the sequence's length (%s: eager)",
                     self.info.rope.kind)
            return None
        max_bs = cfg.engine.cuda_graph_max_bs or cfg.scheduler.max_bs
        width = -(-self.geometry.max_len // self.block_size)
        def step(ids: Tensor, meta: AttentionMetadata) -> tuple[Tensor, Tensor]:
            logits = self.model.forward(ids, meta, self.kv)
            return logits, greedy(logits)

        graphs = Graphs(step, max_bs, cfg.scheduler.max_num_batched_tokens, width, self.geometry.split_decode,
                        self.geometry.token_rows, self.stager, self.block_size, self.info.vocab_size, self.dtype, self.device)
        self.graph_error = "" if graphs.capture() else graphs.error
        return None if self.graph_error else graphs


def verify(result: IterationResult, a: PlanArrays, tokens: list[int], sampling: list[int]) -> None:
    """Speculative decoding's acceptance: a verify row keeps the tokens it sampled up to and including
    the first that differs from the draft token in its place (all k + 1 when every draft agrees), so
    its output is what decoding one token at a time would have sampled."""
    at = 0
    drafts, ids = a.drafts.tolist(), a.token_ids
    q = a.q_lens.astype(np.int64)
    ends = np.cumsum(q)
    while at < len(sampling):
        r = sampling[at]
        k = drafts[r]
        if k:
            proposed = ids[ends[r] - k:ends[r]].tolist()
            n = 0
            while n < k and tokens[at + n] == proposed[n]:
                n += 1
            result.verify_rows.append(r)
            result.verified.append(tokens[at + 1:at + n + 1])
        at += k + 1


@dataclass(slots=True)
class Launched:
    """An iteration issued to the device, not yet collected."""

    arrays: PlanArrays
    out: Tensor | None                 # hidden states; on the last stage [2, >= S] tokens over ok flags (host)
    event: "torch.cuda.Event | None" = None
    failed: list[int] = field(default_factory=list)     # sampling rows whose sampling raised
    unfilled: list[int] = field(default_factory=list)   # plan rows whose token could not be filled
    logprobs: list[LogprobsOut | None] = field(default_factory=list)   # (sampled, prompt) where rows ask
    pooled: Pooled | None = None       # the pooling rows' sums (embeddings), where rows pool
