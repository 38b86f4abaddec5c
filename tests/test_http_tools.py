"""Tool calling on the chat API: orca-mq's own rendering of tools (orca_mq/api/tools.py) on its own, then
through the official `openai` client against a real server with the embedded model, whose template
renders no tools (so orca-mq's system message and the hermes parser serve it): `required` and a named
function give calls whose arguments validate against the tool's JSON schema (streamed and not), `none`
shows no tools, and a tool_choice naming no tool is a 400. What a request costs the others is bounded: a
reply of a tag and a long run of whitespace parses in linear time (the HTTP API's event loop answers
/health throughout), a call nested deeper than json reads is no call, and an earlier call's arguments
nested too deeply to read are a 400 naming the field. Each family's own format: tests/test_http_agents.py."""
from __future__ import annotations

import json
import threading
import time

import httpx
import jsonschema
import openai
import pytest

from orca_mq.api.chat_format import PLAIN
from orca_mq.api.parsers import output_parser, parse_all
from orca_mq.api.tool_grammar import constraint
from orca_mq.api.tools import CLOSE, OPEN, CalledFunction, Function, NamedFunction, NamedToolChoice, Tool, ToolCall, render, shown
from serving_harness import free_port, openai_client, start_server

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"], "properties": {
    "city": {"type": "string", "minLength": 1, "maxLength": 24},
    "unit": {"enum": ["celsius", "fahrenheit"]}}}
TIME = {"type": "object", "additionalProperties": False, "required": ["zone"],
        "properties": {"zone": {"type": "string", "maxLength": 16}}}
TOOLS = [Tool(type="function", function=Function(name="get_weather", description="Weather in a city", parameters=WEATHER)),
         Tool(type="function", function=Function(name="get_time", description="Time in a zone", parameters=TIME))]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def call_text(name: str, args: dict) -> str:
    return f"{OPEN}\n" + json.dumps({"name": name, "arguments": args}) + f"\n{CLOSE}"


def test_a_call_nested_deeper_than_json_reads_is_text_not_an_error():
    for bad in (f"{OPEN}{'[' * 5000}{CLOSE}", f"{OPEN}{'[' * 5000}{']' * 5000}{CLOSE}"):
        parsed = parse_all(output_parser("hermes", None, {"get_weather"}), bad, "stop")
        assert parsed.calls == [] and "".join(parsed.content_parts) == bad


def test_render_shows_tools_once_and_writes_calls_and_results_back():
    history = [{"role": "system", "content": "Be brief."}, *ASK,
               {"role": "assistant", "content": "", "tool_calls": [ToolCall(id="c1", function=CalledFunction(
                   name="get_weather", arguments='{"city": "Paris", "unit": "celsius"}')).model_dump()]},
               {"role": "tool", "content": "18 C, sunny"}]
    out = render(history, TOOLS)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "tool"]
    assert out[0]["content"].startswith("Be brief.") and '"get_time"' in out[0]["content"]
    assert parse_all(output_parser("hermes", None, {"get_weather"}), out[2]["content"], "stop").calls[0].name == "get_weather"
    assert out[3]["content"] == "<tool_response>\n18 C, sunny\n</tool_response>"
    assert all(set(m) == {"role", "content"} for m in out)
    assert render(ASK, []) == ASK


def test_choice_selects_what_is_shown_and_constrained():
    named = NamedToolChoice(type="function", function=NamedFunction(name="get_time"))
    assert shown(TOOLS, "none") == [] and shown(TOOLS, named) == [TOOLS[1]] and shown(None, "auto") == []
    one, many = (constraint(PLAIN, TOOLS, parallel, False)["grammar"] for parallel in (False, True))
    assert '"get_weather"' in one and "call (" not in one and 'call ("\\n" call)*' in many


@pytest.fixture(scope="module")
def oai(tmp_path_factory):
    port = free_port()
    srv = start_server(tmp_path_factory.mktemp("tools"), **{"server.http_address": f"127.0.0.1:{port}",
                                                           "scheduler.max_bs": 4, "engine.n_slots": 4096})
    client = openai_client(f"http://127.0.0.1:{port}")
    yield client
    client.close()
    assert srv.stop() == 0, srv.stderr()[-3000:]


def tools_json() -> list[dict]:
    return [t.model_dump(exclude_none=True) for t in TOOLS]


