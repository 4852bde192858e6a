"""The records a rollout instance writes, built from what it holds: one function per record kind.

Shared by the worker (:mod:`.worker`) and the in-memory processor (:mod:`.instance_processor`), so both
write the same bytes for the same request and result. Pure: no producer, no clock (times are passed in).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from dora_rl.infra.kafka.signing import signed
from dora_rl.schemas.records import KvTransfer, RolloutRequest, TokenChunk, Trajectory

from .engine import GenResult

FINISH = {"stop": "STOP", "length": "LENGTH", "abort": "ABORT"}


def token_chunk(run_id: str, instance_id: str, held: int, req: RolloutRequest, start: int, ids: list[int],
                lps: list[float], ts_ms: int) -> TokenChunk:
    """Tokens ``[start, start + len(ids))`` of ``req``'s response, decoded under version ``held``."""
    return TokenChunk(run_id=run_id, trajectory_id=req.trajectory_id, group_id=req.group_id, policy_version=held,
                      instance_id=instance_id, start=start, token_ids=np.asarray(ids), logprobs=np.asarray(lps),
                      final=False, ts_ms=ts_ms)


def aborted_chunk(run_id: str, instance_id: str, req: RolloutRequest, ids: list[int], lps: list[float],
                  kv: KvTransfer | None, ts_ms: int, token: str) -> TokenChunk:
    """A cancelled trajectory handed back: its whole partial response (and where its KV rows wait), signed, as
    the orchestrator resumes no other."""
    return signed(TokenChunk(
        run_id=run_id, trajectory_id=req.trajectory_id, group_id=req.group_id,
        policy_version=int(req.policy_version), instance_id=instance_id, start=0,
        token_ids=np.asarray(ids, dtype=np.int32), logprobs=np.asarray(lps, dtype=np.float32), final=True,
        ts_ms=ts_ms, aborted=True, kv=kv), token)


def handed_back(run_id: str, instance_id: str, req: RolloutRequest, ts_ms: int, token: str) -> TokenChunk:
    """A request that never started here handed back as the partial it carried (and the KV reference it named:
    its exporter still holds the rows)."""
    return aborted_chunk(run_id, instance_id, req, [int(i) for i in req.partial_ids],
                         [float(x) for x in req.partial_logprobs], req.kv, ts_ms, token)


def trajectory(run_id: str, instance_id: str, held: int, req: RolloutRequest, res: GenResult,
               decode: Callable[[list[int]], str], token: str) -> Trajectory:
    """The finished trajectory of ``req``, signed (the scorer scores no other, decision 0062).

    Its ``policy_version`` is the request's (C1); a partial-rollout resume (``partial_versions`` set) records
    every token's version and takes the oldest as the trajectory's."""
    tv: np.ndarray | None = None
    version = int(req.policy_version)
    if req.partial_versions is not None:  # partial-rollout baseline: tokens of several versions
        n_new = len(res.token_ids) - len(req.partial_ids)
        tv = np.concatenate([np.asarray(req.partial_versions, dtype=np.int64), np.full(n_new, held, dtype=np.int64)])
        version = int(tv.min()) if len(tv) else version
    return signed(Trajectory(
        run_id=run_id, trajectory_id=req.trajectory_id, group_id=req.group_id, prompt_id=req.prompt_id,
        sample_index=req.sample_index, group_size=req.group_size, policy_version=version,
        task=req.task, reference=req.reference, prompt_ids=req.prompt_ids, token_versions=tv,
        response_ids=np.asarray(res.token_ids, dtype=np.int32),
        behaviour_logprobs=np.asarray(res.logprobs, dtype=np.float32),
        response_text=decode(list(res.token_ids)), finish_reason=FINISH[res.finish_reason],
        instance_id=instance_id, instance_version=held, dispatched_ms=req.dispatched_ms,
        first_token_ms=int(res.first_token_s * 1000), finished_ms=int(res.finished_s * 1000)), token)
