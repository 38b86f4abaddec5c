"""Small queues over ZeroMQ sockets: every internal process's link to the broker, and the
worker control chain.

Envelope on the broker's backend ROUTER (after the ROUTER's own identity frame):
    [route, address, payload]   route = b"P" peer (address = its identity, e.g. b"scheduler"),
                                        b"C" client (address = the client's ROUTER identity),
                                        b"B" the broker itself (address empty)
    [b"M", client, payload, client, payload, ...]   many client frames in one message (the
                                        frontend's frames of one iteration: one send, one wake-up)
A sender names the destination; the broker rewrites the address to the source when delivering.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from orca_mq.protocol import PROTOCOL_VERSION, ProtocolError, encode
from orca_mq.protocol.common_msgs import PROTOCOL, Error

PEER = b"P"
CLIENT = b"C"
BROKER = b"B"
CLIENTS = b"M"


@dataclass(slots=True)
class Envelope:
    route: bytes      # PEER | CLIENT | BROKER: where the message came from
    source: bytes     # peer identity or client identity
    payload: bytes


def parse(frames: list[bytes]) -> Envelope:
    if len(frames) != 3 or frames[0] not in (PEER, CLIENT, BROKER):
        raise ProtocolError(f"malformed envelope ({len(frames)} frames)")
    return Envelope(frames[0], frames[1], frames[2])


def parse_to_broker(frames: list[bytes]) -> list[tuple[bytes, bytes, bytes]]:
    """What a process sent the broker, as (route, destination, payload): one envelope, or one per
    client frame of a CLIENTS message."""
    if frames[:1] == [CLIENTS] and len(frames) >= 3 and len(frames) % 2:
        return [(CLIENT, client, payload) for client, payload in zip(frames[1::2], frames[2::2])]
    env = parse(frames)
    return [(env.route, env.source, env.payload)]


def _dealer(ctx: zmq.Context[Any], address: str, identity: str) -> zmq.Socket[Any]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, identity.encode())
    sock.setsockopt(zmq.LINGER, 2000)     # let final messages out when a process stops
    sock.setsockopt(zmq.SNDHWM, 0)        # never drop or block: the broker is local and fast
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(address)
    return sock


class BrokerLink:
    """An asyncio process's DEALER on the broker's backend socket."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, identity: str) -> None:
        self.identity = identity
        self.sock = _dealer(ctx, address, identity)

    async def recv(self) -> Envelope:
        return parse(await self.sock.recv_multipart(copy=True))

    async def envelopes(self, log: Any) -> AsyncIterator[Envelope]:
        """Every well-formed envelope; a malformed one is logged and skipped (the broker never sends one)."""
        while True:
            try:
                yield await self.recv()
            except ProtocolError as e:
                log.warning("rejected envelope", error=str(e))

    async def reject(self, env: Envelope, error: ProtocolError, log: Any) -> None:
        """Log a frame that could not be accepted and answer its sender (the broker reports its own)."""
        log.warning("rejected frame", route=env.route.decode(), source=env.source.hex(), error=str(error))
        if env.route != BROKER:
            await self.send_raw(env.route, env.source, encode(Error(f"{self.identity}: {error}", error.request_id, PROTOCOL)))

    async def to_peer(self, peer: str | bytes, msg: Any) -> None:
        await self.send_raw(PEER, peer if isinstance(peer, bytes) else peer.encode(), encode(msg))

    async def to_client(self, client: bytes, msg: Any, version: int = PROTOCOL_VERSION) -> None:
        await self.send_raw(CLIENT, client, encode(msg, version))

    async def to_broker(self, msg: Any) -> None:
        await self.send_raw(BROKER, b"", encode(msg))

    async def to_clients(self, frames: list[tuple[bytes, bytes]]) -> None:
        """Encoded frames for several clients, (client, payload) each, in one message."""
        if frames:
            await self.sock.send_multipart([CLIENTS, *(part for frame in frames for part in frame)], copy=False)

    async def send_raw(self, route: bytes, address: bytes, payload: bytes) -> None:
        await self.sock.send_multipart([route, address, payload], copy=False)

    def close(self) -> None:
        self.sock.close()


class SyncBrokerLink:
    """The same link for a plain (non-asyncio) process: the launcher."""

    def __init__(self, ctx: zmq.Context[Any], address: str, identity: str, wake_fd: int | None = None) -> None:
        self.identity = identity
        self.sock = _dealer(ctx, address, identity)
        self.wake_fd = wake_fd
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        if wake_fd is not None:
            self.poller.register(wake_fd, zmq.POLLIN)

    def recv(self, timeout: float) -> Envelope | None:
        """The next envelope within `timeout` seconds; None at the timeout, or at once when `wake_fd`
        (a non-blocking pipe: signal.set_wakeup_fd's) is written to."""
        ready = dict(self.poller.poll(int(timeout * 1000)))
        if self.wake_fd is not None and self.wake_fd in ready:
            with contextlib.suppress(BlockingIOError):
                os.read(self.wake_fd, 4096)
        if self.sock not in ready:
            return None
        return parse(self.sock.recv_multipart())

    def to_peer(self, peer: str, msg: Any) -> None:
        self.sock.send_multipart([PEER, peer.encode(), encode(msg)])

    def to_broker(self, msg: Any) -> None:
        self.sock.send_multipart([BROKER, b"", encode(msg)])

    def close(self) -> None:
        self.sock.close(linger=500)


def control_address(run_dir: str, stage: int, tp_rank: int = 0) -> str:
    """Where a worker on this node pulls control frames: stage 0's rank 0 from the scheduler, rank 0 of
    a later stage from the previous stage's rank 0, other TP ranks from their stage's rank 0."""
    return f"ipc://{run_dir}/ctl{stage}" + (f".{tp_rank}" if tp_rank else "")


def results_address(run_dir: str) -> str:
    """Where the scheduler pulls the last stage's results when that worker shares its node (one hop,
    not two through the broker: with async scheduling the round trip decides whether the GPU waits)."""
    return f"ipc://{run_dir}/results"


async def serve(loops: list[Coroutine[Any, Any, None]], log: Any) -> int:
    """Run a process's loops until SIGTERM/SIGINT (exit code 0) or until one fails (exit code 1:
    the launcher sees the death and fails in-flight requests instead of leaving them hanging)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    tasks = [asyncio.create_task(c) for c in loops]
    stopper = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait([*tasks, stopper], return_when=asyncio.FIRST_COMPLETED)
    code = 0
    for t in done:
        if t is not stopper and t.exception() is not None:
            log.error("process loop failed", exc_info=t.exception())
            code = 1
    for t in [*tasks, stopper]:
        t.cancel()
    await asyncio.gather(*tasks, stopper, return_exceptions=True)
    return code
