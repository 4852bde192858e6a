"""``dora-rl replay refeed``: a new run trained on a recorded run's trajectories, with no generation.

Where the new run's batches come from (``source``):

- ``batches`` (default): the recorded run's ``TrainBatch`` of steps ``0 .. n - 1`` (up to the first
  missing step), each copied as it is — train step, base version, ``max_staleness`` and trajectories
  byte for byte — with the new run's ``run_id`` and ``batch_id`` and ``provenance`` naming the
  original batch record (source run, ``dora.train.batches``, partition, offset);
- ``scored``: the recorded run's scored trajectories (first copy per id, complete groups of ``G``
  only) re-assembled by :func:`reassemble`: step ``k`` takes ``TBS / G`` whole groups that C3 allows
  at ``k`` (:meth:`StalenessBound.allows` for every member), earliest deadline first, then log
  order; a group whose deadline passes unused is left out (counted). Each trajectory gets the new
  run's ``run_id`` and its own ``provenance`` (source run, ``dora.rollout.scored``, partition, offset).

The new run is recorded on ``dora.runs`` (the recorded config, ``steps`` = the batches written, plus
the caller's overrides), its batches are written to ``dora.train.batches`` in one Kafka transaction
(all or none), then — unless told not to — the trainer role trains them in this process. No other role
runs: nothing is generated or scored. ``dora-rl audit`` of the new run reports the provenance (counts
per source run) and does not count re-fed trajectories as undispatched or never generated.

Exactness: with ``batches`` and the recorded config unchanged, the new run is the recorded one again
— same initial policy and warm-up from the seed, same batches, same update — so its announced
checksums equal the recorded run's, version for version (checked by the integration test).
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dora_rl.config import DoraConfig
from dora_rl.core.staleness import StalenessBound
from dora_rl.infra.broker.dist import dora_home
from dora_rl.infra.kafka import topics
from dora_rl.infra.kafka.io import RecordProducer
from dora_rl.infra.kafka.keys import make_key
from dora_rl.infra.kafka.read import now_ms
from dora_rl.infra.kafka.runs import offsets_map, start_run
from dora_rl.infra.kafka.signing import signed
from dora_rl.schemas.records import Provenance, TrainBatch, Trajectory

from .source import RawRecord, RecordSource, decoded

SOURCES = ("batches", "scored")
Located = tuple[RawRecord, Trajectory]


@dataclass(frozen=True)
class RefeedResult:
    """The new run and what it reused."""

    run_id: str
    source_run_id: str
    source: str
    batches: int
    trajectories: int
    groups_left_out: int
    trained: bool

    def render(self) -> str:
        left = f", {self.groups_left_out} groups left out (deadline passed)" if self.groups_left_out else ""
        return (f"run {self.run_id} re-fed from run {self.source_run_id} ({self.source}): {self.batches} batches, "
                f"{self.trajectories} trajectories{left}; {'trained' if self.trained else 'not trained yet'}")


def provenance(source_run: str, raw: RawRecord) -> Provenance:
    """Where ``raw`` of run ``source_run`` lies."""
    return Provenance(source_run, raw.topic, raw.partition, raw.offset)


def copy_batches(located: Sequence[tuple[RawRecord, TrainBatch]], source_run: str, run_id: str,
                 created_ms: int) -> list[TrainBatch]:
    """The recorded batches of steps ``0, 1, ...`` up to the first missing step, copied for ``run_id``
    (first committed batch of a step; see the module docstring)."""
    by_step: dict[int, tuple[RawRecord, TrainBatch]] = {}
    for raw, b in located:
        by_step.setdefault(int(b.train_step), (raw, b))
    out: list[TrainBatch] = []
    while len(out) in by_step:
        raw, b = by_step[len(out)]
        out.append(b.replace(run_id=run_id, batch_id=f"{run_id}/step{b.train_step}", created_ms=created_ms,
                             provenance=provenance(source_run, raw)))
    return out


def complete_groups(located: Sequence[Located], group_size: int) -> list[list[Located]]:
    """Groups of exactly ``group_size`` distinct trajectory ids (first copy of each), in first-seen order."""
    groups: dict[str, dict[str, Located]] = {}
    for raw, t in located:
        groups.setdefault(t.group_id, {}).setdefault(t.trajectory_id, (raw, t))
    return [list(g.values()) for g in groups.values() if len(g) == group_size]


def reassemble(located: Sequence[Located], train_batch_size: int, group_size: int, bound: StalenessBound,
               steps: int | None = None) -> tuple[list[list[Located]], int]:
    """Batches of whole groups for steps ``0, 1, ...`` (see the module docstring) and how many complete
    groups were left out; stops at ``steps`` or at the first step it cannot fill."""
    per_batch = train_batch_size // group_size
    groups = complete_groups(located, group_size)
    order = {id(g): i for i, g in enumerate(groups)}
    pending = list(groups)
    batches: list[list[Located]] = []
    while steps is None or len(batches) < steps:
        k = len(batches)
        pending = [g for g in pending if all(bound.deadline(t.policy_version) >= k for _, t in g)]
        ready = [g for g in pending if all(bound.allows(k, t.policy_version) for _, t in g)]
        if len(ready) < per_batch:
            break
        ready.sort(key=lambda g: (min(bound.deadline(t.policy_version) for _, t in g), order[id(g)]))
        chosen = ready[:per_batch]
        taken = {id(g) for g in chosen}
        pending = [g for g in pending if id(g) not in taken]
        batches.append([m for g in chosen for m in g])
    return batches, len(groups) - len(batches) * per_batch


def assembled_batch(members: Sequence[Located], step: int, source_run: str, run_id: str, max_staleness: int,
                    created_ms: int) -> TrainBatch:
    """Step ``step``'s batch of re-fed trajectories, each with its provenance."""
    return TrainBatch(run_id=run_id, batch_id=f"{run_id}/step{step}", train_step=step, base_version=step,
                      max_staleness=max_staleness, created_ms=created_ms,
                      trajectories=tuple(t.replace(run_id=run_id, provenance=provenance(source_run, raw))
                                         for raw, t in members))


