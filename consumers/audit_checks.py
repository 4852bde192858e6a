"""The cross-topic checks of ``dora-rl audit``, as pure functions of plain sequences of records.

No broker and no report here: each function takes records (or plain maps built from them) and
returns what it found; :func:`dora_rl.consumers.audit.audit_records` turns the findings into counts,
examples and the verdict. What each finding means is documented in :mod:`dora_rl.consumers.audit`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dora_rl.infra.kafka.signing import signature_problem
from dora_rl.schemas.records import DeadLetter, InstanceStatus, TokenChunk, Trajectory


def refused_groups(run_id: str, dead_letters: Iterable[DeadLetter], token: str = "") -> dict[str, dict[str, Any]]:
    """The run's refused GRPO groups (letters with ``group_id`` set and, given the run's ``token``, signed
    with it: the orchestrator withdraws on no other), in order of their first letter.

    One entry per group: ``group_id, trajectory_id, component, error_type, reason, attempts`` of the
    first letter, except ``reason``, which joins every distinct reason given for the group with ``"; "``.
    """
    out: dict[str, dict[str, Any]] = {}
    for d in dead_letters:
        if d.group_id is None or d.run_id != run_id or signature_problem(d, token, "refusal") is not None:
            continue
        entry = out.get(d.group_id)
        if entry is None:
            out[d.group_id] = {"group_id": d.group_id, "trajectory_id": d.trajectory_id, "component": d.component,
                               "error_type": d.error_type, "reason": d.reason, "attempts": int(d.attempts)}
        elif d.reason not in entry["reason"].split("; "):
            entry["reason"] = f"{entry['reason']}; {d.reason}"
    return out


def chunk_mismatches(versions: Mapping[str, int], chunks: Iterable[TokenChunk]) -> dict[str, list[int]]:
    """Trajectories of ``versions`` (id -> its policy version) with a non-aborted token chunk of another
    version; for each, the other versions, sorted.

    Aborted chunks are skipped: they hand a migrating partial back tagged with the request's version,
    whatever sampled it.
    """
    found: dict[str, set[int]] = defaultdict(set)
    for c in chunks:
        want = versions.get(c.trajectory_id)
        if want is not None and not c.aborted and int(c.policy_version) != want:
            found[c.trajectory_id].add(int(c.policy_version))
    return {tid: sorted(vs) for tid, vs in found.items()}


def heartbeat_mismatches(versions: Mapping[str, int], statuses: Iterable[InstanceStatus]
                         ) -> dict[str, list[tuple[str, int]]]:
    """Trajectories of ``versions`` (id -> its policy version) that a heartbeat of any instance listed
    in flight while that instance held another version; for each, the ``(instance, held version)``
    pairs, sorted."""
    found: dict[str, set[tuple[str, int]]] = defaultdict(set)
    for s in statuses:
        for tid in s.in_flight_ids:
            want = versions.get(tid)
            if want is not None and int(s.loaded_version) != want:
                found[tid].add((s.instance_id, int(s.loaded_version)))
    return {tid: sorted(pairs) for tid, pairs in found.items()}


def first_copies(generated: Iterable[Trajectory]) -> tuple[dict[str, Trajectory], list[Trajectory]]:
    """The first record of each trajectory id, and every later record (regenerated copies), in order."""
    first: dict[str, Trajectory] = {}
    extra: list[Trajectory] = []
    for t in generated:
        if t.trajectory_id in first:
            extra.append(t)
        else:
            first[t.trajectory_id] = t
    return first, extra


@dataclass
class IdBalance:
    """Distinct trajectory ids: generated = trained + refused, per version (the generated copy's version,
    except for trained ids, counted under their batched version)."""

    by_version: dict[int, dict[str, int]] = field(default_factory=dict)
    refused: list[str] = field(default_factory=list)
    """Generated ids refused (their group, or themselves) and never trained."""
    unaccounted: list[str] = field(default_factory=list)
    """Generated ids neither trained nor refused."""
    never_generated: list[str] = field(default_factory=list)
    """Trained ids no record on the trajectories topic carries."""

    @property
    def unbalanced(self) -> int:
        return len(self.unaccounted) + len(self.never_generated)


def id_balance(first: Mapping[str, Trajectory], trained: Mapping[str, int], groups_refused: Collection[str],
               ids_refused: Collection[str] = (), reused: Collection[str] = ()) -> IdBalance:
    """Balance of distinct ids: ``first`` (generated id -> its first record), ``trained`` (batched id ->
    its batched version), the refused group ids and the ids refused one by one (older letters); ``reused``
    ids (re-fed from another run) are trained without being generated here."""
    out = IdBalance()
    counts: dict[int, dict[str, int]] = defaultdict(lambda: {"generated": 0, "trained": 0, "refused": 0})
    for tid, t in first.items():
        v = int(t.policy_version)
        counts[v]["generated"] += 1
        if tid in trained:
            continue
        if t.group_id in groups_refused or tid in ids_refused:
            counts[v]["refused"] += 1
            out.refused.append(tid)
        else:
            out.unaccounted.append(tid)
    for tid, v in trained.items():
        counts[v]["trained"] += 1
        if tid not in first and tid not in reused:
            out.never_generated.append(tid)
    out.by_version = {v: counts[v] for v in sorted(counts)}
    return out


def waste(first: Mapping[str, Trajectory], extra: Sequence[Trajectory], refused: Iterable[str]) -> tuple[int, int]:
    """``(records, tokens)`` generated for nothing: the regenerated copies (records beyond the first
    per id, after a crash) and their response tokens, plus the response tokens of refused ids."""
    tokens = sum(t.num_tokens for t in extra) + sum(first[tid].num_tokens for tid in refused if tid in first)
    return len(extra), tokens


def provenance(batches: Iterable[Any]) -> tuple[dict[str, dict[str, int]], set[str]]:
    """Records a re-fed run reused (``dora-rl replay refeed``): per source run, the batches copied and the
    trajectories trained from it (a trajectory's own ``provenance``, else its batch's), and the ids of
    every reused trajectory (generated and dispatched in the source run, not in this one)."""
    counts: dict[str, dict[str, int]] = {}
    reused: set[str] = set()
    for b in batches:
        if b.provenance is not None:
            counts.setdefault(b.provenance.source_run_id, {"batches": 0, "trajectories": 0})["batches"] += 1
        for t in b.trajectories:
            origin = t.provenance or b.provenance
            if origin is not None:
                counts.setdefault(origin.source_run_id, {"batches": 0, "trajectories": 0})["trajectories"] += 1
                reused.add(t.trajectory_id)
    return dict(sorted(counts.items())), reused


def not_as_generated(generated: Iterable[Trajectory], trained: Iterable[Trajectory]) -> list[str]:
    """Ids of ``trained`` trajectories whose content (:func:`content_of`) matches none of the ``generated``
    copies of their id; an id never generated is left to the id balance."""
    copies: dict[str, set[tuple[int, bytes, bytes]]] = defaultdict(set)
    for t in generated:
        copies[t.trajectory_id].add(content_of(t))
    return [t.trajectory_id for t in trained
            if t.trajectory_id in copies and content_of(t) not in copies[t.trajectory_id]]


def unsigned_scores(trained: Iterable[Trajectory], scorer_key: str) -> list[str]:
    """Ids of ``trained`` trajectories whose score is not signed with ``scorer_key`` (none without a key)."""
    return [t.trajectory_id for t in trained if signature_problem(t, scorer_key, "score") is not None]


def content_of(t: Trajectory) -> tuple[int, bytes, bytes]:
    """What an instance wrote and no later writer may change: the version, prompt and response token ids."""
    return (int(t.policy_version), np.asarray(t.prompt_ids, dtype=np.int64).tobytes(),
            np.asarray(t.response_ids, dtype=np.int64).tobytes())
