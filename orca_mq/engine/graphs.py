"""CUDA graphs for decode iterations, as vLLM, SGLang and nano-vllm capture them.

Launched op by op, a decode iteration of the embedded model costs 10-20 ms on an H200 for ~1 ms of
GPU work (one norm, GEMM, rotary, KV write or attention kernel after the other, each a Python call
and a launch). So a stage that runs the whole model on one GPU captures its forward at start for
batch-size buckets up to `engine.cuda_graph_max_bs` (default `scheduler.max_bs`), largest first into
one memory pool, each reading the same static input buffer laid out for the largest bucket
(orca_mq/engine/step_inputs.py). An iteration whose rows are each one token that samples is padded
to the smallest bucket that holds it and replayed; prefills and mixed iterations run eagerly.
Padding rows write K/V to the pool's scratch block only. The graph ends with the greedy step of every
row (argmax and a finite check), so a greedy decode iteration is one replay and one copy back. A
capture that fails logs one line and leaves the stage eager.

On the CPU (`engine.cuda_graphs = on`: tests) the same buckets, padding and static buffer run with
the forward called instead of replayed, so all of it but the capture is checked without a GPU.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from orca_mq.engine.attention.metadata import AttentionMetadata
from orca_mq.engine.staging import Stager
from orca_mq.engine.step_inputs import DeviceStep, HostStep, Layout, layout, metadata

Tensor = torch.Tensor
log = logging.getLogger(__name__)
# (token ids, attention metadata) -> (logits, their greedy step: sampler.greedy)
Forward = Callable[[Tensor, AttentionMetadata], tuple[Tensor, Tensor]]


def buckets(max_bs: int) -> list[int]:
    """Batch sizes to capture: dense where padding would cost most (small batches), at most ~1/8 waste above 64."""
    steps = [1, 2, 4, 8, *range(16, 65, 8), *range(80, 129, 16), *range(160, 257, 32), *range(320, 1025, 64)]
    return sorted({b for b in steps if b < max_bs} | {max_bs})


class DecodeGraphs:
    def __init__(self, forward: Forward, max_bs: int, width: int, split_decode: bool, stager: Stager,
                 block_size: int, device: torch.device) -> None:
        self.forward = forward
        self.sizes = buckets(max_bs)
        self.width = width   # block-table width the buffer holds: the model's longest sequence
        self.layout: Layout = layout(max_bs, max_bs, width, max_bs, max_bs, max_bs if split_decode else 0, 0)
        self.buf = torch.zeros(self.layout.nbytes, dtype=torch.uint8, device=device)
        self.stager = stager
        self.device = device
        self.empty = HostStep.empty(block_size, width)
        self.views: dict[int, DeviceStep] = {}    # each bucket's views of the static buffer
        whole = self.layout.device_views(self.buf)
        self.fill_dst, self.fill_src = whole["fill_dst"], whole["fill_src"]
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[Tensor, Tensor]]] = {}
        self.memory = 0           # bytes the captures took on the device
        self.capture_s = 0.0
        self.error = ""           # why capture failed (the stage runs eagerly)

    def bucket(self, rows: int) -> int | None:
        if rows > self.sizes[-1]:
            return None
        return self.sizes[int(np.searchsorted(self.sizes, rows))]

    def fits(self, step: HostStep) -> int | None:
        """The bucket that runs `step`, or None when it must run eagerly."""
        if not step.decode_only or step.width > self.width:
            return None
        return self.bucket(len(step.fields["seq_lens"]))

    def capture(self) -> bool:
        """Capture every bucket (CUDA); on the CPU only prepare the views. False: capture failed (eager)."""
        for b in self.sizes:
            self.stager.stage(self.empty, self.layout, self.buf, rows=b)
            self.views[b] = metadata(self.empty, self.layout, self.buf, rows=b)
        if self.device.type != "cuda":
            return True
        torch.cuda.synchronize(self.device)
        before, started = torch.cuda.memory_reserved(self.device), time.perf_counter()
        pool = None
        try:
            for b in reversed(self.sizes):
                dev = self.views[b]
                self.stager.stage(self.empty, self.layout, self.buf, rows=b)   # padding rows only
                side = torch.cuda.Stream(self.device)
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):   # warm-up: kernels compiled, libraries' handles made
                    self.forward(dev.token_ids, dev.meta)
                torch.cuda.current_stream(self.device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                    out = self.forward(dev.token_ids, dev.meta)
                pool = graph.pool()
                self.graphs[b] = (graph, out)
            torch.cuda.synchronize(self.device)
        except Exception as e:  # noqa: BLE001 - any capture failure: run eagerly, say so once
            self.graphs.clear()
            self.error = f"{type(e).__name__}: {str(e)[:300]}"
            log.warning("cuda graphs off, decode iterations run eagerly: %s", self.error)
            return False
        self.memory = torch.cuda.memory_reserved(self.device) - before
        self.capture_s = time.perf_counter() - started
        log.info("cuda graphs: %d buckets up to %d captured in %.1f s, %.0f MiB", len(self.sizes), self.sizes[-1],
                 self.capture_s, self.memory / 2**20)
        return True

    def run(self, step: HostStep, bucket: int, prev_tokens: Tensor | None) -> tuple[Tensor, Tensor]:
        """Logits [bucket, vocab] of the padded step and their greedy step [2, bucket] (columns past
        the step's rows are padding); from a graph, static outputs the next replay overwrites."""
        self.stager.stage(step, self.layout, self.buf, rows=bucket)
        dev = self.views[bucket]
        p = len(step.fields["fill_dst"])
        fill(dev.token_ids, self.fill_dst[:p], self.fill_src[:p], prev_tokens)
        if bucket in self.graphs:
            graph, out = self.graphs[bucket]
            graph.replay()
            return out
        return self.forward(dev.token_ids, dev.meta)


def fill(token_ids: Tensor, dst: Tensor, src: Tensor, prev_tokens: Tensor | None) -> None:
    """The placeholders of rows planned before their token came back: the previous iteration's
    sampled tokens, gathered on the device (no trip through the host)."""
    if not len(dst):
        return
    if prev_tokens is None:
        raise ValueError("rows follow an iteration whose tokens this stage does not hold")
    token_ids.index_copy_(0, dst, prev_tokens.index_select(0, src))
