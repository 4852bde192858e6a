"""Dispatch rules of the orchestrator as pure logic: which prompt goes to which version and instance.

No Kafka and no clock here: the orchestrator process (and the discrete-event simulator) feeds events
in (prompts, version announcements with the time they were seen, completions, consumed batches,
aborted partials, timer ticks) and carries out what comes back (dispatches, cancels, resumes, batch
plans). Every mode implements one interface, :class:`SchedulingRules`, so the orchestrator and the
simulator drive each mode the same way with no probing of its type; :func:`.rules.make_scheduler` picks the
rules of ``config.mode``.

Versions: version ``v`` is the policy after ``v`` updates; train step ``k`` starts from ``k``.
A *wave* is the ``TBS / G`` prompts (``TBS`` trajectories) destined for one train step.

- ``sync``: wave ``w`` is dispatched with version ``w`` once version ``w`` exists — i.e. after step
  ``w - 1`` has consumed wave ``w - 1``. Staleness is always 0.
- ``one_step_off``: wave ``w`` is dispatched with version ``max(0, w - 1)`` once that version
  exists, so generation runs one version ahead of training. Staleness <= 1.
- ``dora``: see :mod:`dora_rl.streams.dora_policy`; ``partial``: see :mod:`dora_rl.streams.partial_policy`.

Instances: each request goes to the least-loaded instance (fewest trajectories dispatched and
not yet completed), ties broken by index, so load spreads evenly.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from dora_rl.config import DoraConfig

from .planning import Planner

P = TypeVar("P")


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
    """A cancelled trajectory to resume elsewhere; ``partial`` is its response so far."""

    trajectory_id: str
    version: int
    partial: Any


class SchedulingRules(Protocol[P]):
    """What the orchestrator and the simulator call, for every mode.

    Events go in through the ``on_*`` methods and :meth:`tick`; decisions come out of
    :meth:`dispatch`, :meth:`take_cancels`, :meth:`resumes` and :meth:`plans`, which the caller
    carries out in that order after each round of events. ``now`` is the caller's clock (monotonic
    seconds, or the simulator's virtual time): no rule reads a clock of its own.
    """

    def add_prompt(self, group_id: str, prompt: P) -> None:
        """Queue a prompt (FIFO)."""
        ...

    def queued_prompts(self) -> int:
        """Prompts queued and not yet dispatched (the orchestrator reads more only below a bound)."""
        ...

    def on_version(self, version: int, now: float) -> None:
        """Version ``version`` was announced at time ``now``."""
        ...

    def on_completed(self, trajectory_id: str, prompt_tokens: int = 0, response_tokens: int | None = None) -> None:
        """A trajectory finished decoding (its instance is free of it), with its token counts when known
        (what the trajectories topic carries; they inform KV-aware admission, :mod:`.kv_room`)."""
        ...

    def on_scored(self, trajectory_id: str) -> None:
        """A trajectory has its reward: it may be planned into a batch once its whole group has one."""
        ...

    def on_refused(self, group_id: str) -> bool:
        """A member of the group was refused (dead-lettered: the engine failed on it, or it has no reward).

        The whole group is withdrawn (its members still decoding are cancelled) and a replacement
        group is dispatched in its place, so batches stay whole groups of exactly TBS (C2 counts the
        group as refused, not lost). A group that is unknown, still queued (never dispatched: nothing of
        it can have been refused, so the letter is a copy or forged) or already planned is left alone.
        Returns whether the group was withdrawn."""
        ...

    def on_consumed(self, train_step: int, trajectory_ids: Sequence[str]) -> None:
        """A batch was cut for ``train_step``."""
        ...

    def on_aborted(self, trajectory_id: str, partial: Any, instance: int | None = None) -> None:
        """An instance handed back a trajectory's partial response (after a cancel, or giving it up)."""
        ...

    def on_heartbeat(self, instance: int, now: float, leaving: bool = False) -> None:
        """Rollout instance ``instance`` was heard at ``now`` (``dora.instances``): it is alive, or, with
        ``leaving`` (its ``STOPPED`` heartbeat), it is gone for now and its work must move."""
        ...

    def tick(self, now: float) -> None:
        """Time passed: timer- or load-driven decisions (their cancels come out of :meth:`take_cancels`)."""
        ...

    def dispatch(self) -> list[Dispatch[P]]:
        """New trajectories to generate now."""
        ...

    def take_cancels(self) -> list[Cancel]:
        """Cancels decided since the last call (each is returned once)."""
        ...

    def resumes(self) -> list[tuple[Migration, int]]:
        """Migrations that can be placed now: (migration, target instance)."""
        ...

    def plans(self) -> list[tuple[int, list[str]]]:
        """Batches that can be planned now: (train step, trajectory ids), in step order."""
        ...

    def done(self) -> bool:
        """Every trajectory of the run has been dispatched."""
        ...

    def load(self) -> list[int]:
        """In-flight trajectories per instance."""
        ...

    def version_of(self, trajectory_id: str) -> int:
        """The version a dispatched, unconsumed trajectory is generated with (KeyError otherwise)."""
        ...

    def instance_state(self, instance: int, holds: int) -> str:
        """What instance ``instance``, holding version ``holds``, is doing for the rules: ``"newest"``,
        ``"old"``, ``"due"`` (its version is trained at the next step) or ``"draining"`` — how the
        simulator splits the intra-instance bubble."""
        ...

    def describe(self) -> str:
        """One line of state for the log (what is in flight, queued, planned)."""
        ...


