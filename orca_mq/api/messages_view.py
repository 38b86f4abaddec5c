"""POST /v1/messages' output: an Anthropic message made of the parsed reply (orca_mq.api.reply), whole or
streamed, by one builder. Its content blocks come in the order the reply's parts first appear — a
`thinking` block (the reasoning parser's), `text`, a `tool_use` per call (its input whole: the parser
sends a call once complete) — one open at a time, as Anthropic streams them:

    message_start, content_block_start, content_block_delta (thinking_delta | text_delta |
    input_json_delta) ..., content_block_stop, ... message_delta (stop_reason, stop_sequence, usage),
    message_stop

each `event: TYPE` with its JSON `data`; an error mid-stream is an `error` event in Anthropic's shape.
stop_reason: end_turn, max_tokens (cut by max_tokens), stop_sequence (with the one matched) or tool_use.
"""
from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from orca_mq.api.errors import ApiError, anthropic_error_body
from orca_mq.api.parsers import CallDelta
from orca_mq.api.turn import View

if TYPE_CHECKING:
    from orca_mq.api.turn import Turn

DELTAS = {"thinking": "thinking_delta", "text": "text_delta"}


def stop_reason(turn: Turn) -> str:
    reason = turn.reply.reason
    if reason == "tool_calls":
        return "tool_use"
    if reason == "length":
        return "max_tokens"
    return "stop_sequence" if turn.stop_sequence is not None else "end_turn"


class MessageOutput(View):
    THINKING, ANSWER = "thinking", "text"

    def __init__(self, head: dict[str, Any]) -> None:
        self.head = head                       # id, type, role, model
        self.blocks: list[dict[str, Any]] = []
        self.open: str | None = None           # the open block's type (thinking, text)
        self.pieces: list[str] = []            # its text, joined when it closes (adding each delta to its
                                               # string copied all of it: quadratic in the output)

    def start(self) -> list[str]:
        return [_event("message_start", message=self.head | {"content": [], "stop_reason": None, "stop_sequence": None,
                                                             "usage": {"input_tokens": 0, "output_tokens": 0}})]

    def end(self, turn: Turn) -> tuple[list[str], dict[str, Any]]:
        usage = turn.usage()
        counts = {"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
                  "cache_read_input_tokens": usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0}
        reason, stop = stop_reason(turn), turn.stop_sequence
        events = [*self._close(), _event("message_delta", delta={"stop_reason": reason, "stop_sequence": stop}, usage=counts),
                  _event("message_stop")]
        return events, self.head | {"content": self.blocks, "stop_reason": reason, "stop_sequence": stop, "usage": counts}

    def error(self, e: ApiError) -> str:
        return _event("error", **{k: v for k, v in anthropic_error_body(e).items() if k != "type"})

    def text(self, kind: str, text: str) -> list[str]:
        out = []
        if self.open != kind:
            out = self._close()
            self.open = kind
            self.blocks.append({"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking"
                               else {"type": "text", "text": ""})
            out.append(_event("content_block_start", index=len(self.blocks) - 1, content_block=dict(self.blocks[-1])))
        self.pieces.append(text)
        return [*out, _event("content_block_delta", index=len(self.blocks) - 1, delta={"type": DELTAS[kind], kind: text})]

    def call(self, call: CallDelta) -> list[str]:
        out = self._close()
        block = {"type": "tool_use", "id": call.id, "name": call.name, "input": json.loads(call.arguments)}
        self.blocks.append(block)
        i = len(self.blocks) - 1
        return [*out, _event("content_block_start", index=i, content_block=block | {"input": {}}),
                _event("content_block_delta", index=i, delta={"type": "input_json_delta", "partial_json": call.arguments}),
                _event("content_block_stop", index=i)]

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        self.blocks[-1][self.open], self.pieces = "".join(self.pieces), []
        self.open = None
        return [_event("content_block_stop", index=len(self.blocks) - 1)]


def _event(kind: str, **fields: Any) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind} | fields, ensure_ascii=False)}\n\n"
