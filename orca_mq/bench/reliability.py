"""Faults against a live server, shared by tests/test_serving_robustness.py and
tools/bench_reliability.py: a fuzz of undecodable client frames, and a soak of well-behaved
clients mixed with aborts, garbage frames and clients that vanish mid-request, and with issue 44's
shapes: requests for a gateway's end clients (`on_behalf_of`), prompt and token log probabilities,
short constraints of many-byte letters (a closing plan each step), a nucleus of most of the vocabulary
and every logits processor at once.

Everything is counted so that a caller can assert the contract: every garbage frame gets one
`error` reply, every request of a client that stays gets exactly one final message. Every request
that runs to its length is kept, and `reproduce` replays each (prompt, temperature, seed) alone:
what the same request gives under load against alone (engine.deterministic).
"""
from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from orca_mq.protocol import ProtocolError, decode, encode
from orca_mq.protocol.client_msgs import TO_CLIENT, TO_SERVER, Abort, Generate, Output, events
from orca_mq.protocol.codec import registered
from orca_mq.protocol.common_msgs import Error

PROMPTS = ["Hello", "The capital of France is", "Write a haiku about the sea.", "1, 2, 3,", "Once upon a time"]
SHAPES = [{"logprobs": 5, "prompt_logprobs": 5}, {"logprobs": 20},
          {"structured_outputs": {"regex": "[\u0400-\u04ff]{1,3}"}, "max_tokens": 8},
          {"structured_outputs": {"regex": "[a-z]{1,3}"}, "max_tokens": 8},
          {"temperature": 2.0, "top_p": 0.99},
          {"presence_penalty": 2.0, "frequency_penalty": 2.0, "repetition_penalty": 1.3, "min_p": 0.05,
           "logit_bias": {str(t): 1.0 for t in range(1024)}}]
# what `reproduce` sends, and what leaves a request's tokens as they are
REPLAYED = {"max_tokens", "ignore_eos", "temperature", "seed", "logprobs", "prompt_logprobs"}


def _value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(9 if depth < 3 else 6)
    if kind == 0:
        return rng.choice([0, 1, -1, 2**31, 2**63 - 1, -(2**63), 2**64 - 1, rng.randint(-999, 999)])
    if kind == 1:
        return rng.choice([0.0, -1.5, float("nan"), float("inf"), 1e308])
    if kind == 2:
        return "".join(rng.choice("aé字\x00 ") for _ in range(rng.randrange(12)))
    if kind == 3:
        return rng.randbytes(rng.randrange(12))
    if kind == 4:
        return rng.choice([None, True, False])
    if kind == 5:
        return msgpack.ExtType(rng.randrange(128), rng.randbytes(3))
    if kind in (6, 7):
        return [_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(["a", b"b", "type", "v", "request_id"]): _value(rng, depth + 1) for _ in range(rng.randrange(4))}


def garbage_frame(rng: random.Random) -> bytes:
    """One frame no client channel accepts: random bytes, random msgpack, near-valid headers,
    truncated requests, known types with badly typed fields."""
    kind = rng.randrange(5)
    if kind == 0:
        return rng.randbytes(rng.choice([0, 1, 7, 64, 1024, 65536]))
    if kind == 1:
        return msgpack.packb(_value(rng), use_bin_type=True)
    if kind == 4:
        whole = encode(Generate(f"g{rng.randrange(10**9)}", prompt=rng.choice(PROMPTS), sampling={"max_tokens": 2}))
        return whole[:rng.randrange(len(whole))]
    body: dict[Any, Any] = {"v": rng.choice([2, 2, 2, 1, 99, [2], None, "2"]),
                            "type": rng.choice([*registered(), [1], {"a": 1}, None, 7])}
    for _ in range(rng.randrange(5)):
        body[rng.choice(["request_id", "prompt", "sampling", "nonce", "query_id", b"prompt", "colour"])] = _value(rng)
    return msgpack.packb(body, use_bin_type=True)


def garbage_frames(rng: random.Random, n: int) -> list[bytes]:
    frames: list[bytes] = []
    while len(frames) < n:
        frame = garbage_frame(rng)
        try:
            decode(frame, TO_SERVER)  # by chance a valid request: not garbage, and it would be served
        except ProtocolError:
            frames.append(frame)
    return frames


