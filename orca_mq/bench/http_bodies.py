"""The hypothesis strategies orca_mq.bench.http_fuzz sends to the two generation routes and the embeddings
route, each a (path, payload, content type, expectation) request, in three families:

- `wild`: bodies the schema knows nothing of (the request fields, known, unsupported and misspelt,
  with JSON values of every kind and magnitude, bodies that are not objects, not JSON, not UTF-8,
  odd content types): anything may be refused, nothing may fail;
- `served`: bodies built to be accepted (every field within its bounds, the prompt short enough for
  the context whatever its characters): each must get 200;
- `refused`: a served body with one field made wrong (an unknown name, a value of the wrong type or out
  of its bounds): each must get 400 naming that field.

The last two hold by construction, whatever a hypothesis version chooses to draw, so a caller's
"some served, some refused" never rests on the fuzzer's luck. What "within its bounds" assumes of a
server: a vocabulary of at least TOKEN_IDS ids, server.http_max_n >= 2, model.max_logprobs >= 2,
model.max_logit_bias >= 3 and server.http_max_embedding_inputs >= 2 (the defaults: 16, 20, 1024, 128); the
context is asked (/tokenize).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

from orca_mq.protocol.sampling_fields import FIELDS, INT32_MAX, INT64_MAX, SamplingField

PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings")
GENERATION = PATHS[:2]
MAX_TOKENS = 4      # what is served costs milliseconds
TOKEN_IDS = 256     # ids below it are in any real vocabulary
BYTES_PER_CHAR = 4  # UTF-8: a byte-level tokenizer spends at most a token a byte


@dataclass(frozen=True, slots=True)
class Expect:
    """What a request must get: `served` 200, else a refusal naming `param` (None: any refusal, no 5xx)."""

    served: bool = False
    param: str | None = None


ANY, SERVED = Expect(), Expect(served=True)
Request = tuple[str, bytes, str, Expect]


def encode(body: Any) -> bytes:
    return json.dumps(body, allow_nan=True).encode()   # NaN / Infinity tokens: Python's json reads them


# ---------------------------------------------------------------- wild

_NAMES = ["prompt", "messages", "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
          "stop", "stream", "stream_options", "n", "logprobs", "top_logprobs", "echo", "user", "ignore_eos", "stop_token_ids",
          "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "min_p", "logit_bias", "tools",
          "response_format", "skip_special_tokens", "chat_template_kwargs", "input", "encoding_format", "dimensions",
          "pooling", "normalize", "temprature", "", "\x00", "é"]
_EDGE = st.sampled_from([0, 1, -1, 2**31, 2**63, 2**64, 10**30, 2**200, -(2**200), 1e30, 1e308, -1e308, 0.5, 1e-320,
                         math.inf, -math.inf, math.nan, True, False, None, "", "x" * 300, [], {}])
_JSON = st.recursive(st.one_of(_EDGE, st.integers(), st.floats(), st.text(max_size=20), st.booleans(), st.none()),
                     lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                     max_leaves=10)
_MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]),
                                  "content": st.one_of(st.text(max_size=20), _JSON)},
                                 optional={"name": _JSON, "extra": _JSON})
_ASK = [{"role": "user", "content": "Hi"}]
_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
# issue 44's shapes: what one request could cost the others
_SHAPES = st.one_of(
    st.builds(lambda n: {"messages": _ASK, "tools": [_TOOL], "structured_outputs": {"regex": "<tool_call> +"},
                         "logit_bias": {"40686": 100}, "n": n}, st.integers(1, 17)),   # a tag and a run of 64 spaces
    st.builds(lambda depth: {"messages": [*_ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[" * depth + "]" * depth}}]}]},
        st.integers(1, 100_000)),                                                       # arguments nested deep
    st.builds(lambda k, n, extra: {"messages": _ASK, "structured_outputs": {"regex": f"[\u0400-\u04ff]{{{k}}}"}, "n": n,
                                   "max_tokens": 2 * k + extra}, st.integers(1, 40), st.integers(1, 17), st.integers(0, 20)),
    st.fixed_dictionaries({"prompt": st.lists(st.integers(0, 49151), min_size=1, max_size=400), "echo": st.booleans(),
                           "logprobs": st.integers(0, 21), "n": st.integers(1, 17),
                           "max_tokens": st.integers(0, 4)}),                   # log probabilities at their bounds
    st.fixed_dictionaries({"messages": st.just(_ASK), "logprobs": st.just(True), "top_logprobs": st.integers(0, 21),
                           "n": st.integers(1, 17), "max_tokens": st.integers(1, 4)}),
)
_BODY = st.one_of(
    _SHAPES,
    st.dictionaries(st.sampled_from(_NAMES), st.one_of(_JSON, st.lists(_MESSAGE, max_size=3)), max_size=6),
    st.fixed_dictionaries({"prompt": st.one_of(st.text(max_size=30), st.lists(st.integers(-5, 2**40), max_size=5))},
                          optional={k: _JSON for k in ("max_tokens", "temperature", "top_p", "seed", "stop", "top_k", "n")}),
    st.fixed_dictionaries({"messages": st.lists(_MESSAGE, max_size=3)},
                          optional={k: _JSON for k in ("max_completion_tokens", "stream", "stream_options", "tools")}),
    st.fixed_dictionaries({"input": st.one_of(st.text(max_size=30), st.lists(st.integers(-5, 2**40), max_size=5), _JSON)},
                          optional={k: _JSON for k in ("encoding_format", "dimensions", "pooling", "normalize", "user")}),
    _JSON,
)


@st.composite
def wild(draw: st.DrawFn) -> Request:
    path = draw(st.sampled_from(PATHS))
    kind = draw(st.integers(0, 9))
    body = draw(_BODY)
    if isinstance(body, dict) and "max_tokens" not in body and path in GENERATION:
        body["max_tokens"] = MAX_TOKENS   # the schema and the tests cover an absent one
    if kind == 0:
        payload = draw(st.binary(max_size=64))                            # not JSON, maybe not UTF-8
    elif kind == 1:
        payload = encode(body)[: draw(st.integers(0, 40))]                # truncated JSON
    else:
        payload = encode(body)
    content_type = draw(st.sampled_from(["application/json"] * 6 + ["text/plain", "", "application/json; charset=latin-1"]))
    return path, payload, content_type, ANY


# ---------------------------------------------------------------- served

def _floats(low: float, high: float, exclude_min: bool = False) -> st.SearchStrategy[float]:
    return st.floats(low, high, exclude_min=exclude_min, allow_nan=False, allow_infinity=False)


_IDS = st.integers(0, TOKEN_IDS - 1)
_STOP = st.text(min_size=1, max_size=8)
_SAMPLING = {   # optional fields both routes serve, each within its bounds
    "temperature": st.one_of(st.just(0), _floats(FIELDS["temperature"].low, 2.0)),
    "top_p": _floats(0.0, 1.0, exclude_min=True),
    "top_k": st.integers(-1, 50),
    "seed": st.integers(0, INT64_MAX),
    "stop": st.one_of(_STOP, st.lists(_STOP, max_size=3)),
    "n": st.integers(1, 2),
    "ignore_eos": st.booleans(),
    "stop_token_ids": st.lists(_IDS, max_size=3),
    "presence_penalty": _floats(FIELDS["presence_penalty"].low, FIELDS["presence_penalty"].high),
    "frequency_penalty": _floats(FIELDS["frequency_penalty"].low, FIELDS["frequency_penalty"].high),
    "repetition_penalty": _floats(FIELDS["repetition_penalty"].low, 2.0),
    "min_p": _floats(0.0, 1.0),
    "logit_bias": st.dictionaries(_IDS.map(str), _floats(-100.0, 100.0), max_size=3),
    "user": st.text(max_size=16),
    "skip_special_tokens": st.booleans(),
    "stream": st.booleans(),
}
_COMPLETION = _SAMPLING | {"logprobs": st.integers(0, 2), "echo": st.booleans()}
_CHAT = _SAMPLING | {"logprobs": st.booleans(), "response_format": st.just({"type": "text"})}
_EMBEDDING = {"encoding_format": st.sampled_from(["float", "base64"]), "pooling": st.sampled_from(["last", "mean"]),
              "normalize": st.booleans(), "user": st.text(max_size=16)}


@st.composite
def _served_body(draw: st.DrawFn, chat: bool, prompt_chars: int) -> dict[str, Any]:
    # a letter first: a text of only characters the vocabulary lacks (the embedded one has no byte 0x1d)
    # tokenizes to nothing, an empty prompt, refused
    text = st.text(max_size=prompt_chars - 1).map(lambda s: "x" + s)
    ids = st.lists(_IDS, min_size=1, max_size=min(8, prompt_chars))
    if chat is None:   # an embedding
        inputs = st.one_of(text, ids, st.lists(text, min_size=1, max_size=2), st.lists(ids, min_size=1, max_size=2))
        return {"input": draw(inputs)} | draw(st.fixed_dictionaries({}, optional=_EMBEDDING))
    if chat:
        content = draw(st.one_of(text, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}),
                                                min_size=1, max_size=1)))
        body = {"messages": [{"role": "user", "content": content}]} | draw(st.fixed_dictionaries({}, optional=_CHAT))
        if body.get("logprobs"):
            body["top_logprobs"] = draw(st.integers(0, 2))
    else:
        prompt = st.one_of(text, ids, st.lists(text, min_size=1, max_size=2), st.lists(ids, min_size=1, max_size=2))
        body = {"prompt": draw(prompt)} | draw(st.fixed_dictionaries({}, optional=_COMPLETION))
    limit = draw(st.integers(1, MAX_TOKENS))
    body["max_completion_tokens" if chat and draw(st.booleans()) else "max_tokens"] = limit
    if draw(st.booleans()):
        body["min_tokens"] = draw(st.integers(0, limit))
    if body.get("stream") and draw(st.booleans()):
        body["stream_options"] = {"include_usage": draw(st.booleans())}
    return body


def prompt_chars(room: int) -> int:
    """The characters of a prompt that certainly fits `room` tokens, whatever the characters."""
    return max(1, min(16, room // BYTES_PER_CHAR))


@st.composite
def served(draw: st.DrawFn, completion_room: int, chat_room: int) -> Request:
    """`*_room`: the tokens a route's prompt text may take (the context less the template, the BOS and
    MAX_TOKENS: orca_mq.bench.http_fuzz asks the server's /tokenize)."""
    route = draw(st.integers(0, 2))   # completion, chat, embedding (its input: a completion's prompt)
    chat = None if route == 2 else route == 1
    body = draw(_served_body(chat, prompt_chars(chat_room if chat else completion_room)))
    return PATHS[route], encode(body), "application/json", SERVED


