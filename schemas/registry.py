"""Optional Confluent wire format: records framed with a schema id from a schema registry.

DORA's default stays schemaless (:mod:`dora_rl.schemas.codec`, docs/decisions/0003): the value is the
bare Avro body and the headers name the schema. This module is the opt-in alternative for sites whose
tools expect a registry (Kafka Connect, ksqlDB, confluent-kafka's ``AvroDeserializer``): the value is

    byte 0: magic 0 | bytes 1-4: schema id, big-endian | the same schemaless Avro body codec writes

with the schema registered under the subject ``<topic>-value`` (Confluent's TopicNameStrategy) of any
registry speaking the Confluent REST API (Confluent Schema Registry, Karapace, Apicurio Registry's
``/apis/ccompat/v7``; docs/decisions/0022).

Invariants:

- the body after the 5-byte prefix is byte for byte what :func:`codec.encode` writes, and the headers
  are codec's plus ``dora.wire: confluent``; so a value converts either way by adding or stripping 5 bytes;
- the registered schema is the current ``.avsc`` (docs and defaults kept, named types expanded inline so
  it stands alone), hence ``AvroDeserializer`` with no reader schema decodes exactly codec's datum;
- reading resolves the registry's writer schema into the current reader schema (Avro rules), and any
  failure is a :class:`codec.DecodeError`, so a caller dead-letters it as it would a schemaless record.

The REST calls are ``confluent_kafka.schema_registry``'s (``pip install "dora-rl[registry]"`` for what that
client imports); ids and schemas are cached per client.
"""

from __future__ import annotations

import io
import json
import struct
from functools import cache
from typing import Any, TypeVar

import fastavro

from . import codec
from .records import Record

MAGIC = 0
HEADER_WIRE = "dora.wire"
WIRE_CONFLUENT = b"confluent"
R = TypeVar("R", bound=Record)


def _strip(node: Any) -> Any:
    """A parsed fastavro schema without fastavro's private keys (``__fastavro_parsed``, ...)."""
    if isinstance(node, dict):
        return {k: _strip(v) for k, v in node.items() if not k.startswith("__")}
    if isinstance(node, list):
        return [_strip(v) for v in node]
    return node


NAMED = ("record", "enum", "fixed")


def _definitions(node: Any, out: dict[str, Any]) -> dict[str, Any]:
    """Every named type defined in ``node`` (fastavro's parsed form: full names), by name."""
    if isinstance(node, dict):
        if node.get("type") in NAMED and "name" in node:
            out.setdefault(node["name"], node)
        for v in node.values():
            _definitions(v, out)
    elif isinstance(node, list):
        for v in node:
            _definitions(v, out)
    return out


def _expand(node: Any, known: dict[str, Any], defined: set[str]) -> Any:
    """``node`` with each named type referenced by name defined inline at its first use (Avro allows one
    definition per name in a document, later uses stay names)."""
    if isinstance(node, str):
        if node in known and node not in defined:
            return _expand(known[node], known, defined)
        return node
    if isinstance(node, list):
        return [_expand(v, known, defined) for v in node]
    if isinstance(node, dict):
        if node.get("type") in NAMED and "name" in node:
            defined.add(node["name"])
        return {k: v if k in ("name", "doc", "default", "symbols") else _expand(v, known, defined)
                for k, v in node.items()}
    return node


@cache
def registry_schema(name: str) -> str:
    """The current schema of record ``name`` as the standalone JSON a registry stores (every named type
    it uses defined inline, docs and defaults kept)."""
    schemas = {n: _strip(p) for n, p in codec.current_schemas().items()}
    known: dict[str, Any] = {}
    for parsed in schemas.values():
        _definitions(parsed, known)
    return json.dumps(_expand(schemas[name], known, set()), separators=(",", ":"))


def subject(topic: str) -> str:
    """TopicNameStrategy: the value subject of ``topic``."""
    return f"{topic}-value"


class RegistryError(RuntimeError):
    """The registry refused a request or could not be reached (the message names the URL and status)."""


class SchemaRegistry:
    """The two registry calls the codec needs (register, schema by id) on ``confluent_kafka``'s own
    :class:`~confluent_kafka.schema_registry.SchemaRegistryClient` (which caches both); its errors become
    :class:`RegistryError` naming the URL."""

    def __init__(self, url: str, timeout_s: float = 10.0) -> None:
        from confluent_kafka.schema_registry import SchemaRegistryClient

        self.url = url.rstrip("/")
        self._client = SchemaRegistryClient({"url": self.url, "timeout": timeout_s})

    def register(self, subject_name: str, schema: str) -> int:
        """The id of ``schema`` under ``subject_name``, registering it when new (idempotent)."""
        from confluent_kafka.schema_registry import Schema

        try:
            return int(self._client.register_schema(subject_name, Schema(schema, "AVRO")))
        except Exception as exc:
            raise RegistryError(f"registering {subject_name!r} at {self.url}: {exc}") from exc

    def schema(self, schema_id: int) -> str:
        """The schema text registered under ``schema_id``."""
        try:
            return str(self._client.get_schema(schema_id).schema_str)
        except Exception as exc:
            raise RegistryError(f"schema id {schema_id} at {self.url}: {exc}") from exc


class ConfluentCodec:
    """Encodes/decodes records in the Confluent wire format against one registry (module docstring)."""

    def __init__(self, registry: SchemaRegistry) -> None:
        self.registry = registry
        self._writers: dict[int, Any] = {}

    def encode(self, topic: str, record: Record) -> tuple[bytes, list[tuple[str, bytes]]]:
        """(value, headers) of ``record`` for ``topic``; registers its schema on first use."""
        body, headers = record.encode()
        schema_id = self.registry.register(subject(topic), registry_schema(record.SCHEMA))
        return struct.pack(">bI", MAGIC, schema_id) + body, [*headers, (HEADER_WIRE, WIRE_CONFLUENT)]

    def decode_datum(self, name: str, value: bytes | None) -> dict[str, Any]:
        """The Avro datum of a framed value, read as the current schema of ``name``."""
        if value is None or len(value) < 5 or value[0] != MAGIC:
            raise codec.DecodeError(f"not a Confluent-framed {name} (magic byte {MAGIC} + 4-byte id)")
        (schema_id,) = struct.unpack(">I", value[1:5])
        try:
            writer = self._writers.get(schema_id)
            if writer is None:
                writer = self._writers[schema_id] = fastavro.parse_schema(json.loads(self.registry.schema(schema_id)))
        except (RegistryError, ValueError) as exc:
            raise codec.DecodeError(f"writer schema {schema_id} of {name}: {exc}", "schema") from exc
        buf = io.BytesIO(value[5:])
        try:
            out = fastavro.schemaless_reader(buf, writer, codec.schema_for(name))
        except Exception as exc:  # fastavro raises many types on garbage input
            raise codec.DecodeError(f"malformed {name}: {type(exc).__name__}: {exc}") from exc
        if buf.tell() != len(value) - 5 or not isinstance(out, dict):
            raise codec.DecodeError(f"malformed {name}: {len(value) - 5 - buf.tell()} trailing bytes")
        return out

    def decode(self, cls: type[R], value: bytes | None) -> R:
        """The typed record of a framed value."""
        return cls.from_avro(self.decode_datum(cls.SCHEMA, value))


def is_confluent(headers: codec.Headers) -> bool:
    """True when the headers say the value is Confluent-framed (``dora.wire: confluent``)."""
    items = headers.items() if isinstance(headers, dict) else (headers or ())
    return any(k == HEADER_WIRE and v == WIRE_CONFLUENT for k, v in items)
