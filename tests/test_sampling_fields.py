"""The sampling fields' table (orca_mq.protocol.sampling_fields) against everything that checks a field:
values at and just past every bound, derived from the table, must be accepted or refused alike by
SamplingParams (the frontend's admission, the offline LLM), the ZeroMQ client before it sends, and the
HTTP schemas (completions, chat, Responses, Messages), each refusal naming its field. The schema once
took a temperature in (0, 0.001) that SamplingParams refused: the values below include one."""
from __future__ import annotations

import asyncio
import math
import re
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from orca_mq.api.errors import from_validation
from orca_mq.api.messages_schema import MessagesRequest
from orca_mq.api.responses_schema import ResponsesRequest
from orca_mq.api.schemas import ChatCompletionRequest, CompletionRequest
from orca_mq.client import AsyncClient
from orca_mq.errors import InvalidRequest
from orca_mq.protocol.sampling import SamplingParams
from orca_mq.protocol.sampling_fields import FIELDS, SCALARS, SamplingField, is_greedy, markdown
from orca_mq.server.process import ROOT

FAST = settings(max_examples=200, deadline=None, database=None, suppress_health_check=list(HealthCheck))
JUNK = ["0.5", [1], {"a": 1}]


def _past(v: float, toward: float) -> float:
    return math.nextafter(v, toward)


def edges(f: SamplingField) -> list[Any]:
    """The values to try for a field: each bound, just past it, its gaps, null and other types."""
    if f.kind is bool:
        return [True, False, None, 0, 1, 1.0, *JUNK]
    assert f.low is not None and f.high is not None
    low, high = f.low, f.high
    if f.kind is int:
        values: list[Any] = [int(low), int(low) - 1, int(high), int(high) + 1, 1 << 64, float(int(low)), True]
    else:
        values = [low, _past(low, -math.inf), high, _past(high, math.inf), int(high), math.nan, math.inf, -math.inf, False]
        if f.zero:
            values += [0.0, 0, _past(0.0, 1.0), low / 2, _past(low, 0.0), -0.0, _past(0.0, -1.0)]
    return values + [None, *JUNK]


CASES = [(f.name, v) for f in SCALARS for v in edges(f)]


def _ids(case: Any) -> str:
    return repr(case)[:40]


def params_problem(name: str, value: Any) -> str | None:
    """SamplingParams' verdict (as admission gives it, but with the absolute logprobs bound): None or the param it names."""
    try:
        SamplingParams(**{"max_tokens": None, name: value}).validate()   # None: min_tokens bounded by the context alone
    except InvalidRequest as e:
        return e.param or "?"
    return None


def client_problem(name: str, value: Any) -> str | None:
    """The ZeroMQ client's verdict before it sends: an unconnected client refuses a bad field at once,
    and on a good one goes on to send (which it cannot: RuntimeError)."""
    async def first() -> str | None:
        events = AsyncClient().stream(prompt="x", **{"max_tokens": None, name: value})
        try:
            ev = await events.__anext__()
        except RuntimeError:
            return None
        assert ev.finished and ev.code == "invalid_request", ev
        return ev.param or "?"
    return asyncio.run(first())


def schema_problem(schema: type[BaseModel], body: dict[str, Any], name: str, value: Any) -> tuple[str | None, Any]:
    """The HTTP schema's verdict on body + {name: value}: (the param its 400 names, None when accepted;
    the request when accepted)."""
    try:
        req = schema.model_validate(body | {name: value})
    except ValidationError as e:
        return from_validation([dict(x, loc=("body", *x["loc"])) for x in e.errors()]).param or "?", None
    return None, req


@pytest.mark.parametrize("name, value", CASES, ids=_ids)
def test_sampling_params_and_the_client_follow_the_table(name, value):
    expect = None if FIELDS[name].accepts(value) else name
    assert params_problem(name, value) == expect
    assert client_problem(name, value) == expect


HTTP_NAMES = {   # table field -> (schema, its base body, the field's name there), where the API takes the field
    "completions": (CompletionRequest, {"prompt": "x"}, {f.name: f.name for f in SCALARS if f.name != "prompt_logprobs"}),
    "chat": (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "logprobs": True},
             {f.name: f.name for f in SCALARS if f.name not in ("prompt_logprobs", "logprobs")}
             | {"logprobs": "top_logprobs"}),
}


def _http_cases() -> list[tuple[str, str, Any]]:
    return [(api, name, v) for api, (_, _, names) in HTTP_NAMES.items() for name in names for v in edges(FIELDS[name])]


