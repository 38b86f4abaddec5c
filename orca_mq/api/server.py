"""The OpenAI-compatible HTTP API: one more client of the broker (FastAPI on uvicorn + uvloop).

    POST /v1/completions, POST /v1/chat/completions   (stream or not)
    POST /v1/responses                                 (OpenAI's Responses API: orca_mq.api.responses)
    POST /v1/messages                                  (Anthropic's Messages API: orca_mq.api.messages)
    GET  /v1/models, GET /v1/models/{id}, GET /health, GET /metrics, GET /version
    POST /tokenize, POST /detokenize                   (vLLM's; orca_mq.api.tokenize)
    POST /v1/embeddings                                (orca_mq.api.embeddings)

Generation requests go over the normal ZeroMQ protocol (orca_mq.client.AsyncClient), so the
frontend tokenizes, applies the chat template and validates exactly as for ZeroMQ clients; /tokenize
runs that same path here (its tokenizer loaded on the first call). A request with `n` > 1 or a batch
of prompts is fanned out into one engine request per choice (orca_mq.api.fanout).
Run by the launcher as `python -m orca_mq.api.server --config-json ...` when
`server.http_address` is set; it reports Ready once it listens. Requests are checked at the edge
(orca_mq.api.edge: API key, body size) and by the strict schemas (orca_mq.api.schemas); errors are
OpenAI's error object (orca_mq.api.errors); it logs, uvicorn included, to its JSON log only.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Annotated, Any

import uvicorn
import zmq.asyncio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from orca_mq import __version__
from orca_mq.auth import KeyCheck, server_keys
from orca_mq.client import AsyncClient
from orca_mq.config import Config, host_port
from orca_mq.models.files import resolve_model_path
from orca_mq.models.registry import read_model_info
from orca_mq.logs import setup_logging
from orca_mq.protocol.control_msgs import Ready
from orca_mq.api.body import documented, parsed
from orca_mq.api.edge import ApiKeyGuard, BodyLimit, Handled, end_client
from orca_mq.api.embeddings import Embeddings
from orca_mq.api.errors import INTERNAL_TEXT, ApiError, body_for, from_validation
from orca_mq.api.fanout import Build, Choice, Fanout, answer, begin, check_bounds, events
from orca_mq.api.offload import Builder, SlicedJSON
from orca_mq.api.chat import chat_builders
from orca_mq.api.chat_format import ChatFormat, resolve
from orca_mq.api.messages import message
from orca_mq.api.messages_schema import MessagesRequest
from orca_mq.api.reply import Reply
from orca_mq.api.responses import respond
from orca_mq.api.responses_schema import ResponsesRequest
from orca_mq.api.responses_store import ResponseStore
from orca_mq.api.turn import Turn
from orca_mq.api.metrics import ApiMetrics
from orca_mq.api.tokenize import DetokenizeRequest, DetokenizeResponse, Tokenization, TokenizeRequest, TokenizeResponse
from orca_mq.api.schemas import (ChatCompletionRequest, Completion, CompletionChoice, CompletionRequest, ModelCard,
                                           ModelList, Usage, new_id)
from orca_mq.server.process import process_main
from orca_mq.server.zmq_queue import BrokerLink

STATS_TIMEOUT = 3.0    # a scheduler that does not answer stats within this is reported unavailable
STATS_MAX_AGE = 1.0    # /health and /metrics reuse a stats reply this recent
# /health waits this long for a stats reply under way, then answers from the last one: the reply waits
# on the workers' counters, which a worker sends between iterations (a long prefill's second on a CPU),
# and a load balancer's probe must not time out on a busy server. A server that stops answering turns
# unavailable when the poll times out (STATS_TIMEOUT).
HEALTH_WAIT = 0.05


def _json_error(err: ApiError, request: Request) -> JSONResponse:
    return JSONResponse(body_for(request.url.path, err), status_code=err.status)


class Api:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.log = setup_logging("http", cfg.log)
        path = resolve_model_path(cfg.model.path)
        # the names requests may use (server.served_model_name), the first in responses and metrics
        self.model_names = cfg.server.served_names() or (path.stem if path.is_file() else path.name,)
        self.model_name = self.model_names[0]
        info = read_model_info(cfg.model.path, cfg.model.cache_dir)
        self.max_model_len = info.max_model_len(cfg)
        self.tokenization = Tokenization(cfg, self.max_model_len, info.vocab_size)
        keys = cfg.server.api_keys()
        curve = cfg.server.curve_secret_key
        self.client = AsyncClient(cfg.server.frontend_address, api_key=keys[0] if keys else None,
                                  server_key=server_keys(curve)[0].decode() if curve else None)
        self.metrics = ApiMetrics(self.model_name)
        self.builder = Builder()   # heavy responses are built off the event loop
        self.embeddings = Embeddings(self.client, self.metrics, self.model_for, info.hidden_size, cfg.server.http_max_embedding_inputs)
        self.created = int(time.time())
        self.stats_at = -1.0
        self.stats_ok = False
        self.stats_task: asyncio.Task[None] | None = None
        self.format: ChatFormat | None = None   # the model's tool and reasoning format, from its tokenizer (first chat)
        self.responses_store = ResponseStore(cfg.server.responses_store)
        self.app = self._routes()

    def _routes(self) -> FastAPI:
        app = FastAPI(title="orca-mq", docs_url=None, redoc_url=None)
        app.state.builder = self.builder   # bodies are validated off the loop as heavy responses are built (api/body.py)

        @app.exception_handler(RequestValidationError)
        async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
            return _json_error(from_validation(e.errors()), request)

        @app.exception_handler(ApiError)
        async def api_error(request: Request, e: ApiError) -> JSONResponse:
            return _json_error(e, request)

        @app.exception_handler(HTTPException)
        async def http_error(request: Request, e: HTTPException) -> JSONResponse:  # unknown route, wrong method
            code = {400: "invalid_json", 404: "not_found", 405: "method_not_allowed",
                    413: "request_too_large"}.get(e.status_code, "error")   # 413: a chunked body past the limit (edge)
            return _json_error(ApiError(e.status_code, str(e.detail), code), request)

        @app.exception_handler(Exception)
        async def internal(request: Request, e: Exception) -> JSONResponse:
            self.log.exception("request failed", error=str(e)[:500])
            return _json_error(ApiError(500, INTERNAL_TEXT, "internal"), request)

        posts: list[tuple[str, Callable[..., Any], dict[str, Any]]] = [
            ("/v1/completions", self.completions, {"response_model": None}),
            ("/v1/chat/completions", self.chat, {"response_model": None}),
            ("/v1/responses", self.responses, {"response_model": None}),
            ("/v1/messages", self.messages, {"response_model": None}),
            ("/v1/embeddings", self.embeddings.create, {}), ("/tokenize", self.tokenize, {}), ("/detokenize", self.detokenize, {})]
        for path, endpoint, more in posts:   # each reads its body itself (api/body.py), documented here
            app.post(path, openapi_extra=documented(endpoint), **more)(endpoint)
        app.get("/v1/models")(self.models)
        app.get("/v1/models/{model_id:path}")(self.retrieve_model)
        app.get("/version")(self.version)
        app.get("/health")(self.health)
        app.get("/metrics")(self.scrape)
        return app

    # ---------------------------------------------------------------- generation

    async def completions(self, body: Annotated[CompletionRequest, parsed(CompletionRequest)], request: Request) -> Response:
        rid, model = new_id("cmpl"), self.model_for(body.model)

        def chunk(c: Choice, text: str, reason: str | None, usage: Usage | None) -> Completion:
            return Completion(id=rid, model=model, usage=usage,
                              choices=[] if usage else [CompletionChoice(index=c.index, text=text, finish_reason=reason)])

        def whole(c: Choice, text: str, reason: str | None, usage: Usage | None) -> Completion:
            return Completion(id=rid, model=model, usage=usage,
                              choices=[CompletionChoice(index=c.index, text=text, finish_reason=reason)])

        return await self._serve(body, request, chunk, whole)

    async def chat(self, body: Annotated[ChatCompletionRequest, parsed(ChatCompletionRequest)], request: Request) -> Response:
        rid, model = new_id("chatcmpl"), self.model_for(body.model)
        body.bind(await self.chat_format())
        return await self._serve(body, request, *chat_builders(body, rid, model))

    async def _serve(self, body: CompletionRequest | ChatCompletionRequest, request: Request, chunk: Build,
                     whole: Build, opening: Callable[[Choice], BaseModel] | None = None) -> Response:
        check_bounds(body, self.cfg.server, self.max_model_len)
        fan = Fanout(body, self.client, self.metrics, self.builder, end_client(request.scope))
        try:
            if not body.stream:
                return SlicedJSON(await answer(fan, request, whole))
            await begin(fan, request)   # the first tokens before the headers: a refused request gets its HTTP status
        except ApiError as e:   # refused: the field at fault by this request's name for it
            e.param = body.field(e.param)
            raise
        return StreamingResponse(events(fan, chunk, body.include_usage, opening), media_type="text/event-stream")

    async def responses(self, body: Annotated[ResponsesRequest, parsed(ResponsesRequest)], request: Request) -> Response:
        return await respond(self, self.responses_store, body, request)

    async def messages(self, body: Annotated[MessagesRequest, parsed(MessagesRequest)], request: Request) -> Response:
        return await message(self, body, request)

    async def turn(self, body: ChatCompletionRequest, request: Request) -> Turn:
        """A Responses or Messages request, as the chat request `body`, ready to run (streamed: started)."""
        body.bind(await self.chat_format())
        check_bounds(body, self.cfg.server, self.max_model_len)
        turn = Turn(Fanout(body, self.client, self.metrics, self.builder, end_client(request.scope)), Reply.of(body))
        if body.stream:
            await turn.start(request)
        return turn

    async def chat_format(self) -> ChatFormat:
        """The model's tool and reasoning format, resolved from its tokenizer on first use (off the loop)."""
        if self.format is None:
            prompts = await self.tokenization.prompts()
            self.format = await asyncio.get_running_loop().run_in_executor(
                self.tokenization.pool, resolve, self.cfg, prompts.tokenizer)
        return self.format

    # ---------------------------------------------------------------- state

    def _check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_names:
            raise ApiError(404, f"The model `{name[:100]}` does not exist.", "model_not_found", "model")

    def model_for(self, name: str | None) -> str:
        """The name a response gives: the one the request asked for, else the first served name."""
        self._check_model(name)
        return name or self.model_name

    async def models(self) -> ModelList:
        return ModelList(data=[self._card(name) for name in self.model_names])

    async def retrieve_model(self, model_id: str) -> ModelCard:
        """The openai client's `models.retrieve`."""
        self._check_model(model_id)
        return self._card(model_id)

    def _card(self, name: str) -> ModelCard:
        return ModelCard(id=name, created=self.created, max_model_len=self.max_model_len)

    async def tokenize(self, body: Annotated[TokenizeRequest, parsed(TokenizeRequest)]) -> TokenizeResponse:
        self._check_model(body.model)
        return await self.tokenization.tokenize(body)

    async def detokenize(self, body: Annotated[DetokenizeRequest, parsed(DetokenizeRequest)]) -> DetokenizeResponse:
        self._check_model(body.model)
        return await self.tokenization.detokenize(body)

    async def version(self) -> dict[str, str]:
        return {"version": __version__}

    async def health(self) -> JSONResponse:
        await self._refresh(HEALTH_WAIT if self.stats_at >= 0 else None)   # the first waits: no reply to answer from
        sched = self.metrics.engine.stats.get("frontend", {})
        if not self.stats_ok:
            status = "unavailable" if self.metrics.engine.stats else "starting"
        else:
            status = "draining" if sched.get("draining") else "ok"
        return JSONResponse({"status": status}, status_code=200 if status == "ok" else 503)

    async def scrape(self) -> Response:
        await self._refresh()
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def _refresh(self, wait: float | None = None) -> None:
        """One stats call at a time, shared by every /health and /metrics caller of that moment; `wait`:
        at most this long for it (it goes on for the next caller)."""
        loop = asyncio.get_running_loop()
        if loop.time() - self.stats_at < STATS_MAX_AGE:
            return
        if self.stats_task is None or self.stats_task.done():
            self.stats_task = asyncio.create_task(self._poll())
        await asyncio.wait([self.stats_task], timeout=wait)   # neither a timeout nor a caller gone cancels it

    async def _poll(self) -> None:
        """Never raises: no caller may be waiting to hear of it (Python 3.10's asyncio.TimeoutError is not
        the builtin's; a stats reply the metrics cannot read is the engine's fault, not the probe's)."""
        try:
            self.metrics.engine.update(await self.client.stats(timeout=STATS_TIMEOUT))
            self.stats_ok = True
        except Exception as e:
            self.stats_ok = False
            self.log.warning("stats unavailable", error=str(e) or type(e).__name__)
        self.stats_at = asyncio.get_running_loop().time()


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn would re-raise SIGTERM after its shutdown; _main's handlers exit 0 like the other processes."""
        yield


