"""Request and response bodies of the OpenAI-compatible API (pydantic), and their mapping to orca-mq
sampling parameters.

Strict, like the ZeroMQ side: a field the schema does not name is refused with 400
(`unknown_parameter`, naming it); an OpenAI field orca-mq does not implement is refused with 400
(`unsupported_parameter`) unless it carries its no-op value (null, `best_of: 1`, `echo: false`, a 0
penalty, ...), so clients that send defaults still work; numbers are bounded at the schema (the
bounds of orca_mq.protocol.sampling), integers are integers (`1e30` and `5.0` are not), so no value of
any magnitude reaches the wire.

Accepted as OpenAI does: `max_tokens` (chat: also `max_completion_tokens`; absent = the rest of the
context), `temperature`, `top_p`, `seed`, `stop` (a string or a list of them), `n` (choices per prompt,
fanned out by orca_mq.api.fanout; the server bounds it), completions' `prompt` as a batch (a list of
strings or of token-id lists),
`stream`, `stream_options.include_usage`, `response_format` (text, json_object, json_schema), `user`
(accepted, unused), `presence_penalty` / `frequency_penalty` ([-2, 2]), `logit_bias` (token id -> [-100, 100],
at most model.max_logit_bias entries), chat `tools` / `tool_choice` / `parallel_tool_calls` (orca_mq.api.tools); as vLLM's extensions: `top_k` (-1 or 0 = off), `ignore_eos`, `stop_token_ids`,
`repetition_penalty`, `min_tokens`, `min_p`, `structured_outputs` (its shape and grammar are checked by the frontend, as on the ZeroMQ side),
`skip_special_tokens` (default true), chat `chat_template_kwargs` (orca_mq.admission.prompts bounds them);
log probabilities: chat `logprobs` / `top_logprobs`, completions `logprobs` (k) and `echo` (with
`max_tokens` 0 too), shaped by orca_mq.api.logprobs.
"""
from __future__ import annotations

import functools
import time
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, PrivateAttr, Tag, model_validator
from pydantic_core import PydanticCustomError

from orca_mq.api.chat_format import PLAIN, ChatFormat
from orca_mq.api.errors import ApiError
from orca_mq.api.tool_grammar import constraint
from orca_mq.config import MAX_PROMPTS
from orca_mq.api.tools import MAX_TOOLS, Tool, ToolCall, ToolCallDelta, ToolChoice, render, shown
from orca_mq.api.logprobs import ChatLogprobs, CompletionLogprobs
from orca_mq.admission.prompts import check_template_kwargs
from orca_mq.errors import InvalidRequest
from orca_mq.api.fields import bounded, http
from orca_mq.protocol.sampling_fields import (BIAS, INT32_MAX, MAX_LOGIT_BIAS_ENTRIES, MAX_STOP_TOKEN_IDS, TOKEN_ID,
                                              min_tokens_problem)

MAX_MESSAGES = 4096             # messages of one request (Responses' input items): each costs the HTTP loop microseconds
MAX_STOP_STRINGS = 16           # these two bound the work of the stop-string check on every token
MAX_STOP_LEN = 256
TokenId = http(TOKEN_ID)


def _prompt_kind(v: Any) -> str | None:
    """Which of Prompts' forms a value takes, by its first element: only that one is validated (a union
    tries each, and a list that fails one is read to its end: 800,000 one-id prompts in a 4 MB body
    cost 1.5-3 s of the event loop before the fan-out refused them)."""
    if isinstance(v, str):
        return "str"
    if not isinstance(v, list):
        return None
    return "list[str]" if v and isinstance(v[0], str) else "list[list[int]]" if v and isinstance(v[0], list) else "list[int]"


def _batch_bounded(v: Any) -> Any:
    """A batch of more than MAX_PROMPTS is refused before its prompts are read."""
    if isinstance(v, list) and len(v) > MAX_PROMPTS and _prompt_kind(v) != "list[int]":
        raise PydanticCustomError("too_long", "a batch of at most {most} prompts, not {n}", {"most": MAX_PROMPTS, "n": len(v)})
    return v


