"""Prompt data (``dora_rl.core.prompt_data``): loading, validation, split, order and identity."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dora_rl.core.prompt_data import (
    DataSpec,
    PromptRow,
    dumps_tagged,
    epoch_order,
    loads_tagged,
    parse_gym_reference,
    split,
    train_order,
)
from dora_rl.core.rewards import RewardRequest
from dora_rl.core.verifiers import reasoning_gym_reward
from dora_rl.infra.reward_worker import RewardRunner
from dora_rl.prompt_files import identity, load_rows

RECORDS = [{"id": f"q{i}", "question": f"What is {i} + {i}?", "answer": str(2 * i) if i % 2 else 2 * i,
            "level": i % 3} for i in range(40)]


def write_jsonl(path: Path, records: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def write_parquet(path: Path, records: list[dict[str, object]]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    # one type per column: parquet cannot mix int and str answers
    pq.write_table(pa.Table.from_pylist([{**r, "answer": str(r["answer"])} for r in records]), path)
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    import datasets

    d = tmp_path_factory.mktemp("prompts")
    saved = d / "saved"
    datasets.Dataset.from_list([{**r, "answer": str(r["answer"])} for r in RECORDS]).save_to_disk(str(saved))
    return {"jsonl": write_jsonl(d / "p.jsonl", RECORDS), "parquet": write_parquet(d / "p.parquet", RECORDS),
            "saved": saved}


def spec_for(path: Path, **kw: object) -> DataSpec:
    return DataSpec(str(path), prompt_field="question", id_field="id", **kw)  # type: ignore[arg-type]


def test_jsonl_parquet_and_saved_dataset_load_the_same_rows(files: dict[str, Path]) -> None:
    rows = {kind: load_rows(spec_for(path)) for kind, path in files.items()}
    assert rows["jsonl"] == rows["parquet"] == rows["saved"]
    first = rows["jsonl"][1]
    assert first == PromptRow(row_id="q1", prompt="What is 1 + 1?", reference="2", task="math")
    assert rows["jsonl"][2].reference == "4"  # an integer answer in JSONL becomes its text
    assert [r.row_id for r in rows["jsonl"]] == [r["id"] for r in RECORDS]  # source order


def test_template_is_applied_and_default_ids_are_row_indices(files: dict[str, Path]) -> None:
    spec = DataSpec(str(files["jsonl"]), template="Q: {question} (level {level})\nA:", task="arith")
    rows = load_rows(spec)
    assert rows[4].prompt == "Q: What is 4 + 4? (level 1)\nA:"
    assert rows[4].row_id == "4" and rows[4].task == "arith"


def test_json_array_file_loads(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps(RECORDS[:3]))
    assert [r.reference for r in load_rows(spec_for(path))] == ["0", "2", "4"]


def test_missing_field_names_the_field_and_the_row(tmp_path: Path) -> None:
    records = [dict(r) for r in RECORDS[:5]]
    del records[3]["answer"]
    path = write_jsonl(tmp_path / "bad.jsonl", records)
    with pytest.raises(ValueError, match=r"bad\.jsonl row 3 has no field 'answer'"):
        load_rows(spec_for(path))
    with pytest.raises(ValueError, match=r"row 0: template .* uses field 'topic'"):
        load_rows(spec_for(write_jsonl(tmp_path / "ok.jsonl", RECORDS[:2]), template="{topic}: {question}"))


@pytest.mark.parametrize("content,name,message", [
    ('{"prompt": "a", "answer": "b"}\n{not json\n', "x.jsonl", r"x\.jsonl line 2 is not valid JSON"),
    ("", "x.jsonl", "has no rows"),
    ('{"prompt": "a", "answer": null}\n', "x.jsonl", "row 0: field 'answer' is null"),
    ('{"prompt": ["a"], "answer": "b"}\n', "x.jsonl", "row 0: field 'prompt' is a list"),
    ('[1, 2]\n', "x.jsonl", "row 0 is a list, not an object"),
    ("a,b\n", "x.csv", "unknown suffix '.csv'"),
    ("not parquet", "x.parquet", r"cannot read parquet file .*x\.parquet"),
])
def test_bad_input_is_a_clear_value_error(tmp_path: Path, content: str, name: str, message: str) -> None:
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_rows(DataSpec(str(path)))


def test_missing_source_duplicate_ids_and_bad_spec_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        load_rows(DataSpec(str(tmp_path / "nope.jsonl")))
    path = write_jsonl(tmp_path / "dup.jsonl", [RECORDS[0], RECORDS[1], RECORDS[0]])
    with pytest.raises(ValueError, match=r"row 2: id 'q0' .* repeats row 0"):
        load_rows(spec_for(path))
    with pytest.raises(ValueError, match="heldout"):
        DataSpec("a.jsonl", heldout=-1)
    with pytest.raises(ValueError, match="seed"):
        DataSpec("reasoning_gym:chain_sum", gym_config={"seed": 3})
    with pytest.raises(ValueError, match="not registered"):
        load_rows(DataSpec("reasoning_gym:no_such_gym_dataset"))


def test_split_is_disjoint_complete_and_deterministic(files: dict[str, Path]) -> None:
    spec = spec_for(files["jsonl"], heldout=8, seed=5)
    rows = load_rows(spec)
    train, held = split(rows, spec)
    assert len(held) == 8 and len(train) == 32
    assert {r.row_id for r in train}.isdisjoint(r.row_id for r in held)
    assert sorted(r.row_id for r in train + held) == sorted(r.row_id for r in rows)
    assert split(rows, spec) == (train, held)
    assert [r for r in rows if r in train] == train  # training rows keep source order
    assert held != rows[:8]  # a seeded sample, not the file's head
    _, other = split(rows, spec_for(files["jsonl"], heldout=8, seed=6))
    assert other != held
    with pytest.raises(ValueError, match="leaves no training rows"):
        split(rows, spec_for(files["jsonl"], heldout=40))


def test_train_order_is_deterministic_and_reshuffled_per_epoch(files: dict[str, Path]) -> None:
    spec = spec_for(files["jsonl"], heldout=10, seed=3)
    train, _ = split(load_rows(spec), spec)
    n = len(train)
    order = train_order(train, spec, 3 * n + 7)
    assert order == train_order(train, spec, 3 * n + 7)
    assert len(order) == 3 * n + 7
    epochs = [order[k * n:(k + 1) * n] for k in range(3)]
    for epoch in epochs:
        assert sorted(r.row_id for r in epoch) == sorted(r.row_id for r in train)  # each epoch: one pass
    assert epochs[0] != epochs[1] != epochs[2] and epochs[0] != train
    assert order[3 * n:] == [train[j] for j in epoch_order(n, spec, 3)[:7]]
    assert train_order(train, spec, 25, start=n - 5) == order[n - 5:n + 20]  # a resume continues
    assert train_order(train, spec_for(files["jsonl"], heldout=10, seed=4), n) != epochs[0]
    plain = spec_for(files["jsonl"], heldout=10, seed=3, shuffle=False)
    assert train_order(train, plain, 2 * n) == train + train


def test_identity_changes_with_one_byte(files: dict[str, Path], tmp_path: Path) -> None:
    ident = identity(spec_for(files["jsonl"]))
    assert ident.rows == 40 and ident.fields == ("answer", "id", "level", "question")
    assert identity(spec_for(files["jsonl"])) == ident
    data = bytearray(files["jsonl"].read_bytes())
    copy = tmp_path / "copy.jsonl"
    copy.write_bytes(bytes(data))
    assert identity(spec_for(copy)).sha256 == ident.sha256
    data[data.index(b"What is 7")] = ord("w")  # one byte, same length
    copy.write_bytes(bytes(data))
    assert identity(spec_for(copy)).sha256 != ident.sha256
    saved = identity(spec_for(files["saved"]))
    assert saved.rows == 40 and len(saved.sha256) == 64
    gym = identity(DataSpec("reasoning_gym:chain_sum", size=10))
    assert gym.rows == 10 and gym.fields == ("answer", "prompt", "question")
    assert identity(DataSpec("reasoning_gym:chain_sum", size=10)) == gym
    for changed in (DataSpec("reasoning_gym:chain_sum", size=10, seed=1), DataSpec("reasoning_gym:chain_sum", size=11),
                    DataSpec("reasoning_gym:chain_sum", size=10, gym_config={"max_terms": 3})):
        assert identity(changed).sha256 != gym.sha256


def test_tagged_json_round_trips_tuples_and_int_keys() -> None:
    obj = {"grid": ((1, 2), (3, 4)), "colors": {0: "red", 1: "blue"}, "__tuple__": [1], "plain": [1, "a", None]}
    assert loads_tagged(dumps_tagged(obj)) == obj
    assert json.loads(dumps_tagged(obj)) != obj  # plain JSON would lose the tuples and keys


def test_reasoning_gym_rows_score_one_with_their_own_answer() -> None:
    spec = DataSpec("reasoning_gym:basic_arithmetic", size=12, seed=7, template="{question}\nAnswer:",
                    gym_config={"max_terms": 3})
    rows = load_rows(spec)
    assert rows == load_rows(spec) and len(rows) == 12  # generated deterministically
    assert all(r.task == "reasoning_gym:basic_arithmetic" and r.prompt.endswith("\nAnswer:") for r in rows)
    entries = [parse_gym_reference(row.reference) for row in rows]
    with RewardRunner("reasoning_gym", timeout_s=60.0, spare=False) as runner:  # as the scorer runs it
        out = runner.score_many([RewardRequest(row.task, row.reference, str(entry["answer"]), row.row_id)
                                 for row, (_, _, entry) in zip(rows, entries, strict=True)])
    assert out == [1.0] * len(rows)
    for row, (name, config, entry) in zip(rows, entries, strict=True):
        assert (name, config) == ("basic_arithmetic", {"max_terms": 3})
        assert entry["question"] + "\nAnswer:" == row.prompt
        assert reasoning_gym_reward(row.task, row.reference, f"I think it is {entry['answer']}.") == 1.0
        assert reasoning_gym_reward(row.task, row.reference, "no idea") < 1.0


def test_reasoning_gym_entry_survives_the_reference_exactly() -> None:
    """arc_agi compares tuple grids: a plain-JSON reference would score its own answer 0.05."""
    import reasoning_gym

    spec = DataSpec("reasoning_gym:arc_agi", size=3, seed=2)
    generated = reasoning_gym.create_dataset("arc_agi", seed=2, size=3)
    for i, row in enumerate(load_rows(spec)):
        _, _, entry = parse_gym_reference(row.reference)
        assert entry == generated[i] and isinstance(entry["metadata"]["output"], tuple)
        assert reasoning_gym_reward(row.task, row.reference, "Answer:\n" + entry["answer"]) == 1.0
