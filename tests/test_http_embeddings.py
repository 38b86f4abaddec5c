"""POST /v1/embeddings on a real server (issue 41, item 5), through the official `openai` client: embeddings
equal transformers' hidden states pooled the same way (base64, as the SDK asks by default, and float; last
and mean; prompts longer than the token budget); embedding requests beside generating ones leave the
generations' tokens as they are alone and free every KV slot; the ZeroMQ client's embed gives the same
vector, an older client's frame cannot ask for one; API keys, the bounds and errors (400 naming the field);
and hypothesis over the endpoint's fields: 200 or 400, never a 500. One family is served (qwen3: a server
costs seconds to start); both families are compared with transformers offline (tests/test_embeddings.py),
by the same engine path."""
from __future__ import annotations

import asyncio
import base64
import random

import httpx
import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orca_mq.client import AsyncClient, Client
from orca_mq.protocol import decode, encode, unpack
from orca_mq.protocol.client_msgs import TO_CLIENT, Generate
from serving_harness import free_port, openai_client, settled, start_server
from test_embeddings import _check, _expected, _prompts

pytestmark = pytest.mark.e2e

KEY = "sk-embed"
MAX_INPUTS = 4
HIDDEN = 64   # family_config's hidden size


FAMILY = "qwen3"


@pytest.fixture(scope="module")
def server(tmp_path_factory, embedding_checkpoints):
    """Its HTTP API behind a key, a token budget of 16 (the 40-token prompts go in chunks)."""
    port = free_port()
    srv = start_server(tmp_path_factory.mktemp("http_embed"), **{
        "model.path": str(embedding_checkpoints[FAMILY]), "server.http_address": f"127.0.0.1:{port}",
        "server.api_key": KEY, "server.http_max_embedding_inputs": MAX_INPUTS, "scheduler.max_bs": 4,
        "scheduler.max_num_batched_tokens": 16, "engine.n_slots": 1024, "engine.block_size": 8, "model.max_model_len": 256})
    srv.base_url = f"http://127.0.0.1:{port}"
    yield srv
    assert srv.stop() == 0, srv.stderr()[-3000:]


@pytest.fixture(scope="module")
def oai(server):
    client = openai_client(server.base_url, KEY)
    yield client
    client.close()


def test_openai_embeddings_equal_transformers(server, oai, embedding_references):
    """A batch of token-id inputs (the longest chunked), in base64 (the SDK's default) and in float, last and
    mean pooling: transformers' last_hidden_state pooled the same way; usage counts every input's tokens."""
    prompts = _prompts(11, (40, 9, 1))
    ref = embedding_references[FAMILY]
    for pooling, encoding in (("last", {}), ("mean", {"encoding_format": "float"})):   # {}: the SDK asks base64, decodes it
        r = oai.embeddings.create(model=FAMILY, input=prompts, extra_body={"pooling": pooling}, **encoding)
        assert r.model == FAMILY and [d.index for d in r.data] == [0, 1, 2]
        assert r.usage.prompt_tokens == r.usage.total_tokens == sum(map(len, prompts))
        for prompt, d in zip(prompts, r.data):
            _check(d.embedding, _expected(ref, prompt, pooling), True)
    raw = httpx.post(f"{server.base_url}/v1/embeddings", json={"input": prompts[1], "encoding_format": "base64"},
                     headers={"Authorization": f"Bearer {KEY}"}).json()
    vector = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), "<f4")   # OpenAI's: little-endian float32
    _check(vector.tolist(), _expected(ref, prompts[1], "last"), True)
    assert settled(server.address, api_key=KEY)["scheduler"]["used_slots"] == 0


