"""The frontend: tokenizes and validates client requests, forwards them to the scheduler, and
streams each request's tokens back, detokenized incrementally: per iteration, one frame per client
(orca_mq.server.outbox), every reply in the protocol version the client wrote its frame in.

Every request gets exactly one final (an `output`, or a row of `outputs` with its `Final`): "stop" |
"length", "abort" (client abort or drain timeout) or "error" with a stable code (common_msgs:
invalid request, failed on a worker; a process died or the server is full — those sent by the broker).
Admission: the size check runs at once on the event loop, the tokenizer on a small thread pool,
so a long prompt delays neither anyone's tokens nor a short prompt's admission (a request reaches
the scheduler when its tokens are ready), and the check of a structured output's constraint (its
shortest output, orca_mq.structured: seconds for some) on a thread of its own, so a stream of new
constraints delays no one's tokenization; an abort or a vanished client meanwhile is kept.
A client that disconnects is reported by the broker (`client_gone`, from ZMQ_ROUTER_MANDATORY
send failures on the first token sent after it left); its requests are aborted, which frees
their KV at the scheduler's next iteration.
Request ids belong to their client (orca_mq.server.request_ids): the scheduler sees an internal
id per request, so two clients with the same id never see each other's tokens or finals.
"""
from __future__ import annotations

import asyncio
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import zmq.asyncio

from orca_mq.admission.served_model import ServedModel
from orca_mq.assembly import INTERNAL_TEXT, Assembler, Assembly
from orca_mq.config import Config
from orca_mq.logs import setup_logging
from orca_mq.protocol import ProtocolError, decode, unpack
from orca_mq.protocol.client_msgs import TO_SERVER, Abort, Generate, Output, Stats, StatsReply
from orca_mq.protocol.common_msgs import ABORTED, INTERNAL, INVALID_REQUEST, OVERLOADED, UNAVAILABLE, Error
from orca_mq.protocol.codec import channel, from_dict
from orca_mq.protocol.control_msgs import AbortAll, ClientGone, Drain, Drained, Ready
from orca_mq.protocol.engine_msgs import AbortRequest, AddRequest, StatsQuery, StatsResult, TokenBatch
from orca_mq.protocol.pooling import PoolingParams
from orca_mq.errors import InvalidRequest
from orca_mq.fair_share import client_name
from orca_mq.protocol.sampling import SamplingParams
from orca_mq.server.active_request import ActiveRequest, Admission
from orca_mq.server.held_rows import HeldRows
from orca_mq.server.outbox import Outbox
from orca_mq.server.process import process_main
from orca_mq.server.request_ids import RequestIds
from orca_mq.server.zmq_queue import CLIENT, BrokerLink, Envelope, serve
from orca_mq.structured.compiler import bounded

FROM_PROCESSES = channel(TokenBatch, StatsResult, Drain, AbortAll, ClientGone, Error)
TOKENIZE_THREADS = 2      # a long prompt's tokenization leaves a thread for short ones
MAX_STATS_QUERIES = 256   # stats queries awaiting the scheduler; more are refused as overloaded


class _Unavailable(InvalidRequest):
    """Refused because of the server's state, not the request's content."""


