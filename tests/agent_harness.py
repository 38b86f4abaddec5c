"""The agent tests' harness (tests/test_http_agents.py, tests/test_http_reasoning.py): real servers of the
families' tiny checkpoints (tests/family_models.py), one at a time, and the three APIs' calls through the real SDKs,
each streamed or not and added up the same way: `chat` (openai's chat completions), `respond`
(openai's Responses: responses.create / responses.stream), `message` (anthropic's messages.create /
messages.stream)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import anthropic
import openai
from _pytest.tmpdir import TempPathFactory
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from family_models import build
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


class FamilyServers:
    """A real server of a format's tiny family checkpoint, and the openai client on it: one at a time (the
    last asked for, started on first use), shared by the test modules (conftest's `family_servers`)."""

    def __init__(self, tmp: TempPathFactory) -> None:
        self.tmp = tmp
        self.live: Family | None = None

    def get(self, fmt: str) -> Family:
        if self.live is not None and self.live.fmt == fmt:
            return self.live
        self.close()
        path = build(self.tmp.mktemp(f"model_{fmt}"), fmt)
        port = free_port()
        srv = start_server(self.tmp.mktemp(f"srv_{fmt}"), **{
            "model.path": str(path), "server.http_address": f"127.0.0.1:{port}", "model.max_model_len": 4096,
            "scheduler.max_bs": 4, "engine.n_slots": 8192, "server.responses_store": STORED})
        base = f"http://127.0.0.1:{port}"
        self.live = Family(fmt, srv, base, openai_client(base), AutoTokenizer.from_pretrained(path))
        self.live.model = self.live.client.models.list().data[0].id
        return self.live

    def close(self) -> None:
        if self.live is not None:
            live, self.live = self.live, None
            live.client.close()
            assert live.server.stop() == 0, live.server.stderr()[-3000:]


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


ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]
ANSWER_OUTPUT = {"format": {"type": "json_schema", "schema": ANSWER_FORMAT["format"]["schema"]}}


def message(fam: Family, stream: bool, **kwargs: Any) -> tuple[Any, list[str]]:
    """A message and, streamed, its events' types (through the SDK's stream helper)."""
    client = anthropic.Anthropic(base_url=fam.base_url, api_key="unused", max_retries=0, timeout=120)
    kwargs = {"model": fam.model, "max_tokens": 96, "messages": ASK} | kwargs
    kwargs["extra_body"] = {"temperature": 0} | kwargs.get("extra_body", {})   # (this SDK sends no temperature)
    if not stream:
        return client.messages.create(**kwargs), []
    with client.messages.stream(**kwargs) as events:
        kinds = [e.type for e in events]
        return events.get_final_message(), kinds


