"""Typed, frozen records: one class per ``.avsc`` schema, with the writer and readers named.

Each class mirrors its schema field for field (a test checks the two agree). Token ids and
log-probs are numpy arrays here and packed little-endian buffers on the wire (``<i4`` ids,
``<f4`` log-probs, ``<i8`` per-token versions), which is ~150x faster than Avro arrays.

The machinery every record shares (Avro conversion, the wire bytes kept) is :mod:`dora_rl.schemas.record`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from dora_rl.core.staleness import StalenessBound

from . import codec
from .record import F32, I32, I64, Record, avro_long, last_fields, nested, nested_one, packed


@dataclass(frozen=True, eq=False)
class Prompt(Record):
    """Written by the dataset producer; read by the orchestrator. Topic ``dora.prompts``."""

    SCHEMA: ClassVar[str] = "dora.v1.Prompt"
    run_id: str
    prompt_id: str
    group_id: str
    task: str
    prompt_text: str
    prompt_ids: np.ndarray = packed(I32)
    reference: str = ""
    created_ms: int = 0


@dataclass(frozen=True)
class TensorEntry(Record):
    """One tensor inside a weight bucket (nested in :class:`PolicyVersion`)."""

    SCHEMA: ClassVar[str] = "dora.v1.TensorEntry"
    name: str
    dtype: str
    shape: tuple[int, ...]
    bucket: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class BucketEntry(Record):
    """One contiguous weight bucket and its checksum (nested in :class:`PolicyVersion`)."""

    SCHEMA: ClassVar[str] = "dora.v1.BucketEntry"
    index: int
    nbytes: int
    checksum: str


@dataclass(frozen=True)
class KvTransfer(Record):
    """Where a migrating trajectory's KV rows wait (nested in :class:`TokenChunk` and :class:`RolloutRequest`):
    the exporting instance's holder serves them under ``transfer`` as the manifest these entries describe."""

    SCHEMA: ClassVar[str] = "dora.v1.KvTransfer"
    holder: str
    transfer: int
    total_bytes: int
    checksum_algo: str
    tensors: tuple[TensorEntry, ...] = nested(TensorEntry)
    buckets: tuple[BucketEntry, ...] = nested(BucketEntry)
    signature: str | None = None

    def unsigned_encoding(self) -> bytes:
        """What its signature covers (``infra/kafka/signing.py``): its fields as sorted compact JSON with
        signature null (a nested record has no wire encoding of its own)."""
        return json.dumps({**self.to_avro(), "signature": None}, sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True, eq=False)
class RolloutRequest(Record):
    """Written by the orchestrator; read by rollout instances. Topic ``dora.rollout.requests``."""

    SCHEMA: ClassVar[str] = "dora.v1.RolloutRequest"
    run_id: str
    trajectory_id: str
    group_id: str
    prompt_id: str
    sample_index: int
    group_size: int
    policy_version: int
    instance_id: str
    action: str
    task: str
    reference: str
    prompt_ids: np.ndarray = packed(I32)
    partial_ids: np.ndarray = packed(I32)
    partial_logprobs: np.ndarray = packed(F32)
    max_new_tokens: int = 0
    dispatched_ms: int = 0
    partial_versions: np.ndarray | None = packed(I64, optional=True)
    kv: KvTransfer | None = nested_one(KvTransfer)


@dataclass(frozen=True, eq=False)
class TokenChunk(Record):
    """Written by rollout instances; read by monitors and the orchestrator. ``dora.rollout.tokens``."""

    SCHEMA: ClassVar[str] = "dora.v1.TokenChunk"
    run_id: str
    trajectory_id: str
    group_id: str
    policy_version: int
    instance_id: str
    start: int
    token_ids: np.ndarray = packed(I32)
    logprobs: np.ndarray = packed(F32)
    final: bool = False
    ts_ms: int = 0
    aborted: bool = False
    kv: KvTransfer | None = nested_one(KvTransfer)
    signature: str | None = None


@dataclass(frozen=True)
class Provenance(Record):
    """Where a re-fed record was first written (nested in :class:`Trajectory` and :class:`TrainBatch`)."""

    SCHEMA: ClassVar[str] = "dora.v1.Provenance"
    source_run_id: str
    source_topic: str
    source_partition: int
    source_offset: int