# a prompt, its ids, or a batch of either (at most MAX_PROMPTS); a list stops at its first wrong element. The
# tags are pydantic's own names for union members, which an error's param leaves out (api/errors.py)
Prompts = Annotated[Annotated[str, Tag("str")] | Annotated[list[TokenId], Field(fail_fast=True), Tag("list[int]")]
                    | Annotated[list[str], Field(fail_fast=True), Tag("list[str]")]
                    | Annotated[list[Annotated[list[TokenId], Field(fail_fast=True)]], Field(fail_fast=True), Tag("list[list[int]]")],
                    Discriminator(_prompt_kind, custom_error_type="prompt_type", custom_error_message=(
                        "Input should be a string, a list of token ids, a list of strings or a list of lists of token ids")),
                    BeforeValidator(_batch_bounded)]

BiasKey = Annotated[int, Field(ge=TOKEN_ID.low, le=TOKEN_ID.high)]   # a JSON object's key: the token id as a string

# OpenAI fields orca-mq does not implement -> the values that ask for nothing (null always does)
COMPLETION_UNSUPPORTED: dict[str, tuple[Any, ...]] = {"best_of": (1,), "suffix": ("",)}
CHAT_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "functions": ([],),
    "function_call": ("none",), "audio": (), "modalities": (["text"],),
    "prediction": (), "reasoning_effort": (), "service_tier": ("auto", "default"), "store": (False,), "metadata": (),
    "web_search_options": (), "prompt_cache_key": (), "safety_identifier": (), "verbosity": (),
}
MESSAGE_UNSUPPORTED = {"function_call": (), "refusal": (), "audio": ()}


def _noop(value: Any, noops: tuple[Any, ...]) -> bool:
    return value is None or any(type(value) is type(v) and value == v for v in noops) or (
        type(value) is float and any(type(v) is int and value == v for v in noops))


class Strict(BaseModel):
    """Refuses what it does not name; an UNSUPPORTED field only with its no-op value, which is dropped."""

    model_config = ConfigDict(extra="forbid")
    UNSUPPORTED: ClassVar[dict[str, tuple[Any, ...]]] = {}

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        known = cls._names()
        if data.keys() <= known:   # the usual body, one test in C (a Python loop over every message's keys otherwise)
            return data
        for key, value in data.items():
            if key in known:
                continue
            if key in cls.UNSUPPORTED:
                if not _noop(value, cls.UNSUPPORTED[key]):
                    raise PydanticCustomError("unsupported_parameter", "unsupported parameter '{param}': orca-mq does "
                                              "not implement it (see the README's list)", {"param": key})
                continue
            raise PydanticCustomError("unknown_parameter", "unknown parameter '{param}'", {"param": str(key)[:80]})
        return {k: v for k, v in data.items() if k not in cls.UNSUPPORTED or k in known}

    @classmethod
    @functools.cache
    def _names(cls) -> frozenset[str]:
        """The names a body may use for the fields (an alias where one is set)."""
        return frozenset(f.alias or name for name, f in cls.model_fields.items())


class StreamOptions(Strict):
    include_usage: bool = Field(False, strict=True)


class JsonSchemaFormat(Strict):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = Field(None, max_length=4096)                       # accepted, unused
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # absent: any JSON object
    strict: bool | None = Field(None, strict=True)   # the output always follows the schema, strict or not


class ResponseFormat(Strict):
    """OpenAI's `response_format`."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise PydanticCustomError("value_error", "json_schema is required with type json_schema, and only with it",
                                      {"param": "response_format"})
        return self

    def structured_outputs(self) -> dict[str, Any] | None:
        """As orca-mq's StructuredOutputsParams fields; None for plain text."""
        if self.type == "text":
            return None
        if self.json_schema is None or self.json_schema.schema_ is None:
            return {"json_object": True}
        return {"json": self.json_schema.schema_}


