"""A rollout instance: holds exactly one policy version at a time and generates what it is asked.

Reads partition ``index`` of ``dora.rollout.requests`` (group ``dora.<run>.rollout-<index>``) and
all of ``dora.policy.versions``; writes ``dora.rollout.tokens`` (chunks as they are decoded),
``dora.rollout.trajectories`` (each trajectory the moment it finishes, in completion order) and
``dora.instances`` (heartbeats).

C1: a request tagged with version ``v`` is generated only while this instance holds ``v``. The
engine runs in a generation thread; which version to hold and which requests start is the rule of
:mod:`dora_rl.core.instance_policy` (switch only when no generation runs; keep the held version
while it has pending work, else the oldest pending one). Requests of the held version that arrive
while a call runs join it when the engine batches continuously (``engine.add``); otherwise they wait
for the next call. Requests wait for their version to be announced. The worker drives every engine
through the :class:`~.engine.Engine` protocol alone (``load_version``, ``weights_to_serve``,
``decode``); :func:`.requests.make_engine` is the one place that knows the kinds.

Migration: a CANCEL request aborts the trajectory here; its whole partial response is written as
one ``TokenChunk`` with ``aborted = true`` (start 0) for the orchestrator to resume elsewhere. An engine
that can export takes it out with its KV rows, which this instance's holder serves and the chunk names
(:mod:`.kv_moves`); a resume naming rows fetches them, or prefills and counts why.

Offsets are committed only below the oldest request not yet finished, so a crash re-generates,
never loses, a trajectory (downstream consumers are idempotent on trajectory ids).

Poison input (:mod:`.poison`, rule :mod:`dora_rl.core.attempts`): every engine call's tries are made
durable before it starts; a call that raises does not end the instance: its unfinished requests are
retried, a suspect alone (no joins while it runs), and one that keeps failing alone is refused to
``dora.dlq`` with its group, which the orchestrator replaces.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from dora_rl.config import DoraConfig
from dora_rl.core.instance_policy import next_version, startable
from dora_rl.infra.crashpoints import crash_point
from dora_rl.infra.kafka import topics
from dora_rl.infra.kafka.io import DeadLetters, Metrics, RecordProducer, RecordTooLarge, RunConsumer, now_ms
from dora_rl.infra.kafka.keys import make_key, partition_for
from dora_rl.infra.kafka.security import KafkaSecurityError
from dora_rl.infra.kafka.signing import signed
from dora_rl.infra.observability import prom
from dora_rl.infra.weights.announcements import announcement_problem, kind_problem, sign
from dora_rl.infra.weights.protocol import WeightFetchError
from dora_rl.schemas.records import InstanceStatus, KvTransfer, PolicyVersion, RolloutRequest, TokenChunk, Trajectory

from .engine import Engine, GenRequest, GenResult
from .known_versions import KnownVersions
from .kv_moves import KvInbox, KvOutbox
from .poison import PoisonGuard
from .requests import RequestReader, make_engine

log = logging.getLogger(__name__)

FINISH = {"stop": "STOP", "length": "LENGTH", "abort": "ABORT"}


class Instance:
    """State and Kafka outputs of one rollout instance (callbacks run in the generation thread)."""

    def __init__(self, run_id: str, index: int, config: DoraConfig, producer: RecordProducer,
                 decode: Callable[[list[int]], str], guard: PoisonGuard, token: str = "") -> None:
        self.run_id, self.index, self.config = run_id, index, config
        self.out = {t: topics.in_run(run_id, t) for t in (topics.INSTANCES, topics.TOKENS, topics.TRAJECTORIES)}
        self.token = token  # signs each trajectory: the scorer scores no other (decision 0062)
        self.instance_id = f"rollout-{index}"
        self.producer = producer
        self.decode = decode
        self.lock = threading.Lock()
        self.pending: dict[str, tuple[int, RolloutRequest]] = {}  # not finished (queued or running)
        self.running: set[str] = set()
        self.call_ids: set[str] = set()  # every request of the engine call running now (joins included)
        self.alone = False  # the running call holds one suspect alone: nothing joins it
        self.guard = guard
        self.chunk_pos: dict[str, int] = {}
        self.held = -1
        self.tokens = 0
        self.busy_s = 0.0
        self.state = "STARTING"
        self.last_hb = 0.0
        self.endpoint = ""
        self.kv_out: KvOutbox | None = None  # serves exported KV rows (an engine that exports, a holder)

    def heartbeat(self, force: bool = False) -> None:
        if not force and time.monotonic() - self.last_hb < self.config.heartbeat_s:
            return
        self.last_hb = time.monotonic()
        with self.lock:
            running = tuple(sorted(self.running))
        st = InstanceStatus(run_id=self.run_id, instance_id=self.instance_id, instance_index=self.index,
                            loaded_version=self.held, state=self.state, in_flight=len(running),
                            capacity=self.config.instance_concurrency, in_flight_ids=running[:256],
                            weight_endpoint=self.endpoint, generated_tokens=self.tokens, busy_s=self.busy_s,
                            ts_ms=now_ms())
        self.producer.send(self.out[topics.INSTANCES], st, make_key(max(self.held, 0), self.instance_id))

    def _partition(self, group_id: str) -> int:
        return partition_for(group_id, self.config.num_partitions)

    def on_chunk(self, rid: str, ids: list[int], lps: list[float]) -> None:
        req = self.pending[rid][1]
        start = self.chunk_pos.get(rid, len(req.partial_ids))
        self.chunk_pos[rid] = start + len(ids)
        self.producer.send(self.out[topics.TOKENS], TokenChunk(
            run_id=self.run_id, trajectory_id=rid, group_id=req.group_id, policy_version=self.held,
            instance_id=self.instance_id, start=start, token_ids=np.asarray(ids), logprobs=np.asarray(lps),
            final=False, ts_ms=now_ms()), make_key(self.held, req.group_id), partition=self._partition(req.group_id))
        self.tokens += len(ids)
        self.heartbeat()
        crash_point("rollout.in_flight")

    def aborted(self, req: RolloutRequest, ids: list[int], lps: list[float], kv: KvTransfer | None = None) -> None:
        """Hand a cancelled trajectory back: its whole partial response (and where its KV rows wait), for migration;
        signed, as the orchestrator resumes no other."""
        self.producer.send(self.out[topics.TOKENS], signed(TokenChunk(
            run_id=self.run_id, trajectory_id=req.trajectory_id, group_id=req.group_id,
            policy_version=int(req.policy_version), instance_id=self.instance_id, start=0,
            token_ids=np.asarray(ids, dtype=np.int32), logprobs=np.asarray(lps, dtype=np.float32), final=True,
            ts_ms=now_ms(), aborted=True, kv=kv), self.token), make_key(int(req.policy_version), req.group_id),
            partition=self._partition(req.group_id))

    def on_finish(self, res: GenResult) -> None:
        req = self.pending[res.request_id][1]
        if res.finish_reason == "abort":
            kv = self.kv_out.put(res.request_id, res.kv) if res.kv is not None and self.kv_out is not None else None
            self.aborted(req, list(res.token_ids), list(res.logprobs), kv)
        else:
            tv: np.ndarray | None = None
            version = int(req.policy_version)
            if req.partial_versions is not None:  # partial-rollout baseline: tokens of several versions
                n_new = len(res.token_ids) - len(req.partial_ids)
                tv = np.concatenate([np.asarray(req.partial_versions, dtype=np.int64),
                                     np.full(n_new, self.held, dtype=np.int64)])
                version = int(tv.min()) if len(tv) else version
            traj = signed(Trajectory(
                run_id=self.run_id, trajectory_id=req.trajectory_id, group_id=req.group_id, prompt_id=req.prompt_id,
                sample_index=req.sample_index, group_size=req.group_size, policy_version=version,
                task=req.task, reference=req.reference, prompt_ids=req.prompt_ids, token_versions=tv,
                response_ids=np.asarray(res.token_ids, dtype=np.int32),
                behaviour_logprobs=np.asarray(res.logprobs, dtype=np.float32),
                response_text=self.decode(list(res.token_ids)), finish_reason=FINISH[res.finish_reason],
                instance_id=self.instance_id, instance_version=self.held, dispatched_ms=req.dispatched_ms,
                first_token_ms=int(res.first_token_s * 1000), finished_ms=int(res.finished_s * 1000)), self.token)
            try:
                self.producer.send(self.out[topics.TRAJECTORIES], traj, make_key(int(req.policy_version), req.group_id),
                                   partition=self._partition(req.group_id))
            except RecordTooLarge as exc:  # generating it again would not make it smaller: refuse the group
                with self.lock:
                    self.guard.refuse(self.pending[res.request_id][0], req, f"oversize trajectory: {exc}", "oversize")
        with self.lock:
            self.pending.pop(res.request_id, None)
            self.running.discard(res.request_id)
            self.chunk_pos.pop(res.request_id, None)
            self.guard.finished(res.request_id)


class InstanceHolder:
    """An instance serves the version it holds (every holder serves, so fan-out grows with holders).

    ``hold(v)`` serves ``v`` from a snapshot of the model's weights, retires the version held before
    (its memory is freed) and returns the announcement naming this instance as a holder of ``v``.
    """

    def __init__(self, transport: str, run_id: str, token: str) -> None:
        from dora_rl.infra.endpoints import Endpoints
        from dora_rl.infra.weights.channel import make_weight_server

        self.run_id, self.transport, self.token = run_id, transport, token
        ep = Endpoints.from_env()
        self._server = make_weight_server(transport, token, ep.bind_host, recycle=True, advertised_host=ep.advertised,
                                          **ep.weight_transport_options(transport))
        self.endpoint = str(self._server.address)
        self.kv = KvOutbox(self._server, token)

    def hold(self, version: int, weights: dict[str, Any], previous: int) -> PolicyVersion:
        if previous >= 0 and previous != version:
            self._server.retire(previous)
        manifest = self._server.serve(version, weights)
        return sign(manifest.announce(self.run_id, version, self.transport, [self.endpoint],
                                      announced_by=PolicyVersion.HOLDER), self.token)

    def close(self) -> None:
        self._server.close()


def hand_back(inst: Instance, reader: RequestReader) -> None:
    """Graceful leave: every request taken but not started goes back as its (possibly empty) partial, to
    be resumed on an instance of its version; the partition is committed to its end, so an instance
    that takes this index later does not run again what the orchestrator moves elsewhere."""
    with inst.lock:
        queued = [r for rid, (_, r) in sorted(inst.pending.items()) if rid not in inst.running]
        for r in queued:
            inst.pending.pop(r.trajectory_id)
    for r in queued:  # a resume not started yet hands back the rows it named too (their exporter still holds them)
        inst.aborted(r, [int(i) for i in r.partial_ids], [float(x) for x in r.partial_logprobs], r.kv)
    _, high = reader.consumer.get_watermark_offsets(reader.tp, timeout=10)
    reader.commit_before(high)
    log.info("leaving: %d queued requests handed back, request partition committed to %d", len(queued), high)


def _gen_request(r: RolloutRequest) -> GenRequest:
    """The engine's request for ``r``; ``kv_moved`` when its partial tokens were all written by its version
    (their KV was computed by the weights it runs under)."""
    versions = r.partial_versions  # None: every partial token is policy_version's (the schema's rule, C1)
    same = len(r.partial_ids) > 0 and (versions is None or (
        len(versions) == len(r.partial_ids) and bool(np.all(versions == r.policy_version))))
    return GenRequest(request_id=r.trajectory_id, prompt_ids=[int(i) for i in r.prompt_ids],
                      partial_ids=[int(i) for i in r.partial_ids],
                      partial_logprobs=[float(x) for x in r.partial_logprobs], max_new_tokens=int(r.max_new_tokens),
                      kv_moved=same)


def run_rollout(bootstrap: str, run_id: str, config: DoraConfig, index: int,
                start_offsets: dict[tuple[str, int], int], token: str = "",
                stop: Callable[[], bool] = lambda: False, engine: Engine | None = None) -> None:
    """Serve requests until ``stop()``."""
    producer = RecordProducer(bootstrap, f"rollout-{index}-{run_id}")
    inst_dlq = DeadLetters(producer, f"rollout-{index}", run_id)
    metrics = Metrics(producer, run_id, f"rollout-{index}")
    eng: Engine = engine if engine is not None else make_engine(config, index)
    guard = PoisonGuard(bootstrap, run_id, f"rollout-{index}", producer, config.max_attempts,
                        state_since=start_offsets.get((topics.in_run(run_id, topics.STATE), 0), 0), token=token)
    inst = Instance(run_id, index, config, producer, eng.decode, guard, token)
    fetcher = kv_fetcher = None
    moves_kv = eng.exports_kv and config.moves_in_flight and config.weight_transport in ("ucx", "tcp")
    if eng.fetches_weights or moves_kv:  # imported here: the weight channel needs torch, an emulated instance
        from dora_rl.infra.weights.sync import Fetcher  # imports it only to move KV rows

        kv_fetcher = Fetcher(config.weight_transport, token)
        fetcher = kv_fetcher if eng.fetches_weights else None
    holder = (InstanceHolder(config.weight_transport, run_id, token)
              if config.weight_transport in ("ucx", "tcp") and (eng.serves_weights or moves_kv) else None)
    inst.endpoint = holder.endpoint if holder is not None else ""
    inst.kv_out = holder.kv if holder is not None and eng.exports_kv else None
    requests_start = start_offsets.get((topics.in_run(run_id, topics.REQUESTS), index), 0)
    reader = RequestReader(bootstrap, run_id, index, requests_start, inst_dlq)
    versions = RunConsumer(bootstrap, run_id, inst.instance_id,
                           {topics.VERSIONS: PolicyVersion, topics.HOLDERS: PolicyVersion}, inst_dlq,
                           start_offsets, group_suffix=f".versions.{now_ms()}")
    known = KnownVersions()
    inbox = None if kv_fetcher is None or not eng.exports_kv else KvInbox(
        kv_fetcher.fetch_transfer, token,
        lambda name, v, why: metrics.emit(name, 1.0, None, v, **({"reason": why} if why else {})))

    def engine_request(r: RolloutRequest) -> GenRequest:
        return _gen_request(r) if inbox is None else inbox.with_rows(r, _gen_request(r))
    gen_thread: threading.Thread | None = None
    gen_error: list[BaseException] = []

    def generate(batch: list[RolloutRequest]) -> None:
        t0 = time.perf_counter()
        try:
            eng.generate([engine_request(r) for r in batch], on_chunk=inst.on_chunk, chunk_tokens=16,
                         on_finish=inst.on_finish)
        except KafkaSecurityError as exc:  # a send from a callback was refused: the role's fault, not the input's
            gen_error.append(exc)
        except Exception as exc:  # the engine failed on some input: retry its unfinished requests (poison)
            with inst.lock:
                failed = sorted(rid for rid in inst.call_ids if rid in inst.pending)
                inst.running.difference_update(failed)
                log.warning("engine call failed on %d unfinished requests (%s): %s", len(failed), failed[:4], exc)
                metrics.emit("engine_failures", 1.0)
                try:
                    guard.raised(failed, exc)
                except RuntimeError as fatal:
                    gen_error.append(fatal)
        except BaseException as exc:  # surfaced in the main loop
            gen_error.append(exc)
        finally:
            inst.busy_s += time.perf_counter() - t0

    def starting(new_call: bool) -> list[RolloutRequest]:
        """The requests that start now (the instance rule and the poison rule), marked running and their
        tries made durable; refused ones are dead-lettered."""
        with inst.lock:
            queued = [r for _, r in sorted(inst.pending.values(), key=lambda x: x[0])
                      if r.trajectory_id not in inst.running]
            refuse, alone, ok = guard.split(queued)
            for r in refuse:
                offset = inst.pending.pop(r.trajectory_id)[0]
                guard.refuse(offset, r)
            held_alone = [r for r in alone if int(r.policy_version) == inst.held]
            if new_call and held_alone:
                batch, inst.alone = held_alone[:1], True
            elif inst.alone and not new_call:
                batch = []
            else:
                batch = startable(inst.held, ok, lambda r: int(r.policy_version), len(inst.running),
                                  config.instance_concurrency)
                inst.alone = False
            if new_call:
                inst.call_ids = set()
            inst.call_ids.update(r.trajectory_id for r in batch)
            inst.running.update(r.trajectory_id for r in batch)
            if batch:
                guard.starting([r.trajectory_id for r in batch], alone=inst.alone)
        return batch

    def load(version: int) -> bool:
        """Switch to ``version``: load it through the engine's hook, then serve it if we can; False
        (and the version forgotten until announced again) when no holder could deliver it."""
        inst.state = "LOADING"
        inst.heartbeat(force=True)
        t0 = time.perf_counter()
        ann = known.announcement(version)
        own = holder.endpoint if holder is not None else ""
        if own and own in ann.holders:  # never fetch from ourselves
            ann = ann.replace(holders=tuple(h for h in ann.holders if h != own))
        try:
            fs = eng.load_version(ann, fetcher)
        except WeightFetchError as exc:  # every holder gone (a restarting trainer): wait for a new one
            log.warning("version %d not loaded, waiting for another holder to be announced: %s", version, exc)
            known.on_fetch_failed(version)  # a holder announcement (e.g. by the restarted trainer) ends the wait
            metrics.emit("weights_fetch_failed", 1.0, version=version)
            inst.state = "IDLE"
            return False
        if fs is not None:
            metrics.emit("weights_gbps", fs.gbps, version=version)
            log.info("version %d fetched: %d bytes in %.3fs (%.3f GB/s) from %s via %s", version, fs.payload_bytes,
                     fs.seconds, fs.gbps, ",".join(fs.holders), " | ".join(fs.routes))
        if holder is not None:  # serve what we now hold: peers pull from the least-loaded holder
            weights = eng.weights_to_serve()
            if weights is not None:
                producer.send(topics.in_run(run_id, topics.HOLDERS), holder.hold(version, weights, inst.held),
                              make_key(version, "policy"))
        inst.held = version
        metrics.emit("switch_s", time.perf_counter() - t0, version=version)
        return True

    try:
        inst.heartbeat(force=True)
        while not stop():
            if gen_error:
                raise RuntimeError("generation failed") from gen_error[0]
            for env in versions.poll(0.0):
                ann: PolicyVersion = env.record
                from_holder = env.topic == topics.HOLDERS
                problem = (announcement_problem(ann, check_manifest=fetcher is not None, token=token)
                           or kind_problem(ann, PolicyVersion.HOLDER if from_holder else PolicyVersion.TRAINER))
                if problem is not None:  # one dead letter per reader, then the next record
                    inst_dlq.refuse(env, problem, "announcement", value=ann.encode()[0])
                elif from_holder:
                    known.on_holder(ann)
                else:
                    known.on_trainer(ann)
            for offset, req in reader.poll(0.02 if inst.pending else 0.2):
                if req.action == "CANCEL":
                    with inst.lock:
                        entry = inst.pending.get(req.trajectory_id)
                        queued = entry is not None and req.trajectory_id not in inst.running
                        if queued:
                            inst.pending.pop(req.trajectory_id)
                    if queued and entry is not None:
                        r = entry[1]
                        inst.aborted(r, [int(i) for i in r.partial_ids], [float(x) for x in r.partial_logprobs], r.kv)
                    elif entry is not None and not (inst.kv_out is not None and eng.export([req.trajectory_id])):
                        eng.abort([req.trajectory_id])  # no rows to move: the resume prefills (vLLM, emulated)
                        metrics.emit("kv_fallback", 1.0, version=int(req.policy_version), reason="engine")
                    continue
                with inst.lock:
                    if req.trajectory_id not in inst.pending:
                        inst.pending[req.trajectory_id] = (offset, req)
            if gen_thread is not None and gen_thread.is_alive():
                batch = starting(new_call=False)  # continuous batching: join the running call (same version)
                if batch and not eng.add([engine_request(r) for r in batch]):
                    with inst.lock:
                        inst.running.difference_update(r.trajectory_id for r in batch)
                        inst.call_ids.difference_update(r.trajectory_id for r in batch)
                        guard.not_started([r.trajectory_id for r in batch], alone=False)
            else:
                producer.flush()
                with inst.lock:
                    low = min((o for o, _ in inst.pending.values()), default=reader.next_offset)
                    version = next_version(inst.held, (int(r.policy_version) for _, r in inst.pending.values()),
                                           len(inst.running))
                reader.commit_before(low)
                if version is None:
                    inst.state = "IDLE"
                    inst.heartbeat()
                    continue
                if version != inst.held:
                    if not known.loadable(version):  # wait for its announcement, or for a holder
                        inst.heartbeat()
                        continue
                    if not load(version):
                        continue
                batch = starting(new_call=True)
                if batch:
                    inst.state = "BUSY"
                    inst.heartbeat(force=True)
                    gen_thread = threading.Thread(target=generate, args=(batch,), daemon=True)
                    gen_thread.start()
            inst.heartbeat()
            if inst.kv_out is not None:
                inst.kv_out.expire()
    finally:
        leaving = stop()  # a graceful stop (SIGTERM), not a crash: hand the work back before exiting
        if gen_thread is not None and gen_thread.is_alive():
            eng.abort(None)  # running requests come back as aborted partials (resumed elsewhere, C1)
            gen_thread.join(10)
        if leaving and config.moves_work:  # waves: what is uncommitted runs again when this index restarts
            hand_back(inst, reader)
            inst.state = "STOPPED"  # the orchestrator moves whatever is still placed here at once
            inst.heartbeat(force=True)
        producer.flush()
        prom.release_consumer(reader.consumer)
        versions.close()
        if kv_fetcher is not None:
            kv_fetcher.close()
        if holder is not None:
            holder.close()
        metrics.emit("generated_tokens", float(inst.tokens))
        producer.flush()
