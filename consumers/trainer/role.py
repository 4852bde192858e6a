"""The trainer role: consumes ``dora.train.batches``, updates the policy, announces new versions.

Reads ``dora.train.batches`` (assigned directly; group ``dora.<run>.trainer`` stores its offsets) and, at start, the
end of ``dora.policy.versions``; writes ``dora.policy.versions``, ``dora.metrics`` and ``dora.dlq``;
serves weights over the configured transport.

Lifecycle: build/load the initial policy, optional supervised warm-up, publish version 0; then for
train step ``k = 0, 1, ...``: take the batch with ``train_step == k`` (a batch of an already-trained
step is skipped), update (:func:`.step.train_step`, the one update of a batch, shared with
``dora-rl replay retrain``), checkpoint version ``k + 1``, announce it. A batch is refused to
``dora.dlq`` if it violates C3 or has the wrong size. With ``eval_every``, version 0, every
``eval_every``-th and the last version are evaluated on the held-out prompts (:mod:`.evaluate`) after
their announcement (the time is reported as ``eval_s``, apart from ``train_s``). Every
``checkpoint_every`` versions (version 0 and the last one included) a replay checkpoint (policy,
optimizer, schedule) is kept under ``<run dir>/checkpoints`` (:func:`.checkpoint.save_replayable`).

Data parallelism (``config.trainer_ranks = N > 1``, :mod:`.ranks`): this process is rank 0. It
keeps the plain (unsharded, CPU) state everything above works with — restore, warm-up, checkpoints,
publication, evaluation — and, once that state is final for version ``latest``, spawns ranks
``1 .. N-1`` and syncs them to it; each batch is then applied by every rank (FSDP2) and gathered back
into the plain state before its checkpoint. With one rank (the default) no rank machinery runs.

Crash safety (docs/decisions/0015):

- a version is announced only after its checkpoint (weights, optimizer, LR schedule, step) is
  durable (:mod:`.checkpoint`); the announcement names it (``checkpoint_uri``);
- each announcement, its metrics and the consumed batch offset commit in one Kafka transaction
  (``transactional.id = dora.<run>.trainer``): a zombie trainer is fenced by its replacement;
- a restarted trainer reads the newest announcements of its run backwards from the topic's end,
  restores the newest version's checkpoint (so no batch is applied twice and none is skipped),
  serves every live version ``latest - S .. latest`` again from its checkpoints, checks each against
  its announced checksums and re-announces itself as a holder (``announced_by = HOLDER``).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from dora_rl.config import DoraConfig
from dora_rl.core.emulation import modelled_train_s
from dora_rl.infra.crashpoints import crash_point
from dora_rl.infra.kafka import topics
from dora_rl.infra.kafka.consume import RunConsumer
from dora_rl.infra.kafka.io import DeadLetters, Metrics, RecordProducer, read_backwards
from dora_rl.infra.kafka.keys import make_key
from dora_rl.infra.observability import prom
from dora_rl.infra.weights.announcements import announcement_problem
from dora_rl.schemas.codec import DecodeError
from dora_rl.schemas.records import PolicyVersion, TrainBatch

from . import checkpoint
from .evaluate import evaluate
from .ranks import TrainerRanks
from .session import Refuse, Skip, start_session
from .step import precision, train_step

log = logging.getLogger(__name__)
COMPONENT = "trainer"


def pad_to_modelled_time(batch: TrainBatch, config: DoraConfig, spent_s: float) -> float | None:
    """Wait out the modelled step time (``config.modelled_train_s_*``, emulated benches) after a real update
    that took ``spent_s``; returns the seconds waited (``None`` when no model is configured). A real update
    longer than the model is not shortened: it waits 0."""
    if not (config.modelled_train_s_fixed or config.modelled_train_s_per_token):
        return None
    tokens = sum(len(t.prompt_ids) + len(t.response_ids) for t in batch.trajectories)
    wait = max(0.0, modelled_train_s(config.modelled_train_s_fixed, config.modelled_train_s_per_token, tokens)
               - spent_s)
    time.sleep(wait)
    return wait


def trainer_announcements(bootstrap: str, run_id: str, start: dict[tuple[str, int], int],
                          depth: int, token: str = "") -> dict[int, PolicyVersion]:
    """The trainer's own announcements of ``run_id`` by version, read backwards from the end of
    ``dora.policy.versions`` until the newest ``depth + 1`` versions are found (the live ones for ``depth = S``;
    the trainer announces versions in increasing order) or version 0: no full replay of a long run. With the
    run's ``token``, one not signed with it is passed by (a forged announcement never becomes the trainer's
    state: decision 0054); if only such ones exist, starting over at version 0 would announce a second version
    0, so that is an error (a forgery, or a run created before announcements were signed)."""
    found: dict[int, PolicyVersion] = {}
    unsigned = 0
    versions = topics.in_run(run_id, topics.VERSIONS)
    for window in read_backwards(bootstrap, versions, 0, stop_at=start.get((versions, 0), 0)):
        for msg in window:
            try:
                ann = PolicyVersion.decode(msg.value(), msg.headers())
            except DecodeError:
                continue
            if ann.run_id != run_id or ann.announced_by != PolicyVersion.TRAINER:
                continue
            if announcement_problem(ann, check_manifest=False, token=token) is None:
                found.setdefault(int(ann.version), ann)
            else:
                unsigned += 1
        if found and min(found) <= max(0, max(found) - depth):
            break
    if unsigned and not found:
        raise RuntimeError(f"run {run_id}: {unsigned} trainer announcements on {versions}, none signed with "
                           "this run's weight token (forged, or written before announcements were signed: "
                           "docs/decisions/0054); refusing to start over at version 0")
    if unsigned:
        log.warning("passed by %d trainer announcements not signed with the run's token", unsigned)
    return found


def run_trainer(bootstrap: str, run_id: str, config: DoraConfig, start_offsets: dict[tuple[str, int], int],
                run_dir: Path, token: str | None = None, stop: Callable[[], bool] = lambda: False,
                done_key: str = "") -> None:
    """Train until ``config.steps`` versions exist (or ``stop()``), announcing each version; ``done`` is
    signed with ``done_key`` (the trainer's own key, :data:`dora_rl.roles.TRAINER_KEY_FILE`), else the token."""
    from dora_rl.core.tasks import get_task
    from dora_rl.prompt_source import heldout_prompts

    from .sft import sft_warmup

    producer = RecordProducer(bootstrap, f"{COMPONENT}-{run_id}", **{"transactional.id": f"dora.{run_id}.trainer"})
    producer.init_transactions(60)  # fences and aborts any predecessor (a zombie can never announce)
    dlq = DeadLetters(producer, COMPONENT, run_id)
    metrics = Metrics(producer, run_id, COMPONENT)
    token = token or secrets.token_hex(16)
    session = start_session(config, run_id, run_dir, token, f"{os.getpid()}-{secrets.token_hex(3)}")
    state, publisher = session.state, session.publisher
    model, tok, optimizer, lr_schedule = state.model, state.tokenizer, state.optimizer, state.lr_schedule

    @contextmanager
    def transaction() -> Iterator[None]:
        producer.raw.begin_transaction()
        try:
            yield
        except BaseException:
            producer.raw.abort_transaction(30)
            raise
        producer.raw.commit_transaction(60)

    heldout = heldout_prompts(config) if config.eval_every > 0 else []

    def evaluate_if_due(version: int) -> None:
        """Greedy pass@1 of ``version`` on the held-out prompts when one is due (version 0, every
        ``eval_every`` versions, the last one); its metrics commit in their own transaction."""
        if not heldout or not (version % config.eval_every == 0 or version == config.steps):
            return
        with precision(config):
            res = evaluate(model, tok, heldout, config.reward_fn, config.reward_timeout_s, config.max_new_tokens,
                           version)
        with transaction():
            metrics.emit("eval_pass_at_1", res.pass_at_1, version=version, correct=res.correct, n=str(res.n),
                         refused=str(res.refused))
            metrics.emit("eval_reward_mean", res.reward_mean, version=version)
            metrics.emit("eval_s", res.eval_s, version=version)
        log.info("eval v%d: pass@1 %.3f (%d prompts, reward %.3f, %d refused, %.1f tokens, %.1fs)", version,
                 res.pass_at_1, res.n, res.reward_mean, res.refused, res.completion_tokens_mean, res.eval_s)

    def keep_for_replay(version: int) -> None:
        """The replay checkpoint of ``version`` when one is due (after its announcement committed)."""
        if version % config.checkpoint_every == 0 or version == config.steps:
            checkpoint.save_replayable(run_dir / "checkpoints", version, model, tok, optimizer, lr_schedule, version)

    versions_topic = topics.in_run(run_id, topics.VERSIONS)
    announced = trainer_announcements(bootstrap, run_id, start_offsets, config.max_staleness, token or "")
    if announced:
        again = session.restore(announced)
        step = session.step
        with transaction():  # every live version served again by this incarnation
            for ann in again:  # as a holder: only the trainer's first announcement of a version is on VERSIONS
                producer.send(topics.in_run(run_id, topics.HOLDERS), ann, make_key(ann.version, "policy"))
            metrics.emit("restored", step, version=step)
        log.info("restored at version %d from %s", step, announced[step].checkpoint_uri)
    else:
        warmup: dict[str, float] = {}
        if config.warmup_steps > 0:
            t0 = time.perf_counter()
            losses = sft_warmup(model, tok, get_task(config.task), steps=config.warmup_steps, batch_size=64,
                                lr=config.sft_lr, max_answer_chars=16, seed=config.seed)
            warmup = {"sft_loss": losses[-1], "sft_s": time.perf_counter() - t0}
            log.info("warm-up: %d steps, loss %.3f -> %.3f", len(losses), losses[0], losses[-1])
        step = 0
        with transaction():
            for name, value in warmup.items():
                metrics.emit(name, value)
            first = session.announce(0, {})
            producer.send(versions_topic, first, make_key(0, "policy"))
            metrics.emit("version_published", 0, version=0)
        keep_for_replay(0)
        evaluate_if_due(0)

    # undecodable input is refused while polling, outside any transaction: its own idempotent producer
    undecodable = DeadLetters(RecordProducer(bootstrap, f"{COMPONENT}-dlq-{run_id}"), COMPONENT, run_id)
    consumer = RunConsumer(bootstrap, run_id, COMPONENT, {topics.BATCHES: TrainBatch}, undecodable, start_offsets,
                           assign=True)
    ranks: TrainerRanks | None = None
    idle_s = 0.0
    busy_s = 0.0
    try:
        if config.trainer_ranks > 1:
            ranks = TrainerRanks.start(config, state)
        modelled_wait: list[float | None] = [None]

        def update(b: TrainBatch) -> dict[str, float]:
            """One policy update, then the modelled step time waited out (emulated benches)."""
            started = time.perf_counter()
            stats = train_step(state, b, config) if ranks is None else ranks.train_step(b)
            crash_point("trainer.after_update")
            modelled_wait[0] = pad_to_modelled_time(b, config, time.perf_counter() - started)
            return stats

        wait_started = time.perf_counter()
        while step < config.steps and not stop():
            refused = undecodable.count
            envelopes = consumer.poll(0.5, max_records=1)
            if undecodable.count != refused:
                undecodable.producer.flush()
            for env in envelopes:
                batch: TrainBatch = env.record
                verdict = session.check(batch)
                if isinstance(verdict, Skip):
                    log.info("skipping batch %s: %s", batch.batch_id, verdict.reason)
                    continue
                if isinstance(verdict, Refuse):
                    with transaction():
                        dlq.refuse(env, verdict.reason, verdict.kind, value=batch.encode()[0])
                        consumer.commit_in_transaction(producer.raw)
                    continue
                waited = time.perf_counter() - wait_started
                idle_s += waited
                t0 = time.perf_counter()
                trained = session.train(batch, update)
                stats = trained.stats
                step_s = time.perf_counter() - t0
                busy_s += step_s
                with transaction():  # the version, its metrics and the consumed batch: all or nothing
                    producer.send(versions_topic, trained.announcement, make_key(step + 1, "policy"))
                    for name in ("reward_mean", "loss", "trained_tokens", "clip_frac", "approx_kl",
                                 "staleness_max", "response_len_mean", "tis_weight_mean", "logprob_diff_mean",
                                 "logprob_diff_max", "update_tokens_per_s", "mfu", "micro_tokens", "mixed_version"):
                        if name in stats:
                            metrics.emit(name, stats[name], step=step, version=step + 1)
                    metrics.emit("train_s", step_s, step=step)
                    metrics.emit("wait_s", waited, step=step)
                    if modelled_wait[0] is not None:
                        metrics.emit("modelled_wait_s", modelled_wait[0], step=step)
                    metrics.emit("idle_ratio", idle_s / max(idle_s + busy_s, 1e-9), step=step)
                    consumer.commit_in_transaction(producer.raw)
                    crash_point("trainer.before_commit")
                prom.trained_batch(batch)
                log.info("step %d: reward %.3f loss %.4f tokens %d (%.2fs, update %.2fs, waited %.2fs)", step,
                         stats["reward_mean"], stats["loss"], stats["trained_tokens"], step_s, stats["update_s"],
                         waited)
                step += 1
                keep_for_replay(step)
                evaluate_if_due(step)
                wait_started = time.perf_counter()
        with transaction():
            metrics.emit_signed("done", step, done_key or token)  # it ends the run: only the trainer may say it
        if ranks is not None:
            ranks.close()
        if step >= config.steps:
            record_finished(bootstrap, run_id, step, token or "")
    except BaseException:
        if ranks is not None:
            ranks.abort()
        raise
    finally:
        consumer.close()
        publisher.close()


def record_finished(bootstrap: str, run_id: str, step: int, token: str = "") -> None:
    """The run reached its steps: record it ``FINISHED``, signed with the run's ``token`` (a run without a
    launcher has no one else to; a launcher, which stops the trainer before it records its own summary,
    overwrites this one)."""
    from dora_rl.infra.kafka.runs import finish_run, get_run

    info = get_run(bootstrap, run_id, token)
    if info.state == "STARTED":
        finish_run(bootstrap, info, json.dumps({"steps": step, "recorded_by": COMPONENT}), token=token)
        log.info("run %s recorded FINISHED at step %d", run_id, step)
