"""The partial-rollout baselines (``mode = "partial"``, held to the bound, and ``"partial_unbounded"``): DORA's
machinery with one version for all.

Over-provision, abort stragglers, resume under new weights: :class:`PartialRules`, the
:class:`~dora_rl.streams.dora_policy.VersionRules` that :func:`partial_scheduler` gives a
:class:`~dora_rl.streams.dora_policy.DoraScheduler` (its machinery and state, no subclass). They change only
which version may be dispatched (the newest), how instances are re-partitioned (all to the newest) and which
version a migrating trajectory resumes under (the newest: breaks C1 by design).
"""

from __future__ import annotations

from typing import Any

from dora_rl.config import DoraConfig

from .dora_policy import DoraScheduler
from .dora_state import LOST
from .scheduling_events import Cancel


class PartialRules:
    """The partial-rollout baseline's version rules: over-provision, abort stragglers, resume under new weights.

    All instances always hold the newest version. When version ``V`` is published every
    trajectory still decoding under an older version is cancelled and resumed on an instance
    holding ``V`` from its partial tokens, so one trajectory mixes versions (breaks C1 by design;
    per-token versions are recorded). A trajectory's staleness is counted from its *first* token's
    version: held to ``max_staleness`` in ``partial``, only measured in ``partial_unbounded``.
    """

    def feasible(self, s: DoraScheduler[Any], version: int, n: int) -> bool:
        """The newest version only, within RBS and the run's budget, and (``partial``, bounded) the EDF
        condition of the planner with the run's bound: a trajectory's deadline counts from its first
        version, which is the planner's ``version_of`` (a resume moves ``state.trajs[t].version`` to the
        newest version, never the planner's), so C3 holds for the oldest token of every trajectory. With
        ``partial_unbounded`` the bound is the run's length and the condition never binds."""
        st = s.state
        return (version == st.latest and s.unconsumed() + n <= s.rbs
                and st.dispatched + n <= s.steps * s.tbs and s.planner.can_add(version, n))

    def repartition(self, s: DoraScheduler[Any]) -> list[Cancel]:
        """Every live instance to the newest version; what decodes under an older one is cancelled."""
        s.repartitions += 1
        st = s.state
        latest = st.latest
        cancels: dict[int, list[str]] = {}
        for tid, t in st.trajs.items():  # placed ones only: queued resumes take the newest version
            if not t.done and t.instance >= 0 and t.version < latest:
                cancels.setdefault(t.instance, []).append(tid)
                st.migrating[tid] = t.instance
                st.place(tid, -1)
        st.hold_all([v if v == LOST else latest for v in st.instance_version])
        out = [Cancel(i, tuple(tids)) for i, tids in sorted(cancels.items())]
        s.cancels.extend(out)
        return out

    def resume_version(self, s: DoraScheduler[Any], trajectory_id: str) -> int:
        """Partial rollout resumes under the newest weights, whatever version began it."""
        return s.state.latest


def partial_scheduler(config: DoraConfig) -> DoraScheduler[Any]:
    """The scheduler of a partial-rollout mode: DORA's machinery under :class:`PartialRules`."""
    return DoraScheduler(config, PartialRules())
