"""JSON that always parses (orca_mq.structured.budget): the shortest output of many schemas, outputs
that finish within tight max_tokens on a fake engine through the real sampler (uniform, digit-happy
and string-happy logits: the two ways a model ran out of budget) and on a random-weight model
(fp32, offline), the bound on a number's digits, and a max_tokens that cannot hold any valid output
refused up front."""
from __future__ import annotations

import json
import re
import time
import zlib

import jsonschema
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orca_mq.config import load_config
from orca_mq.engine import sampler
from orca_mq.errors import InvalidRequest
from orca_mq.protocol.iteration import IterationPlan, IterationResult, SeqWork
from orca_mq.protocol.sampling import SamplingParams
from orca_mq.protocol.structured import StructuredOutputsParams as SO
from orca_mq.sched import make_scheduler
from orca_mq.sched.request import Request
from orca_mq.structured.bitmask import fill_masks
from orca_mq.structured.tokens import JsonLex
from orca_mq.structured.compiler import Compiler
from orca_mq.structured.grammar import Grammar, Vocabulary
from test_structured import CONSTRAINT, EOS, INFO, VOCAB, allowed, drive

OBJ = {"type": "object"}
SCHEMAS = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8}, "kind": {"enum": ["cat", "dog", "bird"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 1, "maxItems": 3},
        "owner": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                                                   "email": {"type": ["string", "null"], "maxLength": 6}},
                  "required": ["id", "email"], "additionalProperties": False}},
        "required": ["name", "kind", "age", "tags", "owner"], "additionalProperties": False},
    "object": OBJ,
    "string": {"type": "string"},
    "number": {"type": "number"},
    "integer": {"type": "integer"},
    "numbers": {"type": "array", "items": {"type": "number"}},
    "three strings": {"type": "array", "items": {"type": "string"}, "minItems": 3},
    "nested": {"type": "object", "properties": {"a": {"type": "object", "properties": {
        "b": {"type": "object", "properties": {"c": {"type": "string"}}, "required": ["c"]}}, "required": ["b"]}}, "required": ["a"]},
    "enum": {"type": "object", "properties": {"color": {"enum": ["ultramarine", "red", "chartreuse"]}}, "required": ["color"]},
    "required": {"type": "object", "properties": {k: {"type": "string"} for k in ("alpha", "beta", "gamma", "delta")},
                 "required": ["alpha", "beta", "gamma", "delta"]},
    "optional": {"type": "object", "properties": {k: {"type": "number"} for k in "xyz"}},
    "points": {"type": "array", "items": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                                          "required": ["x", "y"], "additionalProperties": False}, "minItems": 2, "maxItems": 6},
    "shapes": {"anyOf": [{"type": "object", "properties": {"kind": {"const": "circle"}, "r": {"type": "number"}},
                          "required": ["kind", "r"]},
                         {"type": "object", "properties": {"kind": {"const": "rect"}, "w": {"type": "number"}, "h": {"type": "number"}},
                          "required": ["kind", "w", "h"]}]},
    "pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}}, "required": ["code"]},
    "long string": {"type": "object", "properties": {"s": {"type": "string", "minLength": 10}}, "required": ["s"]},
    "nullable": {"type": "object", "properties": {"v": {"type": ["number", "null"]},
                                                  "w": {"anyOf": [{"type": "string"}, {"type": "null"}]}}, "required": ["v", "w"]},
    "date": {"type": "object", "properties": {"when": {"type": "string", "format": "date"}}, "required": ["when"]},
    "contact": {"type": "object", "properties": {"email": {"type": "string", "format": "email"},
                                                 "site": {"type": "string", "format": "uri"}}, "required": ["email", "site"]},
    "matrix": {"type": "array", "items": {"type": "array", "items": {"type": "number"}, "minItems": 2}, "minItems": 2},
    "map": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"],
            "additionalProperties": {"type": "array", "items": {"type": "string"}}},
    "ranges": {"type": "object", "properties": {"t": {"type": "number", "minimum": 1000.5, "maximum": 99999},
                                                "n": {"type": "integer", "minimum": 500}}, "required": ["t", "n"]},
    "rows": {"type": "object", "properties": {"rows": {"type": "array", "items": {"type": "object", "properties": {
        "name": {"type": "string"}, "tags": {"type": "array", "items": {"enum": ["a", "bb"]}, "minItems": 1}},
        "required": ["name", "tags"]}, "minItems": 1}}, "required": ["rows"]},
}
SPECS = [(name, SO(json=s), s) for name, s in SCHEMAS.items()] + [("json_object", SO(json_object=True), OBJ)]


