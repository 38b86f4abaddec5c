"""The frontend: tokenizes and validates client requests, forwards them to the scheduler, and
streams each request's tokens back, detokenized incrementally.

Every request gets exactly one final `output`: finished with "stop" | "length", "abort" (client
abort or drain timeout) or "error" with a stable code (common_msgs: invalid request, failed on a
worker; a process died or the server is full — those sent by the broker).
Admission: the size check runs at once on the event loop, the tokenizer (and the check of a
structured output's constraint, orca_mq.structured) on a small thread pool,
so a long prompt delays neither anyone's tokens nor a short prompt's admission (a request reaches
the scheduler when its tokens are ready); an abort or a vanished client meanwhile is kept.
A client that disconnects is reported by the broker (`client_gone`, from ZMQ_ROUTER_MANDATORY
send failures on the first token sent after it left); its requests are aborted, which frees
their KV at the scheduler's next iteration.
"""
from __future__ import annotations

import asyncio
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import zmq.asyncio

from orca_mq.config import Config
from orca_mq.detokenizer import IncrementalDetokenizer
from orca_mq.logs import setup_logging
from orca_mq.protocol import ProtocolError, decode
from orca_mq.protocol.client_msgs import TO_SERVER, Abort, Generate, Output, Stats, StatsReply
from orca_mq.protocol.common_msgs import ABORTED, INTERNAL, INVALID_REQUEST, OVERLOADED, UNAVAILABLE, Error
from orca_mq.protocol.codec import channel
from orca_mq.protocol.control_msgs import AbortAll, ClientGone, Drain, Drained, Ready
from orca_mq.protocol.engine_msgs import AbortRequest, AddRequest, StatsQuery, StatsResult, TokenBatch
from orca_mq.sampling_params import InvalidRequest, SamplingParams
from orca_mq.tokenizer import load_tokenizer
from orca_mq.validation import validate_request
from orca_mq.engine.model_info import read_model_info
from orca_mq.server.active_request import ActiveRequest
from orca_mq.server.prompts import Prompts
from orca_mq.server.process import process_main
from orca_mq.server.zmq_queue import CLIENT, BrokerLink, Envelope, serve
from orca_mq.structured.compiler import Compiler, bounded

FROM_PROCESSES = channel(TokenBatch, StatsResult, Drain, AbortAll, ClientGone, Error)
TOKENIZE_THREADS = 2      # a long prompt's tokenization leaves a thread for short ones
MAX_STATS_QUERIES = 256   # stats queries awaiting the scheduler; more are refused as overloaded
FINAL_CODES = {"abort": ABORTED, "error": INTERNAL}
INTERNAL_TEXT = "internal error: the server failed on this request"


class _Unavailable(InvalidRequest):
    """Refused because of the server's state, not the request's content."""


