"""The yardstick for a decode iteration: the same model step written in plain torch (fused QKV and
gate-up GEMMs, a dense KV of `ctx` tokens, SDPA), launched op by op and replayed from a CUDA graph.
What the replay costs is what one decode iteration of this shape can cost on the card with kernel
launches and host work taken out (../shared/gpu/graph_probe.py, the first GPU run's probe); the
rotary is left out (two elementwise kernels a layer).

It runs over a runner's own weights (every GEMM through engine/gemm.py, so FP8 weights multiply as
the engine's do) and its KV pool's memory as the dense caches: an 8B or 30B shape has no room for a
second copy of either. A layer of experts runs the engine's own MoE (its fused kernel on CUDA):
torch has no grouped GEMM over routed tokens that a graph can capture.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from orca_mq.bench.timing import median_time
from orca_mq.engine import gemm

if TYPE_CHECKING:
    from orca_mq.kv.cache import KVCache
    from orca_mq.models.info import ModelInfo
    from orca_mq.models.weights import StageWeights

Tensor = torch.Tensor
Caches = tuple[list[Tensor], list[Tensor]]
FeedForward = Callable[[Tensor, dict[str, Tensor]], Tensor]


class ProbeModel:
    """One stage holding the whole model (RMSNorm, GQA with q/k norms where the family has them, a
    SiLU-gated MLP or experts). `mlps[i]`: the engine's feed-forward of layer i (used for experts)."""

    def __init__(self, info: "ModelInfo", weights: "StageWeights", mlps: list[FeedForward]) -> None:
        assert weights.embed is not None and weights.lm_head is not None and weights.final_norm is not None
        self.info, self.w, self.mlps = info, weights, mlps
        self.device, self.dtype = weights.embed.device, weights.embed.dtype

    def _norm(self, x: Tensor, w: Tensor) -> Tensor:
        return F.rms_norm(x, (x.shape[-1],), w, self.info.norm_eps)

    def step(self, ids: Tensor, kc: list[Tensor], vc: list[Tensor]) -> Tensor:
        """One decode step of B rows: each writes its token's K/V at the last position of its cache
        and attends over all of it; returns the logits."""
        info, x = self.info, self.w.embed[ids]   # type: ignore[index]
        b, d, nh, nkv = x.shape[0], info.head_dim, info.n_heads, info.n_kv_heads
        for i, p in enumerate(self.w.layers):
            qkv = gemm.linear(self._norm(x, p["attn_norm"]), p["qkv"], p.get("qkv_b"))
            q, k, v = (t.view(b, -1, d) for t in qkv.split([nh * d, nkv * d, nkv * d], -1))
            if "q_norm" in p:
                q, k = self._norm(q, p["q_norm"]), self._norm(k, p["k_norm"])
            kc[i][:, -1] = k
            vc[i][:, -1] = v
            a = F.scaled_dot_product_attention(q.unsqueeze(2), kc[i].transpose(1, 2), vc[i].transpose(1, 2),
                                               enable_gqa=True)
            x = x + gemm.linear(a.reshape(b, nh * d), p["o"], p.get("o_b"))
            y = self._norm(x, p["ffn_norm"])
            if "experts_down" in p:
                x = x + self.mlps[i](y, p)
            else:
                gate, up = gemm.linear(y, p["gate_up"]).chunk(2, -1)
                x = x + gemm.linear(F.silu(gate) * up, p["down"])
        return gemm.linear(self._norm(x, self.w.final_norm["w"]), self.w.lm_head)   # type: ignore[index, arg-type]


def pool_caches(kv: "KVCache", batch: int, ctx: int) -> Caches:
    """Dense [batch, ctx, KV heads, head_dim] caches per layer, viewed over a runner's pool (its first
    batch x ctx slots, which must exist)."""
    n_layers, blocks, block, heads, d = kv.k.shape
    if batch * ctx > blocks * block:
        raise ValueError(f"the probe needs {batch * ctx} KV slots, the pool has {blocks * block}")
    return tuple([c[i].view(-1, heads, d)[: batch * ctx].view(batch, ctx, heads, d) for i in range(n_layers)]
                 for c in (kv.k, kv.v))   # type: ignore[return-value]


@torch.no_grad()
def probe(model: ProbeModel, batch: int, ctx: int, caches: Caches, repeat: int = 20) -> dict[str, float | str]:
    """Median ms of one step at `batch` rows over `ctx` cached tokens: eager, and (CUDA) a graph replay."""
    dev, info = model.device, model.info
    ids = torch.randint(0, info.vocab_size, (batch,), device=dev)
    kc, vc = caches
    cuda = dev.type == "cuda"

    def synced(fn):  # noqa: ANN001, ANN202
        return lambda: (fn(), torch.cuda.synchronize() if cuda else None)

    out: dict[str, float | str] = {"eager_ms": median_time(synced(lambda: model.step(ids, kc, vc)), repeat) * 1e3}
    if cuda:
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):   # warm-up off the capture stream, as torch's docs do
                for _ in range(3):
                    model.step(ids, kc, vc)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                model.step(ids, kc, vc)
            out["graph_ms"] = median_time(synced(graph.replay), repeat) * 1e3
            del graph
        except Exception as e:   # noqa: BLE001 - the probe's own failure is a result, not a crash
            out["graph_error"] = repr(e)[:300]
    return out
