"""Speculative decoding served (tools/bench_spec.py, issue 35): two servers, speculation off and on
(`speculative.method = ngram`), take the same greedy chat requests round by round, interleaved.

Workloads: `copy` asks to correct, rewrite or extract a paragraph (spec_texts.PARAGRAPHS, misspelt
by a seeded hand); `open` asks open-ended questions with nothing to copy, with the same max_tokens.
Scenarios: `alone_copy` sends copy requests one at a time (each after the last finished), the latency
case; `burst_copy` and `burst_open` send all at once. Each run records its makespan, the scheduler's
speculation counters (a stats delta) and each request's final metrics.

Tokens per decode step (alone only, where a request's prompt iterations are known): generated tokens
after the first / the iterations a request ran after its prompt's, i.e. its `iterations` metric less
ceil(uncached prompt tokens / scheduler.max_num_batched_tokens). Off, it is 1 by construction.
"""
from __future__ import annotations

import asyncio
import math
import random
import re
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any, Callable

from orca_mq.bench.bench_server import Server
from orca_mq.bench.spec_texts import COPY_TASKS, OPEN_PROMPTS, PARAGRAPHS
from orca_mq.client import AsyncClient
from orca_mq.config import Config

SIDES = ("off", "on")
SCENARIOS = {"alone_copy": ("copy", False), "burst_copy": ("copy", True), "burst_open": ("open", True)}
TARGETS = {"alone_copy": 0.6, "burst_copy": 1.05, "burst_open": 1.05}   # makespan on/off at most (issue 35)
TARGET_TOKENS_PER_STEP = 1.8                                            # alone_copy, speculation on
VOWELS = "aeiou"
SPEC_KEYS = ("spec_drafts", "spec_draft_tokens", "spec_accepted_tokens")


@dataclass(frozen=True, slots=True)
class Setup:
    requests: int = 16
    rounds: int = 3
    model: str = ""                # "" = the embedded SmolLM2-135M-Instruct
    dtype: str = "auto"
    seed: int = 0
    words: int = 0                 # paragraphs cut to their first `words` words (0: whole)
    max_tokens_cap: int = 256
    misspell_rate: float = 0.12    # share of words of 4+ letters given one typo
    sets: tuple[str, ...] = ()     # more section.key=value for both servers


@dataclass(frozen=True, slots=True)
class Job:
    kind: str                       # copy | open
    prompt: str
    max_tokens: int


WARM_UP = Job("copy", "Repeat this sentence twice: the quick brown fox jumps over the lazy dog.", 16)


def misspell(text: str, rng: random.Random, rate: float) -> str:
    """One typo (swap, drop, double or a wrong vowel) in about `rate` of the words of 4+ letters."""
    def typo(m: re.Match[str]) -> str:
        w = m.group(0)
        if len(w) < 4 or rng.random() >= rate:
            return w
        i = rng.randrange(1, len(w) - 2)          # inside the word: its first and last letters stay
        op = rng.randrange(4)
        if op == 0:
            return w[:i] + w[i + 1] + w[i] + w[i + 2:]
        if op == 1:
            return w[:i] + w[i + 1:]
        if op == 2:
            return w[:i] + w[i] + w[i:]
        vowels = [j for j in range(1, len(w) - 1) if w[j] in VOWELS]
        if not vowels:
            return w[:i] + w[i + 1] + w[i] + w[i + 2:]
        j = rng.choice(vowels)
        return w[:j] + rng.choice(VOWELS.replace(w[j], "")) + w[j + 1:]
    return re.sub(r"[A-Za-z]+", typo, text)


def workloads(setup: Setup, n_tokens: Callable[[str], int], variant: int = 0) -> dict[str, list[Job]]:
    """`requests` copy jobs (paragraph i, task i mod tasks) and as many open ones with the same max_tokens:
    1.3x the clean paragraph's tokens (what a corrected copy needs), capped. Each `variant` misspells
    anew, so that a run's paragraphs are not in the prefix cache from an earlier run."""
    rng = random.Random(f"{setup.seed}/{variant}")
    copy, open_ = [], []
    for i in range(setup.requests):
        text = PARAGRAPHS[i % len(PARAGRAPHS)]
        if setup.words:
            text = " ".join(text.split()[:setup.words])
        max_tokens = min(setup.max_tokens_cap, math.ceil(1.3 * n_tokens(text)))
        task = COPY_TASKS[i % len(COPY_TASKS)]
        copy.append(Job("copy", task.format(text=misspell(text, rng, setup.misspell_rate)), max_tokens))
        open_.append(Job("open", OPEN_PROMPTS[i % len(OPEN_PROMPTS)], max_tokens))
    return {"copy": copy, "open": open_}


