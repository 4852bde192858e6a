"""The scorer processor: crash at every record boundary gives the uninterrupted output; poison rewards
are retried a bounded number of times, then their group is refused with the reason."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np
import pytest

from dora_rl.core.rewards import RewardError
from dora_rl.infra.kafka import topics
from dora_rl.schemas.records import Trajectory
from dora_rl.streams.processor import InRecord, MemoryDriver, OutRecord
from dora_rl.streams.reward_scorer import Scorer

RUN = "r1"


def _traj(gid: str, i: int, text: str) -> Trajectory:
    return Trajectory(run_id=RUN, trajectory_id=f"{gid}/{i}", group_id=gid, prompt_id=gid, sample_index=i,
                      group_size=4, policy_version=1, task="reverse", reference="ab",
                      prompt_ids=np.asarray([5, 6], dtype=np.int32), response_ids=np.asarray([7, 2], dtype=np.int32),
                      behaviour_logprobs=np.asarray([-0.5, -0.1], dtype=np.float32), response_text=text,
                      instance_version=1)


class FakeReward:
    """``raise`` always fails, ``flaky`` fails on its first try only; anything else scores its length."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()

    def __call__(self, batch: Sequence[Trajectory]) -> list[float | RewardError]:
        out: list[float | RewardError] = []
        for t in batch:
            self.calls[t.trajectory_id] += 1
            if t.response_text == "raise" or (t.response_text == "flaky" and self.calls[t.trajectory_id] == 1):
                out.append(RewardError(t.trajectory_id, "exception", "ValueError: bad completion"))
            else:
                out.append(len(t.response_text) / 10)
        return out


def _inputs() -> list[InRecord]:
    texts = ["ba", "raise", "flaky", "b", "ab", "bab", "x", "ba"]
    return [InRecord(topics.TRAJECTORIES, k % 2, k // 2, f"v1/{RUN}/p{k // 4}".encode(),
                     _traj(f"{RUN}/p{k // 4}", k % 4, text)) for k, text in enumerate(texts)]


def _wire(outs: list[OutRecord]) -> list[tuple[str, str, bytes]]:
    return [(o.topic, o.key, b"" if o.topic == topics.METRICS and o.record.name == "score_s" else o.record.encode()[0])
            for o in outs]


def test_poison_reward_is_retried_then_its_group_refused_with_the_reason() -> None:
    reward = FakeReward()
    out = MemoryDriver(lambda: Scorer(RUN, 4, reward, max_attempts=3), _inputs()).run()
    scored = [o.record for o in out if o.topic == topics.SCORED]
    letters = [o.record for o in out if o.topic == topics.DLQ]
    assert len(scored) == 7 and {t.trajectory_id for t in scored} == {
        f"{RUN}/p{k // 4}/{k % 4}" for k in range(8)} - {f"{RUN}/p0/1"}
    assert reward.calls[f"{RUN}/p0/1"] == 3, "tried max_attempts times, then refused"
    assert reward.calls[f"{RUN}/p0/2"] == 2, "a flaky reward succeeds on its retry"
    [letter] = letters
    assert (letter.group_id, letter.trajectory_id, letter.attempts, letter.error_type) == (
        f"{RUN}/p0", f"{RUN}/p0/1", 3, "reward")
    assert "ValueError: bad completion" in letter.reason and letter.value is not None
    assert Trajectory.decode(letter.value).trajectory_id == f"{RUN}/p0/1", "the original record is kept"


@pytest.mark.parametrize("commit_every", [1, 3])
def test_crash_at_every_record_boundary_gives_the_uninterrupted_output(commit_every: int) -> None:
    inputs = _inputs()
    factory = lambda: Scorer(RUN, 4, FakeReward(), max_attempts=2)  # noqa: E731
    clean = MemoryDriver(factory, inputs).run()
    assert any(o.topic == topics.DLQ for o in clean)
    for k in range(1, len(inputs)):
        driver = MemoryDriver(factory, inputs, commit_every=commit_every)
        assert _wire(driver.run(crash_after=[k])) == _wire(clean), f"crash after record {k}"
