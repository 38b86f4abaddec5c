"""Structured outputs on the embedded SmolLM2 model: offline (sampled JSON that validates against
schemas with enums, nested objects, bounded arrays, integer ranges and nullable fields, also 2
tokens above the shortest; regex and choice; free requests untouched by constrained neighbours) and
served (the ZeroMQ client, and the HTTP API through the official `openai` client: response_format,
the structured_outputs extension, 400 for bad constraints and for a max_tokens below the shortest
output, and hypothesis over the new fields: never a 500, never a crash)."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import httpx
import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orca_mq import SamplingParams
from orca_mq.client import Client
from serving_harness import free_port, openai_client, settled, start_server

pytestmark = pytest.mark.e2e

PET = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "species": {"enum": ["cat", "dog", "parrot"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "owner": {"type": "object", "properties": {"first": {"type": "string", "maxLength": 12},
                                                   "phone": {"type": ["string", "null"], "maxLength": 12}},
                  "required": ["first", "phone"], "additionalProperties": False},
        "toys": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 1, "maxItems": 3},
        "weight": {"anyOf": [{"type": "number", "minimum": 0, "maximum": 100}, {"type": "null"}]},
    },
    "required": ["name", "species", "age", "owner", "toys", "weight"], "additionalProperties": False,
}
POINTS = {"type": "array", "items": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                                                     "y": {"type": "integer", "minimum": -9, "maximum": 9}},
                                     "required": ["x", "y"], "additionalProperties": False},
          "minItems": 2, "maxItems": 4}
DATE = r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"
ASK = [{"role": "user", "content": "Describe a pet as JSON."}]


def test_sampled_json_validates_across_seeds(embedded_llm):
    llm = embedded_llm
    jobs = [(PET, s) for s in range(3)] + [(POINTS, s) for s in range(2)]
    params = [SamplingParams(max_tokens=120, temperature=0.8, seed=s, structured_outputs={"json": schema})  # type: ignore[arg-type]
              for schema, s in jobs]
    outs = llm.chat([ASK] * len(jobs), params)
    for (schema, _), out in zip(jobs, outs):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)
        assert out.metrics["scheduler"]["structured_output"]["complete"] is True
    for max_tokens in (8, 60):   # an unbounded object closes within max_tokens
        obj = llm.chat(ASK, SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=7, structured_outputs={"json_object": True}))[0]  # type: ignore[arg-type]
        assert obj.finish_reason == "stop" and isinstance(json.loads(obj.text), dict), obj.text
        assert obj.metrics["scheduler"]["structured_output"]["complete"] is True and len(obj.token_ids) <= max_tokens
    tight = llm.chat([ASK] * 2, [SamplingParams(max_tokens=34, temperature=0.8, seed=s, structured_outputs={"json": PET})  # type: ignore[arg-type]
                                 for s in range(2)])   # 2 tokens above PET's shortest
    for out in tight:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), PET)


def test_regex_and_choice_match_whole(embedded_llm):
    outs = embedded_llm.generate(["Today's date is", "Is the sky blue? Answer:", "Pick a color:"], [
        SamplingParams(max_tokens=16, temperature=0.9, seed=1, structured_outputs={"regex": DATE}),  # type: ignore[arg-type]
        SamplingParams(max_tokens=4, temperature=0, structured_outputs={"choice": ["yes", "no"]}),  # type: ignore[arg-type]
        SamplingParams(max_tokens=8, temperature=0.9, seed=2, structured_outputs={"choice": ["dark red", "sky blue", "green"]}),  # type: ignore[arg-type]
    ])
    assert re.fullmatch(DATE, outs[0].text) and outs[0].finish_reason == "stop"
    assert outs[1].text in ("yes", "no") and outs[2].text in ("dark red", "sky blue", "green")


def test_free_requests_keep_their_tokens_beside_constrained_ones(embedded_llm):
    """fp32, greedy: free requests batched with constrained ones (max_bs 3: one iteration holds
    all three) give the tokens they give alone."""
    llm = embedded_llm
    free = [("The capital of France is", 12), ("1, 2, 3, 4,", 10)]
    alone = [llm.generate(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0].token_ids for p, n in free]
    mixed = llm.generate([free[0][0], "Describe a pet as JSON:", free[1][0]], [
        SamplingParams(max_tokens=free[0][1], temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0, structured_outputs={"json": POINTS}),  # type: ignore[arg-type]
        SamplingParams(max_tokens=free[1][1], temperature=0, ignore_eos=True),
    ])
    assert [mixed[0].token_ids, mixed[2].token_ids] == alone
    jsonschema.validate(json.loads(mixed[1].text), POINTS)


# ---------------------------------------------------------------- served


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    srv = start_server(tmp_path_factory.mktemp("structured"), **{"server.http_address": f"127.0.0.1:{port}",
                                                                "scheduler.max_bs": 8, "engine.n_slots": 4096,
                                                                "scheduler.policy": "fastserve",
                                                                "fastserve.profile_max_len": 64})
    srv.base_url = f"http://127.0.0.1:{port}"
    yield srv
    assert srv.stop() == 0, srv.stderr()[-3000:]


@pytest.fixture(scope="module")
def oai(server):
    client = openai_client(server.base_url, timeout=180)
    yield client
    client.close()


def test_zmq_client_constraints_and_refusals(server):
    with Client(server.address) as c:
        out = c.generate(messages=ASK, chat=True, max_tokens=120, temperature=0.7, seed=3,
                         structured_outputs={"json": POINTS})
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), POINTS)
        assert out.metrics["scheduler"]["structured_output"] == {"constraint": "json", "complete": True,
                                                                 "tokens": len(out.token_ids)}
        short = c.generate("A date:", max_tokens=2, temperature=0, structured_outputs={"regex": DATE})   # a date takes 10
        assert short.finish_reason == "error" and short.code == "invalid_request", short.error
        assert short.error.startswith("max_tokens (2) cannot hold any output the structured_outputs.regex constraint allows")
        for bad, needle in [({"regex": "[a-"}, "unclosed character class"), ({"json": {"type": "foo"}}, "Invalid type"),
                            ({"json": {"type": "integer", "minimum": 3, "maximum": 1}}, "Unsatisfiable"),
                            ({"choice": []}, "choice must be"), ({"regex": "a", "choice": ["a"]}, "exactly one")]:
            out = c.generate("x", max_tokens=4, structured_outputs=bad)
            assert out.finish_reason == "error" and out.code == "invalid_request" and needle in out.error, out.error
    cli = subprocess.run([sys.executable, "-m", "orca_mq.cli", "client", "--address", server.address, "--prompt", "Is ice cold?",
                          "--chat", "--temperature", "0", "--structured-outputs", '{"choice": ["yes", "no"]}', "--json"],
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0 and json.loads(cli.stdout)["text"] in ("yes", "no"), cli.stderr
    settled(server.address)


def test_http_response_format_and_extension(server, oai):
    model = oai.models.list().data[0].id
    chat = oai.chat.completions.create(model=model, messages=ASK, max_tokens=150, temperature=0.7, seed=1,
                                       response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": PET,
                                                                                               "strict": True}})
    assert chat.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(chat.choices[0].message.content), PET)
    chunks = list(oai.completions.create(model=model, prompt="JSON of a point list:", max_tokens=80, temperature=0.5, seed=2,
                                         stream=True, extra_body={"structured_outputs": {"json": POINTS}}))
    jsonschema.validate(json.loads("".join(c.choices[0].text for c in chunks if c.choices)), POINTS)
    choice = oai.completions.create(model=model, prompt="Is fire hot? Answer:", max_tokens=4, temperature=0,
                                    extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert choice.choices[0].text in ("yes", "no")
    obj = oai.chat.completions.create(model=model, messages=ASK, max_tokens=8, temperature=0,
                                      response_format={"type": "json_object"})
    assert obj.choices[0].message.content.startswith("{")
    with pytest.raises(openai.BadRequestError, match=r"max_tokens \(3\) cannot hold any output"):   # PET takes 32 tokens
        oai.chat.completions.create(model=model, messages=ASK, max_tokens=3, temperature=0,
                                    response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": PET}})
    tight = oai.chat.completions.create(model=model, messages=ASK, max_tokens=36, temperature=0.7, seed=4,
                                        response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": PET}})
    assert tight.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(tight.choices[0].message.content), PET)
    for body in [{"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
                 {"response_format": {"type": "json_schema"}},
                 {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
                 {"structured_outputs": {"regex": "(a"}}, {"structured_outputs": {"nope": 1}}]:
        with pytest.raises(openai.BadRequestError):
            oai.chat.completions.create(model=model, messages=ASK, max_tokens=4, extra_body=body)


JSONISH = st.recursive(st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=6),
                       lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids, max_size=3),
                       max_leaves=8)
SCHEMAISH = st.dictionaries(st.sampled_from(["type", "properties", "items", "enum", "minimum", "maximum", "pattern",
                                             "required", "anyOf", "$ref", "minItems", "maxLength"]),
                            st.sampled_from(["object", "integer", "string", "array", "null"]) | JSONISH, max_size=4)
FIELDS = st.fixed_dictionaries({}, optional={
    "response_format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema", "xml"])},
                                             optional={"json_schema": st.fixed_dictionaries(
                                                 {"name": st.text(max_size=70)},
                                                 optional={"schema": SCHEMAISH | JSONISH, "strict": JSONISH})}) | JSONISH,
    "structured_outputs": st.dictionaries(st.sampled_from(["json", "regex", "choice", "grammar", "json_object", "other"]),
                                          SCHEMAISH | JSONISH | st.text(max_size=12) | st.lists(st.text(max_size=4), max_size=3),
                                          max_size=2) | JSONISH,
})


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fields=FIELDS, chat=st.booleans())
def test_http_fuzz_of_the_new_fields_never_500(server, fields, chat):
    body = {"max_tokens": 1, "temperature": 0, **fields}
    body |= {"messages": ASK} if chat else {"prompt": "Hi"}
    r = httpx.post(f"{server.base_url}/v1/{'chat/completions' if chat else 'completions'}", json=body, timeout=120)
    assert r.status_code in (200, 400), (r.status_code, r.text, body)
    if r.status_code == 400:
        assert r.json()["error"]["type"] == "invalid_request_error", r.text


def test_server_whole_after_fuzz(server):
    with Client(server.address) as c:
        assert c.generate("Hi", max_tokens=2, temperature=0).finish_reason in ("stop", "length")
    settled(server.address)
