"""POST /v1/messages (Anthropic's Messages API): the request (orca_mq.api.messages_schema) becomes the chat
request it stands for, runs as one chat choice (orca_mq.api.turn) and its parsed reply is shown as a
message (orca_mq.api.messages_view), whole or as its stream of events. Errors take Anthropic's shape
(orca_mq.api.errors.body_for), the API key comes as `x-api-key` or `Authorization: Bearer`."""
from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import Request

from orca_mq.api.body import sized
from orca_mq.api.messages_schema import MessagesRequest
from orca_mq.api.messages_view import MessageOutput
from orca_mq.api.responses_schema import validated
from orca_mq.api.responses_view import new_id
from orca_mq.api.schemas import ChatCompletionRequest

if TYPE_CHECKING:
    from orca_mq.api.server import Api


async def message(api: Api, body: MessagesRequest, request: Request) -> Response:
    head = {"id": new_id("msg"), "type": "message", "role": "assistant", "model": api.model_for(body.model)}
    turn = await api.turn(await sized(request, lambda: validated(ChatCompletionRequest, body.chat())), request)
    view = MessageOutput(head)
    if not body.stream:
        return JSONResponse(await turn.shown(view, request))
    return StreamingResponse(turn.events(view, lambda _: None), media_type="text/event-stream")