class Frontend:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.log = setup_logging("frontend", cfg.log)
        self.tokenizer = load_tokenizer(cfg.model.path, cfg.model.cache_dir)
        self.info = read_model_info(cfg.model.path, cfg.model.cache_dir)
        self.prompts = Prompts.for_model(self.tokenizer, self.info.max_model_len(cfg))
        self.tokenize_pool = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="tokenize")
        self.grammars = Compiler(cfg.structured)   # checks structured outputs' constraints, in the tokenize pool
        self.admitting: dict[str, tuple[bytes, bool]] = {}   # being tokenized: rid -> (client, aborted); bounded by the broker
        self.admissions: set[asyncio.Task[None]] = set()
        self.ctx = zmq.asyncio.Context()
        self.link = BrokerLink(self.ctx, cfg.server.backend_address, "frontend")
        self.active: dict[str, ActiveRequest] = {}
        self.by_client: dict[bytes, set[str]] = {}
        self.stats_waiting: dict[str, tuple[bytes, str]] = {}  # our query id -> (client, its query id)
        self.draining = False

    async def run(self) -> int:
        await self.link.to_peer("launcher", Ready("frontend", os.getpid()))
        code = await serve([self._loop()], self.log)
        self.tokenize_pool.shutdown(wait=False, cancel_futures=True)
        self.link.close()
        self.ctx.term()
        return code

    async def _loop(self) -> None:
        async for env in self.link.envelopes(self.log):
            try:
                await self._dispatch(env)
            except ProtocolError as e:
                await self.link.reject(env, e, self.log)

    async def _dispatch(self, env: Envelope) -> None:
        if env.route == CLIENT:
            msg = decode(env.payload, TO_SERVER)
            if isinstance(msg, Generate):
                await self._enqueue(env.source, msg)
            elif isinstance(msg, Abort):
                if self.admitting.get(msg.request_id, (b"",))[0] == env.source:
                    self.admitting[msg.request_id] = (env.source, True)
                elif msg.request_id in self.active and self.active[msg.request_id].client == env.source:
                    await self.link.to_peer("scheduler", AbortRequest(msg.request_id))
            elif isinstance(msg, Stats):
                if len(self.stats_waiting) >= MAX_STATS_QUERIES:
                    await self.link.to_client(env.source, Error("too many stats queries in flight", None, OVERLOADED))
                    return
                qid = uuid.uuid4().hex
                self.stats_waiting[qid] = (env.source, msg.query_id)
                await self.link.to_peer("scheduler", StatsQuery(qid, msg.record, msg.reset))
            return
        msg = decode(env.payload, FROM_PROCESSES)
        if isinstance(msg, TokenBatch):
            await self._on_tokens(msg)
        elif isinstance(msg, StatsResult):
            client, query_id = self.stats_waiting.pop(msg.query_id, (b"", ""))
            if client:
                stats = msg.stats | {"frontend": {"active_requests": len(self.active), "admitting": len(self.admitting),
                                         "draining": self.draining}}
                await self.link.to_client(client, StatsReply(query_id, stats))
        elif isinstance(msg, ClientGone):
            await self._client_gone(msg.client)
        elif isinstance(msg, Drain):
            self.draining = True
            self.log.info("draining", active=len(self.active))
            await self._maybe_drained()
        elif isinstance(msg, AbortAll):
            self.log.warning("aborting every request", reason=msg.reason, active=len(self.active))
            for rid in self.active:
                await self.link.to_peer("scheduler", AbortRequest(rid))
            for rid, (client, _) in self.admitting.items():
                self.admitting[rid] = (client, True)
        elif isinstance(msg, Error):
            self.log.warning("error from a process", error=msg.error, request_id=msg.request_id)

    async def _enqueue(self, client: bytes, msg: Generate) -> None:
        rid = msg.request_id
        try:
            if self.draining:
                raise _Unavailable("server is shutting down; not accepting new requests")
            if rid in self.active or rid in self.admitting:
                raise InvalidRequest(f"request_id {rid!r} is already in use")
            self.prompts.check(msg)
            SamplingParams.from_dict(msg.sampling).validate(self.info.vocab_size)
        except InvalidRequest as e:
            await self._refuse(client, rid, e)
            return
        self.admitting[rid] = (client, False)
        task = asyncio.create_task(self._tokenize_and_admit(client, msg))
        self.admissions.add(task)
        task.add_done_callback(self.admissions.discard)

    async def _tokenize_and_admit(self, client: bytes, msg: Generate) -> None:
        rid = msg.request_id
        failure: Exception | None = None
        prompt_ids: list[int] = []
        try:
            prompt_ids = await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, self.prompts.token_ids, msg)
            if (spec := SamplingParams.from_dict(msg.sampling).structured_outputs) is not None:
                await bounded(self.tokenize_pool, self.grammars.check, spec, self.cfg.structured.compile_timeout)
        except Exception as e:
            failure = e
        entry = self.admitting.pop(rid, None)
        try:
            if entry is None:
                pass  # its client vanished meanwhile
            elif entry[1]:  # aborted while it was tokenized
                await self.link.to_client(client, Output(rid, [], "", True, "abort", code=ABORTED))
            elif failure is not None:
                raise failure
            else:
                await self._admit(client, msg, prompt_ids)
        except InvalidRequest as e:
            await self._refuse(client, rid, e)
        except Exception:  # e.g. a tokenizer failure: fail this request, keep serving the others
            self.log.exception("request failed before admission", request_id=rid)
            await self.link.to_client(client, Output(rid, [], "", True, "error", INTERNAL_TEXT, code=INTERNAL))
        await self._maybe_drained()

    async def _admit(self, client: bytes, msg: Generate, prompt_ids: list[int]) -> None:
        rid = msg.request_id
        if self.draining:
            raise _Unavailable("server is shutting down; not accepting new requests")
        params = SamplingParams.from_dict(msg.sampling)
        validate_request(prompt_ids, params, self.info, self.cfg)
        self.active[rid] = ActiveRequest(client, IncrementalDetokenizer(self.tokenizer), len(prompt_ids), time.time())
        self.by_client.setdefault(client, set()).add(rid)
        self.log.info("request admitted", request_id=rid, prompt_tokens=len(prompt_ids), max_tokens=params.max_tokens)
        await self.link.to_peer("scheduler", AddRequest(rid, prompt_ids, params.to_dict()))

    async def _refuse(self, client: bytes, rid: str, e: InvalidRequest) -> None:
        self.log.info("request rejected", request_id=rid, error=str(e))
        code = UNAVAILABLE if isinstance(e, _Unavailable) else INVALID_REQUEST
        await self.link.to_client(client, Output(rid, [], "", True, "error", str(e), code=code))

    async def _on_tokens(self, batch: TokenBatch) -> None:
        now = time.time()
        for rid, token_id, reason in batch.events:
            req = self.active.get(rid)
            if req is None:
                continue  # its client vanished: the abort is already on its way
            new = [] if token_id is None else [token_id]
            if new:
                req.token_ids.append(token_id)  # type: ignore[arg-type]
                req.first_token = req.first_token or now
            text = req.detok.step(new)
            if reason is None:
                await self.link.to_client(req.client, Output(rid, new, text))
                continue
            text += req.detok.finish()
            metrics = {**req.metrics(now), **({"scheduler": batch.metrics[rid]} if rid in batch.metrics else {})}
            error = INTERNAL_TEXT if reason == "error" else None
            await self.link.to_client(req.client, Output(rid, new, text, True, reason, error, metrics, FINAL_CODES.get(reason)))
            self._forget(rid)
            self.log.info("request finished", request_id=rid, finish_reason=reason,
                          completion_tokens=len(req.token_ids), iteration=batch.iteration)
        await self._maybe_drained()

    async def _client_gone(self, client: bytes) -> None:
        rids = self.by_client.get(client, set()).copy()
        for rid in [r for r, (c, _) in self.admitting.items() if c == client]:
            del self.admitting[rid]
        self.log.info("client disconnected; aborting its requests", client=client.hex(), requests=len(rids))
        for rid in rids:
            self._forget(rid)
            await self.link.to_peer("scheduler", AbortRequest(rid))
        await self._maybe_drained()

    def _forget(self, rid: str) -> None:
        req = self.active.pop(rid)
        owned = self.by_client[req.client]
        owned.discard(rid)
        if not owned:
            del self.by_client[req.client]

    async def _maybe_drained(self) -> None:
        if self.draining and not self.active and not self.admitting:
            await self.link.to_peer("launcher", Drained())


def main() -> None:
    process_main("orca-mq frontend", lambda cfg, _: Frontend(cfg).run())


if __name__ == "__main__":
    main()
