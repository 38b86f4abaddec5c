"""POST /v1/responses' output: a Responses API response made of the parsed reply (orca_mq.api.reply),
whole or streamed. One builder serves both: fed the deltas as they come (or the whole output as one),
it opens an output item per kind in the order they first appear — `reasoning` (its text a
reasoning_text part), `message` (an output_text part), a `function_call` per call (whole: the parser
sends a call once complete) — and writes each step's events:

    response.created, response.in_progress,
    response.output_item.added, response.content_part.added, response.reasoning_text.delta | output_text.delta ...,
    response.output_item.added, response.function_call_arguments.delta / .done, response.output_item.done,
    ... response.output_text.done, response.content_part.done, response.output_item.done (the open items, at the end),
    response.completed (or response.incomplete: max_output_tokens reached)

each `event: TYPE` with a JSON `data` carrying its sequence_number.
"""
from __future__ import annotations

import json
import uuid
from typing import Any

from typing import TYPE_CHECKING

from orca_mq.api.errors import ApiError
from orca_mq.api.parsers import CallDelta
from orca_mq.api.schemas import Usage
from orca_mq.api.turn import View

if TYPE_CHECKING:
    from orca_mq.api.turn import Turn

PARTS = {"reasoning": ("reasoning_text", "response.reasoning_text"), "message": ("output_text", "response.output_text")}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseOutput(View):
    THINKING, ANSWER = "reasoning", "message"

    def __init__(self, head: dict[str, Any]) -> None:
        self.head = head                      # the response's fields but its status, output and usage
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, int] = {}        # reasoning / message -> its item's index, while open
        self.texts: dict[str, list[str]] = {}  # an open item's text in pieces, joined at the end (adding each
                                               # delta to its string copied all of it: quadratic in the output)
        self.seq = 0

    def start(self) -> list[str]:
        response = self.response("in_progress", None)
        return [self._event("response.created", response=response), self._event("response.in_progress", response=response)]

    def end(self, turn: Turn) -> tuple[list[str], dict[str, Any]]:
        """The events that close the response, and the response."""
        out = []
        status = "incomplete" if turn.reply.reason == "length" else "completed"
        for kind, i in sorted(self.open.items(), key=lambda kv: kv[1]):
            item, (part, event) = self.items[i], PARTS[kind]
            text = item["content"][0]["text"] = "".join(self.texts.pop(kind, []))
            item["status"] = status
            out += [self._event(f"{event}.done", item_id=item["id"], output_index=i, content_index=0, text=text,
                                **({"logprobs": []} if kind == "message" else {})),
                    self._event("response.content_part.done", item_id=item["id"], output_index=i, content_index=0,
                                part=item["content"][0]),
                    self._event("response.output_item.done", output_index=i, item=item)]
        self.open.clear()
        response = self.response(status, turn.usage(), turn.reply.reasoning_tokens)
        return [*out, self._event(f"response.{status}", response=response)], response

    def error(self, e: ApiError) -> str:
        return self._event("error", code=e.code, message=e.message, param=e.param)

    def response(self, status: str, usage: Usage | None, reasoning_tokens: int = 0) -> dict[str, Any]:
        return self.head | {"status": status, "output": self.items if status != "in_progress" else [],
                            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                            "usage": None if usage is None else {
                                "input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
                                "total_tokens": usage.total_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                                "input_tokens_details": {"cached_tokens": usage.prompt_tokens_details.cached_tokens
                                                         if usage.prompt_tokens_details else 0, "cache_write_tokens": 0}}}

    def text(self, kind: str, text: str) -> list[str]:
        part, event = PARTS[kind]
        out = []
        if kind not in self.open:
            i = self.open[kind] = len(self.items)
            item = {"type": kind, "id": new_id("rs" if kind == "reasoning" else "msg"), "status": "in_progress", "content": []}
            item |= {"summary": []} if kind == "reasoning" else {"role": "assistant"}
            self.items.append(item)
            empty = {"type": part, "text": ""} | ({"annotations": [], "logprobs": []} if kind == "message" else {})
            out += [self._event("response.output_item.added", output_index=i, item=item | {"content": []}),
                    self._event("response.content_part.added", item_id=item["id"], output_index=i, content_index=0,
                                part=empty)]
            item["content"].append(dict(empty))
        i = self.open[kind]
        item = self.items[i]
        self.texts.setdefault(kind, []).append(text)
        return [*out, self._event(f"{event}.delta", item_id=item["id"], output_index=i, content_index=0, delta=text,
                                  **({"logprobs": []} if kind == "message" else {}))]

    def call(self, call: CallDelta) -> list[str]:
        i = len(self.items)
        item = {"type": "function_call", "id": new_id("fc"), "call_id": call.id, "name": call.name,
                "arguments": call.arguments, "status": "completed"}
        self.items.append(item)
        return [self._event("response.output_item.added", output_index=i,
                            item=item | {"arguments": "", "status": "in_progress"}),
                self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=i,
                            delta=call.arguments),
                self._event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                            arguments=call.arguments, name=call.name),
                self._event("response.output_item.done", output_index=i, item=item)]

    def _event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.seq} | fields
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"
