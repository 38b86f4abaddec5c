"""The reasoning and tool-call parsers (orca_mq/api/parsers) on their own: every parser gives the same
calls, content and reasoning fed at any cuts (hypothesis) as fed whole; calls written malformed come
back as text and a call cut by max_tokens is dropped, the complete ones kept; reasoning and calls do
not swallow each other; parsing is linear on adversarial text (a 1 MB run after an opening tag)."""
from __future__ import annotations

import json
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orca_mq.api.parsers import Parsed, finish_reason, output_parser, parse_all
from orca_mq.api.parsers.json_scan import JsonScan

NAMES = frozenset({"get_weather", "get_time"})
W = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
T = '{"name": "get_time", "arguments": {"zone": "UTC"}}'
PARIS, UTC = ("get_weather", {"city": "Paris"}), ("get_time", {"zone": "UTC"})
CONFIGS = {"hermes": ("hermes", None, ""), "qwen3": ("hermes", "think", ""), "r1": ("hermes", "think", "<think>\n"),
           "llama3": ("llama3_json", None, ""), "mistral": ("mistral", None, ""), "gpt_oss": ("gpt_oss", "gpt_oss", ""),
           "think": (None, "think", "")}
H = "<|start|>assistant<|channel|>"
# (config, the model's text, what it must parse to when ended by EOS: content, reasoning, calls)
CORPUS = [
    ("hermes", f"Let me check.\n<tool_call>\n{W}\n</tool_call>\n<tool_call>\n{T}\n</tool_call>", ("Let me check.", "", [PARIS, UTC])),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "a </tool_call> b"}}</tool_call>',
     ("", "", [("get_weather", {"city": "a </tool_call> b"})])),
    ("hermes", f"<tool_call>{W}\n<tool_call>{T}</tool_call>", ("", "", [PARIS, UTC])),         # first left unclosed
    ("hermes", f"<tool_call>{W}", ("", "", [PARIS])),                                          # EOS before the close
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}</tool_call>', ("", "", [PARIS])),
    ("hermes", '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call> ok',                 # not a given tool
     ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call> ok', "", [])),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}</tool_call>',  # a brace short
     ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}</tool_call>', "", [])),
    ("hermes", "<tool_call>{'name': 'get_weather'}</tool_call>", ("<tool_call>{'name': 'get_weather'}</tool_call>", "", [])),
    ("hermes", f"<tool_call>{W} junk</tool_call><tool_call>{T}</tool_call>",
     (f"<tool_call>{W} junk</tool_call>", "", [UTC])),
    ("qwen3", f"<think>\nCall <the> tool.\n</think>\n\n<tool_call>\n{W}\n</tool_call>", ("", "Call <the> tool.", [PARIS])),
    ("qwen3", f"<think>\nI will call it.\n<tool_call>\n{W}\n</tool_call>", ("", "I will call it.", [PARIS])),
    ("qwen3", "No thinking here </think> at all", ("No thinking here </think> at all", "", [])),
    ("r1", "Hmm.\n</think>\n\nIt is <b>sunny</b>.", ("It is <b>sunny</b>.", "Hmm.", [])),
    ("r1", "<think>\nHmm.\n</think>\n\nSunny.", ("Sunny.", "Hmm.", [])),
    ("think", "<think>a<think>b</think>c", ("c", "a<think>b", [])),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {"zone": "UTC"}}',
     ("", "", [PARIS, UTC])),
    ("llama3", f"<|python_tag|>{W} Done.", ("Done.", "", [PARIS])),
    ("llama3", '{"answer": 42}', ('{"answer": 42}', "", [])),
    ("llama3", 'Use {"name": "get_weather"} like so', ('Use {"name": "get_weather"} like so', "", [])),
    ("llama3", '<|python_tag|>brave_search.call(query="x")', ('<|python_tag|>brave_search.call(query="x")', "", [])),
    ("mistral", f"[TOOL_CALLS] [{W}, {T}]", ("", "", [PARIS, UTC])),
    ("mistral", f'[TOOL_CALLS]get_weather[ARGS]{{"city": "Paris"}}[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{{"zone": "UTC"}}',
     ("", "", [PARIS, UTC])),
    ("mistral", f'[TOOL_CALLS] [{W}, {{"name": "nope", "arguments": {{}}}}]', (', {"name": "nope", "arguments": {}}]', "", [PARIS])),
    ("mistral", "[TOOL_CALLS]get weather[ARGS]{}", ("[TOOL_CALLS]get weather[ARGS]{}", "", [])),
    ("gpt_oss", '<|channel|>analysis<|message|>Need it.<|end|>' + H + 'commentary to=functions.get_weather <|constrain|>json'
     '<|message|>{"city":"Paris"}<|call|>', ("", "Need it.", [PARIS])),
    ("gpt_oss", "<|channel|>analysis<|message|>A.<|end|>" + H + "commentary<|message|>Checking.<|end|>"
     '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"zone":"UTC"}', ("Checking.", "A.", [UTC])),
    ("gpt_oss", "<|channel|>analysis<|message|>A.<|end|>" + H + "final<|message|>It is sunny.", ("It is sunny.", "A.", [])),
    ("gpt_oss", H + 'commentary to=functions.rm <|constrain|>json<|message|>{}<|call|>',
     (H + "commentary to=functions.rm <|constrain|>json<|message|>{}<|call|>", "", [])),
]


