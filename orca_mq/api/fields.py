"""The HTTP schemas' sampling fields, made from the table (orca_mq.protocol.sampling_fields): no
bound is written twice, so what the schema accepts SamplingParams accepts too. And their bounded
lists (`bounded`): a length past the bound refused before the elements are read."""
from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, Field
from pydantic_core import PydanticCustomError

from orca_mq.protocol.sampling_fields import FIELDS, SamplingField


def http(name: str | SamplingField, low: float | None = None, high: float | None = None) -> Any:
    """A field's type in an HTTP schema (a view adds `| None`: absent = the default), with the bounds
    its API states where they differ (`low`, `high`): pydantic's strict type (5.0 is no integer, true
    and "0.5" no number), the bounds as constraints (the OpenAPI schema shows them; pydantic's 400
    names the field) and the table's own check after, for what constraints cannot say (temperature's
    0 below its range)."""
    f = (FIELDS[name] if isinstance(name, str) else name).bounded(low, high)
    if f.kind is bool:
        return Annotated[bool, Field(strict=True)]
    lower = {"gt": f.low} if f.low_open else {"ge": 0 if f.zero else f.low}
    finite = {"allow_inf_nan": False} if f.kind is float else {}
    constrained = Field(strict=True, le=f.high, **lower, **finite)
    # the table's check only where the constraints accept more than it does (0 below the range): elsewhere
    # a Python call per value (800,000 prompt ids: 0.32 s of the event loop against 0.06 without)
    return Annotated[f.kind, constrained, AfterValidator(_checked(f))] if f.zero else Annotated[f.kind, constrained]


def _checked(f: SamplingField) -> Any:
    def check(v: Any) -> Any:
        if not f.accepts(v):
            raise PydanticCustomError("value_error", "Input should be {what}", {"what": f.describe()})
        return v
    return check


def bounded(kind: Any, most: int, least: int = 0) -> Any:
    """A list (or dict) field of `least` to `most` elements whose length is checked before they are read
    (`at_most`); the constraints stay for the schema."""
    return Annotated[kind, Field(min_length=least, max_length=most), at_most(most)]


def at_most(most: int) -> Any:
    """A list or dict of more than `most` elements refused before they are read: pydantic's max_length
    counts them after validating each (a body of 123,000 small messages: 0.7 s of validation to refuse).
    The error is pydantic's too_long, without its "after validation"."""
    def check(v: Any) -> Any:
        if isinstance(v, (list, dict)) and len(v) > most:
            raise PydanticCustomError("too_long", "{field_type} should have at most {max_length} items, not {actual_length}",
                                      {"field_type": "List" if isinstance(v, list) else "Dictionary", "max_length": most,
                                       "actual_length": len(v)})
        return v
    return BeforeValidator(check)
