"""The trainer's logic apart from Kafka, in the processor shape of the other roles: batches in, decisions out.

:class:`TrainerSession` holds the policy, its optimizer and LR schedule, the durable checkpoints and the weight
server. It reads and writes no topic: the role (:mod:`.role`) feeds it ``dora.train.batches`` in order and
writes each decision in one Kafka transaction (the announcement, its metrics and the consumed offset); a unit
test feeds it from memory and crashes it at every record boundary.

Invariants (docs/decisions/0015):

- :meth:`announce` returns an announcement only after the checkpoint of its version is durable, and the
  announcement names that checkpoint;
- :meth:`restore` loads the newest announced version with its optimizer and schedule, and serves every live
  version again, each checked against its announced checksums (a mismatch is an error: a version number never
  names two sets of weights);
- so a batch whose announcement did not commit is trained again from the same state, and its version gets
  the same weights and checksums as in a run that never crashed; a batch of a step already trained is
  skipped, never applied twice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from dora_rl.config import DoraConfig
from dora_rl.core.training_input import trajectory_problem
from dora_rl.infra.kafka.signing import signature_problem
from dora_rl.infra.storage import StorageRoot
from dora_rl.infra.weights.checksum import AUTHENTICATED
from dora_rl.infra.weights.sync import Publisher
from dora_rl.schemas.records import PolicyVersion, TrainBatch

from . import checkpoint
from .step import TrainerState, build_state


def validate_batch(batch: TrainBatch, config: DoraConfig, vocab: int | None = None) -> str | None:
    """Why ``batch`` must be refused, or None when it is valid: its size, C3, and every trajectory trainable
    (:func:`~dora_rl.core.training_input.trajectory_problem`, token ids below ``vocab`` when given)."""
    if len(batch.trajectories) != config.train_batch_size:
        return f"batch has {len(batch.trajectories)} trajectories, expected {config.train_batch_size}"
    bad = config.staleness_bound.violations(batch.base_version, (t.policy_version for t in batch.trajectories))
    if bad:
        return (f"{len(bad)} trajectories with staleness {min(bad)}..{max(bad)} outside "
                f"[0, {config.max_staleness}] (C3)")
    for t in batch.trajectories:
        problem = trajectory_problem(t.prompt_ids, t.response_ids, t.behaviour_logprobs, t.reward, t.token_versions,
                                     vocab)
        if problem is not None:
            return f"trajectory {t.trajectory_id}: {problem}"
    return None


@dataclass(frozen=True)
class Skip:
    """The batch's step is trained already (a redelivery after a restart): nothing to write."""

    reason: str


@dataclass(frozen=True)
class Refuse:
    """The batch goes to ``dora.dlq`` with ``reason``; its offset is consumed."""

    reason: str
    kind: str


@dataclass(frozen=True)
class Trained:
    """The batch was applied: ``announcement`` (of the new version, its checkpoint durable) and ``stats``."""

    announcement: PolicyVersion
    stats: dict[str, float] = field(default_factory=dict)


