#!/usr/bin/env python
"""The cost of structured outputs (issue 25).

1. Served throughput, constrained vs free: a real server (tools/launch.py, `scheduler.max_bs` 32);
   rounds of B requests at once (B = 1 and 32), the free and the constrained batch interleaved in
   every round. Both sample (temperature 0.7, seeded) exactly `--tokens` tokens: the free ones with
   ignore_eos, the constrained ones under a JSON schema (an array of at least 1,000 nested objects
   with enums, bounded strings and integers, nullable fields) that cannot complete before
   max_tokens, so every iteration of every row computes and applies a mask. Tokens/s = generated
   tokens / makespan; the ratio is per round, its median reported.
2. Compile times per constraint (in-process, a fresh compiler each time): the frontend's check,
   the scheduler's compile (the template matcher over the vocabulary), a request's copy of it, and
   its first mask; and the one-off vocabulary build.
3. Memory (malloc's bytes in use, glibc `mallinfo2`): the vocabulary, and per live constrained
   request advanced by 24 tokens, 100 with a schema each (its compiled grammar counted in) and
   100 sharing one.
4. The scheduler's mask time per iteration at batch 1 and 32 (random states of that schema).
5. One decode iteration in-process (the worker's ModelRunner: forward + sampling, context 255),
   free vs constrained, interleaved iteration by iteration (a busy host's swings hit both alike):
   the constrained one also fills its rows' masks as the scheduler does and carries them through
   a control frame's encode and decode. Its time ratio is the tokens/s ratio without the messaging.

    flock /tmp/orca-bench.lock python tools/bench_structured.py --out results/bench_structured.json
"""
from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from orca_mq.bench.bench_server import Server
from orca_mq.percentile import percentile
from orca_mq.bench.plans import plan_for
from orca_mq.bench.timing import interleaved_medians
from orca_mq.client import AsyncClient
from orca_mq.config import load_config
from orca_mq.models.registry import read_model_info
from orca_mq.engine.model_runner import ModelRunner
from orca_mq.protocol import decode, encode
from orca_mq.protocol.codec import channel
from orca_mq.protocol.engine_msgs import ControlFrame
from orca_mq.protocol.iteration import IterationPlan, SeqWork, pack
from orca_mq.structured.bitmask import fill_masks
from orca_mq.structured.compiler import Compiler
from orca_mq.structured.grammar import Grammar, Vocabulary
from orca_mq.protocol.structured import StructuredOutputsParams as SO
from orca_mq.tokenizer import load_tokenizer

PET = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "species": {"enum": ["cat", "dog", "parrot", "hamster"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 40},
        "owner": {"type": "object", "properties": {"first": {"type": "string", "maxLength": 16},
                                                   "phone": {"type": ["string", "null"], "pattern": "^[0-9-]{7,12}$"}},
                  "required": ["first", "phone"]},
        "toys": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 4},
        "weight": {"type": ["number", "null"]},
    },
    "required": ["name", "species", "age", "owner", "toys", "weight"], "additionalProperties": False,
}
ENDLESS = {"type": "array", "items": PET, "minItems": 1000}   # cannot complete within max_tokens
WIDE = {"type": "object", "properties": {f"field_{i}": [{"type": "integer"}, {"type": "string", "maxLength": 20},
                                                        {"type": "boolean"}, {"enum": ["a", "b", "c"]}][i % 4]
                                         for i in range(60)}, "required": [f"field_{i}" for i in range(0, 60, 2)]}