def _dealer(ctx: zmq.asyncio.Context, address: str) -> zmq.asyncio.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


@dataclass(slots=True)
class FuzzResult:
    frames: int = 0
    errors: dict[str, int] = field(default_factory=dict)    # Error replies by code
    other_replies: int = 0                                   # anything but an Error: a frame got through
    unanswered: int = 0
    seconds: float = 0.0


async def fuzz(address: str, frames: list[bytes], window: int = 64, timeout: float = 10.0) -> FuzzResult:
    """Send every frame (at most `window` unanswered at once) and count the replies."""
    result = FuzzResult(len(frames))
    ctx = zmq.asyncio.Context()
    sock = _dealer(ctx, address)
    start = time.perf_counter()
    sent = received = 0
    try:
        while received < len(frames):
            while sent < len(frames) and sent - received < window:
                await sock.send(frames[sent])
                sent += 1
            if not await sock.poll(int(timeout * 1000)):
                break
            received += 1
            try:
                msg = decode(await sock.recv(), TO_CLIENT)
            except ProtocolError:
                msg = None
            if isinstance(msg, Error):
                result.errors[msg.code] = result.errors.get(msg.code, 0) + 1
            else:
                result.other_replies += 1
    finally:
        sock.close()
        ctx.term()
    result.unanswered = len(frames) - received
    result.seconds = time.perf_counter() - start
    return result


@dataclass(slots=True)
class SoakConfig:
    clients: int = 4
    requests_per_client: int = 50
    concurrency: int = 2              # requests in flight per client
    max_tokens: int = 4
    abort_rate: float = 0.2           # of requests, aborted at once or after their first token
    garbage_rate: float = 0.1         # a garbage frame after this share of requests
    vanishing_clients: int = 4        # clients that send requests and disappear
    timeout: float = 60.0             # seconds without any message before a client gives up
    seeds: int = 8                    # sampling seeds drawn from: few, so `reproduce` needs few runs alone
    shaped_rate: float = 0.2          # of requests, one of issue 44's shapes (log probabilities, a constraint)


@dataclass(slots=True)
class SoakResult:
    requests: int = 0
    finals: dict[str, int] = field(default_factory=dict)    # "finish_reason/code" of each final
    duplicate_finals: int = 0
    missing_finals: int = 0
    aborts_sent: int = 0
    garbage_sent: int = 0
    garbage_answered: int = 0
    vanished_requests: int = 0
    seconds: float = 0.0
    completed: list[tuple[str, float, int, list[int]]] = field(default_factory=list)  # (prompt, temperature, seed, tokens)


async def soak(address: str, cfg: SoakConfig, seed: int = 0) -> SoakResult:
    result = SoakResult()
    ctx = zmq.asyncio.Context()
    start = time.perf_counter()
    try:
        await asyncio.gather(*(_client(ctx, address, f"c{i}", random.Random(seed * 1000 + i), cfg, result)
                               for i in range(cfg.clients)),
                             *(_vanishing(ctx, address, f"v{i}", cfg, result) for i in range(cfg.vanishing_clients)))
    finally:
        ctx.term()
    result.seconds = time.perf_counter() - start
    return result