@pytest.mark.e2e
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_required_and_named_calls_validate_against_the_schema(oai, choice):
    out = oai.chat.completions.create(model=oai.models.list().data[0].id, messages=ASK, tools=tools_json(),
                                      tool_choice=choice, parallel_tool_calls=False, temperature=0,
                                      max_completion_tokens=120)
    msg, schemas = out.choices[0].message, {t.function.name: t.function.parameters for t in TOOLS}
    assert out.choices[0].finish_reason == "tool_calls" and len(msg.tool_calls) == 1, msg
    call = msg.tool_calls[0]
    assert call.id.startswith("call_") and call.type == "function"
    if isinstance(choice, dict):
        assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    # the same request streamed: the call comes as a delta with the final chunk
    chunks = list(oai.chat.completions.create(model=oai.models.list().data[0].id, messages=ASK, tools=tools_json(),
                                              tool_choice=choice, parallel_tool_calls=False, temperature=0,
                                              max_completion_tokens=120, stream=True))
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert [(d.function.name, d.function.arguments) for d in deltas] == [(call.function.name, call.function.arguments)]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    # and the call and its result go back into the conversation
    again = oai.chat.completions.create(model=oai.models.list().data[0].id, tools=tools_json(), temperature=0,
                                        max_completion_tokens=8, messages=[*ASK, msg.model_dump(exclude_none=True),
                                                                           {"role": "tool", "tool_call_id": call.id,
                                                                            "content": "18 C"}])
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.e2e
def test_none_and_bad_choices(oai):
    model = oai.models.list().data[0].id
    out = oai.chat.completions.create(model=model, messages=ASK, tools=tools_json(), tool_choice="none",
                                      temperature=0, max_completion_tokens=8)
    assert out.choices[0].message.tool_calls is None and out.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError, match="names no tool"):
        oai.chat.completions.create(model=model, messages=ASK, tools=tools_json(), max_completion_tokens=8,
                                    tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match="constrains the output itself"):
        oai.chat.completions.create(model=model, messages=ASK, tools=tools_json(), tool_choice="required",
                                    response_format={"type": "json_object"}, max_completion_tokens=8)


SPACES_64 = 40686   # the embedded tokenizer's token of 64 spaces


@pytest.mark.e2e
@pytest.mark.parametrize("stream", [False, True])
def test_a_tag_then_a_long_run_of_whitespace_does_not_stall_the_api(oai, stream):
    """`<tool_call>` then ~3,500 spaces (forced here; a small model's runaway whitespace does it by
    accident): a regex with a lazy body between two `\\s*` backtracks in cubic time on it, a minute on
    the HTTP process's only event loop (issue 44). Parsed linearly, /health answers throughout."""
    base = str(oai.base_url).removesuffix("/v1/")
    body = {"model": oai.models.list().data[0].id, "messages": ASK, "tools": tools_json(), "temperature": 0,
            "max_completion_tokens": 60, "structured_outputs": {"regex": "<tool_call> +"},
            "logit_bias": {str(SPACES_64): 100}, "stream": stream}
    done: list[httpx.Response] = []
    worker = threading.Thread(target=lambda: done.append(httpx.post(f"{base}/v1/chat/completions", json=body, timeout=300)))
    worker.start()
    worst = 0.0
    with httpx.Client(base_url=base, timeout=30) as http:
        while worker.is_alive():
            t = time.monotonic()
            assert http.get("/health").status_code == 200
            worst = max(worst, time.monotonic() - t)
            time.sleep(0.05)
    worker.join()
    assert done[0].status_code == 200, done[0].text
    text = done[0].text if stream else done[0].json()["choices"][0]["message"]["content"]
    assert text.count(" " * 64) >= 40   # no call (no closing tag): all of it content
    assert '"finish_reason":"tool_calls"' not in text if stream else done[0].json()["choices"][0]["finish_reason"] == "stop"
    assert worst < 5.0, f"/health took {worst:.1f} s while the reply was parsed"


@pytest.mark.e2e
def test_arguments_nested_too_deeply_are_a_400_naming_the_field(oai):
    base = str(oai.base_url).removesuffix("/v1/")
    deep = "[" * 100_000 + "]" * 100_000
    call = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": deep}}
    r = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
        "messages": [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]}], "tools": tools_json(),
        "max_completion_tokens": 2})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages.1.tool_calls.0.function.arguments"
