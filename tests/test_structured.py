"""Structured outputs without a model: constraint checks, compile bounds and cache, masks against a
brute-force oracle at batch 1 and 32, and the scheduler driving grammars through the real sampler
on a fake engine whose logits depend only on (request, position): outputs validate, the EOS rule
holds, and FastServe's preemption and KV offload leave every matcher where it was."""
from __future__ import annotations

import asyncio
import json
import random
import re
import time
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import numpy as np
import pytest
import torch

from orca_mq.config import load_config
from orca_mq.engine import sampler
from orca_mq.models.info import ModelInfo
from orca_mq.errors import InvalidRequest
from orca_mq.protocol.iteration import IterationPlan, IterationResult, SeqWork
from orca_mq.protocol.sampling import SamplingParams
from orca_mq.sched import make_scheduler
from orca_mq.sched.fastserve import FastServeScheduler
from orca_mq.sched.profiler import IterationProfile
from orca_mq.sched.request import Request
from orca_mq.structured.bitmask import fill_masks
from orca_mq.structured.compiler import Compiler, bounded
from orca_mq.structured.grammar import Vocabulary
from orca_mq.protocol.structured import StructuredOutputsParams as SO
from orca_mq.tokenizer import load_tokenizer

VOCAB = 49152
EOS = 2
INFO = ModelInfo("fake", "llama", VOCAB, 64, 2, 4, 2, 128, 1e-5, 4096, eos_token_ids=[EOS])
PERSON = {  # every value bounded, so random logits finish it well within max_tokens
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 1, "maxItems": 3},
        "owner": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                                                   "email": {"type": ["string", "null"], "maxLength": 6}},
                  "required": ["id", "email"], "additionalProperties": False},
    },
    "required": ["name", "kind", "age", "tags", "owner"], "additionalProperties": False,
}
REGEX = r"[a-z]{2,4}-[0-9]{2}"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("", load_config().model.cache_dir)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return Compiler(load_config().structured, lambda: Vocabulary.of(tokenizer, VOCAB, [EOS], 0))


def allowed(mask: bytes) -> np.ndarray:
    return np.unpackbits(np.frombuffer(mask, np.uint8), bitorder="little")[:VOCAB].astype(bool)


# ---------------------------------------------------------------- the constraint


@pytest.mark.parametrize("data, needle", [
    ({}, "exactly one"),
    ({"json": {"type": "object"}, "regex": "a"}, "exactly one"),
    ({"regex": ""}, "regex must be a non-empty string"),
    ({"choice": []}, "choice must be"),
    ({"choice": ["a", 3]}, "choice must be"),
    ({"json": 5}, "json must be"),
    ({"json_object": False}, "json_object must be true"),
])
def test_bad_shapes_are_refused_by_validate(data, needle):
    with pytest.raises(InvalidRequest, match=needle):
        SamplingParams.from_dict({"structured_outputs": data}).validate()


def test_unknown_fields_and_non_objects_are_refused_at_parse():
    with pytest.raises(InvalidRequest, match="unknown field"):
        SamplingParams.from_dict({"structured_outputs": {"json": {}, "whitespace_pattern": " "}})
    with pytest.raises(InvalidRequest, match="expected an object"):
        SamplingParams(structured_outputs="json")  # type: ignore[arg-type]


def test_sampling_params_round_trip_with_a_constraint():
    p = SamplingParams(structured_outputs={"json": PERSON})  # type: ignore[arg-type]
    assert isinstance(p.structured_outputs, SO) and p.structured_outputs.kind == "json"
    assert SamplingParams.from_dict(p.to_dict()) == p


