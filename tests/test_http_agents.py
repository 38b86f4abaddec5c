"""What agents speak, through the real SDKs against a real server, on a tiny random checkpoint of each
family that writes one tool format (tests/family_models.py: Qwen3 hermes + <think>, Llama 3.2
llama3_json, Mistral Nemo mistral, gpt-oss harmony), with the family's real chat template:

- an agent loop (a call, its result, a final answer) through chat completions, streamed and not, the
  call constrained to the format by a named tool_choice and the answer forced by a grammar;
- on Qwen3 (hermes + think): the thinking in reasoning_content and counted in usage, turned off by
  enable_thinking; the streamed parse equals the whole one at the HTTP level on outputs cut at random
  token boundaries; a malformed call back as text with `stop`; issue 41's cut call (required,
  max_tokens 64, a further call begun) dropped with `length`;
- special tokens the parser reads kept from the engine but out of what the client sees, unless asked;
- the same loop through the Responses API (`responses.create`, `responses.stream`: its event sequence),
  statelessly and by previous_response_id; reasoning items; max_output_tokens' incomplete response; the
  store's bound (the oldest evicted: 404).

Random weights write random text: a grammar (structured outputs) or tool_choice makes the model write
what a test needs.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from family_models import SERVED, build
from serving_harness import Server, free_port, openai_client, start_server

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris"]}}, "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Time in a zone",
                                           "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC"]}},
                                                          "required": ["zone"], "additionalProperties": False}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
ANSWER = "It is sunny in Paris."
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}   # a variable only Qwen3's template reads
WEATHER_CHOICE = {"type": "function", "function": {"name": "get_weather"}}
STORED = 3    # server.responses_store: the oldest of more is evicted


@dataclass
class Family:
    fmt: str
    server: Server
    base_url: str
    client: openai.OpenAI
    tok: PreTrainedTokenizerBase
    model: str = ""

    def mark(self, text: str) -> str:
        """A marker in a test grammar: its token where the vocabulary has one (no text spells an added token)."""
        return f"<[{self.tok.convert_tokens_to_ids(text)}]>" if text in self.tok.get_added_vocab() else json.dumps(text)

    def answer_grammar(self) -> dict[str, Any]:
        """The final answer in the format's own form (gpt-oss: its final channel)."""
        if self.fmt == "gpt_oss":
            return {"grammar": f'start: {self.mark("<|channel|>")} "final" {self.mark("<|message|>")} {json.dumps(ANSWER)}'}
        return {"grammar": f"start: {json.dumps(ANSWER)}"}


@pytest.fixture(scope="module", params=list(SERVED))
def family(request, tmp_path_factory) -> Family:
    fmt = request.param
    path = build(tmp_path_factory.mktemp(f"model_{fmt}"), fmt)
    port = free_port()
    srv = start_server(tmp_path_factory.mktemp(f"srv_{fmt}"), **{
        "model.path": str(path), "server.http_address": f"127.0.0.1:{port}", "model.max_model_len": 4096,
        "scheduler.max_bs": 4, "engine.n_slots": 8192, "server.responses_store": STORED})
    base = f"http://127.0.0.1:{port}"
    fam = Family(fmt, srv, base, openai_client(base), AutoTokenizer.from_pretrained(path))
    fam.model = fam.client.models.list().data[0].id
    yield fam
    fam.client.close()
    assert srv.stop() == 0, srv.stderr()[-3000:]


def only(*formats: str):
    """A test of the formats named, on the module's server of each."""
    return pytest.mark.parametrize("family", formats, indirect=True)


@dataclass
class Chat:
    """A chat completion as the client sees it, streamed deltas added up the same way."""
    content: str | None
    reasoning: str | None
    calls: list[tuple[str, dict[str, Any]]]
    finish: str
    raw_calls: list[dict[str, Any]] = field(default_factory=list)   # as the next request sends them back
    usage: Any = None


def chat(fam: Family, stream: bool, **kwargs: Any) -> Chat:
    kwargs = {"model": fam.model, "temperature": 0, "max_tokens": 96} | kwargs
    extra = kwargs.pop("extra", {})
    if not stream:
        out = fam.client.chat.completions.create(**kwargs, extra_body=extra or None)
        m = out.choices[0].message
        raw = [c.model_dump() for c in m.tool_calls or []]
        return Chat(m.content, getattr(m, "reasoning_content", None),
                    [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in raw], out.choices[0].finish_reason,
                    raw, out.usage)
    chunks = list(fam.client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True},
                                                     extra_body=extra or None))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        for k in d.tool_calls or []:
            call = calls.setdefault(k.index, {"id": k.id, "type": "function", "function": {"name": "", "arguments": ""}})
            call["function"]["name"] += k.function.name or ""
            call["function"]["arguments"] += k.function.arguments or ""
    content = "".join(d.content or "" for d in deltas)
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    raw = [calls[i] for i in sorted(calls)]
    return Chat(None if raw and not content.strip() else content, reasoning or None,
                [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in raw],
                [c.choices[0].finish_reason for c in chunks if c.choices][-1], raw, chunks[-1].usage)


# ------------------------------------------------------------------ the agent loop, every format


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


# ------------------------------------------------------------------ hermes and <think> (Qwen3)


