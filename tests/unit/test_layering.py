"""Wiring apart from logic: the rules run without any Kafka client, and callers never probe types."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
KAFKA_CLIENTS = ("confluent_kafka", "aiokafka", "faust", "mode")


@pytest.mark.parametrize("module", ["dora_rl.streams.simulator", "dora_rl.streams.scheduling",
                                    "dora_rl.streams.batching", "dora_rl.core.instance_policy"])
def test_rules_and_simulator_import_no_kafka_client(module: str) -> None:
    code = (f"import sys, {module}\n"
            f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {KAFKA_CLIENTS!r})\n"
            "print(','.join(bad))\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "", f"{module} imports Kafka clients: {run.stdout.strip()}"


def test_roles_that_do_not_train_start_without_torch() -> None:
    """A killed scorer, assembler or orchestrator restarts through ``dora_rl.cli`` (and ``_bootstrap`` imports the
    launcher): importing torch and transformers there cost ~6 s of every such restart (decision 0039). The rollout
    worker and its emulated engine too: a model engine imports torch when ``make_engine`` builds it."""
    modules = ("dora_rl.cli", "dora_rl.launcher", "dora_rl.streams.reward_scorer", "dora_rl.streams.assembler",
               "dora_rl.streams.orchestrator", "dora_rl.core.rewards", "dora_rl.roles",
               "dora_rl.producers.rollout.worker", "dora_rl.producers.rollout.emulated")
    code = (f"import sys, {', '.join(modules)}\n"
            "print(','.join(sorted(m for m in ('torch', 'transformers', 'vllm') if m in sys.modules)))\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "", f"a role that does not train imports {run.stdout.strip()}"


@pytest.mark.parametrize("path", ["streams/orchestrator.py", "streams/simulator.py", "producers/rollout/worker.py"])
def test_callers_drive_interfaces_without_probing(path: str) -> None:
    tree = ast.parse((REPO / path).read_text())
    probes = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
              and n.func.id in ("hasattr", "getattr")]
    assert probes == [], f"{path} probes objects with hasattr/getattr at lines {probes}"


def test_simulator_and_worker_share_the_instance_rule() -> None:
    """The simulator and the rollout instance's request book (which the worker and its processor keep) call one rule."""
    worker = (REPO / "producers/rollout/worker.py").read_text()
    assert "from .instance_rules import RequestBook" in worker and "next_version(" not in worker.replace(
        "book.next_version(", "")
    for path in ("streams/simulator.py", "producers/rollout/instance_rules.py"):
        text = (REPO / path).read_text()
        assert "from dora_rl.core.instance_policy import next_version, startable" in text, path


def test_test_files_have_unique_basenames() -> None:
    """pytest imports test files by basename (no __init__.py): two with one name break collection."""
    from collections import Counter
    from pathlib import Path

    names = Counter(p.name for p in (Path(__file__).resolve().parents[1]).rglob("test_*.py"))
    assert not [n for n, c in names.items() if c > 1], names.most_common(3)
