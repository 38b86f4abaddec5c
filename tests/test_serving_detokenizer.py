"""Streaming detokenization: pieces concatenate to the full decode, and no piece carries a
broken (U+FFFD) multi-byte character, whatever the token boundaries."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orca_mq.detokenizer import IncrementalDetokenizer, alone_texts, plain_texts
from orca_mq.tokenizer import load_tokenizer

TOKENIZER = load_tokenizer("")

TEXTS = [
    "Hello, wörld! naïve café — “quotes”",
    "你好世界，这是一个测试。日本語のテキスト",
    "emoji 🎉🎉👩‍👩‍👧 and ÿ",
    "code:\n\tdef f(x):  return x  # ok\n\n",
]


@pytest.fixture(scope="module")
def tokenizer():
    return TOKENIZER


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
    eos = tokenizer.backend.token_to_id("<|im_end|>")
    detok = IncrementalDetokenizer(tokenizer)
    ids = tokenizer.encode("Done.") + [eos]
    assert "".join(detok.step([i]) for i in ids) + detok.finish() == "Done."


TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=24)


@st.composite
def token_sequences(draw: st.DrawFn, vocab: int) -> list[int]:
    """Tokens of random text (CJK, emoji, combining marks: characters split over byte-level tokens),
    any token of the vocabulary (special ones, stray UTF-8 bytes), or both mixed."""
    parts = draw(st.lists(st.one_of(TEXT.map(lambda t: ("text", t)),
                                    st.lists(st.integers(0, vocab - 1), max_size=6).map(lambda ids: ("ids", ids))),
                          min_size=1, max_size=4))
    return [i for kind, p in parts for i in (TOKENIZER.encode(p) if kind == "text" else p)]


@settings(max_examples=300, deadline=None)
@given(seqs=st.lists(token_sequences(len(TOKENIZER)), min_size=1, max_size=4), seed=st.integers(0, 2**32))
def test_batched_steps_join_to_the_full_decode(seqs: list[list[int]], seed: int) -> None:
    """Requests stepped together, each iteration bringing 0-3 new tokens per request (the
    frontend's batches): every request's pieces join to its full decode, and text that is valid
    UTF-8 never streams a broken character."""
    rng = random.Random(seed)
    detoks = [IncrementalDetokenizer(TOKENIZER) for _ in seqs]
    pieces: list[list[str]] = [[] for _ in seqs]
    pos = [0] * len(seqs)
    while any(p < len(s) for p, s in zip(pos, seqs)):
        for i, (detok, seq) in enumerate(zip(detoks, seqs)):
            k = rng.randint(0, 3)
            pieces[i].append(detok.step(seq[pos[i]:pos[i] + k]))
            pos[i] += k
    for detok, seq, got in zip(detoks, seqs, pieces):
        full = TOKENIZER.decode(seq, skip_special_tokens=True)
        assert "".join(got) + detok.finish() == full
        if "\ufffd" not in full:
            assert not any("\ufffd" in p for p in got)


PLAIN = plain_texts(TOKENIZER, alone_texts(TOKENIZER))


@settings(max_examples=300, deadline=None)
@given(seq=token_sequences(len(TOKENIZER)), seed=st.integers(0, 2**32), skip=st.booleans())
def test_looked_up_tokens_give_the_streams_pieces(seq: list[int], seed: int, skip: bool) -> None:
    """Whole-character tokens looked up (plain_texts) and then the stream from the first other token: the
    same piece at every step as a stream that saw every token, and the same final text."""
    rng = random.Random(seed)
    fast = IncrementalDetokenizer(TOKENIZER, skip, PLAIN)
    slow = IncrementalDetokenizer(TOKENIZER, skip)
    pos = 0
    while pos < len(seq):
        k = rng.randint(0, 3)
        assert fast.step(seq[pos:pos + k]) == slow.step(seq[pos:pos + k])
        pos += k
    assert fast.finish() == slow.finish()


def test_plain_tokens_are_looked_up_until_one_is_not(tokenizer):
    assert PLAIN is not None and PLAIN[tokenizer.backend.token_to_id("<|im_end|>")] is None
    detok = IncrementalDetokenizer(tokenizer, plain=PLAIN)
    assert "".join(detok.step([i]) for i in tokenizer.encode("Hello, world")) == "Hello, world"
    assert detok.plain is PLAIN                     # not streamed
    emoji = tokenizer.encode("🎉")
    assert detok.step(emoji[:1]) == "" and detok.plain is None   # part of a character: the stream from here
    assert "".join(detok.step([i]) for i in emoji[1:]) + detok.finish() == "🎉"


def test_a_log_probabilitys_token_is_its_id_decoded_alone() -> None:
    """The frontend's table of every id decoded alone (one call at start) gives what decoding the id alone gives,
    special and partial-character tokens too; an id past the tokenizer's vocabulary (a padded LM head) is decoded."""
    from orca_mq.assembly import Assembler

    assembler = Assembler(TOKENIZER, [0])
    vocab = len(TOKENIZER)
    ids = [0, 1, 2, vocab - 1, *random.Random(7).sample(range(vocab), 300)]
    assert [assembler.text(t) for t in ids] == [TOKENIZER.decode([t]) for t in ids]
    assert any("\ufffd" in assembler.text(t) for t in range(vocab)) and assembler.text(1) == "<|im_start|>"
    assert assembler.text(vocab + 5) == TOKENIZER.decode([vocab + 5])
