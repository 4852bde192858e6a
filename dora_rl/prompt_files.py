"""Reading prompt data from files and generators into :class:`~dora_rl.core.prompt_data.PromptRow` records.

The data layer beside :mod:`dora_rl.prompt_source`: the file and generator reading that used to sit in
:mod:`dora_rl.core.prompt_data` (the rules there stay pure: no file, no ``pyarrow``). A
:class:`~dora_rl.core.prompt_data.DataSpec` names a source: a JSON-lines file (``.jsonl``, or ``.json``
holding JSON lines or one JSON array of objects), a ``.parquet`` file, a directory written by
``datasets.Dataset.save_to_disk``, or ``reasoning_gym:<dataset_name>``.

Invariants (``tests/unit/test_prompt_data.py``):

* :func:`load_rows` returns the source's rows in source order, the same for the same bytes (or the
  same reasoning-gym name, seed, size and config); a bad source raises ValueError naming the file,
  the row and the field;
* :func:`identity` hashes the source (file bytes; a directory's files with their relative paths
  in sorted order; reasoning-gym's name, size, seed and config), so a checkpoint can record what it
  was trained on and a resume can refuse different data.

Heavy packages (``datasets``, ``pyarrow``, ``reasoning_gym``) are imported only when a source of
their kind is loaded.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dora_rl.core.prompt_data import (
    GYM_FIELDS,
    GYM_PREFIX,
    DatasetIdentity,
    DataSpec,
    PromptRow,
    gym_reference,
    json_ready,
)

# ---------------------------------------------------------------------------------------- reading

def _read_json(path: Path) -> list[Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from exc
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not valid JSON: {exc}") from exc
        return list(data)
    rows = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path} line {lineno} is not valid JSON: {exc}") from exc
    return rows


def _read_parquet(path: Path) -> list[Any]:
    import pyarrow.parquet as pq

    try:
        return list(pq.read_table(path).to_pylist())
    except Exception as exc:
        raise ValueError(f"cannot read parquet file {path}: {type(exc).__name__}: {exc}") from exc


def _read_saved_dataset(path: Path) -> list[Any]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as exc:
        raise ValueError(f"cannot load {path} with datasets.load_from_disk: {type(exc).__name__}: {exc}") from exc
    if isinstance(ds, datasets.DatasetDict):
        raise ValueError(f"{path} holds a DatasetDict with splits {sorted(ds)}: point DataSpec.source at one "
                         f"split's directory, e.g. {path / sorted(ds)[0]}")
    return list(ds.to_list())


def _read_records(spec: DataSpec) -> list[dict[str, Any]]:
    path = Path(spec.source)
    if not path.exists():
        raise ValueError(f"prompt data source {spec.source!r} does not exist")
    if path.is_dir():
        records = _read_saved_dataset(path)
    elif path.suffix in (".jsonl", ".json"):
        records = _read_json(path)
    elif path.suffix == ".parquet":
        records = _read_parquet(path)
    else:
        raise ValueError(f"prompt data source {spec.source!r} has an unknown suffix {path.suffix!r}: use .jsonl, "
                         f".json, .parquet, a datasets.save_to_disk directory or 'reasoning_gym:<name>'")
    if not records:
        raise ValueError(f"prompt data source {spec.source!r} has no rows")
    for i, rec in enumerate(records):
        if not isinstance(rec, dict):
            raise ValueError(f"{spec.source}: row {i} is a {type(rec).__name__}, not an object with fields")
    return records


def _gym_dataset(spec: DataSpec) -> Any:
    import reasoning_gym

    name = spec.gym_name
    try:
        return reasoning_gym.create_dataset(name, seed=spec.seed, size=spec.size, **spec.gym_config)
    except Exception as exc:
        raise ValueError(f"cannot create reasoning-gym dataset {name!r} with config {spec.gym_config}: "
                         f"{type(exc).__name__}: {exc}") from exc


def _gym_rows(spec: DataSpec) -> list[tuple[dict[str, Any], str]]:
    """``(fields, reference)`` for each generated entry."""
    ds = _gym_dataset(spec)
    out = []
    for i in range(spec.size):
        entry = ds[i]
        question = entry.get("question")
        if not isinstance(question, str):
            raise ValueError(f"{spec.source}: row {i} has no text question: {question!r}")
        fields = {"prompt": question, "question": question, "answer": entry.get("answer")}
        try:
            reference = gym_reference(spec.gym_name, spec.gym_config, entry)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{spec.source}: row {i} cannot be written as JSON: {exc}") from exc
        out.append((fields, reference))
    return out


# ---------------------------------------------------------------------------------------- rows

def _text(rec: Mapping[str, Any], name: str, where: str) -> str:
    if name not in rec:
        raise ValueError(f"{where} has no field {name!r} (fields: {sorted(rec)})")
    value = rec[name]
    if isinstance(value, str):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    what = "null" if value is None else f"a {type(value).__name__}"
    raise ValueError(f"{where}: field {name!r} is {what}, expected text or a number")


def _prompt(spec: DataSpec, rec: Mapping[str, Any], where: str) -> str:
    if spec.template is None:
        return _text(rec, spec.prompt_field, where)
    try:
        return spec.template.format_map(rec)
    except KeyError as exc:
        raise ValueError(f"{where}: template {spec.template!r} uses field {exc.args[0]!r}, which the row lacks "
                         f"(fields: {sorted(rec)})") from None
    except (IndexError, ValueError, AttributeError) as exc:
        raise ValueError(f"{where}: template {spec.template!r} cannot be applied: {exc}") from None


def load_rows(spec: DataSpec) -> list[PromptRow]:
    """All rows of ``spec.source``, in source order (see the module docstring); ValueError on bad input."""
    if spec.is_gym:
        task = f"{GYM_PREFIX}{spec.gym_name}"
        items = _gym_rows(spec)
        recs = [rec for rec, _ in items]
        refs = [ref for _, ref in items]
    else:
        task = spec.task
        recs = _read_records(spec)
        refs = [_text(rec, spec.answer_field, f"{spec.source} row {i}") for i, rec in enumerate(recs)]
    rows: list[PromptRow] = []
    seen: dict[str, int] = {}
    for i, (rec, ref) in enumerate(zip(recs, refs, strict=True)):
        where = f"{spec.source} row {i}"
        row_id = str(i) if spec.id_field is None or spec.is_gym else _text(rec, spec.id_field, where)
        if row_id in seen:
            raise ValueError(f"{where}: id {row_id!r} (field {spec.id_field!r}) repeats row {seen[row_id]}")
        seen[row_id] = i
        rows.append(PromptRow(row_id=row_id, prompt=_prompt(spec, rec, where), reference=ref, task=task))
    return rows


def identity(spec: DataSpec) -> DatasetIdentity:
    """The :class:`DatasetIdentity` of ``spec.source`` (reads it whole; see the module docstring)."""
    h = hashlib.sha256()
    if spec.is_gym:
        canon = [spec.gym_name, spec.size, spec.seed, json_ready(dict(spec.gym_config))]
        h.update(json.dumps(canon, sort_keys=True, separators=(",", ":")).encode())
        return DatasetIdentity(spec.source, h.hexdigest(), spec.size, GYM_FIELDS)
    records = _read_records(spec)
    path = Path(spec.source)
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for p in files:
        if path.is_dir():
            rel = p.relative_to(path).as_posix().encode()
            h.update(len(rel).to_bytes(8, "big") + rel + p.stat().st_size.to_bytes(8, "big"))
        h.update(p.read_bytes())
    fields = tuple(sorted({k for rec in records for k in rec}))
    return DatasetIdentity(spec.source, h.hexdigest(), len(records), fields)
