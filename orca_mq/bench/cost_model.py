"""Iteration costs of a model the project cannot run here: GPT-3 175B on 16 A100s, as both papers served it.

A roofline, from the papers' own setup and the A100's data sheet, so that tools/simulate.py can drive the
served schedulers at GPU scale:

* ORCA §6 (Table 1): GPT-3 175B, 96 layers, hidden 12,288, fp16, 2 inter-layer (pipeline) partitions of
  8 intra-layer (tensor) partitions: 16 A100-40GB (FastServe §6.1: the same model on two 8-GPU nodes).
* A100-40GB: 1,555 GB/s HBM2, 312 TFLOP/s fp16 tensor cores. We assume 60 % of each is reached
  (`MEM_EFF`, `FLOP_EFF`: an assumption, not a figure of either paper).

An iteration runs its stages one after the other (ORCA's Fig. 9c disables pipelining the same way; the
simulator models one stage): per stage, the time is the larger of reading the stage's weights once and its
GEMM FLOPs (2 per weight per token), plus reading the batch's KV cache (attention is memory-bound).
"""
from __future__ import annotations

from orca_mq.sched.profiler import IterationProfile

PARAMS = 175e9
LAYERS, HIDDEN = 96, 12288
BYTES = 2                      # fp16
STAGES, TP = 2, 8
HBM_BYTES_S, FLOPS = 1.555e12, 312e12
MEM_EFF, FLOP_EFF = 0.6, 0.6
KV_BYTES_PER_TOKEN = 2 * LAYERS * HIDDEN * BYTES   # K and V, every layer: 4.7 MB


def iteration_s(tokens: int, context_tokens: int) -> float:
    """One iteration feeding `tokens` tokens whose attention reads `context_tokens` tokens of KV in all."""
    per_stage_weights = PARAMS * BYTES / STAGES / TP
    read = per_stage_weights / (HBM_BYTES_S * MEM_EFF)
    compute = 2 * PARAMS / STAGES / TP * tokens / (FLOPS * FLOP_EFF)
    kv = KV_BYTES_PER_TOKEN / STAGES / TP * context_tokens / (HBM_BYTES_S * MEM_EFF)
    return STAGES * (max(read, compute) + kv)


def gpt3_175b_profile(mean_context: int = 320) -> IterationProfile:
    """The profile FastServe's scheduler and the simulator use: an initiation of n prompt tokens, and an
    increment iteration of b requests each reading `mean_context` tokens of KV (the ORCA trace's mean)."""
    initiation = [(n, iteration_s(n, n)) for n in (1, 32, 128, 512, 2048, 8192)]
    increment = [(b, iteration_s(b, b * mean_context)) for b in (1, 8, 32, 128, 256)]
    return IterationProfile(initiation, increment)
