"""Many rows never make one frame past the bound (issue 44, item 7): a step's tokens to the frontend
(TokenBatch) and an iteration's rows for a client (Outputs), with long prompts' log probabilities, are
split into frames that each fit, rows in order, and decode to what one frame would have held; a
receiver refuses a larger frame (codec.unpack), which dropped every token and final it held. One
request's row always fits: admission refuses prompt log probabilities one message cannot carry. Beside
the byte bound, a frame carries at most FRAME_ENTRIES tokens and log probabilities (a heavier row alone),
so that held finals arriving together are decoded a frame per turn of the receiver's loop."""
from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from orca_mq.admission.limits import fit
from orca_mq.errors import InvalidRequest
from orca_mq.kv.pool import PoolSize
from orca_mq.protocol import PROTOCOL_VERSION, codec, decode
from orca_mq.protocol.client_msgs import TO_CLIENT, Final, Outputs
from orca_mq.protocol.codec import channel
from orca_mq.protocol.engine_msgs import TokenBatch
import orca_mq.protocol.frames as frames_module
from orca_mq.protocol.frames import FrameTooLarge, frames, spans
from orca_mq.protocol.logprobs import Logprobs, TokenLogprobs
from orca_mq.protocol.sampling import SamplingParams
from orca_mq.sched import TokenEvent
from orca_mq.server.active_request import ActiveRequest
from orca_mq.server.outbox import Outbox
from orca_mq.server.scheduler_process import token_batch

LIMIT = 64 << 10   # a small bound in place of 64 MiB: the same arithmetic at test size
K = 5


def _prompt(n: int) -> TokenLogprobs:
    return TokenLogprobs(list(range(n)), [-1.5] * n, [list(range(K))] * n, [[-2.5] * K] * n)


def test_a_steps_events_split_into_frames_that_fit(monkeypatch):
    monkeypatch.setattr(codec, "MAX_FRAME_BYTES", LIMIT)
    events = [TokenEvent(f"r{i}", 7, None, prompt_logprobs=_prompt(400)) for i in range(12)]
    events += [TokenEvent("r0", 8), TokenEvent("r3", None, "abort")]
    whole = token_batch(3, [events], lambda rid: {"iterations": 1})
    parts = frames(lambda lo, hi: token_batch(3, [events[lo:hi]], lambda rid: {"iterations": 1}), len(events))
    assert len(parts) > 1 and all(len(p) <= LIMIT for p in parts)
    got = [decode(p, channel(TokenBatch)) for p in parts]
    assert [r for b in got for r in b.request_ids] == whole.request_ids   # in order: r0's tokens, then its next
    assert {r: lp for b in got for r, lp in b.prompt_logprobs.items()} == whole.prompt_logprobs
    assert {r: f for b in got for r, f in b.finals.items()} == {"r3": "abort"}


def test_a_clients_rows_split_into_frames_that_fit(monkeypatch):
    monkeypatch.setattr(codec, "MAX_FRAME_BYTES", LIMIT)
    sent: list[tuple[bytes, bytes]] = []

    class Link:
        async def to_clients(self, frames: list[tuple[bytes, bytes]]) -> None:
            sent.extend(frames)

    box = Outbox()
    for i in range(10):
        req = ActiveRequest(b"c", f"q{i}", None, 6)   # type: ignore[arg-type]
        head = Logprobs.prompt(1, _prompt(400), lambda t: f"tok{t}")
        box.add(req, [9], "x", Final("length") if i % 3 == 0 else None, None, head)
    box.add(ActiveRequest(b"c", "plain", None, 6), [4], "y", None)   # type: ignore[arg-type]
    asyncio.run(box.send(Link()))   # type: ignore[arg-type]
    assert len(sent) > 1 and all(c == b"c" and len(p) <= LIMIT for c, p in sent)
    rows = [row for _, p in sent for row in decode(p, TO_CLIENT).rows()]
    assert [r.request_id for r in rows] == [f"q{i}" for i in range(10)] + ["plain"]
    assert all(len(r.prompt_logprobs) == 401 for r in rows[:10]) and rows[-1].prompt_logprobs is None
    assert [r.finished for r in rows[:4]] == [True, False, False, True]