@pytest.mark.parametrize("spec, needle", [
    (SO(json={"type": "foo"}), "Invalid type"),
    (SO(json="{not json"), "not valid JSON"),
    (SO(json={"type": "integer", "minimum": 5, "maximum": 2}), "Unsatisfiable"),
    (SO(json={"type": "string", "pattern": "[a-"}), "unclosed character class"),
    (SO(json={"type": "array", "uniqueItems": True}), "Unimplemented keys"),   # refused, never silently ignored
    (SO(json={"$ref": "#/nope"}), "does not exist"),
    (SO(regex="[a-"), "unclosed character class"),
    (SO(regex="(a"), "unclosed group"),
    (SO(regex="(" * 300 + ")" * 300), "regex"),
    (SO(grammar="start: undefined_rule"), "unknown name"),
    (SO(grammar='root ::= "a'), "GBNF"),
])
def test_bad_constraints_are_refused_with_their_reason(compiler, spec, needle):
    with pytest.raises(InvalidRequest, match=re.escape(needle)) as e:
        compiler.check(spec)
    assert len(str(e.value)) < 400 and "\n" not in str(e.value)


def test_deep_nesting_is_refused_not_a_crash(compiler):
    schema: dict = {"type": "integer"}
    for _ in range(400):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    with pytest.raises(InvalidRequest, match="recursion"):
        compiler.check(SO(json=schema))
    deeper: dict = {"type": "integer"}
    for _ in range(5000):  # beyond Python's own recursion limit
        deeper = {"items": deeper}
    with pytest.raises(InvalidRequest):
        compiler.check(SO(json=deeper))


def test_size_bound_cache_bound_and_reuse():
    cfg = load_config(overrides={"structured.max_spec_bytes": 200, "structured.cache_size": 3}).structured
    c = Compiler(cfg)
    with pytest.raises(InvalidRequest, match="max_spec_bytes"):
        c.check(SO(regex="a" * 201))
    for i in range(5):
        c.check(SO(regex=f"a{{{i}}}"))
    assert c.cached == 3
    first = c._entry(SO(regex="a{4}"))
    assert c._entry(SO(regex="a{4}")) is first   # compiled once


def test_compile_time_bound():
    def slow(_: SO, deadline: float) -> None:
        time.sleep(0.3)

    with ThreadPoolExecutor(1) as pool, pytest.raises(InvalidRequest, match="did not compile within 0.05 s"):
        asyncio.run(bounded(pool, slow, SO(regex="a"), 0.05))


# ---------------------------------------------------------------- masks


def advanced(compiler, rng: random.Random, n: int):
    """n grammars of several kinds, each advanced by a random number of random allowed tokens."""
    specs = [SO(json=PERSON), SO(regex=REGEX), SO(choice=["yes", "no", "maybe"]), SO(json_object=True),
             SO(grammar='root ::= "x" [0-9]+ ("," [0-9]+)*')]
    grammars = []
    for i in range(n):
        g = compiler.compile(specs[i % len(specs)])
        for _ in range(rng.randrange(8)):
            seqs = [SeqWork("r", [1], 0, [])]
            fill_masks(seqs, [g])
            choices = [t for t in np.flatnonzero(allowed(seqs[0].allowed_token_bitmask)) if t != EOS]
            if not choices or g.accept(int(rng.choice(choices))):
                break
        grammars.append(g)
    return grammars


