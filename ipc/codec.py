"""msgpack codec for the types of `ipc.messages`. Used by every process; no pickle anywhere.

A `Codec` is built for one channel with the message types that channel may carry, so a
message sent to the wrong socket fails loudly with a `ProtocolError` instead of misbehaving.
"""

from __future__ import annotations

import dataclasses
import enum
import operator
import types
import typing
from collections.abc import Callable, Iterable
from typing import Any

import msgpack

from ipc.messages import ALL_MESSAGES, Message, Struct

Decoder = Callable[[Any], Any]


class ProtocolError(ValueError):
    """Bytes that are not a valid message of the expected types. `raw` is what was unpacked."""

    def __init__(self, message: str, raw: Any = None) -> None:
        super().__init__(message)
        self.raw = raw


_GETTERS: dict[type, Callable[[Any], tuple[Any, ...]]] = {}


def _fields_of(cls: type) -> Callable[[Any], tuple[Any, ...]]:
    """A struct's field values in order, by one attrgetter (dataclasses.fields per object
    was a third of the cost of encoding a batch)."""
    getter = _GETTERS.get(cls)
    if getter is None:
        names = [f.name for f in dataclasses.fields(cls)]
        if len(names) > 1:
            getter = operator.attrgetter(*names)  # type: ignore[assignment]
        elif names:
            one = operator.attrgetter(names[0])
            getter = lambda obj: (one(obj),)  # noqa: E731
        else:
            getter = lambda obj: ()  # noqa: E731
        _GETTERS[cls] = getter  # type: ignore[assignment]
    return getter  # type: ignore[return-value]


def _to_wire(obj: Any) -> Any:
    getter = _GETTERS.get(type(obj))  # (a struct seen before: one per delta in a batch)
    if getter is not None:
        return getter(obj)
    if isinstance(obj, Struct):
        return _fields_of(type(obj))(obj)  # a tuple: packed as an array
    raise TypeError(f"cannot encode {type(obj).__name__}")


def _wire_field(value: Any) -> Any:
    """A message's field as packed: a list of structs of one type seen before (a batch's
    deltas or outputs) as a list of their tuples, made in one pass, where msgpack would call
    `default` once an item (most of the cost of encoding a step's DetokBatch)."""
    if type(value) is list and value:
        getter = _GETTERS.get(type(value[0]))
        if getter is not None and len(set(map(type, value))) == 1:
            return list(map(getter, value))
    return value


def encode(msg: Message) -> bytes:
    return msgpack.packb((msg.TAG, *map(_wire_field, _fields_of(type(msg))(msg))),
                         default=_to_wire, use_bin_type=True)


def _scalar(tp: type, name: str) -> Decoder:
    def check(v: Any) -> Any:
        if tp is float and type(v) is int:
            return float(v)
        if type(v) is not tp:
            raise ProtocolError(f"{name}: expected {tp.__name__}, got {type(v).__name__}")
        return v

    return check


def _one_of(tps: tuple[type, ...], name: str) -> Decoder:
    def check(v: Any) -> Any:
        if type(v) not in tps:
            raise ProtocolError(f"{name}: expected one of {[t.__name__ for t in tps]}, "
                                f"got {type(v).__name__}")
        return v

    return check


def _enum(tp: type[enum.Enum], name: str) -> Decoder:
    by_value = {m.value: m for m in tp}

    def check(v: Any) -> Any:
        try:
            return by_value[v]
        except (KeyError, TypeError):
            raise ProtocolError(f"{name}: {v!r} is not a {tp.__name__}") from None

    return check


def _optional(inner: Decoder) -> Decoder:
    return lambda v: None if v is None else inner(v)


def _list_of(inner: Decoder, name: str, item_tp: Any) -> Decoder:
    if item_tp in (int, str):  # hot paths: token ids, a batch's request ids (TokenColumns)

        def check_items(v: Any) -> Any:
            if type(v) is not list or not all(type(x) is item_tp for x in v):
                raise ProtocolError(f"{name}: expected a list of {item_tp.__name__}")
            return v

        return check_items

    def check(v: Any) -> Any:
        if type(v) is not list:
            raise ProtocolError(f"{name}: expected a list, got {type(v).__name__}")
        return [inner(x) for x in v]

    return check


def _dict_of(inner: Decoder, name: str) -> Decoder:
    def check(v: Any) -> Any:
        if type(v) is not dict or not all(type(k) is str for k in v):
            raise ProtocolError(f"{name}: expected a map with string keys")
        return {k: inner(x) for k, x in v.items()}

    return check


