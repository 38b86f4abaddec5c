"""POST /v1/chat/completions' responses: each choice's text through the model's parsers
(orca_mq.api.reply), as the chunks of a stream or the choices of a whole completion (the fan-out of
orca_mq.api.fanout calls these builders a choice at a time)."""
from __future__ import annotations

from collections.abc import Callable

from pydantic import BaseModel

from orca_mq.api.fanout import Build, Choice
from orca_mq.api.parsers import Delta
from orca_mq.api.reply import Reply
from orca_mq.api.schemas import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk,
                                 ChatCompletionRequest, ChatDelta, CompletionTokensDetails, Usage)
from orca_mq.api.tools import CalledFunction, ToolCall, ToolCallDelta


def chat_builders(body: ChatCompletionRequest, rid: str, model: str) -> tuple[Build, Build, Callable[[Choice], BaseModel]]:
    """(chunk, whole, opening) of a chat completion bound to the model's format (ChatCompletionRequest.bind)."""
    replies: dict[int, Reply] = {}   # each choice's output through the model's parsers

    def reply(c: Choice) -> Reply:
        return replies.setdefault(c.index, Reply.of(body))

    def counted(usage: Usage) -> Usage:   # the thinking's tokens, once every choice is parsed
        if body.format.reasoning_parser:
            usage.completion_tokens_details = CompletionTokensDetails(
                reasoning_tokens=sum(r.reasoning_tokens for r in replies.values()))
        return usage

    def chunk(c: Choice, text: str, reason: str | None, usage: Usage | None) -> ChatCompletionChunk:
        if usage:
            return ChatCompletionChunk(id=rid, model=model, usage=counted(usage), choices=[])
        r = reply(c)
        d = r.feed(c.gen, text) if reason is None else r.finish(c.gen)
        delta = ChatDelta(content=d.content or (None if reason or d.reasoning or d.calls else ""),
                          reasoning_content=d.reasoning or None, tool_calls=_call_deltas(d) or None)
        return ChatCompletionChunk(id=rid, model=model, choices=[
            ChatChunkChoice(index=c.index, delta=delta, finish_reason=r.reason)])

    def whole(c: Choice, text: str, reason: str | None, usage: Usage | None) -> ChatCompletion:
        r = reply(c)
        parsed = r.whole(c.gen, text)
        calls = [ToolCall(id=k.id, function=CalledFunction(name=k.name, arguments=k.arguments)) for k in parsed.calls]
        message = AssistantMessage(content=r.content, reasoning_content=parsed.reasoning or None, tool_calls=calls or None)
        return ChatCompletion(id=rid, model=model, usage=usage and counted(usage), choices=[   # one usage, every choice's
            ChatChoice(index=c.index, message=message, finish_reason=r.reason)])

    def opening(c: Choice) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=rid, model=model, choices=[
            ChatChunkChoice(index=c.index, delta=ChatDelta(role="assistant", content=""))])

    return chunk, whole, opening


def _call_deltas(d: Delta) -> list[ToolCallDelta]:
    return [ToolCallDelta(index=k.index, id=k.id or "", function=CalledFunction(name=k.name or "", arguments=k.arguments))
            for k in d.calls]
