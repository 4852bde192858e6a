"""Dispatch rules of the orchestrator as pure logic: which prompt goes to which version and instance.

No Kafka and no clock here: the orchestrator process (and the discrete-event simulator) feeds events
in (prompts, version announcements with the time they were seen, completions, consumed batches,
aborted partials, timer ticks) and carries out what comes back (dispatches, cancels, resumes, batch
plans). Every mode implements one interface, :class:`SchedulingRules` (events in, decisions out:
:mod:`.scheduling_events`), so the orchestrator and the simulator drive each mode the same way with no
probing of its type; :func:`.rules.make_scheduler` picks the
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
from typing import Generic, Protocol, TypeVar

from dora_rl.config import DoraConfig

from .planning import Planner
from .scheduling_events import (
    Aborted,
    Completed,
    Consumed,
    Decisions,
    Dispatch,
    Event,
    Heartbeat,
    PromptQueued,
    Refused,
    RulesStatus,
    Scored,
    Tick,
    VersionSeen,
    decisions,
)

P = TypeVar("P")


class SchedulingRules(Protocol[P]):
    """What the orchestrator, the simulator and the benches call, for every mode: events in, decisions out.

    Every event goes in through :meth:`handle` (:data:`~.scheduling_events.Event`); everything decided
    since the last call comes out of :meth:`decide`, which the caller carries out in the record's field
    order (the orchestrator after each round of events). The other four only read.
    """

    def handle(self, event: Event) -> None:
        """Take one event (a prompt, a version, a completion, a score, a refusal, a consumed batch, an
        aborted partial, a heartbeat or a tick)."""
        ...

    def decide(self) -> Decisions[P]:
        """Everything decided since the last call (each decision is returned once)."""
        ...

    def status(self) -> RulesStatus:
        """Prompts queued and not dispatched, and whether every trajectory of the run is dispatched."""
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
        self._withdrawn: list[str] = []  # groups withdrawn since the last decide

    # -- the interface ---------------------------------------------------------------------------

    def handle(self, event: Event) -> None:
        """Waves are driven by versions, completions and consumed batches; see each handler."""
        match event:
            case PromptQueued(group_id, prompt):
                self._prompts.append((group_id, prompt))
            case VersionSeen(version, _):
                self.state.latest_version = max(self.state.latest_version, version)
            case Completed(trajectory_id):
                self.state.in_flight.pop(trajectory_id, None)
            case Scored(trajectory_id):
                self.planner.complete(trajectory_id)
            case Refused(group_id):
                self._refuse(group_id)
            case Consumed(train_step, trajectory_ids):
                self._consume(train_step, trajectory_ids)
            case Aborted() | Heartbeat() | Tick():
                pass  # waves never cancel, migrate or re-partition: a trajectory an instance gives up (it is
                # stopping) stays uncommitted on its request partition and is generated again when it restarts;
                # the configured instances serve every wave (a lost one's requests wait in its partition)

    def decide(self) -> Decisions[P]:
        withdrawn, self._withdrawn = self._withdrawn, []
        return decisions(self._dispatch(), (), (), self.planner.plans(), withdrawn)

    def status(self) -> RulesStatus:
        """All waves dispatched, and every refused group replaced."""
        done = self.state.waves_dispatched >= self.steps and not self.replacements
        return RulesStatus(len(self._prompts), done)

    def version_of(self, trajectory_id: str) -> int:
        return self.state.version_of[trajectory_id]

    def instance_state(self, instance: int, holds: int) -> str:
        """Waves: every instance generates the wave of the version it holds."""
        return "newest" if holds >= self.state.latest_version else "old"

    def describe(self) -> str:
        st = self.state
        return (f"latest={st.latest_version} waves={st.waves_dispatched} consumed={st.consumed_steps} "
                f"in_flight={len(st.in_flight)} queued_prompts={len(self._prompts)}")

    # -- rules ------------------------------------------------------------------------------------

    def _refuse(self, group_id: str) -> None:
        """Withdraw the group; its replacement is dispatched with the same version (see ``Refused``)."""
        tids = self.planner.withdraw(group_id)
        if not tids:
            return
        versions = [self.state.version_of.pop(t) for t in tids]
        for t in tids:
            self.state.in_flight.pop(t, None)
        self.replacements.append(min(versions))
        self.refused_groups += 1
        self._withdrawn.append(group_id)

    def _consume(self, train_step: int, trajectory_ids: Sequence[str]) -> None:
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

    def _dispatch(self) -> list[Dispatch[P]]:
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
