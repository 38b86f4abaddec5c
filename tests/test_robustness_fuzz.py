"""Property-based fuzz (hypothesis): no frame and no sampling value gets past its check to fail later.

- frame decoding, for every channel: arbitrary msgpack values, near-valid frames and raw bytes
  decode to a message that channel accepts or raise ProtocolError, nothing else;
- validation into the real sampler: whatever SamplingParams.validate accepts travels in a control
  frame and samples without failing; whatever it rejects raises InvalidRequest.
"""
from __future__ import annotations

import dataclasses
import math

import msgpack
import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orca_mq.engine.logprobs import sampled_logprobs
from orca_mq.engine.sampler import SamplingRows, failed_rows, sample
from orca_mq.protocol import ProtocolError, decode, encode
from orca_mq.protocol import client_msgs, control_msgs, engine_msgs
from orca_mq.protocol.codec import _REGISTRY, channel
from orca_mq.engine.history import TokenHistory
from orca_mq.protocol.iteration import IterationPlan, SeqWork, pack
from orca_mq.sched.processors import add_extras
from orca_mq.sched.request import Phase, Request
from orca_mq.protocol.sampling import InvalidRequest, SamplingParams

CHANNELS = [
    client_msgs.TO_SERVER, client_msgs.TO_CLIENT,
    channel(*(c for c in vars(control_msgs).values() if isinstance(c, type) and hasattr(c, "TYPE"))),
    channel(*(c for c in vars(engine_msgs).values() if isinstance(c, type) and hasattr(c, "TYPE"))),
    frozenset(_REGISTRY),
]
EDGE_INTS = st.sampled_from([0, 1, -1, 2, 511, 512, (1 << 31) - 1, 1 << 31, (1 << 63) - 1, -(1 << 63), (1 << 64) - 1])
INTS = st.one_of(EDGE_INTS, st.integers(-(1 << 63), (1 << 64) - 1))
FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                   st.sampled_from([0.0, -0.0, 1e-320, 1e-30, 1e-4, 1e-3, 0.5, 1.0, 100.0, 100.5, 1e308]))
SCALARS = st.one_of(st.none(), st.booleans(), INTS, FLOATS, st.text(max_size=20), st.binary(max_size=20))
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=5),
    st.dictionaries(st.one_of(st.text(max_size=8), st.binary(max_size=8)), inner, max_size=5)), max_leaves=8)


@st.composite
def near_valid_frames(draw: st.DrawFn) -> bytes:
    """A header of a real type (or a broken one) and that type's field names with arbitrary values."""
    name = draw(st.sampled_from(sorted(_REGISTRY)))
    body: dict[object, object] = {"v": draw(st.one_of(st.sampled_from([1, 2, 3, 4, 4, 5, 5]), VALUES)),
                                  "type": draw(st.one_of(st.just(name), st.just(name), VALUES))}
    for f in dataclasses.fields(_REGISTRY[name]):
        if draw(st.integers(0, 9)):  # mostly present
            body[f.name] = draw(VALUES)
    body.update(draw(st.dictionaries(st.one_of(st.text(max_size=8), st.binary(max_size=8)), VALUES, max_size=2)))
    return msgpack.packb(body, use_bin_type=True)


FRAMES = st.one_of(
    near_valid_frames(),
    VALUES.map(lambda v: msgpack.packb(v, use_bin_type=True)),
    st.binary(max_size=64),
    near_valid_frames().flatmap(lambda f: st.integers(0, len(f)).map(lambda n: f[:n])),  # truncated
)


# 400 frames across the channels (drawing one is ~20 ms of hypothesis); tools/bench_reliability.py sends 100,000 to a server
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frame=FRAMES, accepted=st.sampled_from(CHANNELS))
def test_any_frame_decodes_or_raises_protocol_error(frame: bytes, accepted: frozenset[str]) -> None:
    try:
        msg = decode(frame, accepted)
    except ProtocolError:
        return
    assert msg.TYPE in accepted


ANY = st.one_of(INTS, FLOATS, st.booleans(), st.none(), st.text(max_size=5), st.lists(st.one_of(INTS, FLOATS), max_size=3))
TYPED = {"max_tokens": INTS, "temperature": FLOATS, "top_k": INTS, "top_p": FLOATS, "seed": st.one_of(st.none(), INTS),
         "ignore_eos": st.booleans(), "skip_special_tokens": st.booleans(),
         "stop_token_ids": st.lists(st.one_of(st.integers(0, 600), INTS, st.booleans()), max_size=4),
         "logprobs": st.one_of(st.none(), st.integers(-2, 25), INTS), "prompt_logprobs": st.one_of(st.none(), st.integers(-2, 25), INTS),
         "presence_penalty": FLOATS, "frequency_penalty": FLOATS, "repetition_penalty": FLOATS, "min_p": FLOATS,
         "min_tokens": INTS, "logit_bias": st.dictionaries(st.one_of(st.integers(0, 600), st.integers(0, 600).map(str),
                                                                     st.text(max_size=3)), st.one_of(FLOATS, INTS), max_size=4)}
SAMPLING = st.one_of(
    st.fixed_dictionaries({k: TYPED[k] for k in ("temperature", "top_k", "top_p", "seed", "logprobs")}),  # what the sampler reads
    st.fixed_dictionaries({}, optional={**{k: st.one_of(v, ANY) for k, v in TYPED.items()}, "best_of": INTS}))
