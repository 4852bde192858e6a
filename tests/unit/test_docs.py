"""The docs a newcomer reads stay true: every path, topic, command, record field and config field that
``docs/design.md`` names exists; every decision note starts with its status and date; the README stays short
with the two commands on its first screen."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from dora_rl.config import DoraConfig
from dora_rl.infra.kafka import topics
from dora_rl.schemas import codec

ROOT = Path(__file__).resolve().parents[2]
DESIGN = (ROOT / "docs" / "design.md").read_text()
TICKED = re.findall(r"`([^`\n]+)`", DESIGN)
PATH_LIKE = re.compile(r"^(producers|consumers|streams|schemas|infra|tests|bench|docs|dora_rl|examples)/[\w./*-]*$")


def test_every_path_design_md_names_exists() -> None:
    paths = [t for t in TICKED if PATH_LIKE.match(t)]
    assert len(paths) > 10, "the path pattern no longer finds the design's paths"
    missing = [p for p in dict.fromkeys(paths) if not list(ROOT.glob(p))]
    assert not missing, f"docs/design.md names paths that do not exist: {missing}"


def test_every_topic_design_md_names_is_in_the_catalogue() -> None:
    known = {s.name for s in topics.catalogue()} | {codec.HEADER_SCHEMA, codec.HEADER_FINGERPRINT}
    named = {t for t in TICKED if re.match(r"^dora\.[a-z.]+$", t)}
    assert named - known == set(), f"docs/design.md names topics or headers that do not exist: {named - known}"


def test_every_command_design_md_names_exists() -> None:
    from dora_rl.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    commands = set(sub.choices)  # type: ignore[attr-defined]
    named = {t.split()[1] for t in TICKED if t.startswith("dora-rl ") and len(t.split()) > 1}
    assert named - commands - {"<role>"} == set(), f"unknown commands in docs/design.md: {named - commands}"


def test_every_record_field_and_config_field_design_md_names_exists() -> None:
    import dora_rl.core.staleness as staleness
    import dora_rl.schemas.records as records

    owners = {"DoraConfig": DoraConfig, "StalenessBound": staleness.StalenessBound}
    for name in re.findall(r"^[A-Z]\w+\.\w+$", "\n".join(TICKED), flags=re.M):
        cls_name, attr = name.split(".")
        cls = owners.get(cls_name) or getattr(records, cls_name, None)
        assert cls is not None, f"docs/design.md names {name}: no class {cls_name}"
        fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
        assert attr in fields or hasattr(cls, attr), f"docs/design.md names {name}: {cls_name} has no {attr}"
    config_fields = {f.name for f in dataclasses.fields(DoraConfig)}
    config_table = DESIGN[DESIGN.index("| `mode`"):]
    config_table = config_table[:config_table.index("\n\n")]
    names = [n for line in config_table.splitlines() for n in re.findall(r"`([a-z_*]+)`", line.split("|")[1])]
    assert len(names) > 30, "the config table was not found"
    missing = [n for n in names if not (n.endswith("*") and any(f.startswith(n[:-1]) for f in config_fields))
               and n not in config_fields]
    assert not missing, f"docs/design.md's config table names fields DoraConfig lacks: {missing}"


@pytest.mark.parametrize("note", sorted((ROOT / "docs" / "decisions").glob("0*.md")), ids=lambda p: p.name[:4])
def test_every_decision_note_starts_with_its_status_and_date(note: Path) -> None:
    head = note.read_text().splitlines()[:4]
    assert head[0].startswith(f"# {note.name[:4]}"), f"{note.name}: the title names the number"
    status = [line for line in head if line.startswith("Status: ")]
    assert status and re.search(r"(accepted|superseded|retired|a report).* · \d{4}-\d{2}-\d{2}", status[0]), (
        f"{note.name}: no 'Status: <accepted | superseded ... | retired | a report> · YYYY-MM-DD' line at the top")


def test_the_readme_is_short_with_the_two_commands_first() -> None:
    text = (ROOT / "README.md").read_text()
    generated = text[text.index("<!-- topics:begin -->"):text.index("<!-- topics:end -->")]
    assert len(text.replace(generated, "").split()) < 2000
    first = "\n".join(text.splitlines()[:40])
    assert "make run" in first and "make test" in first
