"""orca_mq.chat_template renders what transformers' apply_chat_template(tokenize=False) renders, on every
published template in tests/data/chat_templates and the embedded model's: the conversations the API
sends (tools, earlier calls and their results, thinking under each field name, None-valued fields,
template variables) and contents drawn by hypothesis; where transformers refuses a conversation, so
does the served tokenizer. And the served tokenizer encodes, decodes and names its tokens as
transformers' does."""
from __future__ import annotations

import functools
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orca_mq.tokenizer import Tokenizer, hf_tokenizer
from template_families import ASK, CALLS, FAMILIES, TOOLS, assistant, hf_tokenizer as family_hf

NAMES = ["embedded", *FAMILIES]


@functools.cache
def pair(name: str) -> tuple[Any, Tokenizer]:
    hf = hf_tokenizer() if name == "embedded" else family_hf(name)
    return hf, Tokenizer.of(hf)


def outcome(call: Any) -> str:
    try:
        return call()
    except Exception as e:   # jinja's own errors and the templates' raise_exception: refused alike
        return f"refused: {type(e).__name__}"


def same(name: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, generation: bool,
         **kwargs: Any) -> str:
    hf, ours = pair(name)
    want = outcome(lambda: hf.apply_chat_template(messages, tools=tools, tokenize=False,
                                                  add_generation_prompt=generation, **kwargs))
    assert outcome(lambda: ours.render_chat(messages, tools, generation, **kwargs)) == want
    return want


def conversations(name: str) -> list[list[dict[str, Any]]]:
    fam = FAMILIES.get(name)
    call = assistant(CALLS[:1], thinking="Check the weather.", fam=fam)
    result = {"role": "tool", "content": '{"temp": 21}', "tool_call_id": call.get("tool_calls", [{}])[0].get("id")}
    return [
        ASK,
        [{"role": "system", "content": "Be brief."}, *ASK],
        [*ASK, call, result],
        [*ASK, {"role": "assistant", "content": "Sunny.", "reasoning_content": "It is warm.", "name": None}, *ASK],
        [*ASK, {"role": "assistant", "content": "Sunny.", "thinking": "It is warm."}, *ASK],
        [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],   # some templates refuse two in a row
        [{"role": "assistant", "content": "first"}],
    ]


@pytest.mark.parametrize("name", NAMES)
def test_every_template_renders_the_apis_conversations_as_transformers_does(name: str) -> None:
    rendered = set()
    for messages in conversations(name):
        for tools in (None, TOOLS):
            for generation in (True, False):
                rendered.add(same(name, messages, tools, generation))
    fam = FAMILIES.get(name)
    if fam is not None and fam.takes_enable_thinking:
        for flag in (True, False):
            same(name, ASK, TOOLS, True, enable_thinking=flag)
    same(name, ASK, None, True, bos_token="<override>", custom={"a": [1, None, "x"]})   # variables replace specials
    same(name, ASK, None, True, template="t", special_tokens={"a": 1}, messages_=1)   # names the renderer uses itself
    assert not all(r.startswith("refused") for r in rendered)


text = st.text(st.characters(codec="utf-8"), max_size=40)
message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool"]), "content": text},
                                optional={"reasoning_content": text, "name": st.none() | text})


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(NAMES), messages=st.lists(message, min_size=1, max_size=4), tools=st.booleans(),
       generation=st.booleans())
def test_drawn_conversations_render_alike(name: str, messages: list[dict[str, Any]], tools: bool,
                                          generation: bool) -> None:
    same(name, messages, TOOLS if tools else None, generation)


@pytest.mark.parametrize("name", NAMES)
def test_the_served_tokenizer_encodes_decodes_and_names_tokens_as_transformers(name: str) -> None:
    hf, ours = pair(name)
    texts = ["hello world", "  two spaces\n\nand lines", "ünïcödé 東京 🙂", *(f"x{t}y" for t in hf.all_special_tokens)]
    for t in texts:
        for special in (True, False):
            ids = hf.encode(t, add_special_tokens=special)
            assert ours.encode(t, special) == ids, t
            for skip in (True, False):
                assert ours.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip,
                                                           clean_up_tokenization_spaces=False)
    assert (ours.eos_token, ours.eos_token_id, ours.bos_token_id) == (hf.eos_token, hf.eos_token_id, hf.bos_token_id)
    assert ours.get_vocab() == hf.get_vocab() and len(ours) == len(hf)
    assert ({i: (t.content, t.special) for i, t in ours.added_tokens_decoder.items()}
            == {i: (t.content, t.special) for i, t in hf.added_tokens_decoder.items()})
    assert ours.chat_template == hf.chat_template and ours.special_tokens == hf.special_tokens_map
