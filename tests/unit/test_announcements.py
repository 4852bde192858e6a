"""What a rollout instance checks on an announcement before acting on it (``infra/weights/announcements.py``)."""

from __future__ import annotations

import torch

from dora_rl.infra.weights.announcements import announcement_problem
from dora_rl.infra.weights.manifest import pack_state_dict
from dora_rl.schemas.records import PolicyVersion


def _announcement() -> PolicyVersion:
    manifest, _ = pack_state_dict({"w": torch.arange(6, dtype=torch.float32)}, version=3)
    return manifest.announce("r", 3, "tcp", ["127.0.0.1:1"])


def test_a_valid_announcement_passes() -> None:
    ann = _announcement()
    assert announcement_problem(ann, check_manifest=True) is None
    assert announcement_problem(ann, check_manifest=False) is None


def test_no_holder_a_negative_version_or_a_broken_manifest_is_named() -> None:
    ann = _announcement()
    assert "no holder" in (announcement_problem(ann.replace(holders=()), check_manifest=False) or "")
    assert "start at 0" in (announcement_problem(ann.replace(version=-1), check_manifest=False) or "")
    broken = ann.replace(total_bytes=ann.total_bytes + 7)
    assert announcement_problem(broken, check_manifest=False) is None  # an emulated instance loads no weights
    assert "invalid manifest" in (announcement_problem(broken, check_manifest=True) or "")


def test_a_signed_announcement_passes_only_unchanged_and_under_the_runs_token() -> None:
    """Decision 0054: the signature covers every field (checked through the wire encoding, as readers see it);
    an unsigned, re-targeted, re-numbered or foreign-keyed announcement is refused by a reader with the token."""
    from dora_rl.infra.weights.announcements import sign

    ann = sign(_announcement().replace(train_metrics={"loss": 0.25, "reward_mean": 0.5}), "run-token")
    wire = PolicyVersion.decode(*ann.encode())
    assert wire.signature == ann.signature and announcement_problem(wire, True, token="run-token") is None
    assert announcement_problem(wire, True) is None, "a reader without the token cannot check"
    forged = {
        "unsigned": _announcement(),
        "other holder": wire.replace(holders=("10.6.6.6:9999",)),
        "other version": wire.replace(version=4),
        "other checksum": wire.replace(buckets=tuple(b.replace(checksum="0" * 16) for b in wire.buckets)),
        "other key": sign(_announcement(), "attacker"),
    }
    for what, bad in forged.items():
        problem = announcement_problem(bad, check_manifest=False, token="run-token")
        assert problem is not None and "sign" in problem, what
    assert sign(_announcement(), "").signature is None, "no token: nothing to sign with"


def test_the_orchestrator_dead_letters_a_forged_announcement_and_schedules_no_version_for_it() -> None:
    from dora_rl.config import DoraConfig
    from dora_rl.infra.kafka import topics
    from dora_rl.infra.weights.announcements import sign
    from dora_rl.streams.orchestrator import Orchestrator
    from dora_rl.streams.processor import InRecord, MemoryDriver

    config = DoraConfig.from_dict({"mode": "dora", "max_staleness": 1, "steps": 2, "train_batch_size": 4,
                                   "group_size": 2, "rollout_batch_size": 4, "engine": "emulated"})
    genuine = sign(_announcement().replace(run_id="r", version=0, step=0), "run-token")
    forged = sign(_announcement().replace(run_id="r", version=1, step=1), "attacker")
    inputs = [InRecord(topics.VERSIONS, 0, i, None, a) for i, a in enumerate([genuine, forged])]
    orch: list[Orchestrator] = []
    out = MemoryDriver(lambda: orch.append(Orchestrator("r", config, "run-token")) or orch[-1], inputs).run()
    letters = [o.record for o in out if o.topic == topics.DLQ]
    assert len(letters) == 1 and letters[0].source_offset == 1 and "signature" in letters[0].reason
    assert orch[-1].rules.state.latest == 0  # type: ignore[attr-defined]


def test_each_announcement_topic_carries_one_kind_of_announcement() -> None:
    """Only the trainer announces versions; holders go to their own topic (decision 0057): a HOLDER record on
    the versions topic, or a TRAINER one on the holders topic, is refused by its readers."""
    from dora_rl.infra.weights.announcements import kind_problem
    from dora_rl.schemas.records import PolicyVersion

    ann = PolicyVersion(run_id="r", version=1, step=1, created_ms=0, transport="tcp", holders=("h:1",),
                        total_bytes=0, checksum_algo="crc32", tensors=(), buckets=())
    holder = ann.replace(announced_by=PolicyVersion.HOLDER)
    assert kind_problem(ann, PolicyVersion.TRAINER) is None and kind_problem(holder, PolicyVersion.HOLDER) is None
    assert "only 'TRAINER'" in str(kind_problem(holder, PolicyVersion.TRAINER))
    assert "only 'HOLDER'" in str(kind_problem(ann, PolicyVersion.HOLDER))
