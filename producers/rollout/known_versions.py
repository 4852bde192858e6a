"""What a rollout instance knows about policy versions: the trainer's manifests, the extra holders, and
which versions it can try to load now. Pure (no Kafka, no clock); the worker feeds it checked records.

Two topics, one kind of announcement each (decision 0057):

- ``dora.policy.versions``: the trainer's announcement of a new version (``announced_by = TRAINER``), the
  only source of a version's manifest and checksums. The first one of a version is kept.
- ``dora.policy.holders``: an extra holder of a version (a rollout instance that loaded it, a restarted
  trainer serving it again). Only its addresses are taken, and only for a version whose manifest is known
  (addresses that arrive first wait for it).

Invariants:

- a version is loadable iff its manifest is known and it is not :meth:`unreachable`;
- a failed fetch (every holder gone) marks the version unreachable, never forgets its manifest; the next
  holder announcement of that version (a new instance, the restarted trainer, even at a known address)
  makes it loadable again;
- :meth:`announcement` names the trainer's holders first, then the extra holders in arrival order, each once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dora_rl.schemas.records import PolicyVersion


@dataclass
class KnownVersions:
    """Manifests by version, extra holder addresses by version, and the versions no holder could serve."""

    manifests: dict[int, PolicyVersion] = field(default_factory=dict)
    extra_holders: dict[int, tuple[str, ...]] = field(default_factory=dict)
    unreachable: set[int] = field(default_factory=set)

    def on_trainer(self, ann: PolicyVersion) -> None:
        """A trainer announcement: the first of a version is its manifest."""
        self.manifests.setdefault(int(ann.version), ann)

    def on_holder(self, ann: PolicyVersion) -> None:
        """A holder announcement: its addresses join the version's, which becomes loadable again."""
        v = int(ann.version)
        known = self.extra_holders.get(v, ())
        self.extra_holders[v] = known + tuple(h for h in ann.holders if h not in known)
        self.unreachable.discard(v)

    def on_fetch_failed(self, version: int) -> None:
        """No holder of ``version`` delivered it: wait for the next holder announcement."""
        self.unreachable.add(version)

    def loadable(self, version: int) -> bool:
        return version in self.manifests and version not in self.unreachable

    def announcement(self, version: int) -> PolicyVersion:
        """The trainer's manifest of ``version`` naming every holder known (``KeyError`` if none is known)."""
        ann = self.manifests[version]
        extra = tuple(h for h in self.extra_holders.get(version, ()) if h not in ann.holders)
        return ann.replace(holders=tuple(ann.holders) + extra) if extra else ann
