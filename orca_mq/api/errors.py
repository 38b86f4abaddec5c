"""The HTTP API's errors: OpenAI's error object, its status from orca-mq's stable codes.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": "invalid_value"}}

`type` is OpenAI's (invalid_request_error for 4xx but 429, rate_limit_error for 429, server_error
for 5xx); `param` names the request field at fault where one is; `code` is machine-readable: for a
request the schema refuses `unknown_parameter`, `unsupported_parameter`, `missing_parameter`,
`invalid_type`, `invalid_value` or `invalid_json`, otherwise orca-mq's stable code (invalid_request, overloaded,
unavailable, internal), `invalid_api_key`, `model_not_found`, `request_too_large`, `not_found`.
A 500 says nothing more than that: the log has the rest. POST /v1/messages answers in Anthropic's
shape instead (`body_for`): {"type": "error", "error": {"type": "invalid_request_error", "message": ...}},
the field at fault named in the message.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from orca_mq.protocol.common_msgs import ABORTED, INTERNAL, INVALID_REQUEST, OVERLOADED, PROTOCOL, UNAUTHORIZED, UNAVAILABLE


class ApiError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param


# orca-mq's stable error codes (orca_mq.protocol.common_msgs) -> HTTP status
STATUS_BY_CODE = {INVALID_REQUEST: 400, PROTOCOL: 400, UNAUTHORIZED: 401, OVERLOADED: 429, UNAVAILABLE: 503,
                  ABORTED: 503, INTERNAL: 500}
INTERNAL_TEXT = "internal server error"


def classify(code: str | None, error: str | None, param: str | None = None) -> ApiError:
    """A final's error as the HTTP API's (`param`: the field at fault, as the server names it on the
    wire; the route gives it the request's name: ChatCompletionRequest.field)."""
    code = code or INTERNAL
    status = STATUS_BY_CODE.get(code, 500)
    if status == 500:
        return ApiError(500, INTERNAL_TEXT, INTERNAL)  # a 500 says nothing more
    return ApiError(status, error or code, code, param)


def error_type(status: int) -> str:
    return "server_error" if status >= 500 else "rate_limit_error" if status == 429 else "invalid_request_error"


def error_body(err: ApiError) -> dict[str, Any]:
    return {"error": {"message": err.message, "type": error_type(err.status), "param": err.param, "code": err.code}}


ANTHROPIC_PATHS = frozenset({"/v1/messages"})
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def anthropic_error_body(err: ApiError) -> dict[str, Any]:
    kind = ANTHROPIC_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    message = err.message if not err.param or err.param in err.message else f"{err.param}: {err.message}"
    return {"type": "error", "error": {"type": kind, "message": message}}


def body_for(path: str, err: ApiError) -> dict[str, Any]:
    """The error object of the API a path belongs to."""
    return anthropic_error_body(err) if path in ANTHROPIC_PATHS else error_body(err)


def from_validation(errors: Sequence[Any]) -> ApiError:
    """FastAPI's RequestValidationError.errors() -> one 400 naming the field at fault. Of the errors a
    union gives (one per member), the one that got furthest into the value says the most."""
    err = max(errors, key=lambda e: len(_path(e["loc"][1:])))
    kind = err.get("type", "")
    if kind == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {(err.get('ctx') or {}).get('error', err['msg'])}", "invalid_json")
    ctx = err.get("ctx") or {}
    if "param" in ctx:  # ours (orca_mq.api.schemas): the message names the field
        return ApiError(400, str(err["msg"]), kind if kind in CUSTOM else "invalid_value", str(ctx["param"]))
    param = ".".join(map(str, _path(err["loc"][1:]))) or None
    if param is None and kind in ("model_attributes_type", "model_type", "dict_type"):
        return ApiError(400, "the body must be a JSON object (header content-type: application/json)", "invalid_type")
    code = "missing_parameter" if kind == "missing" else "invalid_type" if kind.endswith(("_type", "_parsing")) else "invalid_value"
    return ApiError(400, f"{param or 'body'}: {err['msg']}", code, param)


CUSTOM = ("unknown_parameter", "unsupported_parameter", "missing_parameter")
_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _path(loc: Sequence[Any]) -> list[Any]:
    """A location without pydantic's union-member tags (`str`, `list[constrained-int]`, `function-after[...]`)."""
    return [p for p in loc if isinstance(p, int) or (p.isidentifier() and p not in _TAGS)]
