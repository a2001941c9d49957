"""Fast frame decoding for replay: msgspec structs derived from the pydantic event models.

Replay reads every event of a run once and only needs its fields as columns; a full pydantic model per
event (~15 µs for a Step, most of it validation in Rust plus Python callbacks for the arrays) is what made
replay several times slower than fetching. Here each event type the models allow it for gets a
``msgspec.Struct`` *derived* from its model (same fields, defaults and constraints; nothing is declared
twice), decoded in C, and then the model's own ``mode="after"`` validators run on the struct. Arrays
stay zero-copy views of the frame.

The fast path only ever accepts a subset of what the model accepts: anything it does not recognise or
refuses (an older schema version to upcast, a missing field the model would default with a factory, a
lax coercion pydantic allows, a constraint it cannot express) falls back to ``schemas.codec.decode``,
which either returns the model or raises the same ``EventDecodeError`` as before. So malformed and
unknown-version events are reported exactly as they always were.
"""

from __future__ import annotations

import re
from functools import lru_cache
from datetime import datetime
from types import NoneType, UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types as at
import msgspec
import numpy as np
from pydantic import BaseModel, JsonValue
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from schemas import codec
from schemas.arrays import BLOB_KEY, _ArrayAnnotation
from schemas.envelope import Event
from schemas.events import EVENTS_BY_TYPE


class Unsupported(TypeError):
    """A model feature the derived struct cannot mirror exactly: that event type always takes the slow path."""


class Blob(msgspec.Struct, forbid_unknown_fields=True, array_like=False):
    ref: tuple[int, int] = msgspec.field(name=BLOB_KEY)


# Datetimes are decoded as text in the one form both parsers read alike (pydantic's own output: RFC 3339 with a
# zone, no or 6 fractional digits), then parsed by datetime.fromisoformat. msgspec would round a 7th digit
# where pydantic truncates; anything else goes to pydantic.
_RFC3339 = Annotated[str, msgspec.Meta(
    pattern=r"^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]{6})?(Z|[+-][0-9]{2}:[0-9]{2})\Z")]


class _Derived:
    """One model's struct, its array fields (name -> dtype) and nested struct fields that hold arrays."""

    def __init__(self, model: type[BaseModel]) -> None:
        self.model = model
        self.arrays: dict[str, np.dtype] = {}
        self.nested: dict[str, tuple[_Derived, bool]] = {}  # field -> (derived, is a list)
        self.datetimes: list[str] = []
        fields: list[tuple[str, Any, Any]] = []
        if model.model_config.get("extra") not in ("forbid", None, "ignore"):
            raise Unsupported(f"{model.__name__}: extra={model.model_config.get('extra')!r}")
        decorators = model.__pydantic_decorators__
        if decorators.field_validators or decorators.field_serializers or decorators.validators \
                or any(d.info.mode != "after" for d in decorators.model_validators.values()):
            raise Unsupported(f"{model.__name__}: validators other than mode='after' model validators")
        self.validators = [d.func for d in decorators.model_validators.values()]
        for name, info in model.model_fields.items():
            if info.alias or info.validation_alias:
                raise Unsupported(f"{model.__name__}.{name}: aliases")
            typ = self._field_type(name, info)
            if info.default_factory in (list, dict):
                default = msgspec.field(default_factory=info.default_factory)
            elif info.default_factory is not None or info.default is PydanticUndefined:
                default = msgspec.NODEFAULT  # required here; a missing value goes to pydantic (new_id, utcnow...)
            else:
                default = info.default
            fields.append((name, typ, default))
        namespace = {k: getattr(model, k) for k in ("EVENT_TYPE", "SCHEMA_VERSION") if hasattr(model, k)}
        self.struct = msgspec.defstruct(
            f"{model.__name__}Frame", [(n, t) if d is msgspec.NODEFAULT else (n, t, d) for n, t, d in fields],
            namespace=namespace, forbid_unknown_fields=model.model_config.get("extra") == "forbid", kw_only=True)

    def _field_type(self, name: str, info: FieldInfo) -> Any:
        arrays = [m for m in info.metadata if isinstance(m, _ArrayAnnotation)]
        if arrays:
            self.arrays[name] = arrays[0].dtype
            return Blob
        base = info.annotation
        if base is datetime or _optional_parts(base) == (datetime,):
            self.datetimes.append(name)
            typ = _RFC3339 if base is datetime else _RFC3339 | None
            return _constrain(typ, info.metadata, f"{self.model.__name__}.{name}")
        typ = _type(base)
        for opt in (base, *_optional_parts(base)):
            inner, is_list = _list_item(opt)
            if isinstance(inner, type) and issubclass(inner, BaseModel):
                derived = derive(inner)
                if derived.arrays or derived.nested or derived.validators or derived.datetimes:
                    self.nested[name] = (derived, is_list)
        return _constrain(typ, info.metadata, f"{self.model.__name__}.{name}")

    def finish(self, obj: Any, blobs: memoryview) -> None:
        """Arrays as zero-copy views of the frame, then the model's validators (ValueError: not valid)."""
        for name, dtype in self.arrays.items():
            offset, count = getattr(obj, name).ref
            if offset < 0 or count < 0 or offset + count * dtype.itemsize > len(blobs):
                raise ValueError(f"{name}: blob reference outside the frame")
            arr = np.frombuffer(blobs, dtype=dtype, count=count, offset=offset)
            setattr(obj, name, arr)
        for name in self.datetimes:
            value = getattr(obj, name)
            if value is not None:
                setattr(obj, name, datetime.fromisoformat(value))
        for name, (derived, is_list) in self.nested.items():
            value = getattr(obj, name)
            for item in (value if is_list else () if value is None else (value,)):
                derived.finish(item, blobs)
        for check in self.validators:
            check(obj)


