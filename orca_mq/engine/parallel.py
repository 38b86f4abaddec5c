"""Tensor parallelism inside one pipeline stage, in the Megatron layout.

Each of a stage's `size` ranks owns whole attention heads: QKV and gate/up are split by columns
(output rows of the [out, in] matrices), the attention output and down projections by rows (their
input columns), each followed by an all-reduce over the stage's group. KV heads are divided among
the ranks, or replicated when there are fewer KV heads than ranks; a rank's KV pool holds only its
own. Heads and MLP columns that do not divide evenly go to the first ranks (SmolLM2's 3 KV heads
over 2 ranks: 2 + 1). The embedding and the LM head are vocabulary-parallel: each rank holds a
contiguous slice of the (padded) vocabulary; embeddings are summed, logits all-gathered.
Size 1 is the identity everywhere, so the single-process engine runs the same code.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from orca_mq.models.info import ModelInfo
from orca_mq.models.weights import StageWeights

Tensor = torch.Tensor
# row-parallel biases are added once (rank 0), after the all-reduce would sum them `size` times
_ROW_BIASES = ("o_b", "down_b", "experts_down_b")


@dataclass(slots=True)
class TPGroup:
    """Where a worker sits in its stage: its rank, the stage's size and its torch.distributed group."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None


@dataclass(slots=True, frozen=True)
class ShardSpec:
    rank: int
    size: int
    heads: range       # query heads of this rank
    kv_heads: range    # KV heads it holds
    ffn: range         # its columns of the MLP's intermediate dimension
    vocab: range       # its rows of the padded embedding / LM head