async def _client(ctx: zmq.asyncio.Context, address: str, name: str, rng: random.Random, cfg: SoakConfig,
                  result: SoakResult) -> None:
    sock = _dealer(ctx, address)
    finals: Counter[str] = Counter()
    pending: set[str] = set()
    abort_on_token: set[str] = set()
    sent_as: dict[str, tuple[str, float, int]] = {}
    tokens: dict[str, list[int]] = {}
    sent = garbage = 0
    try:
        while sent < cfg.requests_per_client or pending or garbage:
            while sent < cfg.requests_per_client and len(pending) < cfg.concurrency:
                rid = f"{name}-{sent}"
                sent += 1
                pending.add(rid)
                sampling = {"max_tokens": rng.randint(1, cfg.max_tokens), "ignore_eos": True,
                            "temperature": rng.choice([0.0, 0.8]), "seed": rng.randrange(cfg.seeds)}
                prompt, shaped = rng.choice(PROMPTS), rng.random() < cfg.shaped_rate
                if shaped:
                    sampling |= rng.choice(SHAPES)
                if set(sampling) <= REPLAYED:   # a constraint's, a nucleus's or a processor's tokens: not replayed alone
                    sent_as[rid] = (prompt, sampling["temperature"], sampling["seed"])
                tokens[rid] = []
                await sock.send(encode(Generate(rid, prompt=prompt, sampling=sampling,
                                                on_behalf_of=rng.choice(["", "end-a", "end-b"]) if shaped else "")))
                if rng.random() < cfg.abort_rate:
                    result.aborts_sent += 1
                    if rng.random() < 0.5:
                        await sock.send(encode(Abort(rid)))
                    else:
                        abort_on_token.add(rid)
                if rng.random() < cfg.garbage_rate:
                    await sock.send(garbage_frame(rng))
                    garbage += 1
                    result.garbage_sent += 1
            if not await sock.poll(int(cfg.timeout * 1000)):
                break
            for msg in events(decode(await sock.recv(), TO_CLIENT)):
                if isinstance(msg, Error) and msg.request_id not in finals and msg.request_id not in pending:
                    garbage -= 1
                    result.garbage_answered += 1
                elif isinstance(msg, (Output, Error)) and (isinstance(msg, Error) or msg.finished):
                    finals[msg.request_id] += 1  # type: ignore[index]
                    pending.discard(msg.request_id)  # type: ignore[arg-type]
                    reason = "error" if isinstance(msg, Error) else msg.finish_reason
                    if isinstance(msg, Output) and reason == "length" and msg.request_id in sent_as:
                        result.completed.append((*sent_as[msg.request_id], tokens[msg.request_id] + msg.token_ids))
                    key = f"{reason}/{msg.code}"
                    result.finals[key] = result.finals.get(key, 0) + 1
                elif isinstance(msg, Output) and msg.request_id in tokens:
                    tokens[msg.request_id] += msg.token_ids
                    if msg.request_id in abort_on_token:
                        abort_on_token.discard(msg.request_id)
                        await sock.send(encode(Abort(msg.request_id)))
        while await sock.poll(300):  # anything after the last final is a duplicate
            for msg in events(decode(await sock.recv(), TO_CLIENT)):
                if isinstance(msg, Output) and msg.request_id in finals:
                    finals[msg.request_id] += 1
    finally:
        sock.close()
    result.requests += sent
    result.duplicate_finals += sum(n - 1 for n in finals.values() if n > 1)
    result.missing_finals += len(pending)


async def reproduce(address: str, completed: list[tuple[str, float, int, list[int]]], max_tokens: int) -> dict[str, Any]:
    """Every (prompt, temperature, seed) of `completed` alone on the idle server for `max_tokens`:
    a request's tokens under load must be a prefix of them (ignore_eos; a draw depends only on the
    seed and the position). Counts the mismatches, greedy ones apart."""
    from orca_mq.client import AsyncClient

    alone: dict[tuple[str, float, int], list[int]] = {}
    async with AsyncClient(address) as client:
        for prompt, temperature, seed in sorted({c[:3] for c in completed}):
            out = await client.generate(prompt, max_tokens=max_tokens, temperature=temperature, seed=seed, ignore_eos=True)
            alone[prompt, temperature, seed] = out.token_ids
    bad = [c for c in completed if alone[c[:3]][: len(c[3])] != c[3]]
    return {"probes": len(completed), "greedy_probes": sum(c[1] == 0 for c in completed), "runs_alone": len(alone),
            "mismatches": len(bad), "greedy_mismatches": sum(c[1] == 0 for c in bad)}


async def _vanishing(ctx: zmq.asyncio.Context, address: str, name: str, cfg: SoakConfig, result: SoakResult) -> None:
    """Send a few long requests, read one event, leave without a word: the server must abort them."""
    sock = _dealer(ctx, address)
    try:
        for i in range(cfg.concurrency):
            await sock.send(encode(Generate(f"{name}-{i}", prompt="Tell me a long story.",
                                            sampling={"max_tokens": 200, "ignore_eos": True})))
            result.vanished_requests += 1
        await sock.poll(int(cfg.timeout * 1000))
    finally:
        sock.close()
