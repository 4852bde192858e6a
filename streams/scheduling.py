"""Dispatch rules of the orchestrator as pure logic: which prompt goes to which version and instance.

No Kafka and no clock here: the orchestrator process feeds events in (prompts, version
announcements, completions, consumed batches) and sends out what :meth:`Scheduler.dispatch`
returns. The same rules drive the real processes and the unit tests.

Versions: version ``v`` is the policy after ``v`` updates; train step ``k`` starts from ``k``.
A *wave* is the ``TBS / G`` prompts (``TBS`` trajectories) destined for one train step.

- ``sync``: wave ``w`` is dispatched with version ``w`` once version ``w`` exists — i.e. after step
  ``w - 1`` has consumed wave ``w - 1``. Staleness is always 0.
- ``one_step_off``: wave ``w`` is dispatched with version ``max(0, w - 1)`` once that version
  exists, so generation runs one version ahead of training. Staleness <= 1.
- ``partial``: like ``sync`` for dispatch; stragglers are aborted and resumed under the new
  version by the orchestrator (mixes versions within a trajectory; breaks C1 by design).
- ``dora``: see :mod:`dora_rl.streams.dora_policy`.

Instances: each request goes to the least-loaded instance (fewest trajectories dispatched and
not yet completed), ties broken by index, so load spreads evenly.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Generic, TypeVar

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


@dataclass
class SchedulerState:
    """What the scheduler knows; rebuilt from Kafka on restart by replaying the same events."""

    latest_version: int = -1
    waves_dispatched: int = 0
    consumed_steps: int = 0
    in_flight: dict[str, int] = field(default_factory=dict)  # trajectory id -> instance
    version_of: dict[str, int] = field(default_factory=dict)  # trajectory id -> version (not consumed)


class Scheduler(Generic[P]):
    """Wave-based dispatch for ``sync``, ``one_step_off`` and ``partial``."""

    def __init__(self, mode: str, train_batch_size: int, group_size: int, steps: int,
                 num_instances: int, max_staleness: int | None = None) -> None:
        if mode not in ("sync", "one_step_off", "partial"):
            raise ValueError(f"Scheduler handles sync/one_step_off/partial, not {mode!r}")
        self.mode = mode
        self.group_size = group_size
        self.prompts_per_wave = train_batch_size // group_size
        self.steps = steps
        self.num_instances = num_instances
        self.max_staleness = (1 if mode == "one_step_off" else 0) if max_staleness is None else max_staleness
        self.train_batch_size = train_batch_size
        self.state = SchedulerState()
        self.planner = Planner(train_batch_size, group_size, self.max_staleness, steps)
        self._prompts: deque[tuple[str, P]] = deque()

    def add_prompt(self, group_id: str, prompt: P) -> None:
        """Queue a prompt (FIFO)."""
        self._prompts.append((group_id, prompt))

    def on_version(self, version: int) -> None:
        """A policy version was announced."""
        self.state.latest_version = max(self.state.latest_version, version)

    def on_completed(self, trajectory_id: str) -> None:
        """A trajectory finished decoding (its instance is free of it)."""
        self.state.in_flight.pop(trajectory_id, None)
        self.planner.complete(trajectory_id)

    def on_consumed(self, train_step: int, trajectory_ids: list[str]) -> None:
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
        while self.state.waves_dispatched < self.steps:
            wave = self.state.waves_dispatched
            version = self.wave_version(wave)
            if version > self.state.latest_version or len(self._prompts) < self.prompts_per_wave:
                break
            load = self.load()
            for _ in range(self.prompts_per_wave):
                group_id, prompt = self._prompts.popleft()
                for i in range(self.group_size):
                    inst = min(range(self.num_instances), key=lambda j: (load[j], j))
                    load[inst] += 1
                    d = Dispatch(prompt, group_id, i, version, inst, wave)
                    self.state.in_flight[d.trajectory_id] = inst
                    self.state.version_of[d.trajectory_id] = version
                    self.planner.add(d.trajectory_id, group_id, version)
                    out.append(d)
            self.state.waves_dispatched += 1
        return out

    def done(self) -> bool:
        """All waves dispatched."""
        return self.state.waves_dispatched >= self.steps

    def plans(self) -> list[tuple[int, list[str]]]:
        """Batches that can be planned now: (train step, trajectory ids), EDF (see ``planning``)."""
        return self.planner.plans()
