"""The yardstick for a decode iteration: the same model step written in plain torch (fused QKV and
gate-up GEMMs, a dense KV of `ctx` tokens, SDPA), launched op by op and replayed from a CUDA graph.
What the replay costs is what one decode iteration of this shape can cost on the card with kernel
launches and host work taken out (../shared/gpu/graph_probe.py, the first GPU run's probe)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from orca_mq.bench.timing import median_time

if TYPE_CHECKING:
    from orca_mq.models.info import ModelInfo


class ProbeModel:
    """Random weights of `info`'s shape (Llama: RMSNorm, GQA, SiLU-gated MLP, tied head)."""

    def __init__(self, info: "ModelInfo", device: torch.device, dtype: torch.dtype) -> None:
        g = torch.Generator(device="cpu").manual_seed(0)
        self.info, self.device, self.dtype = info, device, dtype
        h, d, i = info.hidden_size, info.head_dim, info.intermediate_size

        def w(*shape: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=g) * 0.02).to(device, dtype)

        ones = torch.ones(h, device=device, dtype=dtype)
        self.layers = [dict(qkv=w((info.n_heads + 2 * info.n_kv_heads) * d, h), o=w(h, info.n_heads * d),
                            gu=w(2 * i, h), d=w(h, i)) for _ in range(info.n_layers)]
        self.emb, self.norm = w(info.vocab_size, h), ones

    def step(self, ids: torch.Tensor, kc: list[torch.Tensor], vc: list[torch.Tensor]) -> torch.Tensor:
        """One decode step of B rows: each writes its token's K/V at the last position of its cache
        and attends over all of it; returns the logits."""
        info, x = self.info, self.emb[ids]
        b, h, d, nh, nkv = x.shape[0], info.hidden_size, info.head_dim, info.n_heads, info.n_kv_heads
        for i, p in enumerate(self.layers):
            y = F.rms_norm(x, (h,), self.norm, info.norm_eps)
            q, k, v = (y @ p["qkv"].T).split([nh * d, nkv * d, nkv * d], -1)
            kc[i][:, -1] = k.view(b, nkv, d)
            vc[i][:, -1] = v.view(b, nkv, d)
            a = F.scaled_dot_product_attention(q.view(b, nh, 1, d), kc[i].transpose(1, 2), vc[i].transpose(1, 2),
                                               enable_gqa=True)
            x = x + a.reshape(b, nh * d) @ p["o"].T
            y = F.rms_norm(x, (h,), self.norm, info.norm_eps)
            gate, up = (y @ p["gu"].T).chunk(2, -1)
            x = x + (F.silu(gate) * up) @ p["d"].T
        return F.rms_norm(x, (h,), self.norm, info.norm_eps) @ self.emb.T


@torch.no_grad()
def probe(model: ProbeModel, batch: int, ctx: int, repeat: int = 20) -> dict[str, float | str]:
    """Median ms of one step at `batch` rows over `ctx` cached tokens: eager, and (CUDA) a graph replay."""
    dev, dt, info = model.device, model.dtype, model.info
    ids = torch.randint(0, info.vocab_size, (batch,), device=dev)
    kv = [torch.randn(batch, ctx, info.n_kv_heads, info.head_dim, device=dev, dtype=dt) for _ in range(2 * info.n_layers)]
    kc, vc = kv[:info.n_layers], kv[info.n_layers:]
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
