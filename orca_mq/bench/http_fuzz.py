"""Fuzzing the HTTP API of a live server, shared by tests/test_serving_guard.py (bounded) and
tools/bench_reliability.py (at length):

- `schema_fuzz`: schemathesis, from the server's own OpenAPI schema, positive and negative cases of
  every operation (/v1/responses and /v1/messages among them);
- `body_fuzz`: hypothesis bodies the schema knows nothing of: the request fields (known,
  unsupported and misspelt) with JSON values of every kind and magnitude (1e308, 2**200, NaN),
  bodies that are not objects, not JSON, not UTF-8, with odd content types.

Every reply is judged by the contract: never a 5xx, a JSON error object with a message, type and
code on every 4xx (Anthropic's, with a type and message, on /v1/messages; with a param when the
schema refused a field), and the server still healthy afterwards. A violation is counted with a
sample, never raised, so a caller sees them all.
"""
from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
from hypothesis import HealthCheck, Phase, given, seed as hypothesis_seed, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable

PATHS = ("/v1/completions", "/v1/chat/completions")
SERVED = {200}
REFUSED = {400, 404, 405, 413, 422, 429}
SAMPLES = 10


@dataclass(slots=True)
class FuzzReport:
    requests: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)   # up to SAMPLES, each "why: request"
    n_violations: int = 0

    def judge(self, what: str, status: int, body: bytes, content_type: str) -> None:
        self.requests += 1
        self.statuses[status] += 1
        why = _violation(status, body, content_type)
        if why is not None:
            self.n_violations += 1
            if len(self.violations) < SAMPLES:
                self.violations.append(f"{why}: {what[:300]}")

    def to_dict(self) -> dict[str, Any]:
        return {"requests": self.requests, "statuses": dict(sorted(self.statuses.items())),
                "violations": self.n_violations, "samples": self.violations}


def _violation(status: int, body: bytes, content_type: str) -> str | None:
    if status in SERVED:
        return None
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
        ok = False
    return None if ok else f"{status} without an error object"


def _capped(body: Any, cap: int) -> Any:
    """A body that would be served generates at most `cap` tokens: a fuzz case costs milliseconds, not a whole context."""
    if isinstance(body, dict):
        for key in ("max_tokens", "max_completion_tokens"):
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
                    case.body = _capped(case.body, max_tokens)
                resp = case.call(base_url=base_url, headers=headers, timeout=120)
                content_type = resp.headers.get("content-type", "")   # schemathesis: a list of values
                report.judge(f"{case.method} {case.path} {case.body!r:.200}", resp.status_code, resp.content,
                             " ".join(content_type) if isinstance(content_type, list) else content_type)

            try:
                run()
            except Unsatisfiable:
                pass  # no negative case of an operation without inputs (GET /health)
    return report


_NAMES = ["prompt", "messages", "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
          "stop", "stream", "stream_options", "n", "logprobs", "top_logprobs", "echo", "user", "ignore_eos", "stop_token_ids",
          "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "min_p", "logit_bias", "tools",
          "response_format", "skip_special_tokens", "chat_template_kwargs", "temprature", "", "\x00", "é"]
_EDGE = st.sampled_from([0, 1, -1, 2**31, 2**63, 2**64, 10**30, 2**200, -(2**200), 1e30, 1e308, -1e308, 0.5, 1e-320,
                         math.inf, -math.inf, math.nan, True, False, None, "", "x" * 300, [], {}])
_JSON = st.recursive(st.one_of(_EDGE, st.integers(), st.floats(), st.text(max_size=20), st.booleans(), st.none()),
                     lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                     max_leaves=10)
_MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]),
                                  "content": st.one_of(st.text(max_size=20), _JSON)},
                                 optional={"name": _JSON, "extra": _JSON})
_BODY = st.one_of(
    st.dictionaries(st.sampled_from(_NAMES), st.one_of(_JSON, st.lists(_MESSAGE, max_size=3)), max_size=6),
    st.fixed_dictionaries({"prompt": st.one_of(st.text(max_size=30), st.lists(st.integers(-5, 2**40), max_size=5))},
                          optional={k: _JSON for k in ("max_tokens", "temperature", "top_p", "seed", "stop", "top_k", "n")}),
    st.fixed_dictionaries({"messages": st.lists(_MESSAGE, max_size=3)},
                          optional={k: _JSON for k in ("max_completion_tokens", "stream", "stream_options", "tools")}),
    _JSON,
)


def _encode(body: Any) -> bytes:
    return json.dumps(body, allow_nan=True).encode()   # NaN / Infinity tokens: Python's json reads them


@st.composite
def _request(draw: st.DrawFn) -> tuple[str, bytes, str]:
    path = draw(st.sampled_from(PATHS))
    kind = draw(st.integers(0, 9))
    body = draw(_BODY)
    if isinstance(body, dict) and "max_tokens" not in body:
        body["max_tokens"] = 4  # what is served costs milliseconds (the schema and the tests cover an absent one)
    if kind == 0:
        payload = draw(st.binary(max_size=64))                            # not JSON, maybe not UTF-8
    elif kind == 1:
        payload = _encode(body)[: draw(st.integers(0, 40))]               # truncated JSON
    else:
        payload = _encode(body)
    content_type = draw(st.sampled_from(["application/json"] * 6 + ["text/plain", "", "application/json; charset=latin-1"]))
    return path, payload, content_type


def body_fuzz(base_url: str, api_key: str | None, examples: int, seed: int = 0) -> FuzzReport:
    """`examples` hypothesis requests of every shape to the two generation routes."""
    report = FuzzReport()
    auth = {"authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=base_url, timeout=120) as http:
        @hypothesis_seed(seed)
        @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck),
                  phases=[Phase.generate])
        @given(req=_request())
        def run(req: tuple[str, bytes, str]) -> None:
            path, payload, content_type = req
            headers = auth | ({"content-type": content_type} if content_type else {})
            resp = http.post(path, content=payload, headers=headers)
            report.judge(f"POST {path} {content_type} {payload[:200]!r}", resp.status_code, resp.content,
                         resp.headers.get("content-type", ""))

        run()
    return report
