"""One training step from one recorded batch: the only place a ``TrainBatch`` becomes a policy update.

The trainer role (:mod:`.role`) and ``dora-rl replay retrain`` (:mod:`dora_rl.consumers.replay.retrain`)
both build their state with :func:`build_state` and apply a batch with :func:`train_step`, so a
re-trained step runs exactly the code of the original one (docs/decisions/0012, 0020).

- :func:`build_state`: the initial policy of ``config.model`` (built from ``config.seed``) in fp32 on
  ``config.device`` (or the given device; gradient checkpointing when configured), sharded with FSDP2
  when asked (a data-parallel rank, :mod:`.ranks`: the model is sharded before the optimizer is
  built, so the optimizer holds the shards), its tokenizer, ``AdamW(lr = config.lr, weight_decay = 0)``
  over the model's parameters in their order, and the LR schedule
  ``warmup_cosine_schedule(optimizer, config.lr_warmup_steps)``.
- :func:`train_step`: the batch's trajectories, in batch order, as :class:`~.update.Sample` (reward
  ``None`` is 0); :func:`~.update.policy_update` with every knob from ``config``, the seed
  ``config.seed + batch.train_step`` (the only randomness of an update: the minibatch order), the
  micro-batch budget :func:`~.throughput.resolved_micro_tokens` (packed on a GPU unless configured) and
  decoupled PPO iff ``config.decoupled_ppo`` and some trajectory is stale (staleness > 0), under
  :func:`precision` (bf16 autocast over fp32 master weights when ``config.dtype == "bf16"``). With
  ``dp`` (a rank of :mod:`.ranks`, sharded state) every rank applies the same batch and trains its share
  of it (:mod:`.distributed`): the update one rank makes, up to float rounding.

Exactness: the update is a deterministic function of (weights, optimizer state, schedule position,
batch, config) on CPU with one intra-op thread — the trainer runs with ``torch.set_num_threads(1)``
and replay does the same (:func:`single_thread`). Nothing else of the process (global RNGs, earlier
steps) enters it, which is what lets a checkpoint plus the recorded batches reproduce every later
version bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from dora_rl.config import DoraConfig
from dora_rl.schemas.records import TrainBatch

from .distributed import DataParallel, shard_model
from .grpo import warmup_cosine_schedule
from .precision import precision
from .throughput import mfu, model_flops_per_token, peak_flops, resolved_micro_tokens
from .update import Sample, policy_update


@dataclass(frozen=True)
class TrainerState:
    """What an update mutates (model, optimizer, schedule) and what it reads (pad id)."""

    model: torch.nn.Module
    tokenizer: Any
    optimizer: torch.optim.Optimizer
    lr_schedule: torch.optim.lr_scheduler.LRScheduler
    pad_id: int


def build_state(config: DoraConfig, device: str | None = None, shard: bool = False) -> TrainerState:
    """The trainer's initial state for ``config`` on ``device`` (default ``config.device``), its model
    sharded with FSDP2 when ``shard`` (needs the default process group; see the module docstring)."""
    from dora_rl.modeling import keep_lm_head_fp32, load_policy
    from dora_rl.policy_source import resolve_model

    model, tok = load_policy(resolve_model(config.model, config.seed), device=device or config.device)  # fp32
    if config.lm_head_fp32:
        keep_lm_head_fp32(model)
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    if shard:  # before the optimizer: FSDP2 replaces the parameters by their shards
        shard_model(model)
    fused = torch.device(device or config.device).type == "cuda"  # one kernel for every tensor's AdamW step
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.0, fused=fused)
    lr_schedule = warmup_cosine_schedule(optimizer, config.lr_warmup_steps)
    return TrainerState(model, tok, optimizer, lr_schedule, int(tok.pad_token_id or 0))


def samples_of(batch: TrainBatch) -> list[Sample]:
    """The batch's trajectories as update samples, in batch order (a missing reward counts as 0)."""
    stale = batch.staleness()
    return [Sample(t.prompt_ids.tolist(), t.response_ids.tolist(), t.behaviour_logprobs.tolist(),
                   float(t.reward or 0.0), t.group_id, int(s)) for t, s in zip(batch.trajectories, stale, strict=True)]


def train_step(state: TrainerState, batch: TrainBatch, config: DoraConfig,
               dp: DataParallel | None = None) -> dict[str, float]:
    """Apply ``batch`` to ``state`` (one policy update); returns the update's statistics plus
    ``staleness_max``, ``staleness_mean`` and ``mixed_version`` (its trajectories more than one version
    wrote) of the batch. With ``dp`` collective: every rank calls it
    with the same batch (its ``state`` sharded by :func:`build_state`); the statistics are global."""
    stale = batch.staleness()
    bf16 = config.dtype == "bf16"
    micro = resolved_micro_tokens(config.micro_tokens, state.model, bf16, config.gradient_checkpointing)
    dev = next(state.model.parameters()).device
    with precision(config):
        stats = policy_update(state.model, state.optimizer, samples_of(batch), loss=config.loss,
                              clip_eps=config.clip_eps, tis_cap=config.tis_cap, ppo_epochs=config.ppo_epochs,
                              minibatches=config.minibatches, temperature=config.temperature, pad_id=state.pad_id,
                              seed=config.seed + int(batch.train_step), lr_scheduler=state.lr_schedule,
                              decoupled=config.decoupled_ppo and max(stale, default=0) > 0, dp=dp,
                              micro_tokens=micro, packed=packs(config, dev))
    stats["staleness_max"] = float(max(stale, default=0))
    stats["staleness_mean"] = float(sum(stale) / len(stale)) if stale else 0.0
    stats["mixed_version"] = float(sum(len(t.versions_used()) > 1 for t in batch.trajectories))  # C1 breaks
    stats.update(device_use(state.model, stats, bf16, micro))
    return stats


def packs(config: DoraConfig, device: torch.device) -> bool:
    """Whether micro-batches are packed (``config.packed``, unset: on a GPU)."""
    return config.packed if config.packed is not None else device.type == "cuda"


def device_use(model: torch.nn.Module, stats: dict[str, float], bf16: bool, micro: int) -> dict[str, float]:
    """``update_tokens_per_s`` (prompt + response tokens computed / update wall time), ``mfu`` (when the
    device's peak is known) and the ``micro_tokens`` used, for the step's metrics."""
    out = {"micro_tokens": float(micro)}
    if stats["update_s"] > 0:
        out["update_tokens_per_s"] = stats["computed_tokens"] / stats["update_s"]
    used = mfu(model_flops_per_token(model), stats["computed_tokens"], stats["update_s"],
               peak_flops(next(model.parameters()).device, bf16))
    if used is not None:
        out["mfu"] = used
    return out


@contextmanager
def single_thread() -> Iterator[None]:
    """Run the body with one intra-op torch thread (as the trainer), restoring the count after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