@dataclass(frozen=True, eq=False)
class Trajectory(Record):
    """Written by rollout instances (unscored) and the scorer (scored); read by scorer / assembler.

    Topics ``dora.rollout.trajectories`` and ``dora.rollout.scored``.
    """

    SCHEMA: ClassVar[str] = "dora.v1.Trajectory"
    run_id: str
    trajectory_id: str
    group_id: str
    prompt_id: str
    sample_index: int
    group_size: int
    policy_version: int
    task: str
    reference: str
    prompt_ids: np.ndarray = packed(I32)
    response_ids: np.ndarray = packed(I32)
    behaviour_logprobs: np.ndarray = packed(F32)
    response_text: str = ""
    finish_reason: str = "STOP"
    instance_id: str = ""
    instance_version: int = -1
    dispatched_ms: int = 0
    first_token_ms: int = 0
    finished_ms: int = 0
    token_versions: np.ndarray | None = packed(I64, optional=True)
    reward: float | None = None
    scored_ms: int | None = None
    provenance: Provenance | None = nested_one(Provenance)
    signature: str | None = None

    @property
    def num_tokens(self) -> int:
        """Response tokens (the ones trained on)."""
        return len(self.response_ids)

    def versions_used(self) -> set[int]:
        """Every policy version that sampled a token of this trajectory (C1: exactly one)."""
        if self.token_versions is None or len(self.token_versions) == 0:
            return {int(self.policy_version)}
        return {int(v) for v in np.unique(self.token_versions)}

    def scored(self, reward: float, scored_ms: int, key: str = "") -> Trajectory:
        """This trajectory with its reward (the scorer's output), signed with ``key`` when one is given:
        ``signature = HMAC-SHA256(key, encoding with signature null)`` (as ``infra/kafka/signing.mac``), in place
        of the instance's signature. From kept bytes whose reward, ``scored_ms`` and provenance are still null,
        the copy's bytes are those with ``reward``, ``scored_ms`` and the signature written in: no new encoding
        (see the module docstring)."""
        out = self.replace(reward=reward, scored_ms=scored_ms, signature=None)  # the instance's signature goes
        wire = self._wire()
        sig = b"\0" if self.signature is None else b"".join((b"\2", avro_long(len(self.signature.encode())),
                                                              self.signature.encode()))
        if not (wire is not None and self.reward is None and self.scored_ms is None and self.provenance is None
                and wire.endswith(b"\0\0\0" + sig)
                and last_fields(self.SCHEMA, 4) == ("reward", "scored_ms", "provenance", "signature")):
            return out.replace(signature=_hmac_hex(key, out.encode()[0])) if key else out
        body = b"".join((wire[:-3 - len(sig)], b"\2", struct.pack("<d", float(reward)), b"\2",
                         avro_long(int(scored_ms)), b"\0\0"))
        if not key:
            return out._keep(body)
        signature = _hmac_hex(key, body)
        return out.replace(signature=signature)._keep(
            b"".join((body[:-1], b"\2", avro_long(len(signature)), signature.encode())))


def _hmac_hex(key: str, body: bytes) -> str:
    """HMAC-SHA256 (hex) of ``body`` keyed by ``key``: the signature rule of ``infra/kafka/signing.py``."""
    return hmac.new(key.encode(), body, hashlib.sha256).hexdigest()


@dataclass(frozen=True, eq=False)
class InstanceStatus(Record):
    """Written by rollout instances; read by the orchestrator and monitors. ``dora.instances``."""

    SCHEMA: ClassVar[str] = "dora.v1.InstanceStatus"
    run_id: str
    instance_id: str
    instance_index: int
    loaded_version: int
    state: str
    in_flight: int
    capacity: int
    in_flight_ids: tuple[str, ...] = ()
    weight_endpoint: str = ""
    generated_tokens: int = 0
    busy_s: float = 0.0
    ts_ms: int = 0
    incarnation: str = ""


@dataclass(frozen=True)
class PolicyVersion(Record):
    """Written by the trainer and holders; read by orchestrator and instances. ``dora.policy.versions``.

    ``announced_by`` is :attr:`TRAINER` for the announcement of a new version and :attr:`HOLDER` for a
    re-announcement by a process that now also serves an already announced version (``holders`` then
    names only that process; ``train_metrics`` is empty).
    """

    SCHEMA: ClassVar[str] = "dora.v1.PolicyVersion"
    TRAINER: ClassVar[str] = "TRAINER"
    HOLDER: ClassVar[str] = "HOLDER"
    run_id: str
    version: int
    step: int
    created_ms: int
    transport: str
    holders: tuple[str, ...]
    total_bytes: int
    checksum_algo: str
    tensors: tuple[TensorEntry, ...] = nested(TensorEntry)
    buckets: tuple[BucketEntry, ...] = nested(BucketEntry)
    checkpoint_uri: str | None = None
    train_metrics: dict[str, float] = field(default_factory=dict)
    announced_by: str = "TRAINER"
    signature: str | None = None