class _Sampling(Strict):
    """The sampling fields both routes take: each one's bounds are the table's (orca_mq.protocol.sampling_fields)."""
    model: str | None = None
    max_tokens: http("max_tokens") | None = None
    temperature: http("temperature") | None = None
    top_p: http("top_p") | None = None
    seed: http("seed") | None = None
    n: int | None = Field(None, strict=True, ge=1, le=INT32_MAX)   # choices per prompt; the server bounds it (server.http_max_n)
    stop: str | list[str] | None = None
    stream: bool = Field(False, strict=True)
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256)                         # OpenAI's end-user id: accepted, unused
    top_k: http("top_k", low=-1) | None = None                             # vLLM extension; -1 = off, as vLLM
    ignore_eos: http("ignore_eos") | None = None                           # vLLM extension
    stop_token_ids: bounded(list[TokenId], MAX_STOP_TOKEN_IDS) | None = None  # vLLM extension
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM extension: json | regex | choice | grammar | json_object
    presence_penalty: http("presence_penalty") | None = None
    frequency_penalty: http("frequency_penalty") | None = None
    logit_bias: bounded(dict[BiasKey, http(BIAS)], MAX_LOGIT_BIAS_ENTRIES) | None = None   # the server's model.max_logit_bias: the frontend's
    repetition_penalty: http("repetition_penalty") | None = None           # vLLM extension
    min_tokens: http("min_tokens") | None = None                           # vLLM extension
    min_p: http("min_p") | None = None                                     # vLLM extension
    skip_special_tokens: http("skip_special_tokens") | None = None         # vLLM extension; default true

    @model_validator(mode="after")
    def _stops(self) -> "_Sampling":
        if self.structured_outputs is not None and self.response_format is not None and self.response_format.type != "text":
            raise PydanticCustomError("value_error", "give response_format or structured_outputs, not both",
                                      {"param": "structured_outputs"})
        if self.min_tokens is not None and (problem := min_tokens_problem(self.min_tokens, self.limit())):
            raise PydanticCustomError("value_error", problem, {"param": "min_tokens"})
        if len(self.stop_strings) > MAX_STOP_STRINGS or any(not 0 < len(s) <= MAX_STOP_LEN for s in self.stop_strings):
            raise PydanticCustomError("value_error", "stop: at most {n} strings of 1 to {chars} characters",
                                      {"n": MAX_STOP_STRINGS, "chars": MAX_STOP_LEN, "param": "stop"})
        return self

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def limit(self) -> int | None:
        return self.max_tokens

    def field(self, param: str | None) -> str | None:
        """The request's name for a field the server blames by its wire name (InvalidRequest.param)."""
        return "logprobs" if param == "prompt_logprobs" else param   # echo's k is logprobs'

    def sampling(self) -> dict[str, Any]:
        """The SamplingParams fields that were given; max_tokens None = the rest of the context (the frontend's)."""
        given = {"temperature": self.temperature, "top_p": self.top_p, "seed": self.seed,
                 "top_k": None if self.top_k is None else max(0, self.top_k),
                 "ignore_eos": self.ignore_eos, "stop_token_ids": self.stop_token_ids,
                 "structured_outputs": self.structured_outputs if self.response_format is None
                 else self.response_format.structured_outputs(),
                 "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
                 "repetition_penalty": self.repetition_penalty, "min_tokens": self.min_tokens, "min_p": self.min_p,
                 "skip_special_tokens": self.skip_special_tokens,
                 "logit_bias": None if self.logit_bias is None else {str(k): v for k, v in self.logit_bias.items()}}
        return {"max_tokens": self.limit()} | {k: v for k, v in given.items() if v is not None} | self.logprob_params()

    def logprob_params(self) -> dict[str, Any]:
        """The SamplingParams log-probability fields it asks for (orca_mq.api.logprobs)."""
        return {}


