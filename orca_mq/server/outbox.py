"""One iteration's news for the clients, a frame per client: what the frontend streams.

A client that wrote its request in protocol v4 or later gets one `outputs` frame per iteration with
a row for each of its requests the iteration moved (one encode per client, not per token). An older
client knows only `output`: it gets one per request, in its own version. All of them leave in one
message to the broker, which sends each client its frame (several, in order, where one would exceed
the frame bound or carry more than FRAME_ENTRIES tokens and log probabilities: orca_mq.protocol.frames).
"""
from __future__ import annotations

import dataclasses

from orca_mq.protocol import encode
from orca_mq.protocol.client_msgs import Final, Output, Outputs, as_output
from orca_mq.protocol.frames import frames, spans
from orca_mq.protocol.logprobs import Logprobs, entries
from orca_mq.server.active_request import ActiveRequest
from orca_mq.server.zmq_queue import BrokerLink

BATCHED_VERSION = 4   # the protocol version that added `outputs`
OPTIONAL = (("logprobs", "prompt_logprobs"), ("prompt_tails",), ("embeddings",))   # column groups a row may fill
NO_EXTRAS = (None,) * sum(map(len, OPTIONAL))   # a row without any


class Outbox:
    def __init__(self) -> None:
        self.batches: dict[bytes, Outputs] = {}                # v4 clients: their one frame...
        self.versions: dict[bytes, int] = {}                   # ...in the oldest version of their requests
        self.singles: list[tuple[bytes, int, Output]] = []     # older clients: (client, version, frame)

    def add(self, req: ActiveRequest, token_ids: list[int], text: str, final: Final | None,
            logprobs: Logprobs | None = None, prompt_logprobs: Logprobs | None = None,
            prompt_tail: str | None = None, embedding: bytes | None = None) -> None:
        if req.version < BATCHED_VERSION:
            self.singles.append((req.client, req.version, as_output(req.request_id, token_ids, text, final)))
            return
        batch = self.batches.get(req.client)
        if batch is None:
            batch = self.batches[req.client] = Outputs([], [], [], [])
            self.versions[req.client] = req.version
        elif req.version < self.versions[req.client]:
            self.versions[req.client] = req.version
        extras = (logprobs, prompt_logprobs, prompt_tail, embedding)
        if extras != NO_EXTRAS or batch.logprobs or batch.prompt_tails or batch.embeddings:   # most rows have none
            _optional_row(batch, extras)
        batch.request_ids.append(req.request_id)
        batch.token_ids.append(token_ids)
        batch.texts.append(text)
        batch.finals.append(final)

    async def send(self, link: BrokerLink) -> None:
        await link.to_clients([(client, frame) for client, batch in self.batches.items()
                               for lo, hi in spans(weights(batch))
                               for frame in frames(lambda a, b, lo=lo: rows(batch, lo + a, lo + b), hi - lo, self.versions[client])]
                              + [(client, encode(single, version)) for client, version, single in self.singles])


def weights(batch: Outputs) -> list[int]:
    """Each row's tokens and log probabilities (what a frame is cut by), from the batch's columns: only a batch
    with log probabilities walks them."""
    out = list(map(len, batch.token_ids))
    for column in (batch.logprobs, batch.prompt_logprobs):   # empty, or a value per row
        if column:
            out = [w + entries(lp) for w, lp in zip(out, column)]
    return out


def rows(batch: Outputs, lo: int, hi: int) -> Outputs:
    """Rows lo..hi-1 of `batch` (the batch itself when that is all of it)."""
    if hi - lo == len(batch.request_ids):
        return batch
    return Outputs(*(getattr(batch, f.name)[lo:hi] for f in dataclasses.fields(Outputs)))   # every column, empty ones too


def _optional_row(batch: Outputs, extras: tuple[object, ...]) -> None:
    """A row's values of the optional columns, in OPTIONAL's order (the row is appended next): a group of
    columns starts, together, at the first row with a value in it, None before it."""
    at = 0
    for names in OPTIONAL:
        values, at = extras[at:at + len(names)], at + len(names)
        started = bool(getattr(batch, names[0]))
        if not started and values.count(None) == len(values):
            continue
        for name, value in zip(names, values):
            if not started:
                setattr(batch, name, [None] * len(batch.request_ids))
            getattr(batch, name).append(value)
