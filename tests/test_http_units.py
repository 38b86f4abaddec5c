"""Pieces of the HTTP API and its bench backend that need no server: stop strings held back
across chunks, error classification, goodput SLOs, the engine collector's Prometheus output, a big
JSON body sent in slices."""
from __future__ import annotations

import asyncio
import gc
import threading
import time
from types import SimpleNamespace
from typing import Annotated, ClassVar

import pytest
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient
from prometheus_client import generate_latest
from pydantic import BaseModel, ValidationError, model_validator
from prometheus_client.parser import text_string_to_metric_families

from orca_mq.bench.metrics import parse_goodput, summarize
from orca_mq.api.errors import classify
from orca_mq.api.messages_view import MessageOutput
from orca_mq.api.body import _PAUSE, parsed
from orca_mq.api.chat_format import ChatFormat
from orca_mq.api.offload import SLICE, Builder, SlicedJSON
from orca_mq.api.parsers import Delta
from orca_mq.api.responses_view import ResponseOutput
from orca_mq.api.embeddings import EmbeddingRequest
from orca_mq.api.messages_schema import MessagesRequest
from orca_mq.api.schemas import MAX_MESSAGES, ChatCompletionRequest, CompletionRequest, Usage
from orca_mq.config import MAX_PROMPTS
from orca_mq.api.responses_schema import MAX_ITEMS, ResponsesRequest
from orca_mq.api.stream import StopStrings
from orca_mq.api.reply import Reply
from orca_mq.api.turn import Turn
from orca_mq.api.metrics import ApiMetrics
from orca_mq.server.telemetry import Telemetry


def test_stop_string_split_over_chunks_is_held_back_then_cut():
    stops = StopStrings(["\nUser:", "###"])
    assert stops.feed("Hello") == ("Hello", False)
    assert stops.feed(" there\nUs") == (" there", False)     # "\nUs" may start a stop string
    assert stops.feed("ually") == ("\nUsually", False)        # it did not
    assert stops.feed(" ok\nUser: hi") == (" ok", True)
    tail = StopStrings(["END"])
    assert tail.feed("abcEN") == ("abc", False) and tail.flush() == "EN"


@pytest.mark.parametrize("code, error, status", [
    ("invalid_request", "empty prompt", 400), ("protocol", "malformed frame", 400),
    ("unavailable", "server is shutting down; not accepting new requests", 503), ("aborted", "request aborted", 503),
    ("overloaded", "server overloaded: too many requests waiting", 429), ("internal", "KeyError('x')", 500), (None, None, 500),
    ("unauthorized", "unauthorized: invalid API key", 401),
])
def test_error_classification(code, error, status):
    err = classify(code, error)
    assert err.status == status and err.code == (code or "internal")
    assert err.message == ("internal server error" if status == 500 else error)   # no internals in a 500


def test_goodput_counts_requests_meeting_every_slo():
    assert parse_goodput(["ttft:500", "tpot:50"]) == {"ttft": 0.5, "tpot": 0.05}
    with pytest.raises(ValueError):
        parse_goodput(["latency:5"])

    def rec(i: int, ttft: float, tpot: float) -> dict:
        times = [ttft + k * tpot for k in range(5)]
        return {"index": i, "arrival_s": 0.0, "first_token_s": ttft, "finish_s": times[-1], "token_times_s": times,
                "generated_tokens": 5, "prompt_tokens": 3, "max_tokens": 5, "finish_reason": "length", "error": None}

    records = [rec(0, 0.1, 0.01), rec(1, 0.9, 0.01), rec(2, 0.1, 0.09), rec(3, 0.2, 0.02)]
    s = summarize(records, {"ttft": 0.5, "tpot": 0.05})
    assert s["goodput_req_s"] == pytest.approx(2 / s["makespan_s"])


