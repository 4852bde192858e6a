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

from dora_rl.config import DoraConfig
from dora_rl.infra.crashpoints import crash_point
from dora_rl.infra.kafka import topics
from dora_rl.infra.kafka.consume import RunConsumer
from dora_rl.infra.kafka.io import DeadLetters, Metrics, RecordProducer, RecordTooLarge, now_ms
from dora_rl.infra.kafka.keys import make_key, partition_for
from dora_rl.infra.kafka.security import KafkaSecurityError
from dora_rl.infra.observability import prom
from dora_rl.infra.weights.announcements import announcement_problem, kind_problem, sign
from dora_rl.infra.weights.protocol import WeightFetchError
from dora_rl.schemas.records import InstanceStatus, KvTransfer, PolicyVersion, RolloutRequest

from .engine import Engine, GenRequest, GenResult
from .instance_rules import RequestBook
from .known_versions import KnownVersions
from .kv_moves import KvInbox, KvOutbox
from .outputs import aborted_chunk, handed_back, token_chunk, trajectory
from .poison import PoisonGuard
from .requests import RequestReader, gen_request, make_engine

log = logging.getLogger(__name__)

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
        self.lock = threading.Lock()  # held around every use of ``book`` (the generation thread finishes requests)
        self.book = RequestBook(config.instance_concurrency)
        self.guard = guard
        self.chunk_pos: dict[str, int] = {}
        self.tokens = 0
        self.busy_s = 0.0
        self.state = "STARTING"
        self.last_hb = 0.0
        self.endpoint = ""
        self.kv_out: KvOutbox | None = None  # serves exported KV rows (an engine that exports, a holder)
        self.prepared: dict[str, GenRequest] = {}  # engine requests a refused join built (their KV rows fetched)

    def heartbeat(self, force: bool = False) -> None:
        if not force and time.monotonic() - self.last_hb < self.config.heartbeat_s:
            return
        self.last_hb = time.monotonic()
        with self.lock:
            running = tuple(sorted(self.book.running))
        st = InstanceStatus(run_id=self.run_id, instance_id=self.instance_id, instance_index=self.index,
                            loaded_version=self.held, state=self.state, in_flight=len(running),
                            capacity=self.config.instance_concurrency, in_flight_ids=running[:256],
                            weight_endpoint=self.endpoint, generated_tokens=self.tokens, busy_s=self.busy_s,
                            ts_ms=now_ms())
        self.producer.send(self.out[topics.INSTANCES], st, make_key(max(self.held, 0), self.instance_id))

    @property
    def held(self) -> int:
        """The version the engine holds (-1: none yet)."""
        return self.book.held

    def _send(self, topic: str, record: Any, req: RolloutRequest, version: int | None = None) -> None:
        """Write ``record`` about ``req`` to ``topic``, keyed by its version and group, on its group's partition."""
        key = make_key(int(req.policy_version) if version is None else version, req.group_id)
        partition = partition_for(req.group_id, self.config.num_partitions)
        self.producer.send(self.out[topic], record, key, partition=partition)

    def on_chunk(self, rid: str, ids: list[int], lps: list[float]) -> None:
        req = self.book.request(rid)  # no lock: only this thread removes a running request (finished)
        start = self.chunk_pos.get(rid, len(req.partial_ids))
        self.chunk_pos[rid] = start + len(ids)
        self._send(topics.TOKENS, token_chunk(self.run_id, self.instance_id, self.held, req, start, ids, lps, now_ms()),
                   req, self.held)
        self.tokens += len(ids)
        self.heartbeat()
        crash_point("rollout.in_flight")

    def aborted(self, req: RolloutRequest, ids: list[int], lps: list[float], kv: KvTransfer | None = None) -> None:
        """Hand a cancelled trajectory back: its whole partial response (and where its KV rows wait)."""
        self._send(topics.TOKENS, aborted_chunk(self.run_id, self.instance_id, req, ids, lps, kv, now_ms(), self.token),
                   req)

    def hand_back(self, req: RolloutRequest) -> None:
        """Hand back a request that never started here, as the partial (and KV reference) it carried."""
        with self.lock:
            self.prepared.pop(req.trajectory_id, None)  # rows fetched for a refused join: their exporter still serves
        self._send(topics.TOKENS, handed_back(self.run_id, self.instance_id, req, now_ms(), self.token), req)

    def on_finish(self, res: GenResult) -> None:
        offset, req = self.book.pending[res.request_id]  # as in on_chunk: the main loop may hold the lock, flushing
        if res.finish_reason == "abort":
            kv = self.kv_out.put(res.request_id, res.kv) if res.kv is not None and self.kv_out is not None else None
            self.aborted(req, list(res.token_ids), list(res.logprobs), kv)
        else:
            traj = trajectory(self.run_id, self.instance_id, self.held, req, res, self.decode, self.token)
            try:
                self._send(topics.TRAJECTORIES, traj, req)
            except RecordTooLarge as exc:  # generating it again would not make it smaller: refuse the group
                with self.lock:
                    self.guard.refuse(offset, req, f"oversize trajectory: {exc}", "oversize")
        with self.lock:
            self.book.finished(res.request_id)
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
        queued = inst.book.hand_back()
    for r in queued:
        inst.hand_back(r)
    _, high = reader.consumer.get_watermark_offsets(reader.tp, timeout=10)
    reader.commit_before(high)
    log.info("leaving: %d queued requests handed back, request partition committed to %d", len(queued), high)


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
        """The engine's request for ``r`` with the KV rows it names: fetched once (a refused join keeps them)."""
        with inst.lock:
            ready = inst.prepared.pop(r.trajectory_id, None)
        if ready is not None:
            return ready
        return gen_request(r) if inbox is None else inbox.with_rows(r, gen_request(r))
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
                failed = inst.book.call_failed()
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
            st = inst.book.start(new_call, guard.split)
            for offset, r in st.refused:
                inst.prepared.pop(r.trajectory_id, None)
                guard.refuse(offset, r)
            if st.batch:
                guard.starting([r.trajectory_id for r in st.batch], alone=st.alone)
        return list(st.batch)

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
        with inst.lock:
            inst.book.hold(version)
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
            for offset, req in reader.poll(0.02 if inst.book.pending else 0.2):
                if req.action == "CANCEL":
                    with inst.lock:
                        cancel = inst.book.cancel(req.trajectory_id)
                    if cancel.kind == "queued" and cancel.request is not None:
                        inst.hand_back(cancel.request)
                    elif cancel.kind == "running" and not (inst.kv_out is not None and eng.export([req.trajectory_id])):
                        eng.abort([req.trajectory_id])  # no rows to move: the resume prefills (vLLM, emulated)
                        metrics.emit("kv_fallback", 1.0, version=int(req.policy_version), reason="engine")
                    continue
                with inst.lock:
                    inst.book.take(offset, req)
            if gen_thread is not None and gen_thread.is_alive():
                batch = starting(new_call=False)  # continuous batching: join the running call (same version)
                joining = [engine_request(r) for r in batch]
                if batch and not eng.add(joining):
                    with inst.lock:
                        inst.prepared.update((g.request_id, g) for g in joining)
                        inst.book.not_started(r.trajectory_id for r in batch)
                        guard.not_started([r.trajectory_id for r in batch], alone=False)
            else:
                producer.flush()
                with inst.lock:
                    stranded = inst.book.call_ended()
                    low = inst.book.commit_below(reader.next_offset)
                    version = inst.book.next_version()
                reader.commit_before(low)
                if stranded:  # the engine dropped requests it had taken: they start again in the next call
                    log.warning("the engine call ended without %d of its requests (%s): starting them again",
                                len(stranded), stranded[:4])
                    metrics.emit("engine_dropped", float(len(stranded)))
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