VOCAB = 512
MAX_LOGPROBS = 20   # model.max_logprobs' default


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=SAMPLING, seed=st.integers(0, 2**32 - 1), seq_len=st.integers(1, 4096))
def test_what_validation_accepts_the_sampler_runs(data: dict[str, object], seed: int, seq_len: int) -> None:
    try:
        params = SamplingParams.from_dict(data)
        params.validate(VOCAB)
        params.validate_logprobs(MAX_LOGPROBS)   # admission's bound (model.max_logprobs)
    except InvalidRequest:
        return  # rejected: InvalidRequest and nothing else
    seq = SeqWork("r", [1], seq_len - 1, [0], params.temperature, params.top_k, params.top_p, params.seed)
    seq.logprobs = -1 if params.logprobs is None else params.logprobs
    plan = IterationPlan(1, [seq, SeqWork("other", [2], 0, [1], 0.8, 40, 0.9, 7)])
    wire = decode(encode(engine_msgs.ControlFrame(pack(plan), 0.0)), channel(engine_msgs.ControlFrame)).plan
    rows = SamplingRows.of(wire.arrays())   # it travels to the worker unchanged, as float32 / int32 / int64
    assert (rows.temperature[0], rows.top_k[0], rows.top_p[0], rows.seeds[0]) == (
        np.float32(seq.temperature), seq.top_k, np.float32(seq.top_p), -1 if seq.seed is None else seq.seed)
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(seed)) * 5
    drawn = sample(logits, rows)
    tokens, failed = drawn.tokens.tolist(), failed_rows(drawn.ok.tolist(), drawn.failed)
    assert failed == [] and all(0 <= t < VOCAB for t in tokens)
    if params.top_k > 0:
        assert tokens[0] in logits[0].topk(min(params.top_k, VOCAB)).indices.tolist()
    if params.temperature > 0:  # one the requested distribution can draw (a NaN overflow picks any)
        assert (logits[0].double() / params.temperature).softmax(-1)[tokens[0]] > 0
    lp = sampled_logprobs(logits, drawn.tokens, wire.arrays(), np.arange(2))   # the last stage's, where asked
    if params.logprobs is None:
        assert lp is None
    else:
        (entry,) = lp.copy().entries([tokens[0]])
        assert entry.token_ids == [tokens[0]] and len(entry.top_ids[0]) == params.logprobs
        assert math.isfinite(entry.logprobs[0]) and entry.logprobs[0] <= 0
    assert math.isfinite(params.temperature) and (params.max_tokens is None or params.max_tokens >= 1)  # None: the rest of the context


PROCESSORS = st.fixed_dictionaries(
    {"temperature": st.one_of(st.just(0.0), st.floats(1e-3, 100)), "top_k": st.integers(0, 600),
     "top_p": st.floats(0.01, 1), "seed": st.one_of(st.none(), st.integers(0, (1 << 63) - 1))},
    optional={"presence_penalty": st.one_of(st.floats(-2, 2), FLOATS), "frequency_penalty": st.one_of(st.floats(-2, 2), FLOATS),
              "repetition_penalty": st.one_of(st.floats(0.01, 100), FLOATS), "min_p": st.one_of(st.floats(0, 1), FLOATS),
              "min_tokens": st.one_of(st.integers(0, 20), INTS), "ignore_eos": st.booleans(),
              "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=4), "max_tokens": st.one_of(st.none(), st.integers(1, 40)),
              "logit_bias": st.one_of(st.dictionaries(st.one_of(st.integers(0, 600), st.integers(0, 600).map(str), st.text(max_size=3)),
                                                      st.one_of(st.floats(-100, 100), FLOATS, INTS), max_size=6), ANY)})


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=PROCESSORS, seed=st.integers(0, 2**32 - 1), generated=st.integers(0, 30), prompt_len=st.integers(1, 40))
def test_what_validation_accepts_the_logits_processors_run(data: dict[str, object], seed: int, generated: int,
                                                           prompt_len: int) -> None:
    """Penalties, min_p, logit_bias and min_tokens: what validation accepts becomes a row's RowExtras
    (the scheduler's), travels in a control frame and samples with a token history, never failing."""
    try:
        params = SamplingParams.from_dict(data)
        params.validate(VOCAB)
        params.validate_logit_bias(1024, VOCAB - 1)   # admission's bound (model.max_logit_bias)
    except InvalidRequest:
        return
    req = Request("r", list(range(3, 3 + prompt_len)), params)
    req.output_token_ids, req.phase = [5] * generated, Phase.INCREMENT if generated else Phase.INITIATION
    tokens, start = req.next_tokens()
    row = SeqWork("r", tokens, start, [0, 1, 2], params.temperature, params.top_k, params.top_p, params.seed)
    other = SeqWork("other", [2], 0, [3], 0.8, 40, 0.9, 7)
    add_extras([row, other], [req, Request("other", [2], SamplingParams())], {2})
    assert (row.extra is not None) == params.processed and other.extra is None
    wire = decode(encode(engine_msgs.ControlFrame(pack(IterationPlan(1, [row, other])), 0.0)), channel(engine_msgs.ControlFrame)).plan
    history = TokenHistory(VOCAB, torch.device("cpu"))
    a = wire.arrays()
    assert history.begin(a) == []
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(seed)) * 5
    drawn = sample(logits, SamplingRows.of(a), history=history)
    token, failed = drawn.tokens.tolist()[0], failed_rows(drawn.ok.tolist(), drawn.failed)
    assert failed == [] and 0 <= token < VOCAB
    if generated < params.min_tokens:   # banned until min_tokens: EOS (unless ignored) and the stop ids
        assert token not in params.stop_token_ids and (params.ignore_eos or token != 2)
    if params.penalized:
        assert int(history.counts[history.slots["r"]].sum()) == 1 and bool(history.seen[history.slots["r"], token])