def test_engine_histograms_are_cumulative_prometheus_histograms():
    tel = Telemetry()
    for bs in (1, 3, 3, 20):
        tel.batch_size.observe(bs)
    m = ApiMetrics("m")
    stats = {"scheduler": {"running": 2, "waiting": 1, "used_slots": 32, "n_slots": 128, "queue_lengths": [2, 0, 1]},
             "telemetry": tel.to_dict({})}
    m.engine.update(stats)
    m.engine.update(stats | {"broker": {"restarts": 1}})   # the launcher restarted the engine once
    samples = {(s.name, s.labels.get("le"), s.labels.get("level")): s.value
               for f in text_string_to_metric_families(generate_latest(m.registry).decode()) for s in f.samples}
    assert samples[("orca_mq:batch_size_bucket", "2.0", None)] == 1
    assert samples[("orca_mq:batch_size_bucket", "4.0", None)] == 3
    assert samples[("orca_mq:batch_size_bucket", "+Inf", None)] == 4 and samples[("orca_mq:batch_size_sum", None, None)] == 27
    assert samples[("vllm:kv_cache_usage_perc", None, None)] == 0.25
    assert samples[("orca_mq:mlfq_queue_length", None, "3")] == 1
    assert samples[("orca_mq:engine_restarts_total", None, None)] == 1


