"""One HTTP generation request fanned out into engine requests and merged back: `n` choices of each
prompt (completions: of each prompt of a batch), choice index = prompt index * n + j, as OpenAI and
vLLM number them.

Each choice is its own engine request (id `<base>-<index>`) with its own seed stream: seed + j,
wrapped within the seed range, where the request gives a seed (as vLLM seeds its n children), else
the engine's own random one. A prompt's choices share its KV through the prefix cache: its first
choice is submitted alone and the others once it has produced its first token, when the prompt's
full blocks are published, so they prefill only its last, partial block (submitted together they
would all prefill the whole prompt in the same iteration). Only the first asks for the prompt's log
probabilities (echo): they are computed once, and every choice of the prompt shows them (asking,
the others would compute the whole prompt each, as a request that needs every position's logits
reads no cache). A response's log probabilities are bounded (`server.http_max_logprobs`, checked
before anything runs) and a heavy response is built off the event loop (orca_mq.api.offload).
Streamed, each chunk carries its
choice's index and every choice gets its own finish chunk; the usage (each prompt's tokens once,
every choice's completion tokens) comes once, last. One choice's error, or the client's
disconnect, ends them all.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from starlette.requests import Request

from orca_mq.api.errors import ApiError, error_body
from orca_mq.api.logprobs import Shaper
from orca_mq.api.metrics import ApiMetrics
from orca_mq.api.offload import Builder, dump, encoded, weight
from orca_mq.api.schemas import ChatCompletionRequest, CompletionRequest, PromptTokensDetails, Usage
from orca_mq.api.stream import Generation, StopStrings, until_disconnect
from orca_mq.client import AsyncClient
from orca_mq.config import ServerConfig
from orca_mq.protocol.logprobs import entries
from orca_mq.protocol.sampling_fields import INT64_MAX

Body = CompletionRequest | ChatCompletionRequest


@dataclass(slots=True)
class Choice:
    index: int
    gen: Generation
    shape: Shaper   # its log probabilities (and echo) on its responses; the prompt's are its prompt's first choice's


# a choice's one-choice response: its streamed chunk or whole answer (with usage: the usage chunk, no choice)
Build = Callable[[Choice, str, str | None, Usage | None], BaseModel]


def prompts_of(body: Body) -> list[dict[str, Any]]:
    return body.prompts() if isinstance(body, CompletionRequest) else [body.prompt_args()]


def check_bounds(body: Body, server: ServerConfig, max_model_len: int) -> None:
    prompts = prompts_of(body)
    n, count = body.n or 1, len(prompts)
    if n > server.http_max_n:
        raise ApiError(400, f"n must be at most {server.http_max_n} (the server's server.http_max_n), got {n}",
                       "invalid_value", "n")
    if n * count > server.http_max_choices:
        raise ApiError(400, f"a batch of {count} prompt(s) with n={n} asks for {n * count} choices: at most "
                       f"{server.http_max_choices} (the server's server.http_max_choices)", "invalid_value", "prompt")
    asks = body.logprob_params()
    if "logprobs" not in asks:
        return
    k, echo = asks["logprobs"], isinstance(body, CompletionRequest) and body.echo
    generated = body.limit() or max_model_len
    positions = sum(min(max_model_len, generated + (_prompt_bound(p) if echo else 0)) for p in prompts) * n
    if positions * (1 + k) > server.http_max_logprobs:
        param = "top_logprobs" if isinstance(body, ChatCompletionRequest) and body.top_logprobs else "logprobs"
        raise ApiError(400, f"log probabilities of up to {positions} positions ({n * count} choice(s)), each with {k} "
                       f"alternatives, exceed the {server.http_max_logprobs} one response may carry (the server's "
                       "server.http_max_logprobs): ask for fewer tokens (max_tokens), choices or alternatives",
                       "invalid_value", param)


def _prompt_bound(prompt: dict[str, Any]) -> int:
    """Its tokens at most, before tokenizing: a text's UTF-8 bytes (and a BOS); a prompt of ids, their count."""
    text = prompt.get("prompt")
    return len(text.encode()) + 1 if isinstance(text, str) else len(prompt.get("prompt_token_ids") or ())


def _shaper(body: Body, prompt: dict[str, Any], lead: Generation) -> Shaper:
    """How a choice's responses carry log probabilities and, for completions, its echoed prompt."""
    if isinstance(body, ChatCompletionRequest):
        return Shaper(chat=True, lead=lead)
    text = prompt.get("prompt")
    return Shaper(chat=False, lead=lead, echo=body.echo, echo_text=text if isinstance(text, str) else None)


def sse(payload: BaseModel | dict[str, Any]) -> str:
    body = dump(payload) if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {body}\n\n"