# ---------------------------------------------------------------- refused

def _junk(*without: type) -> st.SearchStrategy[Any]:
    """JSON values of the types a field does not take (a string that is not a number: pydantic reads "1")."""
    kinds: dict[type, st.SearchStrategy[Any]] = {
        str: st.text(max_size=6).map(lambda s: "x" + s), bool: st.booleans(), float: _floats(-1e9, 1e9),
        list: st.lists(st.integers(), min_size=1, max_size=2), dict: st.dictionaries(st.text(max_size=4), st.integers(), max_size=2)}
    return st.one_of(*(s for t, s in kinds.items() if t not in without))


def _out_of(low: float, high: float) -> st.SearchStrategy[Any]:
    """Numbers outside [low, high] (-0.0 is not below 0.0), NaN, and values of other types."""
    return st.one_of(st.floats(max_value=low).filter(lambda v: v < low), st.floats(min_value=high).filter(lambda v: v > high),
                     st.just(math.nan), _junk(float, bool))


def _int_out_of(low: int, high: int) -> st.SearchStrategy[Any]:
    return st.one_of(st.integers(max_value=low - 1), st.integers(min_value=high + 1), _junk())


def _not_bool() -> st.SearchStrategy[Any]:
    return st.one_of(st.integers(), _junk(bool))