def spec_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The scheduler's speculation counters over a run (empty with speculation off)."""
    if "spec_drafts" not in after:
        return {}
    out: dict[str, Any] = {k: after[k] - before[k] for k in SPEC_KEYS}
    pos = zip(after["spec_accepted_per_pos"], before["spec_accepted_per_pos"])
    out["spec_accepted_per_pos"] = [a - b for a, b in pos]
    return out


async def run_once(address: str, jobs: list[Job], burst: bool, budget: int) -> dict[str, Any]:
    """One scenario on one server: makespan, per-request metrics, outputs, the counters' delta."""
    async with AsyncClient(address) as client:
        before = (await client.stats())["scheduler"]
        send = [client.generate(messages=[{"role": "user", "content": j.prompt}], chat=True, max_tokens=j.max_tokens,
                                temperature=0.0) for j in jobs]
        start = time.perf_counter()
        outs = list(await asyncio.gather(*send)) if burst else [await s for s in send]
        makespan = time.perf_counter() - start
        after = (await client.stats())["scheduler"]
    bad = [(o.finish_reason, o.error) for o in outs if o.finish_reason not in ("stop", "length")]
    if bad:
        raise RuntimeError(f"requests failed: {bad[:3]}")
    rows = []
    for o in outs:
        m, s = o.metrics or {}, (o.metrics or {}).get("scheduler", {})
        fed = max(1, m["prompt_tokens"] - s["cached_tokens"])   # a fully cached prompt still feeds its last token
        rows.append({"prompt_tokens": m["prompt_tokens"], "completion_tokens": m["completion_tokens"],
                     "finish_reason": o.finish_reason, "cached_tokens": s["cached_tokens"],
                     "iterations": s["iterations"],
                     "prompt_iterations": math.ceil(fed / budget) if budget else 1,
                     **{k: s[k] for k in SPEC_KEYS if k in s}})
    gen = sum(r["completion_tokens"] for r in rows)
    run = {"makespan_s": makespan, "generated_tokens": gen, "tokens_per_s": gen / makespan,
           "spec": spec_delta(before, after), "requests": rows, "outputs": [o.token_ids for o in outs]}
    if not burst:   # alone, a request's prompt iterations are its uncached prompt over the token budget
        steps = sum(r["iterations"] - r["prompt_iterations"] for r in rows)
        run["decode_steps"] = steps
        run["tokens_per_step"] = sum(r["completion_tokens"] - 1 for r in rows) / max(1, steps)
    return run


@dataclass(slots=True)
class Result:
    setup: dict[str, Any]
    rounds: list[dict[str, dict[str, Any]]] = field(default_factory=list)   # [round][scenario][side]

    def summary(self) -> dict[str, Any]:
        out = {}
        for name in SCENARIOS:
            runs = {side: [r[name][side] for r in self.rounds] for side in SIDES}
            ratios = [on["makespan_s"] / off["makespan_s"] for off, on in zip(runs["off"], runs["on"])]
            spec = [run["spec"] for run in runs["on"]]
            drafted, accepted = sum(s["spec_draft_tokens"] for s in spec), sum(s["spec_accepted_tokens"] for s in spec)
            row = {"makespan_s": {side: statistics.median(run["makespan_s"] for run in runs[side]) for side in SIDES},
                   "ratios": ratios, "ratio": statistics.median(ratios), "target_ratio": TARGETS[name],
                   "outputs_differ": sum(a != b for off, on in zip(runs["off"], runs["on"])
                                         for a, b in zip(off["outputs"], on["outputs"])),
                   "spec_drafts": sum(s["spec_drafts"] for s in spec), "spec_draft_tokens": drafted,
                   "spec_accepted_tokens": accepted, "acceptance": accepted / drafted if drafted else None,
                   "spec_accepted_per_pos": [sum(col) for col in zip(*(s["spec_accepted_per_pos"] for s in spec))]}
            row["meets_ratio"] = row["ratio"] <= TARGETS[name]
            if "tokens_per_step" in runs["on"][0]:
                row["tokens_per_step"] = {side: statistics.median(run["tokens_per_step"] for run in runs[side])
                                          for side in SIDES}
                row["meets_tokens_per_step"] = row["tokens_per_step"]["on"] >= TARGET_TOKENS_PER_STEP
            out[name] = row
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"setup": self.setup, "summary": self.summary(),
                "rounds": [{n: {side: {k: v for k, v in run.items() if k != "outputs"} for side, run in sc.items()}
                            for n, sc in r.items()} for r in self.rounds]}


