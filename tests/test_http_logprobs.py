"""Log probabilities over HTTP, through the official `openai` client against a real server (a tiny
random Llama with the embedded tokenizer, float32): chat's `logprobs`/`top_logprobs` and
completions' legacy `logprobs: k`, streamed and not, equal log_softmax of transformers' logits; `echo`
with `max_tokens` 0 or 1 and `logprobs: 1` gives the prompt's log probabilities as
lm-evaluation-harness' local-completions loglikelihood reads them; the ZeroMQ client gets the same;
a response that could carry more log probabilities than server.http_max_logprobs is a 400.

Tolerance as tests/test_logprobs.py: the engine's fp32 logits are within LOGIT_TOL of transformers'
(test_engine_exact's bound), a log probability within twice that plus the float32 rounding of the
logsumexp reduction.
"""
from __future__ import annotations

import math

import httpx
import openai
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from orca_mq.client import Client
from serving_harness import free_port, openai_client, start_server

pytestmark = pytest.mark.e2e

LOGIT_TOL = 1e-4
TOL = 2 * LOGIT_TOL + 8 * 2 ** -24 * 32
PROMPT = [504, 3575, 282, 4649, 314, 1000, 77, 9020, 15]
MAX_LOGPROBS = 4096   # per response: below a whole context (256 positions) with 20 alternatives


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_served_dir):
    port = free_port()
    srv = start_server(tmp_path_factory.mktemp("http_logprobs"), **{
        "model.path": str(tiny_served_dir), "server.http_address": f"127.0.0.1:{port}", "model.max_model_len": 256,
        "scheduler.max_num_batched_tokens": 4,   # prompts in chunks of 4: prompt positions span iterations
        "server.http_max_logprobs": MAX_LOGPROBS})
    client = openai_client(f"http://127.0.0.1:{port}")
    ref = AutoModelForCausalLM.from_pretrained(tiny_served_dir, dtype=torch.float32).eval()
    yield srv, client, client.models.list().data[0].id, ref
    client.close()
    assert srv.stop() == 0, srv.stderr()[-3000:]