def parser(config: str):
    tool, reasoning, prompt = CONFIGS[config]
    return output_parser(tool, reasoning, NAMES, prompt)


def fed(config: str, pieces: list[str], reason: str) -> Parsed:
    p, out = parser(config), Parsed()
    for piece in pieces:
        out.add(p.feed(piece))
    return out.add(p.finish(reason))


def summary(p: Parsed):
    return p.content.strip(), p.reasoning.strip(), [(c.name, json.loads(c.arguments)) for c in p.calls]


def cuts(text: str, at: set[int]) -> list[str]:
    bounds = [0, *sorted(at), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("config,text,expected", CORPUS)
def test_each_output_parses_to_what_the_model_meant_fed_whole_or_a_character_at_a_time(config, text, expected):
    assert summary(parse_all(parser(config), text, "stop")) == expected
    for reason in ("stop", "length"):
        assert summary(fed(config, list(text), reason)) == summary(parse_all(parser(config), text, reason))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_cuts_give_the_unstreamed_parse(data):
    config, text, _ = data.draw(st.sampled_from(CORPUS))
    text = text[:data.draw(st.integers(0, len(text)))]       # also cut short: a stream ended anywhere
    at = data.draw(st.sets(st.integers(1, max(1, len(text) - 1))))
    reason = data.draw(st.sampled_from(["stop", "length"]))
    assert summary(fed(config, cuts(text, at), reason)) == summary(parse_all(parser(config), text, reason))


FRAGMENTS = ["<tool_call>", "</tool_call>", "<tool_", "call>", "<think>", "</think>", "</thi", "<|python_tag|>",
             "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "[TOOL_", "<|channel|>", "<|message|>", "<|end|>", "<|start|>",
             "<|call|>", "<|return|>", "<|", "analysis", "final", "commentary", " to=functions.get_weather",
             " to=functions.get_time", W, T, '{"city": "Paris"}', "get_weather", "{", "}", "[", "]", '"', "\\", ";", ",",
             " ", "\n", "\t", "Paris", "é東", "<", ">", "json"]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(sorted(CONFIGS)), st.lists(st.sampled_from(FRAGMENTS), max_size=40), st.data())
def test_any_text_parses_the_same_on_any_cuts_into_well_formed_calls(config, fragments, data):
    text = "".join(fragments)
    reason = data.draw(st.sampled_from(["stop", "length"]))
    whole = parse_all(parser(config), text, reason)
    assert summary(fed(config, cuts(text, data.draw(st.sets(st.integers(1, max(1, len(text) - 1))))), reason)) == summary(whole)
    assert all(c.name in NAMES and isinstance(json.loads(c.arguments), dict) for c in whole.calls)
    if config == "hermes" and not whole.calls and reason == "stop":
        assert whole.content == text          # nothing is lost: text without a call comes back whole


def test_a_call_cut_by_max_tokens_is_dropped_from_content_and_calls():
    cut = '<tool_call>\n{"name":"get_weather","arguments":{"city":""}}\n</'     # issue 41's leak
    for config, text in [("hermes", f"<tool_call>{W}</tool_call>\n{cut}"), ("qwen3", f"<think>x</think><tool_call>{W}</tool_call>{cut}"),
                         ("mistral", f'[TOOL_CALLS] [{W}, {{"name": "get_ti'), ("llama3", f'{W}; {{"name": "get_time", "argu'),
                         ("gpt_oss", H + 'commentary to=functions.get_weather<|message|>{"city":"Paris"}<|call|>' + H + "commentary to=fu")]:
        content, _, calls = summary(parse_all(parser(config), text, "length"))
        assert calls == [PARIS] and content == "", config
    assert summary(parse_all(parser("hermes"), "The answer is 4. <tool", "length")) == ("The answer is 4.", "", [])


def test_finish_reason_and_names():
    assert [finish_reason(r, c) for r, c in [("stop", True), ("stop", False), ("length", True)]] == ["tool_calls", "stop", "length"]
    assert summary(parse_all(output_parser("hermes", None, []), f"<tool_call>{W}</tool_call>", "stop"))[2] == []  # no tools: text
    for bad in [("hermes", "gpt_oss"), ("nope", None), (None, "nope")]:
        with pytest.raises(ValueError):
            output_parser(*bad, NAMES)


@settings(max_examples=100, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
                    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=5), kids, max_size=4)),
       st.text(max_size=5), st.data())
