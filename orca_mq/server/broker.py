"""The broker: two ROUTER sockets and a routing table, nothing else.

- clients (DEALER) -> `server.frontend_address` ROUTER -> forwarded to the frontend;
- frontend / scheduler / workers / launcher (DEALER, named) -> `server.backend_address` ROUTER,
  addressed with the envelope of orca_mq.server.zmq_queue.

Both ROUTERs set ZMQ_ROUTER_MANDATORY: a send to a vanished client raises EHOSTUNREACH, and the
broker tells the frontend (`client_gone`), which aborts that client's requests. The broker also
remembers which requests each client still waits on (settled by a final `output`, a final row of an
`outputs` frame, or an `error` naming it), so that when a process dies (`fatal` from the launcher)
it can give each of them an `error` final message itself; and until the launcher's `resume` (every
process ready, at the start and after each restart) it refuses requests and stats queries itself, as
`unavailable`. It answers a client frame that decodes in
that frame's protocol version, so an older client reads its replies (one that does not decode is
answered in the current version).

Facing clients, it bounds what it holds: ZeroMQ drops a client sending a frame over
`server.max_frame_bytes` before buffering it (ZMQ_MAXMSGSIZE); at most `server.max_waiting` +
max_bs x n_workers requests are tracked, past that a new one gets `overloaded` at once, and so does
one past its client's fair share of them (orca_mq.fair_share: a client is its key, else its
connection, and a gateway's end clients, `on_behalf_of`, are each their own); no frame can end the
loop. Its counters join every stats reply under "broker".

It is also the door: with `server.api_key` set, a `generate` or `stats` without one of the keys
gets an `unauthorized` final (or error) at once and reaches nothing else; the key is removed from
a frame before it goes further (a request's is replaced by its index, "#i": its client's name). With `server.curve_secret_key` the client socket is a CurveZMQ
server (orca_mq.auth).
"""
from __future__ import annotations

import dataclasses
import uuid
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

import zmq
import zmq.asyncio

from orca_mq.auth import KeyCheck, curve_server
from orca_mq.config import Config
from orca_mq.logs import setup_logging
from orca_mq.protocol import PROTOCOL_VERSION, ProtocolError, encode, unpack
from orca_mq.protocol.client_msgs import TO_CLIENT, TO_SERVER, Generate, Output, Outputs, Ping, Pong, Stats, StatsReply
from orca_mq.protocol.codec import channel, columns, from_dict
from orca_mq.protocol.common_msgs import INVALID_REQUEST, OVERLOADED, PROTOCOL, UNAUTHORIZED, UNAVAILABLE, Error
from orca_mq.admission.limits import check_request_id
from orca_mq.errors import InvalidRequest
from orca_mq.fair_share import MAX_LABEL_CHARS, FairShare, client_name
from orca_mq.protocol.control_msgs import ClientGone, Fatal, Resume
from orca_mq.server.process import process_main
from orca_mq.server.zmq_queue import BROKER, CLIENT, PEER, parse_to_broker, serve

FRONTEND = b"frontend"
_GONE_MEMORY = 4096   # vanished clients remembered, so the frontend hears of each once


@dataclass(slots=True)
class BrokerCounters:
    tracked_requests: int = 0      # requests without a final message (bounded by the capacity)
    clients: int = 0               # clients with such requests
    rejected_frames: int = 0       # client frames answered with a `protocol` error
    overloaded: int = 0            # requests refused with `overloaded`...
    over_share: int = 0            # ...of them, for their client's fair share
    unauthorized: int = 0          # requests and stats queries refused for want of a valid API key
    vanished_clients: int = 0


def _router(ctx: zmq.asyncio.Context, address: str, max_msg_size: int = -1, curve_secret_key: str = "") -> zmq.asyncio.Socket:
    sock = ctx.socket(zmq.ROUTER)
    if curve_secret_key:
        curve_server(sock, curve_secret_key)
    sock.setsockopt(zmq.MAXMSGSIZE, max_msg_size)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.bind(address)
    return sock