class Fanout:
    """The choices of one HTTP request, read as they produce: `results` yields (choice, text piece)
    and (choice, None) when that choice has ended."""

    def __init__(self, body: Body, client: AsyncClient, metrics: ApiMetrics, builder: Builder, end_client: str) -> None:
        self.n = body.n or 1
        self.builder = builder
        sampling, base, seed = body.sampling(), uuid.uuid4().hex, body.seed
        stream = body.stream or bool(body.stop_strings)   # else the server holds the tokens: stop strings are looked for here
        later = {k: v for k, v in sampling.items() if k != "prompt_logprobs"}   # a prompt's are its first choice's
        self.choices: list[Choice] = []
        for p, prompt in enumerate(prompts_of(body)):
            for j in range(self.n):
                index = p * self.n + j
                own = sampling if j == 0 else later
                own = own if seed is None else own | {"seed": (seed + j) % (INT64_MAX + 1)}
                gen = Generation(client, prompt, own, StopStrings(body.stop_strings), metrics, request_id=f"{base}-{index}",
                                 on_behalf_of=end_client, stream=stream)
                gen.echo_only = isinstance(body, CompletionRequest) and body.echo_only
                lead = gen if j == 0 else self.choices[p * self.n].gen
                self.choices.append(Choice(index, gen, _shaper(body, prompt, lead)))
        self.pieces = [c.gen.pieces() for c in self.choices]
        self.pending: dict[asyncio.Task[str | None], Choice] = {}
        self.leading = set(range(0, len(self.choices), self.n))   # first choices without their first piece yet
        self.early: list[tuple[Choice, str | None]] = []          # read by `start`, not yet by `results`
        for i in self.leading:
            self._pull(self.choices[i])

    def _pull(self, c: Choice) -> None:
        self.pending[asyncio.create_task(_next(self.pieces[c.index]))] = c

    async def _step(self) -> list[tuple[Choice, str | None]]:
        done, _ = await asyncio.wait(self.pending, return_when=asyncio.FIRST_COMPLETED)
        out = []
        for task in sorted(done, key=lambda t: self.pending[t].index):
            c = self.pending.pop(task)
            text = task.result()   # a choice's error ends the request: `close` ends the others
            if c.index in self.leading:   # its prompt is prefilled: the rest of its choices go now
                self.leading.discard(c.index)
                for other in self.choices[c.index + 1:c.index + self.n]:
                    self._pull(other)
            out.append((c, text))
            if text is not None:
                self._pull(c)
        return out

    async def start(self) -> None:
        """Reads until every prompt's first choice has its first piece, so that a refused request
        raises (and gets its HTTP status) before a stream's headers go out."""
        while self.leading:
            self.early += await self._step()

    async def results(self) -> AsyncIterator[tuple[Choice, str | None]]:
        early, self.early = self.early, []
        for item in early:
            yield item
        while self.pending:
            for item in await self._step():
                yield item

    async def texts(self) -> list[str]:
        parts: list[list[str]] = [[] for _ in self.choices]
        async with contextlib.aclosing(self.results()) as results:
            async for c, text in results:
                if text:
                    parts[c.index].append(text)
        return ["".join(p) for p in parts]

    async def close(self) -> None:
        """Ends every choice still running (its stream closes, which aborts its engine request)."""
        for task in self.pending:
            task.cancel()
        await asyncio.gather(*self.pending, return_exceptions=True)
        self.pending.clear()
        for pieces in self.pieces:
            await pieces.aclose()

    def usage(self) -> Usage:
        leads = self.choices[::self.n]   # a prompt's tokens count once, as its first choice saw them
        prompt = sum(c.gen.prompt_tokens for c in leads)
        completion = sum(c.gen.completion_tokens for c in self.choices)
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(c.gen.cached_tokens for c in leads)))


async def _next(pieces: AsyncIterator[str]) -> str | None:
    return await anext(pieces, None)


async def answer(fan: Fanout, request: Request, whole: Build) -> list[bytes]:
    """The whole response's JSON, encoded in pieces (offload.SlicedJSON): every choice, in index order,
    and the usage (built off the loop when heavy)."""
    try:
        texts = await until_disconnect(request, fan.texts())
    finally:
        await fan.close()
    usage = fan.usage()

    def build() -> list[bytes]:
        parts = [c.shape.whole(whole(c, texts[c.index], c.gen.finish_reason, usage), c.gen) for c in fan.choices]
        parts[0].choices = [p.choices[0] for p in parts]  # type: ignore[attr-defined]
        return encoded(parts[0])

    heft = sum(entries(c.gen.logprobs) + c.shape.weight(None) for c in fan.choices)
    return await fan.builder.build(build, weight(heft, sum(map(len, texts))))


async def begin(fan: Fanout, request: Request) -> None:
    """A stream's start (see Fanout.start); a refusal or the client's disconnect ends every choice."""
    try:
        await until_disconnect(request, fan.start())
    except BaseException:
        await fan.close()
        raise


async def events(fan: Fanout, chunk: Build, include_usage: bool,
                 opening: Callable[[Choice], BaseModel] | None) -> AsyncIterator[str]:
    """The server-sent events of a stream `begin` started; leaving early ends every choice."""
    try:
        if opening is not None:
            for c in fan.choices:
                yield sse(opening(c))
        try:
            async with contextlib.aclosing(fan.results()) as results:
                async for c, text in results:
                    if text == "":
                        continue
                    yield await _chunk(fan, c, text, chunk)
        except ApiError as e:
            yield sse(error_body(e))
            yield "data: [DONE]\n\n"
            return
        if include_usage:
            yield sse(chunk(fan.choices[0], "", None, fan.usage()))
        yield "data: [DONE]\n\n"
    finally:
        await fan.close()


async def _chunk(fan: Fanout, c: Choice, text: str | None, chunk: Build) -> str:
    """A choice's chunk (`text` None: its finish chunk, which may parse the reply held back for tool
    calls: weighed by its tokens), built off the loop when heavy (an echoed prompt's log
    probabilities, a long reply). Its fresh log probabilities are taken here, on the loop, where its
    stream adds to them."""
    fresh, reason = c.gen.take(), c.gen.finish_reason if text is None else None
    held = c.gen.completion_tokens if text is None else 0
    return await fan.builder.build(lambda: sse(c.shape.chunk(chunk(c, text or "", reason, None), c.gen, fresh)),
                                   weight(c.shape.weight(fresh) + held, len(text or "")))
