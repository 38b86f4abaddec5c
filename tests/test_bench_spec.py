"""The speculative-decoding benchmark (tools/bench_spec.py): its misspellings and workloads, and one
--small run end to end on the tiny served model (two real servers, off and on), down to its JSON."""
from __future__ import annotations

import json
import random
import subprocess
import sys

from orca_mq.bench.spec_bench import SCENARIOS, SIDES, Setup, misspell, workloads
from orca_mq.bench.spec_texts import OPEN_PROMPTS, PARAGRAPHS
from orca_mq.server.process import ROOT


def test_misspellings_are_seeded_and_keep_the_words():
    text = PARAGRAPHS[0]
    once, again = (misspell(text, random.Random(3), 0.2) for _ in range(2))
    assert once == again != text
    assert len(once.split()) == len(text.split())
    changed = [(a, b) for a, b in zip(text.split(), once.split()) if a != b]
    assert changed and all(a[0] == b[0] and a[-1] == b[-1] for a, b in changed)   # first and last letters stay


def test_workloads_pair_copy_and_open_requests():
    jobs = workloads(Setup(requests=5, words=20, max_tokens_cap=16), lambda text: len(text.split()))
    assert [len(jobs[k]) for k in ("copy", "open")] == [5, 5]
    assert [j.max_tokens for j in jobs["copy"]] == [j.max_tokens for j in jobs["open"]] == [16] * 5
    assert all(len(j.prompt.split("\n\n")[1].split()) == 20 for j in jobs["copy"])   # the paragraph, cut
    assert [j.prompt for j in jobs["open"]] == list(OPEN_PROMPTS[:5])


def test_small_run_writes_its_json(tmp_path, tiny_served_dir):
    out = tmp_path / "spec.json"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_spec.py"), "--small", "--model",
                           str(tiny_served_dir), "--dtype", "float32", "--out", str(out)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "alone_copy" in proc.stdout and "tok/step" in proc.stdout
    result = json.loads(out.read_text())
    assert result["setup"]["requests"] == 3 and result["setup"]["dtype_resolved"] == "float32"
    (rnd,) = result["rounds"]
    for name in SCENARIOS:
        runs = rnd[name]
        assert set(runs) == set(SIDES)
        for side, run in runs.items():
            assert run["makespan_s"] > 0 and len(run["requests"]) == 3
            assert run["generated_tokens"] == sum(r["completion_tokens"] for r in run["requests"]) > 0
            assert (run["spec"] == {}) == (side == "off")
        s = result["summary"][name]
        assert s["ratio"] > 0 and s["spec_drafts"] >= 0 and len(s["spec_accepted_per_pos"]) == 4
        assert s["spec_accepted_tokens"] == sum(r.get("spec_accepted_tokens", 0) for r in runs["on"]["requests"])
    alone = result["summary"]["alone_copy"]
    assert alone["tokens_per_step"]["off"] == 1.0 and alone["tokens_per_step"]["on"] >= 1.0
