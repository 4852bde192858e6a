"""The one rule for what may reach an update (``dora_rl/core/training_input.py``) and the trainer's last
guards: its batch check with the vocabulary, and no optimizer step on a non-finite loss or gradient."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from dora_rl.consumers.trainer.update import NonFiniteUpdate, Sample, policy_update
from dora_rl.core.training_input import reward_problem, trajectory_problem
from dora_rl.modeling import build_tiny_model, load_policy

torch.set_num_threads(1)
OK = dict(prompt_ids=[1, 5], response_ids=[7, 2], behaviour_logprobs=[-0.5, -0.1], reward=0.5)


def test_reward_rule() -> None:
    assert reward_problem(0.0) is None and reward_problem(1) is None
    for bad in (float("nan"), float("inf"), -1e-9, 1.0000001, "0.5", None, True):
        assert reward_problem(bad) is not None, bad


@pytest.mark.parametrize(("change", "why"), [
    (dict(reward=None), "no reward"), (dict(reward=float("nan")), "reward"), (dict(prompt_ids=[]), "empty prompt"),
    (dict(behaviour_logprobs=[-0.5]), "1 behaviour log-probs for 2"),
    (dict(behaviour_logprobs=[-0.5, float("-inf")]), "log-prob"), (dict(behaviour_logprobs=[-0.5, 0.2]), "log-prob"),
    (dict(response_ids=[7, -1]), "response token id"), (dict(prompt_ids=[1, 99]), "prompt token id"),
    (dict(token_versions=np.asarray([3])), "token versions")])
def test_trajectory_rule_names_the_first_broken_rule(change: dict, why: str) -> None:
    assert trajectory_problem(**OK) is None
    assert trajectory_problem(**OK, vocab=100) is None
    problem = trajectory_problem(**{**OK, **change}, vocab=50)
    assert problem is not None and why in problem


def test_no_optimizer_step_on_a_non_finite_loss(tmp_path: Path) -> None:
    model, _ = load_policy(build_tiny_model(tmp_path / "m", "1m", seed=0))
    before = [p.detach().clone() for p in model.parameters()]
    samples = [Sample([1, 5, 6], [7, 8], [-3.0, float("nan")], float(i % 2), "g0") for i in range(4)]
    with pytest.raises(NonFiniteUpdate, match="no weight was changed"):
        policy_update(model, torch.optim.AdamW(model.parameters(), lr=1e-2), samples)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


def test_trainer_refuses_a_batch_with_a_token_outside_its_vocabulary() -> None:
    from dora_rl.config import DoraConfig
    from dora_rl.consumers.trainer.session import validate_batch
    from dora_rl.schemas.records import TrainBatch, Trajectory

    def traj(i: int, response: list[int]) -> Trajectory:
        return Trajectory(run_id="r", trajectory_id=f"g/{i}", group_id="g", prompt_id="g", sample_index=i,
                          group_size=2, policy_version=0, task="reverse", reference="ab",
                          prompt_ids=np.asarray([1, 5], dtype=np.int32), response_ids=np.asarray(response, np.int32),
                          behaviour_logprobs=np.full(len(response), -0.5, np.float32), reward=0.5, instance_version=0)

    cfg = DoraConfig.from_dict({"train_batch_size": 2, "group_size": 2, "rollout_batch_size": 2})
    batch = TrainBatch(run_id="r", batch_id="r/step0", train_step=0, base_version=0, max_staleness=0, created_ms=0,
                       trajectories=(traj(0, [7, 2]), traj(1, [7, 64])))
    assert validate_batch(batch, cfg) is None  # without the vocabulary the ids are only checked >= 0
    reason = validate_batch(batch, cfg, vocab=58)
    assert reason is not None and "g/1" in reason and "response token id" in reason