@pytest.fixture(scope="module")
def tokenizer():
    from orca_mq.tokenizer import load_tokenizer
    return load_tokenizer("", load_config().model.cache_dir)


@pytest.fixture(scope="module")
def vocab(tokenizer):
    return Vocabulary.of(tokenizer, VOCAB, [EOS], 0)


@pytest.fixture(scope="module")
def compiler(vocab):
    return Compiler(load_config().structured, lambda: vocab)


def digits_of(text: bytes) -> int:
    """The most digits of a number in JSON text."""
    lex, most = JsonLex(), 0
    for b in text:
        lex.feed(bytes([b]))
        most = max(most, lex.digits)
    return most


def check(vocab, schema: dict, ids: list[int], reason: str, max_digits: int = 16) -> None:
    text = vocab.tokenizer.decode_bytes([t for t in ids if t != EOS])
    assert reason == "stop", (reason, text)
    jsonschema.validate(json.loads(text), schema)
    assert digits_of(text) <= max_digits, text


def test_the_shortest_output_of_each_schema(compiler, vocab):
    """From the start, every plan is a whole output that validates; where greedy takes the first
    byte allowed, the search takes the shortest way (an enum's shortest member, a choice's shortest
    string, `b` for a*b where greedy loops, an email's @ where text loops); EOS after a value that
    could go on is not counted."""
    for name, spec, schema in SPECS:
        g = compiler.compile(spec)
        text = vocab.tokenizer.decode_bytes([t for t in g.start if t != EOS])
        jsonschema.validate(json.loads(text), schema)
        assert compiler.shortest(spec) == len(g.start) - (g.start[-1] == EOS), name
    assert compiler.shortest(SO(json=OBJ)) == compiler.shortest(SO(json_object=True)) == 1   # {}
    assert vocab.tokenizer.decode_bytes(compiler.compile(SO(json=SCHEMAS["enum"])).start) == b'{"color":"red"}'
    assert compiler.shortest(SO(json=SCHEMAS["number"])) == 1                         # 0, then EOS
    for spec, out in [(SO(choice=["dark red", "sky blue", "green"]), rb"green"), (SO(regex="a*b"), rb"b"),
                      (SO(regex="[0-9]{3,}"), rb"[0-9]{3}"), (SO(json={"type": "string", "format": "email"}), rb'"[^"]+@[^"]+"')]:
        assert re.fullmatch(out, vocab.tokenizer.decode_bytes([t for t in compiler.compile(spec).start if t != EOS])), spec


class Engine:
    """Logits that depend only on (request, position), some tokens favoured, through the real sampler."""

    def __init__(self, favoured: list[int]) -> None:
        self.bias = np.zeros(VOCAB, dtype=np.float32)
        self.bias[favoured] = 6.0

    def execute(self, plan: IterationPlan) -> IterationResult:
        rows = [np.random.default_rng(zlib.crc32(f"{s.request_id}@{s.seq_len}".encode())).standard_normal(VOCAB, dtype=np.float32)
                * 3 + self.bias for s in plan.seqs]
        tokens, failed = sampler.sample_seqs(torch.from_numpy(np.stack(rows)), plan.seqs)
        return IterationResult(plan.iteration, tokens,
                               [plan.seqs[b].request_id for b in failed])


FAVOURED = {"uniform": None, "digits": "0123456789", "strings": "abcdefghijklmnopqrstuvwxyz "}


@pytest.mark.parametrize("kind", list(FAVOURED))
def test_tight_budgets_finish_in_valid_json(compiler, vocab, kind):
    """Every schema at max_tokens from its shortest up, through the scheduler and the real sampler,
    with logits that favour digits or string text (+6: what ran a model out of budget) or neither:
    each output stops (never `length`) within max_tokens and validates, numbers within 16 digits."""
    chars = FAVOURED[kind]
    engine = Engine([t for t, b in enumerate(vocab.tables.token_bytes)
                     if chars and b and set(b.decode(errors="replace")) <= set(chars)])
    sched = make_scheduler(load_config(overrides={"engine.n_slots": 65536, "scheduler.max_bs": 128}), INFO)
    reqs, schemas = [], {}
    for name, spec, schema in SPECS:
        if name == "number":   # a bare number ends by EOS only: at its shortest, max_tokens cuts it whole ("0")
            continue
        n = compiler.shortest(spec)
        for extra in (0, 2, 8, 30):
            rid = f"{name}/{extra}"
            g = compiler.compile(spec)
            g.limit(n + extra)
            reqs.append(Request(rid, [5] * 3, SamplingParams(max_tokens=n + extra, temperature=1.0, seed=extra,
                                                             structured_outputs=spec), grammar=g))
            schemas[rid] = schema
    finals = drive(sched, engine, reqs)
    assert len(finals) == len(reqs)
    for r in reqs:
        ids, reason, metrics = finals[r.request_id]
        check(vocab, schemas[r.request_id], ids, reason)
        assert metrics["structured_output"]["complete"] is True and len(ids) <= r.params.max_tokens


