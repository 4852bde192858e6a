"""Which rollout instance owns which index, when instances start on many hosts with no launcher.

An instance started with ``--index auto`` claims the smallest free index by writing a *claim* (an
``InstanceStatus`` in state ``STARTING`` carrying its ``incarnation`` name) to ``dora.instances``, a
single-partition topic: the log is one total order every reader sees alike. The rule, pure:

1. **Owner.** The owner of index ``i`` is the writer of the *first* record of the run with
   ``instance_index == i`` (a claim, or the first heartbeat of an explicitly numbered instance, whose
   incarnation is ``""``). Later records for ``i`` by others change nothing.
2. **Claim.** A claimant picks :func:`first_free` (the smallest index with no record), writes its claim,
   reads the log up to its own claim and owns ``i`` iff :func:`owners` says so; else it retries with
   the next free index. Two claimants racing for ``i`` cannot both win (rule 1 is a function of one
   log); the loser's claim is a record for ``i`` that names someone else, which is harmless.
3. **Restart.** A name that already owns an index gets it back (:func:`owned_by`): a restarted
   instance keeps its partition and its committed offsets. A new name never takes a used index.
4. **Bounded.** Indices are partitions of ``dora.rollout.requests``: an index ``>= limit``
   (``max_instances``) is refused with :class:`RunFull` instead of being silently shared.

Invariant: no two live names own one index, whatever the interleaving of claims (proof: rule 1).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping


class RunFull(RuntimeError):
    """Every index below ``max_instances`` has an owner."""


def owners(records: Iterable[tuple[int, str]]) -> dict[int, str]:
    """``index -> incarnation`` of each index's first record (rule 1); ``records`` in log order."""
    out: dict[int, str] = {}
    for index, incarnation in records:
        out.setdefault(index, incarnation)
    return out


def owned_by(owner_of: Mapping[int, str], name: str) -> int | None:
    """The index ``name`` owns already (rule 3), if any; an empty name owns nothing."""
    if not name:
        return None
    return min((i for i, n in owner_of.items() if n == name), default=None)


def first_free(owner_of: Mapping[int, str], limit: int) -> int:
    """The smallest index with no owner, below ``limit`` (rule 4)."""
    for i in range(limit):
        if i not in owner_of:
            return i
    raise RunFull(f"all {limit} rollout instance indices of this run are taken; create the run with a larger "
                  f"max_instances (the request topic's partitions)")


__all__ = ["RunFull", "first_free", "owned_by", "owners"]
