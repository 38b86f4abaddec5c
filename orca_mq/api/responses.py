"""POST /v1/responses (OpenAI's Responses API): the request (orca_mq.api.responses_schema) becomes the
chat request it stands for, after the stored conversation of `previous_response_id`
(orca_mq.api.responses_store); it runs as one chat choice (orca_mq.api.turn) and its parsed reply is
shown as a response (orca_mq.api.responses_view), whole or as its stream of events."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import Request

from orca_mq.api.body import sized
from orca_mq.api.responses_schema import ResponsesRequest, validated
from orca_mq.api.responses_store import ResponseStore
from orca_mq.api.responses_view import ResponseOutput, new_id
from orca_mq.api.schemas import ChatCompletionRequest
from orca_mq.api.turn import Turn

if TYPE_CHECKING:
    from orca_mq.api.server import Api


async def respond(api: Api, store: ResponseStore, body: ResponsesRequest, request: Request) -> Response:
    model = api.model_for(body.model)
    history = store.get(body.previous_response_id) if body.previous_response_id is not None else []
    chat = await sized(request, lambda: validated(ChatCompletionRequest, body.chat(history)))
    turn = await api.turn(chat, request)
    rid = new_id("resp")
    view = ResponseOutput(_head(rid, model, body))
    max_chars = (await api.tokenization.prompts()).max_chars

    def keep(_: dict[str, Any]) -> None:
        if body.store:
            store.put(rid, [*history, *body.messages(), _turn_message(turn)], max_chars)

    if not body.stream:
        response = await turn.shown(view, request)
        keep(response)
        return JSONResponse(response)
    return StreamingResponse(turn.events(view, keep), media_type="text/event-stream")


def _turn_message(turn: Turn) -> dict[str, Any]:
    """The reply as the assistant's turn of the stored conversation."""
    parsed = turn.reply.parsed
    calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in parsed.calls]
    return {"role": "assistant", "content": turn.reply.content} | ({"tool_calls": calls} if calls else {}) | (
        {"reasoning_content": parsed.reasoning} if parsed.reasoning else {})


def _head(rid: str, model: str, body: ResponsesRequest) -> dict[str, Any]:
    """A response's fields that echo its request."""
    choice = body.tool_choice.model_dump() if body.tool_choice is not None and not isinstance(body.tool_choice, str) \
        else body.tool_choice or "auto"
    return {"id": rid, "object": "response", "created_at": int(time.time()), "model": model, "error": None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "parallel_tool_calls": body.parallel_tool_calls is not False, "previous_response_id": body.previous_response_id,
            "temperature": body.temperature, "top_p": body.top_p, "tool_choice": choice,
            "tools": [t.model_dump() for t in body.tools or []], "store": body.store, "truncation": "disabled",
            "text": body.text.model_dump(by_alias=True, exclude_none=True) if body.text and body.text.format
            else {"format": {"type": "text"}},
            "reasoning": body.reasoning.model_dump() if body.reasoning else None, "metadata": body.metadata or {},
            "user": body.user, "background": False}
