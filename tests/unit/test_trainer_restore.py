"""The trainer's session (the role's logic apart from Kafka): a crash at every record boundary, before or after
the transaction that announces a version and consumes its batch, gives the uninterrupted run's announced
versions and checksums; no version is announced twice; redelivered batches are skipped, never re-applied."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from dora_rl.config import DoraConfig
from dora_rl.consumers.trainer.session import Refuse, Skip, TrainerSession, start_session
from dora_rl.consumers.trainer.step import train_step
from dora_rl.infra.kafka.signing import signed
from dora_rl.schemas.records import PolicyVersion, TrainBatch, Trajectory

RUN, STEPS = "r1", 3


def _config() -> DoraConfig:
    return DoraConfig.from_dict({"mode": "dora", "model": "tiny:1m", "train_batch_size": 4, "group_size": 2,
                                 "rollout_batch_size": 8, "max_staleness": 1, "steps": STEPS,
                                 "weight_transport": "file", "minibatches": 2, "seed": 3})


def _batch(step: int) -> TrainBatch:
    rng = np.random.default_rng(step)

    def traj(g: int, i: int) -> Trajectory:
        n = int(rng.integers(2, 6))
        return Trajectory(run_id=RUN, trajectory_id=f"{RUN}/p{step}-{g}/{i}", group_id=f"{RUN}/p{step}-{g}",
                          prompt_id=f"p{step}-{g}", sample_index=i, group_size=2, policy_version=max(0, step - 1),
                          task="reverse", reference="ab", prompt_ids=np.asarray([1, 5, 6], dtype=np.int32),
                          response_ids=rng.integers(3, 50, n).astype(np.int32),
                          behaviour_logprobs=rng.uniform(-3, -0.1, n).astype(np.float32),
                          reward=float(i), instance_version=max(0, step - 1))

    return signed(TrainBatch(run_id=RUN, batch_id=f"{RUN}/step{step}", train_step=step, base_version=step,
                             max_staleness=1, created_ms=0,
                             trajectories=tuple(traj(g, i) for g in range(2) for i in range(2))), "token")


class Crash(Exception):
    """The process dies here; only what was committed survives."""


@dataclass
class Log:
    """What the topics hold: committed trainer announcements and the trainer's committed batch offset."""

    versions: list[PolicyVersion] = field(default_factory=list)
    offset: int = 0
    refused: list[str] = field(default_factory=list)

    def announced(self) -> dict[int, PolicyVersion]:
        out: dict[int, PolicyVersion] = {}
        for ann in self.versions:
            if ann.announced_by == PolicyVersion.TRAINER:
                assert ann.version not in out, f"version {ann.version} announced twice"
                out[ann.version] = ann
        return out


def _process(log: Log, batches: list[TrainBatch], run_dir: Path, incarnation: str, crash: tuple[int, str] | None,
             ) -> None:
    """One trainer incarnation, as the role runs it: restore or announce version 0, then each batch from the
    committed offset; ``crash = (k, "before" | "after")`` kills it around the commit of version ``k``."""
    config = _config()
    session: TrainerSession = start_session(config, RUN, run_dir, "token", incarnation)
    announced = log.announced()

    def commit(version: int, ann: PolicyVersion, consumed: bool) -> None:
        if crash == (version, "before"):
            raise Crash
        log.versions.append(ann)
        log.offset += consumed
        if crash == (version, "after"):
            raise Crash

    if announced:
        log.versions.extend(session.restore(announced))
    else:
        commit(0, session.announce(0, {}), consumed=False)
    while session.step < config.steps:
        assert log.offset < len(batches), f"out of batches at step {session.step}; refused: {log.refused}"
        batch = batches[log.offset]
        verdict = session.check(batch)
        if isinstance(verdict, Skip | Refuse):
            log.refused.extend([verdict.reason] if isinstance(verdict, Refuse) else [])
            log.offset += 1
            continue
        trained = session.train(batch, lambda b: train_step(session.state, b, config))
        commit(trained.announcement.version, trained.announcement, consumed=True)
    session.publisher.close()


def _checksums(log: Log) -> dict[int, list[str]]:
    return {v: [b.checksum for b in ann.buckets] for v, ann in sorted(log.announced().items())}


def _run(batches: list[TrainBatch], run_dir: Path, crash: tuple[int, str] | None) -> Log:
    log = Log()
    for incarnation in range(3):
        try:
            _process(log, batches, run_dir, f"i{incarnation}", crash if incarnation == 0 else None)
            return log
        except Crash:
            continue
    raise AssertionError("did not finish")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[str]]:
    log = _run([_batch(k) for k in range(STEPS)], tmp_path_factory.mktemp("straight"), None)
    assert sorted(log.announced()) == list(range(STEPS + 1)) and not log.refused
    sums = _checksums(log)
    assert len({tuple(c) for c in sums.values()}) == STEPS + 1, "every update moves the weights"
    return sums


@pytest.mark.parametrize("version", range(STEPS + 1))
@pytest.mark.parametrize("when", ["before", "after"])
def test_crash_at_every_record_boundary_gives_the_uninterrupted_versions(
        uninterrupted: dict[int, list[str]], tmp_path: Path, version: int, when: str) -> None:
    log = _run([_batch(k) for k in range(STEPS)], tmp_path, (version, when))
    assert _checksums(log) == uninterrupted
    assert log.offset == STEPS and not log.refused


def test_a_redelivered_batch_is_skipped_and_a_batch_from_the_future_refused(
        uninterrupted: dict[int, list[str]], tmp_path: Path) -> None:
    """At-least-once delivery: batch 0 again after step 0 is skipped; batch 2 before batch 1 is refused."""
    batches = [_batch(0), _batch(0), _batch(2), _batch(1), _batch(2)]
    log = _run(batches, tmp_path, None)
    assert _checksums(log) == uninterrupted
    assert log.refused == ["batch for step 2 arrived while expecting 1"]


def test_a_checkpoint_that_does_not_hold_the_announced_weights_is_an_error(tmp_path: Path) -> None:
    log = _run([_batch(k) for k in range(STEPS)], tmp_path, None)
    forged = {v: a for v, a in log.announced().items()}
    forged[2] = forged[2].replace(checkpoint_uri=forged[3].checkpoint_uri)  # 2 and 3 are live (S = 1)
    session = start_session(_config(), RUN, tmp_path, "token", "i9")  # the same run, restarted
    with pytest.raises(RuntimeError, match="does not hold the weights announced as version 2"):
        session.restore(forged)
    session.publisher.close()
