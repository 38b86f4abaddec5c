"""What the model is (ModelInfo): its shape and every option by which its family differs from Llama,
read once from a checkpoint (models/registry.py) and shared by every process.

Torch-free plain data: the frontend and the scheduler size and validate requests with it, and a
GGUF's is cached as JSON. The layer code (models/decoder.py) reads its options, never the family's
name: a family is a set of options, not a fork of the iteration.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from orca_mq.config import Config

LayerKind = Literal["full", "sliding"]
Norm = Literal["rms", "layer"]            # RMSNorm (Gemma's 1 + w folded into w at load) | LayerNorm with bias (GPT-2)
Act = Literal["silu", "gelu_tanh", "swiglu_oss"]   # gated MLPs: SwiGLU, GeGLU, gpt-oss' clamped SwiGLU; GPT-2: gelu_tanh
Scoring = Literal["softmax_topk", "topk_softmax"]  # MoE routers: softmax then top-k (Mixtral, Qwen3) | top-k then softmax (gpt-oss)


@dataclass(slots=True)
class RopeSpec:
    """Rotary position embedding: `kind` as transformers names it ("none": learned positions, GPT-2)."""

    kind: str = "default"          # default | linear | dynamic | llama3 | yarn | longrope | none
    theta: float = 10000.0
    params: dict[str, Any] = field(default_factory=dict)   # the scaling's own parameters, as the checkpoint names them

    @property
    def by_length(self) -> bool:
        """Its tables depend on the sequence's length as well as the position (transformers recomputes them
        per forward from the longest position in it)."""
        return self.kind in ("dynamic", "longrope")


@dataclass(slots=True)
class MoESpec:
    n_experts: int
    top_k: int
    intermediate_size: int         # each expert's
    scoring: Scoring = "softmax_topk"
    renormalize: bool = True       # the top-k weights divided by their sum
    sparse_layers: list[int] | None = None   # the layers with experts (None: all; Qwen3-MoE may keep dense ones)
    bias: bool = False             # router and expert biases (gpt-oss)


@dataclass(slots=True)
class ModelInfo:
    path: str
    arch: str                      # the family (models/registry.py)
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    intermediate_size: int
    norm_eps: float
    context_length: int
    head_dim: int = 0              # 0: hidden_size // n_heads
    rope: RopeSpec = field(default_factory=RopeSpec)
    rope_local: RopeSpec | None = None   # the sliding layers' own rotary (Gemma 3), else theirs is `rope`
    rotary_dim: int = 0            # dims of a head that rotate (0: all; Phi's partial rotary)
    layer_kinds: list[str] = field(default_factory=list)   # "full" | "sliding" per layer ([]: all full)
    sliding_window: int = 0        # a query at position p sees keys at p - window < k <= p on sliding layers
    tie_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    norm: Norm = "rms"
    sandwich_norms: bool = False   # a norm after attention and after the MLP too (Gemma 2 / 3)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False          # RMSNorm of each q and k head before rotary (Qwen3, Gemma 3)
    act: Act = "silu"
    gated_mlp: bool = True         # act(gate) * up (False: GPT-2's act(up))
    swiglu_limit: float = 0.0      # swiglu_oss: gate <= limit, |up| <= limit
    swiglu_alpha: float = 1.702
    attn_scale: float = 0.0        # 0: head_dim ** -0.5
    attn_softcap: float = 0.0      # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_softcap: float = 0.0     # the same on the logits
    embed_scale: float = 1.0       # embeddings times this (Gemma: sqrt(hidden))
    sinks: bool = False            # a learned logit per head in each softmax's denominator (gpt-oss)
    moe: MoESpec | None = None

    def __post_init__(self) -> None:
        if not self.head_dim:
            self.head_dim = self.hidden_size // self.n_heads

    # ------------------------------------------------------------ layers

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding window (0: it attends to the whole context)."""
        return self.sliding_window if self.layer_kinds and self.layer_kinds[layer] == "sliding" else 0

    @property
    def kv_window(self) -> int:
        """The window when every layer slides (a request's blocks that left it can go back), else 0."""
        kinds = self.layer_kinds
        return self.sliding_window if kinds and all(k == "sliding" for k in kinds) else 0

    def is_moe(self, layer: int) -> bool:
        return self.moe is not None and (self.moe.sparse_layers is None or layer in self.moe.sparse_layers)

    @property
    def scale(self) -> float:
        return self.attn_scale or self.head_dim ** -0.5

    # ------------------------------------------------------------ sizes

    def max_model_len(self, cfg: "Config") -> int:
        return min(cfg.model.max_model_len, self.context_length)

    def layer_params(self, layer: int) -> int:
        """Parameters a token goes through in one layer (a mixture of experts: the active ones)."""
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (2 * self.n_heads + 2 * self.n_kv_heads)
        if self.is_moe(layer):
            assert self.moe is not None
            return attn + 3 * h * self.moe.intermediate_size * self.moe.top_k + h * self.moe.n_experts
        return attn + 3 * h * self.intermediate_size

    def stage_layers(self, stage: int, n_stages: int) -> range:
        """Contiguous inter-layer partition balancing work per stage. The last stage also runs the LM
        head (vocab x hidden per request and iteration), counted as layers' worth of parameters at
        half weight: a middle ground between decode-heavy iterations (head ~ every token) and
        prefill-heavy ones (head on one token of many)."""
        if not 1 <= n_stages <= self.n_layers:
            raise ValueError(f"n_workers={n_stages} must be between 1 and the model's {self.n_layers} layers")
        mean = sum(self.layer_params(i) for i in range(self.n_layers)) / self.n_layers
        head = 0.5 * self.vocab_size * self.hidden_size / mean
        per_stage = (self.n_layers + head) / n_stages
        bounds = [min(self.n_layers - (n_stages - s), max(s, round(s * per_stage))) for s in range(n_stages)]
        bounds.append(self.n_layers)
        return range(bounds[stage], bounds[stage + 1])

    # ------------------------------------------------------------ JSON (the GGUF metadata cache)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "ModelInfo":
        d = dict(d)
        d["rope"] = RopeSpec(**d["rope"])
        if d.get("rope_local") is not None:
            d["rope_local"] = RopeSpec(**d["rope_local"])
        if d.get("moe") is not None:
            d["moe"] = MoESpec(**d["moe"])
        return cls(**d)
