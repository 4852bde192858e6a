"""KV-aware admission and consolidation (the ``consolidate`` re-partition policy) as pure rules.

**Slots from KV room.** The orchestrator never sees a running request's final length; it sees the token
counts of completed trajectories (prompt ``P`` and response ``L``, on the trajectories topic). A request's
context grows linearly from ``P`` to ``P + L`` while it decodes, so the context one busy slot holds,
averaged over time, is::

    E[ctx] = E[P] + E[L^2] / (2 E[L])

and an instance with ``kv_tokens`` of KV cache holds ``slots = clamp(floor(kv_tokens / E[ctx]), 1,
max_num_seqs)`` requests at once (:func:`kv_slots`). Until ``MIN_SAMPLES`` completions are seen (or with
``kv_tokens = 0``: unknown) it is ``max_num_seqs``, the engine's own limit. Packing counts these slots.
With ``consolidate_kv_admission`` an instance is also *given* no more than its slots (requests beyond
them stay in the orchestrator's queue, untagged, and get the version that takes them when room opens);
off by default: on the paper setup it cost 4% against letting the engine's own KV admission queue
requests locally (decision 0048).

**Pack or spread.** Whether to pack depends on whether the newest version can use the room packing
frees. While it can (it has prompts it may dispatch), old versions are packed as below. While it
cannot (the run's budget, RBS or the EDF condition holds it back), packing would only slow the old
versions' stragglers — the work the next batch waits for — so instances are spread over every version
in flight (:func:`~dora_rl.streams.repartition.quotas`) and each version's work is levelled over its
instances (:func:`excess`): a straggler decodes faster on an emptier instance, and a KV move costs
milliseconds.

**Spread by deadline** (:func:`urgency`). Spread in proportion to the in-flight count alone, the version due
soonest — a few hundred stragglers beside thousands of the newest's requests — gets one instance or two, and
the batch waits for its tail. So each version's in-flight work ``n_v`` is weighted by the steps ``k_v``
left before the batch it must be in is planned (``k_v = deadline(v) - c + 1 >= 1``, ``c`` the next batch
to plan)::

    weight_v = n_v / k_v ** 2

One factor of ``k_v`` is the rate the work must go at (``n_v`` over the steps left to do it). The second
counts that a version's in-flight work near its deadline is its tail: its longest requests, which no number of
instances decodes faster than one running alone (a cap-length request alone takes most of a step on the paper
setup), so less than ``k_v`` steps' time is left to share. Exponents 0 (by count: the rule before), 1, 2 and 3
were probed on the paper setup's choice seeds (decision 0082): 2 was best. ``consolidate_level_by_deadline``
off weights by count alone (an ablation switch).

**Stragglers at the cap** (:func:`straggler_slots`). An old version's in-flight work is what is left of
it once its short requests are done: its long tail, whose context keeps growing towards the cap ``M``
(``max_new_tokens``) while it is the next batches' critical path. So packing counts each of them at the
cap, not at the average busy context::

    straggler_slots = clamp(floor(kv_tokens / (E[P] + M)), 1, slots)

A packed instance then never runs out of KV (nothing is preempted), and its decode step, which grows with
the context it reads, stays no slower than a full instance's. Off (``consolidate_pack_at_cap = False``):
packing counts ``slots``, and a version's cap-length tail can land on one instance.

**Consolidation** (:func:`consolidated_quotas`). An old version (``v < latest``) keeps as many instances
as its in-flight trajectories need slots (:func:`straggler_slots`), ``ceil(in_flight / slots)``, never more
than it holds (at least one while it has work but holds none: its instances were lost); it gives one up only when the
rest would stay below ``1 - hysteresis`` full. Oldest versions are served first (their work is due
first); the newest version gets every other instance — there is no one-instance floor for anyone. The
instances a version gives up are its least loaded (:func:`~.repartition.keep_order`), and their trajectories move,
with their KV, to the version's other instances. The version due at the next step is packed like the others:
counted at the cap, its stragglers are not slowed. (With ``consolidate_unpack_due``, the rule before decision
0074, it is not packed, and an instance of it left with no work is freed at once.)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

MIN_SAMPLES = 32
"""Completions seen before the length moments are trusted."""

HYSTERESIS = 0.1
"""An old version frees an instance only when its remaining ones would be at most this much below full."""


@dataclass
class LengthMoments:
    """Running moments of completed trajectories' prompt and response token counts."""

    count: int = 0
    prompt_sum: float = 0.0
    response_sum: float = 0.0
    response_sq_sum: float = 0.0

    def add(self, prompt_tokens: int, response_tokens: int) -> None:
        self.count += 1
        self.prompt_sum += prompt_tokens
        self.response_sum += response_tokens
        self.response_sq_sum += float(response_tokens) ** 2

    def busy_context(self) -> float | None:
        """``E[P] + E[L^2] / (2 E[L])`` (module docstring), or None before ``MIN_SAMPLES`` completions."""
        if self.count < MIN_SAMPLES or self.response_sum <= 0:
            return None
        return self.prompt_sum / self.count + self.response_sq_sum / (2.0 * self.response_sum)


