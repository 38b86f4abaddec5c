"""The replayer's client for any OpenAI-compatible server (orca-mq's HTTP API, llama.cpp's
server, vLLM, ...): `POST /v1/completions` with the trace's token ids as the prompt, or
`POST /v1/chat/completions` with a chat trace's messages, streamed (server-sent events), greedy,
generation forced to max_tokens with `ignore_eos` (llama.cpp and vLLM accept it). ``extra`` is
merged into every body, for a server's own options (llama.cpp's `cache_prompt`); orca-mq refuses
fields it does not know.

Every content chunk is one token event, timed when it arrives, as `vllm bench serve` does; the
final `usage` (stream_options.include_usage) gives the true token count, and tokens a server
sent inside a chunk with others are counted on the final event.
"""
from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx


@dataclass(slots=True)
class Event:
    """The replayer's view of one server event (the attributes orca_mq.client.StreamEvent has)."""

    request_id: str
    token_ids: list[int]     # placeholders: one per token received (their ids are not needed)
    text: str
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    metrics: dict[str, Any] | None = None


class OpenAIClient:
    def __init__(self, base_url: str, model: str | None = None, timeout: float = 3600.0,
                 extra: dict[str, Any] | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.extra = dict(extra or {})
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        self.http = httpx.AsyncClient(base_url=self.base_url, timeout=timeout, limits=limits)

    async def __aenter__(self) -> OpenAIClient:
        if self.model is None:
            r = await self.http.get("/v1/models")
            r.raise_for_status()
            self.model = r.json()["data"][0]["id"]
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.http.aclose()

    async def stream(self, *, prompt_token_ids: list[int] | None = None, messages: list[dict[str, str]] | None = None,
                     max_tokens: int, temperature: float = 0.0, ignore_eos: bool = True) -> AsyncIterator[Event]:
        rid = uuid.uuid4().hex
        chat = messages is not None
        body = {"model": self.model, **({"messages": messages} if chat else {"prompt": prompt_token_ids}),
                "max_tokens": max_tokens, "temperature": temperature, "ignore_eos": ignore_eos, "stream": True,
                "stream_options": {"include_usage": True}, **self.extra}
        seen, reason = 0, None
        async with self.http.stream("POST", "/v1/chat/completions" if chat else "/v1/completions", json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")[:500]
                yield Event(rid, [], "", True, "error", f"HTTP {r.status_code}: {text}")
                return
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    yield Event(rid, [], "", True, "error", str(chunk["error"].get("message", chunk["error"])))
                    return
                for choice in chunk.get("choices") or []:
                    reason = choice.get("finish_reason") or reason
                    text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                    if text:
                        seen += 1
                        yield Event(rid, [0], text)
                if chunk.get("usage"):
                    missing = max(0, int(chunk["usage"]["completion_tokens"]) - seen)
                    yield Event(rid, [0] * missing, "", True, reason, None, {"usage": chunk["usage"]})
                    return
        yield Event(rid, [], "", True, reason, None if reason else "stream ended without usage")
