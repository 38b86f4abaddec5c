"""What agents speak, through the real SDKs against a real server, on a tiny random checkpoint of each
family that writes one tool format (tests/family_models.py: Qwen3 hermes + <think>, Llama 3.2
llama3_json, Mistral Nemo mistral, gpt-oss harmony), with the family's real chat template: an agent
loop — a call, its result, a final answer — through chat completions, the Responses API (statelessly
and by previous_response_id; its event sequence streamed) and the Messages API (tool_use and
tool_result blocks; its events), each streamed and not, the call constrained to the format by a named
tool choice and the answer forced by structured outputs; and special tokens the parser reads kept from
the engine but out of what the client sees, unless asked. Random weights write random text: a grammar
or the tool choice makes the model write what a test needs. Qwen3's thinking, the parse on every cut,
malformed and cut calls: tests/test_http_reasoning.py.
"""
from __future__ import annotations

import json

import pytest

from agent_harness import (ANSWER, ANSWER_FORMAT, ANSWER_OUTPUT, ANTHROPIC_TOOLS, ASK, FLAT_TOOLS, NO_THINKING, TOOLS,
                           WEATHER_CHOICE, Family, chat, items, message, respond)
from family_models import SERVED

SPECIAL = {"hermes": "<|im_start|>", "llama3_json": "<|start_header_id|>", "mistral": "[INST]", "gpt_oss": "<|endoftext|>"}


@pytest.fixture(scope="module", params=list(SERVED)[::-1])   # hermes last: tests/test_http_reasoning.py goes on with it
def family(request, family_servers) -> Family:
    return family_servers.get(request.param)


@pytest.mark.parametrize("stream", [False, True])
def test_an_agent_loop_completes_through_chat_completions(family, stream):
    first = chat(family, stream, messages=ASK, tools=TOOLS, tool_choice=WEATHER_CHOICE, parallel_tool_calls=False,
                 extra=NO_THINKING)
    assert first.calls == [("get_weather", {"city": "Paris"})] and first.finish == "tool_calls", first
    assert not first.content
    turn = {"role": "assistant", "content": None, "tool_calls": first.raw_calls}
    result = {"role": "tool", "tool_call_id": first.raw_calls[0]["id"], "content": "18 C, sunny"}
    final = chat(family, stream, messages=[*ASK, turn, result], tools=TOOLS,
                 extra=NO_THINKING | {"structured_outputs": family.answer_grammar()})
    assert (final.content, final.calls, final.finish) == (ANSWER, [], "stop"), final


@pytest.mark.parametrize("stream", [False, True])
def test_special_tokens_reach_the_parser_but_not_the_client_unless_asked(family, stream):
    """A special token the model writes is left out of the answer; kept with skip_special_tokens false
    (llama3_json, mistral and gpt_oss read their markers from the engine's text, which keeps them)."""
    grammar = {"grammar": f'start: "Hi " {family.mark(SPECIAL[family.fmt])} " there"'}
    shown = chat(family, stream, messages=ASK, extra={"structured_outputs": grammar})
    kept = chat(family, stream, messages=ASK, extra={"structured_outputs": grammar, "skip_special_tokens": False})
    assert (shown.content, kept.content) == ("Hi  there", f"Hi {SPECIAL[family.fmt]} there")


@pytest.mark.parametrize("stream", [False, True])
def test_an_agent_loop_completes_through_responses(family, stream):
    first, kinds = respond(family, stream, input=ASK[0]["content"], tools=FLAT_TOOLS, parallel_tool_calls=False,
                           tool_choice={"type": "function", "name": "get_weather"}, extra_body=NO_THINKING)
    [call] = items(first, "function_call")
    assert (call.name, json.loads(call.arguments), first.status) == ("get_weather", {"city": "Paris"}, "completed")
    if stream:
        assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
        assert "response.function_call_arguments.delta" in kinds and "response.output_text.delta" not in kinds
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"}
    # streamed: the conversation by previous_response_id (stored); not: the whole input sent back
    given = {"previous_response_id": first.id, "input": [result]} if stream else {
        "input": [*ASK, *(o.model_dump(exclude_none=True) for o in first.output), result]}
    final, kinds = respond(family, stream, tools=FLAT_TOOLS, text=ANSWER_FORMAT, extra_body=NO_THINKING, **given)
    assert json.loads(final.output_text) == {"answer": ANSWER} and not items(final, "function_call")
    assert final.usage.output_tokens > 0 and final.usage.input_tokens > first.usage.input_tokens
    if stream:
        assert "response.output_text.delta" in kinds and kinds[-1] == "response.completed"


@pytest.mark.parametrize("stream", [False, True])
def test_an_agent_loop_completes_through_messages(family, stream):
    first, kinds = message(family, stream, tools=ANTHROPIC_TOOLS, thinking={"type": "disabled"},
                           tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True})
    [use] = [b for b in first.content if b.type == "tool_use"]
    assert (use.name, use.input, first.stop_reason) == ("get_weather", {"city": "Paris"}, "tool_use")
    if stream:
        assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
        assert "content_block_start" in kinds and "content_block_stop" in kinds
    turns = [*ASK, {"role": "assistant", "content": first.content},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 C, sunny"}]}]
    final, _ = message(family, stream, messages=turns, tools=ANTHROPIC_TOOLS, output_config=ANSWER_OUTPUT,
                       thinking={"type": "disabled"})
    assert [b.type for b in final.content] == ["text"] and json.loads(final.content[0].text) == {"answer": ANSWER}
    assert final.stop_reason == "end_turn" and final.usage.input_tokens > first.usage.input_tokens > 0
