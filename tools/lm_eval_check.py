#!/usr/bin/env python3
"""lm-evaluation-harness scores the served model as it scores the weights themselves: its
`local-completions` backend (echo + logprobs on /v1/completions) against its `hf` backend, on a local
multiple-choice task, on the same random-weight Llama in fp32. Prints per-backend accuracy and the
largest difference of any sample's per-choice loglikelihood; writes JSON; exits 1 past --tolerance.

lm-eval is not an orca-mq dependency: install it in a venv that sees orca-mq's packages and run this
file with that venv's Python:

    python3 -m venv --system-site-packages /work/venv-lmeval && /work/venv-lmeval/bin/pip install "lm-eval[api]"
    /work/venv-lmeval/bin/python tools/lm_eval_check.py --out results/lm_eval.json

The served side is exactly what a user would run (the model_args README gives):
    lm_eval --model local-completions --tasks TASK --model_args \\
        model=MODEL,base_url=http://127.0.0.1:8000/v1/completions,tokenizer=MODEL_DIR,tokenized_requests=True
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

from orca_mq.bench.random_models import random_llama
from orca_mq.server.process import free_port, spawn

WORDS = ("red", "blue", "green", "cat", "dog", "river", "stone", "light", "seven", "north", "apple", "cloud")
TASK = """task: orca_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def write_task(folder: Path, n: int, seed: int) -> Path:
    """A multiple-choice task of n questions (any text serves: the check is the loglikelihoods)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        words = rng.sample(WORDS, 6)
        rows.append({"question": f"Q: Which word follows {' '.join(words[:3])}?\nA:",
                     "choices": [" " + w for w in words[3:6]] + [" none"], "answer": rng.randrange(4)})
    data = folder / "mc.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "orca_mc.yaml").write_text(TASK.format(data=data))
    return folder


def evaluate(backend: str, model_args: str, tasks: Path) -> tuple[float, list[list[float]]]:
    """(accuracy, each sample's per-choice loglikelihoods) of one backend."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    out: dict[str, Any] = lm_eval.simple_evaluate(model=backend, model_args=model_args, tasks=["orca_mc"],
                                                  task_manager=TaskManager(include_path=str(tasks)), batch_size=1,
                                                  log_samples=True, device="cpu")
    samples = sorted(out["samples"]["orca_mc"], key=lambda s: s["doc_id"])
    return float(out["results"]["orca_mc"]["acc,none"]), [[float(r[0][0]) for r in s["resps"]] for s in samples]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--questions", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tolerance", type=float, default=1e-3, help="largest allowed |loglikelihood difference| (fp32)")
    p.add_argument("--out", required=True, metavar="FILE.json")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="orca-lmeval-"))
    model = random_llama(work / "model", layers=2, max_positions=512)
    tasks = write_task(work, args.questions, args.seed)
    hf_acc, hf_ll = evaluate("hf", f"pretrained={model},dtype=float32", tasks)
    port = free_port()
    server = spawn({"model.path": str(model), "model.dtype": "float32", "server.http_address": f"127.0.0.1:{port}",
                    "server.frontend_address": f"tcp://127.0.0.1:{free_port()}", "log.dir": str(work / "logs")},
                   work / "launcher.stderr", ready_timeout=300)
    try:
        args_served = (f"model=model,base_url=http://127.0.0.1:{port}/v1/completions,tokenizer={model},"
                       "tokenized_requests=True,num_concurrent=1,max_retries=1")
        served_acc, served_ll = evaluate("local-completions", args_served, tasks)
    finally:
        server.stop(60)
    diff = max(abs(a - b) for s, t in zip(hf_ll, served_ll) for a, b in zip(s, t))
    rows = [("hf (transformers, fp32)", hf_acc), ("local-completions (orca-mq served, fp32)", served_acc)]
    print(f"{'backend':44} accuracy\n" + "\n".join(f"{name:44} {acc:.3f}" for name, acc in rows))
    print(f"max |loglikelihood difference| over {len(hf_ll)} samples x 4 choices: {diff:.2e} "
          f"(tolerance {args.tolerance:g})")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"hf_acc": hf_acc, "served_acc": served_acc, "max_abs_diff": diff,
                                          "hf_loglikelihoods": hf_ll, "served_loglikelihoods": served_ll,
                                          "model_args_served": args_served}, indent=1))
    return 0 if diff <= args.tolerance and len(hf_ll) == len(served_ll) == args.questions else 1


if __name__ == "__main__":
    sys.exit(main())