def _refused(name: str, low: float | None = None) -> st.SearchStrategy[Any]:
    """Values the table (orca_mq.protocol.sampling_fields) refuses for a field, its gaps too (temperature's
    (0, 0.001), top_p's 0); `low`: the HTTP API's own lower bound."""
    f: SamplingField = FIELDS[name].bounded(low)
    if f.kind is bool:
        return _not_bool()
    assert f.low is not None and f.high is not None
    if f.kind is int:
        return _int_out_of(int(f.low), int(f.high))
    gaps = ([st.floats(0.0, f.low, exclude_min=True, exclude_max=True)] if f.zero else []) + (
        [st.just(float(f.low))] if f.low_open else [])
    return st.one_of(_out_of(0.0 if f.zero else f.low, f.high), *gaps)


_WRONG = {   # field -> values the schema refuses, naming the field
    **{name: _refused(name) for name in ("seed", "min_tokens", "temperature", "top_p", "presence_penalty",
                                         "frequency_penalty", "repetition_penalty", "min_p", "ignore_eos",
                                         "skip_special_tokens")},
    "max_tokens": _refused("max_tokens", low=0), "top_k": _refused("top_k", low=-1), "n": _int_out_of(1, INT32_MAX),
    "stream": _not_bool(),
    "stop": st.one_of(st.integers(), st.just([""]), st.lists(st.integers(), min_size=1, max_size=2)),
}
_WRONG_COMPLETION = _WRONG | {"prompt": st.one_of(st.integers(), _junk(str, list)), "echo": _not_bool(),
                              "logprobs": _refused("logprobs")}
_WRONG_CHAT = _WRONG | {"messages": st.one_of(st.just([]), st.integers(), _junk(list)), "logprobs": _not_bool(),
                        "max_completion_tokens": _refused("max_tokens")}
_WRONG_EMBEDDING = {"input": st.one_of(st.integers(), _junk(str, list)), "encoding_format": _junk(), "pooling": _junk(),
                    "normalize": _not_bool(), "dimensions": _int_out_of(1, INT32_MAX), "user": _junk(str)}


@st.composite
def refused(draw: st.DrawFn, completion_room: int, chat_room: int) -> Request:
    path, payload, content_type, _ = draw(served(completion_room, chat_room))
    body = json.loads(payload)
    wrong = _WRONG_CHAT if "messages" in body else _WRONG_EMBEDDING if "input" in body else _WRONG_COMPLETION
    field = draw(st.sampled_from(sorted(wrong) + ["unknown"]))
    if field == "unknown":
        field = "x_" + draw(st.text(max_size=10))
        body[field] = draw(_JSON)
    else:
        body[field] = draw(wrong[field])
    return path, encode(body), content_type, Expect(param=field)