def new_config(recorded: DoraConfig, steps: int, overrides: Mapping[str, Any]) -> DoraConfig:
    """The new run's config: the recorded one with ``steps`` and ``overrides``; the batch shape is kept."""
    config = DoraConfig.from_dict({**dataclasses.asdict(recorded), **overrides, "steps": steps})
    if (config.train_batch_size, config.group_size) != (recorded.train_batch_size, recorded.group_size):
        raise ValueError("refeed keeps the recorded batches' shape: train_batch_size and group_size cannot change")
    return config


def build_batches(source: RecordSource, kind: str, run_id: str, config: DoraConfig,
                  steps: int | None) -> tuple[list[TrainBatch], int]:
    """The new run's batches from ``source`` (``kind`` of :data:`SOURCES`) and the groups left out."""
    src = source.run_info().run_id
    created = now_ms()
    if kind == "batches":
        copied = copy_batches(list(decoded(source, topics.BATCHES, TrainBatch)), src, run_id, created)
        return copied[:steps] if steps is not None else copied, 0
    if kind == "scored":
        located = list(decoded(source, topics.SCORED, Trajectory))
        groups, left = reassemble(located, config.train_batch_size, config.group_size, config.staleness_bound, steps)
        return [assembled_batch(m, k, src, run_id, config.max_staleness, created) for k, m in enumerate(groups)], left
    raise ValueError(f"refeed source must be one of {SOURCES}, not {kind!r}")


def new_token(rdir: Path) -> str:
    """A fresh token for a new run, in ``<rdir>/weight-token`` (mode 0600), where a trainer started later by
    hand (``DORA_WEIGHT_TOKEN_FILE``) and ``dora-rl audit`` find it."""
    rdir.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = rdir / "weight-token"
    path.touch(mode=0o600)
    path.write_text(secrets.token_hex(16))
    return path.read_text()


def write_batches(bootstrap: str, run_id: str, batches: Sequence[TrainBatch]) -> None:
    """Every batch to the run's ``dora.train.batches`` in one transaction (key ``v<step:010d>/step<step>``)."""
    producer = RecordProducer(bootstrap, f"replay-refeed-{run_id}", **{"transactional.id": f"dora.{run_id}.refeed"})
    producer.init_transactions(60)
    producer.raw.begin_transaction()
    try:
        for b in batches:
            producer.send(topics.in_run(run_id, topics.BATCHES), b, make_key(int(b.train_step), f"step{b.train_step}"))
    except BaseException:
        producer.raw.abort_transaction(30)
        raise
    producer.raw.commit_transaction(60)


def refeed(source: RecordSource, bootstrap: str, kind: str = "batches", steps: int | None = None,
           overrides: Mapping[str, Any] | None = None, run_id: str | None = None, train: bool = True,
           stop: Callable[[], bool] = lambda: False) -> RefeedResult:
    """Create a new run on ``bootstrap`` from the source's run (see the module docstring)."""
    from dora_rl.infra.kafka.runs import new_run_id

    info = source.run_info()
    recorded = DoraConfig.from_json(info.config_json)
    run_id = run_id or new_run_id()
    wanted = new_config(recorded, recorded.steps, overrides or {})
    batches, left = build_batches(source, kind, run_id, wanted, steps)
    if not batches:
        raise LookupError(f"run {info.run_id} yields no complete batch to re-feed from its {kind}")
    config = new_config(recorded, len(batches), overrides or {})
    rdir = dora_home() / "runs" / run_id
    token = new_token(rdir)  # the new run's: its record and batches are signed with it (decision 0060)
    created = start_run(bootstrap, config, run_id, token)
    write_batches(bootstrap, run_id, [signed(b.replace(signature=None), token) for b in batches])
    if train:
        from dora_rl.consumers.trainer.role import run_trainer

        run_trainer(bootstrap, run_id, config, offsets_map(created), rdir, token, stop)
    return RefeedResult(run_id, info.run_id, kind, len(batches), sum(len(b.trajectories) for b in batches), left, train)
