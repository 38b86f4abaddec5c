"""A request's body read into its schema, off the HTTP event loop when it is large.

FastAPI decodes and validates a body parameter on the event loop, and both cost about the body's size:
4 MB of small messages, content parts or input items took 0.5-1.0 s of the loop on a 2-core host (the
JSON decode alone 70-90 ms), every other client's tokens and /health waiting meanwhile. Here the body's
bytes are decoded and validated in one call (pydantic's `model_validate_json`) as a heavy response is
built (orca_mq.api.offload: a body weighs a unit per BODY_BYTES_PER_WEIGHT bytes, so past 32 KB on the
builder's thread, which hands the GIL back at the schemas' Python validators); a small body in place,
cheaper than the hop. The cyclic garbage collector pauses meanwhile (a body's objects hold no cycles,
and the full collections their number set off held the GIL 30-120 ms each). A refusal is FastAPI's
RequestValidationError, each location under "body", read by the same handler as before: no body is a
missing one, a body that is not declared JSON (content-type application/json or +json) is no JSON
object, a body that does not parse is invalid JSON. A body in UTF-16, UTF-32 or with a UTF-8 BOM is read
as json.loads reads bytes; JSON nested deeper than 200 levels is refused (pydantic's parser's bound).

An endpoint's body parameter is `Annotated[Model, parsed(Model)]`, its route registered with
`openapi_extra=documented(endpoint)` (FastAPI documents only the bodies it reads itself: the schema
fuzzers generate cases from it); the app's state carries the builder (`app.state.builder`).
"""
from __future__ import annotations

import email.message
import gc
import inspect
import json
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import Depends, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from orca_mq.api.offload import BODY_BYTES_PER_WEIGHT

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")


def parsed(model: type[M]) -> Any:
    """A FastAPI dependency that gives the body as `model`."""
    async def read(request: Request) -> M:
        return await validate(request, model)
    return Depends(read)


def documented(endpoint: Callable[..., Any]) -> dict[str, Any]:
    """openapi_extra naming the body an endpoint's `body` parameter reads (`Annotated[Model, parsed(Model)]`),
    its schema's definitions inlined (no two models' same-named parts share a component)."""
    model = inspect.signature(endpoint, eval_str=True).parameters["body"].annotation.__origin__
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return inline(defs[ref.removeprefix("#/$defs/")]) | {k: inline(v) for k, v in node.items() if k != "$ref"}
            return {k: inline(v) for k, v in node.items()}
        return [inline(v) for v in node] if isinstance(node, list) else node

    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inline(schema)}}}}


async def validate(request: Request, model: type[M]) -> M:
    raw = await request.body()
    if not raw:
        raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}])
    if not _json(request.headers.get("content-type")):
        raise RequestValidationError([{"type": "model_attributes_type", "loc": ("body",), "input": None,
                                       "msg": "Input should be a valid dictionary or object to extract fields from"}])
    return await sized(request, lambda: _validated(model, raw))


async def sized(request: Request, fn: Callable[[], T]) -> T:
    """fn(), whose work grows with the request's body (its validation, a view's conversion to the chat
    request), on the builder's thread when the body is large, else here."""
    done: T = await request.app.state.builder.build(fn, len(await request.body()) // BODY_BYTES_PER_WEIGHT)
    return done


def _json(content_type: str | None) -> bool:
    """Declared JSON, as FastAPI reads a content-type (application/json, application/*+json)."""
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


class _CollectorPause:
    """The cyclic garbage collector off while any validation runs: validations overlap (the loop's small
    bodies, the builder's large ones), so the first in turns it off and the last out back on, if it was."""

    def __init__(self) -> None:
        self.lock, self.inside, self.resume = threading.Lock(), 0, False

    def __enter__(self) -> None:
        with self.lock:
            if not self.inside:
                self.resume = gc.isenabled()
                gc.disable()
            self.inside += 1

    def __exit__(self, *exc: object) -> None:
        with self.lock:
            self.inside -= 1
            if not self.inside and self.resume:
                gc.enable()


_PAUSE = _CollectorPause()


def _validated(model: type[M], raw: bytes) -> M:
    try:
        if (encoding := json.detect_encoding(raw)) != "utf-8":   # as json.loads reads bytes (a BOM, UTF-16, UTF-32)
            raw = raw.decode(encoding).encode()
        with _PAUSE:
            return model.model_validate_json(raw)
    except UnicodeDecodeError as e:
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body",), "msg": "JSON decode error", "input": {},
                                       "ctx": {"error": str(e)}}]) from None
    except ValidationError as e:
        raise RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in e.errors(include_url=False)]) from None
