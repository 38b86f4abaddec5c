"""Reduced precision vs float32 on the same model: weight memory, greedy agreement, perplexity.

For each dtype (default: float32 and bfloat16) one ModelRunner, then:
* weight memory (bytes of the loaded weights, a tied head counted once);
* greedy agreement: float32 greedily continues each fixed prompt; every other dtype is teacher-forced
  on that continuation and its argmax compared token by token (free-running agreement, which one
  early flip derails, is reported too);
* perplexity of a fixed text, all positions' logits from one prefill.
Prints a table and writes JSON.

    python tools/bench_dtype.py --out results/bench_dtype.json [--dtypes float32,bfloat16] [--tokens 48]
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from orca_mq.bench.plans import block_tables
from orca_mq.bench.weights import weight_bytes
from orca_mq.config import load_config
from orca_mq.engine.step_inputs import build, metadata
from orca_mq.engine.model_runner import ModelRunner
from orca_mq.protocol.iteration import IterationPlan, SeqWork, pack
from orca_mq.tokenizer import load_tokenizer

PROMPTS = [
    "The capital of France is", "Write a short poem about the sea.", "def fibonacci(n):",
    "Explain why the sky is blue in two sentences.", "List three uses of a paperclip:",
    "Once upon a time, in a small village,", "The main causes of the French Revolution were",
    "Translate to German: The weather is nice today.", "Q: What is 17 times 3?\nA:",
    "A recipe for pancakes needs", "The three laws of thermodynamics state that",
    "In Python, a list comprehension is",
]
TEXT = (  # public domain: the opening of Jane Austen's Pride and Prejudice (1813)
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in "
    "want of a wife. However little known the feelings or views of such a man may be on his first entering a "
    "neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he is considered "
    "the rightful property of some one or other of their daughters. \"My dear Mr. Bennet,\" said his lady to him "
    "one day, \"have you heard that Netherfield Park is let at last?\" Mr. Bennet replied that he had not. \"But "
    "it is,\" returned she; \"for Mrs. Long has just been here, and she told me all about it.\" Mr. Bennet made "
    "no answer. \"Do you not want to know who has taken it?\" cried his wife impatiently. \"You want to tell me, "
    "and I have no objection to hearing it.\" This was invitation enough."
)


def all_logits(runner: ModelRunner, tokens: list[int]) -> torch.Tensor:
    """Logits [T, vocab] of every position of one prefill (the LM head on every row, not just the last)."""
    plan = IterationPlan(0, [SeqWork("x", tokens, 0, block_tables([len(tokens)], runner.block_size)[0])])
    step = build(pack(plan).arrays(), runner.geometry)
    step.fields["logit_rows"] = np.arange(len(tokens))
    lay = step.layout()
    dev = metadata(step, lay, runner.stager.stage(step, lay))
    return runner.model.forward(dev.token_ids, dev.meta, runner.kv).float()


def greedy(runner: ModelRunner, prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(all_logits(runner, seq)[-1].argmax()))
    return seq[len(prompt):]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--set", action="append", default=[], metavar="section.key=value")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--tokens", type=int, default=48, help="greedy tokens per prompt")
    ap.add_argument("--out", default="results/bench_dtype.json")
    args = ap.parse_args()
    dtypes = args.dtypes.split(",")
    cfgs = {d: load_config(None, [*args.set, f"model.dtype={d}", "engine.n_slots=4096"]) for d in dtypes}
    tok = load_tokenizer(cfgs[dtypes[0]].model.path)
    prompts = [tok.encode(p) for p in PROMPTS]
    text = tok.encode(TEXT)
    base, rows = None, []
    for d in dtypes:
        runner = ModelRunner(cfgs[d])
        logits = all_logits(runner, text)
        nll = F.cross_entropy(logits[:-1], torch.tensor(text[1:])).item()
        if base is None:
            base = {"continuations": [greedy(runner, p, args.tokens) for p in prompts]}
        forced = free = total = 0
        for p, cont in zip(prompts, base["continuations"]):
            argmax = all_logits(runner, p + cont)[len(p) - 1: -1].argmax(-1).tolist()
            forced += sum(a == b for a, b in zip(argmax, cont))
            mine = greedy(runner, p, args.tokens) if d != dtypes[0] else cont
            free += sum(a == b for a, b in zip(mine, cont))
            total += len(cont)
        rows.append({"dtype": str(runner.dtype).removeprefix("torch."), "attention": runner.model.attention_backend,
                     "weight_mb": weight_bytes(runner) / 2**20, "perplexity": math.exp(nll),
                     "teacher_forced_agreement": forced / total, "free_running_agreement": free / total,
                     "tokens_compared": total})
        print(f"  {d}: done", flush=True)
    print(f"{'dtype':10} {'attention':9} {'weights MiB':>11} {'x fp32':>7} {'ppl':>8} {'forced agree':>12} {'free agree':>10}")
    for r in rows:
        print(f"{r['dtype']:10} {r['attention']:9} {r['weight_mb']:11.0f} {r['weight_mb'] / rows[0]['weight_mb']:7.2f} "
              f"{r['perplexity']:8.3f} {100 * r['teacher_forced_agreement']:11.1f}% {100 * r['free_running_agreement']:9.1f}%")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"settings": args.set, "prompts": PROMPTS, "text_tokens": len(text), "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
