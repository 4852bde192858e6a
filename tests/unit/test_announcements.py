"""What a rollout instance checks on an announcement before acting on it (``infra/announcements.py``)."""

from __future__ import annotations

import torch

from dora_rl.infra.announcements import announcement_problem
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
