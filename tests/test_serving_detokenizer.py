"""Streaming detokenization: pieces concatenate to the full decode, and no piece carries a
broken (U+FFFD) multi-byte character, whatever the token boundaries."""
from __future__ import annotations

import pytest

from orca_mq.detokenizer import IncrementalDetokenizer
from orca_mq.tokenizer import load_tokenizer

TEXTS = [
    "Hello, wörld! naïve café — “quotes”",
    "你好世界，这是一个测试。日本語のテキスト",
    "emoji 🎉🎉👩‍👩‍👧 and ÿ",
    "code:\n\tdef f(x):  return x  # ok\n\n",
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("")


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_pieces_join_to_the_full_decode(tokenizer, text, chunk):
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.step(ids[i:i + chunk]) for i in range(0, len(ids), chunk)] + [detok.finish()]
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)


def test_incomplete_character_is_held_back(tokenizer):
    ids = tokenizer.encode("🎉")
    assert len(ids) > 1, "the emoji must span several tokens for this test"
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.step(ids[:1]) == ""
    assert "".join(detok.step([i]) for i in ids[1:]) + detok.finish() == "🎉"


def test_special_tokens_are_skipped(tokenizer):
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    detok = IncrementalDetokenizer(tokenizer)
    ids = tokenizer.encode("Done.") + [eos]
    assert "".join(detok.step([i]) for i in ids) + detok.finish() == "Done."
