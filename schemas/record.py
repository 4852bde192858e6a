"""The base of every typed record (:mod:`dora_rl.schemas.records`): field kinds, Avro conversion, wire encoding.

Wire bytes kept (the stream processors' hot path, ``bench/pipeline.py``). A record decoded with
``keep_wire=True`` from bytes written with the current schema keeps those bytes, and :meth:`Record.encode`
returns them instead of encoding again (records are frozen, and :meth:`Record.replace` makes a new
record without them). The scorer's :meth:`Trajectory.scored` rewrites only the last three fields of the
kept bytes, and :meth:`TrainBatch.encode` writes the array of its trajectories as their concatenated
encodings, each the kept bytes where there are some: both are byte for byte what the full encoding
writes (``tests/unit/test_wire_reuse.py``), and both fall back to it when the schema's field order is not
the one they rely on. The price: a record that keeps its bytes holds its payload twice.
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from functools import cache
from typing import Any, ClassVar, TypeVar

import numpy as np

from . import codec

__all__ = ["F32", "I32", "I64", "Record", "avro_long", "last_fields", "nested", "nested_one", "packed"]

R = TypeVar("R", bound="Record")

I32 = np.dtype("<i4")
F32 = np.dtype("<f4")
I64 = np.dtype("<i8")


def packed(dtype: np.dtype[Any], *, optional: bool = False) -> Any:
    """Field holding a numpy array that travels as packed little-endian bytes."""
    if optional:
        return field(default=None, metadata={"packed": dtype})
    return field(metadata={"packed": dtype})


def nested(cls: type[Record]) -> Any:
    """Field holding a tuple of nested records."""
    return field(metadata={"nested": cls})


def nested_one(cls: type[Record]) -> Any:
    """Field holding one optional nested record (None: the Avro union's null)."""
    return field(default=None, metadata={"nested_one": cls})


_PLANS: dict[type, tuple[tuple[str, str, Any], ...]] = {}


def _plan(cls: type) -> tuple[tuple[str, str, Any], ...]:
    """(field name, kind, argument) per field of a record class, computed once: kind is ``packed`` (the
    dtype), ``nested`` / ``nested_one`` (the class) or empty (a plain value)."""
    plan = _PLANS.get(cls)
    if plan is None:
        kinds = [(f, next((k for k in ("packed", "nested", "nested_one") if k in f.metadata), ""))
                 for f in dataclasses.fields(cls)]
        plan = _PLANS[cls] = tuple((f.name, k, f.metadata[k] if k else None) for f, k in kinds)
    return plan


@cache
def last_fields(name: str, n: int) -> tuple[str, ...]:
    """Names of the last ``n`` fields of the current schema of record ``name``."""
    return tuple(f["name"] for f in codec.schema_for(name)["fields"][-n:])


@cache
def _headers(name: str) -> tuple[tuple[str, bytes], ...]:
    """The headers :func:`codec.encode` writes for record ``name``."""
    return ((codec.HEADER_SCHEMA, name.encode()), (codec.HEADER_FINGERPRINT, codec.current_fingerprint(name).encode()))


def avro_long(n: int) -> bytes:
    """Avro's encoding of a long: zigzag, then a little-endian base-128 varint."""
    z, out = (n << 1) ^ (n >> 63), bytearray()
    while z > 0x7F:
        out.append((z & 0x7F) | 0x80)
        z >>= 7
    out.append(z)
    return bytes(out)


class Record:
    """Base of all records: Avro dict conversion and wire encoding."""

    SCHEMA: ClassVar[str]

    def to_avro(self) -> dict[str, Any]:
        """The Avro datum (dict) of this record."""
        out: dict[str, Any] = {}
        for name, kind, arg in _plan(type(self)):
            value = getattr(self, name)
            if kind == "packed":
                out[name] = None if value is None else np.ascontiguousarray(value, dtype=arg).tobytes()
            elif kind == "nested":
                out[name] = [item.to_avro() for item in value]
            elif kind == "nested_one":
                out[name] = None if value is None else value.to_avro()
            elif isinstance(value, tuple):
                out[name] = list(value)
            elif isinstance(value, dict):
                out[name] = dict(value)
            else:
                out[name] = value
        return out

    @classmethod
    def from_avro(cls: type[R], datum: dict[str, Any]) -> R:
        """Build the record from an Avro datum (as decoded by :func:`codec.decode`)."""
        kwargs: dict[str, Any] = {}
        for name, kind, arg in _plan(cls):
            value = datum[name]
            if kind == "packed":
                if value is not None and len(value) % arg.itemsize:
                    raise codec.DecodeError(f"{cls.SCHEMA}.{name}: {len(value)} bytes is not a whole "
                                            f"number of {arg.itemsize}-byte items")
                kwargs[name] = None if value is None else np.frombuffer(value, dtype=arg)
            elif kind == "nested":
                kwargs[name] = tuple(arg.from_avro(item) for item in value)
            elif kind == "nested_one":
                kwargs[name] = None if value is None else arg.from_avro(value)
            elif isinstance(value, list):
                kwargs[name] = tuple(value)
            else:
                kwargs[name] = value
        return cls(**kwargs)

    def encode(self) -> tuple[bytes, list[tuple[str, bytes]]]:
        """Schemaless Avro bytes and the schema headers (the kept bytes, if any: see the module docstring)."""
        wire = self._wire()
        if wire is not None:
            return wire, list(_headers(self.SCHEMA))
        return codec.encode(self.SCHEMA, self.to_avro())

    def unsigned_encoding(self) -> bytes:
        """The Avro bytes of this record with its ``signature`` field null: what a signature covers
        (``infra/kafka/signing.py``). From kept bytes ending in the signature (the last field), that field is
        cut and written null, with no new encoding."""
        wire, sig = self._wire(), getattr(self, "signature", None)
        if wire is not None and last_fields(self.SCHEMA, 1) == ("signature",):
            tail = b"\0" if sig is None else b"".join((b"\2", avro_long(len(sig.encode())), sig.encode()))
            if wire.endswith(tail):
                return wire[:-len(tail)] + b"\0"
        return self.replace(signature=None).encode()[0]

    def _wire(self) -> bytes | None:
        """The bytes this record was decoded from (current schema, ``keep_wire``), else None."""
        return self.__dict__.get("_wire_bytes")

    def _keep(self: R, wire: bytes) -> R:
        object.__setattr__(self, "_wire_bytes", wire)  # frozen: set once, right after construction
        return self

    @classmethod
    def decode(cls: type[R], value: bytes | None, headers: codec.Headers = None, *, keep_wire: bool = False) -> R:
        """Decode wire bytes; raises :class:`codec.DecodeError` with the reason. ``keep_wire``: the record
        keeps ``value`` for :meth:`encode` when it was written with the current schema."""
        datum = codec.decode(cls.SCHEMA, value, headers)
        try:
            rec = cls.from_avro(datum)
        except (KeyError, TypeError) as exc:
            raise codec.DecodeError(f"{cls.SCHEMA}: {exc}", "schema") from exc
        if keep_wire and value:
            fp = codec._header(headers, codec.HEADER_FINGERPRINT)
            if fp is None or fp == codec.current_fingerprint(cls.SCHEMA):  # else: bytes of an older writer schema
                rec._keep(bytes(value))
        return rec

    def replace(self: R, **changes: Any) -> R:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]