class Frontend:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.log = setup_logging("frontend", cfg.log)
        self.model = ServedModel(cfg)   # admission's steps 1-3 here (orca_mq.admission); 4 in the scheduler process
        self.tokenizer, self.prompts = self.model.tokenizer, self.model.prompts
        self.model.prompt_logprob_bound   # noqa: B018 (read the vocabulary now, not on the event loop)
        self.assembler = Assembler(self.tokenizer, self.model.info.eos_token_ids)   # what the clients see of each step
        self.tokenize_pool = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="tokenize")
        self.grammar_pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")   # constraints' shortest outputs
        self.ids = RequestIds()                          # (client, its id) <-> internal id
        self.admitting: dict[str, Admission] = {}        # being tokenized, by internal id; bounded by the broker
        self.admissions: set[asyncio.Task[None]] = set()
        self.ctx = zmq.asyncio.Context()
        self.link = BrokerLink(self.ctx, cfg.server.backend_address, "frontend")
        self.active: dict[str, ActiveRequest] = {}       # by internal id
        self.stats_waiting: dict[str, tuple[bytes, str, int]] = {}  # our query id -> (client, its query id, version)
        self.draining = False

    async def run(self) -> int:
        await self.link.to_peer("launcher", Ready("frontend", os.getpid()))
        self.model.warm_grammars(self.grammar_pool)
        code = await serve([self._loop()], self.log)
        self.tokenize_pool.shutdown(wait=False, cancel_futures=True)
        self.grammar_pool.shutdown(wait=False, cancel_futures=True)
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
            body = unpack(env.payload)
            msg, version = from_dict(body, TO_SERVER), body["v"]
            if isinstance(msg, Generate):
                await self._enqueue(env.source, msg, version)
            elif isinstance(msg, Abort):
                await self._abort(self.ids.lookup(env.source, msg.request_id))
            elif isinstance(msg, Stats):
                if len(self.stats_waiting) >= MAX_STATS_QUERIES:
                    await self.link.to_client(env.source, Error("too many stats queries in flight", None, OVERLOADED), version)
                    return
                qid = uuid.uuid4().hex
                self.stats_waiting[qid] = (env.source, msg.query_id, version)
                await self.link.to_peer("scheduler", StatsQuery(qid, msg.record, msg.reset))
            return
        msg = decode(env.payload, FROM_PROCESSES)
        if isinstance(msg, TokenBatch):
            await self._on_tokens(msg)
        elif isinstance(msg, StatsResult):
            await self._stats_reply(msg)
        elif isinstance(msg, ClientGone):
            await self._client_gone(msg.client)
        elif isinstance(msg, Drain):
            self.draining = True
            self.log.info("draining", active=len(self.active))
            await self._maybe_drained()
        elif isinstance(msg, AbortAll):
            self.log.warning("aborting every request", reason=msg.reason, active=len(self.active))
            for iid in [*self.active, *self.admitting]:
                await self._abort(iid)
        elif isinstance(msg, Error):
            self.log.warning("error from a process", error=msg.error, request_id=msg.request_id)

    async def _abort(self, iid: str | None) -> None:
        if iid in self.admitting:
            self.admitting[iid].aborted = True
        elif iid in self.active:
            await self.link.to_peer("scheduler", AbortRequest(iid))

    async def _enqueue(self, client: bytes, msg: Generate, version: int) -> None:
        """The checks that need no tokenizer, on the event loop; the params parsed and validated here, once."""
        try:
            if self.draining:
                raise _Unavailable("server is shutting down; not accepting new requests")
            self.prompts.check(msg)
            params = self.model.params(msg.sampling)
            pooling = None if msg.pooling is None else self._pooling(msg)
            iid = self.ids.new(client, msg.request_id)
        except InvalidRequest as e:
            await self._refuse(client, msg.request_id, e, version)
            return
        self.admitting[iid] = Admission(client, msg, params, version, pooling)
        task = asyncio.create_task(self._tokenize_and_admit(iid, msg, params))
        self.admissions.add(task)
        task.add_done_callback(self.admissions.discard)

    def _pooling(self, msg: Generate) -> PoolingParams:
        """An embedding request's pooling parameters: it embeds a prompt (text or token ids), nothing else."""
        if msg.messages is not None or msg.chat or msg.sampling or msg.chat_template_kwargs is not None:
            raise InvalidRequest("an embedding request (pooling) takes a prompt, as text or token ids, and no messages, "
                                 "chat, chat_template_kwargs or sampling parameters", "pooling")
        return self.model.pooling(msg.pooling)

    async def _tokenize_and_admit(self, iid: str, msg: Generate, params: SamplingParams) -> None:
        failure: Exception | None = None
        prompt_ids: list[int] = []
        tail: str | None = None   # a chat prompt's end, for the client's reasoning parser
        shortest = None   # a constrained request's shortest output, in tokens, that max_tokens must hold
        try:
            prompt_ids, tail = await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, self.prompts.tokenize, msg)
            if (spec := params.structured_outputs) is not None:  # parsed once, in _enqueue
                shortest = await bounded(self.grammar_pool, self.model.grammars.shortest, spec, self.cfg.structured.compile_timeout)
        except Exception as e:
            failure = e
        adm = self.admitting.pop(iid, None)
        if adm is None:
            return  # its client vanished meanwhile
        try:
            if adm.aborted:
                self.ids.release(iid)
                await self.link.to_client(adm.client, Output(msg.request_id, [], "", True, "abort", code=ABORTED), adm.version)
            elif failure is not None:
                raise failure
            else:
                await self._admit(iid, adm, prompt_ids, shortest, tail)
        except InvalidRequest as e:
            self.ids.release(iid)
            await self._refuse(adm.client, msg.request_id, e, adm.version)
        except Exception:  # e.g. a tokenizer failure: fail this request, keep serving the others
            self.ids.release(iid)
            self.log.exception("request failed before admission", request_id=iid)
            await self.link.to_client(adm.client, Output(msg.request_id, [], "", True, "error", INTERNAL_TEXT, code=INTERNAL),
                                      adm.version)
        await self._maybe_drained()

    async def _admit(self, iid: str, adm: Admission, prompt_ids: list[int], shortest: int | None,
                     tail: str | None) -> None:
        if self.draining:
            raise _Unavailable("server is shutting down; not accepting new requests")
        params = self.model.fit(prompt_ids, adm.params, shortest) if adm.pooling is None else self.model.fit_embedding(prompt_ids)
        rid = adm.msg.request_id
        self.active[iid] = ActiveRequest(adm.client, rid, self.assembler.start(prompt_ids, params, time.time()), adm.version,
                                         prompt_tail=tail, held=None if adm.msg.stream else HeldRows())
        share = client_name(adm.client, adm.msg.api_key, adm.msg.on_behalf_of)   # the broker put the key's index there
        self.log.info("request admitted", request_id=iid, client_request_id=rid, prompt_tokens=len(prompt_ids),
                      max_tokens=params.max_tokens, client=share)
        known = None if params.structured_outputs is None else self.model.grammars.known(params.structured_outputs)
        await self.link.to_peer("scheduler", AddRequest(iid, prompt_ids, params, known is not None,
                                                         None if known is None else known.tokens, share, adm.pooling))

    async def _refuse(self, client: bytes, rid: str, e: InvalidRequest, version: int) -> None:
        self.log.info("request rejected", client_request_id=rid, error=str(e))
        code = UNAVAILABLE if isinstance(e, _Unavailable) else INVALID_REQUEST
        await self.link.to_client(client, Output(rid, [], "", True, "error", str(e), code=code, param=e.param), version)

    async def _on_tokens(self, batch: TokenBatch) -> None:
        """One step's tokens: a row per request (orca_mq.assembly), a frame per client; a request that
        does not stream gets its rows with its final (orca_mq.server.held_rows)."""
        out, now = Outbox(), time.time()
        for iid, _, step in self.assembler.rows(batch, now, self._output):
            req = self.active[iid]
            if (row := step if req.held is None else req.held.add(step, now)) is None:
                continue
            if row.final is not None:
                self._forget(iid)
                self.log.info("request finished", request_id=iid, finish_reason=row.final.finish_reason,
                              completion_tokens=len(req.out.detok.ids), iteration=batch.iteration)
            tail, req.prompt_tail = req.prompt_tail, None   # with the request's first row
            out.add(req, row.token_ids, row.text, row.final, row.logprobs, row.prompt_logprobs, tail, row.embedding)
        await out.send(self.link)
        await self._maybe_drained()

    def _output(self, iid: str) -> Assembly | None:
        req = self.active.get(iid)
        return None if req is None else req.out

    async def _stats_reply(self, msg: StatsResult) -> None:
        client, query_id, version = self.stats_waiting.pop(msg.query_id, (b"", "", 0))
        if not client:
            return
        stats = msg.stats | {"frontend": {"active_requests": len(self.active), "admitting": len(self.admitting),
                                          "draining": self.draining, "kv_slots": self.model.pool.device_slots}}
        if "record" in stats:  # the asking client's own requests under its own ids
            stats["record"] = [[it, [self.ids.name(i, client) for i in iids]] for it, iids in stats["record"]]
            stats["arrival_order"] = [self.ids.name(i, client) for i in stats["arrival_order"]]
        await self.link.to_client(client, StatsReply(query_id, stats), version)

    async def _client_gone(self, client: bytes) -> None:
        iids = self.ids.of_client(client)
        self.log.info("client disconnected; aborting its requests", client=client.hex(), requests=len(iids))
        for iid in iids:
            self.ids.release(iid)
            if self.admitting.pop(iid, None) is None and self.active.pop(iid, None) is not None:
                await self.link.to_peer("scheduler", AbortRequest(iid))
        await self._maybe_drained()

    def _forget(self, iid: str) -> None:
        del self.active[iid]
        self.ids.release(iid)

    async def _maybe_drained(self) -> None:
        if self.draining and not self.active and not self.admitting:
            await self.link.to_peer("launcher", Drained())


def main() -> None:
    process_main("frontend", "orca-mq frontend", lambda cfg, _: Frontend(cfg).run())


if __name__ == "__main__":
    main()
