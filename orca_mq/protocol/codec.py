"""Versioned msgpack frames: `{"v": VERSION, "type": NAME, **fields}`, checked against the dataclass.

Every message type is a slotted dataclass registered under a unique name. Decoding checks the
version, the type (against the set the receiving channel accepts), that no field is missing or
unknown, and the type of every field — so a receiver never acts on a frame it did not expect.
Nested dataclasses (the iteration plan) travel as positional lists, tuples as lists.
Whatever the bytes, decoding returns a message or raises ProtocolError, nothing else; an error
message quotes at most a short prefix of what it rejects.

Version 2 added optional fields (Error.code, Output.code); version 3 added Generate.api_key and
Stats.api_key (and the code `unauthorized`). An older frame still decodes, with their defaults.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import msgpack

from orca_mq.short_repr import short_repr

PROTOCOL_VERSION = 3
SUPPORTED_VERSIONS = (1, 2, 3)
MAX_FRAME_BYTES = 64 << 20

Conv = Callable[[Any, str], Any]
T = TypeVar("T")

_REGISTRY: dict[str, type] = {}
_DECODERS: dict[type, dict[str, tuple[Conv, bool]]] = {}   # cls -> field -> (converter, required)


class ProtocolError(ValueError):
    """A frame that cannot be accepted; request_id is set when the frame named one."""

    def __init__(self, msg: str, request_id: str | None = None) -> None:
        super().__init__(msg)
        self.request_id = request_id


def message(name: str) -> Callable[[type[T]], type[T]]:
    """Register a dataclass as the message type `name`."""

    def wrap(cls: type[T]) -> type[T]:
        if name in _REGISTRY:
            raise RuntimeError(f"message type {name!r} registered twice")
        _REGISTRY[name] = cls
        cls.TYPE = name  # type: ignore[attr-defined]
        return cls

    return wrap


def channel(*classes: type) -> frozenset[str]:
    """The set of message types one receiver accepts."""
    return frozenset(c.TYPE for c in classes)  # type: ignore[attr-defined]


def encode(msg: Any) -> bytes:
    body: dict[str, Any] = {"v": PROTOCOL_VERSION, "type": msg.TYPE}
    for f in dataclasses.fields(msg):
        body[f.name] = _to_wire(getattr(msg, f.name))
    return msgpack.packb(body, use_bin_type=True)


def _to_wire(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return [_to_wire(getattr(value, f.name)) for f in dataclasses.fields(value)]
    if isinstance(value, (list, tuple)):
        return [_to_wire(v) for v in value]
    return value


def unpack(frame: bytes) -> dict[str, Any]:
    """Bytes -> header-checked dict (version and a known type); fields are not checked yet."""
    if not isinstance(frame, (bytes, bytearray, memoryview)) or len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError("frame is not bytes or is too large")
    try:
        body = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types for bad input
        raise ProtocolError(f"malformed frame: {type(e).__name__}: {e}") from None
    if not isinstance(body, dict):
        raise ProtocolError("malformed frame: not a map")
    rid = _request_id(body)
    v, name = body.get("v"), body.get("type")
    if type(v) is not int or v not in SUPPORTED_VERSIONS:
        raise ProtocolError(f"unsupported protocol version {short_repr(v)} (expected one of {SUPPORTED_VERSIONS})", rid)
    if type(name) is not str or name not in _REGISTRY:
        raise ProtocolError(f"unknown message type {short_repr(name)}", rid)
    return body


def _request_id(body: dict[Any, Any]) -> str | None:
    rid = body.get("request_id")
    return rid if type(rid) is str else None


def decode(frame: bytes, accepted: frozenset[str]) -> Any:
    """Bytes -> a validated message instance whose type is in `accepted`."""
    return from_dict(unpack(frame), accepted)


def from_dict(body: dict[str, Any], accepted: frozenset[str]) -> Any:
    name = body["type"]
    rid = _request_id(body)
    if name not in accepted:
        raise ProtocolError(f"message type {name!r} not accepted here", rid)
    cls = _REGISTRY[name]
    spec = _decoders(cls)
    unknown = set(body) - set(spec) - {"v", "type"}
    if unknown:
        raise ProtocolError(f"{name}: unknown field(s) {short_repr(sorted(map(str, unknown)))}", rid)
    kwargs: dict[str, Any] = {}
    try:
        for field, (conv, required) in spec.items():
            if field in body:
                kwargs[field] = conv(body[field], field)
            elif required:
                raise ProtocolError(f"missing field {field!r}")
    except ProtocolError as e:
        raise ProtocolError(f"{name}: {e}", rid) from None
    return cls(**kwargs)


def _decoders(cls: type) -> dict[str, tuple[Conv, bool]]:
    if cls not in _DECODERS:
        hints = typing.get_type_hints(cls)
        _DECODERS[cls] = {
            f.name: (_converter(hints[f.name]), f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
            for f in dataclasses.fields(cls)
        }
    return _DECODERS[cls]


def _fail(path: str, want: str, value: Any) -> ProtocolError:
    return ProtocolError(f"field {path[:80]!r}: expected {want}, got {type(value).__name__}")


def _converter(tp: Any) -> Conv:
    """Compile a checker/converter for one annotation (int, float, str, bool, bytes, Any,
    X | None, list[X], tuple[X, ...], dict[str, X], nested dataclasses)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return lambda v, p: v
    if origin in (typing.Union, types.UnionType):
        convs = [_converter(a) for a in args if a is not type(None)]
        nullable = type(None) in args

        def union(v: Any, p: str) -> Any:
            if v is None and nullable:
                return None
            for c in convs:
                try:
                    return c(v, p)
                except ProtocolError:
                    pass
            raise _fail(p, str(tp), v)

        return union
    if tp is bool:
        return _exact(bool)
    if tp is int:
        return _exact(int)
    if tp is str:
        return _exact(str)
    if tp is bytes:
        return _exact(bytes)
    if tp is float:
        def to_float(v: Any, p: str) -> float:
            if type(v) is float or type(v) is int:
                return float(v)
            raise _fail(p, "float", v)

        return to_float
    if origin is list:
        if args[0] is int:  # fast path: token ids and block tables
            def int_list(v: Any, p: str) -> list[int]:
                if type(v) is not list or not all(type(x) is int for x in v):
                    raise _fail(p, "list[int]", v)
                return v

            return int_list
        item = _converter(args[0])
        return lambda v, p: [item(x, p) for x in _seq(v, p)]
    if origin is tuple:
        items = [_converter(a) for a in args]

        def fixed(v: Any, p: str) -> tuple[Any, ...]:
            v = _seq(v, p)
            if len(v) != len(items):
                raise _fail(p, f"{len(items)} items", v)
            return tuple(c(x, p) for c, x in zip(items, v))

        return fixed
    if origin is dict:
        val = _converter(args[1])

        def mapping(v: Any, p: str) -> dict[str, Any]:
            if type(v) is not dict or not all(type(k) is str for k in v):
                raise _fail(p, "map with string keys", v)
            return {k: val(x, f"{p}.{k}") for k, x in v.items()}

        return mapping
    if dataclasses.is_dataclass(tp):
        spec = _decoders(tp)

        def nested(v: Any, p: str) -> Any:
            v = _seq(v, p)
            if len(v) != len(spec):
                raise _fail(p, f"{tp.__name__} as {len(spec)} items", v)
            return tp(*(c(x, f"{p}.{n}") for (n, (c, _)), x in zip(spec.items(), v)))

        return nested
    raise TypeError(f"unsupported annotation in a message: {tp!r}")


def _exact(kind: type) -> Conv:
    def check(v: Any, p: str) -> Any:
        if type(v) is not kind:
            raise _fail(p, kind.__name__, v)
        return v

    return check


def _seq(v: Any, p: str) -> list[Any]:
    if type(v) is not list:
        raise _fail(p, "list", v)
    return v


def registered() -> Iterable[str]:
    return _REGISTRY.keys()
