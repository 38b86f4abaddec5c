"""One pipeline stage of a decoder-only model of any family, run with selective batching.

All tokens of the iteration flow as one [T, hidden] tensor through embeddings, norms, QKV/out
projections, MLP (or experts) and residual adds; only attention is split per request (the backend of
engine/attention/); the LM head runs only on the last token of each request that samples (a prompt
chunk with more to come does not), and on the prompt positions of a request that asks for prompt
logprobs (a call of its own); an embedding request's pooled rows get the final norm alone, in a call of
their own too (its output is transformers' last_hidden_state). What a family changes (biases, q/k norms,
windows, soft-caps, sinks, sandwich norms, the activation, experts, the rotary) comes from ModelInfo's
options, set per layer once.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from orca_mq.engine import gemm
from orca_mq.engine.attention import AttentionBackend, AttentionMetadata, AttentionSpec
from orca_mq.engine.parallel import TensorParallel
from orca_mq.kv.cache import KVCache
from orca_mq.models.info import ModelInfo
from orca_mq.models.layers.mlp import DenseMLP
from orca_mq.models.layers.moe import MoE
from orca_mq.models.layers.rotary import Rotary
from orca_mq.models.weights import StageWeights

Tensor = torch.Tensor


class StageModel:
    def __init__(self, info: ModelInfo, weights: StageWeights, layers: range, max_len: int,
                 device: torch.device, attention: AttentionBackend, tp: TensorParallel | None = None,
                 rows: gemm.Rows = gemm.Rows(), expert_rows: gemm.Rows = gemm.Rows()) -> None:
        """`rows`: how the layers' GEMMs cut a batch (deterministic mode); `expert_rows`: the padded tiles
        the experts' GEMMs take then (their plain weights are not the ones found row-invariant)."""
        self.info, self.layers = info, layers
        self.linear = functools.partial(gemm.linear, rows=rows)   # rows.n > 0: batch-invariant GEMMs
        self.tp = tp or TensorParallel(info)  # this rank's heads and the stage's all-reduces (size 1: identity)
        self.w = weights
        self.first, self.last = weights.embed is not None and layers.start == 0, weights.final_norm is not None
        self.n_heads, self.n_kv_heads, self.d = self.tp.n_heads, self.tp.n_kv_heads, info.head_dim
        self.split = [self.n_heads * self.d, self.n_kv_heads * self.d, self.n_kv_heads * self.d]
        self.attention = attention
        self.attention_backend = attention.name
        self.ops = attention.ops  # norms, rotary and activation for this device (engine/layer_ops.py)
        self.layer_norm = info.norm == "layer"
        dtype = weights.layers[0]["qkv"].dtype if weights.layers else torch.float32
        self.rotary: dict[str, Rotary] = {}
        if info.rope.kind != "none":
            self.rotary["full"] = Rotary(info.rope, self.d, info.rotary_dim or self.d, max_len, device, dtype)
            if info.rope_local is not None:
                self.rotary["sliding"] = Rotary(info.rope_local, self.d, info.rotary_dim or self.d, max_len, device, dtype)
        self.by_length = any(r.by_length for r in self.rotary.values())
        self.kinds = [("sliding" if info.window(i) and "sliding" in self.rotary else "full") for i in layers]
        self.specs = [AttentionSpec(info.scale, info.window(i), info.attn_softcap, w.get("sinks"))
                      for i, w in zip(layers, weights.layers)]
        fused_moe = device.type == "cuda"
        tiles = functools.partial(gemm.linear, rows=expert_rows) if expert_rows.n else None
        self.mlps = [MoE(info, self.ops, self.tp.reduce, fused_moe, tiles) if info.is_moe(i)
                     else DenseMLP(info, self.ops, self.linear, self.tp.reduce) for i in layers]
        self.embed_scale = torch.tensor(info.embed_scale, dtype=dtype).item() if info.embed_scale != 1.0 else 0.0

    # ------------------------------------------------------------ forward

    def forward(self, inputs: Tensor, meta: AttentionMetadata, kv: KVCache) -> Tensor:
        """inputs: token ids [T] on the first stage, else hidden [T, H]. Returns hidden [T, H],
        or on the last stage logits [S, vocab] of the last token of each request that samples."""
        return self.forward_pooled(inputs, meta, kv)[0]

    @torch.inference_mode()
    def forward_pooled(self, inputs: Tensor, meta: AttentionMetadata, kv: KVCache) -> tuple[Tensor, Tensor | None]:
        """`forward`'s output and, on the last stage where `meta.pool_rows` asks (embeddings), the final
        norm's output at those token rows in float32 [N, H] (transformers' last_hidden_state), else None."""
        h = self.embed(inputs, meta) if self.first else inputs
        tables = {kind: r.tables(meta) for kind, r in self.rotary.items()}
        delta = None   # the last layer's MLP output, added to h by the next norm (one pass for both)
        for i, w in enumerate(self.w.layers):
            h, delta = self._layer(i, h, delta, w, meta, tables, *kv.layer(i))
        if not self.last:
            return (h if delta is None else h + delta), None
        logits = self._head(h, delta, meta.logit_rows)
        if meta.prompt_rows is not None:   # prompt logprobs: their rows in an LM-head call of their own, after
            logits = torch.cat((logits, self._head(h, delta, meta.prompt_rows)))
        return logits, None if meta.pool_rows is None else self._final_norm(h, delta, meta.pool_rows).float()

    def _norm(self, x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        if self.layer_norm:
            return F.layer_norm(x, (x.shape[-1],), w, b, self.info.norm_eps)
        return self.ops.rms_norm(x, w, self.info.norm_eps)

    def _add_norm(self, h: Tensor, delta: Tensor | None, w: Tensor, b: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(h + delta, its norm): the residual add rides in the norm where the ops fuse them."""
        if delta is None:
            return h, self._norm(h, w, b)
        if self.layer_norm:
            h = h + delta
            return h, self._norm(h, w, b)
        return self.ops.add_rms_norm(h, delta, w, self.info.norm_eps)

    def _final_norm(self, h: Tensor, delta: Tensor | None, rows: Tensor) -> Tensor:
        """The final norm's output at the token rows `rows`: [len(rows), hidden]."""
        norm = self.w.final_norm
        assert norm is not None
        h, delta = h.index_select(0, rows), None if delta is None else delta.index_select(0, rows)
        return self._add_norm(h, delta, norm["w"], norm.get("b"))[1]

    def _head(self, h: Tensor, delta: Tensor | None, rows: Tensor) -> Tensor:
        """The final norm and the LM head over the token rows `rows`: logits [len(rows), vocab]."""
        logits = self.tp.gather_logits(self.linear(self._final_norm(h, delta, rows), self.w.lm_head))
        if cap := self.info.final_softcap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def embed(self, tokens: Tensor, meta: AttentionMetadata) -> Tensor:
        h = self.tp.embed(tokens, self.w.embed)
        if self.embed_scale:
            h = h * self.embed_scale
        return h + F.embedding(meta.positions, self.w.pos_embed) if self.w.pos_embed is not None else h

    def _qk_norm(self, qkv: Tensor, w: dict[str, Tensor]) -> None:
        """Each q and k head's RMSNorm, in place in the fused QKV output (Qwen3, Gemma 3)."""
        t, (q, k, _), eps = qkv.shape[0], self.split, self.info.norm_eps
        qkv[:, :q] = self.ops.rms_norm(qkv[:, :q].reshape(-1, self.d), w["q_norm"], eps).view(t, q)
        qkv[:, q:q + k] = self.ops.rms_norm(qkv[:, q:q + k].reshape(-1, self.d), w["k_norm"], eps).view(t, k)

    def _layer(self, i: int, h: Tensor, delta: Tensor | None, w: dict[str, Tensor], meta: AttentionMetadata,
               tables: dict[str, tuple[Tensor, Tensor, Tensor]], k_cache: Tensor, v_cache: Tensor) -> tuple[Tensor, Tensor]:
        """(h, delta) in, (h + attention, MLP output) out: each residual add rides in the next norm."""
        t, d = h.shape[0], self.d
        h, x = self._add_norm(h, delta, w["attn_norm"], w.get("attn_norm_b"))
        qkv = self.linear(x, w["qkv"], w.get("qkv_b"))
        if "q_norm" in w:
            self._qk_norm(qkv, w)
        v = qkv[:, -self.split[2]:].view(t, -1, d)
        if not tables:   # learned positions (GPT-2)
            q, k = qkv[:, : self.split[0]].view(t, -1, d), qkv[:, self.split[0]: -self.split[2]].view(t, -1, d)
            self.attention.write_kv(k, v, k_cache, v_cache, meta)
        else:
            cos, sin, at = tables[self.kinds[i]]
            if self.attention.fused_rotary_kv:   # rotary and the KV write in one launch
                q = self.attention.rotary_write_kv(qkv, meta, k_cache, v_cache, cos, sin, self.n_heads, at)
                k = qkv[:, self.split[0]: self.split[0] + self.split[1]].view(t, -1, d)
            else:
                q, k = self.ops.rotary(qkv, at, cos, sin, self.n_heads, self.n_kv_heads)
                self.attention.write_kv(k, v, k_cache, v_cache, meta)
        o = self.attention.attend(q, k, v, k_cache, v_cache, meta, self.specs[i]).reshape(t, -1)
        a = self.tp.reduce(self.linear(o, w["o"], w.get("o_b")))
        if "post_attn_norm" in w:
            a = self._norm(a, w["post_attn_norm"], None)
        h, x = self._add_norm(h, a, w["ffn_norm"], w.get("ffn_norm_b"))
        m = self.mlps[i](x, w)
        if "post_ffn_norm" in w:
            m = self._norm(m, w["post_ffn_norm"], None)
        return h, m