@pytest.mark.parametrize("api, name, value", _http_cases(), ids=_ids)
def test_the_http_schemas_follow_the_table(api, name, value):
    schema, body, names = HTTP_NAMES[api]
    http_name = names[name]
    # null = the default; vLLM's top_k -1 = off, sent as 0; completions' max_tokens 0 with echo: the prompt alone
    wider = (name == "top_k" and value == -1) or (api == "completions" and name == "max_tokens" and value == 0)
    expect_ok = FIELDS[name].accepts(value) or value is None or wider
    if api == "completions" and name == "max_tokens" and value == 0:
        body = body | {"echo": True}
    problem, req = schema_problem(schema, body, http_name, value)
    assert problem == (None if expect_ok else http_name), (problem, value)
    if req is not None:   # what the schema accepted, SamplingParams accepts as the route sends it
        SamplingParams.from_dict(req.sampling()).validate()


VIEWS = [   # the Responses and Messages fields that map to a table field, with the bounds their APIs state
    (ResponsesRequest, {"input": "x"}, "max_output_tokens", FIELDS["max_tokens"]),
    (ResponsesRequest, {"input": "x"}, "temperature", FIELDS["temperature"]),
    (ResponsesRequest, {"input": "x"}, "top_p", FIELDS["top_p"]),
    (MessagesRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}]}, "max_tokens", FIELDS["max_tokens"]),
    (MessagesRequest, {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}, "temperature",
     FIELDS["temperature"].bounded(high=1.0)),   # Anthropic's range
    (MessagesRequest, {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}, "top_p",
     FIELDS["top_p"]),
    (MessagesRequest, {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}, "top_k",
     FIELDS["top_k"]),
]


@pytest.mark.parametrize("schema, body, http_name, f", VIEWS, ids=lambda v: getattr(v, "__name__", None) or _ids(v))
def test_the_responses_and_messages_views_follow_the_table(schema, body, http_name, f):
    for value in edges(f):
        if value is None and http_name == "max_tokens":   # Messages requires it
            continue
        problem, req = schema_problem(schema, body, http_name, value)
        assert problem == (None if f.accepts(value) or value is None else http_name), (http_name, value, problem)
        if req is not None:
            chat = ChatCompletionRequest.model_validate(req.chat() if schema is MessagesRequest else req.chat([]))
            SamplingParams.from_dict(chat.sampling()).validate()


NUMBERS = st.one_of(st.floats(allow_nan=True), st.integers(), st.booleans(), st.none())


@FAST
@given(name=st.sampled_from([f.name for f in SCALARS if f.name not in ("logprobs", "prompt_logprobs")]), value=NUMBERS)
def test_schema_params_and_table_agree_on_any_number(name, value):
    problem, _ = schema_problem(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}]}, name, value)
    schema_ok = problem is None and not (name == "top_k" and value == -1)
    params_ok = params_problem(name, value) is None or value is None   # null on HTTP: the default
    assert schema_ok == params_ok == (FIELDS[name].accepts(value) or value is None), (name, value, problem)


def test_min_tokens_past_max_tokens_is_refused_alike():
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(max_tokens=2, min_tokens=5).validate()
    assert e.value.param == "min_tokens"
    problem, _ = schema_problem(CompletionRequest, {"prompt": "x", "max_tokens": 2}, "min_tokens", 5)
    assert problem == "min_tokens"
    problem, _ = schema_problem(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}],
                                                        "max_completion_tokens": 2}, "min_tokens", 5)
    assert problem == "min_tokens"


def test_sampling_params_take_the_tables_fields_and_defaults():
    fields = SamplingParams.__dataclass_fields__
    assert set(fields) == set(FIELDS)
    default = SamplingParams()
    assert {name: getattr(default, name) for name in FIELDS} == {name: f.default for name, f in FIELDS.items()}


def test_the_greedy_rule_is_one_for_params_and_plan_columns():
    cases = [(0.0, 0, True), (0.7, 1, True), (0.7, 0, False), (1.0, 50, False), (0.0, 1, True)]
    assert [bool(is_greedy(t, k)) for t, k, _ in cases] == [g for _, _, g in cases]
    temps = np.array([t for t, _, _ in cases], np.float32)
    ks = np.array([k for _, k, _ in cases], np.int32)
    assert is_greedy(temps, ks).tolist() == [g for _, _, g in cases]


def test_the_readme_shows_the_table():
    readme = (ROOT / "README.md").read_text()
    shown = re.search(r"<!-- sampling-fields -->\n(.*?)\n<!-- /sampling-fields -->", readme, re.S)
    assert shown is not None and shown.group(1) == markdown(), "regenerate: python -m orca_mq.protocol.sampling_fields"
