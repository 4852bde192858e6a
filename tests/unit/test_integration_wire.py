"""The standalone examples and the registry codec agree with the package's own wire format (no broker).

``examples/reward_service.py`` reimplements, without importing ``dora_rl``, what a scored record needs:
the encoding and headers (codec), the partition (Kafka's murmur2 of the group id) and the task rewards.
"""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path
from types import ModuleType

import fastavro
import pytest

from dora_rl.cli import build_parser
from dora_rl.config import DoraConfig
from dora_rl.core.tasks import get_task
from dora_rl.infra.kafka.keys import partition_for
from dora_rl.schemas import codec
from dora_rl.schemas.registry import registry_schema

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "reward_service.py"


@pytest.fixture(scope="module")
def service() -> ModuleType:
    spec = importlib.util.spec_from_file_location("reward_service_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_imports_nothing_of_dora_rl() -> None:
    for path in EXAMPLE.parent.glob("*.py"):
        assert "dora_rl" not in "".join(line for line in path.read_text().splitlines(keepends=True)
                                        if line.lstrip().startswith(("import ", "from "))), path


def test_example_partition_is_dora_partition(service: ModuleType) -> None:
    rng = random.Random(1)
    for _ in range(3000):
        group = "".join(chr(rng.randrange(32, 0x250)) for _ in range(rng.randrange(0, 24)))
        for n in (1, 4, 7, 16):
            assert service.partition_for(group, n) == partition_for(group, n), group


def test_example_rewards_are_the_task_rewards(service: ModuleType) -> None:
    rng = random.Random(2)
    for name in ("reverse", "chainsum"):
        task = get_task(name)
        for _ in range(300):
            ref = task.sample(rng).reference
            noisy = "".join(rng.choice(ref + "#x") for _ in range(rng.randrange(0, 2 * len(ref) + 1)))
            for completion in (ref, noisy, ref[:-1], ref[::-1], ""):
                assert service.task_reward(name, ref, completion) == task.reward(ref, completion)


def test_example_encodes_as_the_codec(service: ModuleType) -> None:
    wire = service.Wire(codec.SCHEMA_DIR)
    metric = {"run_id": "r", "component": "c", "name": "n", "value": 1.5, "ts_ms": 5, "step": 2}
    assert wire.encode("Metric", metric) == codec.encode("dora.v1.Metric", metric)
    value, headers = codec.encode("dora.v1.Metric", metric)
    assert wire.decode("Metric", value, headers) == codec.decode("dora.v1.Metric", value, headers)
    with pytest.raises(ValueError, match="unknown writer"):
        wire.decode("Metric", value, [("dora.schema.fp", b"0000")])


def test_every_registry_schema_stands_alone() -> None:
    for name in codec.current_schemas():
        parsed = fastavro.parse_schema(json.loads(registry_schema(name)))  # no named type left undefined
        assert parsed["name"] == name


def test_reward_flag_sets_the_config_field() -> None:
    args = build_parser().parse_args(["run", "--reward", "external"])
    assert args.reward == "external"
    assert DoraConfig.load(None, reward_service=args.reward).reward_service == "external"
    assert DoraConfig().reward_service == "builtin"
    with pytest.raises(ValueError, match="reward_service"):
        DoraConfig(reward_service="extrenal").validate()  # type: ignore[arg-type]
