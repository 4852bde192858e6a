"""TensorBoard event files of a run (``consumers/tensorboard_log.py``), read back with TensorBoard's
own reader."""

from __future__ import annotations

from pathlib import Path

from dora_rl.consumers.tensorboard_log import TensorBoardLog
from dora_rl.schemas.records import Metric


def test_metrics_become_tensorboard_scalars(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = TensorBoardLog(tmp_path / "tb")
    for step in range(3):
        log.observe(Metric(run_id="r", component="trainer", name="reward_mean", value=0.1 * step,
                           ts_ms=1_000 + step, step=step))
    log.observe(Metric(run_id="r", component="trainer", name="eval_pass_at_1", value=0.25, ts_ms=5, version=4))
    for _ in range(2):  # neither step nor version: the x-axis counts the points of the tag
        log.observe(Metric(run_id="r", component="rollout", name="tokens_per_s", value=9.0, ts_ms=7,
                           labels={"instance": "rollout-1"}))
    log.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert tags == {"trainer/reward_mean", "trainer/eval_pass_at_1", "rollout/tokens_per_s/rollout-1"}
    reward = acc.Scalars("trainer/reward_mean")
    assert [e.step for e in reward] == [0, 1, 2]
    assert [round(e.value, 6) for e in reward] == [0.0, 0.1, 0.2]
    assert reward[0].wall_time == 1.0
    assert [e.step for e in acc.Scalars("trainer/eval_pass_at_1")] == [4]
    assert [e.step for e in acc.Scalars("rollout/tokens_per_s/rollout-1")] == [0, 1]
