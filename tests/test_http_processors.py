"""The logits processors over HTTP, through the official `openai` client against a real served
server (a tiny random model): penalties, logit_bias, min_tokens and min_p give the offline LLM's
tokens (which tests/test_logits_processors.py holds to transformers'), and their bounds are 400s."""
from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orca_mq import LLM, SamplingParams
from orca_mq.client import Client
from serving_harness import free_port, openai_client, settled, start_server

pytestmark = pytest.mark.e2e

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_served_dir):
    port = free_port()
    srv = start_server(tmp_path_factory.mktemp("http_proc"), **{
        "server.http_address": f"127.0.0.1:{port}", "model.path": str(tiny_served_dir), "scheduler.max_bs": 4,
        "engine.n_slots": 2048, "model.max_logit_bias": 8})
    srv.base_url = f"http://127.0.0.1:{port}"
    yield srv
    assert srv.stop() == 0, srv.stderr()[-3000:]


@pytest.fixture(scope="module")
def oai(server):
    client = openai_client(server.base_url)
    yield client
    client.close()


@pytest.fixture(scope="module")
def offline(tiny_served_dir):
    return LLM(model=str(tiny_served_dir), dtype="float32", max_bs=4, n_slots=2048)


def test_penalties_and_bias_equal_the_offline_llm(oai, offline):
    model = oai.models.list().data[0].id
    eos = offline.info.eos_token_ids[0]
    ids = offline.tokenizer.encode(PROMPT)
    cases = [
        ({"presence_penalty": 0.8, "frequency_penalty": 0.5, "logit_bias": {"42": 2.0, "7": -1.5}}, {}),
        ({}, {"repetition_penalty": 2.0, "min_p": 0.1}),
        ({"logit_bias": {str(eos): 100}}, {"min_tokens": 4}),
    ]
    for openai_fields, extra in cases:
        out = oai.completions.create(model=model, prompt=ids, max_tokens=10, temperature=0, extra_body=extra, **openai_fields)
        params = SamplingParams(max_tokens=10, temperature=0, **openai_fields, **extra)
        [ref] = offline.generate([ids], params)
        assert (out.choices[0].text, out.choices[0].finish_reason) == (ref.text, ref.finish_reason), (openai_fields, extra)
        assert out.usage.completion_tokens == len(ref.token_ids)
    assert ref.finish_reason == "stop" and len(ref.token_ids) == 5   # EOS forced, held off for min_tokens=4
    chat = oai.chat.completions.create(model=model, messages=CHAT, max_completion_tokens=6, temperature=0,
                                       presence_penalty=1.0, logit_bias={"42": 100}, extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 6 and chat.choices[0].message.content == offline.tokenizer.decode([42] * 6)


@pytest.mark.parametrize("body, needle", [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": "high"}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ({"logit_bias": {"1": 101}}, "logit_bias"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"10000000": 1}}, "logit_bias"),                    # outside the vocabulary
    ({"logit_bias": {str(i): 1 for i in range(9)}}, "at most 8"),     # above model.max_logit_bias
])
def test_out_of_bounds_values_are_400(server, body, needle):
    r = httpx.post(server.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"], r.text


NUMBER = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-(2**70), 2**70),
                   st.sampled_from([0, 1, -1, 2, -2, 0.5, 100, 101, 1e30, None, True, "1", [], {}]))
FIELDS = st.fixed_dictionaries({}, optional={
    "presence_penalty": NUMBER, "frequency_penalty": NUMBER, "repetition_penalty": NUMBER, "min_p": NUMBER,
    "min_tokens": NUMBER,
    "logit_bias": st.one_of(st.dictionaries(st.one_of(st.integers(-3, 60000).map(str), st.text(max_size=4)), NUMBER, max_size=10),
                            NUMBER),
})


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fields=FIELDS, chat=st.booleans())
def test_http_fuzz_of_the_new_fields_never_500(server, fields, chat):
    body = {"max_tokens": 3, "temperature": 0.7, "seed": 1, **fields}
    body |= {"messages": CHAT} if chat else {"prompt": "Hi"}
    r = httpx.post(f"{server.base_url}/v1/{'chat/completions' if chat else 'completions'}", timeout=120,
                   content=json.dumps(body, allow_nan=True), headers={"content-type": "application/json"})   # NaN, Infinity too
    assert r.status_code in (200, 400), (r.status_code, r.text, body)
    if r.status_code == 400:
        assert r.json()["error"]["type"] == "invalid_request_error", r.text


def test_server_whole_after_fuzz(server):
    with Client(server.address) as c:
        out = c.generate("Hi", max_tokens=3, temperature=0, presence_penalty=1.0, logit_bias={42: 100}, ignore_eos=True)
        assert out.token_ids == [42, 42, 42]   # the ZeroMQ client's int keys travel as strings
    settled(server.address)
