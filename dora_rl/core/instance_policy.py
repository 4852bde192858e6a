"""The instance-side rule (C1): which version a rollout instance holds next, which requests it starts.

One home for what the rollout worker (:mod:`dora_rl.producers.rollout.worker`) and the
discrete-event simulator (:mod:`dora_rl.streams.simulator`) both do; pure, no clock, no Kafka.

An instance holds exactly one policy version at a time. Requests are tagged with a version by the
orchestrator; a request tagged ``v`` is generated only while the instance holds ``v``.

Rules:

1. **No switch under load (C1).** While any request is running, the held version stays: weights are
   never swapped under a running generation, so no trajectory mixes versions.
2. **Which version next.** When nothing runs: keep the held version if a pending request is tagged
   with it (no needless weight load); otherwise switch to the *oldest* pending version — it is the
   closest to its staleness deadline and its trajectories free the oldest live version soonest.
   Nothing pending: stay as is.
3. **What starts.** Pending requests of the held version that are not running start in arrival order,
   as many as there are free slots (``capacity - running``). Requests of other versions wait.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

T = TypeVar("T")


def next_version(held: int, pending_versions: Iterable[int], running: int) -> int | None:
    """The version to hold for the next generation (rules 1–2); None when nothing is pending."""
    if running > 0:
        return held
    versions = set(pending_versions)
    if not versions:
        return None
    return held if held in versions else min(versions)


def startable(held: int, queued: Sequence[T], version_of: Callable[[T], int], running: int,
              capacity: int) -> list[T]:
    """Rule 3: the requests of ``queued`` (pending, not running, in arrival order) that start now."""
    room = max(0, capacity - running)
    if room == 0:
        return []
    out: list[T] = []
    for q in queued:
        if version_of(q) == held:
            out.append(q)
            if len(out) == room:
                break
    return out