def test_every_optional_column_reaches_its_row_split_or_not(monkeypatch):
    """A prompt's tail and an embedding start their columns at the row that has one, the first row too,
    and each row keeps its own across a split."""
    monkeypatch.setattr(codec, "MAX_FRAME_BYTES", 600)
    for n in (1, 40):
        sent: list[tuple[bytes, bytes]] = []

        class Link:
            async def to_clients(self, frames: list[tuple[bytes, bytes]]) -> None:
                sent.extend(frames)

        box, tails, vectors = Outbox(), {0: "<think>", n - 1: "end"}, {0: b"\x01" * 256, n // 2: b"\x02" * 256}
        for i in range(n):
            req = ActiveRequest(b"c", f"q{i}", None, PROTOCOL_VERSION)   # type: ignore[arg-type]
            box.add(req, [i], "x", Final("stop") if i in vectors else None, None, None, tails.get(i), vectors.get(i))
        asyncio.run(box.send(Link()))   # type: ignore[arg-type]
        assert (len(sent) > 1) == (n > 1)
        rows = [row for _, p in sent for row in decode(p, TO_CLIENT).rows()]
        assert [r.prompt_tail for r in rows] == [tails.get(i) for i in range(n)]
        assert [r.embedding for r in rows] == [vectors.get(i) for i in range(n)]


def test_one_row_over_the_bound_is_an_error_not_a_drop(monkeypatch):
    monkeypatch.setattr(codec, "MAX_FRAME_BYTES", LIMIT)
    with pytest.raises(FrameTooLarge):
        frames(lambda lo, hi: Outputs(["a"], [[1]], ["x" * LIMIT], [None]), 1)


def test_admission_refuses_prompt_log_probabilities_one_message_cannot_carry():
    pool = PoolSize(block_size=16, device_blocks=1024, host_blocks=0)
    params = SamplingParams(max_tokens=1, prompt_logprobs=K)
    assert fit([5] * 100, params, 4096, 1000, pool, None, 100 * (1 + K)).prompt_logprobs == K
    with pytest.raises(InvalidRequest, match="prompt_logprobs"):
        fit([5] * 101, params, 4096, 1000, pool, None, 100 * (1 + K))


@given(st.lists(st.integers(0, 30)), st.integers(1, 40))
def test_spans_are_greedy_runs_within_the_limit(weights, limit):
    out = spans(weights, limit)
    assert [i for lo, hi in out for i in range(lo, hi)] == list(range(len(weights)))
    for k, (lo, hi) in enumerate(out):
        assert sum(weights[lo:hi]) <= limit or hi - lo == 1
        if k + 1 < len(out):   # the next row did not fit beside these
            assert sum(weights[lo:hi + 1]) > limit


def test_held_finals_with_log_probabilities_go_in_frames_of_bounded_entries(monkeypatch):
    monkeypatch.setattr(frames_module, "FRAME_ENTRIES", 100)
    sent: list[tuple[bytes, bytes]] = []

    class Link:
        async def to_clients(self, frames: list[tuple[bytes, bytes]]) -> None:
            sent.extend(frames)

    box = Outbox()
    for i in range(9):   # rows of 1 token + 6 positions x (1 + 5 alternatives) = 37 entries; one of 1
        lp = None if i == 4 else Logprobs.decoded(_prompt(6), str)
        box.add(ActiveRequest(b"c", f"q{i}", None, PROTOCOL_VERSION), [i], "x", Final("length"), lp)   # type: ignore[arg-type]
    asyncio.run(box.send(Link()))   # type: ignore[arg-type]
    rows = [[r.request_id for r in decode(p, TO_CLIENT).rows()] for _, p in sent]
    assert rows == [["q0", "q1"], ["q2", "q3", "q4"], ["q5", "q6"], ["q7", "q8"]]
    sent.clear()
    monkeypatch.setattr(codec, "MAX_FRAME_BYTES", max(map(len, (p for _, p in sent_once(box)))) - 1)   # and the bytes' bound
    asyncio.run(box.send(Link()))   # type: ignore[arg-type]
    rows = [[r.request_id for r in decode(p, TO_CLIENT).rows()] for _, p in sent]
    assert [i for part in rows for i in part] == [f"q{i}" for i in range(9)] and len(rows) > 4


def sent_once(box: Outbox) -> list[tuple[bytes, bytes]]:
    out: list[tuple[bytes, bytes]] = []

    class Link:
        async def to_clients(self, frames: list[tuple[bytes, bytes]]) -> None:
            out.extend(frames)

    asyncio.run(box.send(Link()))   # type: ignore[arg-type]
    return out
