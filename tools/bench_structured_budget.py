#!/usr/bin/env python
"""How often structured outputs parse under max_tokens (issue 33): 18 held-out JSON schemas (none of
them in the tests) and json_object, on the embedded model (offline `LLM`), each at max_tokens a few
tokens above its shortest output (+2, +8, +32) and at a fixed 128, sampled (temperature 0.8, seeded).
Reported per budget: the share of outputs that parse and validate against their schema, the finish
reasons, the most digits of any number. `--baseline` runs the same requests as before budget-aware
closing (no forced close, no digit bound: `Grammar.limit` made a no-op), for comparison; the refusal
of a max_tokens below the shortest stays (every budget here holds it). Then what closing costs the
scheduler: its mask fill per iteration, 32 rows of the schemas above, each at max_tokens its
shortest + 8 (so every step is near the end: the worst case) or unbounded, random allowed tokens.

    flock /tmp/orca-bench.lock python tools/bench_structured_budget.py --out results/bench_structured_budget.json
    flock /tmp/orca-bench.lock python tools/bench_structured_budget.py --baseline --out results/bench_structured_budget_baseline.json
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np

from orca_mq import LLM, SamplingParams, StructuredOutputsParams as SO
from orca_mq.protocol.iteration import SeqWork
from orca_mq.structured.bitmask import fill_masks
from orca_mq.structured.tokens import JsonLex
from orca_mq.structured.compiler import Compiler
from orca_mq.structured.grammar import Grammar

S, I, N, B, OBJ = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}, {"type": "object"}


def obj(required: bool = True, **props: Any) -> dict[str, Any]:
    return {"type": "object", "properties": props, **({"required": list(props)} if required else {})}


def arr(items: dict[str, Any], lo: int = 0) -> dict[str, Any]:
    return {"type": "array", "items": items, "minItems": lo}


SCHEMAS: dict[str, dict[str, Any]] = {
    "address": obj(street=S, city=S, zip={"type": "string", "pattern": "^[0-9]{5}$"}, country=S),
    "invoice": obj(number=I, customer=S, lines=arr(obj(item=S, qty=I, price=N), 1), total=N, paid=B),
    "event": obj(title=S, start={"type": "string", "format": "date-time"}, attendees=arr(S), online=B),
    "product": obj(sku=S, name=S, price=N, tags=arr(S), dimensions=obj(w=N, h=N, d=N)),
    "weather": obj(city=S, temperature_c=N, humidity=I, conditions={"enum": ["sunny", "cloudy", "rain", "snow"]}),
    "recipe": obj(name=S, servings=I, ingredients=arr(obj(name=S, grams=N), 2), steps=arr(S, 1)),
    "user": obj(id=I, email={"type": "string", "format": "email"}, roles=arr({"enum": ["admin", "editor", "viewer"]}, 1)),
    "coordinates": obj(lat={"type": "number", "minimum": -90, "maximum": 90},
                       lon={"type": "number", "minimum": -180, "maximum": 180}),
    "matrix": arr(arr(N, 2), 2),
    "tree": {"$defs": {"node": obj(False, value=I, children=arr({"$ref": "#/$defs/node"}))}, "$ref": "#/$defs/node"},
    "stats": obj(mean=N, stdev=N, samples=arr(N, 3)),
    "book": obj(title=S, authors=arr(S, 1), year={"type": "integer", "minimum": 1450, "maximum": 2030}, isbn=S),
    "shape": {"anyOf": [obj(kind={"const": "circle"}, radius=N), obj(kind={"const": "rect"}, width=N, height=N)]},
    "config": obj(False, debug=B, retries=I, timeout_s=N, hosts=arr(S)),
    "review": obj(stars={"type": "integer", "minimum": 1, "maximum": 5}, text={"type": "string", "minLength": 20}),
    "flight": obj(code={"type": "string", "pattern": "^[A-Z]{2}[0-9]{3,4}$"}, seats=arr(obj(row=I, seat=S), 1)),
    "graph": obj(nodes=arr(S, 2), edges=arr(arr(I, 2), 1)),
    "score": N,
}
PROMPT = "Reply with JSON only: an example {name}."


def most_digits(text: str) -> int:
    lex, most = JsonLex(), 0
    for b in text.encode():
        lex.feed(bytes([b]))
        most = max(most, lex.digits)
    return most


def mask_fill_ms(compiler: Compiler, specs: list[SO], bounded: bool, rows: int = 32) -> dict[str, float]:
    """Median and p90 ms of one iteration's mask fill for `rows` requests sampling random allowed tokens."""
    rng = np.random.default_rng(0)
    grammars = []
    for i in range(rows):
        g = compiler.compile(specs[i % len(specs)])
        if bounded:
            g.limit((compiler.shortest(specs[i % len(specs)]) or 1) + 8)
        grammars.append(g)
    times, live = [], list(grammars)
    while live:
        seqs = [SeqWork(str(i), [0], 0, []) for i in range(len(live))]
        start = time.perf_counter()
        fill_masks(seqs, live)   # type: ignore[arg-type]
        times.append(time.perf_counter() - start)
        for s, g in list(zip(seqs, live)):
            allowed = np.flatnonzero(np.unpackbits(np.frombuffer(s.allowed_token_bitmask, np.uint8), bitorder="little"))
            if g.accept(int(rng.choice(allowed[allowed < g.vocab.size]))) or g.tokens >= 128:
                live.remove(g)
    return {"median_ms": round(1e3 * float(np.median(times)), 3), "p90_ms": round(1e3 * float(np.percentile(times, 90)), 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--extras", default="2,8,32", help="budgets above each schema's shortest output")
    ap.add_argument("--fixed", type=int, default=128, help="one more budget, the same for every schema")
    ap.add_argument("--baseline", action="store_true", help="no forced close, no digit bound (before issue 33)")
    ap.add_argument("--out", default="results/bench_structured_budget.json")
    args = ap.parse_args()
    if args.baseline:
        Grammar.limit = lambda self, max_tokens, min_tokens=0: None   # type: ignore[method-assign]
    llm = LLM(max_bs=32, n_slots=32768, **({"structured__max_number_digits": 0} if args.baseline else {}))
    specs = [(name, SO(json=schema), schema) for name, schema in SCHEMAS.items()] + [("json_object", SO(json_object=True), OBJ)]
    jobs = []
    for name, spec, schema in specs:
        shortest = llm.model.grammars.shortest(spec) or 1
        budgets = [(f"shortest+{e}", shortest + e) for e in map(int, args.extras.split(","))] + [(str(args.fixed), args.fixed)]
        jobs += [(name, spec, schema, label, budget, seed) for label, budget in budgets if budget >= shortest
                 for seed in range(args.seeds)]
    outs = llm.chat([[{"role": "user", "content": PROMPT.format(name=job[0])}] for job in jobs],
                    [SamplingParams(max_tokens=budget, temperature=0.8, seed=seed, structured_outputs=spec)
                     for _, spec, _, _, budget, seed in jobs])
    by: dict[str, dict[str, Any]] = collections.defaultdict(lambda: {"requests": 0, "valid": 0, "finish": collections.Counter(),
                                                                     "most_digits": 0, "failed": []})
    for (name, _, schema, label, budget, seed), out in zip(jobs, outs):
        row = by[label]
        row["requests"] += 1
        row["finish"][out.finish_reason] += 1
        row["most_digits"] = max(row["most_digits"], most_digits(out.text))
        try:
            jsonschema.validate(json.loads(out.text), schema)
            row["valid"] += 1
        except (ValueError, jsonschema.ValidationError):
            row["failed"].append({"schema": name, "max_tokens": budget, "seed": seed, "finish": out.finish_reason,
                                  "text": out.text[-80:]})
    result = {"baseline": args.baseline, "command": " ".join(sys.argv), "budgets": {
        k: {**v, "finish": dict(v["finish"]), "parse_rate": round(v["valid"] / v["requests"], 4)} for k, v in by.items()}}
    if not args.baseline:
        result["mask_fill_32_rows"] = {mode: mask_fill_ms(llm.model.grammars, [s for _, s, _ in specs], mode == "closing")
                                       for mode in ("unbounded", "closing")}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print("| max_tokens | requests | parse and validate | finish reasons | most digits |\n| --- | ---: | ---: | --- | ---: |")
    for label, v in result["budgets"].items():
        print(f"| {label} | {v['requests']} | {v['valid']} ({100 * v['parse_rate']:.1f}%) | {v['finish']} | {v['most_digits']} |")
    print(f"mask fill, 32 rows: {result.get('mask_fill_32_rows')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