def sample(g: Grammar, max_tokens: int, rng: np.random.Generator, bias: np.ndarray | None = None) -> tuple[list[int], str]:
    """A request's tokens by random logits over each step's mask, as the iteration loop does."""
    g.limit(max_tokens)
    out: list[int] = []
    while True:
        seqs = [SeqWork("r", [1], 0, [])]
        fill_masks(seqs, [g])
        logits = rng.standard_normal(VOCAB) * 3 + (0 if bias is None else bias)
        logits[~allowed(seqs[0].allowed_token_bitmask)] = -np.inf
        p = np.exp(logits - logits.max())
        out.append(int(rng.choice(VOCAB, p=p / p.sum())))
        if reason := g.accept(out[-1]) or ("length" if len(out) >= max_tokens else None):
            return out, reason


@pytest.mark.parametrize("max_digits", [16, 3])
def test_numbers_keep_their_digits_bound(vocab, max_digits):
    """Digit-happy logits on any JSON object, numbers and a number array: no number gets more than
    structured.max_number_digits digits (a digit still due counted); a schema that needs more gets them."""
    c = Compiler(load_config(overrides={"structured.max_number_digits": max_digits}).structured, lambda: vocab)
    bias = np.zeros(VOCAB)
    bias[[t for t, b in enumerate(vocab.tables.token_bytes) if b and b.isdigit()]] = 8.0
    rng = np.random.default_rng(max_digits)
    for spec, schema in [(SO(json_object=True), OBJ), (SO(json=SCHEMAS["numbers"]), SCHEMAS["numbers"]),
                         (SO(json=SCHEMAS["matrix"]), SCHEMAS["matrix"])]:
        for _ in range(6):
            ids, reason = sample(c.compile(spec), 60, rng, bias)
            check(vocab, schema, ids, reason, max_digits)
    big = {"type": "integer", "minimum": 10**17}   # 18 digits
    ids, _ = sample(c.compile(SO(json=big)), 40, rng, bias)
    assert int(vocab.tokenizer.decode_bytes([t for t in ids if t != EOS])) >= 10**17


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=CONSTRAINT, extra=st.integers(0, 24), seed=st.integers(0, 2**16))
def test_any_accepted_constraint_finishes_within_its_budget(compiler, data, extra, seed):
    """Whatever the frontend accepts, at max_tokens from its shortest up: a JSON output is whole and
    parses; any other is what its grammar allows so far (forced to close too, without the guard
    that knows what opens more in JSON: a regex's text may need more than its plan said)."""
    try:
        params = SamplingParams.from_dict({"structured_outputs": data})
        params.validate(VOCAB)
        if params.structured_outputs is None:
            return
        n = compiler.shortest(params.structured_outputs)
    except InvalidRequest:
        return
    if n is None:   # no plan found (greedy and its search lost): no promise
        return
    g = compiler.compile(params.structured_outputs)
    ids, reason = sample(g, max(1, n) + extra, np.random.default_rng(seed))
    assert reason in ("stop", "length") and not g.matcher.is_error(), (data, reason)   # type: ignore[union-attr]
    if params.structured_outputs.kind in ("json", "json_object"):
        assert g.complete or g.matcher.is_accepting(), (data, reason)   # type: ignore[union-attr]   # "0", cut whole: length
        json.loads(g.vocab.tokenizer.decode_bytes([t for t in ids if t != EOS]))


