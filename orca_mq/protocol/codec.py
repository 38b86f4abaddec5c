"""Versioned msgpack frames: `{"v": VERSION, "type": NAME, **fields}`, checked against the dataclass.

Every message type is a slotted dataclass registered under a unique name. Decoding checks the
version, the type (against the set the receiving channel accepts, and that the frame's version
has it), that no field is missing or unknown, and the type of every field — so a receiver never
acts on a frame it did not expect. Nested dataclasses (the iteration plan) travel as positional
lists, tuples as lists. Whatever the bytes, decoding returns a message or raises ProtocolError,
nothing else; an error message quotes at most a short prefix of what it rejects.

Encoding reflects over a class once: its first message compiles a function that reads the fields
by name (operator.attrgetter) and converts only what msgpack cannot pack as it is (nested
dataclasses, found from the annotations), so a list of token ids costs msgpack's C loop only.

Version 2 added optional fields (Error.code, Output.code); version 3 added Generate.api_key and
Stats.api_key (and the code `unauthorized`); version 4 added `outputs` (one frame per client per
iteration, client_msgs); version 5 added log probabilities to `output` and `outputs`
(orca_mq.protocol.logprobs); version 6 added `generate`'s chat_template_kwargs; version 7 added
`output`'s param (the request field a refusal blames); version 8 `generate`'s on_behalf_of (a
gateway's end client); version 9 `generate`'s tools and `output`'s prompt_tail; version 10 embeddings
(`generate`'s pooling, `output`'s embedding and the same column of `outputs`: orca_mq.protocol.pooling);
version 11 `generate`'s stream (False: the rows come together at the end).
An older frame still decodes, with the newer fields' defaults (a field its version does not have is
refused: an older client cannot ask for what it would not understand), and `encode(msg, version)` writes
a frame an older peer reads: without the fields added after it.
"""
from __future__ import annotations

import dataclasses
import operator
import types
import typing
from collections.abc import Callable, Iterable
from itertools import chain
from typing import Any, TypeVar

import msgpack

from orca_mq.short_repr import short_repr

PROTOCOL_VERSION = 11
SUPPORTED_VERSIONS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11)
MAX_FRAME_BYTES = 64 << 20

Conv = Callable[[Any, str], Any]
Wire = Callable[[Any], Any]
T = TypeVar("T")
_HEADER = frozenset({"v", "type"})
_SCALARS = frozenset({bool, int, str, bytes, type(None)})   # checked by exact type (a bool is no int here)
_LIST = frozenset({list})

_REGISTRY: dict[str, type] = {}
_SINCE: dict[str, int] = {}                                 # type -> the protocol version that added it
_COLUMNS: dict[type, tuple[str, ...]] = {}                  # cls -> fields that must be equally long
_OPTIONAL_COLUMNS: dict[type, tuple[str, ...]] = {}         # cls -> fields empty or as long as those
_DECODERS: dict[type, dict[str, tuple[Conv, bool]]] = {}   # cls -> field -> (converter, required)
_FIELD_SINCE: dict[type, dict[str, int]] = {}              # cls -> its fields added after version 1 -> that version
_ENCODERS: dict[tuple[type, int], Callable[[Any], dict[str, Any]]] = {}   # (cls, version) -> body builder
_POSITIONAL: dict[type, Wire] = {}                          # nested dataclass -> its positional form


class ProtocolError(ValueError):
    """A frame that cannot be accepted; request_id is set when the frame named one."""

    def __init__(self, msg: str, request_id: str | None = None) -> None:
        super().__init__(msg)
        self.request_id = request_id


def message(name: str, *, since: int = 1, columns: tuple[str, ...] = (),
            optional_columns: tuple[str, ...] = ()) -> Callable[[type[T]], type[T]]:
    """Register a dataclass as the message type `name`, added in protocol version `since`;
    `columns` name list fields that must be equally long (a columnar message: row i across them),
    `optional_columns` list fields that are empty (none of the rows has one) or as long as the first column."""

    def wrap(cls: type[T]) -> type[T]:
        if name in _REGISTRY:
            raise RuntimeError(f"message type {name!r} registered twice")
        _REGISTRY[name] = cls
        _SINCE[name] = since
        _COLUMNS[cls] = columns
        _OPTIONAL_COLUMNS[cls] = optional_columns
        cls.TYPE = name  # type: ignore[attr-defined]
        return cls

    return wrap