class Broker:
    def __init__(self, cfg: Config, restarts: int = 0) -> None:
        self.log = setup_logging("broker", cfg.log)
        self.ctx = zmq.asyncio.Context()
        self.clients = _router(self.ctx, cfg.server.frontend_address, cfg.server.max_frame_bytes, cfg.server.curve_secret_key)
        self.backend = _router(self.ctx, cfg.server.backend_address)
        self.waiting: dict[bytes, dict[str, str]] = {}   # client -> request ids without a final -> whose share
        self.held: Counter[str] = Counter()        # fair-share client -> its requests without a final
        self.versions: dict[bytes, int] = {}       # client in `waiting` -> the protocol version it writes
        self.gone: dict[bytes, None] = {}
        self.fatal: str | None = "starting"        # why the engine side is down (logged, never sent to clients):
        # until the launcher's `resume` says every process is ready (a frontend may be up before its scheduler)
        self.served = False                        # resumed once: from then on, down means a failure, not the start
        self.server_id = uuid.uuid4().hex[:12]
        self.restarts = restarts
        self.capacity = cfg.server.max_waiting + cfg.scheduler.max_bs * cfg.engine.n_workers
        self.shares = FairShare.of(self.capacity, cfg.server.client_headroom)
        self.counters = BrokerCounters()
        self.keys = KeyCheck(cfg.server.api_keys())

    async def run(self) -> int:
        self.log.info("broker listening", clients=self.clients.LAST_ENDPOINT.decode(),
                      backend=self.backend.LAST_ENDPOINT.decode())
        code = await serve([self._client_loop(), self._backend_loop()], self.log)
        self.clients.close()
        self.backend.close()
        self.ctx.term()
        return code

    async def _client_loop(self) -> None:
        while True:
            frames = await self.clients.recv_multipart()
            client, parts = frames[0], frames[1:]
            version = PROTOCOL_VERSION   # of the replies: a frame that decodes is answered in its own
            try:
                if len(parts) != 1:
                    raise ProtocolError(f"expected one frame, got {len(parts)}")
                body = unpack(parts[0])
                msg = from_dict(body, TO_SERVER)
                version = body["v"]
                if isinstance(msg, Generate):
                    check_request_id(msg.request_id)
                    if len(msg.on_behalf_of) > MAX_LABEL_CHARS:
                        raise InvalidRequest(f"on_behalf_of must have at most {MAX_LABEL_CHARS} characters")
            except (ProtocolError, InvalidRequest) as e:
                self.counters.rejected_frames += 1
                self.log.warning("rejected client frame", client=client.hex(), error=str(e))
                rid = e.request_id if isinstance(e, ProtocolError) else None
                await self._reply(client, Error(str(e), rid, PROTOCOL), version)
                continue
            except Exception:  # a codec bug must cost one frame, never the server
                self.counters.rejected_frames += 1
                self.log.exception("client frame failed to decode", client=client.hex())
                await self._reply(client, Error("malformed frame", None, PROTOCOL), version)
                continue
            if isinstance(msg, Ping):
                await self._reply(client, Pong(msg.nonce, self.server_id, self.restarts), version)
                continue
            key_id = ""
            if isinstance(msg, (Generate, Stats)):
                if not self.keys.ok(msg.api_key):
                    await self._unauthorized(client, msg, version)
                    continue
                key_id = f"#{self.keys.which(msg.api_key)}" if self.keys.required and isinstance(msg, Generate) else ""
                if msg.api_key:  # no further (the backend may cross hosts): a request's key by its index
                    parts = [encode(dataclasses.replace(msg, api_key=key_id), version)]
            if isinstance(msg, (Generate, Stats)) and self.fatal is not None:
                await self._unavailable(client, msg, version)
                continue
            if isinstance(msg, Generate):
                if msg.request_id in self.waiting.get(client, ()):
                    await self._reply(client, Error(f"request_id {msg.request_id!r} is already in flight", None,
                                                    INVALID_REQUEST), version)
                    continue
                share = client_name(client, key_id, msg.on_behalf_of)
                if refusal := self._full(share):
                    self.counters.overloaded += 1
                    await self._reply(client, _failed(msg.request_id, OVERLOADED, refusal), version)
                    continue
                self.waiting.setdefault(client, {})[msg.request_id] = share
                self.held[share] += 1
                self.versions[client] = version
                self.counters.tracked_requests += 1
            try:
                await self.backend.send_multipart([FRONTEND, CLIENT, client, parts[0]])
            except zmq.ZMQError:  # the frontend is gone (dead, and the launcher's `fatal` not here yet)
                if isinstance(msg, Generate):
                    self._settle(client, msg.request_id)
                await self._unavailable(client, msg, version)

    async def _unavailable(self, client: bytes, msg: Any, version: int) -> None:
        text = STARTING_TEXT if self.restarts == 0 and not self.served else UNAVAILABLE_TEXT
        if isinstance(msg, Generate):
            await self._reply(client, _failed(msg.request_id, UNAVAILABLE, text), version)
        else:
            await self._reply(client, Error(text, None, UNAVAILABLE), version)

    def _full(self, share: str) -> str | None:
        """Why a request of `share` cannot be tracked now (None: it can)."""
        tracked = self.counters.tracked_requests
        if tracked >= self.capacity:
            return OVERLOADED_TEXT
        if not self.shares.allows(self.held[share], tracked, 1, len(self.held) + (share not in self.held)):
            self.counters.over_share += 1
            return OVER_SHARE_TEXT
        return None

    async def _backend_loop(self) -> None:
        while True:
            frames = await self.backend.recv_multipart()
            source = frames[0]
            try:
                envelopes = parse_to_broker(frames[1:])
            except ProtocolError as e:
                await self._reject(source, e)
                continue
            for route, address, payload in envelopes:
                try:
                    await self._route(source, route, address, payload)
                except ProtocolError as e:
                    await self._reject(source, e)

    async def _route(self, source: bytes, route: bytes, address: bytes, payload: bytes) -> None:
        body = unpack(payload)
        if route == CLIENT:
            await self._deliver(address, payload, body)
        elif route == BROKER:
            await self._handle_control(source, body)
        else:
            try:
                await self.backend.send_multipart([address, PEER, source, payload])
            except zmq.ZMQError:
                raise ProtocolError(f"peer {address!r} unreachable") from None

    async def _reject(self, source: bytes, e: ProtocolError) -> None:
        self.log.warning("rejected backend frame", source=source.decode(errors="replace"), error=str(e))
        try:
            await self.backend.send_multipart([source, BROKER, b"", encode(Error(str(e), e.request_id, PROTOCOL))])
        except zmq.ZMQError:
            pass

    async def _deliver(self, client: bytes, payload: bytes, body: dict[str, Any]) -> None:
        if body["type"] not in TO_CLIENT:
            raise ProtocolError(f"{body['type']!r} is not a client message")
        if self.fatal is not None:
            return  # every waiting request already got its final error
        if body["type"] == Outputs.TYPE:  # type: ignore[attr-defined]
            for rid, final in zip(*columns(body, Outputs, "request_ids", "finals")):
                if final is not None:
                    self._settle(client, rid)
        elif body.get("finished") or body["type"] == Error.TYPE:  # type: ignore[attr-defined]
            self._settle(client, body.get("request_id"))
        elif body["type"] == StatsReply.TYPE:  # type: ignore[attr-defined]
            reply = from_dict(body, channel(StatsReply))
            payload = encode(StatsReply(reply.query_id, reply.stats | {"broker": self.stats()}), body["v"])
        if not await self._to_client(client, payload) and client not in self.gone:
            self.gone[client] = None
            if len(self.gone) > _GONE_MEMORY:
                del self.gone[next(iter(self.gone))]
            self.versions.pop(client, None)
            for rid in list(self.waiting.get(client, ())):
                self._settle(client, rid)
            self.counters.vanished_clients += 1
            self.log.info("client vanished", client=client.hex())
            await self.backend.send_multipart([FRONTEND, BROKER, b"", encode(ClientGone(client))])

    async def _handle_control(self, source: bytes, body: dict[str, Any]) -> None:
        msg = from_dict(body, channel(Fatal, Ping, Resume))
        if isinstance(msg, Ping):
            await self.backend.send_multipart([source, BROKER, b"", encode(Pong(msg.nonce, self.server_id, self.restarts))])
            return
        if isinstance(msg, Resume):
            self.fatal, self.restarts, self.served = None, msg.restarts, True
            self.log.info("serving" if not msg.restarts else "serving again", restarts=msg.restarts)
            return
        self.fatal = msg.reason
        n = sum(len(r) for r in self.waiting.values())
        self.log.error("failing every in-flight request", reason=msg.reason, requests=n)
        for client, rids in list(self.waiting.items()):
            for rid in rids:
                await self._reply(client, _failed(rid, UNAVAILABLE, UNAVAILABLE_TEXT), self.versions[client])
        self.waiting.clear()
        self.versions.clear()
        self.held.clear()
        self.counters.tracked_requests = 0

    async def _unauthorized(self, client: bytes, msg: Generate | Stats, version: int) -> None:
        self.counters.unauthorized += 1
        self.log.warning("unauthorized", client=client.hex(), message=msg.TYPE, key_given=bool(msg.api_key))  # type: ignore[attr-defined]
        text = "unauthorized: this server needs an API key (api_key=...)" if not msg.api_key else "unauthorized: invalid API key"
        if isinstance(msg, Generate):
            await self._reply(client, _failed(msg.request_id, UNAUTHORIZED, text), version)
        else:
            await self._reply(client, Error(text, None, UNAUTHORIZED), version)

    def stats(self) -> dict[str, int]:
        self.counters.clients = len(self.waiting)
        return asdict(self.counters) | {"restarts": self.restarts}

    async def _reply(self, client: bytes, msg: Any, version: int) -> bool:
        return await self._to_client(client, encode(msg, version))

    async def _to_client(self, client: bytes, payload: bytes) -> bool:
        try:
            await self.clients.send_multipart([client, payload])
            return True
        except zmq.ZMQError:  # EHOSTUNREACH under ROUTER_MANDATORY: the client disconnected
            return False

    def _settle(self, client: bytes, request_id: Any) -> None:
        pending = self.waiting.get(client)
        if pending is not None and request_id in pending:
            share = pending.pop(request_id)
            self.held[share] -= 1
            if not self.held[share]:
                del self.held[share]
            self.counters.tracked_requests -= 1
            if not pending:
                del self.waiting[client]
                self.versions.pop(client, None)


UNAVAILABLE_TEXT = "server unavailable: restarting after a failure; retry shortly"
STARTING_TEXT = "server unavailable: starting (the model is loading); retry shortly"
OVERLOADED_TEXT = "server overloaded: too many requests waiting; retry later"
OVER_SHARE_TEXT = "server overloaded: this client holds its share of the requests waiting; retry later"


def _failed(request_id: str, code: str, text: str) -> Output:
    return Output(request_id, [], "", finished=True, finish_reason="error", error=text, code=code)


def main() -> None:
    process_main("broker", "orca-mq broker", lambda cfg, args: Broker(cfg, args.restarts).run(),
                 ("--restarts", {"type": int, "default": 0, "help": "restarts so far (reported in stats)"}))


if __name__ == "__main__":
    main()
