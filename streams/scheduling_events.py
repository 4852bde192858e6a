"""What goes into the scheduling rules and what comes out of them: typed, frozen records.

Events go in through :meth:`~.scheduling.SchedulingRules.handle` (one record type per event kind);
decisions come out of :meth:`~.scheduling.SchedulingRules.decide`, one :class:`Decisions` per call,
which the caller carries out in field order: dispatches, cancels, resumes, plans, then withdrawn groups.
Times are the caller's clock (monotonic seconds, or the simulator's virtual time): no rule reads a clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, TypeVar

P = TypeVar("P")


# -- decisions ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Dispatch(Generic[P]):
    """One trajectory to generate: prompt, sample index in its group, version, target instance."""

    prompt: P
    group_id: str
    sample_index: int
    version: int
    instance: int
    wave: int

    @property
    def trajectory_id(self) -> str:
        """Stable id: ``<group_id>/<sample_index>``."""
        return f"{self.group_id}/{self.sample_index}"


@dataclass(frozen=True)
class Cancel:
    """Stop these trajectories on ``instance`` (it is switching to another version, or their group was
    refused: then ``versions`` holds each one's version, since the rules have forgotten them)."""

    instance: int
    trajectory_ids: tuple[str, ...]
    versions: tuple[int, ...] = ()


@dataclass(frozen=True)
class Migration:
    """A cancelled trajectory to resume elsewhere; ``partial`` is its response so far (None: generate it
    again from scratch, its instance was lost)."""

    trajectory_id: str
    version: int
    partial: Any


@dataclass(frozen=True)
class Decisions(Generic[P]):
    """Everything decided since the last :meth:`decide`; each decision is returned once.

    ``resumes`` pairs a migration with its target instance (which holds the migration's version);
    ``plans`` are (train step, trajectory ids) in step order; ``withdrawn`` are refused groups whose
    members the rules have forgotten (their cancels are in ``cancels``; the caller may drop the prompt)."""

    dispatches: tuple[Dispatch[P], ...] = ()
    cancels: tuple[Cancel, ...] = ()
    resumes: tuple[tuple[Migration, int], ...] = ()
    plans: tuple[tuple[int, tuple[str, ...]], ...] = ()
    withdrawn: tuple[str, ...] = ()


def decisions(dispatches: Sequence[Dispatch[P]], cancels: Sequence[Cancel], resumes: Sequence[tuple[Migration, int]],
              plans: Sequence[tuple[int, Sequence[str]]], withdrawn: Sequence[str]) -> Decisions[P]:
    """A :class:`Decisions` from the rules' working lists."""
    return Decisions(tuple(dispatches), tuple(cancels), tuple(resumes),
                     tuple((step, tuple(tids)) for step, tids in plans), tuple(withdrawn))


@dataclass(frozen=True)
class RulesStatus:
    """What the orchestrator reads between events: prompts queued and not dispatched (it reads more
    prompts only below a bound), and whether every trajectory of the run has been dispatched."""

    queued_prompts: int
    all_dispatched: bool


# -- events ------------------------------------------------------------------------------------
# Typed named tuples, immutable like the records above but built in half the time: at 8,192 instances the
# orchestrator takes ~2.5 million heartbeats per training step (bench/orchestration.py).


class PromptQueued(NamedTuple):
    """A prompt to dispatch (FIFO); ``prompt`` is carried opaquely into its dispatches."""

    group_id: str
    prompt: Any


class VersionSeen(NamedTuple):
    """Version ``version`` was announced, seen at ``now``."""

    version: int
    now: float


class Completed(NamedTuple):
    """A trajectory finished decoding (its instance is free of it), with its token counts when known
    (what the trajectories topic carries; they inform KV-aware admission, :mod:`.kv_room`)."""

    trajectory_id: str
    prompt_tokens: int = 0
    response_tokens: int | None = None


class Scored(NamedTuple):
    """A trajectory has its reward: it may be planned once its whole group has one."""

    trajectory_id: str


class Refused(NamedTuple):
    """A member of the group was dead-lettered (the engine failed on it, or it has no reward).

    The whole group is withdrawn (members still decoding are cancelled) and a replacement group is
    dispatched in its place, so batches stay whole groups of exactly TBS (C2 counts it refused, not
    lost). A group that is unknown, still queued (nothing of it can have been refused: the letter is a
    copy or forged) or already planned is left alone: it is not in ``Decisions.withdrawn``."""

    group_id: str


class Consumed(NamedTuple):
    """A batch was cut for ``train_step``."""

    train_step: int
    trajectory_ids: tuple[str, ...]


class Aborted(NamedTuple):
    """An instance handed back a trajectory's partial response (after a cancel, or giving it up)."""

    trajectory_id: str
    partial: Any
    instance: int | None = None


class Heartbeat(NamedTuple):
    """Rollout instance ``instance`` was heard at ``now``: alive, or, with ``leaving`` (its ``STOPPED``
    heartbeat), gone for now (its work must move)."""

    instance: int
    now: float
    leaving: bool = False


class Tick(NamedTuple):
    """Time passed: timer- and load-driven decisions (timed re-partitions, lost instances)."""

    now: float


Event = PromptQueued | VersionSeen | Completed | Scored | Refused | Consumed | Aborted | Heartbeat | Tick
