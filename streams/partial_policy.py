"""The partial-rollout baselines (``mode = "partial"``, held to the bound, and ``"partial_unbounded"``): DORA's
machinery with one version for all.

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
    per-token versions are recorded). A trajectory's staleness is counted from its *first* token's
    version: held to ``max_staleness`` in ``partial``, only measured in ``partial_unbounded``.
    """

    def feasible(self, version: int, n: int) -> bool:
        """The newest version only, within RBS and the run's budget, and (``partial``, bounded) the EDF
        condition of the planner with the run's bound: a trajectory's deadline counts from its first
        version, which is the planner's ``version_of`` (a resume moves ``state.trajs[t].version`` to the
        newest version, never the planner's), so C3 holds for the oldest token of every trajectory. With
        ``partial_unbounded`` the bound is the run's length and the condition never binds."""
        st = self.state
        return (version == st.latest and self.unconsumed() + n <= self.rbs
                and st.dispatched + n <= self.steps * self.tbs and self.planner.can_add(version, n))

    def repartition(self) -> list[Cancel]:
        self.repartitions += 1
        latest = self.state.latest
        cancels: dict[int, list[str]] = {}
        for tid, t in self.state.trajs.items():  # placed ones only: queued resumes take the newest version
            if not t.done and t.instance >= 0 and t.version < latest:
                cancels.setdefault(t.instance, []).append(tid)
                self.state.migrating[tid] = t.instance
                self.state.place(tid, -1)
        self.state.hold_all([v if v == LOST else latest for v in self.state.instance_version])
        out = [Cancel(i, tuple(tids)) for i, tids in sorted(cancels.items())]
        self.cancels.extend(out)
        return out

    def resume_version(self, trajectory_id: str) -> int:
        """Partial rollout resumes under the newest weights, whatever version began it."""
        return self.state.latest
