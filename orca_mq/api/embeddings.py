"""POST /v1/embeddings, in OpenAI's shape (the openai SDK's `client.embeddings.create`):

    {model?, input: str | [str] | [id] | [[id]], encoding_format?: float | base64, dimensions?, user?,
     pooling?: last | mean, normalize?: bool}
    -> {object: list, data: [{object: embedding, index, embedding: [float] | base64}], model, usage}

Each input is an embedding request of its own over the ZeroMQ protocol (AsyncClient.embed), so the
frontend tokenizes (text as a completion's prompt: the tokenizer's special tokens added) and checks it
exactly as for ZeroMQ clients; they run together, prefill-only, batched by the scheduler beside the
generating requests. base64 is the vector's little-endian float32 bytes, as OpenAI sends it.

Bounds: at most server.http_max_embedding_inputs inputs, each within the context (the frontend's
check: 400 naming `input`); `dimensions` only at the model's hidden size (nothing truncates a vector:
Matryoshka-style shortening is not done); `pooling` (orca-mq's; vLLM's pooler) defaults to the server's
model.pooling, `normalize` (vLLM's) to true. One input's error ends the request (the others are
aborted) with that error, its index in the message.
"""
from __future__ import annotations

import asyncio
import base64
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field
from starlette.requests import Request

from orca_mq.api.body import parsed
from orca_mq.api.edge import end_client
from orca_mq.api.errors import ApiError, classify
from orca_mq.api.metrics import ApiMetrics
from orca_mq.api.schemas import Prompts, Strict, prompt_batch
from orca_mq.api.stream import OUTCOME_BY_STATUS, until_disconnect
from orca_mq.client import AsyncClient
from orca_mq.config import Pooling
from orca_mq.outputs import EmbeddingOutput
from orca_mq.protocol.pooling import floats
from orca_mq.protocol.sampling_fields import INT32_MAX


class EmbeddingRequest(Strict):
    model: str | None = None
    input: Prompts
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, strict=True, ge=1, le=INT32_MAX)   # the hidden size only
    user: str | None = Field(None, max_length=256)                           # accepted, unused
    pooling: Pooling | None = None                                           # default: the server's model.pooling
    normalize: bool = Field(True, strict=True)


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class Embeddings:
    """The route's handler: `model` names the response's model (404 for one not served)."""

    def __init__(self, client: AsyncClient, metrics: ApiMetrics, model: Callable[[str | None], str],
                 hidden_size: int, max_inputs: int) -> None:
        self.client, self.metrics, self.model = client, metrics, model
        self.hidden_size, self.max_inputs = hidden_size, max_inputs

    async def create(self, body: Annotated[EmbeddingRequest, parsed(EmbeddingRequest)], request: Request) -> EmbeddingList:
        model = self.model(body.model)
        inputs = prompt_batch(body.input)
        if len(inputs) > self.max_inputs:
            raise ApiError(400, f"input: {len(inputs)} inputs, at most {self.max_inputs} (the server's "
                           "server.http_max_embedding_inputs)", "invalid_value", "input")
        if body.dimensions is not None and body.dimensions != self.hidden_size:
            raise ApiError(400, f"dimensions: this model's embeddings have {self.hidden_size} dimensions, and are not "
                           f"shortened: give {self.hidden_size} or leave it out", "invalid_value", "dimensions")
        outs = await until_disconnect(request, self._embed(inputs, body.pooling, body.normalize, end_client(request.scope)))
        prompt_tokens = sum(o.prompt_tokens for o in outs)
        self.metrics.prompt_tokens.inc(prompt_tokens)
        return EmbeddingList(data=[Embedding(index=i, embedding=_encoded(o, body.encoding_format)) for i, o in enumerate(outs)],
                             model=model, usage=EmbeddingUsage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens))

    async def _embed(self, inputs: list[dict[str, Any]], pooling: str | None, normalize: bool,
                     on_behalf_of: str) -> list[EmbeddingOutput]:
        """Every input at once, for the HTTP request's end client; the first to fail ends the rest (their
        streams close: aborted)."""
        tasks = [asyncio.ensure_future(self._one(i, prompt, pooling, normalize, on_behalf_of))
                 for i, prompt in enumerate(inputs)]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            if failed := [t for t in tasks if t.done() and t.exception() is not None]:
                raise failed[0].exception()  # type: ignore[misc]
            return [t.result() for t in tasks]
        finally:   # also when the HTTP client left (cancelled)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _one(self, index: int, prompt: dict[str, Any], pooling: str | None, normalize: bool,
                   on_behalf_of: str) -> EmbeddingOutput:
        out = await self.client.embed(**prompt, pooling=pooling, normalize=normalize, on_behalf_of=on_behalf_of)
        if out.finish_reason == "stop":
            self.metrics.outcome("stop")
            return out
        err = classify(out.code, out.error, out.param)
        self.metrics.outcome(OUTCOME_BY_STATUS.get(err.status, "error"))
        if err.status != 500:   # a 500 says nothing more
            err.message = f"input[{index}]: {err.message}"
        if err.param == "prompt" or (err.status == 400 and err.param is None):
            err.param = "input"
        raise err


def _encoded(out: EmbeddingOutput, encoding_format: str) -> list[float] | str:
    return floats(out.data) if encoding_format == "float" else base64.b64encode(out.data).decode("ascii")