def added(version: int, **field_args: Any) -> Any:
    """A field added in protocol `version` (dataclasses.field's arguments): not written to older peers."""
    return dataclasses.field(metadata={"since": version}, **field_args)


def channel(*classes: type) -> frozenset[str]:
    """The set of message types one receiver accepts."""
    return frozenset(c.TYPE for c in classes)  # type: ignore[attr-defined]


def encode(msg: Any, version: int = PROTOCOL_VERSION) -> bytes:
    """A message as a frame of protocol `version` (an older one for an older peer)."""
    body = _ENCODERS.get((type(msg), version)) or _encoder(type(msg), version)
    return msgpack.packb(body(msg), use_bin_type=True)


def _encoder(cls: type, version: int) -> Callable[[Any], dict[str, Any]]:
    name = cls.TYPE  # type: ignore[attr-defined]
    if version not in SUPPORTED_VERSIONS or version < _SINCE[name]:
        raise ValueError(f"message type {name!r} cannot be written in protocol version {version}")
    fields = [f for f in dataclasses.fields(cls) if f.metadata.get("since", 1) <= version]
    names = tuple(f.name for f in fields)
    values = _values(cls, fields)
    head = {"v": version, "type": name}

    def body(msg: Any) -> dict[str, Any]:
        out = head.copy()
        out.update(zip(names, values(msg)))
        return out

    _ENCODERS[(cls, version)] = body
    return body


