"""The HTTP API's routes that need no engine behind it, on the API app in-process (no server, no broker):
/v1/models/{id} (the openai client's models.retrieve) and the served names, /tokenize and /detokenize
(vLLM's shapes, through the frontend's own prompt path), /version."""
from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from orca_mq import __version__
from orca_mq.admission.prompts import Prompts
from orca_mq.api.server import Api
from orca_mq.config import load_config
from orca_mq.protocol.client_msgs import Generate
from orca_mq.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    cfg = load_config(overrides={"log.dir": str(tmp_path_factory.mktemp("http_routes")),
                                 "server.served_model_name": "smol,org/smol-instruct"})
    api = Api(cfg)
    yield api
    api.tokenization.close()


@pytest.fixture(scope="module")
def prompts(api):
    return Prompts.for_model(load_tokenizer(api.cfg.model.path, api.cfg.model.cache_dir), api.max_model_len)


def _call(api: Api, method: str, path: str, body: Any = None) -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=api.app), base_url="http://api") as c:
            return await c.request(method, path, json=body)
    return asyncio.run(go())


def test_served_names_and_models_retrieve(api):
    listed = _call(api, "GET", "/v1/models").json()["data"]
    assert [m["id"] for m in listed] == ["smol", "org/smol-instruct"] and listed[0]["max_model_len"] == 2048
    for name in ("smol", "org/smol-instruct"):
        card = _call(api, "GET", f"/v1/models/{name}")
        assert card.status_code == 200 and card.json() == next(m for m in listed if m["id"] == name)
    missing = _call(api, "GET", "/v1/models/gpt-4")
    assert missing.status_code == 404 and missing.json()["error"] == {
        "message": "The model `gpt-4` does not exist.", "type": "invalid_request_error", "param": "model",
        "code": "model_not_found"}
    refused = _call(api, "POST", "/v1/completions", {"model": "SmolLM2-135M-Instruct.Q4_1", "prompt": "hi"})
    assert refused.status_code == 404, "a served name replaces the derived one"


def test_version(api):
    assert _call(api, "GET", "/version").json() == {"version": __version__}


def test_tokenize_is_the_frontends_prompt_path(api, prompts):
    chat = [{"role": "user", "content": "Say hi."}]
    for body, msg in (({"prompt": "The capital of France is"}, Generate("t", prompt="The capital of France is")),
                      ({"messages": chat, "model": "smol"}, Generate("t", messages=chat))):
        r = _call(api, "POST", "/tokenize", body)
        assert r.status_code == 200, r.text
        want = prompts.token_ids(msg)
        assert r.json() == {"count": len(want), "max_model_len": 2048, "tokens": want}
    text = _call(api, "POST", "/tokenize", {"prompt": "Hello there", "add_special_tokens": False}).json()["tokens"]
    assert text == prompts.tokenizer.encode("Hello there", add_special_tokens=False)
    parts = _call(api, "POST", "/tokenize", {"messages": [{"role": "user", "content": [{"type": "text", "text": "Say hi."}]}],
                                             "add_generation_prompt": True})
    assert parts.json()["tokens"] == prompts.encode_chat(chat)   # content parts and vLLM's no-op default accepted
    back = _call(api, "POST", "/detokenize", {"tokens": prompts.encode_chat(chat), "model": "org/smol-instruct"})
    assert back.json() == {"prompt": prompts.tokenizer.render_chat(chat, None, True)}


@pytest.mark.parametrize("path, body, status, needle", [
    ("/tokenize", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "role 'wizard' is not one of"),
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "hi"}]}, 400, "prompt or messages"),
    ("/tokenize", {}, 400, "prompt or messages"),
    ("/tokenize", {"prompt": "x" * 1_000_000}, 400, "cannot fit the context length"),   # before tokenizing
    ("/tokenize", {"prompt": "x", "model": "gpt-4"}, 404, "gpt-4"),
    ("/tokenize", {"prompt": "x", "return_token_strs": True}, 400, "return_token_strs"),
    ("/detokenize", {"tokens": [10**6]}, 400, "outside the vocabulary"),
    ("/detokenize", {"tokens": [1] * 4096}, 400, "context length is 2048"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens.0"),
])
def test_tokenize_mistakes_are_openai_error_objects(api, path, body, status, needle):
    r = _call(api, "POST", path, body)
    assert r.status_code == status and needle in r.json()["error"]["message"], r.text


def test_every_post_route_documents_the_body_it_reads(api):
    """The bodies are read by api/body.py, not by FastAPI, which documents only what it reads: each route
    says its schema itself, definitions inlined (the schema fuzzers generate their cases from it: without
    it they sent no body at all)."""
    paths = _call(api, "GET", "/openapi.json").json()["paths"]
    fields = {"/v1/completions": "prompt", "/v1/chat/completions": "messages", "/v1/responses": "input",
              "/v1/messages": "messages", "/v1/embeddings": "input", "/tokenize": "messages", "/detokenize": "tokens"}
    for path, field in fields.items():
        body = paths[path]["post"]["requestBody"]
        schema = body["content"]["application/json"]["schema"]
        assert body["required"] and field in schema["properties"] and "#/$defs/" not in json.dumps(schema), path


@pytest.mark.parametrize("encoding", ["utf-8-sig", "utf-16", "utf-32"])
def test_a_body_is_read_in_the_encodings_json_reads_and_a_non_object_is_named(api, encoding):
    """As json.loads reads bytes (Starlette's request.json() before api/body.py): a UTF-8 BOM, UTF-16 and
    UTF-32 bodies are read; a body of JSON that is no object is said to be one that must be."""
    body = {"messages": [{"role": "user", "content": "Say hi."}]}
    want = _call(api, "POST", "/tokenize", body).json()["tokens"]
    got = _raw(api, "/tokenize", json.dumps(body).encode(encoding))
    assert got.status_code == 200 and got.json()["tokens"] == want
    for raw in (b"null", b"[]", b"5"):
        err = _raw(api, "/tokenize", raw).json()["error"]
        assert err["code"] == "invalid_type" and "must be a JSON object" in err["message"], raw


def _raw(api: Api, path: str, content: bytes) -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=api.app), base_url="http://api") as c:
            return await c.post(path, content=content, headers={"content-type": "application/json"})
    return asyncio.run(go())