def kv_slots(kv_tokens: int, moments: LengthMoments, max_num_seqs: int) -> int:
    """Requests one instance holds at once (module docstring); ``max_num_seqs`` while unknown."""
    ctx = moments.busy_context()
    if kv_tokens <= 0 or ctx is None:
        return max_num_seqs
    return max(1, min(max_num_seqs, int(kv_tokens / ctx)))


def straggler_slots(kv_tokens: int, moments: LengthMoments, max_new_tokens: int, slots: int) -> int:
    """Requests of an old version packed onto one instance, each counted at the cap (module docstring);
    ``slots`` while the KV size is unknown."""
    if kv_tokens <= 0:
        return slots
    prompt = moments.prompt_sum / moments.count if moments.count else 0.0
    return max(1, min(slots, int(kv_tokens / (prompt + max_new_tokens))))


def consolidated_quotas(in_flight: Mapping[int, int], held: Mapping[int, int], latest: int, n: int,
                        slots: int, hysteresis: float = HYSTERESIS, due: int = -1,
                        loaded: Mapping[int, int] | None = None) -> dict[int, int]:
    """Instances per version: every old version with in-flight work as many as it needs (module
    docstring), oldest first while instances last; ``latest`` the rest. ``sum == n``. A version due at the
    next step (``v <= due``) is never packed: it keeps every instance that decodes some of its work
    (``loaded[v]`` of them; all it holds when ``loaded`` is None), and gives up those left empty."""
    quota: dict[int, int] = {}
    left = n
    for v in sorted(x for x in in_flight if x < latest and in_flight[x] > 0):
        has = held.get(v, 0)
        need = math.ceil(in_flight[v] / slots)
        slack = math.ceil(in_flight[v] / (slots * (1.0 - hysteresis)))  # keep while the rest would overfill
        if v <= due:  # due next step: never packed, but gives up the instances it left empty
            keep = has if loaded is None else loaded.get(v, 0)
        else:
            keep = max(need, min(has, slack))
        quota[v] = min(left, max(1, min(keep, has)))
        left -= quota[v]
    quota[latest] = quota.get(latest, 0) + left
    return quota


def urgency(in_flight: Mapping[int, int], steps_left: Mapping[int, int], by_deadline: bool = True) -> dict[int, float]:
    """Each version's weight in the spread while ``consolidate`` levels (module docstring): ``n_v / k_v ** 2``,
    ``k_v = steps_left[v]`` floored at 1 (``n_v`` alone without ``by_deadline``). Versions with no work are left out."""
    return {v: n / (max(1, steps_left[v]) ** 2 if by_deadline else 1) for v, n in in_flight.items() if n > 0}


def excess(loads: Mapping[int, int], slack: float = 0.5, floor: int = 4) -> dict[int, int]:
    """Trajectories to move off each of one version's instances (``loads``: instance -> load) to level
    them, down to the level ``ceil(total / instances)``, when the spread is clear: some instance holds more
    than ``level * (1 + slack) + floor``, or some holds less than ``level * (1 - slack) - floor`` (an
    instance left nearly empty while the rest decode). Empty when every instance is within that band
    (moves are not worth their churn)."""
    if not loads:
        return {}
    level = math.ceil(sum(loads.values()) / len(loads))
    high, low = level * (1.0 + slack) + floor, level * (1.0 - slack) - floor
    if max(loads.values()) <= high and min(loads.values()) >= low:
        return {}
    return {i: n - level for i, n in loads.items() if n > level}
