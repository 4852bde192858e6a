"""The pure rules of Ray placement (``dora_rl/ray_placement.py``): resources per role and the scaling plan.
The actors themselves run in ``tests/integration/test_ray_placement.py`` and ``test_ray_netns.py``."""

from __future__ import annotations

import pytest

from dora_rl.config import DoraConfig
from dora_rl.ray_placement import RunControl, role_resources, scale_plan


def test_a_cpu_run_asks_for_no_gpu_and_a_gpu_run_one_per_instance_and_per_trainer_rank() -> None:
    cpu = DoraConfig()
    assert role_resources(cpu, "trainer") == {"num_cpus": 1, "num_gpus": 0}
    assert role_resources(cpu, "rollout") == {"num_cpus": 1, "num_gpus": 0}
    assert role_resources(cpu, "orchestrator") == {"num_cpus": 0.25, "num_gpus": 0}
    gpu = DoraConfig(device="cuda", trainer_ranks=4)
    assert role_resources(gpu, "trainer")["num_gpus"] == 4
    assert role_resources(gpu, "rollout")["num_gpus"] == 1
    assert role_resources(gpu, "scorer")["num_gpus"] == 0


def test_the_config_overrides_a_role_s_resources() -> None:
    cfg = DoraConfig(ray_resources={"rollout": {"num_gpus": 2, "resources": {"h100": 1}}})
    assert role_resources(cfg, "rollout") == {"num_cpus": 1, "num_gpus": 2, "resources": {"h100": 1}}
    assert role_resources(cfg, "trainer") == {"num_cpus": 1, "num_gpus": 0}


@pytest.mark.parametrize(("current", "desired", "limit", "add", "remove"), [
    ([0, 1], 3, 4, [2], []),
    ([0, 2], 4, 4, [1, 3], []),            # the gap first
    ([0, 1, 2, 3], 2, 4, [], [3, 2]),      # the highest leave
    ([0, 1], 9, 4, [2, 3], []),            # never past max_instances
    ([0, 1], 0, 4, [], [1]),               # at least one
    ([0, 1], 2, 4, [], []),
])
def test_scale_plan(current: list[int], desired: int, limit: int, add: list[int], remove: list[int]) -> None:
    assert scale_plan(current, desired, limit) == (add, remove)


def test_a_seed_sets_only_an_unset_count_so_a_restarted_control_actor_never_reverts_a_scale() -> None:
    control = RunControl()  # what Ray builds at the start and again at every restart: no count
    assert control.instances() is None
    assert control.seed(3) == 3
    assert control.seed(5) == 3  # a second driver's seed changes nothing
    assert control.set_instances(4) == 4  # `dora-rl scale`
    assert control.seed(3) == 4 and control.instances() == 4
    restarted = RunControl()
    assert restarted.seed(4) == 4  # the driver seeds it with the instances Ray holds, not the config's count


def test_a_role_started_through_the_trampoline_dies_with_its_parent(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """What keeps a killed actor from leaving an orphan role: the child is SIGKILLed when its parent dies."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from dora_rl.ray_placement import DIE_WITH_PARENT

    pid_file = tmp_path / "child.pid"
    parent = subprocess.Popen([sys.executable, "-c", (
        "import os, subprocess, sys, time; "
        f"p = subprocess.Popen([sys.executable, '-c', {DIE_WITH_PARENT!r}, str(os.getpid()), sys.executable, '-c', "
        "'import time; time.sleep(60)'], start_new_session=True); "
        f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)")])
    deadline = time.monotonic() + 20
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline, "no child"
        time.sleep(0.05)
    child = int(pid_file.read_text())
    while b"time.sleep(60)" not in open(f"/proc/{child}/cmdline", "rb").read():  # exec'd: past the trampoline
        assert time.monotonic() < deadline, "the trampoline never exec'd the role"
        time.sleep(0.02)
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{child}") and _state(child) != "Z":
        assert time.monotonic() < deadline, "the child outlived its parent"
        time.sleep(0.05)


def _state(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"
