"""The rollout instance on the processor shape (:mod:`dora_rl.streams.processor`), for the in-memory driver.

The worker (:mod:`.worker`) runs its engine in a thread with continuous batching, and recovers by committing
its request partition below the oldest unfinished request. This processor keeps the same
:class:`~.instance_rules.RequestBook` and writes the same records (:mod:`.outputs`), but calls the engine
synchronously in :meth:`InstanceProcessor.punctuate`, so :class:`~dora_rl.streams.processor.MemoryDriver` can
crash it at every record boundary and compare what it committed with an uninterrupted run.

Inputs: ``dora.policy.versions`` (the trainer's announcements, checked as the worker checks them: a refused one
is dead-lettered) and the instance's request partition (GENERATE and CANCEL). Outputs: token chunks, aborted
chunks (a queued request cancelled), trajectories, dead letters. Snapshot: the versions known, the version held,
and a reference per pending request (the worker's equivalent is its committed request offset).

Not modelled here (the worker's own, tested through it): continuous batching, KV export of a running request,
poison tries (every request is batchable: :func:`~.instance_rules.no_poison`), heartbeats.
"""

from __future__ import annotations

import json

from dora_rl.config import DoraConfig
from dora_rl.infra.kafka import topics
from dora_rl.infra.kafka.keys import make_key, partition_for
from dora_rl.infra.weights.announcements import announcement_problem, kind_problem
from dora_rl.schemas.records import PolicyVersion, RolloutRequest
from dora_rl.streams.processor import Context, InRecord, Ref, dead_letter_for

from .engine import Engine, GenResult
from .instance_rules import RequestBook
from .outputs import handed_back, token_chunk, trajectory
from .requests import gen_request


class InstanceProcessor:
    """Rollout instance ``index`` of ``run_id`` as a processor (see the module docstring)."""

    inputs = (topics.VERSIONS, topics.REQUESTS)

    def __init__(self, run_id: str, index: int, config: DoraConfig, engine: Engine, token: str = "") -> None:
        self.run_id, self.index, self.config, self.engine, self.token = run_id, index, config, engine, token
        self.name = f"rollout-{index}"
        self.book = RequestBook(config.instance_concurrency)
        self.versions: dict[int, PolicyVersion] = {}
        self.version_refs: dict[int, Ref] = {}

    def init(self, ctx: Context) -> None:
        pass

    def process(self, rec: InRecord, ctx: Context) -> None:
        if rec.topic == topics.VERSIONS:
            ann: PolicyVersion = rec.record
            problem = (announcement_problem(ann, check_manifest=False, token=self.token)
                       or kind_problem(ann, PolicyVersion.TRAINER))
            if problem is not None:
                ctx.emit(topics.DLQ, dead_letter_for(rec, self.name, self.run_id, problem, "announcement",
                                                     ctx.wall_ms()), f"{rec.topic}/{rec.partition}/{rec.offset}")
            elif int(ann.version) not in self.versions:
                self.versions[int(ann.version)], self.version_refs[int(ann.version)] = ann, rec.ref
            return
        req: RolloutRequest = rec.record
        if req.action == "CANCEL":
            cancel = self.book.cancel(req.trajectory_id)  # nothing runs between records here: queued or unknown
            if cancel.kind == "queued" and cancel.request is not None:
                self._emit(ctx, topics.TOKENS, cancel.request,
                           handed_back(self.run_id, self.name, cancel.request, ctx.wall_ms(), self.token))
            return
        self.book.take(rec.offset, req)

    def punctuate(self, now: float, ctx: Context) -> None:
        """Generate while a version with pending work is known: load it (C1: nothing runs), start its requests."""
        while (version := self.book.next_version()) is not None and version in self.versions:
            if version != self.book.held:
                self.engine.load_version(self.versions[version], None)
                self.book.hold(version)
            start = self.book.start(new_call=True)
            if not start.batch:
                return
            self._generate(list(start.batch), ctx)

    def _generate(self, batch: list[RolloutRequest], ctx: Context) -> None:
        held, pos = self.book.held, {r.trajectory_id: len(r.partial_ids) for r in batch}

        def on_chunk(rid: str, ids: list[int], lps: list[float]) -> None:
            req = self.book.request(rid)
            self._emit(ctx, topics.TOKENS, req, token_chunk(self.run_id, self.name, held, req, pos[rid], ids, lps,
                                                            ctx.wall_ms()))
            pos[rid] += len(ids)

        def on_finish(res: GenResult) -> None:
            req = self.book.request(res.request_id)
            self._emit(ctx, topics.TRAJECTORIES, req,
                       trajectory(self.run_id, self.name, held, req, res, self.engine.decode, self.token))
            self.book.finished(res.request_id)

        self.engine.generate([gen_request(r) for r in batch], on_chunk=on_chunk, chunk_tokens=16, on_finish=on_finish)

    def _emit(self, ctx: Context, topic: str, req: RolloutRequest, record: object) -> None:
        ctx.emit(topic, record, make_key(int(req.policy_version), req.group_id),
                 partition=partition_for(req.group_id, self.config.num_partitions))

    def held_back(self) -> frozenset[str]:
        return frozenset()

    def snapshot(self) -> bytes:
        return json.dumps({"held": self.book.held,
                           "versions": {str(v): r.to_list() for v, r in self.version_refs.items()},
                           "pending": [[rid, off] for rid, (off, _) in sorted(self.book.pending.items())]}).encode()

    def restore(self, snapshot: bytes, ctx: Context) -> None:
        state = json.loads(snapshot)
        self.version_refs = {int(v): Ref.from_list(r) for v, r in state["versions"].items()}
        pending = {rid: Ref(topics.REQUESTS, self.index, int(off)) for rid, off in state["pending"]}
        records = ctx.fetch_many([*self.version_refs.values(), *pending.values()])
        self.versions = {v: records[r] for v, r in self.version_refs.items()}
        for ref in sorted(pending.values(), key=lambda r: r.offset):
            self.book.take(ref.offset, records[ref])
        self.book.hold(int(state["held"]))
        if int(state["held"]) >= 0:  # the engine of a new incarnation holds nothing yet
            self.engine.load_version(self.versions[int(state["held"])], None)

    def close(self) -> None:
        pass