DEFS = {"$defs": {"addr": {"type": "object", "properties": {"street": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                           "required": ["street", "zip"]},
                  "person": {"type": "object", "properties": {"name": {"type": "string"}, "home": {"$ref": "#/$defs/addr"},
                                                              "friends": {"type": "array", "items": {"$ref": "#/$defs/person"}}},
                             "required": ["name"]}},
        "anyOf": [{"$ref": "#/$defs/person"}, {"type": "array", "items": {"$ref": "#/$defs/addr"}}]}
FORMATS = {"type": "object", "properties": {"when": {"type": "string", "format": "date-time"},
                                            "mail": {"type": "string", "format": "email"},
                                            "id": {"type": "string", "format": "uuid"},
                                            "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}},
           "required": ["when", "mail", "id", "code"]}
CONSTRAINTS = {
    "json: 1 property": SO(json={"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}),
    "json: pet (nested, enums, ranges, nullable)": SO(json=PET),
    "json: 60 properties": SO(json=WIDE),
    "json: $defs, recursive $ref, anyOf": SO(json=DEFS),
    "json: formats and patterns": SO(json=FORMATS),
    "json_object": SO(json_object=True),
    "regex: ISO date": SO(regex=r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"),
    "choice: 100 strings": SO(choice=[f"option number {i}" for i in range(100)]),
    "grammar: GBNF arithmetic": SO(grammar='root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= [0-9]+ | "(" expr ")"'),
}
PROMPT = [{"role": "user", "content": "List pets as JSON: name, species, age, owner, toys, weight."}]


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]


_libc = ctypes.CDLL("libc.so.6")
_libc.mallinfo2.restype = _MallInfo2


def heap() -> int:
    """Bytes in use from glibc's malloc (llguidance's Rust heap among them): exact where RSS is page-grained and
    keeps freed memory."""
    m = _libc.mallinfo2()
    return m.uordblks + m.hblkhd


def median_ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e3, 3)


# ---------------------------------------------------------------- 1. served throughput


async def one_batch(address: str, batch: int, tokens: int, constrained: bool, round_: int) -> dict[str, Any]:
    async with AsyncClient(address) as client:
        extra = {"structured_outputs": {"json": ENDLESS}} if constrained else {"ignore_eos": True}
        start = time.perf_counter()
        outs = await asyncio.gather(*(client.generate(messages=PROMPT, chat=True, max_tokens=tokens, temperature=0.7,
                                                      seed=1000 * round_ + i, **extra) for i in range(batch)))
        took = time.perf_counter() - start
    bad = [(o.finish_reason, o.error) for o in outs if o.finish_reason != "length" or len(o.token_ids) != tokens]
    if bad:
        raise RuntimeError(f"every request must generate exactly {tokens} tokens; got {bad[:3]}")
    return {"seconds": took, "tokens": batch * tokens, "tokens_per_s": batch * tokens / took}


def throughput(rounds: int, tokens: int, batches: list[int], extra: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with Server(1, 2, 32, extra) as srv:
        asyncio.run(one_batch(srv.address, 2, 8, True, 99))   # warm-up: the scheduler builds the vocabulary, compiles
        asyncio.run(one_batch(srv.address, 2, 8, False, 99))
        for batch in batches:
            runs: dict[str, list[dict[str, Any]]] = {"free": [], "constrained": []}
            for r in range(rounds):
                order = ["free", "constrained"] if r % 2 == 0 else ["constrained", "free"]
                for mode in order:
                    runs[mode].append(asyncio.run(one_batch(srv.address, batch, tokens, mode == "constrained", r)))
                    print(f"  batch {batch} round {r} {mode}: {runs[mode][-1]['tokens_per_s']:.1f} tokens/s", flush=True)
            ratios = [c["tokens_per_s"] / f["tokens_per_s"] for c, f in zip(runs["constrained"], runs["free"])]
            out[str(batch)] = {"runs": runs, "ratios": ratios, "median_ratio": statistics.median(ratios),
                               "free_tokens_per_s": statistics.median(x["tokens_per_s"] for x in runs["free"]),
                               "constrained_tokens_per_s": statistics.median(x["tokens_per_s"] for x in runs["constrained"])}
    return out


# ---------------------------------------------------------------- 2-4. in-process


def walk(grammar: Grammar, steps: int, rng: random.Random) -> None:
    """Advance by random allowed tokens (EOS excluded)."""
    eos = set(grammar.vocab.tokenizer.eos_tokens)
    for _ in range(steps):
        seqs = [SeqWork("w", [0], 0, [])]
        fill_masks(seqs, [grammar])
        bits = np.unpackbits(np.frombuffer(seqs[0].allowed_token_bitmask or b"", np.uint8), bitorder="little")
        choices = [int(t) for t in np.flatnonzero(bits) if t not in eos]
        if not choices or grammar.accept(rng.choice(choices)):
            return


def compile_times(vocab: Vocabulary, repeat: int) -> dict[str, Any]:
    cfg = load_config().structured
    out = {}
    for name, spec in CONSTRAINTS.items():
        check, build, copy, mask = [], [], [], []
        for _ in range(repeat):
            fresh = Compiler(cfg, lambda: vocab)
            t0 = time.perf_counter()
            fresh.check(spec)
            t1 = time.perf_counter()
            g = fresh.compile(spec)
            t2 = time.perf_counter()
            fresh.compile(spec)
            t3 = time.perf_counter()
            fill_masks([SeqWork("m", [0], 0, [])], [g])
            t4 = time.perf_counter()
            check.append(t1 - t0), build.append(t2 - t1), copy.append(t3 - t2), mask.append(t4 - t3)
        out[name] = {"check_ms": median_ms(check), "compile_ms": median_ms(build), "per_request_ms": median_ms(copy),
                     "first_mask_ms": median_ms(mask)}
        print(f"  {name}: {out[name]}", flush=True)
    return out


def memory(vocab: Vocabulary, n: int) -> dict[str, Any]:
    """Heap growth per live request matcher (advanced by 24 tokens): each with its own schema (its
    compiled grammar counted in), and all sharing one cached schema."""
    compiler = Compiler(load_config(overrides={"structured.cache_size": n}).structured, lambda: vocab)
    walk(compiler.compile(SO(json=PET)), 24, random.Random(0))
    out: dict[str, Any] = {"requests": n}
    for name, extra in (("distinct_schema", True), ("shared_schema", False)):
        live: list[Grammar] = []   # the previous pass's matchers are freed before the count starts
        before = heap()
        for i in range(n):
            schema = json.loads(json.dumps(PET))
            if extra:  # PET with one more property: a schema of its own
                schema["properties"][f"extra_{i}"] = {"type": "integer", "maximum": i}
            live.append(compiler.compile(SO(json=schema)))
            walk(live[-1], 24, random.Random(i))
        out[f"heap_per_request_{name}_kb"] = round((heap() - before) / n / 1024, 1)
    return out


def mask_times(vocab: Vocabulary, batches: list[int], repeat: int) -> dict[str, Any]:
    compiler = Compiler(load_config().structured, lambda: vocab)
    out = {}
    for batch in batches:
        grammars = [compiler.compile(SO(json=ENDLESS)) for _ in range(batch)]
        for i, g in enumerate(grammars):
            walk(g, random.Random(i).randrange(60), random.Random(i))
        samples = []
        for _ in range(repeat):
            seqs = [SeqWork(str(i), [0], 0, []) for i in range(batch)]
            t = time.perf_counter()
            fill_masks(seqs, grammars)   # type: ignore[arg-type]
            samples.append(time.perf_counter() - t)
        out[str(batch)] = {"median_ms": median_ms(samples), "p90_ms": round(percentile(samples, 90) * 1e3, 3)}
    return out


def engine_iteration(vocab: Vocabulary, batches: list[int], repeat: int) -> dict[str, Any]:
    cfg = load_config()
    runner = ModelRunner(cfg)
    compiler = Compiler(cfg.structured, lambda: vocab)
    frames = channel(ControlFrame)
    out = {}
    for batch in batches:
        plan = plan_for([(1, 255)] * batch, runner.block_size)
        for i, seq in enumerate(plan.seqs):
            seq.temperature, seq.seed = 0.7, i
        grammars = [compiler.compile(SO(json=ENDLESS)) for _ in range(batch)]
        for i, g in enumerate(grammars):
            walk(g, random.Random(i).randrange(60), random.Random(i))

        def free() -> None:
            runner.execute(decode(encode(ControlFrame(pack(plan), 0.0)), frames).plan)

        def constrained() -> None:
            seqs = [SeqWork(s.request_id, s.token_ids, s.start_pos, s.block_table, s.temperature, seed=s.seed) for s in plan.seqs]
            fill_masks(seqs, grammars)   # type: ignore[arg-type]
            runner.execute(decode(encode(ControlFrame(pack(IterationPlan(plan.iteration, seqs)), 0.0)), frames).plan)

        t_free, t_constrained = interleaved_medians([free, constrained], repeat)
        out[str(batch)] = {"free_ms": round(t_free * 1e3, 2), "constrained_ms": round(t_constrained * 1e3, 2),
                           "ratio": round(t_free / t_constrained, 3)}
        print(f"  batch {batch}: {out[str(batch)]}", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64, help="tokens generated per request")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--repeat", type=int, default=5, help="repetitions of each in-process timing")
    ap.add_argument("--skip-serving", action="store_true")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra server config")
    ap.add_argument("--out", default="results/bench_structured.json")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    cfg = load_config()
    info = read_model_info(cfg.model.path, cfg.model.cache_dir)
    tokenizer = load_tokenizer(cfg.model.path, cfg.model.cache_dir)
    before, t = heap(), time.perf_counter()
    vocab = Vocabulary.of(tokenizer, info.vocab_size, info.eos_token_ids, cfg.structured.mask_threads)
    result: dict[str, Any] = {"vocab_size": info.vocab_size, "vocabulary": {
        "build_s": round(time.perf_counter() - t, 3), "heap_mb": round((heap() - before) / 2**20, 1)}}
    print("compile times", flush=True)
    result["compile"] = compile_times(vocab, args.repeat)
    result["memory"] = memory(vocab, 100)
    result["mask_fill"] = mask_times(vocab, batches, 10 * args.repeat)
    print("engine iteration", flush=True)
    result["iteration"] = engine_iteration(vocab, batches, 6 * args.repeat)
    if not args.skip_serving:
        print("served throughput", flush=True)
        result["throughput"] = throughput(args.rounds, args.tokens, batches, args.set)
    result["command"] = " ".join(sys.argv)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(report(result))
    return 0


def report(r: dict[str, Any]) -> str:
    lines = [f"vocabulary ({r['vocab_size']} tokens): built in {r['vocabulary']['build_s']} s, {r['vocabulary']['heap_mb']} MB",
             "", "| constraint | check (frontend) ms | compile (scheduler) ms | per request ms | first mask ms |",
             "| --- | ---: | ---: | ---: | ---: |"]
    lines += [f"| {k} | {v['check_ms']} | {v['compile_ms']} | {v['per_request_ms']} | {v['first_mask_ms']} |"
              for k, v in r["compile"].items()]
    m = r["memory"]
    lines += ["", f"memory per live constrained request ({m['requests']} requests, 24 tokens in): "
                  f"{m['heap_per_request_distinct_schema_kb']} kB each with its own schema, "
                  f"{m['heap_per_request_shared_schema_kb']} kB sharing one", "",
              "| batch | mask fill median ms | p90 ms |", "| ---: | ---: | ---: |"]
    lines += [f"| {b} | {v['median_ms']} | {v['p90_ms']} |" for b, v in r["mask_fill"].items()]
    lines += ["", "| batch | decode iteration, free ms | constrained ms | ratio (tokens/s) |", "| ---: | ---: | ---: | ---: |"]
    lines += [f"| {b} | {v['free_ms']} | {v['constrained_ms']} | {v['ratio']} |" for b, v in r["iteration"].items()]
    if "throughput" in r:
        lines += ["", "| batch | free tokens/s | constrained tokens/s | ratio (median of rounds) | ratios |",
                  "| ---: | ---: | ---: | ---: | --- |"]
        lines += [f"| {b} | {v['free_tokens_per_s']:.1f} | {v['constrained_tokens_per_s']:.1f} | {v['median_ratio']:.2f} | "
                  f"{', '.join(f'{x:.2f}' for x in v['ratios'])} |" for b, v in r["throughput"].items()]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
