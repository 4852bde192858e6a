"""A rollout instance: holds exactly one policy version at a time and generates what it is asked.

Reads partition ``index`` of ``dora.rollout.requests`` (group ``dora.<run>.rollout-<index>``) and
all of ``dora.policy.versions``; writes ``dora.rollout.tokens`` (chunks as they are decoded),
``dora.rollout.trajectories`` (each trajectory the moment it finishes, in completion order) and
``dora.instances`` (heartbeats).

C1: a request tagged with version ``v`` is generated only while this instance holds ``v``; to
serve requests of another version the instance first finishes its current ``generate`` call, then
loads ``v`` (fetching it from a holder over the weight channel), so no trajectory ever mixes versions.
Requests wait for their version to be announced. Offsets are committed only up to the oldest
request not yet finished (so a crash re-generates, never loses, a trajectory; the scorer and the
assembler are idempotent on trajectory ids).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from confluent_kafka import OFFSET_INVALID, Consumer, TopicPartition

from dora_rl.config import DoraConfig
from dora_rl.infra import topics
from dora_rl.infra.kafka_io import DeadLetters, Metrics, RecordProducer, RunConsumer, consumer_config, now_ms
from dora_rl.infra.keys import make_key, partition_for
from dora_rl.infra.weight_sync import Fetcher
from dora_rl.schemas.codec import DecodeError
from dora_rl.schemas.records import InstanceStatus, PolicyVersion, RolloutRequest, TokenChunk, Trajectory

from .engine import GenRequest, GenResult

log = logging.getLogger(__name__)

FINISH = {"stop": "STOP", "length": "LENGTH", "abort": "ABORT"}


class RequestReader:
    """Consumer of this instance's request partition with explicit, gap-safe commits."""

    def __init__(self, bootstrap: str, run_id: str, index: int, start: int, dlq: DeadLetters) -> None:
        self.tp = TopicPartition(topics.REQUESTS, index)
        self.dlq = dlq
        self.run_id = run_id
        self.consumer = Consumer(consumer_config(bootstrap, f"dora.{run_id}.rollout-{index}",
                                                 f"rollout-{index}-{run_id}"))
        committed = self.consumer.committed([self.tp], timeout=30)[0].offset
        self.tp.offset = committed if committed not in (OFFSET_INVALID,) and committed >= 0 else start
        self.consumer.assign([self.tp])

    def poll(self, timeout: float) -> list[tuple[int, RolloutRequest]]:
        out: list[tuple[int, RolloutRequest]] = []
        for msg in self.consumer.consume(500, timeout):
            if msg.error() is not None:
                continue
            try:
                req = RolloutRequest.decode(msg.value(), msg.headers())
            except DecodeError as exc:
                self.dlq.refuse(msg, str(exc), exc.error_type)
                continue
            if req.run_id == self.run_id:
                out.append((msg.offset() or 0, req))
        return out

    def commit_before(self, offset: int) -> None:
        """Commit: every request below ``offset`` is done."""
        self.consumer.commit(offsets=[TopicPartition(self.tp.topic, self.tp.partition, offset)], asynchronous=False)