def _compile(tp: Any, name: str) -> Decoder:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) > 1 and all(a in (int, str) for a in args):
            return _optional(_one_of(tuple(args), name))
        if len(args) != 1:
            raise TypeError(f"{name}: only `X | None` and unions of int and str are supported")
        return _optional(_compile(args[0], name))
    if origin is list:
        (item,) = typing.get_args(tp)
        return _list_of(_compile(item, f"{name}[]"), name, item)
    if origin is dict:
        _, value = typing.get_args(tp)
        return _dict_of(_compile(value, f"{name}{{}}"), name)
    if isinstance(tp, type) and issubclass(tp, Struct):
        return _struct_decoder(tp)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return _enum(tp, name)
    if tp in (int, float, str, bool, bytes):
        return _scalar(tp, name)
    raise TypeError(f"{name}: unsupported wire type {tp!r}")


_STRUCT_DECODERS: dict[type, Decoder] = {}


def _struct_decoder(cls: type) -> Decoder:
    if cls in _STRUCT_DECODERS:
        return _STRUCT_DECODERS[cls]
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    decoders = [_compile(hints[f.name], f"{cls.__name__}.{f.name}") for f in fields]
    num_required = sum(
        f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        for f in fields
    )

    def decode_any(v: Any) -> Any:
        if type(v) is not list:
            raise ProtocolError(f"{cls.__name__}: expected an array, got {type(v).__name__}")
        if not num_required <= len(v) <= len(decoders):
            raise ProtocolError(
                f"{cls.__name__}: {len(v)} fields, expected {num_required}..{len(decoders)}"
            )
        return cls(*[d(x) for d, x in zip(decoders, v, strict=False)])  # v may be shorter

    if not decoders:
        _STRUCT_DECODERS[cls] = decode_any
        return decode_any
    decode = _complete_decoder(cls, [hints[f.name] for f in fields], decoders, decode_any)
    _STRUCT_DECODERS[cls] = decode
    return decode


_INT_ONLY = frozenset({int})


def _check_line(i: int, tp: Any) -> str:
    """Python source that checks field i in place; on anything unusual it hands the value to
    the field's full decoder D{i}, which converts it (int for float) or raises the error."""
    x, full = f"x{i}", f"x{i} = D{i}(x{i})"
    if tp in (int, str, bool, bytes, float):
        return f"    if type({x}) is not {tp.__name__}: {full}"
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and len(args) == 2 and \
            type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        if inner in (int, str, bool, float):
            return f"    if {x} is not None and type({x}) is not {inner.__name__}: {full}"
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args:
        return f"    if {x} is not None: {full}"  # (most are None: a call saved per field)
    if typing.get_origin(tp) is list and args == (int,):  # (one id, the common case, apart)
        return (f"    if type({x}) is not list or (type({x}[0]) is not int if len({x}) == 1 "
                f"else not set(map(type, {x})) <= INT_ONLY): {full}")
    return f"    {full}"


def _complete_decoder(cls: type, hints: list[Any], decoders: list[Decoder],
                      decode_any: Decoder) -> Decoder:
    """A decoder of cls, generated once per struct type so that an array with every field
    has the common fields (str, int, list of int, None) checked inline, in one call; any
    other value goes to decode_any. Decoding was most of the detokenizer's and the client's
    time per step. Same checks, same errors as the rest."""
    names = [f"x{i}" for i in range(len(hints))]
    lines = ["def complete(v):",
             f"    if type(v) is not list or len(v) != {len(names)}: return decode_any(v)",
             f"    {', '.join(names)}{',' if len(names) == 1 else ''} = v"]
    lines += [_check_line(i, tp) for i, tp in enumerate(hints)]
    lines.append(f"    return cls({', '.join(names)})")
    scope: dict[str, Any] = {"cls": cls, "INT_ONLY": _INT_ONLY, "decode_any": decode_any,
                             **{f"D{i}": d for i, d in enumerate(decoders)}}
    exec("\n".join(lines), scope)  # noqa: S102 (our own source, from type hints)
    return scope["complete"]  # type: ignore[no-any-return]


class Codec:
    """Decodes only the message types it was built with; encodes any message."""

    def __init__(self, accepted: Iterable[type[Message]]) -> None:
        self._decoders = {cls.TAG: (cls, _struct_decoder(cls)) for cls in accepted}

    encode = staticmethod(encode)

    def decode(self, data: bytes) -> Message:
        try:
            raw = msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=True)
        except Exception as exc:  # msgpack raises several unrelated types
            raise ProtocolError(f"malformed msgpack: {exc}") from None
        if type(raw) is not list or not raw or type(raw[0]) is not int:
            raise ProtocolError("not a tagged message array", raw)
        entry = self._decoders.get(raw[0])
        if entry is None:
            raise ProtocolError(f"unexpected message tag {raw[0]} on this channel", raw)
        try:
            return entry[1](raw[1:])
        except ValueError as exc:  # (a ProtocolError, or a struct's own check: same_length)
            raise ProtocolError(str(exc), raw) from None


def _check_tags_unique() -> None:
    tags = [m.TAG for m in ALL_MESSAGES]
    if len(tags) != len(set(tags)):
        raise RuntimeError("duplicate message TAG in ipc.messages")


_check_tags_unique()