@dataclass(frozen=True, eq=False)
class TrainBatch(Record):
    """Written by the batch assembler; read by the trainer. Topic ``dora.train.batches``."""

    SCHEMA: ClassVar[str] = "dora.v1.TrainBatch"
    run_id: str
    batch_id: str
    train_step: int
    base_version: int
    max_staleness: int
    created_ms: int
    trajectories: tuple[Trajectory, ...] = nested(Trajectory)
    provenance: Provenance | None = nested_one(Provenance)
    signature: str | None = None

    def staleness(self) -> list[int]:
        """``base_version - policy_version`` per trajectory (the rule: :mod:`dora_rl.core.staleness`)."""
        return [StalenessBound.staleness(self.base_version, t.policy_version) for t in self.trajectories]

    def encode(self) -> tuple[bytes, list[tuple[str, bytes]]]:
        """As :meth:`Record.encode`, the array of trajectories written as their own encodings (kept bytes
        where there are some) between the Avro array's block count and its end."""
        if self._wire() is not None or self.provenance is not None or last_fields(
                self.SCHEMA, 3) != ("trajectories", "provenance", "signature"):
            return super().encode()
        empty, headers = codec.encode(self.SCHEMA, self.replace(trajectories=()).to_avro())
        sig = b"\0" if self.signature is None else b"".join((b"\2", avro_long(len(self.signature.encode())),
                                                              self.signature.encode()))
        tail = b"".join((b"\0\0", sig))  # the empty array, the null provenance, the signature
        if not empty.endswith(tail):
            return super().encode()
        items = [t.encode()[0] for t in self.trajectories]
        array = b"".join((avro_long(len(items)), *items, b"\0")) if items else b"\0"
        return b"".join((empty[:-len(tail)], array, tail[1:])), headers


@dataclass(frozen=True)
class DeadLetter(Record):
    """Written by any component refusing input; read by operators and audit. Topic ``dora.dlq``."""

    SCHEMA: ClassVar[str] = "dora.v1.DeadLetter"
    component: str
    reason: str
    error_type: str
    source_topic: str
    source_partition: int
    source_offset: int
    ts_ms: int
    run_id: str | None = None
    key: bytes | None = None
    value: bytes | None = None
    group_id: str | None = None
    trajectory_id: str | None = None
    attempts: int = 0
    signature: str | None = None


@dataclass(frozen=True)
class Metric(Record):
    """Written by every role; read by ``dora-rl run``/``monitor``. Topic ``dora.metrics``."""

    SCHEMA: ClassVar[str] = "dora.v1.Metric"
    run_id: str
    component: str
    name: str
    value: float
    ts_ms: int
    step: int | None = None
    version: int | None = None
    labels: dict[str, str] = field(default_factory=dict)
    signature: str | None = None


@dataclass(frozen=True)
class TopicOffset(Record):
    """Where a run starts in one topic partition (nested in :class:`RunInfo`)."""

    SCHEMA: ClassVar[str] = "dora.v1.TopicOffset"
    topic: str
    partition: int
    offset: int


@dataclass(frozen=True)
class RunInfo(Record):
    """Written by ``dora-rl run``; read by every role, audit and replay. Topic ``dora.runs``."""

    SCHEMA: ClassVar[str] = "dora.v1.RunInfo"
    run_id: str
    state: str
    mode: str
    config_json: str
    created_ms: int
    start_offsets: tuple[TopicOffset, ...] = nested(TopicOffset)
    summary_json: str | None = None
    signature: str | None = None


@dataclass(frozen=True)
class BatchPlan(Record):
    """Written by the orchestrator; read by the batch assembler. Topic ``dora.schedule``."""

    SCHEMA: ClassVar[str] = "dora.v1.BatchPlan"
    run_id: str
    train_step: int
    trajectory_ids: tuple[str, ...]
    ts_ms: int
    signature: str | None = None


@dataclass(frozen=True)
class InputPosition(Record):
    """One input partition's next offset (nested in :class:`ProcessorSnapshot`)."""

    SCHEMA: ClassVar[str] = "dora.v1.InputPosition"
    topic: str
    partition: int
    offset: int


@dataclass(frozen=True)
class ProcessorSnapshot(Record):
    """A stream processor's state at one commit. Topic ``dora.state`` (see ``docs/topics.md``)."""

    SCHEMA: ClassVar[str] = "dora.v1.ProcessorSnapshot"
    run_id: str
    processor: str
    commit: int
    ts_ms: int
    state: bytes
    positions: tuple[InputPosition, ...] = nested(InputPosition)
    signature: str | None = None


#: Every top-level record class by schema name.
RECORDS: dict[str, type[Record]] = {
    cls.SCHEMA: cls
    for cls in (Prompt, RolloutRequest, TokenChunk, Trajectory, InstanceStatus, PolicyVersion,
                TrainBatch, DeadLetter, Metric, RunInfo, BatchPlan, ProcessorSnapshot)
}
