"""``dora-rl replay retrain``: re-execute recorded train steps from a checkpoint and the recorded batches.

To re-train step ``k`` (the update from version ``k`` to ``k + 1``): take the newest checkpoint of a
version ``c <= k`` (:func:`nearest_checkpoint`; the trainer's replay checkpoints under
``<run dir>/checkpoints``, every ``checkpoint_every`` versions and version 0, or a trainer-state
checkpoint an announcement still names), restore weights, optimizer and LR schedule from it, then
apply the recorded ``TrainBatch`` of every step ``c .. k`` with :func:`~dora_rl.consumers.trainer.step.train_step`
— the trainer's own update function, with the run's recorded config and one torch thread.

Reported per replayed step (:class:`StepResult`): loss and gradient norm, the checksum of the
resulting weights (:func:`weights_checksum`: the bucket checksums the weight channel announces), and
the original's: the trainer's announcement of version ``s + 1`` on ``dora.policy.versions`` (its
checksums and train metrics), else the checkpoint of version ``s + 1``.

Exactness: on CPU, a re-trained step equals the original bit for bit (``match``) — same code, same
inputs, same seed ``config.seed + step``, deterministic single-threaded kernels; the integration test
holds it. ``rewards`` overrides (trajectory id -> reward) re-train step ``k`` on an edited batch, a
what-if whose checksum then differs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from dora_rl.config import DoraConfig
from dora_rl.consumers.trainer import checkpoint
from dora_rl.consumers.trainer.step import TrainerState, build_state, single_thread, train_step
from dora_rl.infra.kafka import topics
from dora_rl.infra.weights.checksum import default_checksum_algo
from dora_rl.infra.weights.manifest import DEFAULT_BUCKET_BYTES, pack_state_dict
from dora_rl.modeling import state_dict_for_transfer
from dora_rl.schemas.records import PolicyVersion, TrainBatch

from .source import RecordSource, decoded


@dataclass(frozen=True)
class StepResult:
    """One replayed step next to the original."""

    step: int
    loss: float
    grad_norm: float
    checksum: str
    original_checksum: str | None
    original_loss: float | None
    original_grad_norm: float | None
    edited: bool = False

    @property
    def match(self) -> bool:
        """The re-trained weights are the original's, bit for bit (per bucket checksum)."""
        return self.original_checksum is not None and self.checksum == self.original_checksum


@dataclass(frozen=True)
class RetrainReport:
    """A re-trained step and the steps replayed to reach it."""

    run_id: str
    step: int
    from_version: int
    checkpoint: str
    start_checksum: str
    start_original: str | None
    steps: tuple[StepResult, ...] = field(default_factory=tuple)
    trainer_ranks: int = 1
    """The run's data-parallel trainer ranks: a replay re-trains with one rank, bit for bit only
    for a one-rank run (N ranks sum gradients in another order: ~1e-7 apart, decision 0028)."""

    @property
    def result(self) -> StepResult:
        """The requested step."""
        return self.steps[-1]

    def render(self) -> str:
        lines = [f"retrain of run {self.run_id} step {self.step} from version {self.from_version} ({self.checkpoint}); "
                 f"start weights {'match' if self.start_checksum == self.start_original else 'DIFFER from'} "
                 f"the announced version {self.from_version}"]
        for s in self.steps:
            same = "MATCH" if s.match else ("no original" if s.original_checksum is None else "DIFFERENT")
            if same == "DIFFERENT" and self.trainer_ranks > 1:
                same += (f" (the run trained with {self.trainer_ranks} ranks, this replay with 1: equal up to the "
                         "order of the gradient sum, not bit for bit)")
            lines.append(f"  step {s.step}{' (edited)' if s.edited else ''}: loss {s.loss:.6g} (original "
                         f"{_fmt(s.original_loss)}), grad norm {s.grad_norm:.6g} (original "
                         f"{_fmt(s.original_grad_norm)}), weights {s.checksum} vs {s.original_checksum}: {same}")
        return "\n".join(lines)


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.6g}"


def nearest_checkpoint(available: Mapping[int, Path], step: int) -> tuple[int, Path]:
    """The newest checkpoint of a version ``<= step``; LookupError naming what exists when there is none."""
    usable = [v for v in available if v <= step]
    if not usable:
        raise LookupError(f"no checkpoint of a version <= {step} (have versions {sorted(available)}): "
                          "retrain needs one to start from")
    best = max(usable)
    return best, available[best]