class TrainerSession:
    """One trainer incarnation's state: ``step`` is the next train step (= the newest version announced)."""

    def __init__(self, config: DoraConfig, state: TrainerState, publisher: Publisher, checkpoints: StorageRoot,
                 incarnation: str, vocab: int | None = None, token: str = "") -> None:
        self.config, self.state, self.publisher = config, state, publisher
        self.checkpoints, self.incarnation, self.vocab = checkpoints, incarnation, vocab
        self.token = token  # the run's: a batch not signed with it is refused (none: unchecked)
        self.step = 0

    def announce(self, version: int, stats: dict[str, float]) -> PolicyVersion:
        """Checkpoint ``version`` durably, serve it, and return its announcement (for the caller to send)."""
        from dora_rl.modeling import state_dict_for_transfer

        st = self.state
        uri = checkpoint.save(self.checkpoints, version, self.incarnation, st.model, st.optimizer, st.lr_schedule,
                              version)
        ann = self.publisher.publish(version, version, state_dict_for_transfer(st.model), stats, checkpoint_uri=uri)
        checkpoint.prune(self.checkpoints, version - self.config.max_staleness - 1)
        return ann

    def restore(self, announced: dict[int, PolicyVersion]) -> list[PolicyVersion]:
        """Rebuild the state of the newest of ``announced`` (the trainer's own announcements by version) and
        serve every live version again; returns the holder re-announcements to send."""
        from dora_rl.modeling import state_dict_for_transfer

        st = self.state
        latest = max(announced)
        live = [v for v in range(max(0, latest - self.config.max_staleness), latest + 1) if v in announced]
        again: list[PolicyVersion] = []
        for v in live:
            uri = announced[v].checkpoint_uri
            if uri is None:
                raise RuntimeError(f"version {v} was announced without a checkpoint: cannot restart this run")
            checkpoint.load_weights_from(self.checkpoints, uri, st.model)
            ann = self.publisher.publish(v, v, state_dict_for_transfer(st.model), checkpoint_uri=uri,
                                         announced_by=PolicyVersion.HOLDER)
            if [b.checksum for b in ann.buckets] != [b.checksum for b in announced[v].buckets]:
                raise RuntimeError(f"checkpoint {uri} does not hold the weights announced as version {v}")
            again.append(ann)
        newest = str(announced[latest].checkpoint_uri)
        step = checkpoint.load_from(self.checkpoints, newest, st.model, st.optimizer, st.lr_schedule)
        if step != latest:
            raise RuntimeError(f"checkpoint of version {latest} says step {step}")
        self.step = step
        return again

    def check(self, batch: TrainBatch) -> Skip | Refuse | None:
        """What to do with ``batch`` without training it: skip, refuse, or None (train it)."""
        forged = signature_problem(batch, self.token, f"batch {batch.batch_id}")
        if forged is not None:  # before the step checks: a forged batch may neither be trained nor skip one
            return Refuse(forged, "signature")
        if batch.train_step < self.step:
            return Skip(f"step {batch.train_step} is trained already")
        if batch.train_step > self.step:
            return Refuse(f"batch for step {batch.train_step} arrived while expecting {self.step}", "order")
        reason = validate_batch(batch, self.config, vocab=self.vocab)
        return None if reason is None else Refuse(reason, "batch")

    def train(self, batch: TrainBatch, update: Callable[[TrainBatch], dict[str, float]]) -> Trained:
        """Apply ``batch`` (``check`` said None) with ``update`` and announce the next version; ``step`` moves
        on (if the caller's transaction then fails, the process restarts and :meth:`restore` rewinds it)."""
        stats = update(batch)
        ann = self.announce(self.step + 1, stats)
        self.step += 1
        return Trained(ann, stats)


def start_session(config: DoraConfig, run_id: str, run_dir: Path, token: str, incarnation: str) -> TrainerSession:
    """A fresh incarnation's session: seeded, the initial policy built, its checkpoints under
    :func:`checkpoint_root` and its versions served from ``run_dir`` (rank 0's plain CPU copy when
    ``config.trainer_ranks > 1``)."""
    import random

    import torch

    torch.set_num_threads(1)
    torch.manual_seed(config.seed)
    random.seed(config.seed)
    state = build_state(config, device="cpu" if config.trainer_ranks > 1 else None)
    digest = AUTHENTICATED if config.weight_digest == "blake2b" else None
    publisher = Publisher(config.weight_transport, run_id, run_dir, token, keep=config.max_staleness + 2,
                          checksum_algo=digest)
    vocab = getattr(state.model.config, "vocab_size", None)
    if config.vocab_size and vocab != config.vocab_size:
        raise ValueError(f"the run records vocab_size {config.vocab_size}, but model {config.model} has {vocab}: "
                         "the assembler would check token ids against the wrong vocabulary")
    return TrainerSession(config, state, publisher, checkpoint_root(config, run_id, run_dir), incarnation, vocab=vocab,
                          token=token)


def checkpoint_root(config: DoraConfig, run_id: str, run_dir: Path) -> StorageRoot:
    """``<checkpoint_url>/<run id>/trainer-state`` when the run names shared storage, else
    ``<run dir>/trainer-state``: the only place this run's trainer reads a checkpoint from."""
    if config.checkpoint_url:
        return StorageRoot(f"{config.checkpoint_url.rstrip('/')}/{run_id}/trainer-state")
    return StorageRoot(run_dir / "trainer-state")
