"""The trainer role: consumes ``dora.train.batches``, updates the policy, announces new versions.

Reads ``dora.train.batches`` (group ``dora.<run>.trainer``); writes ``dora.policy.versions`` and
``dora.metrics``; serves weights over the configured transport.

Lifecycle: build/load the initial policy, optional supervised warm-up, publish version 0; then
for train step ``k = 0, 1, ...``: take the batch with ``train_step == k`` (idempotent on
``batch_id``: a batch of an already-trained step is skipped), update, publish version ``k + 1``
and commit the batch offset. A batch is refused to ``dora.dlq`` if it violates C3 (some
trajectory with ``base_version - version > max_staleness``) or has the wrong size.
"""

from __future__ import annotations

import logging
import random
import secrets
import time
from collections.abc import Callable
from pathlib import Path

import torch

from dora_rl.config import DoraConfig
from dora_rl.infra import topics
from dora_rl.infra.kafka_io import DeadLetters, Metrics, RecordProducer, RunConsumer
from dora_rl.infra.keys import make_key
from dora_rl.infra.weight_sync import Publisher
from dora_rl.schemas.records import TrainBatch

from .grpo import warmup_cosine_schedule
from .update import Sample, policy_update

log = logging.getLogger(__name__)
COMPONENT = "trainer"


def validate_batch(batch: TrainBatch, config: DoraConfig) -> str | None:
    """Why ``batch`` must be refused, or None when it is valid."""
    if len(batch.trajectories) != config.train_batch_size:
        return f"batch has {len(batch.trajectories)} trajectories, expected {config.train_batch_size}"
    bad = config.staleness_bound.violations(batch.base_version, (t.policy_version for t in batch.trajectories))
    if bad:
        return (f"{len(bad)} trajectories with staleness {min(bad)}..{max(bad)} outside "
                f"[0, {config.max_staleness}] (C3)")
    if any(t.reward is None for t in batch.trajectories):
        return "a trajectory in the batch has no reward"
    return None


def run_trainer(bootstrap: str, run_id: str, config: DoraConfig, start_offsets: dict[tuple[str, int], int],
                run_dir: Path, token: str | None = None, stop: Callable[[], bool] = lambda: False) -> None:
    """Train ``config.steps`` steps (or until ``stop()``), announcing each version."""
    from dora_rl.core.tasks import get_task
    from dora_rl.modeling import load_policy, state_dict_for_transfer
    from dora_rl.policy_source import resolve_model

    from .sft import sft_warmup

    torch.set_num_threads(1)
    torch.manual_seed(config.seed)
    random.seed(config.seed)
    producer = RecordProducer(bootstrap, f"{COMPONENT}-{run_id}")
    dlq = DeadLetters(producer, COMPONENT, run_id)
    metrics = Metrics(producer, run_id, COMPONENT)
    model, tok = load_policy(resolve_model(config.model, config.seed))
    pad_id = int(tok.pad_token_id or 0)
    publisher = Publisher(config.weight_transport, run_id, run_dir, token or secrets.token_hex(16),
                          keep=config.max_staleness + 2)

    def announce(version: int, stats: dict[str, float]) -> None:
        ann = publisher.publish(version, version, state_dict_for_transfer(model), stats)
        producer.send(topics.VERSIONS, ann, make_key(version, "policy"))
        producer.flush()

    if config.sft_steps > 0:
        t0 = time.perf_counter()
        losses = sft_warmup(model, tok, get_task(config.task), steps=config.sft_steps, batch_size=64,
                            lr=config.sft_lr, max_answer_chars=16, seed=config.seed)
        metrics.emit("sft_loss", losses[-1])
        metrics.emit("sft_s", time.perf_counter() - t0)
        log.info("warm-up: %d steps, loss %.3f -> %.3f", len(losses), losses[0], losses[-1])
    announce(0, {})
    metrics.emit("version_published", 0, version=0)

    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.0)
    lr_schedule = warmup_cosine_schedule(optimizer, config.lr_warmup_steps)
    consumer = RunConsumer(bootstrap, run_id, COMPONENT, {topics.BATCHES: TrainBatch}, dlq, start_offsets)
    step = 0
    wait_started = time.perf_counter()
    idle_s = 0.0
    busy_s = 0.0
    try:
        while step < config.steps and not stop():
            for env in consumer.poll(0.5, max_records=1):
                batch: TrainBatch = env.record
                if batch.train_step < step:
                    log.info("skipping duplicate batch %s", batch.batch_id)
                    continue
                if batch.train_step > step:
                    dlq.refuse(env, f"batch for step {batch.train_step} arrived while expecting {step}",
                               "order", value=batch.encode()[0])
                    continue
                reason = validate_batch(batch, config)
                if reason is not None:
                    dlq.refuse(env, reason, "batch", value=batch.encode()[0])
                    continue
                waited = time.perf_counter() - wait_started
                idle_s += waited
                t0 = time.perf_counter()
                samples = [Sample(t.prompt_ids.tolist(), t.response_ids.tolist(), t.behaviour_logprobs.tolist(),
                                  float(t.reward or 0.0),
                                  t.group_id) for t in batch.trajectories]
                stale = batch.staleness()
                stats = policy_update(model, optimizer, samples, loss=config.loss, clip_eps=config.clip_eps,
                                      tis_cap=config.tis_cap, ppo_epochs=config.ppo_epochs,
                                      minibatches=config.minibatches, temperature=config.temperature,
                                      pad_id=pad_id, seed=config.seed + step, lr_scheduler=lr_schedule,
                                      decoupled=config.decoupled_ppo and max(stale) > 0)
                stats["staleness_max"] = float(max(stale))
                stats["staleness_mean"] = float(sum(stale) / len(stale))
                announce(step + 1, stats)
                consumer.commit()
                step_s = time.perf_counter() - t0
                busy_s += step_s
                for name in ("reward_mean", "loss", "trained_tokens", "clip_frac", "approx_kl",
                             "staleness_max", "response_len_mean", "tis_weight_mean"):
                    if name in stats:
                        metrics.emit(name, stats[name], step=step, version=step + 1)
                metrics.emit("train_s", step_s, step=step)
                metrics.emit("wait_s", waited, step=step)
                metrics.emit("idle_ratio", idle_s / max(idle_s + busy_s, 1e-9), step=step)
                producer.flush()
                log.info("step %d: reward %.3f loss %.4f tokens %d (%.2fs, update %.2fs, waited %.2fs)", step,
                         stats["reward_mean"], stats["loss"], stats["trained_tokens"], step_s, stats["update_s"],
                         waited)
                step += 1
                if step % config.checkpoint_every == 0 or step == config.steps:
                    save_checkpoint(model, tok, run_dir / "checkpoints" / f"v{step:06d}")
                wait_started = time.perf_counter()
        metrics.emit("done", step)
        producer.flush()
    finally:
        consumer.close()
        publisher.close()


def save_checkpoint(model: torch.nn.Module, tokenizer: object, path: Path) -> None:
    """A loadable Hugging Face folder of the current policy."""
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)  # type: ignore[operator]
    tokenizer.save_pretrained(path)  # type: ignore[attr-defined]
