"""Executes one iteration plan on one pipeline stage: its layers, its KV pool, and (last stage) sampling."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from orca_mq.engine import gemm
from orca_mq.engine.attention import build_metadata, resolve
from orca_mq.engine.device import resolve_device, use_device
from orca_mq.engine.dtype import native_bf16_flags, resolve_dtype
from orca_mq.protocol.iteration import IterationPlan, IterationResult
from orca_mq.kv.cache import KVCache
from orca_mq.kv.pool import PoolSize
from orca_mq.kv.swapper import KVSwapper
from orca_mq.engine.model import StageModel
from orca_mq.engine.parallel import TensorParallel, TPGroup
from orca_mq.engine.sampler import sample
from orca_mq.engine.threads import use_threads
from orca_mq.engine.model_info import ModelInfo, read_model_info
from orca_mq.engine.weights import MATRICES, StageWeights, load_stage_weights

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
                 tp: TPGroup | None = None, device: torch.device | None = None) -> None:
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
        weights = self.tp.shard(load_stage_weights(self.info, layers, self.first, self.last, self.dtype, cfg.model.cache_dir))
        for w in [*weights.layers, weights.final_norm or {}]:
            for k, t in w.items():
                w[k] = t.to(self.device)
        for name in ("embed", "pos_embed", "lm_head"):
            t = getattr(weights, name)
            if t is not None:
                setattr(weights, name, t.to(self.device))
        if weights.lm_head is not None and weights.embed is not None and self.info.tie_embeddings:
            weights.lm_head = weights.embed  # one copy of a tied head (a second one when the GEMM reorders it)
        self.gemm = gemm.resolve_method(cfg.engine.gemm, self.device, self.dtype, cfg.engine.deterministic)
        for w in weights.layers:
            for k in MATRICES:
                if k in w:
                    w[k] = gemm.prepare(w[k], self.gemm)
        if weights.lm_head is not None:
            weights.lm_head = gemm.prepare(weights.lm_head, self.gemm)
        self.pool = PoolSize.from_config(cfg)
        self.block_size = self.pool.block_size
        attention = resolve(cfg.engine.attention_backend, self.device, self.dtype)
        self.deterministic = cfg.engine.deterministic
        if self.deterministic and attention.name not in DETERMINISTIC_BACKENDS:
            raise ValueError(f"engine.deterministic needs an attention backend whose rows are batch-invariant "
                             f"({' | '.join(DETERMINISTIC_BACKENDS)}); {attention.name} runs for {self.device} {self.dtype}")
        self.rows = self._gemm_rows(cfg, weights) if self.deterministic else gemm.Rows()
        self.model = StageModel(self.info, weights, layers, self.info.max_model_len(cfg), self.device, attention,
                                self.tp, self.rows)
        self.kv = KVCache.allocate(len(layers), self.pool.device_blocks, self.block_size,
                                   self.tp.n_kv_heads, self.info.head_dim, self.dtype, self.device)
        # FastServe's copies: a worker starts its copy thread (start_swap_thread); offline, an inline
        # swapper (and its host pool) is made at the first plan that swaps
        self.swapper: KVSwapper | None = None

    @staticmethod
    def _gemm_rows(cfg: "Config", weights: StageWeights) -> gemm.Rows:
        """Deterministic mode's GEMM calls: tiles of deterministic_rows, unless every GEMM of this
        stage is found row-invariant up to the most rows an iteration gives it (the token budget;
        the LM head: max_bs), when calls are cut only above that."""
        budget, max_bs = cfg.scheduler.max_num_batched_tokens, cfg.scheduler.max_bs
        tiles = gemm.Rows(cfg.engine.deterministic_rows)
        if not budget:   # whole prompts: no bound on an iteration's rows to try up to
            return tiles
        max_rows = max(budget, max_bs)
        shapes = {(tuple(w[k].shape), k + "_b" in w): (w[k], w.get(k + "_b"), max_rows)
                  for w in weights.layers for k in MATRICES if k in w}
        if weights.lm_head is not None:
            shapes["lm_head"] = (weights.lm_head, None, max_bs)
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

    def execute(self, plan: IterationPlan, hidden_in: Tensor | None = None) -> Tensor | IterationResult | None:
        """Stage 0 takes the plan's tokens, later stages the previous stage's hidden states.
        Returns hidden states [T, hidden] to pass on, or on the last stage the sampled tokens
        (tensor-parallel rank 0 only: the other ranks hold the same logits and return None)."""
        swapper = self.swap(plan)
        try:
            out = self.forward(plan, hidden_in)
        finally:
            if swapper is not None:
                swapper.computed(plan)
        if not self.last:
            return out
        if self.tp.where.rank != 0:
            return None
        seqs = [s for s in plan.seqs if s.sample]   # logits' rows, in plan order
        tokens, failed = sample(out, seqs) if seqs else ([], [])
        drawn = iter(tokens)
        return IterationResult(plan.iteration, [s.request_id for s in plan.seqs],
                               [next(drawn) if s.sample else -1 for s in plan.seqs], [seqs[b].request_id for b in failed])

    def prepare(self, plan: IterationPlan) -> None:
        """Start the plan's KV copies ahead of its compute (the controller calls it on frame arrival)."""
        if self.swapper is not None:
            self.swapper.submit(plan)

    def swap(self, plan: IterationPlan) -> KVSwapper | None:
        """FastServe offload (swap_out) then upload (swap_in), landed before this iteration reads the KV."""
        if self.swapper is None and (plan.swap_out or plan.swap_in):
            self.swapper = KVSwapper(self.kv, self.pool.host_blocks, depth=1, threaded=False)
        if self.swapper is not None:
            self.swapper.wait(plan)
        return self.swapper

    def forward(self, plan: IterationPlan, hidden_in: Tensor | None = None) -> Tensor:
        """Hidden states [T, hidden], or on the last stage logits [S, vocab] of each sampling request's last token."""
        meta = build_metadata(plan, self.block_size, self.device, token_rows=self.deterministic)
        if self.first:
            inputs = torch.tensor([t for s in plan.seqs for t in s.token_ids], dtype=torch.int64, device=self.device)
        elif hidden_in is None:
            raise ValueError(f"stage {self.stage} needs the previous stage's hidden states")
        else:
            inputs = hidden_in
        return self.model.forward(inputs, meta, self.kv)
