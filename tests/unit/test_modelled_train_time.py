"""The trainer's modelled time (emulated benches): one formula for the simulator and the real trainer."""

from __future__ import annotations

import time

import numpy as np
import pytest

from dora_rl.config import DoraConfig
from dora_rl.consumers.trainer.role import pad_to_modelled_time
from dora_rl.core.emulation import EmulatedParams, modelled_train_s
from dora_rl.schemas.records import TrainBatch, Trajectory
from dora_rl.streams.simulator import simulate


def _batch(prompt: int, responses: list[int]) -> TrainBatch:
    trajs = tuple(Trajectory(run_id="r", trajectory_id=f"g/{i}", group_id="g", prompt_id="g", sample_index=i,
                             group_size=len(responses), policy_version=0, task="reverse", reference="",
                             prompt_ids=np.ones(prompt, dtype=np.int32), response_ids=np.arange(n, dtype=np.int32),
                             behaviour_logprobs=np.full(n, -1.0), instance_version=0, reward=0.0)
                  for i, n in enumerate(responses))
    return TrainBatch(run_id="r", batch_id="r/step0", train_step=0, base_version=0, max_staleness=0, created_ms=0,
                      trajectories=trajs)


def _cfg(**kw: float) -> DoraConfig:
    return DoraConfig.from_dict({"train_batch_size": 2, "group_size": 2, "rollout_batch_size": 2, **kw})


def test_the_formula() -> None:
    assert modelled_train_s(0.5, 1e-3, 1000) == pytest.approx(1.5)
    assert modelled_train_s(0.0, 0.0, 10**6) == 0.0


def test_the_trainer_waits_out_the_model_after_its_real_update() -> None:
    batch = _batch(prompt=10, responses=[30, 50])  # 100 tokens
    cfg = _cfg(modelled_train_s_fixed=0.05, modelled_train_s_per_token=1e-3)  # 0.15 s
    t0 = time.perf_counter()
    waited = pad_to_modelled_time(batch, cfg, spent_s=0.1)
    assert waited == pytest.approx(0.05)
    assert 0.045 <= time.perf_counter() - t0 < 0.5
    assert pad_to_modelled_time(batch, cfg, spent_s=0.4) == 0.0, "a slower real update is not shortened"
    assert pad_to_modelled_time(batch, _cfg(), spent_s=0.0) is None, "off by default"
    with pytest.raises(ValueError, match="modelled_train_s"):
        _cfg(modelled_train_s_fixed=-1.0)


def test_the_simulator_trains_for_the_same_modelled_time() -> None:
    cfg = DoraConfig.from_dict({"mode": "sync", "steps": 3, "train_batch_size": 8, "group_size": 4,
                                "rollout_batch_size": 8, "num_instances": 2, "instance_concurrency": 4,
                                "max_new_tokens": 64, "engine": "emulated"})
    r = simulate(cfg, EmulatedParams(time_scale=0.0, seed=2), train_s_fixed=0.3, train_s_per_token=2e-3,
                 prompt_tokens=12)
    assert r.train_s == pytest.approx([modelled_train_s(0.3, 2e-3, n + 12 * 8) for n in r.step_tokens])
