"""`n` > 1 and batches of prompts over HTTP, through the official `openai` client against a real
server (a tiny random Llama with the embedded tokenizer): n choices indexed 0..n-1 (prompt index * n
+ j in a batch), each its own seed stream (seed + j: reproducible, different from each other, equal
to a one-choice request with that seed), streamed with a finish chunk per choice and the usage once,
usage counting each prompt once and every choice's tokens; a prompt's later choices read its KV from
the prefix cache, also when the prompt's log probabilities are asked (computed once, shown by every
choice); the bounds refused with 400; a client that leaves aborts every choice; responses
name the model the request asked for."""
from __future__ import annotations

import asyncio
import random
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from orca_mq.api.server import STATS_MAX_AGE
from serving_harness import free_port, openai_client, settled, start_server

pytestmark = pytest.mark.e2e

MAX_N, MAX_CHOICES = 4, 6   # small bounds: the knobs are read from the config
ALIAS = "tiny-alias"        # the second served name: responses must say it when asked for it
SAMPLED = {"temperature": 1.0, "max_tokens": 6, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_served_dir):
    port = free_port()
    srv = start_server(tmp_path_factory.mktemp("http_n"), **{
        "model.path": str(tiny_served_dir), "server.http_address": f"127.0.0.1:{port}", "model.max_model_len": 256,
        "server.served_model_name": f"tiny,{ALIAS}", "server.http_max_n": MAX_N, "server.http_max_choices": MAX_CHOICES})
    srv.base_url = f"http://127.0.0.1:{port}"
    client = openai_client(srv.base_url)
    yield srv, client
    client.close()
    assert srv.stop() == 0, srv.stderr()[-3000:]


def _metric(srv, name: str, **labels: str) -> float:
    text = httpx.get(srv.base_url + "/metrics", timeout=30).text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_n_choices_have_their_own_seed_streams(served):
    _, oai = served
    out = oai.completions.create(model=ALIAS, prompt="Once upon a time", n=3, seed=7, **SAMPLED)
    assert out.model == ALIAS and [c.index for c in out.choices] == [0, 1, 2]
    texts = [c.text for c in out.choices]
    assert len(set(texts)) == 3 and all(c.finish_reason == "length" for c in out.choices)
    single = oai.completions.create(model="tiny", prompt="Once upon a time", seed=8, **SAMPLED)
    assert single.model == "tiny" and single.choices[0].text == texts[1]   # choice j samples with seed + j
    assert out.usage.prompt_tokens == single.usage.prompt_tokens           # the prompt counted once
    assert out.usage.completion_tokens == 18 and out.usage.total_tokens == 18 + out.usage.prompt_tokens
    again = oai.completions.create(model=ALIAS, prompt="Once upon a time", n=3, seed=7, **SAMPLED)
    assert [c.text for c in again.choices] == texts


def test_greedy_choices_are_equal_with_logprobs_and_stop_each(served):
    _, oai = served
    ref = oai.completions.create(model="tiny", prompt="The sky is", max_tokens=8, temperature=0,
                                 extra_body={"ignore_eos": True}).choices[0].text
    stop = ref[3:5]   # cuts each choice where the single greedy answer has it
    out = oai.completions.create(model="tiny", prompt="The sky is", max_tokens=8, temperature=0, n=2, logprobs=1,
                                 stop=[stop], extra_body={"ignore_eos": True})
    want = ref[:ref.index(stop)]
    assert [(c.index, c.text, c.finish_reason) for c in out.choices] == [(0, want, "stop"), (1, want, "stop")]
    assert out.choices[0].logprobs.tokens == out.choices[1].logprobs.tokens
    assert "".join(out.choices[1].logprobs.tokens).startswith(want)


def test_chat_streamed_choices_and_usage_once(served):
    _, oai = served
    messages = [{"role": "user", "content": "Tell me a story."}]
    whole = oai.chat.completions.create(model=ALIAS, messages=messages, n=3, seed=11, **SAMPLED)
    assert [c.index for c in whole.choices] == [0, 1, 2] and whole.usage.completion_tokens == 18
    chunks = list(oai.chat.completions.create(model=ALIAS, messages=messages, n=3, seed=11, stream=True,
                                              stream_options={"include_usage": True}, **SAMPLED))
    assert all(c.model == ALIAS for c in chunks)
    usage = [c for c in chunks if c.usage is not None]
    assert usage == [chunks[-1]] and not chunks[-1].choices
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")   # (the second call's prompt is cached)
    assert [getattr(usage[0].usage, k) for k in counts] == [getattr(whole.usage, k) for k in counts]
    texts, finishes, roles = {}, {}, {}
    for c in chunks[:-1]:
        (choice,) = c.choices
        i = choice.index
        assert i not in finishes   # nothing after a choice's finish chunk
        roles[i] = roles.get(i, 0) + (choice.delta.role == "assistant")
        texts[i] = texts.get(i, "") + (choice.delta.content or "")
        if choice.finish_reason is not None:
            finishes[i] = choice.finish_reason
    assert roles == {0: 1, 1: 1, 2: 1} and finishes == {0: "length", 1: "length", 2: "length"}
    assert [texts[i] for i in range(3)] == [c.message.content for c in whole.choices]