def _lsm(ref, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(ref(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_completions_logprobs_and_echo_equal_transformers(served):
    srv, oai, model, ref = served
    with Client(srv.address) as zmq:
        direct = zmq.generate(prompt_token_ids=PROMPT, max_tokens=4, temperature=0.0, ignore_eos=True,
                              logprobs=3, prompt_logprobs=3)
    lsm = _lsm(ref, PROMPT + direct.token_ids)
    # the ZeroMQ client: ids, texts and values
    assert direct.logprobs.token_ids == direct.token_ids and len(direct.prompt_logprobs) == len(PROMPT)
    for j, t in enumerate(direct.token_ids):
        assert abs(direct.logprobs.logprobs[j] - lsm[len(PROMPT) - 1 + j, t].item()) <= TOL
        assert direct.logprobs.top_ids[j][0] == t   # greedy: the sampled token is the most likely
    for i in range(1, len(PROMPT)):
        assert abs(direct.prompt_logprobs.logprobs[i] - lsm[i - 1, PROMPT[i]].item()) <= TOL

    out = oai.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3,
                                 extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert lp.tokens == direct.logprobs.tokens and out.choices[0].text == direct.text
    assert lp.text_offset == [sum(map(len, lp.tokens[:j])) for j in range(4)]
    for j, t in enumerate(direct.token_ids):
        assert abs(lp.token_logprobs[j] - lsm[len(PROMPT) - 1 + j, t].item()) <= TOL
        top = lsm[len(PROMPT) - 1 + j].topk(3)
        assert len(lp.top_logprobs[j]) == 3   # greedy: the token itself is the first of its top 3
        assert all(abs(v - w) <= TOL for v, w in zip(lp.top_logprobs[j].values(), top.values.tolist()))

    # streamed: each chunk its tokens', the offsets running on
    chunks = list(oai.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3,
                                         stream=True, extra_body={"ignore_eos": True}))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert sum((s.tokens for s in streamed), []) == lp.tokens
    assert sum((s.text_offset for s in streamed), []) == lp.text_offset
    assert all(abs(a - b) <= 1e-6 for a, b in zip(sum((s.token_logprobs for s in streamed), []), lp.token_logprobs))

    # lm-evaluation-harness' local-completions loglikelihood: echo, logprobs 1, max_tokens 1 (and vLLM's 0)
    for max_tokens in (1, 0):
        for stream in (False, True):
            res = oai.completions.create(model=model, prompt=[PROMPT], max_tokens=max_tokens, temperature=0, logprobs=1,
                                         echo=True, stream=stream)
            if stream:
                parts = [c.choices[0] for c in res if c.choices]
                text = "".join(p.text for p in parts)
                got = [p.logprobs for p in parts if p.logprobs]
                tokens, values = sum((g.tokens for g in got), []), sum((g.token_logprobs for g in got), [])
                tops = sum((g.top_logprobs for g in got), [])
            else:
                choice = res.choices[0]
                text, tokens, values, tops = choice.text, choice.logprobs.tokens, choice.logprobs.token_logprobs, \
                    choice.logprobs.top_logprobs
                assert res.usage.prompt_tokens == len(PROMPT) and res.usage.completion_tokens == max_tokens
            assert len(values) == len(PROMPT) + max_tokens and values[0] is None and tops[0] is None
            assert tokens[:len(PROMPT)] == direct.prompt_logprobs.tokens
            assert text.startswith("".join(direct.prompt_logprobs.tokens))   # a prompt of ids: its tokens' texts
            for i in range(1, len(PROMPT)):
                assert abs(values[i] - lsm[i - 1, PROMPT[i]].item()) <= TOL
                # the harness' is_greedy: the token's logprob against the best of its top_logprobs
                assert (values[i] == max(tops[i].values())) == (lsm[i - 1].argmax().item() == PROMPT[i])
                assert abs(max(tops[i].values()) - lsm[i - 1].max().item()) <= TOL
            if max_tokens:
                assert abs(values[-1] - lsm[len(PROMPT) - 1].max().item()) <= TOL


def test_chat_logprobs_streamed_and_not(served):
    srv, oai, model, ref = served
    messages = [{"role": "user", "content": "Name a color."}]
    out = oai.chat.completions.create(model=model, messages=messages, max_completion_tokens=5, temperature=0,
                                      logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 5
    for c in content:
        assert c.bytes == list(c.token.encode()) and len(c.top_logprobs) == 2
        assert c.top_logprobs[0].token == c.token and abs(c.top_logprobs[0].logprob - c.logprob) <= 1e-6   # greedy
        assert c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob and c.logprob <= 0
    with Client(srv.address) as zmq:   # the same values the ZeroMQ client gets, and transformers'
        ref_out = zmq.generate(messages=messages, max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=2,
                               prompt_logprobs=0)
    ids = ref_out.prompt_logprobs.token_ids + ref_out.token_ids
    lsm = _lsm(ref, ids)
    n = len(ref_out.prompt_logprobs)
    for j, (c, t) in enumerate(zip(content, ref_out.token_ids)):
        assert abs(c.logprob - lsm[n - 1 + j, t].item()) <= TOL
    chunks = list(oai.chat.completions.create(model=model, messages=messages, max_completion_tokens=5, temperature=0,
                                              logprobs=True, top_logprobs=2, stream=True, extra_body={"ignore_eos": True}))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [c.token for c in content]
    assert all(abs(a.logprob - b.logprob) <= 1e-6 for a, b in zip(streamed, content))
    # no logprobs asked: none given
    plain = oai.chat.completions.create(model=model, messages=messages, max_completion_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize("body, param", [
    ({"logprobs": 21}, "logprobs"), ({"logprobs": -1}, "logprobs"), ({"logprobs": 1.0}, "logprobs"),
    ({"max_tokens": 0}, "max_tokens"),
])
def test_completions_logprobs_bounds(served, body, param):
    _, oai, model, _ = served
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=model, prompt="hi", **({"max_tokens": 2} | body))
    assert e.value.status_code == 400
    assert param in str(e.value)


def test_a_responses_log_probabilities_are_bounded(served):
    """Counted before anything runs: positions (max_tokens, else the context; an echoed prompt's too) x
    (1 + alternatives), over every choice; past server.http_max_logprobs a 400 names the field."""
    srv, oai, model, _ = served
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 20}
    with pytest.raises(openai.BadRequestError, match="http_max_logprobs") as e:
        oai.chat.completions.create(**chat)   # up to 256 positions x 21
    assert e.value.body["param"] == "top_logprobs"
    assert len(oai.chat.completions.create(**chat, max_completion_tokens=3).choices[0].logprobs.content) <= 3
    text = {"model": model, "prompt": "Hi there", "logprobs": 5, "max_tokens": 150, "extra_body": {"ignore_eos": True}}
    with pytest.raises(openai.BadRequestError, match="http_max_logprobs") as e:
        oai.completions.create(**text, n=5)   # 5 x 150 x 6
    assert e.value.body["param"] == "logprobs"
    with pytest.raises(openai.BadRequestError, match="http_max_logprobs"):   # an echoed prompt counts
        oai.completions.create(model=model, prompt=[7] * 200, echo=True, logprobs=20, max_tokens=1)
    assert len(oai.completions.create(**(text | {"max_tokens": 2}), n=2).choices) == 2


def test_chat_top_logprobs_needs_logprobs(served):
    _, oai, model, _ = served
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], top_logprobs=2)
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], logprobs=True,
                                    top_logprobs=21)
    assert math.isfinite(oai.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], logprobs=True, max_completion_tokens=1,
    ).choices[0].logprobs.content[0].logprob)


_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-3, 25), st.sampled_from([2**31, 2**64, 1e30, 0.5, -1.0, "1", [], {}]))
_FIELDS = st.fixed_dictionaries({}, optional={"logprobs": _VALUES, "top_logprobs": _VALUES, "echo": _VALUES,
                                              "max_tokens": st.one_of(st.integers(0, 3), _VALUES), "stream": st.booleans(),
                                              "prompt": st.one_of(st.just("Hi there"), st.lists(st.integers(0, 3000), max_size=6),
                                                                  st.just([[5, 6, 7]]))})


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fields=_FIELDS, chat=st.booleans())
def test_http_fuzz_of_the_logprob_fields_never_500(served, fields, chat):
    base = str(served[1].base_url).rstrip("/")
    body = {"temperature": 0, "max_tokens": 2} | fields
    if chat:
        body.pop("prompt", None)
        body["messages"] = [{"role": "user", "content": "Hi"}]
    elif "prompt" not in body:
        body["prompt"] = "Hi"
    r = httpx.post(f"{base}/{'chat/completions' if chat else 'completions'}", json=body, timeout=120)
    assert r.status_code in (200, 400), (r.status_code, r.text, body)
    if r.status_code == 400:
        assert r.json()["error"]["type"] == "invalid_request_error", r.text
    elif not body.get("stream"):
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_server_whole_after_fuzz(served):
    with Client(served[0].address) as c:
        assert c.generate("Hi", max_tokens=2, temperature=0, logprobs=1).finish_reason in ("stop", "length")
