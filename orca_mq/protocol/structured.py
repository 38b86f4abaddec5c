"""What a request's output must match (vLLM's `StructuredOutputsParams`): exactly one of a JSON schema,
any JSON object, a regular expression, a choice of strings or a grammar (Lark or GBNF).

This module checks only the shape of the constraint (cheap, on the event loop); compiling it, with
its size and time bounds, is `orca_mq.structured.compiler`'s. A wire type (inside SamplingParams), it
imports nothing heavy, so the client and the HTTP API can use it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any, Literal

from orca_mq.short_repr import short_repr
from orca_mq.errors import InvalidRequest

Kind = Literal["json", "regex", "choice", "grammar", "json_object"]
MAX_CHOICES = 1024      # choices are one alternation: a bound on its width (their size is bounded by max_spec_bytes)


def _bad(msg: str) -> InvalidRequest:
    return InvalidRequest(f"invalid structured_outputs: {msg}")


@dataclass(slots=True)
class StructuredOutputsParams:
    json: dict[str, Any] | str | None = None   # a JSON schema (an object, or its JSON text)
    regex: str | None = None                   # the whole output matches it
    choice: list[str] | None = None            # the output is one of these strings
    grammar: str | None = None                 # a Lark or GBNF grammar (llguidance's dialects)
    json_object: bool | None = None            # any JSON object

    @classmethod
    def from_dict(cls, data: Any) -> "StructuredOutputsParams":
        if isinstance(data, cls):
            return data
        if not isinstance(data, dict):
            raise _bad(f"expected an object with one of {', '.join(f.name for f in fields(cls))}, got {short_repr(data)}")
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise _bad(f"unknown field(s) {short_repr(sorted(map(str, unknown)))}")
        return cls(**data)

    def validate(self) -> None:
        """The shape: one constraint, of the right type. The content is the compiler's to judge."""
        given = [f.name for f in fields(self) if getattr(self, f.name) is not None]
        if len(given) != 1:
            raise _bad(f"give exactly one of json, regex, choice, grammar, json_object; got {given or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise _bad(f"json must be a JSON schema object or its JSON text, got {short_repr(self.json)}")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise _bad(f"{name} must be a non-empty string, got {short_repr(v)}")
        if self.choice is not None and (
            not isinstance(self.choice, list) or not 0 < len(self.choice) <= MAX_CHOICES
            or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise _bad(f"choice must be 1 to {MAX_CHOICES} non-empty strings, got {short_repr(self.choice)}")
        if self.json_object is not None and self.json_object is not True:
            raise _bad(f"json_object must be true, got {short_repr(self.json_object)}")

    @property
    def kind(self) -> Kind:
        return next(f.name for f in fields(self) if getattr(self, f.name) is not None)  # type: ignore[return-value]

    def spec(self) -> str:
        """The constraint as one string: the cache key and what the compiler reads. A JSON schema
        keeps its key order (it is the order of the output's properties)."""
        kind = self.kind
        if kind == "json":
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except (ValueError, RecursionError) as e:
                    raise _bad(f"json is not valid JSON: {short_repr(str(e))}") from None
            if not isinstance(schema, dict):
                raise _bad(f"json must be a JSON schema object, got {short_repr(schema)}")
            return _dumps(schema)
        if kind == "choice":
            return _dumps(self.choice)
        if kind == "json_object":
            return ""
        return getattr(self, kind)


def _dumps(value: Any) -> str:
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (ValueError, TypeError, RecursionError) as e:
        raise _bad(f"not serializable as JSON: {short_repr(str(e))}") from None