def _split(n: int, size: int, rank: int) -> range:
    """The rank-th of `size` contiguous parts of range(n), the first n % size parts one longer."""
    base, extra = divmod(n, size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


def shard_spec(info: ModelInfo, rank: int, size: int) -> ShardSpec:
    h, kv = info.n_heads, info.n_kv_heads
    if not 0 <= rank < size:
        raise ValueError(f"tensor-parallel rank {rank} out of range for tp_size {size}")
    if kv >= size:  # KV heads divided; each rank takes the query heads of its KV heads
        kv_heads = _split(kv, size, rank)
        group = h // kv
        heads = range(kv_heads.start * group, kv_heads.stop * group)
    else:  # fewer KV heads than ranks: each KV head replicated on size // kv ranks that split its queries
        if size % kv:
            raise ValueError(f"tp_size {size} must be a multiple of the model's {kv} KV heads when larger")
        per, group = size // kv, h // kv
        if group < per:
            raise ValueError(f"tp_size {size} exceeds the model's {h} attention heads")
        kv_head, sub = divmod(rank, per)
        kv_heads = range(kv_head, kv_head + 1)
        part = _split(group, per, sub)
        heads = range(kv_head * group + part.start, kv_head * group + part.stop)
    chunk = -(-info.vocab_size // size)
    return ShardSpec(rank, size, heads, kv_heads, _split(info.intermediate_size, size, rank),
                     range(rank * chunk, (rank + 1) * chunk))


class TensorParallel:
    """A stage rank's shard and its collectives; what the model calls at the TP boundaries."""

    def __init__(self, info: ModelInfo, where: TPGroup | None = None) -> None:
        self.where = where or TPGroup()
        self.info = info
        self.spec = shard_spec(info, self.where.rank, self.where.size)
        self.size = self.where.size

    @property
    def n_heads(self) -> int:
        return len(self.spec.heads)

    @property
    def n_kv_heads(self) -> int:
        return len(self.spec.kv_heads)

    # ------------------------------------------------------------ weights

    def shard(self, w: StageWeights) -> StageWeights:
        """Keep only this rank's part of a stage's weights (in place; the full ones are dropped)."""
        if self.size == 1:
            return w
        w.layers = [self._shard_layer(layer) for layer in w.layers]
        tied = w.lm_head is not None and w.lm_head is w.embed
        if w.embed is not None:
            w.embed = self._vocab_rows(w.embed)
        if w.lm_head is not None:
            w.lm_head = w.embed if tied else self._vocab_rows(w.lm_head)
        return w

    def _shard_layer(self, layer: dict[str, Tensor]) -> dict[str, Tensor]:
        """Column-parallel (by output rows): qkv, gate_up / up, each expert's gate_up, with their biases;
        row-parallel (by input columns): o, down, each expert's down; per head: sinks; the rest whole."""
        d, s = self.info.head_dim, self.spec
        q_rows = _rows(s.heads, d)
        kv_rows = _rows(s.kv_heads, d)
        q_size, kv_size = self.info.n_heads * d, self.info.n_kv_heads * d
        qkv_rows = torch.cat([q_rows, q_size + kv_rows, q_size + kv_size + kv_rows])
        out = dict(layer)
        out["qkv"] = layer["qkv"].index_select(0, qkv_rows)
        if "qkv_b" in layer:
            out["qkv_b"] = layer["qkv_b"].index_select(0, qkv_rows)
        out["o"] = layer["o"].index_select(1, q_rows)
        if "sinks" in layer:
            out["sinks"] = layer["sinks"][s.heads.start: s.heads.stop]
        inter = self.info.intermediate_size
        ffn = torch.arange(s.ffn.start, s.ffn.stop)
        for name, rows in (("gate_up", torch.cat([ffn, inter + ffn])), ("up", ffn)):
            if name in layer:
                out[name] = layer[name].index_select(0, rows)
                if name + "_b" in layer:
                    out[name + "_b"] = layer[name + "_b"].index_select(0, rows)
                out["down"] = layer["down"].index_select(1, ffn)
        if "experts_gate_up" in layer:   # each expert's intermediate width split like a dense MLP's
            assert self.info.moe is not None
            e_inter = self.info.moe.intermediate_size
            r = _split(e_inter, self.size, s.rank)
            part = torch.arange(r.start, r.stop)
            rows = torch.cat([part, e_inter + part])
            out["experts_gate_up"] = layer["experts_gate_up"].index_select(1, rows)
            if "experts_gate_up_b" in layer:
                out["experts_gate_up_b"] = layer["experts_gate_up_b"].index_select(1, rows)
            out["experts_down"] = layer["experts_down"].index_select(2, part)
        for name in _ROW_BIASES:
            if name in out and s.rank != 0:
                del out[name]
        return {k: v.contiguous() for k, v in out.items()}

    def _vocab_rows(self, w: Tensor) -> Tensor:
        rows = self.spec.vocab
        part = w[rows.start: min(rows.stop, w.shape[0])]
        pad = len(rows) - part.shape[0]  # the last rank's slice runs past the vocabulary: zero rows
        return torch.cat([part, part.new_zeros(pad, w.shape[1])]) if pad else part.contiguous()

    # ------------------------------------------------------------ collectives

    def reduce(self, x: Tensor) -> Tensor:
        """Sum a row-parallel projection's partial outputs over the stage's ranks."""
        if self.size > 1:
            dist.all_reduce(x, group=self.where.group)
        return x

    def embed(self, tokens: Tensor, weight: Tensor) -> Tensor:
        if self.size == 1:
            return F.embedding(tokens, weight)
        local = tokens - self.spec.vocab.start
        outside = (local < 0) | (local >= len(self.spec.vocab))
        h = F.embedding(local.masked_fill(outside, 0), weight)
        return self.reduce(h.masked_fill(outside[:, None], 0.0))

    def gather_logits(self, logits: Tensor) -> Tensor:
        """[B, vocab / size] on every rank -> [B, vocab] on every rank."""
        if self.size == 1:
            return logits
        parts = [torch.empty_like(logits) for _ in range(self.size)]
        dist.all_gather(parts, logits.contiguous(), group=self.where.group)
        return torch.cat(parts, dim=-1)[:, : self.info.vocab_size]


def _rows(heads: range, head_dim: int) -> Tensor:
    return torch.arange(heads.start * head_dim, heads.stop * head_dim)
