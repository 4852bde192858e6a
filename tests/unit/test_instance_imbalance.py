"""The MoE-imbalance variant's per-instance speed (``core/emulation.py``: ``instance_factor``,
``for_instance``): off by default, a pure function of (seed, instance), every cost scaled alike, mean
speed 1 — and the engine and the simulator both apply it."""

from __future__ import annotations

import statistics
from dataclasses import replace

import pytest

from dora_rl.config import DoraConfig
from dora_rl.core.emulation import (
    EmulatedParams,
    decode_time,
    for_instance,
    instance_factor,
    prefill_time,
)
from dora_rl.streams.simulator import simulate

BASE = EmulatedParams(base_step_s=0.02, kv_s_per_token=1e-6, prefill_s_per_token=2e-5,
                      prefill_s_per_token_sq=1e-9, time_scale=0.0)


def test_off_by_default_and_the_same_params() -> None:
    assert EmulatedParams().instance_speed_sigma == 0.0
    assert instance_factor(7, BASE) == 1.0 and for_instance(BASE, 7) is BASE


def test_every_cost_scales_by_the_factor_and_draws_are_pure() -> None:
    p = replace(BASE, instance_speed_sigma=0.4, seed=3)
    f = instance_factor(5, p)
    assert f != 1.0 and f == instance_factor(5, replace(p)) and f != instance_factor(6, p)
    assert instance_factor(5, replace(p, seed=4)) != f
    q = for_instance(p, 5)
    assert decode_time(40, 8, 64, 2_000, q) == pytest.approx(f * decode_time(40, 8, 64, 2_000, p))
    assert prefill_time(3_000, q) == pytest.approx(f * prefill_time(3_000, p))
    assert q.kv_capacity_tokens == p.kv_capacity_tokens and q.load_s == p.load_s  # memory and weight loads: not


def test_mean_speed_is_one() -> None:
    p = replace(BASE, instance_speed_sigma=0.5)
    speeds = [1.0 / instance_factor(i, p) for i in range(20_000)]
    assert statistics.fmean(speeds) == pytest.approx(1.0, abs=0.02)
    assert max(speeds) / min(speeds) > 4  # a real spread


def test_the_engine_and_the_simulator_apply_it() -> None:
    from dora_rl.producers.rollout.requests import make_engine

    cfg = DoraConfig.from_dict({"mode": "dora", "max_staleness": 1, "steps": 4, "train_batch_size": 16,
                                "group_size": 4, "rollout_batch_size": 32, "num_instances": 4,
                                "instance_concurrency": 8, "max_new_tokens": 128, "engine": "emulated",
                                "emulated": {"time_scale": 0.0, "instance_speed_sigma": 0.5}})
    steps = {i: make_engine(cfg, i).params.base_step_s for i in range(4)}  # type: ignore[attr-defined]
    p = EmulatedParams.from_dict({"seed": cfg.seed, **cfg.emulated})
    assert steps == {i: pytest.approx(p.base_step_s * instance_factor(i, p)) for i in range(4)}
    even = simulate(replace(cfg, emulated={"time_scale": 0.0}), EmulatedParams(time_scale=0.0))
    spread = simulate(cfg, p)
    assert spread.steps == even.steps == 4 and spread.mixed_version_trajectories == 0
    assert spread.wall_s != even.wall_s  # the instances' speeds reach the simulated clock