def test_embeddings_beside_generation_and_the_zmq_client(server, oai):
    """Three embeddings and two greedy generations at once share iterations; the generations' tokens are
    those they get alone, the ZeroMQ client's vectors the HTTP API's (unnormalised: normalize false); every
    slot is free after."""
    texts, embeds = ["The sky is", "Once upon a time"], _prompts(12, (33, 5, 20))

    async def run() -> tuple[list[list[int]], list[bytes], list[list[int]]]:
        async with AsyncClient(server.address, api_key=KEY) as c:
            alone = [(await c.generate(t, max_tokens=6, temperature=0, ignore_eos=True)).token_ids for t in texts]
            gens = [c.generate(t, max_tokens=6, temperature=0, ignore_eos=True) for t in texts]
            vecs = [c.embed(prompt_token_ids=p, pooling="mean", normalize=False) for p in embeds]
            outs = await asyncio.gather(*gens, *vecs)
            return alone, [o.data for o in outs[2:]], [o.token_ids for o in outs[:2]]

    alone, vectors, together = asyncio.run(run())
    assert together == alone
    r = oai.embeddings.create(model=FAMILY, input=embeds, encoding_format="float",
                              extra_body={"pooling": "mean", "normalize": False})
    for d, data in zip(r.data, vectors):
        assert np.allclose(d.embedding, np.frombuffer(data, "<f4"), rtol=0, atol=1e-6)   # one fp32 computation, batched apart
    assert settled(server.address, api_key=KEY)["scheduler"]["used_slots"] == 0


def test_an_older_client_cannot_ask_for_an_embedding(server):
    """A v7 frame with `pooling`: refused with a protocol error naming version 8, in v7."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.connect(server.address)
        body = unpack(encode(Generate("old", prompt="x", api_key=KEY, pooling={})))
        sock.send(msgpack.packb({**body, "v": 7}))
        assert sock.poll(30_000)
        reply = decode(sock.recv(), TO_CLIENT)
        assert reply.code == "protocol" and reply.request_id == "old" and "protocol version 8" in reply.error
    finally:
        sock.close(linger=0)
        ctx.term()


ERRORS = [
    ({"input": "x", "dimensions": 8}, 400, "dimensions"),
    ({"input": ["a"] * (MAX_INPUTS + 1)}, 400, "input"),
    ({"input": [[5] * 300]}, 400, "input"),           # past the context of 256
    ({"input": []}, 400, "input"),
    ({"input": [[5, 6], []]}, 400, "input"),
    ({"input": "x", "pooling": "max"}, 400, "pooling"),
    ({"input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"input": "x", "normalize": "yes"}, 400, "normalize"),
    ({"input": "x", "temperature": 0}, 400, "temperature"),
    ({"input": "x", "model": "nope"}, 404, "model"),
]


@pytest.mark.parametrize("body, status, param", ERRORS)
def test_errors_name_the_field(server, body, status, param):
    r = httpx.post(f"{server.base_url}/v1/embeddings", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == status and r.json()["error"]["param"] == param, r.text


def test_api_keys_are_honoured(server):
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}):
        r = httpx.post(f"{server.base_url}/v1/embeddings", json={"input": "x"}, headers=headers, timeout=60)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with Client(server.address) as c:   # the ZeroMQ side: no key, nothing served
        assert c.embed("x").code == "unauthorized"


_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-2, 70), st.sampled_from([2**31, 2**64, 1e30, 0.5, "", "x", [], {}]))
_INPUT = st.one_of(st.text(max_size=12), st.lists(st.text(max_size=6), max_size=MAX_INPUTS + 1),
                   st.lists(st.integers(-1, 300), max_size=8), st.lists(st.lists(st.integers(0, 260), max_size=5), max_size=3),
                   _VALUES)
_FIELDS = st.fixed_dictionaries({"input": _INPUT}, optional={
    "encoding_format": st.one_of(st.sampled_from(["float", "base64"]), _VALUES),
    "dimensions": st.one_of(st.just(HIDDEN), _VALUES), "pooling": st.one_of(st.sampled_from(["last", "mean"]), _VALUES),
    "normalize": _VALUES, "user": _VALUES, "model": st.one_of(st.sampled_from([FAMILY, None]), st.integers())})


@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=_FIELDS)
def test_hypothesis_fields_never_500(server, body):
    r = httpx.post(f"{server.base_url}/v1/embeddings", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code in (200, 400), (r.status_code, r.text, body)
    if r.status_code == 200:
        data = r.json()["data"]
        assert all(len(d["embedding"]) == HIDDEN or isinstance(d["embedding"], str) for d in data)
    else:
        assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["param"], r.text


def test_the_server_is_whole_after(server):
    assert settled(server.address, api_key=KEY)["scheduler"]["used_slots"] == 0
    with Client(server.address, api_key=KEY) as c:
        assert c.embed("hello", pooling="last").finish_reason == "stop"
        assert c.generate("hi", max_tokens=2, temperature=0).finish_reason in ("stop", "length")