def _weather_call(fam: Family) -> str:
    call = {"type": "object", "properties": {"name": {"const": "get_weather"}, "arguments": WEATHER},
            "required": ["name", "arguments"], "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}
    return f'{fam.mark("<tool_call>")} "\\n" %json {json.dumps(call)} "\\n" {fam.mark("</tool_call>")}'


@only("hermes")
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


@only("hermes")
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


@only("hermes")
@pytest.mark.parametrize("stream", [False, True])
def test_a_malformed_call_comes_back_as_text_with_stop(family, stream):
    for body in ('{"name": "rm_rf", "arguments": {}}', '{"name": "get_weather", "arguments": {"city": "Paris"}'):
        grammar = f'start: {family.mark("<tool_call>")} {json.dumps(body)} {family.mark("</tool_call>")}'
        out = chat(family, stream, messages=ASK, tools=TOOLS, extra=NO_THINKING | {"structured_outputs": {"grammar": grammar}})
        assert (out.content, out.calls, out.finish) == (f"<tool_call>{body}</tool_call>", [], "stop")


@only("hermes")
@pytest.mark.parametrize("stream", [False, True])
def test_issue_41_a_call_cut_by_max_tokens_is_dropped_with_length(family, stream):
    """tool_choice required, max_tokens 64, and the model goes on to another call after the first (its
    end of turn banned): the cut call is in neither content nor calls, the complete ones are returned."""
    eos = family.tok.convert_tokens_to_ids("<|im_end|>")
    out = chat(family, stream, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=64,
               logit_bias={str(eos): -100}, extra=NO_THINKING)
    assert out.finish == "length" and out.content is None and out.calls, out
    assert all(call in [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "UTC"})] for call in out.calls)
    assert out.usage.completion_tokens == 64


# ------------------------------------------------------------------ special tokens


@only("llama3_json")
@pytest.mark.parametrize("stream", [False, True])
def test_special_tokens_reach_the_parser_but_not_the_client_unless_asked(family, stream):
    grammar = {"grammar": f'start: "Hi " {family.mark("<|start_header_id|>")} " there"'}
    shown = chat(family, stream, messages=ASK, tools=TOOLS, extra={"structured_outputs": grammar})
    kept = chat(family, stream, messages=ASK, tools=TOOLS, extra={"structured_outputs": grammar, "skip_special_tokens": False})
    assert (shown.content, kept.content) == ("Hi  there", "Hi <|start_header_id|> there")
    # and the parser reads its <|python_tag|> (a special token) either way
    tagged = {"grammar": f'start: "Checking. " {family.mark("<|python_tag|>")} '
                         f'"{{\\"name\\": \\"get_weather\\", \\"parameters\\": {{\\"city\\": \\"Paris\\"}}}}"'}
    out = chat(family, stream, messages=ASK, tools=TOOLS, extra={"structured_outputs": tagged})
    assert (out.content, out.calls, out.finish) == ("Checking. ", [("get_weather", {"city": "Paris"})], "tool_calls")


# ------------------------------------------------------------------ the Responses API

FLAT_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]
ANSWER_FORMAT = {"format": {"type": "json_schema", "name": "answer", "strict": True, "schema": {
    "type": "object", "properties": {"answer": {"const": ANSWER}}, "required": ["answer"], "additionalProperties": False}}}


def respond(fam: Family, stream: bool, **kwargs: Any) -> tuple[Any, list[str]]:
    """A response and, streamed, its events' types (through the SDK's stream helper)."""
    kwargs = {"model": fam.model, "temperature": 0, "max_output_tokens": 96} | kwargs
    if not stream:
        return fam.client.responses.create(**kwargs), []
    with fam.client.responses.stream(**kwargs) as events:
        kinds = [e.type for e in events]
        return events.get_final_response(), kinds


def items(response: Any, kind: str) -> list[Any]:
    return [o for o in response.output if o.type == kind]


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


@only("hermes")
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


@only("hermes")
def test_max_output_tokens_makes_an_incomplete_response(family):
    out, _ = respond(family, False, input="Hi", max_output_tokens=3, extra_body=NO_THINKING)
    assert (out.status, out.incomplete_details.reason, out.usage.output_tokens) == ("incomplete", "max_output_tokens", 3)
    kinds = [e.type for e in family.client.responses.create(model=family.model, input="Hi", max_output_tokens=3,
                                                            stream=True, extra_body=NO_THINKING)]
    assert kinds[0] == "response.created" and kinds[-1] == "response.incomplete"


@only("hermes")
def test_stored_responses_are_bounded_and_the_oldest_evicted(family):
    made = [respond(family, False, input="Hi", max_output_tokens=2, extra_body=NO_THINKING)[0] for _ in range(STORED + 1)]
    unstored = respond(family, False, input="Hi", max_output_tokens=2, store=False)[0]
    for gone in (made[0], unstored):
        with pytest.raises(openai.NotFoundError, match="previous_response_id|not found"):
            respond(family, False, previous_response_id=gone.id, input="And?", max_output_tokens=2)
    kept, _ = respond(family, False, previous_response_id=made[-1].id, input="And?", max_output_tokens=2,
                      extra_body=NO_THINKING)
    assert kept.previous_response_id == made[-1].id and kept.usage.input_tokens > made[-1].usage.input_tokens
