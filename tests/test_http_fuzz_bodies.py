"""The HTTP fuzz's own guarantees, without a server (tests/test_serving_guard.py sends them to one):
the bodies built to be served pass the API's schema and the ones built to be refused fail it naming
their field, whatever hypothesis draws; and the judge counts every reply that breaks the contract."""
from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from pydantic import ValidationError

from orca_mq.api.errors import from_validation
from orca_mq.api.embeddings import EmbeddingRequest
from orca_mq.api.schemas import ChatCompletionRequest, CompletionRequest
from orca_mq.bench.http_bodies import ANY, SERVED, Expect, refused, served
from orca_mq.bench.http_fuzz import FuzzReport, _capped

FAST = settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))


def _validate(path: str, payload: bytes) -> None:
    schema = (ChatCompletionRequest if path.endswith("chat/completions") else EmbeddingRequest if path.endswith("embeddings")
              else CompletionRequest)
    schema.model_validate(json.loads(payload))


@FAST
@given(req=served(completion_room=40, chat_room=20))
def test_bodies_built_to_be_served_pass_the_schema(req):
    path, payload, content_type, expect = req
    assert expect == SERVED and content_type == "application/json"
    _validate(path, payload)


@FAST
@given(req=refused(completion_room=40, chat_room=20))
def test_bodies_built_to_be_refused_fail_naming_their_field(req):
    path, payload, _, expect = req
    with pytest.raises(ValidationError) as e:
        _validate(path, payload)
    err = from_validation([dict(x, loc=("body", *x["loc"])) for x in e.value.errors()])   # as FastAPI reports it
    assert err.status == 400 and (err.param == expect.param or err.param.startswith(f"{expect.param}.")), (err.param, payload)


ERROR = json.dumps({"error": {"message": "m", "type": "invalid_request_error", "param": "stop.0", "code": "c"}}).encode()
STREAM = b'data: {"choices": [{"text": "a"}]}\n\ndata: [DONE]\n\n'


@pytest.mark.parametrize("status, body, content_type, expect, violation", [
    (200, b'{"choices": [{"text": "a"}]}', "application/json", SERVED, None),
    (200, b'{"data": [{"embedding": [0.5]}]}', "application/json", SERVED, None),
    (200, b'{"data": []}', "application/json", SERVED, "built to be served"),
    (200, STREAM, "text/event-stream", SERVED, None),
    (200, b'data: {"error": {"message": "m"}}\n\ndata: [DONE]\n\n', "text/event-stream", SERVED, "built to be served"),
    (200, b'{"choices": []}', "application/json", SERVED, "built to be served"),
    (400, ERROR, "application/json", SERVED, "built to be served"),
    (400, ERROR, "application/json", Expect(param="stop"), None),
    (400, ERROR, "application/json", Expect(param="stop_token_ids"), "param 'stop.0'"),
    (200, STREAM, "text/event-stream", Expect(param="stop"), "built to be refused"),
    (400, ERROR, "application/json", ANY, None),
    (400, b"{}", "application/json", ANY, "error object"),
    (400, b"oops", "text/plain", ANY, "without a JSON body"),
    (500, ERROR, "application/json", ANY, "status 500"),
])
def test_the_judge_counts_each_broken_promise(status, body, content_type, expect, violation):
    report = FuzzReport()
    report.judge("POST /v1/completions", status, body, content_type, expect)
    assert report.n_violations == (violation is not None) and report.statuses[status] == 1
    assert violation is None or violation in report.violations[0], report.violations


def test_the_schema_fuzz_caps_each_routes_own_length_field():
    """A served schemathesis case generates a few tokens on every route: the Responses API's prompt is
    `input`, as an embedding's is, but its length is max_output_tokens (uncapped, a case generated to the
    context's end: minutes on a CPU, the fuzz's 120 s read timeout)."""
    assert _capped("/v1/responses", {"input": ""}, 4) == {"input": "", "max_output_tokens": 4}
    assert _capped("/v1/responses", {"input": "x", "max_output_tokens": 99}, 4)["max_output_tokens"] == 4
    assert _capped("/v1/embeddings", {"input": "x"}, 4) == {"input": "x"}
    assert _capped("/v1/chat/completions", {"max_tokens": 2}, 4) == {"max_tokens": 2, "max_completion_tokens": 4}
    assert _capped("/v1/messages", {"max_tokens": 10**9}, 4)["max_tokens"] == 4
