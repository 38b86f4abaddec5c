"""Qwen3's hermes calls and <think> reasoning through the three APIs, on a real server of a tiny random
Qwen3 checkpoint with its real chat template (tests/family_models.py), through the real SDKs: the
thinking as reasoning_content (counted in usage, off with enable_thinking), a Responses reasoning item
and an Anthropic thinking block; the streamed parse equal to the whole one at the HTTP level on outputs
whose tokens fall differently; a required call after the thinking; a malformed call back as text with
`stop`; issue 41's cut call (required, max_tokens 64, a further call begun) dropped with `length`; the
Responses API's incomplete response and bounded store; Messages' stop reasons and errors in Anthropic's
shape.
"""
from __future__ import annotations

import json

import anthropic
import openai
import pytest

from agent_harness import ANSWER, ASK, NO_THINKING, STORED, TOOLS, WEATHER, Family, chat, items, message, respond


VALID_CALLS = [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "UTC"})]   # all a required choice allows


@pytest.fixture(scope="module")
def family(family_servers) -> Family:
    yield family_servers.get("hermes")
    family_servers.close()   # the last module of the suite to use one


def _weather_call(fam: Family) -> str:
    call = {"type": "object", "properties": {"name": {"const": "get_weather"}, "arguments": WEATHER},
            "required": ["name", "arguments"], "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}
    return f'{fam.mark("<tool_call>")} "\\n" %json {json.dumps(call)} "\\n" {fam.mark("</tool_call>")}'


@pytest.mark.parametrize("seed", range(4))
def test_the_streamed_parse_equals_the_whole_one_wherever_the_tokens_fall(family, seed):
    """Sampled text around a thinking block and a call: its tokens (and so the stream's pieces) fall
    differently with every seed; the deltas add up to the unstreamed message."""
    grammar = (f'start: {family.mark("<think>")} /[a-z <>]{{1,12}}/ {family.mark("</think>")} /[a-z \\n]{{0,6}}/ '
               f'{_weather_call(family)} /[a-z .<]{{0,8}}/')
    kwargs = {"messages": ASK, "tools": TOOLS, "temperature": 1.0, "seed": seed, "extra": {"structured_outputs": {"grammar": grammar}}}
    whole, streamed = chat(family, False, **kwargs), chat(family, True, **kwargs)
    assert (streamed.content, streamed.reasoning, streamed.calls, streamed.finish) == (
        whole.content, whole.reasoning, whole.calls, whole.finish)
    assert whole.calls == [("get_weather", {"city": "Paris"})] and whole.finish == "tool_calls", whole
    assert "<tool_call>" not in (whole.content or "") and "think>" not in (whole.content or "") + (whole.reasoning or "")


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_is_reasoning_content_counted_in_usage_and_off_with_enable_thinking(family, stream):
    grammar = f'start: {family.mark("<think>")} "\\nWeather asked.\\n" {family.mark("</think>")} "\\n\\n" {json.dumps(ANSWER)}'
    out = chat(family, stream, messages=ASK, extra={"structured_outputs": {"grammar": grammar}})
    assert (out.content, out.reasoning, out.finish) == (ANSWER, "Weather asked.\n", "stop")
    counted = len(family.tok(out.reasoning, add_special_tokens=False).input_ids)
    assert out.usage.completion_tokens_details.reasoning_tokens == counted > 0
    # the template renders an empty thinking block: the output begins in the answer
    off = chat(family, stream, messages=ASK, extra=NO_THINKING | {"structured_outputs": {"grammar": f"start: {json.dumps(ANSWER)}"}})
    assert (off.content, off.reasoning) == (ANSWER, None) and off.usage.completion_tokens_details.reasoning_tokens == 0


def test_a_required_call_may_follow_the_thinking(family):
    """tool_choice's grammar lets the thinking through first: biased to open and close it at once, the
    model writes <think></think> and then the call (its grammar's own), which is parsed as without."""
    think, close = (family.tok.convert_tokens_to_ids(t) for t in ("<think>", "</think>"))
    thought = chat(family, False, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                   logit_bias={str(think): 100, str(close): 100})
    plain = chat(family, False, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, extra=NO_THINKING)
    assert len(thought.calls) == 1 and thought.calls[0] in VALID_CALLS and thought.finish == "tool_calls", thought
    assert (thought.content, thought.reasoning) == (None, None)
    assert thought.usage.completion_tokens >= plain.usage.completion_tokens + 2   # <think></think> came first


@pytest.mark.parametrize("stream", [False, True])
def test_a_malformed_call_comes_back_as_text_with_stop(family, stream):
    for body in ('{"name": "rm_rf", "arguments": {}}', '{"name": "get_weather", "arguments": {"city": "Paris"}'):
        grammar = f'start: {family.mark("<tool_call>")} {json.dumps(body)} {family.mark("</tool_call>")}'
        out = chat(family, stream, messages=ASK, tools=TOOLS, extra=NO_THINKING | {"structured_outputs": {"grammar": grammar}})
        assert (out.content, out.calls, out.finish) == (f"<tool_call>{body}</tool_call>", [], "stop")


@pytest.mark.parametrize("stream", [False, True])
def test_issue_41_a_call_cut_by_max_tokens_is_dropped_with_length(family, stream):
    """tool_choice required, max_tokens 64, and the model goes on to another call after the first (its
    end of turn banned): the cut call is in neither content nor calls, the complete ones are returned."""
    eos = family.tok.convert_tokens_to_ids("<|im_end|>")
    out = chat(family, stream, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=64,
               logit_bias={str(eos): -100}, extra=NO_THINKING)
    assert out.finish == "length" and out.content is None and out.calls, out
    assert all(call in VALID_CALLS for call in out.calls)
    assert out.usage.completion_tokens == 64


@pytest.mark.parametrize("stream", [False, True])
def test_responses_show_the_thinking_as_a_reasoning_item(family, stream):
    grammar = f'start: {family.mark("<think>")} "\\nWeather asked.\\n" {family.mark("</think>")} "\\n\\n" {json.dumps(ANSWER)}'
    out, kinds = respond(family, stream, input=ASK[0]["content"], extra_body={"structured_outputs": {"grammar": grammar}})
    [reasoning], [message] = items(out, "reasoning"), items(out, "message")
    assert [c.text for c in reasoning.content] == ["Weather asked.\n"] and out.output_text == ANSWER
    assert out.output.index(reasoning) < out.output.index(message)
    assert out.usage.output_tokens_details.reasoning_tokens > 0
    if stream:
        assert kinds.index("response.reasoning_text.delta") < kinds.index("response.output_text.delta")


def test_max_output_tokens_makes_an_incomplete_response(family):
    out, _ = respond(family, False, input="Hi", max_output_tokens=3, extra_body=NO_THINKING)
    assert (out.status, out.incomplete_details.reason, out.usage.output_tokens) == ("incomplete", "max_output_tokens", 3)
    kinds = [e.type for e in family.client.responses.create(model=family.model, input="Hi", max_output_tokens=3,
                                                            stream=True, extra_body=NO_THINKING)]
    assert kinds[0] == "response.created" and kinds[-1] == "response.incomplete"


def test_stored_responses_are_bounded_and_the_oldest_evicted(family):
    made = [respond(family, False, input="Hi", max_output_tokens=2, extra_body=NO_THINKING)[0] for _ in range(STORED + 1)]
    unstored = respond(family, False, input="Hi", max_output_tokens=2, store=False)[0]
    for gone in (made[0], unstored):
        with pytest.raises(openai.NotFoundError, match="previous_response_id|not found"):
            respond(family, False, previous_response_id=gone.id, input="And?", max_output_tokens=2)
    kept, _ = respond(family, False, previous_response_id=made[-1].id, input="And?", max_output_tokens=2,
                      extra_body=NO_THINKING)
    assert kept.previous_response_id == made[-1].id and kept.usage.input_tokens > made[-1].usage.input_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_messages_show_thinking_blocks_and_stop_reasons(family, stream):
    grammar = f'start: {family.mark("<think>")} "\\nWeather asked.\\n" {family.mark("</think>")} "\\n\\n" {json.dumps(ANSWER)}'
    out, kinds = message(family, stream, extra_body={"structured_outputs": {"grammar": grammar}})
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in out.content] == [
        ("thinking", "Weather asked.\n"), ("text", ANSWER)] and out.stop_reason == "end_turn"
    stopped, _ = message(family, stream, stop_sequences=["sunny"], thinking={"type": "disabled"},
                         extra_body={"structured_outputs": {"grammar": f"start: {json.dumps(ANSWER)}"}})
    assert (stopped.content[0].text, stopped.stop_reason, stopped.stop_sequence) == ("It is ", "stop_sequence", "sunny")
    cut, _ = message(family, stream, max_tokens=2, thinking={"type": "disabled"})
    assert (cut.stop_reason, cut.usage.output_tokens) == ("max_tokens", 2)


def test_messages_errors_take_anthropics_shape(family):
    client = anthropic.Anthropic(base_url=family.base_url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model=family.model, max_tokens=0, messages=ASK)
    assert bad.value.body["type"] == "error" and bad.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in bad.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="image"):
        client.messages.create(model=family.model, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="claude-nope", max_tokens=4, messages=ASK)
    assert missing.value.body["error"]["type"] == "not_found_error"
