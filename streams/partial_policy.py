"""The partial-rollout baseline (``mode = "partial"``): DORA's machinery with one version for all.

Over-provision, abort stragglers, resume under new weights: see :class:`PartialScheduler`. It reuses
:class:`~dora_rl.streams.dora_policy.DoraScheduler` and its state, changing only which version may be
dispatched (the newest), how instances are re-partitioned (all to the newest) and which version a
migrating trajectory resumes under (the newest: breaks C1 by design).
"""

from __future__ import annotations

from typing import TypeVar

from .dora_policy import DoraScheduler
from .dora_state import LOST
from .scheduling import Cancel

P = TypeVar("P")


class PartialScheduler(DoraScheduler[P]):
    """The partial-rollout baseline: over-provision, abort stragglers, resume under new weights.

    All instances always hold the newest version. When version ``V`` is published every
    trajectory still decoding under an older version is cancelled and resumed on an instance
    holding ``V`` from its partial tokens, so one trajectory mixes versions (breaks C1 by design;
    per-token versions are recorded). No staleness window applies to dispatch: a trajectory's
    staleness is counted from its *first* token's version and is only measured.
    """

    def feasible(self, version: int, n: int) -> bool:
        st = self.state
        return (version == st.latest and self.unconsumed() + n <= self.rbs
                and st.dispatched + n <= self.steps * self.tbs)

    def repartition(self) -> list[Cancel]:
        self.repartitions += 1
        latest = self.state.latest
        cancels: dict[int, list[str]] = {}
        for tid, t in self.state.trajs.items():  # placed ones only: queued resumes take the newest version
            if not t.done and t.instance >= 0 and t.version < latest:
                cancels.setdefault(t.instance, []).append(tid)
                self.state.migrating[tid] = t.instance
                t.instance = -1
        self.state.instance_version = [v if v == LOST else latest for v in self.state.instance_version]
        out = [Cancel(i, tuple(tids)) for i, tids in sorted(cancels.items())]
        self.cancels.extend(out)
        return out

    def resume_version(self, trajectory_id: str) -> int:
        """Partial rollout resumes under the newest weights, whatever version began it."""
        return self.state.latest
