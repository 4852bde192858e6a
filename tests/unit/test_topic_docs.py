"""The topic catalogue is the one source of topic facts: generated docs match it, and the code agrees.

No broker. Drift: ``docs/topics.md`` and the README's topic block must equal what the catalogue
renders (fix: ``dora-rl topics doc``). Code: every declared writer/reader references the topic in
one of its modules, and every module that references a topic constant belongs to a declared
writer/reader of it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dora_rl.infra.kafka import topic_docs, topics
from dora_rl.schemas.codec import SCHEMA_FILES
from dora_rl.schemas.records import RECORDS

ROOT = Path(__file__).resolve().parents[2]
SOURCE_DIRS = ("producers", "streams", "consumers", "infra", "bench")
CONSTANTS = {name: value for name, value in vars(topics).items()
             if name.isupper() and isinstance(value, str) and value.startswith("dora.")}

# Topics some code reaches through a helper instead of naming the constant (``infra/kafka/io.py``,
# ``infra/kafka/runs.py``): a module calling the helper reads/writes the topic.
HELPERS: dict[str, tuple[str, ...]] = {
    topics.METRICS: ("Metrics(",),
    topics.DLQ: ("DeadLetters(",),
    topics.RUNS: ("get_run(", "start_run(", "finish_run(", "list_runs("),
}
# Actors that read any catalogue topic by name (``--topic``), not through a constant.
ANY_TOPIC: dict[str, str] = {"replay": "topics.spec("}
# Modules that name topic constants without being a writer/reader themselves (helpers, tooling).
# shared machinery, not actors: the client layer, the catalogue itself, and the Prometheus hooks (they
# observe what the calling role sends, and announce its endpoint on that role's behalf)
NOT_ACTORS = {"infra/kafka/io.py", "infra/kafka/topics.py", "infra/kafka/topic_docs.py", "infra/observability/prom.py",
              "infra/observability/prom_serve.py"}
# Known disagreements between a schema's ``doc`` and the catalogue, in files this test does not own.
# Remove an entry when the schema doc is fixed (the test fails until then, and again after, to say so).
KNOWN_SCHEMA_DOC_DRIFT: set[tuple[str, str]] = set()


def _references(module: str, topic: str, actor: str) -> bool:
    const = next(name for name, value in CONSTANTS.items() if value == topic)
    text = (ROOT / module).read_text()
    return (re.search(rf"\btopics\.{const}\b", text) is not None
            or any(h in text for h in HELPERS.get(topic, ()))
            or (actor in ANY_TOPIC and ANY_TOPIC[actor] in text))


def test_generated_docs_match_the_catalogue() -> None:
    stale = topic_docs.drifted(ROOT)
    assert not stale, f"{[str(p.relative_to(ROOT)) for p in stale]} drifted from infra/kafka/topics.py: " \
                      "run `dora-rl topics doc` and commit the result"


def test_drift_is_detected_and_only_the_block_is_rewritten(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "topics.md").write_text(topic_docs.render_topics_md())
    readme = topic_docs.splice((ROOT / "README.md").read_text(), topic_docs.render_readme_block())
    (tmp_path / "README.md").write_text(readme + "\nA line someone else owns.\n")
    assert topic_docs.drifted(tmp_path) == []

    md = tmp_path / "docs" / "topics.md"
    md.write_text(md.read_text().replace("| `dora.runs` | `RunInfo` |", "| `dora.runs` | `RunInfoX` |", 1))
    block_row = "| `dora.instances` | `InstanceStatus` |"
    assert block_row in readme
    (tmp_path / "README.md").write_text((tmp_path / "README.md").read_text().replace(block_row, "| x | y |", 1))
    assert sorted(topic_docs.drifted(tmp_path)) == sorted([md, tmp_path / "README.md"])

    assert sorted(topic_docs.write_docs(tmp_path)) == sorted([md, tmp_path / "README.md"])
    assert topic_docs.drifted(tmp_path) == []
    assert (tmp_path / "README.md").read_text() == readme + "\nA line someone else owns.\n"
    assert topic_docs.sync_docs(check=True, root=tmp_path) == 0


def test_splice_refuses_a_readme_without_one_marker_pair() -> None:
    block = topic_docs.render_readme_block()
    for text in ("no markers\n", f"{topic_docs.END}\n{topic_docs.BEGIN}\n",
                 f"{topic_docs.BEGIN}\n{topic_docs.END}\n{topic_docs.BEGIN}\n{topic_docs.END}\n"):
        with pytest.raises(ValueError):
            topic_docs.splice(text, block)
    assert topic_docs.splice(f"a\n{topic_docs.BEGIN}\nold\n{topic_docs.END}\nb\n", block) == f"a\n{block}b\n"


def test_catalogue_is_complete_and_consistent() -> None:
    specs = topics.catalogue()
    names = [s.name for s in specs]
    assert len(names) == len(set(names))
    assert set(names) == set(CONSTANTS.values())
    for s in specs:
        assert s.schema in RECORDS and s.schema in SCHEMA_FILES, s.name
        assert RECORDS[s.schema].__name__ == s.record
        assert topics.spec(s.name) == s
    for actor in topics.ACTORS.values():
        for module in actor.modules:
            assert (ROOT / module).is_file(), f"{actor.name}: {module} does not exist"
    assert topics.spec(topics.INSTANCES).cleanup == "delete"  # its history is kept (not compacted)
    assert topics.spec(topics.RUNS).configs == {"cleanup.policy": "compact", "max.message.bytes": str(8 << 20)}
    assert topics.spec(topics.REQUESTS, 8).partitions == topics.MAX_INSTANCES
    assert topics.spec(topics.REQUESTS, 8, instances=24).partitions == 24  # sized from a run's max_instances
    assert topics.spec(topics.REQUESTS, 8, instances=4).partitions == topics.MAX_INSTANCES
    assert topics.spec(topics.SCORED, 8).partitions == 8
    with pytest.raises(ValueError):
        topics.TopicSpec("dora.x", 2, "dora.v1.Metric", "x", writers=("trainer",), readers=(),
                         key="k", partitioning="single", retention_ms=None)
    with pytest.raises(ValueError):
        topics.TopicSpec("dora.x", 1, "dora.v1.Metric", "x", writers=("nobody",), readers=(),
                         key="k", partitioning="single", retention_ms=None)


@pytest.mark.parametrize("spec", topics.catalogue(), ids=lambda s: s.name)
def test_declared_writers_and_readers_reference_the_topic(spec: topics.TopicSpec) -> None:
    missing = [f"{side} {a}" for side, actors in (("writer", spec.writers), ("reader", spec.readers))
               for a in actors if not any(_references(m, spec.name, a) for m in topics.ACTORS[a].modules)]
    assert not missing, f"{spec.name}: declared but not referenced in their modules: {missing}"


def test_every_module_naming_a_topic_is_a_declared_writer_or_reader() -> None:
    owners: dict[str, set[str]] = {}
    for actor in topics.ACTORS.values():
        for module in actor.modules:
            owners.setdefault(module, set()).add(actor.name)
    files = [p for d in SOURCE_DIRS for p in (ROOT / d).rglob("*.py")] + list((ROOT / "dora_rl").glob("*.py"))
    problems = []
    for path in files:
        module = path.relative_to(ROOT).as_posix()
        text = path.read_text()
        for const, topic in CONSTANTS.items():
            if module in NOT_ACTORS or not re.search(rf"\btopics\.{const}\b", text):
                continue
            declared = set(topics.spec(topic).writers) | set(topics.spec(topic).readers)
            if not owners.get(module, set()) & declared:
                problems.append(f"{module} uses topics.{const} but none of {sorted(owners.get(module, ()))} "
                                f"is a declared writer/reader of {topic}")
    assert not problems, "\n".join(problems)


def test_schema_docs_agree_with_the_catalogue() -> None:
    drift = set()
    for s in topics.catalogue():
        doc = json.loads((ROOT / "schemas" / SCHEMA_FILES[s.schema]).read_text()).get("doc", "")
        assert s.name in doc, f"{SCHEMA_FILES[s.schema]} does not name its topic {s.name}"
        if ("compacted" in doc) != (s.cleanup == "compact"):
            drift.add((s.schema, f"says {'compacted' if 'compacted' in doc else 'not compacted'}; {s.name} is "
                                 f"{'' if s.cleanup == 'compact' else 'not '}compacted"))
    assert drift == KNOWN_SCHEMA_DOC_DRIFT, "schema docs vs catalogue changed: update KNOWN_SCHEMA_DOC_DRIFT"