@dataclass
class SchedulerState:
    """What the scheduler knows; rebuilt from Kafka on restart by replaying the same events."""

    latest_version: int = -1
    waves_dispatched: int = 0
    consumed_steps: int = 0
    in_flight: dict[str, int] = field(default_factory=dict)  # trajectory id -> instance
    version_of: dict[str, int] = field(default_factory=dict)  # trajectory id -> version (not consumed)


class Scheduler(Generic[P]):
    """Wave-based dispatch for ``sync`` and ``one_step_off`` (implements :class:`SchedulingRules`)."""

    def __init__(self, config: DoraConfig) -> None:
        if config.mode not in ("sync", "one_step_off"):
            raise ValueError(f"Scheduler handles sync/one_step_off, not {config.mode!r}")
        self.mode = config.mode
        self.group_size = config.group_size
        self.prompts_per_wave = config.train_batch_size // config.group_size
        self.steps = config.steps
        self.num_instances = config.num_instances
        self.max_staleness = config.max_staleness
        self.train_batch_size = config.train_batch_size
        self.state = SchedulerState()
        self.planner = Planner(config.train_batch_size, config.group_size, config.max_staleness, config.steps)
        self._prompts: deque[tuple[str, P]] = deque()
        self.replacements: list[int] = []  # versions of refused groups still to replace
        self.refused_groups = 0

    def add_prompt(self, group_id: str, prompt: P) -> None:
        """Queue a prompt (FIFO)."""
        self._prompts.append((group_id, prompt))

    def queued_prompts(self) -> int:
        return len(self._prompts)

    def on_version(self, version: int, now: float) -> None:
        """A policy version was announced."""
        self.state.latest_version = max(self.state.latest_version, version)

    def on_completed(self, trajectory_id: str, prompt_tokens: int = 0, response_tokens: int | None = None) -> None:
        """A trajectory finished decoding (its instance is free of it)."""
        self.state.in_flight.pop(trajectory_id, None)

    def on_scored(self, trajectory_id: str) -> None:
        self.planner.complete(trajectory_id)

    def on_refused(self, group_id: str) -> bool:
        """Withdraw the group; its replacement is dispatched with the same version (see the protocol)."""
        tids = self.planner.withdraw(group_id)
        if not tids:
            return False
        versions = [self.state.version_of.pop(t) for t in tids]
        for t in tids:
            self.state.in_flight.pop(t, None)
        self.replacements.append(min(versions))
        self.refused_groups += 1
        return True

    def on_consumed(self, train_step: int, trajectory_ids: Sequence[str]) -> None:
        """A batch was cut for ``train_step``."""
        self.state.consumed_steps = max(self.state.consumed_steps, train_step + 1)
        for tid in trajectory_ids:
            self.state.version_of.pop(tid, None)

    def wave_version(self, wave: int) -> int:
        """Version that generates wave ``wave`` in this mode."""
        return max(0, wave - 1) if self.mode == "one_step_off" else wave

    def load(self) -> list[int]:
        """In-flight trajectories per instance."""
        counts = [0] * self.num_instances
        for inst in self.state.in_flight.values():
            counts[inst] += 1
        return counts

    def dispatch(self) -> list[Dispatch[P]]:
        """Every dispatch allowed now (possibly several waves)."""
        out: list[Dispatch[P]] = []
        while self.replacements and self._prompts:  # a refused group's replacement, in its wave's version
            version = self.replacements.pop(0)
            group_id, prompt = self._prompts.popleft()
            out.extend(self._dispatch_group(group_id, prompt, version, version + 1 if self.mode == "one_step_off"
                                            else version))
        while self.state.waves_dispatched < self.steps:
            wave = self.state.waves_dispatched
            version = self.wave_version(wave)
            if version > self.state.latest_version or len(self._prompts) < self.prompts_per_wave:
                break
            for _ in range(self.prompts_per_wave):
                group_id, prompt = self._prompts.popleft()
                out.extend(self._dispatch_group(group_id, prompt, version, wave))
            self.state.waves_dispatched += 1
        return out

    def _dispatch_group(self, group_id: str, prompt: P, version: int, wave: int) -> list[Dispatch[P]]:
        """The group's trajectories, each on the least-loaded instance."""
        out: list[Dispatch[P]] = []
        load = self.load()
        for i in range(self.group_size):
            inst = min(range(self.num_instances), key=lambda j: (load[j], j))
            load[inst] += 1
            d = Dispatch(prompt, group_id, i, version, inst, wave)
            self.state.in_flight[d.trajectory_id] = inst
            self.state.version_of[d.trajectory_id] = version
            self.planner.add(d.trajectory_id, group_id, version)
            out.append(d)
        return out

    def done(self) -> bool:
        """All waves dispatched, and every refused group replaced."""
        return self.state.waves_dispatched >= self.steps and not self.replacements

    def plans(self) -> list[tuple[int, list[str]]]:
        """Batches that can be planned now: (train step, trajectory ids), EDF (see ``planning``)."""
        return self.planner.plans()

    def on_aborted(self, trajectory_id: str, partial: Any, instance: int | None = None) -> None:
        """Waves never cancel or migrate: a trajectory an instance gives up (it is stopping) stays
        uncommitted on that instance's request partition and is generated again when it restarts."""

    def on_heartbeat(self, instance: int, now: float, leaving: bool = False) -> None:
        """Waves are not elastic: the configured instances serve every wave (a lost one's requests wait
        in its partition until it is back)."""

    def tick(self, now: float) -> None:
        """Waves are driven by versions only."""

    def take_cancels(self) -> list[Cancel]:
        return []

    def resumes(self) -> list[tuple[Migration, int]]:
        return []

    def version_of(self, trajectory_id: str) -> int:
        return self.state.version_of[trajectory_id]

    def instance_state(self, instance: int, holds: int) -> str:
        """Waves: every instance generates the wave of the version it holds."""
        return "newest" if holds >= self.state.latest_version else "old"

    def describe(self) -> str:
        st = self.state
        return (f"latest={st.latest_version} waves={st.waves_dispatched} consumed={st.consumed_steps} "
                f"in_flight={len(st.in_flight)} queued_prompts={len(self._prompts)}")