def run(setup: Setup, log: Callable[[str], None] = partial(print, flush=True)) -> Result:
    """Both servers up side by side (their own free ports, no HTTP), warmed up; then per round each
    scenario on both, the side that goes first alternating round by round."""
    from orca_mq.engine.dtype import resolve_dtype
    from orca_mq.tokenizer import load_tokenizer

    cfg = Config()
    sets = {"model.path": setup.model, "model.dtype": setup.dtype, **dict(s.split("=", 1) for s in setup.sets)}
    for k, v in sets.items():
        cfg.set(k, v)
    tok = load_tokenizer(cfg.model.path, cfg.model.cache_dir)

    def n_tokens(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False))

    budget = cfg.scheduler.max_num_batched_tokens
    result = Result({**asdict(setup), "dtype_resolved": resolve_dtype(cfg.model.dtype, cfg.engine.device),
                     "max_tokens": [j.max_tokens for j in workloads(setup, n_tokens)["copy"]]})
    extra = {side: [f"{k}={v}" for k, v in {**sets, "speculative.method": "off" if side == "off" else "ngram"}.items()]
             for side in SIDES}
    boxes = {side: Server(cfg.engine.n_workers, cfg.engine.threads_per_worker, cfg.scheduler.max_bs, extra[side])
             for side in SIDES}
    with ExitStack() as stack:
        with ThreadPoolExecutor(len(boxes)) as pool:   # both start at once: start-up is most of a small run
            started = {side: pool.submit(box.__enter__) for side, box in boxes.items()}
        for side, fut in started.items():
            if fut.exception() is None:
                stack.push(boxes[side].__exit__)
        servers = {side: fut.result().address for side, fut in started.items()}
        for address in servers.values():   # compiles, allocates, and runs a verify row on the 'on' one
            asyncio.run(run_once(address, [WARM_UP], False, budget))
        for r in range(setup.rounds):
            result.rounds.append({})
            for i, (name, (kind, burst)) in enumerate(SCENARIOS.items()):
                jobs = workloads(setup, n_tokens, r * len(SCENARIOS) + i)[kind]   # the same for both sides
                result.rounds[-1][name] = {}
                for side in SIDES if r % 2 == 0 else SIDES[::-1]:
                    one = result.rounds[-1][name][side] = asyncio.run(run_once(servers[side], jobs, burst, budget))
                    step = f", {one['tokens_per_step']:.2f} tokens/step" if "tokens_per_step" in one else ""
                    log(f"round {r} {name:11} {side:3}: {one['makespan_s']:.2f} s, "
                        f"{one['generated_tokens']} tokens{step}")
    return result


def table(summary: dict[str, Any]) -> str:
    lines = [f"{'scenario':12} {'off s':>8} {'on s':>8} {'on/off':>7} {'target':>7} {'tok/step':>9} {'drafts':>7} "
             f"{'drafted':>8} {'accepted':>9} {'accept':>7} {'differ':>6}"]
    for name, s in summary.items():
        tps = f"{s['tokens_per_step']['on']:.2f}" if "tokens_per_step" in s else "-"
        acc = f"{s['acceptance']:.0%}" if s["acceptance"] is not None else "-"
        lines.append(f"{name:12} {s['makespan_s']['off']:>8.2f} {s['makespan_s']['on']:>8.2f} {s['ratio']:>7.2f} "
                     f"{'<=' + str(s['target_ratio']):>7} {tps:>9} {s['spec_drafts']:>7} {s['spec_draft_tokens']:>8} "
                     f"{s['spec_accepted_tokens']:>9} {acc:>7} {s['outputs_differ']:>6}")
    lines.append("accepted per draft position (all rounds): "
                 + "; ".join(f"{n} {s['spec_accepted_per_pos']}" for n, s in summary.items()))
    lines.append(f"targets: alone_copy on/off <= {TARGETS['alone_copy']} and >= {TARGET_TOKENS_PER_STEP} tokens per "
                 f"decode step; bursts on/off <= {TARGETS['burst_copy']}. differ: requests whose greedy output changed")
    return "\n".join(lines)
