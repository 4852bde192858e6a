"""Poison input in real runs (real broker, dora mode): each run completes and the audit lists the refusals.

One run holds a prompt the engine raises on, a reward function that raises on one prompt's trajectories
and one that hangs on another's; a second run holds a prompt that kills its rollout process (the tries
are durable, so the restarted instance isolates and refuses it). Every refused group is replaced by a
new prompt, so every batch stays exactly TBS and the strict audit passes.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from run_helpers import emulated_run

pytestmark = pytest.mark.broker

CONFIG = emulated_run(steps=8, max_new_tokens=64, seed=7, max_attempts=2, emulated={"base_step_s": 0.02})

REWARD_MODULE = '''
import os, time
from dora_rl.core.rewards import task_reward

def score(task, reference, completion):
    if reference == os.environ["POISON_RAISE_REF"]:
        raise ValueError("poison completion")
    if reference == os.environ["POISON_HANG_REF"]:
        time.sleep(3600)
    return task_reward(task, reference, completion)
'''


def _references(task: str, seed: int, count: int) -> list[str]:
    """The references of a run's first prompts (the dataset's deterministic stream)."""
    from dora_rl.core.tasks import get_task

    t, rng = get_task(task), random.Random(seed)
    return [t.sample(rng).reference for _ in range(count)]


def _run(bootstrap: str, config: dict[str, Any], tmp: Path, env: dict[str, str]) -> tuple[dict[str, Any], str]:
    cfg, out = tmp / "config.json", tmp / "summary.json"
    cfg.write_text(json.dumps(config))
    proc = subprocess.run([sys.executable, "-m", "dora_rl", "run", "--bootstrap-servers", bootstrap, "--config",
                           str(cfg), "--json", str(out), "--quiet"], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **env})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    return summary, summary["run_id"]


def test_engine_raise_reward_raise_and_reward_hang_are_refused_and_the_run_completes(
        bootstrap: str, dora_home: Path, tmp_path: Path) -> None:
    from dora_rl.consumers.audit import audit_run

    refs = _references("reverse", CONFIG["seed"], 8)
    raise_ref, hang_ref = refs[4], refs[6]
    assert len({raise_ref, hang_ref, refs[2]}) == 3 and refs.count(raise_ref) == refs.count(hang_ref) == 1
    (tmp_path / "poison_reward.py").write_text(REWARD_MODULE)
    config = {**CONFIG, "reward_fn": "poison_reward:score", "reward_timeout_s": 1.5,
              "emulated": {**CONFIG["emulated"], "fail_on": ["/p2/1"]}}
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "POISON_RAISE_REF": raise_ref, "POISON_HANG_REF": hang_ref}
    summary, run_id = _run(bootstrap, config, tmp_path, env)
    assert summary["steps"] == config["steps"]
    report = audit_run(bootstrap, run_id)
    assert report.verdict == "PASS", report.render()
    refused = {g["group_id"].rsplit("/", 1)[1]: g for g in report.refused_groups}
    assert set(refused) == {"p2", "p4", "p6"}, refused
    assert refused["p2"]["error_type"] == "engine" and "emulated engine failure" in refused["p2"]["reason"]
    assert refused["p4"]["error_type"] == "reward" and "poison completion" in refused["p4"]["reason"]
    assert refused["p6"]["error_type"] == "reward" and "timeout" in refused["p6"]["reason"]
    assert report.tbs_wrong_size == 0 and report.trajectories_batched == config["steps"] * config["train_batch_size"]
    rendered = report.render()
    assert all(f"/{g}" in rendered for g in ("p2", "p4", "p6")), "the audit lists every refusal"


def test_a_prompt_that_kills_its_rollout_process_is_isolated_and_refused(
        bootstrap: str, dora_home: Path, tmp_path: Path) -> None:
    from dora_rl.consumers.audit import audit_run

    config = {**CONFIG, "seed": 8, "steps": 6,
              "emulated": {**CONFIG["emulated"], "fail_on": ["/p3/0"], "fail_exit": True}}
    summary, run_id = _run(bootstrap, config, tmp_path, {})
    assert summary["steps"] == config["steps"]
    restarts = summary["restarts"]
    killed = [r for r in restarts if r.startswith("rollout-")]
    assert len(killed) == 1 and restarts[killed[0]] == 2 + config["max_attempts"], restarts
    report = audit_run(bootstrap, run_id)
    assert report.verdict == "PASS", report.render()
    [group] = report.refused_groups
    assert group["group_id"].endswith("/p3") and group["error_type"] == "engine" and group["attempts"] == 4, group