def run_rollout(bootstrap: str, run_id: str, config: DoraConfig, index: int,
                start_offsets: dict[tuple[str, int], int], token: str = "",
                stop: Callable[[], bool] = lambda: False, engine: Any = None) -> None:
    """Serve requests until ``stop()``."""
    from dora_rl.modeling import decode_completion, load_policy
    from dora_rl.policy_source import resolve_model

    from .torch_engine import TorchEngine

    torch.set_num_threads(1)
    instance_id = f"rollout-{index}"
    producer = RecordProducer(bootstrap, f"{instance_id}-{run_id}")
    dlq = DeadLetters(producer, instance_id, run_id)
    metrics = Metrics(producer, run_id, instance_id)
    model, tok = load_policy(resolve_model(config.model, config.seed))
    if engine is None:
        engine = TorchEngine(model, tok, temperature=config.temperature, seed=config.seed * 1000 + index)
    fetcher = Fetcher(config.weight_transport, token)
    reader = RequestReader(bootstrap, run_id, index, start_offsets.get((topics.REQUESTS, index), 0), dlq)
    versions = RunConsumer(bootstrap, run_id, instance_id, {topics.VERSIONS: PolicyVersion}, dlq, start_offsets,
                           group_suffix=f".versions.{now_ms()}")
    known: dict[int, PolicyVersion] = {}
    pending: dict[str, tuple[int, RolloutRequest]] = {}
    held = -1
    state = {"tokens": 0, "busy_s": 0.0, "last_hb": 0.0, "in_flight": 0, "state": "STARTING"}

    def heartbeat(force: bool = False) -> None:
        if not force and time.monotonic() - state["last_hb"] < config.heartbeat_s:
            return
        state["last_hb"] = time.monotonic()
        st = InstanceStatus(run_id=run_id, instance_id=instance_id, instance_index=index, loaded_version=held,
                            state=str(state["state"]), in_flight=int(state["in_flight"]),
                            capacity=config.instance_concurrency, weight_endpoint="",
                            generated_tokens=int(state["tokens"]), busy_s=float(state["busy_s"]), ts_ms=now_ms())
        producer.send(topics.INSTANCES, st, make_key(max(held, 0), instance_id))

    def on_chunk(rid: str, ids: list[int], lps: list[float]) -> None:
        req = pending[rid][1]
        start = chunk_pos.get(rid, len(req.partial_ids))
        chunk_pos[rid] = start + len(ids)
        producer.send(topics.TOKENS, TokenChunk(
            run_id=run_id, trajectory_id=rid, group_id=req.group_id, policy_version=held, instance_id=instance_id,
            start=start, token_ids=np.asarray(ids), logprobs=np.asarray(lps), final=False, ts_ms=now_ms()),
            make_key(held, req.group_id), partition=partition_for(req.group_id, config.num_partitions))
        state["tokens"] = int(state["tokens"]) + len(ids)
        heartbeat()

    def on_finish(res: GenResult) -> None:
        req = pending[res.request_id][1]
        traj = Trajectory(
            run_id=run_id, trajectory_id=req.trajectory_id, group_id=req.group_id, prompt_id=req.prompt_id,
            sample_index=req.sample_index, group_size=req.group_size, policy_version=req.policy_version,
            task=req.task, reference=req.reference, prompt_ids=req.prompt_ids,
            response_ids=np.asarray(res.token_ids), behaviour_logprobs=np.asarray(res.logprobs),
            response_text=decode_completion(tok, list(res.token_ids)), finish_reason=FINISH[res.finish_reason],
            instance_id=instance_id, instance_version=held, dispatched_ms=req.dispatched_ms,
            first_token_ms=int(res.first_token_s * 1000), finished_ms=int(res.finished_s * 1000))
        producer.send(topics.TRAJECTORIES, traj, make_key(req.policy_version, req.group_id),
                      partition=partition_for(req.group_id, config.num_partitions))
        finished.append(res.request_id)

    chunk_pos: dict[str, int] = {}
    finished: list[str] = []
    try:
        heartbeat(force=True)
        while not stop():
            for env in versions.poll(0.0):
                known[int(env.record.version)] = env.record
            for offset, req in reader.poll(0.05 if pending else 0.2):
                if req.action == "CANCEL":
                    engine.abort([req.trajectory_id])
                    continue
                if req.trajectory_id not in pending:
                    pending[req.trajectory_id] = (offset, req)
            if not pending:
                state["state"] = "IDLE"
                heartbeat()
                continue
            # serve the oldest-dispatched version first (C1: one version per generate call)
            version = min(int(r.policy_version) for _, r in pending.values())
            if version != held:
                if version not in known:
                    heartbeat()
                    continue
                state["state"] = "LOADING"
                heartbeat(force=True)
                fs = fetcher.fetch_into(known[version], model)
                held = version
                metrics.emit("switch_s", fs.seconds, version=held)
                metrics.emit("weights_gbps", fs.gbps, version=held)
            batch = [r for _, r in sorted(pending.values(), key=lambda x: x[0])
                     if int(r.policy_version) == held][: config.instance_concurrency]
            gen_requests = [GenRequest(request_id=r.trajectory_id, prompt_ids=[int(i) for i in r.prompt_ids],
                                       partial_ids=[int(i) for i in r.partial_ids],
                                       partial_logprobs=[float(x) for x in r.partial_logprobs],
                                       max_new_tokens=int(r.max_new_tokens)) for r in batch]
            state["state"] = "BUSY"
            state["in_flight"] = len(batch)
            heartbeat(force=True)
            t0 = time.perf_counter()
            engine.generate(gen_requests, on_chunk=on_chunk, chunk_tokens=16, on_finish=on_finish)
            state["busy_s"] = float(state["busy_s"]) + time.perf_counter() - t0
            producer.flush()
            for rid in finished:
                pending.pop(rid, None)
                chunk_pos.pop(rid, None)
            finished.clear()
            state["in_flight"] = 0
            low = min((o for o, _ in pending.values()), default=None)
            if low is None:
                low = reader.consumer.position([reader.tp])[0].offset
            if low >= 0:
                reader.commit_before(low)
            metrics.emit("generated_tokens", float(state["tokens"]))
            metrics.emit("busy_s", float(state["busy_s"]))
    finally:
        state["state"] = "STOPPED"
        heartbeat(force=True)
        producer.flush()
        reader.consumer.close()
        versions.close()
        fetcher.close()
