"""One pipeline stage of a Llama- or GPT-2-family model, run with selective batching.

All tokens of the iteration flow as one [T, hidden] tensor through embeddings, norms, QKV/out
projections, MLP and residual adds; only attention is split per request (the backend of attention/); the LM
head runs on each request's last token only.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from orca_mq.engine.attention import AttentionBackend, AttentionMetadata
from orca_mq.kv.cache import KVCache
from orca_mq.engine.model_info import ModelInfo
from orca_mq.engine.parallel import TensorParallel
from orca_mq.engine.weights import StageWeights

Tensor = torch.Tensor


class StageModel:
    def __init__(self, info: ModelInfo, weights: StageWeights, layers: range, max_len: int,
                 device: torch.device, attention: AttentionBackend, tp: TensorParallel | None = None) -> None:
        self.info, self.layers = info, layers
        self.tp = tp or TensorParallel(info)  # this rank's heads and the stage's all-reduces (size 1: identity)
        self.w = weights
        self.first, self.last = weights.embed is not None and layers.start == 0, weights.final_norm is not None
        self.scale = 1.0 / math.sqrt(info.head_dim)
        self.n_heads = self.tp.n_heads
        self.split = [self.n_heads * info.head_dim, self.tp.n_kv_heads * info.head_dim, self.tp.n_kv_heads * info.head_dim]
        self.attention = attention
        self.attention_backend = attention.name
        self.fused = attention.fused_ops  # Triton norm/rotary kernels (CUDA), or None: torch ops
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
        or logits [B, vocab] of each request's last token on the last stage."""
        h = self.embed(inputs, meta) if self.first else inputs
        # the torch path gathers this iteration's rotary rows once for all layers
        rope = (self.cos[meta.positions], self.sin[meta.positions]) if self.info.arch == "llama" and self.fused is None else None
        for i, w in enumerate(self.w.layers):
            k_cache, v_cache = kv.layer(i)
            h = self._layer(h, w, meta, k_cache, v_cache, rope)
        if not self.last:
            return h
        h = h.index_select(0, meta.last_token_idx)
        return self.tp.gather_logits(F.linear(self._norm(h, self.w.final_norm["w"], self.w.final_norm.get("b")), self.w.lm_head))

    def embed(self, tokens: Tensor, meta: AttentionMetadata) -> Tensor:
        h = self.tp.embed(tokens, self.w.embed)
        return h + F.embedding(meta.positions, self.w.pos_embed) if self.w.pos_embed is not None else h

    def _norm(self, x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        if self.info.arch == "gpt2":
            return F.layer_norm(x, (x.shape[-1],), w, b, self.info.norm_eps)
        if self.fused is not None:
            return self.fused.rms_norm(x, w, self.info.norm_eps)
        xf = x.float()  # F.rms_norm is not fused on CPU and is far slower than these three ops
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.info.norm_eps)).to(x.dtype)

    def _layer(self, h: Tensor, w: dict[str, Tensor], meta: AttentionMetadata,
               k_cache: Tensor, v_cache: Tensor, rope: tuple[Tensor, Tensor] | None) -> Tensor:
        gpt2 = self.info.arch == "gpt2"
        x = self._norm(h, w["ln1_w"], w["ln1_b"]) if gpt2 else self._norm(h, w["attn_norm"], None)
        qkv = F.linear(x, w["qkv"], w.get("qkv_b"))
        t, d = h.shape[0], self.info.head_dim
        q, k = qkv[:, : self.split[0]].reshape(t, -1, d), qkv[:, self.split[0]: -self.split[2]].reshape(t, -1, d)
        v = qkv[:, -self.split[2]:].reshape(t, -1, d)
        if rope is not None:  # Q and K heads rotate together: one set of elementwise ops
            qk = _rotary(qkv[:, : self.split[0] + self.split[1]].reshape(t, -1, d), *rope)
            q, k = qk[:, : self.n_heads], qk[:, self.n_heads:]
        elif self.fused is not None and not gpt2:
            q, k = self.fused.rotary(q, k, meta.positions, self.cos, self.sin)
        self.attention.write_kv(k, v, k_cache, v_cache, meta)
        o = self.attention.attend(q, k, v, k_cache, v_cache, meta, self.scale).reshape(t, -1)
        h = h + self.tp.reduce(F.linear(o, w["o"], w.get("o_b")))  # row-parallel: partial sums per rank
        if gpt2:
            x = self._norm(h, w["ln2_w"], w["ln2_b"])
            return h + self.tp.reduce(F.linear(F.gelu(F.linear(x, w["fc"], w["fc_b"]), approximate="tanh"), w["proj"], w.get("proj_b")))
        gate, up = F.linear(self._norm(h, w["ffn_norm"], None), w["gate_up"]).chunk(2, dim=-1)
        return h + self.tp.reduce(F.linear(F.silu(gate) * up, w["down"]))


def _rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x * cos + rotate_half(x) * sin, with the table's two equal halves computed once."""
    half = x.shape[-1] // 2
    cos, sin = cos[:, None, :half], sin[:, None, :half]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