def test_too_small_max_tokens_is_refused_up_front(compiler):
    """fit (admission's step 3) refuses a max_tokens below the shortest output, naming max_tokens;
    the shortest itself is served."""
    from orca_mq.admission.limits import fit
    from orca_mq.kv.pool import PoolSize

    spec = SO(json=SCHEMAS["person"])
    n = compiler.shortest(spec)
    pool = PoolSize(16, 4096 // 16, 0)
    params = SamplingParams(max_tokens=n - 1, structured_outputs=spec)
    with pytest.raises(InvalidRequest, match=rf"max_tokens \({n - 1}\) cannot hold any output the structured_outputs.json "
                                             rf"constraint allows: its shortest takes {n} tokens"):
        fit([5] * 3, params, 4096, VOCAB, pool, n)
    assert fit([5] * 3, SamplingParams(max_tokens=n, structured_outputs=spec), 4096, VOCAB, pool, n).max_tokens == n
    with pytest.raises(InvalidRequest, match="tokens the prompt leaves"):   # max_tokens absent: the room left is too small
        fit([5] * (4096 - n + 1), SamplingParams(max_tokens=None, structured_outputs=spec), 4096, VOCAB, pool, n)


@pytest.fixture(scope="module")
def tiny_llm(tiny_served_dir):
    from orca_mq import LLM
    return LLM(model=str(tiny_served_dir), dtype="float32", max_bs=16, n_slots=8192)


def test_random_weight_model_offline(tiny_llm):
    """A random-weight model (fp32) under every schema at max_tokens just above its shortest, and
    with room: each output stops and validates; a max_tokens below the shortest is refused."""
    llm = tiny_llm
    jobs = []
    for name, spec, schema in SPECS:
        n = llm.model.grammars.shortest(spec)
        jobs += [(name, spec, schema, n + extra, seed) for extra in (1, 4, 30) for seed in range(2)]
    outs = llm.generate(["Write JSON:"] * len(jobs), [SamplingParams(max_tokens=m, temperature=1.0, seed=seed,
                                                                     structured_outputs=spec) for _, spec, _, m, seed in jobs])
    for (name, _, schema, m, _), out in zip(jobs, outs):
        assert out.finish_reason == "stop" and len(out.token_ids) <= m, (name, m, out.text)
        jsonschema.validate(json.loads(out.text), schema)
        assert digits_of(out.text.encode()) <= 16 and out.metrics["scheduler"]["structured_output"]["complete"] is True
    spec = SO(json=SCHEMAS["points"])
    n = llm.model.grammars.shortest(spec)
    with pytest.raises(InvalidRequest, match=rf"max_tokens \({n - 1}\) cannot hold any output"):
        llm.generate("Write JSON:", SamplingParams(max_tokens=n - 1, structured_outputs=spec))
    assert llm.generate("Hi", SamplingParams(max_tokens=4, temperature=0))[0].finish_reason in ("stop", "length")


def test_a_closing_plan_costs_the_others_at_most_the_planning_budget(compiler, vocab):
    """[Ѐ-ӿ]{400} at max_tokens = its shortest + 20: near the end every token the model picks leaves the
    plan, which was walked again from scratch, up to 256 matcher calls a byte (issue 44: 222 ms of the
    scheduler's loop for one step of a 900-letter one). Beside a free request, each step's planning
    stays within structured.plan_budget (the plan shifted by the token that left it is checked first;
    a walk that does not fit goes on at the next step, the request sitting out), the free request
    gets its token every iteration, and the constrained one still finishes whole."""
    spec = SO(regex="[\u0400-\u04ff]{400}")
    n = compiler.shortest(spec)
    g = compiler.compile(spec)
    g.limit(n + 20)
    attacker = Request("a", [5] * 3, SamplingParams(max_tokens=n + 20, temperature=1.0, seed=1, structured_outputs=spec),
                       grammar=g)
    bystander = Request("b", [5] * 3, SamplingParams(max_tokens=200, temperature=1.0, seed=2, ignore_eos=True))
    sched = make_scheduler(load_config(), INFO)
    engine, out, results, worst, steps_beside = Engine([]), {"a": [], "b": []}, [], 0.0, 0
    sched.add(attacker)
    reason = None
    while sched.has_work():
        if len(out["a"]) == 10:
            sched.add(bystander)
        beside = "b" in sched.pool
        t = time.process_time()
        step = sched.step(0.0, results)
        if beside:
            worst, steps_beside = max(worst, time.process_time() - t), steps_beside + 1
            assert worst < 0.05, f"a step took {worst * 1e3:.0f} ms of CPU beside the constrained request"   # main: 123, now 10
        for e in step.events:
            out[e.request_id] += [e.token_id] if e.token_id is not None else []
            reason = e.finish_reason if e.request_id == "a" and e.finish_reason else reason
        results = [engine.execute(p) for p in step.plans]
    assert len(out["b"]) == 200 and steps_beside <= 201   # a token every iteration
    text = vocab.tokenizer.decode_bytes([t for t in out["a"] if t != EOS]).decode()
    assert reason == "stop" and re.fullmatch("[\u0400-\u04ff]{400}", text), (reason, len(text))