@pytest.mark.parametrize("batch", [1, 32])
def test_masks_are_exact(compiler, tokenizer, batch):
    """A batch's masks equal each row's alone, and each allows exactly the tokens the grammar
    accepts (llguidance's token-by-token check over the whole vocabulary), EOS only where complete.
    Where the grammar forces bytes (a required key's name), llguidance allows only their canonical
    tokenization: a subset that holds the tokenizer's own first token for them."""
    grammars = advanced(compiler, random.Random(batch), batch)
    seqs = [SeqWork(f"r{i}", [1], 0, []) for i in range(batch)]
    fill_masks(seqs, grammars)
    for i, g in enumerate(grammars):
        alone = [SeqWork("a", [1], 0, [])]
        fill_masks(alone, [g])
        assert seqs[i].allowed_token_bitmask == alone[0].allowed_token_bitmask
        assert len(seqs[i].allowed_token_bitmask) == sampler.mask_bytes(VOCAB)
    for i in range(0, batch, max(1, batch // 8)):   # the oracle costs ~0.1 s a row
        m, mask = grammars[i].matcher, allowed(seqs[i].allowed_token_bitmask)
        oracle = np.array([m.validate_tokens([t]) == 1 for t in range(VOCAB)])
        oracle[EOS] = m.is_accepting()
        forced = m.compute_ff_bytes().decode()
        if forced:
            assert (mask <= oracle).all() and mask[tokenizer.encode(forced, add_special_tokens=False)[0]]
        else:
            assert (mask == oracle).all(), f"row {i}: {np.flatnonzero(mask != oracle)[:10]}"
        assert mask.any()


def test_free_and_pending_rows_get_no_mask(compiler):
    seqs = [SeqWork("a", [1], 0, []), SeqWork("b", [1], 0, [])]
    fill_masks(seqs, [None, compiler.compile(SO(regex="a+"))])
    assert seqs[0].allowed_token_bitmask is None and seqs[1].allowed_token_bitmask is not None


# ---------------------------------------------------------------- in the iteration loop


class LogitsEngine:
    """Logits that depend only on (request, position): a request's seeded tokens are then the
    same alone, in any batch and across preemptions, unless its matcher state changed. Runs
    plans through the real sampler, masks included."""

    def __init__(self, bias: dict[int, float] | None = None) -> None:
        self.bias = bias or {}

    def logits(self, rid: str, pos: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(hash((rid, pos)) & 0xFFFFFFFF)
        row = torch.randn(VOCAB, generator=g) * 3
        for t, b in self.bias.items():
            row[t] += b
        return row

    def execute(self, plan: IterationPlan) -> IterationResult:
        logits = torch.stack([self.logits(s.request_id, s.seq_len) for s in plan.seqs])
        tokens, failed = sampler.sample_seqs(logits, plan.seqs)
        return IterationResult(plan.iteration, tokens,
                               [plan.seqs[b].request_id for b in failed])


def drive(sched, engine, reqs, arrivals=None) -> dict[str, tuple[list[int], str, dict | None]]:
    """The scheduler's one loop (`step`) over the engine; arrivals at their times."""
    finals: dict[str, tuple[list[int], str, dict | None]] = {}
    out: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    pending, results, now = list(reqs), [], 0.0
    while pending or sched.has_work():
        while pending and (arrivals is None or arrivals[pending[0].request_id] <= now):
            sched.add(pending.pop(0))
        step = sched.step(now, results)
        for e in step.events:
            if e.token_id is not None:
                out[e.request_id].append(e.token_id)
            if e.finish_reason:
                finals[e.request_id] = (out[e.request_id], e.finish_reason, e.metrics)
        for plan in step.plans:  # a mask exactly on the constrained rows that sample (a prompt's last chunk, or a decode)
            for seq in plan.seqs:
                r = sched.pool[seq.request_id]
                assert (seq.allowed_token_bitmask is not None) == (r.grammar is not None and not r.prompt_pending)
        results = [engine.execute(plan) for plan in step.plans]
        assert results or pending or not sched.has_work(), "stalled"
        now += 0.01
    return finals


def text(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def constrained(compiler, rid: str, spec: SO, max_tokens: int = 160, seed: int = 0, prompt: int = 3) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, structured_outputs=spec)
    return Request(rid, [5] * prompt, params, grammar=compiler.compile(spec))


def test_sampled_outputs_validate_and_free_rows_are_untouched(compiler, tokenizer):
    """Chunked prefill (a 40-token prompt over several iterations samples nothing until its last
    chunk), constrained and free rows in one batch, several seeds: every constrained output
    validates; the free row's tokens equal its tokens alone."""
    sched = make_scheduler(load_config(overrides={"engine.block_size": 4, "engine.n_slots": 4096, "scheduler.max_bs": 8,
                                                  "scheduler.max_num_batched_tokens": 16}), INFO)
    engine = LogitsEngine()
    reqs = [constrained(compiler, f"j{s}", SO(json=PERSON), seed=s, prompt=40 if s == 0 else 3) for s in range(4)]
    reqs += [constrained(compiler, "re", SO(regex=REGEX), seed=9), constrained(compiler, "ch", SO(choice=["yes", "no"]), seed=3)]
    free = Request("free", [5] * 3, SamplingParams(max_tokens=30, temperature=1.0, seed=1, ignore_eos=True))
    finals = drive(sched, engine, [*reqs, free])
    for s in range(4):
        ids, reason, metrics = finals[f"j{s}"]
        assert reason == "stop" and metrics == {"structured_output": {"constraint": "json", "complete": True, "tokens": len(ids)}}
        jsonschema.validate(json.loads(text(tokenizer, ids)), PERSON)
    assert re.fullmatch(REGEX, text(tokenizer, finals["re"][0])) and finals["re"][1] == "stop"
    assert text(tokenizer, finals["ch"][0]) in ("yes", "no")
    alone = drive(make_scheduler(load_config(overrides={"engine.n_slots": 4096}), INFO), engine,
                  [Request("free", [5] * 3, SamplingParams(max_tokens=30, temperature=1.0, seed=1, ignore_eos=True))])
    assert finals["free"][0] == alone["free"][0] and finals["free"][2] is None


def test_eos_only_where_the_grammar_accepts(compiler, tokenizer):
    """EOS strongly favoured by the logits: an unbounded regex ends at its first accepting point,
    never before; a schema never ends early; max_tokens cuts one with "length" and says so."""
    sched = make_scheduler(load_config(overrides={"engine.n_slots": 4096}), INFO)
    engine = LogitsEngine({EOS: 50.0})
    reqs = [constrained(compiler, "num", SO(regex="[0-9]{3,}")), constrained(compiler, "js", SO(json=PERSON)),
            constrained(compiler, "cut", SO(json=PERSON), max_tokens=4)]
    finals = drive(sched, engine, reqs)
    ids, reason, _ = finals["num"]
    assert reason == "stop" and ids[-1] == EOS and re.fullmatch("[0-9]{3}", text(tokenizer, ids))
    jsonschema.validate(json.loads(text(tokenizer, finals["js"][0])), PERSON)
    ids, reason, metrics = finals["cut"]
    assert reason == "length" and len(ids) == 4
    assert metrics == {"structured_output": {"constraint": "json", "complete": False, "tokens": 4}}


def test_fastserve_preemption_and_offload_keep_the_matcher(compiler, tokenizer):
    """Eight constrained jobs on FastServe with room for two at a time and a KV pool that forces
    offloads: most jobs are preempted, demoted and swapped out and back, and each one's tokens equal its
    tokens run alone (any change to its matcher state would change them, or break the JSON)."""
    cfg = load_config(overrides={"engine.block_size": 4, "engine.n_slots": 64 * 4, "engine.host_slots": 1024 * 4,
                                 "scheduler.max_bs": 2, "scheduler.max_num_batched_tokens": 0,
                                 "fastserve.min_free_blocks": 30, "fastserve.burst_queues": 2})
    sched = FastServeScheduler(cfg, INFO, IterationProfile([(1, 0.001), (1000, 1.0)], [(1, 0.010), (64, 0.020)]))
    for n in [1] * 90 + [400] * 10:   # heavy-tailed lengths: a started job is expected to run long, so arrivals may take its room
        sched.lengths.observe(n, True)
    sched.lengths.refresh([])
    engine = LogitsEngine()
    specs = [SO(json=PERSON), SO(regex=REGEX)]
    reqs = [constrained(compiler, f"r{i}", specs[i % 2], seed=i, prompt=3 + 5 * i) for i in range(8)]
    finals = drive(sched, engine, reqs, arrivals={r.request_id: 0.004 * i for i, r in enumerate(reqs)})
    metrics = [sched.request_metrics(r.request_id) for r in reqs]
    assert sum(m["preempted_s"] > 0 for m in metrics) >= 4
    assert sum(m["offloads"] > 0 for m in metrics) >= 2
    for i, r in enumerate(reqs):
        alone = drive(make_scheduler(load_config(overrides={"engine.n_slots": 4096}), INFO), engine,
                      [constrained(compiler, r.request_id, specs[i % 2], seed=i, prompt=3 + 5 * i)])
        assert finals[r.request_id][0] == alone[r.request_id][0], r.request_id
        assert finals[r.request_id][1] == "stop"
        out = text(tokenizer, finals[r.request_id][0])
        if i % 2:
            assert re.fullmatch(REGEX, out)
        else:
            jsonschema.validate(json.loads(out), PERSON)


# ---------------------------------------------------------------- fuzz


from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

LEAF = st.none() | st.booleans() | st.integers(-3, 40) | st.text("ab0-9[]{}()*+?|^$.\\\"' ", max_size=8)
JSONISH = st.recursive(LEAF, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text("abtype", max_size=5), kids, max_size=3),
                       max_leaves=10)
SCHEMA = st.recursive(
    st.fixed_dictionaries({"type": st.sampled_from(["integer", "string", "boolean", "null", "number"])},
                          optional={"minimum": st.integers(-5, 5), "maximum": st.integers(-5, 50), "maxLength": st.integers(0, 6),
                                    "pattern": st.sampled_from(["^[a-z]+$", "[0-9]{2}", "(", "a|b"]), "enum": st.lists(LEAF, max_size=3)}),
    lambda kids: st.fixed_dictionaries({"type": st.just("object"), "properties": st.dictionaries(st.text("abc", min_size=1, max_size=3), kids, max_size=3)},
                                       optional={"required": st.lists(st.text("abc", min_size=1, max_size=3), max_size=2),
                                                 "additionalProperties": st.booleans()})
    | st.fixed_dictionaries({"type": st.just("array"), "items": kids},
                            optional={"minItems": st.integers(0, 3), "maxItems": st.integers(0, 3)})
    | st.fixed_dictionaries({"anyOf": st.lists(kids, max_size=3)}),
    max_leaves=6)
CONSTRAINT = st.one_of(
    st.fixed_dictionaries({"json": SCHEMA}),
    st.fixed_dictionaries({"regex": st.sampled_from(["a+", "[0-9]{2,4}", "(ab|c)*d", "^x?y$", ".{1,3}", "[^a]*"])
                           | st.text("ab0-9[]{}()*+?|^$.", min_size=1, max_size=10)}),
    st.fixed_dictionaries({"choice": st.lists(st.text("ab c\"{", min_size=1, max_size=4), min_size=1, max_size=3)}),
    st.fixed_dictionaries({"grammar": st.sampled_from(['root ::= "a" [0-9]*', "start: /[a-c]+/", 'root ::= x', "start: "])
                           | st.text("ab:=|\"()* ", min_size=1, max_size=12)}),
    st.dictionaries(st.sampled_from(["json", "regex", "choice", "grammar", "json_object", "bogus"]),
                    SCHEMA | JSONISH | st.lists(st.text("abc ", max_size=4), max_size=3), max_size=2) | JSONISH,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=CONSTRAINT, seed=st.integers(0, 2**16))
def test_what_the_frontend_accepts_compiles_and_always_allows_a_token(compiler, data, seed):
    """The new field through SamplingParams, validation and the frontend's check: InvalidRequest or
    accepted, nothing else; and what is accepted compiles at the scheduler, where every mask along
    a random walk allows some token."""
    try:
        params = SamplingParams.from_dict({"structured_outputs": data})
        params.validate(VOCAB)
        if params.structured_outputs is None:   # null: no constraint
            return
        compiler.check(params.structured_outputs)
    except InvalidRequest:
        return
    g = compiler.compile(params.structured_outputs)
    rng = random.Random(seed)
    for _ in range(12):
        seqs = [SeqWork("r", [1], 0, [])]
        fill_masks(seqs, [g])
        choices = np.flatnonzero(allowed(seqs[0].allowed_token_bitmask))
        assert len(choices), "a mask that allows nothing"
        if g.accept(int(rng.choice(choices))):
            break
    g.release()
    assert g.matcher is None and set(g.report()) == {"constraint", "complete", "tokens"}
