"""The engine with attention_backend=triton (the CUDA path) equals the torch path, run on the CPU
under TRITON_INTERPRET=1 in a child process (the variable must be set before triton is imported);
and so does the CUDA-graph path's padding (engine.cuda_graphs=on: on the CPU the same buckets and
static buffer, the forward called instead of replayed) for prefill, mixed and decode iterations, and
speculative decoding's verify rows (a chunk with a logit per token: a mixed bucket)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import random, sys, torch
    from orca_mq.kv.block_manager import BlockManager
    from orca_mq.config import load_config
    from orca_mq.protocol.iteration import IterationPlan, SeqWork
    from orca_mq.engine.model_runner import ModelRunner

    def logits(backend, graphs="off"):
        cfg = load_config(overrides={"model.path": sys.argv[1], "engine.block_size": 4, "engine.n_slots": 256,
                                     "engine.attention_backend": backend, "engine.threads_per_worker": 1,
                                     "model.dtype": "float32", "engine.cuda_graphs": graphs, "scheduler.max_bs": 4,
                                     "scheduler.max_num_batched_tokens": 16})
        runner = ModelRunner(cfg)
        assert (runner.graphs is not None) == (graphs == "on")
        runs = []
        if runner.graphs is not None:   # every iteration below must take a bucket: prefill, mixed, decode
            run = runner.graphs.run
            runner.graphs.run = lambda step, bucket, prev: runs.append(bucket) or run(step, bucket, prev)
        bm = BlockManager(runner.pool)
        random.Random(3).shuffle(bm.device.free)
        seqs = {"a": list(range(5, 14)), "b": list(range(20, 26)), "c": list(range(40, 43))}
        runner.forward(IterationPlan(0, [SeqWork(n, s[:-1], 0, list(bm.ensure(n, len(s)))) for n, s in seqs.items() if n != "c"]))
        mixed = [SeqWork("a", seqs["a"][-1:], 8, bm.table("a")), SeqWork("c", seqs["c"], 0, list(bm.ensure("c", 3))),
                 SeqWork("b", seqs["b"][-1:], 5, bm.table("b"))]
        out = runner.forward(IterationPlan(1, mixed))
        decode = [SeqWork(n, [7], len(s), list(bm.ensure(n, len(s) + 1))) for n, s in seqs.items()]
        out = torch.cat([out, runner.forward(IterationPlan(2, decode))])
        verify = [SeqWork("a", [7, 30, 31], len(seqs["a"]) + 1, list(bm.ensure("a", len(seqs["a"]) + 4)), draft=2),
                  SeqWork("c", [7], len(seqs["c"]) + 1, list(bm.ensure("c", len(seqs["c"]) + 2)))]
        out = torch.cat([out, runner.forward(IterationPlan(3, verify))])   # 3 + 1 logit rows: max_bs
        assert len(runs) == (4 if graphs == "on" else 0) and [b.decode_tiles for b in runs] == [False, False, True, False][:len(runs)]
        return out

    torch_out, triton_out, graphs_out = logits("torch"), logits("triton"), logits("triton", "on")
    err = max(((x - torch_out).abs().max() / torch_out.abs().max()).item() for x in (triton_out, graphs_out))
    print("REL_ERR", err)
    sys.exit(0 if err <= 1e-4 else 1)
""")


def test_engine_triton_kernel_backend_matches_torch(tiny_llama_dir):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tiny_llama_dir)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "REL_ERR" in proc.stdout