@pytest.mark.parametrize("sizes", [[], [0], [10], [SLICE], [3, 2 * SLICE + 3, 0, 5]])
def test_a_json_body_goes_in_slices_of_a_loop_turn_each(sizes):
    """A 22 MB response joined into one string, or written in one call, held the HTTP loop 0.1-0.2 s
    (issue 44): its pieces go as they are, in writes of at most SLICE bytes, the last one marked,
    together the body whole, after one start with the whole length."""
    pieces = [bytes((i + n) % 251 for i in range(n)) for n in sizes]
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(SlicedJSON(pieces)({"type": "http"}, None, send))
    start, *slices = sent
    assert start["type"] == "http.response.start" and (b"content-type", b"application/json") in start["headers"]
    assert [v for k, v in start["headers"] if k == b"content-length"] == [str(sum(sizes)).encode()]
    assert b"".join(m["body"] for m in slices) == b"".join(pieces) and all(len(m["body"]) <= SLICE for m in slices)
    assert [m["more_body"] for m in slices] == [True] * (len(slices) - 1) + [False]
    assert len(slices) == max(1, sum(-(-n // SLICE) for n in sizes))


@pytest.mark.parametrize("thinking", [False, True])
def test_a_responses_input_of_many_assistant_items_becomes_one_turn_in_linear_time(thinking):
    """Consecutive assistant items (and the reasoning items before them) join one assistant turn: each
    item's text was added to the turn's string, copying all of it (4,096 items of 1 KB, a body under the
    default server.http_max_body_bytes: 2 to 5 s on the HTTP event loop here, by how the allocator
    reuses memory; 4 KB items: 2 to 8 s). Joined once: a few tens of milliseconds for 8 KB items."""
    size = 8192
    text = {"role": "assistant", "content": [{"type": "output_text", "text": "x" * size}]}
    thought = {"type": "reasoning", "summary": [{"type": "summary_text", "text": "y" * size}]}
    count = MAX_ITEMS // 2 if thinking else MAX_ITEMS
    body = ResponsesRequest.model_validate({"input": [thought, text] * count if thinking else [text] * count})
    start = time.perf_counter()
    [turn] = body.messages()
    took = time.perf_counter() - start
    assert turn == {"role": "assistant", "content": "x" * size * count} | (
        {"reasoning_content": "y" * size * count} if thinking else {})
    assert took < 1.0, f"{took:.2f} s to join {count} items"


@pytest.mark.parametrize("view", [ResponseOutput, MessageOutput])
def test_a_streamed_view_costs_each_delta_its_own_length(view):
    """The Responses and Messages streams add each delta of the reply to the open item's (block's) text:
    added to its string, every delta copied all the text so far (a 131,072-token answer: 17 to 27 s of
    the HTTP event loop here; 5,000 deltas after 4 MB, 10 to 13 s). In pieces joined at the end: 0.04-0.11 s."""
    out = view({"id": "x"})
    out.add(Delta("x" * 4_000_000, "thinking"))
    start = time.perf_counter()
    for _ in range(5000):
        out.add(Delta("abcd"))
    took = time.perf_counter() - start
    turn = SimpleNamespace(reply=SimpleNamespace(reason="stop", reasoning_tokens=1), stop_sequence=None,
                           usage=lambda: Usage(prompt_tokens=1, completion_tokens=5001, total_tokens=5002))
    _, response = out.end(turn)
    answer = "x" * 4_000_000 + "abcd" * 5000
    if view is ResponseOutput:
        assert [item["content"][0]["text"] for item in response["output"]] == ["thinking", answer]
    else:
        assert response["content"] == [{"type": "thinking", "thinking": "thinking", "signature": ""},
                                       {"type": "text", "text": answer}]
    assert took < 2.0, f"{took:.2f} s for 5,000 deltas"


@pytest.mark.parametrize("schema,field", [(CompletionRequest, "prompt"), (EmbeddingRequest, "input")])
def test_a_prompt_is_read_as_the_one_form_its_first_element_names(schema, field):
    """A prompt's union is read by its first element's type, each list to its first wrong element and a batch
    refused past MAX_PROMPTS before its prompts are read: the union tried every form and read every element of
    each (800,000 one-id prompts in a 4 MB body: 2-5 s of the HTTP event loop, 800,003 errors)."""
    for ok in ("hi", [], [5, 6], ["a", "b"], [[1], [2, 3]], [[]], [[0]] * MAX_PROMPTS):
        assert getattr(schema.model_validate({field: ok}), field) == ok
    for bad, loc, kind in [([[0]] * 800_000, (field,), "too_long"), (["a"] * (MAX_PROMPTS + 1), (field,), "too_long"),
                           ([0] * 99_999 + ["a"], (field, "list[int]", 99_999), "int_type"), (["a", 1], (field, "list[str]", 1), "string_type"),
                           ([[0, "x"]] * 3, (field, "list[list[int]]", 0, 1), "int_type"), (5, (field,), "prompt_type"),
                           (None, (field,), "prompt_type")]:
        with pytest.raises(ValidationError) as e:
            schema.model_validate({field: bad})
        assert [(x["loc"], x["type"]) for x in e.value.errors()] == [(loc, kind)], str(bad)[:40]


def test_a_stream_closed_at_its_first_event_ends_its_request():
    """A Responses or Messages stream whose client leaves after the opening events (before any delta) closes
    its choices at once: the engine request was left to the garbage collector's finalizing of its pieces."""
    closed = []

    class Fan:
        async def close(self):
            closed.append(True)

    class View:
        def start(self):
            return ["event: opened"]

    async def leave_early():
        stream = Turn(Fan(), None).events(View(), lambda response: None)
        assert await stream.__anext__() == "event: opened"
        await stream.aclose()

    asyncio.run(leave_early())
    assert closed == [True]



@pytest.mark.parametrize("tokens, off_loop", [(10, False), (100_000, True)])
def test_a_streamed_reply_of_a_long_output_finishes_off_the_event_loop(tokens, off_loop):
    """The Responses and Messages streams' last delta finishes the reply: the parser's end and the count of
    the thinking's tokens (a whole long thinking tokenized again: about 0.1 s). A long output's runs on the
    builder's thread, as the chat stream's finish chunk does; a short one's stays on the loop."""
    threads = []

    def count(text: str) -> int:
        threads.append(threading.current_thread())
        return len(text)

    choice = SimpleNamespace(gen=SimpleNamespace(finish_reason="stop", completion_tokens=tokens, prompt_tail=""))
    builder = Builder()

    class Fan:
        def __init__(self):
            self.builder = builder

        async def results(self):
            yield choice, "<think>hmm"
            yield choice, None

        async def close(self):
            pass

    async def stream():
        reply = Reply(ChatFormat(None, "deepseek_r1", False, count=count), frozenset(), False)
        return [d async for d in Turn(Fan(), reply).deltas()], reply

    deltas, reply = asyncio.run(stream())
    builder.close()
    assert reply.reasoning_tokens == len("hmm") and reply.reason == "stop" and len(deltas) == 2
    assert (threads[0] is not threading.main_thread()) == off_loop



class Probe(BaseModel):
    """A body that says on which thread it was validated (the test below)."""
    items: list[int]

    @model_validator(mode="after")
    def _where(self) -> "Probe":
        Probe.seen["validated"] = threading.current_thread()
        return self

    seen: ClassVar[dict[str, threading.Thread]] = {}


def test_a_large_body_is_validated_off_the_event_loop_and_its_errors_read_as_fastapis():
    """A body's validation costs about its size (4 MB of small messages: 0.5-1.0 s of the HTTP event loop on
    a 2-core host): past 32 KB it runs on the builder's thread (api/body.py), a small one in place; a
    refusal is FastAPI's RequestValidationError with the field's location under "body", as before."""
    app = FastAPI()
    app.state.builder = Builder()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        return JSONResponse({"locs": [list(err["loc"]) for err in e.errors()]}, status_code=400)

    async def probe(body: Annotated[Probe, parsed(Probe)]) -> dict[str, int]:
        Probe.seen["handler"] = threading.current_thread()
        return {"n": len(body.items)}

    app.post("/probe")(probe)
    with TestClient(app) as http:
        for n, off in [(10, False), (20_000, True)]:
            Probe.seen.clear()
            assert http.post("/probe", json={"items": [1] * n}).json() == {"n": n}
            assert (Probe.seen["validated"] is not Probe.seen["handler"]) == off, n
            r = http.post("/probe", json={"items": [1] * (n - 1) + ["x"]})
            assert r.status_code == 400 and r.json() == {"locs": [["body", "items", n - 1]]}
        r = http.post("/probe", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["locs"][0][0] == "body"
    app.state.builder.close()


@pytest.mark.parametrize("schema, field, body", [
    (ChatCompletionRequest, "messages", {}), (MessagesRequest, "messages", {"model": "m", "max_tokens": 1}),
    (ResponsesRequest, "input", {}), (CompletionRequest, "logit_bias", {"prompt": "x"}),
    (ChatCompletionRequest, "tools", {"messages": [{"role": "user", "content": "x"}]})])
def test_a_list_past_its_bound_is_refused_before_its_elements_are_read(schema, field, body):
    """pydantic's max_length counts a list's elements after validating each: 123,000 small messages took
    0.7 s to refuse, with an error per bad element besides. Now one too_long, the elements unread (here
    each element is wrong: were they read, each would add its error)."""
    most = {"messages": MAX_MESSAGES, "input": MAX_MESSAGES, "logit_bias": 4096, "tools": 128}[field]
    value = {str(i): "x" for i in range(most + 1)} if field == "logit_bias" else [{"bad": i} for i in range(most + 1)]
    with pytest.raises(ValidationError) as e:
        schema.model_validate(body | {field: value})
    assert [(x["loc"], x["type"], x["ctx"]["max_length"]) for x in e.value.errors()] == [((field,), "too_long", most)]
    if field in ("messages", "input"):   # at the bound: read
        assert len(getattr(schema.model_validate(body | {field: [{"role": "user", "content": "x"}] * most}), field)) == most


def test_a_messages_text_parts_are_joined_once_where_the_body_is_validated():
    """The parts of a message's content become its text at validation (off the loop for a large body), not
    each time the prompt is built on the loop (140,000 parts: 26 ms a time, twice a request)."""
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    assert body.messages[0].content == "ab" and body.messages[0].text == "ab"


def test_the_collector_stays_paused_while_any_validation_runs_and_comes_back_after_the_last():
    """Validations overlap (the loop's small bodies, the builder's large ones): the first in pauses the cyclic
    collector and the last out resumes it. Each remembering what it found left it off for good when a small
    body's began inside a large one's and ended after it (a reviewer's race: found within seconds)."""
    assert gc.isenabled()
    outer, inner = threading.Event(), threading.Event()

    def large():
        with _PAUSE:
            outer.set()
            inner.wait(5)

    t = threading.Thread(target=large)
    t.start()
    outer.wait(5)
    with _PAUSE:       # a small body's validation, begun inside the large one's
        assert not gc.isenabled()
        inner.set()
        t.join(5)      # the large one ends first
        assert not gc.isenabled()
    assert gc.isenabled()
