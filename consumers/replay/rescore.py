"""``dora-rl replay rescore``: recorded trajectories through the same or another reward function.

Reads the run's trajectories (``dora.rollout.scored`` by default, or ``dora.rollout.trajectories``,
whose reward is null), keeps the first record of each trajectory id, scores every one with
``reward_fn`` (default: the run's) in :class:`~dora_rl.infra.reward_worker.RewardRunner` — the scorer's
runner: same worker process, timeout and validity rule, same request (task, reference, response
text) — and reports, per GRPO group, the recorded and the new rewards and GRPO advantages.

Advantages come from :func:`dora_rl.consumers.trainer.update.compute_advantages` over the group's
:func:`~dora_rl.consumers.trainer.update.trainable` trajectories, with the run's ``loss``: the one
advantage formula, exactly what the trainer would compute for that group in a batch (advantages are
group-local). A trajectory the trainer would not train (empty response) has no advantage; a group
with a missing reward (unscored, or the new function failed on one member: the error is reported)
has no advantages on that side.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from dora_rl.config import DoraConfig
from dora_rl.consumers.trainer.update import Sample, compute_advantages, trainable
from dora_rl.core.rewards import RewardError, RewardRequest
from dora_rl.infra.kafka import topics
from dora_rl.infra.reward_worker import RewardRunner
from dora_rl.schemas.records import Trajectory

from .source import RecordSource, decoded


@dataclass(frozen=True)
class TrajectoryDiff:
    """One trajectory's reward and advantage, recorded and new (None: none)."""

    trajectory_id: str
    old_reward: float | None
    new_reward: float | None
    old_advantage: float | None
    new_advantage: float | None
    error: str | None = None


@dataclass(frozen=True)
class GroupDiff:
    """One GRPO group, recorded vs new."""

    group_id: str
    policy_version: int
    trajectories: tuple[TrajectoryDiff, ...]

    @property
    def max_reward_change(self) -> float:
        return max((abs(t.new_reward - t.old_reward) for t in self.trajectories
                    if t.new_reward is not None and t.old_reward is not None), default=0.0)

    @property
    def max_advantage_change(self) -> float:
        return max((abs(t.new_advantage - t.old_advantage) for t in self.trajectories
                    if t.new_advantage is not None and t.old_advantage is not None), default=0.0)


@dataclass(frozen=True)
class RescoreReport:
    """Every group of the run (in first-seen order) under both reward functions."""

    run_id: str
    topic: str
    recorded_fn: str
    reward_fn: str
    groups: tuple[GroupDiff, ...]

    @property
    def trajectories(self) -> int:
        return sum(len(g.trajectories) for g in self.groups)

    @property
    def rewards_changed(self) -> int:
        return sum(1 for g in self.groups for t in g.trajectories if t.new_reward != t.old_reward)

    @property
    def groups_changed(self) -> int:
        return sum(1 for g in self.groups if g.max_advantage_change > 0 or g.max_reward_change > 0)

    @property
    def errors(self) -> list[str]:
        return [t.error for g in self.groups for t in g.trajectories if t.error]

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "trajectories": self.trajectories, "rewards_changed": self.rewards_changed,
                "groups_changed": self.groups_changed}

    def render(self, limit: int = 20) -> str:
        lines = [f"rescore of run {self.run_id} ({self.topic}): {self.recorded_fn!r} -> {self.reward_fn!r}: "
                 f"{self.trajectories} trajectories in {len(self.groups)} groups, {self.rewards_changed} rewards "
                 f"and {self.groups_changed} groups changed, {len(self.errors)} errors"]
        changed = sorted(self.groups, key=lambda g: -g.max_advantage_change)[:limit]
        for g in changed:
            old, new = [t.old_reward for t in g.trajectories], [t.new_reward for t in g.trajectories]
            lines.append(f"  {g.group_id} (v{g.policy_version}): max |dA| {g.max_advantage_change:.4g}, "
                         f"rewards {old} -> {new}")
        lines.extend(f"  error: {e}" for e in self.errors[:limit])
        return "\n".join(lines)


def advantages(trajectories: Sequence[Trajectory], rewards: Sequence[float | None], loss: str) -> list[float | None]:
    """The trainer's advantage of each trajectory of one group under ``rewards`` (see the module docstring)."""
    if any(r is None for r in rewards):
        return [None] * len(trajectories)
    samples = [Sample(t.prompt_ids.tolist(), t.response_ids.tolist(), t.behaviour_logprobs.tolist(), float(r or 0.0),
                      t.group_id) for t, r in zip(trajectories, rewards, strict=True)]
    kept = trainable(samples)
    adv = compute_advantages(kept, loss).tolist() if kept else []
    out: list[float | None] = []
    it = iter(adv)
    for s in samples:
        out.append(next(it) if len(s.response_ids) > 0 else None)
    return out


def group_diff(members: Sequence[Trajectory], new: Sequence[float | None], errors: Sequence[str | None],
               loss: str) -> GroupDiff:
    """One group's diff: recorded rewards (``t.reward``) vs ``new`` ones, with their advantages."""
    old = [t.reward for t in members]
    old_adv, new_adv = advantages(members, old, loss), advantages(members, new, loss)
    rows = tuple(TrajectoryDiff(t.trajectory_id, o, n, oa, na, e)
                 for t, o, n, oa, na, e in zip(members, old, new, old_adv, new_adv, errors, strict=True))
    return GroupDiff(members[0].group_id, int(members[0].policy_version), rows)


def by_group(trajectories: Sequence[Trajectory]) -> dict[str, list[Trajectory]]:
    """First copy of each trajectory id, grouped by GRPO group, groups and members in first-seen order."""
    seen: set[str] = set()
    out: dict[str, list[Trajectory]] = {}
    for t in trajectories:
        if t.trajectory_id not in seen:
            seen.add(t.trajectory_id)
            out.setdefault(t.group_id, []).append(t)
    return out


def rescore(source: RecordSource, reward_fn: str | None = None, topic: str = topics.SCORED,
            version: int | None = None, group: str | None = None, timeout_s: float | None = None) -> RescoreReport:
    """Re-score the source's run with ``reward_fn`` (default: the run's own)."""
    if topic not in (topics.SCORED, topics.TRAJECTORIES):
        raise ValueError(f"rescore reads {topics.SCORED} or {topics.TRAJECTORIES}, not {topic}")
    info = source.run_info()
    config = DoraConfig.from_json(info.config_json)
    fn = reward_fn or config.reward_fn
    groups = by_group([t for _, t in decoded(source, topic, Trajectory, version)
                       if group is None or t.group_id == group])
    members = [t for g in groups.values() for t in g]
    with RewardRunner(fn, timeout_s or config.reward_timeout_s) as runner:
        outcomes = runner.score_many([RewardRequest(t.task, t.reference, t.response_text, t.trajectory_id)
                                      for t in members])
    result = dict(zip((t.trajectory_id for t in members), outcomes, strict=True))
    diffs = []
    for g in groups.values():
        outs = [result[t.trajectory_id] for t in g]
        diffs.append(group_diff(g, [o if isinstance(o, float) else None for o in outs],
                                [o.message if isinstance(o, RewardError) else None for o in outs], config.loss))
    return RescoreReport(info.run_id, topic, config.reward_fn, fn, tuple(diffs))