class CompletionRequest(_Sampling):
    UNSUPPORTED = COMPLETION_UNSUPPORTED

    prompt: Prompts
    max_tokens: http("max_tokens", low=0) | None = None   # 0 only with echo: the prompt alone
    logprobs: http("logprobs") | None = None              # k; the frontend bounds it (model.max_logprobs)
    echo: bool = Field(False, strict=True)                                   # the prompt before the text (and its logprobs)

    @model_validator(mode="after")
    def _echo(self) -> "CompletionRequest":
        if self.max_tokens == 0 and not self.echo:
            raise PydanticCustomError("value_error", "max_tokens 0 asks for nothing: it is accepted only with echo",
                                      {"param": "max_tokens"})
        return self

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0 (lm-evaluation-harness' loglikelihood, as vLLM serves it): one token is
        generated and dropped, the answer is the prompt alone."""
        return self.echo and self.max_tokens == 0

    def limit(self) -> int | None:
        return 1 if self.echo_only else self.max_tokens

    def logprob_params(self) -> dict[str, Any]:
        """logprobs k: each token's and its k most likely; with echo, the prompt's too (asked also
        without logprobs for a prompt of token ids: its tokens' texts are the echoed text)."""
        asks: dict[str, Any] = {} if self.logprobs is None else {"logprobs": self.logprobs}
        if self.echo and (self.logprobs is not None or "prompt_token_ids" in self.prompt_args()):
            asks["prompt_logprobs"] = self.logprobs or 0
        return asks

    def prompts(self) -> list[dict[str, Any]]:
        return prompt_batch(self.prompt)

    def prompt_args(self) -> dict[str, Any]:
        return self.prompts()[0]   # a batch's prompts are all text or all ids: the first tells which


def prompt_batch(p: str | list[int] | list[str] | list[list[int]]) -> list[dict[str, Any]]:
    """Each prompt's arguments: the one prompt, or each of a batch (a list of strings or of id lists)."""
    batch = p if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]
    return [{"prompt": q} if isinstance(q, str) else {"prompt_token_ids": q} for q in batch]


class TextPart(Strict):
    type: Literal["text"]
    text: str

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") != "text":
            raise PydanticCustomError("unsupported_parameter", "content parts of type '{kind}' are not supported "
                                      "(text only)", {"param": "content", "kind": str(data.get("type"))[:40]})
        return data


class ChatMessage(Strict):
    UNSUPPORTED = MESSAGE_UNSUPPORTED

    role: str
    content: str | list[TextPart] | None = None   # None only beside an assistant's tool_calls
    name: str | None = Field(None, max_length=256)                 # accepted, not shown to the model
    tool_calls: bounded(list[ToolCall], MAX_TOOLS) | None = None   # an assistant's earlier calls
    tool_call_id: str | None = Field(None, max_length=256)         # a tool message's call
    reasoning_content: str | None = None                           # an assistant's thinking (a reasoning model's template reads it)

    @model_validator(mode="after")
    def _content(self) -> "ChatMessage":
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise PydanticCustomError("missing_parameter", "a message needs content (only an assistant's tool_calls "
                                      "may stand without it)", {"param": "content"})
        if isinstance(self.content, list):   # joined once, where the body is validated (api/body.py: off the loop)
            self.content = "".join(p.text for p in self.content)
        return self

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else ""   # parts were joined at validation

    def plain(self) -> dict[str, Any]:
        calls = [c.model_dump() for c in self.tool_calls or []]
        return {"role": self.role, "content": self.text} | ({"tool_calls": calls} if calls else {})

    def templated(self, fmt: ChatFormat) -> dict[str, Any]:
        """As the families' templates read a message: a call's arguments as their JSON value, its id as
        the format takes it, the thinking under both names templates use (Qwen3's, gpt-oss')."""
        out: dict[str, Any] = {"role": self.role, "content": self.text}
        if self.tool_calls:
            out["tool_calls"] = [{"id": fmt.call_id(c.id), "type": "function", "function": {
                "name": c.function.name, "arguments": c.function.value()}} for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = fmt.call_id(self.tool_call_id)
        if self.reasoning_content:
            out["reasoning_content"] = out["thinking"] = self.reasoning_content
        return out


class ChatCompletionRequest(_Sampling):
    UNSUPPORTED = CHAT_UNSUPPORTED

    messages: bounded(list[ChatMessage], MAX_MESSAGES, least=1)
    max_completion_tokens: http("max_tokens") | None = None
    logprobs: bool | None = Field(None, strict=True)                      # each token's log probability...
    top_logprobs: http("logprobs") | None = None          # ...and its k most likely (needs logprobs)
    tools: bounded(list[Tool], MAX_TOOLS) | None = None
    tool_choice: ToolChoice | None = None         # default: auto with tools, none without
    parallel_tool_calls: bool | None = Field(None, strict=True)   # default true
    chat_template_kwargs: dict[str, Any] | None = None   # vLLM extension: more variables for the chat template
    _format: ChatFormat = PrivateAttr(default=PLAIN)       # the served model's (`bind`)

    @model_validator(mode="after")
    def _template_kwargs(self) -> "ChatCompletionRequest":
        try:
            if self.chat_template_kwargs is not None:
                check_template_kwargs(self.chat_template_kwargs)
        except InvalidRequest as e:
            raise PydanticCustomError("value_error", str(e), {"param": "chat_template_kwargs"}) from None
        return self

    @model_validator(mode="after")
    def _tools(self) -> "ChatCompletionRequest":
        choice = self.tool_choice
        if choice not in (None, "none", "auto") and not self.shown_tools:
            raise PydanticCustomError("value_error", "tool_choice {choice} names no tool of `tools`",
                                      {"param": "tool_choice", "choice": str(choice)[:100]})
        if self.constrained and (self.structured_outputs is not None or (
                self.response_format is not None and self.response_format.type != "text")):
            raise PydanticCustomError("value_error", "a required or named tool_choice constrains the output itself: "
                                      "give no response_format or structured_outputs with it", {"param": "tool_choice"})
        return self

    @model_validator(mode="after")
    def _arguments(self) -> "ChatCompletionRequest":
        """An earlier call's arguments are read back for the template: nested deeper than json reads is a 400
        naming them, here, rather than a RecursionError's 500 when the prompt is rendered."""
        for i, m in enumerate(self.messages):
            for j, c in enumerate(m.tool_calls or ()):
                try:
                    c.function.value()
                except RecursionError:
                    param = f"messages.{i}.tool_calls.{j}.function.arguments"
                    raise PydanticCustomError("value_error", "{param}: JSON nested too deeply to read",
                                              {"param": param}) from None
        return self

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def field(self, param: str | None) -> str | None:
        if param in ("prompt", "logprobs"):
            return "messages" if param == "prompt" else "top_logprobs"
        return "max_completion_tokens" if param == "max_tokens" and self.max_completion_tokens is not None else param

    @model_validator(mode="after")
    def _top_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise PydanticCustomError("value_error", "top_logprobs needs logprobs: true", {"param": "top_logprobs"})
        return self

    def logprob_params(self) -> dict[str, Any]:
        return {"logprobs": self.top_logprobs or 0} if self.logprobs else {}

    @property
    def shown_tools(self) -> list[Tool]:
        return shown(self.tools, self.tool_choice)

    @property
    def constrained(self) -> bool:
        """tool_choice required or a named function: the output is calls in the model's format (tool_grammar)."""
        return bool(self.shown_tools) and self.tool_choice not in (None, "auto", "none")

    @property
    def thinking(self) -> bool:
        """The model may think first (unless the template is told not to: enable_thinking false)."""
        return (self.chat_template_kwargs or {}).get("enable_thinking") is not False

    @property
    def format(self) -> ChatFormat:
        return self._format

    @property
    def strip_specials(self) -> bool:
        """The engine keeps special tokens for the parser, which the request did not ask to see."""
        return self._format.keeps_specials and self.skip_special_tokens is not False

    def bind(self, fmt: ChatFormat) -> "ChatCompletionRequest":
        """The request as the served model takes it (before anything runs): a 400 for tools it cannot parse."""
        if self.shown_tools and fmt.tool_parser is None:
            raise ApiError(400, "this server parses no tool calls (server.tool_call_parser = none): give no tools",
                           "invalid_value", "tools")
        self._format = fmt
        return self

    def prompt_args(self) -> dict[str, Any]:
        kwargs = {} if self.chat_template_kwargs is None else {"chat_template_kwargs": self.chat_template_kwargs}
        fmt = self._format
        if not fmt.template_tools:
            return {"messages": render([m.plain() for m in self.messages], self.shown_tools)} | kwargs
        tools = [t.model_dump(exclude_none=True) for t in self.shown_tools]
        return {"messages": [m.templated(fmt) for m in self.messages]} | ({"tools": tools} if tools else {}) | kwargs

    def sampling(self) -> dict[str, Any]:
        given = _Sampling.sampling(self) | ({"skip_special_tokens": False} if self._format.keeps_specials else {})
        if self.constrained:
            given["structured_outputs"] = constraint(self._format, self.shown_tools, self.parallel_tool_calls is not False,
                                                     self.thinking)
        return given


# ---------------------------------------------------------------- responses

class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0   # prompt tokens whose K/V came from the prefix cache (as OpenAI reports it)


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0   # the thinking's tokens (with a reasoning parser)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None    # the thinking (a reasoning parser's), as vLLM
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class _Response(BaseModel):
    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str


class Completion(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatCompletion(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage | None = None


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "orca-mq"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
