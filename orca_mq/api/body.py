"""A request's body read into its schema, off the HTTP event loop when it is large.

FastAPI decodes and validates a body parameter on the event loop, and both cost about the body's size:
4 MB of small messages, content parts or input items took 0.5-1.0 s of the loop on a 2-core host (the
JSON decode alone 70-90 ms), every other client's tokens and /health waiting meanwhile. Here the body's
bytes are decoded and validated in one call (pydantic's `model_validate_json`) as a heavy response is
built (orca_mq.api.offload: a body weighs a unit per BODY_BYTES_PER_WEIGHT bytes, so past 32 KB on the
builder's thread, which hands the GIL back at the schemas' Python validators); a small body in place,
cheaper than the hop. A refusal is FastAPI's RequestValidationError, each location under "body", read
by the same handler as before: no body is a missing one, a body that is not declared JSON
(content-type application/json or +json) is no JSON object, a body that does not parse is invalid JSON.

An endpoint's body parameter is `Annotated[Model, parsed(Model)]`; the app's state carries the
builder (`app.state.builder`).
"""
from __future__ import annotations

import email.message
import gc
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


def _validated(model: type[M], raw: bytes) -> M:
    """The body as `model`, the cyclic garbage collector paused meanwhile: a body's objects hold no cycles,
    and the full collections their number set off held the GIL 30-120 ms each (six in 4 MB of parts)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        raise RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in e.errors(include_url=False)]) from None
    finally:
        if collecting:
            gc.enable()
