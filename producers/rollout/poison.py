"""A rollout instance's guard against poison requests: durable tries, isolation, refusal of the group.

The rule is :mod:`dora_rl.core.attempts`; this module is its I/O for one instance:

- the tries are written to ``dora.state`` (key ``<run>/rollout-<i>.attempts``) and flushed **before**
  every engine call starts, so the next incarnation of a process killed by a request knows it;
- :meth:`PoisonGuard.split` sorts the queued requests into refused, to run alone, and batchable;
- a refused request becomes a dead letter on ``dora.dlq`` naming its ``group_id``: the orchestrator
  withdraws the whole group and dispatches a replacement prompt (batches stay exactly TBS), and the
  audit lists the group as refused with this reason.

Thread-safety: the caller holds the instance lock around :meth:`split`, :meth:`finished` and
:meth:`raised` (the generation thread reports finishes).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from dora_rl.core.attempts import Attempts
from dora_rl.infra.kafka import topics
from dora_rl.infra.kafka.io import RecordProducer, now_ms
from dora_rl.infra.kafka.keys import make_key
from dora_rl.infra.kafka.signing import signed
from dora_rl.infra.kafka.snapshots import latest_snapshot, send_snapshot
from dora_rl.schemas.records import DeadLetter, RolloutRequest

log = logging.getLogger(__name__)

ENGINE_BROKEN_AFTER = 10
"""Consecutive engine calls that raised, with nothing finished in between, after which the engine (not
one input) is taken to be broken: the instance exits and its supervisor decides."""


class PoisonGuard:
    """Durable tries and refusals of one rollout instance (see the module docstring)."""

    def __init__(self, bootstrap: str, run_id: str, instance_id: str, producer: RecordProducer,
                 max_attempts: int, state_since: int = 0, token: str = "") -> None:
        self.run_id, self.instance_id, self.producer = run_id, instance_id, producer
        self.token = token  # signs the refusals: the orchestrator withdraws a group only on a signed one
        self.max_attempts = max_attempts
        self.name = f"{instance_id}.attempts"
        snap = latest_snapshot(bootstrap, run_id, self.name, since=state_since)
        self.attempts = Attempts.loads(snap.state) if snap is not None else Attempts()
        self.commit = int(snap.commit) if snap is not None else 0
        self.last_error: dict[str, str] = {}
        self.failed_calls = 0
        self.refused = 0
        if self.attempts.tries:
            log.warning("%s: %d requests were in calls that failed before this start: %s", instance_id,
                        len(self.attempts.tries), sorted(self.attempts.tries)[:4])

    def split(self, queued: Sequence[RolloutRequest]) -> tuple[list[RolloutRequest], list[RolloutRequest],
                                                               list[RolloutRequest]]:
        """(refuse, alone, batch) of ``queued``, each in the given order."""
        out: dict[str, list[RolloutRequest]] = {"refuse": [], "alone": [], "batch": []}
        for r in queued:
            out[self.attempts.verdict(r.trajectory_id, self.max_attempts)].append(r)
        return out["refuse"], out["alone"], out["batch"]

    def starting(self, request_ids: Iterable[str], alone: bool) -> None:
        """A call (or a join) is about to start: count the try and make it durable first."""
        self.attempts.started(request_ids, alone)
        self.commit += 1
        send_snapshot(self.producer, self.run_id, self.name, self.commit, self.attempts.dumps())
        self.producer.flush(30)

    def not_started(self, request_ids: Iterable[str], alone: bool) -> None:
        """A join the engine refused (its call had just ended): take the counted try back."""
        self.attempts.not_started(request_ids, alone)

    def finished(self, request_id: str) -> None:
        self.attempts.finished(request_id)
        self.last_error.pop(request_id, None)
        self.failed_calls = 0

    def raised(self, request_ids: Sequence[str], error: BaseException) -> None:
        """The call holding ``request_ids`` (its unfinished requests) raised ``error``."""
        self.attempts.raised(request_ids)
        for rid in request_ids:
            self.last_error[rid] = f"{type(error).__name__}: {error}"
        self.failed_calls += 1
        if self.failed_calls >= ENGINE_BROKEN_AFTER:
            raise RuntimeError(f"{self.instance_id}: {self.failed_calls} engine calls in a row failed; "
                               f"the engine itself is broken") from error

    def refuse(self, offset: int, req: RolloutRequest, reason: str | None = None, error_type: str = "engine") -> None:
        """Dead-letter ``req`` with its group (the orchestrator replaces the group); ``reason`` defaults to
        its failed tries."""
        t = self.attempts.of(req.trajectory_id)
        if reason is None:
            cause = self.last_error.get(req.trajectory_id, "the process died during the call")
            reason = (f"the engine failed on this request alone {t.alone_failed} times "
                      f"({t.raised} calls raised, {t.died} died); last: {cause}")
        value, _ = req.encode()
        letter = signed(DeadLetter(component=self.instance_id, reason=reason[:2000], error_type=error_type,
                            source_topic=topics.REQUESTS, source_partition=int(self.instance_id.rsplit("-", 1)[1]),
                            source_offset=offset, ts_ms=now_ms(), run_id=self.run_id,
                            key=make_key(int(req.policy_version), req.group_id).encode(), value=value,
                            group_id=req.group_id, trajectory_id=req.trajectory_id, attempts=t.failures),
                        self.token)
        dlq = topics.in_run(self.run_id, topics.DLQ)
        self.producer.send(dlq, letter, make_key(int(req.policy_version), req.group_id))
        self.producer.flush(30)
        self.refused += 1
        log.error("%s: refused %s (group %s): %s", self.instance_id, req.trajectory_id, req.group_id, reason)
        self.attempts.finished(req.trajectory_id)
        self.last_error.pop(req.trajectory_id, None)