def _values(cls: type, fields: list[dataclasses.Field[Any]]) -> Wire:
    """obj -> its fields' values in order, in wire form (a tuple when none needs converting)."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in fields]
    get: Wire = (operator.attrgetter(*names) if len(names) > 1
                 else (lambda o: (getattr(o, names[0]),)) if names else (lambda o: ()))
    convs = [(i, c) for i, n in enumerate(names) if (c := _wire(hints[n])) is not None]
    if not convs:
        return get

    def converted(obj: Any) -> list[Any]:
        vals = list(get(obj))
        for i, c in convs:
            vals[i] = c(vals[i])
        return vals

    return converted


def _wire(tp: Any) -> Wire | None:
    """How a value of annotation `tp` becomes what msgpack packs: None when it packs it as it is
    (scalars, and lists, tuples and maps of them); a nested dataclass becomes a positional list."""
    if dataclasses.is_dataclass(tp):
        if tp not in _POSITIONAL:
            _POSITIONAL[tp] = _values(tp, list(dataclasses.fields(tp)))  # type: ignore[arg-type]
        return _POSITIONAL[tp]
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        table = {a: c for a in args if (c := _wire(a)) is not None}
        if not table:
            return None
        if not all(dataclasses.is_dataclass(a) for a in table):
            raise TypeError(f"unsupported annotation in a message: {tp!r}")
        return lambda v: table[type(v)](v) if type(v) in table else v
    if origin is dict:
        val = _wire(args[1])
        return None if val is None else (lambda v: {k: val(x) for k, x in v.items()})
    if origin is list:
        item = _wire(args[0])
        return None if item is None else (lambda v: [item(x) for x in v])
    if origin is tuple:
        items = [_wire(a) for a in args]
        if not any(items):
            return None
        return lambda v: [x if c is None else c(x) for c, x in zip(items, v)]
    return None


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
    if v < _SINCE[name]:
        raise ProtocolError(f"message type {name!r} needs protocol version {_SINCE[name]} or later", rid)
    return body


def _request_id(body: dict[Any, Any]) -> str | None:
    rid = body.get("request_id")
    return rid if type(rid) is str else None


def decode(frame: bytes, accepted: frozenset[str]) -> Any:
    """Bytes -> a validated message instance whose type is in `accepted`."""
    return from_dict(unpack(frame), accepted)


def from_dict(body: dict[str, Any], accepted: frozenset[str]) -> Any:
    """A header-checked dict (`unpack`) -> a validated message instance whose type is in `accepted`."""
    name = body["type"]
    rid = _request_id(body)
    if name not in accepted:
        raise ProtocolError(f"message type {name!r} not accepted here", rid)
    cls = _REGISTRY[name]
    spec = _decoders(cls)
    if not body.keys() <= spec.keys() | _HEADER:
        unknown = body.keys() - spec.keys() - _HEADER
        raise ProtocolError(f"{name}: unknown field(s) {short_repr(sorted(map(str, unknown)))}", rid)
    if newer := sorted(f for f, since in _FIELD_SINCE[cls].items() if since > body["v"] and f in body):
        raise ProtocolError(f"{name}: field {newer[0]!r} needs protocol version {_FIELD_SINCE[cls][newer[0]]} or later "
                            f"(the frame is version {body['v']}: upgrade the client)", rid)
    kwargs: dict[str, Any] = {}
    try:
        for field, (conv, required) in spec.items():
            if field in body:
                kwargs[field] = conv(body[field], field)
            elif required:
                raise ProtocolError(f"missing field {field!r}")
        if len({len(kwargs.get(c, ())) for c in _COLUMNS[cls]}) > 1:
            raise ProtocolError(f"columns {', '.join(_COLUMNS[cls])} differ in length")
        if (opt := _OPTIONAL_COLUMNS[cls]) and any(
                len(kwargs.get(c, ())) not in (0, len(kwargs.get(_COLUMNS[cls][0], ()))) for c in opt):
            raise ProtocolError(f"columns {', '.join(opt)} are neither empty nor as long as {_COLUMNS[cls][0]}")
    except ProtocolError as e:
        raise ProtocolError(f"{name}: {e}", rid) from None
    return cls(**kwargs)


def columns(body: dict[str, Any], cls: type, *names: str) -> list[Any]:
    """Required columns `names` of a header-checked dict (`unpack`) of message `cls`, each checked as `from_dict`
    checks it and all equally long: what a relay routes by, without building the rest (a row's log
    probabilities, texts)."""
    spec, out = _decoders(cls), []
    try:
        for name in names:
            if name not in body:
                raise ProtocolError(f"missing field {name!r}")
            out.append(spec[name][0](body[name], name))
        if len(set(map(len, out))) > 1:
            raise ProtocolError(f"columns {', '.join(names)} differ in length")
    except ProtocolError as e:
        raise ProtocolError(f"{body['type']}: {e}", _request_id(body)) from None
    return out


def _decoders(cls: type) -> dict[str, tuple[Conv, bool]]:
    if cls not in _DECODERS:
        hints = typing.get_type_hints(cls)
        _DECODERS[cls] = {
            f.name: (_converter(hints[f.name]), f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
            for f in dataclasses.fields(cls)
        }
        _FIELD_SINCE[cls] = {f.name: f.metadata["since"] for f in dataclasses.fields(cls) if f.metadata.get("since", 1) > 1}
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
        if nullable and len(convs) == 1:  # X | None: one test, no try (finals, optional fields)
            conv = convs[0]
            return lambda v, p: None if v is None else conv(v, p)

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
        item = _converter(args[0])

        def each(v: Any, p: str) -> list[Any]:
            return [item(x, p) for x in _seq(v, p)]

        kept = _kept_types(args[0])
        inner = _kept_types(typing.get_args(args[0])[0]) if typing.get_origin(args[0]) is list else None
        if kept is None and inner is None:
            return each
        # fast path, one C loop (map(type) and the set test run in C: ~40 ns an item less): token ids, block
        # tables, request ids, columns, new tokens per request, log probabilities
        converts = float in (kept or inner)   # type: ignore[operator]

        def scalars(v: Any, p: str) -> list[Any]:
            if type(v) is list and (kept.issuperset(map(type, v)) if kept is not None else _LIST.issuperset(map(type, v))
                                    and inner.issuperset(map(type, chain.from_iterable(v)))):  # type: ignore[union-attr]
                return v
            if converts:   # an int where a float goes: converted (or refused) one by one
                return each(v, p)
            raise _fail(p, str(tp), v)

        return scalars
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
        convs = [c for c, _ in spec.values()]

        def nested(v: Any, p: str) -> Any:
            v = _seq(v, p)
            if len(v) != len(spec):
                raise _fail(p, f"{tp.__name__} as {len(spec)} items", v)
            try:   # each field's path is made only for a refusal's message (a row's log probabilities: 16% less)
                return tp(*[c(x, p) for c, x in zip(convs, v)])
            except ProtocolError:
                return tp(*[c(x, f"{p}.{n}") for (n, (c, _)), x in zip(spec.items(), v)])   # raises, naming the field

        return nested
    raise TypeError(f"unsupported annotation in a message: {tp!r}")


def _kept_types(tp: Any) -> frozenset[type] | None:
    """The types a value of `tp` may have when each is checked by `type(v) is` and kept as it is
    (bool, int, str, bytes, float, and unions of them with None); None for any other annotation."""
    members = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    return frozenset(members) if all(m in _SCALARS or m is float for m in members) else None


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
