"""The reward scorer as a processor: ``dora.rollout.trajectories`` in, ``dora.rollout.scored`` out.

Run by :class:`~dora_rl.streams.kafka_runtime.KafkaDriver`: each commit puts the scored trajectories,
the dead letters, the metrics, the (tiny) snapshot and the consumed positions in one transaction, so
a restarted scorer neither loses nor repeats a committed score, and a zombie is fenced. Downstream
consumers read ``read_committed``.

Pluggable: the reward comes from a scoring function (in a run,
:class:`dora_rl.infra.reward_worker.RewardRunner` running ``DoraConfig.reward_fn`` in a worker process with
``reward_timeout_s`` per call; in tests, any function). The trajectories received since the last
punctuation go to it as one batch.

Poison input: a trajectory whose reward fails (an exception, a non-finite or out-of-range value, a
timeout, a crashed worker: a :class:`~dora_rl.core.rewards.RewardError`) is tried again, up to
``max_attempts`` tries in all, then refused to ``dora.dlq`` with the error's message, its
``group_id`` and its tries: the orchestrator withdraws the whole group and dispatches a replacement,
so batches stay whole groups of exactly TBS. The tries are counted in memory: the reward runs in a
worker process, so a reward that kills, hangs or exhausts memory costs that worker, never the scorer
(``dora_rl.core.rewards``), and nothing the scorer does with a trajectory can kill the scorer itself.

Signatures (decision 0059): a score is signed with the run's scorer key, which only the scorer and the
assembler hold, so the assembler trains no reward another writer of ``dora.rollout.scored`` planted; a
refusal is signed with the run's token, so no writer outside the run can withdraw a group.

Snapshot: the counters of scored and refused trajectories and when the metrics were last emitted (the
outputs are a function of the input and the clock alone, so a restore needs nothing else). A regenerated
copy of a trajectory (an instance restarted) is scored again; the assembler keeps the first copy by
trajectory id.

Latency (``bench/pipeline.py``): a poll returns as soon as a record is fetched, and a commit follows
within ``commit_interval_s`` (0.02 s: at most 50 transactions a second; under load what arrives while a
transaction commits goes into the next one), so a trajectory is scored and visible downstream within one
transaction of arriving. The metrics (counters, scoring time) are emitted when the counters changed, at
most once per ``metrics_interval_s`` of the clock, not with every transaction. An output is the input's
bytes with the reward written in (:meth:`Trajectory.scored`), not a new encoding.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence

from dora_rl.core.rewards import RewardError, RewardRequest
from dora_rl.infra.kafka import topics
from dora_rl.infra.kafka.keys import make_key, partition_for
from dora_rl.infra.kafka.signing import signed
from dora_rl.infra.reward_worker import RewardRunner
from dora_rl.schemas.records import Metric, Trajectory

from .processor import Context, InRecord, dead_letter_for

log = logging.getLogger(__name__)
COMPONENT = "scorer"
ScoreFn = Callable[[Sequence[Trajectory]], list[float | RewardError]]


def runner_scores(runner: RewardRunner) -> ScoreFn:
    """A scoring function over a :class:`RewardRunner` (one batch per call)."""
    def score(batch: Sequence[Trajectory]) -> list[float | RewardError]:
        return runner.score_many([RewardRequest(t.task, t.reference, t.response_text, t.trajectory_id)
                                  for t in batch])
    return score


class Scorer:
    """The scorer's processor (see the module docstring)."""

    name = COMPONENT
    inputs: tuple[str, ...] = (topics.TRAJECTORIES,)

    def __init__(self, run_id: str, num_partitions: int, score: ScoreFn, max_attempts: int = 2,
                 metrics_interval_s: float = 1.0, scorer_key: str = "", token: str = "") -> None:
        self.run_id, self.num_partitions, self.score_fn = run_id, num_partitions, score
        self.scorer_key, self.token = scorer_key, token  # signs the scores / the refusals (empty: unsigned)
        self.max_attempts = max(1, max_attempts)
        self.metrics_interval_s = metrics_interval_s
        self.batch: list[InRecord] = []
        self.scored = 0
        self.refused = 0
        self.metrics_at: float | None = None  # clock of the last metrics emitted
        self.emitted = (0, 0)  # the counters they carried
        self.score_s = 0.0  # scoring time since then (a measurement: not part of the state)

    def init(self, ctx: Context) -> None:
        pass

    def process(self, rec: InRecord, ctx: Context) -> None:
        self.batch.append(rec)

    def punctuate(self, now: float, ctx: Context) -> None:
        if self.batch:
            self._score(ctx)
        if (self.scored, self.refused) != self.emitted and (
                self.metrics_at is None or now - self.metrics_at >= self.metrics_interval_s):
            self.metrics_at, self.emitted = now, (self.scored, self.refused)
            for name, value in (("scored_total", self.scored), ("reward_errors_total", self.refused),
                                ("score_s", self.score_s)):
                ctx.emit(topics.METRICS, Metric(run_id=self.run_id, component=COMPONENT, name=name,
                                                value=float(value), ts_ms=ctx.wall_ms()), f"{COMPONENT}/{name}")
            self.score_s = 0.0

    def _score(self, ctx: Context) -> None:
        t0 = time.perf_counter()
        todo, self.batch = self.batch, []
        errors: dict[int, RewardError] = {}
        rewards: dict[int, float] = {}
        left = list(range(len(todo)))
        for _ in range(self.max_attempts):
            outcomes = self.score_fn([todo[i].record for i in left])
            for i, o in zip(left, outcomes, strict=True):
                if isinstance(o, RewardError):
                    errors[i] = o
                else:
                    rewards[i] = o
                    errors.pop(i, None)
            left = [i for i in left if i in errors]
            if not left:
                break
        for i, rec in enumerate(todo):
            traj: Trajectory = rec.record
            if i in rewards:
                out = traj.scored(rewards[i], ctx.wall_ms(), self.scorer_key)
                ctx.emit(topics.SCORED, out, make_key(int(traj.policy_version), traj.group_id),
                         partition=partition_for(traj.group_id, self.num_partitions))
                self.scored += 1
            else:
                self._refuse(ctx, rec, errors[i])
        self.score_s += time.perf_counter() - t0

    def _refuse(self, ctx: Context, rec: InRecord, err: RewardError) -> None:
        traj: Trajectory = rec.record
        self.refused += 1
        reason = f"no reward after {self.max_attempts} tries: {err.message}"
        letter = signed(dead_letter_for(rec, COMPONENT, self.run_id, reason[:2000], "reward", ctx.wall_ms(),
                                        value=traj.encode()[0], group_id=traj.group_id,
                                        trajectory_id=traj.trajectory_id, attempts=self.max_attempts), self.token)
        ctx.emit(topics.DLQ, letter, make_key(int(traj.policy_version), traj.group_id))
        log.warning("refused %s (group %s): %s", traj.trajectory_id, traj.group_id, reason)

    def held_back(self) -> frozenset[str]:
        return frozenset()  # never: its inputs are bounded by what the run has in flight

    def snapshot(self) -> bytes:
        return json.dumps({"scored": self.scored, "refused": self.refused, "metrics_at": self.metrics_at,
                           "emitted": list(self.emitted)}).encode()

    def restore(self, snapshot: bytes, ctx: Context) -> None:
        state = json.loads(snapshot)
        self.scored, self.refused = int(state["scored"]), int(state["refused"])
        self.metrics_at = state.get("metrics_at")  # absent from a snapshot of an earlier version: emit at once
        scored, refused = state.get("emitted", (-1, -1))
        self.emitted = (int(scored), int(refused))

    def close(self) -> None:
        log.info("scorer stopping: %d scored, %d refused", self.scored, self.refused)


def run_scorer(bootstrap: str, run_id: str, start_offsets: dict[tuple[str, int], int], num_partitions: int,
               stop: Callable[[], bool] = lambda: False, reward_fn: str = "task", reward_timeout_s: float = 10.0,
               max_attempts: int = 2, token: str = "", scorer_key: str = "") -> None:
    """Score until ``stop()``; every commit is one transaction (see the module docstring). Its snapshot and
    refusals are signed with the run's ``token``, its scores with ``scorer_key`` (the token when empty)."""
    from .kafka_runtime import KafkaDriver

    runner = RewardRunner(reward_fn, reward_timeout_s)  # an unresolvable reward_fn fails here, before Kafka
    try:
        scorer = Scorer(run_id, num_partitions, runner_scores(runner), max_attempts, scorer_key=scorer_key or token,
                        token=token)
        KafkaDriver(bootstrap, run_id, scorer, {topics.TRAJECTORIES: Trajectory}, start_offsets,
                    commit_interval_s=0.02, linger_s=0.0, token=token).run(stop)
    finally:
        runner.close()
