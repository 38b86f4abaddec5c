"""The OpenAI-compatible HTTP API on a real server, through the official `openai` client: greedy
output equals the ZeroMQ client's for the same prompt (completions and chat, streaming and not),
errors carry OpenAI's error object and status, a client that disconnects frees its request, and
/metrics (parsed by prometheus_client) moves by what the test sent."""
from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from orca_mq.api.server import STATS_MAX_AGE
from orca_mq.client import Client
from orca_mq.config import load_config
from serving_harness import free_port, openai_client, ROOT, start_server

pytestmark = pytest.mark.e2e

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of Japan? Answer in one word."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    srv = start_server(tmp_path_factory.mktemp("http"), **{"server.http_address": f"127.0.0.1:{port}",
                                                          "scheduler.max_bs": 4, "engine.n_slots": 4096})
    srv.base_url = f"http://127.0.0.1:{port}"
    yield srv
    assert srv.stop() == 0, srv.stderr()[-3000:]


@pytest.fixture(scope="module")
def zmq(server):
    with Client(server.address) as client:
        yield client


@pytest.fixture(scope="module")
def oai(server):
    client = openai_client(server.base_url)
    yield client
    client.close()


@pytest.fixture(scope="module")
def model(oai):
    return oai.models.list().data[0].id


def test_completions_equal_zmq_client(zmq, oai, model):
    ref = zmq.generate(PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True)
    out = oai.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert out.choices[0].text == ref.text and out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (ref.metrics["prompt_tokens"], 8)
    chunks = list(oai.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                         stream=True, stream_options={"include_usage": True},
                                         extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    # a prompt of token ids, as the ZeroMQ client sends it
    ids = zmq.generate(prompt_token_ids=ref.token_ids, max_tokens=4, temperature=0.0, ignore_eos=True)
    by_ids = oai.completions.create(model=model, prompt=ref.token_ids, max_tokens=4, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert by_ids.choices[0].text == ids.text and by_ids.usage.prompt_tokens == len(ref.token_ids)


def test_chat_equal_zmq_client(zmq, oai, model):
    ref = zmq.generate(messages=CHAT, max_tokens=12, temperature=0.0)
    out = oai.chat.completions.create(model=model, messages=CHAT, max_completion_tokens=12, temperature=0)
    assert out.choices[0].message.content == ref.text and out.choices[0].finish_reason == ref.finish_reason
    assert out.usage.completion_tokens == len(ref.token_ids)
    chunks = list(oai.chat.completions.create(model=model, messages=CHAT, max_tokens=12, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == ref.finish_reason and chunks[-1].usage is None


def test_stop_string_cuts_the_text_and_frees_the_request(zmq, oai, model):
    ref = zmq.generate("1, 2, 3, 4,", max_tokens=16, temperature=0.0, ignore_eos=True)
    stop = ref.text.split(",")[2] + ","   # a string the model is known to produce
    want = ref.text[:ref.text.index(stop)]
    for stream in (False, True):
        out = oai.completions.create(model=model, prompt="1, 2, 3, 4,", max_tokens=16, temperature=0, stop=[stop],
                                     stream=stream)
        if stream:
            chunks = list(out)
            text, reason = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        else:
            text, reason = out.choices[0].text, out.choices[0].finish_reason
        assert (text, reason) == (want, "stop")
    _wait_idle(zmq)


@pytest.mark.parametrize("body, status, needle, code, param", [
    ({"prompt": ""}, 400, "empty prompt", "invalid_request", "prompt"),
    ({"prompt": "hi", "temperature": -1}, 400, "temperature", "invalid_value", "temperature"),
    ({"prompt": "hi", "temperature": 0.0001, "stream": True}, 400, "temperature", "invalid_value", "temperature"),
    ({"prompt": "hi", "max_tokens": 100000}, 400, "context length", "invalid_request", "max_tokens"),
    ({"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens", "invalid_type", "max_tokens"),
    ({"prompt": "hi", "best_of": 2}, 400, "'best_of'", "unsupported_parameter", "best_of"),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "gpt-4", "model_not_found", "model"),
    ({"prompt": [[1, 2]] * 65}, 400, "batch", "invalid_value", "prompt"),   # over server.http_max_choices
])
def test_errors_are_openai_error_objects(server, body, status, needle, code, param):
    r = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and (err["code"], err["param"]) == (code, param), err
    assert err["type"] == "invalid_request_error"


def test_error_statuses_through_the_openai_client(oai, model):
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=model, messages=[], max_tokens=4)
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="nope", prompt="hi", max_tokens=4)


def test_malformed_and_oversized_bodies(server):
    r = httpx.post(server.base_url + "/v1/completions", content=b"{not json", timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    r = httpx.post(server.base_url + "/v1/completions", json={"prompt": "x" * 5_000_000}, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_a_chunked_body_over_the_limit_is_413_too(server):
    """No Content-Length (Transfer-Encoding: chunked): the body is cut off once past server.http_max_body_bytes
    and refused as a declared one is, 413 request_too_large, not FastAPI's 400 'error parsing the body'."""
    def body():   # valid JSON, 5 MB in 1 MB chunks
        yield b'{"prompt": "'
        for _ in range(5):
            yield b"x" * 1_000_000
        yield b'"}'

    r = httpx.post(server.base_url + "/v1/completions", content=body(), timeout=30,
                   headers={"content-type": "application/json"})
    assert "content-length" not in r.request.headers and r.request.headers["transfer-encoding"] == "chunked"
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text


def _stats(zmq) -> dict:
    return zmq.stats()["scheduler"]


def _wait_idle(zmq, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = _stats(zmq)
        if s["running"] + s["waiting"] == 0 and s["used_slots"] == 0:
            return
        time.sleep(0.2)
    raise AssertionError(f"requests still in the pool: {_stats(zmq)}")


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "blocking"])
def test_client_disconnect_aborts_the_request(server, zmq, model, stream):
    body = {"model": model, "prompt": PROMPT, "max_tokens": 1500, "temperature": 0, "ignore_eos": True, "stream": stream}

    async def leave_early() -> None:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as http:
            if stream:
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            break   # one token seen: leave
            else:
                task = asyncio.create_task(http.post("/v1/completions", json=body))
                while _stats(zmq)["used_slots"] == 0:   # admitted and running
                    await asyncio.sleep(0.1)
                task.cancel()   # closes the connection
                await asyncio.gather(task, return_exceptions=True)

    asyncio.run(leave_early())
    _wait_idle(zmq)   # 1500 tokens would take minutes here: only the abort frees it this soon


def _scrape(server) -> dict[tuple[str, tuple], float]:
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_metrics_move_by_what_was_sent(server, oai, model, zmq):
    _wait_idle(zmq)
    before = _scrape(server)
    usages = [oai.completions.create(model=model, prompt=p, max_tokens=n, temperature=0,
                                     extra_body={"ignore_eos": True}).usage
              for p, n in (("Hello", 3), ("The sky is", 5))]
    streamed = oai.completions.create(model=model, prompt="Hi", max_tokens=4, temperature=0, stream=True,
                                      stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    usages += [chunk.usage for chunk in streamed if chunk.usage is not None]
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model=model, prompt="", max_tokens=3)
    time.sleep(STATS_MAX_AGE)  # the engine's figures are read at most once per STATS_MAX_AGE
    after = _scrape(server)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)

    assert delta("vllm:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("vllm:generation_tokens_total") == 3 + 5 + 4
    assert delta("vllm:request_success_total", finished_reason="length") == 3
    assert delta("orca_mq:requests_total", outcome="invalid") == 1
    assert delta("vllm:time_to_first_token_seconds_count") == 3
    # gaps between the tokens' arrivals: the streamed request's only (the others' tokens came with their finals)
    assert delta("vllm:inter_token_latency_seconds_count") == 4 - 1
    assert delta("vllm:request_time_per_output_token_seconds_count") == 3
    assert delta("vllm:e2e_request_latency_seconds_count") == 3
    assert delta("orca_mq:batch_size_count") >= 12 and delta("orca_mq:iteration_time_seconds_count") >= 12
    assert delta("vllm:request_queue_time_seconds_count") == 3
    assert after[("vllm:num_requests_running", ())] == 0 and after[("vllm:kv_cache_usage_perc", ())] == 0
    assert ("vllm:num_requests_waiting", ()) in after and ("orca_mq:engine_restarts_total", ()) in after


def test_health_and_models(server, model):
    assert httpx.get(server.base_url + "/health", timeout=30).json() == {"status": "ok"}
    models = httpx.get(server.base_url + "/v1/models", timeout=30).json()["data"]
    assert [m["id"] for m in models] == [model] and models[0]["max_model_len"] == 2048


def test_retrieve_tokenize_and_the_ready_line(server, oai, model):
    """models.retrieve through the openai client; /tokenize counts what a generation of the same prompt
    reports as its prompt tokens (completion text and chat); the ready line names the HTTP address."""
    assert oai.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("gpt-4")
    out = oai.completions.create(model=model, prompt=PROMPT, max_tokens=1, temperature=0)
    chat = oai.chat.completions.create(model=model, messages=CHAT, max_tokens=1, temperature=0)
    for body, usage in (({"prompt": PROMPT}, out.usage), ({"messages": CHAT, "model": model}, chat.usage)):
        r = httpx.post(server.base_url + "/tokenize", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["count"] == usage.prompt_tokens, r.text
    ids = httpx.post(server.base_url + "/tokenize", json={"prompt": PROMPT}, timeout=60).json()["tokens"]
    assert httpx.post(server.base_url + "/detokenize", json={"tokens": ids}, timeout=60).json() == {"prompt": PROMPT}
    assert httpx.get(server.base_url + "/version", timeout=30).json()["version"]
    assert server.handle.ready_line == f"orca-mq ready on {server.address} and {server.base_url}"
    from orca_mq.logs import _running
    assert _running(server.log_dir)   # `orca-mq logs` finds it by its marker (pid and start time)


def test_health_answers_at_once_while_the_worker_is_busy(server):
    """A stats reply waits for the workers' counters, which a worker sends between iterations: while the
    worker is busy (here stopped) past a stale reply, /health answers from the last one at once instead
    of waiting server.stats_timeout for the new one (a load balancer's probe would time out)."""
    assert httpx.get(server.base_url + "/health", timeout=30).json() == {"status": "ok"}
    worker, took = server.pid_of("workers.main"), []
    os.kill(worker, signal.SIGSTOP)
    try:
        time.sleep(STATS_MAX_AGE + 0.1)   # stale: each /health now asks the engine again
        for _ in range(4):
            start = time.monotonic()
            assert httpx.get(server.base_url + "/health", timeout=30).json() == {"status": "ok"}
            took.append(time.monotonic() - start)
            time.sleep(0.3)
    finally:
        os.kill(worker, signal.SIGCONT)
    assert max(took) < load_config().server.stats_timeout, took


def test_health_is_503_until_the_server_answers(tmp_path):
    """The API process alone, with no broker behind it: it listens, but is not healthy."""
    port = free_port()
    cfg = load_config(overrides={"server.http_address": f"127.0.0.1:{port}", "log.dir": str(tmp_path),
                                 "server.frontend_address": f"tcp://127.0.0.1:{free_port()}",
                                 "server.backend_address": f"ipc://{tmp_path}/backend"})
    proc = subprocess.Popen([sys.executable, "-m", "orca_mq.api.server", "--config-json", json.dumps(cfg.to_dict())],
                            cwd=ROOT, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "the API process did not come up"
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=30)
                break
            except httpx.ConnectError:
                time.sleep(0.3)
        assert (r.status_code, r.json()) == (503, {"status": "starting"})
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


def test_bench_openai_backend_replays_a_trace(server):
    """tools/bench.py --backend openai: the replayer over HTTP counts every token the server made, in one
    process or several (--client-procs: the factory travels to spawned processes, the records merge)."""
    from orca_mq.bench.client_procs import replay_in_processes
    from orca_mq.bench.metrics import summarize
    from orca_mq.bench.openai_backend import OpenAIClient
    from orca_mq.bench.replay import replay
    from orca_mq.bench.trace import TraceRequest

    trace = [TraceRequest(i, 0.1 * i, list(range(100, 100 + 8 + i)), 5 + i) for i in range(3)]
    records, _ = asyncio.run(replay(server.base_url, trace, progress=False, client_factory=OpenAIClient))
    assert [r["generated_tokens"] for r in records] == [5, 6, 7]
    assert all(r["error"] is None and r["finish_reason"] == "length" for r in records)
    assert summarize(records)["n_ok"] == 3
    merged, _, cpu = replay_in_processes(server.base_url, trace, 2, client_factory=functools.partial(OpenAIClient, model=None))
    assert [r["index"] for r in merged] == [0, 1, 2] and [r["generated_tokens"] for r in merged] == [5, 6, 7] and cpu > 0


def test_repeated_prefix_is_reported_cached(server, oai, model, zmq):
    """The second request of a long prompt takes its full blocks from the prefix cache: usage says so
    (as OpenAI reports it), the Prometheus counters count it, and the text is the same."""
    _wait_idle(zmq)
    before = _scrape(server)
    prompt = "Rules of the house: be kind, be brief, be exact; say so when unsure. " * 6 + "Question: why is the sky blue?"
    outs = [oai.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0) for _ in range(2)]
    first, second = (o.usage for o in outs)
    assert first.prompt_tokens == second.prompt_tokens > 64 and outs[0].choices[0].text == outs[1].choices[0].text
    assert first.prompt_tokens_details.cached_tokens == 0
    assert second.prompt_tokens_details.cached_tokens == (second.prompt_tokens - 1) // 16 * 16
    time.sleep(STATS_MAX_AGE)
    after = _scrape(server)
    assert after[("vllm:prefix_cache_hits_total", ())] - before.get(("vllm:prefix_cache_hits_total", ()), 0.0) == \
        second.prompt_tokens_details.cached_tokens
    assert after[("vllm:prefix_cache_queries_total", ())] - before.get(("vllm:prefix_cache_queries_total", ()), 0.0) == \
        2 * second.prompt_tokens