def weights_checksum(weights: Mapping[str, torch.Tensor], algo: str | None = None,
                     bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> str:
    """``<algo>:<bucket checksum>[,...]`` of ``weights`` packed as the weight channel packs a version."""
    manifest, _ = pack_state_dict(weights, bucket_bytes, checksum_algo=algo or default_checksum_algo())
    return announced_checksum_of(manifest.checksum_algo, [b.checksum for b in manifest.buckets])


def announced_checksum_of(algo: str, buckets: list[str]) -> str:
    """The checksum string of an announcement's buckets (comparable with :func:`weights_checksum`)."""
    return f"{algo}:{','.join(buckets)}"


def announced_checksum(ann: PolicyVersion) -> str:
    return announced_checksum_of(ann.checksum_algo, [b.checksum for b in ann.buckets])


def edit_rewards(batch: TrainBatch, rewards: Mapping[str, float]) -> TrainBatch:
    """``batch`` with the rewards of ``rewards`` (trajectory id -> reward) replaced; KeyError on an id the
    batch does not hold."""
    unknown = set(rewards) - {t.trajectory_id for t in batch.trajectories}
    if unknown:
        raise KeyError(f"batch {batch.batch_id} holds no trajectory {sorted(unknown)}")
    return batch.replace(trajectories=tuple(t.replace(reward=float(rewards[t.trajectory_id]))
                                            if t.trajectory_id in rewards else t for t in batch.trajectories))


def available_checkpoints(source: RecordSource, announced: Mapping[int, PolicyVersion]) -> dict[int, Path]:
    """Replay checkpoints of the run, plus trainer-state ones announcements name that still exist under the
    run's own directory (an announcement naming anywhere else is not followed)."""
    run_dir = checkpoint.StorageRoot(source.checkpoints_dir().parent)
    found: dict[int, Path] = {}
    for v, a in announced.items():
        try:
            path = Path(run_dir.within(a.checkpoint_uri)) if a.checkpoint_uri else None
        except ValueError:  # elsewhere, shared storage included: replay reads the run's own folder only
            continue
        if path is not None and (path / checkpoint.COMPLETE).exists():
            found[v] = path
    found.update(checkpoint.complete_versions(source.checkpoints_dir()))
    return found


def recorded(source: RecordSource) -> tuple[dict[int, TrainBatch], dict[int, PolicyVersion]]:
    """The run's batches by train step and the trainer's announcements by version (first of each)."""
    batches: dict[int, TrainBatch] = {}
    for _, b in decoded(source, topics.BATCHES, TrainBatch):
        batches.setdefault(int(b.train_step), b)
    announced: dict[int, PolicyVersion] = {}
    for _, a in decoded(source, topics.VERSIONS, PolicyVersion):
        if a.announced_by == PolicyVersion.TRAINER:
            announced.setdefault(int(a.version), a)
    return batches, announced


def original_of(version: int, announced: Mapping[int, PolicyVersion], available: Mapping[int, Path],
                names: list[str], algo: str) -> tuple[str | None, dict[str, float]]:
    """Checksum and train metrics of the original ``version``: its announcement, else its checkpoint."""
    if version in announced:
        return announced_checksum(announced[version]), dict(announced[version].train_metrics)
    if version in available:
        tensors = load_file(str(available[version] / "model.safetensors"))
        return weights_checksum({n: tensors[n] for n in names}, algo), {}
    return None, {}


def retrain(source: RecordSource, step: int, rewards: Mapping[str, float] | None = None) -> RetrainReport:
    """Re-train step ``step`` of the source's run (see the module docstring)."""
    info = source.run_info()
    config = DoraConfig.from_json(info.config_json)
    batches, announced = recorded(source)
    if step not in batches:
        raise LookupError(f"run {info.run_id} has no batch of step {step} (steps recorded: {sorted(batches)})")
    available = available_checkpoints(source, announced)
    start, path = nearest_checkpoint(available, step)
    missing = [s for s in range(start, step + 1) if s not in batches]
    if missing:
        raise LookupError(f"replaying from version {start} needs the batches of steps {missing}, which the run lacks")
    with single_thread():
        state = build_state(config)
        restored = checkpoint.load(path, state.model, state.optimizer, state.lr_schedule)
        if restored != start:
            raise RuntimeError(f"checkpoint {path} holds step {restored}, not {start}")
        algo = announced[start].checksum_algo if start in announced else default_checksum_algo()
        names = list(state_dict_for_transfer(state.model, clone=False))
        start_sum = weights_checksum(state_dict_for_transfer(state.model), algo)
        start_original, _ = original_of(start, announced, {}, names, algo)
        results = [_replay_step(state, config, batches[s] if s < step or not rewards else
                                edit_rewards(batches[s], rewards), s == step and bool(rewards),
                                announced, available, names, algo) for s in range(start, step + 1)]
    return RetrainReport(info.run_id, step, start, str(path), start_sum, start_original, tuple(results),
                         config.trainer_ranks)


def _replay_step(state: TrainerState, config: DoraConfig, batch: TrainBatch, edited: bool,
                 announced: Mapping[int, PolicyVersion], available: Mapping[int, Path], names: list[str],
                 algo: str) -> StepResult:
    stats = train_step(state, batch, config)
    step = int(batch.train_step)
    original, metrics = original_of(step + 1, announced, available, names, algo)
    return StepResult(step, stats["loss"], stats["grad_norm"], weights_checksum(state_dict_for_transfer(state.model),
                                                                                algo),
                      original, metrics.get("loss"), metrics.get("grad_norm"), edited)