def _optional_parts(t: Any) -> tuple[Any, ...]:
    if get_origin(t) in (Union, UnionType):
        return tuple(a for a in get_args(t) if a is not NoneType)
    return ()


def _list_item(t: Any) -> tuple[Any, bool]:
    return (get_args(t)[0], True) if get_origin(t) is list else (t, False)


def _type(t: Any) -> Any:
    """The msgspec type mirroring a pydantic annotation (nested models become their derived structs)."""
    if t is JsonValue:
        return Any
    if t in (str, int, float, bool, NoneType):
        return t
    if t is Any:
        raise Unsupported("Any")
    if isinstance(t, type) and issubclass(t, BaseModel):
        return derive(t).struct
    origin, args = get_origin(t), get_args(t)
    if origin is Literal and all(isinstance(a, str) for a in args):
        return t
    if origin in (Union, UnionType):
        return Union[tuple(_type(a) for a in args)]  # noqa: UP007
    if origin is list:
        return list[_type(args[0])]
    if origin is dict and args[0] is str:
        return dict[str, _type(args[1])]
    raise Unsupported(f"type {t!r}")


# annotated-types bounds and their msgspec.Meta names (each holds its value under that same attribute)
_BOUNDS = {at.Ge: "ge", at.Gt: "gt", at.Le: "le", at.Lt: "lt", at.MinLen: "min_length", at.MaxLen: "max_length"}


def _constrain(typ: Any, metadata: list[Any], where: str) -> Any:
    kw: dict[str, Any] = {}
    for m in metadata:
        if type(m) in _BOUNDS:
            kw[_BOUNDS[type(m)]] = getattr(m, _BOUNDS[type(m)])
        elif getattr(m, "pattern", None) is not None and set(vars(m)) == {"pattern"}:
            kw["pattern"] = _anchored(m.pattern)
        else:
            raise Unsupported(f"{where}: constraint {m!r}")
    if not kw:
        return typ
    inner = _optional_parts(typ)
    if inner:  # Optional[constrained]: the constraint applies to the value, not to None
        if len(inner) != 1:
            raise Unsupported(f"{where}: constraint on a union")
        return Annotated[inner[0], msgspec.Meta(**kw)] | None
    return Annotated[typ, msgspec.Meta(**kw)]


def _anchored(pattern: str) -> str:
    """pydantic matches patterns with Rust's regex, where ``$`` is the end of the text; Python's ``$`` also
    matches before a final newline, so it becomes ``\\Z`` here (never more lenient than the model)."""
    if pattern.endswith("$") and not pattern.endswith("\\$"):
        return pattern[:-1] + r"\Z"
    if re.search(r"(?<!\\)\$", pattern):
        raise Unsupported(f"pattern {pattern!r}")
    return pattern


@lru_cache(maxsize=None)
def derive(model: type[BaseModel]) -> _Derived:
    return _Derived(model)


# Event types whose replay columns are built from their fields alone. Training records and trainer batches
# are not among them: their columns include record digests, which schemas.digests computes from the model.
FAST_TYPES = ("policy_revision", "step", "rollout", "rollout_scored", "admission_claim", "admission_done",
              "admission_renew", "admission_release", "admission_refund", "admission_rebase")


def _decoders() -> dict[str, tuple[int, _Derived, msgspec.json.Decoder]]:
    out = {}
    for event_type in FAST_TYPES:
        cls = EVENTS_BY_TYPE[event_type]
        try:
            d = derive(cls)
        except Unsupported:
            continue
        out[event_type] = (cls.SCHEMA_VERSION, d, msgspec.json.Decoder(d.struct))
    return out


_DECODERS = _decoders()


def decode(frame: bytes) -> Event | Any:
    """A frame's event: its derived struct when the fast path accepts it, else ``schemas.codec.decode``'s model
    (or its ``EventDecodeError``). Both have the same attributes and values."""
    if type(frame) is bytes:
        try:
            event_type, version, header, blobs = codec._split(memoryview(frame))
            entry = _DECODERS.get(event_type)
            if entry is not None and version == entry[0]:
                obj = entry[2].decode(header)
                entry[1].finish(obj, blobs)
                return obj
        except (msgspec.ValidationError, msgspec.DecodeError, ValueError, TypeError, AttributeError):
            pass
        except Exception:  # noqa: BLE001 - whatever the fast path trips on, the model decides
            pass
    return codec.decode(frame)


def fast_types() -> list[str]:
    """Event types with a fast path (the others always decode through their pydantic model)."""
    return sorted(_DECODERS)
