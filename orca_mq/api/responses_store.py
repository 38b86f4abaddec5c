"""The responses kept for `previous_response_id` (POST /v1/responses with `store`, the default): each one's
conversation as chat messages (its input after the instructions, and its output as the assistant's turn),
at most `server.responses_store` of them, the oldest evicted first, and none longer than a prompt the
context could hold (its continuation could not fit). Kept in the API process: a restart forgets them."""
from __future__ import annotations

from collections import OrderedDict
from typing import Any

from orca_mq.admission.prompts import text_chars
from orca_mq.api.errors import ApiError


class ResponseStore:
    def __init__(self, size: int) -> None:
        self.size = size
        self.kept: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()

    def put(self, response_id: str, conversation: list[dict[str, Any]], max_chars: int) -> None:
        if self.size == 0 or text_chars(conversation) > max_chars:
            return
        self.kept[response_id] = conversation
        while len(self.kept) > self.size:
            self.kept.popitem(last=False)

    def get(self, response_id: str) -> list[dict[str, Any]]:
        if (conversation := self.kept.get(response_id)) is None:
            raise ApiError(404, f"Response with id '{response_id[:100]}' not found: it was not stored, or the server "
                           f"no longer holds it (server.responses_store keeps the last {self.size})", "not_found",
                           "previous_response_id")
        return conversation
