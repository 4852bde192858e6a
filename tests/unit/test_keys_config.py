"""Keys carry the version; partitions follow the group; the config refuses bad knobs."""

from __future__ import annotations

import pytest

from dora_rl.config import DoraConfig
from dora_rl.infra.kafka.keys import make_key, murmur2, parse_key, partition_for


def test_key_round_trip_and_sorting() -> None:
    assert make_key(3, "g-1") == "v0000000003/g-1"
    assert parse_key(b"v0000000003/g-1") == (3, "g-1")
    assert parse_key(make_key(None, "run/p1")) == (None, "run/p1")
    keys = [make_key(v, "g") for v in (10, 2, 100)]
    assert sorted(keys) == [make_key(v, "g") for v in (2, 10, 100)]
    with pytest.raises(ValueError):
        parse_key("garbage")
    with pytest.raises(ValueError):
        make_key(-1, "g")


def test_murmur2_matches_kafka_reference_values() -> None:
    # Reference values from Kafka's UtilsTest.testMurmur2 (org.apache.kafka.common.utils).
    cases = {b"21": -973932308, b"foobar": -790332482, b"a-little-bit-long-string": -985981536,
             b"a-little-bit-longer-string": -1486304829, b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8": -58897971,
             b"abc": 479470107}
    for data, expected in cases.items():
        assert murmur2(data) == expected


def test_partition_depends_on_group_only() -> None:
    # the same group lands on one partition whatever the version in the key
    assert len({partition_for("run/p7", 4) for _ in range(3)}) == 1
    spread = {partition_for(f"run/p{i}", 4) for i in range(64)}
    assert spread == {0, 1, 2, 3}


def test_config_invariants() -> None:
    assert DoraConfig(mode="sync", max_staleness=3).validate().max_staleness == 0
    assert DoraConfig(mode="one_step_off").validate().max_staleness == 1
    with pytest.raises(ValueError, match="multiple"):
        DoraConfig(train_batch_size=10, group_size=4, rollout_batch_size=12).validate()
    with pytest.raises(ValueError, match="rollout_batch_size"):
        DoraConfig(train_batch_size=16, rollout_batch_size=8, group_size=8).validate()
    with pytest.raises(ValueError, match="unknown config keys"):
        DoraConfig.from_dict({"stpes": 3})


def test_config_file_and_overrides(tmp_path) -> None:  # type: ignore[no-untyped-def]
    f = tmp_path / "c.toml"
    f.write_text('mode = "dora"\nmax_staleness = 2\nsteps = 7\n')
    cfg = DoraConfig.load(f, steps=9, mode=None)
    assert (cfg.mode, cfg.max_staleness, cfg.steps) == ("dora", 2, 9)
    assert DoraConfig.from_json(cfg.to_json()) == cfg