def test_batch_of_prompts_times_n(served):
    _, oai = served
    prompts = ["Hello there", "A quick brown fox jumps"]
    out = oai.completions.create(model="tiny", prompt=prompts, n=2, seed=3, echo=True, **SAMPLED)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    singles = [oai.completions.create(model="tiny", prompt=p, n=2, seed=3, echo=True, **SAMPLED) for p in prompts]
    assert [c.text for c in out.choices] == [c.text for s in singles for c in s.choices]
    assert all(c.text.startswith(prompts[c.index // 2]) for c in out.choices)
    assert out.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert out.usage.completion_tokens == 4 * 6
    ids = oai.completions.create(model="tiny", prompt=[[504, 3575, 282], [1000, 77]], max_tokens=2, temperature=0,
                                 extra_body={"ignore_eos": True})
    assert [c.index for c in ids.choices] == [0, 1] and ids.usage.prompt_tokens == 5


def test_later_choices_read_the_prompt_from_the_prefix_cache(served):
    """While another request runs, choices submitted together would all be planned into one
    iteration and prefill the whole prompt each; fanned out, they read its full blocks."""
    srv, _ = served
    prompt = [random.Random(5).randrange(1000, 20000) for _ in range(40)]   # 2 full blocks of 16, never seen before
    hits = _metric(srv, "vllm:prefix_cache_hits_total")

    async def beside_a_running_request() -> None:
        busy = {"model": "tiny", "prompt": [7] * 20, "max_tokens": 230, "ignore_eos": True, "stream": True}
        async with httpx.AsyncClient(base_url=srv.base_url, timeout=60) as http:
            async with http.stream("POST", "/v1/completions", json=busy) as r:
                await anext(r.aiter_lines())   # it runs
                out = await http.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "n": 3, "max_tokens": 2,
                                                               "ignore_eos": True})
                assert out.status_code == 200, out.text

    asyncio.run(beside_a_running_request())
    time.sleep(STATS_MAX_AGE)   # /metrics reuses a stats reply this recent
    assert _metric(srv, "vllm:prefix_cache_hits_total") - hits >= 2 * 32   # choices 1 and 2: both full blocks


def test_a_prompts_log_probabilities_are_computed_once_for_all_its_choices(served):
    """echo + logprobs with n = 3: a request asking for its prompt's log probabilities computes every
    position and reads no cache, so only the prompt's first choice asks; the others read its blocks,
    and every choice shows the same prompt log probabilities, streamed and not."""
    srv, oai = served
    prompt = [random.Random(6).randrange(1000, 20000) for _ in range(40)]   # 2 full blocks of 16, never seen before
    hits = _metric(srv, "vllm:prefix_cache_hits_total")
    args = {"model": "tiny", "prompt": prompt, "n": 3, "echo": True, "logprobs": 2, "max_tokens": 1,
            "extra_body": {"ignore_eos": True}}
    out = oai.completions.create(**args)
    heads = [(c.logprobs.tokens[:40], c.logprobs.token_logprobs[:40], c.logprobs.top_logprobs[:40]) for c in out.choices]
    assert heads[0][1][0] is None and len(heads[0][0]) == 40 and heads == [heads[0]] * 3
    assert all(c.text.startswith("".join(heads[0][0])) for c in out.choices)
    time.sleep(STATS_MAX_AGE)   # /metrics reuses a stats reply this recent
    assert _metric(srv, "vllm:prefix_cache_hits_total") - hits >= 2 * 32   # choices 1 and 2: both full blocks
    firsts: dict[int, object] = {}
    for chunk in oai.completions.create(**args, stream=True):
        for c in chunk.choices:
            firsts.setdefault(c.index, c)
    assert sorted(firsts) == [0, 1, 2]
    assert all((c.logprobs.tokens[:40], c.logprobs.token_logprobs[:40]) == heads[0][:2] for c in firsts.values())


@pytest.mark.parametrize("body, param", [
    ({"prompt": "hi", "n": MAX_N + 1}, "n"),
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": ["a", "b", "c", "d"], "n": 2}, "prompt"),   # 8 choices > MAX_CHOICES
    ({"prompt": ["a"] * (MAX_CHOICES + 1)}, "prompt"),
])
def test_bounds_are_refused(served, body, param):
    srv, oai = served
    r = httpx.post(srv.base_url + "/v1/completions", json={"max_tokens": 2, **body}, timeout=30)
    assert r.status_code == 400, r.text
    assert (r.json()["error"]["code"], r.json()["error"]["param"]) == ("invalid_value", param)
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=MAX_N + 1)
    r = httpx.post(srv.base_url + "/v1/completions", json={"prompt": "hi", "best_of": 2}, timeout=30)
    assert r.json()["error"]["code"] == "unsupported_parameter"


def test_client_disconnect_aborts_every_choice(served):
    srv, _ = served
    aborts = _metric(srv, "orca_mq:requests_total", outcome="abort")
    body = {"model": "tiny", "prompt": "Far away", "n": 3, "max_tokens": 240, "temperature": 0, "ignore_eos": True,
            "stream": True}

    async def leave_once_all_run() -> None:
        seen: set[int] = set()
        async with httpx.AsyncClient(base_url=srv.base_url, timeout=60) as http:
            async with http.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        seen.update(c["index"] for c in httpx.Response(200, content=line[6:]).json()["choices"])
                    if len(seen) == 3:
                        break   # every choice has a token: leave

    asyncio.run(leave_once_all_run())
    settled(srv.address)
    assert _metric(srv, "orca_mq:requests_total", outcome="abort") - aborts == 3
