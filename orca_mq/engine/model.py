"""One pipeline stage of a Llama- or GPT-2-family model, run with selective batching.

All tokens of the iteration flow as one [T, hidden] tensor through embeddings, norms, QKV/out
projections, MLP and residual adds; only attention is split per request (the backend of attention/); the LM
head runs only on the last token of each request that samples (a prompt chunk with more to come does not),
and on the prompt positions of a request that asks for prompt logprobs (a call of its own).
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from orca_mq.engine import gemm
from orca_mq.engine.attention import AttentionBackend, AttentionMetadata
from orca_mq.kv.cache import KVCache
from orca_mq.engine.model_info import ModelInfo
from orca_mq.engine.parallel import TensorParallel
from orca_mq.engine.weights import StageWeights

Tensor = torch.Tensor


class StageModel:
    def __init__(self, info: ModelInfo, weights: StageWeights, layers: range, max_len: int,
                 device: torch.device, attention: AttentionBackend, tp: TensorParallel | None = None,
                 rows: gemm.Rows = gemm.Rows()) -> None:
        self.info, self.layers = info, layers
        self.linear = functools.partial(gemm.linear, rows=rows)   # rows.n > 0: batch-invariant GEMMs
        self.tp = tp or TensorParallel(info)  # this rank's heads and the stage's all-reduces (size 1: identity)
        self.w = weights
        self.first, self.last = weights.embed is not None and layers.start == 0, weights.final_norm is not None
        self.scale = 1.0 / math.sqrt(info.head_dim)
        self.n_heads = self.tp.n_heads
        self.split = [self.n_heads * info.head_dim, self.tp.n_kv_heads * info.head_dim, self.tp.n_kv_heads * info.head_dim]
        self.attention = attention
        self.attention_backend = attention.name
        self.ops = attention.ops  # norms, rotary and activation for this device (engine/layer_ops.py)
        if info.arch == "llama":  # rotary tables in the rotate-half layout, as Hugging Face computes them
            d = info.head_dim
            inv_freq = 1.0 / (info.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
            freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)
            emb = torch.cat([freqs, freqs], dim=-1)
            dtype = weights.layers[0]["qkv"].dtype if weights.layers else torch.float32
            self.cos, self.sin = emb.cos().to(device, dtype), emb.sin().to(device, dtype)

    # ------------------------------------------------------------ forward

    @torch.inference_mode()
    def forward(self, inputs: Tensor, meta: AttentionMetadata, kv: KVCache) -> Tensor:
        """inputs: token ids [T] on the first stage, else hidden [T, H]. Returns hidden [T, H],
        or on the last stage logits [S, vocab] of the last token of each request that samples."""
        h = self.embed(inputs, meta) if self.first else inputs
        layer = self._gpt2_layer if self.info.arch == "gpt2" else self._llama_layer
        delta = None   # the last layer's MLP output, added to h by the next norm (llama: one pass for both)
        for i, w in enumerate(self.w.layers):
            h, delta = layer(h, delta, w, meta, *kv.layer(i))
        if not self.last:
            return h if delta is None else h + delta
        logits = self._head(h, delta, meta.logit_rows)
        if meta.prompt_rows is not None:   # prompt logprobs: their rows in an LM-head call of their own, after
            logits = torch.cat((logits, self._head(h, delta, meta.prompt_rows)))
        return logits

    def _head(self, h: Tensor, delta: Tensor | None, rows: Tensor) -> Tensor:
        """The final norm and the LM head over the token rows `rows`: logits [len(rows), vocab]."""
        norm = self.w.final_norm
        assert norm is not None
        h, delta = h.index_select(0, rows), None if delta is None else delta.index_select(0, rows)
        if self.info.arch == "gpt2":
            x = F.layer_norm(h if delta is None else h + delta, (h.shape[-1],), norm["w"], norm["b"], self.info.norm_eps)
        elif delta is None:
            x = self.ops.rms_norm(h, norm["w"], self.info.norm_eps)
        else:
            x = self.ops.add_rms_norm(h, delta, norm["w"], self.info.norm_eps)[1]
        return self.tp.gather_logits(self.linear(x, self.w.lm_head))

    def embed(self, tokens: Tensor, meta: AttentionMetadata) -> Tensor:
        h = self.tp.embed(tokens, self.w.embed)
        return h + F.embedding(meta.positions, self.w.pos_embed) if self.w.pos_embed is not None else h

    def _attention(self, q: Tensor, k: Tensor, v: Tensor, w: dict[str, Tensor], meta: AttentionMetadata,
                   k_cache: Tensor, v_cache: Tensor) -> Tensor:
        """Each request over its own KV (this iteration's already written), the output projection (summed over TP ranks)."""
        o = self.attention.attend(q, k, v, k_cache, v_cache, meta, self.scale).reshape(q.shape[0], -1)
        return self.tp.reduce(self.linear(o, w["o"], w.get("o_b")))

    def _llama_layer(self, h: Tensor, delta: Tensor | None, w: dict[str, Tensor], meta: AttentionMetadata,
                     k_cache: Tensor, v_cache: Tensor) -> tuple[Tensor, Tensor]:
        """(h, delta) in, (h + attention, MLP output) out: each residual add rides in the next norm."""
        eps, t, d = self.info.norm_eps, h.shape[0], self.info.head_dim
        if delta is None:
            x = self.ops.rms_norm(h, w["attn_norm"], eps)
        else:
            h, x = self.ops.add_rms_norm(h, delta, w["attn_norm"], eps)
        qkv = self.linear(x, w["qkv"])
        v = qkv[:, -self.split[2]:].view(t, -1, d)
        if self.attention.fused_rotary_kv:   # rotary and the KV write in one launch
            q = self.attention.rotary_write_kv(qkv, meta, k_cache, v_cache, self.cos, self.sin, self.n_heads)
            k = qkv[:, self.split[0]: self.split[0] + self.split[1]].view(t, -1, d)
        else:
            q, k = self.ops.rotary(qkv, meta.positions, self.cos, self.sin, self.n_heads, self.tp.n_kv_heads)
            self.attention.write_kv(k, v, k_cache, v_cache, meta)
        h, x = self.ops.add_rms_norm(h, self._attention(q, k, v, w, meta, k_cache, v_cache), w["ffn_norm"], eps)
        return h, self.tp.reduce(self.linear(self.ops.silu_mul(self.linear(x, w["gate_up"])), w["down"]))

    def _gpt2_layer(self, h: Tensor, delta: Tensor | None, w: dict[str, Tensor], meta: AttentionMetadata,
                    k_cache: Tensor, v_cache: Tensor) -> tuple[Tensor, Tensor]:
        if delta is not None:
            h = h + delta
        eps, t, d = self.info.norm_eps, h.shape[0], self.info.head_dim
        qkv = self.linear(F.layer_norm(h, (h.shape[-1],), w["ln1_w"], w["ln1_b"], eps), w["qkv"], w.get("qkv_b"))
        q, k = qkv[:, : self.split[0]].view(t, -1, d), qkv[:, self.split[0]: -self.split[2]].view(t, -1, d)
        v = qkv[:, -self.split[2]:].view(t, -1, d)
        self.attention.write_kv(k, v, k_cache, v_cache, meta)
        h = h + self._attention(q, k, v, w, meta, k_cache, v_cache)
        x = F.layer_norm(h, (h.shape[-1],), w["ln2_w"], w["ln2_b"], eps)
        return h, self.tp.reduce(self.linear(F.gelu(self.linear(x, w["fc"], w["fc_b"]), approximate="tanh"),
                                             w["proj"], w.get("proj_b")))
