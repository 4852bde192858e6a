"""What a rollout instance decides about the requests it holds, as pure rules: no Kafka, no engine, no thread.

The worker (:mod:`.worker`) and the in-memory processor (:mod:`.instance_processor`) both keep one
:class:`RequestBook` and carry out what it decides; the version and admission rules themselves are
:mod:`dora_rl.core.instance_policy` (C1) and :mod:`dora_rl.core.attempts` (poison), called from here only.

State: ``pending`` maps each request taken and not finished to its offset on the request partition;
``running`` are those handed to the engine; ``call_ids`` those of the engine call running now (joins
included); ``alone`` says that call holds one suspect alone; ``held`` is the version the engine holds.

Invariants (tested, ``tests/unit/test_instance_rules.py``):

- ``running ⊆ pending`` and every running request is of version ``held`` (C1: a request of version ``v``
  starts only while ``v`` is held, and the held version changes only when nothing runs);
- a request id is pending at most once (a copy, or a re-read after a restart, is taken once);
- :meth:`RequestBook.commit_below` never passes an unfinished request, so a restarted instance reads every
  unfinished request again (nothing lost; downstream is idempotent on trajectory ids);
- a cancelled request leaves the book exactly once: handed back at once when queued, or when the engine
  hands its partial back when it runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from dora_rl.core.instance_policy import next_version, startable
from dora_rl.schemas.records import RolloutRequest

Verdict = Callable[[Sequence[RolloutRequest]], tuple[list[RolloutRequest], list[RolloutRequest], list[RolloutRequest]]]
"""The poison rule's split of queued requests: (refuse, alone, batch), each in the given order."""


def no_poison(queued: Sequence[RolloutRequest]) -> tuple[list[RolloutRequest], list[RolloutRequest],
                                                         list[RolloutRequest]]:
    """The split when no request ever failed: everything is batchable."""
    return [], [], list(queued)


@dataclass(frozen=True)
class Start:
    """What starts now: ``batch`` (in arrival order), alone or not, and the requests refused on the way
    (``(offset, request)``: dead-lettered with their group, out of the book)."""

    batch: tuple[RolloutRequest, ...]
    alone: bool
    refused: tuple[tuple[int, RolloutRequest], ...]


@dataclass(frozen=True)
class CancelOutcome:
    """What a cancel finds: ``queued`` (taken out: hand ``request`` back as its partial now), ``running`` (the
    engine hands it back: export its rows, else abort it) or ``unknown`` (finished, or never here)."""

    kind: Literal["queued", "running", "unknown"]
    request: RolloutRequest | None = None


class RequestBook:
    """The requests one instance holds and what it may do with them (see the module docstring).

    Not thread-safe: the worker holds its lock around every change. Its generation thread reads a running
    request's entry without it: only that thread removes a running request (:meth:`finished`)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.pending: dict[str, tuple[int, RolloutRequest]] = {}
        self.running: set[str] = set()
        self.call_ids: set[str] = set()
        self.alone = False
        self.held = -1

    # -- requests in ------------------------------------------------------------------------------

    def take(self, offset: int, req: RolloutRequest) -> bool:
        """A request to generate, read at ``offset``; False when already held (a copy or a re-read)."""
        if req.trajectory_id in self.pending:
            return False
        self.pending[req.trajectory_id] = (offset, req)
        return True

    def cancel(self, trajectory_id: str) -> CancelOutcome:
        """A cancel: a queued request leaves the book now; a running one leaves when the engine hands it back."""
        entry = self.pending.get(trajectory_id)
        if entry is None:
            return CancelOutcome("unknown")
        if trajectory_id in self.running:
            return CancelOutcome("running", entry[1])
        del self.pending[trajectory_id]
        return CancelOutcome("queued", entry[1])

    # -- what runs --------------------------------------------------------------------------------

    def next_version(self) -> int | None:
        """The version to hold for the next call (C1, :func:`~dora_rl.core.instance_policy.next_version`)."""
        return next_version(self.held, (int(r.policy_version) for _, r in self.pending.values()), len(self.running))

    def hold(self, version: int) -> None:
        """The engine now holds ``version`` (only while nothing runs: C1)."""
        if self.running and version != self.held:
            raise RuntimeError(f"C1: switching to version {version} while {len(self.running)} requests of "
                               f"version {self.held} run")
        self.held = version

    def start(self, new_call: bool, split: Verdict = no_poison) -> Start:
        """The requests that start now, marked running: a new call, or a join of the running one.

        A suspect of the held version runs alone in a new call (nothing joins it); otherwise the
        instance rule picks the held version's queued requests into the free slots."""
        queued = [r for _, r in sorted(self.pending.values(), key=lambda x: x[0])
                  if r.trajectory_id not in self.running]
        refuse, alone, ok = split(queued)
        refused = tuple((self.pending.pop(r.trajectory_id)[0], r) for r in refuse)
        held_alone = [r for r in alone if int(r.policy_version) == self.held]
        if new_call and held_alone:
            batch, self.alone = held_alone[:1], True
        elif self.alone and not new_call:
            batch = []
        else:
            batch = startable(self.held, ok, lambda r: int(r.policy_version), len(self.running), self.capacity)
            self.alone = False
        if new_call:
            self.call_ids = set()
        self.call_ids.update(r.trajectory_id for r in batch)
        self.running.update(r.trajectory_id for r in batch)
        return Start(tuple(batch), self.alone, refused)

    def not_started(self, trajectory_ids: Iterable[str]) -> None:
        """A join the engine refused (its call had just ended): back to queued."""
        ids = set(trajectory_ids)
        self.running -= ids
        self.call_ids -= ids

    def call_failed(self) -> list[str]:
        """The running call raised: its unfinished requests go back to queued (sorted ids returned)."""
        failed = sorted(rid for rid in self.call_ids if rid in self.pending)
        self.running.difference_update(failed)
        return failed

    def call_ended(self) -> list[str]:
        """The engine call returned: a request still marked running was never reported by it (an engine that
        accepted a join and dropped it); back to queued so the next call starts it (sorted ids returned)."""
        stranded = sorted(self.running)
        self.running.clear()
        self.call_ids.clear()
        return stranded

    def finished(self, trajectory_id: str) -> RolloutRequest | None:
        """The engine is done with a request (finished, refused or handed back): it leaves the book."""
        entry = self.pending.pop(trajectory_id, None)
        self.running.discard(trajectory_id)
        return None if entry is None else entry[1]

    # -- positions and leaving ----------------------------------------------------------------------

    def commit_below(self, next_offset: int) -> int:
        """The request partition's commit position: the oldest unfinished request, else ``next_offset``."""
        return min((o for o, _ in self.pending.values()), default=next_offset)

    def hand_back(self) -> list[RolloutRequest]:
        """Graceful leave: the queued requests (not running) leave the book, in id order, to be handed back."""
        queued = [r for rid, (_, r) in sorted(self.pending.items()) if rid not in self.running]
        for r in queued:
            del self.pending[r.trajectory_id]
        return queued

    def request(self, trajectory_id: str) -> RolloutRequest:
        """The pending request ``trajectory_id`` (KeyError when it left the book)."""
        return self.pending[trajectory_id][1]