def test_the_json_scanner_finds_where_a_value_ends_in_any_pieces(value, tail, data):
    text = json.dumps({"v": value}, ensure_ascii=data.draw(st.booleans())) + tail
    scan, seen = JsonScan(), 0
    for piece in cuts(text, data.draw(st.sets(st.integers(1, len(text) - 1)))):
        j = scan.scan(piece, 0)
        if scan.state != "open":
            break
        seen += len(piece)
    assert scan.state == "done" and seen + j == len(text) - len(tail)


ADVERSARIAL = {   # text of about n characters that a backtracking or rescanning parser would choke on
    "hermes": lambda n: "<tool_call>" + " " * n, "qwen3": lambda n: "<think>" + "</thin" * (n // 6),
    "llama3": lambda n: '{"name": "get_weather", "parameters": {"a": [' + '"x", ' * (n // 5),    # huge unclosed arguments
    "mistral": lambda n: "[TOOL_CALLS] [" + "[" * n + "{" + "\n" * n,
    "gpt_oss": lambda n: "<|channel|>" * (n // 11), "r1": lambda n: "<tool_call>x" * (n // 12),
    "think": lambda n: "<think>" + '{"a": "' * (n // 7),
}


def _seconds(config: str, text: str, piece: int) -> float:
    best = float("inf")
    for _ in range(2):
        start = time.perf_counter()
        fed(config, [text[i:i + piece] for i in range(0, len(text), piece)], "stop")
        best = min(best, time.perf_counter() - start)
    return best


@pytest.mark.parametrize("config", sorted(ADVERSARIAL))
def test_parsing_is_linear_on_adversarial_text(config):
    n = 1 << 16
    for piece in (1 << 20, 4093):      # whole (the unstreamed parse) and streamed in pieces
        small, large = _seconds(config, ADVERSARIAL[config](n), piece), _seconds(config, ADVERSARIAL[config](4 * n), piece)
        assert large < 8 * small + 0.05, (config, piece, small, large)   # 4x the text, ~4x the time (quadratic: 16x)


OPENERS = {"hermes": "<tool_call>", "qwen3": "<think>", "r1": "", "llama3": "<|python_tag|>", "mistral": "[TOOL_CALLS]",
           "gpt_oss": "<|channel|>commentary to=functions.get_weather<|message|>", "think": "<think>"}


@pytest.mark.parametrize("config", sorted(OPENERS))
def test_a_megabyte_of_whitespace_after_an_opening_tag_parses_at_once(config):
    text = OPENERS[config] + " \n\t" * (1 << 18)
    start = time.perf_counter()
    parse_all(parser(config), text, "stop")
    assert time.perf_counter() - start < 1      # ~10 ms on a quiet core (a backtracking regex: minutes)
