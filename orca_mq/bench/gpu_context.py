"""What every section of tools/gpu_check.py shares: its sizes (the GPU's, or --small for a CPU
plumbing run), and `Ctx`, which emits result rows and builds runners, LLMs and references."""
from __future__ import annotations

import contextlib
import json
import random
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# what a section started in sessions of their own (a server): stopped when the run kills it at its budget
CLEANUP: list[Callable[[], None]] = []
RUNNER_SLOTS = 16384   # a runner's KV pool unless its section says (engine.n_slots = 0 would take most of the card)


@dataclass(frozen=True)
class Sizes:
    exact_prefills: tuple[int, ...] = (1, 7, 33, 70, 300)
    exact_decodes: tuple[int, ...] = (2, 9, 16, 17, 100, 513)
    graph_decodes: int = 13                  # a batch between CUDA-graph buckets: padded rows in play
    decode_batches: tuple[int, ...] = (1, 32, 128, 256)
    ctx: int = 256
    prefills: tuple[int, ...] = (512, 2048)
    mixed: tuple[int, int] = (1792, 256)     # a prompt chunk + that many decodes
    launches_batch: int = 32
    repeat: int = 10
    iter_slots: int = 80_000
    offline: tuple[int, int, int, int] = (512, 64, 512, 128)   # requests, prompt min, max, generated each
    offline_budget: int = 8192
    offline_bs: int = 512
    offline_slots: int = 400_000
    served_n: int = 256
    served_warm_n: int = 64
    served_in: tuple[int, int] = (32, 512)
    served_out: tuple[int, int] = (1, 256)
    served_bs: int = 128
    served_budget: int = 2048
    served_slots: int = 131_072   # max_bs requests at the longest prompt + output
    det: tuple[int, int, int] = (8, 24, 24)  # targets, fillers, tokens
    det_len: tuple[int, int] = (300, 600)    # longest target, filler prompt
    fs_n: int = 96
    fs_len: tuple[int, int, int] = (32, 400, 96)   # prompt min, max, longest output
    fs_slots: tuple[int, int] = (65_536, 4096)     # orca (room for all), fastserve (too small)
    host_slots: int = 65_536


SMALL = Sizes(exact_prefills=(1, 7, 33), exact_decodes=(2, 9, 40), graph_decodes=3, decode_batches=(1, 4), ctx=32,
              prefills=(64,), mixed=(48, 4), launches_batch=4, repeat=3, iter_slots=2048, offline=(16, 16, 64, 8),
              offline_budget=256, offline_bs=16, offline_slots=4096, served_n=16, served_warm_n=4, served_in=(16, 64),
              served_out=(1, 16), served_bs=8, served_budget=256, served_slots=4096, det=(4, 8, 8), det_len=(40, 80),
              fs_n=8, fs_len=(16, 64, 32), fs_slots=(4096, 256), host_slots=8192)


def one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return f"{type(e).__name__}: {text[:300]}"


class Ctx:
    def __init__(self, section: str, work: Path, small: bool) -> None:
        self.section, self.work, self.small = section, work, small
        self.sizes = SMALL if small else Sizes()
        self.cuda = torch.cuda.is_available()
        self.device = "cuda" if self.cuda else "cpu"
        self.fast_dtype = "bfloat16" if self.cuda else "float32"   # the speed sections' dtype (bf16 on the GPU)
        self.models = work / "models"

    def emit(self, figure: str | None = None, value: Any = None, *, unit: str = "", target: str | None = None,
             met: bool | None = None, shown: str | None = None, how: str = "", **detail: Any) -> None:
        row = {"section": self.section, **({"figure": figure} if figure else {}), "value": value, "unit": unit,
               "target": target, "met": met, "shown": shown, "how": how, **detail}
        print(json.dumps({k: v for k, v in row.items() if v is not None and v != ""}, default=str), flush=True)

    @contextlib.contextmanager
    def attempt(self, what: str, on_cpu_unavailable: bool = False) -> Iterator[None]:
        """A sub-check whose failure is a row, not the end of the section. `on_cpu_unavailable`: on the
        CPU a failure means the feature is CUDA-only (shown, not failed)."""
        try:
            yield
        except Exception as e:   # noqa: BLE001
            if on_cpu_unavailable and not self.cuda:
                self.emit(f"{what}: not on the CPU", shown=one_line(e)[:120])
            else:
                self.emit(f"{what}: error", shown=one_line(e)[:160], met=False, error=one_line(e),
                          traceback=traceback.format_exc()[-2500:])

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def timed_ms(self, fn: Callable[[], object], repeat: int | None = None) -> float:
        """Median ms of `fn` (with a CUDA synchronize) after two untimed calls (compiles, captures)."""
        from orca_mq.bench.timing import median_time

        fn()
        return median_time(lambda: (fn(), self.sync()), repeat or self.sizes.repeat) * 1e3

    def runner(self, model: str, dtype: str, **sets: Any) -> Any:
        from orca_mq.config import load_config
        from orca_mq.engine.model_runner import ModelRunner

        over = {"model.path": str(self.models / model), "engine.block_size": 16, "engine.device": self.device,
                "model.dtype": dtype, "engine.n_slots": RUNNER_SLOTS,
                **{k.replace("__", "."): v for k, v in sets.items() if v is not None}}
        return ModelRunner(load_config(overrides=over))

    def llm(self, model: str, **kw: Any) -> Any:
        from orca_mq import LLM

        return LLM(model=str(self.models / model), device=self.device, **kw)

    def hf(self, model: str, dtype: torch.dtype) -> Any:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(self.models / model, dtype=dtype).to(self.device).eval()


def random_prompts(rng: random.Random, n: int, lo: int, hi: int) -> list[list[int]]:
    return [[rng.randrange(100, 40000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
