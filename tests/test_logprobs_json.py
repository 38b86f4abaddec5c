"""The log probabilities' JSON text (orca_mq.api.logprobs, written without a dict per entry and with each
token's pieces made once per text) parses to what OpenAI's shapes, built by pydantic from the same
values, dump: any token text, any float (NaN and the infinities floored to -9999.0), and the same after
the per-text cache fills and starts again."""
from __future__ import annotations

import json
import math

from hypothesis import given, settings
from hypothesis import strategies as st

import orca_mq.api.logprobs as lpjson
from orca_mq.api.logprobs import FLOOR, ChatLogprobs, ChatTokenLogprob, TopLogprob, chat_logprobs
from orca_mq.protocol.logprobs import Logprobs

texts = st.text(st.characters(exclude_categories=["Cs"]), max_size=6)   # a token's text: no lone surrogates
values = st.floats(allow_nan=True, allow_infinity=True, width=32) | st.floats(allow_nan=True)
position = st.tuples(texts, values | st.none(), st.lists(st.tuples(texts, values), max_size=4))


def floored(v: float | None) -> float:
    return v if v is not None and math.isfinite(v) and v > FLOOR else FLOOR


def expected(positions: list) -> dict:
    def entry(cls, t: str, v: float | None, **more):
        return cls(token=t, logprob=floored(v), bytes=list(t.encode("utf-8", errors="replace")), **more)
    return ChatLogprobs(content=[entry(ChatTokenLogprob, t, v, top_logprobs=[entry(TopLogprob, a, w) for a, w in tops])
                                 for t, v, tops in positions]).model_dump()


def logprobs(positions: list) -> Logprobs:
    lp = Logprobs()
    for i, (t, v, tops) in enumerate(positions):
        lp.extend(Logprobs([i], [t], [v], [list(range(len(tops)))], [[a for a, _ in tops]], [[w for _, w in tops]]))
    return lp


@settings(max_examples=300, deadline=None)
@given(st.lists(position, max_size=8))
def test_chat_logprobs_json_is_the_models_dump(positions):
    assert json.loads(chat_logprobs(logprobs(positions))) == expected(positions)


@settings(max_examples=50, deadline=None)
@given(st.lists(position, min_size=1, max_size=8))
def test_the_same_when_the_cache_starts_again(positions):
    saved = lpjson._MAX_PIECES
    lpjson._PIECES.clear()
    lpjson._MAX_PIECES = 2   # clears every third new text, mid-response
    try:
        assert json.loads(chat_logprobs(logprobs(positions))) == expected(positions)
        assert len(lpjson._PIECES) <= 2
    finally:
        lpjson._MAX_PIECES = saved