async def _main(cfg: Config) -> int:
    api = Api(cfg)
    host, port = host_port(cfg.server.http_address, "server.http_address")
    app = ApiKeyGuard(BodyLimit(Handled(api.app), cfg.server.http_max_body_bytes), KeyCheck(cfg.server.api_keys()))
    server = _Server(uvicorn.Config(
        app, host=host, port=port, limit_concurrency=cfg.server.http_max_connections, timeout_graceful_shutdown=5,
        log_config=None, log_level="warning", access_log=False, lifespan="off"))
    await api.client.connect()
    ctx = zmq.asyncio.Context()
    link = BrokerLink(ctx, cfg.server.backend_address, "http")
    serving = asyncio.create_task(server.serve())
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, setattr, server, "should_exit", True)
    while not server.started and not serving.done():
        await asyncio.sleep(0.05)
    if server.started:
        await link.to_peer("launcher", Ready("http", os.getpid()))
        api.log.info("http api listening", address=cfg.server.http_address, model=api.model_name)
    await asyncio.gather(serving, return_exceptions=True)  # uvicorn exits on SIGTERM/SIGINT, or SystemExit on a bind failure
    link.close()
    ctx.term()
    await api.client.close()
    api.tokenization.close()
    api.builder.close()
    return 0 if server.started else 1


def main() -> None:
    process_main("http", "orca-mq OpenAI-compatible HTTP API", lambda cfg, _: _main(cfg))


if __name__ == "__main__":
    main()
