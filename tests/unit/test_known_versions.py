"""The rollout instance's view of versions (producers/rollout/known_versions.py): manifests only from the
trainer's topic, addresses from the holders topic, and a failed fetch that waits for the next holder."""

from __future__ import annotations

from dora_rl.producers.rollout.known_versions import KnownVersions
from dora_rl.schemas.records import PolicyVersion


def ann(version: int, *holders: str, by: str = PolicyVersion.TRAINER, checksum_algo: str = "crc32") -> PolicyVersion:
    return PolicyVersion(run_id="r", version=version, step=version, created_ms=0, transport="tcp", holders=holders,
                         total_bytes=0, checksum_algo=checksum_algo, tensors=(), buckets=(), announced_by=by)


def test_the_trainers_first_announcement_is_the_manifest_and_holders_add_addresses() -> None:
    k = KnownVersions()
    k.on_holder(ann(1, "i0:1", by=PolicyVersion.HOLDER))  # before the trainer's: waits for the manifest
    assert not k.loadable(1)
    k.on_trainer(ann(1, "t:1"))
    k.on_trainer(ann(1, "x:1", checksum_algo="blake2b"))  # a second "manifest" of 1 changes nothing
    k.on_holder(ann(1, "i1:1", "i0:1", by=PolicyVersion.HOLDER))
    assert k.loadable(1)
    got = k.announcement(1)
    assert got.holders == ("t:1", "i0:1", "i1:1") and got.checksum_algo == "crc32"


def test_a_failed_fetch_waits_for_the_next_holder_even_at_a_known_address() -> None:
    """The restarted trainer re-announces on the holders topic, possibly at its old address: that must make
    the version loadable again (the bug that reverted commit 81dd530)."""
    k = KnownVersions()
    k.on_trainer(ann(3, "t:1"))
    k.on_fetch_failed(3)
    assert not k.loadable(3) and k.announcement(3).holders == ("t:1",)  # the manifest is kept
    k.on_holder(ann(3, "t:1", by=PolicyVersion.HOLDER))
    assert k.loadable(3) and k.announcement(3).holders == ("t:1",)
    assert not k.loadable(4)
