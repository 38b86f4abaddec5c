"""The model families' published chat templates (tests/data/chat_templates) and the parsers: each
template renders through transformers' apply_chat_template with tools (and enable_thinking where it
takes it), detect() names the parsers its markers call for, and what a model of the family writes (an
assistant message rendered by the family's own template) parses back to the same calls, thinking and
answer — fed whole, at every token boundary of a tokenizer with the family's special tokens, and at
every character; a call cut by max_tokens is dropped, the ones before it kept."""
from __future__ import annotations

import json

import pytest

from orca_mq.api.parsers import Parsed, detect, output_parser, parse_all
from template_families import (ASK, CALLS, FAMILIES, NAMES, assistant, render, token_pieces, tokenizer,
                               written)

TOOLED = [n for n, f in FAMILIES.items() if f.tool_parser]


def parser_for(name: str, prompt: str):
    found = detect(FAMILIES[name].text)
    return output_parser(found.tool_parser, found.reasoning_parser, NAMES, prompt)


def fed(name: str, prompt: str, pieces: list[str], reason: str) -> Parsed:
    parser, out = parser_for(name, prompt), Parsed()
    for piece in pieces:
        out.add(parser.feed(piece))
    return out.add(parser.finish(reason))


def summary(p: Parsed) -> tuple[str, str, list[tuple[str, object]]]:
    return p.content.strip(), p.reasoning.strip(), [(c.name, json.loads(c.arguments)) for c in p.calls]


def every_cut_agrees(name: str, prompt: str, text: str, reason: str) -> Parsed:
    whole = parse_all(parser_for(name, prompt), text, reason)
    for pieces in (token_pieces(name, text), list(text)):
        assert "".join(pieces) == text
        assert summary(fed(name, prompt, pieces, reason)) == summary(whole)
    return whole


@pytest.mark.parametrize("name", list(FAMILIES))
def test_template_renders_with_tools_and_detect_names_its_parsers(name):
    fam = FAMILIES[name]
    for kwargs in ({"enable_thinking": True}, {"enable_thinking": False}) if fam.takes_enable_thinking else ({},):
        prompt = render(name, ASK, True, **kwargs)
        assert ASK[-1]["content"] in prompt
        assert ("get_weather" in prompt) == (fam.tool_parser is not None)   # the template shows the tools itself
    found = detect(fam.text)
    assert (found.tool_parser, found.reasoning_parser) == (fam.tool_parser, fam.reasoning_parser)
    assert tokenizer(name).backend.token_to_id(fam.specials[-1]) is not None


@pytest.mark.parametrize("name", TOOLED)
def test_a_familys_own_calls_parse_back_on_every_cut(name):
    fam = FAMILIES[name]
    calls = CALLS[:fam.calls_per_message]
    prompt, text = written(name, assistant(calls, thinking="The user wants weather: call the tool.", fam=fam))
    for reason in ("stop", "length"):
        content, reasoning, got = summary(every_cut_agrees(name, prompt, text, reason))
        # gpt-oss ends a call with <|call|>, its EOS (hidden from the text): cut by length, the call is unfinished
        assert got == ([] if reason == "length" and name == "gpt-oss" else calls) and content == ""
        assert reasoning == ("The user wants weather: call the tool." if fam.thinking_field else "")


@pytest.mark.parametrize("name", TOOLED)
def test_a_call_cut_by_max_tokens_is_dropped_and_the_complete_ones_kept(name):
    fam = FAMILIES[name]
    calls = CALLS[:fam.calls_per_message]
    prompt, text = written(name, assistant(calls, fam=fam))
    last = text.rindex(calls[-1][0])     # cuts from the last call's name to its last string's closing quote
    for cut in range(last, text.rindex('"'), 5):
        content, _, got = summary(every_cut_agrees(name, prompt, text[:cut], "length"))
        assert got == calls[:-1] and content == ""
        content, _, got = summary(parse_all(parser_for(name, prompt), text[:cut], "stop"))
        assert got == calls[:-1] and content   # ended by EOS mid-call: malformed, given back as text


@pytest.mark.parametrize("name", ["qwen3", "gpt-oss"])
def test_thinking_and_answer_are_kept_apart(name):
    fam = FAMILIES[name]
    prompt, text = written(name, assistant([], content="It is 18 C in Paris.", thinking="Weather asked; answer.", fam=fam))
    assert summary(every_cut_agrees(name, prompt, text, "stop")) == ("It is 18 C in Paris.", "Weather asked; answer.", [])
    cut = text.index("asked") + 2     # a stream cut inside the thinking: all of it reasoning, no answer
    assert summary(every_cut_agrees(name, prompt, text[:cut], "length")) == ("", "Weather as", [])


def test_qwen3_without_thinking_renders_an_empty_block_and_the_output_is_all_answer():
    prompt, text = written("qwen3", assistant(CALLS, content="Checking both."), enable_thinking=False)
    assert prompt.endswith("<think>\n\n</think>\n\n") and "<think>" not in text
    assert summary(every_cut_agrees("qwen3", prompt, text, "stop")) == ("Checking both.", "", CALLS)


def test_deepseek_r1_distill_output_starts_inside_the_thinking():
    prompt = render("deepseek-r1-distill-qwen", ASK, True)
    assert prompt.endswith("<think>\n")     # the template opens the thinking: the model writes only </think>
    text = "Paris is in France.\nTokyo is UTC+9.\n</think>\n\nParis: sunny. Tokyo: 21:00."
    assert summary(every_cut_agrees("deepseek-r1-distill-qwen", prompt, text, "stop")) == (
        "Paris: sunny. Tokyo: 21:00.", "Paris is in France.\nTokyo is UTC+9.", [])
    assert summary(every_cut_agrees("deepseek-r1-distill-qwen", prompt, text[:25], "length")) == (
        "", "Paris is in France.\nTokyo", [])


def test_llama_python_tag_and_semicolon_separated_calls():
    prompt = render("llama3.1-instruct", ASK, True)
    text = "<|python_tag|>" + "; ".join(json.dumps({"name": n, "parameters": a}, ensure_ascii=False) for n, a in CALLS)
    assert summary(every_cut_agrees("llama3.1-instruct", prompt, text, "stop")) == ("", "", CALLS)


def test_families_without_a_format_parse_nothing():
    for name in ("gemma2-it", "phi3.5-mini-instruct"):
        found = detect(FAMILIES[name].text)
        parser = output_parser(found.tool_parser, found.reasoning_parser, NAMES)
        text = '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call> <think>x</think>'
        assert summary(parse_all(parser, text, "stop")) == (text, "", [])
