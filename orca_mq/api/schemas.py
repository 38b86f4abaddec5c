"""Request and response bodies of the OpenAI-compatible API (pydantic), and their mapping to orca-mq
sampling parameters.

Accepted as OpenAI does: `max_tokens` (chat: also `max_completion_tokens`), `temperature`,
`top_p`, `seed`, `stop` (a string or a list of them), `n` (1 only), `stream`,
`stream_options.include_usage`, `response_format` (json_object, json_schema); as vLLM's extensions:
`top_k`, `ignore_eos`, `stop_token_ids`, `structured_outputs`.
Fields we cannot honour (n > 1, logprobs, echo, penalties) are refused with 400 instead of
silently ignored; other unknown fields (`user`, ...) are ignored, as vLLM does.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_STOP_STRINGS = 16           # these two bound the work of the stop-string check on every token
MAX_STOP_LEN = 256


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # absent: any JSON object
    strict: bool | None = None    # the output always follows the schema, strict or not


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type json_schema, and only with it")
        return self

    def structured_outputs(self) -> dict[str, Any] | None:
        """As orca-mq's StructuredOutputsParams fields; None for plain text."""
        if self.type == "text":
            return None
        if self.json_schema is None or self.json_schema.schema_ is None:
            return {"json_object": True}
        return {"json": self.json_schema.schema_}


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    top_k: int | None = None                 # vLLM extension
    ignore_eos: bool | None = None           # vLLM extension
    stop_token_ids: list[int] | None = None  # vLLM extension
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM extension: json | regex | choice | grammar | json_object
    logprobs: Any = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @model_validator(mode="after")
    def _supported(self) -> "_Sampling":
        if self.n != 1:
            raise ValueError("only n=1 is supported")
        if self.logprobs not in (None, False):
            raise ValueError("logprobs are not supported")
        if self.presence_penalty or self.frequency_penalty:
            raise ValueError("presence_penalty and frequency_penalty are not supported")
        if self.structured_outputs is not None and self.response_format is not None and self.response_format.type != "text":
            raise ValueError("give response_format or structured_outputs, not both")
        if len(self.stop_strings) > MAX_STOP_STRINGS or any(not 0 < len(s) <= MAX_STOP_LEN for s in self.stop_strings):
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} strings of 1 to {MAX_STOP_LEN} characters")
        return self

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def limit(self) -> int | None:
        return self.max_tokens

    def sampling(self, default_max_tokens: int) -> dict[str, Any]:
        """The orca-mq SamplingParams fields that were given; the frontend validates them."""
        given = {"temperature": self.temperature, "top_p": self.top_p, "seed": self.seed, "top_k": self.top_k,
                 "ignore_eos": self.ignore_eos, "stop_token_ids": self.stop_token_ids,
                 "structured_outputs": self.structured_outputs if self.response_format is None
                 else self.response_format.structured_outputs()}
        limit = self.limit()
        return {"max_tokens": default_max_tokens if limit is None else limit} | {k: v for k, v in given.items() if v is not None}


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False

    @model_validator(mode="after")
    def _one_prompt(self) -> "CompletionRequest":
        if self.echo:
            raise ValueError("echo is not supported")
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], (str, list)):
            if len(self.prompt) != 1:
                raise ValueError("a batch of prompts is not supported: send one prompt per request")
        return self

    def prompt_args(self) -> dict[str, Any]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            p = p[0]
        return {"prompt": p} if isinstance(p, str) else {"prompt_token_ids": p}


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[TextPart]

    def plain(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": self.role, "content": text}


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def prompt_args(self) -> dict[str, Any]:
        return {"messages": [m.plain() for m in self.messages]}


# ---------------------------------------------------------------- responses

class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0   # prompt tokens whose K/V came from the prefix cache (as OpenAI reports it)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: None = None
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


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 413: "BadRequestError", 429: "RateLimitError",
               500: "InternalServerError", 503: "ServiceUnavailableError"}


def error_body(status: int, message: str) -> dict[str, Any]:
    return ErrorResponse(error=ErrorInfo(message=message, type=ERROR_TYPES.get(status, "Error"), code=status)).model_dump()


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
