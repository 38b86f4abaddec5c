"""CUDA graphs for iterations, as vLLM, SGLang and nano-vllm capture them.

Launched op by op, an iteration of the embedded model costs ~9 ms on an H200 for 1-2 ms of GPU work
(a norm, GEMM, rotary, attention or activation kernel after the other, each a Python call and a
launch). So a stage that runs the whole model on one GPU captures its forward at start, into one
memory pool, for two families of buckets, each reading the same static input buffer laid out for
the largest (orca_mq/engine/step_inputs.py):
- decode: batch sizes up to `engine.cuda_graph_max_bs` (default `scheduler.max_bs`), an iteration of
  one-token rows that all sample padded to the smallest that holds it;
- mixed (prompt chunks beside decodes, the steady state of a server whose requests come and go):
  token counts up to the token budget, every ~256 tokens (512 past 2,048), with room for max_bs rows
  and the padding tokens. The attention kernel reads every row's extent from the device, so one
  graph serves any mix of rows of that many tokens.
Padding tokens are one-token rows on the pool's scratch block. Prefills beyond the budget, and
backends that walk prompts on the host (torch, cpu), run eagerly. Every graph ends with the greedy
step of its rows (argmax and a finite check), written with the logits into buffers all graphs share:
a greedy iteration is one replay and one copy back. A capture that fails logs one line and leaves
the stage eager.

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
from orca_mq.engine.step_inputs import Bucket, DeviceStep, HostStep, Layout, layout, metadata

Tensor = torch.Tensor
log = logging.getLogger(__name__)
# (token ids, attention metadata) -> (logits, their greedy step: sampler.greedy)
Forward = Callable[[Tensor, AttentionMetadata], tuple[Tensor, Tensor]]
MIXED_STEP = 512   # mixed token buckets past 2,048 tokens: padding costs at most a fifth of an iteration


def buckets(max_bs: int) -> list[int]:
    """Batch sizes to capture: dense where padding would cost most (small batches), at most ~1/8 waste above 64."""
    steps = [1, 2, 4, 8, *range(16, 65, 8), *range(80, 129, 16), *range(160, 257, 32), *range(320, 1025, 64)]
    return sorted({b for b in steps if b < max_bs} | {max_bs})


def token_buckets(budget: int) -> list[int]:
    """Token counts of mixed iterations to capture, up to the token budget (none without one)."""
    steps = [*range(256, 2049, 256), *range(2560, budget + 1, MIXED_STEP)]
    return sorted({t for t in steps if t < budget} | ({budget} if budget else set()))


class Graphs:
    def __init__(self, forward: Forward, max_bs: int, budget: int, width: int, split_decode: bool, token_rows: bool,
                 stager: Stager, block_size: int, vocab: int, dtype: torch.dtype, device: torch.device) -> None:
        self.forward = forward
        self.max_bs = max_bs
        # deterministic mode: every token is its own attention row, attended by one-token tiles in
        # every iteration (a row's bits must not depend on its iteration's shape)
        self.mixed_tiles = token_rows
        self.sizes = buckets(max_bs)
        # mixed iterations hold prompt chunks, which the torch and cpu paths attend on the host
        self.token_sizes = [] if split_decode else token_buckets(budget)
        self.width = width   # block-table width the buffer holds: the model's longest sequence
        # a mixed bucket pads fewer tokens (each a row) than the step up to it, and B <= T: its rows fit this
        self.mixed_rows = max_bs + int(np.diff([0, *self.token_sizes]).max(initial=0))
        tokens = max([max_bs, *self.token_sizes])
        self.layout: Layout = layout(tokens, self.mixed_rows, width, max_bs, max_bs, max_bs if split_decode else 0, 0)
        self.buf = torch.zeros(self.layout.nbytes, dtype=torch.uint8, device=device)
        whole = self.layout.device_views(self.buf)
        self.fill_dst, self.fill_src = whole["fill_dst"], whole["fill_src"]
        self.stager = stager
        self.device = device
        self.empty = HostStep.empty(block_size, width)
        self.block_size, self.scratch_block = block_size, stager.scratch_block
        self.views: dict[Bucket, DeviceStep] = {}
        self.graphs: dict[Bucket, torch.cuda.CUDAGraph] = {}
        self.out = (torch.empty(max_bs, vocab, dtype=dtype, device=device),
                    torch.empty(2, max_bs, dtype=torch.int64, device=device))
        self.memory = 0           # bytes the captures took on the device
        self.capture_s = 0.0
        self.error = ""           # why capture failed (the stage runs eagerly)

    @property
    def all(self) -> list[Bucket]:
        return ([Bucket(b, b, b, True) for b in self.sizes]
                + [Bucket(t, self.mixed_rows, self.max_bs, self.mixed_tiles) for t in self.token_sizes])

    def fits(self, step: HostStep) -> Bucket | None:
        """The bucket that runs `step`, or None when it must run eagerly."""
        f = step.fields
        t, b = len(f["token_ids"]), len(f["seq_lens"])
        if step.width > self.width or b > self.max_bs:
            return None
        if step.decode_only:
            n = self.sizes[int(np.searchsorted(self.sizes, b))]
            return Bucket(n, n, n, True)
        if self.token_sizes and t <= self.token_sizes[-1] and len(f["logit_rows"]) <= self.max_bs:   # verify rows: a logit each
            n = self.token_sizes[int(np.searchsorted(self.token_sizes, t))]
            return Bucket(n, self.mixed_rows, self.max_bs, self.mixed_tiles)
        return None

    def _placeholder(self, bucket: Bucket) -> HostStep:
        """What a bucket is captured on: its padding alone, or (a mixed bucket of more tokens than
        rows) its tokens spread over its rows, all on the scratch block."""
        if bucket.tokens <= bucket.rows:
            return self.empty
        return HostStep.filler(bucket.tokens, bucket.rows, self.block_size, self.width, self.scratch_block)

    def capture(self) -> bool:
        """Capture every bucket (CUDA); on the CPU only prepare the views. False: capture failed (eager)."""
        for bucket in self.all:
            self.stager.stage(self._placeholder(bucket), self.layout, self.buf, bucket)
            self.views[bucket] = metadata(self.empty, self.layout, self.buf, bucket)
        if self.device.type != "cuda":
            return True
        torch.cuda.synchronize(self.device)
        before, started = torch.cuda.memory_reserved(self.device), time.perf_counter()
        pool = None
        try:
            for bucket in sorted(self.all, key=lambda k: -k.tokens):   # largest first: the pool grows once
                dev = self.views[bucket]
                self.stager.stage(self._placeholder(bucket), self.layout, self.buf, bucket)
                side = torch.cuda.Stream(self.device)
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):   # warm-up: kernels compiled, libraries' handles made
                    self._step(bucket, dev)
                torch.cuda.current_stream(self.device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                    self._step(bucket, dev)
                pool = graph.pool()
                self.graphs[bucket] = graph
            torch.cuda.synchronize(self.device)
        except Exception as e:  # noqa: BLE001 - any capture failure: run eagerly, say so once
            self.graphs.clear()
            self.error = f"{type(e).__name__}: {str(e)[:300]}"
            log.warning("cuda graphs off, iterations run eagerly: %s", self.error)
            return False
        self.memory = torch.cuda.memory_reserved(self.device) - before
        self.capture_s = time.perf_counter() - started
        log.info("cuda graphs: %d decode buckets up to %d, %d mixed up to %d tokens, captured in %.1f s, %.0f MiB",
                 len(self.sizes), self.sizes[-1], len(self.token_sizes), max(self.token_sizes, default=0),
                 self.capture_s, self.memory / 2**20)
        return True

    def _step(self, bucket: Bucket, dev: DeviceStep) -> None:
        """The captured work: the forward and its greedy step, into the shared outputs."""
        logits, first = self.forward(dev.token_ids, dev.meta)
        self.out[0][:bucket.logits].copy_(logits)
        self.out[1][:, :bucket.logits].copy_(first)

    def run(self, step: HostStep, bucket: Bucket, prev_tokens: Tensor | None) -> tuple[Tensor, Tensor]:
        """Logits [bucket.logits, vocab] of the padded step and their greedy step [2, bucket.logits]
        (rows past the step's are padding); from a graph, shared outputs the next replay overwrites."""
        self.stager.stage(step, self.layout, self.buf, bucket)
        p = len(step.fields["fill_dst"])
        dev = self.views[bucket]
        fill(dev.token_ids, self.fill_dst[:p], self.fill_src[:p], prev_tokens)
        if (graph := self.graphs.get(bucket)) is not None:
            graph.replay()
            return self.out[0][:bucket.logits], self.out[1][:, :bucket.logits]
        return self.forward(dev.token_ids, metadata(step, self.layout, self.buf, bucket).meta)


def fill(token_ids: Tensor, dst: Tensor, src: Tensor, prev_tokens: Tensor | None) -> None:
    """The placeholders of rows planned before their token came back: the previous iteration's
    sampled tokens, gathered on the device (no trip through the host)."""
    if not len(dst):
        return
    if prev_tokens is None:
        raise ValueError("rows follow an iteration whose tokens this stage does not hold")
    token_ids.index_copy_(0, dst, prev_tokens.index_select(0, src))
