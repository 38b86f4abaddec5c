"""Fuzzing the HTTP API of a live server, shared by tests/test_serving_guard.py (bounded) and
tools/bench_reliability.py (at length):

- `schema_fuzz`: schemathesis, from the server's own OpenAPI schema, positive and negative cases of
  every operation (/v1/responses and /v1/messages among them);
- `body_fuzz`: hypothesis requests to the generation and embeddings routes (orca_mq.bench.http_bodies):
  wild ones the schema knows nothing of (issue 44's costly shapes among them: a tool reply of a tag and
  whitespace, arguments nested deep, a closing plan of many-byte letters, log probabilities and n at
  and past their bounds), and ones built to be served or to be refused for one named field.

Every reply is judged by the contract: never a 5xx, a JSON error object with a message, type and
code on every 4xx (Anthropic's, with a type and message, on /v1/messages; with a param when the
schema refused a field); a request built to be served gets 200 and its whole answer, one built to be
refused a 400 naming its field. A violation is counted with a sample, never raised, so a caller sees them all.
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
from hypothesis import HealthCheck, Phase, given, seed as hypothesis_seed, settings
from hypothesis.errors import Unsatisfiable

from orca_mq.bench.http_bodies import ANY, MAX_TOKENS, Expect, Request, refused, served, wild

SERVED = {200}
REFUSED = {400, 404, 405, 413, 422, 429}
SAMPLES = 10
BUILT_SHARE = 8   # a served request costs a generation: a few of them beside the wild ones


@dataclass(slots=True)
class FuzzReport:
    requests: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    built: Counter[str] = field(default_factory=Counter)   # requests built to be "served" / "refused"
    violations: list[str] = field(default_factory=list)   # up to SAMPLES, each "why: request"
    n_violations: int = 0

    def judge(self, what: str, status: int, body: bytes, content_type: str, expect: Expect = ANY) -> None:
        self.requests += 1
        self.statuses[status] += 1
        if expect != ANY:
            self.built["served" if expect.served else "refused"] += 1
        why = _violation(status, body, content_type, expect)
        if why is not None:
            self.n_violations += 1
            if len(self.violations) < SAMPLES:
                self.violations.append(f"{why}: {what[:300]}")

    def to_dict(self) -> dict[str, Any]:
        return {"requests": self.requests, "statuses": dict(sorted(self.statuses.items())), "built": dict(self.built),
                "violations": self.n_violations, "samples": self.violations}


def _violation(status: int, body: bytes, content_type: str, expect: Expect) -> str | None:
    if expect.served:
        return None if status in SERVED and _whole(body, content_type) else f"status {status} for a request built to be served"
    if status in SERVED:
        return None if expect.param is None else f"served a request built to be refused for {expect.param!r}"
    if status not in REFUSED:
        return f"status {status}"
    if "json" not in content_type:
        return f"{status} without a JSON body"
    try:
        reply = json.loads(body)
        err = reply["error"]
        ok = isinstance(err["message"], str) and isinstance(err["type"], str) and (
            isinstance(err.get("code"), str) or reply.get("type") == "error")   # OpenAI's object, or Anthropic's
    except (ValueError, KeyError, TypeError, AttributeError):
        return f"{status} without an error object"
    if ok and expect.param is not None and not (status == 400 and _names(err.get("param"), expect.param)):
        return f"{status} with param {err.get('param')!r}, not {expect.param!r}"
    return None if ok else f"{status} without an error object"


def _names(param: Any, field_name: str) -> bool:
    return isinstance(param, str) and (param == field_name or param.startswith(field_name + "."))


def _whole(body: bytes, content_type: str) -> bool:
    """A served answer is whole: a completion with choices, embeddings with data, or a stream to its [DONE]
    without an error event."""
    if "event-stream" in content_type:
        text = body.decode()
        return text.endswith("data: [DONE]\n\n") and '\ndata: {"error"' not in "\n" + text
    try:
        answer = json.loads(body)
        return bool(answer["choices"] if "choices" in answer else answer["data"])
    except (ValueError, KeyError, TypeError):
        return False


# each generating route's own length fields (an embedding generates nothing; the Responses API's `input`
# is its prompt, so a body's keys cannot tell the two apart)
LENGTH_FIELDS = {"/v1/responses": ("max_output_tokens",), "/v1/embeddings": ()}
MAX_TOKENS_FIELDS = ("max_tokens", "max_completion_tokens")


def _capped(path: str, body: Any, cap: int) -> Any:
    """A body that would be served generates at most `cap` tokens: a fuzz case costs milliseconds, not a whole context."""
    if isinstance(body, dict):
        for key in LENGTH_FIELDS.get(path, MAX_TOKENS_FIELDS):
            if type(body.get(key)) is int and body[key] > cap or key not in body:
                body[key] = cap
    return body


def schema_fuzz(base_url: str, api_key: str | None, examples: int, seed: int = 0, max_tokens: int = 4) -> FuzzReport:
    """schemathesis on the server's /openapi.json: `examples` positive and `examples` negative cases per operation
    (positive ones generate at most `max_tokens` tokens)."""
    import schemathesis

    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    raw = httpx.get(f"{base_url}/openapi.json", headers=headers, timeout=30).json()
    schema = schemathesis.openapi.from_dict(raw)
    report = FuzzReport()
    for result in schema.get_all_operations():
        op = result.ok()
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            @hypothesis_seed(seed)
            @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck),
                      phases=[Phase.generate])
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case: Any) -> None:
                if mode == schemathesis.GenerationMode.POSITIVE:
                    case.body = _capped(case.path, case.body, max_tokens)
                resp = case.call(base_url=base_url, headers=headers, timeout=120)
                content_type = resp.headers.get("content-type", "")   # schemathesis: a list of values
                report.judge(f"{case.method} {case.path} {case.body!r:.200}", resp.status_code, resp.content,
                             " ".join(content_type) if isinstance(content_type, list) else content_type)

            try:
                run()
            except Unsatisfiable:
                pass  # no negative case of an operation without inputs (GET /health)
    return report


def body_fuzz(base_url: str, api_key: str | None, examples: int, seed: int = 0) -> FuzzReport:
    """`examples` wild requests to the generation and embeddings routes, and `examples // BUILT_SHARE` (at least one) each
    built to be served and built to be refused: each family is its own hypothesis run, so every one is sent."""
    report = FuzzReport()
    auth = {"authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=base_url, headers=auth, timeout=120) as http:
        rooms = _rooms(http)
        built = max(1, examples // BUILT_SHARE)
        for strategy, n in ((wild(), examples), (served(*rooms), built), (refused(*rooms), built)):
            @hypothesis_seed(seed)
            @settings(max_examples=n, deadline=None, database=None, suppress_health_check=list(HealthCheck),
                      phases=[Phase.generate])
            @given(req=strategy)
            def run(req: Request) -> None:
                path, payload, content_type, expect = req
                resp = http.post(path, content=payload, headers={"content-type": content_type} if content_type else {})
                report.judge(f"POST {path} {content_type} {payload[:200]!r}", resp.status_code, resp.content,
                             resp.headers.get("content-type", ""), expect)

            run()
    return report


def _rooms(http: httpx.Client) -> tuple[int, int]:
    """The tokens a completion's and a chat's prompt text may take on this server: its context less
    MAX_TOKENS, a token of margin, and what /tokenize counts for a one-character prompt and an empty chat."""
    def count(body: dict[str, Any]) -> tuple[int, int]:
        r = http.post("/tokenize", json=body)
        r.raise_for_status()
        return r.json()["count"], r.json()["max_model_len"]

    plain, max_len = count({"prompt": "a"})
    chat, _ = count({"messages": [{"role": "user", "content": ""}]})
    return max_len - plain - MAX_TOKENS, max_len - chat - MAX_TOKENS - 1
