"""The strict config (``dora_rl/config_checks.py``): every field's type and range, unknown keys and values
refused with the closest match — before any role starts."""

from __future__ import annotations

import pytest

from dora_rl.config import DoraConfig


@pytest.mark.parametrize(("data", "why"), [
    ({"decoupled_ppo": "false"}, "decoupled_ppo = 'false': must be true or false"),
    ({"engine": "vLLM"}, "did you mean 'vllm'"),
    ({"engine": "emulatd"}, "did you mean 'emulated'"),
    ({"loss": "GRPO"}, "did you mean 'grpo'"),
    ({"lr": -1}, "lr = -1: must be > 0"),
    ({"lr": float("nan")}, "lr = nan: must be a finite number"),
    ({"group_size": 1, "train_batch_size": 8, "rollout_batch_size": 8}, "group_size = 1: must be >= 2"),
    ({"checkpoint_every": 0}, "checkpoint_every = 0: must be >= 1"),
    ({"max_new_tokens": 0}, "max_new_tokens = 0: must be >= 1"),
    ({"temperature": 0}, "temperature = 0: must be > 0"),
    ({"reward_timeout_s": -5}, "reward_timeout_s = -5: must be > 0"),
    ({"steps": True}, "steps = True: must be an integer"),
    ({"steps": 2.5}, "steps = 2.5: must be an integer"),
    ({"tis_cap": 0}, "tis_cap = 0: must be > 0"),
    ({"sft_steps": "10"}, "sft_steps = '10': must be an integer"),
    ({"emulated": [1]}, "emulated = [1]: must be a table"),
])
def test_bad_values_are_refused_naming_the_field(data: dict, why: str) -> None:
    with pytest.raises(ValueError) as info:
        DoraConfig.from_dict(data)
    assert why in str(info.value)


def test_every_problem_is_named_at_once_and_good_values_pass() -> None:
    with pytest.raises(ValueError) as info:
        DoraConfig.from_dict({"lr": 0, "steps": 0, "dtype": "bf32"})
    text = str(info.value)
    assert "lr = 0" in text and "steps = 0" in text and "dtype = 'bf32'" in text
    ok = DoraConfig.from_dict({"lr": 1, "tis_cap": None, "sft_steps": None, "packed": True, "temperature": 0.7})
    assert ok.lr == 1 and ok.tis_cap is None
    with pytest.raises(ValueError, match="did you mean 'max_staleness'"):
        DoraConfig.from_dict({"max_stalenes": 2})
    with pytest.raises(ValueError, match="must be one of"):
        DoraConfig(mode="async").validate()  # type: ignore[arg-type]  # direct construction is checked too


def test_max_instances_follows_the_instance_count_unless_set() -> None:
    assert DoraConfig.from_dict({"num_instances": 24}).instance_limit == 24  # refused before unless raised too
    assert DoraConfig().instance_limit == 16
    assert DoraConfig.from_dict({"num_instances": 4, "max_instances": 8}).instance_limit == 8
    with pytest.raises(ValueError, match="must be <= max_instances"):
        DoraConfig.from_dict({"num_instances": 9, "max_instances": 8})


def test_every_field_with_a_value_of_the_wrong_type_is_refused_naming_it() -> None:
    """Each field of :class:`DoraConfig` in turn gets a value no type of it admits (a list, or a table for a
    field that takes a list): the error names that field."""
    import dataclasses

    for f in dataclasses.fields(DoraConfig):
        bad: object = {"x": 1} if "list" in str(f.type) or "tuple" in str(f.type) else [1, 2]
        with pytest.raises(ValueError) as info:
            DoraConfig.from_dict({f.name: bad})
        assert f"{f.name} = " in str(info.value), (f.name, str(info.value))


def test_the_cli_refuses_a_bad_config_within_seconds_naming_the_field(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``dora-rl run`` with a config of a wrong type exits 2 before it starts a broker or any role."""
    import json
    import os
    import subprocess
    import sys
    import time

    cfg = tmp_path / "bad.json"
    cfg.write_text(json.dumps({"steps": "ten", "max_staleness": -1}))
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "dora_rl", "run", "--config", str(cfg)], capture_output=True,
                         text=True, timeout=60, env={**os.environ, "DORA_HOME": str(tmp_path)})
    assert time.monotonic() - t0 < 10
    assert res.returncode == 2, res.stderr[-2000:]
    assert "steps = 'ten'" in res.stderr and "max_staleness = -1" in res.stderr
    assert not (tmp_path / "runs").exists(), "nothing may start"
